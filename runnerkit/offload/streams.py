"""Copy engines: how a streamed unit's bytes get from host memory into its device slot.

Two engines share one small interface (`CopyEngine`), so the streamer never branches on the
device and tests can inject an instrumented fake:

- `CudaCopyEngine`: a dedicated copy stream and CUDA events both ways. A copy into slot s
  waits (on the GPU) for the "compute done" event of the slot's previous user; the compute
  stream waits (on the GPU) for the slot's "copy done" event. No host synchronize on the hot
  path; copies are `non_blocking=True` only from pinned memory.
- `SyncCopyEngine`: `dst.copy_(src)` on the compute stream, synchronous; every wait is a
  no-op. Used on the CPU and whenever the host memory is pageable (a non-blocking copy from
  pageable memory is never issued: ARCHITECTURE §4).

Design source: diffusers group offloading (`record_stream`-free prefetch on a side stream) and
LightX2V's weight-streaming manager (copy stream + events), restated here.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
from loguru import logger

from runnerkit.offload.pinned import copy_h2d


class CopyEngine(Protocol):
    """What the block streamer needs from a copy engine (slots are 0..num_slots-1)."""

    def h2d(self, slot: int, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        """Copy host `src` into device `dst` (slot `slot`), after the slot's last compute finished."""

    def wait_copy(self, slot: int) -> None:
        """Make the compute stream wait for the slot's last copy (no host synchronize)."""

    def mark_compute_done(self, slot: int) -> None:
        """Record on the compute stream that the slot's current user finished computing."""

    def wait_copy_host(self, slot: int) -> None:
        """Block the host until the slot's last copy has read its source (staging reuse)."""

    def in_flight(self) -> int:
        """Number of slots whose last copy has not completed yet."""

    def reset(self) -> None:
        """Wait for every copy and every marked compute, then forget all events."""

    def stats(self) -> dict[str, float]:
        """{"copies", "bytes", "seconds", "gb_per_s"} of H2D copies since construction."""


