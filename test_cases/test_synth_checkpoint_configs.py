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
import torch

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


@pytest.mark.parametrize("family", ["qwen_image", "ltx2"])
def test_a_rank_other_than_0_writes_the_whole_text_encoder(family: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun every rank writes its own temporary copy of a synthetic checkpoint and the first
    complete one is renamed into place. transformers (5.x) `save_pretrained` writes nothing on a rank
    other than 0 once a process group exists, so a rank-1 copy lacked its text encoder, and when it won
    the rename the cached checkpoint stayed broken for every later run. Rank 1 is simulated through
    transformers' own helpers: the text encoder's weights are written all the same."""
    from transformers.distributed import mixin

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    if family == "qwen_image":
        from runnerkit.models.qwen_image.arch import QwenImageArch
        from runnerkit.models.qwen_image.text_encoder import write_tiny_text_encoder

        arch = QwenImageArch.model_validate(
            json.loads((REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json").read_text())["model"])
        folder = write_tiny_text_encoder(tmp_path / "te", arch.text_encoder, seed=0, dtype=torch.float32)
    else:
        from runnerkit.models.ltx2.arch import tiny_ltx2_arch
        from runnerkit.models.ltx2.checkpoint_synthetic import write_tiny_gemma

        folder = write_tiny_gemma(tmp_path / "te", tiny_ltx2_arch("2.3"), 0)
    written = sorted(p.name for p in folder.iterdir())
    assert "config.json" in written and any(n.endswith(".safetensors") for n in written), written


def test_a_synthetic_config_pointing_at_a_file_says_how_to_run_from_it(tmp_path: Path) -> None:
    """A tiny config (`synthetic_checkpoint`) whose `model_path` names a file (a single-file release) is refused at
    load, naming the path and the key to remove to run from existing files."""
    from runnerkit.config import load_runner_config
    from runnerkit.registry import get_runner_cls
    from runnerkit.weights import CheckpointError

    file = tmp_path / "release.safetensors"
    file.write_bytes(b"x")
    data = {**json.loads((REPO / "configs/wan/wan_t2v_tiny.json").read_text()), "model_path": str(file)}
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    with pytest.raises(CheckpointError, match=r"`model_path` '.*release.safetensors' is a file; a synthetic checkpoint "
                                              r"needs a folder \(to run from existing files, remove "
                                              r"`synthetic_checkpoint` from the config\)"):
        runner.init_modules()


@pytest.mark.parametrize("shown", [True, False])
def test_a_transformers_write_shows_no_progress_bars_and_leaves_the_setting_as_it_was(shown: bool,
                                                                                      tmp_path: Path) -> None:
    """transformers' shard-writing progress bars are off while a synthetic text encoder is saved (the writer logs
    one line instead), and the caller's setting is restored after."""
    from transformers.utils import logging as hf_logging

    seen: list[bool] = []

    class Model:
        def save_pretrained(self, folder: Path) -> None:
            seen.append(hf_logging.is_progress_bar_enabled())

    (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    try:
        synthetic.save_pretrained_here(Model(), tmp_path)
        assert seen == [False] and hf_logging.is_progress_bar_enabled() is shown
    finally:
        hf_logging.enable_progress_bar()


@pytest.mark.parametrize("family", ["wan/wan_t2v_tiny", "qwen_image/qwen_image_t2i_tiny", "ltx2/ltx2_t2av_tiny"])
def test_a_synthetic_checkpoint_written_in_another_dtype_is_refused(family: str, tmp_path: Path) -> None:
    """The values of a synthetic checkpoint are drawn in its dtype: a folder written by a float32 run is refused by
    a bfloat16 run of the same config (naming both dtypes), as a folder of another seed is, and taken again by a
    float32 run. The marker says what was written."""
    from runnerkit.config import load_runner_config
    from runnerkit.registry import get_runner_cls
    from runnerkit.weights import CheckpointError

    data = {**json.loads((REPO / f"configs/{family}.json").read_text()), "model_path": str(tmp_path / "ckpt"),
            "device": "cpu"}

    def locate(dtype: str) -> Any:
        config = load_runner_config(None, {**data, "dtype": dtype})
        return get_runner_cls(config.model_cls, config.task)(config).checkpoints.locate()

    locate("float32")
    marker = json.loads((tmp_path / "ckpt" / synthetic.SYNTHETIC_MARKER).read_text())
    assert (marker["dtype"], marker["seed"]) == ("float32", data["synthetic_checkpoint"]["seed"]), marker
    with pytest.raises(CheckpointError, match=r"holds synthetic weights written in float32, but `dtype` is "
                                              r"'bfloat16': use another model_path$"):
        locate("bfloat16")
    locate("float32")


@pytest.mark.parametrize("text, reader, message", [
    ("[1, 2]", "seed", "is unreadable: it holds a JSON list, not an object; delete"),
    ("{}", "seed", "is unreadable: its `seed` is missing, not an integer; delete"),
    ('{"seed": null}', "seed", "is unreadable: its `seed` is None, not an integer; delete"),
    ('{"seed": "x"}', "seed", "is unreadable: its `seed` is 'x', not an integer; delete"),
    ('{"seed": true}', "seed", "is unreadable: its `seed` is True, not an integer; delete"),
    ('{"seed": 0, "dtype": 7}', "dtype", "is unreadable: its `dtype` is 7, not one of 'float32', 'bfloat16', "
                                         "'float16'; delete"),
    ('{"seed": 0', "seed", "is unreadable (Expecting"),
])
def test_a_damaged_marker_is_named_with_what_is_wrong(text: str, reader: str, message: str, tmp_path: Path) -> None:
    """The synthetic checkpoint's marker, damaged: one CheckpointError naming the file, what it holds instead and
    the folder to delete (never a Python error's wording such as 'list indices must be integers')."""
    from runnerkit.weights import CheckpointError

    (tmp_path / synthetic.SYNTHETIC_MARKER).write_text(text)
    read = synthetic.synthetic_seed_of if reader == "seed" else synthetic.synthetic_dtype_of
    with pytest.raises(CheckpointError) as err:
        read(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / synthetic.SYNTHETIC_MARKER} {message}"), str(err.value)
    assert str(err.value).endswith(f"delete {tmp_path} to write it again"), str(err.value)
