"""Memory helpers: device and host snapshots, the memory limit of a device, pressure-aware cache emptying, gc freeze.

`maybe_empty_cache` is the only way runnerkit returns cached blocks to the driver: emptying the
allocator cache unconditionally would throw away exactly what warmup paid for (ARCHITECTURE §3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from loguru import logger

from runnerkit.cgroup import memory_available

GIB = 1024**3


@dataclass(frozen=True)
class HostMemory:
    """Host memory of this process in GiB.

    rss: resident set size now; peak_rss: high-water mark of the RSS since `reset_host_peak`
    succeeded (`peak_scope` "request"), or since the process started (`peak_scope` "process":
    the kernel offers no reset, e.g. outside Linux); available: what the kernel can still hand
    out (`host_available_bytes`; None where unknown); anon: the anonymous and shared (pinned slabs,
    shared memory) part of the RSS now, without the pages of memory-mapped files, which the kernel
    may drop at any time: what the planner's host estimate bounds (None where unknown). Source:
    /proc/self/status (VmRSS, VmHWM, RssAnon, RssShmem) on Linux, `resource.getrusage` elsewhere.
    """

    rss_gib: float
    peak_rss_gib: float
    available_gib: float | None
    peak_scope: str = "process"
    anon_gib: float | None = None

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"host_rss_gib": round(self.rss_gib, 4),
                                       "host_peak_rss_gib": round(self.peak_rss_gib, 4),
                                       "host_peak_scope": self.peak_scope}
        if self.anon_gib is not None:
            out["host_anon_shmem_gib"] = round(self.anon_gib, 4)
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
    status = _proc_kib("/proc/self/status", ("VmRSS", "VmHWM", "RssAnon", "RssShmem"))
    anon = None
    if "RssAnon" in status and "RssShmem" in status:
        anon = (status["RssAnon"] + status["RssShmem"]) * 1024 / GIB
    if "VmRSS" in status and "VmHWM" in status:
        rss, peak = status["VmRSS"] * 1024, status["VmHWM"] * 1024
    else:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS; no current RSS, the peak stands in
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        rss = peak
    found = host_available_bytes()  # MemAvailable, psutil or free pages; a cgroup limit if smaller
    available = found[0] / GIB if found is not None else None
    return HostMemory(rss / GIB, peak / GIB, available, _host_peak_scope, anon)


def trim_host_heap() -> float | None:
    """Give the C heap's free pages back to the kernel (glibc `malloc_trim(0)`); returns the GiB the anonymous
    RSS fell by (`HostMemory.anon_gib`), or None where there is no glibc or no /proc.

    Loading frees many tensors below glibc's mmap threshold (after one large free it rises to 32 MiB), which
    stay resident in the heap as free chunks between live ones: memory no later allocation of another size
    reuses, and that the host estimate does not count. Called once after loading.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    before = host_memory().anon_gib
    trim(0)
    after = host_memory().anon_gib
    return None if before is None or after is None else before - after


