"""Instrumented copy engines for CPU tests (injected into BlockStreamer)."""

from __future__ import annotations

import threading

import torch

from runnerkit.offload import SyncCopyEngine


class RecordingEngine(SyncCopyEngine):
    """Synchronous copies; logs ("h2d", slot, label), ("wait", slot), ("done", slot), ("host_wait", slot)."""

    def __init__(self, num_slots: int, log: list[tuple]) -> None:
        super().__init__(num_slots)
        self.log = log

    def h2d(self, slot: int, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        self.log.append(("h2d", slot, label))
        super().h2d(slot, dst, src, label)

    def wait_copy(self, slot: int) -> None:
        self.log.append(("wait", slot))

    def mark_compute_done(self, slot: int) -> None:
        self.log.append(("done", slot))

    def wait_copy_host(self, slot: int) -> None:
        self.log.append(("host_wait", slot))


class DeferredEngine(SyncCopyEngine):
    """Emulates an asynchronous copy stream on the CPU.

    A copy is queued at `h2d` and lands (in issue order, like one CUDA stream) only when the
    compute waits for its slot, the host waits for it, or at `reset`. A streamer that forgot
    a wait computes with stale bytes, so parity tests catch it. Thread-safe: the disk source's
    read-ahead thread waits for copies (`wait_copy_host`) while the main thread issues and waits.
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.queue: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()

    def h2d(self, slot: int, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        with self._lock:
            self.queue.append((slot, dst, src))

    def _land_through(self, slot: int) -> None:
        with self._lock:
            last = max((i for i, (s, _, _) in enumerate(self.queue) if s == slot), default=-1)
            for s, dst, src in self.queue[:last + 1]:
                super().h2d(s, dst, src)
            del self.queue[:last + 1]

    def wait_copy(self, slot: int) -> None:
        self._land_through(slot)

    def wait_copy_host(self, slot: int) -> None:
        self._land_through(slot)

    def in_flight(self) -> int:
        with self._lock:
            return len({s for s, _, _ in self.queue})

    def reset(self) -> None:
        with self._lock:
            for s, dst, src in self.queue:
                super().h2d(s, dst, src)
            self.queue.clear()
