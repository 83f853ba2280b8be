"""Opt-in fp8 compute for a transformer's block linear layers (config `compute_dtype: fp8`).

Each eligible `nn.Linear` inside the transformer's blocks becomes an `Fp8Linear`:

- its weight W [N, K] is quantized once, at load, to float8 E4M3 with one float32 scale per output
  row: `s_w[n] = max_k |W[n, k]| / 448`, `W_q = round_e4m3(W / s_w)` (448 is E4M3's largest finite
  value, so every row uses the format's whole range);
- at each call the activations x [M, K] (M = all tokens) are quantized the same way per row
  (per token), dynamically: `s_x[m] = max_k |x[m, k]| / 448`;
- the GEMM is `torch._scaled_mm(x_q, W_q^T, scale_a=s_x [M, 1], scale_b=s_w^T [1, N], out_dtype=<model
  dtype>, bias=b)`: the products accumulate in float32, are multiplied by `s_x[m] * s_w[n]`, the
  bias added, and the result rounded once to the model dtype.

So `y = (x_q * s_x) (W_q * s_w)^T + b` exactly up to float32 accumulation and the final rounding
(test_cases/test_fp8_compute.py checks this on the CPU, whose `_scaled_mm` also takes rowwise scales).
E4M3 keeps 3 mantissa bits: each quantized element is within a relative 2^-4 of its value (normal
range), or an absolute 2^-10 * scale (subnormals), which bounds the error against the unquantized
layer (`error_bound`).

Which layers: every `nn.Linear` inside the module's block list (the `ModuleSpec.blocks` attribute, the
unit of regional compile) whose in and out features are multiples of 16 (the fp8 tensor cores' tile
rule) and whose weight is in the model dtype (layers a family keeps float32 stay so), except those
under the block-relative names the family lists in `ModuleSpec.fp8_skip` (modulation / AdaLN
projections: they turn the timestep into per-channel scales and shifts that multiply the whole
residual stream, a few GEMMs of one row per sample, so fp8 saves nothing there and costs accuracy).
Outside the blocks nothing changes: the patch/text/time embeddings, norms and the final projection
run once per step (not once per block), are a small share of the FLOPs and feed or produce the
latents directly.

Availability (`probe`): torch must have `float8_e4m3fn` and `torch._scaled_mm` with rowwise scales
for the model dtype on the device; on CUDA the device needs compute capability >= 8.9 (Ada/Hopper fp8
tensor cores). The probe runs the real call once on a tiny matmul and compares it with the float32
math of the same quantized values; it says why when it cannot.
"""

from __future__ import annotations

import torch
from loguru import logger
from torch import Tensor, nn

__all__ = ["E4M3_MAX", "Fp8Linear", "convert_blocks", "error_bound", "input_dtype", "probe", "quantize_rows"]

E4M3_MAX = 448.0
"""Largest finite float8 E4M3 (`torch.float8_e4m3fn`) value."""
E4M3_REL = 2.0 ** -4
"""Half an E4M3 unit in the last place, relative (3 mantissa bits): the rounding error of a normal value."""
E4M3_SUBNORMAL_ABS = 2.0 ** -10
"""Half the smallest E4M3 subnormal (2^-9): the rounding error of a value below the normal range, in scale units."""
TILE = 16
"""In and out features must be multiples of this (cuBLASLt's fp8 GEMM rule)."""
_MIN_AMAX = 1e-12
"""Floor of a row's max |value| (an all-zero row gets a tiny scale and quantizes to zeros)."""


def quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row E4M3 quantization.

    Args:
        t: [R, C] float tensor (any float dtype).

    Returns:
        (q [R, C] float8_e4m3fn, scale [R, 1] float32) with `q * scale ~= t`; `scale = max|row| / 448`.
    """
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX)  # [R, 1]
    scale = amax / E4M3_MAX  # [R, 1]
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # [R, C]
    return q, scale


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose weight is stored as float8 E4M3 with per-output-row scales and whose
    forward runs the fp8 GEMM (module docstring). Made in place from a linear by `Fp8Linear.convert`.

    Attributes:
        weight: [N, K] float8_e4m3fn parameter (no grad).
        weight_scale: [1, N] float32 buffer (the `scale_b` of `_scaled_mm`).
        bias: [N] in `out_dtype`, or None.
        out_dtype: the model dtype: the output's, and the dtype callers cast inputs to (`input_dtype`).
        bias_in_gemm: add the bias in the GEMM's epilogue (False where the probe found that torch
            refuses a bias with rowwise scales: then it is added after).
    """

    weight_scale: Tensor
    out_dtype: torch.dtype
    bias_in_gemm: bool

    @classmethod
    def convert(cls, linear: nn.Linear, bias_in_gemm: bool = True) -> "Fp8Linear":
        """Quantize `linear`'s weight (float32/bfloat16/float16, on any device) in place and make it an
        `Fp8Linear`; returns the same object. Its bias keeps its dtype (the model dtype)."""
        assert type(linear) is nn.Linear, f"only a plain nn.Linear converts (got {type(linear).__name__})"
        w = linear.weight.data
        q, scale = quantize_rows(w)  # [N, K] fp8, [N, 1] float32
        linear.__class__ = cls
        linear.weight = nn.Parameter(q, requires_grad=False)
        linear.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]
        linear.out_dtype = w.dtype  # type: ignore[attr-defined]
        linear.bias_in_gemm = bias_in_gemm  # type: ignore[attr-defined]
        return linear  # type: ignore[return-value]

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        """x: [..., K] (any float dtype) -> [..., N] in `out_dtype`."""
        K, N = self.in_features, self.out_features
        x2 = x.reshape(-1, K)  # [M, K]
        x_q, x_scale = quantize_rows(x2)  # [M, K] fp8, [M, 1] float32
        fused_bias = self.bias if self.bias_in_gemm else None
        y = torch._scaled_mm(x_q, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, bias=fused_bias,
                             out_dtype=self.out_dtype)  # [M, N]
        if self.bias is not None and not self.bias_in_gemm:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], N)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_e4m3 rowwise, out_dtype={self.out_dtype}"


def input_dtype(linear: nn.Linear) -> torch.dtype:
    """The dtype a block casts a linear layer's input to: the weight's, or an fp8 layer's model dtype
    (its weight is float8; the quantization happens inside its forward)."""
    return linear.out_dtype if isinstance(linear, Fp8Linear) else linear.weight.dtype


def error_bound(x: Tensor, w: Tensor) -> Tensor:
    """Largest |Fp8Linear(x) - x W^T| that E4M3 rounding of both operands can cause, per output element.

    Each quantized element differs from its value by at most `e = max(2^-4 |v|, 2^-10 scale)` (normal
    or subnormal range; per-row scales), so |x_q w_q - x w| <= |x| e_w + e_x |w| + e_x e_w summed over K.
    Float32 accumulation and the output rounding come on top (compare in float32 output).

    Args:
        x: [M, K], w: [N, K] float tensors. Returns [M, N] float32.
    """
    x, w = x.float(), w.float()
    sx = x.abs().amax(1, keepdim=True).clamp(min=_MIN_AMAX) / E4M3_MAX  # [M, 1]
    sw = w.abs().amax(1, keepdim=True).clamp(min=_MIN_AMAX) / E4M3_MAX  # [N, 1]
    ex = torch.maximum(E4M3_REL * x.abs(), E4M3_SUBNORMAL_ABS * sx)  # [M, K]
    ew = torch.maximum(E4M3_REL * w.abs(), E4M3_SUBNORMAL_ABS * sw)  # [N, K]
    return x.abs() @ ew.t() + ex @ w.abs().t() + ex @ ew.t()  # [M, N]


