"""Building blocks of the LTX-2 video VAE: padded 3D conv, residual block, space-to-depth
downsampler, depth-to-space upsampler, decode-timestep embedding.

Design source: Lightricks LTX-2 (`ltx-core` video VAE) as ported by diffusers 0.42.1
(`models/autoencoders/autoencoder_kl_ltx2.py`); module and parameter names are diffusers' so a
diffusers-layout state dict loads strictly. Causality and the spatial padding mode are fixed when
a block is built (the encoder and decoder each have one setting in every release).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.models.ltx2.layers import TimestepMLP, timestep_features
from runnerkit.models.ltx2.vae_arch import STRIDES, PaddingMode

PIXEL_NORM_EPS = 1e-8
"""Epsilon of the parameter-free per-pixel RMS norm over channels (diffusers `PerChannelRMSNorm`)."""
def pixel_norm(x: Tensor) -> Tensor:
    """RMS-normalise every pixel over its channels: x / sqrt(mean_c(x^2) + 1e-8). [B, C, ...] -> same."""
    return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + PIXEL_NORM_EPS)


def space_to_depth(x: Tensor, stride: tuple[int, int, int]) -> Tensor:
    """Fold (t, h, w) blocks into channels: [B, C, F, H, W] -> [B, C*t*h*w, F/t, H/h, W/w].

    Channel order (c, t, h, w), as the LTX-2 downsampler's residual expects.
    """
    st, sh, sw = stride
    x = x.unflatten(4, (-1, sw)).unflatten(3, (-1, sh)).unflatten(2, (-1, st))  # [B, C, F', t, H', h, W', w]
    return x.permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(1, 4)  # [B, C*t*h*w, F', H', W']


def depth_to_space(x: Tensor, stride: tuple[int, int, int]) -> Tensor:
    """Unfold channels into (t, h, w) blocks: [B, C*t*h*w, F, H, W] -> [B, C, F*t, H*h, W*w]."""
    B, _, Fr, H, W = x.shape
    st, sh, sw = stride
    x = x.reshape(B, -1, st, sh, sw, Fr, H, W)  # [B, C, t, h, w, F, H, W]
    return x.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)  # [B, C, F*t, H*h, W*w]


class TimeEmbedder(nn.Module):
    """Decode-timestep embedding; holds `timestep_embedder` for diffusers' key names
    (`PixArtAlphaCombinedTimestepSizeEmbeddings` without size conditioning)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepMLP(dim)

    def forward(self, timestep: Tensor, dtype: torch.dtype) -> Tensor:
        """[B] scaled timestep -> [B, dim, 1, 1, 1] in `dtype`."""
        emb = self.timestep_embedder(timestep_features(timestep).to(dtype))  # [B, dim]
        return emb[:, :, None, None, None]


