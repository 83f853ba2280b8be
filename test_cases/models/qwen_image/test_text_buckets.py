"""Qwen-Image text buckets (issue 22, item 1; docs/prompt_lengths.md): prompts padded to a few text
lengths with the padded tokens masked out, and warmup covering every bucket.

What would break silently is checked against something independent of the code that provides it:
the padded call against the unpadded one (the padded rows hold large random values, so any leak
through attention shows), and warmup's coverage through spies on the attention call's key lengths
and the text encoder's input lengths (not through the runner's own bookkeeping).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit import attention, memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.qwen_image import text_encoder as te
from runnerkit.models.qwen_image.arch import QwenImageTransformerArch
from runnerkit.models.qwen_image.runner import QwenImageRunner
from runnerkit.models.qwen_image.transformer import QwenImageTransformer2D
from runnerkit.registry import get_runner_cls
from test_cases.conftest import tiny_config_dict
from test_cases.models.qwen_image.conftest import T2I_CONFIG, qwen_config_dict

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
SHAPES = [(1, 5, 6)]
PAD_TOL = 1e-5
"""Max abs difference, float32, of a padded+masked call from the unpadded one (outputs ~1): the
same math; only the kernels' summation order over the longer sequence differs (measured ~1e-6)."""
PIPELINE_TOL = 1e-4
"""Max abs difference, float32, of a whole request (3 steps, CFG, VAE) with buckets from without
(the parity bound the issue keeps with diffusers)."""


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


def _transformer(seed: int = 0) -> QwenImageTransformer2D:
    torch.manual_seed(seed)
    model = QwenImageTransformer2D(QwenImageTransformerArch(**TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def _padded(txt: torch.Tensor, bucket: int, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """txt [1, L, D] padded to [1, bucket, D] with large random rows (a leak would show), and its mask."""
    B, L, D = txt.shape
    junk = 10 * torch.randn(B, bucket - L, D, generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(bucket)[None] < L  # [1, bucket]
    return torch.cat([txt, junk], dim=1), mask


@torch.no_grad()
@pytest.mark.parametrize("length", [3, 7, 16])
def test_padded_text_with_its_mask_gives_the_unpadded_output(length: int) -> None:
    model = _transformer()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, math.prod(SHAPES[0]), 64, generator=g)
    txt = torch.randn(1, length, 32, generator=g)
    t = torch.tensor([0.6])
    plain = model(x, txt, t, SHAPES)
    padded, mask = _padded(txt, 16)
    out = model(x, padded, t, SHAPES, mask)
    assert plain.abs().max() > 0.1
    assert (out - plain).abs().max().item() <= PAD_TOL
    # forward_branches (block streaming's CFG pass) takes one mask per branch.
    branches = model.forward_branches(x, [padded, txt], t, SHAPES, [mask, None])
    assert (branches[0] - plain).abs().max().item() <= PAD_TOL and torch.equal(branches[1], plain)


@torch.no_grad()
def test_the_mask_is_what_removes_the_padding() -> None:
    """Without the mask the same padded call is far off: the tolerance above is not met by accident."""
    model = _transformer()
    g = torch.Generator().manual_seed(1)
    x, txt, t = torch.randn(1, 30, 64, generator=g), torch.randn(1, 5, 32, generator=g), torch.tensor([0.6])
    padded, mask = _padded(txt, 16)
    assert (model(x, padded, t, SHAPES) - model(x, txt, t, SHAPES)).abs().max().item() > 100 * PAD_TOL


def test_a_mask_of_the_wrong_shape_or_dtype_is_refused_naming_it() -> None:
    model = _transformer()
    x, txt, t = torch.zeros(1, 30, 64), torch.zeros(1, 5, 32), torch.tensor([0.6])
    for bad in (torch.ones(1, 4, dtype=torch.bool), torch.ones(1, 5)):
        with pytest.raises(ValueError, match="`encoder_hidden_states_mask` must be bool \\[1, 5\\]"):
            model(x, txt, t, SHAPES, bad)


def test_bucket_length_takes_the_smallest_bucket_that_holds_the_text() -> None:
    buckets = (64, 128, 256)
    assert [te.bucket_length(n, buckets) for n in (1, 64, 65, 128, 200, 256, 300)] == [64, 64, 128, 128, 256, 256, 300]
    assert te.bucket_length(17, ()) == 17


# ---- the runner --------------------------------------------------------------------------------
def _runner(ckpt: Path, **overrides: Any) -> QwenImageRunner:
    runner = QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, ckpt, **overrides)))
    runner.init_modules()
    return runner


