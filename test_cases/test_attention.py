"""Attention backends (runnerkit/attention.py): explicit backends that cannot run are refused at
load with the reason, `auto` is logged and reported, every build path installs the backend, and
each CPU backend agrees with SDPA within a stated tolerance."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit import attention
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.infer import main
from runnerkit.models.qwen_image.arch import QwenImageTransformerArch
from runnerkit.models.qwen_image.transformer import JointAttention, QwenImageTransformer2D
from runnerkit.models.wan.runner import WanT2VRunner
from test_cases.conftest import tiny_config_dict, write_config

CPU = torch.device("cpu")
AGREE = 1e-5
"""Max abs difference from `sdpa` of a tiny transformer's output (float32, values ~1) for every backend the CPU runs."""


def test_explicit_backends_that_cannot_run_are_refused_with_the_reason() -> None:
    with pytest.raises(NotImplementedError, match=r"`attention`='sdpa_cudnn' cannot run on cpu .*head size 64: "
                                                  r"cuDNN attention runs on CUDA devices only"):
        attention.resolve("sdpa_cudnn", CPU, torch.float32, 64)
    with pytest.raises(NotImplementedError, match="FlashAttention-4 runs on CUDA devices only"):
        attention.resolve("flash_attn_4", CPU, torch.float32, 64)
    with pytest.raises(ValueError, match="`attention` must be one of"):
        attention.resolve("xformers", CPU, torch.float32, 64)
    chosen = attention.resolve("auto", CPU, torch.float32, 64)
    assert chosen.name == "sdpa" and chosen.reason.startswith("auto")


def test_launch_script_refuses_an_unavailable_backend_at_load(tiny_ckpt: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, attention="sdpa_cudnn"))
    rc = main(["--config_json", str(config), "--prompt", "x", "--save_tensor_path", str(tmp_path / "o.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "`attention`='sdpa_cudnn' cannot run on cpu" in err and "Traceback" not in err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("name", ["sdpa_math", "sdpa_flash", "sdpa_efficient"])
def test_cpu_backends_agree_with_sdpa(name: str) -> None:
    why = attention.probe(name, CPU, torch.float32, 16)
    if why is not None:
        with pytest.raises(NotImplementedError, match=f"`attention`='{name}' cannot run on cpu"):
            attention.resolve(name, CPU, torch.float32, 16)
        return
    arch = QwenImageTransformerArch(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    axes_dims_rope=(4, 6, 6))
    torch.manual_seed(0)
    model = QwenImageTransformer2D(arch).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    x, ctx, t = torch.randn(1, 24 + 6, 64), torch.randn(1, 7, 32), torch.tensor([0.6])
    shapes = [(1, 4, 6), (1, 2, 3)]
    with torch.inference_mode():
        ref = model(x, ctx, t, shapes)
        assert attention.install(model, attention.resolve(name, CPU, torch.float32, 16)) == arch.num_layers
        got = model(x, ctx, t, shapes)
    err = (got - ref).abs().max().item()
    assert err <= AGREE, err


@pytest.mark.parametrize("overrides", [{}, {"offload": {"mode": "block"}},
                                       {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
                                       {"unload_modules": True}], ids=["none", "block", "lazy", "unload"])
def test_every_build_path_installs_the_backend(tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               overrides: dict[str, Any]) -> None:
    calls = []
    real = attention.backend_fn

    def counting(name: str) -> attention.AttentionFn:
        fn = real(name)
        if name != "sdpa_math":
            return fn

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            calls.append(q.shape)
            return fn(q, k, v)

        return attend

    monkeypatch.setattr(attention, "backend_fn", counting)
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, attention="sdpa_math", **overrides)))
    runner.init_modules()
    calls.clear()  # the probe's call
    runner.run_pipeline(RequestConfig(prompt="x", save_tensor_path=str(tmp_path / "o.safetensors")), 0)
    steps, cfg, blocks = runner.config.infer_steps, 2, runner.parse_arch(runner.config.model).transformer.num_layers
    assert len(calls) == steps * cfg * blocks * 2  # self- and cross-attention of every block, both CFG branches
    assert runner.profiler.report()["attention"] == {"backend": "sdpa_math", "reason": "asked for by the config",
                                                     "head_dim": 32, "text_buckets": [],
                                                     "text_buckets_reason": "the family's text has one fixed length"}


def test_every_attention_module_of_both_families_takes_the_backend() -> None:
    from runnerkit.models.wan.arch import WanTransformerArch
    from runnerkit.models.wan.transformer import WanSelfAttention, WanTransformer3D

    wan = WanTransformer3D(WanTransformerArch(dim=64, ffn_dim=128, freq_dim=32, text_dim=64, num_heads=2, num_layers=3))
    backend = attention.resolve("sdpa_math", CPU, torch.float32, 32)
    assert attention.install(wan, backend) == sum(isinstance(m, WanSelfAttention) for m in wan.modules()) == 6
    assert all(m.attention_fn is backend.fn for m in wan.modules() if isinstance(m, WanSelfAttention))
    qwen = QwenImageTransformer2D(QwenImageTransformerArch(num_layers=3, attention_head_dim=16, num_attention_heads=2,
                                                           joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))
    assert attention.install(qwen, backend) == sum(isinstance(m, JointAttention) for m in qwen.modules()) == 3


def test_profile_json_reports_the_backend(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt))
    rc = main(["--config_json", str(config), "--prompt", "x", "--save_tensor_path", str(tmp_path / "o.safetensors"),
               "--profile_json", str(tmp_path / "p.json")])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "p.json").read_text())["attention"]["backend"] == "sdpa"


