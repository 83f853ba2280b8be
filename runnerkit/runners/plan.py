"""`offload.mode: auto`: the memory plan, chosen before anything loads (docs/memory_plan.md).

The planner walks a ladder of concrete offload configs, fastest first, and takes the first one
whose estimate fits every shape the run will serve, on the device and on the host:

    1. resident                               mode none
    2. model offload                          mode model
    3. block streaming from host memory       mode block, storage cpu          (a) transformers, (b) + text encoders
    4. the same in fp8_e4m3 (lossy)           + weight_dtype fp8_e4m3          (only with weight_dtype auto)
    5. block streaming from disk              storage disk, reader pread       (a), (b)
    6. the same, built per request            + lazy_load                      (a), (b)

    fits = max over shapes of peak_of(estimate, candidate).bytes <= device limit
           and max over shapes of host_bytes_of(estimate, candidate).bytes <= host limit

(b) lists every module the estimate says can stream (`offload.stream_modules`); it is left out
when that is only the transformers. Offload keys the user set explicitly constrain the ladder
(`constrain`): a key the ladder sets (storage, lazy_load, weight_dtype) must match; reader and
stream_modules replace the ladder's; the rest are added; a candidate the result is not a valid
concrete config for (e.g. `gpu_slots` with mode none) is left out, with the validator's reason.

On the CPU the device is the host and offload cannot lower the peak: the first allowed candidate
(resident, unless explicit keys exclude it) is taken if it fits. Nothing fits: `MemoryFitError`
(exit 2) naming the GiB missing for the closest candidate and what would fit (`refusal`).

Pure functions of estimates: the runner side (shapes, limits, the family's estimate per candidate)
is `RequestChecksMixin.plan_memory` (runners/requests.py); the report is runners/plan_report.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.memory import MemoryLimit
from runnerkit.runners.fit import GIB, HostEstimate, MemoryEstimate, MemoryFitError, PeakEstimate, host_bytes_of, peak_of
from runnerkit.runners.pipeline import Shape

__all__ = ["Candidate", "Evaluation", "MemoryPlan", "candidate_name", "constrain", "explicit_keys", "ladder",
           "plan_offload"]

#: Explicit keys a ladder candidate must match where it sets them (else the candidate is left out).
MATCH_KEYS = ("storage", "lazy_load", "weight_dtype")

#: (estimate of a shape under a concrete offload config) -> MemoryEstimate; raises what estimate_memory raises.
EstimateFn = Callable[[OffloadConfig, Shape], MemoryEstimate]
#: A concrete offload config -> None if the run supports it, else the reason (compile, warmup).
SupportedFn = Callable[[OffloadConfig], "str | None"]


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
        data[key] = value
    try:
        return OffloadConfig.model_validate(data), ""
    except ValidationError as exc:
        return None, "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())


def candidate_name(off: OffloadConfig) -> str:
    """A short name of a concrete offload config, e.g. 'block streaming from pinned host memory, fp8_e4m3'."""
    if off.mode == "none":
        return "resident (mode none)"
    if off.mode == "model":
        return "model offload (mode model)"
    source = ("disk" if off.storage == "disk" else "pinned host memory" if off.pin_memory else "host memory")
    extras = [f"weight_dtype {off.weight_dtype}"] if off.weight_dtype != "same" else []
    extras += [f"reader {off.reader}"] if off.storage == "disk" else []
    extras += ["lazy_load"] if off.lazy_load else []
    extras.append("streams " + (", ".join(off.stream_modules) if off.stream_modules else "the transformers"))
    return f"{off.mode} streaming from {source} ({'; '.join(extras)})"


@dataclass
class Evaluation:
    """One candidate judged: its config, the worst peak and host bytes over the shapes, and the verdict.

    `reason` is empty for the chosen candidate; otherwise why it was not taken.
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

    @property
    def fits(self) -> bool:
        return self.offload is not None and self.peak is not None and not (self.device_missing or self.host_missing)


@dataclass
class MemoryPlan:
    """The outcome of `plan_offload`: the chosen concrete config and every candidate looked at."""

    chosen: Evaluation
    rejected: list[Evaluation]
    shapes: tuple[Shape, ...]
    device: torch.device
    device_limit: MemoryLimit
    host_limit: MemoryLimit | None
    passes_per_step: int
    why: str
    skipped: list[Evaluation] = field(default_factory=list)  # CPU: candidates not evaluated

    @property
    def offload(self) -> OffloadConfig:
        assert self.chosen.offload is not None, "a plan always holds a concrete config"
        return self.chosen.offload


