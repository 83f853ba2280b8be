"""Rotary position embedding (RoPE) on interleaved channel pairs, as the families' transformers
apply it to queries and keys (Su et al. 2021, "RoFormer", arXiv:2104.09864).

The cos / sin tables are the family's (their axes and frequencies differ); the rotation is shared.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
