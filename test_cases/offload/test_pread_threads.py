"""pread with `read_threads` > 1: a batch's runs are cut into jobs (`split_jobs`) that threads read at
once; every byte still lands where a one-thread read puts it, the jobs really overlap, a short read
names its tensor, and a failed job is raised only once every other job has ended."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from runnerkit import cgroup
from runnerkit.config import OffloadConfig
from runnerkit.offload import pread_jobs
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.pread_jobs import ReadJob, preadv_job, split_jobs
from runnerkit.planning.ladder import Candidate, constrain
from runnerkit.weights import CheckpointError
from test_cases._logs import logged
from test_cases.offload import _rss_driver
from test_cases.offload.test_disk_coalesce import _read_unit as _read


def _runs(lengths: list[list[int]], gap_at: set[tuple[int, int]]) -> tuple[list, bytes, list[bytearray]]:
    """Runs of segments over a fake file: run r starts 1000 * r bytes after the previous one ends; the
    segment (r, s) in `gap_at` is a gap (entry None). Returns (runs, the file's bytes, the destinations)."""
    file = bytes(range(256)) * 200
    runs, dsts, pos = [], [], 0
    for r, run in enumerate(lengths):
        pos += 1000 * r
        segments = []
        offset = pos
        for s, n in enumerate(run):
            dst = bytearray(n)
            dsts.append(dst)
            segments.append((memoryview(dst), None if (r, s) in gap_at else f"t{r}.{s}"))
            pos += n
        runs.append((offset, segments))
    return runs, file, dsts


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 40])
def test_split_jobs_cover_every_byte_once_in_file_order(parts: int) -> None:
    """Jobs read as if from the file (each its range into its views) fill every destination with the
    file's bytes at its offset; jobs never join two runs, follow each other in file order, and are of
    the size `total / parts` (rounded up) but the last of each run; one job per run with 1 part."""
    lengths = [[10, 333, 7, 1], [500], [3, 0, 64, 120]]
    runs, file, dsts = _runs(lengths, gap_at={(0, 2)})
    jobs = split_jobs(runs, parts, min_bytes=1)
    for job in jobs:
        at = job.offset
        for view, _ in job.segments:
            view[:] = file[at:at + len(view)]
            at += len(view)
    expected = [file[offset:offset + sum(len(v) for v, _ in segments)] for offset, segments in runs]
    got = [b"".join(bytes(v) for v, _ in segments) for _, segments in runs]
    assert got == expected
    total = sum(map(sum, lengths))
    size = total if parts == 1 else -(-total // parts)
    for r, (offset, segments) in enumerate(runs):
        mine = [j for j in jobs if offset <= j.offset < offset + sum(len(v) for v, _ in segments) + 1]
        lens = [sum(len(v) for v, _ in j.segments) for j in mine]
        assert [j.offset for j in mine] == [offset + sum(lens[:i]) for i in range(len(mine))]
        assert all(n == size for n in lens[:-1]) and 0 < lens[-1] <= size
        assert all(j.last == next(e for _, e in reversed(segments) if e is not None) for j in mine)
    if parts == 1:
        assert len(jobs) == len(runs)


def test_split_jobs_keep_small_batches_whole() -> None:
    """Below `MIN_JOB_BYTES` a thread, a batch is not cut: 3 MiB in 4 parts is one job."""
    runs = [(0, [(memoryview(bytearray(3 << 20)), "t")])]
    assert len(split_jobs(runs, 4)) == 1
    assert [sum(len(v) for v, _ in j.segments) for j in split_jobs(runs, 4, min_bytes=1 << 20)] == [1 << 20] * 3


def test_a_short_read_inside_a_gap_names_the_runs_last_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    job = ReadJob(100, [(memoryview(bytearray(8)), None), (memoryview(bytearray(8)), None)], "last tensor")
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: 0)
    assert preadv_job(-1, job) == (1, "last tensor")
    job = ReadJob(100, [(memoryview(bytearray(8)), None), (memoryview(bytearray(8)), "b")], "last tensor")
    assert preadv_job(-1, job) == (1, "b")


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    sd = {f"blocks.{b}.{k}": torch.randn(n, generator=gen) for b in range(3)
          for k, n in (("attn.weight", 4096), ("ff.weight", 6000), ("norm.weight", 33))}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return path, sd


