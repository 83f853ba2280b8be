"""Every shipped config can be given to the synthetic-checkpoint tool (issue 19: the Wan2.1 i2v and
flf2v 14B configs were refused, their `model` lacking `image_encoder`).

The tool runs for real up to its first weight write: every family's writer validates the config's
`model` as a whole architecture and builds every network on the meta device (all tensor shapes)
before it writes a tensor; `runnerkit.synthetic.write_sharded`, the first write, stops it there, so
no 14B or 20B weights are written.

LTX-2's real-size configs omit `model` (the architecture is the checkpoint's, which the release file
does not spell out in runnerkit's form): the tool takes the architecture of the checkpoint at
`model_path` and, with none there, refuses naming `model` (bench/DEVICE_RUN.md §9 writes the 22B one
from a config that adds the release's `model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runnerkit import synthetic
from runnerkit.tools import synth_checkpoint
from test_cases.conftest import REPO

ALL_CONFIGS = sorted((REPO / "configs").glob("*/*.json"))
FROM_CHECKPOINT = [p for p in ALL_CONFIGS if p.parent.name == "ltx2" and "model" not in json.loads(p.read_text())
                   and "synthetic_checkpoint" not in json.loads(p.read_text())]
"""Configs whose architecture is their checkpoint's (no `model`, not synthetic)."""
CONFIGS = [p for p in ALL_CONFIGS if p not in FROM_CHECKPOINT]


class FirstWeightWrite(Exception):
    """Raised where the tool would write its first tensor: everything before it passed."""


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{p.parent.name}/{p.stem}" for p in CONFIGS])
def test_every_shipped_config_reaches_the_first_weight_write(config: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[dict[str, Any]] = []

    def stop(tensor_shapes: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        shapes.append(tensor_shapes)
        raise FirstWeightWrite

    monkeypatch.setattr(synthetic, "write_sharded", stop)
    out = tmp_path / "ckpt"
    with pytest.raises(FirstWeightWrite):
        synth_checkpoint.main(["--config", str(config), "--out", str(out)])
    assert len(shapes) == 1 and shapes[0], "the writer stopped at its first tensor write"
    assert not out.exists() and list(tmp_path.iterdir()) == []  # the partial folder is removed


@pytest.mark.parametrize("config", FROM_CHECKPOINT, ids=[p.stem for p in FROM_CHECKPOINT])
def test_a_config_of_an_absent_checkpoint_without_model_is_refused_naming_model(
        config: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Not the tiny default architecture under a 22B config's name: exit 2, nothing written."""
    out = tmp_path / "ckpt"
    assert synth_checkpoint.main(["--config", str(config), "--out", str(out)]) == 2
    assert "`model` is omitted" in capfd.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_omitted_wan_image_encoder_is_the_released_clip_and_an_explicit_null_is_refused() -> None:
    """The fix: `image_encoder` omitted under an image-attending transformer means the released CLIP
    (as the original layout reads it), like the other components' defaults; `null` stays an error."""
    from runnerkit.models.wan.arch import CLIPVisionArch
    from runnerkit.models.wan.runner import WanT2VRunner

    transformer = {"model_type": "i2v", "in_dim": 36}
    assert WanT2VRunner.parse_arch({"transformer": transformer}).image_encoder == CLIPVisionArch()
    assert WanT2VRunner.parse_arch({"transformer": {}}).image_encoder is None  # t2v: none
    with pytest.raises(ValueError, match=r"`image_encoder` \(the CLIP vision tower\) is needed"):
        WanT2VRunner.parse_arch({"transformer": transformer, "image_encoder": None})
