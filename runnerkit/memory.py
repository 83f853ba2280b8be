"""Device-memory helpers: snapshots, pressure-aware cache emptying, gc freeze.

`maybe_empty_cache` is the only way runnerkit returns cached blocks to the driver: emptying the
allocator cache unconditionally would throw away exactly what warmup paid for (ARCHITECTURE §3).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from loguru import logger

GIB = 1024**3


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory in GiB (zeros on the CPU). allocated: live tensors; reserved: allocator cache
    including allocated; peak_allocated: high-water mark since the last reset; free: driver-free."""

    allocated_gib: float = 0.0
    reserved_gib: float = 0.0
    peak_allocated_gib: float = 0.0
    free_gib: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in asdict(self).items()}

    def describe(self) -> str:
        if self == MemorySnapshot():
            return "cpu: no device memory (allocated 0 GiB, reserved 0 GiB)"
        return (f"allocated {self.allocated_gib:.2f} GiB live, reserved {self.reserved_gib:.2f} GiB "
                f"(cache {self.reserved_gib - self.allocated_gib:.2f} GiB), free {self.free_gib:.2f} GiB")


def snapshot(device: torch.device) -> MemorySnapshot:
    """Current memory of `device` (a CUDA device), or zeros for the CPU."""
    if device.type != "cuda":
        return MemorySnapshot()
    free, _total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(
        allocated_gib=torch.cuda.memory_allocated(device) / GIB,
        reserved_gib=torch.cuda.memory_reserved(device) / GIB,
        peak_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB,
        free_gib=free / GIB,
    )


def maybe_empty_cache(device: torch.device, reason: str, min_free_gib: float, min_reclaimable_gib: float,
                      collect_garbage: bool = False) -> bool:
    """Empty the CUDA caching allocator only under memory pressure; log the decision.

    Acts when driver-free memory is below `min_free_gib` or reserved-but-unallocated memory is above
    `min_reclaimable_gib` (both GiB). `collect_garbage` runs `gc.collect()` first (lazy-load teardown).
    Returns True if the cache was emptied. A no-op on the CPU.
    """
    if collect_garbage:
        gc.collect()
    if device.type != "cuda":
        return False
    snap = snapshot(device)
    reclaimable = snap.reserved_gib - snap.allocated_gib
    act = snap.free_gib < min_free_gib or reclaimable > min_reclaimable_gib
    if act:
        torch.cuda.empty_cache()
    logger.debug("maybe_empty_cache({}): free {:.2f} GiB (floor {:.2f}), reclaimable {:.2f} GiB (threshold {:.2f}) -> {}",
                 reason, snap.free_gib, min_free_gib, reclaimable, min_reclaimable_gib,
                 "emptied" if act else "kept")
    return act


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on `device` (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_frozen = False


def freeze_gc_once() -> bool:
    """`gc.collect(); gc.freeze()` once per process (eager runners, after warmup). Returns True if it froze now."""
    global _frozen
    if _frozen:
        return False
    gc.collect()
    gc.freeze()
    _frozen = True
    logger.info("gc: collected and froze {} start-up objects", gc.get_freeze_count())
    return True


@contextmanager
def oom_note(device: torch.device, where: str) -> Iterator[None]:
    """Add live-allocated vs reserved-cache memory to a CUDA OOM raised inside the block."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        exc.add_note(f"[runnerkit] out of memory during {where}: {snapshot(device).describe()}")
        raise
