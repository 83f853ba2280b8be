"""Qwen-Image fixtures: the tiny t2i and edit configs with synthetic checkpoints written once per session."""

from __future__ import annotations

import json
from pathlib import Path
import pytest
import torch

from test_cases.conftest import REPO, config_dict

T2I_CONFIG = REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json"
EDIT_CONFIG = REPO / "configs" / "qwen_image" / "qwen_image_edit_tiny.json"


def _write(config: Path, out: Path, layout: str = "runnerkit") -> Path:
    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic

    arch = QwenImageArch.model_validate(json.loads(config.read_text())["model"])
    return write_synthetic(arch, out, seed=0, dtype=torch.float32, layout=layout)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def qwen_t2i_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic float32 checkpoint (runnerkit layout) of the tiny text-to-image config."""
    return _write(T2I_CONFIG, tmp_path_factory.mktemp("qwen") / "t2i")


@pytest.fixture(scope="session")
def qwen_edit_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic float32 checkpoint (runnerkit layout) of the tiny Edit-Plus config."""
    return _write(EDIT_CONFIG, tmp_path_factory.mktemp("qwen") / "edit")


@pytest.fixture(scope="session")
def qwen_diffusers_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both tiny configs in the diffusers layout (what diffusers' pipelines load)."""
    root = tmp_path_factory.mktemp("qwen_diffusers")
    return {"t2i": _write(T2I_CONFIG, root / "t2i", "diffusers"), "i2i": _write(EDIT_CONFIG, root / "edit", "diffusers")}


qwen_config_dict = config_dict  # the tiny JSON config `config` pointing at a checkpoint, on the CPU


def reference_images(folder: Path) -> tuple[Path, Path]:
    """Two deterministic reference images of different aspect ratios (PNG): 40x56 and 64x36."""
    from runnerkit.images import write_image

    g = torch.Generator().manual_seed(5)
    a, b = folder / "ref_a.png", folder / "ref_b.png"
    write_image(a, torch.rand(3, 56, 40, generator=g) * 2 - 1)
    write_image(b, torch.rand(3, 36, 64, generator=g) * 2 - 1)
    return a, b
