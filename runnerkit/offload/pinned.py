"""Host memory slabs for H2D weight copies: one contiguous buffer of exact size per use.

A slab is obtained through a fallback chain (ARCHITECTURE §4):

1. ``registered``: a plain anonymous mapping of exactly ``nbytes`` (page aligned, zero pages
   until touched) page-locked with ``cudaHostRegister``. Preferred because PyTorch's pinned
   allocator (``pin_memory=True``) rounds every block up to a power of two: a 9 GiB model
   would lock 16 GiB. The mapping is registered in consecutive chunks of at most
   ``REGISTER_CHUNK_BYTES`` (256 MiB), one ``cudaHostRegister`` call each: one multi-GiB call
   can stall for minutes (the driver locks and maps every page in one go; reported for
   model-sized slabs on Windows/WSL). All or nothing: when a chunk fails, the chunks registered
   before it are unregistered at once and the slab goes on down the chain, so no slab is ever
   part page-locked (the copy engine would have to treat it as pageable anyway, and its locked
   part would be locked for nothing). A CUDA copy must not cross from one registration into the
   next (cudaMemcpyAsync answers "invalid argument"): every H2D copy from host memory goes
   through ``copy_h2d``, which splits it at the chunk boundaries it spans.
2. ``pinned``: ``torch.empty(nbytes, dtype=uint8, pin_memory=True)`` (the caching host
   allocator; rounded up internally, but the tensor we expose still has exactly ``nbytes``).
3. ``pageable``: ``torch.empty(nbytes, dtype=uint8)``. Used without CUDA, when
   ``pin_memory=False``, when env ``RUNNERKIT_DISABLE_PINNED=1`` is set, or when both steps
   above fail. Copies from pageable memory must be synchronous (see ``streams.py``).

Deferred pinning (``HostSlab(..., defer_pinning=True)``, used by model offload): registering
populates every page of the mapping, so a slab registered before it is filled from a pageable
module holds the module twice (the full slab resident next to the full module). A deferred slab is
the same anonymous mapping left untouched (no resident pages) until its owner has copied the
tensors in, one at a time, freeing each pageable original as it goes (each slab page becomes
resident as it is written); ``pin()`` then registers it, in chunks, all or nothing, as above. The
host peak of filling is the slab plus one tensor. When that registration fails, the slab stays
``pageable`` (a WARNING says so; copies from it are synchronous): the next step of the chain,
torch's pinned allocator, would need a second buffer of the slab's size rounded up to a power of
two while the first is full, i.e. the double hold deferral exists to avoid, at the moment a
registration just failed (most often for lack of lockable memory). When the mapping itself cannot
be created, the deferred slab is pageable from the start, for the same reason.

"Exact size": the buffer holds exactly the bytes asked for. Tensors packed into one slab are
placed at offsets aligned to ``ALIGNMENT`` (256 bytes, enough for every dtype and for the
128-byte vectorised loads of GPU kernels); each tensor occupies its size rounded up to the
alignment, and the slab size is exactly the sum of those (no power-of-two rounding).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Literal

import torch
from loguru import logger

ALIGNMENT = 256
"""Byte alignment of every tensor placed in a slab (and in a device slot)."""

DISABLE_PINNED_ENV = "RUNNERKIT_DISABLE_PINNED"

REGISTER_CHUNK_BYTES = 256 * 2**20
"""Largest range (bytes) one `cudaHostRegister` call page-locks; a larger slab is registered in chunks."""

SlabKind = Literal["registered", "pinned", "pageable"]

_chunk_starts: list[int] = []  # start address of every live registered chunk, sorted
_chunk_lock = threading.Lock()  # the disk read-ahead thread copies too


def _note_chunks(chunks: Sequence[tuple[int, int]], live: bool) -> None:
    with _chunk_lock:
        for ptr, _ in chunks:
            i = bisect.bisect_left(_chunk_starts, ptr)
            if live and (i == len(_chunk_starts) or _chunk_starts[i] != ptr):
                _chunk_starts.insert(i, ptr)
            elif not live and i < len(_chunk_starts) and _chunk_starts[i] == ptr:
                del _chunk_starts[i]


def chunk_cuts(ptr: int, nbytes: int) -> list[int]:
    """Byte offsets in (0, nbytes) where the host range [ptr, ptr + nbytes) crosses into another
    registered chunk (empty: the range lies in one registration, or in memory not registered here)."""
    with _chunk_lock:
        i = bisect.bisect_right(_chunk_starts, ptr)
        j = bisect.bisect_left(_chunk_starts, ptr + nbytes)
        return [a - ptr for a in _chunk_starts[i:j]]


def copy_h2d(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> int:
    """`dst.copy_(src, non_blocking=...)` from host memory, as one copy per registered chunk the
    source spans (a single copy across two `cudaHostRegister` ranges fails with "invalid argument").

    Args:
        dst: device tensor; src: host tensor of the same dtype and number of elements (both
            contiguous when the copy is split).
    Returns:
        The number of copies issued (1 unless `src` spans several chunks).
    Raises:
        ValueError: a split copy between tensors of different dtypes, sizes or non-contiguous.
    """
    nbytes = src.numel() * src.element_size()
    cuts = chunk_cuts(src.data_ptr(), nbytes) if nbytes else []
    if not cuts:
        dst.copy_(src, non_blocking=non_blocking)
        return 1
    if dst.dtype != src.dtype or dst.numel() != src.numel() or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"a copy spanning {len(cuts) + 1} registered host chunks needs contiguous tensors of one "
                         f"dtype and size (got {src.dtype} {tuple(src.shape)} -> {dst.dtype} {tuple(dst.shape)})")
    d, s = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
    edges = [0, *cuts, nbytes]
    for a, b in zip(edges, edges[1:]):
        d[a:b].copy_(s[a:b], non_blocking=non_blocking)
    return len(edges) - 1


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """`nbytes` rounded up to a multiple of `alignment` (bytes)."""
    return (nbytes + alignment - 1) // alignment * alignment


def plan_offsets(sizes: Sequence[int], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Pack tensors of `sizes` bytes back to back at `alignment`-aligned offsets.

    Returns:
        (offsets in bytes, total bytes); total == sum(align_up(s) for s in sizes), exactly.

    Raises:
        ValueError: a size is negative.
    """
    offsets: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"`sizes[{i}]` must be >= 0 bytes, got {size}")
        offsets.append(total)
        total += align_up(size, alignment)
    return offsets, total


