"""SafetensorsDiskReader: header-only planning, one handle per file, lazy long-lived handles."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pytest_mock import MockerFixture

from runnerkit.offload import DiskSource, SafetensorsDiskReader
from runnerkit.offload.disk import PAGE_BYTES, _Handle
from runnerkit.weights import CheckpointError
from test_cases.offload._handles import HandleSampler, mapped_bytes, open_fds
from test_cases.offload._toy import build_streamed, make_reference, state_dict_of, write_checkpoint


@pytest.fixture()
def sd() -> dict[str, torch.Tensor]:
    return state_dict_of(make_reference(seed=3))


@pytest.fixture()
def files(tmp_path: Path, sd: dict[str, torch.Tensor]) -> list[Path]:
    return write_checkpoint(sd, tmp_path, split_block=1)


@pytest.fixture()
def handle_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every open/close of a reader handle, in order: ("open"|"close", file name)."""
    log: list[tuple[str, str]] = []
    orig_open, orig_close = SafetensorsDiskReader._open, SafetensorsDiskReader._close

    def _open(self: SafetensorsDiskReader, path: Path) -> _Handle:
        handle = orig_open(self, path)
        log.append(("open", path.name))
        return handle

    def _close(self: SafetensorsDiskReader, handle: _Handle) -> None:
        log.append(("close", handle.path.name))
        orig_close(self, handle)

    monkeypatch.setattr(SafetensorsDiskReader, "_open", _open)
    monkeypatch.setattr(SafetensorsDiskReader, "_close", _close)
    return log


def _max_open(log: list[tuple[str, str]]) -> dict[str, int]:
    count: dict[str, int] = {}
    peak: dict[str, int] = {}
    for kind, name in log:
        count[name] = count.get(name, 0) + (1 if kind == "open" else -1)
        assert count[name] >= 0, f"{name} closed more often than opened"
        peak[name] = max(peak.get(name, 0), count[name])
    return peak


@pytest.mark.parametrize("reader", ["mmap", "pread"])
@pytest.mark.parametrize("mode", ["block", "phase"])
def test_one_handle_per_file_and_lazy_long_lived(sd: dict[str, torch.Tensor], files: list[Path],
                                                 handle_log: list[tuple[str, str]], reader: str, mode: str) -> None:
    """When the reader opens and closes (its own log); the OS-side count is `test_os_sees_one_handle_per_shard`."""
    reader_obj = SafetensorsDiskReader(files, reader=reader)
    blocks1 = {reader_obj.index[k].path.name for k in sd if k.startswith("blocks.1.")}
    assert len(blocks1) == 2, "block 1 must be split over the two shards"
    assert handle_log == [("open", files[0].name), ("close", files[0].name),
                          ("open", files[1].name), ("close", files[1].name)]  # index: short-lived handles

    model, streamer = build_streamed(sd, mode, reader, 2, 1, reader=reader_obj)
    built = len(handle_log)
    # non-block weights (embed, head, modulation, norm3) were read with short-lived handles, already closed
    assert handle_log[4:] == [("open", files[0].name), ("close", files[0].name),
                              ("open", files[1].name), ("close", files[1].name)]
    assert reader_obj.open_handles() == {}  # long-lived handles are not opened at construction

    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        model(x)
        model(x)
    first_block_fetch = handle_log[built:]
    assert sorted(first_block_fetch) == [("open", files[0].name), ("open", files[1].name)]  # once each, kept open
    assert reader_obj.open_handles() == {files[0]: 1, files[1]: 1}

    again = reader_obj.load_tensors(["embed.weight", "head.bias"])  # reuses the long-lived handles
    assert torch.equal(again["embed.weight"], sd["embed.weight"]) and torch.equal(again["head.bias"], sd["head.bias"])
    assert len(handle_log) == built + 2
    streamer.close()
    assert reader_obj.open_handles() == {}
    assert max(_max_open(handle_log).values()) == 1


@pytest.mark.parametrize("mode,reader,read_ahead", [("phase", "mmap", True), ("phase", "mmap", False),
                                                     ("phase", "pread", True), ("phase", "pread", False),
                                                     ("block", "mmap", True)])
