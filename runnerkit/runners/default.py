"""DefaultRunner: serves a family's pipeline description (runners/pipeline.py).

The family returns a `Pipeline` from `describe_pipeline()` and fills in a few hooks; this class
runs it, for requests and for warmup alike (ARCHITECTURE §2, §3):

    # 1. resolve and check the request            resolve_request, check_fit
    # 2. encoders (text, image, VAE encode)         pipeline.encoders, each with its module on the device
    # 3. denoise stages, in order                   transition (e.g. upsampler) -> scheduler.prepare
    #                                               -> condition_latents -> (step_pre -> select_transformer
    #                                               -> run_step -> step_post)*  per stage
    # 4. decoders (iterators consumed fully)        pipeline.decoders -> {output key: tensor}
    # 5. save (all-or-nothing, through media.py)    inline, or the writer thread (runners/writes.py `save`)
    # end_run (always, from BaseRunner.run_pipeline)

This file holds that request path and the hooks a family overrides; the rest are objects the runner holds
(`warmups`, runners/warmup.py; `memory_checks`, planning/checks.py; `builder`) or functions it calls
(runners/: loading, adapters, parallelism, progress_report, writes, requests; docs/architecture.md §1).
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, ClassVar

import torch
from loguru import logger
from torch import nn

from runnerkit import attention, memory
from runnerkit.config import RequestConfig, RunnerConfig
from runnerkit.lora import LoRAManager
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.planning.checks import MemoryChecks, default_sources
from runnerkit.planning.compute import StageFlops
from runnerkit.planning.fit import MemoryEstimate
from runnerkit.profiling import RequestProfile
from runnerkit.runners.base import BaseRunner
from runnerkit.runners.pipeline import DenoiseStage, InputInfo, OutputKind, Pipeline, Shape, collect_output
from runnerkit.runners.building import ModuleBuilder, stream_choice
from runnerkit.runners.installers import Installer
from runnerkit.runners.loading import module_on_device
from runnerkit.runners.placement import Placement, held_across_stages
from runnerkit.runners.request_state import RequestState, check_finite_latents
from runnerkit.runners import adapters, loading, parallelism, progress_report, writes
from runnerkit.runners.requests import check_request, check_shape, lora_specs, resolve, shape_with_defaults
from runnerkit.runners.warmup import Warmup
from runnerkit.schedulers import SCHEDULERS
from runnerkit.schedulers.base import Scheduler
from runnerkit.text_buckets import TextBuckets, configured

__all__ = ["DefaultRunner", "InputInfo", "Shape", "check_finite_latents", "stream_choice"]


class DefaultRunner(BaseRunner):
    """Runs a family's `Pipeline`: requests, warmup, profiling, placement and offload."""

    #: Spatial and temporal factors a request shape must respect (VAE stride x patch size).
    SPATIAL_FACTOR: ClassVar[int] = 16
    TEMPORAL_FACTOR: ClassVar[int] = 4
    #: Family default negative prompt (used when neither config nor request gives one).
    DEFAULT_NEGATIVE_PROMPT: ClassVar[str] = ""
    #: Image inputs a task takes (request fields); text-only tasks take none.
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Per task, how many further reference images (`extra_image_paths`) it takes at most (absent: none).
    EXTRA_IMAGES: ClassVar[dict[str, int]] = {}
    #: The kind of each task's primary output (what `save_result_path` holds); default "video".
    RESULT_KINDS: ClassVar[dict[str, OutputKind]] = {}
    #: Config paths of separately shipped modules it reads (e.g. `text_encoder_path`); others are refused.
    MODULE_PATHS: ClassVar[tuple[str, ...]] = ()
    #: The pipeline's modules that can stream (a `ModuleSpec.stream`): what `offload.stream_modules` may list.
    STREAM_MODULES: ClassVar[tuple[str, ...]] = ()
    #: Text lengths (tokens) prompts are padded to under `text_buckets: auto`; None: a fixed length already.
    TEXT_BUCKETS: ClassVar[tuple[int, ...] | None] = None
    #: `run_step` runs its CFG branches through each streamed block in one pass (`one_pass_streamer`).
    CFG_ONE_PASS: ClassVar[bool] = False
    #: Parallel modes (config `parallel`): "cfg" (via `cfg_branches`), "ulysses" (`attention_heads`, `sequence_tokens`).
    PARALLEL_MODES: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        loading.check_settings(self)  # family settings, `offload.stream_modules`, compile support: before any plan
        self.warmups = Warmup(self)  # the gate, the shapes, the run (runners/warmup.py); BaseRunner.warmup drives it
        # made by `load_modules` (runners/loading.py), read by the request path
        self.pipeline: Pipeline | None = None
        self.schedulers: dict[str, Scheduler] = {}
        self.placement: Placement | None = None
        self.modules: dict[str, nn.Module] = {}  # resident and model-offloaded modules (not per-stage ones)
        self.streamers: dict[str, Any] = {}  # block/phase streamers of streamed modules, by module name
        self.attention: attention.AttentionBackend | None = None  # chosen in load_modules
        self.buckets: TextBuckets | None = None  # with the attention, in load_modules (runnerkit/text_buckets.py)
        self.lora: LoRAManager | None = None  # adapters per request (config `lora`; runners/adapters.py)
        self.fp8_bias_in_gemm = True  # fp8 compute: whether torch takes the bias in the GEMM (check_fp8_compute)
        self.installers: tuple[Installer, ...] = ()  # what every built module gets, in order (runners/installers.py)
        self.builder: ModuleBuilder | None = None
        self.memory_checks = MemoryChecks(self)  # the memory plan and fit checks (planning/checks.py)

    # ---- family hooks: loading ----------------------------------------------------------
    @abstractmethod
    def prepare_load(self) -> None:
        """Open the checkpoint, record the resolved architecture (`update_config`), load tokenizers."""

    @abstractmethod
    def describe_pipeline(self) -> Pipeline:
        """The family's pipeline for this config (called once, in `load_modules`, after `prepare_load`)."""

    @abstractmethod
    def flavour(self) -> str | None:
        """Model flavour recognised from the checkpoint's architecture (e.g. 'debug', '1.3B'), or None."""

    load_modules = loading.load_modules  # prepare_load -> attention -> describe_pipeline -> placement -> schedulers

    def attention_head_dim(self) -> int:
        """The transformer's attention head size (after `prepare_load`), for the attention backend. Default 128."""
        return 128

    def text_buckets(self) -> tuple[int, ...]:
        """The text lengths prompts are padded to, increasing; () unpadded (`auto`: decided at load)."""
        return configured(self.config.text_buckets, self.TEXT_BUCKETS) if self.buckets is None else self.buckets.lengths

    def build_scheduler(self, stage: DenoiseStage) -> Scheduler:
        """A fresh scheduler of `stage` (no request state)."""
        return SCHEDULERS[stage.scheduler](shift=stage.shift, spacing=stage.spacing, sigmas=stage.sigmas)

    @property
    def scheduler(self) -> Scheduler | None:
        """The first denoise stage's scheduler (the one a single-stage family has)."""
        return next(iter(self.schedulers.values()), None)

    def estimate_memory(self, shape: Shape) -> MemoryEstimate | None:
        """The memory estimate of a request of `shape` (h, w, f) on `self.device` (planning/fit.py); None (default):
        unchecked. Raises fit.EstimateUnavailable when it cannot be given before loading (checked once loaded)."""
        return None

    # ---- family hooks: LoRA (runners/adapters.py) ----------------------------------------------
    def lora_aliases(self, names: Sequence[str]) -> dict[str, str]:
        """Other names of the transformer's linear layers `names` (e.g. diffusers names) -> the layer's name."""
        return {}

    lora_slot_rank = adapters.slot_rank  # the unfused slots' rank (0 without), for a family's memory estimate
    check_adapters = adapters.check_adapters  # after init_modules: every request's adapters matched, none applied

    # ---- family hooks: parallel (runners/parallelism.py) ---------------------------------------
    def attention_heads(self) -> int:
        """Family hook (Ulysses): the transformer's attention heads (after `prepare_load`)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its attention heads (attention_heads)")

    def sequence_tokens(self, stage: DenoiseStage, info: InputInfo) -> int:
        """Family hook (Ulysses): the tokens the transformer of `stage` shards for request `info`."""
        raise NotImplementedError(f"{type(self).__name__} does not say its token count (sequence_tokens)")

    cfg_parallel = property(parallelism.cfg_parallel)  # the CFG branches run on two ranks (`parallel.cfg` = 2)
    decodes_here = property(parallelism.decodes_here)  # one process, or rank 0: runs the decoders and saves

    cfg_branches = parallelism.cfg_branches  # each CFG branch's prediction (under CFG parallel: one per rank)
    check_sequence_split = parallelism.check_sequence_split  # Ulysses: a request's tokens divide, per stage
    check_requests_split = parallelism.check_requests_split  # the same for every request of a launch

    # ---- family hooks: warmup (runners/warmup.py; opt-in: WARMUP_TASKS/SHAPES/OFFLOAD_MODES) -----
    def run_warmup(self, shapes: Sequence[Shape]) -> None:
        """Both shapes through the real request path, never `run_pipeline` (`Warmup.run`)."""
        self.warmups.run(shapes)

    def warmup_infos(self, shape: Shape) -> tuple[InputInfo, ...]:
        """The dummy requests warmup runs at `shape`: one per input variant that changes sequence lengths."""
        return (self.warmup_info(shape),)

    def warmup_info(self, shape: Shape) -> InputInfo:
        """The dummy request of warmup at `shape` (`Warmup.info`)."""
        return self.warmups.info(shape)

    def warmup_steps(self, req: RequestState, stage: DenoiseStage, sched: Scheduler) -> list[int]:
        """Steps warmup runs in `stage`, after `prepare` (default: `Warmup.first_steps`)."""
        return self.warmups.first_steps(req, stage, sched)

    def compiled_sizes(self, info: InputInfo) -> dict[str, int]:
        """Sizes of the dimensions compiled blocks see as dynamic for `info` (e.g. {'transformer tokens': 45})."""
        return {}

    def warmup_shapes(self) -> tuple[Shape, ...]:
        """The class-constant warmup shapes of this checkpoint's flavour (`Warmup.shapes`)."""
        return self.warmups.shapes()

    # ---- family hooks: the request path -------------------------------------------------------
    @abstractmethod
    def run_step(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: torch.Tensor,
                 timestep: torch.Tensor, step_index: int) -> torch.Tensor:
        """One denoising step's model output for the scheduler (all CFG branches combined): `latents`
        `[B, C, ...]` in the model dtype, `timestep` `[B]`, `model` the transformer (or MoE expert)
        `select_transformer` chose, on the device; the request's encoder outputs are in `req.inputs`."""

    def one_pass_streamer(self, model: nn.Module) -> BlockStreamer | None:
        """`model`'s block streamer when CFG branches share one pass through its blocks (building.py), else None."""
        return self.builder.one_pass_streamer(model) if self.builder is not None else None

    def select_transformer(self, req: RequestState, stage: DenoiseStage, step_index: int,
                           timestep: torch.Tensor) -> str:
        """The transformer (MoE expert) of `stage` for step `step_index`: the only one (several: override)."""
        if len(stage.transformers) != 1:
            raise NotImplementedError(f"{type(self).__name__}: denoise stage {stage.name!r} has experts "
                                      f"{list(stage.transformers)}; override select_transformer to choose per step")
        return stage.transformers[0]

    def run_transition(self, req: RequestState, stage: DenoiseStage, model: nn.Module,
                       latents: torch.Tensor) -> torch.Tensor:
        """Latents of the previous stage -> this stage's initial latents (default: `model(latents)`)."""
        with torch.inference_mode():
            return model(latents)

    def condition_latents(self, req: RequestState, stage: DenoiseStage, latents: torch.Tensor,
                          init_latents: torch.Tensor | None) -> torch.Tensor:
        """The start `latents` of `stage`'s scheduler (float32; do not write into it) with conditioned tokens (e.g.
        i2v's clean first frame; `init_latents`: the stage's input, None in the first); the scheduler goes on."""
        return latents

    def sidecar_extra(self, req: RequestState) -> dict[str, Any]:
        """Family fields added to the sidecar JSON of a saved result."""
        return {}

    def clear_request_state(self) -> None:
        """Family hook: drop request-specific caches (RoPE tables, VAE feature caches, branch state)."""

    # ---- request path -------------------------------------------------------------------
    report_progress = progress_report.report_progress  # tell `on_progress` (which may cancel) where a request is

    def profile_stages(self) -> tuple[str, ...]:
        assert self.pipeline is not None, "load_modules sets the pipeline"
        return self.pipeline.profile_stages()

    def serve_request(self, request: RequestConfig, index: int, prof: RequestProfile) -> None:
        """encoders -> denoise stages -> decoders -> save (see the module docstring)."""
        # 1. resolve and check the request (its shape against the device's memory, before any stage)
        info = self.resolve_request(request)
        req = RequestState(info)  # the request's state; dropped when serve_request returns
        adapters.set_request(self, info)  # request state: cleared in end_run (reset_request_state)
        prof.shape = list(info.shape)  # until the encoders ran (a family may predict part)
        self.memory_checks.check_request(request, info.shape, f"request {index}")  # unless admission checked it
        if not (info.save_result_path or info.save_tensor_path):
            logger.warning("request {}: no save_result_path or save_tensor_path: the result is not saved", index)
        req.inputs = self.run_encoders(req)  # 2. encoders
        prof.shape = list(req.info.shape)  # the shape that runs (a family may predict its frames)
        self.warmups.log_unwarmed_shape(req.info, index)  # after a warmup, at a shape it did not run
        latents = self.run_denoise(req)  # 3. denoise stages
        if not self.decodes_here:
            return  # parallel: rank 0 alone decodes and saves; this rank's part of the request is done
        outputs = self.decode(req, latents)  # 4. decoders
        # 5. save: here, or queued for the writer thread, which writes while the next request computes
        self.report_progress(info, "save")
        writes.save(self, req, prof, outputs)

    def run_encoders(self, req: RequestState, per_shape: bool | None = None) -> Any:
        """The encoder stages that run (`Pipeline.encoders_to_run`), each with its module on the device and the
        inputs built so far in `req.inputs`; returns the inputs (also left in `req.inputs`)."""
        assert self.pipeline is not None, "load_modules first"
        for enc in self.pipeline.encoders_to_run(req, per_shape, self.profiler):
            self.report_progress(req.info, enc.name)
            with self.profiler.stage(enc.name), module_on_device(self.placement, enc.module, req):
                req.inputs = enc.run(req)
        return req.inputs

    def run_denoise(self, req: RequestState, warmup: bool = False) -> torch.Tensor:
        """Every denoise stage in order (with its transition); returns the final latents."""
        assert self.pipeline is not None, "load_modules first"
        latents: torch.Tensor | None = None
        with held_across_stages(self.pipeline.denoise, self.config.offload.keep_across_stages,
                                self.placement) as hold:
            for stage in self.pipeline.denoise:
                hold(stage.index)
                req.stage = stage
                latents = self._denoise_one(req, stage, latents, warmup)
        req.stage = None
        assert latents is not None
        if self.decodes_here:  # the rank that decodes (every rank holds the same latents)
            check_finite_latents(latents, self.dtype)
        return latents

    def _denoise_one(self, req: RequestState, stage: DenoiseStage, latents: torch.Tensor | None,
                     warmup: bool) -> torch.Tensor:
        """One denoise stage with its transition; the request's generator lends itself to the stage's scheduler."""
        if stage.transition is not None:
            assert latents is not None, "a transition needs the previous stage's latents"
            self.report_progress(req.info, stage.transition)
            with (self.profiler.stage(stage.transition),
                  module_on_device(self.placement, stage.transition, req) as model):
                latents = self.run_transition(req, stage, model, latents)
        sched = self.schedulers[stage.name]
        sched.generator = req.generator  # one generator per request, drawn from in a fixed order
        self.report_progress(req.info, stage.name, 0, stage.steps)
        with self.profiler.stage(stage.name):
            latents = self.run_denoise_stage(req, stage, sched, latents, warmup)
        req.generator = sched.generator
        return latents

    def run_denoise_stage(self, req: RequestState, stage: DenoiseStage, sched: Scheduler,
                          init_latents: torch.Tensor | None, warmup: bool = False) -> torch.Tensor:
        """prepare -> condition_latents -> (step_pre -> select_transformer -> run_step -> step_post)* -> latents.
        Warmup runs `warmup_steps` only (a jump resets a solver's history); the chosen transformer stays on the
        device while consecutive steps use it (an MoE switch moves the other expert in)."""
        info = req.info
        self.check_sequence_split(info, (stage,))  # before the stage's first step
        sched.prepare(stage.latent_shape(info), stage.steps, info.seed, self.device, self.dtype,
                      init_latents=init_latents, strength=stage.strength,
                      noise_shapes=stage.noise_shapes(info) if stage.noise_shapes is not None else None)
        sched.set_latents(self.condition_latents(req, stage, sched.latents, init_latents))
        order = self.warmups.stage_steps(req, stage, sched) if warmup else list(range(sched.infer_steps))
        label = f"warmup {list(info.shape)}: {stage.name} step" if warmup else f"{stage.name} step"
        with ExitStack() as placed:
            current: str | None = None
            model: nn.Module | None = None
            previous = -1
            for i in order:
                if i != previous + 1:
                    if sched.keeps_history:
                        sched.reset_history()
                    sched.set_step(i)
                with self.profiler.step():
                    latents, timestep = sched.step_pre(i)
                    name = self.select_transformer(req, stage, i, timestep)
                    if name != current:
                        placed.close()  # the previous expert leaves the device first
                        model = placed.enter_context(module_on_device(self.placement, name, req))
                        current = name
                    noise_pred = self.run_step(req, stage, model, latents, timestep, i)
                    sched.step_post(noise_pred)
                # marked: while the launch script's bar shows the steps, it drops these lines (runnerkit/progress.py)
                logger.bind(denoise_step=True).log(req.step_log_level, "{} {}/{}", label, i + 1, sched.infer_steps)
                previous = i
                self.report_progress(info, stage.name, i + 1, sched.infer_steps)  # a cancel stops here
        return sched.latents

    def decode(self, req: RequestState, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every decoder with its module on the device: output key -> tensor `[B, ...]` (video `[B, 3, F, H, W]`)."""
        assert self.pipeline is not None, "load_modules first"
        outputs: dict[str, torch.Tensor] = {}
        for dec in self.pipeline.decoders:
            self.report_progress(req.info, dec.name)
            with self.profiler.stage(dec.name), module_on_device(self.placement, dec.module, req):
                outputs[dec.output] = collect_output(dec.run(req, latents),
                                                     functools.partial(self.report_progress, req.info, dec.name))
        return outputs

    def save_outputs(self, req: RequestState, outputs: dict[str, torch.Tensor]) -> list[str]:
        """Write the request's files now, all-or-nothing (runners/writes.py `prepare_write`); the paths written."""
        return writes.prepare_write(self, req, outputs)(lambda: None)

    def end_run(self) -> None:
        """Back to the start-up baseline, then a pressure-aware cache cleanup."""
        self.reset_request_state()
        memory.maybe_empty_cache(self.device, "end_run", self.config.memory.empty_cache_min_free_gib,
                                 self.config.memory.empty_cache_min_reclaimable_gib)

    def reset_request_state(self) -> None:
        """Schedulers, LoRA adapters, streamer positions and the family's caches back to the start-up baseline
        (the request's `RequestState` is dropped with `serve_request`'s frame)."""
        for sched in self.schedulers.values():
            sched.clear()
        if self.lora is not None:
            self.lora.clear()  # unfused slots zeroed / fused weights restored from the kept copies
        for streamer in self.streamers.values():
            streamer.reset()  # slots, prefetch index and events back at the request boundary
        self.clear_request_state()

    # ---- request checks (runners/requests.py) ------------------------------------------------------------------
    @classmethod
    def validate_shape(cls, height: int, width: int, frames: int) -> None:
        """ValueError naming the field if the shape breaks `SPATIAL_FACTOR` / `TEMPORAL_FACTOR`."""
        check_shape(height, width, frames, cls.SPATIAL_FACTOR, cls.TEMPORAL_FACTOR)

    shape_of = staticmethod(shape_with_defaults)  # a family whose shape follows its inputs overrides it
    lora_specs = staticmethod(lora_specs)

    @classmethod
    def validate_request(cls, request: RequestConfig, config: RunnerConfig) -> None:
        """Check `request` before anything loads (`config` as the user gave it); raises as `check_request`."""
        check_request(request, cls.resolve_config(config), cls.IMAGE_INPUTS, cls.EXTRA_IMAGES, cls.RESULT_KINDS,
                      cls.shape_of, cls.validate_shape, cls.PROMPT_ENHANCER)

    def resolve_request(self, request: RequestConfig | dict[str, Any]) -> InputInfo:
        """The request's defaults filled in, validated unless admitted (`runners/requests.py` `resolve`)."""
        return resolve(request, self.config, self.validate_request, self.shape_of, self.DEFAULT_NEGATIVE_PROMPT)

    def request_shape(self, request: RequestConfig) -> Shape:
        """(height, width, frames) of `request`, the config's defaults filled in (`shape_of`)."""
        return self.shape_of(request, self.config)

    # ---- memory plan hooks (planning/checks.py `MemoryChecks` asks them; families override) -------------------
    def estimate_sources(self) -> list[str]:
        """Where the estimate takes the architecture from, and what it assumes beyond it (`runnerkit plan`)."""
        return default_sources(self.config)

    def denoise_flops(self, shape: Shape) -> tuple[StageFlops, ...] | None:
        """Per denoising stage, its steps and the FLOPs of one step at `shape` (planning/compute.py); None: none."""
        return None

    def plan_steps_per_request(self) -> int:
        """Denoising steps of one request over all its stages (the plan's copy time per request)."""
        return self.config.infer_steps or 1
