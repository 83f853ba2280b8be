"""The pread reader's scatter reads (`runnerkit.offload.disk`), cut into jobs that threads run at once.

A run (`coalesce_reads`) is a contiguous file range scattered into its tensors' destinations and,
between them, into a discarded scratch buffer: a list of segments in file order. One thread reading
a streamed unit from the page cache copies at a single core's memory bandwidth (a few GB/s on a
server CPU), well under the host's and the H2D link's, so with `read_threads` > 1 a batch's runs are
cut at byte boundaries into about that many jobs of equal size, each one contiguous file range read
by its own `os.preadv` calls (`preadv_job`); a cold disk is read at a deeper queue as well.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from queue import Empty, SimpleQueue

from runnerkit.cgroup import cpu_quota
from runnerkit.weights import TensorIndexEntry

__all__ = ["AUTO_READ_THREADS", "IOV_MAX", "MIN_JOB_BYTES", "PreadPool", "ReadJob", "preadv_job",
           "resolve_read_threads", "split_jobs"]

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
"""Most buffers one `os.preadv` call is given."""

MIN_JOB_BYTES = 4 << 20
"""Runs are cut into jobs of at least this many bytes (smaller ones cost more in hand-offs than they gain)."""

AUTO_READ_THREADS = 4
"""`offload.read_threads` auto for files whose pages stay in the page cache: this many, or the CPUs the process
may run on if fewer (a copy out of the page cache runs at one core's memory bandwidth: on the H100 machine 5.0 GB/s
with 1 thread, 18.1 GB/s with 4; bench/results/pread_threads_h100_s16.md). Files read from the disk take 1 thread:
more read slower there (4 threads 0.82-0.91 x one thread's 1.7 GB/s)."""

Segment = tuple[memoryview, TensorIndexEntry | None]  # a destination view, its tensor's entry (None: a gap, discarded)
JobResult = tuple[int, TensorIndexEntry | None]  # `os.preadv` calls, and the tensor a short read stopped in (or None)


@dataclass
class ReadJob:
    """One contiguous file range from `offset`, scattered into `segments` (views in file order);
    `last` is the tensor entry a short read is reported against when the range holds gap bytes only."""

    offset: int
    segments: list[Segment]
    last: TensorIndexEntry | None


def resolve_read_threads(setting: int | str, from_disk: bool = False) -> int:
    """`offload.read_threads` as a count: an int as it is; "auto" 1 for files read `from_disk` (their pages
    dropped after each read, `offload.page_cache`), else `AUTO_READ_THREADS`, or fewer where the process may use
    fewer CPUs (its affinity mask, a cgroup CPU quota)."""
    if setting != "auto":
        return int(setting)
    if from_disk:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_READ_THREADS, cpus, cpu_quota() or cpus))


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
    """The jobs of one `PreadPool.run`, claimed one at a time (`claims`, an atomic counter) by the calling thread
    and by the workers it was handed to. Each worker says which batch it is in a job of (`_Worker.busy`, set
    before it claims and cleared after it stored the result) and leaves a token on `wake` when it clears it; a
    job claimed once `cancelled` is set is skipped. The calling thread touches only C-level objects (the counter,
    a `SimpleQueue`, attributes), never a Python lock: an interrupt landing anywhere in it leaves nothing held."""

    def __init__(self, fd: int, jobs: list[ReadJob]) -> None:
        self.fd, self.jobs = fd, jobs
        self.results: list[JobResult | BaseException | None] = [None] * len(jobs)
        self.claims = itertools.count()
        self.cancelled = False
        self.wake: SimpleQueue[None] = SimpleQueue()

    def drain(self, worker: _Worker | None = None) -> None:
        """Claim and run jobs until none is left or the batch is cancelled; a failed job's exception is kept as
        its result and cancels the jobs not started (a worker never dies of one). On the calling thread (`worker`
        None) an interrupt propagates."""
        while True:
            if worker is not None:
                worker.busy = self
            index = next(self.claims)
            done = index >= len(self.jobs) or self.cancelled
            if not done:
                try:
                    self.results[index] = preadv_job(self.fd, self.jobs[index])
                except BaseException as exc:  # noqa: BLE001  raised by the caller once no thread reads
                    if worker is None and not isinstance(exc, Exception):
                        raise  # the calling thread's interrupt
                    self.results[index], self.cancelled = exc, True
            if worker is not None:
                worker.busy = None
                self.wake.put(None)
            if done:
                return

    def nap(self) -> None:
        """Wait for a worker's token, at most 50 ms."""
        try:
            self.wake.get(timeout=0.05)
        except Empty:
            pass

    def settle(self, workers: Sequence[_Worker]) -> BaseException | None:
        """Return once no worker is in a job of this batch: an interrupt that arrives meanwhile (Ctrl-C, a SIGTERM
        handler's exception) cancels the batch and is held and returned, the first one if several, for the
        caller to raise once no thread writes."""
        held: BaseException | None = None
        while True:
            try:
                while any(w.busy is self for w in workers):
                    self.nap()
                return held
            except BaseException as exc:  # noqa: BLE001  returned to the caller, raised there
                held = held or exc
                self.cancelled = True


