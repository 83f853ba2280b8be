"""Small layers the LTX-2 networks share: sinusoidal timestep features, the timestep MLP and the
tanh-GELU feed-forward, in diffusers' key layouts.

Source: diffusers 0.42.1 `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)`,
`TimestepEmbedding` and `FeedForward(activation_fn="gelu-approximate", bias=...)` (models/embeddings.py,
models/attention.py), as the LTX-2 transformer, text connectors and video VAE use them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.fused import linear_gelu_tanh

TIMESTEP_FEATURES = 256
"""Size of the sinusoidal timestep features (every LTX-2 timestep embedding takes 256)."""


def timestep_features(timestep: Tensor) -> Tensor:
    """Sinusoidal features, cos half then sin half, max period 10000, no frequency shift.

    Args:
        timestep: [N], any dtype (already scaled by the caller where the network scales it).

    Returns:
        [N, 256] float32.
    """
    half = TIMESTEP_FEATURES // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep.float()[:, None] * torch.exp(exponent)[None, :]  # [N, 128]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)  # [N, 256]


class TimestepMLP(nn.Module):
    """256 timestep features -> dim: linear_1, SiLU, linear_2 (diffusers `TimestepEmbedding`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(TIMESTEP_FEATURES, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, features: Tensor) -> Tensor:
        """[N, 256] -> [N, dim]."""
        return self.linear_2(F.silu(self.linear_1(features)))


class GELUProj(nn.Module):
    """Holder of `proj` (diffusers `GELU` key layout); the tanh GELU is applied by `FeedForward`."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=bias)


class FeedForward(nn.Module):
    """Linear(dim, 4 dim) -> tanh GELU -> Linear(4 dim, dim), in diffusers' keys `net.0.proj`, `net.2`
    (`net.1` stands where diffusers keeps a no-op Dropout).

    The GELU runs in the first GEMM's epilogue on CUDA (`runnerkit.fused.linear_gelu_tanh`) when the
    linears have biases; `bias=False` (LTX-2.5's video FFN: no `net.0.proj.bias`, `net.2.bias`) runs it
    unfused.
    """

    def __init__(self, dim: int, bias: bool = True) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, 4 * dim, bias), nn.Identity(), nn.Linear(4 * dim, dim, bias=bias)])

    def forward(self, x: Tensor) -> Tensor:
        """[..., dim] -> [..., dim]."""
        proj = self.net[0].proj
        assert isinstance(proj, nn.Linear), "net.0 is a GELUProj"
        return self.net[2](linear_gelu_tanh(x, proj))
