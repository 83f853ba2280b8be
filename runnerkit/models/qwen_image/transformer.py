"""Qwen-Image dual-stream MMDiT (20B), in diffusers' key names.

Design and numerics follow diffusers `QwenImageTransformer2DModel`
(`diffusers/models/transformers/transformer_qwenimage.py`) and the Qwen-Image technical report
(arXiv 2508.02324, "MMDiT" and "MSRoPE"): packed 2x2 latent patches and the text encoder's
hidden states are projected to one width, then every block modulates each stream with its own
AdaLN (shift, scale, gate for attention and for the MLP), runs one joint attention over
[text, image] tokens with per-stream QKV projections, per-head RMSNorm on Q/K and 3-axis RoPE,
and a per-stream tanh-GELU MLP. Only the image stream goes through the modulated output head.

Dtypes follow diffusers: the residual streams, the time embedding and every modulation run in
the weight dtype (no float32 residual); the sinusoidal timestep features, RMSNorm's variance and
the RoPE rotation are computed in float32 and cast back. No parameter is kept in float32.

RoPE (MSRoPE): head channels are split over (frame, height, width) axes (`axes_dims_rope`).
Image k in the sequence (0 = the target, 1, 2, ... = reference images) has frame position k;
its rows and columns are centred on 0 (positions -(h - h//2) ... h//2 - 1). Text token j sits at
position max(h//2, w//2 over all images) + j on all three axes, after every image position.

Qwen-Image-Edit-2511 (`zero_cond_t`): the reference images' tokens are modulated with the time
embedding of t = 0, the target's with t; the text stream and the output head use t.

Layout for the offload engine: `forward` is embed -> `transformer_blocks[i](...)` -> head, and
inside a block the phases `img_mod`, `txt_mod`, `attn`, `img_mlp`, `txt_mlp` run in that order,
each using its weights only inside its own `forward` (the LayerNorms have no weights).
`forward_branches` runs the CFG branches block by block (block i for every branch, then block
i+1), so a block streamer moves each block once per step for all branches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.attention import AttentionUser
from runnerkit.fused import linear_gelu_tanh
from runnerkit.models.qwen_image.arch import QwenImageTransformerArch
from runnerkit.offload.layout import StreamSpec
from runnerkit.parallel.sequence import ShardsSequence
from runnerkit.rope import apply_rope

ROPE_THETA = 10000.0
ROPE_MAX_POSITIONS = 4096
"""Positions per sign and axis in diffusers' `QwenEmbedRope` tables; text positions must fit too."""
TIME_FEATURES = 256
"""Sinusoidal timestep features (diffusers `Timesteps(num_channels=256)`)."""
EPS = 1e-6
ImgShapes = list[tuple[int, int, int]]


def keep_fp32(name: str) -> bool:
    """Whether parameter `name` stays float32 whatever the weight dtype: never for Qwen-Image.

    diffusers' `QwenImageTransformer2DModel` declares no `_keep_in_fp32_modules`; its
    `_skip_layerwise_casting_patterns` ("pos_embed", "norm") only exempts the norms from fp8
    *storage* casting, and they still load in the compute dtype. So every weight (RMSNorm
    weights included) takes the compute dtype, and inside a block everything is streamed.
    """
    return False


def timestep_features(timestep: Tensor) -> Tensor:
    """Sinusoidal features of `timestep` x 1000, cos half then sin half (diffusers `Timesteps`,
    flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000).

    Args:
        timestep: [B'] sigmas in [0, 1] (any float dtype; its rounding is kept).

    Returns:
        [B', 256] float32.
    """
    half = TIME_FEATURES // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep[:, None].float() * torch.exp(exponent)[None, :]  # [B', 128]
    angles = 1000 * angles  # scaled after the product, as diffusers rounds it
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)  # [B', 256]


