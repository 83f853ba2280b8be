"""What a memory plan (planning/planner.py, ladder.py) says: per module where it lives, its bytes and copy volume,
the log block, the profile's `memory_plan`, and the refusal when nothing fits (docs/memory_plan.md).

Copy volume per denoising step (H2D, an estimate from the plan's sizes, labelled as such):

    streamed transformer:  streamed bytes x passes per step under the candidate's own config (the
                           memory checks' `denoise_passes_per_step`, per candidate: 1 without CFG; with
                           CFG 1 in mode block where the family runs both branches through each block
                           in one pass, else 2)
        streamed bytes = the units' raw bytes as copied (`ModuleFootprint.stream_moved_bytes`: the
                         host slabs with storage cpu; with storage disk what is read and copied,
                         checkpoint fp8 tensors at 1 byte + scale)
    streamed text encoder: streamed bytes once per stage that uses it (one encoder pass)
    model-offloaded module: weight_bytes once per stage that uses it (it visits the device for each;
                           a two-stage family's transformer twice, once with keep_across_stages)
    lazy_load:             + the streamed module's resident part, read from disk once per stage that uses it
    resident module (mode none, `offload.resident_modules`, `offload.resident_blocks` units): nothing

    request copy seconds = step copy seconds x denoising steps per request + the per-request copies'
    seconds (what the planner minimizes among the candidates that fit: planning/planner.py)

    seconds = bytes / bandwidth: pinned H2D `H2D_PINNED_BYTES_PER_S`, pageable `H2D_PAGEABLE_BYTES_PER_S`,
    disk `min(DISK_BYTES_PER_S, H2D)`; assumptions, not measurements. One transformer runs per step
    (MoE experts take turns), so the step's copy is the largest transformer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger
from pydantic import ValidationError

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.memory import MemoryLimit
from runnerkit.planning.fit import GIB, host_module_bytes, overhead_bytes, placement_of, streams
from runnerkit.offload.pinned import pinning_disabled_by_env
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.compute import ComputeModel, denoise_seconds
from runnerkit.planning.ladder import (EstimateFn, Evaluation, MemoryPlan, PassesFn, SupportedFn, candidate_name,
                                           evaluate, explicit_keys, ladder)

__all__ = ["DISK_BYTES_PER_S", "H2D_PAGEABLE_BYTES_PER_S", "H2D_PINNED_BYTES_PER_S", "ModuleRow", "describe",
           "module_rows", "refusal", "report", "request_copy_seconds", "request_seconds"]

H2D_PINNED_BYTES_PER_S = 20e9
"""Assumed host-to-device copy rate from pinned memory: PCIe 4.0 x16 in practice (~25 GB/s peak), the
link of most 8-24 GB GPUs. (A PCIe 5.0 H200 host measured 55 GB/s: 1 GiB copies, torch 2.11.)"""
H2D_PAGEABLE_BYTES_PER_S = 8e9
"""Assumed rate from pageable memory (pin_memory false): the driver stages through its own pinned
buffer (the same H200 host measured 8.7 GB/s)."""
DISK_BYTES_PER_S = 2e9
"""Assumed sequential read rate of the checkpoint's disk: a PCIe 3.0/4.0 NVMe drive with a cold page cache."""


@dataclass(frozen=True)
class ModuleRow:
    """One module under the plan (bytes; seconds are estimates at the assumed rates)."""

    name: str
    placement: str
    device_bytes: int  # on the device during its own stage
    host_bytes: int  # kept in host memory
    copy_step_bytes: int  # H2D per denoising step
    copy_request_bytes: int  # H2D once per request
    bytes_per_s: float  # the assumed rate of its copies

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s if nbytes else 0.0