def reset_device_peak(device: torch.device) -> None:
    """Restart the CUDA allocator's peak-allocated mark of `device` (a phase's own peak); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


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
class DiskIO:
    """This process's file reads so far, in bytes (Linux /proc/self/io: every thread of the process,
    the disk reader's read-ahead thread included; cumulative since the process started).

    Attributes:
        read_bytes: bytes the storage layer fetched for this process (page-cache misses: what the
            disk really delivered; reads served from the page cache count 0). Reads of a mapped file
            (reader "mmap") count here when they fault pages in from the disk.
        rchar: bytes passed to read-like system calls (read, pread, preadv, ...), cache hits included;
            page faults of a mapping are not counted (reader "mmap" adds 0 here).

    Difference two readings (`delta`) around a step for its disk-bound ratio:
    `delta.read_bytes / step_seconds` against the disk's bandwidth.
    """

    read_bytes: int
    rchar: int

    def delta(self, earlier: DiskIO) -> DiskIO:
        """What was read between `earlier` and this reading."""
        return DiskIO(self.read_bytes - earlier.read_bytes, self.rchar - earlier.rchar)


def disk_io() -> DiskIO | None:
    """This process's disk reads so far (see `DiskIO`); None where /proc/self/io cannot be read (not
    Linux, or a kernel without task I/O accounting)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("read_bytes", "rchar"):
                    found[name] = int(rest.strip())
    except (OSError, ValueError):
        return None
    if len(found) != 2:
        return None
    return DiskIO(read_bytes=found["read_bytes"], rchar=found["rchar"])


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
        return (f"allocated {self.allocated_gib:.2f} GiB live (peak {self.peak_allocated_gib:.2f} GiB), "
                f"reserved {self.reserved_gib:.2f} GiB "
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


@dataclass(frozen=True)
class MemoryLimit:
    """How many bytes a run may use on its device, and where the number comes from.

    Attributes:
        bytes: the limit a request's estimated peak (weights included) is compared with.
        source: how it was obtained, for messages, e.g. "cpu: MemAvailable 21.9 GiB (/proc/meminfo)".
    """

    bytes: int
    source: str


MEMINFO = Path("/proc/meminfo")


def _meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (the kernel's estimate of memory a new workload can
    use without swapping: free memory plus reclaimable page cache and slab), or None."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_available_bytes() -> tuple[int, str] | None:
    """Host memory a new allocation can use, in bytes, and its source; None if unknown.

    /proc/meminfo MemAvailable (Linux), else psutil's `virtual_memory().available` if psutil is
    installed, else free pages (`os.sysconf`: conservative, ignores reclaimable cache); then the
    smaller of that and what the cgroup memory limits on this process's groups leave
    (`runnerkit.cgroup.memory_available`).
    """
    found: tuple[int, str] | None = None
    available = _meminfo_available()
    if available is not None:
        found = available, "MemAvailable of /proc/meminfo"
    else:
        try:
            import psutil  # type: ignore[import-not-found]  # optional; not a dependency

            found = int(psutil.virtual_memory().available), "psutil.virtual_memory().available"
        except ImportError:
            try:
                found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages (os.sysconf)"
            except (ValueError, OSError, AttributeError):
                found = None
    cgroup = memory_available()
    if cgroup is not None and (found is None or cgroup[0] < found[0]):
        return cgroup[0], f"{cgroup[1]} minus its usage"
    return found


def memory_limit(device: torch.device, limit_gib: float | None = None) -> MemoryLimit | None:
    """The bytes a run may use on `device`, as the device reports them now; None if they cannot be
    known. A runner reads this once, before loading, through `device_budget`.

    - `limit_gib` given (config `memory.limit_gib`): exactly that, whatever the device has.
    - CUDA: driver-free memory (`torch.cuda.mem_get_info`) plus what this process's caching
      allocator already holds (`torch.cuda.memory_reserved`: its live tensors and its cache).
    - CPU: available host memory (`host_available_bytes`).

    Args:
        device: the run's compute device.
        limit_gib: the configured limit in GiB, or None to read the device.
    """
    if limit_gib is not None:
        return MemoryLimit(int(limit_gib * GIB), "config memory.limit_gib")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        return MemoryLimit(free + held, f"{device}: {free / GIB:.2f} GiB free (torch.cuda.mem_get_info) + "
                                        f"{held / GIB:.2f} GiB held by this process (torch.cuda.memory_reserved)")
    if device.type == "cpu":
        found = host_available_bytes()
        if found is None:
            return None
        available, source = found
        return MemoryLimit(available, f"cpu: {available / GIB:.2f} GiB available ({source})")
    return None


HEADROOM_BYTES: dict[str, int] = {"cuda": 1024**3}
"""Bytes a run's budget leaves unused under a limit read from the device, by device type
(`device_budget`). CUDA: memory the CUDA libraries take outside PyTorch's caching allocator once
work starts (cuBLAS and cuDNN handles and workspaces, NCCL buffers, Triton and inductor modules),
which free + reserved no longer shows after loading and warmup, and allocator fragmentation beyond
the estimates' margin. CPU: none (the estimate's fixed overhead covers the allocator's and oneDNN's
caches). The drop of free + reserved between the plan and the first request is measured in
bench/results/limit_drift_h100.md."""


def device_budget(device: torch.device, limit_gib: float | None = None) -> MemoryLimit | None:
    """The limit a run plans and checks against; None where the device's memory cannot be read.

    A configured `limit_gib` is the budget exactly (the user's number). A limit read from the device
    (`memory_limit`) is lowered by `HEADROOM_BYTES` for its device type: what the CUDA libraries will
    take outside the caching allocator once work starts. A runner reads this once, before loading, and
    keeps it: the planner, the warmup gate and every request's check compare with this same number, so
    a plan the planner accepted is never refused later by a re-read limit that the load's library
    allocations have lowered.
    """
    raw = memory_limit(device, limit_gib)
    headroom = HEADROOM_BYTES.get(device.type, 0)
    if raw is None or limit_gib is not None or not headroom:
        return raw
    return MemoryLimit(max(0, raw.bytes - headroom),
                       f"{raw.source} - {headroom / GIB:.2f} GiB kept for the CUDA libraries")


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
