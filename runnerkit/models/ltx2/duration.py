"""LTX-2.5 duration head: the clip length a prompt implies, predicted from the text connectors' outputs.

Used when a request gives no frame count (LTX-2.5 checkpoints onward; 2.0 / 2.3 default to 121
frames). After diffusers 0.42.1 `pipelines/ltx2/duration_head.py` (`LTX2DurationHead`,
`LTX2DurationAttentionPooler`) and Lightricks' ltx-core `duration_head/duration_head.py`
(`DurationHead`, trained in JAX):

1. each modality's connector output is projected to `pooler_hidden_dim` and tagged with a learned
   modality vector; video tokens then audio tokens are concatenated along the sequence;
2. `num_queries` learned queries cross-attend to them (multi-head, no mask: the connectors already
   replaced the padding with registers, every token is valid);
3. an MLP (tanh-approximated GELU, as the JAX head) gives a log-duration; `exp` turns it to seconds.

`frames_for_duration` turns the seconds into a frame count as diffusers
`LTX2DurationHead.predict_num_frames` does (bounds, rounding and the 8k + 1 grid: its docstring).

Checkpoint names: diffusers' `duration_head/` folder uses this module's names (separate q/k/v);
the single-file release stores the head under `duration_head.` with the pooler as
`torch.nn.MultiheadAttention` (`attention_pooler.cross_attn.in_proj_weight` fused q/k/v,
`...out_proj.*`): `state_dict_from_single_file` maps it (diffusers'
`scripts/convert_ltx2_to_diffusers.py`, `convert_ltx2_duration_head`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from loguru import logger
from pydantic import Field, ValidationInfo, model_validator
from torch import Tensor, nn

from runnerkit.arch import Arch

MIN_SECONDS = 1.0
"""Default lower bound on a predicted duration (diffusers `LTX2Pipeline.__call__` `min_seconds`)."""
MAX_SECONDS = 20.0
"""Default upper bound on a predicted duration (diffusers `max_seconds`)."""
SINGLE_FILE_PREFIX = "duration_head."
"""Key prefix of the head in the single-file release (ltx-core `DURATION_HEAD_KEY_OPS`)."""


class LTX2DurationHeadArch(Arch):
    """diffusers `LTX2DurationHead` config; defaults are diffusers' and ltx-core's (the LTX-2.5 head;
    diffusers' converter reads the widths back from the weights and fixes the heads at 4)."""

    video_cross_attention_dim: int = Field(4096, gt=0, description="Width of the video connector output.")
    audio_cross_attention_dim: int = Field(2048, gt=0, description="Width of the audio connector output.")
    pooler_hidden_dim: int = Field(256, gt=0, description="Shared width both modalities are projected to.")
    num_queries: int = Field(1, gt=0, description="Learned pooling queries.")
    num_pooler_heads: int = Field(4, gt=0, description="Attention heads of the pooler; divides `pooler_hidden_dim`.")
    mlp_hidden_dim: int = Field(256, gt=0, description="Hidden width of the output MLP.")

    @model_validator(mode="after")
    def _heads_divide(self, info: ValidationInfo) -> LTX2DurationHeadArch:
        if self._check(info, "pooler_hidden_dim", "num_pooler_heads") and self.pooler_hidden_dim % self.num_pooler_heads:
            raise ValueError(f"`pooler_hidden_dim`={self.pooler_hidden_dim} must be a multiple of "
                             f"`num_pooler_heads`={self.num_pooler_heads}")
        return self


LTX25_DURATION_HEAD = LTX2DurationHeadArch()
"""The LTX-2.5 head (connector widths of the 22B transformer: video 4096, audio 2048)."""
TINY_DURATION_HEAD = LTX2DurationHeadArch(video_cross_attention_dim=32, audio_cross_attention_dim=8,
                                          pooler_hidden_dim=16, num_queries=2, num_pooler_heads=4, mlp_hidden_dim=12)
"""Test size, fitting `TINY23_CONNECTORS` (video 32 wide, audio 8 wide)."""


class DurationAttentionPooler(nn.Module):
    """`num_queries` learned tokens cross-attending to a token sequence (no mask)."""

    def __init__(self, hidden_dim: int, num_queries: int, num_heads: int) -> None:
        super().__init__()
        self.heads = num_heads
        self.query_tokens = nn.Parameter(torch.zeros(num_queries, hidden_dim))
        self.to_q = nn.Linear(hidden_dim, hidden_dim)
        self.to_k = nn.Linear(hidden_dim, hidden_dim)
        self.to_v = nn.Linear(hidden_dim, hidden_dim)
        self.to_out = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, S, D] -> pooled [B, num_queries, D]."""
        B = tokens.shape[0]
        Q, D = self.query_tokens.shape
        queries = self.query_tokens.unsqueeze(0).expand(B, Q, D)
        q = self.to_q(queries).unflatten(2, (self.heads, -1)).transpose(1, 2)  # [B, H, Q, D/H]
        k = self.to_k(tokens).unflatten(2, (self.heads, -1)).transpose(1, 2)  # [B, H, S, D/H]
        v = self.to_v(tokens).unflatten(2, (self.heads, -1)).transpose(1, 2)  # [B, H, S, D/H]
        pooled = F.scaled_dot_product_attention(q, k, v)  # [B, H, Q, D/H]
        return self.to_out(pooled.transpose(1, 2).flatten(2))  # [B, Q, D]


class LTX2DurationHead(nn.Module):
    """Predicted duration of the shot a prompt implies, in seconds (module docstring)."""

    def __init__(self, arch: LTX2DurationHeadArch = LTX25_DURATION_HEAD) -> None:
        super().__init__()
        self.arch = arch
        width = arch.pooler_hidden_dim
        self.video_input_proj = nn.Linear(arch.video_cross_attention_dim, width)
        self.video_modality_emb = nn.Parameter(torch.zeros(width))
        self.audio_input_proj = nn.Linear(arch.audio_cross_attention_dim, width)
        self.audio_modality_emb = nn.Parameter(torch.zeros(width))
        self.attention_pooler = DurationAttentionPooler(width, arch.num_queries, arch.num_pooler_heads)
        self.mlp_hidden = nn.Linear(width * arch.num_queries, arch.mlp_hidden_dim)
        self.mlp_out = nn.Linear(arch.mlp_hidden_dim, 1)

    def forward(self, video_tokens: Tensor | None = None, audio_tokens: Tensor | None = None) -> Tensor:
        """Duration in seconds.

        Args:
            video_tokens: the video connector's output [B, Sv, video_cross_attention_dim] (any dtype:
                cast to the head's, as diffusers), or None.
            audio_tokens: the audio connector's output [B, Sa, audio_cross_attention_dim], or None.

        Returns:
            seconds: [B], positive (the exponential of the predicted log-duration).

        Raises:
            ValueError: both are None, or their batch sizes differ.
        """
        if video_tokens is None and audio_tokens is None:
            raise ValueError("`LTX2DurationHead` needs `video_tokens`, `audio_tokens` or both; got neither")
        if video_tokens is not None and audio_tokens is not None and video_tokens.shape[0] != audio_tokens.shape[0]:
            raise ValueError(f"`video_tokens` batch {video_tokens.shape[0]} != `audio_tokens` batch "
                             f"{audio_tokens.shape[0]}")
        dtype = self.mlp_out.weight.dtype
        groups = []
        if video_tokens is not None:
            groups.append(self.video_input_proj(video_tokens.to(dtype)) + self.video_modality_emb)  # [B, Sv, P]
        if audio_tokens is not None:
            groups.append(self.audio_input_proj(audio_tokens.to(dtype)) + self.audio_modality_emb)  # [B, Sa, P]
        pooled = self.attention_pooler(torch.cat(groups, dim=1)).flatten(1)  # [B, num_queries * P]
        hidden = F.gelu(self.mlp_hidden(pooled), approximate="tanh")
        return self.mlp_out(hidden).squeeze(-1).exp()  # [B]


def frames_for_duration(seconds: float, frame_rate: float, temporal_compression_ratio: int = 8,
                        min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS) -> int:
    """Frame count for a predicted duration: diffusers 0.42.1 `LTX2DurationHead.predict_num_frames`.

    1. Bounds in frames: `min_frames = max(1, round(min_seconds * frame_rate))`,
       `max_frames = round(max_seconds * frame_rate)`; the prediction `round(seconds * frame_rate)`
       is clamped to [min_frames, max_frames]. `round` is Python's (halves to even: 12.5 -> 12).
    2. Snapped DOWN to the VAE's causal grid k * r + 1 (r = `temporal_compression_ratio`).
    3. Below `min_frames` after the snap: one grid step up, if that stays <= max_frames; else
       (no grid point in the window) the grid point nearer the clamped count, a warning logged.

    At 24 fps, r = 8 and the default bounds [1 s, 20 s]: 25 .. 473 frames (24 -> 25; 480 -> 473).

    Args:
        seconds: the head's prediction (s).
        frame_rate: frames per second of the output video (the playback rate).
        temporal_compression_ratio: frames per latent frame after the first (8).
        min_seconds, max_seconds: bounds (s), `min_seconds` < `max_seconds`.

    Returns:
        a frame count k * r + 1 >= 1.

    Raises:
        ValueError: a non-positive or non-finite `frame_rate`, `temporal_compression_ratio` < 1,
            `min_seconds` >= `max_seconds`, or a non-finite `seconds`.
    """
    if not (math.isfinite(frame_rate) and frame_rate > 0):
        raise ValueError(f"`frame_rate` must be a positive finite number, got {frame_rate}")
    if temporal_compression_ratio < 1:
        raise ValueError(f"`temporal_compression_ratio` must be >= 1, got {temporal_compression_ratio}")
    if not min_seconds < max_seconds:
        raise ValueError(f"`min_seconds` ({min_seconds}) must be less than `max_seconds` ({max_seconds})")
    if not math.isfinite(seconds):
        raise ValueError(f"`seconds` must be finite, got {seconds}")
    r = temporal_compression_ratio
    min_frames = max(1, round(min_seconds * frame_rate))
    max_frames = round(max_seconds * frame_rate)
    clamped = max(min_frames, min(round(seconds * frame_rate), max_frames))
    frames = (clamped - 1) // r * r + 1
    if frames < min_frames:
        if frames + r <= max_frames or abs(frames + r - clamped) < abs(frames - clamped):
            frames += r
        if frames > max_frames or frames < min_frames:
            logger.warning(f"duration: bounds [{min_seconds:.2f} s, {max_seconds:.2f} s] at {frame_rate:.2f} fps hold "
                           f"no count {r}k + 1; using the nearest, {frames} frames")
    return frames


def predict_frames(head: LTX2DurationHead, video_tokens: Tensor | None, audio_tokens: Tensor | None,
                   frame_rate: float, temporal_compression_ratio: int = 8, min_seconds: float = MIN_SECONDS,
                   max_seconds: float = MAX_SECONDS) -> int:
    """Frame count the head predicts for ONE prompt (diffusers `predict_num_frames`).

    Args:
        video_tokens, audio_tokens: the positive prompt's connector outputs [1, S, D] (under CFG,
            the second half of the [negative, positive] batch, as diffusers takes it).
        Others: `frames_for_duration`.

    Returns:
        a frame count k * r + 1 (`frames_for_duration`).

    Raises:
        ValueError: a batch other than 1 (one frame count cannot serve several prompts), or as
            `LTX2DurationHead.forward` / `frames_for_duration`.
    """
    with torch.inference_mode():
        seconds = head(video_tokens, audio_tokens)
    if seconds.numel() != 1:
        raise ValueError(f"the duration head predicts for one prompt at a time; got a batch of {seconds.numel()}")
    frames = frames_for_duration(seconds.item(), frame_rate, temporal_compression_ratio, min_seconds, max_seconds)
    logger.info(f"duration: predicted {seconds.item():.2f} s -> {frames} frames at {frame_rate:.2f} fps")
    return frames


def state_dict_from_single_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """This module's state dict from the single-file release's `duration_head.*` tensors (other keys
    ignored): the prefix dropped and `nn.MultiheadAttention`'s fused `in_proj_{weight,bias}` split
    into `to_q`, `to_k`, `to_v` (thirds along dim 0, in that order), `out_proj` -> `to_out`.

    Raises:
        KeyError: naming the missing pooler tensor.
    """
    own = {k[len(SINGLE_FILE_PREFIX):]: v for k, v in tensors.items() if k.startswith(SINGLE_FILE_PREFIX)}
    fused = "attention_pooler.cross_attn."
    for kind in ("weight", "bias"):
        name = f"{fused}in_proj_{kind}"
        if name not in own:
            raise KeyError(f"duration head: `{SINGLE_FILE_PREFIX}{name}` is missing")
        for proj, part in zip(("to_q", "to_k", "to_v"), own.pop(name).chunk(3, dim=0)):
            own[f"attention_pooler.{proj}.{kind}"] = part
        own[f"attention_pooler.to_out.{kind}"] = own.pop(f"{fused}out_proj.{kind}")
    return own


__all__ = ["LTX25_DURATION_HEAD", "MAX_SECONDS", "MIN_SECONDS", "TINY_DURATION_HEAD", "LTX2DurationHead",
           "LTX2DurationHeadArch", "frames_for_duration", "predict_frames", "state_dict_from_single_file"]