def module_rows(ev: Evaluation, device: torch.device) -> list[ModuleRow]:
    """Per module of an evaluated candidate (at its peak shape; `plan.chosen` for the plan itself): placement,
    bytes and copy volume, the streamed transformers' at the candidate's own passes per step (module docstring)."""
    off = ev.offload
    assert ev.estimate is not None and off is not None, "an evaluated candidate"
    config = RunnerConfig.model_construct(offload=off, unload_modules=False)
    h2d = H2D_PINNED_BYTES_PER_S if off.pin_memory else H2D_PAGEABLE_BYTES_PER_S
    rows = []
    for name, m in ev.estimate.modules.items():
        held = sum(1 for s in ev.estimate.stages if name in s.holds) if off.keep_across_stages else 0
        uses = max(1, sum(1 for s in ev.estimate.stages if s.module == name) - held)  # a hold joins two uses
        host = host_module_bytes(name, m, config) if device.type != "cpu" else 0
        where = placement_of(name, m, config) if device.type != "cpu" else "resident"
        if device.type == "cpu" or where == "resident":
            rows.append(ModuleRow(name, "resident", m.weight_bytes, host, 0, 0, h2d))
        elif streams(name, m, off):
            assert m.stream_resident_bytes is not None
            streamed = m.stream_moved_bytes or m.weight_bytes - m.stream_resident_bytes  # as copied (fp8: 1 byte)
            step, request = (streamed * ev.passes_per_step, 0) if m.stream_default else (0, streamed * uses)
            request += m.stream_resident_bytes * uses if off.lazy_load else 0  # built per stage from disk
            rate = h2d if off.storage == "cpu" else min(h2d, DISK_BYTES_PER_S)
            on_device = m.stream_resident_bytes + m.stream_slot_bytes
            rows.append(ModuleRow(name, where, on_device, host, step, request, rate))
        else:
            rows.append(ModuleRow(name, where, m.weight_bytes, host, 0, m.weight_bytes * uses, h2d))
    return rows


def request_copy_seconds(rows: Sequence[ModuleRow], steps_per_request: int) -> float:
    """Estimated H2D seconds of one request (module docstring): the step's copy x steps + the per-request copies."""
    return _step_copy(rows)[1] * steps_per_request + sum(r.seconds(r.copy_request_bytes) for r in rows)


def request_seconds(rows: Sequence[ModuleRow], compute: ComputeModel, offload: OffloadConfig) -> float:
    """Estimated seconds of one request under a candidate (planning/compute.py): the denoising steps, each the
    larger of its compute and the streamed copy (prefetched; their sum from pageable memory), + the per-request
    copies."""
    overlapped = offload.pin_memory and not pinning_disabled_by_env()
    return (denoise_seconds(compute, _step_copy(rows)[1], overlapped)
            + sum(r.seconds(r.copy_request_bytes) for r in rows))


def _gib(n: int | float) -> float:
    return round(n / GIB, 3)


def _dump(off: OffloadConfig | None) -> dict[str, Any] | None:
    return off.model_dump(mode="json") if off is not None else None


def _step_copy(rows: Sequence[ModuleRow]) -> tuple[int, float]:
    """(bytes, seconds) copied per denoising step: the largest streamed transformer's (one runs per step)."""
    return (max((r.copy_step_bytes for r in rows), default=0),
            max((r.seconds(r.copy_step_bytes) for r in rows), default=0.0))


def _rejected(e: Evaluation, device: torch.device) -> dict[str, Any]:
    """A rejected candidate in the report; its copy volume at its own passes per step where it was evaluated."""
    step = _step_copy(module_rows(e, device)) if e.estimate is not None else None
    return {"candidate": e.name, "offload": _dump(e.offload), "reason": e.reason,
            "device_gib": _gib(e.peak.bytes) if e.peak is not None else None,
            "host_gib": _gib(e.host.bytes) if e.host is not None else None,
            "passes_per_step": e.passes_per_step if step is not None else None,
            "copy_per_step_gib": _gib(step[0]) if step is not None else None,
            "copy_seconds_per_step_estimate": round(step[1], 4) if step is not None else None}


