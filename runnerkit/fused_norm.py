"""Row-fused LayerNorm / RMSNorm kernels for the transformer blocks' float32 residual stream (issue 22).

Inductor turns a block's norms into Triton reductions over the model width (5120 for Wan 14B) that
loop over each row twice and, for the q/k RMSNorm followed by RoPE, gather channel pairs through
index arithmetic; measured on the H200 at Wan 14B's 32760 tokens they ran 2.4-4.3x their memory
traffic's time (bench/results/norm_kernels_h200.md). The kernels here keep one row in registers:
one read of each input, one write of each output, in the order of the unfused ops.

- `residual_norm`: optionally `x + y * gate` (or `x + y`) first, written back as the new float32
  residual, then LayerNorm over the last dim, optionally affine (`weight`, `bias`) and/or AdaLN
  modulation `* (1 + scale) + shift`, cast to `out_dtype`.
- `rms_norm_rope`: RMSNorm over the whole projection (all heads) times `weight`, then RoPE on
  adjacent channel pairs (x[2i], x[2i+1]) of every head, cast to `out_dtype`.

Both run as torch custom ops (`runnerkit::residual_norm`, `runnerkit::rms_norm_rope`), so a compiled
block calls them as extern kernels and the compile cache keeps them. They run where `available(x)`
holds (CUDA tensors, triton importable, `ENABLED`); everywhere else the same functions compute the
unfused torch ops, bit for bit the model's reference path. The fused results agree with those ops
in float32 up to the summation order of the row reductions (relative ~1e-6 before the cast).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ENABLED = True
"""Use the Triton kernels on CUDA. bench/norm_kernels.py and the speed bench's unfused arms turn it off."""


@functools.cache
def _triton() -> Any:
    """The triton module, or None where it cannot be imported."""
    try:
        import triton  # noqa: PLC0415 (optional: CUDA builds of torch ship it)
        import triton.language  # noqa: F401, PLC0415
    except ImportError:
        return None
    return triton


def available(x: Tensor) -> bool:
    """Whether the fused kernels run for tensors like `x` (CUDA, triton importable, `ENABLED`)."""
    return ENABLED and x.is_cuda and _triton() is not None


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Compile-on-first-use Triton kernels (defined here so that importing this module needs no triton)."""
    triton = _triton()
    tl = triton.language

    @triton.jit
    def residual_norm_kernel(x_ptr, y_ptr, gate_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, x_out_ptr, out_ptr,
                             rows_per_batch, gate_stride, scale_stride, shift_stride, D, eps,
                             HAS_Y: tl.constexpr, HAS_GATE: tl.constexpr, HAS_AFFINE: tl.constexpr,
                             HAS_MOD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        batch = row // rows_per_batch
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)
        if HAS_Y:
            y = tl.load(y_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_GATE:
                y = y * tl.load(gate_ptr + batch * gate_stride + cols, mask=mask, other=0.0)
            x = x + y
            tl.store(x_out_ptr + row * D + cols, x, mask=mask)
        mean = tl.sum(x, axis=0) / D
        centered = tl.where(mask, x - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / D
        out = centered * tl.rsqrt(var + eps)
        if HAS_AFFINE:
            out = out * tl.load(w_ptr + cols, mask=mask, other=0.0) + tl.load(b_ptr + cols, mask=mask, other=0.0)
        if HAS_MOD:
            scale = tl.load(scale_ptr + batch * scale_stride + cols, mask=mask, other=0.0)
            shift = tl.load(shift_ptr + batch * shift_stride + cols, mask=mask, other=0.0)
            out = out * (1.0 + scale) + shift
        tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, D, half_head, eps,
                             BLOCK_PAIRS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pos = row % seq_len
        pairs = tl.arange(0, BLOCK_PAIRS)
        offs = 2 * pairs[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK_PAIRS, 2]: (x[2i], x[2i+1])
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / D + eps)
        x = x * inv_rms * tl.load(w_ptr + offs, mask=mask, other=0.0)
        x0, x1 = tl.split(x)  # each [BLOCK_PAIRS]
        pair_mask = pairs < D // 2
        angle = pos * half_head + pairs % half_head
        cos = tl.load(cos_ptr + angle, mask=pair_mask, other=0.0)
        sin = tl.load(sin_ptr + angle, mask=pair_mask, other=0.0)
        out = tl.join(x0 * cos - x1 * sin, x0 * sin + x1 * cos)  # [BLOCK_PAIRS, 2]
        tl.store(out_ptr + row * D + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    return residual_norm_kernel, rms_norm_rope_kernel


def _warps(elements: int) -> int:
    """Warps for one row of `elements` values: ~16 per thread, 1 to 16 warps."""
    return max(1, min(16, elements // 512))


# ---- residual + LayerNorm (+ affine, + modulation) ----

def _channels_contiguous(t: Tensor | None) -> Tensor | None:
    """A [B, 1, D] modulation row (a chunk of a [B, k, D] table) with unit channel stride; its batch stride stays."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _residual_norm_reference(x: Tensor, y: Tensor | None, gate: Tensor | None, weight: Tensor | None,
                             bias: Tensor | None, scale: Tensor | None, shift: Tensor | None, eps: float,
                             out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The unfused ops, in the blocks' order (see `residual_norm`)."""
    if y is not None:
        x = x + y.float() * gate if gate is not None else x + y.float()
    out = F.layer_norm(x.float(), x.shape[-1:], weight, bias, eps)
    if scale is not None:
        out = out * (1 + scale) + shift
    return x, out.to(out_dtype)


