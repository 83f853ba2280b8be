"""pread reads a batch's tensors in runs (`coalesce_reads`): few `os.preadv` calls, each scattering
one contiguous file range into the tensors' destinations; the bytes land exactly where a
per-tensor read would put them, whatever the file order, gaps, short reads or iovec limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runnerkit.offload import disk, pread_jobs
from runnerkit.offload.disk import SafetensorsDiskReader, coalesce_reads


@pytest.mark.parametrize(("spans", "max_gap", "runs"), [
    ([(0, 10), (10, 5), (15, 1)], 0, [[0, 1, 2]]),  # touching
    ([(15, 1), (0, 10), (10, 5)], 0, [[1, 2, 0]]),  # sorted by offset
    ([(0, 10), (14, 2)], 4, [[0, 1]]),  # a gap of 4 <= 4
    ([(0, 10), (15, 2)], 4, [[0], [1]]),  # a gap of 5 > 4
    ([(0, 10), (0, 10), (10, 2)], 8, [[0], [1, 2]]),  # the same tensor twice: its second read starts a run
    ([(0, 10), (5, 10)], 8, [[0], [1]]),  # overlapping spans are never in one run
    ([], 8, []),
])
def test_coalesce_reads_groups_spans_in_file_order(spans: list[tuple[int, int]], max_gap: int,
                                                   runs: list[list[int]]) -> None:
    assert coalesce_reads(spans, max_gap) == runs


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors of three 'units' whose names sort so that each unit's tensors are spread over the
    file: float32 weights, bfloat16 norms and float32 one-element scales, as an fp8 release orders them."""
    gen = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for b in range(3):
        sd[f"blocks.{b}.attn.weight"] = torch.randn(64, 32, generator=gen)
        sd[f"blocks.{b}.ff.weight"] = torch.randn(32, 96, generator=gen)
        sd[f"blocks.{b}.norm.weight"] = torch.randn(32, generator=gen).to(torch.bfloat16)
        sd[f"blocks.{b}.attn.scale"] = torch.randn(1, generator=gen)
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return path, sd


def _read_unit(reader: SafetensorsDiskReader, names: list[str]) -> dict[str, torch.Tensor]:
    dsts = [(n, torch.full((reader.index[n].nbytes,), 0xAB, dtype=torch.uint8)) for n in names]
    reader.read_many(dsts)
    return {n: d.view(reader.index[n].dtype).view(reader.index[n].shape) for n, d in dsts}


def _unit(b: int) -> list[str]:
    return [f"blocks.{b}.{k}" for k in ("attn.weight", "norm.weight", "attn.scale", "ff.weight")]


@pytest.mark.parametrize("max_gap", [0, 64, 1 << 20])
def test_pread_runs_put_every_tensor_where_it_belongs(tmp_path: Path, max_gap: int) -> None:
    """Each unit read with any gap tolerance: every destination holds its tensor's bytes; the reader
    counts tensor bytes (not gaps) and one `preadv` per run."""
    path, sd = _checkpoint(tmp_path)
    reader = SafetensorsDiskReader([path], reader="pread")
    reader.max_gap = max_gap
    calls = 0
    for b in range(3):
        names = _unit(b)
        got = _read_unit(reader, names)
        for n in names:
            assert torch.equal(got[n], sd[n]), n
        runs = coalesce_reads([(reader.index[n].offset, reader.index[n].nbytes) for n in names], max_gap)
        calls += len(runs)
        assert reader.read_calls == calls
    assert reader.bytes_read == sum(t.numel() * t.element_size() for t in sd.values())
    if max_gap == 1 << 20:  # the whole unit in one run: 3 calls for 3 units, gap bytes read and discarded
        assert reader.read_calls == 3 and reader.gap_bytes_read > 0
    reader.close()


def test_short_reads_and_the_iovec_limit_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`preadv` returning fewer bytes than asked (at most 7 here, ending inside tensors and gaps) and
    runs longer than the iovec limit (3 here): the reads resume where they stopped."""
    path, sd = _checkpoint(tmp_path)
    real = os.preadv
    monkeypatch.setattr(pread_jobs, "IOV_MAX", 3)

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        assert len(buffers) <= 3
        first = buffers[0][:7] if len(buffers[0]) > 7 else buffers[0]
        return real(fd, [first], offset)

    monkeypatch.setattr(disk.os, "preadv", short)
    reader = SafetensorsDiskReader([path], reader="pread")
    reader.max_gap = 1 << 20
    names = _unit(1) + _unit(0)  # both units in one batch: one run with gaps
    got = _read_unit(reader, names)
    for n in names:
        assert torch.equal(got[n], sd[n]), n
    reader.close()


def test_one_tensor_read_into_two_destinations_fills_both(tmp_path: Path) -> None:
    path, sd = _checkpoint(tmp_path)
    reader = SafetensorsDiskReader([path], reader="pread")
    name = "blocks.2.ff.weight"
    a, b = (torch.zeros(reader.index[name].nbytes, dtype=torch.uint8) for _ in range(2))
    reader.read_many([(name, a), (name, b), ("blocks.2.attn.scale", torch.zeros(4, dtype=torch.uint8))])
    want = sd[name].view(torch.uint8).flatten()
    assert torch.equal(a, want) and torch.equal(b, want)
    reader.close()


@pytest.mark.parametrize("max_gap", [0, 1 << 20])
def test_the_page_cache_drop_covers_the_gaps_a_run_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        max_gap: int) -> None:
    """Tensors `a` and `c` read in one batch, `b` (two pages and more) between them not asked for: in one
    run the gap's bytes go through the page cache too, so the drop covers `a`'s first page to `c`'s last
    in one call; read apart (max_gap 0), each tensor's pages alone are dropped."""
    page = disk.PAGE_BYTES
    sd = {"a": torch.arange(5 * page // 8, dtype=torch.float32),  # 2.5 pages
          "b": torch.zeros(2 * page // 4 + 3, dtype=torch.float32),  # 2 pages + 12 bytes
          "c": torch.ones(3 * page // 8, dtype=torch.float32)}  # 1.5 pages
    path = tmp_path / "gaps.safetensors"
    save_file(sd, str(path))
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(disk.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    reader = SafetensorsDiskReader([path], reader="pread")
    reader.max_gap = max_gap
    a, b, c = (reader.index[n] for n in ("a", "b", "c"))
    assert a.offset + a.nbytes == b.offset and b.offset + b.nbytes == c.offset  # the layout the test means
    got = _read_unit(reader, ["c", "a"])
    assert torch.equal(got["a"], sd["a"]) and torch.equal(got["c"], sd["c"])

    def pages(start: int, end: int) -> tuple[int, int, int]:
        first, last = start // page * page, -(-end // page) * page
        return (first, last - first, os.POSIX_FADV_DONTNEED)

    if max_gap:
        assert reader.read_calls == 1 and reader.gap_bytes_read == b.nbytes
        assert calls == [pages(a.offset, c.offset + c.nbytes)]
    else:
        assert reader.read_calls == 2 and reader.gap_bytes_read == 0
        assert calls == [pages(a.offset, a.offset + a.nbytes), pages(c.offset, c.offset + c.nbytes)]
    reader.close()
