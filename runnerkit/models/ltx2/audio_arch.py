"""Architecture descriptions of the LTX-2 audio networks: the audio VAE decoder and the vocoder.

Field names are diffusers' config keys (`audio_vae/config.json`, `vocoder/config.json` of a
diffusers-layout LTX-2 folder), so `from_diffusers_config` is a checked copy. Release values come
from diffusers' `scripts/convert_ltx2_to_diffusers.py` (`get_ltx2_audio_vae_config`,
`get_ltx2_vocoder_config`): the audio VAE is the same in LTX-2 (19B) and LTX-2.3 (22B); the
vocoder is not (2.0: HiFi-GAN style, LeakyReLU, 24 kHz; 2.3: BigVGAN style, anti-aliased
SnakeBeta, 16 kHz, followed by a bandwidth extender to 48 kHz, `LTX2VocoderWithBWE`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from runnerkit.arch import Arch

LATENT_DOWNSAMPLE = 4
"""Audio VAE compression of time (mel frames) and of mel bins (diffusers `LATENT_DOWNSAMPLE_FACTOR`)."""


def _checked_fields(config: dict[str, Any], known: set[str], ignored: set[str], what: str) -> dict[str, Any]:
    """The entries of a diffusers config that name `known` fields; private keys (`_class_name`,
    `_diffusers_version`) and the `ignored` ones are dropped.

    Raises:
        ValueError: a key that is neither, so that a switch we do not implement is never dropped silently.
    """
    unknown = sorted(k for k in config if not k.startswith("_") and k not in known | ignored)
    if unknown:
        raise ValueError(f"{what} config has keys this implementation does not know: {unknown}")
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in config.items() if k in known}


class LTX2AudioVAEArch(Arch):
    """Decoder half of diffusers' `AutoencoderKLLTX2Audio`; defaults are the LTX-2 / LTX-2.3 release."""

    base_channels: int = Field(128, gt=0, description="Channels of the first (finest) level; also the length "
                               "of the per-channel latent statistics.")
    output_channels: int = Field(2, gt=0, description="Spectrogram channels out (stereo: 2).")
    ch_mult: tuple[int, ...] = Field((1, 2, 4), strict=False, min_length=1,
                                     description="Channel multiplier per level, finest first.")
    num_res_blocks: int = Field(2, gt=0, description="Residual blocks per level in the encoder; the decoder has one more.")
    attn_resolutions: tuple[int, ...] | None = Field(None, strict=False, description="Resolutions (in steps of the "
                                                     "nominal `resolution`) with self-attention blocks (release: none).")
    resolution: int = Field(256, gt=0, description="Nominal input size, only used to place `attn_resolutions`.")
    latent_channels: int = Field(8, gt=0, description="Latent channels.")
    norm_type: Literal["group", "pixel"] = Field("pixel", description="GroupNorm(32) or per-position RMS (pixel) norm.")
    causality_axis: Literal["none", "width", "height", "width-compatibility"] = Field(
        "height", description="Axis along which convolutions pad on one side only (height = time).")
    mid_block_add_attention: bool = Field(False, description="Self-attention between the two middle blocks.")
    sample_rate: int = Field(16000, gt=0, description="Waveform sample rate of the mel spectrogram, Hz.")
    mel_hop_length: int = Field(160, gt=0, description="Mel hop, samples: 100 mel frames per second at 16 kHz.")
    mel_bins: int | None = Field(64, gt=0, description="Mel bins of the decoded spectrogram (None: what the "
                                 "network produces).")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> LTX2AudioVAEArch:
        if self._check(info, "norm_type", "causality_axis") and self.norm_type == "group" \
                and self.causality_axis != "none":
            raise ValueError(f"`norm_type`='group' needs `causality_axis`='none' (got {self.causality_axis!r}): "
                             "diffusers refuses causal residual blocks with GroupNorm")
        if self._check(info, "norm_type", "base_channels", "ch_mult") and self.norm_type == "group" \
                and any(self.base_channels * m % 32 for m in self.ch_mult):
            raise ValueError(f"`norm_type`='group' uses 32 groups: every level's channels (`base_channels` x "
                             f"`ch_mult`) must be a multiple of 32 (got {self.base_channels} x {list(self.ch_mult)})")
        if self._check(info, "base_channels", "latent_channels", "mel_bins") and self.mel_bins is not None \
                and self.base_channels != self.latent_channels * (self.mel_bins // LATENT_DOWNSAMPLE):
            # diffusers stores the statistics with `base_channels` entries and applies them to packed tokens
            # of latent_channels x latent mel bins features; the release has 128 = 8 x 16.
            raise ValueError(f"the latent statistics (`base_channels`={self.base_channels} values) apply to packed "
                             f"audio tokens of `latent_channels` x `mel_bins`/4 = "
                             f"{self.latent_channels * (self.mel_bins // LATENT_DOWNSAMPLE)} features: they must match")
        return self

    @property
    def latent_mel_bins(self) -> int:
        """Mel bins of the latents (16 in the release)."""
        assert self.mel_bins is not None, "latent_mel_bins needs `mel_bins`"
        return self.mel_bins // LATENT_DOWNSAMPLE

    @property
    def latents_per_second(self) -> float:
        """Latent frames per second of audio (25 in the release: 16000 / 160 / 4)."""
        return self.sample_rate / self.mel_hop_length / LATENT_DOWNSAMPLE

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> LTX2AudioVAEArch:
        """From diffusers' `audio_vae/config.json`. Encoder-only keys are ignored (`in_channels`,
        `double_z`), as are `dropout` (no-op at inference) and `is_causal` (read by no layer)."""
        fields = _checked_fields(config, set(cls.model_fields),
                                 {"in_channels", "double_z", "dropout", "is_causal"}, "audio VAE")
        return cls.model_validate(fields, strict=False)


ActFn = Literal["leaky_relu", "snake", "snakebeta"]


class LTX2VocoderArch(Arch):
    """A mel -> waveform generator (diffusers `LTX2Vocoder`); defaults are the LTX-2 (19B) release vocoder."""

    in_channels: int = Field(128, gt=0, description="Mel features per frame: spectrogram channels x mel bins.")
    hidden_channels: int = Field(1024, gt=0, description="Width after `conv_in`; halved by every upsampler.")
    out_channels: int = Field(2, gt=0, description="Waveform channels (stereo: 2).")
    upsample_kernel_sizes: tuple[int, ...] = Field((16, 15, 8, 4, 4), strict=False, min_length=1)
    upsample_factors: tuple[int, ...] = Field((6, 5, 2, 2, 2), strict=False, min_length=1,
                                              description="Stride of each transposed convolution.")
    resnet_kernel_sizes: tuple[int, ...] = Field((3, 7, 11), strict=False, min_length=1,
                                                 description="Kernel of each parallel residual block per level.")
    resnet_dilations: tuple[tuple[int, ...], ...] = Field(((1, 3, 5),) * 3, strict=False,
                                                          description="Dilations of each parallel residual block.")
    act_fn: ActFn = Field("leaky_relu", description="Activation: LeakyReLU (2.0) or Snake/SnakeBeta (2.3).")
    leaky_relu_negative_slope: float = Field(0.1, ge=0)
    antialias: bool = Field(False, description="Wrap the residual blocks' activations in 2x up/down filters.")
    antialias_ratio: int = Field(2, gt=0)
    antialias_kernel_size: int = Field(12, gt=0)
    final_act_fn: Literal["tanh", "clamp"] | None = Field("tanh", description="Applied to the waveform last.")
    final_bias: bool = Field(True, description="Whether `conv_out` has a bias.")
    output_sampling_rate: int = Field(24000, gt=0, description="Sample rate of the waveform out, Hz.")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> LTX2VocoderArch:
        if self._check(info, "upsample_kernel_sizes", "upsample_factors") and \
                len(self.upsample_kernel_sizes) != len(self.upsample_factors):
            raise ValueError(f"`upsample_kernel_sizes` ({len(self.upsample_kernel_sizes)}) and `upsample_factors` "
                             f"({len(self.upsample_factors)}) need one entry per upsampler")
        if self._check(info, "resnet_kernel_sizes", "resnet_dilations") and \
                len(self.resnet_kernel_sizes) != len(self.resnet_dilations):
            raise ValueError(f"`resnet_kernel_sizes` ({len(self.resnet_kernel_sizes)}) and `resnet_dilations` "
                             f"({len(self.resnet_dilations)}) need one entry per parallel residual block")
        if self._check(info, "hidden_channels", "upsample_factors") and \
                self.hidden_channels >> len(self.upsample_factors) == 0:
            raise ValueError(f"`hidden_channels`={self.hidden_channels} is halved by each of the "
                             f"{len(self.upsample_factors)} upsamplers and must stay at least 1")
        if self._check(info, "act_fn", "antialias") and self.act_fn == "leaky_relu" and self.antialias:
            raise NotImplementedError("`antialias` with `act_fn`='leaky_relu' is not implemented: diffusers wraps "
                                      "the second activations twice there, and no release uses it")
        return self

    @property
    def hop(self) -> int:
        """Waveform samples per mel frame: the product of `upsample_factors` (240 for 2.0, 160 for 2.3)."""
        return math.prod(self.upsample_factors)

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> LTX2VocoderArch:
        """From diffusers' `vocoder/config.json` of an `LTX2Vocoder`."""
        return cls.model_validate(_checked_fields(config, set(cls.model_fields), set(), "vocoder"), strict=False)


class LTX2VocoderBWEArch(Arch):
    """Vocoder then bandwidth extender (diffusers `LTX2VocoderWithBWE`); defaults are the LTX-2.3 release.

    The first vocoder makes a 16 kHz waveform, whose log-mel spectrogram (causal STFT, `hop_length`)
    drives a second generator that predicts the residual over a windowed-sinc 3x resampling of it.
    """

    vocoder: LTX2VocoderArch = LTX2VocoderArch(
        hidden_channels=1536, upsample_kernel_sizes=(11, 4, 4, 4, 4, 4), upsample_factors=(5, 2, 2, 2, 2, 2),
        act_fn="snakebeta", antialias=True, final_act_fn=None, final_bias=False, output_sampling_rate=16000)
    bwe: LTX2VocoderArch = LTX2VocoderArch(
        hidden_channels=512, upsample_kernel_sizes=(12, 11, 4, 4, 4), upsample_factors=(6, 5, 2, 2, 2),
        act_fn="snakebeta", antialias=True, final_act_fn=None, final_bias=False, output_sampling_rate=48000)
    filter_length: int = Field(512, gt=0, description="STFT size of the bandwidth extender's mel.")
    hop_length: int = Field(80, gt=0, description="STFT hop, samples of the first vocoder's waveform.")
    window_length: int = Field(512, gt=0, description="STFT window; the waveform is left-padded by window - hop.")
    num_mel_channels: int = Field(64, gt=0, description="Mel bins of the bandwidth extender's input.")
    input_sampling_rate: int = Field(16000, gt=0, description="Sample rate of the first vocoder, Hz.")
    output_sampling_rate: int = Field(48000, gt=0, description="Sample rate out, Hz (a multiple of the input rate).")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> LTX2VocoderBWEArch:
        if self._check(info, "input_sampling_rate", "output_sampling_rate") and \
                self.output_sampling_rate % self.input_sampling_rate:
            raise ValueError(f"`output_sampling_rate`={self.output_sampling_rate} must be a multiple of "
                             f"`input_sampling_rate`={self.input_sampling_rate}")
        if self._check(info, "bwe", "hop_length", "input_sampling_rate", "output_sampling_rate"):
            ratio = self.output_sampling_rate // self.input_sampling_rate
            if self.bwe.hop != self.hop_length * ratio:
                raise ValueError(f"the extender makes prod(`bwe_upsample_factors`)={self.bwe.hop} samples per mel "
                                 f"frame; it must be `hop_length` x rate ratio = {self.hop_length * ratio}")
        return self

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> LTX2VocoderBWEArch:
        """From diffusers' `vocoder/config.json` of an `LTX2VocoderWithBWE` (`bwe_*` keys: the extender)."""
        own = {"filter_length", "hop_length", "window_length", "num_mel_channels",
               "input_sampling_rate", "output_sampling_rate"}
        generator_keys = set(LTX2VocoderArch.model_fields) - {"output_sampling_rate"}
        known = own | generator_keys | {f"bwe_{k}" for k in generator_keys}
        fields = _checked_fields(config, known, set(), "vocoder (with bandwidth extension)")
        top = {k: v for k, v in fields.items() if k in own}
        rates = {"input_sampling_rate": 16000, "output_sampling_rate": 48000} | top
        first = {k: v for k, v in fields.items() if k in generator_keys}
        second = {k.removeprefix("bwe_"): v for k, v in fields.items() if k.startswith("bwe_")}
        defaults = cls.model_fields
        return cls.model_validate({
            **top,
            "vocoder": defaults["vocoder"].default.model_dump() | first  # validated with the rest
            | {"output_sampling_rate": rates["input_sampling_rate"]},
            "bwe": defaults["bwe"].default.model_dump() | second
            | {"output_sampling_rate": rates["output_sampling_rate"]},
        }, strict=False)


LTX2_AUDIO_VAE = LTX2AudioVAEArch()
"""Audio VAE of LTX-2 (19B) and LTX-2.3 (22B): the same architecture in both releases."""
LTX2_VOCODER = LTX2VocoderArch()
"""LTX-2 (19B) vocoder: mel (2 x 64 bins, 100 frames/s) -> 24 kHz stereo."""
LTX23_VOCODER = LTX2VocoderBWEArch()
"""LTX-2.3 (22B) vocoder with bandwidth extension: mel -> 16 kHz -> 48 kHz stereo."""

TINY_AUDIO_VAE = LTX2AudioVAEArch(base_channels=16, ch_mult=(1, 2, 2), num_res_blocks=1, latent_channels=4,
                                  mel_bins=16)
"""Test size: 16 = 4 latent channels x 4 latent mel bins, so the statistics fit the packed tokens."""
TINY_VOCODER = LTX2VocoderArch(in_channels=2 * 16, hidden_channels=16, upsample_kernel_sizes=(8, 4),
                               upsample_factors=(4, 2), resnet_kernel_sizes=(3, 5), resnet_dilations=((1, 2), (1, 3)))
"""Test size of the 2.0 vocoder (leaky ReLU, tanh out), taking TINY_AUDIO_VAE's spectrogram."""
TINY_VOCODER_BWE = LTX2VocoderBWEArch(
    vocoder=LTX2VocoderArch(in_channels=2 * 16, hidden_channels=16, upsample_kernel_sizes=(11, 4),
                            upsample_factors=(5, 2), resnet_kernel_sizes=(3, 5), resnet_dilations=((1, 2), (1, 3)),
                            act_fn="snakebeta", antialias=True, final_act_fn=None, final_bias=False,
                            output_sampling_rate=16000),
    bwe=LTX2VocoderArch(in_channels=2 * 4, hidden_channels=8, upsample_kernel_sizes=(12, 4),
                        upsample_factors=(6, 4), resnet_kernel_sizes=(3,), resnet_dilations=((1, 3),),
                        act_fn="snakebeta", antialias=True, final_act_fn=None, final_bias=False,
                        output_sampling_rate=48000),
    filter_length=16, hop_length=8, window_length=16, num_mel_channels=4)
"""Test size of the 2.3 vocoder: 3x rate, 24 = 8 x 3 extender samples per mel frame."""
