"""LTX-2 text connectors: Gemma-3 hidden states of every layer -> video and audio text embeddings.

Design and numerics follow diffusers 0.42.1 (`pipelines/ltx2/connectors.py`, `LTX2TextConnectors`,
and `LTX2Pipeline._get_gemma_prompt_embeds`), a port of Lightricks' LTX-2 "embeddings connector":

1. The pipeline stacks the hidden states of all Gemma layers (embedding output included) and
   flattens them per token: [B, T, D * (layers + 1)] (`stack_text_hidden_states`).
2. Feature extraction. LTX-2: every layer is normalised over the prompt's valid tokens and
   channels (minus its masked mean, over its masked range, x 8), then one linear projection to D.
   LTX-2.3: an RMS norm per token and layer, zeroed padding, then one projection per modality,
   each input scaled by sqrt(width / D).
3. Per modality, a 1D transformer: padding tokens are replaced by learnable registers (the valid
   tokens are moved to the front, the tail takes the registers of those positions), then
   pre-norm blocks of self-attention (RMS-normed Q/K across heads, 1D RoPE on positions
   index / 4096, optional per-head output gates) and a tanh-GELU MLP, and a final RMS norm.

The returned mask is all ones: after the registers took the padding every token is valid
(diffusers derives it from an all-zero additive mask; with no registers its test `< 1e-6` also
passes for the -max entries, so it is all ones there too).

Lightricks' reference (`ltx_core/text_encoders/gemma/feature_extractor.py`, `embeddings_connector.py`,
`embeddings_processor.py`) agrees: it too moves the valid tokens to the front (stable sort of the
mask) before the registers replace the tail. Its 2.0 norm reads the mask itself rather than its
length and padding side (the same for contiguous padding) and multiplies by 8 before dividing
(float rounding only); diffusers is followed here.

Keys are diffusers' (`text_proj_in` or `video_text_proj_in` / `audio_text_proj_in`,
`{video,audio}_connector.learnable_registers`, `...transformer_blocks.i.attn1.to_q`, `...ff.net.0.proj`).
In the single-file release the same weights sit under `model.diffusion_model.` as
`video_embeddings_connector.*` / `audio_embeddings_connector.*` (`transformer_1d_blocks`, `q_norm`,
`k_norm`) and `text_embedding_projection.aggregate_embed` (2.0) or `.video_aggregate_embed` /
`.audio_aggregate_embed` (2.3); renaming them is the checkpoint loader's job.

Not covered: LTX-2.5's Gemma-4 text encoder (different stacking and connector widths), its
duration head, diffusion decoder and DFR layouts.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.attention import AttentionUser
from runnerkit.models.ltx2.layers import FeedForward
from runnerkit.models.ltx2.connectors_arch import LTX2ConnectorsArch
from runnerkit.offload.layout import StreamSpec

EPS = 1e-6
MEAN_RANGE_SCALE = 8.0
"""Scale of the LTX-2 mean/range-normalised features (diffusers `scale_factor=8`)."""


# ---- text encoder features ------------------------------------------------------------------

def stack_text_hidden_states(hidden_states: tuple[Tensor, ...], dtype: torch.dtype | None = None) -> Tensor:
    """Pack a text encoder's per-layer hidden states into one feature vector per token.

    Args:
        hidden_states: the `hidden_states` tuple of transformers' Gemma-3 with
            `output_hidden_states=True`: layers + 1 tensors [B, T, D] (embedding output first).
        dtype: cast of the result (None: keep).

    Returns:
        [B, T, D * (layers + 1)], feature d * (layers + 1) + l = channel d of hidden state l.
    """
    packed = torch.stack(hidden_states, dim=-1)  # [B, T, D, layers + 1]
    return packed.flatten(2, 3).to(dtype=dtype)  # [B, T, D * (layers + 1)]


def valid_token_mask(attention_mask: Tensor, padding_side: str) -> Tensor:
    """Bool [B, T]: the first (right padding) or last (left padding) `attention_mask.sum(-1)` tokens.

    As diffusers' 2.0 path, only the count of valid tokens and the padding side are read.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be 'left' or 'right' (got {padding_side!r})")
    T = attention_mask.shape[1]
    lengths = attention_mask.sum(dim=-1)[:, None]  # [B, 1]
    index = torch.arange(T, device=attention_mask.device)[None]  # [1, T]
    return index < lengths if padding_side == "right" else index >= T - lengths