def _threaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_gap: int) -> tuple[dict, SafetensorsDiskReader]:
    """`_checkpoint`'s tensors and a pread reader of it with 3 read threads, jobs of at least 64 bytes."""
    path, sd = _checkpoint(tmp_path)
    monkeypatch.setattr(pread_jobs, "MIN_JOB_BYTES", 64)
    reader = SafetensorsDiskReader([path], reader="pread", read_threads=3)
    reader.max_gap = max_gap
    return sd, reader


@pytest.mark.parametrize("keys, jobs", [(("attn.weight", "ff.weight", "norm.weight"), 3),
                                         (("attn.weight", "norm.weight"), 4)], ids=["one-run", "two-runs"])
def test_threads_read_the_same_bytes_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: tuple[str, ...],
                                             jobs: int) -> None:
    """read_threads 3: each unit's bytes equal the tensors. A unit read whole is one run (its tensors are
    adjacent in the file), cut into three jobs that meet at a barrier inside `preadv` (they run at once, on
    three threads); read without its middle tensor (max_gap 0), two runs of 16,384 and 132 bytes make jobs
    of 5,506, 5,506, 5,372 and 132 bytes. `read_calls` counts every job's call."""
    path, sd = _checkpoint(tmp_path)
    monkeypatch.setattr(pread_jobs, "MIN_JOB_BYTES", 64)
    real = os.preadv
    barrier = threading.Barrier(3, timeout=10)
    threads: set[int] = set()
    sizes: list[int] = []

    def meeting(fd: int, views: list[memoryview], offset: int) -> int:
        threads.add(threading.get_ident())
        sizes.append(sum(len(v) for v in views))
        if jobs == 3:
            barrier.wait()  # BrokenBarrierError after 10 s if the three jobs ran one after another
        return real(fd, views, offset)

    monkeypatch.setattr(os, "preadv", meeting)
    reader = SafetensorsDiskReader([path], reader="pread", read_threads=3)
    reader.max_gap = 0
    for b in range(3):
        names = [f"blocks.{b}.{k}" for k in keys]
        got = _read(reader, names)
        assert all(torch.equal(got[n], sd[n]) for n in names)
    assert reader.read_calls == 3 * jobs and reader.gap_bytes_read == 0
    assert reader.bytes_read == 3 * sum(sd[f"blocks.0.{k}"].numel() * 4 for k in keys)
    if jobs == 3:
        assert len(threads) == 3 and sorted(sizes[:3]) == [13_504, 13_506, 13_506]
    else:
        assert sorted(sizes[:4]) == [132, 5_372, 5_506, 5_506]
    workers = list(reader._pool._workers)
    reader.close()
    assert reader._pool._workers == [] and len(workers) == 2 and not any(w.is_alive() for w in workers)


