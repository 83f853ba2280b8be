"""Wan2.1 diffusion transformer (text-to-video), in the original release's key names.

Design and numerics follow `WanModel` of Wan-Video/Wan2.1 (`wan/modules/model.py`): a Conv3d
patch embedding, a sinusoidal timestep embedding turned into six AdaLN modulation vectors per
block, self-attention with q/k RMSNorm and 3D RoPE, cross-attention to the (zero-padded) text
context, a tanh-GELU FFN, and a modulated output head. As in Wan, the residual stream, the
time embedding, the modulation arithmetic and the norms run in float32; every matmul runs in
the dtype of its own weight, so bf16 weights work on the CPU and on CUDA.

Layout for the offload engine: `forward` is `embed` -> `blocks[i](...)` for each block ->
`head` -> `unpatchify`, and all of a block's weights are used inside `blocks[i].forward`,
so forward hooks on `blocks[i]` bracket every use of them. Inside a block the three phases are
the submodules `self_attn`, `cross_attn` (preceded by its sibling LayerNorm `norm3`) and `ffn`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.models.wan.arch import WanTransformerArch
from runnerkit.offload.layout import StreamSpec

ROPE_THETA = 10000.0
ROPE_MAX_POSITIONS = 1024  # positions per axis (frames, height, width), as in Wan

# Parameters the reference keeps in float32 (diffusers `WanTransformer3DModel._keep_in_fp32_modules`:
# time embedder, scale-shift tables, the affine cross-attention LayerNorm), in native names.
# Block-relative names ("modulation", "norm3.weight") match too, for per-block loaders.
_FP32_PATTERN = re.compile(r"^time_embedding\.\d+\.(weight|bias)$|(^|\.)modulation$|(^|\.)norm3\.(weight|bias)$")


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


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent channel pairs (x[2i], x[2i+1]) by the RoPE angle of their position.

    Args:
        x: [B, L, N, d] queries or keys (any float dtype).
        cos, sin: [L, 1, d/2] float32.

    Returns:
        [B, L, N, d] float32 (the caller casts to its matmul dtype).
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, L, N, d/2, 2]
    x0, x1 = pairs.unbind(-1)  # each [B, L, N, d/2]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # [B, L, N, d/2, 2]
    return rotated.flatten(-2)  # [B, L, N, d]


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


class WanSelfAttention(nn.Module):
    """Multi-head attention with q/k RMSNorm; `forward` is the self-attention with 3D RoPE."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q: nn.Module = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k: nn.Module = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """[B, Lq, N, d], [B, Lk, N, d] x2 -> output projection [B, Lq, dim] (weight dtype)."""
        B, Lq, N, d = q.shape
        dtype = self.o.weight.dtype
        out = F.scaled_dot_product_attention(
            q.to(dtype).transpose(1, 2), k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)
        )  # [B, N, Lq, d]
        out = out.transpose(1, 2).reshape(B, Lq, N * d)  # [B, Lq, dim]
        return self.o(out)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """x: [B, L, dim] (any float dtype); rope: (cos, sin) [L, 1, d/2]. Returns [B, L, dim]."""
        x = x.to(self.q.weight.dtype)
        q = self.norm_q(self.q(x)).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        k = self.norm_k(self.k(x)).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        v = self.v(x).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        return self.attend(apply_rope(q, *rope), apply_rope(k, *rope), v)


class WanCrossAttention(WanSelfAttention):
    """Text cross-attention (Wan `WanT2VCrossAttention`); i2v adds image keys in a subclass."""

    def forward(self, x: Tensor, context: Tensor) -> Tensor:  # type: ignore[override]
        """x: [B, L, dim]; context: [B, text_len, dim] embedded text. Returns [B, L, dim]."""
        x = x.to(self.q.weight.dtype)
        context = context.to(self.k.weight.dtype)
        q = self.norm_q(self.q(x)).unflatten(2, (self.num_heads, -1))  # [B, L, N, d]
        k = self.norm_k(self.k(context)).unflatten(2, (self.num_heads, -1))  # [B, text_len, N, d]
        v = self.v(context).unflatten(2, (self.num_heads, -1))  # [B, text_len, N, d]
        return self.attend(q, k, v)


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
        self.cross_attn = WanCrossAttention(dim, arch.num_heads, arch.qk_norm, arch.eps)
        self.norm2 = FP32LayerNorm(dim, arch.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, arch.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(arch.ffn_dim, dim))
        # Rows: shift, scale, gate (self-attention), shift, scale, gate (FFN).
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: Tensor, time_mod: Tensor, context: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Args: x [B, L, dim] float32 residual stream; time_mod [B, 6, dim] float32; context
        [B, text_len, dim]; rope (cos, sin) [L, 1, head_dim/2]. Returns [B, L, dim] float32."""
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (
            self.modulation.float() + time_mod
        ).chunk(6, dim=1)  # each [B, 1, dim]
        y = self.self_attn(self.norm1(x) * (1 + scale_sa) + shift_sa, rope)
        x = x + y.float() * gate_sa
        x = x + self.cross_attn(self.norm3(x), context).float()
        y = self.ffn((self.norm2(x) * (1 + scale_ff) + shift_ff).to(self.ffn[0].weight.dtype))
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


