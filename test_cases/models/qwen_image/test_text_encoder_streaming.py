"""Qwen-Image's Qwen2.5-VL text encoder streamed through the block streamer (issue 21,
`offload.stream_modules`): the prompt embeddings the runner uses (text-to-image, and Edit-Plus with
its reference images through the resident vision tower) equal the resident encoder's bit for bit,
from host memory and from the folder's safetensors (transformers 4.x key names), block and phase."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import load_runner_config
from runnerkit.models.qwen_image.edit import QwenImageEditRunner
from runnerkit.models.qwen_image.runner import QwenImageRunner
from runnerkit.runners.pipeline import InputInfo
from test_cases._alignment import misaligned_weights
from test_cases._encoder_streaming import (assert_streamed_parity, deterministic_cuda, layer_units, streamed_encoder,
                                           text_stage, two_requests)
from test_cases.models.qwen_image.conftest import EDIT_CONFIG, T2I_CONFIG, qwen_config_dict, reference_images

CPU = torch.device("cpu")
CASES: dict[str, dict[str, Any]] = {
    "block_cpu": {"mode": "block"},
    "block_disk": {"mode": "block", "storage": "disk"},
    "phase_cpu": {"mode": "phase"},
    "phase_disk_3slots_prefetch2": {"mode": "phase", "storage": "disk", "gpu_slots": 3, "prefetch_depth": 2},
}


def make_runner(cls: type[QwenImageRunner], config: Path, ckpt: Path, **offload: Any) -> QwenImageRunner:
    """`config` over `ckpt`, its text encoder listed in `offload.stream_modules`; prepared, not loaded (so
    `text_buckets` is `on` where the family pads: `auto` is decided at load, with the attention backend)."""
    overrides = {"offload": {"stream_modules": ["transformer", "text_encoder"], **offload},
                 **({"text_buckets": "on"} if cls.TEXT_BUCKETS else {})}
    runner = cls(load_runner_config(None, qwen_config_dict(config, ckpt, **overrides)))
    runner.prepare_load()
    return runner


def embeddings(runner: QwenImageRunner, module: torch.nn.Module, info: InputInfo) -> tuple[torch.Tensor, ...]:
    """The runner's own text stage on `module`: (prompt_embeds, negative_embeds) [1, L, D] each."""
    return text_stage(runner, module, info, "prompt_embeds", "negative_embeds")


def check_streamed(runner: QwenImageRunner, info: InputInfo, case: str) -> None:
    """Resident vs streamed, two requests (a reset between), every layer weight streamed."""
    resident = runner.build_text_encoder(runner.device)
    assert misaligned_weights(resident) == []  # transformers leaves float32 weights on the file mapping: re-homed
    want = embeddings(runner, resident, info)
    phases = ("self_attn", "mlp") if CASES[case]["mode"] == "phase" else ("",)
    with streamed_encoder(runner) as (model, streamer):
        layers = len(model.language_model.layers)
        assert [u.module for u in streamer.units] == layer_units("language_model.layers", layers, phases)
        streamed = {p for u in streamer.units for p in u.params}
        layer_weights = {n for n, _ in model.named_parameters() if n.startswith("language_model.layers.")}
        left = {n.split(".", 3)[3] for n in layer_weights - streamed}  # per layer: what stays resident
        assert left == (set() if phases == ("",) else {"input_layernorm.weight", "post_attention_layernorm.weight"})
        runs, stats = two_requests(lambda m: embeddings(runner, m, info), model, streamer)
    assert_streamed_parity(runs, want, stats, len(streamer.units), CASES[case].get("storage", "cpu"), case)


@pytest.mark.parametrize("case", list(CASES))
def test_t2i_streamed_embeddings_equal_the_resident_encoders(qwen_t2i_ckpt: Path, case: str) -> None:
    runner = make_runner(QwenImageRunner, T2I_CONFIG, qwen_t2i_ckpt, **CASES[case])
    check_streamed(runner, InputInfo(prompt="a red fox in the snow", negative_prompt=" ", seed=0, height=48,
                                     width=80, frames=1), case)


def test_edit_plus_streamed_embeddings_equal_the_resident_encoders(qwen_edit_ckpt: Path, tmp_path: Path) -> None:
    """Two reference images go through the vision tower, which stays resident; the decoder layers stream."""
    a, b = reference_images(tmp_path)
    runner = make_runner(QwenImageEditRunner, EDIT_CONFIG, qwen_edit_ckpt, **CASES["block_disk"])
    check_streamed(runner, InputInfo(prompt="make it blue", negative_prompt=" ", seed=0, height=48, width=80,
                                     frames=1, image_path=str(a), extra_image_paths=(str(b),)), "block_disk")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["block_cpu", "phase_disk_3slots_prefetch2"])
def test_cuda_streamed_embeddings_equal_the_resident_encoders(qwen_t2i_ckpt: Path, case: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (copy stream, pinned slabs), under deterministic algorithms."""
    with deterministic_cuda(monkeypatch):
        runner = make_runner(QwenImageRunner, T2I_CONFIG, qwen_t2i_ckpt, **CASES[case])
        runner.device = torch.device("cuda")
        check_streamed(runner, InputInfo(prompt="a red fox in the snow", negative_prompt=" ", seed=0, height=48,
                                         width=80, frames=1), case)