def test_a_cut_file_names_the_tensor_a_job_stopped_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads past byte `cut` of the file return nothing (a file cut while streamed, its identity kept):
    the error names the tensor that holds byte `cut`, read by a job on a worker thread."""
    path, _ = _checkpoint(tmp_path)
    monkeypatch.setattr(pread_jobs, "MIN_JOB_BYTES", 64)
    reader = SafetensorsDiskReader([path], reader="pread", read_threads=4)
    reader.max_gap = 1 << 20
    ff = reader.index["blocks.1.ff.weight"]
    cut = ff.offset + ff.nbytes // 2
    real = os.preadv

    def cut_file(fd: int, views: list[memoryview], offset: int) -> int:
        if offset >= cut:
            return 0
        return real(fd, [v[:cut - offset] for v in views[:1]], offset)

    monkeypatch.setattr(os, "preadv", cut_file)
    names = [f"blocks.1.{k}" for k in ("attn.weight", "ff.weight", "norm.weight")]
    with pytest.raises(CheckpointError, match=r"unexpected end of file reading 'blocks.1.ff.weight'"):
        _read(reader, names)
    reader.close()


@pytest.mark.parametrize("failing", ["caller", "worker"])
def test_a_failed_job_is_raised_after_every_other_job_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            failing: str) -> None:
    """Four jobs (the runs attn.0 | norm.0 attn.1 | norm.1 attn.2 | norm.2), the first three on three threads (they
    meet at a barrier); one of them, on the calling thread or on a worker, then fails (EIO) at once while the
    others take 0.2 s: the error reaches the caller only after they have written their bytes (none writes into a
    destination after the read returned), and the fourth job, not started, is skipped."""
    _, reader = _threaded(tmp_path, monkeypatch, max_gap=0)
    caller, real, done, failed, started = threading.get_ident(), os.preadv, [], [], []
    barrier = threading.Barrier(3, timeout=10)

    def slow_or_failing(fd: int, views: list[memoryview], offset: int) -> int:
        started.append(offset)
        if len(started) <= 3:
            barrier.wait()
        on_caller = threading.get_ident() == caller
        if on_caller == (failing == "caller") and not failed:
            failed.append(offset)
            raise OSError(errno.EIO, "Input/output error")
        time.sleep(0.2)
        n = real(fd, views, offset)
        done.append(offset)
        return n

    monkeypatch.setattr(os, "preadv", slow_or_failing)
    with pytest.raises(OSError, match="Input/output error"):
        _read(reader, [f"blocks.{b}.{k}" for b in range(3) for k in ("attn.weight", "norm.weight")])
    assert len(done) == 2 and len(failed) == 1 and len(started) == 3
    reader.close()


@pytest.mark.parametrize("cpus, quota, want", [(16, "max 100000", 4), (2, None, 2), (1, None, 1),
                                               (16, "250000 100000", 3), (16, "50000 100000", 1),
                                               (16, "100000 0", 4), (16, "abc def", 4), (16, "", 4)])
def test_auto_takes_four_threads_or_the_cpus_the_process_may_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 cpus: int, quota: str | None, want: int) -> None:
    """auto: 4, or fewer CPUs in the affinity mask, or a cgroup v2 CPU quota (2.5 CPUs: 3 threads); an int as is."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    if quota is not None:
        (tmp_path / "cpu.max").write_text(quota + "\n")
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cgroup, "MEMBERSHIP", tmp_path / "no-membership")
    assert pread_jobs.resolve_read_threads("auto") == want and pread_jobs.resolve_read_threads(7) == 7
    assert pread_jobs.resolve_read_threads("auto", from_disk=True) == 1  # every read from the disk: one thread
    assert pread_jobs.resolve_read_threads(7, from_disk=True) == 7


@pytest.mark.parametrize("where", ["caller's job", "wait", "both"])
def test_an_interrupt_returns_only_once_no_thread_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         where: str) -> None:
    """Ctrl-C in the calling thread's own job, while it waits for the workers, or both (the first one surfaces):
    the interrupt surfaces only after the workers' running jobs wrote their bytes (none writes afterwards); after
    an interrupt in its job, the fourth job is skipped. Four jobs: the runs attn.0 | norm.0 attn.1 | norm.1
    attn.2 | norm.2 (the ff tensors between them not read, max_gap 0); the first three start together (barrier)."""
    _, reader = _threaded(tmp_path, monkeypatch, max_gap=0)
    caller, real, started, done = threading.get_ident(), os.preadv, [], []
    barrier = threading.Barrier(3, timeout=10)

    def slow_workers(fd: int, views: list[memoryview], offset: int) -> int:
        started.append(offset)
        if len(started) <= 3:
            barrier.wait()
        if threading.get_ident() == caller:
            if where != "wait":
                raise KeyboardInterrupt("in the caller's job")
            return real(fd, views, offset)
        time.sleep(0.3)
        n = real(fd, views, offset)
        done.append(offset)
        return n

    monkeypatch.setattr(os, "preadv", slow_workers)
    real_nap, naps = pread_jobs._Batch.nap, []

    def interrupted_nap(batch: pread_jobs._Batch) -> None:  # a Ctrl-C lands in the first wait
        naps.append(batch.cancelled)
        if len(naps) == 1 and where != "caller's job":
            raise KeyboardInterrupt("while waiting")
        real_nap(batch)

    monkeypatch.setattr(pread_jobs._Batch, "nap", interrupted_nap)
    names = [f"blocks.{b}.{k}" for b in range(3) for k in ("attn.weight", "norm.weight")]
    with pytest.raises(KeyboardInterrupt, match="while waiting" if where == "wait" else "in the caller's job"):
        _read(reader, names)
    assert len(done) == 2 and len(started) == (4 if where == "wait" else 3)  # "wait": the caller ran the 4th
    assert naps[0] == (where != "wait")  # the batch is cancelled before the wait that follows an interrupt
    time.sleep(0.5)
    assert len(done) == 2 and len(started) == (4 if where == "wait" else 3)  # nothing ran after the raise
    reader.close()