def evaluate(name: str, config: RunnerConfig, shapes: Sequence[Shape], device: torch.device, estimate: EstimateFn,
             device_limit: MemoryLimit, host_limit: MemoryLimit | None) -> Evaluation:
    """Peak and host bytes of `config` over `shapes` (the worst of each) against the limits."""
    ev = Evaluation(name, config.offload)
    for shape in shapes:
        est = estimate(config.offload, shape)
        peak = peak_of(est, config, device)
        if ev.peak is None or peak.bytes > ev.peak.bytes:
            ev.peak, ev.peak_shape, ev.estimate = peak, shape, est
        host = host_bytes_of(est, config, device)
        if ev.host is None or host.bytes > ev.host.bytes:
            ev.host = host
    assert ev.peak is not None and ev.host is not None, "plan at least one shape"
    ev.device_missing = max(0, ev.peak.bytes - device_limit.bytes)
    ev.host_missing = max(0, ev.host.bytes - host_limit.bytes) if host_limit is not None else 0
    problems = []
    if ev.device_missing:
        problems.append(f"device: peak {ev.peak.bytes / GIB:.2f} GiB > limit {device_limit.bytes / GIB:.2f} GiB "
                        f"(stage {ev.peak.stage}, shape {_shape(ev.peak_shape)})")
    if ev.host_missing and host_limit is not None:
        problems.append(f"host: {ev.host.bytes / GIB:.2f} GiB > limit {host_limit.bytes / GIB:.2f} GiB")
    ev.reason = "; ".join(problems)
    return ev


def _shape(shape: Shape | None) -> str:
    return "x".join(str(v) for v in shape) if shape else "?"


def plan_offload(config: RunnerConfig, shapes: Sequence[Shape], device: torch.device, estimate: EstimateFn,
                 device_limit: MemoryLimit, host_limit: MemoryLimit | None, passes_per_step: int,
                 supported: SupportedFn = lambda off: None, factors: tuple[int, int] = (16, 4)) -> MemoryPlan:
    """Resolve `config.offload` (mode auto) into the fastest concrete config that fits (module docstring).

    Args:
        config: the run config, `offload.mode` 'auto' (its other offload keys constrain the plan).
        shapes: (height, width, frames) of every request shape the run will serve (at least one).
        device: the device the memory is planned for (the run's compute device).
        estimate: the family's estimate of a shape under a concrete offload config.
        device_limit / host_limit: bytes available (host None: host memory unknown, not checked).
        passes_per_step: transformer forward passes per denoising step (2 with CFG, 1 without).
        supported: None if the run supports a concrete config, else why not (compile, warmup).
        factors: the family's (spatial, temporal) shape factors, for the smaller shapes the refusal names.

    Raises:
        MemoryFitError: no allowed candidate fits (the message: GiB missing, what would fit).
        ValueError: `config.offload.mode` is not 'auto', or no shape is given.
    """
    if config.offload.mode != "auto":
        raise ValueError(f"plan_offload resolves `offload.mode`='auto' only (got {config.offload.mode!r})")
    if not shapes:
        raise ValueError("plan_offload needs at least one request shape")
    shapes = tuple(dict.fromkeys(shapes))
    requested = config.offload
    explicit = explicit_keys(requested)
    streamable, default_streams = _streamable(estimate, shapes[0])
    allow_fp8 = requested.weight_dtype in ("auto", "fp8_e4m3")
    evaluations: list[Evaluation] = []
    seen: set[str] = set()
    for cand in ladder(streamable, default_streams, allow_fp8):
        off, why = constrain(cand, explicit)
        name = candidate_name(off) if off is not None else candidate_name(OffloadConfig.model_validate(cand.keys))
        if off is None:
            evaluations.append(Evaluation(name, None, f"excluded: {why}"))
            continue
        if off.model_dump_json() in seen:  # two rungs the explicit keys made equal: the faster one stands
            continue
        seen.add(off.model_dump_json())
        if off.mode == "block" and not streamable:
            evaluations.append(Evaluation(name, off, "excluded: no module of this family streams its blocks"))
            continue
        refused = supported(off)
        if refused:
            evaluations.append(Evaluation(name, off, f"excluded: {refused}"))
            continue
        if device.type == "cpu" and any(e.peak is not None for e in evaluations):
            evaluations.append(Evaluation(name, off, "not evaluated: on the CPU the first allowed candidate is taken"))
            continue
        ev = evaluate(name, config.model_copy(update={"offload": off}), shapes, device, estimate, device_limit,
                      host_limit)
        evaluations.append(ev)
        if ev.fits:
            break
    chosen = next((e for e in evaluations if e.fits), None)
    if chosen is None:
        from runnerkit.runners.plan_report import refusal  # the report module imports this one

        raise MemoryFitError(refusal(config, evaluations, shapes, device, estimate, device_limit, host_limit,
                                     streamable, default_streams, supported, factors))
    rejected = [e for e in evaluations if e is not chosen and "not evaluated" not in e.reason]
    why = ("the device is the CPU: weights live in host memory whatever the mode, so offload cannot lower the "
           "peak; the first allowed candidate is taken" if device.type == "cpu" else
           "the fastest candidate that fits" + (" (every faster one was rejected)" if rejected else ""))
    return MemoryPlan(chosen=chosen, rejected=rejected, shapes=shapes, device=device, device_limit=device_limit,
                      host_limit=host_limit, passes_per_step=passes_per_step, why=why,
                      skipped=[e for e in evaluations if "not evaluated" in e.reason])


def _streamable(estimate: EstimateFn, shape: Shape) -> tuple[list[str], list[str]]:
    """(modules that can stream, those that stream by default) from the estimate under plain block streaming."""
    modules = estimate(OffloadConfig(mode="block"), shape).modules
    can = [n for n, m in modules.items() if m.streams]
    return can, [n for n in can if modules[n].stream_default]