def _summary(copies: int, nbytes: int, seconds: float) -> dict[str, float]:
    return {"copies": float(copies), "bytes": float(nbytes), "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0}


class SyncCopyEngine:
    """Synchronous copies on the compute stream; all waits are no-ops (CPU or pageable host memory).

    Args:
        num_slots: number of device slots (for argument checks only).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._copies = 0
        self._bytes = 0
        self._seconds = 0.0

    def h2d(self, slot: int, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        """`dst.copy_(src)` with non_blocking=False; wall time counted (the copy is synchronous)."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        start = time.perf_counter()
        dst.copy_(src, non_blocking=False)
        self._seconds += time.perf_counter() - start
        self._copies += 1
        self._bytes += src.numel() * src.element_size()

    def wait_copy(self, slot: int) -> None:
        """No-op: the copy already completed."""

    def mark_compute_done(self, slot: int) -> None:
        """No-op: computation is ordered with the synchronous copies."""

    def wait_copy_host(self, slot: int) -> None:
        """No-op: a synchronous copy has read its source before returning."""

    def in_flight(self) -> int:
        """Always 0."""
        return 0

    def reset(self) -> None:
        """Nothing to wait for or forget."""

    def stats(self) -> dict[str, float]:
        """Copies, bytes, seconds (wall) and GB/s since construction."""
        return _summary(self._copies, self._bytes, self._seconds)


class CudaCopyEngine:
    """H2D copies on a dedicated CUDA stream, ordered with compute by events both ways.

    Per slot: `copy_done[s]` (recorded on the copy stream after each copy into s) and
    `compute_done[s]` (recorded on the compute stream by `mark_compute_done`). Events are
    created once and re-recorded; a stream waits for the latest record at the time of the
    wait call, which is exactly the copy or compute the streamer means.

    Args:
        device: the CUDA device of the slots.
        num_slots: number of device slots.
        timing: time each copy with a pair of timing events (read in `stats()`/`reset()`).

    Raises:
        ValueError: `device` is not a CUDA device.
    """

    def __init__(self, device: torch.device | str, num_slots: int, timing: bool = True) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"`device` must be a CUDA device for CudaCopyEngine, got {self.device}")
        self.num_slots = num_slots
        self.stream = torch.cuda.Stream(device=self.device)
        self._copy_done = [torch.cuda.Event() for _ in range(num_slots)]
        self._compute_done = [torch.cuda.Event() for _ in range(num_slots)]
        self._copy_recorded = [False] * num_slots
        self._compute_recorded = [False] * num_slots
        self._timing = timing
        self._pending_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._copies = 0
        self._bytes = 0
        self._seconds = 0.0

    def _compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def h2d(self, slot: int, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        """Issue `dst.copy_(src)` on the copy stream after the slot's last compute; record copy done.

        `non_blocking=True` only when `src` is pinned; a pageable `src` makes this call block
        the host until the copy stream drained (correct, slow: the factory avoids it).
        """
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        if self._compute_recorded[slot]:
            self.stream.wait_event(self._compute_done[slot])
        pinned = src.is_pinned()
        with torch.cuda.stream(self.stream):
            if self._timing:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            copy_h2d(dst, src, pinned)  # split at registered-chunk boundaries
            if self._timing:
                end.record(self.stream)
                self._pending_timings.append((start, end))
            self._copy_done[slot].record(self.stream)
        self._copy_recorded[slot] = True
        self._copies += 1
        self._bytes += src.numel() * src.element_size()
        if len(self._pending_timings) > 512:
            self._fold_timings(block=False)

    def wait_copy(self, slot: int) -> None:
        """The compute stream waits (on the GPU) for the slot's last copy."""
        if self._copy_recorded[slot]:
            self._compute_stream().wait_event(self._copy_done[slot])

    def mark_compute_done(self, slot: int) -> None:
        """Record `compute_done[slot]` on the compute stream."""
        self._compute_done[slot].record(self._compute_stream())
        self._compute_recorded[slot] = True

    def wait_copy_host(self, slot: int) -> None:
        """Host waits for the slot's last copy only (an event synchronize, not a device sync)."""
        if self._copy_recorded[slot]:
            self._copy_done[slot].synchronize()

    def in_flight(self) -> int:
        """Slots whose last copy is still running (non-blocking event queries)."""
        return sum(1 for s in range(self.num_slots) if self._copy_recorded[s] and not self._copy_done[s].query())

    def reset(self) -> None:
        """Wait for the copy stream and each slot's last marked compute, then forget all events."""
        self.stream.synchronize()
        for s in range(self.num_slots):
            if self._compute_recorded[s]:
                self._compute_done[s].synchronize()
        self._copy_recorded = [False] * self.num_slots
        self._compute_recorded = [False] * self.num_slots
        self._fold_timings(block=True)

    def _fold_timings(self, block: bool) -> None:
        keep = []
        for start, end in self._pending_timings:
            if block:
                end.synchronize()
            if end.query():
                self._seconds += start.elapsed_time(end) / 1e3
            else:
                keep.append((start, end))
        self._pending_timings = keep

    def stats(self) -> dict[str, float]:
        """Copies, bytes, seconds (sum of per-copy GPU times) and GB/s; waits for pending timings."""
        self._fold_timings(block=True)
        return _summary(self._copies, self._bytes, self._seconds)


def make_copy_engine(device: torch.device | str, num_slots: int, source_pinned: bool) -> CopyEngine:
    """CudaCopyEngine for a CUDA device with a pinned host source, SyncCopyEngine otherwise."""
    device = torch.device(device)
    if device.type == "cuda" and source_pinned:
        engine: CopyEngine = CudaCopyEngine(device, num_slots)
    else:
        engine = SyncCopyEngine(num_slots)
        if device.type == "cuda":
            logger.info("host memory is pageable: H2D copies are synchronous on the compute stream")
    return engine
