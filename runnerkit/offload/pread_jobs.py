"""The pread reader's scatter reads (`runnerkit.offload.disk`), cut into jobs that threads run at once.

A run (`coalesce_reads`) is a contiguous file range scattered into its tensors' destinations and,
between them, into a discarded scratch buffer: a list of segments in file order. One thread reading
a streamed unit from the page cache copies at a single core's memory bandwidth (a few GB/s on a
server CPU), well under the host's and the H2D link's, so with `read_threads` > 1 a batch's runs are
cut at byte boundaries into about that many jobs of equal size, each one contiguous file range read
by its own `os.preadv` calls (`preadv_job`); a cold disk is read at a deeper queue as well.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from runnerkit.weights import TensorIndexEntry

__all__ = ["AUTO_READ_THREADS", "IOV_MAX", "MIN_JOB_BYTES", "PreadPool", "ReadJob", "preadv_job",
           "resolve_read_threads", "split_jobs"]

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
"""Most buffers one `os.preadv` call is given."""

MIN_JOB_BYTES = 4 << 20
"""Runs are cut into jobs of at least this many bytes (smaller ones cost more in hand-offs than they gain)."""

AUTO_READ_THREADS = 4
"""`offload.read_threads` auto: this many, or the CPUs the process may run on if fewer."""

Segment = tuple[memoryview, TensorIndexEntry | None]  # a destination view, its tensor's entry (None: a gap, discarded)
JobResult = tuple[int, TensorIndexEntry | None]  # `os.preadv` calls, and the tensor a short read stopped in (or None)


@dataclass
class ReadJob:
    """One contiguous file range from `offset`, scattered into `segments` (views in file order);
    `last` is the tensor entry a short read is reported against when the range holds gap bytes only."""

    offset: int
    segments: list[Segment]
    last: TensorIndexEntry | None


def _cgroup_cpus(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """The CPUs a cgroup v2 CPU quota allows ("<quota> <period>" in `cpu.max`, rounded up), or None (no quota,
    "max", or no such file)."""
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" or int(period) <= 0 else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def resolve_read_threads(setting: int | str) -> int:
    """`offload.read_threads` as a count: an int as it is; "auto" `AUTO_READ_THREADS`, or fewer where the
    process may use fewer CPUs (its affinity mask, a cgroup CPU quota)."""
    if setting != "auto":
        return int(setting)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_READ_THREADS, cpus, _cgroup_cpus() or cpus))


def split_jobs(runs: Sequence[tuple[int, list[Segment]]], parts: int, min_bytes: int | None = None) -> list[ReadJob]:
    """Cut runs `(file offset, segments)` into jobs of about `total / parts` bytes each (at least
    `min_bytes`, default `MIN_JOB_BYTES`; whole runs when `parts` is 1), cutting a segment's view in two
    where a job ends inside it; a run is never joined with another.

    Returns:
        The jobs in file order; their ranges cover every run's bytes exactly once.
    """
    total = sum(len(view) for _, segments in runs for view, _ in segments)
    size = total if parts <= 1 else max(MIN_JOB_BYTES if min_bytes is None else min_bytes, -(-total // parts))
    jobs: list[ReadJob] = []
    for pos, segments in runs:  # pos: the file offset of the next byte
        last = next((e for _, e in reversed(segments) if e is not None), None)
        job, room = ReadJob(pos, [], last), size
        for view, entry in segments:
            while len(view) > room:  # the job ends inside this view
                if room:
                    job.segments.append((view[:room], entry))
                    view, pos = view[room:], pos + room
                jobs.append(job)
                job, room = ReadJob(pos, [], last), size
            if len(view):
                job.segments.append((view, entry))
                room, pos = room - len(view), pos + len(view)
        if job.segments:
            jobs.append(job)
    return jobs


def preadv_job(fd: int, job: ReadJob) -> JobResult:
    """Read the job's range with `os.preadv` calls (at most `IOV_MAX` views each) until it is read.

    Returns:
        (the number of `os.preadv` calls, None) when every byte was read; at a short read (end of
        file: the file was cut) the entry of the tensor the read stopped in, or `job.last` in a gap.

    Raises:
        OSError: a failed read (its views are then partly written).
    """
    segments = list(job.segments)
    offset, at, calls = job.offset, 0, 0
    while at < len(segments):
        n = os.preadv(fd, [view for view, _ in segments[at:at + IOV_MAX]], offset)
        calls += 1
        if n <= 0:
            return calls, next((e for _, e in segments[at:] if e is not None), job.last)
        offset += n
        while n > 0:  # consume n bytes of segments (the last one possibly in part)
            view, entry = segments[at]
            if n >= len(view):
                n -= len(view)
                at += 1
            else:
                segments[at] = (view[n:], entry)
                n = 0
    return calls, None


class _Batch:
    """The jobs of one `PreadPool.run` handed to workers. A worker runs a job only if the batch is not cancelled
    when the job starts, and counts it while it runs: that count, not the futures the submissions return (an
    interrupt can land after a job was queued and before its future came back), says when no thread writes."""

    def __init__(self, fd: int, jobs: list[ReadJob]) -> None:
        self.fd, self.jobs = fd, jobs
        self.results: list[JobResult | BaseException | None] = [None] * len(jobs)
        self.cond = threading.Condition()
        self.running = 0  # jobs started and not ended
        self.ended = 0  # jobs run to their end or skipped
        self.cancelled = False

    def work(self, index: int) -> None:
        """Run job `index` (on a worker) unless the batch was cancelled; its result or exception kept."""
        with self.cond:
            if self.cancelled:
                self.ended += 1
                self.cond.notify_all()
                return
            self.running += 1
        try:
            self.results[index] = preadv_job(self.fd, self.jobs[index])
        except BaseException as exc:  # noqa: BLE001  raised by the caller once every job ended
            self.results[index] = exc
        finally:
            with self.cond:
                self.running -= 1
                self.ended += 1
                self.cond.notify_all()

    def _wait(self, predicate: Callable[[], bool]) -> None:
        """Wait (holding `cond`) until `predicate()` is true."""
        self.cond.wait_for(predicate)

    def settle(self, submitted: int, cancel: bool) -> BaseException | None:
        """Return once `submitted` jobs ended, or (with `cancel`, or once anything interrupts) once the batch is
        cancelled and no job runs: an interrupt that arrives meanwhile (Ctrl-C, a SIGTERM handler's exception) is
        held and returned, the first one if several, for the caller to raise once no thread writes."""
        held: BaseException | None = None
        while True:
            try:
                with self.cond:
                    if cancel:
                        self.cancelled = True
                        self._wait(lambda: self.running == 0)
                    else:
                        self._wait(lambda: self.ended >= submitted)
                return held
            except BaseException as exc:  # noqa: BLE001  returned to the caller, raised there
                held, cancel = held or exc, True


class PreadPool:
    """Runs a batch's jobs (`split_jobs`) on `threads` threads: the first job on the calling thread, the others
    on `threads - 1` workers started at the first batch that has more than one job.

    `run` returns only once every job ended, also when one failed or the caller was interrupted (jobs not
    started are then skipped): no thread writes into a destination after `run` returned or raised.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"`read_threads` must be at least 1, got {threads}")
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None

    def run(self, fd: int, jobs: list[ReadJob]) -> list[JobResult]:
        """`preadv_job(fd, job)` of every job, in job order.

        Raises:
            OSError: the first failed read in job order, after every job ended.
        """
        if len(jobs) <= 1 or self.threads == 1:
            return [preadv_job(fd, job) for job in jobs]
        batch = _Batch(fd, jobs)
        try:  # every submission inside: an interrupt between two still settles the jobs already queued
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.threads - 1,
                                                    thread_name_prefix="runnerkit-pread")
            for index in range(1, len(jobs)):
                self._executor.submit(batch.work, index)
            batch.results[0] = preadv_job(fd, jobs[0])
        except BaseException:
            batch.settle(0, cancel=True)  # a second interrupt meanwhile is dropped: the first one goes on
            raise
        held = batch.settle(len(jobs) - 1, cancel=False)
        if held is not None:
            raise held
        for result in batch.results:
            if isinstance(result, BaseException):
                raise result
        return batch.results  # type: ignore[return-value]  every job ran: no None, no exception

    def close(self) -> None:
        """Stop the workers (after the jobs they run); a later `run` starts them again."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
