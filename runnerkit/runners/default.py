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

Module placement (offload mode none/model/block/phase, lazy_load, unload_modules) is decided here
from the pipeline's `ModuleSpec`s; a family only says how to build (or stream) each module.

Two parts live in their own modules, as mixins of `DefaultRunner`: request validation and the
memory fit check (runners/requests.py, `RequestChecksMixin`), and warmup with its per-class opt-in
(runners/warmup.py, `WarmupMixin`).
"""

from __future__ import annotations

import functools
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from loguru import logger
from torch import nn

from runnerkit import attention, fp8_compute, memory, synthetic
from runnerkit import compile as regional_compile
from runnerkit.config import RequestConfig, RunnerConfig
from runnerkit.lora import LoRAError, LoRAManager
from runnerkit.offload.setup import pin_memory_enabled
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.profiling import RequestProfile
from runnerkit.runners.base import BaseRunner, Progress
from runnerkit.runners.fit import MemoryEstimate
from runnerkit.runners.pipeline import DenoiseStage, InputInfo, ModuleSpec, OutputKind, Pipeline, Shape
from runnerkit.runners.placement import Loader, Placement, held_across_stages
from runnerkit.runners.request_state import RequestState
from runnerkit.runners import writes
from runnerkit.runners.requests import RequestChecksMixin
from runnerkit.runners.warmup import WarmupMixin
from runnerkit.schedulers import SCHEDULERS
from runnerkit.schedulers.base import Scheduler
from runnerkit.text_buckets import TextBuckets, choose, configured

__all__ = ["DefaultRunner", "InputInfo", "Shape"]


class DefaultRunner(WarmupMixin, RequestChecksMixin, BaseRunner):
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
        for key in ("text_encoder_path", "upsampler_path"):
            value = getattr(self.config, key)
            if value is not None and key not in self.MODULE_PATHS:
                raise ValueError(f"`{key}` ({value!r}) is not read by {self.config.model_cls!r}: its checkpoint folder "
                                 "holds that module; remove it")
        self.check_stream_modules()
        if self.TEXT_BUCKETS is None and self.config.text_buckets != "auto":
            raise ValueError(f"`text_buckets` ({self.config.text_buckets!r}) is not read by {self.config.model_cls!r} "
                             f"task {self.config.task!r}: "
                             "its prompts are not padded to text buckets (docs/prompt_lengths.md); remove it")
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
        self._fit_unchecked_logged = False
        self._fit_deferred_logged = False
        self._budget: memory.MemoryLimit | None = None  # device_budget(): read once, before loading
        self._budget_read = False

    def check_stream_modules(self) -> None:
        """Refuse an `offload.stream_modules` entry that is not one of this runner's `STREAM_MODULES`
        (before planning and loading: under mode auto it would otherwise exclude every streaming candidate).

        Raises:
            ValueError: naming the field, the value, the names that cannot stream and the allowed ones.
        """
        names = self.config.offload.stream_modules
        if names is None:
            return
        bad = [n for n in names if n not in self.STREAM_MODULES]
        if bad:
            allowed = list(self.STREAM_MODULES) or "none (no module of this runner streams)"
            raise ValueError(f"`offload.stream_modules`={list(names)}: {bad} cannot stream in model_cls "
                             f"{self.config.model_cls!r} (task {self.config.task!r}, {type(self).__name__}); "
                             f"modules that can: {allowed}")

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
        """The block streamer of `model` when the CFG branches share one pass through its blocks:
        `offload.mode` "block" and `model` streamed. The family's `run_step` then
        calls the transformer's `forward_branches` inside `streamer.entries(branches)`, so each block
        is moved once per step instead of once per branch. None otherwise: resident or
        model-offloaded (nothing is moved per block, and one forward per branch keeps the smaller
        activation peak), or mode "phase" (branch-major inside a block would enter its phases
        0, 1, 2, 0, 1, 2: one forward per branch, each phase moved twice per step)."""
        if self.config.offload.mode != "block":
            return None
        return next((s for s in self.streamers.values() if s.streams(model)), None)

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
        """Refuse a `parallel` config this runner cannot serve (at load, after `prepare_load`).

        Raises:
            ParallelSetupError: `parallel` is set but no process group is attached (not under torchrun).
            NotImplementedError: a mode the family does not support, or heads that do not divide by `ulysses`.
        """
        par = self.config.parallel
        if par is None:
            return
        from runnerkit.parallel.group import ParallelSetupError, split_even

        if self.parallel is None:
            raise ParallelSetupError("`parallel` is set but this runner has no process group: launch with "
                                     f"`torchrun --nproc_per_node {par.world_size} -m runnerkit.infer ...`")
        asked = [m for m, on in (("cfg", par.cfg > 1), ("ulysses", par.ulysses > 1)) if on]
        unsupported = [m for m in asked if m not in self.PARALLEL_MODES]
        if unsupported:
            raise NotImplementedError(f"`parallel`: {type(self).__name__} (task {self.config.task!r}) does not support "
                                      f"{unsupported} parallel (supported: {sorted(self.PARALLEL_MODES)})")
        if par.ulysses > 1:
            split_even(self.attention_heads(), par.ulysses, "the attention heads", "each rank attends with its share "
                       "of the heads")

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
        runners/fit.py for what the family gives (module weights, per-stage activations) and what
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
        if self.lora is not None:
            self.preload_adapters()

    def preload_adapters(self) -> None:
        """Read and match every named adapter of the config's `lora.adapters` at load, one at a time:
        a missing or unusable file fails the load (naming it) instead of the first request that names
        it, and the parsed adapters are cached (`LoRAManager.read`, up to `ADAPTER_CACHE_SIZE`), so the
        first request with one does not read it from disk; in fused mode the base copies of the layers
        they cover are taken now (`LoRAManager.prepare`), not by the first request.

        Raises:
            runnerkit.lora.LoRAError: naming the adapter's file and what is wrong with it.
        """
        assert self.lora is not None and self.config.lora is not None and self.pipeline is not None
        for name, path in self.config.lora.adapters.items():
            try:
                self.lora.prepare(((path, 1.0),))  # matched now; fused: the base copies too
            except LoRAError as exc:
                raise LoRAError(f"`lora.adapters.{name}`: {exc}") from exc
        unbuilt = [m.name for m in self.pipeline.modules if m.role == "transformer" and m.name not in self.lora.targets]
        if self.config.lora.adapters and unbuilt:  # unload_modules: no transformer exists between requests
            logger.warning("`lora.adapters` {} were read but not matched to {}: under `unload_modules` the transformer "
                           "is first built by a request, so an adapter that does not fit it fails that request (then "
                           "every later submission is checked)", sorted(self.config.lora.adapters), unbuilt)

    def check_fp8_compute(self, pipeline: Pipeline) -> None:
        """`compute_dtype: fp8`: refuse it where it cannot run, before anything loads; else remember
        whether the bias goes into the fp8 GEMM (`fp8_compute.probe`, one tiny matmul on the device).

        Raises:
            NotImplementedError: no transformer of the pipeline declares its blocks for fp8 compute
                (`ModuleSpec.fp8_skip` None), or the device or torch cannot (with the probe's reason).
        """
        declared = [m.name for m in pipeline.modules if m.role == "transformer" and m.fp8_skip is not None
                    and m.blocks is not None]
        if not declared:
            raise NotImplementedError(f"`compute_dtype`='fp8': {type(self).__name__} does not declare which of its "
                                      "transformer's block layers may compute in fp8; use `compute_dtype`='same'")
        why, bias_in_gemm = fp8_compute.probe(self.device, self.dtype)
        if why is not None:
            raise NotImplementedError(f"`compute_dtype`='fp8' cannot run on {self.device} with `dtype`="
                                      f"{self.config.dtype!r}: {why}; use `compute_dtype`='same'")
        self.fp8_bias_in_gemm = bias_in_gemm
        logger.info("fp8 compute: block linear layers of {} in E4M3 (rowwise scales) via torch._scaled_mm on {}, "
                    "bias {}", declared, self.device, "in the GEMM" if bias_in_gemm else "added after")

    def build_scheduler(self, stage: DenoiseStage) -> Scheduler:
        """A fresh scheduler of `stage` (no request state)."""
        return SCHEDULERS[stage.scheduler](shift=stage.shift, spacing=stage.spacing, sigmas=stage.sigmas)

    @property
    def scheduler(self) -> Scheduler | None:
        """The first denoise stage's scheduler (the one a single-stage family has)."""
        return next(iter(self.schedulers.values()), None)

    def place_modules(self, pipeline: Pipeline) -> Placement:
        """Build every module where the offload config puts it (ARCHITECTURE §4).

        none: all resident on the device; model: all in host memory, each visits the device for
        its stage; block/phase: the modules of `offload.stream_modules` (default: the streamable
        transformers) stream their blocks or layers (built per stage under lazy_load), the others
        are model-offloaded; in model/block/phase, `offload.resident_modules` are built on the
        device instead; unload_modules: every module built per stage.

        Raises:
            NotImplementedError: block/phase offload of a pipeline without a streamable module.
            ValueError: `offload.stream_modules` names a module that is not in the pipeline or cannot stream;
                `offload.resident_modules` names one that is not in the pipeline or streams.
        """
        cfg, off = self.config, self.config.offload
        thresholds = dict(empty_cache_min_free_gib=cfg.memory.empty_cache_min_free_gib,
                          empty_cache_min_reclaimable_gib=cfg.memory.empty_cache_min_reclaimable_gib)
        pin = pin_memory_enabled(off)
        cpu = torch.device("cpu")
        resident: dict[str, nn.Module] = {}
        offloaded: dict[str, nn.Module] = {}
        loaders: dict[str, Loader] = {}
        if cfg.unload_modules:
            loaders = {m.name: self._per_stage(m, streamed=False) for m in pipeline.modules}
        elif off.mode == "none":
            resident = {m.name: self._build(m, self.device) for m in pipeline.modules}
        elif off.mode == "model":
            kept = self._resident_choice(pipeline, ())
            resident = {m.name: self._build(m, self.device) for m in pipeline.modules if m.name in kept}
            offloaded = {m.name: self._build(m, cpu) for m in pipeline.modules if m.name not in kept}
        else:
            if cfg.compute_dtype == "fp8":  # the config refuses block/phase; the memory planner may choose it
                raise NotImplementedError(f"`compute_dtype`='fp8' with `offload.mode`={off.mode!r}: streamed blocks "
                                          "cannot hold fp8 compute weights; use 'none' or 'model'")
            streamable = stream_choice(pipeline, off.stream_modules, type(self).__name__)
            if not streamable:
                raise NotImplementedError(f"`offload.mode`={off.mode!r}: {type(self).__name__} has no module that "
                                          "streams its blocks; use 'none' or 'model'")
            kept = self._resident_choice(pipeline, [x.name for x in streamable])
            resident = {m.name: self._build(m, self.device) for m in pipeline.modules if m.name in kept}
            offloaded = {m.name: self._build(m, cpu) for m in pipeline.modules
                         if m.name not in {x.name for x in streamable} and m.name not in kept}
            self._log_cfg_passes(streamable)
            for m in streamable:
                if off.lazy_load:
                    self._stream(m)  # once now, so a checkpoint that cannot stream fails at load
                    self._drop_streamer(m.name)
                    loaders[m.name] = self._per_stage(m, streamed=True)
                else:
                    resident[m.name] = self._stream(m)
        self.modules = {**resident, **offloaded}
        return Placement(self.device, resident=resident, offloaded=offloaded, loaders=loaders, pin_memory=pin,
                         **thresholds)

    def _resident_choice(self, pipeline: Pipeline, streamed: Sequence[str]) -> set[str]:
        """The modules of `offload.resident_modules`, checked against the pipeline and the streamed ones.

        Raises:
            ValueError: a name that is not a module of the pipeline, or one that streams (`streamed`).
        """
        names = self.config.offload.resident_modules or ()
        known = [m.name for m in pipeline.modules]
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"`offload.resident_modules`={list(names)}: {type(self).__name__} has no module {bad}; "
                             f"its modules: {known}")
        both = [n for n in names if n in streamed]
        if both:
            raise ValueError(f"`offload.resident_modules`={list(names)}: {both} stream their blocks in mode "
                             f"{self.config.offload.mode!r} (streamed: {list(streamed)}); list the modules to "
                             "stream in `offload.stream_modules` without them, or leave them out of resident_modules")
        return set(names)

    def _log_cfg_passes(self, streamed: Sequence[ModuleSpec]) -> None:
        """One INFO line: how the CFG branches go through the streamed transformer(s)."""
        names = [m.name for m in streamed if m.role == "transformer"]
        if not (self.CFG_ONE_PASS and self.config.enable_cfg and names):
            return
        if self.config.offload.mode == "block":
            logger.info("CFG: both branches run through each streamed block of {} while it is on the device "
                        "(one block pass per step)", names)
        else:
            logger.info("CFG with `offload.mode`='phase': one forward per branch, so each phase of {} is "
                        "streamed twice per step (mode 'block' streams each block once for both branches)", names)

    def _build(self, spec: ModuleSpec, device: torch.device) -> nn.Module:
        module = spec.build(device)
        self._finish(spec, module)
        return module

    def _stream(self, spec: ModuleSpec) -> nn.Module:
        assert spec.stream is not None, f"module {spec.name} does not stream"
        module, streamer = spec.stream()
        self._finish(spec, module)
        self.streamers[spec.name] = streamer
        return module

    def _finish(self, spec: ModuleSpec, module: nn.Module) -> None:
        """What every built module gets, on every build path: LoRA slots (transformers, config `lora`),
        fp8 compute (config `compute_dtype`), the attention backend, regional compile."""
        if self.config.compute_dtype == "fp8" and spec.role == "transformer" and spec.fp8_skip is not None:
            assert spec.blocks is not None, f"{spec.name}: fp8_skip without blocks (check_fp8_compute)"
            start = time.perf_counter()
            done, kept = fp8_compute.convert_blocks(module, spec.blocks, spec.fp8_skip, self.dtype,
                                                    self.fp8_bias_in_gemm)
            logger.info("fp8 compute: {} linear layers of {} quantized in {:.2f} s; kept in {}: {}", len(done),
                        spec.name, time.perf_counter() - start, self.config.dtype,
                        sorted({k.split(".", 2)[-1] + f" ({v})" for k, v in kept.items()}) or "none")
        if self.lora is not None and spec.role == "transformer":
            self.lora.attach(spec.name, module)
        attention.install(module, self.attention)
        if self.parallel is not None and self.parallel.ulysses > 1:
            from runnerkit.parallel import sequence

            if sequence.install(module, sequence.SequenceParallel(self.parallel)) == 0 and spec.role == "transformer":
                raise NotImplementedError(f"`parallel.ulysses`: transformer {spec.name!r} of {type(self).__name__} "
                                          "does not shard its tokens (no ShardsSequence inside it)")
        regional_compile.install(module, spec.blocks, self.config.compile)

    def _drop_streamer(self, name: str) -> None:
        streamer = self.streamers.pop(name, None)
        if streamer is not None:
            streamer.close()

    def _per_stage(self, spec: ModuleSpec, streamed: bool) -> Loader:
        def load() -> tuple[nn.Module, Callable[[], None]]:
            module = self._stream(spec) if streamed else self._build(spec, self.device)
            return module, lambda: self._drop_streamer(spec.name)

        return load

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
        before, total = self._progress_offsets(self.pipeline)
        done = before.get(stage, total) + step  # decoders and save: every step is done
        current = self.profiler.current
        self.on_progress(Progress(index=current.index if current is not None else 0, stage=stage, step=step,
                                  steps=steps, steps_done=done, steps_total=total))

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _progress_offsets(pipeline: Pipeline) -> tuple[dict[str, int], int]:
        """Per stage, the denoising steps of the stages before it; and the request's total steps."""
        denoise = pipeline.denoise
        before = {s.name: sum(d.steps for d in denoise[:k]) for k, s in enumerate(denoise)}
        before.update({s.transition: before[s.name] for s in denoise if s.transition is not None})
        before.update({e.name: 0 for e in pipeline.encoders})
        return before, sum(s.steps for s in denoise)

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
        self.check_fit(info.shape, f"request {index}")
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


