"""Adapters are request state (ARCHITECTURE §7): in one process the sequence [no LoRA, LoRA A,
LoRA B (two adapters), no LoRA] gives each request exactly what it gives alone in a fresh runner,
bit for bit, in every offload mode (none, model, block from host memory, phase from disk, lazy
block from disk, unload_modules), unfused and (where weights stay put) fused, compiled (aot_eager) and not; and a
request without an adapter equals a runner configured without LoRA at all."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runnerkit import memory
from runnerkit.config import LoRARequest, RequestConfig, load_runner_config
from runnerkit.lora.synthetic import synthetic_adapter
from runnerkit.models.wan.runner import WanT2VRunner
from test_cases.conftest import tiny_config_dict

SHAPE = dict(target_height=32, target_width=32, target_video_length=5)  # the tiny flavour's first warmup shape
STEPS = 2  # isolation does not depend on the solver's order; fewer steps keep the file fast
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "model": {"offload": {"mode": "model"}},
    "block_cpu": {"offload": {"mode": "block"}},
    "phase_disk": {"offload": {"mode": "phase", "storage": "disk", "reader": "pread"}},
    "block_disk_lazy": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
    "unload_modules": {"unload_modules": True},
}


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


@pytest.fixture(scope="module")
def adapters(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[LoRARequest]]:
    """A: one LightX2V-layout adapter; B: a kohya-layout adapter and A again at another strength."""
    folder = tmp_path_factory.mktemp("adapters")
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt))
    layers, _ = WanT2VRunner.lora_layers(config, "lightx2v")
    save_file(synthetic_adapter(layers, "lightx2v", 4, seed=1, alpha=4.0, bias=True), str(folder / "a.safetensors"))
    save_file(synthetic_adapter(layers, "kohya", 8, seed=2, alpha=4.0), str(folder / "b.safetensors"))
    return {"A": [LoRARequest(path=str(folder / "a.safetensors"))],
            "B": [LoRARequest(path=str(folder / "b.safetensors"), strength=0.7),
                  LoRARequest(path=str(folder / "a.safetensors"), strength=-0.5)]}


def make_runner(ckpt: Path, **overrides: Any) -> WanT2VRunner:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(ckpt, infer_steps=STEPS, **overrides)))
    runner.init_modules()
    return runner


AUDITS: list[dict[str, Any]] = []  # the last `serve` call's per-request compile audits


def serve(runner: WanT2VRunner, tmp_path: Path, loras: list[list[LoRARequest] | None]) -> list[torch.Tensor]:
    out = []
    AUDITS.clear()
    for i, lora in enumerate(loras):
        path = tmp_path / f"r{i}.safetensors"
        prof = runner.run_pipeline(RequestConfig(prompt="a fox", seed=5, lora=lora, save_tensor_path=str(path), **SHAPE), i)
        out.append(load_file(str(path))["video"])
        AUDITS.append(prof.audit)
        assert runner.lora is None or (runner.lora.active == () and not runner.lora._written and not runner.lora._fused)
    return out


@pytest.fixture(scope="module")
def alone(tiny_ckpt: Path, adapters: dict[str, list[LoRARequest]],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Each request alone in a fresh runner; "none" from a runner without `lora` in its config."""
    folder = tmp_path_factory.mktemp("alone")
    refs = {"none": serve(make_runner(tiny_ckpt), folder / "none", [None])[0]}
    for name in ("A", "B"):
        refs[name] = serve(make_runner(tiny_ckpt, lora={}), folder / name, [adapters[name]])[0]
    return refs


def _check(videos: list[torch.Tensor], alone: dict[str, torch.Tensor], label: str) -> None:
    assert not torch.equal(alone["A"], alone["none"]) and not torch.equal(alone["B"], alone["A"])
    for got, name in zip(videos, ("none", "A", "B", "none")):
        assert torch.equal(got, alone[name]), f"{label}: request {name} differs from the same request alone"


@pytest.mark.parametrize("mode", list(MODES))
def test_unfused_sequence_equals_each_request_alone(tiny_ckpt: Path, tmp_path: Path, mode: str,
                                                     adapters: dict[str, list[LoRARequest]],
                                                     alone: dict[str, torch.Tensor]) -> None:
    for d in (tmp_path / "a", tmp_path / "b"):
        d.mkdir()
    runner = make_runner(tiny_ckpt, lora={"max_rank": 16}, **MODES[mode])
    _check(serve(runner, tmp_path / "a", [None, adapters["A"], adapters["B"], None]), alone, f"unfused/{mode}")