@pytest.mark.parametrize("when", ["before the hand-off", "after the hand-off"])
def test_an_interrupt_in_the_hand_off_settles_the_jobs_the_workers_took(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      when: str) -> None:
    """Ctrl-C while the batch is handed to the workers, before they got it or after (they took a job each, 0.2 s):
    the jobs the workers started have written their bytes when the interrupt surfaces, the third job (the
    caller's to claim) never runs, and nothing writes afterwards."""
    _, reader = _threaded(tmp_path, monkeypatch, max_gap=1 << 20)
    real, started, done = os.preadv, [], []

    def slow(fd: int, views: list[memoryview], offset: int) -> int:
        started.append(offset)
        time.sleep(0.2)
        n = real(fd, views, offset)
        done.append(offset)
        return n

    real_hand_off = pread_jobs.PreadPool._hand_off

    def interrupted(pool: pread_jobs.PreadPool, batch: pread_jobs._Batch, helpers: int) -> None:
        if when == "after the hand-off":
            real_hand_off(pool, batch, helpers)
            while len(started) < 2:  # both workers took a job
                time.sleep(0.001)
        raise KeyboardInterrupt(when)

    monkeypatch.setattr(os, "preadv", slow)
    monkeypatch.setattr(pread_jobs.PreadPool, "_hand_off", interrupted)
    with pytest.raises(KeyboardInterrupt, match=when):
        _read(reader, [f"blocks.0.{k}" for k in ("attn.weight", "ff.weight", "norm.weight")])
    ran = 2 if when == "after the hand-off" else 0
    assert len(done) == ran
    time.sleep(0.4)
    assert len(done) == len(started) == ran
    reader.close()