def check_finite_latents(latents: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse denoised latents that hold NaN or Inf before they are decoded (one device sync per
    request or warmup shape). Decoded, they would give a video or image of noise, and the request
    would look successful. `dtype`: the transformer's compute dtype, named in the message.

    Raises:
        FloatingPointError: naming how many values are not finite, the dtype and the likely causes.
    """
    bad = int((~torch.isfinite(latents)).sum())
    if bad:
        raise FloatingPointError(
            f"the denoised latents {list(latents.shape)} hold {bad} non-finite values (NaN or Inf) of "
            f"{latents.numel()}: NaN or Inf in the checkpoint's weights (the transformer's, or an encoder's "
            f"that fed it) or in a LoRA, or an overflow in {str(dtype).removeprefix('torch.')}; nothing is "
            "decoded or saved")


def stream_choice(pipeline: Pipeline, names: Sequence[str] | None, runner: str) -> list[ModuleSpec]:
    """The modules that stream in mode block/phase: those of `names` (config `offload.stream_modules`),
    or, for None, every streamable module of role "transformer".

    Raises:
        ValueError: a name that is not a module of the pipeline, or a module that cannot stream
            (the message lists the ones that can).
    """
    can = [m for m in pipeline.modules if m.stream is not None]
    if names is None:
        return [m for m in can if m.role == "transformer"]
    bad = [n for n in names if n not in {m.name for m in can}]
    if bad:
        raise ValueError(f"`offload.stream_modules`={list(names)}: {runner} cannot stream {bad}; modules that "
                         f"can stream: {[m.name for m in can]}")
    return [m for m in can if m.name in names]