@torch.library.custom_op("runnerkit::residual_norm", mutates_args=())
def _residual_norm_op(x: Tensor, y: Tensor | None, gate: Tensor | None, weight: Tensor | None,
                      bias: Tensor | None, scale: Tensor | None, shift: Tensor | None, eps: float,
                      out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    B, L, D = x.shape
    x = x.contiguous()
    out = torch.empty(B, L, D, device=x.device, dtype=out_dtype)
    x_out = torch.empty_like(x) if y is not None else x
    gate, scale, shift = (_channels_contiguous(t) for t in (gate, scale, shift))
    kernel, _ = _kernels()
    block = _triton().next_power_of_2(D)
    kernel[(B * L,)](x, y.contiguous() if y is not None else x, gate if gate is not None else x,
                     weight if weight is not None else x, bias if bias is not None else x,
                     scale if scale is not None else x, shift if shift is not None else x, x_out, out,
                     L, *(t.stride(0) if t is not None else 0 for t in (gate, scale, shift)), D, eps, HAS_Y=y is not None, HAS_GATE=gate is not None,
                     HAS_AFFINE=weight is not None, HAS_MOD=scale is not None, BLOCK=block,
                     num_warps=_warps(block))
    return (x_out if y is not None else x.new_empty(0)), out


@_residual_norm_op.register_fake
def _(x, y, gate, weight, bias, scale, shift, eps, out_dtype):
    return (torch.empty_like(x) if y is not None else x.new_empty(0)), torch.empty(x.shape, device=x.device,
                                                                                 dtype=out_dtype)


def residual_norm(x: Tensor, *, y: Tensor | None = None, gate: Tensor | None = None, weight: Tensor | None = None,
                  bias: Tensor | None = None, scale: Tensor | None = None, shift: Tensor | None = None,
                  eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`x2 = x + y * gate` (or `x + y`, or `x`), then `LayerNorm(x2) [* weight + bias] [* (1 + scale) + shift]`.

    Args:
        x: [B, L, D] float32 residual stream.
        y: [B, L, D] branch output (any float dtype, added in float32), or None.
        gate: [B, 1, D] float32 gate of `y`, or None (y added as is).
        weight, bias: [D] float32 LayerNorm affine parameters, or None (both).
        scale, shift: [B, 1, D] float32 AdaLN modulation, or None (both).
        eps: LayerNorm epsilon.
        out_dtype: dtype of the normalized output (the next matmul's input dtype).

    Returns:
        (x2 [B, L, D] float32, normalized [B, L, D] out_dtype); x2 is `x` itself when `y` is None.
    """
    fused = available(x) and x.dim() == 3 and x.dtype == torch.float32
    B, _, D = x.shape if fused else (0, 0, 0)
    fused = fused and all(t is None or t.shape == (B, 1, D) and t.dtype == torch.float32 for t in (gate, scale, shift))
    fused = fused and all(t is None or t.shape == (D,) and t.dtype == torch.float32 for t in (weight, bias))
    fused = fused and (y is None or y.shape == x.shape) and (weight is None) == (bias is None) and (scale is None) == (
        shift is None)
    if not fused:
        return _residual_norm_reference(x, y, gate, weight, bias, scale, shift, eps, out_dtype)
    x2, out = _residual_norm_op(x, y, gate, weight, bias, scale, shift, eps, out_dtype)
    return (x2 if y is not None else x), out


# ---- RMSNorm + RoPE ----

def _rms_norm_rope_reference(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, num_heads: int,
                             out_dtype: torch.dtype) -> Tensor:
    """The unfused ops: RMSNorm in float32 over the last dim, then RoPE per head (see `rms_norm_rope`)."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    pairs = x.unflatten(-1, (num_heads, -1, 2))  # [B, L, N, d/2, 2]
    x0, x1 = pairs.unbind(-1)  # each [B, L, N, d/2]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # [B, L, N, d/2, 2]
    return rotated.flatten(-2).to(out_dtype)  # [B, L, N, d]


@torch.library.custom_op("runnerkit::rms_norm_rope", mutates_args=())
def _rms_norm_rope_op(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, num_heads: int,
                      out_dtype: torch.dtype) -> Tensor:
    B, L, D = x.shape
    x = x.contiguous()
    out = torch.empty(B, L, num_heads, D // num_heads, device=x.device, dtype=out_dtype)
    _, kernel = _kernels()
    block = _triton().next_power_of_2(D // 2)
    kernel[(B * L,)](x, weight.contiguous(), cos.contiguous(), sin.contiguous(), out, L, D, D // num_heads // 2,
                     eps, BLOCK_PAIRS=block, num_warps=_warps(2 * block))
    return out


@_rms_norm_rope_op.register_fake
def _(x, weight, cos, sin, eps, num_heads, out_dtype):
    B, L, D = x.shape
    return torch.empty(B, L, num_heads, D // num_heads, device=x.device, dtype=out_dtype)


def rms_norm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, *, eps: float, num_heads: int,
                  out_dtype: torch.dtype) -> Tensor:
    """RMSNorm over the whole projection times `weight`, then RoPE on each head's adjacent channel pairs.

    Args:
        x: [B, L, D] queries or keys (any float dtype; normalized in float32), D = num_heads * d, d even.
        weight: [D] RMSNorm weight.
        cos, sin: [L, 1, d/2] float32 RoPE tables of the L positions.
        eps: RMSNorm epsilon.
        num_heads: N.
        out_dtype: dtype of the result (the attention's input dtype).

    Returns:
        [B, L, N, d] out_dtype: pair i of a head becomes (x0 cos - x1 sin, x0 sin + x1 cos).
    """
    fused = available(x) and x.dim() == 3 and weight.dtype == torch.float32 and x.shape[-1] % (2 * num_heads) == 0
    fused = fused and cos.shape == sin.shape == (x.shape[1], 1, x.shape[-1] // num_heads // 2)
    if not fused:
        return _rms_norm_rope_reference(x, weight, cos, sin, eps, num_heads, out_dtype)
    return _rms_norm_rope_op(x, weight, cos, sin, eps, num_heads, out_dtype)
