"""Host memory of disk streaming (docs/host_memory.md): the peak RSS bound, the page cache left by the
pread reader, and this process's disk reads (`memory.disk_io`).

The RSS is measured in a fresh process (`_rss_driver.py`), so what this test process allocated
before does not count: 32 blocks of 4 MiB (128 MiB streamed per step, 4 MiB largest unit) through
2 slots, against a bound of 2 x 2 x 4 MiB + resident + `CONSTANT` (+ 4 MiB for mmap).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runnerkit import memory
from runnerkit.offload import DiskSource
from runnerkit.offload.disk import PAGE_BYTES, page_ranges
from test_cases._logs import logged
from test_cases.conftest import REPO
from test_cases.offload import _rss_driver

MIB = 2**20
CONSTANT = 16 * MIB
"""The bound's constant (docs/host_memory.md): allocator slack, activations, Python objects, the
read-ahead thread; measured 5 MiB (pread) on this toy."""
BLOCKS = 32


def _run_driver(checkpoint: Path, reader: str, gpu_slots: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "test_cases.offload._rss_driver", str(checkpoint), reader,
                           str(gpu_slots), str(steps), str(BLOCKS)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and /proc/self/clear_refs are Linux's")
@pytest.mark.parametrize("reader", ["pread", "mmap"])
def test_peak_rss_of_disk_streaming_is_bounded(tmp_path: Path, reader: str) -> None:
    """peak RSS - baseline <= S x U (staging slabs) + S x U (device slots: host memory on the CPU)
    + resident + CONSTANT, + U for mmap (the mapped pages of the unit being copied, dropped after
    each unit): not the checkpoint's size, although 32 x 4 MiB stream through per step."""
    checkpoint = tmp_path / "wide.safetensors"
    _rss_driver.write_checkpoint(checkpoint, BLOCKS)
    found = _run_driver(checkpoint, reader, gpu_slots=2, steps=1)
    if not found["peak_reset"]:
        pytest.skip("/proc/self/clear_refs cannot reset the RSS high-water mark here")
    unit, slots = found["largest_unit"], found["gpu_slots"]
    assert unit == _rss_driver.UNIT_BYTES and found["units"] == BLOCKS
    assert found["streamed_per_step"] == BLOCKS * unit
    assert found["disk_bytes_read"] >= BLOCKS * unit  # every block was really read (plus the wrap read-ahead)
    bound = 2 * slots * unit + found["resident_bytes"] + CONSTANT + (unit if reader == "mmap" else 0)
    grown = found["peak_rss"] - found["baseline_rss"]
    assert grown <= bound, (f"peak RSS grew {grown / MIB:.1f} MiB over the baseline; bound {bound / MIB:.1f} MiB "
                            f"({reader}, {found})")
    assert found["streamed_per_step"] > 3 * bound  # the bound means something: far less than what streamed
    if reader == "pread":  # pread goes through read system calls: /proc/self/io rchar counts every byte
        assert found["rchar"] >= found["disk_bytes_read"]
    else:  # mapped pages are faulted in, not read: rchar sees only the header reads
        assert found["rchar"] < unit


# -- the page cache left by the pread reader (mincore on a mapping of the file) -----------------------------

