"""Wan2.1 text-to-video runner: loading, the request stages, CFG, and its warmup.

Source of the pipeline: Wan-Video/Wan2.1 `wan/text2video.py` (WanT2V.generate): UMT5 prompt
embeddings (and the default negative prompt for CFG), noise [16, (F-1)/4+1, H/8, W/8], flow UniPC
with shift and the reference's own sigma spacing (`scheduler_spacing` "train_range"),
`uncond + scale * (cond - uncond)`, VAE decode, clamp to [-1, 1].
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from loguru import logger
from torch import nn

from runnerkit.config import RequestConfig, RunnerConfig, validate_model_arch
from runnerkit.models.wan import text_encoder as te
from runnerkit.models.wan import lora_keys, vae_tiling
from runnerkit.models.wan.arch import WanArch, WanTransformerArch
from runnerkit.models.wan.checkpoint import LAYOUTS, WanCheckpoint, synthetic_seed_of, write_synthetic
from runnerkit.models.wan.estimate import transformer_tokens, wan_t2v_estimate
from runnerkit.models.wan.flops import wan_denoise_flops
from runnerkit.models.wan.scheduler_config import SCHEDULER_CONFIG, read_flow_shift
from runnerkit.models.wan.tokenizer import WanTokenizer
from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
from runnerkit.models.wan.vae import WanVAE, build_wan_vae
from runnerkit.offload.setup import stream_module
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.registry import register_runner
from runnerkit.runners.default import DefaultRunner
from runnerkit.planning.compute import StageFlops
from runnerkit.planning.fit import EstimateUnavailable, MemoryEstimate
from runnerkit.runners.request_state import RequestState
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
from runnerkit.weights import CheckpointError, assign_state_dict, build_on_meta

if TYPE_CHECKING:
    from runnerkit.models.wan.i2v import WanImageConditioning

# Wan2.1's default negative prompt (`wan/configs/shared_config.py`, sample_neg_prompt).
WAN_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，"
    "静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
)

# Architectures recognised as flavours: (dim, num_layers, num_heads, ffn_dim) -> name.
FLAVOURS: dict[tuple[int, int, int, int], str] = {
    (64, 2, 2, 128): "debug",  # configs/wan/wan_t2v_tiny.json
    (1536, 30, 12, 8960): "1.3B",
    (5120, 40, 40, 13824): "14B",
}


def flavour_of(arch: WanTransformerArch) -> str | None:
    """The flavour name of a transformer architecture, or None if it is not a known one."""
    return FLAVOURS.get((arch.dim, arch.num_layers, arch.num_heads, arch.ffn_dim))


@dataclass
class WanInputs:
    """A request's encoded inputs (the runner's `inputs`)."""

    context: torch.Tensor
    """[1, L, text_dim] prompt embeddings (trimmed to the prompt's tokens)."""
    context_null: torch.Tensor | None
    """[1, L', text_dim] negative-prompt embeddings (None without CFG)."""
    clip_context: torch.Tensor | None = None
    """Wan2.1 i2v / flf2v: [1, 257 | 514, 1280] CLIP tokens of the conditioning frame(s) (i2v.py)."""
    y: torch.Tensor | None = None
    """i2v / flf2v: [1, 4 + z_dim, F_lat, H/8, W/8] temporal mask + VAE latents of the conditioning clip."""
    frames: Any = None
    """i2v / flf2v, between the image stages: the request's conditioning frames (i2v.ConditioningFrames)."""


@register_runner("wan2.1")
class WanT2VRunner(DefaultRunner):
    """Wan2.1 text-to-video (1.3B / 14B, and the tiny `debug` architecture)."""

    TASKS = ("t2v",)
    CFG_ONE_PASS = True  # run_step: forward_branches under block streaming
    #: Every Wan task (t2v, i2v, flf2v, MoE) splits its CFG branches and its video tokens (runnerkit/parallel).
    PARALLEL_MODES = frozenset({"cfg", "ulysses"})
    SPATIAL_FACTOR = 16  # VAE 8x * patch 2
    TEMPORAL_FACTOR = 4
    DEFAULT_NEGATIVE_PROMPT = WAN_NEGATIVE_PROMPT
    #: Wan2.1 t2v defaults (`wan/configs/wan_t2v_*.py` and `generate.py`): 480p, 81 frames at 16 fps,
    #: 50 UniPC steps on the reference's own sigma spacing, shift 5.0 (a diffusers folder's
    #: `flow_shift` replaces it: `resolve_sample_shift`), guidance 5.0.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": 50, "target_height": 480, "target_width": 832, "target_video_length": 81, "fps": 16,
        "sample_shift": 5.0, "sample_guide_scale": 5.0, "scheduler": "unipc", "scheduler_spacing": "train_range"}
    RESULT_KINDS = {"t2v": "video"}

    # ---- warmup opt-in (declared here; not inherited by subclasses) --------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("t2v",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> (small/square, production/non-square) shapes as (height, width, frames).
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((32, 32, 5), (48, 80, 9)),
        "1.3B": ((320, 320, 17), (480, 832, 81)),
        "14B": ((320, 320, 17), (480, 832, 81)),
    }
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {"t2v": ()}
    STREAM_MODULES: ClassVar[tuple[str, ...]] = ("text_encoder", "transformer")
    #: The image conditioning the runner holds (`images`) for a task that takes images (i2v.py); None: text only.
    IMAGE_CONDITIONING: ClassVar[type[WanImageConditioning] | None] = None

    def __init__(self, config: RunnerConfig) -> None:
        # Before the family defaults fill it: the user's own shift wins over the checkpoint's.
        self.sample_shift_configured = config.sample_shift is not None
        super().__init__(config)
        config = self.config  # with the family defaults
        self.check_guidance_settings(config)
        # Without model_path (or planning without its checkpoint: `for_plan`) the config's `model` is the
        # whole architecture: check every rule now. Otherwise it overrides the checkpoint's, checked merged.
        self.arch_override = self.parse_arch(config.model, partial=config.model_path is not None
                                             and not self.checkpoints.absent())
        self.checkpoint: WanCheckpoint | None = None
        self.tokenizer: WanTokenizer | None = None
        self.images = self.IMAGE_CONDITIONING(self) if self.IMAGE_CONDITIONING is not None else None
        self.check_task_fits()  # config files only: a checkpoint of another task is refused before loading

    @staticmethod
    def check_guidance_settings(config: RunnerConfig) -> None:
        """One transformer: one guidance scale and no expert `boundary`.

        Raises:
            ValueError: a pair of guidance scales or a `boundary` (both are for MoE models).
        """
        if not isinstance(config.sample_guide_scale, (int, float)):
            raise ValueError(f"`sample_guide_scale` must be one number for wan2.1 (a pair is for MoE models); "
                             f"got {config.sample_guide_scale!r}")
        if config.boundary is not None:
            raise ValueError(f"`boundary` ({config.boundary}) switches MoE experts (Wan2.2); wan2.1 has one "
                             "transformer: remove it")

    @staticmethod
    def parse_arch(model: dict[str, Any] | None, partial: bool = False) -> WanArch:
        """The config's `model` key as a validated Wan architecture (defaults fill what it omits).

        `partial`: `model` overrides a checkpoint's architecture, so a rule between fields is only
        checked where `model` gives all of them (the merged architecture is checked at load).

        Raises:
            ValueError: naming each bad field as `model.<component>.<field>`.
        """
        return validate_model_arch(WanArch, model, partial, "wan2.1", "runnerkit/models/wan/arch.py")

    # ---- modules that tests and tools look at ---------------------------------------------
    @property
    def transformer(self) -> WanTransformer3D | None:
        """The loaded transformer (None when built per stage: lazy_load, unload_modules)."""
        return self.modules.get("transformer")  # type: ignore[return-value]

    @property
    def vae(self) -> WanVAE | None:
        """The loaded VAE (None when built per stage: unload_modules)."""
        return self.modules.get("vae")  # type: ignore[return-value]

    @property
    def streamer(self) -> BlockStreamer | None:
        """The transformer's block/phase streamer (None unless streaming; per request under lazy_load)."""
        return self.streamers.get("transformer")

    # ---- synthetic checkpoints (runnerkit.tools.synth_checkpoint) ----------------------------
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = LAYOUTS

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Write deterministic random weights of `config.model`'s architecture to `out` (see checkpoint.py)."""
        arch = cls.parse_arch(config.model)
        write_synthetic(arch, out, seed, dtype, layout, **options)  # type: ignore[arg-type]

    @classmethod
    def lora_layers(cls, config: RunnerConfig, layout: str) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """The blocks' linear layers of `config.model`'s transformer (what LightX2V's distill adapters
        cover); diffusers names for the "peft" layout."""
        arch = cls.parse_arch(config.model).transformer
        layers = lora_keys.block_layers(build_on_meta(lambda: WanTransformer3D(arch)))
        names = {v: k for k, v in lora_keys.lora_aliases(list(layers)).items()} if layout == "peft" else {}
        return layers, names

    def lora_aliases(self, names: Sequence[str]) -> dict[str, str]:
        """Diffusers names of the transformer's linear layers (runnerkit/models/wan/lora_keys.py)."""
        return lora_keys.lora_aliases(names)

    # ---- loading -----------------------------------------------------------------------
    def open_checkpoint(self, path: Path, raw: bool = False) -> Any:
        """The checkpoint at `path` with the config's `model` over its architecture (`raw`: without
        it, as the checkpoint itself says); no weight is read."""
        return WanCheckpoint.open(path, override=None if raw else self.config.model)

    def prepare_load(self) -> None:
        """Checkpoint (written first if synthetic) and its files checked, its architecture into the
        config, the tokenizer.

        Raises:
            CheckpointError: the checkpoint is missing or damaged (`WanCheckpoint.check_files`),
                naming the file and the tensor, in every offload mode.
        """
        self.check_task_fits()  # before the config's `model` is merged in and before any weight is read
        self.checkpoint = ckpt = self.checkpoints.locate()
        self.check_checkpoint_files(ckpt)
        logger.info("checkpoint {} ({} layout), flavour {}", ckpt.path, ckpt.layout, flavour_of(ckpt.arch.transformer))
        self.resolve_sample_shift(ckpt)
        self.update_config(model=ckpt.arch.model_dump(mode="json"), model_path=str(ckpt.path))
        self.tokenizer = WanTokenizer.from_file(ckpt.tokenizer_path())

    def check_checkpoint_files(self, ckpt: Any) -> None:
        """`ckpt.check_files()` (a `WanCheckpoint` or `WanMoECheckpoint`), with the hint a synthetic
        checkpoint of the original layout needs when run without the config's `model`: that layout
        records only the transformer's architecture (config.json), so the text encoder, VAE and
        image encoder are taken at their released sizes.

        Raises:
            CheckpointError: naming the component, the file and the tensor (and the hint).
        """
        try:
            ckpt.check_files()
        except CheckpointError as exc:
            if ckpt.layout == "original" and not self.config.model and synthetic_seed_of(ckpt.path) is not None:
                raise CheckpointError(
                    f"{exc}\n  hint: this synthetic checkpoint's original layout records only the transformer's "
                    "architecture (config.json); run it with the config that wrote it (its `model` key gives the "
                    "text encoder, VAE and image encoder sizes)") from None
            raise

    def resolve_sample_shift(self, ckpt: WanCheckpoint) -> None:
        """`sample_shift`: the config's own value, else a diffusers folder's `flow_shift`
        (`scheduler/scheduler_config.json`), else the family default; recorded in the config.

        Raises:
            CheckpointError: the scheduler config is unreadable or its `flow_shift` invalid.
        """
        flow_shift = read_flow_shift(ckpt.path) if ckpt.layout == "diffusers" else None
        if flow_shift is None:
            logger.info("sample_shift {} ({})", self.config.sample_shift,
                        "from the config" if self.sample_shift_configured else "the family default")
        elif self.sample_shift_configured:
            logger.info("sample_shift {} from the config (the checkpoint's {} says flow_shift {})",
                        self.config.sample_shift, SCHEDULER_CONFIG, flow_shift)
        else:
            logger.info("sample_shift {} from the checkpoint's {} (the config sets none)", flow_shift, SCHEDULER_CONFIG)
            self.update_config(sample_shift=flow_shift)

    def attention_head_dim(self) -> int:
        """dim / num_heads of the transformer (the architecture `prepare_load` put in the config)."""
        arch = self.parse_arch(self.config.model).transformer
        return arch.dim // arch.num_heads

    def build_text_encoder(self, device: torch.device) -> te.UMT5Encoder:
        assert self.checkpoint is not None, "prepare_load first"
        arch = self.checkpoint.arch.text_encoder
        return te.load_umt5_encoder(arch, self.checkpoint.text_encoder_state_dict(), dtype=self.dtype).to(device)

    def stream_text_encoder(self) -> tuple[te.UMT5Encoder, BlockStreamer]:
        """The UMT5 encoder with its layers (or their attention and FFN, mode "phase") streamed from host
        memory or the checkpoint's safetensors (`offload.stream_modules` lists "text_encoder").

        Raises:
            NotImplementedError: storage "disk" with the original layout's `.pth` encoder (named).
        """
        ckpt = self.checkpoint
        assert ckpt is not None, "prepare_load first"
        model = build_on_meta(lambda: te.UMT5Encoder(ckpt.arch.text_encoder))
        off, spec = self.config.offload, te.UMT5Encoder.STREAM_SPEC
        if off.storage == "cpu":
            streamer = stream_module(model, spec, off, self.device, self.dtype, "text_encoder",
                                     state_dict=ckpt.text_encoder_state_dict(), consume=True)
        else:
            names = list(model.state_dict(keep_vars=True))
            streamer = stream_module(model, spec, off, self.device, self.dtype, "text_encoder",
                                     files=ckpt.text_encoder_files(), key_map=ckpt.text_encoder_key_map(names),
                                     shared_files=True)  # a diffusers file may also hold the tied embedding alias
        return model.eval().requires_grad_(False), streamer

    def build_vae(self, device: torch.device) -> WanVAE:
        assert self.checkpoint is not None, "prepare_load first"
        # float32, as the reference runs its VAE
        return build_wan_vae(self.checkpoint.arch.vae, self.checkpoint.vae_state_dict(), dtype=torch.float32).to(device)

    def build_transformer(self, device: torch.device, checkpoint: WanCheckpoint | None = None,
                          name: str = "transformer") -> WanTransformer3D:
        """The transformer of `checkpoint` (default: the runner's) with all its weights, on `device`;
        `name` labels its errors (e.g. an MoE expert's module name)."""
        ckpt = checkpoint or self.checkpoint
        assert ckpt is not None, "prepare_load first"
        model = build_on_meta(lambda: WanTransformer3D(ckpt.arch.transformer))
        assign_state_dict(model, ckpt.transformer_state_dict(), name, dtype=self.dtype, keep_fp32=keep_fp32,
                          device=device)
        return model.to(device).eval().requires_grad_(False)

    def stream_transformer(self, checkpoint: WanCheckpoint | None = None,
                           name: str = "transformer") -> tuple[WanTransformer3D, BlockStreamer]:
        """The transformer of `checkpoint` (default: the runner's) with its blocks (or phases) streamed
        from host memory or the checkpoint files; `name` labels the streamer (its module name)."""
        ckpt = checkpoint or self.checkpoint
        assert ckpt is not None, "prepare_load first"
        model = build_on_meta(lambda: WanTransformer3D(ckpt.arch.transformer))
        off = self.config.offload
        if off.storage == "cpu":
            streamer = stream_module(model, WanTransformer3D.STREAM_SPEC, off, self.device, self.dtype, name,
                                     state_dict=ckpt.transformer_state_dict(), consume=True)
        else:
            names = list(model.state_dict(keep_vars=True))
            streamer = stream_module(model, WanTransformer3D.STREAM_SPEC, off, self.device, self.dtype, name,
                                     files=ckpt.transformer_files(), key_map=ckpt.transformer_key_map(names))
        return model.eval().requires_grad_(False), streamer

    def describe_pipeline(self) -> Pipeline:
        """UMT5 text encoder (-> image stages) -> one denoise stage of the transformer(s) (CFG) -> VAE
        decoder -> video. Image tasks add their encoder module and stages (`image_modules`,
        `image_stages`); MoE runners list their experts (`transformer_specs`)."""
        cfg = self.config
        specs = self.transformer_specs()
        return Pipeline(
            modules=(ModuleSpec("text_encoder", "text_encoder", build=self.build_text_encoder,
                                stream=self.stream_text_encoder),
                     *self.image_modules(), *specs, ModuleSpec("vae", "decoder", build=self.build_vae)),
            encoders=(EncoderStage("text_encoder", module="text_encoder", run=self.run_text_encoder),
                      *self.image_stages()),
            denoise=(DenoiseStage("transformer", transformers=tuple(m.name for m in specs), steps=cfg.infer_steps,
                                  scheduler=cfg.scheduler, shift=cfg.sample_shift, spacing=cfg.scheduler_spacing,
                                  sigmas=cfg.sample_sigmas, latent_shape=self.latent_shape),),
            decoders=(DecoderStage("vae_decoder", module="vae", output="video", run=self.run_vae_decoder),),
            outputs=(OutputSpec("video", "video"),),
        )

    def transformer_specs(self) -> tuple[ModuleSpec, ...]:
        """The denoising transformer(s): one for Wan2.1 (MoE runners list their experts)."""
        return (ModuleSpec("transformer", "transformer", build=self.build_transformer, stream=self.stream_transformer,
                           blocks=WanTransformer3D.STREAM_SPEC.blocks_attr, fp8_skip=WanTransformer3D.FP8_SKIP),)

    def image_modules(self) -> tuple[ModuleSpec, ...]:
        """Modules of the image stages (`images.modules`; none for text-to-video)."""
        return self.images.modules() if self.images is not None else ()

    def image_stages(self) -> tuple[EncoderStage, ...]:
        """Encoder stages after the text encoder (`images.stages`; none for text-to-video)."""
        return self.images.stages() if self.images is not None else ()

    def transformer_inputs(self, req: RequestState) -> dict[str, torch.Tensor]:
        """Extra keyword inputs of every transformer call (`images.transformer_inputs`; none for text-to-video)."""
        return self.images.transformer_inputs(req) if self.images is not None else {}

    @classmethod
    def shape_of(cls, request: RequestConfig, config: RunnerConfig) -> Shape:
        """(height, width, frames), the config's defaults filled in; a task with images takes the image's
        aspect ratio over that area (`WanImageConditioning.shape`; raises ImageInputError as it does)."""
        shape = super().shape_of(request, config)
        return shape if cls.IMAGE_CONDITIONING is None else cls.IMAGE_CONDITIONING.shape(request, shape)

    #: The transformer `model_type` each task needs.
    TASK_MODEL_TYPES: ClassVar[dict[str, str]] = {"t2v": "t2v"}

    def checkpoint_model_type(self) -> str | None:
        """The transformer `model_type` the checkpoint itself declares (the configured architecture
        for a synthetic checkpoint still to write); None if its config files cannot be read (the
        load then says why)."""
        try:
            path = self.checkpoints.path()
            if self.checkpoints.arch_from_config(path):
                return self.arch_override.transformer.model_type
            return self.open_checkpoint(path, raw=True).arch.transformer.model_type
        except (ValueError, OSError):  # CheckpointError included
            return None

    def check_task_fits(self) -> None:
        """The checkpoint's transformer must be trained for the task, and the config's `model`
        cannot make it another kind (`model.transformer.model_type` must match the checkpoint's).

        Raises:
            CheckpointError: naming the checkpoint, its `model_type` and the task to use instead.
        """
        have = self.checkpoint_model_type()
        if have is None:
            return
        want = self.TASK_MODEL_TYPES[self.config.task]
        where = self.config.model_path or "the synthetic checkpoint"
        if want != have:
            what = "text-only: it takes no image conditioning" if have == "t2v" else "trained for another task"
            raise CheckpointError(f"task {self.config.task!r} needs {want} weights, but the transformer of {where} "
                                  f"is `model_type`={have!r} ({what}): use --task {have}, or a Wan {want.upper()} "
                                  "checkpoint")
        configured = ((self.config.model or {}).get("transformer") or {}).get("model_type")
        if configured is not None and configured != have:
            raise CheckpointError(f"the config's `model.transformer.model_type` is {configured!r}, but {where} holds "
                                  f"{have} weights: remove it from the config's `model`")

    def flavour(self) -> str | None:
        """From the loaded checkpoint; before loading (the warmup gate) from its config files only,
        or from the configured architecture if a synthetic checkpoint is still to be written."""
        if self.checkpoint is not None:
            return flavour_of(self.checkpoint.arch.transformer)
        path = self.checkpoints.path()
        if self.checkpoints.arch_from_config(path):
            return flavour_of(self.arch_override.transformer)
        return flavour_of(self.open_checkpoint(path).arch.transformer)

    # ---- memory estimate (models/wan/estimate.py) ------------------------------------------
    def architecture(self) -> WanArch:
        """The checkpoint's architecture: from the loaded checkpoint; before loading from its config
        files (or the configured one, for a synthetic checkpoint still to write).

        Raises:
            EstimateUnavailable: the config files cannot be read before loading (loading then
                reports why; the memory check waits for it).
            CheckpointError: a synthetic checkpoint of the original layout, run without the config's
                `model`, whose files do not hold the released sizes that layout implies: the
                estimate would be of networks it does not hold (`check_checkpoint_files`, with the hint).
        """
        if self.checkpoint is not None:
            return self.checkpoint.arch
        try:
            path = self.checkpoints.path()
            if self.checkpoints.arch_from_config(path):
                return self.arch_override
            ckpt = self.open_checkpoint(path)
        except (ValueError, OSError) as exc:  # CheckpointError included
            raise EstimateUnavailable(f"the checkpoint's architecture cannot be read before loading ({exc})") from None
        if ckpt.layout == "original" and not self.config.model and synthetic_seed_of(ckpt.path) is not None:
            self.check_checkpoint_files(ckpt)  # headers and mapped .pth only: no weight is read
        return ckpt.arch

    def estimate_sources(self) -> list[str]:
        """Where the estimate before loading takes the architecture from (`runnerkit plan`)."""
        if self.checkpoint is None and self.checkpoints.absent():
            return [f"architecture: the config's `model` over the Wan release sizes (runnerkit/models/wan/arch.py "
                    f"defaults): `model_path` {self.config.model_path} does not exist"]
        return super().estimate_sources()

    def denoise_flops(self, shape: Shape) -> tuple[StageFlops, ...]:
        """FLOPs of a step at `shape` (flops.py `wan_denoise_flops`). Raises EstimateUnavailable: see `architecture`."""
        return wan_denoise_flops(self.architecture(), self.config, shape, len(self.IMAGE_INPUTS.get(self.config.task, ())))

    def estimate_memory(self, shape: Shape) -> MemoryEstimate:
        """Text encoder, image stages (i2v / flf2v), one transformer step, VAE decode and save of
        `shape` on `self.device` (formulas and sources: models/wan/estimate.py).

        Raises:
            EstimateUnavailable, CheckpointError: see `architecture`.
        """
        arch = self.architecture()
        image_frames = len(self.IMAGE_INPUTS.get(self.config.task, ()))
        return wan_t2v_estimate(arch, shape, self.dtype, self.device, self.config.enable_cfg, self.config.offload,
                                transformers=self.transformer_names(), image_frames=image_frames,
                                lora_rank=self.lora_slot_rank())

    def transformer_names(self) -> tuple[str, ...]:
        """Module names of the denoising transformer(s) (MoE runners: both experts)."""
        return ("transformer",)

    # ---- request stages ------------------------------------------------------------------
    def latent_shape(self, info: InputInfo) -> tuple[int, ...]:
        """[1, z_dim, (F-1)/4 + 1, H/8, W/8]."""
        assert self.checkpoint is not None, "load_modules first"
        z = self.checkpoint.arch.vae.z_dim
        return (1, z, (info.frames - 1) // self.TEMPORAL_FACTOR + 1, info.height // 8, info.width // 8)

    def attention_heads(self) -> int:
        """Self-attention heads of the transformer (Ulysses splits them over its ranks)."""
        return self.parse_arch(self.config.model).transformer.num_heads

    def sequence_tokens(self, stage: DenoiseStage, info: InputInfo) -> int:
        """Video tokens L = (f/pt)(h/ph)(w/pw) of the request's latent grid (Ulysses splits them)."""
        assert self.checkpoint is not None, "load_modules first"
        return transformer_tokens(self.checkpoint.arch.transformer, stage.latent_shape(info)[2:])

    def compiled_sizes(self, info: InputInfo) -> dict[str, int]:
        """The blocks' one dynamic dimension: the token count L (x [B, L, dim], RoPE [L, 1, d/2])."""
        assert self.checkpoint is not None, "load_modules first"
        return {"transformer tokens": transformer_tokens(self.checkpoint.arch.transformer,
                                                         self.latent_shape(info)[2:])}

    @torch.inference_mode()
    def run_text_encoder(self, req: RequestState) -> WanInputs:
        """Prompt (and negative prompt, for CFG) -> WanInputs with [1, L, text_dim] embeddings."""
        assert self.tokenizer is not None and self.checkpoint is not None, "load_modules first"
        info = req.info
        encoder = te.WanTextEncoder(self.tokenizer, req.modules["text_encoder"])
        prompts = [info.prompt, info.negative_prompt] if self.config.enable_cfg else [info.prompt]
        embeds = encoder.encode(prompts)
        text_len = self.checkpoint.arch.text_encoder.text_len
        for name, e in zip(("prompt", "negative_prompt"), embeds):
            if e.shape[0] >= text_len and not info.warmup:
                logger.warning("`{}` fills all {} tokens and is truncated there (as the reference does)", name, text_len)
        return WanInputs(context=embeds[0][None], context_null=embeds[1][None] if len(embeds) > 1 else None)

    @torch.inference_mode()
    def run_step(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: torch.Tensor,
                 timestep: torch.Tensor, step_index: int) -> torch.Tensor:
        """Transformer on the cond (and uncond) branch; CFG combine in float32. Returns [1, C, F', H', W'].

        With block streaming both branches go through each block while it is on the device
        (`forward_branches`, bit-identical to two forwards; `one_pass_streamer`)."""
        inputs = req.inputs
        assert isinstance(inputs, WanInputs), "run the encoders first"
        extra = self.transformer_inputs(req)  # image tasks: the same clip_context and y on both branches
        if inputs.context_null is None:
            return model(latents, timestep, inputs.context, **extra).float()
        streamer = self.one_pass_streamer(model)
        if self.cfg_parallel:  # one branch per rank, the other's prediction all-gathered
            cond, uncond = self.cfg_branches([
                lambda: model(latents, timestep, inputs.context, **extra).float(),
                lambda: model(latents, timestep, inputs.context_null, **extra).float()])
        elif streamer is not None:
            with streamer.entries(2):
                contexts = [inputs.context, inputs.context_null]
                cond, uncond = model.forward_branches(latents, timestep, contexts, **extra)
            cond, uncond = cond.float(), uncond.float()
        else:
            cond = model(latents, timestep, inputs.context, **extra).float()
            uncond = model(latents, timestep, inputs.context_null, **extra).float()
        return uncond + self.guide_scale(req, stage, step_index, timestep) * (cond - uncond)

    def guide_scale(self, req: RequestState, stage: DenoiseStage, step_index: int, timestep: torch.Tensor) -> float:
        """The CFG scale of one step (one scale for wan2.1; MoE runners choose it per expert)."""
        return float(self.config.sample_guide_scale)  # type: ignore[arg-type]

    @torch.inference_mode()
    def run_vae_decoder(self, req: RequestState, latents: torch.Tensor) -> torch.Tensor | Iterator[torch.Tensor]:
        """Normalized latents [1, z, f, h, w] -> video [1, 3, 4(f-1)+1, 8h, 8w] in [-1, 1] (float32):
        chunk by chunk, one latent frame at a time (`WanVAE.decode_iter`; the runner concatenates
        them, and a cancel can stop between them), or whole when tiled."""
        if self.config.offload.vae_tiling:
            return vae_tiling.decode_tiled(req.modules["vae"], latents.float(), vae_tiling.TILE_LATENT,
                                           vae_tiling.OVERLAP_LATENT)
        return req.modules["vae"].decode_iter(latents.float())

    def clear_request_state(self) -> None:
        """Per-grid RoPE tables and the VAE feature cache are request state."""
        if self.transformer is not None:
            self.transformer.clear_cache()
        if self.vae is not None:
            self.vae.clear_cache()