def _fake_flash_attn_cute(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[int, ...]]) -> None:
    """Install a stand-in `flash_attn.cute` whose `flash_attn_func` takes FA4's [B, L, N, d] layout and
    returns `(out, lse)` as FA4 does, computing SDPA (the CPU has no FA4 kernel)."""
    import importlib.machinery
    import types

    @torch.compiler.disable  # untraceable, as FA4's autograd Function around CuTe-DSL launches is
    def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, None]:
        calls.append(tuple(q.shape))
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).contiguous(), None

    @torch.compiler.disable
    def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """FA4's batched varlen call: batch element b attends to its first `seqused_k[b]` keys only."""
        calls.append(("varlen", *q.shape))
        outs = []
        for b in range(q.shape[0]):
            n = int(seqused_k[b]) if seqused_k is not None else k.shape[1]
            outs.append(flash_attn_func(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])[0])
            calls.pop()
        return torch.cat(outs), None

    pkg, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    cute.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute", None)
    cute.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    cute.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    pkg.cute = cute  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(attention, "_FA4_FUNC", None)
    monkeypatch.setattr(attention, "_FA4_VARLEN", None)


def test_flash_attn_4_takes_fa4_layout_and_compiles_as_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FA4 backend hands FA4 its [B, L, N, d] layout, unpacks `(out, lse)`, returns SDPA's layout,
    and is one opaque custom op to dynamo: a block using it compiles with `fullgraph=True`."""
    calls: list[tuple[int, ...]] = []
    _fake_flash_attn_cute(monkeypatch, calls)
    fn = attention.backend_fn("flash_attn_4")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 16, generator=g) for _ in range(3))  # [B, N, L, d]
    torch.testing.assert_close(fn(q, k, v), attention.sdpa(q, k, v), rtol=0, atol=0)
    assert calls == [(1, 10, 2, 16)]  # FA4 saw [B, L, N, d]

    arch = QwenImageTransformerArch(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    axes_dims_rope=(4, 6, 6))
    torch.manual_seed(0)
    model = QwenImageTransformer2D(arch).eval()
    attention.install(model, attention.AttentionBackend("flash_attn_4", fn, "test"))
    block = model.transformer_blocks[0]
    torch._dynamo.reset()
    compiled = torch.compile(block.forward, backend="aot_eager", fullgraph=True)  # a graph break raises here
    img, txt = torch.randn(1, 12, 32), torch.randn(1, 5, 32)  # [B, L_img, dim], [B, L_txt, dim]
    temb = torch.randn(1, 1, 32)  # [B, S, dim]
    rope = model.rope_for_shapes([(1, 3, 4)], 5, CPU)
    with torch.inference_mode():
        eager = block(img, txt, temb, rope, [12])
        traced = compiled(img, txt, temb, rope, [12])
    for a, b in zip(eager, traced, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert len(calls) == 3  # the direct call, the eager block, the compiled block (tracing used the fake)


def test_a_backend_that_asserts_on_the_probe_is_skipped_by_auto_and_refused_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashAttention-4 rejects float32 and unsupported head sizes with `assert` (seen on the H200: `auto`
    with FA4 installed crashed a float32 run at load): the probe turns any failure into a reason."""
    calls: list[tuple[int, ...]] = []
    _fake_flash_attn_cute(monkeypatch, calls)
    fake = sys.modules["flash_attn.cute"]

    def asserting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        assert q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"

    monkeypatch.setattr(fake, "flash_attn_func", asserting)
    monkeypatch.setattr(attention, "CUDA_ONLY", {})  # let the CPU probe run the stand-in
    monkeypatch.setitem(attention.AUTO_ORDER, "cpu", ("flash_attn_4", "sdpa"))
    with pytest.raises(NotImplementedError, match="`attention`='flash_attn_4' cannot run on cpu .*inputs must be "
                                                  "float16 or bfloat16"):
        attention.resolve("flash_attn_4", CPU, torch.float32, 64)
    chosen = attention.resolve("auto", CPU, torch.float32, 64)
    assert chosen.name == "sdpa" and "flash_attn_4: inputs must be float16 or bfloat16" in chosen.reason


