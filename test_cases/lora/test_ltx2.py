"""LTX-2 LoRA: `runnerkit.lora.synthetic` writes an adapter for the tiny LTX-2 config (the family names
its blocks' linear layers, `LTX2Runner.lora_layers`), the runner accepts it as a named adapter and
matches every one of its layers, the adapter changes the request, and the next request without it
equals a fresh runner's (video and audio, bit for bit)."""

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
from runnerkit.config import LoRARequest, RequestConfig, load_runner_config
from runnerkit.lora.synthetic import main as synth_main
from runnerkit.models.ltx2.checkpoint_synthetic import write_synthetic_ltx2
from runnerkit.models.ltx2.runner import LTX2Runner
from test_cases.conftest import REPO, write_config

TINY = REPO / "configs" / "ltx2" / "ltx2_t2av_tiny.json"
REQUEST = RequestConfig(prompt="a red fox runs through fresh snow", seed=11, target_height=64, target_width=64,
                        target_video_length=9)


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


def _config(ckpt: Path, **overrides: Any) -> dict[str, Any]:
    return {**json.loads(TINY.read_text()), "device": "cpu", "model_path": str(ckpt), **overrides}


def _serve(runner: LTX2Runner, path: Path, index: int, lora: list[LoRARequest] | None) -> dict[str, torch.Tensor]:
    runner.run_pipeline(REQUEST.model_copy(update={"lora": lora, "save_tensor_path": str(path)}), index)
    return load_file(str(path))


@pytest.mark.parametrize("layout, prefix", [("lightx2v", "diffusion_model."), ("peft", "transformer.")])
def test_a_synthetic_ltx2_adapter_is_matched_and_removed_exactly(tmp_path: Path, layout: str, prefix: str) -> None:
    ckpt = write_synthetic_ltx2(LTX2Runner.parse_arch(json.loads(TINY.read_text())["model"]), tmp_path / "ckpt", 0,
                                torch.float32)
    adapter = tmp_path / "style.safetensors"
    data = _config(ckpt, lora={"mode": "unfused", "max_rank": 4, "adapters": {"style": str(adapter)}})
    config_path = write_config(tmp_path / "config.json", data)
    assert synth_main(["--config", str(config_path), "--out", str(adapter), "--layout", layout, "--rank", "4",
                       "--dtype", "fp32"]) == 0
    layers, _ = LTX2Runner.lora_layers(load_runner_config(str(config_path), {}), layout)
    num_layers = data["model"]["transformer"]["num_layers"]
    per_block = 5 * 6 + 4  # 6 attentions (video/audio self and cross, audio-to-video, video-to-audio): q, k, v,
    #                        out, gate; 2 feed-forwards: in, out
    assert len(layers) == num_layers * per_block
    with safe_open(str(adapter), "pt") as f:
        keys = set(f.keys())
    down = ".lora_down.weight" if layout == "lightx2v" else ".lora_A.weight"
    assert {k.removeprefix(prefix).removesuffix(down) for k in keys if k.endswith(down)} == set(layers)
    assert prefix + "transformer_blocks.0.audio_to_video_attn.to_q" + down in keys

    runner = LTX2Runner(load_runner_config(str(config_path), {}))
    runner.init_modules()  # the named adapter is read and matched at load
    assert runner.lora is not None
    matched = runner.lora.match([(str(adapter), 1.0)])
    assert sorted(matched["transformer"]) == sorted(layers)
    with_adapter = _serve(runner, tmp_path / "a.safetensors", 0, [LoRARequest(path="style")])
    after = _serve(runner, tmp_path / "b.safetensors", 1, None)

    fresh = LTX2Runner(load_runner_config(None, _config(ckpt)))
    fresh.init_modules()
    want = _serve(fresh, tmp_path / "c.safetensors", 0, None)
    for key in ("video", "audio"):
        assert torch.equal(after[key], want[key]), key
    assert not torch.equal(with_adapter["video"], want["video"]), "the adapter changes the video"
