"""Text buckets decided with the attention backend (runnerkit/text_buckets.py, docs/prompt_lengths.md):
`auto` pads prompts only for a backend that declares key masks free and runs with one; explicit
settings are kept whatever the backend; the decision is logged in one INFO line; `attention: auto`
takes FlashAttention-4 when it imports and the device is one it targets. Through the Qwen-Image runner:
test_cases/models/qwen_image/test_text_buckets_auto.py.

Fakes: backends are `AttentionBackend`s with a declared `mask_cost` around SDPA (the CPU has no
FlashAttention-4); the device-dependent parts (`torch.cuda.get_device_capability`, the kernels' probe)
are monkeypatched where a CUDA device is pretended.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from loguru import logger

from runnerkit import attention
from runnerkit.attention import AttentionBackend, MaskCost
from runnerkit.text_buckets import TextBuckets, auto_buckets, choose
from test_cases.test_attention import _fake_flash_attn_cute

CPU = torch.device("cpu")
FAMILY = (64, 128, 256)
HEAD = 16


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


def _fake(name: str, cost: MaskCost, masks: bool = True) -> AttentionBackend:
    """A backend declaring `cost` that computes SDPA; with `masks` False it raises when handed a mask."""

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None and not masks:
            raise NotImplementedError(f"{name} has no masked kernel")
        return attention.sdpa(q, k, v, mask)

    return AttentionBackend(name, fn, "test", cost)


@pytest.mark.parametrize("backend, lengths, reason", [
    (_fake("free", "free"), FAMILY, "auto: free applies the padding mask at no steady cost (it declares key masks "
                                    "free)"),
    (_fake("costly", "costly"), (), "auto: a key mask would cost costly on every step (it declares key masks costly); "
                                    "exact prompt lengths, `text_buckets: on` pads anyway"),
    (_fake("maskless", "none"), (), "auto: maskless takes no key mask (it declares key masks none); exact prompt "
                                    "lengths"),
    (_fake("broken", "free", masks=False), (), "auto: broken takes key masks at no steady cost but not here (broken "
                                               "has no masked kernel); exact prompt lengths"),
], ids=["free", "costly", "none", "free but fails the masked probe"])
def test_auto_pads_only_for_a_backend_that_takes_masks_free(backend: AttentionBackend, lengths: tuple[int, ...],
                                                            reason: str) -> None:
    assert auto_buckets(backend, FAMILY, CPU, torch.float32, HEAD) == TextBuckets(lengths, reason)


def test_the_shipped_backends_declare_what_a_mask_costs_them() -> None:
    """Every backend name has a declaration, and `resolve` carries it: FA4's key count is free, SDPA's
    masked kernels cost every step (cuDNN's bias: 6-10 % a Qwen-Image step), FA2 takes none."""
    assert set(attention.MASK_COST) == set(attention.ATTENTION_NAMES) - {"auto"}
    assert {name: cost for name, (cost, _) in attention.MASK_COST.items()} == {
        "sdpa": "costly", "sdpa_cudnn": "costly", "sdpa_flash": "none", "sdpa_efficient": "costly",
        "sdpa_math": "costly", "flash_attn_4": "free"}
    assert attention.resolve("auto", CPU, torch.float32, HEAD).mask_cost == "costly"  # sdpa
    assert attention.resolve("sdpa_math", CPU, torch.float32, HEAD).mask_cost == "costly"


@pytest.mark.parametrize("setting, lengths, masked, reason", [
    ("auto", (), False, "auto: a key mask would cost sdpa on every step (" + attention.MASK_COST["sdpa"][1] +
     "); exact prompt lengths, `text_buckets: on` pads anyway"),
    ("on", FAMILY, True, "config `text_buckets`: on; sdpa pays for the key mask on every step"),
    ((8, 300), (8, 300), True, "config `text_buckets`: [8, 300]; sdpa pays for the key mask on every step"),
    ("off", (), False, "config `text_buckets`: off"),
])
def test_explicit_settings_are_kept_whatever_the_backend(monkeypatch: pytest.MonkeyPatch, info_lines: list[str],
                                                         setting: Any, lengths: tuple[int, ...], masked: bool,
                                                         reason: str) -> None:
    """On the CPU `auto` takes SDPA, which pays for masks: `auto` keeps exact lengths, and the backend is
    resolved as for unpadded text; `on` and a list pad anyway and resolve a backend that takes a mask;
    one INFO line says which and why."""
    asked: list[bool] = []
    real = attention.resolve

    def resolve(*args: Any, **kwargs: Any) -> AttentionBackend:
        asked.append(kwargs.get("masked", args[4] if len(args) > 4 else False))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "resolve", resolve)
    backend, buckets = choose("auto", setting, FAMILY, CPU, torch.float32, HEAD)
    assert backend.name == "sdpa" and asked == [masked]
    assert buckets == TextBuckets(lengths, reason)
    state = f"on {list(lengths)}" if lengths else "off, each prompt at its own length"
    assert info_lines == [f"text buckets: {state} ({reason})"]


