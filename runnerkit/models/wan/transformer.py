"""Wan2.1 diffusion transformer (t2v, i2v, flf2v), in the original release's key names.

Design and numerics follow `WanModel` of Wan-Video/Wan2.1 (`wan/modules/model.py`): a Conv3d
patch embedding, a sinusoidal timestep embedding turned into six AdaLN modulation vectors per
block, self-attention with q/k RMSNorm and 3D RoPE, cross-attention to the (zero-padded) text
context, a tanh-GELU FFN, and a modulated output head. The image-conditioned checkpoints
(`model_type` "i2v" / "flf2v") add the CLIP image projection `img_emb` (Wan `MLPProj`, with
the first/last-frame position embedding `emb_pos` for flf2v) and, in every block, a second
cross-attention over the image tokens (`k_img`, `v_img`, `norm_k_img`; Wan
`WanI2VCrossAttention`) whose output is added to the text attention's before the output
projection; their latents arrive with the conditioning channels `y` (mask + VAE latents of the
given frames) concatenated. As in Wan, the residual stream, the
time embedding, the modulation arithmetic and the norms run in float32; every matmul runs in
the dtype of its own weight, so bf16 weights work on the CPU and on CUDA.

Layout for the offload engine: `forward` is `embed` -> `blocks[i](...)` for each block ->
`head` -> `unpatchify`, and all of a block's weights are used inside `blocks[i].forward`,
so forward hooks on `blocks[i]` bracket every use of them. `forward_branches` runs the CFG
branches block by block (block i for every branch, then block i+1), so a block streamer moves
each block once per step for all branches. Inside a block the three phases are
the submodules `self_attn`, `cross_attn` (preceded by its sibling LayerNorm `norm3`) and `ffn`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.attention import AttentionUser
from runnerkit.fp8_compute import input_dtype
from runnerkit.fused import TanhGELUMLP
from runnerkit.models.wan.arch import WAN_CLIP_DIM, WAN_CLIP_TOKENS, WanTransformerArch
from runnerkit.offload.layout import StreamSpec
from runnerkit.parallel.sequence import ShardsSequence
from runnerkit.rope import apply_rope

ROPE_THETA = 10000.0
ROPE_MAX_POSITIONS = 1024  # positions per axis (frames, height, width), as in Wan

# Parameters the reference keeps in float32 (diffusers `WanTransformer3DModel._keep_in_fp32_modules`:
# time embedder, scale-shift tables, the affine cross-attention LayerNorm, and the two LayerNorms
# of the image projection, diffusers `image_embedder.norm1/norm2`), in native names.
# Block-relative names ("modulation", "norm3.weight") match too, for per-block loaders.
_FP32_PATTERN = re.compile(r"^time_embedding\.\d+\.(weight|bias)$|(^|\.)modulation$|(^|\.)norm3\.(weight|bias)$"
                           r"|^img_emb\.proj\.[04]\.(weight|bias)$")
FLF2V_IMAGE_TOKENS = 2 * WAN_CLIP_TOKENS
"""Image tokens of flf2v: the first frame's 257 CLIP tokens, then the last frame's."""


def keep_fp32(name: str) -> bool:
    """Whether the native parameter `name` stays float32 whatever the weight dtype.

    Use as `assign_state_dict(model, sd, "transformer", dtype=torch.bfloat16, keep_fp32=keep_fp32)`.
    """
    return _FP32_PATTERN.search(name) is not None


def sinusoidal_embedding(timestep: Tensor, dim: int) -> Tensor:
    """Sinusoidal timestep embedding, cos half then sin half (Wan `sinusoidal_embedding_1d`).

    Args:
        timestep: [B] timesteps in [0, 1000], float or int.
        dim: embedding size (even).

    Returns:
        [B, dim] float32, computed in float64 as the reference does.
    """
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=timestep.device) / half)  # [half]
    angles = torch.outer(timestep.to(torch.float64), freqs)  # [B, half]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).float()  # [B, dim]


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of one head given to the (frame, height, width) RoPE axes, as Wan splits them."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


class WanRMSNorm(nn.Module):
    """RMSNorm over the whole projection (all heads), computed in float32; returns float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.float()


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 whatever the input and weight dtype; returns float32."""

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


class WanSelfAttention(AttentionUser):
    """Multi-head attention with q/k RMSNorm; `forward` is the self-attention with 3D RoPE."""

    SEQUENCE_PARALLEL = "self"  # Ulysses: queries and keys are the sharded video tokens

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q: nn.Module = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k: nn.Module = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()

    def heads(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """[B, Lq, N, d], [B, Lk, N, d] x2 -> attention output [B, Lq, N*d] (weight dtype), not projected."""
        B, Lq, N, d = q.shape
        dtype = input_dtype(self.o)
        out = self.attention_fn(
            q.to(dtype).transpose(1, 2), k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)
        )  # [B, N, Lq, d] (the run's attention backend: runnerkit/attention.py)
        return out.transpose(1, 2).reshape(B, Lq, N * d)  # [B, Lq, dim]

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """[B, Lq, N, d], [B, Lk, N, d] x2 -> output projection [B, Lq, dim] (weight dtype)."""
        return self.o(self.heads(q, k, v))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """x: [B, L, dim] (any float dtype); rope: (cos, sin) [L, 1, d/2]. Returns [B, L, dim]."""
        x = x.to(input_dtype(self.q))
        q = self.norm_q(self.q(x)).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        k = self.norm_k(self.k(x)).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        v = self.v(x).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        return self.attend(apply_rope(q, *rope), apply_rope(k, *rope), v)


class WanCrossAttention(WanSelfAttention):
    """Text cross-attention (Wan `WanT2VCrossAttention`); i2v adds image keys in a subclass."""

    SEQUENCE_PARALLEL = "none"  # Ulysses: local video queries, text (and image) keys on every rank

    def forward(self, x: Tensor, context: Tensor) -> Tensor:  # type: ignore[override]
        """x: [B, L, dim]; context: [B, text_len, dim] embedded text. Returns [B, L, dim]."""
        x = x.to(input_dtype(self.q))
        context = context.to(input_dtype(self.k))
        q = self.norm_q(self.q(x)).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        k = self.norm_k(self.k(context)).unflatten(2, (self.num_heads, -1))  # [B, text_len, N, d]
        v = self.v(context).unflatten(2, (self.num_heads, -1))  # [B, text_len, N, d]
        return self.attend(q, k, v)


class WanI2VCrossAttention(WanCrossAttention):
    """Text cross-attention plus image cross-attention (Wan `WanI2VCrossAttention`).

    The queries attend separately to the text keys and to the image keys (`k_img`, `v_img`,
    RMSNorm `norm_k_img`); the two attention outputs are summed, then projected once by `o`.
    """

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float) -> None:
        super().__init__(dim, num_heads, qk_norm, eps)
        self.k_img = nn.Linear(dim, dim)
        self.v_img = nn.Linear(dim, dim)
        self.norm_k_img: nn.Module = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, context: Tensor,  # type: ignore[override]
                image_context: Tensor | None = None) -> Tensor:
        """x: [B, L, dim]; context: [B, text_len, dim] embedded text; image_context: [B, L_img, dim]
        embedded CLIP tokens (L_img 257, or 514 for flf2v). Returns [B, L, dim]."""
        assert image_context is not None, "image cross-attention needs `image_context` (checked in `check_inputs`)"
        x = x.to(input_dtype(self.q))
        context = context.to(input_dtype(self.k))
        image_context = image_context.to(input_dtype(self.k_img))
        q = self.norm_q(self.q(x)).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        k = self.norm_k(self.k(context)).unflatten(2, (self.num_heads, -1))  # [B, text_len, N, d]
        v = self.v(context).unflatten(2, (self.num_heads, -1))  # [B, text_len, N, d]
        k_img = self.norm_k_img(self.k_img(image_context)).unflatten(2, (self.num_heads, -1))  # [B, L_img, N, d]
        v_img = self.v_img(image_context).unflatten(2, (self.num_heads, -1))  # [B, L_img, N, d]
        return self.o(self.heads(q, k, v) + self.heads(q, k_img, v_img))


class WanImageEmbedding(nn.Module):
    """CLIP image features -> image context tokens (Wan `MLPProj`, diffusers `WanImageEmbedding`).

    `proj` is LayerNorm -> Linear(1280, 1280) -> GELU (exact) -> Linear(1280, dim) -> LayerNorm;
    flf2v first adds the learned position embedding `emb_pos` [1, 514, 1280] over the first
    frame's and the last frame's tokens.
    """

    def __init__(self, dim: int, first_last_frame: bool) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            FP32LayerNorm(WAN_CLIP_DIM), nn.Linear(WAN_CLIP_DIM, WAN_CLIP_DIM), nn.GELU(),
            nn.Linear(WAN_CLIP_DIM, dim), FP32LayerNorm(dim),
        )
        self.emb_pos: nn.Parameter | None = (
            nn.Parameter(torch.zeros(1, FLF2V_IMAGE_TOKENS, WAN_CLIP_DIM)) if first_last_frame else None
        )

    def forward(self, clip_context: Tensor) -> Tensor:
        """clip_context: [B, L_img, 1280] -> [B, L_img, dim] float32."""
        x = clip_context.float()
        if self.emb_pos is not None:
            x = x + self.emb_pos.float()  # [B, 514, 1280]
        x = self.proj[0](x).to(self.proj[1].weight.dtype)  # LayerNorm in float32
        x = self.proj[3](self.proj[2](self.proj[1](x)))  # [B, L_img, dim]
        return self.proj[4](x)


class WanAttentionBlock(nn.Module):
    """One transformer block: AdaLN self-attention, cross-attention, AdaLN FFN."""

    def __init__(self, arch: WanTransformerArch) -> None:
        super().__init__()
        dim = arch.dim
        self.norm1 = FP32LayerNorm(dim, arch.eps, elementwise_affine=False)
        self.self_attn = WanSelfAttention(dim, arch.num_heads, arch.qk_norm, arch.eps)
        self.norm3: nn.Module = (
            FP32LayerNorm(dim, arch.eps, elementwise_affine=True) if arch.cross_attn_norm else nn.Identity()
        )
        cross = WanI2VCrossAttention if arch.image_context else WanCrossAttention
        self.cross_attn = cross(dim, arch.num_heads, arch.qk_norm, arch.eps)
        self.norm2 = FP32LayerNorm(dim, arch.eps, elementwise_affine=False)
        self.ffn = TanhGELUMLP(dim, arch.ffn_dim, dim)  # GELU in the first GEMM's epilogue on CUDA (runnerkit/fused.py)
        # Rows: shift, scale, gate (self-attention), shift, scale, gate (FFN).
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: Tensor, time_mod: Tensor, context: Tensor, rope: tuple[Tensor, Tensor],
                image_context: Tensor | None = None) -> Tensor:
        """Args: x [B, L, dim] float32 residual stream; time_mod [B, 6, dim] float32; context
        [B, text_len, dim]; rope (cos, sin) [L, 1, head_dim/2]; image_context [B, L_img, dim]
        (i2v / flf2v only, else None). Returns [B, L, dim] float32."""
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (
            self.modulation.float() + time_mod
        ).chunk(6, dim=1)  # each [B, 1, dim]
        y = self.self_attn(self.norm1(x) * (1 + scale_sa) + shift_sa, rope)
        x = x + y.float() * gate_sa
        cross = self.cross_attn(self.norm3(x), context) if image_context is None else (
            self.cross_attn(self.norm3(x), context, image_context))
        x = x + cross.float()
        y = self.ffn((self.norm2(x) * (1 + scale_ff) + shift_ff).to(input_dtype(self.ffn[0])))
        return x + y.float() * gate_ff


class WanHead(nn.Module):
    """Output head: modulated LayerNorm then a Linear to `out_dim * prod(patch_size)`."""

    def __init__(self, arch: WanTransformerArch) -> None:
        super().__init__()
        dim = arch.dim
        self.norm = FP32LayerNorm(dim, arch.eps, elementwise_affine=False)
        self.head = nn.Linear(dim, arch.out_dim * math.prod(arch.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)  # rows: shift, scale

    def forward(self, x: Tensor, time_emb: Tensor) -> Tensor:
        """x: [B, L, dim] float32; time_emb: [B, dim] float32. Returns [B, L, C_out*pt*ph*pw] float32."""
        shift, scale = (self.modulation.float() + time_emb.unsqueeze(1)).chunk(2, dim=1)  # each [B, 1, dim]
        y = self.norm(x) * (1 + scale) + shift
        return self.head(y.to(self.head.weight.dtype)).float()


@dataclass
class WanEmbedded:
    """What `WanTransformer3D.embed` hands to the blocks and the head."""

    x: Tensor
    """[B, L, dim] float32 patch tokens (the residual stream), L = f*h*w."""
    time_emb: Tensor
    """[B, dim] float32 time embedding (the head's modulation input)."""
    time_mod: Tensor
    """[B, 6, dim] float32 per-block modulation input."""
    context: Tensor
    """[B, text_len, dim] embedded text."""
    rope: tuple[Tensor, Tensor]
    """(cos, sin), each [L, 1, head_dim/2] float32."""
    grid: tuple[int, int, int]
    """(f, h, w): the latent grid in patches."""
    image_context: Tensor | None = None
    """[B, L_img, dim] float32 embedded CLIP tokens (i2v: 257, flf2v: 514); None for t2v."""


class WanTransformer3D(ShardsSequence, nn.Module):
    """Wan2.1 `WanModel` (t2v, i2v or flf2v after `arch.model_type`), built from a `WanTransformerArch`.

    Raises:
        ValueError: `arch.dim` not divisible by `arch.num_heads`, odd head or frequency size.
    """

    STREAM_SPEC: ClassVar[StreamSpec] = StreamSpec(blocks_attr="blocks", phases=("self_attn", "cross_attn", "ffn"),
                                                   keep_fp32=keep_fp32)
    """Block/phase offload: `blocks[i]` and its phases in call order (`norm3` and `modulation` stay resident)."""
    FP8_SKIP: ClassVar[tuple[str, ...]] = ()
    """fp8 compute (`compute_dtype: fp8`): every linear of a block is eligible (attention q/k/v/o, the image keys
    of i2v, the FFN); the block's AdaLN modulation is a parameter table, not a linear layer."""

    def __init__(self, arch: WanTransformerArch) -> None:
        super().__init__()
        if arch.dim % arch.num_heads != 0 or (arch.dim // arch.num_heads) % 2 != 0:
            raise ValueError(f"`dim`={arch.dim} must be `num_heads`={arch.num_heads} times an even head size")
        if arch.freq_dim % 2 != 0:
            raise ValueError(f"`freq_dim`={arch.freq_dim} must be even")
        self.arch = arch
        dim = arch.dim
        self.head_dim = dim // arch.num_heads
        self.patch_embedding = nn.Conv3d(arch.in_dim, dim, kernel_size=arch.patch_size, stride=arch.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(arch.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(arch.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_emb: WanImageEmbedding | None = (
            WanImageEmbedding(dim, first_last_frame=arch.model_type == "flf2v") if arch.image_context else None
        )
        self.blocks = nn.ModuleList([WanAttentionBlock(arch) for _ in range(arch.num_layers)])
        self.head = WanHead(arch)
        self._rope_cache: dict[tuple[int, int, int, torch.device], tuple[Tensor, Tensor]] = {}
        self.register_buffer("rope_freqs", torch.empty(0, dtype=torch.complex64), persistent=False)
        self.init_non_persistent_buffers()

    def init_non_persistent_buffers(self) -> None:
        """(Re)create the RoPE table `rope_freqs` [1024, head_dim/2] complex64 on the weights' device.

        Each axis (frame, height, width) has its own frequencies over its share of the head
        channels (`rope_axis_dims`); angles are computed in float64 as in Wan's `rope_params`.
        """
        device = self.patch_embedding.weight.device
        positions = torch.arange(ROPE_MAX_POSITIONS, dtype=torch.float64, device=device)
        tables = []
        for axis_dim in rope_axis_dims(self.head_dim):
            inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, axis_dim, 2, dtype=torch.float64, device=device) / axis_dim)
            angles = torch.outer(positions, inv_freq)  # [1024, axis_dim/2]
            tables.append(torch.polar(torch.ones_like(angles), angles))
        self.rope_freqs = torch.cat(tables, dim=1).to(torch.complex64)  # [1024, head_dim/2]
        self._rope_cache.clear()

    def clear_cache(self) -> None:
        """Drop the per-grid RoPE tables (request-specific state; warmup isolation needs this)."""
        self._rope_cache.clear()

    @torch.compiler.disable
    def rope_for_grid(self, f: int, h: int, w: int) -> tuple[Tensor, Tensor]:
        """(cos, sin) [f*h*w, 1, head_dim/2] float32 for a latent grid of f x h x w patches (cached).

        Kept out of torch.compile: a dict cache and complex math, run once per grid and device.
        """
        key = (f, h, w, self.rope_freqs.device)
        if key not in self._rope_cache:
            if self.rope_freqs.dtype != torch.complex64:
                raise RuntimeError(
                    f"RoPE table has dtype {self.rope_freqs.dtype}, expected complex64: cast weights with "
                    "`assign_state_dict(dtype=...)`, not `module.to(dtype)`"
                )
            ft, fh, fw = self.rope_freqs.split([c // 2 for c in rope_axis_dims(self.head_dim)], dim=1)
            freqs = torch.cat([
                ft[:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                fh[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                fw[:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ], dim=-1).reshape(f * h * w, 1, -1)  # [L, 1, head_dim/2]
            self._rope_cache[key] = (freqs.real.contiguous(), freqs.imag.contiguous())
        return self._rope_cache[key]

    def check_inputs(self, latents: Tensor, timestep: Tensor, context: Tensor,
                     clip_context: Tensor | None = None, y: Tensor | None = None) -> None:
        """Raise ValueError naming the argument when shapes do not fit the architecture."""
        arch = self.arch
        image = arch.model_type != "t2v"
        if image and (y is None or arch.image_context and clip_context is None):
            raise ValueError(f"`model_type`={arch.model_type!r} needs {'`clip_context` and ' if arch.image_context else ''}"
                             f"`y` (got clip_context={clip_context is not None}, y={y is not None})")
        if not image and (clip_context is not None or y is not None):
            raise ValueError("`clip_context` and `y` are only accepted by i2v / flf2v weights (`model_type`='t2v')")
        if image and not arch.image_context and clip_context is not None:
            raise ValueError("`clip_context` is not accepted by these i2v weights (`image_context` false: Wan2.2 "
                             "conditions through `y` only)")
        y_dim = arch.in_dim - arch.out_dim if image else 0
        if latents.ndim != 5 or latents.shape[1] != arch.in_dim - y_dim:
            raise ValueError(f"`latents` must be [B, {arch.in_dim - y_dim}, F, H, W], got shape {tuple(latents.shape)}")
        B, _, F_, H, W = latents.shape
        if y is not None and y.shape != (B, y_dim, F_, H, W):
            raise ValueError(f"`y` must be [B, C_in - C_out, F, H, W] = {(B, y_dim, F_, H, W)}, "
                             f"got shape {tuple(y.shape)}")
        tokens = FLF2V_IMAGE_TOKENS if arch.model_type == "flf2v" else None
        if clip_context is not None and (clip_context.ndim != 3 or clip_context.shape[0] != B
                                         or clip_context.shape[2] != WAN_CLIP_DIM
                                         or tokens is not None and clip_context.shape[1] != tokens):
            raise ValueError(f"`clip_context` must be [{B}, {tokens or 'L_img'}, {WAN_CLIP_DIM}], "
                             f"got shape {tuple(clip_context.shape)}")
        for name, size, patch in zip(("frames", "height", "width"), (F_, H, W), arch.patch_size):
            if size % patch != 0 or not 0 < size // patch <= ROPE_MAX_POSITIONS:
                raise ValueError(
                    f"`latents` {name} = {size} must be a positive multiple of the patch size {patch} "
                    f"with at most {ROPE_MAX_POSITIONS} patches (shape {tuple(latents.shape)})"
                )
        if timestep.shape != (B,):
            raise ValueError(f"`timestep` must have shape [B] = ({B},), got {tuple(timestep.shape)}")
        if context.ndim != 3 or context.shape[0] != B or context.shape[2] != arch.text_dim:
            raise ValueError(f"`context` must be [{B}, L, {arch.text_dim}], got shape {tuple(context.shape)}")
        if context.shape[1] > arch.text_len:
            raise ValueError(f"`context` length L = {context.shape[1]} exceeds `text_len` = {arch.text_len}")

    def embed(self, latents: Tensor, timestep: Tensor, context: Tensor,
              clip_context: Tensor | None = None, y: Tensor | None = None) -> WanEmbedded:
        """Patchify the latents (with `y` concatenated), embed timestep, text and image, look up
        RoPE tables (see `forward`)."""
        self.check_inputs(latents, timestep, context, clip_context, y)
        if y is not None:
            latents = torch.cat([latents, y.to(latents.dtype)], dim=1)  # [B, C_in, F, H, W]
        x = self.patch_embedding(latents.to(self.patch_embedding.weight.dtype))  # [B, dim, f, h, w]
        f, h, w = x.shape[2:]
        # [B, L, dim], made row-major: `.float()` keeps the transpose's channel-major strides, with which every
        # block's LayerNorms reduce over strided channels (a compiled 14B block's three: 2.58 against 1.44 ms on
        # the H200, bench/results/residual_layout_h200.md). `.to(memory_format=)` would not copy a float32 stream.
        x = x.flatten(2).transpose(1, 2).float().contiguous()

        time_in = sinusoidal_embedding(timestep, self.arch.freq_dim)  # [B, freq_dim]
        time_emb = self.time_embedding(time_in.to(self.time_embedding[0].weight.dtype)).float()  # [B, dim]
        time_mod = self.time_projection(time_emb.to(self.time_projection[1].weight.dtype)).float()  # [B, 6*dim]
        time_mod = time_mod.unflatten(1, (6, self.arch.dim))  # [B, 6, dim]

        # Wan pads each prompt's embeddings (trimmed to its true length) with zeros to text_len.
        context = F.pad(context, (0, 0, 0, self.arch.text_len - context.shape[1]))  # [B, text_len, text_dim]
        context = self.text_embedding(context.to(self.text_embedding[0].weight.dtype))  # [B, text_len, dim]
        image_context = None
        if self.img_emb is not None:
            image_context = self.img_emb(clip_context)  # [B, L_img, dim]
        return WanEmbedded(x, time_emb, time_mod, context, self.rope_for_grid(f, h, w), (f, h, w), image_context)

    def unpatchify(self, x: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """[B, f*h*w, C_out*pt*ph*pw] -> [B, C_out, f*pt, h*ph, w*pw]."""
        B = x.shape[0]
        f, h, w = grid
        pt, ph, pw = self.arch.patch_size
        x = x.reshape(B, f, h, w, pt, ph, pw, self.arch.out_dim)  # [B, f, h, w, pt, ph, pw, C]
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, f, pt, h, ph, w, pw]
        return x.reshape(B, self.arch.out_dim, f * pt, h * ph, w * pw)  # [B, C, F, H, W]

    def forward(self, latents: Tensor, timestep: Tensor, context: Tensor,
                clip_context: Tensor | None = None, y: Tensor | None = None) -> Tensor:
        """Predict the flow (velocity) for one denoising step.

        Args:
            latents: [B, C, F, H, W] noisy latents, C = `in_dim` for t2v, `out_dim` (16) for
                i2v / flf2v; H, W (and F) multiples of `patch_size`.
            timestep: [B] timesteps in [0, 1000] (float or int).
            context: [B, L, text_dim] text-encoder output, L <= `text_len`; rows past a prompt's
                true length should be zero (they are zero-padded to `text_len` here, as Wan does).
            clip_context: i2v / flf2v only: [B, 257, 1280] CLIP ViT-H/14 penultimate hidden
                states of the first frame; flf2v: [B, 514, 1280], the first frame's 257 tokens
                then the last frame's.
            y: i2v / flf2v only: [B, `in_dim` - `out_dim` (20), F, H, W] conditioning channels,
                concatenated after the latents: 4 temporal mask channels (1 where a frame is
                given) then the 16 VAE latents of the given frames (zeros elsewhere in pixels).

        Returns:
            [B, C_out, F, H, W] float32.

        Raises:
            ValueError: a shape does not fit the architecture, or `clip_context` / `y` missing for
                i2v / flf2v weights or given to t2v weights (the message names the argument).

        Source: Wan-Video/Wan2.1 `wan/modules/model.py` (`WanModel.forward`, `MLPProj`,
        `WanI2VCrossAttention`).
        """
        pre = self.shard(self.embed(latents, timestep, context, clip_context, y))
        x = pre.x
        for block in self.blocks:
            x = block(x, pre.time_mod, pre.context, pre.rope, pre.image_context)
        return self.unpatchify(self.gather(self.head(x, pre.time_emb)), pre.grid)

    def shard(self, pre: WanEmbedded) -> WanEmbedded:
        """Ulysses sequence parallel (`sequence_parallel` set): this rank's 1/K of the tokens x
        [B, L/K, dim] and of the RoPE tables [L/K, 1, d/2]; one process: `pre` unchanged."""
        sp = self.sequence_parallel
        if sp is None:
            return pre
        return replace(pre, x=sp.shard(pre.x, 1), rope=(sp.shard(pre.rope[0], 0), sp.shard(pre.rope[1], 0)))

    def gather(self, out: Tensor) -> Tensor:
        """The head's output of every rank's tokens [B, L, C_out*pt*ph*pw] (one all-gather); one process: `out`."""
        sp = self.sequence_parallel
        return out if sp is None else sp.gather(out, 1)

    def forward_branches(self, latents: Tensor, timestep: Tensor, contexts: Sequence[Tensor],
                         clip_context: Tensor | None = None, y: Tensor | None = None) -> list[Tensor]:
        """`forward` for several text contexts (the CFG branches), block-major: block i runs for
        every branch, in `contexts` order, before block i+1 runs for any.

        Each branch goes through exactly the ops and shapes of `forward(latents, timestep,
        contexts[b], clip_context, y)`, so output b is bit-identical to that call (each branch keeps
        its own context length; nothing is batched or padded across branches). With block
        streaming, a block's weights are fetched once per call for all branches (the streamer
        serves the re-entry from its slot: runnerkit/offload/streamer.py).

        Args:
            latents, timestep, clip_context, y: as `forward`, shared by every branch.
            contexts: one [B, L_b, text_dim] text context per branch (e.g. [prompt, negative
                prompt]); L_b <= `text_len` may differ between branches.

        Returns:
            One [B, C_out, F, H, W] float32 prediction per branch, in `contexts` order.

        Raises:
            ValueError: `contexts` is empty, or as `forward` (naming the argument).

        Memory: the branches' residual streams [B, L, dim] float32 are alive together; the
        embedding's own reference is dropped, so per token the blocks hold as many streams as
        `forward` does (its `pre.x` and the block input), plus the second branch's embedded text.
        """
        if not contexts:
            raise ValueError("`contexts` is empty: give one text context per branch")
        pres = [self.shard(self.embed(latents, timestep, context, clip_context, y)) for context in contexts]
        xs = [pre.x for pre in pres]  # [B, L, dim] each: the only reference to each branch's stream
        pres = [replace(pre, x=pre.x.new_empty(0)) for pre in pres]
        for block in self.blocks:
            for b, pre in enumerate(pres):
                xs[b] = block(xs[b], pre.time_mod, pre.context, pre.rope, pre.image_context)
        return [self.unpatchify(self.gather(self.head(x, pre.time_emb)), pre.grid) for x, pre in zip(xs, pres)]
