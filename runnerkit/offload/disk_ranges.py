"""Byte-range arithmetic of the safetensors disk reader (`runnerkit.offload.disk`).

Which tensors of a batch one `os.preadv` call covers (`coalesce_reads`), which whole pages a
batch's reads touched (`page_ranges`), and libc's `madvise` (`MADVISE`) the mmap reader drops
those pages with. Pure functions of byte offsets, no file is opened here.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable, Sequence

__all__ = ["MADVISE", "PAGE_BYTES", "READ_GAP_BYTES", "coalesce_reads", "page_ranges"]


PAGE_BYTES = mmap.PAGESIZE
"""The OS page size in bytes: the unit in which read pages are dropped (`page_ranges`)."""


def page_ranges(spans: Iterable[tuple[int, int]], limit: int | None = None) -> list[tuple[int, int]]:
    """Byte spans `(offset, nbytes)` rounded out to whole pages, sorted, overlapping or touching
    ones merged; `(start, nbytes)` pairs, start a multiple of `PAGE_BYTES`. `limit` (bytes): no
    range ends past `limit` rounded up to a page (a mapping's end). Empty spans are skipped."""
    rounded = sorted((off // PAGE_BYTES * PAGE_BYTES, -(-(off + n) // PAGE_BYTES) * PAGE_BYTES)
                     for off, n in spans if n > 0)
    if limit is not None:
        end_max = -(-limit // PAGE_BYTES) * PAGE_BYTES
        rounded = [(a, min(b, end_max)) for a, b in rounded if a < end_max]
    merged: list[list[int]] = []
    for start, end in rounded:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b - a) for a, b in merged]


def _libc_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's `madvise(addr, length, advice) -> int` (Linux), or None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


MADVISE = _libc_madvise()
"""libc's `madvise` where the OS has it (Linux), else None: the mmap reader drops read pages with it."""


READ_GAP_BYTES = 256 << 10
"""pread: tensors of one batch less than this many bytes apart in a file are read with one
`os.preadv` call, the bytes between them read and discarded (`coalesce_reads`)."""


def coalesce_reads(spans: Sequence[tuple[int, int]], max_gap: int = READ_GAP_BYTES) -> list[list[int]]:
    """Group one file's byte spans `(offset, nbytes)` (a batch's tensors) into runs that one scatter
    read each covers: sorted by offset, a run goes on while the next span starts at most `max_gap`
    bytes after the previous one ends and does not overlap it (a tensor read twice, into two
    destinations, starts a new run). A streamed unit's tensors sit in a few such runs (a
    safetensors writer orders tensors by dtype, then name), so a unit costs a few large reads
    instead of one small read per tensor and scale (each a separate disk request, with its latency).

    Returns:
        Runs of indices into `spans`, in file order; every index in exactly one run.
    """
    runs: list[list[int]] = []
    end = 0
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        offset, nbytes = spans[i]
        if runs and end <= offset <= end + max_gap:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = offset + nbytes
    return runs
