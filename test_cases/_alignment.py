"""Place tensors at chosen byte alignments, and check where a module's weights sit.

Independent of `runnerkit.weights`: addresses are read with `data_ptr()` and the alignment the
guarantee promises (64 bytes, the widest x86-64 vector) is written out here, not imported.
"""

from __future__ import annotations

import torch
from torch import nn

ALIGNED = 64  # bytes


def copy_at_residue(tensor: torch.Tensor, residue: int) -> torch.Tensor:
    """A contiguous CPU copy of `tensor` starting at an address == `residue` (mod 64 bytes).

    Stands in for a tensor that aliases a file mapping at that offset. `residue` must be a
    multiple of the item size (e.g. 4 for float32: the worst case a safetensors file allows).
    """
    nbytes = tensor.numel() * tensor.element_size()
    buffer = torch.empty(nbytes + 2 * ALIGNED, dtype=torch.uint8)
    start = (residue - buffer.data_ptr()) % ALIGNED
    out = buffer[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    assert out.data_ptr() % ALIGNED == residue
    return out


def misaligned_weights(module: nn.Module) -> list[str]:
    """Names of the CPU parameters and buffers of `module` that are not contiguous at a 64-byte address."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return [f"{name} (address % 64 = {t.data_ptr() % ALIGNED})" for name, t in tensors
            if t.device.type == "cpu" and t.numel() and (t.data_ptr() % ALIGNED or not t.is_contiguous())]
