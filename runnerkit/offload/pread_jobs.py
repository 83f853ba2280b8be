"""The pread reader's scatter reads (`runnerkit.offload.disk`), cut into jobs that threads run at once.

A run (`coalesce_reads`) is a contiguous file range scattered into its tensors' destinations and,
between them, into a discarded scratch buffer: a list of segments in file order. One thread reading
a streamed unit from the page cache copies at a single core's memory bandwidth (a few GB/s on a
server CPU), well under the host's and the H2D link's, so with `read_threads` > 1 a batch's runs are
cut at byte boundaries into about that many jobs of equal size, each one contiguous file range read
by its own `os.preadv` calls (`preadv_job`); a cold disk is read at a deeper queue as well.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO_READ_THREADS", "IOV_MAX", "MIN_JOB_BYTES", "ReadJob", "preadv_job", "read_threads", "split_jobs"]

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
"""Most buffers one `os.preadv` call is given."""

MIN_JOB_BYTES = 4 << 20
"""Runs are cut into jobs of at least this many bytes (smaller ones cost more in hand-offs than they gain)."""

AUTO_READ_THREADS = 4
"""`offload.read_threads` auto: this many, or the CPUs the process may run on if fewer."""

Segment = tuple[memoryview, Any]  # a destination view, and its tensor's index entry (None: a gap, discarded)


@dataclass
class ReadJob:
    """One contiguous file range from `offset`, scattered into `segments` (views in file order);
    `last` is the tensor entry a short read is reported against when the range holds gap bytes only."""

    offset: int
    segments: list[Segment]
    last: Any


def read_threads(setting: int | str) -> int:
    """`offload.read_threads` as a count: an int as it is; "auto" `AUTO_READ_THREADS`, or the CPUs this
    process may run on (its affinity mask) if fewer."""
    if setting != "auto":
        return int(setting)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_READ_THREADS, cpus))


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


def preadv_job(fd: int, job: ReadJob) -> tuple[int, Any]:
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
