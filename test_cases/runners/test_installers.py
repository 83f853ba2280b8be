"""The per-module feature installs as a list of installers (runners/installers.py), applied in order by the
runner's `ModuleBuilder` (runners/building.py) to every module it builds."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runnerkit import attention
from runnerkit.config import load_runner_config
from runnerkit.runners import installers
from runnerkit.runners.installers import installers_for
from test_cases.runners.two_stage import TwoStageImageRunner, config_dict

ORDER = ["fp8_compute", "lora", "attention", "sequence_parallel", "compile"]


def test_every_installer_in_its_order(tmp_path: Path) -> None:
    """fp8 compute first (before anything wraps the linear layers), compile last (it compiles what the others
    installed); an installer a run does not use is left out, the others keep their order."""
    config = load_runner_config(None, config_dict(tmp_path, compute_dtype="fp8", lora={"max_rank": 4}))
    backend = attention.AttentionBackend("sdpa", torch.nn.functional.scaled_dot_product_attention, "test")
    manager = SimpleNamespace(attach=lambda name, module: None)
    group = SimpleNamespace(ulysses=2)
    every = installers_for(config, torch.float32, backend, manager, True, group, "Toy")  # type: ignore[arg-type]
    assert [i.name for i in every] == ORDER
    plain = load_runner_config(None, config_dict(tmp_path))
    assert [i.name for i in installers_for(plain, torch.float32, backend, None, True, None, "Toy")] == [
        "attention", "compile"]
    assert [i.name for i in installers_for(plain, torch.float32, backend, None, True, SimpleNamespace(ulysses=1),
                                           "Toy")] == ["attention", "compile"]


@pytest.mark.parametrize("mode", ["none", "model"])
def test_the_builder_applies_them_in_order_to_every_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           mode: str) -> None:
    """Each module of the toy pipeline, resident or offloaded, gets the run's installers once each, in order."""
    calls: list[tuple[str, str]] = []
    for cls in (installers.LoRASlots, installers.Attention, installers.RegionalCompile):
        real = cls.install

        def spy(self: Any, spec: Any, module: Any, _real: Any = real) -> None:
            calls.append((spec.name, self.name))
            _real(self, spec, module)

        monkeypatch.setattr(cls, "install", spy)
    runner = TwoStageImageRunner(load_runner_config(None, config_dict(tmp_path, lora={"max_rank": 4},
                                                                      offload={"mode": mode})))
    runner.init_modules()
    assert [i.name for i in runner.installers] == ["lora", "attention", "compile"]
    assert runner.builder is not None and runner.builder.installers == runner.installers
    modules = ["text_encoder", "transformer", "transformer_2", "upsampler", "decoder"]
    assert calls == [(m, name) for m in modules for name in ("lora", "attention", "compile")]
    assert sorted(runner.lora.targets) == ["transformer", "transformer_2"]  # LoRA slots on transformers only
