"""runnerkit/fused_norm.py: row-fused residual + LayerNorm and RMSNorm + RoPE kernels against the unfused ops.

The Triton kernels are checked on the CPU through Triton's interpreter where triton is installed (CUDA
builds of torch ship it; the CPU CI has none, so those cases skip there) and on CUDA by the `gpu` cases.
The CPU path (no kernel) must stay the unfused ops bit for bit: the Wan parity tests hold it to diffusers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from runnerkit import fused_norm as fn

HAS_TRITON = importlib.util.find_spec("triton") is not None
REPO = Path(__file__).resolve().parents[1]
EPS = 1e-6


def _inputs(device: str, B: int = 2, L: int = 6, D: int = 48, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(B, 6, D, generator=g)  # rows of a modulation table: [B, 1, D] views with batch stride 6D
    tensors = {"x": torch.randn(B, L, D, generator=g) * 3 + 1, "y": torch.randn(B, L, D, generator=g).bfloat16(),
               "weight": torch.randn(D, generator=g), "bias": torch.randn(D, generator=g), "table": table}
    out = {k: v.to(device) for k, v in tensors.items()}
    t = out.pop("table")
    out.update(shift=t[:, 0:1], scale=t[:, 1:2], gate=t[:, 2:3])
    return out


CASES = {  # the blocks' four uses (Wan: norm1, norm3, norm2) and a plain residual add
    "modulation": ("scale", "shift"),
    "residual gate affine": ("y", "gate", "weight", "bias"),
    "residual modulation": ("y", "scale", "shift"),
    "residual": ("y",),
}


def _reference_f64(t: dict[str, Any], names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's arithmetic in float64: (new residual, normalized before the output cast)."""
    d = {k: v.double() for k, v in t.items()}
    x = d["x"] + d["y"] * d["gate"] if "gate" in names else d["x"] + d["y"] if "y" in names else d["x"]
    out = F.layer_norm(x, x.shape[-1:], d["weight"] if "weight" in names else None,
                       d["bias"] if "bias" in names else None, EPS)
    if "scale" in names:
        out = out * (1 + d["scale"]) + d["shift"]
    return x, out


def _check_residual_norm(device: str, case: str, out_dtype: torch.dtype, op: Any) -> None:
    names = CASES[case]
    t = _inputs(device)
    x2, out = op(t["x"], *(t[k] if k in names else None for k in ("y", "gate", "weight", "bias", "scale", "shift")),
                 EPS, out_dtype)
    want_x, want = _reference_f64(t, names)
    assert out.dtype == out_dtype and out.shape == t["x"].shape
    if "y" in names:
        assert x2.dtype == torch.float32
        torch.testing.assert_close(x2.double(), want_x, rtol=1e-6, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if out_dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)  # one bf16 unit (the interpreter truncates)
    torch.testing.assert_close(out.double(), want, **tol)


def _reference_rope_f64(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        heads: int) -> torch.Tensor:
    x = q.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    x0, x1 = x.unflatten(-1, (heads, -1, 2)).unbind(-1)  # [B, L, N, d/2]
    c, s = cos.double(), sin.double()
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)  # [B, L, N, d]


