"""Activation peak of the LTX-2.5 diffusion decoder (`diffusion_decode.decode_video`, untiled).

Read from this package's forward code (diffusion_decoder.py, diffusion_decoder_layers.py) as
estimate_decoders.py reads the VAE: an argument stays alive for the call it is passed to, a local
until it is rebound. Units: bytes; `s` = bytes per element of the decoder's dtype. The latents
(kilobytes to a few MiB): the caller's float32 ones (counted here), their de-normalised copy,
its cast to the decoder's dtype and the copy with the padding frames, alive throughout.

At a token grid of N tokens and width C (a = B N C s):
- deterministic block (`NABlock`), at the attention kernel's output: the block input kept by the
  caller, norm1's output, the rotated q and k (each projection and its normed copy freed once
  rotated), v and the kernel's output: 6a (FlexAttention lays its output out as the query,
  [B, N, heads, d], so the transpose back to [B, T, H, W, C] is a view). As many are alive while
  k's RMS norm runs (the block's tensors, the rotated q, k's projection, the norm's two products),
  with its float32 statistics (B N heads) beside them: that point binds. Its MLP holds the input, the
  residual sum, norm2's output and the tiled output (4a) beside one tile's three hidden-width
  tensors (`SWIGLU_TILE_TOKENS` tokens; untiled under that count).
- in bfloat16 the RoPE's float32 temporaries outgrow that point: while k's last (W, 3/8 of
  head_dim) chunk rotates, the normed k, the rotated q and k's other chunks are alive beside the
  chunk's float32 copy, two half-chunk products and their float32 stack (~7.9a in a diffusion
  block at head_dim 64); in float32 they stay under the attention point.
- a stage of two or more blocks: its caller holds the stage's input (the upsampler's storage) beside a
  later block's tensors.
- diffusion block: the same plus the context sum (input + context_proj): 7a, and the AdaLN
  modulated copy where the plain block has the norm's output.
- the tiled token order (CUDA) copies q, k and v into tile order as each is made, the grid-order
  tensor freed at once: one activation more for an instant, under the points above.
- compiled (`compile.enabled`) in half precision, the key region holds k's projection, its output,
  the norm's statistics and the RoPE's float32 angle table [T, H, W, head_dim/2] (`_rope_3d_one_pass`)
  beside the block's tensors and q (copies - 3): the output and the table (a / heads) where eager holds
  the norm's two products, so under the norm point; not a point of its own (measured with CPU inductor:
  test_diffusion_decoder_estimate.py `compiled_key_bytes`).
- upsampler: its input, the projection (prod(stride) x C_out per token) and the pixel-shuffle copy
  of it; the last one's copy IS the context (a view of it, frames cropped), alive through stage 5.
- stage 5 around the blocks: the context, the noise canvas x_t [B, 3, F, H, W] in s, the timestep
  embedding and AdaLN modulation (a few KiB); at the end the
  conv_out output and its unpatchify copy, then `decode_video`'s float32 copy (none when the
  decoder computes in float32) and its clamp.
Not counted: the attention kernel's own workspace (compiled FlexAttention: its logsumexp, B x
heads x N float32, and the `BlockMask`, ~(N/128)^2 int32 per stage) and the CPU path's dense
[N, N] mask (test sizes only). On the CPU with that kernel replaced by an output-only stand-in the
formula bounds the measured peak (test_cases/models/ltx2/test_diffusion_decoder_estimate.py).

LTX-2.5 at 512x768x121 in bfloat16 (latent 16x16x24): stage 5 is 121 x 128 x 192 = 2.97 M tokens x
256 channels, 1.42 GiB per activation; the peak is in a diffusion block (9 of them, beside the
1.62 GiB context storage and the 0.27 GiB noise) and the RoPE's float32 temporaries: 13.1 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling, tile_plan
from runnerkit.models.ltx2.diffusion_decoder import LTX2DiffusionDecoderArch
from runnerkit.models.ltx2.diffusion_decoder_layers import DiffusionNABlock
from runnerkit.models.ltx2.layers import TIMESTEP_FEATURES

F32 = 4

BLOCK_COPIES = 6
"""Activations alive in a deterministic block at the attention output (see the module doc)."""
DIFFUSION_BLOCK_COPIES = 7
"""Activations alive in a stage-5 block at the attention output (the context sum added)."""
MLP_COPIES = 4
"""Activations alive in a block's MLP beside the tile: input, residual sum, normed input, output."""


@dataclass(frozen=True)
class _Stage:
    tokens: int  # B x T x H x W
    width: int


def _block_peak(stage: _Stage, batch: int, s: int, copies: int, stored: int, head_dim: int) -> int:
    """A block's peak: at the attention output, or in the MLP (three hidden-width tensors of one
    tile; untiled, the MLP's output is no separate buffer: one activation less). `stored`: bytes
    of the stage input's storage (a temporal x2 upsampler's output is a view one frame short)."""
    a = stage.tokens * stage.width * s
    per_batch = stage.tokens // batch
    tiles = layers.swiglu_tiles(per_batch)  # as the forward splits them (a one-token tail joins the tile before)
    tiled = len(tiles) > 1
    tile = batch * max(stop - start for start, stop in tiles)
    mlp = (MLP_COPIES - (0 if tiled else 1)) * a + 3 * tile * layers.swiglu_hidden_dim(stage.width) * s
    norm_k = copies * a + stage.tokens * stage.width // head_dim * F32  # + its float32 statistics per head
    return stored - a + max(norm_k, mlp, _rope_k_peak(stage, s, head_dim, copies))