def report(plan: MemoryPlan, requested: OffloadConfig) -> dict[str, Any]:
    """The profile's `memory_plan` (every key: docs/profile.md)."""
    ev = plan.chosen
    assert ev.peak is not None and ev.host is not None and ev.peak_shape is not None
    rows = module_rows(ev, plan.device)
    step, step_s = _step_copy(rows)
    return {
        "requested": requested.model_dump(mode="json", exclude_unset=True),
        "offload": _dump(plan.offload),
        "candidate": ev.name,
        "why": plan.why,
        "shapes": [list(s) for s in plan.shapes],
        "peak_shape": list(ev.peak_shape),
        "device_gib": _gib(ev.peak.bytes),
        "peak_stage": ev.peak.stage,
        "device_limit_gib": _gib(plan.device_limit.bytes),
        "device_limit_source": plan.device_limit.source,
        "host_gib": _gib(ev.host.bytes),
        "host_pinned_gib": _gib(ev.host.pinned_bytes),
        "host_limit_gib": _gib(plan.host_limit.bytes) if plan.host_limit is not None else None,
        "host_limit_source": plan.host_limit.source if plan.host_limit is not None else None,
        "passes_per_step": plan.passes_per_step,
        "copy_per_step_gib": _gib(step),
        "copy_seconds_per_step_estimate": round(step_s, 4),
        "copy_per_request_gib": _gib(sum(r.copy_request_bytes for r in rows)),
        "copy_seconds_per_request_estimate": round(sum(r.seconds(r.copy_request_bytes) for r in rows), 4),
        "steps_per_request": plan.steps_per_request,
        "request_copy_seconds_estimate": round(request_copy_seconds(rows, plan.steps_per_request), 4),
        "estimated_request_seconds": (round(ev.request_seconds, 3) if ev.request_seconds is not None else None),
        "compute_estimate": plan.compute.report() if plan.compute is not None else None,
        "compute_note": plan.compute_note or None,
        "modules": [{"name": r.name, "placement": r.placement, "device_gib": _gib(r.device_bytes),
                     "host_gib": _gib(r.host_bytes), "copy_per_step_gib": _gib(r.copy_step_bytes),
                     "copy_seconds_per_step_estimate": round(r.seconds(r.copy_step_bytes), 4),
                     "copy_per_request_gib": _gib(r.copy_request_bytes),
                     "assumed_gb_per_s": round(r.bytes_per_s / 1e9, 2)} for r in rows],
        "rejected": [_rejected(e, plan.device) for e in plan.rejected],
    }


def describe(plan: MemoryPlan) -> str:
    """The plan's INFO block: the choice and why, per module, copy volume, the rejected candidates."""
    ev = plan.chosen
    assert ev.peak is not None and ev.host is not None
    host_limit = (f"{plan.host_limit.bytes / GIB:.2f} GiB ({plan.host_limit.source})" if plan.host_limit is not None
                  else "unknown (not checked)")
    lines = [f"memory plan (offload.mode auto): {ev.name} -- {plan.why}",
             f"  offload: {plan.offload.model_dump_json()}",
             f"  shapes {[list(s) for s in plan.shapes]}; device {plan.device}: estimated {ev.peak.describe()} of "
             f"{plan.device_limit.bytes / GIB:.2f} GiB ({plan.device_limit.source})",
             f"  host: estimated {ev.host.describe()} of {host_limit}",
             f"  {'module':<18} {'where':<44} {'device GiB':>10} {'host GiB':>9} {'H2D/step GiB':>12} "
             f"{'H2D/request GiB':>15}"]
    rows = module_rows(ev, plan.device)
    for r in rows:
        lines.append(f"  {r.name:<18} {r.placement:<44} {r.device_bytes / GIB:>10.2f} {r.host_bytes / GIB:>9.2f} "
                     f"{r.copy_step_bytes / GIB:>12.2f} {r.copy_request_bytes / GIB:>15.2f}")
    step = max(rows, key=lambda r: r.copy_step_bytes, default=None)
    if step is not None and step.copy_step_bytes:
        lines.append(f"  copy per denoising step (estimate): {step.copy_step_bytes / GIB:.2f} GiB "
                     f"({plan.passes_per_step} pass(es)) = {step.seconds(step.copy_step_bytes):.2f} s at an assumed "
                     f"{step.bytes_per_s / 1e9:.0f} GB/s, vs 0 s resident (prefetch overlaps it with compute)")
    request = sum(r.copy_request_bytes for r in rows)
    if request:
        lines.append(f"  copy per request (estimate): {request / GIB:.2f} GiB = "
                     f"{sum(r.seconds(r.copy_request_bytes) for r in rows):.2f} s at the assumed rates")
    ranked = "" if plan.compute is not None else ", the least of the plans that fit"
    lines.append(f"  copies of one request (estimate, {plan.steps_per_request} denoising steps): "
                 f"{request_copy_seconds(rows, plan.steps_per_request):.2f} s{ranked}")
    if plan.compute is not None and ev.request_seconds is not None:
        steps = ", ".join(f"{n} {k} x {s:.3f} s" for n, k, s in plan.compute.stages)
        lines.append(f"  request time (estimate): {ev.request_seconds:.2f} s, the least of the plans that fit "
                     f"(compute per step {steps} at {plan.compute.efficiency:.0%} of the {plan.compute.peak.label}'s "
                     f"{plan.compute.peak.tflops:.0f} TFLOP/s, overlapped with the streamed copy)")
    elif plan.compute_note:
        lines.append(f"  {plan.compute_note}: plans ranked by their copy seconds")
    for e in plan.rejected:
        lines.append(f"  rejected: {e.name}: {e.reason}")
    return "\n".join(lines)


