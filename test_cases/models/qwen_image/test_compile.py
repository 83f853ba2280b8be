"""Regional compile of the Qwen-Image transformer on the CPU (counting with the `eager` backend;
see test_cases/test_compile.py for the core's tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.qwen_image.edit import QwenImageEditRunner
from runnerkit.models.qwen_image.runner import QwenImageRunner
from test_cases.models.qwen_image.conftest import EDIT_CONFIG, T2I_CONFIG, qwen_config_dict

COMPILE = {"compile": {"enabled": True, "backend": "eager"}}


pytestmark = pytest.mark.usefixtures("fresh_compiler")


def test_qwen_image_new_prompt_lengths_and_reference_counts_compile_nothing_after_warmup(
        qwen_t2i_ckpt: Path, qwen_edit_ckpt: Path, tmp_path: Path) -> None:
    """Without CFG warmup sees one prompt length; the text dimension is marked dynamic, so another
    prompt length compiles nothing. Editing: 1 and 2 references after warmup compile nothing."""
    t2i = QwenImageRunner(load_runner_config(None, qwen_config_dict(
        T2I_CONFIG, qwen_t2i_ckpt, warmup=True, enable_cfg=False, sample_guide_scale=None, **COMPILE)))
    t2i.init_modules()
    for i, prompt in enumerate(["x", "a much longer prompt about a red fox in fresh snow at dawn"]):
        prof = t2i.run_pipeline(RequestConfig(prompt=prompt, save_tensor_path=str(tmp_path / f"t{i}.safetensors")), i)
        assert prof.audit["compilations"] == 0 and prof.audit["recompilations"] == 0, (prompt, prof.audit)
    edit = QwenImageEditRunner(load_runner_config(None, qwen_config_dict(EDIT_CONFIG, qwen_edit_ckpt, warmup=True,
                                                                         **COMPILE)))
    edit.init_modules()
    grey = tmp_path / "grey.png"
    Image.new("RGB", (96, 64), (90, 90, 90)).save(grey)
    for i, extra in enumerate([None, [str(grey)]]):
        prof = edit.run_pipeline(RequestConfig(prompt="make it blue", image_path=str(grey), extra_image_paths=extra,
                                               save_tensor_path=str(tmp_path / f"e{i}.safetensors")), i)
        assert prof.audit["compilations"] == 0 and prof.audit["recompilations"] == 0, (extra, prof.audit)