def _rope_k_peak(stage: _Stage, s: int, head_dim: int, copies: int) -> int:
    """Rotating k's last (W) chunk of c elements: the rotated q, the normed k and the block's tensors
    before them (copies - 2), k's rotated T and H chunks, and float32 temporaries: the chunk's
    float32 copy (none in float32), two half-chunk products and their stack."""
    a = stage.tokens * stage.width * s
    dim_w = layers.rope_dim_split(head_dim)[2]
    c = stage.tokens * stage.width * dim_w // head_dim
    temporaries = (0 if s == F32 else c * F32) + 2 * (c // 2) * F32 + c * F32
    return (copies - 2) * a + (a - c * s) + temporaries


def _latent_bytes(arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int], s: int,
                  batch: int) -> tuple[int, tuple[int, int, int]]:
    """The latents' bytes (the caller's float32 ones, their de-normalised copy, its cast, the padded copy in
    the decoder dtype) and the padded latent grid (f + pad, h, w).

    Raises:
        ValueError: a latent grid smaller than the stage-1 window.
    """
    f, h, w = latent_fhw
    pad = arch.trailing_pad_frames
    grid = (f + pad, h, w)
    if any(g < k for g, k in zip(grid, arch.decoder_stage_kernels[0])):
        raise ValueError(f"latent grid (f + {pad} padding frames, h, w) = {grid} is smaller than the stage-1 "
                         f"window {arch.decoder_stage_kernels[0]}.")
    cells = batch * arch.latent_channels * h * w
    return 2 * cells * f * F32 + (cells * f * s if s != F32 else 0) + cells * (f + pad) * s, grid


def _deterministic_stages(arch: LTX2DiffusionDecoderArch, grid: tuple[int, int, int], batch: int, s: int,
                          stages: range, stored: int, base: int, peak: tuple[int, str],
                          ) -> tuple[tuple[int, str], int, tuple[int, int, int]]:
    """Deterministic stages `stages` (0-based) and their upsamplers from a (T, H, W) `grid` whose input
    storage is `stored` bytes, with `base` bytes alive beside them: the (peak, where) so far updated,
    the last upsampler's storage (bytes) and the grid after it (no frames cropped)."""
    for i in stages:
        stride, reduction = arch.decoder_upsample_strides[i], arch.decoder_upsample_channel_reductions[i]
        stage = _Stage(batch * math.prod(grid), arch.decoder_stage_channels[i])
        a = stage.tokens * stage.width * s
        shuffled = stage.tokens * math.prod(stride) * (stage.width // reduction) * s
        # the caller holds the stage's input through its blocks: beside a later block's own input when there are two
        held = stored + (a if arch.decoder_stage_depths[i] > 1 else 0)
        block = _block_peak(stage, batch, s, BLOCK_COPIES, held, arch.decoder_head_dim)
        for name, live in ((f"stage {i + 1} block", block),
                           (f"upsampler {i + 1}", a + 2 * shuffled)):
            if arch.decoder_stage_depths[i] or name.startswith("upsampler"):
                peak = max(peak, (base + live, name))
        stored = shuffled  # the last one's storage stays alive (the context, or the tiled decode's features)
        grid = (grid[0] * stride[0] - (1 if stride[0] == 2 else 0), grid[1] * stride[1], grid[2] * stride[2])
    return peak, stored, grid


def _stage5_points(arch: LTX2DiffusionDecoderArch, grid: tuple[int, int, int], batch: int, s: int,
                   base: int) -> tuple[list[tuple[int, str]], int, int, int]:
    """One stage-5 step on a (T, H/p, W/p) token `grid` with `base` bytes alive beside it (the context
    included): its (bytes, where) points, the bytes alive around its blocks (`base`, the noise canvas, the
    modulation), the canvas's element count and one stage-5 activation (bytes)."""
    p = arch.patch_size
    stage5 = _Stage(batch * math.prod(grid), arch.decoder_stage_channels[4])
    canvas = batch * arch.out_channels * grid[0] * grid[1] * p * grid[2] * p  # elements
    # the timestep features (float32), its embedding, the shared modulation and one block's sum with its table
    modulation = batch * (TIMESTEP_FEATURES * F32 + arch.decoder_t_emb_dim * s
                          + 2 * DiffusionNABlock.NUM_MOD * stage5.width * s)
    outer = base + canvas * s + modulation
    a5 = stage5.tokens * stage5.width * s
    points = [(outer + 2 * a5 + canvas * s, "stage 5 norm_out + conv_out"), (outer + 2 * canvas * s, "unpatchify")]
    if arch.decoder_stage_depths[4]:
        points.append((outer + _block_peak(stage5, batch, s, DIFFUSION_BLOCK_COPIES, a5, arch.decoder_head_dim),
                       "stage 5 block"))
    return points, outer, canvas, a5


def diffusion_decode_bytes(arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int], s: int,
                           batch: int = 1) -> tuple[int, str]:
    """Activation peak of `decode_video` on latents [batch, C, f, h, w] with one stage-5 step
    (the release), the float32 result included; and a one-line detail.

    Raises:
        ValueError: a latent grid smaller than the stage-1 window.
    """
    latents, grid = _latent_bytes(arch, latent_fhw, s, batch)
    pad = arch.trailing_pad_frames
    stored = batch * math.prod(grid) * arch.decoder_stage_channels[0] * s  # conv_in's output
    (peak, where), context, grid = _deterministic_stages(arch, grid, batch, s, range(4), stored, latents,
                                                         (latents, "latents"))
    frames = grid[0] - pad * arch.temporal_compression_ratio
    points, outer, canvas, a5 = _stage5_points(arch, (frames, grid[1], grid[2]), batch, s, latents + context)
    peak, where = max([(peak, where), *points,
                       (outer + (canvas * s if s != F32 else 0) + 2 * canvas * F32, "float + clamp")])
    gib = 2**30
    return peak, (f"diffusion decode peak in {where}: {frames} frames, stage-5 activation {a5 / gib:.2f} GiB, "
                  f"context {context / gib:.2f} GiB")


