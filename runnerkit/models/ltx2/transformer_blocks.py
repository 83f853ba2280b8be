"""Building blocks of the LTX-2 audio+video transformer: attention, FFN, AdaLN embeddings, the block.

Each block runs, for the video stream (width 4096) and the audio stream (2048) side by side:
self-attention with RoPE -> text cross-attention -> audio<->video cross-attention (a2v: video
queries audio, v2a: audio queries video, both at the audio width with time-only RoPE) -> FFN. Every
sublayer input is an RMSNorm (no affine) modulated by AdaLN rows: the block's learned table plus the
per-token (or per-sample) projection of the timestep embedding, as in PixArt-alpha's adaLN-single.

LTX-2.3 adds per-head output gates (`to_gate_logits`) and AdaLN on the text cross-attention: three
more rows (query shift/scale/gate) and a sigma-driven shift/scale of the text keys/values. LTX-2.5
drops the video FFN's biases (`ff_bias` false).

Numerics follow diffusers: everything in the activation dtype (the weights'), RMSNorm statistics
and RoPE in float32. Text masks are additive (-10000 on padded keys), as diffusers applies them.

Source: diffusers 0.42.1 `LTX2VideoTransformerBlock`, `LTX2Attention`,
`LTX2AudioVideoAttnProcessor`, `LTX2AdaLayerNormSingle` (models/transformers/transformer_ltx2.py).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.attention import AttentionUser
from runnerkit.models.ltx2.layers import FeedForward, TimestepMLP, timestep_features
from runnerkit.models.ltx2.rope import RopeTable, apply_rope
from runnerkit.models.ltx2.transformer_arch import LTX2TransformerArch

def rms_norm(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without weight, statistics in float32; returns x's dtype (diffusers `RMSNorm`, no affine)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype)


class TimestepEmbedding(nn.Module):
    """Holder of `timestep_embedder` (diffusers `PixArtAlphaCombinedTimestepSizeEmbeddings` key layout)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepMLP(dim)


class AdaLNSingle(nn.Module):
    """adaLN-single (PixArt-alpha): timestep -> embedding -> SiLU -> Linear to `rows` x dim modulation values."""

    def __init__(self, dim: int, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.emb = TimestepEmbedding(dim)
        self.linear = nn.Linear(dim, rows * dim)

    def forward(self, timestep: Tensor, batch: int) -> tuple[Tensor, Tensor]:
        """Args: timestep [B] or [B, T] (already scaled, e.g. sigma x 1000); batch B.

        Returns: (modulation [B, T, rows * dim], embedding [B, T, dim]) in the weights' dtype (T = 1 for [B]).
        """
        dtype = self.linear.weight.dtype
        embedded = self.emb.timestep_embedder(timestep_features(timestep.flatten()).to(dtype))  # [B*T, dim]
        modulation = self.linear(F.silu(embedded))  # [B*T, rows*dim]
        return modulation.view(batch, -1, modulation.shape[-1]), embedded.view(batch, -1, embedded.shape[-1])


def modulation_rows(table: Tensor, temb: Tensor) -> list[Tensor]:
    """The AdaLN rows of a block: table [n, dim] + temb [B, T, n * dim] -> n tensors [B, T, dim]."""
    B, T, _ = temb.shape
    values = table.to(temb.dtype) + temb.view(B, T, table.shape[0], table.shape[1])  # [B, T, n, dim]
    return list(values.unbind(dim=2))


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """x * (1 + scale) + shift; x [B, L, dim], shift/scale [B, L or 1, dim]."""
    return x * (1 + scale) + shift


class LTX2Attention(AttentionUser):
    """Multi-head attention with q/k RMSNorm across heads, optional RoPE on q and k (separate tables
    for audio<->video attention) and optional per-head output gates (LTX-2.3).

    Unmasked calls run on the runner's backend (`attention_fn`); masked calls (padded text) run
    SDPA with the additive mask, since the backends take no mask.
    """

    def __init__(self, query_dim: int, heads: int, head_dim: int, eps: float, kv_dim: int | None = None,
                 gated: bool = False) -> None:
        super().__init__()
        inner = heads * head_dim
        kv_dim = kv_dim or query_dim
        self.heads = heads
        self.norm_q = nn.RMSNorm(inner, eps=eps)
        self.norm_k = nn.RMSNorm(inner, eps=eps)
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(kv_dim, inner)
        self.to_v = nn.Linear(kv_dim, inner)
        # diffusers' key `to_out.0` (its `to_out.1` is a Dropout, without weights)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim)])
        self.to_gate_logits = nn.Linear(query_dim, heads) if gated else None

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None,
                q_rope: RopeTable | None = None, k_rope: RopeTable | None = None) -> Tensor:
        """Args:
            x: [B, Lq, query_dim] queries' input.
            context: [B, Lk, kv_dim] keys'/values' input; None for self-attention.
            mask: [B, 1, 1, Lk] additive (0 / -10000), or None.
            q_rope, k_rope: RoPE of the queries and keys (k_rope None: q_rope); None: no RoPE.

        Returns: [B, Lq, query_dim].
        """
        kv = x if context is None else context
        q = self.norm_q(self.to_q(x))  # [B, Lq, inner]
        k = self.norm_k(self.to_k(kv))  # [B, Lk, inner]
        v = self.to_v(kv)
        if q_rope is not None:
            q, k = apply_rope(q, q_rope), apply_rope(k, k_rope or q_rope)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # [B, N, L, d]
        if mask is None:
            out = self.attention_fn(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        out = out.transpose(1, 2).to(q.dtype)  # [B, Lq, N, d]
        if self.to_gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(self.to_gate_logits(x))).unsqueeze(-1)  # gates [B, Lq, N, 1]
        return self.to_out[0](out.flatten(2))  # [B, Lq, query_dim]