def test_an_interrupt_as_the_wait_begins_still_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C raised on entry to the wait for the workers (where Python checks for signals as a function is
    called, before any `try` of that function): the workers' running jobs have written their bytes when it
    surfaces, and nothing writes afterwards."""
    _, reader = _threaded(tmp_path, monkeypatch, max_gap=1 << 20)
    caller, real, done = threading.get_ident(), os.preadv, []
    barrier = threading.Barrier(3, timeout=10)

    def slow_workers(fd: int, views: list[memoryview], offset: int) -> int:
        barrier.wait()  # each of the three jobs on its own thread
        if threading.get_ident() != caller:
            time.sleep(0.3)
        n = real(fd, views, offset)
        done.append(threading.get_ident() != caller)
        return n

    entered = []

    def interrupt_on_entry(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is pread_jobs._Batch.settle.__code__ and not entered:
            entered.append(1)
            raise KeyboardInterrupt("as the wait begins")

    monkeypatch.setattr(os, "preadv", slow_workers)
    sys.settrace(interrupt_on_entry)
    try:
        with pytest.raises(KeyboardInterrupt, match="as the wait begins"):
            _read(reader, [f"blocks.0.{k}" for k in ("attn.weight", "ff.weight", "norm.weight")])
    finally:
        sys.settrace(None)
    assert entered and done.count(True) == 2
    time.sleep(0.4)
    assert done.count(True) == 2
    reader.close()


def test_a_batch_of_zero_size_tensors_reads_nothing(tmp_path: Path) -> None:
    """A file whose part of a batch holds only empty tensors has no job (no read), with any thread count."""
    path = tmp_path / "empty.safetensors"
    save_file({"a": torch.zeros(0), "b": torch.ones(10)}, str(path))
    reader = SafetensorsDiskReader([path], reader="pread", read_threads=2)
    assert reader.load_tensors(["a"])["a"].shape == (0,) and reader.read_calls == 0
    assert torch.equal(reader.load_tensors(["a", "b"])["b"], torch.ones(10))
    reader.close()


def test_read_threads_reach_the_reader_through_stream_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit count, auto (3 CPUs here: 3 threads where the pages are kept or cannot be dropped, 1 where each
    read goes to the disk) and the mmap reader (one thread); the streaming log line says how many threads read."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", tmp_path / "no-cgroup")
    checkpoint = tmp_path / "wide.safetensors"
    _rss_driver.write_checkpoint(checkpoint, 4)
    for reader, cache, threads, want, said in (("pread", "drop", 5, 5, "reader=pread, 5 read threads)"),
                                               ("pread", "keep", 1, 1, "reader=pread, 1 read thread)"),
                                               ("pread", "keep", None, 3, "reader=pread, 3 read threads)"),
                                               ("pread", "drop", None, 1, "reader=pread, 1 read thread)"),
                                               ("mmap", "auto", None, 1, "reader=mmap)")):
        with logged() as lines:
            streamer, _ = _rss_driver.stream([checkpoint], reader, gpu_slots=2, steps=1, num_blocks=4,
                                             page_cache=cache, read_threads=threads)
        try:
            assert streamer.source.reader.read_threads == want  # type: ignore[attr-defined]
        finally:
            streamer.close()  # type: ignore[attr-defined]
        assert [line for line in lines if "streaming of" in line][0].endswith(said)
    monkeypatch.delattr(os, "posix_fadvise", raising=False)  # no way to drop pages: they stay cached, 3 threads
    streamer, _ = _rss_driver.stream([checkpoint], "pread", gpu_slots=2, steps=1, num_blocks=4, page_cache="drop")
    try:
        assert streamer.source.reader.read_threads == 3  # type: ignore[attr-defined]
    finally:
        streamer.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("keys, message", [
    ({"mode": "block", "storage": "disk", "read_threads": 2}, r"`offload.read_threads`=2 applies to "
     r"`offload.storage`='disk' with `offload.reader`='pread' only \(got storage='disk', reader='mmap'\); allowed "
     r"there: 'auto' or an int from 1 to 64"),
    ({"mode": "block", "read_threads": 4}, r"`offload.read_threads`=4 applies to .* \(got storage='cpu'"),
    ({"mode": "model", "read_threads": 2}, r"`offload.read_threads` has no effect with `offload.mode`='model'"),
    ({"mode": "auto", "storage": "cpu", "read_threads": 2}, r"`offload.read_threads`=2 applies to "
     r"`offload.storage`='disk' with `offload.reader`='pread' only \(allowed there: 'auto' or an int from 1 to "
     r"64\); the config sets storage='cpu' \[type"),
    *[({"mode": "block", "storage": "disk", "reader": "pread", "read_threads": value},
       "must be 'auto' or an int from 1 to 64") for value in (0, 65, "4", True)],
], ids=["reader-mmap", "storage-cpu", "model", "auto-storage-cpu", "zero", "too-many", "string", "bool"])
def test_read_threads_outside_pread_streaming_or_out_of_range_are_refused(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        OffloadConfig(**keys)
    assert len(refused.value.errors()) == 1  # type: ignore[attr-defined]  # one error, not one per union member


def test_in_a_plan_read_threads_set_how_the_pread_rungs_read() -> None:
    """Mode auto: `read_threads` excludes no rung; the pread rungs take it, the others keep the default."""
    explicit = {"read_threads": 8}
    assert OffloadConfig(mode="auto", read_threads=8).read_threads == 8
    host_rung, reason = constrain(Candidate({"mode": "block", "storage": "cpu", "weight_dtype": "same",
                                             "lazy_load": False, "stream_modules": None}), explicit)
    assert reason == "" and host_rung is not None and host_rung.read_threads == "auto"
    disk_rung, _ = constrain(Candidate({"mode": "block", "storage": "disk", "reader": "pread", "weight_dtype": "same",
                                        "lazy_load": True, "stream_modules": None}), explicit)
    assert disk_rung is not None and disk_rung.read_threads == 8
    resident, _ = constrain(Candidate({"mode": "none"}), explicit)
    assert resident is not None and resident.read_threads == "auto"


def test_real_interrupts_at_random_moments_leave_no_thread_writing(tmp_path: Path) -> None:
    """SIGALRM raising KeyboardInterrupt at 600 random moments of threaded reads, in a fresh process
    (`_pread_signal_driver.py`): no worker read ends after an interrupt reached the caller, no other exception,
    the reads after it are right, no read thread is left after `close`, and the process ends (no lock left held)."""
    done = subprocess.run([sys.executable, "-m", "test_cases.offload._pread_signal_driver", str(tmp_path), "600", "7"],
                          capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["interrupted"] > 100 and stats["interrupted"] + stats["completed"] == 600, stats
    assert (stats["late_writes"], stats["other"], stats["wrong"], stats["threads_left"]) == (0, 0, 0, 0), stats


def test_a_reader_dropped_without_close_stops_its_read_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers built and dropped (a module built per request, never closed): their pools' workers end."""
    path, _ = _checkpoint(tmp_path)
    monkeypatch.setattr(pread_jobs, "MIN_JOB_BYTES", 64)
    workers: list[threading.Thread] = []
    for _ in range(5):
        reader = SafetensorsDiskReader([path], reader="pread", read_threads=3)
        reader.load_tensors([f"blocks.0.{k}" for k in ("attn.weight", "ff.weight", "norm.weight")])
        workers += reader._pool._workers
        del reader
        gc.collect()
    assert len(workers) == 10
    for worker in workers:
        worker.join(timeout=5)
    assert not any(w.is_alive() for w in workers)


