"""LTX-2 latent upsampler (x2 spatial) and the latent handling around it between the two stages.

Design source: Lightricks LTX-2 spatial upscaler (`ltx-2-spatial-upscaler-x2-1.0.safetensors`,
LTX-2.3's `ltx-2.3-spatial-upscaler-x2`), as ported by diffusers 0.42.1
(`pipelines/ltx2/latent_upsampler.py` `LTX2LatentUpsamplerModel`, and
`pipeline_ltx2_latent_upsample.py` `LTX2LatentUpsamplePipeline`); parity-tested against both.
Parameter names are diffusers' (which are also the release file's: diffusers loads that file
strictly without renaming).

The network: 3D conv + GroupNorm + SiLU, residual blocks, a per-frame 2D conv to 4x channels and
pixel shuffle (x2 height and width), residual blocks, 3D conv back to the latent channels. LTX-2.0
stores the x2 stage as diffusers' `SpatialRationalResampler` (`upsampler.conv`, plus a binomial
blur kernel `upsampler.blur_down.kernel` that a x2 scale never uses: stride 1), LTX-2.3 as a plain
`upsampler.0` conv; both compute the same thing.

The upsampler works on RAW latents (diffusers: "latent upsampler operates on the unnormalized
latents"): the two-stage chain (diffusers docs, "two-stage generation") is stage 1 with
output_type="latent" (de-normalised), `LTX2LatentUpsamplePipeline(latents=..., latents_normalized=False,
output_type="latent")`, then stage 2's `prepare_latents` normalises again. `upsample_normalized_latents`
is that chain for latents kept normalised.

Not covered: temporal upscalers (`temporal_upsample`), `dims=2` upsamplers, rational scales other
than x2 (x1.5 etc.), which no model of this pipeline uses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from runnerkit.models.ltx2.vae import denormalize_latents, normalize_latents
from runnerkit.weights import load_on_meta

GROUPS = 32
"""GroupNorm groups of every norm of the upsampler (`mid_channels` must be a multiple)."""


class LTX2LatentUpsamplerArch(BaseModel):
    """x2 spatial latent upsampler; defaults are the LTX-2.0 release (diffusers conversion "2.0")."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    in_channels: int = Field(128, gt=0, description="Latent channels (the VAE's).")
    mid_channels: int = Field(1024, gt=0, multiple_of=GROUPS, description="Width of the residual blocks.")
    num_blocks_per_stage: int = Field(4, ge=0, description="Residual blocks before and after the upsampling.")
    use_rational_resampler: bool = Field(
        True, description="Key layout of the x2 stage: `upsampler.conv` + `upsampler.blur_down.kernel` "
                          "(LTX-2.0) or `upsampler.0` (LTX-2.3). Same computation.")

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> LTX2LatentUpsamplerArch:
        """Read diffusers' `latent_upsampler/config.json` (`LTX2LatentUpsamplerModel`).

        Raises:
            NotImplementedError: a temporal upsampler, `dims` other than 3, or a rational scale
                other than 2.0.
            ValueError: an unknown key.
        """
        data = {k: v for k, v in config.items() if not k.startswith("_")}
        fixed = {"dims": 3, "spatial_upsample": True, "temporal_upsample": False, "rational_spatial_scale": 2.0}
        for key, value in fixed.items():
            if key in data and data.pop(key) != value:
                raise NotImplementedError(f"`{key}`={config[key]!r}: only the x2 spatial upsampler ({key}={value!r}) "
                                          "of the LTX-2 / LTX-2.3 releases is implemented")
        return cls.model_validate(data)

    def to_diffusers_config(self) -> dict[str, Any]:
        """`LTX2LatentUpsamplerModel(**config)` keyword arguments."""
        return {**self.model_dump(), "dims": 3, "spatial_upsample": True, "temporal_upsample": False,
                "rational_spatial_scale": 2.0}


LTX2_LATENT_UPSAMPLER = LTX2LatentUpsamplerArch()
"""LTX-2.0 `ltx-2-spatial-upscaler-x2-1.0.safetensors`."""
LTX23_LATENT_UPSAMPLER = LTX2LatentUpsamplerArch(use_rational_resampler=False)
"""LTX-2.3 x2 spatial upscaler."""
TINY_LTX2_LATENT_UPSAMPLER = LTX2LatentUpsamplerArch(in_channels=8, mid_channels=32, num_blocks_per_stage=1)
"""Tiny, for tests and synthetic runs (the LTX-2.0 key layout)."""


class ResBlock(nn.Module):
    """conv -> GroupNorm -> SiLU -> conv -> GroupNorm, + input, -> SiLU (3D, same width)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(GROUPS, channels)
        self.conv2 = nn.Conv3d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(GROUPS, channels)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(h)) + x)


class RationalResampler(nn.Module):
    """The x2 stage in LTX-2.0's layout: `conv` then pixel shuffle; `blur_down.kernel` is stored
    (the release file holds it) but a x2 scale downsamples by 1, so it is never applied."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 4 * channels, 3, padding=1)
        self.blur_down = nn.Module()
        self.blur_down.register_buffer("kernel", torch.zeros(1, 1, 5, 5))

    def forward(self, x: Tensor) -> Tensor:
        return F.pixel_shuffle(self.conv(x), 2)


class LTX2LatentUpsampler(nn.Module):
    """x2 spatial upsampler of raw LTX-2 latents (diffusers `LTX2LatentUpsamplerModel`, dims=3)."""

    def __init__(self, arch: LTX2LatentUpsamplerArch) -> None:
        super().__init__()
        self.arch = arch
        c, mid = arch.in_channels, arch.mid_channels
        self.initial_conv = nn.Conv3d(c, mid, 3, padding=1)
        self.initial_norm = nn.GroupNorm(GROUPS, mid)
        self.res_blocks = nn.ModuleList(ResBlock(mid) for _ in range(arch.num_blocks_per_stage))
        self.upsampler: nn.Module = (RationalResampler(mid) if arch.use_rational_resampler
                                     else nn.Sequential(nn.Conv2d(mid, 4 * mid, 3, padding=1), nn.PixelShuffle(2)))
        self.post_upsample_res_blocks = nn.ModuleList(ResBlock(mid) for _ in range(arch.num_blocks_per_stage))
        self.final_conv = nn.Conv3d(mid, c, 3, padding=1)

    def forward(self, latents: Tensor) -> Tensor:
        """[B, C, F, H, W] raw latents -> [B, C, F, 2H, 2W] raw latents.

        Raises:
            ValueError: `latents` is not [B, in_channels, F, H, W].
        """
        if latents.ndim != 5 or latents.shape[1] != self.arch.in_channels:
            raise ValueError(f"`latents` must be [B, {self.arch.in_channels}, F, H, W], got {tuple(latents.shape)}")
        B = latents.shape[0]
        x = F.silu(self.initial_norm(self.initial_conv(latents)))
        for block in self.res_blocks:
            x = block(x)
        x = x.transpose(1, 2).flatten(0, 1)  # [B*F, mid, H, W]: the x2 stage is per frame
        x = self.upsampler(x)  # [B*F, mid, 2H, 2W]
        x = x.unflatten(0, (B, -1)).transpose(1, 2)  # [B, mid, F, 2H, 2W]
        for block in self.post_upsample_res_blocks:
            x = block(x)
        return self.final_conv(x)


def build_ltx2_latent_upsampler(arch: LTX2LatentUpsamplerArch, state_dict: dict[str, Tensor],
                                dtype: torch.dtype | None = None) -> LTX2LatentUpsampler:
    """Build on the meta device and load `state_dict` (diffusers / release names) strictly.

    Raises:
        CheckpointError: listing missing / unexpected keys or shape mismatches.
    """
    return load_on_meta(lambda: LTX2LatentUpsampler(arch), state_dict, component="latent_upsampler", dtype=dtype)


# ---- latent handling of LTX2LatentUpsamplePipeline ------------------------------------------

def adain_filter_latents(latents: Tensor, reference: Tensor, factor: float = 1.0) -> Tensor:
    """Match each (sample, channel) of `latents` to the mean and std of `reference`, then blend:
    lerp(latents, matched, factor) (diffusers `adain_filter_latent`; unbiased std).

    Args:
        latents: [B, C, F, H, W] (the upsampled latents); reference: [B, C, F', H', W'].
    """
    dims = (2, 3, 4)
    ref_std, ref_mean = torch.std_mean(reference, dim=dims, keepdim=True)  # [B, C, 1, 1, 1]
    std, mean = torch.std_mean(latents, dim=dims, keepdim=True)
    matched = (latents - mean) / std * ref_std + ref_mean
    return torch.lerp(latents, matched, factor)


def tone_map_latents(latents: Tensor, compression: float) -> Tensor:
    """Sigmoid soft compression of large values (diffusers `tone_map_latents`):
    x * (1 - 0.8 s sigmoid(4 s (|x| - 1))), s = 0.75 * compression, compression in [0, 1]."""
    s = compression * 0.75
    return latents * (1.0 - 0.8 * s * torch.sigmoid(4.0 * s * (latents.abs() - 1.0)))


@torch.no_grad()
def upsample_latents(upsampler: LTX2LatentUpsampler, latents: Tensor, latents_mean: Tensor, latents_std: Tensor,
                     scaling_factor: float = 1.0, latents_normalized: bool = False, adain_factor: float = 0.0,
                     tone_map_compression_ratio: float = 0.0) -> Tensor:
    """`LTX2LatentUpsamplePipeline(latents=..., output_type="latent")` for 5-D latents.

    Args:
        latents: [B, C, F, H, W]; raw unless `latents_normalized`.
        latents_mean, latents_std: [C], the VAE's statistics; scaling_factor: the VAE config's.
        latents_normalized: de-normalise `latents` first.
        adain_factor: > 0 matches the upsampled latents' per-channel statistics to the input's.
        tone_map_compression_ratio: in [0, 1]; > 0 applies `tone_map_latents`.

    Returns:
        [B, C, F, 2H, 2W] RAW latents in the upsampler's dtype (the pipeline never re-normalises).

    Raises:
        ValueError: `tone_map_compression_ratio` outside [0, 1].
    """
    if not 0.0 <= tone_map_compression_ratio <= 1.0:
        raise ValueError(f"`tone_map_compression_ratio`={tone_map_compression_ratio} must be in [0, 1]")
    latents = latents.float()  # the pipeline prepares float32 latents
    if latents_normalized:
        latents = denormalize_latents(latents, latents_mean, latents_std, scaling_factor)
    weight = upsampler.initial_conv.weight
    latents = latents.to(weight.device, weight.dtype)
    upsampled = upsampler(latents)
    if adain_factor > 0.0:
        upsampled = adain_filter_latents(upsampled, latents, adain_factor)
    if tone_map_compression_ratio > 0.0:
        upsampled = tone_map_latents(upsampled, tone_map_compression_ratio)
    return upsampled


def upsample_normalized_latents(upsampler: LTX2LatentUpsampler, latents: Tensor, latents_mean: Tensor,
                                latents_std: Tensor, scaling_factor: float = 1.0) -> Tensor:
    """The two-stage transition on the transformer's (normalised) latents: de-normalise, upsample
    x2, normalise again (as stage 2's `prepare_latents` does with 5-D latents). No AdaIN, no tone
    mapping (the documented chain's defaults).

    Args:
        latents: [B, C, F, H, W] normalised stage-1 latents.

    Returns:
        [B, C, F, 2H, 2W] normalised, in the upsampler's dtype.
    """
    raw = upsample_latents(upsampler, latents, latents_mean, latents_std, scaling_factor, latents_normalized=True)
    return normalize_latents(raw, latents_mean, latents_std, scaling_factor)
