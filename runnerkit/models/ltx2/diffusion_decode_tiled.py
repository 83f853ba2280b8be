"""Tiled decoding of the LTX-2.5 diffusion decoder (config `offload.vae_tiling`): stage 4 and stage 5,
whose grids and widths dominate the decode's memory, run per overlapping tile; stages 1-3 see the
whole latent.

Reference: diffusers 0.42.1 `LTX2VideoDiffusionDecoderModel.enable_tiling` / `tiled_decode` /
`_tile_intervals` (models/autoencoders/ltx2_diffusion_decoder.py); parity-tested against it. What it
does, in order:

1. Stages 1-3 on the whole latent (`LTX2DiffusionDecoder3d.features`, its padding frames kept):
   the feature grid [B, T_f + ghost, H_f, W_f, C_4], one cell of which stage 4 and the stage-5 patch
   turn into (s_t, s_h, s_w) = (2, 8, 8) output pixels in the release (the last upsampler's stride
   times the patch size spatially). The tile sizes (pixels, frames) are divided by that cell.
2. Tiles of that grid (`tile_intervals`): starts `stride` cells apart, `tile` cells long; a trailing
   remnant shorter than the smallest grid both remaining windows accept is merged into the tile
   before it. Temporal tiles are the outer loop, then rows, then columns.
3. Per tile, stage 4 (`stage_4`): only the tile at frame 0 drops the temporal upsampler's leading
   frame (its other tiles start at an interior frame, whose two output frames are both real) and only
   a tile that ends at the video's end takes the padding ("ghost") frames along and crops them.
4. Noise: with one step and x0 prediction (the release) each tile draws its own x_1 of its own pixel
   shape, in tile order, from the generator (CPU, decoder dtype, then moved, as the untiled decode
   draws); with more steps one full canvas is drawn first and each tile denoises its slice (a
   non-origin temporal tile's slice starts one frame before `t0 * s_t`: the kept leading frame).
5. Blending, in the decoder dtype, as diffusers' VAEs blend: a tile's first `extent` rows (columns,
   frames) become `a[-extent + y] * (1 - y / extent) + b[y] * (y / extent)` with the tile above (left,
   previous temporal group), each neighbour already blended; extent = (tile - stride) cells in
   pixels. Every tile but the last of its axis keeps `stride` cells (the frame-0 group one frame less
   under the causal mapping); the last keeps all of itself.

Memory: the features, the output (decoder dtype; float32 at the end) and, per temporal group, the previous group, the group
being assembled and one row of tiles beside one tile's stage 4 + stage 5 (estimate: the tiled branch
of estimate_diffusion_decoder.py). Cost: the overlaps are computed twice (release defaults: 80-frame
tiles every 56 frames, 768-px tiles every 704 px: ~1.4x the untiled stage 4 + 5 work on long clips),
and the result differs from the untiled decode near tile borders (each tile's windows shift inward at
its own border; with one step every tile has its own noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from runnerkit.models.ltx2.diffusion_decoder import (
    LTX2DiffusionDecoder3d,
    LTX2DiffusionDecoderArch,
    denoise_pixels,
)

Interval = tuple[int, int]


@dataclass(frozen=True)
class DecoderTiling:
    """Tile sizes in output pixels / frames (diffusers' `tile_sample_*`; defaults are its: 768 x 768 px
    x 80 frames, starts 704 px / 704 px / 56 frames apart). Sizes should be multiples of the tiling
    cell (release: 8 px, 2 frames); they are floored to it.

    Raises:
        ValueError: a size not positive, or a stride larger than its tile (the tiles would leave gaps).
    """

    tile_height: int = 768
    tile_width: int = 768
    tile_frames: int = 80
    stride_height: int = 704
    stride_width: int = 704
    stride_frames: int = 56

    def __post_init__(self) -> None:
        for axis in ("height", "width", "frames"):
            tile, stride = getattr(self, f"tile_{axis}"), getattr(self, f"stride_{axis}")
            if not 0 < stride <= tile:
                raise ValueError(f"`stride_{axis}` must be in [1, tile_{axis}={tile}], got {stride}.")

    def applies(self, arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int]) -> bool:
        """Whether latents of (F, H, W) decode tiled: one axis longer than a tile in latent cells (the
        reference's rule; a smaller latent decodes whole, bit-identical to the untiled decode)."""
        f, h, w = latent_fhw
        return (f > self.tile_frames // arch.temporal_compression_ratio
                or h > self.tile_height // arch.spatial_compression_ratio
                or w > self.tile_width // arch.spatial_compression_ratio)


def tile_intervals(length: int, tile: int, stride: int, min_size: int) -> list[Interval]:
    """[start, end) tiles covering [0, length): starts `stride` apart, `tile` long; a trailing remnant
    shorter than `min_size` is merged into the tile before it (so the last tile may be longer than
    `tile`); `length <= tile` is one tile."""
    if length <= tile:
        return [(0, length)]
    starts = list(range(0, length, stride))
    while len(starts) > 1 and length - starts[-1] < min_size:
        starts.pop()
    return [(s, min(s + tile, length)) for s in starts[:-1]] + [(starts[-1], length)]


@dataclass(frozen=True)
class TilePlan:
    """The tiles of one decode on the feature grid (stage 4's input), and their pixel scale.

    Attributes:
        frames, height, width: the feature grid without its ghost frames (T_f, H_f, W_f).
        ghost: padding frames at the feature grid's end (taken by a tile that ends at `frames`).
        scale: output pixels per cell (s_t, s_h, s_w).
        tiles: the (T, H, W) intervals, in order.
        strides: the tile strides in cells (T, H, W); blends: the blend extents in pixels (T, H, W).
    """

    frames: int
    height: int
    width: int
    ghost: int
    scale: tuple[int, int, int]
    tiles: tuple[list[Interval], list[Interval], list[Interval]]
    strides: tuple[int, int, int]
    blends: tuple[int, int, int]

    def pixel_frames(self, t0: int, t1: int) -> int:
        """Output frames of the temporal tile [t0, t1): s_t per cell, one less at frame 0 when s_t = 2."""
        return (t1 - t0) * self.scale[0] - (1 if t0 == 0 and self.scale[0] == 2 else 0)


def feature_grid(arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int]) -> tuple[int, int, int]:
    """(T, H, W) of `features` (padding frames included) for latents of (F, H, W)."""
    t, h, w = latent_fhw[0] + arch.trailing_pad_frames, latent_fhw[1], latent_fhw[2]
    for st, sh, sw in arch.decoder_upsample_strides[:-1]:
        t, h, w = t * st - (1 if st == 2 else 0), h * sh, w * sw
    return t, h, w


def tile_plan(arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int], tiling: DecoderTiling) -> TilePlan:
    """The tiles of a tiled decode of latents (F, H, W) (module docstring, steps 1-2)."""
    last = arch.decoder_upsample_strides[-1]
    scale = (last[0], last[1] * arch.patch_size, last[2] * arch.patch_size)
    tile = (tiling.tile_frames // scale[0], tiling.tile_height // scale[1], tiling.tile_width // scale[2])
    stride = (tiling.stride_frames // scale[0], tiling.stride_height // scale[1], tiling.stride_width // scale[2])
    if min(stride) < 1:
        raise ValueError(f"tile strides {stride} (cells of {scale} pixels) must be at least one cell: "
                         f"raise the strides of {tiling}.")
    # a tile must fit stage 4's window as it is and stage 5's once upsampled
    min_sizes = [max(k4, -(-k5 // s)) for k4, k5, s in
                 zip(arch.decoder_stage_kernels[-1], arch.decoder_stage5_kernel, last)]
    ghost = arch.trailing_pad_frames * math.prod(s[0] for s in arch.decoder_upsample_strides[:-1])
    t, h, w = feature_grid(arch, latent_fhw)
    grid = (t - ghost, h, w)
    tiles = tuple(tile_intervals(n, k, s, m) for n, k, s, m in zip(grid, tile, stride, min_sizes))
    blends = tuple((k - s) * c for k, s, c in zip(tile, stride, scale))
    return TilePlan(*grid, ghost, scale, tiles, stride, blends)  # type: ignore[arg-type]


def decode_grids(arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int],
                 tiling: DecoderTiling | None) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """The distinct (stage-4 grid, stage-5 grid) pairs, each (T, H, W) in tokens, that a decode of latents
    (F, H, W) runs stage 4 and stage 5 on: one pair untiled (or within one tile), one per tile shape tiled
    (what warmup must cover: docs/ltx2.md, "Tiled diffusion decode")."""
    up = arch.decoder_upsample_strides[-1]
    pad = arch.trailing_pad_frames * arch.temporal_compression_ratio
    if tiling is None or not tiling.applies(arch, latent_fhw):
        t, h, w = feature_grid(arch, latent_fhw)
        return [((t, h, w), (t * up[0] - (1 if up[0] == 2 else 0) - pad, h * up[1], w * up[2]))]
    plan = tile_plan(arch, latent_fhw, tiling)
    grids = {((t1 - t0 + (plan.ghost if t1 == plan.frames else 0), h1 - h0, w1 - w0),
              (plan.pixel_frames(t0, t1), (h1 - h0) * up[1], (w1 - w0) * up[2]))
             for t0, t1 in plan.tiles[0] for h0, h1 in plan.tiles[1] for w0, w1 in plan.tiles[2]}
    return sorted(grids)


def blend(a: Tensor, b: Tensor, extent: int, dim: int) -> None:
    """In place: `b`'s first rows along `dim` ramp from `a`'s last ones (diffusers' blend_v / blend_h /
    blend_t: `b[y] = a[y - e] * (1 - y / e) + b[y] * (y / e)`, e = min(extent, both lengths))."""
    e = min(a.shape[dim], b.shape[dim], extent)
    for y in range(e):
        b.select(dim, y).copy_(a.select(dim, y - e) * (1 - y / e) + b.select(dim, y) * (y / e))


def _spatial_offsets(intervals: list[Interval], stride: int, scale: int) -> list[int]:
    """Pixel offset of each tile's kept part: every tile but the last keeps `stride` cells."""
    return [i * stride * scale for i in range(len(intervals))]


@torch.no_grad()
def decode_tiled(decoder: LTX2DiffusionDecoder3d, latents: Tensor, generator: torch.Generator,
                 num_inference_steps: int, tiling: DecoderTiling) -> Tensor:
    """The tiled decode of raw latents (module docstring).

    Args:
        decoder: the network, on its device and dtype.
        latents: [B, C_lat, F, H, W] de-normalised, in the decoder's dtype.
        generator: the request's CPU generator (its next draws are the tiles' noise).
        num_inference_steps: stage-5 steps (>= 1).
        tiling: the tile sizes.

    Returns:
        [B, 3, 8(F-1)+1, 32H, 32W] float32 pixels clamped to [-1, 1] (release ratios).
    """
    arch = decoder.arch
    B, dtype, device = latents.shape[0], latents.dtype, latents.device
    plan = tile_plan(arch, tuple(latents.shape[2:]), tiling)  # type: ignore[arg-type]
    (st, sh, sw), (tiles_t, tiles_h, tiles_w) = plan.scale, plan.tiles
    features = decoder.features(latents)  # [B, T_f + ghost, H_f, W_f, C_4]
    p, C = arch.patch_size, arch.out_channels
    total = (B, C, plan.pixel_frames(0, plan.frames), plan.height * sh, plan.width * sw)
    canvas = None
    if not (num_inference_steps == 1 and arch.decoder_model_output_type == "x0"):
        canvas = torch.randn(total, generator=generator, dtype=dtype).to(device)  # shared by overlapping tiles
    out = torch.empty(total, dtype=dtype, device=device)
    rows_at = _spatial_offsets(tiles_h, plan.strides[1], sh)
    cols_at = _spatial_offsets(tiles_w, plan.strides[2], sw)
    previous: Tensor | None = None
    written = 0
    for k, (t0, t1) in enumerate(tiles_t):
        origin, trailing = t0 == 0, t1 == plan.frames
        pixel_t0 = t0 * st - (1 if not origin and st == 2 else 0)
        group = torch.empty((B, C, plan.pixel_frames(t0, t1), *total[3:]), dtype=dtype, device=device)
        above: list[Tensor | None] = []
        for i, (h0, h1) in enumerate(tiles_h):
            row: list[Tensor] = []
            for j, (w0, w1) in enumerate(tiles_w):
                end = features.shape[1] if trailing else t1  # the trailing tile takes the ghost frames
                context = decoder.stage_4(features[:, t0:end, h0:h1, w0:w1], drop_leading_frame=origin,
                                          crop_padding=trailing)  # [B, T_5, H_5, W_5, C_5]
                shape = (B, C, context.shape[1], context.shape[2] * p, context.shape[3] * p)
                if canvas is None:
                    x_t = torch.randn(shape, generator=generator, dtype=dtype).to(device)
                else:
                    x_t = canvas[:, :, pixel_t0:pixel_t0 + shape[2], h0 * sh:h0 * sh + shape[3],
                                 w0 * sw:w0 * sw + shape[4]]
                tile = denoise_pixels(decoder, context, x_t, num_inference_steps)
                del context, x_t
                if i > 0:
                    blend(above[j], tile, plan.blends[1], dim=3)  # type: ignore[arg-type]
                    above[j] = None  # its last consumer
                if j > 0:
                    blend(row[j - 1], tile, plan.blends[2], dim=4)
                keep_h = plan.strides[1] * sh if i < len(tiles_h) - 1 else tile.shape[3]
                keep_w = plan.strides[2] * sw if j < len(tiles_w) - 1 else tile.shape[4]
                group[:, :, :, rows_at[i]:rows_at[i] + keep_h, cols_at[j]:cols_at[j] + keep_w] = \
                    tile[:, :, :, :keep_h, :keep_w]
                row.append(tile)
                del tile
            above = list(row)
            del row
        del above  # the last row's tiles
        if previous is not None:
            blend(previous, group, plan.blends[0], dim=2)
        keep = group.shape[2] if k == len(tiles_t) - 1 else plan.strides[0] * st - (1 if origin and st == 2 else 0)
        out[:, :, written:written + keep] = group[:, :, :keep]
        written += keep
        previous = group
    assert written == total[2], f"temporal tiles wrote {written} of {total[2]} frames"
    del features, previous, group
    return out.float().clamp_(-1.0, 1.0)  # (in float32 `float()` is `out` itself: clamped in place)