def test_a_workers_base_exception_surfaces_and_the_worker_stays(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's job raising SystemExit (not an Exception): the read raises it once no thread reads, the worker
    keeps serving, and the next read is right."""
    sd, reader = _threaded(tmp_path, monkeypatch, max_gap=1 << 20)
    caller, real, raised = threading.get_ident(), os.preadv, []
    barrier = threading.Barrier(3, timeout=10)

    def exiting(fd: int, views: list[memoryview], offset: int) -> int:
        if not raised:
            barrier.wait()
            if threading.get_ident() != caller and not raised:
                raised.append(offset)
                raise SystemExit("from a job")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "preadv", exiting)
    names = [f"blocks.0.{k}" for k in ("attn.weight", "ff.weight", "norm.weight")]
    with pytest.raises(SystemExit, match="from a job"):
        _read(reader, names)
    assert all(w.serving for w in reader._pool._workers) and len(reader._pool._workers) == 2
    got = _read(reader, names)
    assert all(torch.equal(got[n], sd[n]) for n in names)
    reader.close()


def test_a_worker_that_cannot_start_is_not_handed_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second worker's start fails ("can't start new thread"): that read raises, the worker is dropped (no
    batch waits in its inbox), and the next read starts it again and is right."""
    sd, reader = _threaded(tmp_path, monkeypatch, max_gap=1 << 20)
    real_start, starts = pread_jobs._Worker.start, []

    def failing_once(worker: pread_jobs._Worker) -> None:
        starts.append(worker)
        if len(starts) == 2:
            raise RuntimeError("can't start new thread")
        real_start(worker)

    monkeypatch.setattr(pread_jobs._Worker, "start", failing_once)
    names = [f"blocks.0.{k}" for k in ("attn.weight", "ff.weight", "norm.weight")]
    with pytest.raises(RuntimeError, match="can't start new thread"):
        _read(reader, names)
    assert reader._pool._workers == starts[:1] and starts[1].inbox.empty()
    got = _read(reader, names)
    assert all(torch.equal(got[n], sd[n]) for n in names) and len(starts) == 3
    assert [w.serving for w in reader._pool._workers] == [True, True]
    reader.close()


def test_no_worker_holds_a_batch_after_the_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a read returned, no read thread keeps its batch (and so its destination tensors): a worker that still
    held one when the interpreter exits would free tensors while the interpreter tears down (a C++ abort)."""
    _, reader = _threaded(tmp_path, monkeypatch, max_gap=1 << 20)
    batches: list[weakref.ref] = []
    real_init = pread_jobs._Batch.__init__

    def recording(batch: pread_jobs._Batch, *args: Any) -> None:
        real_init(batch, *args)
        batches.append(weakref.ref(batch))

    monkeypatch.setattr(pread_jobs._Batch, "__init__", recording)
    for _ in range(3):
        _read(reader, [f"blocks.0.{k}" for k in ("attn.weight", "ff.weight", "norm.weight")])
    deadline = time.monotonic() + 5
    while any(ref() is not None for ref in batches) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(batches) == 3 and all(ref() is None for ref in batches)
    reader.close()
