"""Phase, stage and per-step timers, and the `--profile_json` report (ARCHITECTURE §5).

Stages are timed on the host after a device synchronize at the stage's end (a handful per
request). Denoising steps are timed with CUDA events recorded around each step and read once at
the end of the request, so the step loop never synchronizes; on the CPU, wall clocks are used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runnerkit.memory import synchronize

STAGES = ("text_encoder", "image_encoder", "vae_encoder", "transformer", "vae_decoder", "save")


class StepTimer:
    """Times denoising steps without synchronizing inside the loop."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: list[tuple[Any, Any]] = []
        self._wall: list[float] = []

    @contextmanager
    def step(self) -> Iterator[None]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._wall.append(time.perf_counter() - t0)

    def seconds(self) -> list[float]:
        """Per-step seconds, in order (synchronizes once on CUDA)."""
        if self._events:
            self._events[-1][1].synchronize()
            return [s.elapsed_time(e) / 1000.0 for s, e in self._events]
        return list(self._wall)


@dataclass
class RequestProfile:
    """What one request measured; serialised as one entry of the report's `requests`."""

    index: int
    shape: list[int]
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    steps: list[float] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    error: str | None = None


class Profiler:
    """Collects the warmup section and one `RequestProfile` per request."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, float] = {}
        self.warmup: dict[str, Any] | None = None
        self.requests: list[RequestProfile] = []
        self.current: RequestProfile | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a request stage (adds up if entered twice, e.g. two text encodes)."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; allowed: {STAGES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            if self.current is not None:
                self.current.stages[name] += time.perf_counter() - t0

    def report(self) -> dict[str, Any]:
        return {
            "phases": self.phases,
            "warmup": self.warmup,
            "requests": [r.__dict__ for r in self.requests],
        }

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.report(), indent=2))
