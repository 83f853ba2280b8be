"""FLOPs of one Wan denoising step, from the architecture alone (the planner's time model,
planning/compute.py). 2 FLOPs per multiply-add; the count of bench/speed.py's `wan_flops`.

Per block and CFG pass, with L video tokens, T = text_len text tokens, I CLIP image tokens (Wan2.1
i2v / flf2v: 257 per conditioning frame), D = dim, F = ffn_dim:

    self-attention   q, k, v, o projections 8 L D^2 + scores and values 4 L^2 D
    cross-attention  q, o 4 L D^2 + k, v of the text 4 T D^2 + attention 4 L T D
                     (+ image k, v 4 I D^2 + attention 4 L I D)
    FFN              4 L D F

Embeddings, the head, norms and modulation are below 1 % at production shapes and left out.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from runnerkit.models.wan.arch import WanArch, WanTransformerArch
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.compute import StageFlops

if TYPE_CHECKING:
    from runnerkit.config import RunnerConfig

__all__ = ["wan_denoise_flops", "wan_step_flops"]


def wan_step_flops(arch: WanTransformerArch, shape: Shape, passes: int, image_tokens: int = 0) -> float:
    """FLOPs of one denoising step (module docstring) at `shape` (height, width, frames) with `passes` CFG
    passes (2 with CFG, else 1) and `image_tokens` CLIP tokens in the cross-attention."""
    height, width, frames = shape
    latent = ((frames - 1) // 4 + 1, height // 8, width // 8)  # VAE stride (4, 8, 8)
    L = math.prod(n // p for n, p in zip(latent, arch.patch_size))
    D, F, T, I = arch.dim, arch.ffn_dim, arch.text_len, image_tokens
    matmul = 8 * L * D * D + 4 * L * D * D + 4 * T * D * D + 4 * L * D * F + 4 * I * D * D
    attention = 4 * L * L * D + 4 * L * T * D + 4 * L * I * D
    return float((matmul + attention) * arch.num_layers * passes)


def wan_denoise_flops(arch: WanArch, config: RunnerConfig, shape: Shape, image_frames: int) -> tuple[StageFlops, ...]:
    """The one denoising stage of a Wan runner (MoE experts share the architecture): `infer_steps` steps of
    `wan_step_flops` at `shape` (height, width, frames), with the CLIP tokens of `image_frames` conditioning
    frames (Wan2.1 i2v: 1, flf2v: 2) when the transformer attends to them."""
    clip = arch.image_encoder
    tokens = image_frames * ((clip.image_size // clip.patch_size) ** 2 + 1) if clip is not None and image_frames else 0
    if not arch.transformer.image_context:
        tokens = 0
    flops = wan_step_flops(arch.transformer, shape, 2 if config.enable_cfg else 1, tokens)
    return (StageFlops("transformer", config.infer_steps or 1, flops),)
