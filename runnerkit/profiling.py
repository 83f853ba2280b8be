"""Phase, stage and per-step timers, and the `--profile_json` report (ARCHITECTURE §5).

Stages are timed on the host after a device synchronize at the stage's end (a handful per
request). Denoising steps are timed with CUDA events recorded around each step and read once at
the end of the request, so the step loop never synchronizes; on the CPU, wall clocks are used.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runnerkit.memory import synchronize

SCHEMA_VERSION = 2
"""Version of the report's layout (docs/profile.md). 2: `stage_seconds`/`step_seconds` (were
`stages`/`steps`), host memory on every device, no device-memory zeros on the CPU."""


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, recompilations) so far in this process, from torch._dynamo's counters."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - very old torch
        return 0, 0
    return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["recompiles"].values()))


def inductor_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX-graph cache so far in this process: a miss is a graph inductor
    lowered and generated code for; a hit was served by a cache (e.g. one `compile.cache_dir` loaded)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - very old torch
        return 0, 0
    return int(counters["inductor"].get("fxgraph_cache_hit", 0)), int(counters["inductor"].get("fxgraph_cache_miss", 0))


def compile_seconds() -> float:
    """Seconds torch's compiler has spent in this process so far (dynamo's per-frame compile times)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - very old torch
        return 0.0
    for key in ("_compile.compile_inner", "entire_frame_compile"):  # the name differs between torch versions
        if key in compilation_time_metrics:
            return float(sum(compilation_time_metrics[key]))
    return 0.0


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
    """[height, width, frames] of the request, pixels and frames: the shape it ran at (read after the encoders:
    a family may predict part of it, e.g. the frame count)."""
    stages: dict[str, float | None]
    """Seconds per profiling stage of the family's pipeline (`Pipeline.profile_stages`), in order; None for a
    stage that did not run for this request (`Profiler.skip_stage`: e.g. a stage that predicts the frame count when
    the request gives it)."""
    seconds: float = 0.0
    """Wall seconds of the whole request, `end_run` included, and its files: when the writer thread wrote
    them (`write.overlapped`), up to the moment they were written, beside later requests' compute."""
    steps: list[float] = field(default_factory=list)
    """Seconds of each denoising step, in order (CUDA events on the GPU, wall clock on the CPU)."""
    memory: dict[str, float | str] = field(default_factory=dict)
    """GiB at the request's end: device allocated/reserved/peak (CUDA only) and host RSS/peak."""
    audit: dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    error: str | None = None
    saved: bool = False
    """True once the request's outputs were written (an interrupt after that leaves them finished)."""
    write: dict[str, Any] = field(default_factory=dict)
    """How its files were written: `overlapped` (on the writer thread while later requests computed),
    `seconds` (writing them), `wait_seconds` (its `save` stage waiting for a free writer slot)."""
    started: float = field(default=0.0, repr=False)
    """`time.perf_counter()` when the request began (not reported)."""
    pending_write: Any = field(default=None, repr=False)
    """While its files are on the writer thread: the `runners.writes.PendingRequest` that reports the
    request once both its compute and its files ended (not reported)."""


class Profiler:
    """Collects the warmup section and one `RequestProfile` per request."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, float] = {}
        self.attention: dict[str, Any] | None = None  # the attention backend chosen at load
        self.compile_cache: dict[str, Any] | None = None  # compile.cache_dir: what was loaded and saved
        self.memory_plan: dict[str, Any] | None = None  # offload.mode auto: the plan (planning/report.py)
        self.warmup: dict[str, Any] | None = None
        self.requests: list[RequestProfile] = []
        self.current: RequestProfile | None = None
        self._timer: StepTimer | None = None

    def begin_request(self, index: int, stages: tuple[str, ...]) -> RequestProfile:
        """Start the profile of request `index` with the pipeline's profiling `stages`."""
        prof = RequestProfile(index=index, shape=[0, 0, 0], stages={s: 0.0 for s in stages})
        self.requests.append(prof)
        self.current, self._timer = prof, StepTimer(self.device)
        return prof

    def end_request(self) -> None:
        """Read the request's step timers (one synchronize on CUDA) and close its profile."""
        if self.current is not None and self._timer is not None:
            try:
                self.current.steps = self._timer.seconds()
            finally:
                self.current, self._timer = None, None

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one denoising step of the current request (no-op outside a request, e.g. warmup)."""
        if self._timer is None:
            yield
            return
        with self._timer.step():
            yield

    def skip_stage(self, name: str) -> None:
        """Record that stage `name` did not run for the current request (None in its profile, not 0.0 seconds);
        no-op outside a request (warmup).

        Raises:
            ValueError: `name` is not one of the pipeline's profiling stages.
        """
        if self.current is None:
            return
        if name not in self.current.stages:
            raise ValueError(f"unknown profiling stage {name!r}; this pipeline's stages: {list(self.current.stages)}")
        if not self.current.stages[name]:  # a stage that ran earlier in the request keeps its seconds
            self.current.stages[name] = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a request stage (adds up if entered twice, e.g. two text encodes). An exception leaving it is
        tagged with the stage (`runnerkit_stage`, the innermost; a note on its traceback), which the failure
        lines name (`cli_common.in_stage`).

        Raises:
            ValueError: inside a request, `name` is not one of the pipeline's profiling stages.
        """
        if self.current is not None and name not in self.current.stages:
            raise ValueError(f"unknown profiling stage {name!r}; this pipeline's stages: {list(self.current.stages)}")
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as exc:  # the innermost stage is the one named (cli_common.in_stage)
            if getattr(exc, "runnerkit_stage", None) is None:
                exc.runnerkit_stage = name  # type: ignore[attr-defined]
                exc.add_note(f"[runnerkit] raised in stage: {name}")
            raise
        finally:
            synchronize(self.device)
            if self.current is not None:
                self.current.stages[name] = (self.current.stages[name] or 0.0) + time.perf_counter() - t0

    def report(self) -> dict[str, Any]:
        """The `--profile_json` report; every key is described in docs/profile.md (schema version 2)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "device": str(self.device),
            "phases": self.phases,
            "attention": self.attention,
            "compile_cache": self.compile_cache,
            "memory_plan": self.memory_plan,
            "warmup": self.warmup,
            "requests": [{"index": r.index, "shape": r.shape, "seconds": r.seconds, "stage_seconds": r.stages,
                          "step_seconds": r.steps, "memory": r.memory, "audit": r.audit, "ok": r.ok,
                          "error": r.error, "saved": r.saved, "write": dict(r.write)}
                         for r in self.requests],
        }

    def write(self, path: str | Path) -> None:
        """Write the report to `path` atomically: a temporary file beside it, renamed into place (a
        failed or interrupted write leaves no truncated report and keeps an older one).

        Raises:
            OSError: the file could not be written (the temporary file is removed).
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.report(), indent=2))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
