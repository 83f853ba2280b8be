"""LTX-2.5 sizes and switches against diffusers' and transformers' classes."""

from __future__ import annotations

import torch

from runnerkit.models.ltx2.arch import LTX23_22B_ARCH
from runnerkit.models.ltx2.ltx25_arch import (
    GEMMA4_12B_TEXT,
    LTX25_22B_ARCH,
    LTX25_DURATION,
    LTX25_TRANSFORMER_CHANGES,
)
from runnerkit.models.ltx2.transformer_arch import tiny_arch
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")
from diffusers import LTX2VideoTransformer3DModel


def test_gemma4_12b_fits_the_connectors_and_the_duration_head_fits_the_transformer() -> None:
    text = transformers.Gemma4UnifiedTextConfig(**GEMMA4_12B_TEXT)
    assert LTX25_22B_ARCH.connectors.caption_channels == text.hidden_size == 3840
    assert LTX25_22B_ARCH.connectors.text_proj_in_factor == text.num_hidden_layers + 1 == 49
    assert text.layer_types.count("full_attention") == 8 and text.layer_types[5::6] == ["full_attention"] * 8
    assert LTX25_DURATION.video_cross_attention_dim == LTX25_22B_ARCH.transformer.inner_dim == 4096
    assert LTX25_DURATION.audio_cross_attention_dim == LTX25_22B_ARCH.transformer.audio_inner_dim == 2048
    assert LTX25_22B_ARCH == LTX23_22B_ARCH.model_copy(update={"transformer": LTX25_22B_ARCH.transformer})
    assert LTX25_22B_ARCH.transformer == LTX23_22B_ARCH.transformer.model_copy(update=LTX25_TRANSFORMER_CHANGES)


def test_transformer_changes_are_the_documented_tensors() -> None:
    """A tiny 2.3 transformer in diffusers, then with LTX-2.5's switches: the video FFN biases go, one
    [1, inner_dim] keyframe embedding comes; nothing else changes. runnerkit reads them from the config."""
    config = {**tiny_arch("2.3").model_dump(), "rope_type": "split"}
    for key in LTX25_TRANSFORMER_CHANGES:
        config.pop(key)
    with torch.device("meta"):
        old = LTX2VideoTransformer3DModel(**config).state_dict()
        new = LTX2VideoTransformer3DModel(**config, **LTX25_TRANSFORMER_CHANGES).state_dict()
    gone = sorted(set(old) - set(new))
    assert gone == sorted(f"transformer_blocks.{i}.ff.net.{j}" for i in range(2) for j in ("0.proj.bias", "2.bias"))
    assert sorted(set(new) - set(old)) == ["keyframes_abs_pos_embedding"]
    assert new["keyframes_abs_pos_embedding"].shape == (1, 16)
    assert type(LTX25_22B_ARCH.transformer).from_diffusers_config(
        {**config, **LTX25_TRANSFORMER_CHANGES}) == tiny_arch("2.5")