def resident_pages(path: Path, spans: list[tuple[int, int]]) -> tuple[int, int]:
    """(pages of `spans` in the page cache, pages of `spans`), asked with mincore(2) on a private
    mapping of `path` that is never touched (the mapping faults nothing in)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        buf = (ctypes.c_char * size).from_buffer(mapping)
        try:
            pages = -(-size // PAGE_BYTES)
            vec = (ctypes.c_ubyte * pages)()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            if libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            wanted = {p for start, n in page_ranges(spans)
                      for p in range(start // PAGE_BYTES, (start + n) // PAGE_BYTES)}
            return sum(1 for p in wanted if vec[p] & 1), len(wanted)
        finally:
            del buf
    finally:
        mapping.close()


def _cache_whole_file(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(4 * MIB):
            pass


def read_ahead_bytes(path: Path) -> int | None:
    """The kernel's read-ahead window for the file system of `path` (its BDI's `read_ahead_kb`), or None."""
    dev = path.stat().st_dev
    try:
        return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text()) * 1024
    except (OSError, ValueError):
        return None


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
@pytest.mark.parametrize("drop", [True, False], ids=["drop_pages", "keep_pages"])
def test_pread_streaming_keeps_the_page_cache_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      drop: bool) -> None:
    """Streaming 16 blocks of 4 MiB with reader pread from a file none of whose pages are cached: after
    each unit fetch at most 3 units + 2 read-ahead windows of the file are cached (if that is less
    than half the file: otherwise nothing is shown), and after the request (`streamer.reset()`) none
    of it; with `offload.page_cache` keep (the control) all of it."""
    checkpoint = tmp_path / "wide.safetensors"
    tensors = _rss_driver.write_checkpoint(checkpoint, 16)  # 64 MiB, written back to the disk (fsync)
    spans = [(offset, nbytes) for _, offset, nbytes in tensors]
    _cache_whole_file(checkpoint)
    cached, total = resident_pages(checkpoint, spans)
    fd = os.open(checkpoint, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if cached < total or resident_pages(checkpoint, spans)[0]:  # e.g. tmpfs: pages are the file itself
        pytest.skip(f"this file system does not show a file's cached pages as cached and dropped ({cached} of {total})")
    during: list[int] = []
    real_fetch = DiskSource.fetch

    def sampled_fetch(self: DiskSource, unit: int, slot: int, engine: object) -> torch.Tensor:
        out = real_fetch(self, unit, slot, engine)
        during.append(resident_pages(checkpoint, spans)[0])
        return out

    monkeypatch.setattr(DiskSource, "fetch", sampled_fetch)
    streamer, found = _rss_driver.stream([checkpoint], "pread", gpu_slots=2, steps=1, num_blocks=16,
                                         page_cache="drop" if drop else "keep")
    after_request = resident_pages(checkpoint, spans)[0]  # `stream` ended with streamer.reset()
    streamer.close()
    assert len(during) == 16 + 1  # every unit, then the wrap read-ahead's fetch of unit 0
    if not drop:
        # the control keeps (nearly) the whole file cached: the kernel may still evict a few clean pages
        # when another process (the suite's other worker) needs memory, so allow 1 % of them
        slack = total // 100
        assert after_request >= total - slack and found["reader_dropped_bytes"] == 0, (after_request, total)
        assert during[-2] >= total - slack and during[7] <= during[-2], during  # grows with the units, to the file
        return
    assert after_request == 0, f"{after_request} of {total} streamed pages still cached after the request"
    window = read_ahead_bytes(checkpoint)
    # the unit just read (its pages are dropped once its run is read), the one being read, the next
    # whose first pages a large `preadv` has already started, and the kernel's read-ahead beyond
    limit = (3 * _rss_driver.UNIT_BYTES + 2 * (window or 0)) // PAGE_BYTES + 4
    if window is not None and limit <= total // 2:
        # at most one sample above: on a loaded machine the drop after a unit's run can be scheduled after the
        # next sample (seen once, 7272 of a 7172 limit, the rest below); without drops every later sample is
        # above (the file grows to 16384 pages)
        second = sorted(during)[-2]
        assert second <= limit, f"{second} pages cached during the request (2nd most), limit {limit} ({during})"
    assert found["reader_dropped_bytes"] >= sum(n for _, n in spans)


def test_page_ranges_round_out_to_whole_pages_and_merge() -> None:
    p = PAGE_BYTES
    assert page_ranges([(10, 20)]) == [(0, p)]
    assert page_ranges([(p + 1, p)]) == [(p, 2 * p)]  # spans two pages
    assert page_ranges([(3 * p, 5), (0, 1), (p - 1, 2), (0, 0)]) == [(0, 2 * p), (3 * p, p)]  # merged, sorted
    assert page_ranges([(0, 10 * p)], limit=2 * p + 1) == [(0, 3 * p)]  # clipped at the mapping's last page
    assert page_ranges([(5 * p, 1)], limit=2 * p) == []


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
def test_disk_io_counts_this_process_reads(tmp_path: Path) -> None:
    """A file none of whose pages are cached, read once with pread: the disk delivers the whole file
    (`read_bytes` at least its size) and the system call passes it (`rchar`); read again, the page cache
    serves it (`read_bytes` well below its size, `rchar` its size again)."""
    size = 75 * PAGE_BYTES
    path = tmp_path / "data.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED can drop them
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if resident_pages(path, [(0, size)])[0]:  # e.g. tmpfs: pages are the file itself
            pytest.skip("this file system keeps the file's pages cached after POSIX_FADV_DONTNEED")
        before = memory.disk_io()
        if before is None:
            pytest.skip("/proc/self/io is not readable here")
        assert len(os.pread(fd, size, 0)) == size
        cold = memory.disk_io().delta(before)
        before = memory.disk_io()
        assert len(os.pread(fd, size, 0)) == size
        warm = memory.disk_io().delta(before)
    finally:
        os.close(fd)
    slack = 64 * PAGE_BYTES  # what else the process may read meanwhile (pytest, imports)
    assert size <= cold.read_bytes < size + slack, cold  # read-ahead stops at the end of the file
    assert size <= cold.rchar < size + slack, cold
    assert warm.read_bytes < size and size <= warm.rchar < size + slack, warm
    assert memory.DiskIO(10, 20).delta(memory.DiskIO(3, 5)) == memory.DiskIO(7, 15)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc/self/status (not Linux)")
def test_host_anon_counts_allocations_and_not_mapped_file_pages(tmp_path: Path) -> None:
    """`host_memory().anon_gib` (RssAnon + RssShmem, what the host estimate bounds): 64 MiB of fresh anonymous
    memory written raise it by 64 MiB; 64 MiB of a memory-mapped file read through raise the RSS by as much and
    it by (almost) nothing. (A fresh anonymous mapping, not a tensor: an allocator may hand back pages that an
    earlier test left resident.)"""
    mib = 2**20 / memory.GIB
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * 2**20))
    before = memory.host_memory()
    anon = mmap.mmap(-1, 64 * 2**20)
    for i in range(0, len(anon), 4096):
        anon[i] = 1  # every page written
    grown = memory.host_memory()
    assert 62 * mib <= grown.anon_gib - before.anon_gib <= 67 * mib
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert sum(mapped[i] for i in range(0, len(mapped), 4096)) >= 0  # one byte a page: every page resident
    after = memory.host_memory()
    assert after.rss_gib - grown.rss_gib >= 60 * mib
    assert after.anon_gib - grown.anon_gib <= 2 * mib
    assert memory.host_memory().as_dict()["host_anon_shmem_gib"] == pytest.approx(after.anon_gib, abs=4 * mib)
    mapped.close()
    anon.close()


TRIM_DRIVER = """
import json, torch
from runnerkit import memory
keep, drop = [], []
for i in range(3200):  # 64 KiB tensors: below glibc's mmap threshold, so they live in the heap
    (keep if i % 10 == 0 else drop).append(torch.ones(64 * 1024, dtype=torch.uint8))