#: (concrete offload config, shapes) -> that candidate judged over those shapes against the run's limits.
Judge = Callable[[OffloadConfig, Sequence[Shape]], Evaluation]


def refusal(config: RunnerConfig, evaluations: Sequence[Evaluation], shapes: Sequence[Shape], device: torch.device,
            estimate: EstimateFn, device_limit: MemoryLimit, host_limit: MemoryLimit | None,
            streamable: Sequence[str], default_streams: Sequence[str], supported: SupportedFn, passes: PassesFn,
            factors: tuple[int, int], fixed: Sequence[Shape] = (), own: Sequence[Shape] | None = None) -> str:
    """Why no candidate fits: the closest one with the GiB missing on the device and the host (rounded up to
    0.01 GiB: a limit of the figure named fits that candidate), and what would fit by the planner's own estimate
    (every shape judged again, device and host): a candidate the user's keys excluded, the family's hints
    (`MemoryEstimate.hints`) set on an evaluated candidate, the largest smaller shapes in place of a peak shape
    the user chooses, and `warmup` false (with a smaller shape of `own`, the shapes the requests or target sizes
    choose, if needed) where the peak is one of `fixed` (warmup's shapes, which the family fixes: no target size
    changes them). Advice the estimate says would still not fit is not given."""
    tried = [e for e in evaluations if e.peak is not None]
    for e in evaluations:  # the whole ladder: for whoever asks why, not for the error line
        logger.debug("memory plan candidate: {}: {}", e.name, e.reason)
    on_cpu = device.type == "cpu"
    head = (f"`offload.mode`='auto': no offload plan fits {len(shapes)} shape(s) {[list(s) for s in shapes]} "
            f"on {device} (limit {device_limit.bytes / GIB:.2f} GiB: {device_limit.source}"
            + (f"; host limit {host_limit.bytes / GIB:.2f} GiB: {host_limit.source})" if host_limit else ")"))
    if not tried:
        return (f"{head}. Every candidate is excluded: "
                + "; ".join(f"{e.name}: {e.reason}" for e in evaluations))
    best = min(tried, key=lambda e: e.device_missing + e.host_missing + e.pinned_missing)
    assert best.peak is not None and best.host is not None
    warmup_peak = ", a warmup shape: no target size changes it" if best.peak_shape in fixed else ""
    missing = []
    if best.device_missing:
        missing.append(f"{_up(best.peak.bytes)} GiB on the device ({_up(best.device_missing)} GiB missing, "
                       f"peak in stage {best.peak.stage} at shape {list(best.peak_shape or ())}{warmup_peak})")
    if best.host_missing:
        missing.append(f"{_up(best.host.bytes)} GiB of host memory ({_up(best.host_missing)} GiB missing)")
    if best.pinned_missing:
        missing.append(f"{_up(best.host.pinned_bytes)} GiB of pinned host memory ({_up(best.pinned_missing)} "
                       "GiB over `memory.pinned_limit_gib`; `offload.pin_memory`=false pins none)")

    def judge(off: OffloadConfig, planned: Sequence[Shape]) -> Evaluation:
        return evaluate(candidate_name(off), config.model_copy(update={"offload": off}), planned, device, estimate,
                        device_limit, host_limit, passes)

    # on the CPU the plan takes the first allowed candidate whatever fits further down the ladder
    advice = [] if on_cpu else _would_fit(config, evaluations, shapes, judge, streamable, default_streams, supported)
    if best.device_missing:
        advice += _hints(tried, shapes, judge, supported)
    if best.device_missing and not best.host_missing:
        own = [s for s in shapes if s not in fixed] if own is None else list(own)
        advice += _without_warmup(tried, best, own, fixed, judge, named=not on_cpu,
                                  smaller=lambda t, b, rest: _smaller_shapes(t, b, rest, judge, device, device_limit,
                                                                             factors, named=not on_cpu))
        advice += _smaller_shapes(tried, best, shapes, judge, device, device_limit, factors, named=not on_cpu,
                                  fixed=fixed)
    elif best.host_missing:
        advice.append("free host memory or raise `memory.host_limit_gib` (host memory barely depends on the shape)"
                      if not on_cpu else "a smaller shape or more host memory (`memory.host_limit_gib`)")
        if best.device_missing and not on_cpu:  # both short: the host advice alone leaves the device short
            advice.append(f"a device with {_up(best.device_missing)} GiB more memory as well")
    if on_cpu:
        logger.debug("memory plan: {} needs {}", best.name, " and ".join(missing))
        over = []
        if best.device_missing:
            over.append(f"{_up(best.peak.bytes)} GiB, {_up(best.device_missing)} GiB over the limit "
                        f"({device_limit.bytes / GIB:.2f} GiB: {device_limit.source})")
        if best.host_missing and host_limit is not None:
            over.append(f"{_up(best.host.bytes)} GiB, {_up(best.host_missing)} GiB over the host limit "
                        f"({host_limit.bytes / GIB:.2f} GiB: {host_limit.source})")
        advice = advice or ["more memory"]
        return (f"`offload.mode`='auto' on the CPU: {best.name} needs {' and '.join(over)}; offload cannot lower it "
                f"(the device is the host). To fit: {'; or '.join(advice)}")
    advice = advice or ["a device with more memory"]
    return f"{head}. Closest: {best.name} needs {' and '.join(missing)}. To fit: {'; or '.join(advice)}"