class WanTransformer3D(nn.Module):
    """Wan2.1 `WanModel` for text-to-video, built from a `WanTransformerArch`.

    Raises:
        ValueError: `arch.dim` not divisible by `arch.num_heads`, odd head or frequency size.
        NotImplementedError: `arch.model_type` other than "t2v" (image conditioning is not built yet).
    """

    STREAM_SPEC: ClassVar[StreamSpec] = StreamSpec(blocks_attr="blocks", phases=("self_attn", "cross_attn", "ffn"),
                                                   keep_fp32=keep_fp32)
    """Block/phase offload: `blocks[i]` and its phases in call order (`norm3` and `modulation` stay resident)."""

    def __init__(self, arch: WanTransformerArch) -> None:
        super().__init__()
        if arch.model_type != "t2v":
            raise NotImplementedError(f"`model_type`={arch.model_type!r}: only 't2v' is implemented (no image encoder branch yet)")
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

    def check_inputs(self, latents: Tensor, timestep: Tensor, context: Tensor) -> None:
        """Raise ValueError naming the argument when shapes do not fit the architecture."""
        arch = self.arch
        if latents.ndim != 5 or latents.shape[1] != arch.in_dim:
            raise ValueError(f"`latents` must be [B, {arch.in_dim}, F, H, W], got shape {tuple(latents.shape)}")
        B, _, F_, H, W = latents.shape
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

    def embed(self, latents: Tensor, timestep: Tensor, context: Tensor) -> WanEmbedded:
        """Patchify the latents, embed timestep and text, look up RoPE tables (see `forward`)."""
        self.check_inputs(latents, timestep, context)
        x = self.patch_embedding(latents.to(self.patch_embedding.weight.dtype))  # [B, dim, f, h, w]
        f, h, w = x.shape[2:]
        x = x.flatten(2).transpose(1, 2).float()  # [B, L, dim]

        time_in = sinusoidal_embedding(timestep, self.arch.freq_dim)  # [B, freq_dim]
        time_emb = self.time_embedding(time_in.to(self.time_embedding[0].weight.dtype)).float()  # [B, dim]
        time_mod = self.time_projection(time_emb.to(self.time_projection[1].weight.dtype)).float()  # [B, 6*dim]
        time_mod = time_mod.unflatten(1, (6, self.arch.dim))  # [B, 6, dim]

        # Wan pads each prompt's embeddings (trimmed to its true length) with zeros to text_len.
        context = F.pad(context, (0, 0, 0, self.arch.text_len - context.shape[1]))  # [B, text_len, text_dim]
        context = self.text_embedding(context.to(self.text_embedding[0].weight.dtype))  # [B, text_len, dim]
        return WanEmbedded(x, time_emb, time_mod, context, self.rope_for_grid(f, h, w), (f, h, w))

    def unpatchify(self, x: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """[B, f*h*w, C_out*pt*ph*pw] -> [B, C_out, f*pt, h*ph, w*pw]."""
        B = x.shape[0]
        f, h, w = grid
        pt, ph, pw = self.arch.patch_size
        x = x.reshape(B, f, h, w, pt, ph, pw, self.arch.out_dim)  # [B, f, h, w, pt, ph, pw, C]
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, f, pt, h, ph, w, pw]
        return x.reshape(B, self.arch.out_dim, f * pt, h * ph, w * pw)  # [B, C, F, H, W]

    def forward(self, latents: Tensor, timestep: Tensor, context: Tensor) -> Tensor:
        """Predict the flow (velocity) for one denoising step.

        Args:
            latents: [B, C_in, F, H, W] noisy latents; H, W (and F) multiples of `patch_size`.
            timestep: [B] timesteps in [0, 1000] (float or int).
            context: [B, L, text_dim] text-encoder output, L <= `text_len`; rows past a prompt's
                true length should be zero (they are zero-padded to `text_len` here, as Wan does).

        Returns:
            [B, C_out, F, H, W] float32.

        Raises:
            ValueError: a shape does not fit the architecture (the message names the argument).

        Source: Wan-Video/Wan2.1 `wan/modules/model.py` (`WanModel.forward`).
        """
        pre = self.embed(latents, timestep, context)
        x = pre.x
        for block in self.blocks:
            x = block(x, pre.time_mod, pre.context, pre.rope)
        return self.unpatchify(self.head(x, pre.time_emb), pre.grid)