def pinning_disabled_by_env() -> bool:
    """True when env `RUNNERKIT_DISABLE_PINNED` is set to 1/true/yes."""
    return os.environ.get(DISABLE_PINNED_ENV, "").strip().lower() in ("1", "true", "yes")


def _cuda_ok(code: object) -> bool:
    """True when a `torch.cuda.cudart()` call returned cudaSuccess (an enum or an int)."""
    try:
        return int(code) == 0  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return getattr(code, "value", code) == 0


def _clear_cuda_last_error() -> None:
    """Reset the CUDA runtime's per-thread 'last error' after a failed cudaHostRegister.

    PyTorch checks `cudaGetLastError()` after each kernel launch, so a failed register left
    unreported would surface later as a bogus launch error. `torch.cuda.cudart()` has no
    `cudaGetLastError`, so call it in the libcudart the process already loaded.
    """
    try:
        with open("/proc/self/maps") as f:
            paths = {parts[-1] for parts in (line.split() for line in f)
                     if len(parts) >= 6 and "libcudart" in os.path.basename(parts[-1])}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
        if not paths:
            logger.warning("cudaHostRegister failed and libcudart was not found to clear the error state")
    except OSError as exc:  # no /proc (not Linux) or the library cannot be opened
        logger.warning(f"could not clear the CUDA error state after a failed cudaHostRegister: {exc}")


def _unregister_chunks(chunks: Sequence[tuple[int, int]]) -> None:
    """`cudaHostUnregister` each registered `(address, nbytes)` chunk, last first; failures are logged."""
    _note_chunks(chunks, live=False)
    for ptr, size in reversed(chunks):
        try:
            code = torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception as exc:  # interpreter shutdown: CUDA may already be torn down
            logger.debug(f"cudaHostUnregister skipped: {exc}")
            return
        if not _cuda_ok(code):
            _clear_cuda_last_error()
            logger.warning(f"cudaHostUnregister failed with {code} for a {size}-byte chunk")


def _unregister(buffer: torch.Tensor, chunks: Sequence[tuple[int, int]]) -> None:
    """Finalizer of a registered slab: unlock its chunks while `buffer` (which it holds) still owns the pages."""
    _unregister_chunks(chunks)


