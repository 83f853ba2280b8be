"""runnerkit/fused.py: the MLP's first GEMM with its tanh GELU fused on CUDA; the unfused ops elsewhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runnerkit import fused
from runnerkit.fused import TanhGELUMLP, linear_gelu_tanh


def _count_addmm_activation(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = torch._addmm_activation

    def counting(*a: Any, **k: Any) -> torch.Tensor:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_addmm_activation", counting)
    return calls


@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16)])
def test_cpu_runs_the_unfused_tanh_gelu_bit_for_bit(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's `_addmm_activation` computes the exact (erf) GELU: routing the CPU through it changes values."""
    calls = _count_addmm_activation(monkeypatch)
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    x = torch.randn(*shape) * 3
    out = linear_gelu_tanh(x, lin)
    assert out.shape == (*shape[:-1], 24)
    assert torch.equal(out, F.gelu(F.linear(x, lin.weight, lin.bias), approximate="tanh"))
    assert not torch.equal(out, F.gelu(F.linear(x, lin.weight, lin.bias)))  # tanh and erf differ at these values
    assert calls == []


def test_mlp_keeps_the_sequential_keys_and_values() -> None:
    torch.manual_seed(0)
    mlp = TanhGELUMLP(16, 40, 12)
    ref = nn.Sequential(nn.Linear(16, 40), nn.GELU(approximate="tanh"), nn.Linear(40, 12))
    assert list(mlp.state_dict()) == list(ref.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    ref.load_state_dict(mlp.state_dict())
    x = torch.randn(3, 9, 16)
    assert torch.equal(mlp(x), ref(x))


CUDA = torch.device("cuda")


@pytest.mark.gpu
def test_cuda_fuses_the_tanh_gelu_into_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the fused GEMM computes tanh GELU, not erf GELU; one fused call.

    The pre-activations have std ~1.7 (max ~8), where tanh and erf GELU differ by up to 4.7e-4 (mean ~1e-4);
    at std ~0.1 they differ by under 4e-5, which is why an earlier version of this test, with inputs that
    small, failed its erf check on the H200."""
    calls = _count_addmm_activation(monkeypatch)
    torch.manual_seed(0)
    lin = nn.Linear(256, 512).to(CUDA)
    x = (torch.randn(2, 300, 256) * 3).to(CUDA)
    with torch.inference_mode():
        out = linear_gelu_tanh(x, lin).double()
        h = F.linear(x.double(), lin.weight.double(), lin.bias.double())
        tanh_ref, erf_ref = F.gelu(h, approximate="tanh"), F.gelu(h)
    assert calls == [1] and out.shape == (2, 300, 512)
    assert (tanh_ref - erf_ref).abs().max().item() > 4e-4
    err_tanh, err_erf = (out - tanh_ref).abs().mean().item(), (out - erf_ref).abs().mean().item()
    assert err_tanh < err_erf / 4, (err_tanh, err_erf)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_bf16_fused_is_as_close_to_float64_as_unfused(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 at a Wan-like width: one rounding (fused) instead of two (unfused), so the error against a float64
    reference is no larger; compiled, inductor keeps the fused op as an extern kernel."""
    torch.manual_seed(0)
    lin = nn.Linear(1536, 8960).to(CUDA, torch.bfloat16)
    x = torch.randn(2, 2048, 1536).to(CUDA, torch.bfloat16)

    def run(enabled: bool) -> torch.Tensor:
        monkeypatch.setattr(fused, "ENABLED", enabled)
        fn = torch.compile(linear_gelu_tanh, fullgraph=True) if compiled else linear_gelu_tanh
        with torch.inference_mode():
            return fn(x, lin)

    torch._dynamo.reset()
    fused_out = run(True)
    torch._dynamo.reset()
    unfused_out = run(False)
    ref = F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double()), approximate="tanh")
    err_fused = (fused_out.double() - ref).abs().mean().item()
    err_unfused = (unfused_out.double() - ref).abs().mean().item()
    assert not torch.equal(fused_out, unfused_out)  # the fused path ran
    assert err_fused <= err_unfused * 1.001
