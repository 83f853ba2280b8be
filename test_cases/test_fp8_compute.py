"""fp8 compute (`compute_dtype: fp8`, runnerkit/fp8_compute.py) on the CPU, whose `torch._scaled_mm`
takes rowwise scales (torch 2.13), so the real GEMM runs here: the layer's exact math, its error
against the unquantized layer within E4M3's bound, which layers convert (Wan, Qwen-Image), a whole
tiny Wan request against the unquantized run, LoRA on top, model offload, compile without graph
breaks or recompiles after warmup, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from runnerkit import fp8_compute
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.fp8_compute import Fp8Linear, convert_blocks, error_bound
from runnerkit.infer import main
from runnerkit.lora.apply import LoRALinear, attach_slots
from runnerkit.models.wan.runner import WanT2VRunner
from test_cases.conftest import REPO, tiny_config_dict, write_config

SHAPE = (32, 48, 5)
"""A small request (latent 2 x 4 x 6 -> 12 tokens) that keeps each request well under a second of transformer time."""


def _reference_quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 quantization written out independently of `quantize_rows`: [R, C] -> (q float32 holding
    E4M3 values, scale [R, 1] float32)."""
    scale = t.float().abs().max(dim=1, keepdim=True).values.clamp(min=1e-12) / 448.0
    q = (t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return q, scale


def _wide_range_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, nn.Linear]:
    """x [2, 5, 64] whose rows (tokens) span 8 orders of magnitude (so per-token scaling matters and some
    elements fall into E4M3's subnormal range) and a 64 -> 48 linear with bias, in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=gen) * torch.logspace(-4, 4, 10).reshape(2, 5, 1)
    x[0, 0, :8] *= 1e-4  # a few elements far below their row's max: subnormal after scaling
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen) * torch.logspace(-2, 1, 48).reshape(48, 1))
        lin.bias.copy_(torch.randn(48, generator=gen))
    return x.to(dtype), lin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_float32_math_of_its_quantized_values(dtype: torch.dtype) -> None:
    """y = (x_q s_x)(W_q s_w)^T + b, up to float32 accumulation order and the one rounding to `dtype`."""
    x, lin = _wide_range_inputs(dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    fp8 = Fp8Linear.convert(lin)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (1, 48)
    assert fp8.bias is not None and fp8.bias.dtype == dtype
    wq, ws = _reference_quantize(w)
    assert torch.equal(fp8.weight.float(), wq) and torch.equal(fp8.weight_scale, ws.t())
    y = fp8(x)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    xq, xs = _reference_quantize(x.reshape(10, 64))
    want = ((xq * xs) @ (wq * ws).t() + b.float()).reshape(2, 5, 48)  # float32
    tol = (4 * 64 * torch.finfo(torch.float32).eps) * ((xq * xs).abs() @ (wq * ws).abs().t()).reshape(2, 5, 48)
    if dtype != torch.float32:
        tol = tol + torch.finfo(dtype).eps * want.abs()  # the output's one rounding (half an ulp, with margin)
    err = (y.float() - want).abs()
    assert (err <= tol + 1e-30).all(), f"max excess {(err - tol).max().item():.3g}"


def test_fp8_linear_against_the_unquantized_layer_is_within_the_e4m3_bound() -> None:
    """Each operand element is within max(2^-4 |v|, 2^-10 scale) of its value (3 mantissa bits; subnormals),
    so |y_fp8 - y| <= sum_k |x| e_w + e_x |w| + e_x e_w (`error_bound`), plus float32 accumulation. The bound
    is met, not vacuous (the error is not 0 and its median is a few percent of it), and the relative error
    of the whole output is E4M3-sized (< 2^-4)."""
    x, lin = _wide_range_inputs(torch.float32)
    w = lin.weight.detach().clone()
    exact = lin(x).detach()  # [2, 5, 48]
    y = Fp8Linear.convert(lin)(x)
    bound = error_bound(x.reshape(10, 64), w).reshape(2, 5, 48) + 1e-5 * exact.abs() + 1e-30
    err = (y - exact).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    assert err.max() > 0 and (err / bound).median() > 0.01
    per_token = err.norm(dim=-1) / exact.norm(dim=-1)  # every token, whatever its magnitude (per-token scales)
    assert per_token.max() < 2 ** -4, per_token


def test_an_all_zero_token_gives_the_bias() -> None:
    lin = nn.Linear(32, 16)
    fp8 = Fp8Linear.convert(lin)
    y = fp8(torch.zeros(3, 32))
    assert torch.equal(y, fp8.bias.detach().expand(3, 16))


def test_wan_blocks_convert_every_linear_and_nothing_else(tiny_ckpt: Path) -> None:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, compute_dtype="fp8")))
    runner.init_modules()
    model = runner.transformer
    assert model is not None
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    per_block = {"self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                 "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2"}
    assert fp8 == {f"blocks.{i}.{n}" for i in range(2) for n in per_block}
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}  # embeddings, time projection, head
    assert plain and all(not n.startswith("blocks.") for n in plain), plain


def test_qwen_image_keeps_its_modulation_projections() -> None:
    """Qwen-Image's `FP8_SKIP` keeps `img_mod`/`txt_mod` (AdaLN) in the model dtype; the attention and MLP
    linears convert; nothing outside the blocks does."""
    from runnerkit.models.qwen_image.arch import QwenImageTransformerArch
    from runnerkit.models.qwen_image.transformer import QwenImageTransformer2D

    data = json.loads((REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json").read_text())
    model = QwenImageTransformer2D(QwenImageTransformerArch.model_validate(data["model"]["transformer"]))
    done, kept = convert_blocks(model, "transformer_blocks", QwenImageTransformer2D.FP8_SKIP, torch.float32)
    per_block = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                 "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                 "txt_mlp.net.2"}
    assert set(done) == {f"transformer_blocks.{i}.{n}" for i in range(2) for n in per_block}
    assert set(kept) == {f"transformer_blocks.{i}.{n}.1" for i in range(2) for n in ("img_mod", "txt_mod")}
    assert {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)} == set(done)


def test_the_qwen_image_runner_converts_its_blocks_at_load(tmp_path: Path) -> None:
    """Through the runner (its ModuleSpec carries `FP8_SKIP`): 12 fp8 linears per block, the modulation kept."""
    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic
    from runnerkit.models.qwen_image.runner import QwenImageRunner
    from test_cases.conftest import config_dict

    config = REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json"
    ckpt = write_synthetic(QwenImageArch.model_validate(json.loads(config.read_text())["model"]), tmp_path / "q",
                           seed=0, dtype=torch.float32)
    runner = QwenImageRunner(load_runner_config(None, config_dict(config, ckpt, compute_dtype="fp8")))
    runner.init_modules()
    model = runner.modules["transformer"]
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 24 and all(n.startswith("transformer_blocks.") for n in fp8), fp8
    assert type(model.transformer_blocks[0].img_mod[1]) is nn.Linear


def _video(runner: WanT2VRunner, out: Path, index: int = 0) -> torch.Tensor:
    h, w, f = SHAPE
    path = out / f"r{index}.safetensors"
    runner.run_pipeline(RequestConfig(prompt="a fox", seed=3, target_height=h, target_width=w, target_video_length=f,
                                      save_tensor_path=str(path)), index)
    return load_file(str(path))["video"].float()


def _runner(ckpt: Path, **overrides: Any) -> WanT2VRunner:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(ckpt, infer_steps=2, **overrides)))
    runner.init_modules()
    return runner


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of videos in [-1, 1] (peak-to-peak 2)."""
    mse = (a - b).pow(2).mean().item()
    return 10 * math.log10(4.0 / mse) if mse > 0 else math.inf