class _Worker(threading.Thread):
    """A read thread: takes batches from its own inbox and drains them, until it takes None. A daemon (a worker
    that an interrupt left half started never holds up the interpreter's exit); its own inbox, so that a worker the
    pool no longer counts is never handed a batch."""

    def __init__(self, index: int) -> None:
        super().__init__(name=f"runnerkit-pread-{index}", daemon=True)
        self.inbox: SimpleQueue[_Batch | None] = SimpleQueue()
        self.busy: _Batch | None = None
        self.ended = False

    @property
    def serving(self) -> bool:
        """Whether it runs and takes batches. Read without a lock (`Thread.is_alive` may take one, and an
        interrupt inside it can mark a running thread stopped, CPython issue 45274's recovery path)."""
        return self.ident is not None and not self.ended

    def run(self) -> None:
        try:
            while (batch := self.inbox.get()) is not None:
                batch.drain(self)
                batch = None  # not held while waiting: its destinations are never freed here at interpreter exit
        finally:
            self.ended = True


class PreadPool:
    """Runs a batch's jobs (`split_jobs`) on `threads` threads: the calling thread and `threads - 1` workers
    (started at the first batch that has more than one job) claim the jobs one at a time.

    `run` returns or raises only once no thread is in a job of the batch, also when a job failed or the caller
    was interrupted (jobs not started are then skipped): no thread writes into a destination afterwards. A second
    interrupt while the first is handled may return before that (by the time it takes a worker to end its job).
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"`read_threads` must be at least 1, got {threads}")
        self.threads = threads
        self._workers: list[_Worker] = []
        # A pool dropped without `close` (its reader garbage): its workers get their None and end. Not at
        # interpreter exit: daemon threads woken then would run while the interpreter tears down.
        weakref.finalize(self, _stop, self._workers).atexit = False

    def _hand_off(self, batch: _Batch, helpers: int) -> None:
        """Replace the workers that ended, start the missing ones, and give the batch to `helpers` of those that
        serve (a worker whose start an interrupt cut short before its thread ran keeps its place and gets none)."""
        self._workers[:] = [w for w in self._workers if not w.ended]
        while len(self._workers) < self.threads - 1:
            worker = _Worker(len(self._workers))
            self._workers.append(worker)  # first: a started worker is always one `settle` looks at
            try:
                worker.start()
            except RuntimeError:  # "can't start new thread": it never runs
                self._workers.remove(worker)
                raise
        for worker in [w for w in self._workers if w.serving][:helpers]:
            worker.inbox.put(batch)

    def run(self, fd: int, jobs: list[ReadJob]) -> list[JobResult]:
        """`preadv_job(fd, job)` of every job, in job order.

        Raises:
            OSError (or another exception of a job): the first failed read in job order, once no thread reads.
        """
        if len(jobs) <= 1 or self.threads == 1:
            return [preadv_job(fd, job) for job in jobs]
        batch = _Batch(fd, jobs)
        try:  # the wait too: an interrupt as it starts is handled here
            self._hand_off(batch, min(self.threads, len(jobs)) - 1)
            batch.drain()
            held = batch.settle(self._workers)
        except BaseException:
            batch.cancelled = True
            batch.settle(self._workers)  # a second interrupt meanwhile is dropped: the first one goes on
            raise
        if held is not None:
            raise held
        failed = next((r for r in batch.results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        return batch.results  # type: ignore[return-value]  every job ran: no None, no exception

    def close(self) -> None:
        """Stop the workers (after the jobs they run); a later `run` starts them again."""
        workers = list(self._workers)
        _stop(self._workers)
        for worker in workers:
            if worker.serving:  # (not one whose start an interrupt cut short: it ends at its None if it runs)
                worker.join()


def _stop(workers: list[_Worker]) -> None:
    """Give each of `workers` a None (it ends once it takes it) and forget them."""
    for worker in workers:
        worker.inbox.put(None)
    workers.clear()
