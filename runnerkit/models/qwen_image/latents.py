"""Qwen-Image latent layout (2x2 patch packing) and its true CFG.

Source: diffusers 0.42.1 `QwenImagePipeline` (pipelines/qwenimage/pipeline_qwenimage.py):
`_pack_latents`, `_unpack_latents` and the CFG combination inside the denoising loop. The
transformer reads and predicts packed latents [B, L, C * 4], one token per 2x2 patch of the
VAE latents, with the 4 patch pixels innermost in each token (channel-major, then row, then
column of the patch).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_latents", "true_cfg", "unpack_latents"]


def pack_latents(latents: Tensor) -> Tensor:
    """Pack VAE latents into transformer tokens (diffusers `QwenImagePipeline._pack_latents`).

    Args:
        latents: [B, C, 1, H, W], H and W even (the VAE latent grid).

    Returns:
        [B, (H / 2) * (W / 2), C * 4], same dtype; token (i, j) of the (H / 2) x (W / 2) grid in
        row-major order holds the 2x2 patch at rows 2i..2i+1, columns 2j..2j+1, as
        `[c, di, dj]` flattened.

    Raises:
        ValueError: `latents` is not [B, C, 1, H, W] with H and W even.
    """
    if latents.ndim != 5 or latents.shape[2] != 1:
        raise ValueError(f"`latents` must be [B, C, 1, H, W]; got shape {tuple(latents.shape)}")
    B, C, _, H, W = latents.shape
    if H % 2 or W % 2:
        raise ValueError(f"`latents` height and width must be even (2x2 patches); got H={H}, W={W}")
    x = latents.reshape(B, C, H // 2, 2, W // 2, 2)  # [B, C, h, 2, w, 2]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, h, w, C, 2, 2]
    return x.reshape(B, (H // 2) * (W // 2), C * 4)  # [B, h*w, C*4]


def unpack_latents(packed: Tensor, height_px: int, width_px: int, vae_scale: int = 8) -> Tensor:
    """Unpack transformer tokens into VAE latents (diffusers `QwenImagePipeline._unpack_latents`).

    The latent grid is `2 * (height_px // (2 * vae_scale))` x `2 * (width_px // (2 * vae_scale))`,
    as the pipeline rounds a pixel size down to a multiple of 16.

    Args:
        packed: [B, L, D] with L = (H / 2) * (W / 2) and D = C * 4.
        height_px: image height in pixels.
        width_px: image width in pixels.
        vae_scale: the VAE's spatial compression (8).

    Returns:
        [B, D / 4, 1, H, W], same dtype.

    Raises:
        ValueError: `packed` is not [B, L, D] with D a multiple of 4 and L matching the size.
    """
    if packed.ndim != 3 or packed.shape[2] % 4:
        raise ValueError(f"`packed` must be [B, L, C*4]; got shape {tuple(packed.shape)}")
    B, L, D = packed.shape
    H = 2 * (int(height_px) // (vae_scale * 2))
    W = 2 * (int(width_px) // (vae_scale * 2))
    if L != (H // 2) * (W // 2):
        raise ValueError(f"`packed` has {L} tokens but {height_px}x{width_px} px with `vae_scale`={vae_scale} "
                         f"gives a {H // 2}x{W // 2} token grid ({(H // 2) * (W // 2)} tokens)")
    x = packed.reshape(B, H // 2, W // 2, D // 4, 2, 2)  # [B, h, w, C, 2, 2]
    x = x.permute(0, 3, 1, 4, 2, 5)  # [B, C, h, 2, w, 2]
    return x.reshape(B, D // 4, 1, H, W)  # [B, C, 1, H, W]


def true_cfg(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """True classifier-free guidance with a per-token norm rescale (Qwen-Image pipelines).

    `comb = uncond + scale * (cond - uncond)`, then each token is rescaled so that its norm over
    the last dimension equals that of `cond`: `comb * (|cond| / |comb|)`. Computed in float32
    (diffusers computes in the transformer's dtype; identical in float32). With `scale` = 1,
    `comb` is `cond` up to rounding and the result is `cond` itself.

    Args:
        cond: [B, L, D] packed prediction with the prompt.
        uncond: [B, L, D] packed prediction with the negative prompt.
        scale: `true_cfg_scale` (the pipelines apply CFG only when it is > 1).

    Returns:
        [B, L, D] float32.

    Raises:
        ValueError: `cond` and `uncond` differ in shape, or are not [B, L, D].
    """
    if cond.shape != uncond.shape or cond.ndim != 3:
        raise ValueError(f"`cond` and `uncond` must both be [B, L, D]; got {tuple(cond.shape)} and "
                         f"{tuple(uncond.shape)}")
    cond, uncond = cond.float(), uncond.float()
    if scale == 1:
        return cond
    comb = uncond + scale * (cond - uncond)  # [B, L, D]
    cond_norm = torch.linalg.vector_norm(cond, dim=-1, keepdim=True)  # [B, L, 1]
    comb_norm = torch.linalg.vector_norm(comb, dim=-1, keepdim=True)  # [B, L, 1]
    return comb * (cond_norm / comb_norm)
