"""A config's `model` given as a partial override of a checkpoint's architecture (`model_path` set)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from runnerkit.models.wan.arch import WanArch

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "wan"


@pytest.mark.parametrize("config", ["wan_i2v_tiny.json", "wan_flf2v_tiny.json"])
def test_image_config_model_with_clip_is_a_valid_override(config: str) -> None:
    """`image_context` omitted: the checkpoint decides, and the CLIP rule is checked after merging."""
    model = json.loads((CONFIGS / config).read_text())["model"]
    assert WanArch.model_validate(model, context={"partial": True}).transformer.image_context is None
    assert WanArch.model_validate(model).transformer.image_context is True  # the whole architecture (merged)
    no_clip = {**model, "transformer": {**model["transformer"], "image_context": False}}
    with pytest.raises(ValidationError, match="takes no CLIP image tokens"):
        WanArch.model_validate(no_clip, context={"partial": True})