def test_a_family_with_one_text_length_runs_unpadded_and_logs_nothing(info_lines: list[str]) -> None:
    backend, buckets = choose("auto", "auto", None, CPU, torch.float32, HEAD)
    assert backend.name == "sdpa" and buckets == TextBuckets((), "the family's text has one fixed length")
    assert info_lines == []


# ---- `attention: auto` and FlashAttention-4 ---------------------------------------------------------
@pytest.mark.parametrize("installed, capability, name, skipped", [
    (True, (9, 0), "flash_attn_4", None),
    (True, (10, 3), "flash_attn_4", None),
    (False, (9, 0), "sdpa_cudnn", "flash-attn-4 is not installed (the `flash_attn.cute` package of "
                                  "Dao-AILab/flash-attention; pip install 'runnerkit[fa4]', README)"),
    (True, (8, 0), "sdpa_cudnn", "FlashAttention-4 targets Hopper (sm_90) and Blackwell (sm_100, sm_103, sm_110); "
                                 "this device is sm_80"),
    (True, (12, 0), "sdpa_cudnn", "FlashAttention-4 targets Hopper (sm_90) and Blackwell (sm_100, sm_103, "
                                  "sm_110); this device is sm_120"),
], ids=["hopper", "blackwell", "not installed", "ampere", "consumer blackwell"])
def test_auto_takes_flash_attn_4_when_it_imports_on_a_device_it_targets(
        monkeypatch: pytest.MonkeyPatch, installed: bool, capability: tuple[int, int], name: str,
        skipped: str | None) -> None:
    """A pretended CUDA device whose kernels all pass the probe: FA4 first when it imports and the device
    is Hopper/Blackwell, else the next of `AUTO_ORDER` (cuDNN) with FA4's reason; the text buckets
    follow (FA4: on; cuDNN: exact lengths)."""
    if installed:
        _fake_flash_attn_cute(monkeypatch, [])
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # find_spec: not importable
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    probed: list[str] = []

    def probe_fn(fn: attention.AttentionFn, device: torch.device, dtype: torch.dtype, head_dim: int,
                 masked: bool = False) -> None:
        probed.append(getattr(fn, "__name__", "?") + (" masked" if masked else ""))

    monkeypatch.setattr(attention, "probe_fn", probe_fn)
    backend, buckets = choose("auto", "auto", FAMILY, torch.device("cuda"), torch.bfloat16, 128)
    assert backend.name == name and backend.mask_cost == attention.MASK_COST[name][0]
    assert backend.reason == "auto: first available" + (f" (not available: flash_attn_4: {skipped})" if skipped else "")
    if name == "flash_attn_4":
        assert probed == ["flash_attn_4", "flash_attn_4 masked"] and buckets.lengths == FAMILY
    else:  # the FA4 candidate never reached its kernel probe; cuDNN's mask costs: no masked probe
        assert probed == ["attend"] and buckets.lengths == ()


# ---- on a GPU ------------------------------------------------------------------------------------
CUDA = torch.device("cuda")


@pytest.mark.gpu
def test_on_this_gpu_auto_pads_with_flash_attn_4() -> None:
    """The real FlashAttention-4, where it runs: `auto` takes it, and it pads the text (its masked kernel
    ran in the probe). Skipped with the reason where it does not run (not installed, another GPU)."""
    why = attention.fa4_device_reason(CUDA) or attention.probe("flash_attn_4", CUDA, torch.bfloat16, 128, masked=True)
    if why is not None:
        pytest.skip(f"FlashAttention-4 does not run here with a mask: {why}")
    backend, buckets = choose("auto", "auto", FAMILY, CUDA, torch.bfloat16, 128)
    assert backend.name == "flash_attn_4" and buckets.lengths == FAMILY


@pytest.mark.gpu
def test_on_this_gpu_cudnn_keeps_exact_lengths_unless_asked() -> None:
    """cuDNN attention takes the mask as a bias (it runs with one: `on` pads), but `auto` keeps exact lengths."""
    why = attention.probe("sdpa_cudnn", CUDA, torch.bfloat16, 128, masked=True)
    if why is not None:
        pytest.skip(f"cuDNN attention does not run here with a mask: {why}")
    backend, buckets = choose("sdpa_cudnn", "auto", FAMILY, CUDA, torch.bfloat16, 128)
    assert (backend.name, backend.mask_cost, buckets.lengths) == ("sdpa_cudnn", "costly", ())
    assert choose("sdpa_cudnn", "on", FAMILY, CUDA, torch.bfloat16, 128)[1].lengths == FAMILY
