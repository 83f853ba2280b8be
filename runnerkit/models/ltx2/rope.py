"""RoPE of the LTX-2 transformer: positions in seconds and pixels, fractional frequencies.

Unlike Wan's integer-index RoPE, LTX-2 places each token at the midpoint of the span it covers
in the decoded media, measured in seconds (time) and pixels (space), then divides by a base size
(`pos_embed_max_pos` seconds, `base_height`/`base_width` pixels) so that positions are fractions:

- video token (f, h, w) with patch (pt, p, p) covers latent frames [f, f + pt), rows [h, h + p),
  columns [w, w + p); pixel spans are those times the VAE factors (8, 32, 32). The causal VAE's
  first latent frame is one pixel frame, so the time span is shifted by `causal_offset - 8` and
  clamped at 0, then divided by the frame rate (seconds).
- audio token t covers mel frames [4t, 4(t + pt)), shifted the same way, times hop / rate (seconds).

Each of the P position axes (3 for video self-attention, 1 for audio and for the audio<->video
attention, which use time only) gets `dim // (2P)` frequencies `theta ** linspace(0, 1) * pi / 2`
(float64 when `rope_double_precision`, then float32); the angle of a position x in [0, 1] is
`(2x - 1) * freq`. Frequencies of the axes are interleaved (f0 of every axis, then f1, ...), and
the table is padded at its front with angle 0 up to `dim / 2` angles.

"split" RoPE (both releases) cuts the width into G groups (the heads of the RoPE's own config,
which for the audio<->video attention is the video head count on the video side) and rotates the
first half of each group against its second half; "interleaved" rotates adjacent channel pairs.

Source: diffusers 0.42.1 `LTX2AudioVideoRotaryPosEmbed` and `apply_split_rotary_emb` /
`apply_interleaved_rotary_emb` (models/transformers/transformer_ltx2.py); Lightricks LTX-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

RopeType = Literal["split", "interleaved"]


@dataclass(frozen=True)
class RopeTable:
    """cos/sin of one RoPE, float32, shared by the batch.

    split: cos, sin [1, L, G, r] (G groups of 2r channels); interleaved: [1, L, dim].
    """

    cos: Tensor
    sin: Tensor
    kind: RopeType


def video_positions(frames: int, height: int, width: int, patch: tuple[int, int, int],
                    scale_factors: tuple[int, int, int], causal_offset: int, fps: float,
                    device: torch.device) -> Tensor:
    """Token spans of a video latent grid: [3, L, 2] float32, (time s | pixel row | pixel col) x (start, end).

    Args:
        frames, height, width: latent grid size (before patching); tokens in (f, h, w) order.
        patch: (pt, p, p) patch of the latent grid.
        scale_factors: VAE (frame, height, width) compression.
        causal_offset: 1 for the causal video VAE (first latent frame = one pixel frame).
        fps: frame rate of the generated video (frames / second).
    """
    pt, ph, pw = patch
    axes = [torch.arange(0, n, step, dtype=torch.float32, device=device)
            for n, step in zip((frames, height, width), patch)]
    starts = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # [3, f, h, w]
    ends = starts + torch.tensor([pt, ph, pw], dtype=torch.float32, device=device).view(3, 1, 1, 1)
    spans = torch.stack([starts, ends], dim=-1).flatten(1, 3)  # [3, L, 2] latent units
    spans = spans * torch.tensor(scale_factors, device=device).view(3, 1, 1)  # pixel units
    time = (spans[0] + causal_offset - scale_factors[0]).clamp(min=0) / fps  # [L, 2] seconds
    return torch.cat([time.unsqueeze(0), spans[1:]], dim=0)


def audio_positions(frames: int, patch_t: int, scale_factor: int, causal_offset: int, hop_length: int,
                    sampling_rate: int, device: torch.device) -> Tensor:
    """Token spans of an audio latent sequence: [1, L, 2] float32 seconds (start, end).

    Args:
        frames: audio latent frames; patch_t: temporal patch; scale_factor: mel frames per latent frame.
        hop_length, sampling_rate: of the mel spectrogram (seconds = mel frame x hop / rate).
    """
    t = torch.arange(0, frames, patch_t, dtype=torch.float32, device=device)  # [L]

    def seconds(latent: Tensor) -> Tensor:
        mel = (latent * scale_factor + causal_offset - scale_factor).clip(min=0)
        return mel * hop_length / sampling_rate

    return torch.stack([seconds(t), seconds(t + patch_t)], dim=-1).unsqueeze(0)  # [1, L, 2]


def rope_table(spans: Tensor, base: tuple[float, ...], dim: int, groups: int, theta: float,
               double_precision: bool, kind: RopeType) -> RopeTable:
    """cos/sin for tokens at the midpoints of `spans`.

    Args:
        spans: [P, L, 2] (start, end) per position axis (`video_positions` / `audio_positions`,
            or their first axis for the audio<->video attention).
        base: P divisors turning positions into fractions (seconds, pixels, pixels).
        dim: width the RoPE covers (all heads).
        groups: split RoPE only: number of channel groups (heads) the width is cut into.
        theta: frequency base. double_precision: frequencies in float64 before the float32 cast.
        kind: "split" or "interleaved".

    Returns:
        RopeTable: split [1, L, groups, dim / (2 groups)], interleaved [1, L, dim].
    """
    P, L, _ = spans.shape
    mid = (spans[..., 0:1] + spans[..., 1:2]) / 2.0  # [P, L, 1]
    frac = torch.stack([mid[i, :, 0] / base[i] for i in range(P)], dim=-1)  # [L, P]
    n_freq = dim // (2 * P)
    dtype = torch.float64 if double_precision else torch.float32
    freqs = torch.pow(theta, torch.linspace(0.0, 1.0, n_freq, dtype=dtype, device=spans.device))
    freqs = (freqs * math.pi / 2.0).to(torch.float32)  # [n_freq]
    angles = (frac.unsqueeze(-1) * 2 - 1) * freqs  # [L, P, n_freq]
    angles = angles.transpose(-1, -2).flatten(1)  # [L, n_freq * P], axes interleaved per frequency
    if kind == "interleaved":
        cos, sin = angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)  # [L, 2 n P]
        pad = dim % (2 * P)
        cos = torch.cat([torch.ones_like(cos[:, :pad]), cos], dim=-1)  # [L, dim]
        sin = torch.cat([torch.zeros_like(sin[:, :pad]), sin], dim=-1)
        return RopeTable(cos.unsqueeze(0), sin.unsqueeze(0), kind)
    pad = dim // 2 - angles.shape[-1]
    cos = torch.cat([torch.ones_like(angles[:, :pad]), angles.cos()], dim=-1)  # [L, dim/2]
    sin = torch.cat([torch.zeros_like(angles[:, :pad]), angles.sin()], dim=-1)
    return RopeTable(cos.view(1, L, groups, -1), sin.view(1, L, groups, -1), kind)  # [1, L, G, r]


def apply_rope(x: Tensor, rope: RopeTable) -> Tensor:
    """Rotate queries or keys by their RoPE angles, in float32; returns x's dtype.

    Args:
        x: [B, L, dim] projections (all heads; before the head split).
        rope: the table of these L tokens.

    Returns:
        [B, L, dim] in x.dtype.
    """
    if rope.kind == "interleaved":
        pairs = x.unflatten(-1, (-1, 2))  # [B, L, dim/2, 2]
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)  # [B, L, dim]
        return (x.float() * rope.cos + rotated.float() * rope.sin).to(x.dtype)
    G, r = rope.cos.shape[-2:]
    halves = x.float().unflatten(-1, (G, 2, r))  # [B, L, G, 2, r]
    first, second = halves[..., 0, :], halves[..., 1, :]  # each [B, L, G, r]
    out = torch.stack([first * rope.cos - second * rope.sin, second * rope.cos + first * rope.sin], dim=-2)
    return out.flatten(-3).to(x.dtype)  # [B, L, dim]
