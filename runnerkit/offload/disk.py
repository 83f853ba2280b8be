"""Safetensors disk reader for weight streaming: header-only planning, one handle per file.

File format: see `runnerkit.weights.read_safetensors_header`, which checks every header (the
all-resident loader uses the same check, so a damaged file is refused the same way in every mode).

Handle discipline (ARCHITECTURE §4):
- the key index (name -> file, offset, bytes, dtype, shape) is built from headers only, with
  a short-lived handle per file (open, read header, close);
- non-block weights are read by `load_tensors` with a short-lived handle, closed before
  returning (or through the file's long-lived handle if one is already open);
- the long-lived handle of a file is opened lazily at the first block fetch from it;
- at no moment are two handles open on the same file (enforced in `_open`).

Readers: "mmap" maps each file once (lazily) and copies tensor bytes out of the mapping into
the caller's buffer (a clone: nothing handed out aliases the mapping); the mapping keeps no
descriptor open (see `_map`); "pread" reads with `os.preadv` into the caller's buffer (no mapping): a batch's tensors are
sorted by file offset and those at most `READ_GAP_BYTES` apart read by one scatter read per run
(`coalesce_reads`), so a streamed unit costs a few large sequential reads; with `read_threads` > 1
the runs are cut into that many parts read at once (`pread_jobs`: one thread copies out of the page
cache at one core's memory bandwidth).

Host memory (docs/host_memory.md): after each batch of reads (`read_many`, `load_tensors`), with
`drop_pages` (the default), the pages the batch read are let go, each tensor's byte range rounded
out to whole pages and adjacent ranges merged into one call:
- "pread": `posix_fadvise(POSIX_FADV_DONTNEED)` drops them from the page cache, so streaming a
  checkpoint larger than RAM does not evict everything else (where the OS has `posix_fadvise`);
- "mmap": `madvise(MADV_DONTNEED)` unmaps them from this process (Linux), so the file pages a
  copy touched stop counting in its RSS (they stay in the page cache: the kernel reclaims them
  like any clean cache page). Without it the RSS would grow to the whole checkpoint's size.
Pages shared with a neighbouring tensor are dropped too; a later read fetches them again. The
kernel's own read-ahead fetches up to about two read-ahead windows (`read_ahead_kb` of the
device) past the last read, which the next batch reads and drops; `drop_cached()`, called at each
request boundary (`DiskSource.reset`) and by `close()`, drops what is left of the files' pages.

Files that change while they are streamed (truncated, rewritten in place, or replaced): the
reader records each file's identity when it indexes it (`FileIdentity`: device, inode, size,
modification time) and compares the path's identity (`os.stat`) with it before and after each
batch of tensor reads from the file (one `read_many` call, e.g. a streamed unit's tensors in
that file; `read_into` is a batch of one; bench/disk_identity_check.py measures the cost). A
difference raises `CheckpointChangedError` naming the file and what changed, and drops the
file's long-lived handle (a mapping of a truncated file is never touched again): the read, hence
the request that needed it, fails and the process goes on. The next read re-opens the file and
streams from it only if it has the size and the header the reader indexed (the file was
restored); otherwise every read raises `CheckpointChangedError` again. At a request boundary
`revalidate()` drops the handles of files that changed since they were opened, so a file
changed between two requests fails the next one only if it does not have the indexed layout. A
restored file cannot be told apart from other weights with the same names, dtypes, shapes and
size (the bytes are not hashed); weights that are not streamed stay those read at load.

Residual risk (mmap only): touching a mapped page beyond the current end of the file raises
SIGBUS, which Python cannot recover from. The checks keep every copy inside the size the file
had a moment before, but a truncation that lands while tensors are being copied out of the
mapping (between a batch's first check and the end of its copies) still kills the process (the
launch script prints the traceback first: `interrupts.enable_fault_tracebacks`). Streaming
spends a good part of each step in those copies (nearly all of it when disk-bound), so the
window is not negligible when files are cut in place (`truncate`, or `cp` over a file: it opens
with O_TRUNC). Replacing a file by rename (`mv`, `os.replace`) never faults: the mapping keeps
the old file alive. The "pread" reader cannot fault: a truncation shows as a short read,
reported as a change. Modification times come from the kernel's coarse clock: an in-place
rewrite of the same size within one tick (a few ms) of the file's previous change keeps the
same identity and is not seen.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from loguru import logger

from runnerkit.offload.disk_ranges import MADVISE, PAGE_BYTES, READ_GAP_BYTES, coalesce_reads, page_ranges
from runnerkit.offload.pread_jobs import PreadPool, Segment, split_jobs
from runnerkit.weights import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    TensorIndexEntry,
    read_safetensors_header,
    short_list,
)

__all__ = ["PAGE_BYTES", "SAFETENSORS_DTYPES", "CheckpointChangedError", "FileIdentity", "ReaderKind",
           "READ_GAP_BYTES", "SafetensorsDiskReader", "TensorIndexEntry", "coalesce_reads", "identity_of",
           "page_ranges", "read_header"]

ReaderKind = Literal["mmap", "pread"]


class CheckpointChangedError(CheckpointError):
    """A checkpoint file changed (truncated, rewritten, replaced or removed) after the reader indexed it."""


class FileIdentity(NamedTuple):
    """What tells a file's contents apart cheaply (one `stat`): same identity, same bytes (see
    the module docstring for the one exception, a rewrite within one clock tick)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def change_to(self, new: FileIdentity | None) -> str:
        """How `new` differs from `self`, in words (None: the path no longer exists)."""
        if new is None:
            return "removed"
        if (new.device, new.inode) != (self.device, self.inode):
            return f"replaced by another file (size {self.size} -> {new.size} bytes)"
        if new.size < self.size:
            return f"truncated (size {self.size} -> {new.size} bytes)"
        if new.size > self.size:
            return f"rewritten (size {self.size} -> {new.size} bytes)"
        return f"modified in place (same size, {self.size} bytes; modification time changed)"


