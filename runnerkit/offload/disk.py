"""Safetensors disk reader for weight streaming: header-only planning, one handle per file.

File format (safetensors spec): 8 bytes little-endian u64 N, then N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
tensor bytes; a tensor's bytes are [8 + N + begin, 8 + N + end) of the file.

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

import json
import os
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from loguru import logger

from runnerkit.weights import CheckpointError, short_list

ReaderKind = Literal["mmap", "pread"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors reference rejects larger headers


@dataclass(frozen=True)
class TensorIndexEntry:
    """Where one tensor's bytes are: file, absolute byte offset, byte count, dtype and shape."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class _Handle:
    """An open file: its descriptor `fd`, or, once the mmap reader mapped it (at the first read),
    the mapping alone (`fd` is -1 then)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.mapping: torch.Tensor | None = None  # uint8 [file size] over a private read mapping


def read_header(fd: int, path: Path) -> tuple[int, dict[str, dict]]:
    """Read the header of an open safetensors file.

    Returns:
        (byte offset where tensor data starts, header dict without "__metadata__").

    Raises:
        CheckpointError: truncated file or malformed header.
    """
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {n} bytes exceeds {_MAX_HEADER_BYTES}; not a safetensors file?")
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise CheckpointError(f"{path}: header truncated ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from exc
    header.pop("__metadata__", None)
    return 8 + n, header


class SafetensorsDiskReader:
    """Key index over safetensors files, and byte reads with one handle per file.

    Args:
        files: the checkpoint's safetensors files (a tensor may be in any of them; a block's
            tensors may be split over several shards).
        reader: "mmap" or "pread" (see module docstring).
        drop_page_cache: pread only: `posix_fadvise(DONTNEED)` after each tensor read.

    Raises:
        ValueError: `reader` not in ("mmap", "pread").
        CheckpointError: a file is missing or malformed, a tensor appears in two files, or
            a dtype is unknown or a byte range does not match dtype x shape.
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
                data_start, header = read_header(handle.fd, path)
                self.header_bytes_read += data_start
                file_size = os.fstat(handle.fd).st_size
            finally:
                self._close(handle)
            for name, meta in header.items():
                self.index[name] = self._entry(path, name, meta, data_start, file_size)
        logger.info(f"disk reader ({reader}): indexed {len(self.index)} tensors in {len(self.files)} files "
                    f"from headers ({self.header_bytes_read} bytes) in {time.perf_counter() - start:.3f}s")

    def _entry(self, path: Path, name: str, meta: dict, data_start: int, file_size: int) -> TensorIndexEntry:
        if name in self.index:
            raise CheckpointError(f"disk reader: tensor {name!r} appears in {self.index[name].path} and {path}")
        dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {meta.get('dtype')!r}; "
                                  f"supported: {sorted(SAFETENSORS_DTYPES)}")
        shape = tuple(int(d) for d in meta["shape"])
        begin, end = (int(x) for x in meta["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * torch.empty((), dtype=dtype, device="meta").element_size()
        if end - begin != expected or data_start + end > file_size:
            raise CheckpointError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not hold "
                                  f"{dtype} {list(shape)} ({expected} bytes) inside a {file_size}-byte file")
        return TensorIndexEntry(name, path, data_start + begin, end - begin, dtype, shape)

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
