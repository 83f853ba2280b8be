"""Memory helpers: device and host snapshots, pressure-aware cache emptying, gc freeze.

`maybe_empty_cache` is the only way runnerkit returns cached blocks to the driver: emptying the
allocator cache unconditionally would throw away exactly what warmup paid for (ARCHITECTURE §3).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from loguru import logger

GIB = 1024**3


@dataclass(frozen=True)
class HostMemory:
    """Host memory of this process in GiB.

    rss: resident set size now; peak_rss: high-water mark of the RSS since `reset_host_peak`
    succeeded (`peak_scope` "request"), or since the process started (`peak_scope` "process":
    the kernel offers no reset, e.g. outside Linux); available: what the kernel can still hand
    out (MemAvailable; None where unknown). Source: /proc/self/status (VmRSS, VmHWM) and
    /proc/meminfo on Linux, `resource.getrusage` elsewhere.
    """

    rss_gib: float
    peak_rss_gib: float
    available_gib: float | None
    peak_scope: str = "process"

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"host_rss_gib": round(self.rss_gib, 4),
                                       "host_peak_rss_gib": round(self.peak_rss_gib, 4),
                                       "host_peak_scope": self.peak_scope}
        if self.available_gib is not None:
            out["host_available_gib"] = round(self.available_gib, 4)
        return out


_host_peak_scope = "process"


def _proc_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    found[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return found


def host_memory() -> HostMemory:
    """This process's host memory now (see `HostMemory`)."""
    status = _proc_kib("/proc/self/status", ("VmRSS", "VmHWM"))
    info = _proc_kib("/proc/meminfo", ("MemAvailable",))
    if "VmRSS" in status and "VmHWM" in status:
        rss, peak = status["VmRSS"] * 1024, status["VmHWM"] * 1024
    else:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS; no current RSS, the peak stands in
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        rss = peak
    available = info["MemAvailable"] * 1024 / GIB if "MemAvailable" in info else None
    return HostMemory(rss / GIB, peak / GIB, available, _host_peak_scope)


def reset_host_peak() -> bool:
    """Restart the host peak-RSS high-water mark (Linux: write 5 to /proc/self/clear_refs).

    Returns True if it was reset; otherwise later peaks stay process-wide (`peak_scope` "process").
    """
    global _host_peak_scope
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        try:
            os.write(fd, b"5")
        finally:
            os.close(fd)
    except OSError:
        _host_peak_scope = "process"
        return False
    _host_peak_scope = "request"
    return True


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory in GiB (zeros on the CPU, where `as_dict` leaves these keys out). allocated:
    live tensors; reserved: allocator cache including allocated; peak_allocated: high-water mark
    since the last reset; free: driver-free."""

    allocated_gib: float = 0.0
    reserved_gib: float = 0.0
    peak_allocated_gib: float = 0.0
    free_gib: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in asdict(self).items()}

    def describe(self) -> str:
        if self == MemorySnapshot():
            host = host_memory()
            available = f", {host.available_gib:.2f} GiB available" if host.available_gib is not None else ""
            return f"cpu: host RSS {host.rss_gib:.2f} GiB{available}"
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