class CausalConv3d(nn.Module):
    """3D conv that pads time by repeating edge frames, space with `padding_mode`.

    Causal: k_t - 1 copies of the first frame before it. Non-causal: (k_t - 1) / 2 copies of the
    first frame before and of the last frame after. Frames out = frames in (stride 1).
    """

    def __init__(self, in_channels: int, out_channels: int, causal: bool, padding_mode: PaddingMode,
                 kernel_size: int = 3, stride: tuple[int, int, int] = (1, 1, 1)) -> None:
        super().__init__()
        self.causal = causal
        self.time_kernel = kernel_size
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride=stride,
                              padding=(0, kernel_size // 2, kernel_size // 2), padding_mode=padding_mode)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, F, H, W] -> [B, C', F, H, W] (divided by the stride where one is set)."""
        pad = self.time_kernel - 1
        if self.causal:
            x = torch.cat([x[:, :, :1].expand(-1, -1, pad, -1, -1), x], dim=2)  # [B, C, F + k - 1, H, W]
        else:
            first = x[:, :, :1].expand(-1, -1, pad // 2, -1, -1)
            last = x[:, :, -1:].expand(-1, -1, pad // 2, -1, -1)
            x = torch.cat([first, x, last], dim=2)  # [B, C, F + k - 1, H, W]
        return self.conv(x)


class ResnetBlock3d(nn.Module):
    """Pixel norm -> [AdaLN] -> SiLU -> conv -> [noise] -> pixel norm -> [AdaLN] -> SiLU -> conv
    -> [noise], plus a shortcut (LayerNorm + 1x1x1 conv when the channels change)."""

    def __init__(self, in_channels: int, out_channels: int, causal: bool, padding_mode: PaddingMode,
                 eps: float, inject_noise: bool = False, timestep_conditioning: bool = False) -> None:
        super().__init__()
        self.conv1 = CausalConv3d(in_channels, out_channels, causal, padding_mode)
        self.conv2 = CausalConv3d(out_channels, out_channels, causal, padding_mode)
        self.norm3: nn.LayerNorm | None = None
        self.conv_shortcut: nn.Conv3d | None = None
        if in_channels != out_channels:
            self.norm3 = nn.LayerNorm(in_channels, eps=eps, elementwise_affine=True)
            self.conv_shortcut = nn.Conv3d(in_channels, out_channels, kernel_size=1)
        self.per_channel_scale1: nn.Parameter | None = None
        self.per_channel_scale2: nn.Parameter | None = None
        if inject_noise:
            self.per_channel_scale1 = nn.Parameter(torch.zeros(in_channels, 1, 1))
            self.per_channel_scale2 = nn.Parameter(torch.zeros(in_channels, 1, 1))
        self.scale_shift_table: nn.Parameter | None = None
        if timestep_conditioning:
            self.scale_shift_table = nn.Parameter(torch.zeros(4, in_channels))

    @staticmethod
    def _add_noise(x: Tensor, scale: Tensor, generator: torch.Generator | None) -> Tensor:
        # One [H, W] noise plane shared by all channels and frames, scaled per channel.
        noise = torch.randn(x.shape[-2:], generator=generator, device=x.device, dtype=x.dtype)  # [H, W]
        return x + (noise[None] * scale)[None, :, None]  # [1, C, 1, H, W]

    def forward(self, x: Tensor, temb: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """x [B, C, F, H, W], temb [B, 4C, 1, 1, 1] (conditioned blocks) -> [B, C', F, H, W].

        `generator` drives the noise injection (None: the global RNG, as diffusers' decoder)."""
        h = pixel_norm(x)
        if self.scale_shift_table is not None:
            assert temb is not None, "a timestep-conditioned block needs the embedded timestep"
            table = self.scale_shift_table[None, :, :, None, None, None]  # [1, 4, C, 1, 1, 1]
            mod = temb.unflatten(1, (4, -1)) + table  # [B, 4, C, 1, 1, 1]
            shift1, scale1, shift2, scale2 = mod.unbind(dim=1)
            h = h * (1 + scale1) + shift1
        h = self.conv1(F.silu(h))
        if self.per_channel_scale1 is not None:
            h = self._add_noise(h, self.per_channel_scale1, generator)
        h = pixel_norm(h)
        if self.scale_shift_table is not None:
            h = h * (1 + scale2) + shift2
        h = self.conv2(F.silu(h))
        if self.per_channel_scale2 is not None:
            h = self._add_noise(h, self.per_channel_scale2, generator)
        if self.norm3 is not None:
            x = self.norm3(x.movedim(1, -1)).movedim(-1, 1)  # LayerNorm over channels
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return h + x


class Downsampler3d(nn.Module):
    """Space-to-depth downsampling: conv to out / (t h w) channels then fold the blocks into
    channels, plus the folded input averaged over groups of channels (a parameter-free residual).

    For a temporal stride of 2 the first frame is repeated once in front, so 1 + 8k frames give
    1 + 4k (the causal frame layout is kept)."""

    def __init__(self, in_channels: int, out_channels: int, stride: tuple[int, int, int], causal: bool,
                 padding_mode: PaddingMode) -> None:
        super().__init__()
        self.stride = stride
        volume = math.prod(stride)
        self.group_size = in_channels * volume // out_channels
        self.conv = CausalConv3d(in_channels, out_channels // volume, causal, padding_mode)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, F, H, W] -> [B, C_out, (F + t - 1) / t, H / h, W / w]."""
        x = torch.cat([x[:, :, : self.stride[0] - 1], x], dim=2)  # [B, C, F + t - 1, H, W]
        residual = space_to_depth(x, self.stride)  # [B, C*thw, F', H', W']
        residual = residual.unflatten(1, (-1, self.group_size)).mean(dim=2)  # [B, C_out, F', H', W']
        return space_to_depth(self.conv(x), self.stride) + residual


class Upsampler3d(nn.Module):
    """Depth-to-space upsampling: conv to C * (t h w) / factor channels, unfold into (t, h, w)
    blocks, drop the first t - 1 frames (1 + k frames give 1 + t k). With `residual`, the unfolded
    input repeated over channels is added (LTX-2.0; LTX-2.3 has none)."""

    def __init__(self, in_channels: int, stride: tuple[int, int, int], residual: bool, factor: int, causal: bool,
                 padding_mode: PaddingMode) -> None:
        super().__init__()
        self.stride = stride
        self.residual = residual
        self.repeats = math.prod(stride) // factor
        self.conv = CausalConv3d(in_channels, in_channels * math.prod(stride) // factor, causal, padding_mode)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, F, H, W] -> [B, C / factor, t (F - 1) + 1, h H, w W]."""
        drop = self.stride[0] - 1
        h = depth_to_space(self.conv(x), self.stride)[:, :, drop:]  # [B, C/factor, tF - drop, hH, wW]
        if self.residual:
            residual = depth_to_space(x, self.stride).repeat(1, self.repeats, 1, 1, 1)[:, :, drop:]
            h = h + residual
        return h


def make_downsampler(kind: str, in_channels: int, out_channels: int, causal: bool,
                     padding_mode: PaddingMode) -> nn.Module:
    """The encoder block's downsampler: a stride-2 conv ('conv', channels kept) or space-to-depth."""
    if kind == "conv":
        return CausalConv3d(in_channels, in_channels, causal, padding_mode, stride=(2, 2, 2))
    return Downsampler3d(in_channels, out_channels, STRIDES[kind], causal, padding_mode)
