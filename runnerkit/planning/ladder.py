"""The pieces of the memory planner (planning/planner.py, docs/memory_plan.md): the ladder of concrete
offload configs, the user's explicit keys applied to it, and one candidate judged against the
device and host limits. Pure functions of estimates; imported by plan.py and plan_report.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from runnerkit.config import PREAD_KEYS, OffloadConfig, RunnerConfig
from runnerkit.memory import MemoryLimit
from runnerkit.planning.fit import GIB, HostEstimate, MemoryEstimate, PeakEstimate, host_bytes_of, peak_of
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.compute import ComputeModel

__all__ = ["MATCH_KEYS", "Candidate", "EstimateFn", "Evaluation", "MemoryPlan", "PassesFn", "SupportedFn",
           "candidate_name", "constrain", "evaluate", "explicit_keys", "ladder", "measure", "verdict"]

#: Explicit keys a ladder candidate must match where it sets them (else the candidate is left out).
MATCH_KEYS = ("storage", "lazy_load", "weight_dtype")

#: (estimate of a shape under a concrete offload config) -> MemoryEstimate; raises what estimate_memory raises.
EstimateFn = Callable[[OffloadConfig, Shape], MemoryEstimate]
#: A concrete offload config -> None if the run supports it, else the reason (compile, warmup).
SupportedFn = Callable[[OffloadConfig], "str | None"]
#: A concrete offload config -> passes through the streamed transformer blocks per denoising step under it
#: (the family's `denoise_passes_per_step`: with CFG 1 in mode block where both branches share a pass, else 2).
PassesFn = Callable[[OffloadConfig], int]


@dataclass(frozen=True)
class Candidate:
    """One rung of the ladder: the offload keys it sets (mode first)."""

    keys: dict[str, Any]


def ladder(streamable: Sequence[str], default_streams: Sequence[str], allow_fp8: bool) -> list[Candidate]:
    """The candidates, fastest first (module docstring).

    Args:
        streamable: every module that can stream its blocks/layers (estimate order).
        default_streams: those that stream when `offload.stream_modules` is null (the transformers).
        allow_fp8: include the fp8_e4m3 storage rung.
    """
    variants: list[list[str] | None] = [None]
    if streamable and set(streamable) != set(default_streams):
        variants.append(list(streamable))
    rungs: list[dict[str, Any]] = [{"mode": "none"}, {"mode": "model"}]
    streaming = [{"storage": "cpu", "weight_dtype": "same"}]
    if allow_fp8:
        streaming.append({"storage": "cpu", "weight_dtype": "fp8_e4m3"})
    streaming += [{"storage": "disk", "reader": "pread", "weight_dtype": "same", "lazy_load": False},
                  {"storage": "disk", "reader": "pread", "weight_dtype": "same", "lazy_load": True}]
    for keys in streaming:
        for names in variants:
            rung = {"mode": "block", **keys}
            if keys["storage"] == "cpu":
                rung["lazy_load"] = False
            rung["stream_modules"] = names
            rungs.append(rung)
    return [Candidate(r) for r in rungs]


def explicit_keys(requested: OffloadConfig) -> dict[str, Any]:
    """The offload keys the user set (besides `mode`), which constrain the plan; weight_dtype 'auto' is
    a permission, not a constraint."""
    keys = {k: getattr(requested, k) for k in sorted(requested.model_fields_set) if k != "mode"}
    if keys.get("weight_dtype") == "auto":
        del keys["weight_dtype"]
    return keys


def constrain(candidate: Candidate, explicit: dict[str, Any]) -> tuple[OffloadConfig | None, str]:
    """The concrete config of `candidate` under the user's explicit keys, or (None, why it is left out)."""
    data = dict(candidate.keys)
    for key, value in explicit.items():
        if key in MATCH_KEYS and key in data and data[key] != value:
            return None, f"`offload.{key}`={value!r} is set in the config (this candidate uses {data[key]!r})"
        if key not in PREAD_KEYS:
            data[key] = value
    if data.get("storage") == "disk" and data.get("reader") == "pread":  # how the pread rungs read; the others
        data.update({k: v for k, v in explicit.items() if k in PREAD_KEYS})  # have no page cache or read threads
    try:
        return OffloadConfig.model_validate(data), ""
    except ValidationError as exc:
        return None, "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())


def candidate_name(off: OffloadConfig) -> str:
    """A short name of a concrete offload config, e.g. 'block streaming from pinned host memory, fp8_e4m3'."""
    kept = [f"resident {', '.join(off.resident_modules)}"] if off.resident_modules else []
    if off.mode == "none":
        return "resident (mode none)"
    if off.mode == "model":
        return "model offload (mode model" + "".join(f"; {k}" for k in kept) + ")"
    source = ("disk" if off.storage == "disk" else "pinned host memory" if off.pin_memory else "host memory")
    extras = [f"weight_dtype {off.weight_dtype}"] if off.weight_dtype != "same" else []
    extras += [f"reader {off.reader}"] if off.storage == "disk" else []
    extras += ["lazy_load"] if off.lazy_load else []
    extras.append("streams " + (", ".join(off.stream_modules) if off.stream_modules else "the transformers"))
    extras += [f"{off.resident_blocks} units resident"] if off.resident_blocks else []
    extras += kept
    return f"{off.mode} streaming from {source} ({'; '.join(extras)})"


