"""An LTX-2.5 diffusers folder's own files: the synthetic writer's one warning, and a bad `config.json` of the
duration head or diffusion decoder refused at load naming the file, the key, the value and what is allowed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger

from runnerkit.config import load_runner_config
from runnerkit.models.ltx2.arch25 import tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint25 import write_synthetic_ltx25
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.runners.base import error_phase
from runnerkit.weights import CheckpointError

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ltx2" / "ltx25_t2av_tiny.json"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The tiny pipeline as a diffusers folder (seed 0, float32), and the warnings its writer logged."""
    out = tmp_path_factory.mktemp("ltx25") / "ckpt"
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        write_synthetic_ltx25(tiny_ltx25_arch(), out, 0, torch.float32)
    finally:
        logger.remove(sink)
    return out, warnings


def test_the_writer_warns_once_naming_the_final_folder(written: tuple[Path, list[str]]) -> None:
    out, warnings = written
    assert warnings == [(f"wrote a SYNTHETIC checkpoint of RANDOM weights (seed 0, diffusers layout) to {out}: its "
                         "output is noise")]


@pytest.mark.parametrize(("component", "change", "says"), [
    ("diffusion_decoder", {"latent_channels": "8"},
     "  `latent_channels`: Input should be a valid integer (got '8'); allowed: int > 0"),
    ("diffusion_decoder", {"decoder_head_dims": 8},
     "  `decoder_head_dims`: unknown key (got 8); allowed keys: out_channels, latent_channels, patch_size, "),
    ("diffusion_decoder", {"decoder_model_output_type": "eps"},
     "  `decoder_model_output_type`: Input should be 'x0' or 'v' (got 'eps'); allowed: 'x0' | 'v'"),
    ("duration_head", {"num_queries": 2.5},
     "  `num_queries`: Input should be a valid integer (got 2.5); allowed: int > 0"),
], ids=["string-for-int", "unknown-key", "literal", "float-for-int"])
def test_a_bad_config_json_is_a_load_error_naming_file_key_value_and_allowed(
        written: tuple[Path, list[str]], tmp_path: Path, component: str, change: dict[str, Any], says: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written[0], ckpt)
    file = ckpt / component / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    data = json.loads(CONFIG.read_text())
    del data["synthetic_checkpoint"], data["model"]  # the architecture is the folder's own
    runner = LTX25Runner(load_runner_config(None, {**data, "model_path": str(ckpt), "device": "cpu"}))
    with pytest.raises(CheckpointError) as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "load"
    first, line = str(exc.value).splitlines()[:2]
    assert first == f"architecture in config.json files of {ckpt}: invalid {component} config in {file}:"
    assert line.startswith(says), line
