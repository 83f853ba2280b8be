"""Activation peak of the LTX-2.5 diffusion decoder (`diffusion_decode.decode_video`, untiled).

Read from this package's forward code (diffusion_decoder.py, diffusion_decoder_layers.py) as
estimate_decoders.py reads the VAE: an argument stays alive for the call it is passed to, a local
until it is rebound. Units: bytes; `s` = bytes per element of the decoder's dtype. The latents
(kilobytes to a few MiB): the caller's float32 ones (counted here), their de-normalised copy,
its cast to the decoder's dtype and the copy with the padding frames, alive throughout.

At a token grid of N tokens and width C (a = B N C s):
- deterministic block (`NABlock`), at the attention kernel's output: the block input kept by the
  caller, norm1's output, q, k, v (their projections, normed and scaled), the rotated q and k and
  the kernel's output: 8a (FlexAttention lays its output out as the query, [B, N, heads, d], so
  the transpose back to [B, T, H, W, C] is a view). Its MLP holds the input, the
  residual sum, norm2's output and the tiled output (4a) beside one tile's three hidden-width
  tensors (`SWIGLU_TILE_TOKENS` tokens; untiled under that count).
- in bfloat16 the RoPE's float32 temporaries outgrow that point: while k's last (W, 3/8 of
  head_dim) chunk rotates, q, k, v, the rotated q and k's other chunks are alive beside the
  chunk's float32 copy, two half-chunk products and their float32 stack (~9.9a in a diffusion
  block at head_dim 64); in float32 they stay under the attention point.
- diffusion block: the same plus the context sum (input + context_proj): 9a, and the AdaLN
  modulated copy where the plain block has the norm's output.
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
1.62 GiB context storage and the 0.27 GiB noise) and the RoPE's float32 temporaries: 15.9 GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.diffusion_decoder import LTX2DiffusionDecoderArch
from runnerkit.models.ltx2.diffusion_decoder_layers import DiffusionNABlock
from runnerkit.models.ltx2.layers import TIMESTEP_FEATURES

F32 = 4

BLOCK_COPIES = 8
"""Activations alive in a deterministic block at the attention output (see the module doc)."""
DIFFUSION_BLOCK_COPIES = 9
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
    tiled = per_batch > layers.SWIGLU_TILE_TOKENS
    tile = batch * min(per_batch, layers.SWIGLU_TILE_TOKENS)
    mlp = (MLP_COPIES - (0 if tiled else 1)) * a + 3 * tile * layers.swiglu_hidden_dim(stage.width) * s
    return stored - a + max(copies * a, mlp, _rope_k_peak(stage, s, head_dim, copies))


def _rope_k_peak(stage: _Stage, s: int, head_dim: int, copies: int) -> int:
    """Rotating k's last (W) chunk of c elements: q, k, v, the rotated q and the block's tensors
    before them (copies - 2), k's rotated T and H chunks, and float32 temporaries: the chunk's
    float32 copy (none in float32), two half-chunk products and their stack."""
    a = stage.tokens * stage.width * s
    dim_w = layers.rope_dim_split(head_dim)[2]
    c = stage.tokens * stage.width * dim_w // head_dim
    temporaries = (0 if s == F32 else c * F32) + 2 * (c // 2) * F32 + c * F32
    return (copies - 2) * a + (a - c * s) + temporaries


def diffusion_decode_bytes(arch: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int], s: int,
                           batch: int = 1) -> tuple[int, str]:
    """Activation peak of `decode_video` on latents [batch, C, f, h, w] with one stage-5 step
    (the release), the float32 result included; and a one-line detail.

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
    # the caller's float32 latents, their de-normalised copy, its cast, the padded copy (decoder dtype)
    latents = 2 * cells * f * F32 + (cells * f * s if s != F32 else 0) + cells * (f + pad) * s
    peak, where, context = latents, "latents", 0
    stored = batch * math.prod(grid) * arch.decoder_stage_channels[0] * s  # conv_in's output
    for i, (stride, reduction) in enumerate(zip(arch.decoder_upsample_strides,
                                                arch.decoder_upsample_channel_reductions)):
        stage = _Stage(batch * math.prod(grid), arch.decoder_stage_channels[i])
        a = stage.tokens * stage.width * s
        shuffled = stage.tokens * math.prod(stride) * (stage.width // reduction) * s
        for name, live in ((f"stage {i + 1} block", _block_peak(stage, batch, s, BLOCK_COPIES, stored, arch.decoder_head_dim)),
                           (f"upsampler {i + 1}", a + 2 * shuffled)):
            if arch.decoder_stage_depths[i] or name.startswith("upsampler"):
                peak, where = max((peak, where), (latents + live, name))
        stored = context = shuffled  # the last one's storage stays alive as the context
        grid = (grid[0] * stride[0] - (1 if stride[0] == 2 else 0), grid[1] * stride[1], grid[2] * stride[2])
    frames = grid[0] - pad * arch.temporal_compression_ratio
    p = arch.patch_size
    stage5 = _Stage(batch * frames * grid[1] * grid[2], arch.decoder_stage_channels[4])
    canvas = batch * arch.out_channels * frames * grid[1] * p * grid[2] * p  # elements
    # the timestep features (float32), its embedding, the shared modulation and one block's sum with its table
    modulation = batch * (TIMESTEP_FEATURES * F32 + arch.decoder_t_emb_dim * s
                          + 2 * DiffusionNABlock.NUM_MOD * stage5.width * s)
    outer = latents + context + canvas * s + modulation
    a5 = stage5.tokens * stage5.width * s
    if arch.decoder_stage_depths[4]:
        peak, where = max((peak, where), (outer + _block_peak(stage5, batch, s, DIFFUSION_BLOCK_COPIES, a5, arch.decoder_head_dim),
                                          "stage 5 block"))
    peak, where = max((peak, where), (outer + 2 * a5 + canvas * s, "stage 5 norm_out + conv_out"),
                      (outer + 2 * canvas * s, "unpatchify"), (outer + (canvas * s if s != F32 else 0) + 2 * canvas * F32, "float + clamp"))
    gib = 2**30
    return peak, (f"diffusion decode peak in {where}: {frames} frames, stage-5 activation {a5 / gib:.2f} GiB, "
                  f"context {context / gib:.2f} GiB")
