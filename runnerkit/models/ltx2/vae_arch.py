"""Architecture of the LTX-2 video VAE (`AutoencoderKLLTX2Video`), in diffusers' config names.

The fields are those of diffusers' `AutoencoderKLLTX2Video` config.json (diffusers 0.42.1), so a
diffusers folder's `vae/config.json` reads with `LTX2VideoVAEArch.from_diffusers_config`. The
release values come from diffusers' `scripts/convert_ltx2_to_diffusers.py` (versions "2.0" and
"2.3"); they differ in the encoder widths and depths, the decoder's block list (3 residual
depth-to-space stages in 2.0, 4 plain ones in 2.3 with a temporal-only and a spatial-only stage)
and the decoder's spatial padding (reflect in 2.0, zeros in 2.3). Both releases: 128 latent
channels, 32x spatial and 8x temporal compression, causal encoder, non-causal decoder, no
timestep conditioning and no noise injection in the decoder (both exist as switches and are
covered). Not covered: LTX-2.5's diffusion decoder (`LTX2VideoDiffusionDecoderModel`), which
replaces this decoder there (its encoder is the 2.3 one, so `encoder` still applies).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DownsampleType = Literal["conv", "spatial", "temporal", "spatiotemporal"]
UpsampleType = Literal["spatial", "temporal", "spatiotemporal"]
PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]

# (time, height, width) stride of each resampling type.
STRIDES: dict[str, tuple[int, int, int]] = {
    "conv": (2, 2, 2), "spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2),
}


class LTX2VideoVAEArch(BaseModel):
    """LTX-2 video VAE; the defaults are the LTX-2 (19B release) VAE.

    Tuples listed "per encoder block" run from the input side; the decoder tuples are given in
    the ENCODER's order (from the latent side they are reversed: the decoder's first up block uses
    the last entry), except `upsample_type`, which diffusers applies in decoder order unreversed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    in_channels: int = Field(3, gt=0, description="Video channels in (RGB).")
    out_channels: int = Field(3, gt=0, description="Video channels out (RGB).")
    latent_channels: int = Field(128, gt=0, description="Latent channels.")
    block_out_channels: tuple[int, ...] = Field(
        (256, 512, 1024, 2048), strict=False, description="Encoder: channels after each down block's downsampler.")
    layers_per_block: tuple[int, ...] = Field(
        (4, 6, 6, 2, 2), strict=False, description="Encoder: residual blocks per down block, then the mid block.")
    spatio_temporal_scaling: tuple[bool, ...] = Field(
        (True, True, True, True), strict=False, description="Encoder: whether each down block downsamples.")
    downsample_type: tuple[DownsampleType, ...] = Field(
        ("spatial", "temporal", "spatiotemporal", "spatiotemporal"), strict=False,
        description="Encoder: downsampling of each down block (space-to-depth, or 'conv': a stride-2 conv).")
    decoder_block_out_channels: tuple[int, ...] = Field(
        (256, 512, 1024), strict=False,
        description="Decoder: channel widths, encoder order (the last is the mid block's).")
    decoder_layers_per_block: tuple[int, ...] = Field(
        (5, 5, 5, 5), strict=False,
        description="Decoder: residual blocks per up block, encoder order; the last is the mid block.")
    decoder_spatio_temporal_scaling: tuple[bool, ...] = Field(
        (True, True, True), strict=False, description="Decoder: whether each up block upsamples (encoder order).")
    decoder_inject_noise: tuple[bool, ...] = Field(
        (False, False, False, False), strict=False,
        description="Decoder: per-channel scaled spatial noise after each conv of the residual blocks (encoder order; "
                    "the last is the mid block). No LTX-2 release uses it.")
    upsample_type: tuple[UpsampleType, ...] = Field(
        ("spatiotemporal", "spatiotemporal", "spatiotemporal"), strict=False,
        description="Decoder: upsampling of each up block, in DECODER order (diffusers does not reverse it).")
    upsample_residual: tuple[bool, ...] = Field(
        (True, True, True), strict=False,
        description="Decoder: depth-to-space residual added to each upsampler (encoder order).")
    upsample_factor: tuple[int, ...] = Field(
        (2, 2, 2), strict=False, description="Decoder: channel reduction of each upsampler (encoder order).")
    timestep_conditioning: bool = Field(
        False, description="Decoder conditioned on the decode timestep (AdaLN tables in every residual block).")
    patch_size: int = Field(4, gt=0, description="Spatial patch folded into channels before the encoder.")
    patch_size_t: int = Field(1, ge=1, le=1,
                              description="Temporal patch folded into channels (diffusers supports only 1).")
    resnet_norm_eps: float = Field(1e-6, gt=0, description="Epsilon of the shortcut LayerNorm.")
    scaling_factor: float = Field(1.0, gt=0, description="Latent scale applied with the mean/std normalisation.")
    encoder_causal: bool = Field(True, description="Encoder pads time with copies of the first frame only.")
    decoder_causal: bool = Field(False,
                                 description="Decoder pads time causally (else first and last frame, symmetric).")
    encoder_spatial_padding_mode: PaddingMode = Field("zeros", description="Spatial padding of the encoder's convs.")
    decoder_spatial_padding_mode: PaddingMode = Field("reflect", description="Spatial padding of the decoder's convs.")

    @model_validator(mode="after")
    def _consistent(self) -> LTX2VideoVAEArch:
        n_enc = len(self.block_out_channels)
        if len(self.layers_per_block) != n_enc + 1:
            raise ValueError(f"`layers_per_block` needs len(`block_out_channels`) + 1 = {n_enc + 1} entries "
                             f"(got {len(self.layers_per_block)})")
        for name in ("spatio_temporal_scaling", "downsample_type"):
            if len(getattr(self, name)) != n_enc:
                raise ValueError(f"`{name}` needs one entry per encoder block ({n_enc}), "
                                 f"got {len(getattr(self, name))}")
        n_dec = len(self.decoder_block_out_channels)
        if len(self.decoder_layers_per_block) != n_dec + 1:
            raise ValueError(f"`decoder_layers_per_block` needs len(`decoder_block_out_channels`) + 1 = {n_dec + 1} "
                             f"entries (got {len(self.decoder_layers_per_block)})")
        if len(self.decoder_inject_noise) != n_dec + 1:
            raise ValueError(f"`decoder_inject_noise` needs {n_dec + 1} entries (got {len(self.decoder_inject_noise)})")
        for name in ("decoder_spatio_temporal_scaling", "upsample_type", "upsample_residual", "upsample_factor"):
            if len(getattr(self, name)) != n_dec:
                raise ValueError(f"`{name}` needs one entry per decoder block ({n_dec}), "
                                 f"got {len(getattr(self, name))}")
        changing = [i for i, (c_in, c_out) in enumerate(self.decoder_up_channels) if c_in != c_out]
        if self.timestep_conditioning and changing:
            # diffusers hands such a block the raw timestep, not its embedding, and fails.
            raise NotImplementedError(f"`timestep_conditioning` with a channel change inside up block(s) {changing} "
                                      "is not runnable in diffusers either")
        return self

    # ---- derived sizes --------------------------------------------------------------------

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along height and width (32 for both releases)."""
        down = [t for t, on in zip(self.downsample_type, self.spatio_temporal_scaling, strict=True) if on]
        return self.patch_size * 2 ** sum(STRIDES[t][1] == 2 for t in down)

    @property
    def temporal_compression(self) -> int:
        """Frames per latent frame after the first (8 for both releases)."""
        down = [t for t, on in zip(self.downsample_type, self.spatio_temporal_scaling, strict=True) if on]
        return self.patch_size_t * 2 ** sum(STRIDES[t][0] == 2 for t in down)

    @property
    def decoder_up_channels(self) -> list[tuple[int, int]]:
        """(in, out) channels of each up block in decoder order, computed as diffusers does: the
        previous block's width and this block's width, both divided by this block's
        `upsample_factor`. They differ only where a channel-changing residual block (`conv_in`)
        precedes the upsampler; no release has one."""
        widths = self.decoder_block_out_channels[::-1]
        factors = self.upsample_factor[::-1]
        out, channels = widths[0], []
        for width, factor in zip(widths, factors, strict=True):
            channels.append((out // factor, width // factor))
            out = width // factor
        return channels

    # ---- diffusers config -----------------------------------------------------------------

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> LTX2VideoVAEArch:
        """Read diffusers' `vae/config.json` dict (`AutoencoderKLLTX2Video`).

        Bool-or-tuple fields given as one bool are expanded as diffusers does. Keys starting with
        `_` (class name, versions) are ignored.

        Raises:
            ValueError: an unknown key, a `down_block_types` entry other than
                "LTX2VideoDownBlock3D", or a `spatial_compression_ratio` /
                `temporal_compression_ratio` that disagrees with the block structure.
        """
        data = {k: v for k, v in config.items() if not k.startswith("_")}
        block_types = data.pop("down_block_types", None)
        if block_types is not None and any(t != "LTX2VideoDownBlock3D" for t in block_types):
            raise ValueError(f"`down_block_types`={block_types!r}: only 'LTX2VideoDownBlock3D' exists")
        ratios = {"spatial_compression_ratio": data.pop("spatial_compression_ratio", None),
                  "temporal_compression_ratio": data.pop("temporal_compression_ratio", None)}
        n_enc = len(data.get("layers_per_block", cls.model_fields["layers_per_block"].default))
        n_dec = len(data.get("decoder_layers_per_block", cls.model_fields["decoder_layers_per_block"].default))
        for name, count in (("spatio_temporal_scaling", n_enc - 1), ("decoder_spatio_temporal_scaling", n_dec - 1),
                            ("decoder_inject_noise", n_dec), ("upsample_residual", n_dec - 1)):
            if isinstance(data.get(name), bool):
                data[name] = (data[name],) * count
        arch = cls.model_validate({k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}, strict=False)
        for name, derived in (("spatial_compression_ratio", arch.spatial_compression),
                              ("temporal_compression_ratio", arch.temporal_compression)):
            if ratios[name] is not None and ratios[name] != derived:
                raise ValueError(f"`{name}`={ratios[name]} disagrees with the block structure, which gives {derived}")
        return arch

    def to_diffusers_config(self) -> dict[str, Any]:
        """The `AutoencoderKLLTX2Video(**config)` keyword arguments of this architecture."""
        config = self.model_dump()
        config["down_block_types"] = ("LTX2VideoDownBlock3D",) * len(self.block_out_channels)
        config["spatial_compression_ratio"] = self.spatial_compression
        config["temporal_compression_ratio"] = self.temporal_compression
        return config


LTX2_VIDEO_VAE = LTX2VideoVAEArch()
"""LTX-2 (19B release, `ltx-2-19b-*.safetensors` under `vae.`): diffusers' conversion "2.0"."""