def register_chunks(ptr: int, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]] | None:
    """Page-lock host range [ptr, ptr + nbytes) with one `cudaHostRegister` per chunk of at most
    `chunk_bytes` bytes, in address order. All or nothing.

    Returns:
        The registered `(address, nbytes)` chunks (they tile the range exactly), or None when a
        call failed or raised: the chunks registered before it are unregistered first, so nothing
        stays locked.

    Raises:
        ValueError: `chunk_bytes` < 1.
    """
    if chunk_bytes < 1:
        raise ValueError(f"`chunk_bytes` must be >= 1, got {chunk_bytes}")
    done: list[tuple[int, int]] = []
    for start in range(0, nbytes, chunk_bytes):
        size = min(chunk_bytes, nbytes - start)
        try:
            code = torch.cuda.cudart().cudaHostRegister(ptr + start, size, 0)
        except Exception as exc:
            logger.info(f"cudaHostRegister unavailable ({exc})")
            _unregister_chunks(done)
            return None
        if not _cuda_ok(code):
            _clear_cuda_last_error()
            logger.info(f"cudaHostRegister of chunk {len(done) + 1} ({size} bytes at offset {start} of {nbytes}) "
                        f"returned {code}; unregistering the {len(done)} chunks before it")
            _unregister_chunks(done)
            return None
        done.append((ptr + start, size))
    _note_chunks(done, live=True)
    return done


