"""Every shipped config can be given to the synthetic-checkpoint tool (issue 19: the Wan2.1 i2v and
flf2v 14B configs were refused, their `model` lacking `image_encoder`).

The tool runs for real up to its first weight write: every family's writer validates the config's
`model` as a whole architecture and builds every network on the meta device (all tensor shapes)
before it writes a tensor; `runnerkit.synthetic.write_sharded`, the first write, stops it there, so
no 14B or 20B weights are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runnerkit import synthetic
from runnerkit.tools import synth_checkpoint
from test_cases.conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*/*.json"))


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
