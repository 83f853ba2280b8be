"""The result writer: one thread that writes requests' files while the next request computes.

    writer = ResultWriter(max_in_flight=1)
    waited = writer.submit(index, prepare, done)   # waits for a free slot, then queues the write
    ...
    writer.drain()                                 # every write submitted so far has ended
    writer.close()                                 # drain, then stop the thread

A write is in flight from `submit` (its slot is taken before `prepare` runs) until its `done`
callback returned; `submit` waits while `max_in_flight` writes are in flight, so the host memory the
queued results hold is bounded, and a request whose result finds every slot taken waits (its
compute is finished; the next request starts once this one's result is queued). One thread writes
the queue in submission order: results end in the order their requests ran.

Nothing here knows what a request is: `prepare()` runs on the caller's thread once a slot is free
and returns the write itself, `write(checkpoint) -> paths`, which runs on the writer thread (under
the task's `lock`, e.g. the output lock of a parallel group); `done(WriteOutcome)` runs on the
writer thread after it, outside the lock. `write` must call `checkpoint()` between files: after
`abandon()` it raises `WriteAbandoned` there, so an abandoned write stops at its next file boundary
and its all-or-nothing file set (runnerkit/media.py `atomic_outputs`) removes its temporary files.

`max_in_flight` 0 is not a mode of this class: callers with 0 write inline, as before the writer
existed (runners/writes.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

__all__ = ["ResultWriter", "WriteAbandoned", "WriteFn", "WriteOutcome"]

#: How often a caller waiting in `submit` or `drain` wakes up. A Ctrl-C that the kernel hands to another
#: thread (the writer, the one that signalled) does not interrupt the main thread's lock wait; its handler
#: runs when the main thread next runs Python code, so the wait must not block longer than this.
SIGNAL_CHECK_S = 0.1

#: The write itself: called on the writer thread with `checkpoint`; returns the final paths written.
WriteFn = Callable[[Callable[[], None]], list[str]]


class WriteAbandoned(Exception):
    """The write was abandoned (`ResultWriter.abandon`, a second Ctrl-C): its files were not kept."""


@dataclass
class WriteOutcome:
    """How one submitted write ended.

    Attributes:
        index: the request's index, as given to `submit`.
        paths: the final paths written (empty when it failed).
        error: None if every file was written; else what failed (`WriteAbandoned` when abandoned).
        seconds: wall seconds the write took on the writer thread (0 if it never started).
    """

    index: int
    paths: list[str] = field(default_factory=list)
    error: BaseException | None = None
    seconds: float = 0.0


@dataclass
class _Task:
    index: int
    write: WriteFn
    done: Callable[[WriteOutcome], None]
    lock: AbstractContextManager[Any]


class ResultWriter:
    """Writes submitted results on one thread, in order, at most `max_in_flight` at once.

    Args:
        max_in_flight: results that may be in flight (queued or being written), >= 1.

    Raises:
        ValueError: `max_in_flight` is not an int >= 1.
    """

    def __init__(self, max_in_flight: int) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"`max_writes_in_flight` for the writer thread must be an int >= 1 (got "
                             f"{max_in_flight!r}; 0 writes inline, without a writer)")
        self.max_in_flight = max_in_flight
        self._cond = threading.Condition()
        self._queue: deque[_Task] = deque()
        self._reserved = 0  # slots taken by a `submit` whose `prepare` runs
        self._waiting = 0  # `submit`s waiting for a free slot
        self._active: _Task | None = None
        self._abandoned = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def in_flight(self) -> list[int]:
        """The indices of the writes in flight, oldest first (the one being written, then the queued)."""
        with self._cond:
            return ([self._active.index] if self._active is not None else []) + [t.index for t in self._queue]

    def waiting(self) -> int:
        """How many `submit`s wait for a free slot now (every slot is in flight)."""
        with self._cond:  # (a submit counted here is inside `wait`: it checks and leaves under this lock)
            return self._waiting

    def _count(self) -> int:
        return len(self._queue) + self._reserved + (self._active is not None)

    def submit(self, index: int, prepare: Callable[[], WriteFn], done: Callable[[WriteOutcome], None],
               lock: AbstractContextManager[Any] | None = None) -> float:
        """Wait for a free slot, take it, run `prepare()` here, queue the write it returns.

        Returns:
            seconds waited for the slot.

        Raises:
            RuntimeError: the writer was closed or abandoned.
            whatever `prepare` raises (the slot is freed; nothing is queued).
        """
        t0 = time.perf_counter()
        with self._cond:
            self._waiting += 1
            try:
                while not (self._closed or self._abandoned) and self._count() >= self.max_in_flight:
                    self._cond.wait(SIGNAL_CHECK_S)
            finally:
                self._waiting -= 1
            if self._closed or self._abandoned:
                raise RuntimeError(f"the result writer is {'closed' if self._closed else 'abandoned'}: request "
                                   f"{index}'s files cannot be queued")
            self._reserved += 1
        waited = time.perf_counter() - t0
        try:
            write = prepare()
        except BaseException:
            with self._cond:
                self._reserved -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._reserved -= 1
            self._queue.append(_Task(index, write, done, lock if lock is not None else nullcontext()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="runnerkit-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return waited

    def drain(self) -> None:
        """Wait until every write submitted so far has ended (written, failed or abandoned). A
        KeyboardInterrupt (main thread) interrupts the wait, not the writes."""
        # polled without taking the lock: a KeyboardInterrupt can land anywhere in this wait, and one landing
        # between a lock's acquire and its `with` block would leave it held, and the writer thread waiting on it
        while self._count():  # reads under the GIL; the writer thread changes it under the lock
            time.sleep(SIGNAL_CHECK_S)

    def abandon(self) -> list[int]:
        """Stop writing: the queued writes are dropped (their `done` gets `WriteAbandoned`, here), the
        one being written stops at its next `checkpoint` (its temporary files removed) unless it is
        past its last one. Later `submit`s raise. Returns the indices abandoned (or still finishing)."""
        with self._cond:
            self._abandoned = True
            dropped = list(self._queue)
            self._queue.clear()
            active = [self._active.index] if self._active is not None else []
            self._cond.notify_all()
        for task in dropped:
            self._call_done(task, WriteOutcome(task.index, error=WriteAbandoned(f"request {task.index}'s files "
                                                                                "were abandoned before writing")))
        return active + [t.index for t in dropped]

    def close(self) -> None:
        """Drain, then end the thread (a later `submit` raises)."""
        self.drain()
        self._closed = True  # no lock (as `drain`): the writer thread's idle wait re-reads it every SIGNAL_CHECK_S
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            while thread.is_alive():  # timed, as every wait of the main thread here: a Ctrl-C reaches it at once
                thread.join(SIGNAL_CHECK_S)

    def _checkpoint(self) -> None:
        if self._abandoned:
            raise WriteAbandoned("the files were abandoned (interrupted twice); their temporary files are removed")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:  # timed: a wakeup lost to an interrupt cannot hang it
                    self._cond.wait(SIGNAL_CHECK_S)
                if not self._queue:
                    return
                task = self._active = self._queue.popleft()
            outcome = WriteOutcome(task.index)
            t0 = time.perf_counter()
            try:
                with task.lock:
                    self._checkpoint()  # abandoned while it waited for the lock
                    outcome.paths = list(task.write(self._checkpoint))
            except BaseException as exc:  # noqa: BLE001 - the request's failure, reported through `done`
                outcome.error = exc
            outcome.seconds = time.perf_counter() - t0
            self._call_done(task, outcome)
            with self._cond:
                self._active = None
                self._cond.notify_all()

    @staticmethod
    def _call_done(task: _Task, outcome: WriteOutcome) -> None:
        try:
            task.done(outcome)
        except Exception as exc:  # noqa: BLE001 - a broken callback must not stop the writer
            logger.opt(exception=exc).error("request {}: reporting its files failed: {}: {}", task.index,
                                            type(exc).__name__, exc)