def test_a_run_with_masks_takes_only_a_backend_that_applies_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded text (docs/prompt_lengths.md) needs a key mask: a FlashAttention-4 without the varlen entry
    point (stand-in, working without a mask) is skipped by `auto` and refused when asked with the reason;
    SDPA takes the mask and matches the math path on the unmasked keys alone."""
    _fake_flash_attn_cute(monkeypatch, [])
    monkeypatch.delattr(sys.modules["flash_attn.cute"], "flash_attn_varlen_func")
    monkeypatch.setattr(attention, "CUDA_ONLY", {})  # let the CPU probe run the stand-in
    monkeypatch.setitem(attention.AUTO_ORDER, "cpu", ("flash_attn_4", "sdpa"))
    assert attention.resolve("auto", CPU, torch.float32, 16).name == "flash_attn_4"  # without masks it runs
    with pytest.raises(NotImplementedError, match="`attention`='flash_attn_4' cannot run on cpu .* with a key mask "
                                                  "\\(padded text: set `text_buckets` to 'auto' or 'off'.*"
                                                  "flash_attn_varlen_func"):
        attention.resolve("flash_attn_4", CPU, torch.float32, 16, masked=True)
    chosen = attention.resolve("auto", CPU, torch.float32, 16, masked=True)
    assert chosen.name == "sdpa" and "flash_attn_4: " in chosen.reason
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 16, generator=g) for _ in range(3))
    mask = torch.arange(12)[None, None, None] < 9  # the last 3 keys padded
    out = chosen(q, k, v, mask)
    ref = attention.backend_fn("sdpa_math")(q, k[:, :, :9], v[:, :, :9])
    assert (out - ref).abs().max().item() <= 1e-6


def test_flash_attn_4_applies_a_key_mask_as_a_key_count_over_the_kept_keys_moved_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a mask, FA4 gets K and V with the kept keys first (pads in the middle, as Qwen-Image's
    [text + pads, image] joint sequence has them; a different mask per batch element) and `seqused_k`
    = their count: the result equals SDPA with the mask on the same inputs; `auto` takes FA4 for a
    masked run; a block with the masked op compiles as one graph."""
    calls: list[tuple] = []
    _fake_flash_attn_cute(monkeypatch, calls)
    monkeypatch.setattr(attention, "CUDA_ONLY", {})  # let the CPU probe run the stand-in
    monkeypatch.setitem(attention.AUTO_ORDER, "cpu", ("flash_attn_4", "sdpa"))
    chosen = attention.resolve("auto", CPU, torch.float32, 16, masked=True)
    assert chosen.name == "flash_attn_4"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 16, generator=g) for _ in range(3))  # [B, N, L, d]
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[0, 4:8] = False  # batch 0: 4 text pads after 4 text tokens, then image keys
    keep[1, 2:8] = False  # batch 1: 6 pads
    mask = keep[:, None, None]
    calls.clear()
    out = chosen(q, k, v, mask)
    assert calls == [("varlen", 2, 20, 3, 16)]
    ref = attention.sdpa(q, k, v, mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    kf, vf, used = attention.keys_first(k.transpose(1, 2), v.transpose(1, 2), keep)
    assert used.tolist() == [16, 14] and used.dtype == torch.int32
    assert torch.equal(kf[1, :14], k.transpose(1, 2)[1][keep[1]])  # kept keys first, in their order
    compiled = torch.compile(lambda a, b, c, m: attention.flash_attn_4(a, b, c, m), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled(q, k, v, mask), ref, rtol=0, atol=1e-6)