def tiled_diffusion_decode_bytes(arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int], s: int,
                                 tiling: DecoderTiling, batch: int = 1) -> tuple[int, str]:
    """Activation peak of `decode_video(..., tiling=tiling)` (diffusion_decode_tiled.py) with one x0 stage-5
    step (the release); the untiled `diffusion_decode_bytes` when the latents fit one tile. Stages 1-3 on
    the whole latent as untiled; then, tile by tile in the decode's order, stage 4 and stage 5 on the tile
    beside what stays alive: the latents, the features (stage 3's upsampler storage), the output video
    (decoder dtype; its float32 copy at the end), the previous and the current temporal group (decoder dtype)
    and the row tiles still to blend
    from (the current row's and the previous row's not yet consumed). A multi-step decode's noise canvas
    is added; its per-step float32 temporaries are not counted.

    Raises:
        ValueError: a latent grid smaller than the stage-1 window.
    """
    if not tiling.applies(arch, latent_fhw):
        return diffusion_decode_bytes(arch, latent_fhw, s, batch)
    latents, grid = _latent_bytes(arch, latent_fhw, s, batch)
    stored = batch * math.prod(grid) * arch.decoder_stage_channels[0] * s  # conv_in's output
    peak, features, _ = _deterministic_stages(arch, grid, batch, s, range(3), stored, latents, (latents, "latents"))
    plan = tile_plan(arch, latent_fhw, tiling)
    (_, sh, sw), (tiles_t, tiles_h, tiles_w) = plan.scale, plan.tiles
    px = batch * arch.out_channels * sh * sw  # elements per feature cell (H, W) and output frame
    total = px * plan.pixel_frames(0, plan.frames) * plan.height * plan.width
    base = latents + features + total * s
    if not (arch.decoder_num_inference_steps == 1 and arch.decoder_model_output_type == "x0"):
        base += total * s  # the shared noise canvas
    up = arch.decoder_upsample_strides[-1]
    previous, largest = 0, (0, 0, 0)
    for t0, t1 in tiles_t:
        frames = plan.pixel_frames(t0, t1)
        group = px * frames * plan.height * plan.width * s
        above = [0] * len(tiles_w)
        for h0, h1 in tiles_h:
            row: list[int] = []
            for j, (w0, w1) in enumerate(tiles_w):
                alive = base + previous + group + sum(row) + sum(above[j:])
                grid4 = (t1 - t0 + (plan.ghost if t1 == plan.frames else 0), h1 - h0, w1 - w0)
                # the blocks read a view of the features (counted in `alive`): no storage of the stage's own
                peak, context, _ = _deterministic_stages(arch, grid4, batch, s, range(3, 4), 0, alive, peak)
                grid5 = (frames, (h1 - h0) * up[1], (w1 - w0) * up[2])
                points, *_ = _stage5_points(arch, grid5, batch, s, alive + context)
                peak = max([peak, *points])
                largest = max(largest, grid5, key=math.prod)
                above[j] = 0
                row.append(px * frames * (h1 - h0) * (w1 - w0) * s)
            above = row
        previous = group
    # the end: the output and its float32 copy (none in float32), clamped in place
    peak = max(peak, (latents + total * s + (total * F32 if s != F32 else 0), "float + clamp"))
    gib = 2**30
    tiles = len(tiles_t) * len(tiles_h) * len(tiles_w)
    return peak[0], (f"tiled diffusion decode peak in {peak[1]}: {tiles} tiles, the largest stage-5 grid "
                     f"{'x'.join(map(str, largest))}, features {features / gib:.2f} GiB, "
                     f"output {total * s / gib:.2f} GiB")
