"""Hand-fused operators that the compiler leaves unfused.

`linear_gelu_tanh` puts the tanh-approximated GELU of a transformer's MLP into the epilogue of its
first GEMM on CUDA. Inductor fuses elementwise chains into Triton kernels but does not fuse an
activation into a cuBLAS GEMM (only its max-autotune Triton templates do), so without this the
GELU is a kernel of its own that reads and writes the whole [tokens, ffn_dim] activation: with
32760 tokens, ffn_dim 8960 and CFG (2 passes), 2 x 1.17 GB per block.

On CUDA it calls `torch._addmm_activation(bias, x, weight.T, use_gelu=True)`, which cuBLASLt runs
with its GELU_BIAS epilogue (the tanh approximation, applied to the float32 accumulator before the
one rounding to the output dtype); inductor keeps that op as an extern kernel (it has no
decomposition), so compiled blocks get the fused GEMM too. Where cuBLASLt cannot take the call,
torch runs the GEMM and then an in-place tanh GELU: same values, no saving. On the CPU,
`_addmm_activation` computes the exact (erf) GELU instead, so the CPU keeps the unfused ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


ENABLED = True
"""Use the fused CUDA path. bench/speed.py turns it off for its unfused arms; nothing else should."""


def linear_gelu_tanh(x: Tensor, linear: nn.Linear) -> Tensor:
    """`gelu(linear(x), approximate="tanh")`, the GELU fused into the GEMM on CUDA.

    Args:
        x: [..., in_features] activations, in `linear`'s weight dtype for the fused path.
        linear: an `nn.Linear` (bias or not).

    Returns:
        [..., out_features] in x's dtype. On CUDA (fused) the values differ from the unfused ops'
        by the rounding of the intermediate GEMM output (at most about one unit in the last place
        of the output dtype); elsewhere they are the unfused ops' bit for bit.
    """
    if type(linear).forward is not nn.Linear.forward:  # a linear with its own GEMM: unfused LoRA (its update
        return F.gelu(linear(x), approximate="tanh")  # joins the output first), fp8 compute (runnerkit/fp8_compute.py)
    w, b = linear.weight, linear.bias
    if not (ENABLED and x.is_cuda and b is not None and x.dtype == w.dtype == b.dtype and x.dim() >= 2):
        return F.gelu(F.linear(x, w, b), approximate="tanh")
    out = torch._addmm_activation(b, x.reshape(-1, x.shape[-1]), w.t(), use_gelu=True)
    return out.view(*x.shape[:-1], w.shape[0])


class TanhGELUMLP(nn.Sequential):
    """Linear -> tanh GELU -> Linear, keeping `nn.Sequential`'s children and state-dict keys
    (`0.weight`, `2.weight`; `1` is the `nn.GELU(approximate="tanh")` that the fused path stands in for).

    Args: x [..., in_features]. Returns [..., out_features] in the second Linear's output dtype.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int) -> None:
        super().__init__(nn.Linear(in_features, hidden_features), nn.GELU(approximate="tanh"),
                         nn.Linear(hidden_features, out_features))

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return self[2](linear_gelu_tanh(x, self[0]))