before = memory.host_memory().anon_gib
del drop  # 180 MiB freed between live tensors: the heap cannot shrink
freed = memory.host_memory().anon_gib
returned = memory.trim_host_heap()
print(json.dumps({"before": before, "freed": freed, "returned": returned, "after": memory.host_memory().anon_gib}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc/self/status (not Linux)")
def test_trim_host_heap_returns_freed_heap_pages() -> None:
    """In a fresh process: 180 MiB of small tensors freed between live ones stay resident (glibc keeps them in its
    heap), and `trim_host_heap` gives them back to the kernel and says how much it gave."""
    done = subprocess.run([sys.executable, "-c", TRIM_DRIVER], capture_output=True, text=True, timeout=120,
                          cwd=REPO, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if platform.libc_ver()[0] != "glibc":
        assert got["returned"] is None, got  # nothing to call
        pytest.skip("not glibc: no malloc_trim")
    mib = 2**20 / memory.GIB
    if got["before"] - got["freed"] > 90 * mib:
        pytest.skip("this allocator returned the freed pages itself")
    assert got["returned"] >= 150 * mib and got["freed"] - got["after"] >= 150 * mib, got
    assert got["returned"] == pytest.approx(got["freed"] - got["after"], abs=2 * mib)


@pytest.mark.parametrize("returned, said", [(0.5, "freed heap returned: 0.50 GiB"),
                                             (None, "freed heap returned: n/a (no malloc_trim)")])
def test_loading_gives_the_freed_heap_back_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                returned: float | None, said: str) -> None:
    """`init_modules` trims the heap once, after the modules are loaded (before warmup), and the load line says what
    it gave back, or that there is no trim here."""
    from runnerkit.config import load_runner_config
    from runnerkit.models.wan.runner import WanT2VRunner

    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)
    runner = WanT2VRunner(load_runner_config(REPO / "configs" / "wan" / "wan_t2v_tiny.json", {"device": "cpu"}))
    order: list[str] = []
    monkeypatch.setattr(memory, "trim_host_heap", lambda: order.append("trim") or returned)
    load = runner.load_modules
    monkeypatch.setattr(runner, "load_modules", lambda: (load(), order.append("load"))[0])
    with logged("INFO") as lines:
        runner.init_modules()
    assert order == ["load", "trim"]
    assert [line for line in lines if line.startswith("load: ")][0].endswith(said)


def test_warmup_and_each_request_start_the_device_peak_afresh(tiny_ckpt: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's peak mark restarts before warmup's work and before each request's, so warmup's summary line and
    `warmup.memory_after.peak_allocated_gib` give warmup's own peak, not the load's (CUDA's mark; recorded here)."""
    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.models.wan.runner import WanT2VRunner
    from test_cases.conftest import tiny_config_dict

    events: list[str] = []
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)
    monkeypatch.setattr(memory, "reset_device_peak", lambda device: events.append(f"reset {device.type}"))
    real = WanT2VRunner.run_warmup
    monkeypatch.setattr(WanT2VRunner, "run_warmup", lambda self, shapes: events.append("warmup") or real(self, shapes))
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, warmup=True)))
    runner.init_modules()
    assert events == ["reset cpu", "warmup"]
    runner.run_pipeline(RequestConfig(prompt="a fox", seed=1, save_tensor_path=str(tmp_path / "r.safetensors")), 0)
    assert events == ["reset cpu", "warmup", "reset cpu"]


def test_a_device_snapshot_describes_its_peak() -> None:
    """The load, warmup and out-of-memory lines give the allocator's high-water mark beside the live bytes (a
    warmup that breaks its cap shows in its own line)."""
    snap = memory.MemorySnapshot(allocated_gib=1.5, reserved_gib=20.0, peak_allocated_gib=32.875, free_gib=40.0)
    assert snap.describe() == ("allocated 1.50 GiB live (peak 32.88 GiB), reserved 20.00 GiB (cache 18.50 GiB), "
                               "free 40.00 GiB")
