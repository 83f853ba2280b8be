"""Recording stand-ins for CUDA streams and events, so the real `CudaCopyEngine` runs on the CPU.

`FakeCuda.install` replaces `torch.cuda.Stream`, `Event`, `stream` (the context manager) and
`current_stream`, and wraps `torch.Tensor.copy_` so a copy issued inside a side-stream context
is recorded as a copy on that stream (the bytes are still copied, at once, on the CPU).

Two records come out:
- `calls`: every stream/event call in host order, e.g. ("wait", "copy", "compute_done[0]"),
  ("record", "compute", "compute_done[0]"), ("copy", "copy", "slot0"), ("compute", "compute", "unit 3").
- `ops`: the copies and computes with a vector clock each, so that `happens_before(a, b)` says
  whether the GPU would be forced to finish `a` before starting `b`: work on one stream runs in
  order; `stream.wait_event(e)` orders the stream's later work after everything that preceded the
  latest `e.record(...)` at the time of the wait (CUDA semantics; a never-recorded event is no wait);
  a host synchronize (`event.synchronize()`, `stream.synchronize()`) orders all work issued after
  it after what it waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

TIMING = "timing"
"""Name of every event created with `enable_timing=True` (the engine's per-copy timers)."""


@dataclass(frozen=True)
class Op:
    """One copy or compute as the GPU would run it.

    Attributes:
        kind: "copy" or "compute".
        stream: stream name.
        index: position on its stream (1-based).
        label: what it is (the test's name for the copy's destination, or the computing unit).
        clock: stream name -> number of that stream's ops ordered before this op (itself included).
    """

    kind: str
    stream: str
    index: int
    label: str
    clock: dict[str, int]


def happens_before(a: Op, b: Op) -> bool:
    """Whether the GPU must finish `a` before it starts `b`."""
    return b.clock.get(a.stream, 0) >= a.index


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda = cuda
        self.name = name
        self.clock: dict[str, int] = {name: 0}

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.calls.append(("wait", self.name, event.name))
        for stream, n in (event.clock or {}).items():
            self.clock[stream] = max(self.clock.get(stream, 0), n)

    def synchronize(self) -> None:
        self.cuda.calls.append(("stream_sync", self.name))
        self.cuda.host_waited(self.clock)


class FakeEvent:
    def __init__(self, cuda: FakeCuda, enable_timing: bool = False, **_: Any) -> None:
        self.cuda = cuda
        self.name = TIMING if enable_timing else f"event{len(cuda.events)}"
        self.clock: dict[str, int] | None = None  # the recording stream's clock at the latest record
        cuda.events.append(self)

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current
        self.clock = dict(stream.clock)
        self.cuda.calls.append(("record", stream.name, self.name))

    def synchronize(self) -> None:
        self.cuda.calls.append(("host_sync", self.name))
        self.cuda.host_waited(self.clock or {})

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0  # milliseconds


class FakeCuda:
    """The fake CUDA runtime: one compute stream (current by default) plus the streams created."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.ops: list[Op] = []
        self.events: list[FakeEvent] = []
        self.compute = FakeStream(self, "compute")
        self._stack = [self.compute]
        self._streams = 0
        self.host_clock: dict[str, int] = {}  # work the host has waited for
        self.copy_label: Callable[[torch.Tensor, torch.Tensor], str] = lambda dst, src: "?"

    @property
    def current(self) -> FakeStream:
        return self._stack[-1]

    def new_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        self._streams += 1
        return FakeStream(self, "copy" if self._streams == 1 else f"side{self._streams}")

    @contextmanager
    def stream_context(self, stream: FakeStream | None) -> Iterator[None]:
        self._stack.append(stream or self.current)
        try:
            yield
        finally:
            self._stack.pop()

    def host_waited(self, clock: dict[str, int]) -> None:
        for stream, n in clock.items():
            self.host_clock[stream] = max(self.host_clock.get(stream, 0), n)

    def launch(self, kind: str, label: str) -> Op:
        """Issue one op on the current stream (kernels of a unit: kind "compute")."""
        stream = self.current
        for name, n in self.host_clock.items():  # issued after the host waited for that work
            stream.clock[name] = max(stream.clock.get(name, 0), n)
        stream.clock[stream.name] += 1
        op = Op(kind, stream.name, stream.clock[stream.name], label, dict(stream.clock))
        self.ops.append(op)
        self.calls.append((kind, stream.name, label))
        return op

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "Stream", self.new_stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(self, **kw))
        monkeypatch.setattr(torch.cuda, "stream", self.stream_context)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        real_copy = torch.Tensor.copy_

        def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            if self.current is not self.compute:  # an H2D copy on a side stream
                self.launch("copy", self.copy_label(dst, src))
            return real_copy(dst, src, non_blocking=non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)

    def name_engine_events(self, engine: Any) -> None:
        """Name a `CudaCopyEngine`'s per-slot events copy_done[s] / compute_done[s]."""
        for s, (copy, compute) in enumerate(zip(engine._copy_done, engine._compute_done)):
            copy.name, compute.name = f"copy_done[{s}]", f"compute_done[{s}]"

    def protocol(self) -> list[tuple[str, ...]]:
        """`calls` without the timing events' records and waits."""
        return [c for c in self.calls if c[-1] != TIMING]


def check_slot_protocol(ops: list[Op], slot_of: Callable[[str], str], unit_of: Callable[[str], str]) -> int:
    """Assert, for every compute, that its slot holds its unit's bytes and that the GPU is forced to
    (1) finish that copy before the compute starts, (2) finish the compute before the next copy into
    the slot starts. `slot_of` / `unit_of` read an op's label. Returns the number of computes checked."""
    computes = 0
    for i, op in enumerate(ops):
        if op.kind != "compute":
            continue
        computes += 1
        slot = slot_of(op.label)
        before = [c for c in ops[:i] if c.kind == "copy" and slot_of(c.label) == slot]
        assert before, f"{op.label}: nothing was copied into {slot}"
        assert unit_of(before[-1].label) == unit_of(op.label), \
            f"{op.label} computes with the bytes of {before[-1].label}"
        assert happens_before(before[-1], op), f"{op.label} does not wait for its copy {before[-1].label}"
        after = [c for c in ops[i + 1:] if c.kind == "copy" and slot_of(c.label) == slot]
        if after:
            assert happens_before(op, after[0]), f"copy {after[0].label} may overwrite {slot} while {op.label} computes"
    return computes
