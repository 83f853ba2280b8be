"""DefaultRunner: serves a family's pipeline description (runners/pipeline.py).

The family returns a `Pipeline` from `describe_pipeline()` and fills in a few hooks; this class
runs it, for requests and for warmup alike (ARCHITECTURE §2, §3):

    # 1. resolve and check the request            resolve_request
    # 2. encoders (text, image, VAE encode)         pipeline.encoders, each with its module on the device
    # 3. denoise stages, in order                   transition (e.g. upsampler) -> scheduler.prepare
    #                                               -> (step_pre -> select_transformer -> run_step
    #                                                   -> step_post)*  per stage
    # 4. decoders (iterators consumed fully)        pipeline.decoders -> {output key: tensor}
    # 5. save (all-or-nothing, through media.py)    save_outputs, or the writer thread (runners/writes.py)
    # end_run (always, from BaseRunner.run_pipeline)

Module placement (offload mode none/model/block/phase, lazy_load, unload_modules) is decided from the
pipeline's `ModuleSpec`s by the runner's `ModuleBuilder` (runners/building.py), which applies the run's
installers (runners/installers.py) to every module it builds; a family only says how to build (or
stream) each module.

Request validation is functions (runners/requests.py) behind hooks declared at the end of the class;
the memory plan and fit checks are an object the runner holds (`memory_checks`, planning/checks.py);
warmup with its per-class opt-in is a mixin (runners/warmup.py, `WarmupMixin`).
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from loguru import logger
from torch import nn

from runnerkit import attention, memory, synthetic
from runnerkit import compile as regional_compile
from runnerkit.config import RequestConfig, RunnerConfig
from runnerkit.lora import LoRAManager
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.planning.checks import MemoryChecks, default_sources
from runnerkit.planning.compute import StageFlops
from runnerkit.planning.fit import MemoryEstimate
from runnerkit.profiling import RequestProfile
from runnerkit.runners.base import BaseRunner, Progress
from runnerkit.runners.pipeline import DenoiseStage, InputInfo, OutputKind, Pipeline, Shape
from runnerkit.runners.building import ModuleBuilder, check_family_settings, check_stream_modules, stream_choice
from runnerkit.runners.installers import Installer, check_fp8_compute, check_parallel, installers_for, preload_adapters
from runnerkit.runners.placement import Placement, held_across_stages
from runnerkit.runners.request_state import RequestState, check_finite_latents
from runnerkit.runners import writes
from runnerkit.runners.requests import check_request, check_shape, lora_specs, resolve, shape_with_defaults
from runnerkit.runners.warmup import WarmupMixin
from runnerkit.schedulers import SCHEDULERS
from runnerkit.schedulers.base import Scheduler
from runnerkit.text_buckets import TextBuckets, choose, configured

__all__ = ["DefaultRunner", "InputInfo", "Shape", "check_finite_latents", "stream_choice"]


class DefaultRunner(WarmupMixin, BaseRunner):
    """Runs a family's `Pipeline`: requests, warmup, profiling, placement and offload."""

    #: Spatial and temporal factors a request shape must respect (VAE stride x patch size).
    SPATIAL_FACTOR: ClassVar[int] = 16
    TEMPORAL_FACTOR: ClassVar[int] = 4
    #: Family default negative prompt (used when neither config nor request gives one).
    DEFAULT_NEGATIVE_PROMPT: ClassVar[str] = ""
    #: Seed of warmup's own noise; the generator is dropped after warmup, so requests never see it.
    WARMUP_SEED: ClassVar[int] = 0
    #: Image inputs a task takes (request fields); text-only tasks take none.
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Per task, how many further reference images (`extra_image_paths`) it takes at most (absent: none).
    EXTRA_IMAGES: ClassVar[dict[str, int]] = {}
    #: The kind of each task's primary output (what `save_result_path` holds); default "video".
    RESULT_KINDS: ClassVar[dict[str, OutputKind]] = {}
    #: Config paths of separately shipped modules this family reads (`text_encoder_path`,
    #: `upsampler_path`); any other one set in the config is refused.
    MODULE_PATHS: ClassVar[tuple[str, ...]] = ()
    #: The modules of `describe_pipeline` that can stream their blocks or layers (those it gives a
    #: `ModuleSpec.stream`): the names `offload.stream_modules` may list. Checked when the runner is
    #: built, before any plan (`check_stream_modules`), and against the described pipeline at load.
    STREAM_MODULES: ClassVar[tuple[str, ...]] = ()
    #: Text lengths (tokens) the family pads its prompts' embeddings to under `text_buckets: auto`
    #: (docs/prompt_lengths.md); None: the family's text has a fixed length already (or no text),
    #: and `text_buckets` takes 'auto' only.
    TEXT_BUCKETS: ClassVar[tuple[int, ...] | None] = None

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        check_family_settings(self.config, self.MODULE_PATHS, self.TEXT_BUCKETS is not None)
        self.check_stream_modules()
        regional_compile.check_supported(self.config.compile, self.config.offload, self.config.unload_modules,
                                         self.device)
        self.pipeline: Pipeline | None = None
        self.schedulers: dict[str, Scheduler] = {}
        self.placement: Placement | None = None
        self.modules: dict[str, nn.Module] = {}  # resident and model-offloaded modules (not per-stage ones)
        self.streamers: dict[str, Any] = {}  # block/phase streamers of streamed modules, by module name
        self._warmup_steps_run: dict[str, list[int]] = {}
        self.attention: attention.AttentionBackend | None = None  # chosen in load_modules
        self.buckets: TextBuckets | None = None  # with the attention, in load_modules (runnerkit/text_buckets.py)
        #: LoRA adapters per request (config `lora`; runnerkit/lora): made in load_modules; None without `lora`.
        self.lora: LoRAManager | None = None
        self.fp8_bias_in_gemm = True  # fp8 compute: whether torch takes the bias in the GEMM (check_fp8_compute)
        #: What every built module gets, in order (runners/installers.py), and the builder that places the
        #: pipeline's modules and applies them (runners/building.py); both made by place_modules, in load_modules.
        self.installers: tuple[Installer, ...] = ()
        self.builder: ModuleBuilder | None = None
        self.memory_checks = MemoryChecks(self)  # the memory plan and fit checks (planning/checks.py)

    def check_stream_modules(self) -> None:
        """Refuse an `offload.stream_modules` entry that is not one of `STREAM_MODULES`, before planning and
        loading (ValueError; runners/building.py `check_stream_modules`)."""
        check_stream_modules(self.config, self.STREAM_MODULES, type(self).__name__)

    # ---- family hooks -------------------------------------------------------------------
    @abstractmethod
    def prepare_load(self) -> None:
        """Open the checkpoint, record the resolved architecture (`update_config`), load tokenizers."""

    @abstractmethod
    def describe_pipeline(self) -> Pipeline:
        """The family's pipeline for this config (called once, in `load_modules`, after `prepare_load`)."""

    @abstractmethod
    def flavour(self) -> str | None:
        """Model flavour recognised from the checkpoint's architecture (e.g. 'debug', '1.3B'), or None."""

    @abstractmethod
    def run_step(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: torch.Tensor,
                 timestep: torch.Tensor, step_index: int) -> torch.Tensor:
        """One denoising step's model output for the scheduler (all CFG branches combined).

        Args:
            req: the request (its encoder outputs in `req.inputs`).
            stage: the denoise stage running.
            model: the transformer (or MoE expert) `select_transformer` chose, on the device.
            latents: `[B, C, ...]` in the model dtype; timestep: `[B]`.
        """

    #: The family's `run_step` runs its CFG branches through each streamed block in one pass
    #: (`one_pass_streamer`, the transformer's `forward_branches`); read for the load-time log line.
    CFG_ONE_PASS: ClassVar[bool] = False

    def one_pass_streamer(self, model: nn.Module) -> BlockStreamer | None:
        """The block streamer of `model` when the CFG branches share one pass through its blocks (mode
        "block", `model` streamed; runners/building.py `ModuleBuilder.one_pass_streamer`), else None."""
        return self.builder.one_pass_streamer(model) if self.builder is not None else None

    #: Parallel modes the runner supports under config `parallel` (runnerkit/parallel): "cfg" (its
    #: `run_step` computes the branches through `cfg_branches`), "ulysses" (its transformer derives from
    #: `parallel.sequence.ShardsSequence`, and `attention_heads` / `sequence_tokens` are given).
    PARALLEL_MODES: ClassVar[frozenset[str]] = frozenset()

    def attention_heads(self) -> int:
        """Family hook (Ulysses): the transformer's attention heads (after `prepare_load`)."""
        raise NotImplementedError(f"{type(self).__name__} does not say its attention heads (attention_heads)")

    def sequence_tokens(self, stage: DenoiseStage, info: InputInfo) -> int:
        """Family hook (Ulysses): the tokens the transformer of `stage` shards for request `info`."""
        raise NotImplementedError(f"{type(self).__name__} does not say its token count (sequence_tokens)")

    @property
    def cfg_parallel(self) -> bool:
        """The CFG branches run on two ranks (config `parallel.cfg` = 2)."""
        return self.parallel is not None and self.parallel.cfg > 1

    @property
    def decodes_here(self) -> bool:
        """This process runs the decoders and saves: one process, or rank 0 of a parallel run."""
        return self.parallel is None or self.parallel.rank == 0

    def cfg_branches(self, branches: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Each CFG branch's prediction, in `branches` order (e.g. [cond, uncond]).

        One process: every branch runs here. CFG parallel (`parallel.cfg` = 2): this rank runs branch
        `cfg_rank` only and one all-gather over the CFG group brings the other's (same shape and dtype
        on both ranks), so every rank combines the same tensors as one process would.
        """
        if not self.cfg_parallel:
            return [branch() for branch in branches]
        assert len(branches) == self.parallel.cfg, f"{len(branches)} CFG branches for parallel.cfg {self.parallel.cfg}"
        return self.parallel.all_gather(branches[self.parallel.cfg_rank](), "cfg")

    def check_parallel(self) -> None:
        """Refuse a `parallel` config this runner cannot serve (at load, after `prepare_load`; runners/installers.py
        `check_parallel` says what it raises)."""
        check_parallel(self.config, self.parallel, self.PARALLEL_MODES, self.attention_heads, type(self).__name__)

    def select_transformer(self, req: RequestState, stage: DenoiseStage, step_index: int,
                           timestep: torch.Tensor) -> str:
        """The transformer (MoE expert) of `stage` that runs step `step_index` (default: the only one).

        Raises:
            NotImplementedError: the stage lists several experts and the family did not say how to choose.
        """
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
        """Family hook, right after `stage`'s scheduler drew its start `latents` (float32, the
        scheduler's own tensor: do not write into it): the start with conditioned tokens, e.g. an
        image-to-video model's clean first frame (`init_latents`: what the stage started from, None
        for the first stage); the scheduler continues from what it returns. Default: `latents`."""
        return latents

    def clear_request_state(self) -> None:
        """Family hook: drop request-specific caches (RoPE tables, VAE feature caches, branch state)."""

    #: Checkpoint layouts `write_synthetic_checkpoint` can write (empty: the family writes none).
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Write deterministic random weights of `config`'s architecture to `out` (runnerkit.tools.synth_checkpoint)."""
        raise NotImplementedError(f"{cls.__name__} cannot write synthetic checkpoints")

    @staticmethod
    def synthetic_seed_of(path: Path) -> int | None:
        """The seed of the synthetic checkpoint at `path`, or None if it holds none (its
        `runnerkit.synthetic.SYNTHETIC_MARKER`)."""
        return synthetic.synthetic_seed_of(path)

    def sidecar_extra(self, req: RequestState) -> dict[str, Any]:
        """Family fields added to the sidecar JSON of a saved result."""
        return {}

    def estimate_memory(self, shape: Shape) -> MemoryEstimate | None:
        """Family hook: the memory estimate of a request of `shape` (height, width, frames) on `self.device`.

        Called before loading (from the checkpoint's architecture) and before each request; see
        planning/fit.py for what the family gives (module weights, per-stage activations) and what
        the base makes of it. None: no estimate (the default): requests are served unchecked.

        Raises:
            fit.EstimateUnavailable: the family has an estimate but cannot give it yet (e.g. the
                checkpoint's architecture is not readable before loading); checked once loaded.
        """
        return None

    def lora_aliases(self, names: Sequence[str]) -> dict[str, str]:
        """Family hook: other names of the transformer's linear layers `names` (e.g. the diffusers
        names of a model built in the original release's names) -> the layer's name, for matching
        LoRA adapters (runnerkit/lora). Default: none (the model's names are the only ones)."""
        return {}

    @classmethod
    def lora_layers(cls, config: RunnerConfig, layout: str) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """Family hook for the synthetic adapter writer (runnerkit/lora/synthetic.py): the linear layers
        a typical adapter of `config`'s architecture covers, name -> (out, in), and the names to write
        them under in `layout` (e.g. diffusers names for "peft"); no weight is read.

        Raises:
            NotImplementedError: the family has no such table.
        """
        raise NotImplementedError(f"{cls.__name__} cannot describe its LoRA layers for a synthetic adapter")

    def lora_slot_rank(self) -> int:
        """The rank R of the unfused LoRA slots every transformer carries on the device (config `lora`
        in mode unfused: `lora.max_rank`); 0 without them. For a family's memory estimate."""
        lora = self.config.lora
        return lora.max_rank if lora is not None and lora.mode == "unfused" else 0

    def check_adapters(self, requests: Sequence[RequestConfig]) -> None:
        """After `init_modules`, before serving: every request's adapters read and matched to the
        transformer's layers (nothing applied).

        Raises:
            runnerkit.lora.LoRAError: naming the file (unknown format, keys matching no layer, an
                adapter for another model, shapes or ranks that do not fit).
        """
        for request in requests:
            specs = self.lora_specs(request, self.config)
            if specs:
                assert self.lora is not None, "lora_specs refuses adapters without the config's `lora`"
                self.lora.check(specs)

    # ---- loading and placement --------------------------------------------------------------
    def attention_head_dim(self) -> int:
        """Family hook: the transformer's attention head size (after `prepare_load`), for the attention
        backend's probe (runnerkit/attention.py). Default 128."""
        return 128

    def text_buckets(self) -> tuple[int, ...]:
        """The text lengths (tokens) prompts are padded to, increasing; () when prompts run unpadded
        (runnerkit/text_buckets.py; `auto` is decided at load, with the attention backend)."""
        return configured(self.config.text_buckets, self.TEXT_BUCKETS) if self.buckets is None else self.buckets.lengths

    def load_modules(self) -> None:
        """prepare_load -> the attention backend -> describe_pipeline -> place every module as the
        offload config says -> schedulers.

        Raises:
            NotImplementedError: the configured attention backend cannot run here (with the reason).
        """
        self.prepare_load()
        self.check_parallel()
        head_dim = self.attention_head_dim()
        self.attention, self.buckets = backend, buckets = choose(self.config.attention, self.config.text_buckets,
                                                                 self.TEXT_BUCKETS, self.device, self.dtype, head_dim)
        logger.info("attention: {} ({}; head size {}, {})", backend.name, backend.reason, head_dim, self.dtype)
        self.profiler.attention = {"backend": backend.name, "reason": backend.reason, "head_dim": head_dim,
                                   "text_buckets": list(buckets.lengths), "text_buckets_reason": buckets.reason}
        self.pipeline = pipeline = self.describe_pipeline()
        if self.config.compute_dtype == "fp8":
            self.check_fp8_compute(pipeline)
        can = sorted(m.name for m in pipeline.modules if m.stream is not None)
        assert can == sorted(self.STREAM_MODULES), (f"{type(self).__name__}.STREAM_MODULES "
                                                     f"{list(self.STREAM_MODULES)} differs from the modules its "
                                                     f"pipeline can stream, {can}: declare them")
        if self.config.lora is not None:
            self.lora = LoRAManager(self.config.lora.mode, self.config.lora.max_rank, self.device, self.dtype,
                                    self.lora_aliases, f"{self.config.model_cls} transformer")
        self.placement = self.place_modules(pipeline)
        self.schedulers = {s.name: self.build_scheduler(s) for s in pipeline.denoise}
        if self.lora is not None:  # every adapter of `lora.adapters` read and matched now (a bad file fails the load)
            assert self.config.lora is not None
            preload_adapters(self.lora, self.config.lora.adapters, pipeline)

    def check_fp8_compute(self, pipeline: Pipeline) -> None:
        """`compute_dtype: fp8`: refuse it where it cannot run, before anything loads (runners/installers.py
        `check_fp8_compute`, which raises NotImplementedError with the reason); else remember whether the
        bias goes into the fp8 GEMM."""
        self.fp8_bias_in_gemm = check_fp8_compute(pipeline, self.device, self.dtype, self.config.dtype,
                                                  type(self).__name__)

    def build_scheduler(self, stage: DenoiseStage) -> Scheduler:
        """A fresh scheduler of `stage` (no request state)."""
        return SCHEDULERS[stage.scheduler](shift=stage.shift, spacing=stage.spacing, sigmas=stage.sigmas)

    @property
    def scheduler(self) -> Scheduler | None:
        """The first denoise stage's scheduler (the one a single-stage family has)."""
        return next(iter(self.schedulers.values()), None)

    def place_modules(self, pipeline: Pipeline) -> Placement:
        """Build every module where the offload config puts it (runners/building.py `ModuleBuilder.place`),
        with the run's installers (runners/installers.py), made here from what load chose (attention, LoRA, fp8)."""
        assert self.attention is not None, "load_modules chooses the attention backend first"
        self.installers = installers_for(self.config, self.dtype, self.attention, self.lora, self.fp8_bias_in_gemm,
                                         self.parallel, type(self).__name__)
        self.builder = ModuleBuilder(self.config, self.device, type(self).__name__, self.CFG_ONE_PASS, self.installers,
                                     self.streamers)
        placement, self.modules = self.builder.place(pipeline)
        return placement

    @contextmanager
    def module_on_device(self, name: str | None, req: RequestState | None = None) -> Iterator[nn.Module | None]:
        """Module `name` on the compute device for one stage (runners/placement.py); while the block
        runs it is also `req.modules[name]`. `name` None: yields None."""
        if name is None or self.placement is None:
            yield None
            return
        with self.placement.on_device(name) as module:
            if req is None:
                yield module
                return
            req.modules[name] = module
            try:
                yield module
            finally:
                del req.modules[name]

    # ---- request path -------------------------------------------------------------------
    def report_progress(self, info: InputInfo, stage: str, step: int = 0, steps: int = 0) -> None:
        """Tell `on_progress` where the request is (never during warmup); the observer may raise
        `RequestCancelled` to stop the request here.

        `stage` is a profiling stage that starts, or the denoise stage that finished step `step`
        of `steps`; `steps_done` counts the steps of every denoise stage before it.
        """
        if self.on_progress is None or info.warmup or self.pipeline is None:
            return
        before, total = self.pipeline.step_offsets
        done = before.get(stage, total) + step  # decoders and save: every step is done
        current = self.profiler.current
        self.on_progress(Progress(index=current.index if current is not None else 0, stage=stage, step=step,
                                  steps=steps, steps_done=done, steps_total=total))

    def profile_stages(self) -> tuple[str, ...]:
        assert self.pipeline is not None, "load_modules sets the pipeline"
        return self.pipeline.profile_stages()

    def serve_request(self, request: RequestConfig, index: int, prof: RequestProfile) -> None:
        """encoders -> denoise stages -> decoders -> save (see the module docstring)."""
        # 1. resolve and check the request (its shape against the device's memory, before any stage)
        info = self.resolve_request(request)
        req = RequestState(info)  # the request's state; dropped when serve_request returns
        if info.lora:  # request state: cleared in end_run (reset_request_state)
            assert self.lora is not None, "lora_specs refuses adapters without the config's `lora`"
            self.lora.set_request(info.lora)
        prof.shape = list(info.shape)
        self.memory_checks.check_request(request, info.shape, f"request {index}")  # unless admission checked it
        if self._warmup_ran and info.shape not in self.warmed_shapes:
            self.log_unwarmed_shape(info, index)
        if not (info.save_result_path or info.save_tensor_path):
            logger.warning("request {}: no save_result_path or save_tensor_path: the result is not saved", index)
        # 2. encoders
        req.inputs = self.run_encoders(req)
        # 3. denoise stages
        latents = self.run_denoise(req)
        if not self.decodes_here:
            return  # parallel: rank 0 alone decodes and saves; this rank's part of the request is done
        # 4. decoders
        outputs = self.decode(req, latents)
        # 5. save: here, or queued for the writer thread, which writes while the next request computes
        self.report_progress(info, "save")
        if self.writer is not None and (info.save_result_path or info.save_tensor_path):
            with self.profiler.stage("save"):  # a free writer slot, the sidecar and CPU copies (runners/writes.py)
                return writes.hand_off(self, prof, functools.partial(writes.prepare_write, self, req, outputs))
        # under `parallel`, the lock keeps a failing group's cleanup (parallel/driver.py) from racing the renames
        with self.profiler.stage("save"), self.parallel.output_lock if self.parallel is not None else nullcontext():
            written = self.save_outputs(req, outputs)
            prof.saved = True  # before logging: an interrupt from here on leaves the request finished
        for path in written:
            logger.info("saved {}", path)

    def run_encoders(self, req: RequestState, per_shape: bool | None = None) -> Any:
        """Run the pipeline's encoder stages (only those with `per_shape` == `per_shape` unless None),
        each with its module on the device and the inputs built so far in `req.inputs`; returns the
        inputs (also left in `req.inputs`)."""
        assert self.pipeline is not None, "load_modules first"
        for enc in self.pipeline.encoders:
            if per_shape is not None and enc.per_shape != per_shape:
                continue
            self.report_progress(req.info, enc.name)
            with self.profiler.stage(enc.name), self.module_on_device(enc.module, req):
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
        """One denoise stage with its transition: its latents; the request's generator goes to the stage's
        scheduler before and comes back to `req.generator` after."""
        if stage.transition is not None:
            assert latents is not None, "a transition needs the previous stage's latents"
            self.report_progress(req.info, stage.transition)
            with self.profiler.stage(stage.transition), self.module_on_device(stage.transition, req) as model:
                latents = self.run_transition(req, stage, model, latents)
        sched = self.schedulers[stage.name]
        sched.generator = req.generator  # one generator per request, drawn from in a fixed order
        self.report_progress(req.info, stage.name, 0, stage.steps)
        with self.profiler.stage(stage.name):
            latents = self.run_denoise_stage(req, stage, sched, latents, warmup)
        req.generator = sched.generator
        return latents

    def check_sequence_split(self, info: InputInfo, stages: Sequence[DenoiseStage] | None = None) -> None:
        """Under Ulysses sequence parallel, refuse request `info` if a denoise stage's transformer tokens
        (`sequence_tokens`) do not divide by `parallel.ulysses`; a no-op otherwise. The server calls it
        at submission (422), every stage calls it before its first step. `stages`: default every one.

        Raises:
            NotImplementedError: naming the stage, the shape, the token count and `parallel.ulysses`.
        """
        if self.parallel is None or self.parallel.ulysses <= 1:
            return
        from runnerkit.parallel.group import split_even

        assert self.pipeline is not None, "load_modules sets the pipeline"
        for stage in stages if stages is not None else self.pipeline.denoise:
            split_even(self.sequence_tokens(stage, info), self.parallel.ulysses, "the transformer's tokens",
                       f"stage {stage.name!r} at shape {list(info.shape)}; choose a shape whose tokens divide")

    def check_requests_split(self, requests: Sequence[RequestConfig]) -> None:
        """`check_sequence_split` for every request of a launch, after `init_modules` and before the
        first runs (under `parallel` a failed request ends every rank, so none starts).

        Raises:
            NotImplementedError: naming the first request whose tokens do not divide (index, source).
        """
        for index, request in enumerate(requests):
            try:
                self.check_sequence_split(self.resolve_request(request))
            except NotImplementedError as exc:
                raise NotImplementedError(f"request {index} ({request.source}): {exc}") from None

    def run_denoise_stage(self, req: RequestState, stage: DenoiseStage, sched: Scheduler,
                          init_latents: torch.Tensor | None, warmup: bool = False) -> torch.Tensor:
        """prepare -> condition_latents -> (step_pre -> select_transformer -> run_step -> step_post)*
        -> the stage's latents.

        Warmup runs `warmup_steps` only; a non-consecutive jump resets the solver history (only
        for schedulers that keep one). The chosen transformer is kept on the device while
        consecutive steps use it (an MoE switch moves the other expert in).
        """
        info = req.info
        self.check_sequence_split(info, (stage,))  # before the stage's first step
        sched.prepare(stage.latent_shape(info), stage.steps, info.seed, self.device, self.dtype,
                      init_latents=init_latents, strength=stage.strength,
                      noise_shapes=stage.noise_shapes(info) if stage.noise_shapes is not None else None)
        sched.set_latents(self.condition_latents(req, stage, sched.latents, init_latents))
        order = self.warmup_steps(req, stage, sched) if warmup else list(range(sched.infer_steps))
        if warmup:
            self._warmup_steps_run[stage.name] = order
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
                        model = placed.enter_context(self.module_on_device(name, req))
                        current = name
                    noise_pred = self.run_step(req, stage, model, latents, timestep, i)
                    sched.step_post(noise_pred)
                # marked: while the launch script's bar shows the steps, it drops these lines (runnerkit/progress.py)
                logger.bind(denoise_step=True).info("{} {}/{}", label, i + 1, sched.infer_steps)
                previous = i
                self.report_progress(info, stage.name, i + 1, sched.infer_steps)  # a cancel stops here
        return sched.latents

    def decode(self, req: RequestState, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """Run every decoder (iterators consumed fully while the module is on the device); progress is
        reported for requests (never warmup's).

        Returns:
            output key -> tensor `[B, ...]` (e.g. video `[B, 3, F, H, W]`).
        """
        assert self.pipeline is not None, "load_modules first"
        outputs: dict[str, torch.Tensor] = {}
        for dec in self.pipeline.decoders:
            self.report_progress(req.info, dec.name)
            with self.profiler.stage(dec.name), self.module_on_device(dec.module, req):
                out = dec.run(req, latents)
                if isinstance(out, torch.Tensor):
                    outputs[dec.output] = out
                    continue
                chunks = []
                try:
                    for chunk in out:  # an observer may cancel between chunks (a long decode)
                        chunks.append(chunk)
                        self.report_progress(req.info, dec.name)
                finally:
                    close = getattr(out, "close", None)
                    if close is not None:
                        close()  # a generator left early (cancelled, failed) releases its caches now
                outputs[dec.output] = torch.cat(chunks, dim=2)
        return outputs

    def save_outputs(self, req: RequestState, outputs: dict[str, torch.Tensor]) -> list[str]:
        """Write the request's files now through the media module, all-or-nothing (runnerkit/media.py;
        what is written: runners/writes.py `prepare_write`); returns the paths written."""
        return writes.prepare_write(self, req, outputs)(lambda: None)

    def end_run(self) -> None:
        """Back to the start-up baseline, then a pressure-aware cache cleanup."""
        self.reset_request_state()
        memory.maybe_empty_cache(self.device, "end_run", self.config.memory.empty_cache_min_free_gib,
                                 self.config.memory.empty_cache_min_reclaimable_gib)

    def reset_request_state(self) -> None:
        """Schedulers (latents, sigmas, history, generator), LoRA adapters, streamer positions and the
        family's caches all go back to the start-up baseline (the request's `RequestState` itself is
        dropped with `serve_request`'s frame)."""
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
                      cls.shape_of, cls.validate_shape)

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
