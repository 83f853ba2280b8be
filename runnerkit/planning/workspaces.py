"""Kernel workspaces the families' memory estimates share (`models/<family>/estimate.py`).

Units: bytes. A family's estimate counts the tensors its own forward code keeps alive; what a
PyTorch kernel allocates besides its output is the same for every family and lives here.
Measured on the CPU with torch 2.13 (`torch.profiler` peaks, see the families'
`test_cases/models/<family>/test_estimate.py`) or bounded on CUDA (`bench/estimate_vs_peak.py`).
"""

from __future__ import annotations

import math

import torch

F32 = 4
"""Bytes per float32 element (norms, modulation tables, RoPE tables and VAEs run in float32)."""
#: PyTorch's CPU convolution dispatch (float32, kernels <= 3): oneDNN when N*C*T*H (5-D input) or
#: N*C*H*W (4-D) exceeds this, else the slow im2col kernels (measured with torch 2.13).
CPU_MKLDNN_MIN_ELEMENTS = 20480
#: cuDNN's workspace is chosen at run time; bounded by this many copies of the convolution's input
#: (+ its weights). Calibrated on the H200 runs of bench/results (the 1.3B text-to-video model at
#: 480x832x81: its VAE decode peaks 9.68 GiB above the weights, cold_start_h200.md: 23.41 - 13.73
#: GiB); checked by bench/estimate_vs_peak.py.
CUDA_CONV_WORKSPACE_INPUTS = 2
#: Tiles of the CPU flash-attention kernel: query and key/value block sizes (upper bounds).
CPU_SDPA_Q_SPLIT, CPU_SDPA_KV_SPLIT = 256, 512


def _threads() -> int:
    return max(1, torch.get_num_threads())


def sdpa_workspace(device_type: str, heads: int, q_len: int, head_dim: int, s: int) -> int:
    """Bytes the fused attention kernel allocates besides its output.

    CPU (`_scaled_dot_product_flash_attention_for_cpu`): per thread a 256 x 512 float32 score tile
    (plus one in the compute dtype when it is not float32) and a 256 x head_dim output tile.
    CUDA (flash / memory-efficient): the float32 log-sum-exp [heads, q_len].

    Args:
        device_type: 'cpu' or 'cuda'; s: bytes per element of the compute dtype.
    """
    if device_type == "cpu":
        scores = CPU_SDPA_Q_SPLIT * CPU_SDPA_KV_SPLIT * (F32 + (s if s != F32 else 0))
        return _threads() * (scores + CPU_SDPA_Q_SPLIT * (head_dim + 2) * F32)
    return 2 * heads * q_len * F32


def conv_workspace(device_type: str, in_shape: tuple[int, ...], in_bytes: int, out_positions: int, kernel_numel: int,
                   weight_bytes: int, out_bytes: int, e: int = F32) -> int:
    """Workspace of one convolution.

    On the CPU, the im2col buffer (C_in * k^3 x output positions) of the slow kernels PyTorch
    picks when N * C * T * H <= `CPU_MKLDNN_MIN_ELEMENTS` (measured: `slow_conv3d_forward`,
    `_slow_conv2d_forward`), else the oneDNN reorder of input and weights (measured <= input +
    weights + half the larger of input and output); on CUDA `CUDA_CONV_WORKSPACE_INPUTS` x input
    + weights (cuDNN picks its algorithm and workspace at run time).

    Args:
        in_shape: the (padded) input's shape, [N, C, T, H, W] or [N, C, H, W].
        in_bytes: its bytes; out_positions: N x output positions; kernel_numel: k_t*k_h*k_w.
        e: bytes per element of the input (float32 by default).
    """
    if device_type == "cpu":
        if math.prod(in_shape[:4]) <= CPU_MKLDNN_MIN_ELEMENTS:
            return in_shape[1] * kernel_numel * out_positions * e  # im2col columns
        return in_bytes + weight_bytes + max(in_bytes, out_bytes) // 2
    return CUDA_CONV_WORKSPACE_INPUTS * in_bytes + weight_bytes