@pytest.fixture(scope="module")
def reference_videos(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The tiny Wan request (SHAPE, 2 UniPC steps, CFG) in float32 unquantized, and with fp8 compute."""
    out = tmp_path_factory.mktemp("fp8_videos")
    return {"same": _video(_runner(tiny_ckpt), out, 0), "fp8": _video(_runner(tiny_ckpt, compute_dtype="fp8"), out, 1)}


def test_a_whole_wan_request_stays_close_to_the_unquantized_run(reference_videos: dict[str, torch.Tensor]) -> None:
    """Tiny Wan t2v (random weights, float32, CFG), decoded video in [-1, 1]: fp8 compute vs the same
    request unquantized measured 42.4 dB PSNR here (a bf16 run of the same request vs float32: 48.6 dB; at
    48x80x9 with 4 steps: 40.3 vs 45.6 dB). The bound, 30 dB, is E4M3's ~2^-5 relative error per GEMM through
    2 blocks and 2 steps with a margin; the run must differ (fp8 is not a no-op)."""
    psnr = _psnr(reference_videos["fp8"], reference_videos["same"])
    assert 30.0 < psnr < math.inf, psnr


def test_model_offload_gives_the_resident_fp8_output(tiny_ckpt: Path, tmp_path: Path,
                                                     reference_videos: dict[str, torch.Tensor]) -> None:
    """`offload.mode: model` quantizes the host copy once; the module visits the device with its fp8
    weights and scales: the same video bit for bit."""
    runner = _runner(tiny_ckpt, compute_dtype="fp8", offload={"mode": "model"})
    assert runner.transformer is not None and isinstance(runner.transformer.blocks[0].ffn[0], Fp8Linear)
    assert torch.equal(_video(runner, tmp_path), reference_videos["fp8"])


def test_unfused_lora_adds_its_update_to_the_fp8_gemm() -> None:
    """LoRA slots on an fp8 layer: zero slots give the fp8 layer's output bit for bit; written slots add
    (x down^T) up^T + bias in the slot dtype to it."""
    gen = torch.Generator().manual_seed(1)
    block = nn.Sequential(nn.Linear(32, 16))
    x = torch.randn(4, 32, generator=gen)
    convert_blocks(nn.ModuleDict({"blocks": nn.ModuleList([block])}), "blocks", (), torch.float32)
    base = block[0](x)
    layers = attach_slots(block, 8, torch.device("cpu"), torch.float32)
    lin = layers["0"]
    assert isinstance(lin, LoRALinear) and isinstance(lin, Fp8Linear) and lin.lora_down.dtype == torch.float32
    assert torch.equal(lin(x), base)
    down, up = torch.randn(8, 32, generator=gen), torch.randn(16, 8, generator=gen)
    lin.lora_down.copy_(down)
    lin.lora_up.copy_(up)
    assert torch.allclose(lin(x), base + F.linear(F.linear(x, down), up), rtol=0, atol=1e-5)


def test_a_compiled_fp8_block_has_no_graph_break() -> None:
    """A Wan block whose linears are fp8 traces as one graph (`fullgraph=True` raises on a break) with
    the aot_eager backend, and gives the eager fp8 block's output."""
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.transformer import WanAttentionBlock
    from test_cases.conftest import TINY_CONFIG

    torch._dynamo.reset()
    arch = WanArch.model_validate(json.loads(TINY_CONFIG.read_text())["model"]).transformer
    gen = torch.Generator().manual_seed(2)
    block = WanAttentionBlock(arch).eval().requires_grad_(False)
    convert_blocks(nn.ModuleDict({"blocks": nn.ModuleList([block])}), "blocks", (), torch.float32)
    x = torch.randn(1, 12, 64, generator=gen)
    time_mod = torch.randn(1, 6, 64, generator=gen)
    context = torch.randn(1, 7, 64, generator=gen)
    angles = torch.randn(12, 1, 16, generator=gen)  # [L, 1, head_dim / 2]
    rope = (angles.cos(), angles.sin())
    try:
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        assert torch.allclose(compiled(x, time_mod, context, rope), block(x, time_mod, context, rope), rtol=0,
                              atol=1e-5)
    finally:
        torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_compiler")
def test_after_warmup_an_fp8_request_compiles_nothing(tiny_ckpt: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Regional compile (aot_eager) with fp8 compute: warmup compiles the fp8 blocks, the request at a
    warmed shape compiles nothing (runnerkit's audit and torch's counters) and no graph broke. (Two
    small warmup shapes instead of the debug flavour's, to keep the test short.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(WanT2VRunner, "WARMUP_SHAPES", {"debug": ((32, 32, 5), SHAPE)})
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(
        tiny_ckpt, infer_steps=1, enable_cfg=False, sample_guide_scale=None, warmup=True, compute_dtype="fp8",
        compile={"enabled": True, "backend": "aot_eager"},
        target_height=SHAPE[0], target_width=SHAPE[1], target_video_length=SHAPE[2])))
    runner.init_modules()
    assert runner.profiler.warmup is not None and runner.profiler.warmup["compilations"] >= 1
    graphs = counters["stats"]["unique_graphs"]
    path = tmp_path / "r.safetensors"
    prof = runner.run_pipeline(RequestConfig(prompt="a fox", seed=3, save_tensor_path=str(path)), 0)
    assert counters["stats"]["unique_graphs"] == graphs
    audit = prof.audit
    assert (audit["compilations"], audit["recompilations"], audit["compile_seconds"]) == (0, 0, 0.0), audit
    assert not counters["graph_break"], dict(counters["graph_break"])


# ---- refusals ------------------------------------------------------------------------------------
def test_a_bad_value_is_refused_naming_the_field(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="compute_dtype"):
        load_runner_config(None, tiny_config_dict(tiny_ckpt, compute_dtype="fp4"))


@pytest.mark.parametrize("overrides, needle", [
    ({"offload": {"mode": "block"}}, "`compute_dtype`='fp8' with `offload.mode`='block' is not supported"),
    ({"offload": {"mode": "phase"}}, "`compute_dtype`='fp8' with `offload.mode`='phase' is not supported"),
    ({"lora": {"mode": "fused"}}, "`compute_dtype`='fp8' with `lora.mode`='fused' is not supported"),
], ids=["block", "phase", "fused-lora"])
def test_unsupported_combinations_are_refused_with_the_reason(tiny_ckpt: Path, overrides: dict[str, Any],
                                                              needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        load_runner_config(None, tiny_config_dict(tiny_ckpt, compute_dtype="fp8", **overrides))
    load_runner_config(None, tiny_config_dict(tiny_ckpt, **overrides))  # the same settings without fp8 load


def test_an_old_cuda_device_is_refused_by_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compute capability 8.6 (Ampere): no fp8 tensor cores; the probe says so before any CUDA call."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    why, _ = fp8_compute.probe(torch.device("cuda"), torch.bfloat16)
    assert why is not None and "compute capability 8.6" in why and "8.9" in why


def test_the_cpu_probe_passes_with_the_bias_in_the_gemm() -> None:
    assert fp8_compute.probe(torch.device("cpu"), torch.bfloat16) == (None, True)


def test_the_launch_script_exits_2_naming_the_field_when_the_probe_refuses(
        tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(fp8_compute, "probe", lambda device, dtype: ("no fp8 tensor cores (simulated)", False))
    config = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, compute_dtype="fp8"))
    rc = main(["--config_json", str(config), "--prompt", "x", "--save_tensor_path", str(tmp_path / "o.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "`compute_dtype`='fp8' cannot run on cpu" in err and "no fp8 tensor cores (simulated)" in err
    assert "Traceback" not in err and not (tmp_path / "o.safetensors").exists()


def test_a_family_that_declares_no_fp8_layers_is_refused(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runnerkit.models.wan.transformer import WanTransformer3D

    monkeypatch.setattr(WanTransformer3D, "FP8_SKIP", None)
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, compute_dtype="fp8")))
    with pytest.raises(NotImplementedError, match="`compute_dtype`='fp8': WanT2VRunner does not declare"):
        runner.init_modules()


def test_the_compile_cache_key_covers_compute_dtype(tiny_ckpt: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a runner: `compute_dtype` reaches its compile-cache key (nothing compiles: no warmup)."""
    from runnerkit import memory

    monkeypatch.setattr(memory, "_frozen", True)
    keys = {}
    for value in ("same", "fp8"):
        runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(
            tiny_ckpt, compute_dtype=value, compile={"enabled": True, "cache_dir": str(tmp_path / "cache")})))
        runner.init_modules()
        assert runner.compile_cache is not None and runner.compile_cache.fields["compute_dtype"] == value
        keys[value] = runner.compile_cache.key
    assert keys["same"] != keys["fp8"]
