"""Architecture of the LTX-2 text connectors (Gemma-3 hidden states -> video and audio text embeddings).

Field names are diffusers' `LTX2TextConnectors` config keys (`connectors/config.json`); release
values from diffusers' `scripts/convert_ltx2_to_diffusers.py` (`get_ltx2_connectors_config`).
LTX-2 (19B) vs LTX-2.3 (22B):

- 2.0: one projection of the 49 stacked Gemma layers (no bias) after a masked mean/range norm
  per layer; 2 blocks of 30 x 128 in each connector; no attention gates.
- 2.3: per-modality projections (with bias, to 4096 for video and 2048 for audio) after an RMS
  norm per token and layer; 8 blocks, 32 x 128 (video) and 32 x 64 (audio); gated attention.

Both use 128 learnable registers, split RoPE over 4096 base positions, theta 1e4, float64 frequencies.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from runnerkit.arch import Arch
from runnerkit.models.ltx2.audio_arch import _checked_fields


class LTX2ConnectorsArch(Arch):
    """diffusers `LTX2TextConnectors`; defaults are the LTX-2 (19B) release."""

    caption_channels: int = Field(3840, gt=0, description="Hidden size of the text encoder (Gemma-3 12B: 3840).")
    text_proj_in_factor: int = Field(49, gt=0, description="Stacked hidden states: layers + the embedding output "
                                     "(Gemma-3 12B: 48 + 1).")
    video_connector_num_attention_heads: int = Field(30, gt=0)
    video_connector_attention_head_dim: int = Field(128, gt=0)
    video_connector_num_layers: int = Field(2, ge=0)
    video_connector_num_learnable_registers: int | None = Field(128, gt=0, description="Registers that replace "
                                                                "padding tokens (None: padding is masked instead).")
    video_gated_attn: bool = Field(False, description="Per-head sigmoid gates on the attention output (2.3).")
    audio_connector_num_attention_heads: int = Field(30, gt=0)
    audio_connector_attention_head_dim: int = Field(128, gt=0)
    audio_connector_num_layers: int = Field(2, ge=0)
    audio_connector_num_learnable_registers: int | None = Field(128, gt=0)
    audio_gated_attn: bool = Field(False)
    connector_rope_base_seq_len: int = Field(4096, gt=0, description="Positions are token index / this.")
    rope_theta: float = Field(10000.0, gt=0)
    rope_double_precision: bool = Field(True, description="Compute the RoPE frequency ladder in float64.")
    rope_type: Literal["interleaved", "split"] = Field("interleaved", description="Rotate (2i, 2i+1) pairs "
                                                       "(interleaved) or the two halves of each head (split; releases).")
    per_modality_projections: bool = Field(False, description="2.3: RMS-normed features, one projection per "
                                           "modality; 2.0: masked mean/range norm, one shared projection.")
    video_hidden_dim: int = Field(4096, gt=0, description="Video projection width (per-modality projections only).")
    audio_hidden_dim: int = Field(2048, gt=0, description="Audio projection width (per-modality projections only).")
    proj_bias: bool = Field(False, description="Bias on the input projection(s).")

    def width(self, modality: str) -> int:
        """Width of the `modality` ('video' or 'audio') connector: heads x head size."""
        return getattr(self, f"{modality}_connector_num_attention_heads") * \
            getattr(self, f"{modality}_connector_attention_head_dim")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> LTX2ConnectorsArch:
        for modality in ("video", "audio"):
            heads, head_dim = f"{modality}_connector_num_attention_heads", f"{modality}_connector_attention_head_dim"
            if self._check(info, head_dim) and getattr(self, head_dim) % 2:
                raise ValueError(f"`{head_dim}`={getattr(self, head_dim)} must be even (RoPE rotates pairs)")
            projected = f"{modality}_hidden_dim" if self.per_modality_projections else "caption_channels"
            if self._check(info, heads, head_dim, projected, "per_modality_projections") and \
                    getattr(self, projected) != self.width(modality):
                raise ValueError(f"the {modality} connector's width (`{heads}` x `{head_dim}` = {self.width(modality)})"
                                 f" must equal its input projection's `{projected}`={getattr(self, projected)}")
        return self

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> LTX2ConnectorsArch:
        """From diffusers' `connectors/config.json`. `causal_temporal_positioning` is ignored: no layer reads it."""
        fields = _checked_fields(config, set(cls.model_fields), {"causal_temporal_positioning"}, "connectors")
        return cls.model_validate(fields, strict=False)


LTX2_CONNECTORS = LTX2ConnectorsArch(rope_type="split")
"""LTX-2 (19B) connectors."""
LTX23_CONNECTORS = LTX2ConnectorsArch(
    video_connector_num_attention_heads=32, video_connector_num_layers=8, video_gated_attn=True,
    audio_connector_num_attention_heads=32, audio_connector_attention_head_dim=64, audio_connector_num_layers=8,
    audio_gated_attn=True, rope_type="split", per_modality_projections=True, proj_bias=True)
"""LTX-2.3 (22B) connectors."""

TINY_CONNECTORS = LTX2ConnectorsArch(
    caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=8, video_connector_num_layers=2, video_connector_num_learnable_registers=4,
    audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=2,
    audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=32, rope_type="split")
"""Test size of the 2.0 layout."""
TINY23_CONNECTORS = LTX2ConnectorsArch(**{
    **TINY_CONNECTORS.model_dump(), "video_connector_num_attention_heads": 4, "audio_connector_attention_head_dim": 4,
    "video_gated_attn": True, "audio_gated_attn": True, "per_modality_projections": True, "video_hidden_dim": 32,
    "audio_hidden_dim": 8, "proj_bias": True})
"""Test size of the 2.3 layout: video 4 x 8 = 32 wide, audio 2 x 4 = 8 wide, narrower than the text features."""
