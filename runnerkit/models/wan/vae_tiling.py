"""Spatially tiled VAE decoding: bounded decoder memory for large videos (config `offload.vae_tiling`).

The latent frame grid [h, w] is cut into overlapping tiles; each tile is decoded on its own
(all frames, with its own causal feature cache), and the tiles are blended in pixel space
with linear ramps across each overlap. Decoder activation memory then scales with the tile,
not the frame. Tiles see no context beyond their borders (convolution receptive field, the
middle attention block), so tiled output is an approximation of the untiled one near tile
seams; a video no larger than one tile is decoded untiled, bit-identically. The default tile
(32 latent px = 256 px) and overlap (8 latent px = 64 px) follow diffusers' AutoencoderKLWan.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runnerkit.models.wan.vae import WanVAE

TILE_LATENT = 32  # latent pixels per tile side (256 output pixels)
OVERLAP_LATENT = 8  # latent pixels shared by neighbouring tiles (64 output pixels)


def tile_starts(size: int, tile: int, overlap: int) -> list[int]:
    """Start offsets of tiles of `tile` covering [0, size) with at least `overlap` shared; the last
    tile ends exactly at `size`. One start (0) when `size <= tile`.

    Raises:
        ValueError: `overlap` not in [0, tile).
    """
    if not 0 <= overlap < tile:
        raise ValueError(f"`overlap` must be in [0, tile={tile}) (got {overlap})")
    if size <= tile:
        return [0]
    stride = tile - overlap
    starts = list(range(0, size - tile, stride))
    return starts + [size - tile]


def _ramp(length: int, scale: int, left: bool, right: bool, overlap_left: int, overlap_right: int) -> Tensor:
    """1-D blend weights [length * scale]: ramps up over the left overlap, down over the right one."""
    w = torch.ones(length * scale)
    if left and overlap_left:
        n = overlap_left * scale
        w[:n] = torch.arange(1, n + 1, dtype=torch.float32) / (n + 1)
    if right and overlap_right:
        n = overlap_right * scale
        w[-n:] = torch.arange(n, 0, -1, dtype=torch.float32) / (n + 1)
    return w


@torch.no_grad()
def decode_tiled(vae: WanVAE, latents: Tensor, tile: int = TILE_LATENT, overlap: int = OVERLAP_LATENT) -> Tensor:
    """Decode normalized latents tile by tile and blend.

    Args:
        vae: the Wan VAE.
        latents: [B, z_dim, f, h, w], normalized as `WanVAE.encode` returns them.
        tile, overlap: tile side and overlap in latent pixels.

    Returns:
        [B, 3, 4 (f - 1) + 1, 8h, 8w], float32 in [-1, 1] (equal to `vae.decode` when h, w <= tile).

    Raises:
        ValueError: bad `latents` (from the VAE) or `overlap` not in [0, tile).
    """
    B, _, f, h, w = latents.shape
    ys, xs = tile_starts(h, tile, overlap), tile_starts(w, tile, overlap)
    if len(ys) == 1 and len(xs) == 1:
        return vae.decode(latents)
    s = vae.spatial_factor
    frames = vae.temporal_factor * (f - 1) + 1
    out = torch.zeros(B, 3, frames, h * s, w * s, dtype=torch.float32, device=latents.device)
    weight = torch.zeros(h * s, w * s, dtype=torch.float32, device=latents.device)
    for iy, y0 in enumerate(ys):
        th = min(tile, h)
        for ix, x0 in enumerate(xs):
            tw = min(tile, w)
            video = vae.decode(latents[:, :, :, y0:y0 + th, x0:x0 + tw]).to(out.device)  # [B, 3, F, 8th, 8tw]
            # overlap with the previous/next tile along each axis (tiles may overlap by more than `overlap`)
            oy_l = ys[iy - 1] + th - y0 if iy > 0 else 0
            oy_r = y0 + th - ys[iy + 1] if iy + 1 < len(ys) else 0
            ox_l = xs[ix - 1] + tw - x0 if ix > 0 else 0
            ox_r = x0 + tw - xs[ix + 1] if ix + 1 < len(xs) else 0
            wy = _ramp(th, s, iy > 0, iy + 1 < len(ys), oy_l, oy_r)
            wx = _ramp(tw, s, ix > 0, ix + 1 < len(xs), ox_l, ox_r)
            mask = (wy[:, None] * wx[None, :]).to(out.device)  # [8th, 8tw]
            out[..., y0 * s:(y0 + th) * s, x0 * s:(x0 + tw) * s] += video.float() * mask
            weight[y0 * s:(y0 + th) * s, x0 * s:(x0 + tw) * s] += mask
    return out / weight  # every pixel is covered with a positive weight