@dataclass
class Evaluation:
    """One candidate judged: its config, the worst peak and host bytes over the shapes, and the verdict.

    `reason` is empty for the chosen candidate; otherwise why it was not taken. `passes_per_step`: passes
    through the streamed transformer blocks per denoising step under this candidate's config (0: not evaluated).
    """

    name: str
    offload: OffloadConfig | None
    reason: str = ""
    peak: PeakEstimate | None = None
    peak_shape: Shape | None = None
    host: HostEstimate | None = None
    estimate: MemoryEstimate | None = None  # at `peak_shape`
    device_missing: int = 0
    host_missing: int = 0
    pinned_missing: int = 0
    passes_per_step: int = 0
    copy_seconds: float | None = None  # estimated H2D seconds per request (planning/report.py), once evaluated
    request_seconds: float | None = None  # estimated request seconds, compute included (None: no compute estimate)

    @property
    def rank(self) -> tuple[float, float]:
        """What the planner minimizes: (estimated request seconds, else copy seconds; copy seconds)."""
        copy = self.copy_seconds or 0.0
        return (self.request_seconds if self.request_seconds is not None else copy, copy)

    @property
    def fits(self) -> bool:
        return self.offload is not None and self.peak is not None and not (self.device_missing or self.host_missing
                                                                          or self.pinned_missing)


@dataclass
class MemoryPlan:
    """The outcome of `plan_offload`: the chosen concrete config and every candidate looked at."""

    chosen: Evaluation
    rejected: list[Evaluation]
    shapes: tuple[Shape, ...]
    device: torch.device
    device_limit: MemoryLimit
    host_limit: MemoryLimit | None
    why: str
    skipped: list[Evaluation] = field(default_factory=list)  # CPU: candidates not evaluated
    steps_per_request: int = 1  # denoising steps of one request, all stages (the copy time's multiplier)
    compute: ComputeModel | None = None  # the time model's compute side (planning/compute.py); None: copies only
    compute_note: str = ""  # why there is no compute estimate

    @property
    def estimated_request_seconds(self) -> float | None:
        """The chosen plan's estimated request time (compute and copies), None without a compute estimate."""
        return self.chosen.request_seconds

    @property
    def offload(self) -> OffloadConfig:
        assert self.chosen.offload is not None, "a plan always holds a concrete config"
        return self.chosen.offload

    @property
    def passes_per_step(self) -> int:
        """Passes through the streamed blocks per denoising step under the chosen config."""
        return self.chosen.passes_per_step


def evaluate(name: str, config: RunnerConfig, shapes: Sequence[Shape], device: torch.device, estimate: EstimateFn,
             device_limit: MemoryLimit, host_limit: MemoryLimit | None, passes: PassesFn,
             pinned_limit: MemoryLimit | None = None) -> Evaluation:
    """Peak and host bytes of `config` over `shapes` (the worst of each) against the limits (`pinned_limit`: of
    the host bytes, the pinned ones; None: not checked apart), and the passes per denoising step under
    `config.offload` (`passes`)."""
    return verdict(measure(name, config, shapes, device, estimate, passes), device_limit, host_limit, pinned_limit)


def measure(name: str, config: RunnerConfig, shapes: Sequence[Shape], device: torch.device, estimate: EstimateFn,
            passes: PassesFn) -> Evaluation:
    """`evaluate`'s limit-independent part: the worst peak and host bytes of `config` over `shapes`, and the passes
    per step (no verdict yet: `verdict`). Pure in (config.offload, shapes): a plan over many limits may cache it."""
    ev = Evaluation(name, config.offload, passes_per_step=passes(config.offload))
    for shape in shapes:
        est = estimate(config.offload, shape)
        peak = peak_of(est, config, device)
        if ev.peak is None or peak.bytes > ev.peak.bytes:
            ev.peak, ev.peak_shape, ev.estimate = peak, shape, est
        host = host_bytes_of(est, config, device)
        if ev.host is None or host.bytes > ev.host.bytes:
            ev.host = host
    assert ev.peak is not None and ev.host is not None, "plan at least one shape"
    return ev


def verdict(measured: Evaluation, device_limit: MemoryLimit, host_limit: MemoryLimit | None,
            pinned_limit: MemoryLimit | None = None) -> Evaluation:
    """A copy of a `measure`d candidate judged against the limits: the bytes missing and the reason."""
    ev = dataclasses.replace(measured)
    assert ev.peak is not None and ev.host is not None, "a measured candidate"
    ev.device_missing = max(0, ev.peak.bytes - device_limit.bytes)
    ev.host_missing = max(0, ev.host.bytes - host_limit.bytes) if host_limit is not None else 0
    ev.pinned_missing = max(0, ev.host.pinned_bytes - pinned_limit.bytes) if pinned_limit is not None else 0
    problems = []
    if ev.device_missing:
        problems.append(f"device: peak {ev.peak.bytes / GIB:.2f} GiB > limit {device_limit.bytes / GIB:.2f} GiB "
                        f"(stage {ev.peak.stage}, shape {_shape(ev.peak_shape)})")
    if ev.host_missing and host_limit is not None:
        problems.append(f"host: {ev.host.bytes / GIB:.2f} GiB > limit {host_limit.bytes / GIB:.2f} GiB")
    if ev.pinned_missing and pinned_limit is not None:
        problems.append(f"pinned host memory: {ev.host.pinned_bytes / GIB:.2f} GiB > limit "
                        f"{pinned_limit.bytes / GIB:.2f} GiB ({pinned_limit.source})")
    ev.reason = "; ".join(problems)
    return ev


def _shape(shape: Shape | None) -> str:
    return "x".join(str(v) for v in shape) if shape else "?"
