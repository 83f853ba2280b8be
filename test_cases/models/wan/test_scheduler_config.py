"""Wan2.1's sampling schedule choice: the reference's spacing by default, and `sample_shift` from a
diffusers folder's `scheduler/scheduler_config.json` unless the run config sets one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import write_synthetic
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.models.wan.scheduler_config import SCHEDULER_CONFIG, SYNTHETIC_FLOW_SHIFT, read_flow_shift
from runnerkit.models.wan.transformer import WanTransformer3D
from runnerkit.registry import get_runner_cls
from runnerkit.runners.base import error_phase
from runnerkit.weights import CheckpointError
from test_cases._reference import require_reference
from test_cases.conftest import TINY_CONFIG, tiny_config_dict
from test_cases.schedulers.test_spacing import GOLDEN

FAMILY_SHIFT = WanT2VRunner.DEFAULTS["sample_shift"]


@pytest.fixture(scope="module")
def diffusers_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny architecture in the diffusers layout (with its scheduler config), float32."""
    arch = WanArch.model_validate(json.loads(TINY_CONFIG.read_text())["model"])
    return write_synthetic(arch, tmp_path_factory.mktemp("sched") / "wan_tiny_diffusers", seed=0,
                           dtype=torch.float32, layout="diffusers")


def _config_dict(ckpt: Path, **overrides: Any) -> dict[str, Any]:
    """The tiny config on `ckpt` with `sample_shift` and `scheduler_spacing` left to the family."""
    data = tiny_config_dict(ckpt, model=None, **overrides)
    for key in ("sample_shift", "scheduler_spacing"):
        if key not in overrides:
            data.pop(key, None)
    return data


def _loaded(ckpt: Path, **overrides: Any) -> tuple[WanT2VRunner, list[str]]:
    """A runner on `ckpt` after init_modules, and the log messages of loading."""
    messages: list[str] = []
    sink = logger.add(messages.append, level="INFO", format="{message}")
    try:
        config = load_runner_config(None, _config_dict(ckpt, **overrides))
        runner = get_runner_cls(config.model_cls)(config)
        runner.init_modules()
    finally:
        logger.remove(sink)
    assert isinstance(runner, WanT2VRunner)
    return runner, messages


def _copy_with_scheduler_config(src: Path, dst: Path, content: str | None) -> Path:
    """A copy of the checkpoint `src` whose scheduler config holds `content` (None: no file)."""
    shutil.copytree(src, dst)
    path = dst / SCHEDULER_CONFIG
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    return dst


# ---- read_flow_shift ---------------------------------------------------------------------------
@pytest.mark.parametrize(("content", "expected"), [
    ('{"flow_shift": 3.0}', 3.0), ('{"flow_shift": 7}', 7.0), ('{"solver_order": 2}', None), (None, None)])
def test_read_flow_shift(tmp_path: Path, content: str | None, expected: float | None) -> None:
    if content is not None:
        (tmp_path / "scheduler").mkdir()
        (tmp_path / SCHEDULER_CONFIG).write_text(content)
    assert read_flow_shift(tmp_path) == expected


@pytest.mark.parametrize(("content", "message"), [
    ('{"flow_shift": 0}', r"`flow_shift` in .* must be a number > 0 \(got 0\)"),
    ('{"flow_shift": -2.5}', r"must be a number > 0 \(got -2.5\)"),
    ('{"flow_shift": "3.0"}', r"must be a number > 0 \(got '3.0'\)"),
    ('{"flow_shift": true}', r"must be a number > 0 \(got True\)"),
    ('{"flow_shift": NaN}', r"must be a number > 0 \(got nan\)"),
    ("[3.0]", "must hold a JSON object"),
    ("{flow_shift: 3}", "is not valid JSON"),
])
def test_read_flow_shift_refuses_a_broken_file(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "scheduler").mkdir()
    (tmp_path / SCHEDULER_CONFIG).write_text(content)
    with pytest.raises(CheckpointError, match=message) as info:
        read_flow_shift(tmp_path)
    assert "scheduler_config.json" in str(info.value)


def test_synthetic_diffusers_checkpoint_has_a_scheduler_config_diffusers_reads(diffusers_ckpt: Path) -> None:
    diffusers = require_reference("diffusers")
    sched = diffusers.UniPCMultistepScheduler.from_pretrained(diffusers_ckpt, subfolder="scheduler")
    assert sched.config.flow_shift == SYNTHETIC_FLOW_SHIFT != FAMILY_SHIFT
    assert sched.config.use_flow_sigmas and sched.config.prediction_type == "flow_prediction"
    assert read_flow_shift(diffusers_ckpt) == SYNTHETIC_FLOW_SHIFT


