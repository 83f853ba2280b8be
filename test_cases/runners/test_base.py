"""The lifecycle template: final init_modules, config lock, phase tagging, registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from runnerkit.config import load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.registry import get_runner_cls, register_runner
from runnerkit.runners.base import ConfigLockedError, error_phase, lifecycle_phase
from test_cases.conftest import tiny_config_dict


def test_init_modules_cannot_be_overridden() -> None:
    with pytest.raises(TypeError, match="overrides init_modules"):
        class Sneaky(WanT2VRunner):  # noqa: F841
            def init_modules(self) -> None:  # type: ignore[override]
                pass


def test_config_is_locked_after_load(tiny_ckpt: Path) -> None:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt)))
    runner.init_modules()
    assert runner.config.model["transformer"]["num_layers"] == 2  # resolved during load
    with pytest.raises(ConfigLockedError, match="infer_steps"):
        runner.update_config(infer_steps=8)
    assert runner.config.infer_steps == 4


def test_phase_tag_keeps_type_and_first_phase() -> None:
    with pytest.raises(KeyError) as exc:
        with lifecycle_phase("request 2"), lifecycle_phase("inner"):
            raise KeyError("x")
    assert error_phase(exc.value) == "inner"
    assert exc.value.__notes__ == ["[runnerkit] raised during phase: inner"]


def test_registry_rejects_duplicates_and_lists_known_names() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_runner("wan2.1")(WanT2VRunner)
    with pytest.raises(ValueError, match=r"unknown `model_cls` 'nope'; registered: \['wan2.1'\]"):
        get_runner_cls("nope")


def test_unknown_task_is_refused(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="`task` 'i2v' is not served by model_cls 'wan2.1'"):
        WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, task="i2v")))