def _up(nbytes: int) -> str:
    """`nbytes` in GiB rounded up to 0.01, as the refusal names what is needed: a limit of that figure holds it."""
    hundredths = -(-int(nbytes) * 100 // GIB)  # integer ceiling: no float rounding above an exact figure
    return f"{hundredths // 100}.{hundredths % 100:02d}"


def _without_warmup(tried: Sequence[Evaluation], best: Evaluation, own: Sequence[Shape], fixed: Sequence[Shape],
                    judge: Judge, named: bool,
                    smaller: Callable[[Sequence[Evaluation], Evaluation, Sequence[Shape]], list[str]]) -> list[str]:
    """Where the closest candidate's peak is a warmup shape (`fixed`): `warmup` false, if an evaluated candidate
    then fits the shapes the user chooses (`own`; device and host judged again), else `warmup` false with each
    smaller shape of those that fits (`smaller`: `_smaller_shapes` over candidates judged at `own`); nothing
    where the peak is not a warmup shape or neither fits."""
    if best.peak_shape not in fixed or not own:
        return []
    at_own = [judge(e.offload, own) for e in tried if e.offload is not None]
    for ev in at_own:
        if ev.fits:
            return ["`warmup` false (the first request then pays what warmup would)"
                    + (f" ({ev.name})" if named else "")]
    near = [e for e in at_own if e.peak is not None and not e.host_missing]
    if not near:
        return []
    closest = min(near, key=lambda e: e.device_missing + e.pinned_missing)
    return [f"`warmup` false and {text}" for text in smaller(near, closest, own) if text.startswith("target_")]


def _would_fit(config: RunnerConfig, evaluations: Sequence[Evaluation], shapes: Sequence[Shape], judge: Judge,
               streamable: Sequence[str], default_streams: Sequence[str], supported: SupportedFn) -> list[str]:
    """The first candidate of the unconstrained ladder (fp8 allowed) that fits, and what keeps it out."""
    excluded = {e.name: e.reason for e in evaluations}
    for cand in ladder(streamable, default_streams, allow_fp8=True):
        off = OffloadConfig.model_validate(cand.keys)
        name = candidate_name(off)
        if name in excluded and not excluded[name].startswith("excluded"):
            continue  # evaluated already: it does not fit
        if off.mode == "block" and not streamable:
            continue
        ev = judge(off, shapes)
        if not ev.fits:
            continue
        assert ev.peak is not None
        fit = f"{name} fits ({ev.peak.bytes / GIB:.2f} GiB on the device)"
        if name in excluded:
            return [f"{fit}, but it is {excluded[name]}"]
        if off.weight_dtype == "fp8_e4m3" and config.offload.weight_dtype == "same":
            return [f"`offload.weight_dtype`='auto' (lets the planner store streamed weights in lossy fp8_e4m3): {fit}"]
        refused = supported(off)
        return [f"{fit}, but {refused}" if refused else
                f"{fit} without the config's explicit offload keys {explicit_keys(config.offload)}"]
    return []


def _hints(tried: Sequence[Evaluation], shapes: Sequence[Shape], judge: Judge, supported: SupportedFn) -> list[str]:
    """The families' advice (`fit.Hint`) that makes an evaluated candidate fit: its offload keys set on the
    candidate (fastest first) and every shape judged again. Advice with which nothing fits, or that sets no
    keys (nothing to judge), is left out."""
    out: list[str] = []
    hints = {h.text: h for e in tried if e.estimate is not None for h in e.estimate.hints if h.offload}
    for hint in hints.values():
        for e in tried:
            assert e.offload is not None, "an evaluated candidate has a config"
            try:
                off = OffloadConfig.model_validate({**e.offload.model_dump(exclude_unset=True), **hint.offload})
            except ValidationError:
                continue  # the advice does not apply to this candidate
            ev = judge(off, shapes)
            if ev.fits and not supported(off):
                assert ev.peak is not None
                out.append(f"{hint.text}: {ev.name} then fits ({ev.peak.bytes / GIB:.2f} GiB on the device)")
                break
    return out


def _smaller_shapes(tried: Sequence[Evaluation], best: Evaluation, shapes: Sequence[Shape], judge: Judge,
                    device: torch.device, device_limit: MemoryLimit, factors: tuple[int, int],
                    named: bool = True, fixed: Sequence[Shape] = ()) -> list[str]:
    """The most frames at the same size, and the largest smaller size of the same aspect ratio on the
    family's spatial grid (`_same_ratio_sizes`) at the same frames, with which an evaluated candidate fits:
    its peak shape replaced by the smaller one, the other shapes kept, device and host judged. If neither:
    what `best` still needs at the smallest size of that aspect ratio at 1 frame (weights, activations,
    margin and fixed overhead at DEBUG), or that shape if it fits. `named`: name the candidate that fits (the
    CPU evaluates one). A candidate whose peak is one of `fixed` (warmup's shapes: no target size changes them) is
    not offered a smaller size, and when `best`'s is, neither is the smallest size."""
    spatial, temporal = factors

    def by(e: Evaluation, sep: str = " (") -> str:
        return f"{sep}{e.name})" if named else (")" if sep == "; " else "")

    def judged(e: Evaluation, new: Shape) -> Evaluation | None:
        """`e`'s plan with its peak shape replaced by `new`; None where the family's estimate refuses `new`
        (a shape below its networks' minimum, e.g. a decoder window: ValueError), which then does not fit."""
        assert e.offload is not None and e.peak_shape is not None
        try:
            return judge(e.offload, tuple(dict.fromkeys(new if s == e.peak_shape else s for s in shapes)))
        except ValueError as exc:
            logger.debug("memory plan: shape {} not estimated ({})", list(new), exc)
            return None

    def fits(e: Evaluation, new: Shape) -> bool:
        ev = judged(e, new)
        return ev is not None and ev.fits

    usable = [e for e in tried if e.offload is not None and e.peak_shape is not None and not e.host_missing
              and e.peak_shape not in fixed]
    out = []
    frames = []
    for e in usable:
        h, w, f = e.peak_shape  # type: ignore[misc]
        top = (f - 1) // temporal
        # the fewest frames the estimate takes (a family may refuse counts below its networks' minimum), then
        # the most that fit above them
        low = _smallest(lambda n, e=e, h=h, w=w: judged(e, (h, w, temporal * n + 1)) is not None, top)
        n = None if low is None else _largest(lambda n, e=e, h=h, w=w: fits(e, (h, w, temporal * n + 1)), top, low)
        if n is not None and f > 1:
            frames.append((temporal * n + 1, e))
    if frames:
        most, ev = max(frames, key=lambda x: x[0])
        h, w, _ = ev.peak_shape  # type: ignore[misc]
        out.append(f"target_video_length {most} at {h}x{w}{by(ev)}")
    sizes = [(e, (hs, ws, e.peak_shape[2])) for e in usable  # type: ignore[index]
             for hs, ws in _same_ratio_sizes(e.peak_shape[0], e.peak_shape[1], spatial)]  # type: ignore[index]
    for e, size in sorted(sizes, key=lambda x: -x[1][0] * x[1][1]):  # the largest first, fastest first
        if fits(e, size):
            out.append(f"target_height x target_width {size[0]}x{size[1]} at {size[2]} frames (aspect ratio "
                       f"{_ratio(size[0], size[1])}{by(e, '; ')}")
            break
    if out or best.peak_shape in fixed:
        return out
    assert best.offload is not None and best.peak_shape is not None
    h, w, _ = best.peak_shape
    smaller = _same_ratio_sizes(h, w, spatial)
    smallest = (*(smaller[-1] if smaller else (h, w)), 1)
    ev = judged(best, smallest)
    if ev is None:
        return [(f"no smaller size of the aspect ratio {_ratio(h, w)} in place of {list(best.peak_shape)} fits (the "
                 "smallest the estimate takes was tried); a device with more memory")]
    assert ev.peak is not None
    if ev.fits:
        return [f"target_height x target_width {smallest[0]}x{smallest[1]} at 1 frame{by(best)}"]
    fixed = overhead_bytes(device)
    alone = (f"; its fixed overhead alone ({fixed / GIB:.2f} GiB) exceeds the limit" if fixed >= device_limit.bytes
             else "")
    others = " (the other shapes as planned)" if len(shapes) > 1 else ""
    ratio = (f"no smaller size of the aspect ratio {_ratio(h, w)} in place of {list(best.peak_shape)} fits{others}"
             if smaller else f"no smaller size keeps the aspect ratio {_ratio(h, w)} of {list(best.peak_shape)} on "
                             f"the family's {spatial}-pixel grid{others}")
    where = f" at shape {list(ev.peak_shape)}" if ev.peak_shape not in (None, smallest) else ""  # another shape's
    logger.debug("memory plan: at {} {} still needs {}", list(smallest), best.name, ev.peak.describe())
    return [f"{ratio}: at {'x'.join(map(str, smallest))}{' ' + best.name if named else ' it'} still needs {ev.peak.bytes / GIB:.2f} GiB{where} "
            f"({ev.peak.weight_bytes / GIB:.2f} GiB weights, {fixed / GIB:.2f} GiB fixed overhead){alone}; a device "
            "with more memory"]


def _same_ratio_sizes(h: int, w: int, spatial: int) -> list[tuple[int, int]]:
    """(height, width) smaller than h x w with exactly its aspect ratio, both multiples of `spatial` (the
    family's shape rule), the largest first; none where h x w is the smallest such size (or off the grid).

    E.g. 128x192 on a 64-pixel grid (2:3 = 2 x 3 cells) has none; 480x832 on a 16-pixel grid (30 x 52 cells,
    15:26) has 240x416."""
    if h % spatial or w % spatial:
        return []
    steps = math.gcd(h // spatial, w // spatial)
    unit_h, unit_w = h // steps, w // steps
    return [(m * unit_h, m * unit_w) for m in range(steps - 1, 0, -1)]


def _ratio(h: int, w: int) -> str:
    """'2:3' for 128x192."""
    g = math.gcd(h, w)
    return f"{h // g}:{w // g}"


def _largest(ok: Any, top: int, bottom: int = 0) -> int | None:
    """The largest n in [bottom, top) with ok(n) (ok monotone: true up to some n), or None."""
    lo, hi = bottom - 1, top  # ok(lo) true (virtually), ok(hi) false (the shape that failed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo if lo >= bottom else None


def _smallest(ok: Any, top: int) -> int | None:
    """The smallest n in [0, top) with ok(n) (ok monotone: false up to some n, then true), or None."""
    lo, hi = -1, top  # ok(lo) false (virtually), ok(hi) true (virtually)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi if hi < top else None
