"""Qwen-Image text-to-image runner: loading, the request stages, true CFG, and its warmup.

Source of the pipeline: diffusers `QwenImagePipeline` (pipelines/qwenimage/pipeline_qwenimage.py)
and the Qwen-Image technical report: Qwen2.5-VL prompt embeddings (valid tokens of the last
hidden state, the system-prompt prefix dropped), noise [1, 16, 1, H/8, W/8] packed into 2x2
patches [1, H/16 * W/16, 64], flow-match Euler with dynamic shifting (mu from the token count),
the transformer on the cond and uncond prompts, true CFG with per-token norm rescale, VAE decode.
Image editing (task i2i) is `edit.QwenImageEditRunner`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from loguru import logger
from torch import nn

from runnerkit.config import RunnerConfig, validate_model_arch
from runnerkit.models.qwen_image import text_encoder as te
from runnerkit.models.qwen_image.arch import QwenImageArch, QwenImageTransformerArch
from runnerkit.models.qwen_image.checkpoint import LAYOUTS, QwenCheckpoint, write_synthetic
from runnerkit.models.qwen_image.estimate import qwen_denoise_flops, qwen_estimate
from runnerkit.models.qwen_image.latents import pack_latents, true_cfg, unpack_latents
from runnerkit.models.qwen_image.scheduler import QwenImageScheduler, QwenSchedulerConfig, check_steps
from runnerkit.models.qwen_image.transformer import QwenImageTransformer2D, keep_fp32
from runnerkit.models.qwen_image.vae import build_qwen_vae, decode_latents
from runnerkit.lora import linear_targets
from runnerkit.nets.causal_vae3d import CausalVAE3D as WanVAE  # the shared network (Wan2.1's VAE)
from runnerkit.offload.setup import stream_module
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.registry import register_runner
from runnerkit.runners.default import DefaultRunner
from runnerkit.planning.compute import StageFlops
from runnerkit.planning.fit import EstimateUnavailable, MemoryEstimate
from runnerkit.runners.pipeline import (
    DecoderStage,
    DenoiseStage,
    EncoderStage,
    InputInfo,
    ModuleSpec,
    OutputSpec,
    Pipeline,
    Shape,
)
from runnerkit.runners.request_state import RequestState
from runnerkit.schedulers.base import Scheduler
from runnerkit.weights import CheckpointError, assign_state_dict, build_on_meta

#: Negative prompt when neither config nor request gives one: a single space, as Qwen-Image's
#: published examples use (diffusers' pipeline itself runs no CFG without a negative prompt).
QWEN_NEGATIVE_PROMPT = " "

# Architectures recognised as flavours: (num_layers, inner_dim, joint_attention_dim) -> name.
FLAVOURS: dict[tuple[int, int, int], str] = {
    (2, 32, 32): "debug",  # configs/qwen_image/*_tiny.json
    (60, 3072, 3584): "20B",
}


def flavour_of(arch: QwenImageTransformerArch) -> str | None:
    """The flavour name of a transformer architecture, or None if it is not a known one."""
    return FLAVOURS.get((arch.num_layers, arch.inner_dim, arch.joint_attention_dim))


@dataclass
class QwenInputs:
    """A request's encoded inputs (the runner's `inputs`)."""

    prompt_embeds: torch.Tensor
    """[1, L, D] last hidden states of the prompt's valid tokens (model dtype); with text buckets
    padded to the bucket (zero rows after the valid ones)."""
    negative_embeds: torch.Tensor | None
    """[1, L', D] of the negative prompt (None without CFG)."""
    prompt_mask: torch.Tensor | None = None
    """[1, L] bool, True for a valid token, with text buckets (None: unpadded, no mask)."""
    negative_mask: torch.Tensor | None = None
    """[1, L'] bool of the negative prompt (None without CFG or without text buckets)."""
    vae_images: list[torch.Tensor] = field(default_factory=list)
    """i2i, between the stages: each reference image [1, 3, 1, h, w] in [-1, 1] at its VAE size."""
    ref_latents: torch.Tensor | None = None
    """i2i: packed normalised latents of every reference, concatenated: [1, sum L_i, 64] (model dtype)."""
    ref_shapes: list[tuple[int, int, int]] = field(default_factory=list)
    """i2i: each reference's patch grid (1, h/16, w/16), in order."""


@register_runner("qwen_image")
class QwenImageRunner(DefaultRunner):
    """Qwen-Image text-to-image (20B, and the tiny `debug` architecture)."""

    TASKS = ("t2i",)
    CFG_ONE_PASS = True  # run_step: forward_branches under block streaming
    #: t2i and edit split their CFG branches and their image tokens (runnerkit/parallel; text tokens on every rank).
    PARALLEL_MODES = frozenset({"cfg", "ulysses"})
    SPATIAL_FACTOR = 16  # VAE 8x * patch 2
    TEMPORAL_FACTOR = 1
    DEFAULT_NEGATIVE_PROMPT = QWEN_NEGATIVE_PROMPT
    #: diffusers QwenImagePipeline defaults: 50 steps, true CFG scale 4.0, 1328x1328 (the model's
    #: 1:1 training size); flow-match Euler with dynamic shifting (the shift follows the token
    #: count, `sample_shift` is not used).
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": 50, "target_height": 1328, "target_width": 1328, "target_video_length": 1, "fps": 1,
        "sample_shift": 1.0, "sample_guide_scale": 4.0, "scheduler": "euler", "scheduler_spacing": "diffusers"}
    RESULT_KINDS = {"t2i": "image"}
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {"t2i": ()}
    STREAM_MODULES: ClassVar[tuple[str, ...]] = ("text_encoder", "transformer")
    #: Text buckets under `text_buckets: auto` (docs/prompt_lengths.md): powers of two from 64 to the
    #: 1024-token prompt limit. A joint sequence of >= 4096 image tokens (1024x1024 and up) grows by
    #: < 1.6 % when a 1-token negative prompt pads to 64; a 600-token prompt pays 424 padded tokens
    #: (< 6 % more tokens at 1328x1328). Warmup covers each bucket at each warmup shape.
    TEXT_BUCKETS: ClassVar[tuple[int, ...] | None] = (64, 128, 256, 512, 1024)

    # ---- warmup opt-in (declared here; not inherited by subclasses) --------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("t2i",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> (square, production non-square) shapes as (height, width, frames).
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((32, 32, 1), (48, 80, 1)),
        "20B": ((1328, 1328, 1), (928, 1664, 1)),
    }

    def __init__(self, config: RunnerConfig) -> None:
        if config.sample_shift is not None:  # before the family defaults fill it
            raise ValueError(f"`sample_shift` ({config.sample_shift}) is not used by {config.model_cls}: its sigmas are "
                             "shifted by the image token count (dynamic shifting, the checkpoint's scheduler config); "
                             "remove it")
        if config.fps is not None:
            raise ValueError(f"`fps` ({config.fps}) does nothing for {config.model_cls}: it makes one image; remove it")
        super().__init__(config)
        config = self.config  # with the family defaults
        if not isinstance(config.sample_guide_scale, (int, float)):
            raise ValueError(f"`sample_guide_scale` must be one number for {config.model_cls} (the true CFG scale); "
                             f"got {config.sample_guide_scale!r}")
        if config.boundary is not None:
            raise ValueError(f"`boundary` ({config.boundary}) switches MoE experts; {config.model_cls} has one "
                             "transformer: remove it")
        if config.scheduler != "euler" or config.scheduler_spacing != "diffusers":
            raise ValueError(f"`scheduler` {config.scheduler!r} / `scheduler_spacing` {config.scheduler_spacing!r}: "
                             f"{config.model_cls} samples with flow-match Euler and dynamic shifting only "
                             "(scheduler 'euler', spacing 'diffusers')")
        if config.offload.vae_tiling:
            raise NotImplementedError(f"`offload.vae_tiling` is not available for {config.model_cls} (one image is "
                                      "decoded whole)")
        self.arch_override = self.parse_arch(config.model, partial=config.model_path is not None)
        self.checkpoint: QwenCheckpoint | None = None
        self.tokenizer: Any = None
        self.processor: Any = None
        self._declared: tuple[str, QwenSchedulerConfig] | None = None
        self._warmup_pad_to: int | None = None  # run_warmup: the bucket its extra runs pad every prompt to
        self.check_task_fits()
        self.check_schedule()

    def check_schedule(self) -> None:
        """`infer_steps` against the checkpoint's scheduler settings (its config file; the default
        ones for a synthetic checkpoint still to write), before anything loads.

        Raises:
            ValueError: naming `infer_steps` (e.g. 1 step with a terminal stretch).
        """
        declared = self.declared()
        if declared is not None:
            check_steps(self.config.infer_steps, declared[1])

    def declared(self) -> tuple[str, QwenSchedulerConfig] | None:
        """What the checkpoint itself declares, read once (its config files, not the config's
        `model`; the configured architecture for a synthetic checkpoint still to write): its kind
        (t2i, edit, edit_plus) and scheduler settings. None if unreadable (the load says why)."""
        if self._declared is None:
            try:
                path = self.checkpoints.path()
                if self.checkpoints.pending(path):
                    edit = self.arch_override.edit
                    self._declared = ("t2i" if edit is None else edit.variant, QwenSchedulerConfig())
                else:
                    ckpt = self.open_checkpoint(path, raw=True)
                    self._declared = (ckpt.kind, ckpt.scheduler)
            except (ValueError, OSError):  # CheckpointError included
                return None
        return self._declared

    @classmethod
    def validate_shape(cls, height: int, width: int, frames: int) -> None:
        """Height and width on the 16-pixel grid; one frame.

        Raises:
            ValueError: naming `target_height`, `target_width` or `target_video_length`.
        """
        if frames != 1:
            raise ValueError(f"`target_video_length` must be 1: Qwen-Image makes one image (got {frames})")
        super().validate_shape(height, width, frames)

    @staticmethod
    def parse_arch(model: dict[str, Any] | None, partial: bool = False) -> QwenImageArch:
        """The config's `model` key as a validated Qwen-Image architecture (defaults fill what it omits).

        Raises:
            ValueError: naming each bad field as `model.<component>.<field>`.
        """
        return validate_model_arch(QwenImageArch, model, partial, "qwen_image", "runnerkit/models/qwen_image/arch.py")

    # ---- memory estimate (models/qwen_image/estimate.py) -----------------------------------
    def architecture(self) -> QwenImageArch:
        """The checkpoint's architecture: the loaded one; before loading from its config files, or the configured
        one (the release sizes filling what it omits) for a synthetic checkpoint still to write or a planning
        runner's absent checkpoint.

        Raises:
            EstimateUnavailable: the config files cannot be read before loading (the load then says why).
        """
        if self.checkpoint is not None:
            return self.checkpoint.arch
        try:
            path = self.checkpoints.path()
            return self.arch_override if self.checkpoints.arch_from_config(path) else self.open_checkpoint(path).arch
        except (ValueError, OSError) as exc:  # CheckpointError included
            raise EstimateUnavailable(f"the checkpoint's architecture cannot be read before loading ({exc})") from None

    def estimate_sources(self) -> list[str]:
        """Where the estimate before loading takes the architecture from (`runnerkit plan`)."""
        if self.checkpoint is None and self.checkpoints.absent():
            return [f"architecture: the config's `model` over the Qwen-Image release sizes (runnerkit/models/"
                    f"qwen_image/arch.py defaults): `model_path` {self.config.model_path} does not exist"]
        return super().estimate_sources()

    def estimate_memory(self, shape: Shape) -> MemoryEstimate:
        """Text encoder, (reference encode,) one transformer step, VAE decode and save of `shape` on `self.device`
        (bounds and sources: models/qwen_image/estimate.py); editing counts the checkpoint's most references.

        Raises:
            EstimateUnavailable: see `architecture`.
        """
        arch, cfg = self.architecture(), self.config
        images = arch.edit.max_images if arch.edit is not None and self.IMAGE_INPUTS.get(cfg.task) else 0
        return qwen_estimate(arch, shape, self.dtype, self.device, cfg.enable_cfg, cfg.offload, images,
                             self.lora_slot_rank())

    def denoise_flops(self, shape: Shape) -> tuple[StageFlops, ...]:
        """FLOPs of a step at `shape` (estimate.py `qwen_denoise_flops`). Raises EstimateUnavailable: see `architecture`."""
        return qwen_denoise_flops(self.architecture(), self.config, shape, len(self.IMAGE_INPUTS.get(self.config.task, ())))

    # ---- modules that tests and tools look at ---------------------------------------------
    @property
    def transformer(self) -> QwenImageTransformer2D | None:
        """The loaded transformer (None when built per stage: lazy_load, unload_modules)."""
        return self.modules.get("transformer")  # type: ignore[return-value]

    @property
    def streamer(self) -> BlockStreamer | None:
        """The transformer's block/phase streamer (None unless streaming)."""
        return self.streamers.get("transformer")

    # ---- synthetic checkpoints (runnerkit.tools.synth_checkpoint) ----------------------------
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = LAYOUTS

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Write deterministic random weights of `config.model`'s architecture to `out` (checkpoint.py)."""
        write_synthetic(cls.parse_arch(config.model), out, seed, dtype, layout, **options)  # type: ignore[arg-type]

    # ---- loading -----------------------------------------------------------------------
    def open_checkpoint(self, path: Path, raw: bool = False) -> QwenCheckpoint:
        """The checkpoint at `path` with the config's `model` over its architecture (`raw`: without it)."""
        return QwenCheckpoint.open(path, override=None if raw else self.config.model)

    def prepare_load(self) -> None:
        """Checkpoint (written first if synthetic) and its files checked, its architecture into the
        config, the tokenizer (and the VL processor for editing).

        Raises:
            CheckpointError: the checkpoint is missing or damaged, naming the file and the tensor.
        """
        self.check_task_fits()
        self.checkpoint = ckpt = self.checkpoints.locate()
        ckpt.check_files()
        logger.info("checkpoint {} ({} layout, {}), flavour {}", ckpt.path, ckpt.layout, ckpt.kind,
                    flavour_of(ckpt.arch.transformer))
        check_steps(self.config.infer_steps, ckpt.scheduler)  # e.g. 1 step with a terminal stretch: refused now
        self.update_config(model=ckpt.arch.model_dump(mode="json"), model_path=str(ckpt.path))
        self.tokenizer = te.load_tokenizer(ckpt.folder("tokenizer"))
        if ckpt.arch.edit is not None:
            self.processor = te.load_processor(ckpt.folder("processor"))

    def attention_head_dim(self) -> int:
        """The transformer's `attention_head_dim` (128 for the 20B model)."""
        assert self.checkpoint is not None, "prepare_load first"
        return self.checkpoint.arch.transformer.attention_head_dim

    @classmethod
    def lora_layers(cls, config: RunnerConfig, layout: str) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """The blocks' linear layers of `config.model`'s transformer (what Qwen-Image-Lightning covers);
        our names are diffusers' in every layout."""
        arch = cls.parse_arch(config.model).transformer
        model = build_on_meta(lambda: QwenImageTransformer2D(arch))
        return {n: (m.out_features, m.in_features) for n, m in linear_targets(model).items()
                if n.startswith("transformer_blocks.")}, {}

    def attention_heads(self) -> int:
        """The transformer's attention heads (Ulysses splits them over its ranks)."""
        assert self.checkpoint is not None, "prepare_load first"
        return self.checkpoint.arch.transformer.num_attention_heads

    def sequence_tokens(self, stage: DenoiseStage, info: InputInfo) -> int:
        """Image tokens of the target and the references (Ulysses splits them; the text stays whole),
        from the request alone: the server checks them at submission and a parallel launch before
        its first request, before any encoder ran (`reference_grids`)."""
        return sum(math.prod(grid) for grid in [(1, info.height // 16, info.width // 16), *self.reference_grids(info)])

    def reference_grids(self, info: InputInfo) -> list[tuple[int, int, int]]:
        """Patch grids (1, h/16, w/16) the references of `info` will have, from their sizes only
        (the edit runner's; text-to-image has none)."""
        return []

    def build_scheduler(self, stage: DenoiseStage) -> Scheduler:
        """Flow-match Euler with the checkpoint's dynamic-shifting settings, or the config's fixed
        `sample_sigmas` table (a step-distilled model's, e.g. Qwen-Image-Lightning's)."""
        assert self.checkpoint is not None, "prepare_load first"
        return QwenImageScheduler(self.checkpoint.scheduler, sigmas=stage.sigmas)

    def build_text_encoder(self, device: torch.device) -> nn.Module:
        assert self.checkpoint is not None, "prepare_load first"
        return te.load_text_encoder(self.checkpoint.folder("text_encoder"), self.dtype, device)

    def stream_text_encoder(self) -> tuple[nn.Module, BlockStreamer]:
        """The Qwen2.5-VL with its decoder layers (or their attention and MLP, mode "phase") streamed
        from host memory or the folder's safetensors (`offload.stream_modules` lists "text_encoder")."""
        assert self.checkpoint is not None, "prepare_load first"
        return te.stream_text_encoder(self.checkpoint.folder("text_encoder"), self.config.offload, self.device,
                                      self.dtype)

    def build_vae(self, device: torch.device) -> WanVAE:
        assert self.checkpoint is not None, "prepare_load first"
        return build_qwen_vae(self.checkpoint.arch.vae, self.checkpoint.vae_state_dict(), torch.float32).to(device)

    def build_transformer(self, device: torch.device) -> QwenImageTransformer2D:
        ckpt = self.checkpoint
        assert ckpt is not None, "prepare_load first"
        model = build_on_meta(lambda: QwenImageTransformer2D(ckpt.arch.transformer))
        assign_state_dict(model, ckpt.transformer_state_dict(), "transformer", dtype=self.dtype, keep_fp32=keep_fp32,
                          device=device)
        return model.to(device).eval().requires_grad_(False)

    def stream_transformer(self) -> tuple[QwenImageTransformer2D, BlockStreamer]:
        """The transformer with its blocks (or phases) streamed from host memory or the checkpoint files."""
        ckpt = self.checkpoint
        assert ckpt is not None, "prepare_load first"
        model = build_on_meta(lambda: QwenImageTransformer2D(ckpt.arch.transformer))
        off = self.config.offload
        if off.storage == "cpu":
            streamer = stream_module(model, QwenImageTransformer2D.STREAM_SPEC, off, self.device, self.dtype,
                                     "transformer", state_dict=ckpt.transformer_state_dict(), consume=True)
        else:
            names = list(model.state_dict(keep_vars=True))  # the file names are the model's names
            streamer = stream_module(model, QwenImageTransformer2D.STREAM_SPEC, off, self.device, self.dtype,
                                     "transformer", files=ckpt.transformer_files(), key_map={n: n for n in names})
        return model.eval().requires_grad_(False), streamer

    def describe_pipeline(self) -> Pipeline:
        """Qwen2.5-VL text encoder (-> VAE encoder of the references, i2i) -> one denoise stage of the
        transformer (true CFG) -> VAE decoder -> image."""
        cfg = self.config
        return Pipeline(
            modules=(ModuleSpec("text_encoder", "text_encoder", build=self.build_text_encoder,
                                stream=self.stream_text_encoder),
                     ModuleSpec("transformer", "transformer", build=self.build_transformer,
                                stream=self.stream_transformer, blocks=QwenImageTransformer2D.STREAM_SPEC.blocks_attr,
                                fp8_skip=QwenImageTransformer2D.FP8_SKIP),
                     ModuleSpec("vae", "decoder", build=self.build_vae)),
            encoders=self.encoder_stages(),
            denoise=(DenoiseStage("transformer", transformers=("transformer",), steps=cfg.infer_steps,
                                  scheduler=cfg.scheduler, shift=cfg.sample_shift, spacing=cfg.scheduler_spacing,
                                  sigmas=cfg.sample_sigmas, latent_shape=self.latent_shape),),
            decoders=(DecoderStage("vae_decoder", module="vae", output="image", run=self.run_vae_decoder),),
            outputs=(OutputSpec("image", "image"),),
        )

    def encoder_stages(self) -> tuple[EncoderStage, ...]:
        """Text-to-image: the text encoder alone, once per request (warmup: once)."""
        return (EncoderStage("text_encoder", module="text_encoder", run=self.run_text_encoder),)

    #: The kind of checkpoint each task needs (checkpoint.QwenCheckpoint.kind).
    TASK_KINDS: ClassVar[dict[str, tuple[str, ...]]] = {"t2i": ("t2i",), "i2i": ("edit", "edit_plus")}

    def check_task_fits(self) -> None:
        """The checkpoint must be trained for the task (a text-to-image checkpoint for t2i, an Edit or
        Edit-Plus one for i2i).

        Raises:
            CheckpointError: naming the checkpoint, its kind and the task to use instead.
        """
        declared = self.declared()
        if declared is None:
            return
        kind = declared[0]
        pending = self.checkpoints.pending(self.checkpoints.path())
        task = self.config.task
        where = self.config.model_path or "the synthetic checkpoint"
        if kind not in self.TASK_KINDS[task]:
            other = next(t for t, kinds in self.TASK_KINDS.items() if kind in kinds)
            raise CheckpointError(f"task {task!r} needs a {' or '.join(self.TASK_KINDS[task])} checkpoint, but "
                                  f"{where} is a checkpoint of kind {kind!r}: use --task {other}, or another checkpoint")
        configured = (self.config.model or {}).get("edit")
        if not pending and configured is not None and kind == "t2i":
            raise CheckpointError(f"the config's `model.edit` describes an editing checkpoint, but {where} is a "
                                  "text-to-image one: remove `model.edit` from the config")

    def flavour(self) -> str | None:
        """From the loaded checkpoint; before loading from its config files (or the configured
        architecture of a synthetic checkpoint still to write)."""
        if self.checkpoint is not None:
            return flavour_of(self.checkpoint.arch.transformer)
        path = self.checkpoints.path()
        if self.checkpoints.pending(path):
            return flavour_of(self.arch_override.transformer)
        return flavour_of(self.open_checkpoint(path).arch.transformer)

    # ---- request stages ------------------------------------------------------------------
    def latent_shape(self, info: InputInfo) -> tuple[int, ...]:
        """[1, z_dim, 1, H/8, W/8] (the noise diffusers draws as [1, 1, z, H/8, W/8]: the same order)."""
        assert self.checkpoint is not None, "load_modules first"
        return (1, self.checkpoint.arch.vae.z_dim, 1, info.height // 8, info.width // 8)

    def prompt_encoder(self, req: RequestState) -> te.QwenPromptEncoder:
        return te.QwenPromptEncoder(self.tokenizer, self.processor, req.modules["text_encoder"])

    def prompts(self, info: InputInfo) -> list[str]:
        """The prompt, and the negative prompt when CFG is on."""
        return [info.prompt, info.negative_prompt] if self.config.enable_cfg else [info.prompt]

    @torch.inference_mode()
    def run_text_encoder(self, req: RequestState) -> QwenInputs:
        """Prompt (and negative prompt, for CFG) -> QwenInputs with [1, L, D] embeddings; with text
        buckets (`text_buckets`), each padded to its bucket with its [1, L] mask."""
        info = req.info
        encoder = self.prompt_encoder(req)
        buckets = self.text_buckets()
        if not buckets:
            embeds = [encoder.encode_t2i(p)[None] for p in self.prompts(info)]  # [1, L, D] each
            return QwenInputs(prompt_embeds=embeds[0], negative_embeds=embeds[1] if len(embeds) > 1 else None)
        padded = [encoder.encode_t2i_padded(p, buckets, pad_to=self._warmup_pad_to) for p in self.prompts(info)]
        neg = padded[1] if len(padded) > 1 else None
        return QwenInputs(prompt_embeds=padded[0].embeds[None], negative_embeds=None if neg is None else neg.embeds[None],
                          prompt_mask=padded[0].mask[None], negative_mask=None if neg is None else neg.mask[None])

    def run_warmup(self, shapes: Sequence[Shape]) -> None:
        """The default warmup (warmup.py: text encoder once, each shape through the whole pipeline),
        then every text bucket the warmup prompts did not fall in: the text encoder once with every
        prompt (cond and negative) padded to the bucket, and one transformer step (every CFG
        branch) at each warmup shape; no VAE decode (its shapes do not follow the text). So each
        (image shape, text length) a request can produce at a warmup shape has run once
        (docs/prompt_lengths.md). Without buckets (exact lengths) only the warmup prompts' text lengths
        are warm: a prompt of another length builds its attention plans on its first request."""
        super().run_warmup(shapes)
        buckets = self.text_buckets()
        if not buckets and self.TEXT_BUCKETS is None:  # Edit: not bucketed, its text lengths follow the images too
            return
        if not buckets:
            lengths = sorted({self.prompt_length(p) for p in self.prompts(self.warmup_info(shapes[0]))})
            logger.info("warmup: no text buckets (exact prompt lengths): text lengths {} tokens warm at {} shapes; a "
                        "prompt of another length pays a one-time cost on its first request (docs/prompt_lengths.md)",
                        lengths, len(shapes))
            return
        seen = self.warmed_buckets()
        shortest = self.prompt_length("")  # the template alone: no prompt gives fewer tokens
        start = time.perf_counter()
        extra = [b for b in buckets if b not in seen and b >= shortest]  # a bucket below `shortest` is never used
        for bucket in extra:
            self._warmup_pad_to = bucket
            try:
                shared = self.run_encoders(RequestState(self.warmup_info(shapes[0])), per_shape=False)
                for shape in shapes:
                    req = RequestState(self.warmup_info(shape), inputs=shared)
                    try:
                        self.run_encoders(req, per_shape=True)
                        self.run_denoise(req, warmup=True)
                    finally:
                        self.reset_request_state()
            finally:
                self._warmup_pad_to = None
        logger.info("warmup: text buckets {} (warm from the default warmup: {}; below the shortest text, {} tokens: "
                    "{}; {} more, each: text encoder once, one step at {} shapes) in {:.2f} s", list(buckets),
                    sorted(seen), shortest, [b for b in buckets if b < shortest], len(extra), len(shapes),
                    time.perf_counter() - start)

    def warmed_buckets(self) -> set[int]:
        """The buckets the default warmup's prompts (placeholder, negative) fell in: their
        tokenized lengths (the tokenizer alone; no encoder run)."""
        info = self.warmup_info((1, 1, 1))
        lengths = [self.prompt_length(p) for p in self.prompts(info)]
        return {te.bucket_length(n, self.text_buckets()) for n in lengths}

    def prompt_length(self, prompt: str) -> int:
        """Tokens `encode_t2i` returns for `prompt` (template prefix dropped, cut to the limit)."""
        ids = self.tokenizer(te.T2I_TEMPLATE.format(prompt), return_tensors="pt").input_ids
        return min(ids.shape[1], te.T2I_DROP_IDX + te.TOKENIZER_MAX_LENGTH) - te.T2I_DROP_IDX

    def img_shapes(self, req: RequestState) -> list[tuple[int, int, int]]:
        """Patch grids of the target image then the references: [(1, H/16, W/16), ...]."""
        assert isinstance(req.inputs, QwenInputs), "run the encoders first"
        return [(1, req.info.height // 16, req.info.width // 16), *req.inputs.ref_shapes]

    @torch.inference_mode()
    def run_step(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: torch.Tensor,
                 timestep: torch.Tensor, step_index: int) -> torch.Tensor:
        """Transformer on the cond (and uncond) prompt over [target, references] tokens; the target's
        tokens only; true CFG with norm rescale in float32. Returns [1, z, 1, H/8, W/8] float32."""
        inputs, info = req.inputs, req.info
        assert isinstance(inputs, QwenInputs), "run the encoders first"
        packed = pack_latents(latents)  # [1, L, 64]
        tokens = packed.shape[1]
        hidden = packed if inputs.ref_latents is None else torch.cat([packed, inputs.ref_latents], dim=1)
        # The reference casts the timestep to the latents' dtype, then divides by 1000 (sigma).
        sigma = timestep.to(self.dtype) / 1000
        shapes = self.img_shapes(req)

        def velocity(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            return model(hidden, embeds, sigma, shapes, mask)[:, :tokens].float()  # [1, L, 64]

        streamer = self.one_pass_streamer(model) if inputs.negative_embeds is not None else None
        if self.cfg_parallel and inputs.negative_embeds is not None:  # one branch per rank, then one all-gather
            pred, neg = self.cfg_branches([lambda: velocity(inputs.prompt_embeds),
                                           lambda: velocity(inputs.negative_embeds)])
            pred = true_cfg(pred, neg, float(self.config.sample_guide_scale))
        elif streamer is not None:  # block streaming: both branches through each block while it is on the device
            with streamer.entries(2):
                outs = model.forward_branches(hidden, [inputs.prompt_embeds, inputs.negative_embeds], sigma, shapes,
                                              [inputs.prompt_mask, inputs.negative_mask])
            pred, neg = (out[:, :tokens].float() for out in outs)  # [1, L, 64] each
            pred = true_cfg(pred, neg, float(self.config.sample_guide_scale))
        else:
            pred = velocity(inputs.prompt_embeds, inputs.prompt_mask)
            if inputs.negative_embeds is not None:
                pred = true_cfg(pred, velocity(inputs.negative_embeds, inputs.negative_mask),
                                float(self.config.sample_guide_scale))
        return unpack_latents(pred, info.height, info.width)

    @torch.inference_mode()
    def run_vae_decoder(self, req: RequestState, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [1, z, 1, H/8, W/8] -> image [1, 3, H, W] in [-1, 1] (float32; the VAE
        decoder clamps, as the reference's does)."""
        return decode_latents(req.modules["vae"], latents.float())

    def clear_request_state(self) -> None:
        """RoPE tables and the VAE feature cache are request state."""
        if self.transformer is not None:
            self.transformer.clear_cache()
        vae = self.modules.get("vae")
        if isinstance(vae, WanVAE):
            vae.clear_cache()


__all__ = ["QwenImageRunner", "QwenInputs", "flavour_of"]
