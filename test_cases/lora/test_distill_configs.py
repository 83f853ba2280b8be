"""The step-distilled configs (Wan2.1-T2V-14B with LightX2V's 4-step distill adapter, Qwen-Image with
Qwen-Image-Lightning's 8-step one) run end to end with a synthetic adapter of the real key layout
written by `python -m runnerkit.lora.synthetic`, on the tiny architectures: their fixed sigma table
drives the steps, CFG is off, and the adapter changes the result."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.files import new_file_mode
from runnerkit.lora.synthetic import main as synth_main
from runnerkit.registry import get_runner_cls
from test_cases.conftest import REPO, write_config
from test_cases.models.qwen_image.conftest import qwen_t2i_ckpt  # noqa: F401  (a session fixture of that folder)

CASES = {
    # shipped config, tiny config (its architecture), ckpt fixture, adapter name, its layout's first key prefix
    "wan_distill4": ("configs/wan/wan_t2v_14b_distill4.json", "configs/wan/wan_t2v_tiny.json", "tiny_ckpt", "distill4",
                     "diffusion_model.blocks.0."),
    "qwen_lightning8": ("configs/qwen_image/qwen_image_t2i_20b_lightning8.json", "configs/qwen_image/qwen_image_t2i_tiny.json",
                        "qwen_t2i_ckpt", "lightning8", "diffusion_model.transformer_blocks.0."),
}


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


@pytest.mark.parametrize("case", list(CASES))
def test_distilled_config_runs_with_a_synthetic_adapter(case: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    shipped, tiny, ckpt_fixture, name, prefix = CASES[case]
    data: dict[str, Any] = json.loads((REPO / shipped).read_text())
    table = data["sample_sigmas"]
    assert data["enable_cfg"] is False and data["infer_steps"] == len(table)
    adapter = tmp_path / f"{name}.safetensors"
    data.update(model=json.loads((REPO / tiny).read_text())["model"], model_path=str(request.getfixturevalue(ckpt_fixture)),
                device="cpu", dtype="float32", target_height=32, target_width=32,
                target_video_length=min(data["target_video_length"], 5))
    data["lora"]["adapters"] = {name: str(adapter)}
    config_path = write_config(tmp_path / "config.json", data)
    assert synth_main(["--config", str(config_path), "--out", str(adapter), "--rank", "4", "--dtype", "fp32"]) == 0
    assert adapter.stat().st_mode & 0o777 == new_file_mode()  # the umask's mode, not the writer's 0o600
    with safe_open(str(adapter), "pt") as f:  # LightX2V's layout: original names, down/up pairs with alpha
        keys = set(f.keys())
    assert prefix + "self_attn.q.lora_down.weight" in keys or prefix + "attn.to_q.lora_down.weight" in keys, sorted(keys)[:4]
    assert all(k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in keys)

    config = load_runner_config(str(config_path), {})
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.init_modules()
    sched = runner.schedulers["transformer"]
    assert sched.fixed_sigmas == tuple(table)
    out = []
    for i, lora in enumerate(([{"path": name}], None)):
        path = tmp_path / f"r{i}.safetensors"
        prof = runner.run_pipeline(RequestConfig(prompt="a fox", seed=2, lora=lora, save_tensor_path=str(path)), i)
        assert len(prof.steps) == len(table)
        out.append(next(iter(load_file(str(path)).values())))
    assert not torch.equal(out[0], out[1]), "the adapter changes the result"
