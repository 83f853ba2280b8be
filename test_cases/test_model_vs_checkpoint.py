"""A config's `model` against the architecture in a checkpoint's own config files, for every family: the
checkpoint's config wins; a `model` field with another value is a load error naming the field, both values and
the file (nothing is silently corrected); what the checkpoint does not say (the original Wan layout's text
encoder and VAE) comes from `model`. Synthetic checkpoints are written from the config's `model`: they agree."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from runnerkit.config import load_runner_config
from runnerkit.registry import get_runner_cls
from runnerkit.tools import synth_checkpoint
from runnerkit.weights import CheckpointError
from test_cases.conftest import REPO, config_dict

# (tiny config, layout written, the file the error names, relative to the checkpoint: one for the whole
# architecture, or None: a diffusers folder, whose component's own config.json is named on the field's line)
CASES = {
    "wan-runnerkit": ("wan/wan_t2v_tiny.json", "runnerkit", "runnerkit.json"),
    "wan-original": ("wan/wan_t2v_tiny.json", "original", "config.json"),
    "wan-diffusers": ("wan/wan_t2v_tiny.json", "diffusers", None),
    "qwen_image": ("qwen_image/qwen_image_t2i_tiny.json", "runnerkit", "runnerkit.json"),
    "qwen_image-diffusers": ("qwen_image/qwen_image_t2i_tiny.json", "diffusers", None),
    "ltx2": ("ltx2/ltx2_t2av_tiny.json", "diffusers", None),
    "ltx2.5": ("ltx2/ltx25_t2av_tiny.json", "diffusers", None),
}


@pytest.fixture(scope="module", params=list(CASES))
def written(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str | None]:
    """A case's config (pointing at its checkpoint), the checkpoint written from its `model`, and its files."""
    config, layout, files = CASES[request.param]
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    assert synth_checkpoint.main(["--config", str(REPO / "configs" / config), "--out", str(out), "--layout", layout,
                                  "--dtype", "fp32"]) == 0
    return config_dict(REPO / "configs" / config, out), out, files


def _open(data: dict[str, Any], ckpt: Path) -> Any:
    config = load_runner_config(None, data)
    return get_runner_cls(config.model_cls, config.task)(config).open_checkpoint(ckpt)


def test_a_checkpoint_written_from_the_config_agrees(written: tuple[dict[str, Any], Path, str | None]) -> None:
    data, ckpt, _ = written
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    assert runner.open_checkpoint(ckpt).arch == type(runner).parse_arch(data["model"])  # original Wan: T5/VAE from `model`


def test_a_model_field_that_disagrees_is_a_load_error_naming_both_values_and_the_file(
        written: tuple[dict[str, Any], Path, str | None]) -> None:
    data, ckpt, file = written
    changed = copy.deepcopy(data)
    changed["model"]["transformer"]["num_layers"] = 3
    with pytest.raises(CheckpointError) as exc:
        _open(changed, ckpt)
    lines = str(exc.value).splitlines()
    head = "the checkpoint's config files" if file is None else f"{ckpt}/{file}"
    assert lines[0].endswith(f"the config's `model` disagrees with the architecture in {head}:"), lines
    where = f", in {ckpt}/transformer/config.json" if file is None else ""
    assert f"  `model.transformer.num_layers` 3 (the checkpoint's: 2{where})" in lines, lines


def test_a_partial_model_that_agrees_is_taken(written: tuple[dict[str, Any], Path, str | None]) -> None:
    data, ckpt, _ = written
    if data["model_cls"].startswith("ltx2"):
        pytest.skip("LTX-2's `model` gives every component (arch.py `from_config_model`)")
    partial = {**data, "model": {"transformer": {"num_layers": 2}}}
    if data["model_cls"] == "wan2.1" and (ckpt / "config.json").exists():
        partial["model"] = {**data["model"], "transformer": {"num_layers": 2}}  # original: T5 and VAE from `model`
    assert _open(partial, ckpt).arch.transformer.num_layers == 2