LTX23_VIDEO_VAE = LTX2VideoVAEArch(
    block_out_channels=(256, 512, 1024, 1024),
    layers_per_block=(4, 6, 4, 2, 2),
    decoder_block_out_channels=(256, 512, 512, 1024),
    decoder_layers_per_block=(4, 6, 4, 2, 2),
    decoder_spatio_temporal_scaling=(True, True, True, True),
    decoder_inject_noise=(False, False, False, False, False),
    upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
    upsample_residual=(False, False, False, False),
    upsample_factor=(2, 2, 1, 2),
    decoder_spatial_padding_mode="zeros",
)
"""LTX-2.3 (22B release): diffusers' conversion "2.3" (the LTX-2.5 encoder is the same)."""

TINY_LTX2_VIDEO_VAE = LTX2VideoVAEArch(**{**LTX2_VIDEO_VAE.model_dump(), **dict(
    latent_channels=8, block_out_channels=(8, 16, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
    decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1))})
"""LTX-2.0 block structure (32x / 8x compression) at tiny width, for tests and synthetic runs."""

TINY_LTX23_VIDEO_VAE = LTX2VideoVAEArch(**{**LTX23_VIDEO_VAE.model_dump(), **dict(
    latent_channels=8, block_out_channels=(8, 16, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
    decoder_block_out_channels=(8, 16, 16, 32), decoder_layers_per_block=(1, 1, 1, 1, 1))})
"""LTX-2.3 block structure at tiny width."""
