"""Request checks of `DefaultRunner`: a request's fields and shape, the memory plan of
`offload.mode` auto (runners/plan.py), and whether a request's estimated peak memory fits the
device (runners/fit.py), all before anything runs.

    validate_request (classmethod, before loading) -> shape_of -> validate_shape
    plan_memory (before loading: check_requests_fit, or init_modules) -> the concrete offload config
    check_requests_fit (before loading) / check_fit (warmup gate, each request) -> MemoryFitError
    resolve_request (each request): the request's defaults filled in -> InputInfo

`RequestChecksMixin` is mixed into `DefaultRunner` (runners/default.py) and reads what that class
supplies: `config`, `device`, `resolve_config` (BaseRunner); `placement`, the family hook
`estimate_memory`, the class settings `SPATIAL_FACTOR`, `TEMPORAL_FACTOR`, `IMAGE_INPUTS`,
`EXTRA_IMAGES`, `RESULT_KINDS`, `DEFAULT_NEGATIVE_PROMPT`, and the `_fit_unchecked_logged` /
`_fit_deferred_logged` flags set in `DefaultRunner.__init__`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from runnerkit import compile as regional_compile
from runnerkit import memory
from runnerkit.admission import AdmittedRequest
from runnerkit.config import OffloadConfig, RequestConfig, RunnerConfig, as_request
from runnerkit.images import check_image
from runnerkit.lora import LoRAError, read_adapter
from runnerkit.runners import fit, offload_checks, plan, plan_compute, plan_report
from runnerkit.runners.fit import MemoryEstimate, MemoryFitError, PeakEstimate
from runnerkit.runners.pipeline import InputInfo, Shape

__all__ = ["RequestChecksMixin"]


class RequestChecksMixin:
    """Request validation and the memory fit check of `DefaultRunner` (see the module docstring)."""

    # ---- request validation ---------------------------------------------------------------
    @classmethod
    def validate_shape(cls, height: int, width: int, frames: int) -> None:
        """Raise ValueError naming the field if the shape breaks the patch/VAE factors."""
        s, t = cls.SPATIAL_FACTOR, cls.TEMPORAL_FACTOR
        if height % s:
            raise ValueError(f"`target_height` must be a multiple of {s} (got {height})")
        if width % s:
            raise ValueError(f"`target_width` must be a multiple of {s} (got {width})")
        if (frames - 1) % t:
            examples = ", ".join(str(t * k + 1) for k in (1, 2, 80 // t))  # 5, 9, 81 for 4; 9, 17, 81 for 8
            raise ValueError(f"`target_video_length` must be {t}n+1, e.g. {examples} (got {frames})")

    @classmethod
    def shape_of(cls, request: RequestConfig, config: RunnerConfig) -> Shape:
        """(height, width, frames) a request runs at (`config` with the family defaults).

        Default: the request's fields, else the config's. A family whose shape follows its inputs
        (e.g. image-to-video keeping the image's aspect ratio) overrides this; its image inputs
        have already been checked by `validate_request` when it is called.
        """
        return (request.target_height or config.target_height, request.target_width or config.target_width,
                request.target_video_length or config.target_video_length)

    @classmethod
    def validate_request(cls, request: RequestConfig, config: RunnerConfig) -> None:
        """Check a request against the runner before anything loads (`config` as given by the user).

        Raises:
            ValueError: naming the field: `lora` adapters that are not readable adapter files
                (`runnerkit.lora.LoRAError`, naming the file) or without the config's `lora`; image
                inputs the task does not take, lacks, or that are
                not readable images (`runnerkit.images.ImageInputError`), shape factors, a result
                file suffix that does not fit the task's primary output.
        """
        config = cls.resolve_config(config)
        if request.negative_prompt is not None and not config.enable_cfg:
            raise ValueError("`negative_prompt` only acts with classifier-free guidance, but the runner's "
                             "`enable_cfg` is false: remove it from the request")
        task_inputs = cls.IMAGE_INPUTS.get(config.task, ())
        for field in ("image_path", "last_frame_path"):
            value = getattr(request, field)
            if value is not None and field not in task_inputs:
                raise ValueError(f"`{field}` is not used by task {config.task!r} (got {value!r}); image inputs of "
                                 f"this task: {', '.join(f'`{f}`' for f in task_inputs) or 'none'}")
            if field in task_inputs:
                if value is None:
                    flag = "--" + field
                    raise ValueError(f"`{field}` ({flag}) is required by task {config.task!r}: give an image file")
                check_image(value, field)
        extra, most = request.extra_image_paths or [], cls.EXTRA_IMAGES.get(config.task, 0)
        if len(extra) > most:
            raise ValueError(f"`extra_image_paths` holds {len(extra)} image(s); task {config.task!r} takes at most "
                             f"{most} after `image_path`" + ("" if most else " (it takes no further references)"))
        for k, value in enumerate(extra):
            check_image(value, f"extra_image_paths[{k}]")
        for path, _ in cls.lora_specs(request, config):  # format, pairs and ranks; layer names once loaded
            try:
                read_adapter(path, header_only=True)
            except LoRAError as exc:
                raise LoRAError(f"`lora`: {exc}") from None
        h, w, f = cls.shape_of(request, config)
        cls.validate_shape(h, w, f)
        if request.save_result_path:
            suffix = Path(request.save_result_path).suffix.lower()
            kind = cls.RESULT_KINDS.get(config.task, "video")
            allowed = {"video": (".mp4", ".png") if f == 1 else (".mp4",), "image": (".png",), "audio": (".wav",)}[kind]
            if suffix not in allowed:
                what = f"a {f}-frame video" if kind == "video" else f"an {kind}" if kind == "image" else "audio"
                hint = " (.png: with target_video_length 1)" if kind == "video" and f != 1 else ""
                raise ValueError(f"`save_result_path` {request.save_result_path!r}: task {config.task!r} makes {what}; "
                                 f"use {' or '.join(allowed)}{hint}")

    def request_shape(self, request: RequestConfig) -> Shape:
        """(height, width, frames) of `request`, the config's defaults filled in (`shape_of`)."""
        return self.shape_of(request, self.config)

    # ---- memory plan (runners/plan.py) ------------------------------------------------------
    def memory_device(self) -> torch.device:
        """The device whose memory the plan and the fit check model: the compute device. (Tests plan
        for a CUDA device while computing on the CPU by replacing this.)"""
        return self.device

    def device_budget(self) -> memory.MemoryLimit | None:
        """The device memory this run plans and checks against (`memory.device_budget`: the limit less
        the headroom kept for the CUDA libraries), read at the first call and kept for the runner's life.
        `plan_memory` makes the first call, before anything loads (the launch script's
        `check_requests_fit` or `init_modules`'s plan phase), so the planner, the warmup gate and every
        request's check judge against one number (a re-read after loading would see the libraries' own
        allocations and refuse what the plan accepted). None: the device's memory cannot be read."""
        if not self._budget_read:
            self._budget = memory.device_budget(self.memory_device(), self.config.memory.limit_gib)
            self._budget_read = True
        return self._budget

    def host_budget(self) -> memory.MemoryLimit | None:
        """The host memory the plan judges against: `memory.host_limit_gib`, else the host's available memory
        (`memory.host_available_bytes`: MemAvailable, or the cgroup's limit less its usage if smaller) plus what
        this process holds already. None: unknown (the plan then checks no host limit)."""
        cfg = self.config
        if cfg.memory.host_limit_gib is not None:
            return memory.MemoryLimit(int(cfg.memory.host_limit_gib * fit.GIB), "config memory.host_limit_gib")
        found = memory.host_available_bytes()
        rss = int(memory.host_memory().rss_gib * fit.GIB)
        return None if found is None else memory.MemoryLimit(
            found[0] + rss, f"{found[0] / fit.GIB:.2f} GiB available ({found[1]}) + {rss / fit.GIB:.2f} GiB "
                            "held by this process")

    def estimate_sources(self) -> list[str]:
        """Family hook: where the memory estimate before loading takes the architecture from, and what it
        assumes beyond it (`runnerkit plan` prints these lines). Default: the checkpoint's own architecture
        (the configured one for a synthetic checkpoint still to write)."""
        cfg = self.config
        if cfg.model_path is None:
            return ["architecture: the config's `model` (its synthetic checkpoint)"]
        over = ", the config's `model` over it" if cfg.model else ""
        return [f"architecture: the checkpoint's own ({cfg.model_path}){over}"]

    def denoise_passes_per_step(self, offload: OffloadConfig | None = None) -> int:
        """Passes through the streamed transformer blocks per denoising step under `offload` (default:
        the config's), for the plan's copy volume: 1 without CFG; with CFG 1 where the family runs both
        branches through each block in one pass (`CFG_ONE_PASS`, mode block: docs/cfg_one_pass.md),
        else 2 (one forward per branch)."""
        offload = offload or self.config.offload
        if not self.config.enable_cfg:
            return 1
        return 1 if getattr(self, "CFG_ONE_PASS", False) and offload.mode == "block" else 2

    def plan_steps_per_request(self) -> int:
        """Denoising steps of one request over all its stages, for the plan's copy time per request (the
        streamed transformers' copies repeat every step): `infer_steps`; a family with more stages overrides."""
        return self.config.infer_steps or 1

    #: The device name the plan's compute estimate looks its peak up by (`runnerkit plan --device_name`); None:
    #: the CUDA device's own name (runners/plan_compute.py).
    planned_device_name: str | None = None

    def denoise_flops(self, shape: Shape) -> tuple[plan_compute.StageFlops, ...] | None:
        """Family hook: per denoising stage, its steps and the FLOPs of one step at `shape` (every CFG pass), from
        the architecture alone, for the plan's request time (runners/plan_compute.py). None: no FLOP count."""
        return None

    def compute_model(self, shapes: Sequence[Shape]) -> tuple[plan_compute.ComputeModel | None, str]:
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
            counts = [self.denoise_flops(shape) for shape in shapes]
        except fit.EstimateUnavailable as exc:
            return None, f"no compute estimate: {exc}"
        largest = max(counts, key=lambda st: sum(s.steps * s.flops for s in st or ()), default=None)
        return plan_compute.compute_model(largest, name, self.config.compile.enabled)

    @contextmanager
    def _offload_for_estimate(self, offload: OffloadConfig) -> Iterator[None]:
        """`self.config.offload` reads `offload` inside the block (the family's `estimate_memory`
        reads the run config); restored after it. Before loading only: the config is not locked."""
        assert not self._config_locked, "the plan is made before loading"
        saved = self._config
        self._config = saved.model_copy(update={"offload": offload})
        try:
            yield
        finally:
            self._config = saved

    def _estimate_with(self, offload: OffloadConfig, shape: Shape) -> MemoryEstimate:
        with self._offload_for_estimate(offload):
            try:
                estimate = self.estimate_memory(shape)
            except fit.EstimateUnavailable as exc:
                raise NotImplementedError(f"`offload.mode`='auto' plans from {type(self).__name__}'s memory estimate "
                                          f"before loading, which is not available: {exc}; choose `offload.mode` "
                                          "yourself") from None
        if estimate is None:
            raise NotImplementedError(f"`offload.mode`='auto' needs a memory estimate, and {type(self).__name__} "
                                      f"(model_cls {self.config.model_cls!r}) gives none (estimate_memory): choose "
                                      "`offload.mode` none/model/block/phase yourself")
        return estimate

    def _estimate_before_load(self, offload: OffloadConfig) -> MemoryEstimate | None:
        """The estimate of the config's default shape under `offload`; None where the family gives none before
        loading (its load then checks what this would)."""
        cfg = self.config
        with self._offload_for_estimate(offload):
            try:
                return self.estimate_memory((cfg.target_height, cfg.target_width, cfg.target_video_length))
            except fit.EstimateUnavailable:
                return None

    def _plan_supports(self, offload: OffloadConfig) -> str | None:
        """Why this run cannot use `offload` (compile, warmup's offload modes), or None."""
        try:
            regional_compile.check_supported(self.config.compile, offload, self.config.unload_modules, self.device)
        except NotImplementedError as exc:
            return str(exc)
        modes = self._opt_in("WARMUP_OFFLOAD_MODES")
        mode = "lazy_load" if offload.lazy_load else offload.mode
        if self.config.warmup and modes is not None and mode not in modes:
            return f"warmup of {type(self).__name__} does not support offload mode {mode!r} (supported: {list(modes)})"
        return None

    def plan_memory(self, shapes: Sequence[Shape]) -> plan.MemoryPlan | None:
        """Resolve `offload.mode` auto into a concrete offload config before anything loads (runners/plan.py);
        a no-op (None) for any other mode.

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
                or `offload.keep_across_stages` the family's modules refuse (runners/offload_checks.py).
        """
        cfg = self.config
        offload_checks.check_offload_modules(cfg, self._estimate_before_load, type(self).__name__)
        # read here, before loading, and kept: every later check judges against the same number
        device_limit = self.device_budget() if cfg.memory.check_fit or cfg.offload.mode == "auto" else None
        if cfg.offload.mode != "auto":
            return None
        chosen = "mode" in cfg.offload.model_fields_set
        if not chosen and (default := self._resident_by_default(device_limit)):
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
                self.update_config(offload=resident)
                return None
        shapes = list(shapes) or [(cfg.target_height, cfg.target_width, cfg.target_video_length)]
        if cfg.warmup:
            shapes += list(self.warmup_shapes())
        device = self.memory_device()
        if device_limit is None:
            raise ValueError(f"`offload.mode`='auto': the memory of device {device} cannot be read; set "
                             "`memory.limit_gib`")
        host_limit = self.host_budget()
        result = plan.plan_offload(cfg, shapes, device, self._estimate_with, device_limit, host_limit,
                                   self.denoise_passes_per_step, self._plan_supports,
                                   (self.SPATIAL_FACTOR, self.TEMPORAL_FACTOR), self.plan_steps_per_request(),
                                   pinned_limit=None if cfg.memory.pinned_limit_gib is None else memory.MemoryLimit(
                                       int(cfg.memory.pinned_limit_gib * fit.GIB), "config memory.pinned_limit_gib"),
                                   **dict(zip(("compute", "compute_note"), self.compute_model(shapes))))
        if not chosen:
            logger.info("memory plan: `offload.mode` not set, so the plan is automatic (`offload.mode` 'none' keeps "
                        "every module resident, or refuses)")
        logger.info(plan_report.describe(result))
        self.profiler.memory_plan = plan_report.report(result, cfg.offload)
        self.update_config(offload=result.offload)
        return result

    def _resident_by_default(self, device_limit: memory.MemoryLimit | None) -> tuple[str, bool] | None:
        """Why a config that does not set `offload.mode` (auto by default) keeps every module resident
        without a plan, and whether a plan could be made all the same (for offload keys that resident
        cannot take); None to plan. Resident, a plan possible: the memory check is off, the device is the
        CPU, or its memory cannot be read (the plan then says to set `memory.limit_gib`). Resident, no plan
        possible: `unload_modules` places the modules itself, or the family has no estimate before loading.
        The CPU is judged before the estimate, which may read the checkpoint (the load reports its damage)."""
        cfg = self.config
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
        cfg = self.config
        shape = (cfg.target_height, cfg.target_width, cfg.target_video_length)
        with self._offload_for_estimate(OffloadConfig(mode="none")):
            try:
                estimate = self.estimate_memory(shape)
            except fit.EstimateUnavailable as exc:
                return f"the memory estimate is not available before loading ({exc})"
        if estimate is None:
            return f"{type(self).__name__} gives no memory estimate (estimate_memory) to plan from"
        return None

    # ---- memory fit (runners/fit.py) --------------------------------------------------------
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
        if self.config.offload.mode == "auto":  # checked before init_modules (the API): plan first
            self.plan_memory(())
        cfg = self.config
        if not cfg.memory.check_fit:
            return None
        try:
            estimate = self.estimate_memory(shape)
        except fit.EstimateUnavailable as exc:
            if not self._fit_deferred_logged:
                logger.info("memory check: waits for the load, then checks each request before it runs: {}", exc)
                self._fit_deferred_logged = True
            return None
        if estimate is None:
            self._log_unchecked(f"{type(self).__name__} gives no memory estimate (estimate_memory)")
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
                raise MemoryFitError(fit.host_refusal_message(what, shape, host, cfg.memory.host_limit_gib, device,
                                                              cfg, estimate,
                                                              lambda off: self._estimate_with(off, shape)))
        if cfg.memory.pinned_limit_gib is not None and device.type != "cpu":
            host = fit.host_bytes_of(estimate, cfg, device)
            if host.pinned_bytes > cfg.memory.pinned_limit_gib * fit.GIB:
                raise MemoryFitError(f"{what}: shape {list(shape)} needs an estimated {host.pinned_bytes / fit.GIB:.2f} "
                                     f"GiB of pinned host memory ({host.describe()}), more than config "
                                     f"memory.pinned_limit_gib ({cfg.memory.pinned_limit_gib} GiB). Try "
                                     "`offload.pin_memory`=false (pageable copies, slower), offload storage 'disk' "
                                     "(one staging slab per slot), or `offload.mode`='auto'")
        logger.debug("{}: shape {} fits: estimated {} of {:.2f} GiB ({})", what, list(shape), peak.describe(),
                     limit.bytes / fit.GIB, limit.source)
        return peak

    def _log_unchecked(self, reason: str) -> None:
        if not self._fit_unchecked_logged:
            logger.info("memory check: requests are not checked against the device's memory: {}", reason)
            self._fit_unchecked_logged = True

    def check_requests_fit(self, requests: Sequence[RequestConfig]) -> None:
        """Plan `offload.mode` auto for every request's shape (`plan_memory`), then check every
        request's shape, before anything loads (the launch script calls this first).

        Raises:
            MemoryFitError: for the first request that cannot fit (its index and source in the
                message), or no offload plan fits.
            NotImplementedError: `offload.mode` auto for a family without an estimate before loading.
        """
        self.plan_memory([self.request_shape(r) for r in requests])
        peaks: dict[Shape, PeakEstimate | None] = {}
        for index, request in enumerate(requests):
            shape = self.request_shape(request)
            if shape not in peaks:
                peaks[shape] = self.check_fit(shape, f"request {index} ({request.source})")
        checked = {s: p for s, p in peaks.items() if p is not None}
        if checked:
            shape, peak = max(checked.items(), key=lambda item: item[1].bytes)
            logger.info("memory check: {} request(s) fit; largest estimate {} for shape {}", len(requests),
                        peak.describe(), list(shape))

    def resolve_request(self, request: RequestConfig | dict[str, Any]) -> InputInfo:
        """Fill request defaults from the runner config and validate the request (`validate_request`), unless
        the entry point admitted it already (`runnerkit.admission.admit`: an `AdmittedRequest`).

        Raises:
            ValueError: an invalid request (a dict is validated as a `RequestConfig` first).
            TypeError: `request` is neither a `RequestConfig` nor a dict.
        """
        cfg = self.config
        request = as_request(request)
        if not isinstance(request, AdmittedRequest):  # the Python API: nothing checked it yet
            self.validate_request(request, cfg)
        height, width, frames = self.shape_of(request, cfg)
        return InputInfo(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt if request.negative_prompt is not None
            else (cfg.negative_prompt if cfg.negative_prompt is not None else self.DEFAULT_NEGATIVE_PROMPT),
            seed=request.seed if request.seed is not None else cfg.seed,
            height=height,
            width=width,
            frames=frames,
            save_result_path=request.save_result_path,
            save_tensor_path=request.save_tensor_path,
            image_path=request.image_path,
            last_frame_path=request.last_frame_path,
            extra_image_paths=tuple(request.extra_image_paths or ()),
            lora=self.lora_specs(request, cfg),
        )

    @staticmethod
    def lora_specs(request: RequestConfig, config: RunnerConfig) -> tuple[tuple[str, float], ...]:
        """The request's adapters as ((path, strength), ...), names of `config.lora.adapters` resolved.

        Raises:
            ValueError: `lora` in a request while the config has no `lora` section; an adapter that is
                neither a name of `lora.adapters` nor an existing path (naming `lora[i].path` and the names),
                or a folder.
        """
        if not request.lora:
            return ()
        if config.lora is None:
            raise ValueError("`lora`: this runner's config has no `lora` section, so requests cannot carry adapters; "
                             'add `"lora": {}` (or {"mode": "fused"}) to the config')
        known = config.lora.adapters
        for i, a in enumerate(request.lora):
            if a.path not in known and not Path(a.path).exists():
                names = sorted(known) or "none: the config's `lora.adapters` is empty"
                raise ValueError(f"`lora[{i}].path`={a.path!r} is neither a name of the config's `lora.adapters` "
                                 f"(names: {names}) nor an existing .safetensors file")
            if a.path not in known and Path(a.path).is_dir():
                raise ValueError(f"`lora[{i}].path`={a.path!r} is a folder: give an adapter's .safetensors file or a "
                                 "name of the config's `lora.adapters`")
        return tuple((known.get(a.path, a.path), a.strength) for a in request.lora)
