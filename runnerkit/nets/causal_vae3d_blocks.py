"""Building blocks of the causal 3D video VAE (`causal_vae3d.py`).

Design and module names follow the 2.1 release's reference VAE (its `modules/vae.py`; the
repository is named in docs/architecture.md, "Shared code"), so its released `.pth` loads
without renaming (`residual.0.gamma`, `resample.1.weight`, ...); diffusers ports it as
`AutoencoderKLWan`.

Video is processed in chunks along time. Every causal convolution keeps the last `CACHE_T`
frames it saw in a `FeatureCache` and puts them in front of the next chunk, so chunked
processing matches running the causal network over the whole video at once.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Frames a causal 3x3x3 convolution needs from the previous chunk (its temporal padding).
CACHE_T = 2

ResampleMode = Literal["upsample2d", "upsample3d", "downsample2d", "downsample3d"]


class FeatureCache:
    """The tail frames each layer saw in the previous chunk (the reference's `feat_cache`).

    Keyed by the layer itself rather than by call order (the reference's `feat_idx` counter), so
    a layer always reads back its own frames. One cache serves one encode or decode call; once
    closed it frees its tensors and refuses further use, so a stale iterator fails loudly
    instead of decoding without its history.
    """

    def __init__(self) -> None:
        self._frames: dict[nn.Module, Tensor] = {}
        self._closed = False

    def get(self, layer: nn.Module) -> Tensor | None:
        """Frames `layer` stored during the previous chunk, or None in the first chunk."""
        self._check_open()
        return self._frames.get(layer)

    def put(self, layer: nn.Module, frames: Tensor) -> None:
        """Store `frames` [B, C, T<=CACHE_T, H, W] for `layer`'s next chunk."""
        self._check_open()
        self._frames[layer] = frames

    def close(self) -> None:
        """Free the stored frames; later `get`/`put` raise."""
        self._frames.clear()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the VAE feature cache was cleared while an encode/decode was in progress "
                               "(clear_cache(), or a newer encode/decode call)")

    def __len__(self) -> int:
        return len(self._frames)


class CausalConv3d(nn.Conv3d):
    """3D convolution that pads time only in front, so output frame t sees input frames <= t.

    `padding` is given as for `nn.Conv3d`; the 2 * padding_t temporal padding goes entirely
    before the first frame (zeros, or the cached frames of the previous chunk).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int, int],
                 stride: int | tuple[int, int, int] = 1, padding: int | tuple[int, int, int] = 0) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        pad_t, pad_h, pad_w = (padding,) * 3 if isinstance(padding, int) else padding
        # F.pad order: (W left, W right, H top, H bottom, T front, T back).
        self.causal_padding = (pad_w, pad_w, pad_h, pad_h, 2 * pad_t, 0)

    def conv_after(self, x: Tensor, previous: Tensor | None) -> Tensor:
        """Convolve `x` [B, C, T, H, W] as the continuation of `previous` [B, C, P, H, W].

        The previous frames replace P frames of the front zero padding; a kernel without
        temporal padding ignores them.
        """
        padding = list(self.causal_padding)
        if previous is not None and padding[4] > 0:
            x = torch.cat([previous, x], dim=2)  # [B, C, P + T, H, W]
            padding[4] -= previous.shape[2]
        return super().forward(F.pad(x, padding))

    def forward(self, x: Tensor, cache: FeatureCache | None = None) -> Tensor:
        """Causal convolution of `x` [B, C, T, H, W]; with `cache`, continue the previous chunk."""
        if cache is None:
            return self.conv_after(x, None)
        previous = cache.get(self)
        tail = x[:, :, -CACHE_T:].clone()  # [B, C, min(T, 2), H, W]
        if tail.shape[2] < CACHE_T and previous is not None:
            # A one-frame chunk: keep the last frame of the previous chunk too.
            tail = torch.cat([previous[:, :, -1:], tail], dim=2)  # [B, C, 2, H, W]
        cache.put(self, tail)
        return self.conv_after(x, previous)


class RMSNorm(nn.Module):
    """RMS norm over channels (dim 1): x / ||x||_2 * sqrt(C) * gamma, no bias (as in the reference VAE).

    Args:
        dim: channels C.
        images: True for [N, C, H, W] inputs (gamma [C, 1, 1]), False for [B, C, T, H, W]
            (gamma [C, 1, 1, 1]).
    """

    def __init__(self, dim: int, images: bool) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))

    def forward(self, x: Tensor) -> Tensor:
        # Half-precision inputs are normalized in float32, as torch.autocast runs `norm` in the
        # reference and as diffusers does explicitly.
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        normalized = F.normalize(x.float() if low_precision else x, dim=1).to(x.dtype)
        return normalized * self.scale * self.gamma


class ResidualBlock(nn.Module):
    """norm -> SiLU -> causal conv 3x3x3 -> norm -> SiLU -> (dropout) -> causal conv, plus shortcut.

    The layers sit in one `nn.Sequential` named `residual` so the key names are the reference's
    (`residual.0.gamma`, `residual.2.weight`, ..., `residual.6.weight`, `shortcut.weight`).
    """

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            RMSNorm(in_dim, images=False),
            nn.SiLU(),
            CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMSNorm(out_dim, images=False),
            nn.SiLU(),
            nn.Identity(),  # dropout in training; inference only here
            CausalConv3d(out_dim, out_dim, 3, padding=1),
        )
        self.shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: Tensor, cache: FeatureCache) -> Tensor:
        """[B, in_dim, T, H, W] -> [B, out_dim, T, H, W]."""
        norm1, act1, conv1, norm2, act2, dropout, conv2 = self.residual
        h = self.shortcut(x)  # a 1x1x1 kernel needs no cached frames
        x = conv1(act1(norm1(x)), cache)
        x = conv2(dropout(act2(norm2(x))), cache)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame separately (no temporal mixing)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, T, H, W] -> [B, C, T, H, W]."""
        B, C, T, H, W = x.shape
        identity = x
        x = x.permute(0, 2, 1, 3, 4).reshape(B * T, C, H, W)  # [B*T, C, H, W]
        qkv = self.to_qkv(self.norm(x))  # [B*T, 3C, H, W]
        # Contiguous as in the reference: SDPA's bf16 result depends on the memory layout.
        qkv = qkv.reshape(B * T, 1, 3 * C, H * W).transpose(2, 3).contiguous()  # [B*T, 1, H*W, 3C]
        q, k, v = qkv.chunk(3, dim=-1)  # [B*T, 1, H*W, C] each
        x = F.scaled_dot_product_attention(q, k, v)  # [B*T, 1, H*W, C]
        x = x.squeeze(1).transpose(1, 2).reshape(B * T, C, H, W)  # [B*T, C, H, W]
        x = self.proj(x)
        x = x.view(B, T, C, H, W).permute(0, 2, 1, 3, 4)  # [B, C, T, H, W]
        return x + identity


class Resample(nn.Module):
    """2x spatial resampling per frame, and for the `3d` modes 2x temporal resampling.

    - `upsample2d`: nearest 2x, conv 3x3 to dim // 2 channels.
    - `upsample3d`: as upsample2d, preceded by a causal time conv to 2 * dim channels whose two
      halves become two consecutive frames (T -> 2T); the first chunk is not doubled.
    - `downsample2d`: pad right/bottom by 1, conv 3x3 stride 2.
    - `downsample3d`: as downsample2d, followed by a time conv (3, 1, 1) with stride 2 over
      [last frame of the previous chunk, chunk]; the first chunk passes through unchanged.
    """

    def __init__(self, dim: int, mode: ResampleMode) -> None:
        super().__init__()
        self.mode = mode
        if mode in ("upsample2d", "upsample3d"):
            # Nearest-neighbour 2x only copies values, so it runs in the input dtype (the
            # reference upcasts to float32 for old bf16 kernels; the values are the same).
            self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                          nn.Conv2d(dim, dim // 2, 3, padding=1))
        elif mode in ("downsample2d", "downsample3d"):
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        else:
            raise ValueError(f"`mode` must be one of upsample2d, upsample3d, downsample2d, downsample3d; got {mode!r}")
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=0)

    def forward(self, x: Tensor, cache: FeatureCache) -> Tensor:
        """[B, C, T, H, W] -> upsample: [B, C/2, T', 2H, 2W]; downsample: [B, C, T', H/2, W/2].

        T' = T for the 2d modes and for the first chunk; 2T (upsample3d) or T/2 (downsample3d,
        T even) for later chunks.
        """
        if self.mode == "upsample3d":
            x = self._double_frames(x, cache)
        B, C, T, H, W = x.shape
        x = x.permute(0, 2, 1, 3, 4).reshape(B * T, C, H, W)  # [B*T, C, H, W]
        x = self.resample(x)  # [B*T, C', H', W']
        x = x.view(B, T, *x.shape[1:]).permute(0, 2, 1, 3, 4)  # [B, C', T, H', W']
        if self.mode == "downsample3d":
            x = self._halve_frames(x, cache)
        return x

    def _double_frames(self, x: Tensor, cache: FeatureCache) -> Tensor:
        B, C, T, H, W = x.shape
        previous = cache.get(self.time_conv)
        if previous is None:
            # First chunk (the first frame of the video) is not doubled. Zeros stand for the
            # frames before the video: the same values the reference's zero padding uses.
            cache.put(self.time_conv, x.new_zeros(B, C, CACHE_T, H, W))
            return x
        tail = x[:, :, -CACHE_T:].clone()  # [B, C, min(T, 2), H, W]
        if tail.shape[2] < CACHE_T:
            tail = torch.cat([previous[:, :, -1:], tail], dim=2)  # [B, C, 2, H, W]
        cache.put(self.time_conv, tail)
        x = self.time_conv.conv_after(x, previous)  # [B, 2C, T, H, W]
        # Channel half 0 is the earlier frame of each pair, half 1 the later one.
        x = x.view(B, 2, C, T, H, W).permute(0, 2, 3, 1, 4, 5)  # [B, C, T, 2, H, W]
        return x.reshape(B, C, 2 * T, H, W)  # [B, C, 2T, H, W]

    def _halve_frames(self, x: Tensor, cache: FeatureCache) -> Tensor:
        previous = cache.get(self.time_conv)
        cache.put(self.time_conv, x[:, :, -1:].clone())  # [B, C, 1, H, W]
        if previous is None:
            return x  # first chunk: its single frame stays
        x = torch.cat([previous[:, :, -1:], x], dim=2)  # [B, C, 1 + T, H, W]
        return self.time_conv.conv_after(x, None)  # [B, C, T/2, H, W]


class Encoder3d(nn.Module):
    """Video [B, 3, T, H, W] -> posterior parameters [B, out_dim, T', H/s, W/s] (mean and log-variance).

    Args:
        dim: base channels; level i has dim * dim_mult[i] channels.
        out_dim: output channels (2 * z_dim: mean and log-variance).
        dim_mult: channel multiplier per level; every level but the last halves H and W.
        num_res_blocks: residual blocks per level.
        temporal_downsample: per level but the last, whether it also halves time.
    """

    def __init__(self, dim: int, out_dim: int, dim_mult: tuple[int, ...], num_res_blocks: int,
                 temporal_downsample: tuple[bool, ...]) -> None:
        super().__init__()
        dims = [dim * m for m in (1, *dim_mult)]
        self.conv1 = CausalConv3d(3, dims[0], 3, padding=1)
        downsamples: list[nn.Module] = []
        for level, (in_dim, level_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(num_res_blocks):
                downsamples.append(ResidualBlock(in_dim, level_dim))
                in_dim = level_dim
            if level != len(dim_mult) - 1:
                downsamples.append(Resample(level_dim, "downsample3d" if temporal_downsample[level] else "downsample2d"))
        self.downsamples = nn.Sequential(*downsamples)
        self.middle = nn.Sequential(ResidualBlock(dims[-1], dims[-1]), AttentionBlock(dims[-1]),
                                    ResidualBlock(dims[-1], dims[-1]))
        self.head = nn.Sequential(RMSNorm(dims[-1], images=False), nn.SiLU(),
                                  CausalConv3d(dims[-1], out_dim, 3, padding=1))

    def forward(self, x: Tensor, cache: FeatureCache) -> Tensor:
        """One chunk [B, 3, T, H, W] (T = 1 first, then 4) -> [B, out_dim, T', H/s, W/s]."""
        x = self.conv1(x, cache)
        for block in self.downsamples:
            x = block(x, cache)
        res1, attention, res2 = self.middle
        x = res2(attention(res1(x, cache)), cache)
        norm, act, conv = self.head
        return conv(act(norm(x)), cache)


class Decoder3d(nn.Module):
    """Latents [B, z_dim, T, h, w] -> video [B, 3, T', h*s, w*s] (before clamping).

    Args are as for `Encoder3d`, mirrored: levels run from dim * dim_mult[-1] down to
    dim * dim_mult[0]; each level but the last upsamples, in time too where
    `temporal_upsample[level]` is set; every upsample halves the channels, so each level after
    the first starts from half the previous level's channels.
    """

    def __init__(self, dim: int, z_dim: int, dim_mult: tuple[int, ...], num_res_blocks: int,
                 temporal_upsample: tuple[bool, ...]) -> None:
        super().__init__()
        dims = [dim * m for m in (dim_mult[-1], *dim_mult[::-1])]
        self.conv1 = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResidualBlock(dims[0], dims[0]), AttentionBlock(dims[0]),
                                    ResidualBlock(dims[0], dims[0]))
        upsamples: list[nn.Module] = []
        for level, (in_dim, level_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if level > 0:
                in_dim = in_dim // 2  # the previous level's upsample halved the channels
            for _ in range(num_res_blocks + 1):
                upsamples.append(ResidualBlock(in_dim, level_dim))
                in_dim = level_dim
            if level != len(dim_mult) - 1:
                upsamples.append(Resample(level_dim, "upsample3d" if temporal_upsample[level] else "upsample2d"))
        self.upsamples = nn.Sequential(*upsamples)
        self.head = nn.Sequential(RMSNorm(dims[-1], images=False), nn.SiLU(),
                                  CausalConv3d(dims[-1], 3, 3, padding=1))

    def forward(self, x: Tensor, cache: FeatureCache) -> Tensor:
        """One latent frame [B, z_dim, 1, h, w] -> [B, 3, 1 (first) or 4 (later), h*s, w*s]."""
        x = self.conv1(x, cache)
        res1, attention, res2 = self.middle
        x = res2(attention(res1(x, cache)), cache)
        for block in self.upsamples:
            x = block(x, cache)
        norm, act, conv = self.head
        return conv(act(norm(x)), cache)