def identity_of(path: Path) -> FileIdentity | None:
    """The identity of the file at `path` now, or None if nothing is there."""
    try:
        return FileIdentity.of(os.stat(path))
    except FileNotFoundError:
        return None


class _Handle:
    """An open file: its descriptor `fd`, or, once the mmap reader mapped it (at the first read),
    the mapping alone (`fd` is -1 then). `identity` is the file's identity when it was opened
    (set for data handles; reads check the path against it)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.mapping: torch.Tensor | None = None  # uint8 [file size] over a private read mapping
        self.identity: FileIdentity | None = None

    @property
    def is_open(self) -> bool:
        return self.fd >= 0 or self.mapping is not None

    def __del__(self) -> None:  # a handle an interrupt kept from its owner: its descriptor is not left open
        if getattr(self, "fd", -1) >= 0:  # (an `__init__` cut short has none: `_open` closed it)
            fd, self.fd = self.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)


def read_header(fd: int, path: Path) -> tuple[int, dict[str, TensorIndexEntry]]:
    """Read and check the header of an open safetensors file (`weights.read_safetensors_header`).

    Returns:
        (byte offset where tensor data starts, name -> entry with absolute offsets).

    Raises:
        CheckpointError: a truncated file or a damaged header, naming the file and the tensor.
    """
    return read_safetensors_header(fd, path)


class SafetensorsDiskReader:
    """Key index over safetensors files, and byte reads with one handle per file.

    Args:
        files: the checkpoint's safetensors files (a tensor may be in any of them; a block's
            tensors may be split over several shards).
        reader: "mmap" or "pread" (see module docstring).
        drop_pages: after each batch of reads, drop the pages it read: from the page cache
            (pread, `posix_fadvise`) or from this process's mapping (mmap, `madvise`); see the
            module docstring. False keeps them (tests of the old behaviour).
        read_threads: pread: threads that read one batch's bytes at once, each a contiguous part
            (`pread_jobs`); 1 reads them in this thread. The mmap reader reads in this thread.

    Raises:
        ValueError: `reader` not in ("mmap", "pread"), or `read_threads` < 1.
        CheckpointError: a file is missing or damaged (any header `weights.read_safetensors_header`
            refuses: it names the file and the tensor), or a tensor appears in two files.

    Reads (`read_into`, `load_tensors`) raise `CheckpointChangedError` when a file is no longer
    what was indexed (module docstring); the reader stays usable and re-checks at the next read.
    """

    def __init__(self, files: Sequence[Path | str], reader: ReaderKind = "mmap", drop_pages: bool = True,
                 read_threads: int = 1) -> None:
        if reader not in ("mmap", "pread"):
            raise ValueError(f"`reader` must be 'mmap' or 'pread', got {reader!r}")
        self._pool = PreadPool(read_threads if reader == "pread" else 1)  # ValueError below 1
        self.read_threads = self._pool.threads
        if not files:
            raise CheckpointError("disk reader: no .safetensors files given")
        self.reader: ReaderKind = reader
        self.drop_pages = drop_pages and (hasattr(os, "posix_fadvise") if reader == "pread" else MADVISE is not None)
        self.dropped_bytes = 0  # bytes of whole pages let go after reads (`_drop_read_pages`)
        self.files = [Path(f) for f in files]
        self._long_lived: dict[Path, _Handle] = {}
        # Every handle not yet garbage: one an interrupt kept from its owner (inside `_open`) goes with it.
        self._handles: weakref.WeakSet[_Handle] = weakref.WeakSet()
        self._identity: dict[Path, FileIdentity] = {}  # per file: the identity reads expect
        self._headers: dict[Path, tuple[int, dict[str, TensorIndexEntry]]] = {}  # per file: what a restored file must match
        self.bytes_read = 0
        self.header_bytes_read = 0
        self.read_seconds = 0.0
        self.read_calls = 0  # pread: `os.preadv` calls for tensor bytes
        self.gap_bytes_read = 0  # pread: bytes between coalesced tensors, read and discarded
        self.max_gap = READ_GAP_BYTES
        start = time.perf_counter()
        self.index: dict[str, TensorIndexEntry] = {}
        for path in self.files:
            if not path.is_file():
                raise CheckpointError(f"disk reader: checkpoint file {path} does not exist")
            handle = self._open(path)
            try:
                data_start, entries = read_header(handle.fd, path)
                self.header_bytes_read += data_start
                self._identity[path] = FileIdentity.of(os.fstat(handle.fd))
            finally:
                self._close(handle)
            self._headers[path] = (data_start, entries)
            for entry in entries.values():
                self._add(entry)
        logger.info(f"disk reader ({reader}): indexed {len(self.index)} tensors in {len(self.files)} files "
                    f"from headers ({self.header_bytes_read} bytes) in {time.perf_counter() - start:.3f}s")

    def _add(self, entry: TensorIndexEntry) -> None:
        if entry.name in self.index:
            raise CheckpointError(f"disk reader: tensor {entry.name!r} appears in {self.index[entry.name].path} "
                                  f"and {entry.path}")
        self.index[entry.name] = entry

    # -- handles (every open and close goes through these two methods; tests spy on them) --

    def _open(self, path: Path) -> _Handle:
        assert not any(h.path == path and h.is_open for h in self._handles), \
            f"a second handle on {path} would be opened"
        fd = os.open(path, os.O_RDONLY)
        try:
            handle = _Handle(path, fd)
        except BaseException:
            os.close(fd)
            raise
        self._handles.add(handle)
        return handle

    def _close(self, handle: _Handle) -> None:
        if handle.mapping is not None:
            handle.mapping = None  # the last reference: unmapped now (reads hand out copies only)
        elif handle.fd >= 0:  # (-1: `_map` closed it and failed to map)
            fd, handle.fd = handle.fd, -1  # first: the number may be reused by the next open, never pass it on
            os.close(fd)

    def open_handles(self) -> dict[Path, int]:
        """Open handles per file right now (each value is 1)."""
        return dict(Counter(h.path for h in list(self._handles) if h.is_open))

    # -- file identity (module docstring: files that change while they are streamed) --

    def _open_data(self, path: Path) -> _Handle:
        """A handle for tensor reads, on a file that still is what was indexed.

        A file whose identity differs (changed since it was indexed or last checked) is taken
        back only if it has the indexed size and header: a restored file. Its new identity is
        then the one later reads expect.

        Raises:
            CheckpointChangedError: the file is missing, or its size or header differ.
        """
        expected = self._identity[path]
        try:
            handle = self._open(path)
        except FileNotFoundError:
            raise self._changed_error(path, expected.change_to(None), "cannot be re-opened") from None
        try:
            now = FileIdentity.of(os.fstat(handle.fd))
            if now != expected:
                mismatch = self._layout_mismatch(handle, now)
                if mismatch:
                    raise self._changed_error(path, expected.change_to(now), f"is not taken back: {mismatch}")
                logger.warning(f"checkpoint file {path} was {expected.change_to(now)}; it has the size and header "
                               "indexed at load, so streaming goes on from it (its tensor bytes are not compared: "
                               "if it holds other weights, they are used from now on)")
                self._identity[path] = now
        except BaseException:
            self._close(handle)
            raise
        handle.identity = now
        return handle

    def _layout_mismatch(self, handle: _Handle, now: FileIdentity) -> str:
        """'' when the open file has the indexed size and header; else what differs, in words."""
        size = self._identity[handle.path].size
        if now.size != size:
            return f"its size is {now.size} bytes, the indexed file had {size}"
        try:
            header = read_header(handle.fd, handle.path)
        except CheckpointError as exc:
            return f"its header cannot be read ({exc})"
        if header != self._headers[handle.path]:
            return "its header (tensor names, dtypes, shapes or offsets) differs from the indexed one"
        return ""

    def _check(self, handle: _Handle, entry: TensorIndexEntry, when: str, more: int = 0) -> None:
        """Raise if the file at the handle's path is no longer the file the handle opened.

        One `os.stat` of the path (the mmap reader keeps no descriptor to `fstat`; the path also
        shows a replacement by rename). On a change the file's long-lived handle is dropped.
        The error says `when` it was seen: before / while / after reading `entry` (and `more`
        tensors of its batch).
        """
        assert handle.identity is not None, f"{handle.path}: data handles are opened by `_open_data`"
        now = identity_of(handle.path)
        if now == handle.identity:
            return
        self._drop(handle)
        what = f"{entry.name!r}" + (f" and {more} more tensors" if more else "")
        raise self._changed_error(handle.path, handle.identity.change_to(now), f"{when} reading {what}")

    def _drop(self, handle: _Handle) -> None:
        """Close the file's long-lived handle if `handle` is it (a short-lived one is closed by its
        owner): its mapping, which may reach past the file's new end, is never touched again."""
        if self._long_lived.get(handle.path) is handle:
            del self._long_lived[handle.path]
            self._close(handle)

    def revalidate(self) -> list[Path]:
        """At a request boundary: drop the long-lived handle of every file that changed since it
        was opened (one `os.stat` per file), so the next read re-opens it and takes it back if it
        has the indexed size and header, or raises `CheckpointChangedError` if not.

        Returns:
            The files whose handle was dropped.
        """
        changed = [h for h in self._long_lived.values() if identity_of(h.path) != h.identity]
        for handle in changed:
            logger.info(f"disk reader: {handle.path} {handle.identity.change_to(identity_of(handle.path))} since it "
                        "was opened; it is checked again at its next read")
            self._drop(handle)
        return [h.path for h in changed]

    @staticmethod
    def _changed_error(path: Path, change: str, where: str) -> CheckpointChangedError:
        return CheckpointChangedError(
            f"checkpoint file {path} changed while runnerkit streams from it: {change}; {where}. The read fails "
            "(and the request that needed it); later reads use the file again only if it has the size and header "
            "indexed at load: restore it, or restart to load another checkpoint")

    # -- reads --

    def entry(self, name: str) -> TensorIndexEntry:
        """The index entry of `name`. Raises CheckpointError when the checkpoint lacks it."""
        try:
            return self.index[name]
        except KeyError:
            raise CheckpointError(f"disk reader: tensor {name!r} is not in the checkpoint "
                                  f"({len(self.index)} tensors in {len(self.files)} files)") from None

    def _read_batch(self, handle: _Handle, batch: Sequence[tuple[TensorIndexEntry, torch.Tensor]]) -> None:
        """Read tensors of the handle's file, each into its `dst`, checking the file's identity
        before the first (no mapped page past the file's end is touched, unless it shrinks during
        the batch: module docstring) and after the last (bytes rewritten meanwhile are not handed out).

        Raises:
            CheckpointChangedError: the file changed (the handle is dropped if long-lived).
        """
        self._check(handle, batch[0][0], "before", len(batch) - 1)
        spans = [(e.offset, e.nbytes) for e, _ in batch]
        try:
            if self.reader == "pread":
                runs = [[batch[i] for i in run] for run in coalesce_reads(spans, self.max_gap)]
                spans = [(run[0][0].offset, run[-1][0].offset + run[-1][0].nbytes - run[0][0].offset) for run in runs]
                self._read_runs(handle, runs)
            else:
                for entry, dst in batch:
                    self._read(handle, entry, dst)
        finally:
            if self.drop_pages:
                self._drop_read_pages(handle, spans)
        self._check(handle, batch[0][0], "after", len(batch) - 1)

    def _read_runs(self, handle: _Handle, runs: Sequence[Sequence[tuple[TensorIndexEntry, torch.Tensor]]]) -> None:
        """pread: read runs of tensors in file order (`coalesce_reads`), each a contiguous file range
        scattered into the tensors' destinations (uint8 [nbytes], CPU, contiguous) and the gaps between
        them into a scratch buffer (discarded); with `read_threads` > 1 cut into that many jobs read at
        once (`pread_jobs`). Only inside `_read_batch`.

        Raises:
            CheckpointChangedError / CheckpointError: a short read (the file was cut), naming the
                tensor the read stopped in.
            OSError: a failed read (after every job ended: no thread writes into a destination later;
                `PreadPool.run`).
        """
        segmented: list[tuple[int, list[Segment]]] = []
        scratch: memoryview | None = None
        for run in runs:
            segments: list[Segment] = []  # in file order; entry None: a gap
            end = run[0][0].offset
            for entry, dst in run:
                assert dst.dtype == torch.uint8 and dst.device.type == "cpu" and dst.is_contiguous() \
                    and dst.numel() == entry.nbytes, f"bad destination for {entry.name}: {dst.dtype} {tuple(dst.shape)}"
                gap = entry.offset - end
                if gap > 0:
                    if scratch is None or len(scratch) < gap:
                        scratch = memoryview(bytearray(max(gap, self.max_gap)))
                    segments.append((scratch[:gap], None))  # gaps share the scratch: their bytes are discarded
                if entry.nbytes:
                    segments.append((memoryview(dst.numpy()), entry))
                end = entry.offset + entry.nbytes
            segmented.append((run[0][0].offset, segments))
        jobs = split_jobs(segmented, self.read_threads)
        start = time.perf_counter()
        results = self._pool.run(handle.fd, jobs)
        self.read_seconds += time.perf_counter() - start
        self.read_calls += sum(calls for calls, _ in results)
        short = next((entry for _, entry in results if entry is not None), None)
        if short is not None:
            self._check(handle, short, "while")  # a truncation shows here as a short read
            raise CheckpointError(f"{short.path}: unexpected end of file reading {short.name!r}")
        for run in runs:
            nbytes = sum(e.nbytes for e, _ in run)
            self.bytes_read += nbytes
            self.gap_bytes_read += run[-1][0].offset + run[-1][0].nbytes - run[0][0].offset - nbytes

    def _drop_read_pages(self, handle: _Handle, spans: list[tuple[int, int]]) -> None:
        """Let go of the pages of `spans` (file byte `(offset, nbytes)`) once their bytes were copied
        out: pread drops them from the page cache, mmap from this process's mapping (module docstring).

        Best effort: a failing call is logged at DEBUG and changes nothing else (the bytes are read).
        """
        if self.reader == "pread":
            if handle.fd < 0:
                return
            for start, nbytes in page_ranges(spans):
                try:
                    os.posix_fadvise(handle.fd, start, nbytes, os.POSIX_FADV_DONTNEED)
                except OSError as exc:
                    logger.debug(f"posix_fadvise(DONTNEED) of {nbytes} bytes of {handle.path.name} failed: {exc}")
                    return
                self.dropped_bytes += nbytes
            return
        if handle.mapping is None or MADVISE is None:
            return
        base = handle.mapping.data_ptr()  # page aligned: the mapping starts at file offset 0
        for start, nbytes in page_ranges(spans, limit=handle.mapping.numel()):
            if MADVISE(base + start, nbytes, mmap.MADV_DONTNEED) != 0:
                logger.debug(f"madvise(MADV_DONTNEED) of {nbytes} bytes of {handle.path.name} failed: "
                             f"{os.strerror(ctypes.get_errno())}")
                return
            self.dropped_bytes += nbytes

    def _read(self, handle: _Handle, entry: TensorIndexEntry, dst: torch.Tensor) -> None:
        """mmap: copy the tensor's bytes out of the mapping into `dst` (uint8 [nbytes], CPU,
        contiguous), mapping the file at its first read. Only inside `_read_batch`, which checks the
        file's identity around it (pread reads runs: `_read_run`).

        Raises:
            CheckpointChangedError: the file could not be mapped because it changed.
        """
        assert dst.dtype == torch.uint8 and dst.device.type == "cpu" and dst.is_contiguous() \
            and dst.numel() == entry.nbytes, f"bad destination for {entry.name}: {dst.dtype} {tuple(dst.shape)}"
        if entry.nbytes == 0:
            return
        start = time.perf_counter()
        if handle.mapping is None:
            try:
                handle.mapping = self._map(handle)
            except BaseException:
                self._drop(handle)  # its descriptor is closed and it has no mapping
                raise
        dst.copy_(handle.mapping[entry.offset:entry.offset + entry.nbytes])  # the clone out of the mapping
        self.bytes_read += entry.nbytes
        self.read_seconds += time.perf_counter() - start

    def _map(self, handle: _Handle) -> torch.Tensor:
        """Map the handle's whole file (private, never written) and close its descriptor.

        Ours is closed before the mapping opens the file again, and the mapping closes its own
        descriptor once mapped: the file never has two open descriptors. (Python's `mmap.mmap`
        would keep a duplicate of ours for the mapping's lifetime.) The mapping opens the path
        anew, so the path must still hold the file the handle opened, before and after.

        Raises:
            CheckpointChangedError: the file at the path changed before it was mapped.
        """
        assert handle.identity is not None, f"{handle.path}: data handles are opened by `_open_data`"
        fd, handle.fd = handle.fd, -1  # first: never closed twice
        os.close(fd)
        try:
            storage = torch.UntypedStorage.from_file(str(handle.path), shared=False, nbytes=handle.identity.size)
        except RuntimeError as exc:  # e.g. the file is now smaller than the mapping
            now = identity_of(handle.path)
            if now == handle.identity:
                raise
            change = handle.identity.change_to(now)
            raise self._changed_error(handle.path, change, f"cannot be mapped ({exc})") from None
        mapping = torch.empty(0, dtype=torch.uint8).set_(storage)  # uint8 [size]
        now = identity_of(handle.path)
        if now != handle.identity:
            raise self._changed_error(handle.path, handle.identity.change_to(now), "while it was being mapped")
        return mapping

    def read_many(self, reads: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Block fetch: read each `name`'s bytes into its `dst` (uint8 [nbytes]) via the files'
        long-lived handles, file by file (one identity check before and one after each file's batch).

        A long-lived handle is opened here, at the first fetch from its file (and again after a
        change dropped it).

        Raises:
            CheckpointError: a name is not in the checkpoint.
            CheckpointChangedError: a file changed since it was indexed (module docstring).
        """
        by_file: dict[Path, list[tuple[TensorIndexEntry, torch.Tensor]]] = {}
        for name, dst in reads:
            entry = self.entry(name)
            by_file.setdefault(entry.path, []).append((entry, dst))
        for path, batch in by_file.items():
            handle = self._long_lived.get(path)
            if handle is None:
                handle = self._long_lived[path] = self._open_data(path)
                logger.debug(f"disk reader: long-lived {self.reader} handle opened on {path.name}")
            self._read_batch(handle, batch)

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """`read_many([(name, dst)])`: one tensor's bytes into `dst` (uint8 [nbytes])."""
        self.read_many([(name, dst)])

    def load_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read non-block weights into fresh CPU tensors (checkpoint dtype and shape).

        Each file is read through a short-lived handle closed before this returns, or
        through its long-lived handle when a block fetch already opened one.

        Raises:
            CheckpointError: listing the names the checkpoint lacks.
            CheckpointChangedError: a file changed since it was indexed (module docstring).
        """
        names = list(names)
        missing = [n for n in names if n not in self.index]
        if missing:
            raise CheckpointError(f"disk reader: {len(missing)} tensors are not in the checkpoint: {short_list(missing)}")
        by_file: dict[Path, list[TensorIndexEntry]] = {}
        for n in names:
            by_file.setdefault(self.index[n].path, []).append(self.index[n])
        out: dict[str, torch.Tensor] = {}
        for path, entries in by_file.items():
            handle = self._long_lived.get(path)
            short = handle is None
            if short:
                handle = self._open_data(path)
            try:
                batch = [(e, torch.empty(e.nbytes, dtype=torch.uint8)) for e in entries]
                self._read_batch(handle, batch)
                for e, buf in batch:
                    out[e.name] = buf.view(e.dtype).view(e.shape)
            finally:
                if short:
                    self._close(handle)
        return out

    def drop_cached(self) -> int:
        """pread with `drop_pages`: drop every page cache page of the files that have a long-lived
        handle (the kernel's read-ahead past the last batch; module docstring). A no-op for mmap
        (its pages are dropped from the mapping after each batch) and without `drop_pages`.
        Call when no read is in flight. Returns the number of files advised."""
        if not (self.drop_pages and self.reader == "pread"):
            return 0
        advised = 0
        for handle in self._long_lived.values():
            if handle.fd >= 0:
                try:
                    os.posix_fadvise(handle.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # length 0: to the end of the file
                    advised += 1
                except OSError as exc:
                    logger.debug(f"posix_fadvise(DONTNEED) of {handle.path.name} failed: {exc}")
        return advised

    def close(self) -> None:
        """Close every long-lived handle (and mapping), after `drop_cached()`, and stop the read threads. The reader
        can fetch again afterwards."""
        self.drop_cached()
        for handle in self._long_lived.values():
            self._close(handle)
        self._long_lived.clear()
        self._pool.close()

    def stats(self) -> dict[str, float]:
        """Tensor bytes read, header bytes read, seconds spent reading, GB/s (tensor bytes), and for
        pread the `os.preadv` calls and the gap bytes read and discarded (`coalesce_reads`)."""
        s = self.read_seconds
        return {"bytes_read": float(self.bytes_read), "header_bytes_read": float(self.header_bytes_read),
                "seconds": s, "gb_per_s": self.bytes_read / s / 1e9 if s > 0 else 0.0,
                "read_calls": float(self.read_calls), "gap_bytes_read": float(self.gap_bytes_read)}