class LTX2Block(nn.Module):
    """One audio+video block (diffusers `LTX2VideoTransformerBlock`; same submodule and table names).

    Phases in call order (phase offload): attn1, audio_attn1, attn2, audio_attn2,
    audio_to_video_attn, video_to_audio_attn, ff, audio_ff. The scale-shift tables stay with the block.
    """

    def __init__(self, arch: LTX2TransformerArch) -> None:
        super().__init__()
        dim, adim, eps = arch.inner_dim, arch.audio_inner_dim, arch.norm_eps
        heads, head_dim = arch.num_attention_heads, arch.attention_head_dim
        aheads, ahead_dim = arch.audio_num_attention_heads, arch.audio_attention_head_dim
        self.eps = eps
        self.video_q_mod, self.audio_q_mod = arch.cross_attn_mod, arch.audio_cross_attn_mod
        self.attn1 = LTX2Attention(dim, heads, head_dim, eps, gated=arch.gated_attn)
        self.audio_attn1 = LTX2Attention(adim, aheads, ahead_dim, eps, gated=arch.audio_gated_attn)
        self.attn2 = LTX2Attention(dim, heads, head_dim, eps, kv_dim=arch.cross_attention_dim, gated=arch.gated_attn)
        self.audio_attn2 = LTX2Attention(adim, aheads, ahead_dim, eps, kv_dim=arch.audio_cross_attention_dim,
                                         gated=arch.audio_gated_attn)
        # audio<->video attention at the audio width: a2v queries from video, v2a queries from audio
        self.audio_to_video_attn = LTX2Attention(dim, aheads, ahead_dim, eps, kv_dim=adim, gated=arch.gated_attn)
        self.video_to_audio_attn = LTX2Attention(adim, aheads, ahead_dim, eps, kv_dim=dim, gated=arch.audio_gated_attn)
        self.ff = FeedForward(dim, bias=arch.ff_bias)  # LTX-2.5: no biases
        self.audio_ff = FeedForward(adim)
        # Rows: shift, scale, gate (self-attention); shift, scale, gate (FFN);
        # LTX-2.3 adds shift, scale, gate (text cross-attention query)
        self.scale_shift_table = nn.Parameter(torch.randn(9 if arch.cross_attn_mod else 6, dim) / dim**0.5)
        self.audio_scale_shift_table = nn.Parameter(
            torch.randn(9 if arch.audio_cross_attn_mod else 6, adim) / adim**0.5)
        if arch.prompt_modulation:  # rows: shift, scale of the text keys/values
            self.prompt_scale_shift_table = nn.Parameter(torch.randn(2, dim))
            self.audio_prompt_scale_shift_table = nn.Parameter(torch.randn(2, adim))
        # Rows: a2v scale, a2v shift, v2a scale, v2a shift, gate (a2v for video, v2a for audio)
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, dim))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.randn(5, adim))

    def forward(self, video: Tensor, audio: Tensor, context: Tensor, audio_context: Tensor,
                temb: Tensor, audio_temb: Tensor, av_temb: Tensor, audio_av_temb: Tensor,
                av_gate_temb: Tensor, audio_av_gate_temb: Tensor,
                prompt_temb: Tensor | None, audio_prompt_temb: Tensor | None,
                rope: RopeTable, audio_rope: RopeTable, av_rope: RopeTable, audio_av_rope: RopeTable,
                mask: Tensor | None, audio_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Args:
            video [B, Lv, D], audio [B, La, Da]: the two residual streams.
            context [B, Lt, D], audio_context [B, Lt, Da]: text contexts (projected).
            temb [B, Tv, rows*D], audio_temb [B, Ta, rows*Da]: AdaLN inputs (Tv = 1 or Lv per-token).
            av_temb [B, T, 4D], audio_av_temb [B, T, 4Da]; av_gate_temb [B, T, D], audio_av_gate_temb
                [B, T, Da]: audio<->video AdaLN inputs.
            prompt_temb [B, 1, 2D], audio_prompt_temb [B, 1, 2Da]: text key/value modulation (LTX-2.3), else None.
            rope, audio_rope: self-attention RoPE; av_rope, audio_av_rope: time-only RoPE of the
                audio<->video attention (video side, audio side).
            mask, audio_mask: [B, 1, 1, Lt] additive text masks, or None.

        Returns: (video [B, Lv, D], audio [B, La, Da]).
        """
        eps = self.eps
        v_rows = modulation_rows(self.scale_shift_table, temb)
        a_rows = modulation_rows(self.audio_scale_shift_table, audio_temb)

        # 1. self-attention
        y = self.attn1(modulate(rms_norm(video, eps), v_rows[0], v_rows[1]), q_rope=rope)
        video = video + y * v_rows[2]
        y = self.audio_attn1(modulate(rms_norm(audio, eps), a_rows[0], a_rows[1]), q_rope=audio_rope)
        audio = audio + y * a_rows[2]

        # 2. text cross-attention (LTX-2.3: keys/values shifted and scaled by sigma, queries modulated and gated)
        if prompt_temb is not None and audio_prompt_temb is not None:
            kv_shift, kv_scale = modulation_rows(self.prompt_scale_shift_table, prompt_temb)
            context = modulate(context, kv_shift, kv_scale)
            kv_shift, kv_scale = modulation_rows(self.audio_prompt_scale_shift_table, audio_prompt_temb)
            audio_context = modulate(audio_context, kv_shift, kv_scale)
        x = rms_norm(video, eps)
        y = self.attn2(modulate(x, v_rows[6], v_rows[7]) if self.video_q_mod else x, context, mask)
        video = video + (y * v_rows[8] if self.video_q_mod else y)
        x = rms_norm(audio, eps)
        y = self.audio_attn2(modulate(x, a_rows[6], a_rows[7]) if self.audio_q_mod else x, audio_context, audio_mask)
        audio = audio + (y * a_rows[8] if self.audio_q_mod else y)

        # 3. audio<->video cross-attention, both from the streams as they are after step 2
        v_scale_a2v, v_shift_a2v, v_scale_v2a, v_shift_v2a = modulation_rows(
            self.video_a2v_cross_attn_scale_shift_table[:4], av_temb)
        a_scale_a2v, a_shift_a2v, a_scale_v2a, a_shift_v2a = modulation_rows(
            self.audio_a2v_cross_attn_scale_shift_table[:4], audio_av_temb)
        a2v_gate = modulation_rows(self.video_a2v_cross_attn_scale_shift_table[4:], av_gate_temb)[0]
        v2a_gate = modulation_rows(self.audio_a2v_cross_attn_scale_shift_table[4:], audio_av_gate_temb)[0]
        video_n, audio_n = rms_norm(video, eps), rms_norm(audio, eps)
        y = self.audio_to_video_attn(modulate(video_n, v_shift_a2v, v_scale_a2v),
                                     modulate(audio_n, a_shift_a2v, a_scale_a2v), q_rope=av_rope, k_rope=audio_av_rope)
        video = video + a2v_gate * y
        y = self.video_to_audio_attn(modulate(audio_n, a_shift_v2a, a_scale_v2a),
                                     modulate(video_n, v_shift_v2a, v_scale_v2a), q_rope=audio_av_rope, k_rope=av_rope)
        audio = audio + v2a_gate * y

        # 4. FFN
        video = video + self.ff(modulate(rms_norm(video, eps), v_rows[3], v_rows[4])) * v_rows[5]
        audio = audio + self.audio_ff(modulate(rms_norm(audio, eps), a_rows[3], a_rows[4])) * a_rows[5]
        return video, audio