# ---- sample_shift precedence: config > checkpoint > family default ------------------------------
def test_checkpoint_flow_shift_replaces_the_family_default(diffusers_ckpt: Path, tmp_path: Path) -> None:
    runner, messages = _loaded(diffusers_ckpt)
    assert runner.config.sample_shift == SYNTHETIC_FLOW_SHIFT
    assert runner.scheduler.shift == SYNTHETIC_FLOW_SHIFT
    assert any(f"sample_shift {SYNTHETIC_FLOW_SHIFT} from the checkpoint's scheduler/scheduler_config.json" in m
               for m in messages), messages
    resolved = [m for m in messages if m.startswith("resolved config: ")]
    assert len(resolved) == 1 and json.loads(resolved[0].removeprefix("resolved config: "))["sample_shift"] == 3.0

    # The saved result's sidecar records the shift the request ran with.
    png = tmp_path / "frame.png"
    runner.run_pipeline(RequestConfig(prompt="a kite", seed=3, target_height=32, target_width=32,
                                      target_video_length=1, save_result_path=str(png)), 0)
    sidecar = json.loads(png.with_suffix(".json").read_text())
    assert sidecar["config"]["sample_shift"] == SYNTHETIC_FLOW_SHIFT
    assert sidecar["config"]["scheduler_spacing"] == "train_range"


@pytest.mark.parametrize("shift", [FAMILY_SHIFT, 7.0])
def test_the_configs_own_shift_wins_over_the_checkpoint(diffusers_ckpt: Path, shift: float) -> None:
    # FAMILY_SHIFT: a value equal to the family default is still the user's choice.
    runner, messages = _loaded(diffusers_ckpt, sample_shift=shift)
    assert runner.config.sample_shift == shift and runner.scheduler.shift == shift
    assert any(f"sample_shift {shift} from the config (the checkpoint's" in m and f"flow_shift {SYNTHETIC_FLOW_SHIFT}" in m
               for m in messages), messages


def test_a_checkpoint_without_flow_shift_keeps_the_family_default(tiny_ckpt: Path, diffusers_ckpt: Path,
                                                                   tmp_path: Path) -> None:
    no_key = _copy_with_scheduler_config(diffusers_ckpt, tmp_path / "no_key", '{"solver_order": 2}')
    no_file = _copy_with_scheduler_config(diffusers_ckpt, tmp_path / "no_file", None)
    for ckpt in (tiny_ckpt, no_key, no_file):  # runnerkit layout: never a scheduler config
        runner, messages = _loaded(ckpt)
        assert runner.config.sample_shift == FAMILY_SHIFT and runner.scheduler.shift == FAMILY_SHIFT, ckpt
        assert any(f"sample_shift {FAMILY_SHIFT} (the family default)" in m for m in messages), messages


def test_a_broken_flow_shift_fails_the_load(diffusers_ckpt: Path, tmp_path: Path) -> None:
    broken = _copy_with_scheduler_config(diffusers_ckpt, tmp_path / "broken", '{"flow_shift": -1}')
    config = load_runner_config(None, _config_dict(broken))
    runner = get_runner_cls(config.model_cls)(config)
    with pytest.raises(CheckpointError, match=r"`flow_shift` in .*broken.* must be a number > 0 \(got -1\)") as info:
        runner.init_modules()
    assert error_phase(info.value) == "load"


# ---- the reference's spacing is the family default ----------------------------------------------
def test_default_spacing_is_the_reference_one_end_to_end(tiny_ckpt: Path, mocker: Any) -> None:
    # Through the config, the family defaults, the pipeline description and the runner's scheduler
    # to the timesteps the transformer receives: a silent fallback to diffusers' grid fails here
    # (diffusers' last timestep would be 625, not 624).
    assert WanT2VRunner.DEFAULTS["scheduler_spacing"] == "train_range"
    runner, _ = _loaded(tiny_ckpt)
    assert runner.config.scheduler_spacing == "train_range" and runner.scheduler.spacing == "train_range"
    forward = mocker.spy(WanTransformer3D, "forward")
    runner.run_pipeline(RequestConfig(prompt="a kite", seed=3, target_height=32, target_width=32,
                                      target_video_length=5), 0)
    seen = [call.args[2].tolist() for call in forward.call_args_list]  # (self, latents, timestep, context)
    timesteps = GOLDEN[(4, FAMILY_SHIFT)][0]
    assert seen == [[t] for t in timesteps for _ in ("cond", "uncond")]

    runner.scheduler.prepare((1, 4), 50, seed=0, device="cpu")  # the production step count
    assert runner.scheduler.sigmas.tolist() == GOLDEN[(50, FAMILY_SHIFT)][1]


def test_diffusers_spacing_is_an_option(tiny_ckpt: Path) -> None:
    runner, _ = _loaded(tiny_ckpt, scheduler_spacing="diffusers")
    assert runner.config.scheduler_spacing == "diffusers" and runner.scheduler.spacing == "diffusers"
    runner.scheduler.prepare((1, 4), 4, seed=0, device="cpu")
    assert runner.scheduler.timesteps.tolist() == [999, 937, 833, 625]  # diffusers' grid (test_unipc.py)
