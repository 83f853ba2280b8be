"""Image conditioning of Wan2.1 i2v / flf2v: the pixel clip to VAE-encode and the temporal mask.

The transformer's `y` is `cat([mask, vae_latents], dim=0)` per sample ([4 + 16, F_lat, h, w]),
where `vae_latents` is the (normalised, mean not sampled) VAE encoding of `conditioning_video`:
the given frame(s) at the target resolution with zeros for every other frame. Follows
Wan-Video/Wan2.1 `wan/image2video.py` and `wan/first_last_frame2video.py` (`msk`, `y`), and
diffusers `WanImageToVideoPipeline.prepare_latents`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def conditioning_mask(num_frames: int, latent_height: int, latent_width: int, last_frame: bool,
                      temporal_factor: int = 4) -> Tensor:
    """Which pixel frames are given, folded onto the latent frames.

    Pixel frame 0 (and frame `num_frames - 1` with `last_frame`) is 1, every other frame 0.
    The first latent frame encodes pixel frame 0 alone, so its mask is repeated
    `temporal_factor` times; each later latent frame holds `temporal_factor` pixel frames, one
    per mask channel.

    Args:
        num_frames: pixel frames F, `temporal_factor` * n + 1.
        latent_height, latent_width: the latent grid (pixels / 8).
        last_frame: flf2v (first and last frame given) instead of i2v (first frame only).
        temporal_factor: pixel frames per latent frame of the VAE (Wan2.1: 4).

    Returns:
        [temporal_factor, (F - 1) / temporal_factor + 1, latent_height, latent_width] float32.

    Raises:
        ValueError: `num_frames` is not `temporal_factor` * n + 1 (n >= 1 for flf2v).
    """
    if num_frames < 1 or (num_frames - 1) % temporal_factor or last_frame and num_frames == 1:
        raise ValueError(f"`num_frames`={num_frames} must be {temporal_factor}n + 1"
                         f"{' with n >= 1 (first and last frame)' if last_frame else ''}")
    frames = torch.zeros(num_frames)
    frames[0] = 1
    if last_frame:
        frames[-1] = 1
    frames = torch.cat([frames[:1].repeat(temporal_factor), frames[1:]])  # [F - 1 + temporal_factor]
    mask = frames.view(-1, temporal_factor).t()  # [temporal_factor, F_lat]
    return mask[:, :, None, None].expand(-1, -1, latent_height, latent_width).contiguous()


def conditioning_video(first: Tensor, num_frames: int, last: Tensor | None = None) -> Tensor:
    """The clip whose VAE latents condition the transformer: given frames, zeros elsewhere.

    Args:
        first: [3, H, W] first frame in [-1, 1], already at the target resolution (Wan resizes
            with bicubic interpolation to the target H x W; see the integration notes).
        num_frames: pixel frames F.
        last: flf2v only: [3, H, W] last frame in [-1, 1] at the same resolution.

    Returns:
        [3, F, H, W] in the dtype of `first`.

    Raises:
        ValueError: a frame is not [3, H, W], the frames differ in size, or `num_frames` is too small.
    """
    if first.ndim != 3 or first.shape[0] != 3:
        raise ValueError(f"`first` must be [3, H, W], got shape {tuple(first.shape)}")
    if last is not None and last.shape != first.shape:
        raise ValueError(f"`last` must have the shape of `first` {tuple(first.shape)}, got {tuple(last.shape)}")
    given = 1 if last is None else 2
    if num_frames < given:
        raise ValueError(f"`num_frames`={num_frames} must be at least {given}")
    _, H, W = first.shape
    zeros = first.new_zeros(3, num_frames - given, H, W)
    parts = [first[:, None], zeros] + ([] if last is None else [last[:, None].to(first.dtype)])
    return torch.cat(parts, dim=1)  # [3, F, H, W]
