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
is `RequestChecksMixin.plan_memory` (runners/requests.py); the ladder and the judging of one
candidate are runners/plan_ladder.py; the log, the report and the refusal runners/plan_report.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.memory import MemoryLimit
from runnerkit.runners.fit import MemoryFitError
from runnerkit.runners.pipeline import Shape
from runnerkit.runners.plan_ladder import (EstimateFn, Evaluation, MemoryPlan, PassesFn, SupportedFn, candidate_name,
                                           constrain, evaluate, explicit_keys, ladder)
from runnerkit.runners.plan_report import refusal

__all__ = ["MemoryPlan", "plan_offload"]


def plan_offload(config: RunnerConfig, shapes: Sequence[Shape], device: torch.device, estimate: EstimateFn,
                 device_limit: MemoryLimit, host_limit: MemoryLimit | None, passes_per_step: PassesFn,
                 supported: SupportedFn = lambda off: None, factors: tuple[int, int] = (16, 4)) -> MemoryPlan:
    """Resolve `config.offload` (mode auto) into the fastest concrete config that fits (module docstring).

    Args:
        config: the run config, `offload.mode` 'auto' (its other offload keys constrain the plan).
        shapes: (height, width, frames) of every request shape the run will serve (at least one).
        device: the device the memory is planned for (the run's compute device).
        estimate: the family's estimate of a shape under a concrete offload config.
        device_limit / host_limit: bytes available (host None: host memory unknown, not checked).
        passes_per_step: passes through the streamed blocks per denoising step under a candidate's concrete
            offload config (the runner's `denoise_passes_per_step`), asked per evaluated candidate: its copy
            volume in the report and the log.
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
        cannot = [m for m in off.stream_modules or () if m not in streamable]
        if off.mode == "block" and cannot:
            evaluations.append(Evaluation(name, off, f"excluded: `offload.stream_modules` names {cannot}, which "
                                                     f"cannot stream (modules that can: {streamable})"))
            continue
        refused = supported(off)
        if refused:
            evaluations.append(Evaluation(name, off, f"excluded: {refused}"))
            continue
        if device.type == "cpu" and any(e.peak is not None for e in evaluations):
            evaluations.append(Evaluation(name, off, "not evaluated: on the CPU the first allowed candidate is taken"))
            continue
        ev = evaluate(name, config.model_copy(update={"offload": off}), shapes, device, estimate, device_limit,
                      host_limit, passes_per_step)
        evaluations.append(ev)
        if ev.fits:
            break
    chosen = next((e for e in evaluations if e.fits), None)
    if chosen is None:
        raise MemoryFitError(refusal(config, evaluations, shapes, device, estimate, device_limit, host_limit,
                                     streamable, default_streams, supported, passes_per_step, factors))
    rejected = [e for e in evaluations if e is not chosen and "not evaluated" not in e.reason]
    why = ("the device is the CPU: weights live in host memory whatever the mode, so offload cannot lower the "
           "peak; the first allowed candidate is taken" if device.type == "cpu" else
           "the fastest candidate that fits" + (" (every faster one was rejected)" if rejected else ""))
    return MemoryPlan(chosen=chosen, rejected=rejected, shapes=shapes, device=device, device_limit=device_limit,
                      host_limit=host_limit, why=why,
                      skipped=[e for e in evaluations if "not evaluated" in e.reason])


def _streamable(estimate: EstimateFn, shape: Shape) -> tuple[list[str], list[str]]:
    """(modules that can stream, those that stream by default) from the estimate under plain block streaming."""
    modules = estimate(OffloadConfig(mode="block"), shape).modules
    can = [n for n, m in modules.items() if m.streams]
    return can, [n for n in can if modules[n].stream_default]