def test_os_sees_one_handle_per_shard(sd: dict[str, torch.Tensor], files: list[Path], monkeypatch: pytest.MonkeyPatch,
                                      reader: str, mode: str, read_ahead: bool) -> None:
    """At every tensor read (main and read-ahead thread), every unit fetch, all along (a polling
    thread) and at the end, `/proc/self/fd` shows at most one descriptor per shard and
    `/proc/self/maps` at most one mapping of it; both shards of the split block were opened."""
    sampler = HandleSampler(files)
    real_read, real_runs, real_fetch = SafetensorsDiskReader._read, SafetensorsDiskReader._read_runs, DiskSource.fetch

    def sampled_read(self: SafetensorsDiskReader, handle: _Handle, entry: object, dst: torch.Tensor) -> None:
        sampler.sample(f"before reading {entry.name}")
        real_read(self, handle, entry, dst)
        sampler.sample(f"after reading {entry.name}")

    def sampled_runs(self: SafetensorsDiskReader, handle: _Handle, runs: list) -> None:  # pread: runs of tensors
        sampler.sample(f"before reading {runs[0][0][0].name}")
        real_runs(self, handle, runs)
        sampler.sample(f"after reading {runs[0][0][0].name}")

    def sampled_fetch(self: DiskSource, unit: int, slot: int, engine: object) -> torch.Tensor:
        out = real_fetch(self, unit, slot, engine)
        sampler.sample(f"fetch of unit {unit}")
        return out

    monkeypatch.setattr(SafetensorsDiskReader, "_read", sampled_read)
    monkeypatch.setattr(SafetensorsDiskReader, "_read_runs", sampled_runs)
    monkeypatch.setattr(DiskSource, "fetch", sampled_fetch)
    sampler.start_polling()
    try:
        model, streamer = build_streamed(sd, mode, reader, 2, 1, files=files)
        streamer.source.read_ahead = read_ahead
        x = torch.randn(1, 3, 8)
        with torch.no_grad():
            for _ in range(2):  # the second step reuses the long-lived handles
                model(x)
        streamer.reset()
        end = sampler.sample("end of streaming")
        streamer.close()
    finally:
        sampler.stop_polling()
    closed = sampler.sample("after close")
    assert sampler.violations() == []
    assert sampler.ever_open() == {f.name for f in files}, "block 1 is split: both shards must have been read"
    # the long-lived handles as the OS sees them: pread keeps one descriptor per shard, mmap one mapping, no descriptor
    if reader == "pread":
        assert end.fds == {f.name: 1 for f in files} and end.mapped == {f.name: 0 for f in files}
    else:
        assert end.fds == {f.name: 0 for f in files} and all(end.mapped[f.name] > 0 for f in files)
    assert closed.fds == {f.name: 0 for f in files} and closed.mapped == {f.name: 0 for f in files}
    threads = {s.thread for s in sampler.samples if s.where.startswith("before reading")}
    if read_ahead:
        assert any(t.startswith("runnerkit-disk-read") for t in threads), threads  # the read-ahead thread was sampled
    else:
        assert threads == {"MainThread"}
    units = len(streamer.units)
    fetched = [int(s.where.rsplit(" ", 1)[1]) for s in sampler.samples if s.where.startswith("fetch")]
    assert fetched == list(range(units)) * 2 + [0]  # two steps, then the wrap prefetch of the next step


def test_second_handle_on_a_file_is_refused(files: list[Path]) -> None:
    reader = SafetensorsDiskReader(files, reader="pread")
    handle = reader._open(files[0])
    with pytest.raises(AssertionError, match="second handle"):
        reader._open(files[0])
    reader._close(handle)


def test_an_interrupt_inside_open_leaves_the_reader_usable(files: list[Path]) -> None:
    """Ctrl-C as the short-lived handle of `load_tensors` is being built (the descriptor open, the handle not yet
    returned): its descriptor is closed, the next load opens the file again and its bytes are right."""
    reader = SafetensorsDiskReader(files, reader="pread")
    name = next(iter(reader.index))
    want = reader.load_tensors([name])[name]
    fired = []

    def interrupt_in_handle(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is _Handle.__init__.__code__ and not fired:
            fired.append(1)
            raise KeyboardInterrupt("inside _open")

    sys.settrace(interrupt_in_handle)
    try:
        with pytest.raises(KeyboardInterrupt, match="inside _open"):
            reader.load_tensors([name])
    finally:
        sys.settrace(None)
    assert fired and torch.equal(reader.load_tensors([name])[name], want) and reader.open_handles() == {}
    path = reader.index[name].path
    assert open_fds({os.path.realpath(path): path.name}) == {path.name: 0}  # the lost handle's descriptor closed
    reader.close()


def test_planning_reads_headers_only(files: list[Path], monkeypatch: pytest.MonkeyPatch, mocker: MockerFixture) -> None:
    reads: list[tuple[int, int, int]] = []
    orig_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append((fd, n, offset)) or orig_pread(fd, n, offset))
    spy = mocker.spy(SafetensorsDiskReader, "_read")
    reader = SafetensorsDiskReader(files, reader="mmap")
    assert spy.call_count == 0 and reader.bytes_read == 0
    header_ends = []
    for path in files:
        with open(path, "rb") as f:
            header_ends.append(8 + struct.unpack("<Q", f.read(8))[0])
    assert reader.header_bytes_read == sum(header_ends)
    assert len(reads) == 4  # length prefix + JSON header, per file
    assert all(offset + n <= max(header_ends) for _, n, offset in reads)
    assert [n for _, n, _ in reads] == [8, header_ends[0] - 8, 8, header_ends[1] - 8]
    e = reader.index["blocks.1.ffn.fc1.weight"]
    assert (e.dtype, e.shape, e.nbytes) == (torch.float32, (32, 16), 32 * 16 * 4)


