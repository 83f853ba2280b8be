"""Checkpoint files that change under the disk reader: truncated, rewritten in place, replaced, removed.

The reader must raise `CheckpointChangedError` naming the file, drop its handle (as the OS sees
it), keep serving the other files, and take the file back once it has its indexed layout again.
The mmap reader died of SIGBUS here: its cases run in a subprocess, so a crash fails the test
instead of ending pytest. The streamer cases (read-ahead thread, request boundary) use pread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from runnerkit.offload import CheckpointChangedError, SafetensorsDiskReader
from test_cases.conftest import REPO
from test_cases.offload._handles import mapped_bytes, open_fds
from test_cases.offload._toy import build_streamed, make_reference, state_dict_of, write_checkpoint

OTHER = "head.weight"  # in the second shard


def tick() -> None:
    """Let the kernel's coarse clock move on, so the next change gets another modification time."""
    time.sleep(0.02)


def write_earlier(folder: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """The toy checkpoint in two shards, with modification times 10 s in the past (written earlier)."""
    sd = state_dict_of(make_reference(seed=3))
    files = write_checkpoint(sd, folder, split_block=1)
    past = time.time_ns() - 10**10
    for f in files:
        os.utime(f, ns=(past, past))
    return sd, files


def read(reader: SafetensorsDiskReader, name: str) -> torch.Tensor:
    e = reader.index[name]
    dst = torch.empty(e.nbytes, dtype=torch.uint8)
    reader.read_into(name, dst)
    return dst.view(e.dtype).view(e.shape)


def exercise_changes(kind: str, folder: str) -> None:
    """Each change to the first shard, then its restore; plain asserts (also run in a subprocess)."""
    sd, files = write_earlier(Path(folder))
    first = files[0]
    original = first.read_bytes()
    size = len(original)
    os_paths = {os.path.realpath(f): f.name for f in files}
    reader = SafetensorsDiskReader(files, reader=kind)
    # the first shard's last tensor: past the end of the file once it is cut to half
    NAME = max((e for e in reader.index.values() if e.path == first), key=lambda e: e.offset).name  # noqa: N806
    assert reader.index[NAME].offset >= size // 2
    assert torch.equal(read(reader, NAME), sd[NAME]) and torch.equal(read(reader, OTHER), sd[OTHER])
    e = reader.index[NAME]
    flipped = bytes(255 - b for b in original[e.offset:e.offset + e.nbytes])

    def rewrite() -> None:
        with open(first, "r+b") as f:
            f.seek(e.offset)
            f.write(flipped)

    def rename(data: bytes) -> None:
        first.with_suffix(".tmp").write_bytes(data)
        os.replace(first.with_suffix(".tmp"), first)

    def restore_in_place() -> None:
        with open(first, "r+b") as f:
            f.write(original)
            f.truncate(size)

    cases: list[tuple[str, Callable[[], None], str, str | None, Callable[[], None]]] = [
        # (case, change, what the error says, what a second read says (None: taken back), restore)
        ("truncate", lambda: os.truncate(first, size // 2), f"truncated (size {size} -> {size // 2} bytes)",
         f"its size is {size // 2} bytes, the indexed file had {size}", restore_in_place),
        ("rewrite", rewrite, f"modified in place (same size, {size} bytes; modification time changed)", None,
         restore_in_place),
        ("replace", lambda: rename(original + b"\0" * 64),
         f"replaced by another file (size {size} -> {size + 64} bytes)",
         f"its size is {size + 64} bytes", lambda: rename(original)),
        ("reheader", lambda: rename(original.replace(b'"F32"', b'"I32"', 1)),  # same size, another header
         f"replaced by another file (size {size} -> {size} bytes)", "its header (tensor names, dtypes, shapes or "
         "offsets) differs from the indexed one", lambda: rename(original)),
        ("remove", first.unlink, "removed", "cannot be re-opened", lambda: first.write_bytes(original)),
    ]
    for case, change, says, again, restore in cases:
        tick()
        change()
        try:
            read(reader, NAME)
            raise AssertionError(f"{kind}/{case}: a read after the change did not raise")
        except CheckpointChangedError as exc:
            assert f"checkpoint file {first} changed while runnerkit streams from it: {says}; before reading " \
                   f"{NAME!r}" in str(exc), f"{kind}/{case}: {exc}"
        assert first not in reader.open_handles(), f"{kind}/{case}: the changed file's handle was kept"
        assert open_fds(os_paths)[first.name] == 0 and mapped_bytes(os_paths)[first.name] == 0, \
            f"{kind}/{case}: the OS still sees a descriptor or mapping of the changed file"
        assert torch.equal(read(reader, OTHER), sd[OTHER]), f"{kind}/{case}: the other shard must still be read"
        if again is None:  # same size and header: taken back, and its (rewritten) bytes are what is read
            assert torch.equal(read(reader, NAME).view(torch.uint8).flatten(),
                               torch.frombuffer(bytearray(flipped), dtype=torch.uint8)), f"{kind}/{case}"
        else:
            for _ in range(2):  # every read while the file stays changed fails the same way
                try:
                    read(reader, NAME)
                    raise AssertionError(f"{kind}/{case}: a read of the still-changed file did not raise")
                except CheckpointChangedError as exc:
                    assert f"{first} changed while runnerkit streams from it" in str(exc) and again in str(exc), \
                        f"{kind}/{case}: {exc}"
            if case == "truncate":
                try:
                    reader.load_tensors([NAME])
                    raise AssertionError(f"{kind}/{case}: load_tensors did not raise")
                except CheckpointChangedError as exc:
                    assert str(first) in str(exc), exc
        tick()
        restore()
        reader.revalidate()  # a request boundary (a restore while reading would be one more change)
        assert torch.equal(read(reader, NAME), sd[NAME]), f"{kind}/{case}: the restored file is not read back"

    # between requests: `revalidate` drops the handle of a file renamed over (a new inode), keeps the others
    assert reader.revalidate() == []
    tick()
    rename(original)
    assert reader.revalidate() == [first] and reader.open_handles() == {files[1]: 1}
    assert torch.equal(read(reader, NAME), sd[NAME])
    assert torch.equal(reader.load_tensors([NAME])[NAME], sd[NAME])
    reader.close()
    assert open_fds(os_paths) == {f.name: 0 for f in files} and mapped_bytes(os_paths) == {f.name: 0 for f in files}


def test_pread_reader_survives_changes(tmp_path: Path) -> None:
    exercise_changes("pread", str(tmp_path))


def test_mmap_reader_survives_changes(tmp_path: Path) -> None:
    """In a subprocess: a read from a mapping past the file's end kills the process with SIGBUS."""
    code = ("from test_cases.offload.test_disk_changes import exercise_changes; "
            f"exercise_changes('mmap', {str(tmp_path)!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    died = f"died of signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else ""
    assert proc.returncode == 0, f"{died or f'exit {proc.returncode}'}; stderr tail:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("change,says", [("rewrite", "modified in place"), ("truncate", "truncated")])
def test_pread_change_during_a_read_is_not_handed_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       change: str, says: str) -> None:
    """A change that lands while `os.preadv` runs: a same-size rewrite after the bytes were read (seen
    by the check after the read), or a truncation before them (a short read)."""
    sd, files = write_earlier(tmp_path)
    reader = SafetensorsDiskReader(files, reader="pread")
    name = max((e for e in reader.index.values() if e.path == files[0]), key=lambda e: e.offset).name
    size = files[0].stat().st_size
    real = os.preadv

    def preadv(fd: int, buffers: list, offset: int) -> int:
        if change == "truncate":
            os.truncate(files[0], size // 2)
        n = real(fd, buffers, offset)
        if change == "rewrite":
            with open(files[0], "r+b") as f:
                f.seek(offset)
                f.write(bytes(n))
        return n

    tick()
    monkeypatch.setattr(os, "preadv", preadv)
    when = "after" if change == "rewrite" else "while"
    with pytest.raises(CheckpointChangedError, match=f"{files[0]} changed while runnerkit streams from it: {says}.*; "
                                                     f"{when} reading {name!r}"):
        read(reader, name)
    assert reader.open_handles() == {}


class HeldReadAhead:
    """Holds a read-ahead of one unit (the read-ahead thread's `read_many` holding the unit's first
    tensor, after `skip` earlier ones) until `release()`, so a test can change a file before that
    read starts; records which thread each failed read ran on, and its first tensor."""

    def __init__(self, reader: SafetensorsDiskReader) -> None:
        self.first: str | None = None
        self.skip = 0
        self.released = threading.Event()
        self.failures: list[tuple[str, str]] = []  # (thread name, tensor name)
        real = reader.read_many

        def read_many(reads: list[tuple[str, torch.Tensor]]) -> None:
            names = [name for name, _ in reads]
            if self.first in names and threading.current_thread().name.startswith("runnerkit-disk-read"):
                self.skip -= 1
                if self.skip < 0:
                    assert self.released.wait(10), "the read-ahead was never released"
            try:
                real(reads)
            except CheckpointChangedError:
                self.failures.append((threading.current_thread().name, names[0]))
                raise

        reader.read_many = read_many  # type: ignore[method-assign]

    def hold(self, unit_params: list[str], skip: int = 0) -> None:
        self.first, self.skip, self.failures = (unit_params[0] if unit_params else None), skip, []
        self.released.clear()

    def release(self) -> None:
        self.released.set()


def disk_read_threads(besides: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """The live disk-read threads, but those in `besides` (another test's streamer, not yet collected)."""
    return [t for t in threading.enumerate() if t.name.startswith("runnerkit-disk-read") and t not in besides]


def test_streamer_change_fails_the_forward_that_needs_the_unit_then_recovers(tmp_path: Path) -> None:
    """Phase streaming with read-ahead (pread). A truncation seen by the read-ahead thread is raised
    by the forward that needs that unit; after `reset()` the streamer is at the request boundary
    with no handle on the file and one read thread; a read-ahead that fails for a unit nobody needs
    any more is dropped at `reset()` and never raised later; the restored file gives bit-identical
    output."""
    sd, files = write_earlier(tmp_path)
    original = files[0].read_bytes()
    os_paths = {os.path.realpath(f): f.name for f in files}
    earlier = frozenset(disk_read_threads())  # read threads of streamers this test did not build
    model, streamer = build_streamed(sd, "phase", "pread", files=files)
    source = streamer.source
    held = HeldReadAhead(source.reader)
    x = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = make_reference(seed=3)(x)
        fresh = streamer.state()

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return model(x)

        def change_at(unit: int, action: Callable[[], None]) -> Callable[[], None]:
            """Apply `action` in `unit`'s forward pre-hook, after the streamer's own (which has fetched
            unit + 1 and so started the read-ahead of unit + 2), then let the held read-ahead go;
            returns the hook's remover."""
            def hook(module: nn.Module, args: object) -> None:
                action()
                held.release()
            return model.get_submodule(streamer.units[unit].module).register_forward_pre_hook(hook).remove

        def truncate() -> None:
            os.truncate(files[0], len(original) // 2)

        def restore() -> None:
            tick()
            with open(files[0], "r+b") as f:
                f.write(original)

        assert torch.equal(forward(), expected)
        streamer.reset()
        # 1. the read-ahead thread sees the truncation; the forward fails at the unit it was reading
        units = [u.module for u in streamer.units]
        k = units.index("blocks.2.cross_attn")
        held.hold(list(streamer.units[k].params))
        remove = change_at(k - 2, truncate)
        with pytest.raises(CheckpointChangedError, match=f"{files[0]} changed while runnerkit streams from it: "
                                                         r"truncated .*; before reading 'blocks\.2\.cross_attn\."):
            forward()
        remove()
        assert [(t.startswith("runnerkit-disk-read"), n.startswith("blocks.2.cross_attn.")) for t, n in held.failures] \
            == [(True, True)], held.failures
        streamer.reset()
        assert streamer.state() == fresh
        assert len(disk_read_threads(earlier)) == 1
        assert files[0] not in source.reader.open_handles() and open_fds(os_paths)[files[0].name] == 0
        # 2. still truncated: the next request fails at its first read, and the next one again
        held.hold([])
        for _ in range(2):
            with pytest.raises(CheckpointChangedError, match="is not taken back"):
                forward()
            streamer.reset()
        # 3. restored: bit-identical
        restore()
        assert torch.equal(forward(), expected)
        streamer.reset()
        # 3b. the original renamed over between requests (another inode): the next request's first
        # fetch re-checks the files and takes it back instead of failing on the held handle
        tick()
        files[0].with_suffix(".tmp").write_bytes(original)
        os.replace(files[0].with_suffix(".tmp"), files[0])
        assert torch.equal(forward(), expected)
        streamer.reset()
        # 4. the last unit's pre-hook fetched unit 0 of the next step (the wrap), which started the
        # read-ahead of unit 1: that one fails, nobody needs it, and `reset` drops it
        last = len(units) - 1
        held.hold(list(streamer.units[1].params), skip=1)  # the first read-ahead of unit 1 is at the start
        remove = change_at(last, truncate)
        assert torch.equal(forward(), expected)
        remove()
        streamer.reset()  # waits for the held read-ahead: it failed, and its error is dropped here
        assert [n for _, n in held.failures] == [streamer.units[1].params[0]], held.failures
        restore()
        held.hold([])
        assert torch.equal(forward(), expected), "the dropped read-ahead error must not surface in the next request"
        assert len(disk_read_threads(earlier)) == 1
    streamer.close()
    assert disk_read_threads(earlier) == [] and open_fds(os_paths) == {f.name: 0 for f in files}


RACE = """
import os, sys
from pathlib import Path
from runnerkit.interrupts import enable_fault_tracebacks
from runnerkit.offload import SafetensorsDiskReader
from test_cases.offload.test_disk_changes import read, write_earlier

enable_fault_tracebacks()
sd, files = write_earlier(Path(sys.argv[1]))
reader = SafetensorsDiskReader(files, reader="mmap")
name = max((e for e in reader.index.values() if e.path == files[0]), key=lambda e: e.offset).name
read(reader, name)  # mapped
real_read, size = reader._read, files[0].stat().st_size

def cut_then_read(handle, entry, dst):  # the truncation lands after the check, before the copy ends
    os.truncate(files[0], size // 2)
    real_read(handle, entry, dst)

reader._read = cut_then_read
read(reader, name)
"""


def test_mmap_residual_race_dies_with_a_traceback(tmp_path: Path) -> None:
    """The race the checks cannot close (module docstring of runnerkit/offload/disk.py): a file cut
    while a tensor is copied out of its mapping. The process dies of SIGBUS, but not silently: the
    launch script's fault handler prints the traceback, which ends in the reader."""
    proc = subprocess.run([sys.executable, "-c", RACE, str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGBUS, proc.stderr[-3000:]
    assert "Fatal Python error: Bus error" in proc.stderr, proc.stderr[-3000:]
    assert 'runnerkit/offload/disk.py", line' in proc.stderr and "in _read" in proc.stderr, proc.stderr[-3000:]