@pytest.mark.parametrize("mode", ["none", "model", "unload_modules"])
def test_fused_sequence_equals_each_request_alone(tiny_ckpt: Path, tmp_path: Path, mode: str,
                                                   adapters: dict[str, list[LoRARequest]],
                                                   alone: dict[str, torch.Tensor]) -> None:
    """Fused: W + s B A differs from the unfused sum by rounding, so A and B are compared with a
    fresh fused runner's; the requests without an adapter with the runner without LoRA."""
    fresh = {"none": alone["none"]}
    for name in ("A", "B"):
        fresh[name] = serve(make_runner(tiny_ckpt, lora={"mode": "fused"}, **MODES[mode]), tmp_path / name,
                            [adapters[name]])[0]
        assert (fresh[name] - alone[name]).abs().max() < 1e-4, "fused and unfused agree to rounding"
    runner = make_runner(tiny_ckpt, lora={"mode": "fused"}, **MODES[mode])
    _check(serve(runner, tmp_path, [None, adapters["A"], adapters["B"], None]), fresh, f"fused/{mode}")


COMPILE = {"compile": {"enabled": True, "backend": "aot_eager"}, "warmup": True}


@pytest.mark.parametrize("lora, offload", [({"max_rank": 16}, {}), ({"max_rank": 16}, {"offload": {"mode": "block"}}),
                                           ({"mode": "fused"}, {})], ids=["unfused", "unfused_block", "fused"])
def test_compiled_switches_compile_nothing(tiny_ckpt: Path, tmp_path: Path, lora: dict[str, Any],
                                           offload: dict[str, Any], adapters: dict[str, list[LoRARequest]],
                                           alone: dict[str, torch.Tensor]) -> None:
    """Warmup compiles the blocks with the LoRA matmuls in them (zero slots); every later switch
    (none -> A -> B -> none) compiles nothing, and the outputs are the eager ones (aot_eager runs the
    eager kernels: test_compile.py); fused: the eager fused runner's."""
    runner = make_runner(tiny_ckpt, lora=lora, **COMPILE, **offload)
    videos = serve(runner, tmp_path, [None, adapters["A"], adapters["B"], None])
    assert [(a["compilations"], a["recompilations"]) for a in AUDITS] == [(0, 0)] * 4, AUDITS
    if lora.get("mode") == "fused":
        alone = {**alone, **{n: serve(make_runner(tiny_ckpt, lora=lora), tmp_path / n, [adapters[n]])[0]
                             for n in ("A", "B")}}
    _check(videos, alone, f"compiled/{lora}/{offload}")


def test_fused_takes_each_base_copy_once_and_restores_from_it(tiny_ckpt: Path, tmp_path: Path,
                                                               adapters: dict[str, list[LoRARequest]],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused mode copies a layer's base weight to the host the first time the layer is adapted only
    (the base never changes: later requests restore from that copy), so [A, B, A] takes one copy per
    adapted tensor, and the third request equals the first bit for bit."""
    from runnerkit.lora import apply

    copies: list[str] = []
    original = apply._host_copy

    def counting(t: torch.Tensor, label: str) -> Any:
        copies.append(label)
        return original(t, label)

    monkeypatch.setattr(apply, "_host_copy", counting)
    runner = make_runner(tiny_ckpt, lora={"mode": "fused"})
    videos = serve(runner, tmp_path, [adapters["A"], adapters["B"], adapters["A"]])
    assert torch.equal(videos[0], videos[2]) and not torch.equal(videos[0], videos[1])
    assert len(copies) == len(set(copies)) > 0  # one copy per adapted weight and bias, none taken twice
    assert runner.lora is not None
    assert sorted(copies) == sorted(f"lora base {layer}" + suffix for (_, layer), (_, b) in runner.lora._base.items()
                                    for suffix in ("", ".bias")[: 1 + (b is not None)])


def test_fused_named_adapters_take_their_base_copies_at_load(tiny_ckpt: Path, tmp_path: Path,
                                                             adapters: dict[str, list[LoRARequest]],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A named adapter of `lora.adapters` gets its base copies at load (`init_modules`), so the first
    request with it copies nothing (measured on the H200: without this, request 1 took 2x request 3)."""
    from runnerkit.lora import apply

    copies: list[str] = []
    original = apply._host_copy
    monkeypatch.setattr(apply, "_host_copy", lambda t, label: (copies.append(label), original(t, label))[1])
    runner = make_runner(tiny_ckpt, lora={"mode": "fused", "adapters": {"a": adapters["A"][0].path}})
    at_load = len(copies)
    serve(runner, tmp_path, [[LoRARequest(path="a")], None])
    assert at_load > 0 and len(copies) == at_load