def test_mmap_tensors_are_cloned_out_of_the_mapping(sd: dict[str, torch.Tensor], files: list[Path]) -> None:
    reader = SafetensorsDiskReader(files, reader="mmap")
    dst = torch.empty(reader.index["blocks.0.ffn.fc2.weight"].nbytes, dtype=torch.uint8)
    reader.read_into("blocks.0.ffn.fc2.weight", dst)
    loaded = reader.load_tensors(["blocks.2.self_attn.q.weight"])
    paths = {os.path.realpath(f): f.name for f in files}
    assert mapped_bytes(paths)[files[0].name] > 0 and open_fds(paths) == {f.name: 0 for f in files}
    reader.close()
    assert mapped_bytes(paths) == {f.name: 0 for f in files}  # a tensor aliasing the mapping would keep it mapped
    assert torch.equal(dst.view(torch.float32).view(16, 32), sd["blocks.0.ffn.fc2.weight"])
    assert torch.equal(loaded["blocks.2.self_attn.q.weight"], sd["blocks.2.self_attn.q.weight"])


def test_pread_drops_the_page_cache(sd: dict[str, torch.Tensor], files: list[Path],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    reader = SafetensorsDiskReader(files, reader="pread")
    e = reader.index["blocks.3.ffn.fc1.bias"]
    dst = torch.empty(e.nbytes, dtype=torch.uint8)
    reader.read_into(e.name, dst)
    start = e.offset // PAGE_BYTES * PAGE_BYTES  # whole pages: the kernel keeps a partly covered page
    end = -(-(e.offset + e.nbytes) // PAGE_BYTES) * PAGE_BYTES
    assert calls == [(start, end - start, os.POSIX_FADV_DONTNEED)]  # the page cache itself: test_host_memory.py
    assert torch.equal(dst.view(torch.float32), sd[e.name])
    assert reader.stats()["bytes_read"] == e.nbytes
    reader.close()  # what the kernel's read-ahead left: the whole file
    assert calls[1:] == [(0, 0, os.POSIX_FADV_DONTNEED)]
    no_drop = SafetensorsDiskReader(files, reader="pread", drop_pages=False)
    no_drop.read_into(e.name, dst)
    no_drop.close()
    assert len(calls) == 2


def _write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_malformed_checkpoints_raise(tmp_path: Path, files: list[Path]) -> None:
    with pytest.raises(ValueError, match="`reader` must be 'mmap' or 'pread', got 'aio'"):
        SafetensorsDiskReader(files, reader="aio")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsDiskReader([tmp_path / "missing.safetensors"])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsDiskReader([_write_raw(tmp_path / "a.safetensors", b"{not json")])
    bad_range = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}
    with pytest.raises(CheckpointError, match=r"byte range \[0, 12\) does not hold"):
        SafetensorsDiskReader([_write_raw(tmp_path / "b.safetensors", bad_range, bytes(16))])
    with pytest.raises(CheckpointError, match="dtype 'F7'"):
        SafetensorsDiskReader([_write_raw(tmp_path / "c.safetensors", {"w": {"dtype": "F7", "shape": [1],
                                                                                "data_offsets": [0, 4]}}, bytes(4))])
    with pytest.raises(CheckpointError, match="appears in"):
        SafetensorsDiskReader([files[0], files[0]])
    reader = SafetensorsDiskReader(files)
    with pytest.raises(CheckpointError, match="2 tensors are not in the checkpoint: nope, nada"):
        reader.load_tensors(["embed.weight", "nope", "nada"])
