"""Wan2.1 text-to-video runner: loading, the request stages, CFG, and its warmup.

Source of the pipeline: Wan-Video/Wan2.1 `wan/text2video.py` (WanT2V.generate): UMT5 prompt
embeddings (and the default negative prompt for CFG), noise [16, (F-1)/4+1, H/8, W/8], flow UniPC
with shift, `uncond + scale * (cond - uncond)`, VAE decode, clamp to [-1, 1].
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from loguru import logger

from runnerkit.config import RunnerConfig
from runnerkit.media import save_media, save_tensor, write_sidecar
from runnerkit.models.wan import text_encoder as te
from runnerkit.models.wan.arch import WanArch, WanTransformerArch
from runnerkit.models.wan.checkpoint import WanCheckpoint, write_synthetic
from runnerkit.models.wan.tokenizer import WanTokenizer
from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
from runnerkit.models.wan.vae import WanVAE
from runnerkit.registry import register_runner
from runnerkit.runners.default import DefaultRunner, InputInfo, Shape
from runnerkit.weights import assign_state_dict, build_on_meta

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

WARMUP_PROMPT = "warmup"  # dummy user content; only its embedding shape matters (padded to text_len)
WARMUP_SEED = 0


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


def synthetic_cache_dir() -> Path:
    """Where synthetic checkpoints go when `model_path` is not set (env RUNNERKIT_CACHE overrides)."""
    root = os.environ.get("RUNNERKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "runnerkit")
    return Path(root) / "synthetic"


@register_runner("wan2.1")
class WanT2VRunner(DefaultRunner):
    """Wan2.1 text-to-video (1.3B / 14B, and the tiny `debug` architecture)."""

    TASKS = ("t2v",)
    SPATIAL_FACTOR = 16  # VAE 8x * patch 2
    TEMPORAL_FACTOR = 4
    DEFAULT_NEGATIVE_PROMPT = WAN_NEGATIVE_PROMPT

    # ---- warmup opt-in (declared here; not inherited by subclasses) --------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("t2v",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none",)
    #: flavour -> (small/square, production/non-square) shapes as (height, width, frames).
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((32, 32, 5), (48, 80, 9)),
        "1.3B": ((320, 320, 17), (480, 832, 81)),
        "14B": ((320, 320, 17), (480, 832, 81)),
    }

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        if not isinstance(config.sample_guide_scale, (int, float)):
            raise ValueError(f"`sample_guide_scale` must be one number for wan2.1 (a pair is for MoE models); "
                             f"got {config.sample_guide_scale!r}")
        if config.offload.mode != "none":
            raise NotImplementedError(f"`offload.mode`={config.offload.mode!r} is not available for wan2.1 yet "
                                      "(only 'none')")
        if config.compile.enabled:
            raise NotImplementedError("`compile.enabled`=true is not available yet for wan2.1")
        self.checkpoint: WanCheckpoint | None = None
        self.transformer: WanTransformer3D | None = None
        self.text_encoder: te.WanTextEncoder | None = None
        self.vae: WanVAE | None = None

    # ---- loading -----------------------------------------------------------------------
    def locate_checkpoint(self) -> WanCheckpoint:
        """Open `model_path`, writing a synthetic checkpoint first if configured and absent."""
        cfg = self.config
        path = Path(cfg.model_path) if cfg.model_path else None
        if cfg.synthetic_checkpoint is not None:
            arch = WanArch.model_validate(cfg.model or {})
            if path is None:
                digest = hashlib.sha1(json.dumps(arch.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]
                path = synthetic_cache_dir() / f"wan2.1-{digest}-seed{cfg.synthetic_checkpoint.seed}-{cfg.dtype}"
            if not path.exists() or not any(path.iterdir()):
                write_synthetic(arch, path, cfg.synthetic_checkpoint.seed, self.dtype)
        assert path is not None, "config validation requires model_path or synthetic_checkpoint"
        ckpt = WanCheckpoint.open(path, override=cfg.model)
        meta = path / "runnerkit.json"
        if meta.is_file() and "synthetic_seed" in json.loads(meta.read_text()):
            logger.warning("model_path {} holds SYNTHETIC RANDOM weights: the output will be noise", path)
        return ckpt

    def load_modules(self) -> None:
        """Load tokenizer + UMT5, the transformer and the VAE onto `device`; build the scheduler."""
        ckpt = self.locate_checkpoint()
        self.checkpoint = ckpt
        arch = ckpt.arch
        logger.info("checkpoint {} ({} layout), flavour {}", ckpt.path, ckpt.layout, flavour_of(arch.transformer))
        self.update_config(model=arch.model_dump(mode="json"), model_path=str(ckpt.path))

        tokenizer = WanTokenizer.from_file(ckpt.tokenizer_path())
        encoder = te.load_umt5_encoder(arch.text_encoder, ckpt.text_encoder_state_dict(), dtype=self.dtype)
        self.text_encoder = te.WanTextEncoder(tokenizer, encoder.to(self.device))

        transformer = build_on_meta(lambda: WanTransformer3D(arch.transformer))
        assign_state_dict(transformer, ckpt.transformer_state_dict(), "transformer", dtype=self.dtype, keep_fp32=keep_fp32)
        self.transformer = transformer.to(self.device).eval().requires_grad_(False)

        vae = build_on_meta(lambda: WanVAE(arch.vae))
        assign_state_dict(vae, ckpt.vae_state_dict(), "vae", dtype=torch.float32)  # the reference runs its VAE in fp32
        self.vae = vae.to(self.device).eval().requires_grad_(False)

        self.scheduler = self.build_scheduler()

    def flavour(self) -> str | None:
        if self.checkpoint is None:  # warmup gate before loading: read the architecture only
            self.checkpoint = self.locate_checkpoint()
        return flavour_of(self.checkpoint.arch.transformer)

    # ---- request stages ------------------------------------------------------------------
    def latent_shape(self, info: InputInfo) -> tuple[int, ...]:
        """[1, z_dim, (F-1)/4 + 1, H/8, W/8]."""
        assert self.vae is not None, "load_modules first"
        z = self.vae.arch.z_dim
        return (1, z, (info.frames - 1) // self.TEMPORAL_FACTOR + 1, info.height // 8, info.width // 8)

    @torch.inference_mode()
    def run_text_encoder(self, prompt: str, negative_prompt: str | None) -> WanInputs:
        """Prompt (and negative prompt, for CFG) -> WanInputs with [1, L, text_dim] embeddings."""
        assert self.text_encoder is not None, "load_modules first"
        prompts = [prompt] if negative_prompt is None else [prompt, negative_prompt]
        embeds = self.text_encoder.encode(prompts)
        return WanInputs(context=embeds[0][None], context_null=embeds[1][None] if len(embeds) > 1 else None)

    @torch.inference_mode()
    def run_step(self, latents: torch.Tensor, timestep: torch.Tensor, step_index: int) -> torch.Tensor:
        """Transformer on the cond (and uncond) branch; CFG combine in float32. Returns [1, C, F', H', W']."""
        assert self.transformer is not None and isinstance(self.inputs, WanInputs), "load_modules/encoders first"
        cond = self.transformer(latents, timestep, self.inputs.context).float()
        if self.inputs.context_null is None:
            return cond
        uncond = self.transformer(latents, timestep, self.inputs.context_null).float()
        return uncond + float(self.config.sample_guide_scale) * (cond - uncond)  # type: ignore[arg-type]

    @torch.inference_mode()
    def run_vae_decoder(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents [1, z, f, h, w] -> video [1, 3, 4(f-1)+1, 8h, 8w] in [-1, 1] (float32)."""
        assert self.vae is not None, "load_modules first"
        return self.vae.decode(latents.float())

    def save_outputs(self, video: torch.Tensor, info: InputInfo) -> None:
        """--save_tensor_path (.safetensors 'video' [3, F, H, W]) and --save_result_path (+ sidecar json)."""
        if info.save_tensor_path:
            save_tensor(video, info.save_tensor_path, key="video")
        if info.save_result_path:
            save_media(video, info.save_result_path, fps=self.config.fps)
            write_sidecar(info.save_result_path, {
                "seed": info.seed, "prompt": info.prompt, "negative_prompt": info.negative_prompt,
                "shape": list(info.shape), "config": self.config.model_dump(mode="json")})
            logger.info("saved {}", info.save_result_path)

    def clear_request_state(self) -> None:
        """Per-grid RoPE tables and the VAE feature cache are request state."""
        if self.transformer is not None:
            self.transformer.clear_cache()
        if self.vae is not None:
            self.vae.clear_cache()

    # ---- warmup ----------------------------------------------------------------------------
    def run_warmup(self, shapes: Sequence[Shape]) -> None:
        """Both shapes through the real path: text encoded once (cond + CFG negative), then per shape
        prepare -> step 0 (both CFG branches) -> step_post -> decode. Dummy prompt only."""
        assert self.scheduler is not None, "load_modules first"
        self.scheduler.generator = None  # before any encoder that could draw random numbers
        negative = self.config.negative_prompt or self.DEFAULT_NEGATIVE_PROMPT if self.config.enable_cfg else None
        with torch.inference_mode():
            inputs = self.run_text_encoder(WARMUP_PROMPT, negative)
        for shape in shapes:
            self.warmup_shape(shape, inputs)