class HostSlab:
    """One contiguous uint8 host buffer of exactly `nbytes` bytes, pinned where possible.

    Attributes:
        nbytes: size in bytes (exact, no rounding).
        kind: "registered" | "pinned" | "pageable" (see module docstring), "pageable" after
            `release()` of a registered slab, and for a deferred slab until `pin()` registers it.
        chunks: kind "registered": the `(address, nbytes)` ranges registered one call each
            (at most `REGISTER_CHUNK_BYTES` each, tiling the buffer); otherwise empty.
        buffer: uint8 tensor [nbytes] on the CPU.
        pin_pending: a deferred slab whose `pin()` has not run yet (its buffer is an anonymous
            mapping that `pin()` will try to register).

    Args:
        nbytes: bytes to allocate (>= 0).
        pin_memory: try page-locked memory (needs CUDA); False, or env
            RUNNERKIT_DISABLE_PINNED=1, forces pageable memory.
        label: name used in log lines (e.g. "blocks.3").
        defer_pinning: map the buffer untouched now and page-lock it only in `pin()`, after the
            owner has filled it (module docstring, "Deferred pinning"): filling then costs no
            more host memory than the slab itself. Without pinning (no CUDA, `pin_memory`
            False, the env switch) the slab is pageable as without deferral and `pin()` does nothing.

    Raises:
        ValueError: `nbytes` < 0.

    Design source: diffusers group offloading (one pinned buffer per group) and LightX2V's
    pinned CPU buffers, with cudaHostRegister first to avoid the allocator's rounding.
    """

    def __init__(self, nbytes: int, pin_memory: bool = True, label: str = "slab", defer_pinning: bool = False) -> None:
        if nbytes < 0:
            raise ValueError(f"`nbytes` must be >= 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.label = label
        self._finalizer: weakref.finalize | None = None
        try_pinning = pin_memory and not pinning_disabled_by_env() and torch.cuda.is_available() and nbytes > 0
        self.kind: SlabKind = "pageable"
        self.pin_pending = False
        buffer = None
        self.chunks: list[tuple[int, int]] = []  # registered `(address, nbytes)` ranges, tiling the buffer
        if try_pinning and defer_pinning:
            buffer = self._map(self.nbytes)  # zero resident pages until written
            self.pin_pending = buffer is not None
            if buffer is None:
                logger.warning(f"host slab {label}: no anonymous mapping for deferred pinning; the slab stays "
                               f"pageable ({self.nbytes / 2**30:.3f} GiB, synchronous H2D copies)")
        elif try_pinning:
            registered = self._try_register(self.nbytes)
            if registered is not None:
                buffer, self.chunks = registered
                self.kind = "registered"
                self._finalizer = weakref.finalize(self, _unregister, buffer, list(self.chunks))
            else:
                buffer = self._try_pin(self.nbytes)
                if buffer is not None:
                    self.kind = "pinned"
        if buffer is None:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        self.buffer: torch.Tensor | None = buffer
        reason = "" if try_pinning or self.kind != "pageable" else (
            " (pinning off: " + ("env " + DISABLE_PINNED_ENV if pinning_disabled_by_env()
                                 else "no CUDA" if not torch.cuda.is_available() else "pin_memory=False") + ")")
        pending = ", page-locked once filled" if self.pin_pending else ""
        logger.debug(f"host slab {label}: {self.nbytes / 2**30:.3f} GiB, {self.kind}{reason}{pending}")

    @property
    def is_pinned(self) -> bool:
        """True when the buffer is page-locked (registered or pinned): async H2D copies are safe."""
        return self.kind in ("registered", "pinned")

    def pin(self) -> SlabKind:
        """Page-lock a deferred slab now that it is filled: `register_chunks` over the whole buffer,
        in chunks of `REGISTER_CHUNK_BYTES`, all or nothing. Contents and address are unchanged, so
        views taken while filling stay valid. On failure nothing stays registered and the slab stays
        "pageable", with a WARNING (module docstring: why not torch's pinned allocator).
        Does nothing for a slab that was not deferred, or was already pinned or released.

        Returns:
            `kind` afterwards: "registered", or "pageable" when the registration failed.
        """
        if not self.pin_pending:
            return self.kind
        self.pin_pending = False
        assert self.buffer is not None, "a released slab has no pending pinning"
        start = time.perf_counter()
        chunks = register_chunks(self.buffer.data_ptr(), self.nbytes, REGISTER_CHUNK_BYTES)
        if chunks is None:
            logger.warning(f"host slab {self.label}: cudaHostRegister of the filled slab failed; it stays pageable "
                           f"({self.nbytes / 2**30:.3f} GiB, synchronous H2D copies). torch's pinned allocator is "
                           f"not tried: it would hold a second copy of the slab while this one is full")
            return self.kind
        self.chunks = chunks
        self.kind = "registered"
        self._finalizer = weakref.finalize(self, _unregister, self.buffer, list(chunks))
        logger.debug(f"host slab {self.label}: filled, then registered ({self.nbytes} bytes in {len(chunks)} chunks "
                     f"of <= {REGISTER_CHUNK_BYTES} bytes, {time.perf_counter() - start:.3f}s)")
        return self.kind

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor | None:
        """Anonymous mapping of exactly `nbytes` (page aligned; no resident pages until written) as a
        uint8 tensor [nbytes] that keeps the mapping alive; None when the mapping fails."""
        try:
            region = mmap.mmap(-1, nbytes)
        except OSError as exc:
            logger.info(f"anonymous mapping of {nbytes} bytes failed ({exc})")
            return None
        return torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive

    @staticmethod
    def _try_register(nbytes: int) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
        """Anonymous mapping of exactly `nbytes`, page-locked with `register_chunks` in chunks of
        `REGISTER_CHUNK_BYTES`: (uint8 tensor [nbytes], its registered chunks), or None on failure
        (nothing left registered; the mapping is dropped with the tensor)."""
        tensor = HostSlab._map(nbytes)
        chunks = None
        start = time.perf_counter()
        if tensor is not None:
            chunks = register_chunks(tensor.data_ptr(), nbytes, REGISTER_CHUNK_BYTES)
        if tensor is None or chunks is None:
            logger.info(f"no registered slab of {nbytes} bytes; falling back to pin_memory")
            return None
        logger.debug(f"cudaHostRegister: {nbytes} bytes in {len(chunks)} chunks of <= {REGISTER_CHUNK_BYTES} bytes, "
                     f"{time.perf_counter() - start:.3f}s")
        return tensor, chunks

    @staticmethod
    def _try_pin(nbytes: int) -> torch.Tensor | None:
        """torch's pinned (caching host) allocator; None on failure."""
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            logger.info(f"pin_memory allocation of {nbytes} bytes failed ({exc}); using pageable memory")
            return None

    def view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A typed tensor of `shape` aliasing bytes [offset, offset + numel * itemsize).

        Raises:
            ValueError: the slab was released, `offset` is not a multiple of the dtype's item
                size, or the range does not fit in the slab.
        """
        if self.buffer is None:
            raise ValueError(f"host slab {self.label!r} was released; no views can be taken")
        return typed_view(self.buffer, offset, dtype, shape)

    def release(self) -> None:
        """Unregister (registered kind) and drop the slab's own reference to the buffer.

        Views handed out earlier keep the memory alive, as pageable memory for a registered
        slab. Call only when no copy from the slab is in flight.
        """
        if self._finalizer is not None:
            self._finalizer()  # unregisters every chunk once; a no-op if already called
            self._finalizer = None
            self.kind = "pageable"
            self.chunks = []
        self.pin_pending = False
        self.buffer = None


def typed_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """View bytes [offset, offset + nbytes) of a uint8 `buffer` [N] as `dtype` tensor `shape`.

    Raises:
        ValueError: misaligned `offset` or a range past the end of `buffer`.
    """
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    numel = 1
    for d in shape:
        numel *= int(d)
    nbytes = numel * itemsize
    if offset % itemsize:
        raise ValueError(f"`offset` {offset} is not a multiple of the {dtype} item size {itemsize}")
    if offset < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"`offset` {offset} + {nbytes} bytes does not fit in a {buffer.numel()}-byte buffer")
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(int(d) for d in shape))