def mean_range_norm(hidden: Tensor, attention_mask: Tensor, padding_side: str = "left",
                    scale: float = MEAN_RANGE_SCALE, eps: float = EPS) -> Tensor:
    """LTX-2 features: per prompt and layer, (x - masked mean) / (masked max - masked min) * scale.

    Args:
        hidden: [B, T, D, L] stacked hidden states.
        attention_mask: [B, T] 1 for prompt tokens, 0 for padding.

    Returns:
        [B, T, D * L] in `hidden`'s dtype, zero at padding tokens.
    """
    B, _, D, _ = hidden.shape
    valid = valid_token_mask(attention_mask, padding_side)[:, :, None, None]  # [B, T, 1, 1]
    count = (attention_mask.sum(dim=-1) * D).view(B, 1, 1, 1)
    mean = hidden.masked_fill(~valid, 0.0).sum(dim=(1, 2), keepdim=True) / (count + eps)  # [B, 1, 1, L]
    low = hidden.masked_fill(~valid, float("inf")).amin(dim=(1, 2), keepdim=True)
    high = hidden.masked_fill(~valid, float("-inf")).amax(dim=(1, 2), keepdim=True)
    out = (hidden - mean) / (high - low + eps) * scale
    out = out.flatten(2).masked_fill(~valid[..., 0], 0.0)  # [B, T, D*L]
    return out.to(hidden.dtype)


def per_layer_rms_norm(hidden: Tensor, attention_mask: Tensor, eps: float = EPS) -> Tensor:
    """LTX-2.3 features: RMS norm over the channels of each token and layer, padding zeroed.

    Args:
        hidden: [B, T, D, L]; attention_mask: [B, T].

    Returns:
        [B, T, D * L].
    """
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(dim=2, keepdim=True) + eps)
    normed = normed.flatten(2, 3)  # [B, T, D*L]
    return torch.where(attention_mask.bool()[..., None], normed, torch.zeros_like(normed))


# ---- RoPE -----------------------------------------------------------------------------------

