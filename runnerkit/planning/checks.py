"""The memory checks a runner holds (`runner.memory_checks`, made in `DefaultRunner.__init__`): the plan of
`offload.mode` auto (planning/planner.py) and whether a shape's estimated peak memory fits the device
(planning/fit.py), all judged against one device budget read before anything loads.

    plan_memory (before loading: check_requests_fit, or init_modules) -> the concrete offload config
    check_requests_fit (the launch script, before loading) / check_request (admission's `fit` rule, each request
    the runner serves) / check_fit (the warmup gate) -> MemoryFitError

A request checked before it runs (the launch script's `check_requests_fit`, the server's admission) carries the
shape it was checked for (`AdmittedRequest.fit_checked`); `check_request` does not check it again before its first
stage: the budget is kept for the runner's life, so a second check would give the same answer.

`MemoryChecks` asks its runner (a `DefaultRunner`) for what the family knows, through the hooks declared at
the end of `DefaultRunner`'s class body: `estimate_memory` (planning/fit.py: what an estimate holds),
`denoise_flops` and `plan_steps_per_request` (the plan's request time, planning/compute.py), and reads its
`config`, `device`, `warmup_shapes`, the class settings `SPATIAL_FACTOR`, `TEMPORAL_FACTOR`, `CFG_ONE_PASS` and
the warmup opt-in `WARMUP_OFFLOAD_MODES` (from the class's own body). It writes the plan into the run config
(`update_config`, before the lock) and the profile (`profiler.memory_plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

from runnerkit import compile as regional_compile
from runnerkit import allocator, memory
from runnerkit.admission import AdmittedRequest
from runnerkit.config import OffloadConfig, RequestConfig
from runnerkit.planning import compute, fit, host_advice, offload_checks, planner, report
from runnerkit.planning.fit import MemoryEstimate, MemoryFitError, PeakEstimate
from runnerkit.runners.pipeline import Shape

if TYPE_CHECKING:
    from runnerkit.runners.default import DefaultRunner

__all__ = ["MemoryChecks", "default_sources"]


def default_sources(config: Any) -> list[str]:
    """`DefaultRunner.estimate_sources` by default: the checkpoint's own architecture (the configured one for a
    synthetic checkpoint still to write)."""
    if config.model_path is None:
        return ["architecture: the config's `model` (its synthetic checkpoint)"]
    over = ", the config's `model` over it" if config.model else ""
    return [f"architecture: the checkpoint's own ({config.model_path}){over}"]


class MemoryChecks:
    """The memory plan and fit checks of one runner (see the module docstring).

    Attributes:
        runner: the runner whose family estimates memory.
        planned_device_name: the device name the plan's compute estimate looks its peak up by (`runnerkit plan
            --device_name`); None: the CUDA device's own name (planning/compute.py).
        unchecked_logged, deferred_logged: the notices "requests are not checked" and "checked once loaded" were
            logged (once per runner).
    """

    def __init__(self, runner: DefaultRunner) -> None:
        self.runner = runner
        self.planned_device_name: str | None = None
        self.unchecked_logged = False
        self.deferred_logged = False
        self._budget: memory.MemoryLimit | None = None  # device_budget(): read once, before loading
        self._budget_read = False

    # ---- limits ---------------------------------------------------------------------------------------------
    def memory_device(self) -> torch.device:
        """The device whose memory the plan and the fit check model: the runner's compute device. (Tests plan
        for a CUDA device while computing on the CPU by replacing this.)"""
        return self.runner.device

    def device_budget(self) -> memory.MemoryLimit | None:
        """The device memory this run plans and checks against (`memory.device_budget`: the limit less
        the headroom kept for the CUDA libraries), read at the first call and kept for the runner's life.
        `plan_memory` makes the first call, before anything loads (the launch script's
        `check_requests_fit` or `init_modules`'s plan phase), so the planner, the warmup gate and every
        request's check judge against one number (a re-read after loading would see the libraries' own
        allocations and refuse what the plan accepted). None: the device's memory cannot be read."""
        if not self._budget_read:
            self._budget = memory.device_budget(self.memory_device(), self.runner.config.memory.limit_gib)
            self._budget_read = True
        return self._budget

    def host_budget(self) -> memory.MemoryLimit | None:
        """The host memory the plan judges against: `memory.host_limit_gib`, else the host's available memory
        (`memory.host_available_bytes`: MemAvailable, or the cgroup's limit less its usage if smaller) plus what
        this process holds already. None: unknown (the plan then checks no host limit)."""
        cfg = self.runner.config
        if cfg.memory.host_limit_gib is not None:
            return memory.MemoryLimit(int(cfg.memory.host_limit_gib * fit.GIB), "config memory.host_limit_gib")
        found = memory.host_available_bytes()
        rss = int(memory.host_memory().rss_gib * fit.GIB)
        return None if found is None else memory.MemoryLimit(
            found[0] + rss, f"{found[0] / fit.GIB:.2f} GiB available ({found[1]}) + {rss / fit.GIB:.2f} GiB "
                            "held by this process")

    # ---- what the plan asks per candidate -------------------------------------------------------------------
    def denoise_passes_per_step(self, offload: OffloadConfig | None = None) -> int:
        """Passes through the streamed transformer blocks per denoising step under `offload` (default:
        the config's), for the plan's copy volume: 1 without CFG; with CFG 1 where the family runs both
        branches through each block in one pass (`CFG_ONE_PASS`, mode block: docs/cfg_one_pass.md),
        else 2 (one forward per branch)."""
        config = self.runner.config
        offload = offload or config.offload
        if not config.enable_cfg:
            return 1
        return 1 if self.runner.CFG_ONE_PASS and offload.mode == "block" else 2

    def compute_model(self, shapes: Sequence[Shape]) -> tuple[compute.ComputeModel | None, str]:
        """The plan's compute model for the largest of `shapes` by FLOPs, or (None, why there is none): the CPU, a
        device without a name here (no CUDA and no `planned_device_name`) or not in the table, a family without
        a FLOP count, or an architecture not readable before loading."""
        device = self.memory_device()
        if device.type != "cuda":
            return None, f"no compute estimate: the device is {device.type}"
        name = self.planned_device_name
        if name is None and torch.cuda.is_available():
            try:
                name = torch.cuda.get_device_name(device)
            except (RuntimeError, AssertionError):  # a device index this machine lacks
                name = None
        try:
            counts = [self.runner.denoise_flops(shape) for shape in shapes]
        except fit.EstimateUnavailable as exc:
            return None, f"no compute estimate: {exc}"
        largest = max(counts, key=lambda st: sum(s.steps * s.flops for s in st or ()), default=None)
        return compute.compute_model(largest, name, self.runner.config.compile.enabled)

    def estimate_with(self, offload: OffloadConfig, shape: Shape) -> MemoryEstimate:
        """The family's estimate of `shape` with the run config's offload replaced by `offload` (before loading).

        Raises:
            NotImplementedError: the family gives no estimate, or cannot before loading (naming the runner).
        """
        runner = self.runner
        with runner.config_trial(offload=offload):
            try:
                estimate = runner.estimate_memory(shape)
            except fit.EstimateUnavailable as exc:
                raise NotImplementedError(f"`offload.mode`='auto' plans from {type(runner).__name__}'s memory estimate "
                                          f"before loading, which is not available: {exc}; choose `offload.mode` "
                                          "yourself") from None
        if estimate is None:
            raise NotImplementedError(f"`offload.mode`='auto' needs a memory estimate, and {type(runner).__name__} "
                                      f"(model_cls {runner.config.model_cls!r}) gives none (estimate_memory): choose "
                                      "`offload.mode` none/model/block/phase yourself")
        return estimate

    def default_shape(self) -> Shape:
        """(height, width, frames) of a request that sets no shape field: the config's defaults through the
        family's `shape_of` (a family that predicts the frame count gives its largest one)."""
        return self.runner.shape_of(RequestConfig(prompt="-"), self.runner.config)

    def _estimate_before_load(self, offload: OffloadConfig) -> MemoryEstimate | None:
        """The estimate of the config's default shape under `offload`; None where the family gives none before
        loading (its load then checks what this would)."""
        runner = self.runner
        with runner.config_trial(offload=offload):
            try:
                return runner.estimate_memory(self.default_shape())
            except fit.EstimateUnavailable:
                return None

    def plan_supports(self, offload: OffloadConfig) -> str | None:
        """Why this run cannot use `offload` (compile, warmup's offload modes), or None."""
        runner = self.runner
        cfg = runner.config
        try:
            regional_compile.check_supported(cfg.compile, offload, cfg.unload_modules, runner.device)
        except NotImplementedError as exc:
            return str(exc)
        modes = type(runner).__dict__.get("WARMUP_OFFLOAD_MODES")  # the warmup opt-in: the class's own, not inherited
        mode = "lazy_load" if offload.lazy_load else offload.mode
        if cfg.warmup and modes is not None and mode not in modes:
            return (f"warmup of {type(runner).__name__} does not support offload mode {mode!r} "
                    f"(supported: {list(modes)})")
        return None

    # ---- the plan ---------------------------------------------------------------------------------------------
    def plan_memory(self, shapes: Sequence[Shape]) -> planner.MemoryPlan | None:
        """Resolve `offload.mode` auto into a concrete offload config before anything loads (planning/planner.py);
        a no-op (None) for any other mode. First, on a runner that will load, sets the CUDA caching allocator the
        plan's allocated bytes assume (`memory.expandable_segments`, runnerkit/allocator.py).

        Plans for `shapes` (the launch script: every request's; empty: the config's default shape) and,
        with `warmup`, the warmup shapes. Limits: the device budget (`device_budget`: `memory.limit_gib`
        else what the device offers, less the headroom for the CUDA libraries); `memory.host_limit_gib`
        else the host's available memory plus what this process holds already. Logs the plan (INFO),
        records it in the profile (`memory_plan`)
        and writes the chosen config into the run config (`update_config`, before the lock).

        Raises:
            MemoryFitError: nothing fits (the GiB missing; what would fit).
            NotImplementedError: the family gives no estimate, or cannot before loading.
            ValueError: the device's memory cannot be read (set `memory.limit_gib`); `offload.resident_modules`
                or `offload.keep_across_stages` the family's modules refuse (planning/offload_checks.py).
        """
        runner = self.runner
        cfg = runner.config
        if not runner.plan_only:  # the allocator the plan's allocated bytes assume, before anything is reserved
            allocator.configure_cuda_allocator(runner.device, cfg.memory.expandable_segments)
        offload_checks.check_offload_modules(cfg, self._estimate_before_load, type(runner).__name__)
        # read here, before loading, and kept: every later check judges against the same number
        device_limit = self.device_budget() if cfg.memory.check_fit or cfg.offload.mode == "auto" else None
        if cfg.offload.mode != "auto":
            return None
        chosen = "mode" in cfg.offload.model_fields_set
        if not chosen and (default := self.resident_by_default(device_limit)):
            why, plannable = default
            keys = cfg.offload.model_dump(exclude_unset=True)
            try:
                resident = OffloadConfig.model_validate({**keys, "mode": "none"})
            except ValueError:  # keys of another mode are set: they constrain a plan, as with explicit auto
                missing = None if not plannable else self._estimate_missing()
                if not plannable or missing:
                    raise ValueError(f"`offload` sets {sorted(keys)} but no `offload.mode`, and the default plan "
                                     f"cannot be made: {missing or why}; set `offload.mode` to the mode they belong "
                                     "to ('model', 'block' or 'phase')") from None
            else:
                logger.info("memory plan: `offload.mode` not set, every module resident: {}", why)
                runner.update_config(offload=resident)
                return None
        shapes = list(shapes) or [self.default_shape()]
        own = tuple(shapes)  # what requests and target sizes choose; warmup's are the family's
        if cfg.warmup:
            shapes += list(runner.warmup_shapes())
        device = self.memory_device()
        if device_limit is None:
            raise ValueError(f"`offload.mode`='auto': the memory of device {device} cannot be read; set "
                             "`memory.limit_gib`")
        host_limit = self.host_budget()
        result = planner.plan_offload(cfg, shapes, device, self.estimate_with, device_limit, host_limit,
                                      self.denoise_passes_per_step, self.plan_supports,
                                      (runner.SPATIAL_FACTOR, runner.TEMPORAL_FACTOR), runner.plan_steps_per_request(),
                                      pinned_limit=None if cfg.memory.pinned_limit_gib is None else memory.MemoryLimit(
                                          int(cfg.memory.pinned_limit_gib * fit.GIB), "config memory.pinned_limit_gib"),
                                      **dict(zip(("compute", "compute_note"), self.compute_model(shapes))),
                                      fixed_shapes=tuple(runner.warmup_shapes()) if cfg.warmup else (),
                                      own_shapes=own)
        if not chosen:
            logger.info("memory plan: `offload.mode` not set, so the plan is automatic (`offload.mode` 'none' keeps "
                        "every module resident, or refuses)")
        logger.info(report.describe(result))
        runner.profiler.memory_plan = report.report(result, cfg.offload)
        runner.update_config(offload=result.offload)
        return result

    def resident_by_default(self, device_limit: memory.MemoryLimit | None) -> tuple[str, bool] | None:
        """Why a config that does not set `offload.mode` (auto by default) keeps every module resident
        without a plan, and whether a plan could be made all the same (for offload keys that resident
        cannot take); None to plan. Resident, a plan possible: the memory check is off, the device is the
        CPU, or its memory cannot be read (the plan then says to set `memory.limit_gib`). Resident, no plan
        possible: `unload_modules` places the modules itself, or the family has no estimate before loading.
        The CPU is judged before the estimate, which may read the checkpoint (the load reports its damage)."""
        cfg = self.runner.config
        if not cfg.memory.check_fit:
            return "`memory.check_fit` is false", True
        if cfg.unload_modules:
            return "`unload_modules` loads each module for its stage", False
        if self.memory_device().type == "cpu":  # the plan would take resident first: the same, without a plan
            return ("on the CPU the weights live in host memory whatever the mode, so offload cannot lower the "
                    "peak", True)
        if device_limit is None:
            return f"the memory of device {self.memory_device()} cannot be read", True
        missing = self._estimate_missing()
        return (missing, False) if missing else None

    def _estimate_missing(self) -> str | None:
        """Why the family gives no memory estimate before loading, or None when it does."""
        runner = self.runner
        shape = self.default_shape()
        with runner.config_trial(offload=OffloadConfig(mode="none")):
            try:
                estimate = runner.estimate_memory(shape)
            except fit.EstimateUnavailable as exc:
                return f"the memory estimate is not available before loading ({exc})"
        if estimate is None:
            return f"{type(runner).__name__} gives no memory estimate (estimate_memory) to plan from"
        return None

    # ---- the fit of a shape -----------------------------------------------------------------------------------
    def check_fit(self, shape: Shape, what: str) -> PeakEstimate | None:
        """Refuse `shape` if its estimated peak memory exceeds the device's limit; return the estimate.

        The limit is the run's device budget (`device_budget`, read once before loading: `memory.limit_gib`,
        else CUDA free + held by this process, CPU available host memory; less the CUDA headroom).
        Returns None without a check: `memory.check_fit` false, no family estimate, an estimate not
        available before loading (`fit.EstimateUnavailable`: checked again before each request), or
        a device whose memory cannot be read (each logged once).

        Raises:
            MemoryFitError: naming `what`, the shape, the estimate, the limit and what to change.
        """
        runner = self.runner
        if runner.config.offload.mode == "auto":  # checked before init_modules (the API): plan first
            self.plan_memory(())
        cfg = runner.config
        if not cfg.memory.check_fit:
            return None
        try:
            estimate = runner.estimate_memory(shape)
        except fit.EstimateUnavailable as exc:
            if not self.deferred_logged:
                logger.info("memory check: waits for the load, then checks each request before it runs: {}", exc)
                self.deferred_logged = True
            return None
        if estimate is None:
            self._log_unchecked(f"{type(runner).__name__} gives no memory estimate (estimate_memory)")
            return None
        device = self.memory_device()
        limit = self.device_budget()
        if limit is None:
            self._log_unchecked(f"the memory of device {device} cannot be read; set memory.limit_gib")
            return None
        peak = fit.peak_of(estimate, cfg, device)
        if peak.bytes > limit.bytes:
            raise MemoryFitError(fit.refusal_message(what, shape, peak, limit.bytes, limit.source, device, cfg,
                                                     estimate.hints))
        if cfg.memory.host_limit_gib is not None:
            host = fit.host_bytes_of(estimate, cfg, device)
            if host.bytes > cfg.memory.host_limit_gib * fit.GIB:
                raise MemoryFitError(host_advice.host_refusal_message(what, shape, host, cfg.memory.host_limit_gib,
                                                                      device, cfg, estimate,
                                                                      lambda off: self.estimate_with(off, shape)))
        if cfg.memory.pinned_limit_gib is not None and device.type != "cpu":
            host = fit.host_bytes_of(estimate, cfg, device)
            if host.pinned_bytes > cfg.memory.pinned_limit_gib * fit.GIB:
                raise MemoryFitError(f"{what}: shape {list(shape)} needs an estimated "
                                     f"{host.pinned_bytes / fit.GIB:.2f} GiB of pinned host memory ({host.describe()}), more than config "
                                     f"memory.pinned_limit_gib ({cfg.memory.pinned_limit_gib} GiB). Try "
                                     + host_advice.pinned_options(cfg, cfg.memory.pinned_limit_gib, device,
                                                                  lambda off: self.estimate_with(off, shape)))
        logger.debug("{}: shape {} fits: estimated {} of {:.2f} GiB ({})", what, list(shape), peak.describe(),
                     limit.bytes / fit.GIB, limit.source)
        return peak

    def _log_unchecked(self, reason: str) -> None:
        if not self.unchecked_logged:
            logger.info("memory check: requests are not checked against the device's memory: {}", reason)
            self.unchecked_logged = True

    def check_request(self, request: RequestConfig | dict[str, Any], shape: Shape, what: str) -> PeakEstimate | None:
        """`check_fit` of a request's `shape`, unless the request was admitted with its fit checked at that shape
        (`AdmittedRequest.fit_checked`: the launch script's `check_requests_fit`, the server's admission); an
        admitted request whose check came back with an estimate records it. Returns the estimate; None also
        when the check was made before.

        Raises:
            MemoryFitError: see `check_fit`.
        """
        admitted = isinstance(request, AdmittedRequest)
        if admitted and request.fit_checked == shape:  # the same kept budget: a second check gives the same answer
            return None
        peak = self.check_fit(shape, what)
        if admitted and peak is not None:
            request.record_fit_check(shape)
        return peak

    def check_requests_fit(self, requests: Sequence[RequestConfig]) -> None:
        """Plan `offload.mode` auto for every request's shape (`plan_memory`), then check every
        request's shape, before anything loads (the launch script calls this first). Each admitted request whose
        shape was checked with an estimate records it (`AdmittedRequest.fit_checked`).

        Raises:
            MemoryFitError: for the first request that cannot fit (its index and source in the
                message), or no offload plan fits.
            NotImplementedError: `offload.mode` auto for a family without an estimate before loading.
        """
        self.plan_memory([self.runner.request_shape(r) for r in requests])
        peaks: dict[Shape, PeakEstimate | None] = {}
        for index, request in enumerate(requests):
            shape = self.runner.request_shape(request)
            if shape not in peaks:
                peaks[shape] = self.check_fit(shape, f"request {index} ({request.source})")
            if peaks[shape] is not None and isinstance(request, AdmittedRequest):
                request.record_fit_check(shape)
        checked = {s: p for s, p in peaks.items() if p is not None}
        if checked:
            shape, peak = max(checked.items(), key=lambda item: item[1].bytes)
            logger.info("memory check: {} request(s) fit; largest estimate {} for shape {}", len(requests),
                        peak.describe(), list(shape))
