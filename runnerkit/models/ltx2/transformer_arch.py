"""Architecture of the LTX-2 audio+video diffusion transformer, in diffusers' config names.

Field names are those of diffusers' `LTX2VideoTransformer3DModel` config (`transformer/config.json`
of a diffusers-layout folder), so a config maps one to one (`from_diffusers_config`). The release
values come from diffusers' conversion script (`scripts/convert_ltx2_to_diffusers.py`, versions
"2.0" and "2.3"): both releases have the same widths (video 32 x 128 = 4096, audio 32 x 64 = 2048,
48 blocks); LTX-2.3 switches on

- `gated_attn` / `audio_gated_attn`: a per-head gate `2 * sigmoid(to_gate_logits(x))` on every
  attention output of the stream (self, text cross, and the audio<->video attention it queries);
- `cross_attn_mod` / `audio_cross_attn_mod`: AdaLN on the text cross-attention (9 instead of 6
  modulation rows per block: shift/scale/gate of the query side) and a sigma-driven modulation of
  the text keys/values (`prompt_adaln`, per-block `prompt_scale_shift_table`);
- `use_prompt_embeddings` false: the caption projections moved into the text connectors;
- `perturbed_attn` true: diffusers' STG-capable attention processor (no weights of its own).

LTX-2.5 (diffusers' "2.5" conversion config) keeps every 2.3 switch and adds two:

- `ff_bias` false: the video FFN's two linears have no bias (`ff.net.0.proj.bias`, `ff.net.2.bias` gone);
- `use_keyframes_abs_pos_embedding` (2.5.1+ files): one learned [1, video width] vector,
  `keyframes_abs_pos_embedding`, added after `proj_in` to the video tokens a keyframe mask marks
  (`LTX2Transformer.forward`'s `video_keyframes_mask`); without a mask it has no effect.

Not covered (refused by `from_diffusers_config` with NotImplementedError), as no release uses them:
`audio_ff_bias` false (LTX-2.5 keeps the audio FFN's biases), a timestep-independent prompt
modulation (`use_prompt_adaln_single` false), non-default activation, q/k norm, affine block norms
or attention biases.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LTX2TransformerArch(BaseModel):
    """LTX-2 `LTX2VideoTransformer3DModel`; defaults are the LTX-2.3 (22B) release.

    Raises (validation): ValueError when a width does not fit (cross-attention dims must equal the
    stream widths, as both releases have them; head sizes must be even for RoPE).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    # video stream
    in_channels: int = Field(128, gt=0, description="Packed video latent channels (VAE channels x patch volume).")
    out_channels: int = Field(128, gt=0, description="Predicted video channels per token.")
    patch_size: int = Field(1, gt=0, description="Spatial patch of the video latents (1 in the releases).")
    patch_size_t: int = Field(1, gt=0, description="Temporal patch of the video latents (1 in the releases).")
    num_attention_heads: int = Field(32, gt=0, description="Video attention heads.")
    attention_head_dim: int = Field(128, gt=0, description="Video head size.")
    cross_attention_dim: int = Field(4096, gt=0, description="Width of the video text context (= video width).")
    vae_scale_factors: tuple[int, int, int] = Field(
        (8, 32, 32), strict=False,
        description="Video VAE (frame, height, width) compression: latent -> pixel RoPE positions.")
    pos_embed_max_pos: int = Field(20, gt=0, description="Video RoPE: frame positions (seconds) are divided by this.")
    base_height: int = Field(2048, gt=0, description="Video RoPE: pixel rows are divided by this.")
    base_width: int = Field(2048, gt=0, description="Video RoPE: pixel columns are divided by this.")
    gated_attn: bool = Field(True, description="Per-head output gates on the video stream's attentions (LTX-2.3).")
    cross_attn_mod: bool = Field(True, description="AdaLN on the video text cross-attention, 9 rows (LTX-2.3).")
    # audio stream
    audio_in_channels: int = Field(128, gt=0, description="Packed audio latent channels (channels x mel bins).")
    audio_out_channels: int = Field(128, gt=0, description="Predicted audio channels per token.")
    audio_patch_size: int = Field(1, gt=0, description="Audio patch along mel bins (1 in the releases).")
    audio_patch_size_t: int = Field(1, gt=0, description="Audio patch along time (1 in the releases).")
    audio_num_attention_heads: int = Field(32, gt=0,
                                           description="Audio attention heads (also audio<->video attention).")
    audio_attention_head_dim: int = Field(64, gt=0, description="Audio head size (also audio<->video attention).")
    audio_cross_attention_dim: int = Field(2048, gt=0, description="Width of the audio text context (= audio width).")
    audio_scale_factor: int = Field(4, gt=0, description="Audio VAE temporal compression (latent frame -> mel frames).")
    audio_pos_embed_max_pos: int = Field(20, gt=0, description="Audio RoPE: positions (seconds) are divided by this.")
    audio_sampling_rate: int = Field(16000, gt=0, description="Mel spectrogram sampling rate (Hz), for RoPE seconds.")
    audio_hop_length: int = Field(160, gt=0, description="Mel spectrogram hop (samples), for RoPE seconds.")
    audio_gated_attn: bool = Field(True,
                                   description="Per-head output gates on the audio stream's attentions (LTX-2.3).")
    audio_cross_attn_mod: bool = Field(True, description="AdaLN on the audio text cross-attention, 9 rows (LTX-2.3).")
    # shared
    num_layers: int = Field(48, gt=0, description="Audio+video transformer blocks.")
    norm_eps: float = Field(1e-6, gt=0, description="Epsilon of the block RMSNorms and q/k norms.")
    caption_channels: int = Field(3840, gt=0, description="Text width before the caption projections (LTX-2.0).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE frequency base.")
    rope_double_precision: bool = Field(True, description="RoPE frequencies computed in float64, then float32.")
    rope_type: Literal["split", "interleaved"] = Field(
        "split", description="RoPE pairing: 'split' rotates the two halves of each head (both releases), "
        "'interleaved' adjacent channel pairs (diffusers' default).")
    causal_offset: int = Field(1, ge=0, description="RoPE: the causal VAE's first latent frame covers one pixel frame.")
    timestep_scale_multiplier: int = Field(1000, gt=0, description="Timestep scale of the AdaLN inputs.")
    cross_attn_timestep_scale_multiplier: int = Field(
        1000, gt=0, description="Timestep scale of the audio<->video gates (ratio to `timestep_scale_multiplier`).")
    use_prompt_embeddings: bool = Field(
        False, description="Caption projections in the transformer (LTX-2.0); LTX-2.3 projects in the connectors.")
    perturbed_attn: bool = Field(
        True, description="diffusers' STG attention processor (LTX-2.3); no weights, and `forward` runs without STG.")
    ff_bias: bool = Field(True, description="Biases on the video FFN's two linears (LTX-2.5: false).")
    use_keyframes_abs_pos_embedding: bool = Field(
        False, description="A learned [1, video width] `keyframes_abs_pos_embedding` added after `proj_in` to the "
        "tokens a keyframe mask marks (LTX-2.5.1+).")

    FIXED: ClassVar[dict[str, Any]] = {
        "activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False,
        "attention_bias": True, "attention_out_bias": True, "audio_ff_bias": True, "use_prompt_adaln_single": True,
    }
    """diffusers config keys with the one value every release (2.0, 2.3, 2.5) uses and this module implements."""

    @property
    def inner_dim(self) -> int:
        """Video width: heads x head size (4096 in both releases)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_inner_dim(self) -> int:
        """Audio width: heads x head size (2048 in both releases)."""
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def prompt_modulation(self) -> bool:
        """Whether the text keys/values are modulated by sigma (`prompt_adaln`; LTX-2.3)."""
        return self.cross_attn_mod or self.audio_cross_attn_mod

    @property
    def cross_timestep(self) -> bool:
        """Whether the audio<->video cross-attention AdaLN takes the other stream's sigma (LTX-2.3, the
        gated-attention release) rather than each stream's own timestep (LTX-2.0). Only i2av tells them apart
        (per-token video timesteps). Sources: diffusers 0.42.1 `use_cross_timestep` ("`False` is the legacy
        LTX-2.0 behavior"); ltx-core as released with LTX-2.0 (github Lightricks/LTX-2 @ 9ce438b,
        `transformer_args.py`: both AdaLNs from the modality's own timesteps)."""
        return self.gated_attn

    @model_validator(mode="after")
    def _widths_fit(self) -> LTX2TransformerArch:
        if self.cross_attention_dim != self.inner_dim:
            raise ValueError(f"`cross_attention_dim`={self.cross_attention_dim} must equal the video width "
                             f"`num_attention_heads` x `attention_head_dim` = {self.inner_dim}")
        if self.audio_cross_attention_dim != self.audio_inner_dim:
            raise ValueError(f"`audio_cross_attention_dim`={self.audio_cross_attention_dim} must equal the audio "
                             f"width `audio_num_attention_heads` x `audio_attention_head_dim` = {self.audio_inner_dim}")
        for name in ("attention_head_dim", "audio_attention_head_dim"):
            if getattr(self, name) % 2:
                raise ValueError(f"`{name}`={getattr(self, name)} must be even (RoPE rotates channel pairs)")
        return self

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> LTX2TransformerArch:
        """The arch of a diffusers `transformer/config.json` dict.

        Keys starting with "_" (class name, version) are ignored; diffusers defaults fill missing keys.

        Raises:
            NotImplementedError: a key of `FIXED` with another value (a variant no release uses).
            ValueError (pydantic ValidationError): an unknown key or a bad value.
        """
        fields = {k: v for k, v in config.items() if not k.startswith("_")}
        for key, supported in cls.FIXED.items():
            if key in fields:
                value = fields.pop(key)
                if value != supported:
                    raise NotImplementedError(f"transformer config `{key}`={value!r} is not supported (LTX-2.0, "
                                              f"2.3 and 2.5 use {supported!r}; no release uses another value)")
        # diffusers' own defaults (not ours) for keys a config leaves out
        defaults = {"gated_attn": False, "cross_attn_mod": False, "audio_gated_attn": False,
                    "audio_cross_attn_mod": False, "rope_type": "interleaved", "use_prompt_embeddings": True,
                    "perturbed_attn": False}
        fields = {**defaults, **fields}
        if isinstance(fields.get("vae_scale_factors"), list):
            fields["vae_scale_factors"] = tuple(fields["vae_scale_factors"])
        for key in ("rope_theta", "norm_eps"):
            if isinstance(fields.get(key), int):
                fields[key] = float(fields[key])
        return cls(**fields)


LTX2_19B = LTX2TransformerArch(gated_attn=False, cross_attn_mod=False, audio_gated_attn=False,
                               audio_cross_attn_mod=False, use_prompt_embeddings=True, perturbed_attn=False)
"""LTX-2 (19B) transformer (`Lightricks/LTX-2`): no gates, 6-row AdaLN, caption projections inside."""
LTX23_22B = LTX2TransformerArch()
"""LTX-2.3 (22B) transformer (`Lightricks/LTX-2.3`): the class defaults."""
LTX25_22B = LTX2TransformerArch(ff_bias=False, use_keyframes_abs_pos_embedding=True)
"""LTX-2.5 (22B) transformer (`Lightricks/LTX-2.5`, 2.5.1+ files): LTX-2.3's, video FFN without biases, with the
keyframe embedding."""
SWITCHES = ("gated_attn", "cross_attn_mod", "audio_gated_attn", "audio_cross_attn_mod", "use_prompt_embeddings",
            "perturbed_attn", "ff_bias", "use_keyframes_abs_pos_embedding")
"""The fields that tell the releases apart (the rest are sizes, equal in all three)."""


def tiny_arch(version: Literal["2.0", "2.3", "2.5"], **overrides: Any) -> LTX2TransformerArch:
    """A tiny transformer with the switches of `version` (tests, synthetic checkpoints): video 4 heads x 4,
    audio 2 heads x 4 (so the video side of the audio<->video RoPE groups channels by 4, its attention by 2,
    as happens whenever the head counts differ), 2 blocks, 4 latent channels, caption width 16."""
    release = {"2.0": LTX2_19B, "2.3": LTX23_22B, "2.5": LTX25_22B}[version]
    switches = {k: getattr(release, k) for k in SWITCHES}
    sizes = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 4, "attention_head_dim": 4,
             "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4,
             "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
             "num_layers": 2, "caption_channels": 16}
    return LTX2TransformerArch(**{**switches, **sizes, **overrides})