def rope_table(img_shapes: ImgShapes, text_len: int, axes_dims: tuple[int, int, int],
               device: torch.device) -> tuple[Tensor, Tensor]:
    """(cos, sin) of the joint [text, image] sequence, each [L_txt + L_img, 1, head_dim/2] float32.

    Angles are position x 1 / theta^(2i/d) in float32, per axis, as diffusers `QwenEmbedRope`
    computes them (see the module docstring for the positions).

    Raises:
        ValueError: a position past the reference's 4096-entry tables.
    """
    inv_freqs = [1.0 / torch.pow(ROPE_THETA, torch.arange(0, d, 2, device=device).float().div(d)) for d in axes_dims]

    def angles(positions: Tensor, axis: int) -> Tensor:
        return torch.outer(positions.float(), inv_freqs[axis])  # [n, d_axis/2]

    image_parts = []
    text_start = 0
    for k, (f, h, w) in enumerate(img_shapes):
        frame = angles(torch.arange(k, k + f, device=device), 0)  # [f, d0/2]
        rows = angles(torch.arange(h, device=device) - (h - h // 2), 1)  # [h, d1/2], centred
        cols = angles(torch.arange(w, device=device) - (w - w // 2), 2)  # [w, d2/2], centred
        image_parts.append(torch.cat([
            frame.view(f, 1, 1, -1).expand(f, h, w, -1),
            rows.view(1, h, 1, -1).expand(f, h, w, -1),
            cols.view(1, 1, w, -1).expand(f, h, w, -1),
        ], dim=-1).reshape(f * h * w, -1))  # [f*h*w, head_dim/2]
        text_start = max(text_start, h // 2, w // 2)
    needed = max(text_start + text_len, *(k + f for k, (f, _, _) in enumerate(img_shapes)),
                 *(n - n // 2 for _, h, w in img_shapes for n in (h, w)))
    if needed > ROPE_MAX_POSITIONS:
        raise ValueError(f"`img_shapes`={img_shapes} with {text_len} text tokens needs RoPE positions past "
                         f"{ROPE_MAX_POSITIONS} (text starts at {text_start}), beyond the reference's tables")
    text_pos = torch.arange(text_start, text_start + text_len, device=device)
    text = torch.cat([angles(text_pos, axis) for axis in range(3)], dim=-1)  # [L_txt, head_dim/2]
    joint = torch.cat([text, *image_parts], dim=0).unsqueeze(1)  # [L_txt + L_img, 1, head_dim/2]
    return torch.cos(joint).contiguous(), torch.sin(joint).contiguous()


class RMSNorm(nn.Module):
    """RMSNorm with a weight (diffusers `RMSNorm`): variance in float32, the normalized values
    cast to the weight's dtype before the weight multiplies them."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """[..., dim] any float dtype -> [..., dim] in the weight dtype (float32 if x is float32)."""
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)  # promotes to float32
        return x.to(self.weight.dtype) * self.weight


class TanhGELUProj(nn.Module):
    """Linear then tanh-approximated GELU (diffusers `GELU(approximate="tanh")`, key `proj`); on CUDA the
    GELU runs in the GEMM's epilogue (runnerkit/fused.py)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return linear_gelu_tanh(x, self.proj)


class FeedForward(nn.Module):
    """dim -> 4 dim (tanh GELU) -> dim; `net.1` stands where diffusers keeps a no-op Dropout."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(TanhGELUProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class JointAttention(AttentionUser):
    """Joint attention of the text and image streams (diffusers `Attention` with
    `QwenDoubleStreamAttnProcessor2_0`): image projections `to_*`, text projections `add_*`."""

    SEQUENCE_PARALLEL = "joint"  # Ulysses: text tokens first, on every rank; image tokens sharded

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm_q = RMSNorm(head_dim)
        self.norm_k = RMSNorm(head_dim)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.add_k_proj = nn.Linear(dim, dim)
        self.add_v_proj = nn.Linear(dim, dim)
        self.add_q_proj = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # diffusers' to_out.1 is a Dropout
        self.to_add_out = nn.Linear(dim, dim)
        self.norm_added_q = RMSNorm(head_dim)
        self.norm_added_k = RMSNorm(head_dim)

    def forward(self, img: Tensor, txt: Tensor, rope: tuple[Tensor, Tensor],
                mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """img [B, L_img, dim], txt [B, L_txt, dim] (weight dtype); rope (cos, sin) [L_txt + L_img,
        1, head_dim/2]; mask None or bool [B, 1, 1, L_txt + L_img] over the joint keys (False: a
        padded text token, attended by nobody). Returns (img [B, L_img, dim], txt [B, L_txt, dim])
        attention outputs (a padded text token's own output row is computed and meaningless)."""
        B, L_txt, _ = txt.shape
        heads = (self.num_heads, -1)
        q = torch.cat([self.norm_added_q(self.add_q_proj(txt).unflatten(-1, heads)),
                       self.norm_q(self.to_q(img).unflatten(-1, heads))], dim=1)  # [B, L, N, d], text first
        k = torch.cat([self.norm_added_k(self.add_k_proj(txt).unflatten(-1, heads)),
                       self.norm_k(self.to_k(img).unflatten(-1, heads))], dim=1)  # [B, L, N, d]
        v = torch.cat([self.add_v_proj(txt).unflatten(-1, heads),
                       self.to_v(img).unflatten(-1, heads)], dim=1)  # [B, L, N, d]
        q = apply_rope(q, *rope).to(v.dtype)  # rotated in float32, as diffusers
        k = apply_rope(k, *rope).to(v.dtype)
        # [B, N, L, d] (attention.py); under Ulysses the L_txt text tokens are the replicated prefix
        out = self.joint_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), L_txt, mask)
        out = out.transpose(1, 2).flatten(2)  # [B, L, dim]
        # Contiguous slices, as diffusers: a strided input can take another bf16 matmul kernel (other rounding).
        return self.to_out[0](out[:, L_txt:].contiguous()), self.to_add_out(out[:, :L_txt].contiguous())


def modulate(x: Tensor, shift: Tensor, scale: Tensor, sizes: list[int]) -> Tensor:
    """AdaLN `x * (1 + scale) + shift` per token segment.

    Args:
        x: [B, L, dim]; shift, scale: [B, S, dim], row s for the s-th segment of `sizes` (sum L).
    """
    parts = [xs * (1 + scale[:, s:s + 1]) + shift[:, s:s + 1] for s, xs in enumerate(x.split(sizes, dim=1))]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def gated(y: Tensor, gate: Tensor, sizes: list[int]) -> Tensor:
    """`gate * y` per token segment; y [B, L, dim], gate [B, S, dim] (see `modulate`)."""
    parts = [gate[:, s:s + 1] * ys for s, ys in enumerate(y.split(sizes, dim=1))]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def layer_norm(x: Tensor) -> Tensor:
    """LayerNorm without weights (diffusers `nn.LayerNorm(elementwise_affine=False, eps=1e-6)`)."""
    return F.layer_norm(x, x.shape[-1:], eps=EPS)


class QwenImageBlock(nn.Module):
    """One dual-stream block (diffusers `QwenImageTransformerBlock`)."""

    def __init__(self, arch: QwenImageTransformerArch) -> None:
        super().__init__()
        dim = arch.inner_dim
        # Rows of the 6*dim output: shift, scale, gate (attention), shift, scale, gate (MLP).
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.attn = JointAttention(dim, arch.num_attention_heads, arch.attention_head_dim)
        self.img_mlp = FeedForward(dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mlp = FeedForward(dim)

    def forward(self, img: Tensor, txt: Tensor, temb: Tensor, rope: tuple[Tensor, Tensor],
                img_sizes: list[int], mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Args: img [B, L_img, dim], txt [B, L_txt, dim] residual streams (weight dtype); temb
        [B, S, dim] time embeddings, S = len(img_sizes): row 0 for the target tokens (and the
        text), row 1 (zero_cond_t) for the reference tokens; rope (cos, sin) [L_txt + L_img, 1,
        head_dim/2]; img_sizes: image tokens per segment; mask: the joint key mask (see
        `JointAttention.forward`) or None. Returns (img, txt), same shapes.

        Every op but attention is per token, so a padded text token reaches the valid tokens only
        through attention's keys, which `mask` removes."""
        img_mod = self.img_mod(temb).chunk(6, dim=-1)  # 6 x [B, S, dim]
        txt_mod = self.txt_mod(temb[:, :1]).chunk(6, dim=-1)  # 6 x [B, 1, dim]
        txt_sizes = [txt.shape[1]]

        img_attn, txt_attn = self.attn(modulate(layer_norm(img), img_mod[0], img_mod[1], img_sizes),
                                       modulate(layer_norm(txt), txt_mod[0], txt_mod[1], txt_sizes), rope, mask)
        img = img + gated(img_attn, img_mod[2], img_sizes)
        txt = txt + gated(txt_attn, txt_mod[2], txt_sizes)

        img = img + gated(self.img_mlp(modulate(layer_norm(img), img_mod[3], img_mod[4], img_sizes)),
                          img_mod[5], img_sizes)
        txt = txt + gated(self.txt_mlp(modulate(layer_norm(txt), txt_mod[3], txt_mod[4], txt_sizes)),
                          txt_mod[5], txt_sizes)
        if img.dtype == torch.float16:  # as diffusers: keep fp16 residuals finite
            img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
        return img, txt


class TimestepEmbedder(nn.Module):
    """256 sinusoidal features -> dim (diffusers `TimestepEmbedding`: linear_1, SiLU, linear_2)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(TIME_FEATURES, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(features)))


class TimeTextEmbed(nn.Module):
    """Holder of `timestep_embedder`, for diffusers' key names (`time_text_embed.timestep_embedder.*`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim)


class OutputNorm(nn.Module):
    """Modulated LayerNorm of the head (diffusers `AdaLayerNormContinuous`): rows scale, then shift."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        """x [B, L, dim]; temb [B, dim]. Returns [B, L, dim]."""
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=-1)  # each [B, dim]
        return layer_norm(x) * (1 + scale)[:, None] + shift[:, None]


@dataclass
class QwenEmbedded:
    """The blocks' and the head's inputs besides the two residual streams (`QwenImageTransformer2D.embed`)."""

    temb: Tensor
    """[B, S, dim] time embeddings (weight dtype), S = len(img_sizes)."""
    rope: tuple[Tensor, Tensor]
    """(cos, sin), each [L_txt + L_img, 1, head_dim/2] float32."""
    img_sizes: list[int]
    """Image tokens per modulation segment (target, references under `zero_cond_t`)."""
    mask: Tensor | None = None
    """Joint key mask bool [B, 1, 1, L_txt + L_img] (text's mask, then the image tokens, all True), or
    None without a text mask."""


class QwenImageTransformer2D(ShardsSequence, nn.Module):
    """Qwen-Image `QwenImageTransformer2DModel`, built from a `QwenImageTransformerArch`.

    `state_dict()` has exactly diffusers' keys and shapes: a diffusers checkpoint loads with an
    identity key map.
    """

    STREAM_SPEC: ClassVar[StreamSpec] = StreamSpec(
        blocks_attr="transformer_blocks", phases=("img_mod", "txt_mod", "attn", "img_mlp", "txt_mlp"),
        keep_fp32=keep_fp32)
    """Block/phase offload: `transformer_blocks[i]` and its phases in call order."""
    FP8_SKIP: ClassVar[tuple[str, ...]] = ("img_mod", "txt_mod")
    """fp8 compute (`compute_dtype: fp8`): the blocks' AdaLN modulation projections stay in the model dtype (one row
    per sample, scales and shifts of the whole residual stream); attention and MLP linears are eligible."""

    def __init__(self, arch: QwenImageTransformerArch) -> None:
        super().__init__()
        self.arch = arch
        dim = arch.inner_dim
        self.time_text_embed = TimeTextEmbed(dim)
        self.txt_norm = RMSNorm(arch.joint_attention_dim)
        self.img_in = nn.Linear(arch.in_channels, dim)
        self.txt_in = nn.Linear(arch.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList([QwenImageBlock(arch) for _ in range(arch.num_layers)])
        self.norm_out = OutputNorm(dim)
        self.proj_out = nn.Linear(dim, arch.patch_size ** 2 * arch.out_channels)
        self._rope_cache: dict[tuple[tuple[tuple[int, int, int], ...], int, torch.device], tuple[Tensor, Tensor]] = {}

    def clear_cache(self) -> None:
        """Drop the cached RoPE tables (request state; the runner calls it after every request)."""
        self._rope_cache.clear()

    @torch.compiler.disable
    def rope_for_shapes(self, img_shapes: ImgShapes, text_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(cos, sin) [L_txt + L_img, 1, head_dim/2] float32 for these images and text length (cached).

        Kept out of torch.compile: a dict cache, run once per request shape and device.
        """
        key = (tuple(tuple(s) for s in img_shapes), text_len, device)
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_table(img_shapes, text_len, self.arch.axes_dims_rope, device)
        return self._rope_cache[key]

    def check_inputs(self, hidden_states: Tensor, encoder_hidden_states: Tensor, timestep: Tensor,
                     img_shapes: ImgShapes, encoder_hidden_states_mask: Tensor | None = None) -> None:
        """Raise ValueError naming the argument when shapes do not fit the architecture (see `forward`)."""
        arch = self.arch
        if hidden_states.ndim != 3 or hidden_states.shape[2] != arch.in_channels:
            raise ValueError(f"`hidden_states` must be [B, L_img, {arch.in_channels}], "
                             f"got {tuple(hidden_states.shape)}")
        B, L_img, _ = hidden_states.shape
        txt_shape = tuple(encoder_hidden_states.shape)
        if len(txt_shape) != 3 or txt_shape[0] != B or txt_shape[1] == 0 or txt_shape[2] != arch.joint_attention_dim:
            raise ValueError(f"`encoder_hidden_states` must be [{B}, L_txt > 0, {arch.joint_attention_dim}], "
                             f"got {tuple(encoder_hidden_states.shape)}")
        if timestep.shape != (B,):
            raise ValueError(f"`timestep` must have shape [B] = ({B},), got {tuple(timestep.shape)}")
        if not img_shapes or any(len(s) != 3 or min(s) < 1 for s in img_shapes):
            raise ValueError(f"`img_shapes` must be a non-empty list of positive (frames, rows, cols), "
                             f"got {img_shapes}")
        if sum(math.prod(s) for s in img_shapes) != L_img:
            raise ValueError(f"`img_shapes`={img_shapes} describes {sum(math.prod(s) for s in img_shapes)} image "
                             f"tokens but `hidden_states` has L_img = {L_img}")
        if encoder_hidden_states_mask is not None and (
                tuple(encoder_hidden_states_mask.shape) != txt_shape[:2] or encoder_hidden_states_mask.dtype != torch.bool):
            raise ValueError(f"`encoder_hidden_states_mask` must be bool [{B}, {txt_shape[1]}] (True: a valid text "
                             f"token), got {encoder_hidden_states_mask.dtype} {tuple(encoder_hidden_states_mask.shape)}")

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor, timestep: Tensor,
                img_shapes: ImgShapes, encoder_hidden_states_mask: Tensor | None = None) -> Tensor:
        """Predict the flow (velocity) of every image token for one denoising step.

        Args:
            hidden_states: [B, L_img, in_channels] packed latents (2x2 patches, channel-major
                `c*4 + dy*2 + dx`): the target image's tokens, then each reference image's.
            encoder_hidden_states: [B, L_txt, joint_attention_dim] text-encoder hidden states:
                the valid tokens only, or (with `encoder_hidden_states_mask`) valid tokens padded.
            encoder_hidden_states_mask: None, or bool [B, L_txt], True for a valid token: padded
                tokens are removed from every attention's keys (the only op that mixes tokens), so
                the image tokens' output equals an unpadded call's up to summation order
                (docs/prompt_lengths.md). Valid tokens must come first (text RoPE positions count
                from the first text token, padded or not), as diffusers' `encoder_hidden_states_mask`.
            timestep: [B] sigma in [0, 1] (diffusers' pipelines pass scheduler timestep / 1000);
                cast to the weight dtype first, as diffusers does (its pipelines also round the
                timestep to the latents' dtype before dividing: `t.to(dtype) / 1000`).
            img_shapes: (frames, rows, cols) in patches of each image in sequence order, target
                first, the same for every batch row (diffusers takes `[img_shapes] * B`).

        Returns:
            [B, L_img, patch_size^2 * out_channels] in the weight dtype, for all image tokens
            (the target's come first; diffusers' pipeline keeps those).

        Raises:
            ValueError: a shape does not fit the architecture or `img_shapes` (names the
                argument), or RoPE positions past 4096.

        RoPE tables are cached per (img_shapes, L_txt, device) until `clear_cache`.

        Source: diffusers `transformer_qwenimage.py` (`QwenImageTransformer2DModel.forward`,
        `QwenEmbedRope`, `QwenDoubleStreamAttnProcessor2_0`); Qwen-Image technical report.
        """
        img, txt, pre = self.shard(*self.embed(hidden_states, encoder_hidden_states, timestep, img_shapes,
                                               encoder_hidden_states_mask))
        for block in self.transformer_blocks:
            img, txt = block(img, txt, pre.temb, pre.rope, pre.img_sizes, pre.mask)
        return self.gather(self.proj_out(self.norm_out(img, pre.temb[:, 0])))  # [B, L_img, p*p*C_out]

    def shard(self, img: Tensor, txt: Tensor, pre: QwenEmbedded) -> tuple[Tensor, Tensor, QwenEmbedded]:
        """Ulysses sequence parallel (`sequence_parallel` set): this rank's 1/K of the image tokens
        [B, L_img/K, dim], the RoPE tables [L_txt + L_img/K, 1, d/2] (text rows whole) and the
        modulation segments cut to the shard (a segment may be empty on a rank); the text stream stays
        whole on every rank. One process: unchanged."""
        sp = self.sequence_parallel
        if sp is None:
            return img, txt, pre
        L_txt = txt.shape[1]
        start, end = sp.bounds(img.shape[1])
        rope = tuple(torch.cat([t[:L_txt], sp.shard(t[L_txt:], 0)]) for t in pre.rope)
        sizes, offset = [], 0
        for size in pre.img_sizes:  # the part of each segment [offset, offset + size) inside [start, end)
            sizes.append(max(0, min(end, offset + size) - max(start, offset)))
            offset += size
        return sp.shard(img, 1), txt, replace(pre, rope=rope, img_sizes=sizes)  # type: ignore[arg-type]

    def gather(self, out: Tensor) -> Tensor:
        """Every rank's image tokens of the output [B, L_img, C] (one all-gather); one process: `out`."""
        sp = self.sequence_parallel
        return out if sp is None else sp.gather(out, 1)

    def forward_branches(self, hidden_states: Tensor, encoder_hidden_states: Sequence[Tensor], timestep: Tensor,
                         img_shapes: ImgShapes,
                         encoder_hidden_states_masks: Sequence[Tensor | None] | None = None) -> list[Tensor]:
        """`forward` for several text conditions (the CFG branches), block-major: block i runs for
        every branch, in `encoder_hidden_states` order, before block i+1 runs for any.

        Each branch goes through exactly the ops and shapes of `forward(hidden_states,
        encoder_hidden_states[b], timestep, img_shapes)`, so output b is bit-identical to that call;
        each branch keeps its own text length (no padding, no batching across branches). With block
        streaming a block's weights are fetched once per call for all branches (the streamer serves
        the re-entry from its slot: runnerkit/offload/streamer.py).

        Args:
            hidden_states, timestep, img_shapes: as `forward`, shared by every branch.
            encoder_hidden_states: one [B, L_txt_b, joint_attention_dim] per branch (e.g. [prompt,
                negative prompt]); the lengths may differ.
            encoder_hidden_states_masks: None, or one mask (or None) per branch, as `forward`'s.

        Returns:
            One [B, L_img, patch_size^2 * out_channels] prediction per branch (weight dtype), in order.

        Raises:
            ValueError: no branch, or as `forward` (naming the argument).

        Memory: every branch's residual streams (img [B, L_img, dim], txt [B, L_txt_b, dim], weight
        dtype) are alive together: one more image stream than `forward` holds while a block runs.
        """
        if not encoder_hidden_states:
            raise ValueError("`encoder_hidden_states` is empty: give one text condition per branch")
        masks = list(encoder_hidden_states_masks or [None] * len(encoder_hidden_states))
        if len(masks) != len(encoder_hidden_states):
            raise ValueError(f"`encoder_hidden_states_masks` has {len(masks)} entries for "
                             f"{len(encoder_hidden_states)} branches: give one per branch")
        embedded = [self.shard(*self.embed(hidden_states, txt, timestep, img_shapes, mask))
                    for txt, mask in zip(encoder_hidden_states, masks)]
        imgs = [img for img, _, _ in embedded]  # [B, L_img, dim] each
        txts = [txt for _, txt, _ in embedded]  # [B, L_txt_b, dim] each
        pres = [pre for _, _, pre in embedded]
        del embedded  # the lists hold the only references to the streams
        for block in self.transformer_blocks:
            for b, pre in enumerate(pres):
                imgs[b], txts[b] = block(imgs[b], txts[b], pre.temb, pre.rope, pre.img_sizes, pre.mask)
        return [self.gather(self.proj_out(self.norm_out(img, pre.temb[:, 0]))) for img, pre in zip(imgs, pres)]

    def embed(self, hidden_states: Tensor, encoder_hidden_states: Tensor, timestep: Tensor,
              img_shapes: ImgShapes, encoder_hidden_states_mask: Tensor | None = None
              ) -> tuple[Tensor, Tensor, QwenEmbedded]:
        """Check the inputs, project the image and text tokens, embed the timestep, look up RoPE, build
        the joint key mask (see `forward`). Returns (img [B, L_img, dim], txt [B, L_txt, dim], the
        blocks' other inputs)."""
        self.check_inputs(hidden_states, encoder_hidden_states, timestep, img_shapes, encoder_hidden_states_mask)
        B, L_img, _ = hidden_states.shape
        img = self.img_in(hidden_states.to(self.img_in.weight.dtype))  # [B, L_img, dim]
        dtype = img.dtype

        timestep = timestep.to(dtype)
        target_len = math.prod(img_shapes[0])
        if self.arch.zero_cond_t:  # segment 0 (target tokens) at t, segment 1 (reference tokens) at 0
            timestep = torch.stack([timestep, timestep * 0], dim=1).flatten()  # [B*2]: (t_b, 0) per row
            img_sizes = [target_len, L_img - target_len]
        else:
            img_sizes = [L_img]
        temb = self.time_text_embed.timestep_embedder(timestep_features(timestep).to(dtype))  # [B*S, dim]
        temb = temb.unflatten(0, (B, len(img_sizes)))  # [B, S, dim]

        txt = self.txt_in(self.txt_norm(encoder_hidden_states))  # [B, L_txt, dim]
        rope = self.rope_for_shapes(img_shapes, txt.shape[1], img.device)
        # Regional compile (runnerkit/compile.py): the prompt's token count varies per request; mark it
        # dynamic so a new prompt length compiles nothing (eager: no effect).
        torch._dynamo.maybe_mark_dynamic(txt, 1)
        for table in rope:
            torch._dynamo.maybe_mark_dynamic(table, 0)
        mask = None
        if encoder_hidden_states_mask is not None:
            image_keys = encoder_hidden_states_mask.new_ones(B, L_img)
            mask = torch.cat([encoder_hidden_states_mask.to(img.device), image_keys.to(img.device)], dim=1)
            mask = mask[:, None, None, :]  # [B, 1, 1, L_txt + L_img], broadcast over heads and queries
            torch._dynamo.maybe_mark_dynamic(mask, 3)
        return img, txt, QwenEmbedded(temb, rope, img_sizes, mask)
