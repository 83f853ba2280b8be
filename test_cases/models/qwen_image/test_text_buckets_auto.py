"""`text_buckets: auto` through the Qwen-Image runner (runnerkit/text_buckets.py, docs/prompt_lengths.md):
decided at load from the attention backend, logged in one INFO line and reported in the profile; with
exact lengths warmup runs the warmup prompts' own lengths. The decision itself, per backend:
test_cases/test_text_buckets.py."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from runnerkit import attention, memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.qwen_image.runner import QwenImageRunner
from test_cases.models.qwen_image.conftest import T2I_CONFIG, qwen_config_dict
from test_cases.models.qwen_image.test_text_buckets import spy_attention
from test_cases.test_attention import _fake_flash_attn_cute


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


@pytest.fixture
def info_lines() -> Iterator[list[str]]:
    """The messages of the INFO lines that start with 'text buckets' while the test runs."""
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO",
                      filter=lambda r: r["message"].startswith("text buckets"))
    try:
        yield lines
    finally:
        logger.remove(sink)


def test_the_runner_decides_at_load_reports_it_and_warms_the_exact_lengths(
        qwen_t2i_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, info_lines: list[str]) -> None:
    """Qwen-Image t2i with `auto` on the CPU: SDPA pays for masks, so prompts run at their own lengths;
    the decision is one INFO line and in the profile; warmup runs the warmup prompts' own lengths (no
    padded pass), and a request runs at its prompt's length (spy on the attention's key lengths)."""
    keys = spy_attention(monkeypatch)
    runner = QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt, warmup=True)))
    runner.init_modules()
    reason = ("auto: a key mask would cost sdpa on every step (" + attention.MASK_COST["sdpa"][1] +
              "); exact prompt lengths, `text_buckets: on` pads anyway")
    assert info_lines == [f"text buckets: off, each prompt at its own length ({reason})"]
    assert runner.text_buckets() == ()
    report = runner.profiler.report()["attention"]
    assert (report["backend"], report["text_buckets"], report["text_buckets_reason"]) == ("sdpa", [], reason)
    warm = runner.warmup_info((1, 1, 1))
    lengths = [runner.prompt_length(p) for p in (warm.prompt, warm.negative_prompt)]
    images = [h * w // 256 for h, w, _ in runner.warmup_shapes()]
    assert set(keys) == {n + i for n in lengths for i in images}
    keys.clear()
    prompt = "x " * 7
    runner.run_pipeline(RequestConfig(prompt=prompt, seed=1, save_tensor_path=str(tmp_path / "o.safetensors")), 0)
    n = runner.config.target_height * runner.config.target_width // 256
    assert set(keys) == {runner.prompt_length(prompt) + n, lengths[1] + n}  # cond at its length, the negative at its


def test_the_runner_pads_with_a_free_mask_backend(qwen_t2i_ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                  info_lines: list[str]) -> None:
    """The same config where `auto` finds FlashAttention-4 (a stand-in computing SDPA, on a CPU that
    pretends it runs CUDA kernels): the family's buckets are on, and the log and profile say why."""
    _fake_flash_attn_cute(monkeypatch, [])
    monkeypatch.setattr(attention, "CUDA_ONLY", {})  # let the CPU probe run the stand-in
    monkeypatch.setitem(attention.AUTO_ORDER, "cpu", ("flash_attn_4", "sdpa"))
    runner = QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt)))
    runner.init_modules()
    reason = f"auto: flash_attn_4 applies the padding mask at no steady cost ({attention.MASK_COST['flash_attn_4'][1]})"
    assert runner.attention is not None and runner.attention.name == "flash_attn_4"
    assert runner.text_buckets() == QwenImageRunner.TEXT_BUCKETS == (64, 128, 256, 512, 1024)
    assert info_lines == [f"text buckets: on [64, 128, 256, 512, 1024] ({reason})"]
    assert runner.profiler.report()["attention"]["text_buckets_reason"] == reason
