"""`runnerkit plan`: the memory plan a config would get, before anything loads, without its weights.

    runnerkit plan --config_json configs/<family>/<config>.json                      # this machine
    runnerkit plan --config_json configs/<family>/<config>.json --device_gib 24 --host_gib 64 [--json]

The runner is built to plan only (`BaseRunner.for_plan`): no weight is read and the checkpoint need not
exist (a family then takes the architecture its config gives or implies, and says so). The plan is the
run's own: `runner.memory_checks.plan_memory` (planning/checks.py) for the config's default shape and, with
`warmup`, its warmup shapes (the launch script's path without requests), then `check_fit` of each shape, as
a run checks them before loading. What a config without `offload.mode` plans is `offload.mode` auto; a config
with a mode gets that mode, judged against the limits as the planner judges a candidate.

Limits: `--device_gib` (as config `memory.limit_gib`: the budget exactly), else this machine's CUDA device
(`memory.device_budget`: free + held, less the headroom for the CUDA libraries); `--host_gib` (as
`memory.host_limit_gib`), else the host's available memory (`memory.host_available_bytes`: MemAvailable or
the cgroup v1/v2 limit less its usage, whichever is smaller). A config whose `device` is `cpu` is planned
for the CPU (the device is the host).

Output: per module its placement (`fit.placement_of`), device and host bytes and H2D copy per step and per
request; the estimated request time where the planner gives one (`estimated_request_seconds`, null
otherwise), else its estimate of the request's host-to-device copy time (`request_copy_seconds_estimate`);
the faster candidates rejected, with the limit each broke. `--json`: the profile's `memory_plan` object
(docs/profile.md) with `estimated_request_seconds`, `fits`, `refusal`, `estimate_sources`, `estimate_missing`
(why there are no numbers: a family without a memory estimate), `over_limits`, and per module
`device_bytes`, `host_bytes`, `copy_bytes_per_step`, `copy_bytes_per_request`.

Exit status: 0 the run would start with this plan (or, for a family without a memory estimate, unchecked);
1 the run would be refused (no plan fits, or the config's own mode exceeds a limit: `refusal` says why and
what would fit); 2 invalid input (flags, config, a CUDA plan without CUDA and without `--device_gib`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from loguru import logger

from runnerkit.config import ConfigError, load_runner_config
from runnerkit.memory import MemoryLimit
from runnerkit.registry import get_runner_cls
from runnerkit.planning import fit
from runnerkit.planning import report as plan_report
from runnerkit.runners.default import DefaultRunner
from runnerkit.planning.fit import GIB, MemoryFitError
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.ladder import Evaluation, MemoryPlan, candidate_name, evaluate
from runnerkit.tools.plan_args import build_parser

__all__ = ["build_parser", "describe", "main", "plan_device", "plan_of"]

LOG_FORMAT = "<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}"
EXIT_REFUSED = 1


def plan_device(config_device: str, limit_gib: float | None) -> torch.device:
    """The device to plan for: the CPU for a config on `cpu`; else CUDA (`cuda:N` as configured), which
    this machine need not have when `limit_gib` (`--device_gib` or config `memory.limit_gib`) gives its size.

    Raises:
        ConfigError: a CUDA plan on a machine without CUDA and without a limit (naming `--device_gib`).
    """
    if config_device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda" if config_device == "auto" else config_device)
    if not torch.cuda.is_available() and limit_gib is None:
        raise ConfigError(f"the config's `device` is {config_device!r} but this machine has no CUDA, so the GPU's "
                          "memory cannot be read: pass --device_gib GIB (the GPU memory to plan for, e.g. "
                          "--device_gib 24), or set the config's `device` to 'cpu' to plan for the CPU")
    return device


def run_shapes(runner: DefaultRunner) -> list[Shape]:
    """The shapes a run of the config plans and checks without requests: its default shape (`default_shape`: a
    frame count the config omits at the family's count for a request without one), and with `warmup` the warmup
    shapes (`plan_memory` with no request shapes)."""
    cfg = runner.config
    shapes: list[Shape] = [runner.memory_checks.default_shape()]
    if cfg.warmup:
        shapes += list(runner.warmup_shapes())
    return list(dict.fromkeys(shapes))


def planner_seconds(report: dict[str, Any], plan: MemoryPlan | None) -> float | None:
    """The planner's estimated request time in seconds where it gives one: `estimated_request_seconds` of the
    report, else of the plan or its chosen candidate; None where the planner has no time model."""
    if report.get("estimated_request_seconds") is not None:
        return float(report["estimated_request_seconds"])
    for owner in (plan, plan.chosen if plan is not None else None):
        value = getattr(owner, "estimated_request_seconds", None)  # the time model is newer than this tool
        if value is not None:
            return float(value)
    return None


def _module_entries(report: dict[str, Any], ev: Evaluation, device: torch.device) -> list[dict[str, Any]]:
    """The report's modules (their placement words: `fit.placement_of`, through `plan_report.module_rows`) with
    their bytes."""
    rows = {r.name: r for r in plan_report.module_rows(ev, device)}
    return [{**entry, "device_bytes": rows[entry["name"]].device_bytes, "host_bytes": rows[entry["name"]].host_bytes,
             "copy_bytes_per_step": rows[entry["name"]].copy_step_bytes,
             "copy_bytes_per_request": rows[entry["name"]].copy_request_bytes} for entry in report["modules"]]


def _first_refusal(runner: DefaultRunner, shapes: Sequence[Shape]) -> str | None:
    """The run's own check of each shape before loading (`check_fit`): the first refusal, or None."""
    for k, shape in enumerate(shapes):
        try:
            runner.memory_checks.check_fit(shape, "the default shape" if k == 0 else f"warmup shape {list(shape)}")
        except MemoryFitError as exc:
            return str(exc)
    return None


def plan_of(runner: DefaultRunner, mode_set_by: str = "in the config") -> dict[str, Any]:
    """The plan of a `for_plan` runner as one JSON-ready object (module docstring: its keys).

    Args:
        mode_set_by: where a concrete `offload.mode` came from, for `why`: "in the config" or "by the --offload
            flag".

    Raises:
        ConfigError: the family's estimate needs the checkpoint (`fit.EstimateUnavailable`: e.g. one whose
            architecture the config neither gives nor implies).
        ValueError, NotImplementedError: what the run's planning raises before loading (e.g. an explicit
            `offload.mode` auto for a family without a memory estimate).
    """
    cfg = runner.config
    requested = cfg.offload
    try:  # the estimate's inputs, before the run's planning would wait for the load (that is no plan)
        runner.estimate_memory((cfg.target_height, cfg.target_width, cfg.target_video_length))
    except fit.EstimateUnavailable as exc:
        raise ConfigError(f"{type(runner).__name__} cannot estimate the memory without what the checkpoint "
                          f"holds: {exc}") from None
    checks = runner.memory_checks
    resident_why = None
    if requested.mode == "auto" and "mode" not in requested.model_fields_set:
        default = checks.resident_by_default(checks.device_budget())  # what plan_memory logs, for the output
        resident_why = default[0] if default else None
    device = checks.memory_device()
    shapes = run_shapes(runner)
    plan: MemoryPlan | None = None
    refusal: str | None = None
    try:
        plan = checks.plan_memory(())
    except MemoryFitError as exc:
        refusal = str(exc)
    device_limit, host_limit = checks.device_budget(), checks.host_budget()
    base: dict[str, Any] = {
        "config_json": None, "model_cls": cfg.model_cls, "task": cfg.task, "runner": type(runner).__name__,
        "dtype": cfg.dtype, "device": str(device), "estimate_sources": runner.estimate_sources(),
        "estimate_missing": None, "fits": refusal is None, "refusal": refusal, "over_limits": None}
    limits = {"device_limit_gib": round(device_limit.bytes / GIB, 3) if device_limit else None,
              "device_limit_source": device_limit.source if device_limit else None,
              "host_limit_gib": round(host_limit.bytes / GIB, 3) if host_limit else None,
              "host_limit_source": host_limit.source if host_limit else None}
    empty = {"requested": requested.model_dump(mode="json", exclude_unset=True), "candidate": None,
             "shapes": [list(s) for s in shapes], "device_gib": None, "host_gib": None, "modules": [], "rejected": [],
             **limits}
    if refusal is not None:  # no plan fits: the refusal names the closest candidate and what would fit
        return {**base, **empty, "offload": None, "why": None, "estimated_request_seconds": None}
    if plan is not None:
        assert runner.profiler.memory_plan is not None, "plan_memory records its plan"
        report = dict(runner.profiler.memory_plan)
        report["modules"] = _module_entries(report, plan.chosen, device)
        return {**base, **report, "estimated_request_seconds": planner_seconds(report, plan)}
    cfg = runner.config  # concrete now: the config's own mode, or resident by default
    why = (f"`offload.mode` not set, every module resident: {resident_why}" if resident_why is not None else
           f"`offload.mode` {requested.mode!r} is set {mode_set_by}: not planned, judged as it is")
    missing = None if runner.estimate_memory(shapes[0]) is not None else (
        f"{type(runner).__name__} gives no memory estimate (estimate_memory)")
    if missing is not None or device_limit is None:
        reason = missing or f"the memory of {device} cannot be read"
        return {**base, **empty, "offload": cfg.offload.model_dump(mode="json"),
                "candidate": candidate_name(cfg.offload), "why": why, "estimate_missing": reason, "fits": None,
                "estimated_request_seconds": None}
    pinned = cfg.memory.pinned_limit_gib  # as plan_memory judges the pinned part of the host bytes
    pinned_limit = None if pinned is None else MemoryLimit(int(pinned * GIB), "config memory.pinned_limit_gib")
    ev = evaluate(candidate_name(cfg.offload), cfg, shapes, device, lambda off, shape: runner.estimate_memory(shape),
                  device_limit, host_limit, checks.denoise_passes_per_step, pinned_limit)
    compute, note = checks.compute_model(shapes)
    if compute is not None:
        ev.request_seconds = plan_report.request_seconds(plan_report.module_rows(ev, device), compute, cfg.offload)
    judged = MemoryPlan(chosen=ev, rejected=[], shapes=tuple(shapes), device=device, device_limit=device_limit,
                        host_limit=host_limit, why=why, steps_per_request=runner.plan_steps_per_request(),
                        compute=compute, compute_note=note)
    report = plan_report.report(judged, requested)
    report["modules"] = _module_entries(report, ev, device)
    refusal = _first_refusal(runner, shapes)
    return {**base, **report, "fits": refusal is None, "refusal": refusal, "over_limits": ev.reason or None,
            "estimated_request_seconds": planner_seconds(report, judged)}


def describe(out: dict[str, Any]) -> str:
    """The plan for a reader: the choice and why, the limits, per module, the rejected candidates."""
    shapes = ", ".join("x".join(map(str, s)) for s in out["shapes"])
    lines = [(f"memory plan of {out['config_json']}: {out['model_cls']} {out['task']} ({out['runner']}), "
             f"{out['dtype']}, on {out['device']}, shapes {shapes} (height x width x frames)")]
    lines += [f"  {s}" for s in out["estimate_sources"]]
    lines.append("  weights: not read (the plan reads architectures and headers only; a run checks every file as it "
                 "loads)")
    host = (f"{out['host_limit_gib']:.2f} GiB ({out['host_limit_source']})" if out["host_limit_gib"] is not None
            else "unknown (not checked)")
    device = (f"{out['device_limit_gib']:.2f} GiB ({out['device_limit_source']})"
              if out["device_limit_gib"] is not None else "unknown")
    lines.append(f"  limits: device {device}; host {host}")
    if out["refusal"] is not None and out["offload"] is None:
        lines.append(f"  NOTHING FITS: the run would be refused before loading (exit 2): {out['refusal']}")
        return "\n".join(lines)
    lines.append(f"  plan: {out['candidate']}" + (f" -- {out['why']}" if out["why"] else ""))
    lines.append(f"  offload: {json.dumps(out['offload'], separators=(',', ':'))}")
    if out["estimate_missing"] is not None:
        lines.append(f"  no memory numbers: {out['estimate_missing']}; the run starts with this offload config, "
                     "unchecked")
        return "\n".join(lines)
    lines.append(f"  estimated: device {out['device_gib']:.2f} GiB at its peak (stage {out['peak_stage']}, shape "
                 f"{'x'.join(map(str, out['peak_shape']))}), host {out['host_gib']:.2f} GiB")
    seconds, copies = out["estimated_request_seconds"], out.get("request_copy_seconds_estimate")
    compute = out.get("compute_estimate")
    if seconds is not None and compute is not None:
        steps = ", ".join(f"{st['name']} {st['steps']} x {st['seconds_per_step']:.3f} s" for st in compute["stages"])
        lines.append(f"  estimated request time: {seconds:.1f} s (denoising compute per step {steps} on "
                     f"{compute['device']} at {compute['efficiency']:.0%} of {compute['peak_tflops']:.0f} TFLOP/s, "
                     f"overlapped with the streamed copy; + {copies:.2f} s of copies in all)")
    elif seconds is not None:
        lines.append(f"  estimated request time: {seconds:.1f} s")
    elif copies is not None:
        lines.append(f"  estimated host-to-device copies per request: {copies:.2f} s over {out['steps_per_request']} "
                     f"denoising step(s) ({out.get('compute_note') or 'no compute estimate'}: the time model counts "
                     "copies, not compute)")
    else:
        lines.append("  estimated request time: not given (the planner has no time model)")
    if out["copy_per_step_gib"]:
        lines.append(f"  H2D copy per denoising step: {out['copy_per_step_gib']:.2f} GiB "
                     f"({out['passes_per_step']} pass(es)), {out['copy_seconds_per_step_estimate']:.2f} s at the "
                     "assumed rate (prefetch overlaps it with compute)")
    width = max(len(m["placement"]) for m in out["modules"]) if out["modules"] else 9
    lines.append(f"  {'module':<18} {'placement':<{width}} {'device GiB':>10} {'host GiB':>9} {'H2D/step GiB':>12} "
                 f"{'H2D/request GiB':>15}")
    for m in out["modules"]:
        lines.append(f"  {m['name']:<18} {m['placement']:<{width}} {m['device_bytes'] / GIB:>10.2f} "
                     f"{m['host_bytes'] / GIB:>9.2f} {m['copy_bytes_per_step'] / GIB:>12.2f} "
                     f"{m['copy_bytes_per_request'] / GIB:>15.2f}")
    for r in out["rejected"]:
        lines.append(f"  rejected (faster): {r['candidate']}: {r['reason']}")
    if out["refusal"] is not None:
        lines.append(f"  REFUSED: the run would stop before loading (exit 2): {out['refusal']}")
    elif out.get("over_limits"):
        lines.append(f"  over the limits (the run checks the host only with memory.host_limit_gib): "
                     f"{out['over_limits']}")
    return "\n".join(lines)


def check_shape(runner_cls: type[DefaultRunner], config: Any) -> None:
    """The shape `config` plans for, checked as a request of it is checked before loading (the family's
    `validate_shape`: multiples, frame grid; its `shortest_clip`): a plan for a shape no run takes is refused.

    Raises:
        ValueError: naming the field (`target_height`, `target_width`, `target_video_length`), its value and what
            is allowed.
    """
    from runnerkit.config import RequestConfig
    from runnerkit.runners.requests import shape_with_defaults

    height, width, frames = shape_with_defaults(RequestConfig(prompt="plan"), runner_cls.resolve_config(config))
    runner_cls.validate_shape(height, width, frames)
    fewest = runner_cls.shortest_clip(config)
    if frames is not None and 1 < frames < fewest:
        raise ValueError(f"`target_video_length` {frames}: {config.model_cls} takes at least {fewest} frames")


def main(argv: list[str] | None = None) -> int:
    """`runnerkit plan ...` (module docstring); returns the exit status."""
    args = build_parser().parse_args(argv)  # bad or unknown flags: argparse's message, exit 2
    logger.remove()
    logger.add(sys.stderr, level=args.log_level, format=LOG_FORMAT)
    overrides = {"memory.limit_gib": args.device_gib, "memory.host_limit_gib": args.host_gib,
                 "offload.mode": args.offload, "target_height": args.target_height, "target_width": args.target_width,
                 "target_video_length": args.target_video_length, "warmup": True if args.warmup else None}
    flags = {"memory.limit_gib": "--device_gib", "memory.host_limit_gib": "--host_gib", "offload.mode": "--offload"}
    try:
        config = load_runner_config(args.config_json, overrides, flags=flags)
        runner_cls = get_runner_cls(config.model_cls, config.task)
        check_shape(runner_cls, config)
        device = plan_device(config.device, config.memory.limit_gib)
        runner = runner_cls.for_plan(config, device)
        runner.memory_checks.planned_device_name = args.device_name
        out = plan_of(runner, "by the --offload flag" if args.offload is not None else "in the config")
    except (ValueError, NotImplementedError) as exc:  # ConfigError, CheckpointError, the family's settings checks
        logger.error("invalid input: {}: {}", args.config_json, exc)
        return 2
    out["config_json"] = args.config_json
    for key, flag, value in (("device_limit_source", "--device_gib", args.device_gib),
                             ("host_limit_source", "--host_gib", args.host_gib)):
        if value is not None and out[key] is not None:
            out[key] = f"{flag}, as {out[key]}"
    print(json.dumps(out, indent=2) if args.json else describe(out))
    return EXIT_REFUSED if out["fits"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