def _rope_inputs(device: str, B: int = 2, L: int = 5, heads: int = 3, d: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    angles = torch.rand(L, 1, d // 2, generator=g) * 6.3  # per position: L distinct rows catch a wrong `pos`
    q = (torch.randn(B, L, heads * d, generator=g) * 2).bfloat16()
    return tuple(v.to(device) for v in (q, torch.randn(heads * d, generator=g), angles.cos(), angles.sin()))


def _check_rms_norm_rope(device: str, out_dtype: torch.dtype, op: Any) -> None:
    q, w, cos, sin = _rope_inputs(device)
    out = op(q, w, cos, sin, EPS, 3, out_dtype)
    assert out.shape == (2, 5, 3, 16) and out.dtype == out_dtype
    tol = dict(rtol=1e-5, atol=1e-5) if out_dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)  # one bf16 unit (the interpreter truncates)
    torch.testing.assert_close(out.double(), _reference_rope_f64(q, w, cos, sin, 3), **tol)


def run_interpreter_cases() -> list[str]:
    """Every kernel case on CPU tensors; run in a process that set TRITON_INTERPRET=1 before importing triton
    (triton picks its interpreter when the kernels and its language functions are defined). Returns the cases run."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    ran = []
    for case in CASES:
        for out_dtype in (torch.float32, torch.bfloat16):
            _check_residual_norm("cpu", case, out_dtype, fn._residual_norm_op)
            ran.append(f"{case} {out_dtype}")
    for out_dtype in (torch.float32, torch.bfloat16):
        _check_rms_norm_rope("cpu", out_dtype, fn._rms_norm_rope_op)
        ran.append(f"rms_norm_rope {out_dtype}")
    return ran


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (CUDA builds of torch ship it; the gpu cases "
                    "below cover the kernels)")
def test_kernels_match_float64_in_triton_interpreter() -> None:
    """Both kernels, every case of the blocks (B=2 with the modulation rows as strided views of one table,
    D=48: masked lanes; L=5 rope positions), float32 and bf16 outputs, in a fresh process."""
    code = ("from test_cases.test_fused_norm import run_interpreter_cases as r; import json; "
            "print('CASES', json.dumps(r()))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = json.loads(proc.stdout.split("CASES", 1)[1])
    assert len(ran) == 2 * len(CASES) + 2, ran


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_runs_the_unfused_ops_bit_for_bit(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU `residual_norm` is the block's own ops (no custom op call), values equal to the last bit."""
    monkeypatch.setattr(fn, "_residual_norm_op", None)  # calling it would raise
    names = CASES[case]
    t = _inputs("cpu")
    kw = {k: t[k] for k in names}
    x2, out = fn.residual_norm(t["x"], eps=EPS, out_dtype=torch.bfloat16, **kw)
    x = t["x"] + t["y"].float() * t["gate"] if "gate" in names else t["x"] + t["y"].float() if "y" in names else t["x"]
    norm = F.layer_norm(x, x.shape[-1:], kw.get("weight"), kw.get("bias"), EPS)
    if "scale" in names:
        norm = norm * (1 + t["scale"]) + t["shift"]
    assert torch.equal(x2, x) and torch.equal(out, norm.bfloat16())


def test_cpu_rms_norm_rope_is_the_unfused_ops_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    from runnerkit.models.wan.transformer import WanRMSNorm, apply_rope

    monkeypatch.setattr(fn, "_rms_norm_rope_op", None)
    q, w, cos, sin = _rope_inputs("cpu")
    norm = WanRMSNorm(q.shape[-1], EPS)
    norm.weight.data.copy_(w)
    want = apply_rope(norm(q).unflatten(2, (3, -1)), cos, sin).bfloat16()
    assert torch.equal(fn.rms_norm_rope(q, w, cos, sin, eps=EPS, num_heads=3, out_dtype=torch.bfloat16), want)


CUDA = "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_residual_norm_kernel_matches_float64_on_cuda(case: str, out_dtype: torch.dtype) -> None:
    assert fn.available(torch.empty(0, device=CUDA))
    _check_residual_norm(CUDA, case, out_dtype, lambda *a: fn._residual_norm_op(*a))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_kernel_matches_float64_on_cuda(out_dtype: torch.dtype) -> None:
    _check_rms_norm_rope(CUDA, out_dtype, lambda *a: fn._rms_norm_rope_op(*a))


@pytest.mark.gpu
def test_wan_block_fused_against_unfused_on_cuda_compiled_and_eager() -> None:
    """A bf16 Wan block (dim 256, 2 heads, 500 tokens): eager and compiled, fused kernels on against off,
    within bf16 rounding of the activations; the fused run calls each custom op (a spy on the ops)."""
    from runnerkit.models.wan.arch import WanTransformerArch
    from runnerkit.models.wan.transformer import WanAttentionBlock, keep_fp32

    torch.manual_seed(0)
    block = WanAttentionBlock(WanTransformerArch(dim=256, num_heads=2, ffn_dim=512, num_layers=1))
    for name, p in block.named_parameters():
        if not keep_fp32(name):
            p.data = p.data.bfloat16()
    block.to(CUDA)
    x = torch.randn(1, 500, 256, device=CUDA)
    mod = torch.randn(1, 6, 256, device=CUDA) * 0.1
    ctx = torch.randn(1, 7, 256, device=CUDA).bfloat16()
    angles = torch.rand(500, 1, 64, device=CUDA) * 6.3
    rope = (angles.cos(), angles.sin())
    with torch.inference_mode():
        fn.ENABLED = False
        try:
            want = block(x, mod, ctx, rope)
        finally:
            fn.ENABLED = True
        got = block(x, mod, ctx, rope)
        torch._dynamo.reset()
        compiled = torch.compile(WanAttentionBlock.forward)(block, x, mod, ctx, rope)
    for out in (got, compiled):
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert not torch.equal(got, want)  # the kernels ran (the unfused ops would give the same bits)