def rope_1d(arch: LTX2ConnectorsArch, num_heads: int, width: int, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin of the connectors' 1D RoPE for tokens 0..T-1.

    Position p = index / `connector_rope_base_seq_len` is mapped to 2p - 1, times a frequency
    ladder theta^(j / (width/2 - 1)) * pi / 2 over the whole width (j = 0 .. width/2 - 1).

    Returns:
        interleaved: [T, width] each (every angle twice, for the (2i, 2i+1) pairs);
        split: [num_heads, T, head_dim / 2] each (head h takes angles h*d/2 .. (h+1)*d/2 - 1).
    """
    positions = torch.arange(T, dtype=torch.float32, device=device) / arch.connector_rope_base_seq_len  # [T]
    ladder_dtype = torch.float64 if arch.rope_double_precision else torch.float32
    ladder = arch.rope_theta ** torch.linspace(0.0, 1.0, width // 2, dtype=ladder_dtype, device=device)
    freqs = (ladder * torch.pi / 2.0).to(torch.float32)  # [width/2]
    angles = (positions[:, None] * 2 - 1) * freqs  # [T, width/2]
    if arch.rope_type == "interleaved":
        return angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)
    per_head = angles.unflatten(1, (num_heads, -1)).transpose(0, 1)  # [H, T, d/2]
    return per_head.cos(), per_head.sin()


def apply_rope_1d(x: Tensor, cos: Tensor, sin: Tensor, rope_type: str, num_heads: int) -> Tensor:
    """Rotate x [B, T, width] (heads flattened) by `rope_1d`'s tables; computed in float32, returned in x's dtype."""
    if rope_type == "interleaved":
        real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)  # [B, T, width/2] each
        rotated = torch.stack([-imag, real], dim=-1).flatten(2)  # (x0, x1) -> (-x1, x0)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)
    B, T, _ = x.shape
    heads = x.unflatten(-1, (num_heads, 2, -1)).transpose(1, 2).float()  # [B, H, T, 2, d/2]: the two halves
    first, second = heads[..., 0, :], heads[..., 1, :]
    out = torch.stack([first * cos - second * sin, second * cos + first * sin], dim=-2)  # [B, H, T, 2, d/2]
    return out.transpose(1, 2).reshape(B, T, -1).to(x.dtype)  # [B, T, width]


# ---- blocks ---------------------------------------------------------------------------------

class ConnectorAttention(AttentionUser):
    """Self-attention of a connector block (diffusers `LTX2Attention`, `LTX2AudioVideoAttnProcessor`)."""

    def __init__(self, width: int, num_heads: int, gated: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm_q = nn.RMSNorm(width, eps=EPS)  # across heads
        self.norm_k = nn.RMSNorm(width, eps=EPS)
        self.to_q = nn.Linear(width, width)
        self.to_k = nn.Linear(width, width)
        self.to_v = nn.Linear(width, width)
        self.to_out = nn.ModuleList([nn.Linear(width, width)])  # diffusers' to_out.1 is a Dropout
        self.to_gate_logits = nn.Linear(width, num_heads) if gated else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], rope_type: str, mask: Tensor | None) -> Tensor:
        """x [B, T, width]; mask None or additive [B, 1, 1, T]. Returns [B, T, width]."""
        heads = (self.num_heads, -1)
        q = apply_rope_1d(self.norm_q(self.to_q(x)), *rope, rope_type, self.num_heads)
        k = apply_rope_1d(self.norm_k(self.to_k(x)), *rope, rope_type, self.num_heads)
        q, k, v = (t.unflatten(-1, heads).transpose(1, 2) for t in (q, k, self.to_v(x)))  # [B, N, T, d]
        if mask is None:
            out = self.attention_fn(q, k, v)  # [B, N, T, d] (attention.py backend)
        else:  # no registers: padding masked out (a mask the backends do not take)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2)  # [B, T, N, d]
        if self.to_gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(self.to_gate_logits(x)))[..., None]  # gates in (0, 2), 1 at logit 0
        return self.to_out[0](out.flatten(2))


class ConnectorBlock(nn.Module):
    """x + attn(rms(x)), then x + ff(rms(x)); the RMS norms have no weights."""

    def __init__(self, width: int, num_heads: int, gated: bool) -> None:
        super().__init__()
        self.attn1 = ConnectorAttention(width, num_heads, gated)
        self.ff = FeedForward(width)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], rope_type: str, mask: Tensor | None) -> Tensor:
        width = (x.shape[-1],)
        x = x + self.attn1(F.rms_norm(x, width, eps=EPS), rope, rope_type, mask)
        return x + self.ff(F.rms_norm(x, width, eps=EPS))


class ConnectorTransformer1d(nn.Module):
    """One modality's connector (diffusers `LTX2ConnectorTransformer1d`)."""

    def __init__(self, arch: LTX2ConnectorsArch, modality: str) -> None:
        super().__init__()
        self.arch = arch
        self.num_heads: int = getattr(arch, f"{modality}_connector_num_attention_heads")
        self.width = arch.width(modality)
        registers = getattr(arch, f"{modality}_connector_num_learnable_registers")
        self.learnable_registers = nn.Parameter(torch.zeros(registers, self.width)) if registers else None
        gated = getattr(arch, f"{modality}_gated_attn")
        self.transformer_blocks = nn.ModuleList(
            ConnectorBlock(self.width, self.num_heads, gated)
            for _ in range(getattr(arch, f"{modality}_connector_num_layers")))

    def fill_padding(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        """Valid tokens to the front (in order), registers after them.

        Args:
            x: [B, T, width]; attention_mask: [B, T], nonzero for prompt tokens.

        Returns:
            [B, T, width]: row b holds its n_b prompt tokens, then registers[n_b % R], registers[(n_b + 1) % R], ...

        Raises:
            ValueError: T is not a multiple of the register count.
        """
        assert self.learnable_registers is not None, "fill_padding needs registers"
        _, T, D = x.shape
        R = self.learnable_registers.shape[0]
        if T % R:
            raise ValueError(f"the prompt length {T} must be a multiple of the {R} learnable registers "
                             "(pad prompts to a multiple, e.g. the release's 1024 tokens)")
        registers = self.learnable_registers.repeat(T // R, 1).to(x.dtype)  # [T, D]: register of each position
        valid = attention_mask.bool()
        order = torch.argsort((~valid).to(torch.int64), dim=1, stable=True)  # [B, T]: valid first, in order
        front = torch.gather(x, 1, order[..., None].expand(-1, -1, D))
        n_valid = valid.sum(dim=1, keepdim=True)  # [B, 1]
        keep = torch.arange(T, device=x.device)[None] < n_valid  # [B, T]
        return torch.where(keep[..., None], front, registers[None])

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        """x [B, T, width] projected text features; attention_mask [B, T] (1 prompt, 0 padding).
        Returns [B, T, width]."""
        B, T, _ = x.shape
        if self.learnable_registers is not None:
            x = self.fill_padding(x, attention_mask)
            mask = None
        else:  # additive mask, as diffusers builds it: 0 for tokens, -max for padding
            finfo = torch.finfo(x.dtype)
            mask = ((attention_mask.to(torch.int64) - 1).to(x.dtype) * finfo.max).view(B, 1, 1, T)
        rope = rope_1d(self.arch, self.num_heads, self.width, T, x.device)
        for block in self.transformer_blocks:
            x = block(x, rope, self.arch.rope_type, mask)
        return F.rms_norm(x, (self.width,), eps=EPS)


class LTX2TextConnectors(nn.Module):
    """Stacked Gemma-3 hidden states -> (video, audio) text embeddings (diffusers `LTX2TextConnectors`)."""

    STREAM_SPEC: ClassVar[StreamSpec] = StreamSpec(
        blocks_attr="video_connector.transformer_blocks", more_blocks=("audio_connector.transformer_blocks",),
        phases=("attn1", "ff"), keep_fp32=lambda name: False, per_step=False)
    """Block/phase streaming (`offload.stream_modules` lists "connectors"): the 1D blocks of the video
    connector, then the audio connector's (the order `forward` runs them); the input projections,
    registers and everything else stay resident (LTX-2.3: 1.16 B of the 3.17 B parameters)."""

    def __init__(self, arch: LTX2ConnectorsArch) -> None:
        super().__init__()
        self.arch = arch
        features = arch.caption_channels * arch.text_proj_in_factor
        if arch.per_modality_projections:
            self.video_text_proj_in = nn.Linear(features, arch.video_hidden_dim, bias=arch.proj_bias)
            self.audio_text_proj_in = nn.Linear(features, arch.audio_hidden_dim, bias=arch.proj_bias)
        else:
            self.text_proj_in = nn.Linear(features, arch.caption_channels, bias=arch.proj_bias)
        self.video_connector = ConnectorTransformer1d(arch, "video")
        self.audio_connector = ConnectorTransformer1d(arch, "audio")

    def forward(self, hidden: Tensor, attention_mask: Tensor,
                padding_side: str = "left") -> tuple[Tensor, Tensor, Tensor]:
        """Text embeddings of a batch of padded prompts.

        Args:
            hidden: [B, T, D * L] from `stack_text_hidden_states` (or [B, T, D, L]), D = `caption_channels`,
                L = `text_proj_in_factor`.
            attention_mask: [B, T] tokenizer mask (1 prompt, 0 padding).
            padding_side: the tokenizer's padding side ('left' for Gemma); read by the 2.0 features only.

        Returns:
            video [B, T, video width], audio [B, T, audio width], mask [B, T] int64 (all ones: see the module docstring).
        """
        if hidden.dim() == 3:
            hidden = hidden.unflatten(2, (self.arch.caption_channels, -1))  # [B, T, D, L]
        if self.arch.per_modality_projections:
            features = per_layer_rms_norm(hidden, attention_mask)
            D = self.arch.caption_channels
            video = self.video_text_proj_in(features * math.sqrt(self.arch.video_hidden_dim / D))
            audio = self.audio_text_proj_in(features * math.sqrt(self.arch.audio_hidden_dim / D))
        else:
            video = audio = self.text_proj_in(mean_range_norm(hidden, attention_mask, padding_side))
        video = self.video_connector(video, attention_mask)
        audio = self.audio_connector(audio, attention_mask)
        return video, audio, torch.ones_like(attention_mask, dtype=torch.int64)