def eligible(linear: nn.Module, dtype: torch.dtype) -> str | None:
    """Why `linear` stays unquantized, or None when it converts: a plain `nn.Linear` in `dtype` whose
    features are multiples of 16."""
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__}, not a plain nn.Linear"
    if linear.weight.dtype != dtype:
        return f"weight kept in {linear.weight.dtype}"
    if linear.in_features % TILE or linear.out_features % TILE:
        return f"features {linear.in_features}->{linear.out_features} not multiples of {TILE}"
    return None


def convert_blocks(module: nn.Module, blocks_attr: str, skip: tuple[str, ...], dtype: torch.dtype,
                   bias_in_gemm: bool = True) -> tuple[list[str], dict[str, str]]:
    """Turn the eligible linear layers of `module.<blocks_attr>[i]` into `Fp8Linear`s, in place.

    Args:
        module: the transformer, its weights loaded (any device).
        blocks_attr: dotted attribute of its `nn.ModuleList` of blocks.
        skip: block-relative module names whose linear layers (the module and everything under it) stay
            unquantized, e.g. ("img_mod", "txt_mod").
        dtype: the model dtype (layers whose weight has another dtype stay).
        bias_in_gemm: see `Fp8Linear`.

    Returns:
        (converted names, {kept name: reason}), names relative to `module`.
    """
    blocks = module.get_submodule(blocks_attr)
    converted: list[str] = []
    kept: dict[str, str] = {}
    for i, block in enumerate(blocks):
        for name, sub in block.named_modules():
            if not isinstance(sub, nn.Linear):
                continue
            full = f"{blocks_attr}.{i}.{name}"
            if any(name == s or name.startswith(s + ".") for s in skip):
                kept[full] = "fp8_skip"
                continue
            why = eligible(sub, dtype)
            if why is not None:
                kept[full] = why
                continue
            Fp8Linear.convert(sub, bias_in_gemm)
            converted.append(full)
    return converted, kept


def probe(device: torch.device, dtype: torch.dtype) -> tuple[str | None, bool]:
    """Whether fp8 compute can run on `device` with output `dtype`, tried once on a tiny matmul.

    Returns:
        (reason it cannot, or None; whether the bias can go into the GEMM's epilogue).
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}: fp8 tensor cores "
                    "need 8.9 or later (Ada, Hopper, Blackwell)"), False
    elif device.type != "cpu":
        return f"no fp8 matmul on device type {device.type!r}", False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=gen)  # [M, K]
    w = torch.randn(32, 32, generator=gen)  # [N, K]
    b = torch.randn(32, generator=gen)  # [N]
    x_q, sx = quantize_rows(x)
    w_q, sw = quantize_rows(w)
    expected = (x_q.float() * sx) @ (w_q.float() * sw).t() + b.to(dtype).float()  # [M, N] float32
    tol = 4 * torch.finfo(dtype).eps * expected.abs().max().item()

    def run(with_bias: bool) -> str | None:
        try:
            got = torch._scaled_mm(x_q.to(device), w_q.to(device).t(), scale_a=sx.to(device),
                                   scale_b=sw.t().contiguous().to(device), out_dtype=dtype,
                                   bias=b.to(device, dtype) if with_bias else None)
            if not with_bias:
                got = got + b.to(device, dtype)
        except Exception as exc:  # noqa: BLE001 - any refusal of the op on the probe is the reason
            return f"torch {torch.__version__} torch._scaled_mm with rowwise scales and out_dtype {dtype} fails: " \
                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        err = (got.float().cpu() - expected).abs().max().item()
        if err > tol:
            return f"torch._scaled_mm differs from the float32 math by {err:.3g} on the probe (more than {tol:.3g})"
        return None

    why = run(with_bias=True)
    if why is None:
        return None, True
    if run(with_bias=False) is None:
        logger.info("fp8 compute: torch._scaled_mm refuses a bias with rowwise scales here ({}); the bias is added "
                    "after the GEMM", why)
        return None, False
    return why, False
