"""Qwen-Image's memory estimate from the architecture alone (models/qwen_image/estimate.py): the weights as the
runner loads them (a tiny checkpoint, before and after loading), the release's language-model head, and the
image decode bound against the H200 measurement it is calibrated on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.models.qwen_image.arch import QwenImageArch
from runnerkit.models.qwen_image.estimate import footprints, image_decode_bytes, qwen_estimate
from runnerkit.models.qwen_image.runner import QwenImageRunner
from runnerkit.planning.fit import GIB
from test_cases.conftest import config_dict
from test_cases.models.qwen_image.conftest import T2I_CONFIG


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def test_the_weights_are_the_loaded_modules(qwen_t2i_ckpt: Path) -> None:
    runner = QwenImageRunner(load_runner_config(None, config_dict(T2I_CONFIG, qwen_t2i_ckpt, offload={"mode": "none"})))
    before = runner.estimate_memory((32, 32, 1))  # from the checkpoint's files, nothing loaded
    runner.init_modules()
    after = runner.estimate_memory((32, 32, 1))
    assert before == after
    assert {n: m.weight_bytes for n, m in after.modules.items()} == {
        n: _bytes(runner.modules[n]) for n in ("text_encoder", "transformer", "vae")}


def test_a_streamed_text_encoder_has_no_language_model_head() -> None:
    arch = QwenImageArch()
    whole = footprints(arch, torch.bfloat16, OffloadConfig(mode="block"))["text_encoder"]
    streamed = footprints(arch, torch.bfloat16, OffloadConfig(mode="block", stream_modules=["text_encoder",
                                                                                             "transformer"]))
    head = arch.text_encoder.vocab_size * arch.text_encoder.hidden_size * 2
    assert whole.weight_bytes - streamed["text_encoder"].weight_bytes == head
    assert not whole.stream_default and whole.streams  # it can stream when listed: the planner's ladder asks


def test_the_image_decode_bound_against_the_h200_peak() -> None:
    """bench/results/qwen_image_h200_none.json, 1328x1328 all resident: 53.756 GiB peak allocated, 39.426 GiB
    allocated before the first request (the weights): 14.33 GiB of decode activations. The bound: at most 2 % over
    it, never under."""
    arch = QwenImageArch()
    decode, detail = image_decode_bytes(arch, 1328 // 8, 1328 // 8, "cuda")
    measured = (53.7559 - 39.4255) * GIB
    assert 1.0 <= decode / measured <= 1.02, detail
    est = qwen_estimate(arch, (1328, 1328, 1), torch.bfloat16, torch.device("cuda"), True, OffloadConfig())
    assert max(est.stages, key=lambda s: s.activation_bytes).name == "vae_decoder"
    assert {s.name for s in est.stages} == {"text_encoder", "transformer", "vae_decoder", "save"}


def test_editing_counts_its_references() -> None:
    arch = QwenImageArch.model_validate({"edit": {"variant": "edit_plus"}})
    plain = qwen_estimate(arch, (1024, 1024, 1), torch.bfloat16, torch.device("cuda"), True, OffloadConfig())
    edit = qwen_estimate(arch, (1024, 1024, 1), torch.bfloat16, torch.device("cuda"), True, OffloadConfig(),
                         images=3)
    steps = {s.name: s.activation_bytes for s in plain.stages}, {s.name: s.activation_bytes for s in edit.stages}
    assert "vae_encoder" in steps[1] and "vae_encoder" not in steps[0]
    assert steps[1]["transformer"] > 3 * steps[0]["transformer"]  # 3 x 4096 reference tokens beside 4096


@pytest.mark.parametrize("device_gib, mode", [(80, "none"), (24, "block")])
def test_the_release_plans_without_weights(device_gib: int, mode: str) -> None:
    config = load_runner_config(T2I_CONFIG.parent / "qwen_image_t2i_20b.json",
                                {"model_path": "absent", "memory.limit_gib": device_gib, "memory.host_limit_gib": 128})
    runner = QwenImageRunner.for_plan(config, torch.device("cuda"))
    plan = runner.memory_checks.plan_memory(())
    assert plan is not None and plan.offload.mode == mode
    assert plan.chosen.peak is not None and plan.chosen.peak.bytes <= device_gib * GIB
