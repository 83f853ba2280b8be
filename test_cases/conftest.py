"""Shared fixtures: the tiny Wan config with a synthetic checkpoint written once per session."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import RunnerConfig, load_runner_config

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "wan" / "wan_t2v_tiny.json"

# A shell that starts the suite in the background (`cmd &`) makes it ignore SIGINT, and an ignored
# signal stays ignored in every subprocess: the Ctrl-C tests would then see runs that never stop.
# A Python handler here is reset to the default at exec, so the subprocesses get Ctrl-C back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic checkpoints without a model_path go to a per-session temp cache, never ~/.cache."""
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path_factory.getbasetemp() / "rk_cache"))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic checkpoint (runnerkit layout, float32) of the tiny config's architecture."""
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import write_synthetic

    data = json.loads(TINY_CONFIG.read_text())
    path = tmp_path_factory.mktemp("ckpt") / "wan_tiny"
    write_synthetic(WanArch.model_validate(data["model"]), path, seed=0, dtype=torch.float32)
    return path


def tiny_config_dict(ckpt: Path, **overrides: Any) -> dict[str, Any]:
    """The tiny JSON config pointing at `ckpt` (no synthetic writing), with overrides, on the CPU."""
    return config_dict(TINY_CONFIG, ckpt, **overrides)


def config_dict(config: Path, ckpt: Path, **overrides: Any) -> dict[str, Any]:
    """The JSON config `config` pointing at `ckpt` (no synthetic writing), with overrides (dicts
    merged one level deep), on the CPU."""
    data = json.loads(config.read_text())
    data.pop("synthetic_checkpoint")
    data.update(model_path=str(ckpt), device="cpu")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


@pytest.fixture
def tiny_config(tiny_ckpt: Path) -> RunnerConfig:
    return load_runner_config(None, tiny_config_dict(tiny_ckpt))


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def fresh_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's compile caches and runnerkit's compiled block forwards emptied (compilation counts
    start from zero), and no real gc freeze (tests build many runners in one process)."""
    import gc

    from runnerkit import compile as regional_compile
    from runnerkit import memory

    torch._dynamo.reset()
    regional_compile._COMPILED.clear()
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)

