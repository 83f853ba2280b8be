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
descriptor open (see `_map`); "pread" reads with
`os.preadv` into the caller's buffer (no mapping) and, with `drop_page_cache`, tells the
kernel to drop those pages (`POSIX_FADV_DONTNEED`) so streaming does not grow the page cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import torch
from loguru import logger

from runnerkit.weights import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    TensorIndexEntry,
    read_safetensors_header,
    short_list,
)

__all__ = ["SAFETENSORS_DTYPES", "ReaderKind", "SafetensorsDiskReader", "TensorIndexEntry", "read_header"]

ReaderKind = Literal["mmap", "pread"]


class _Handle:
    """An open file: its descriptor `fd`, or, once the mmap reader mapped it (at the first read),
    the mapping alone (`fd` is -1 then)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.mapping: torch.Tensor | None = None  # uint8 [file size] over a private read mapping


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
        drop_page_cache: pread only: `posix_fadvise(DONTNEED)` after each tensor read.

    Raises:
        ValueError: `reader` not in ("mmap", "pread").
        CheckpointError: a file is missing or damaged (any header `weights.read_safetensors_header`
            refuses: it names the file and the tensor), or a tensor appears in two files.
    """

    def __init__(self, files: Sequence[Path | str], reader: ReaderKind = "mmap", drop_page_cache: bool = True) -> None:
        if reader not in ("mmap", "pread"):
            raise ValueError(f"`reader` must be 'mmap' or 'pread', got {reader!r}")
        if not files:
            raise CheckpointError("disk reader: no .safetensors files given")
        self.reader: ReaderKind = reader
        self.drop_page_cache = drop_page_cache and reader == "pread" and hasattr(os, "posix_fadvise")
        self.files = [Path(f) for f in files]
        self._long_lived: dict[Path, _Handle] = {}
        self._open_count: dict[Path, int] = {}
        self.bytes_read = 0
        self.header_bytes_read = 0
        self.read_seconds = 0.0
        start = time.perf_counter()
        self.index: dict[str, TensorIndexEntry] = {}
        for path in self.files:
            if not path.is_file():
                raise CheckpointError(f"disk reader: checkpoint file {path} does not exist")
            handle = self._open(path)
            try:
                data_start, entries = read_header(handle.fd, path)
                self.header_bytes_read += data_start
            finally:
                self._close(handle)
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
        assert self._open_count.get(path, 0) == 0, f"a second handle on {path} would be opened"
        fd = os.open(path, os.O_RDONLY)
        self._open_count[path] = 1
        return _Handle(path, fd)

    def _close(self, handle: _Handle) -> None:
        if handle.mapping is not None:
            handle.mapping = None  # the last reference: unmapped now (reads hand out copies only)
        else:
            os.close(handle.fd)
        self._open_count[handle.path] -= 1

    def open_handles(self) -> dict[Path, int]:
        """Open handles per file right now (each value is 0 or 1)."""
        return {p: n for p, n in self._open_count.items() if n}

    # -- reads --

    def entry(self, name: str) -> TensorIndexEntry:
        """The index entry of `name`. Raises CheckpointError when the checkpoint lacks it."""
        try:
            return self.index[name]
        except KeyError:
            raise CheckpointError(f"disk reader: tensor {name!r} is not in the checkpoint "
                                  f"({len(self.index)} tensors in {len(self.files)} files)") from None

    def _read(self, handle: _Handle, entry: TensorIndexEntry, dst: torch.Tensor) -> None:
        """Copy the tensor's bytes into `dst` (uint8 [nbytes], CPU, contiguous)."""
        assert dst.dtype == torch.uint8 and dst.device.type == "cpu" and dst.is_contiguous() \
            and dst.numel() == entry.nbytes, f"bad destination for {entry.name}: {dst.dtype} {tuple(dst.shape)}"
        if entry.nbytes == 0:
            return
        start = time.perf_counter()
        if self.reader == "mmap":
            if handle.mapping is None:
                handle.mapping = self._map(handle)
            dst.copy_(handle.mapping[entry.offset:entry.offset + entry.nbytes])  # the clone out of the mapping
        else:
            done = 0
            view = memoryview(dst.numpy())
            while done < entry.nbytes:
                n = os.preadv(handle.fd, [view[done:]], entry.offset + done)
                if n <= 0:
                    raise CheckpointError(f"{entry.path}: unexpected end of file reading {entry.name!r}")
                done += n
            view.release()
            if self.drop_page_cache:
                os.posix_fadvise(handle.fd, entry.offset, entry.nbytes, os.POSIX_FADV_DONTNEED)
        self.bytes_read += entry.nbytes
        self.read_seconds += time.perf_counter() - start

    @staticmethod
    def _map(handle: _Handle) -> torch.Tensor:
        """Map the handle's whole file (private, never written) and close its descriptor.

        Ours is closed before the mapping opens the file again, and the mapping closes its own
        descriptor once mapped: the file never has two open descriptors. (Python's `mmap.mmap`
        would keep a duplicate of ours for the mapping's lifetime.)
        """
        size = os.fstat(handle.fd).st_size
        os.close(handle.fd)
        handle.fd = -1
        storage = torch.UntypedStorage.from_file(str(handle.path), shared=False, nbytes=size)
        return torch.empty(0, dtype=torch.uint8).set_(storage)  # uint8 [size]

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """Block fetch: read `name`'s bytes into `dst` (uint8 [nbytes]) via the file's long-lived handle.

        The long-lived handle is opened here, at the first fetch from the file.
        """
        entry = self.entry(name)
        handle = self._long_lived.get(entry.path)
        if handle is None:
            handle = self._long_lived[entry.path] = self._open(entry.path)
            logger.debug(f"disk reader: long-lived {self.reader} handle opened on {entry.path.name}")
        self._read(handle, entry, dst)

    def load_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read non-block weights into fresh CPU tensors (checkpoint dtype and shape).

        Each file is read through a short-lived handle closed before this returns, or
        through its long-lived handle when a block fetch already opened one.

        Raises:
            CheckpointError: listing the names the checkpoint lacks.
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
                handle = self._open(path)
            try:
                for e in entries:
                    buf = torch.empty(e.nbytes, dtype=torch.uint8)
                    self._read(handle, e, buf)
                    out[e.name] = buf.view(e.dtype).view(e.shape)
            finally:
                if short:
                    self._close(handle)
        return out

    def close(self) -> None:
        """Close every long-lived handle (and mapping). The reader can fetch again afterwards."""
        for handle in self._long_lived.values():
            self._close(handle)
        self._long_lived.clear()

    def stats(self) -> dict[str, float]:
        """Tensor bytes read, header bytes read, seconds spent reading, GB/s."""
        s = self.read_seconds
        return {"bytes_read": float(self.bytes_read), "header_bytes_read": float(self.header_bytes_read),
                "seconds": s, "gb_per_s": self.bytes_read / s / 1e9 if s > 0 else 0.0}
