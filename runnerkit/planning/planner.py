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
stream_modules replace the ladder's; page_cache and read_threads go to the pread rungs only; the rest are
added; a candidate the result is not a valid concrete config for (e.g. `gpu_slots` with mode none) is left out,
with the validator's reason.

On the CPU the device is the host and offload cannot lower the peak: the first allowed candidate
(resident, unless explicit keys exclude it) is taken if it fits. Nothing fits: `MemoryFitError`
(exit 2) naming the GiB missing for the closest candidate and what would fit (`refusal`).

Pure functions of estimates: the runner side (shapes, limits, the family's estimate per candidate)
is `MemoryChecks.plan_memory` (planning/checks.py); the ladder and the judging of one
candidate are planning/ladder.py; the log, the report and the refusal planning/report.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations, product

import torch

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.memory import MemoryLimit
from runnerkit.planning.fit import MemoryEstimate, MemoryFitError, placement_of, streams
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.ladder import (EstimateFn, Evaluation, MemoryPlan, PassesFn, SupportedFn, candidate_name,
                                           constrain, explicit_keys, ladder, measure, verdict)
from runnerkit.planning.compute import ComputeModel
from runnerkit.planning.report import module_rows, refusal, request_copy_seconds, request_seconds

__all__ = ["MemoryPlan", "PlanMemo", "plan_offload"]


def plan_offload(config: RunnerConfig, shapes: Sequence[Shape], device: torch.device, estimate: EstimateFn,
                 device_limit: MemoryLimit, host_limit: MemoryLimit | None, passes_per_step: PassesFn,
                 supported: SupportedFn = lambda off: None, factors: tuple[int, int] = (16, 4),
                 steps_per_request: int = 1, keep_resident: bool = True,
                 pinned_limit: MemoryLimit | None = None, compute: ComputeModel | None = None,
                 compute_note: str = "", memo: PlanMemo | None = None, fixed_shapes: Sequence[Shape] = (),
                 own_shapes: Sequence[Shape] | None = None) -> MemoryPlan:
    """Resolve `config.offload` (mode auto) into the fastest concrete config that fits (module docstring).

    Args:
        config: the run config, `offload.mode` 'auto' (its other offload keys constrain the plan).
        shapes: (height, width, frames) of every request shape the run will serve (at least one).
        device: the device the memory is planned for (the run's compute device).
        estimate: the family's estimate of a shape under a concrete offload config.
        device_limit / host_limit: bytes available (host None: host memory unknown, not checked).
        passes_per_step: passes through the streamed blocks per denoising step under a candidate's concrete
            offload config (`MemoryChecks.denoise_passes_per_step`), asked per evaluated candidate: its copy
            volume in the report and the log.
        supported: None if the run supports a concrete config, else why not (compile, warmup).
        factors: the family's (spatial, temporal) shape factors, for the smaller shapes the refusal names.
        steps_per_request: denoising steps of one request (all stages), for the request's copy time.
        keep_resident: try keeping modules and streamed units resident beside each rung (`_fastest_variant`);
            False judges each rung as the ladder writes it (the ladder alone, e.g. to compare with).
        pinned_limit: page-locked host bytes allowed apart from `host_limit` (config `memory.pinned_limit_gib`);
            None: pinned bytes count only towards the host limit.
        compute: the time model's compute side (planning/compute.py): with it, candidates are ranked by
            their estimated request seconds (compute overlapped with the streamed copies); None: by copy seconds.
        compute_note: why there is no compute model (the log and the report say it).
        memo: what is pure in a plan (`PlanMemo`), shared by plans of the same run config, shapes, estimate and
            compute model over several limits (runnerkit/tools/plan_table.py); None: a fresh one.
        fixed_shapes / own_shapes: for the refusal's advice, those of `shapes` no target size changes (warmup's)
            and those the requests or the config's target sizes choose (None: every shape not fixed). A shape
            can be both.

    Raises:
        MemoryFitError: no allowed candidate fits (the message: GiB missing, what would fit).
        ValueError: `config.offload.mode` is not 'auto', or no shape is given.
    """
    if config.offload.mode != "auto":
        raise ValueError(f"plan_offload resolves `offload.mode`='auto' only (got {config.offload.mode!r})")
    if not shapes:
        raise ValueError("plan_offload needs at least one request shape")
    shapes = tuple(dict.fromkeys(shapes))
    estimate = _cached(estimate)
    explicit = explicit_keys(config.offload)
    streamable, default_streams = _streamable(estimate, shapes[0])
    memo = memo if memo is not None else PlanMemo()
    measured = memo.evaluations

    def judge(off: OffloadConfig) -> Evaluation:
        key = off.model_dump_json()
        ev = measured.get(key)
        if ev is None:
            ev = measure(candidate_name(off), config.model_copy(update={"offload": off}), shapes, device, estimate,
                         passes_per_step)
            rows = module_rows(ev, device)
            ev.copy_seconds = request_copy_seconds(rows, steps_per_request)
            ev.request_seconds = request_seconds(rows, compute, off) if compute is not None else None
            measured[key] = ev
        return verdict(ev, device_limit, host_limit, pinned_limit)

    walk = _walk_ladder(config.offload, explicit, streamable, default_streams, supported, device, judge,
                        keep_resident, memo)
    evaluations, fitting = walk.evaluations, walk.fitting
    if not fitting:
        closest = [walk.closest.get(i, e) for i, e in enumerate(evaluations)]
        raise MemoryFitError(refusal(config, closest, shapes, device, estimate, device_limit, host_limit,
                                     streamable, default_streams, supported, passes_per_step, factors,
                                     tuple(fixed_shapes), own_shapes))
    rung, chosen = min(fitting, key=lambda x: (*x[1].rank, x[0]))
    # the rungs before the chosen one's that were left out or do not fit (those after it are slower kinds)
    rejected = [e for e in evaluations[:walk.rung_of[rung]] if not e.fits and "not evaluated" not in e.reason]
    return MemoryPlan(chosen=chosen, rejected=rejected, shapes=shapes, device=device, device_limit=device_limit,
                      host_limit=host_limit, why=_why_chosen(chosen, len(fitting), device),
                      steps_per_request=steps_per_request,
                      skipped=[e for e in evaluations if "not evaluated" in e.reason], compute=compute,
                      compute_note=compute_note)


@dataclass
class _LadderWalk:
    """What `_walk_ladder` found, rung by rung."""

    evaluations: list[Evaluation] = field(default_factory=list)
    """One per rung, in ladder order: its base candidate (nothing kept resident beyond the keys), or why it is
    left out."""
    fitting: list[tuple[int, Evaluation]] = field(default_factory=list)
    """(rung index, the rung's fastest variant that fits)."""
    rung_of: dict[int, int] = field(default_factory=dict)
    """Rung index -> its entry in `evaluations` (judged rungs only)."""
    closest: dict[int, Evaluation] = field(default_factory=dict)
    """Entry in `evaluations` -> the rung's variant that misses the least (`_least_memory`), for the refusal."""


def _walk_ladder(requested: OffloadConfig, explicit: dict[str, object], streamable: list[str],
                 default_streams: list[str], supported: SupportedFn, device: torch.device,
                 judge: Callable[[OffloadConfig], Evaluation], keep_resident: bool, memo: PlanMemo) -> _LadderWalk:
    """Step 1 of `plan_offload`: judge the ladder's rungs, fastest first, under the user's explicit keys.

    Decides, per rung: left out (the explicit keys make it invalid, `_excluded`), skipped (the explicit
    keys made it equal to a faster rung), not evaluated (on the CPU, once an allowed rung was judged),
    or judged; a judged rung that fits the device is replaced by its fastest variant that fits
    (`_fastest_variant`, with `keep_resident`). fp8 rungs only with `weight_dtype` auto or fp8_e4m3.
    """
    walk = _LadderWalk()
    seen: set[str] = set()
    allow_fp8 = requested.weight_dtype in ("auto", "fp8_e4m3")
    for rung, cand in enumerate(ladder(streamable, default_streams, allow_fp8)):
        off, why = constrain(cand, explicit)
        name = candidate_name(off) if off is not None else candidate_name(OffloadConfig.model_validate(cand.keys))
        if off is None:
            walk.evaluations.append(Evaluation(name, None, f"excluded: {why}"))
            continue
        if off.model_dump_json() in seen:  # two rungs the explicit keys made equal: the faster one stands
            continue
        seen.add(off.model_dump_json())
        excluded = _excluded(off, streamable, default_streams, supported)
        if excluded is not None:
            walk.evaluations.append(Evaluation(name, off, excluded))
            continue
        if device.type == "cpu":
            if any(e.peak is not None for e in walk.evaluations):
                walk.evaluations.append(Evaluation(name, off, "not evaluated: on the CPU the first allowed candidate "
                                                              "is taken"))
                continue
            ev = judge(off)
            walk.rung_of[rung] = len(walk.evaluations)
            walk.evaluations.append(ev)
            if ev.fits:
                walk.fitting.append((rung, ev))
            continue
        base = judge(off)
        walk.rung_of[rung] = len(walk.evaluations)
        variants = [base]

        def recorded(variant: OffloadConfig) -> Evaluation:
            variants.append(judge(variant))
            return variants[-1]

        # a variant keeps more on the device: it can only help a rung that fits the device (less host memory)
        best = _fastest_variant(off, base, explicit, recorded, memo.tops) if keep_resident and not base.device_missing \
            else (base if base.fits else None)
        walk.evaluations.append(base)
        walk.closest[len(walk.evaluations) - 1] = _least_memory(variants)
        if best is not None:
            walk.fitting.append((rung, best))
    return walk


def _least_memory(variants: Sequence[Evaluation]) -> Evaluation:
    """The variant of a rung that misses the least: `variants[0]` (nothing kept resident) unless it fits, misses
    device memory, or a variant that fits the device misses fewer host (and pinned) bytes. Keeping units resident
    shrinks the host's slabs and staging, so a refusal's "closest" names the host memory the rung really needs."""
    base = variants[0]
    if base.fits or base.device_missing:
        return base
    on_device = [v for v in variants if not v.device_missing]
    return min(on_device, key=lambda v: v.host_missing + v.pinned_missing)


def _excluded(off: OffloadConfig, streamable: list[str], default_streams: list[str],
              supported: SupportedFn) -> str | None:
    """Whether a rung (after the explicit keys) is left out before any estimate: in block mode with no
    module that streams, `offload.stream_modules` naming a module that cannot stream, or
    `offload.resident_modules` keeping a module the rung streams; in any mode, the run refusing it
    (`supported`: compile, warmup). Returns the reason ("excluded: ..."), or None: it is judged."""
    if off.mode == "block" and not streamable:
        return "excluded: no module of this family streams its blocks"
    cannot = [m for m in off.stream_modules or () if m not in streamable]
    if off.mode == "block" and cannot:
        return (f"excluded: `offload.stream_modules` names {cannot}, which cannot stream "
                f"(modules that can: {streamable})")
    kept = [m for m in off.resident_modules or () if m in (off.stream_modules or default_streams)]
    if off.mode == "block" and kept:
        return f"excluded: `offload.resident_modules` keeps {kept} resident, which this candidate streams"
    refused = supported(off)
    if refused:
        return f"excluded: {refused}"
    return None


def _why_chosen(chosen: Evaluation, fitting: int, device: torch.device) -> str:
    """Step 2 of `plan_offload`: the plan's reason in words (the log and the report): the CPU's rule,
    or the chosen candidate's estimated seconds per request and how many slower plans (`fitting` - 1)
    fit too."""
    assert chosen.copy_seconds is not None
    return ("the device is the CPU: weights live in host memory whatever the mode, so offload cannot lower the "
            "peak; the first allowed candidate is taken" if device.type == "cpu" else
            (f"the fastest that fits: an estimated {chosen.request_seconds:.2f} s per request (compute and copies)"
             if chosen.request_seconds is not None else
             f"the fastest that fits: an estimated {chosen.copy_seconds:.2f} s of host-to-device copies per request")
            + (f" ({fitting - 1} slower plan(s) fit too)" if fitting > 1 else ""))


#: Modules the planner tries keeping resident beside an offload mode: all subsets up to this many candidates
#: (2^n plans judged by pure functions of cached estimates); beyond it, only the largest modules are tried.
MAX_RESIDENT_CHOICES = 8
#: `offload.resident_blocks` searched up to this many units per streamed module.
MAX_RESIDENT_BLOCKS = 4096


@dataclass
class PlanMemo:
    """What a plan computes that does not depend on the limits: each candidate measured (`ladder.measure`,
    by its concrete config's JSON) and, per streaming config, the fewest resident units that keep all of them
    (`_fewest_same`)."""

    evaluations: dict[str, Evaluation] = field(default_factory=dict)
    tops: dict[str, int] = field(default_factory=dict)


def _fastest_variant(off: OffloadConfig, base: Evaluation, explicit: dict[str, object],
                     judge: Callable[[OffloadConfig], Evaluation], tops: dict[str, int]) -> Evaluation | None:
    """The fastest variant of a rung that fits (None: none), `base` (nothing kept resident) fitting the device:
    every subset of the
    modules that neither stream nor are resident already kept on the device whole (`offload.resident_modules`,
    unless set explicitly), with and without `offload.keep_across_stages` where a stage of the estimate holds a
    module (unless set explicitly), and in block/phase the most streamed units kept resident that still fit
    (`offload.resident_blocks`, unless set explicitly; more units never copy more, so the most that fits is the
    fastest of a subset)."""
    best = base if base.fits else None
    if off.mode == "none":
        return best
    assert base.estimate is not None
    config = RunnerConfig.model_construct(offload=off, unload_modules=False)
    movable = [n for n, m in base.estimate.modules.items() if placement_of(n, m, config) != "resident"
               and not streams(n, m, off)]
    movable = sorted(movable, key=lambda n: -base.estimate.modules[n].weight_bytes)[:MAX_RESIDENT_CHOICES]
    subsets: list[tuple[str, ...]] = [()]
    if "resident_modules" not in explicit:
        order = list(base.estimate.modules)
        subsets = [tuple(sorted(c, key=order.index)) for r in range(len(movable) + 1)
                   for c in combinations(movable, r)]
        if off.mode == "model":  # every module resident is mode none, the ladder's first rung
            subsets = [c for c in subsets if len(c) < len(base.estimate.modules)]
    search_blocks = off.mode in ("block", "phase") and "resident_blocks" not in explicit
    holds = any(s.holds for s in base.estimate.stages)
    keeps = [off.keep_across_stages] if "keep_across_stages" in explicit or not holds else [False, True]
    for kept, keep in product(subsets, keeps):
        keys = {"resident_modules": (*(off.resident_modules or ()), *kept) or None, "keep_across_stages": keep}
        variant = off.model_copy(update=keys)
        if search_blocks:
            ev = _most_units_that_fit(variant, judge, tops)
        else:
            ev = judge(variant)
        if ev is not None and ev.fits and (best is None or ev.rank < best.rank):
            best = ev
    return best


def _most_units_that_fit(off: OffloadConfig, judge: Callable[[OffloadConfig], Evaluation],
                         tops: dict[str, int]) -> Evaluation | None:
    """`off` with the most `resident_blocks` that fit, or None. More units resident never copy more. Device
    bytes grow with the count, so the most that fit the device is found by bisection; host bytes move one way
    with it for a given storage (disk: the resident part read through host memory grows; cpu: the host slabs
    shrink by what the resident part grows, or more), so if that count is over the host limit, the most below it
    that fits everything is found by bisection too (`_fewest_same` first: counts above the module's own unit
    count say nothing more)."""

    def at(n: int) -> Evaluation:
        return judge(off.model_copy(update={"resident_blocks": n}))

    # the count past which more units change nothing is the streamed modules' own: the same for every set of
    # resident modules and either keep_across_stages, so it is found once per streaming config
    key = off.model_copy(update={"resident_modules": None, "keep_across_stages": False}).model_dump_json()
    if key not in tops:
        tops[key] = _fewest_same(off, MAX_RESIDENT_BLOCKS, judge)
    top = tops[key]
    device = _most(lambda n: not at(n).device_missing, top)
    if device is None:
        return None
    if at(device).fits:
        return at(device)
    most = _most(lambda n: at(n).fits, device)
    return at(most) if most is not None else None


def _most(ok: Callable[[int], bool], top: int) -> int | None:
    """The largest n in [0, top] with ok(n), ok true up to some n and false after it; None if not ok(0)."""
    if not ok(0):
        return None
    lo, hi = 0, top + 1  # ok(lo); not ok(hi) (virtually)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _fewest_same(off: OffloadConfig, n: int, judge: Callable[[OffloadConfig], Evaluation]) -> int:
    """The smallest resident_blocks m <= n judged the same as n (device and host bytes, copy seconds): n above the
    units a module has says nothing more, and the plan names the count that matters."""

    def verdict(m: int) -> tuple[int | None, int | None, float | None]:
        ev = judge(off.model_copy(update={"resident_blocks": m}))
        return (ev.peak.bytes if ev.peak else None, ev.host.bytes if ev.host else None, ev.copy_seconds)

    target = verdict(n)
    lo, hi = -1, n  # verdict(hi) == target
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if verdict(mid) == target else (mid, hi)
    return hi


def _cached(estimate: EstimateFn) -> EstimateFn:
    """`estimate` memoized per (offload config, shape); `offload.resident_modules` does not change a family's
    estimate (fit.py places the modules), so configs that differ only there share one."""
    memo: dict[tuple[str, Shape], MemoryEstimate] = {}

    def cached(off: OffloadConfig, shape: Shape) -> MemoryEstimate:
        key = (off.model_copy(update={"resident_modules": None}).model_dump_json(), shape)
        if key not in memo:
            memo[key] = estimate(off, shape)
        return memo[key]

    return cached


def _streamable(estimate: EstimateFn, shape: Shape) -> tuple[list[str], list[str]]:
    """(modules that can stream, those that stream by default) from the estimate under plain block streaming."""
    modules = estimate(OffloadConfig(mode="block"), shape).modules
    can = [n for n, m in modules.items() if m.streams]
    return can, [n for n in can if modules[n].stream_default]