def _image(runner: QwenImageRunner, folder: Path, prompt: str, index: int) -> torch.Tensor:
    path = folder / f"{index}.safetensors"
    runner.run_pipeline(RequestConfig(prompt=prompt, seed=5, save_tensor_path=str(path)), index)
    return load_file(str(path))["image"]


PROMPTS = ("a red fox", "a fox in snow")
"""Two prompts of different token counts that fall in the same bucket (checked in the test)."""


def test_padded_text_encoder_rows_equal_the_unpadded_ones(qwen_t2i_ckpt: Path) -> None:
    runner = _runner(qwen_t2i_ckpt)
    encoder = te.QwenPromptEncoder(runner.tokenizer, None, runner.modules["text_encoder"])
    for prompt in PROMPTS:
        plain = encoder.encode_t2i(prompt)  # [L, D]
        padded = encoder.encode_t2i_padded(prompt, (128, 256))
        L = plain.shape[0]
        assert padded.length == L and padded.embeds.shape == (128, plain.shape[1])
        assert torch.equal(padded.mask, torch.arange(128) < L)
        assert (padded.embeds[:L] - plain).abs().max().item() <= PAD_TOL
        assert torch.count_nonzero(padded.embeds[L:]) == 0


def spy_attention(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The key length of every attention call of the modules the runner installs its backend on (the
    transformer's joint attention), in call order: `attention.install` wrapped (the backend's probe
    at load is not recorded)."""
    keys: list[int] = []
    real_install = attention.install

    def install(model: torch.nn.Module, backend: attention.AttentionBackend) -> int:
        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
            keys.append(k.shape[2])
            return backend.fn(q, k, v, *mask)

        return real_install(model, dataclasses.replace(backend, fn=fn))

    monkeypatch.setattr(attention, "install", install)
    return keys


def test_bucketing_keeps_the_image_and_same_bucket_prompts_share_one_shape(
        qwen_t2i_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prompt's image with buckets equals its image without (PIPELINE_TOL), and the two prompts of
    different lengths run attention at the same key length (a spy on the attention call)."""
    keys = spy_attention(monkeypatch)
    on = _runner(qwen_t2i_ckpt, text_buckets="on")  # the CPU's SDPA pays for masks: `auto` would not pad
    lengths = [on.prompt_length(p) for p in PROMPTS]
    assert lengths[0] != lengths[1] and {te.bucket_length(n, on.text_buckets()) for n in lengths} == {128}
    with_buckets = []
    (tmp_path / "on").mkdir()
    for i, prompt in enumerate(PROMPTS):
        keys.clear()
        with_buckets.append(_image(on, tmp_path / "on", prompt, i))
        assert set(keys) == {128 + 48 * 80 // 256}, keys  # text bucket + image tokens (48x80 -> 15 tokens)
    off = _runner(qwen_t2i_ckpt, text_buckets="off")
    (tmp_path / "off").mkdir()
    for i, prompt in enumerate(PROMPTS):
        plain = _image(off, tmp_path / "off", prompt, i)
        assert plain.abs().max() > 0.1
        assert (with_buckets[i] - plain).abs().max().item() <= PIPELINE_TOL


def test_warmup_runs_every_bucket_at_every_warmup_shape(qwen_t2i_ckpt: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Spies on the attention call's key lengths and the text encoder's input lengths: warmup runs
    every bucket a prompt can reach at each warmup shape, and requests of lengths warmup never saw
    run at their own prompt's bucket, all of them warmed. Also counts warmup's calls (its added cost
    on the CPU)."""
    keys = spy_attention(monkeypatch)
    encoder_inputs: list[int] = []
    real_encode = te.QwenPromptEncoder._encode

    def spy_encode(self: te.QwenPromptEncoder, inputs: dict[str, torch.Tensor], drop_idx: int) -> torch.Tensor:
        encoder_inputs.append(inputs["input_ids"].shape[1])
        return real_encode(self, inputs, drop_idx)

    monkeypatch.setattr(te.QwenPromptEncoder, "_encode", spy_encode)
    runner = _runner(qwen_t2i_ckpt, warmup=True, text_buckets="on")
    buckets = runner.text_buckets()
    shortest = runner.prompt_length("")
    reachable = [b for b in buckets if b >= shortest]
    assert reachable == [128, 256, 512, 1024], (shortest, buckets)  # the tiny tokenizer: the template is ~100 tokens
    image_tokens = [h * w // 256 for h, w, _ in runner.warmup_shapes()]
    layers = runner.transformer.arch.num_layers
    # Text encoder: the default warmup's prompt and negative prompt (both in bucket 128), then both
    # prompts once per other bucket. Transformer: one step, 2 CFG branches, per shape and bucket.
    assert sorted(encoder_inputs) == sorted([te.T2I_DROP_IDX + 128] * 2 +
                                            [te.T2I_DROP_IDX + b for b in reachable[1:] for _ in range(2)])
    expected = {b + n for b in reachable for n in image_tokens}
    assert set(keys) == expected
    assert len(keys) == layers * 2 * len(expected)  # every (bucket, shape): one step, cond + uncond, each layer
    warmed_keys, warmed_inputs = set(keys), set(encoder_inputs)
    # Requests: each prompt pads to the smallest bucket that holds it (the literal below, not
    # `bucket_length`), the default negative prompt to 128, lengths warmup never had among them.
    assert runner.config.negative_prompt is None and runner.prompt_length(runner.DEFAULT_NEGATIVE_PROMPT) <= 128
    (tmp_path / "r").mkdir()
    steps = runner.config.infer_steps
    # the tiny tokenizer: 108 + 2 k tokens for "x " * k; 128 fills its bucket exactly
    for i, (k, bucket) in enumerate([(5, 128), (10, 128), (60, 256), (150, 512)]):
        prompt = "x " * k
        length = runner.prompt_length(prompt)
        assert bucket // 2 < length <= bucket and (length == 128) == (k == 10), (prompt, length)
        keys.clear()
        encoder_inputs.clear()
        _image(runner, tmp_path / "r", prompt, i)
        assert sorted(encoder_inputs) == sorted([te.T2I_DROP_IDX + bucket, te.T2I_DROP_IDX + 128]), (length, bucket)
        n = runner.config.target_height * runner.config.target_width // 256  # image tokens (16x16 pixels each)
        assert sorted(set(keys)) == sorted({bucket + n, 128 + n}), (length, bucket)
        assert len(keys) == steps * layers * 2  # cond + uncond, each layer, each step
        assert set(keys) <= warmed_keys and set(encoder_inputs) <= warmed_inputs


def test_text_buckets_setting_is_checked(qwen_t2i_ckpt: Path, tiny_ckpt: Path) -> None:
    cfg = load_runner_config(None, tiny_config_dict(tiny_ckpt, text_buckets=[64, 512]))
    with pytest.raises(ValueError, match="`text_buckets` \\(\\(64, 512\\)\\) is not read by 'wan2.1' task 't2v'"):
        get_runner_cls(cfg.model_cls, cfg.task)(cfg)
    runner = QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt,
                                                                       text_buckets=[200, 1024])))
    assert runner.text_buckets() == (200, 1024)
    assert QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt, text_buckets="off"))
                           ).text_buckets() == ()
    assert QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt, text_buckets="on"))
                           ).text_buckets() == QwenImageRunner.TEXT_BUCKETS
    with pytest.raises(RuntimeError, match="`text_buckets: auto` is decided at load with the attention backend"):
        QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt))).text_buckets()


@pytest.mark.parametrize("value", ["yes", True, 64, [64.5], ["64"], [128, 64], [64, 64], [0], [2048], []])
def test_a_bad_text_buckets_value_is_one_line_naming_the_field_and_what_is_allowed(value: Any) -> None:
    """Wrong types and wrong values alike: one message naming `text_buckets`, the value and the rule
    (no pydantic union internals); the largest bucket is 1024 tokens, where prompts are cut."""
    from runnerkit.config import ConfigError, load_runner_config

    with pytest.raises(ConfigError) as err:
        load_runner_config(None, {"model_cls": "qwen_image", "task": "t2i", "model_path": "x", "text_buckets": value})
    text = str(err.value)
    assert "`text_buckets` must be 'auto', 'on', 'off' or a non-empty, strictly increasing list of integer" in text
    assert "in [1, 1024]" in text and "literal[" not in text and "tuple[int" not in text
