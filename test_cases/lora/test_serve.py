"""LoRA over HTTP: `GET /v1/models` lists the base model and the config's known adapters; a request's
`lora` is checked when it is submitted (422 naming `lora` and the file), before it is queued."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from runnerkit.config import load_runner_config
from runnerkit.lora.synthetic import synthetic_adapter
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.runners.base import error_phase
from runnerkit.serve.app import InputError, ServerState, build_request, create_app
from runnerkit.serve.jobs import JobQueue
from test_cases.conftest import tiny_config_dict


@pytest.fixture(scope="module")
def state(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerState:
    folder = tmp_path_factory.mktemp("serve_lora")
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, lora={"adapters": {"style": str(folder / "s.safetensors")}}))
    layers, _ = WanT2VRunner.lora_layers(config, "lightx2v")
    save_file(synthetic_adapter(layers, "lightx2v", 4), str(folder / "s.safetensors"))
    runner = WanT2VRunner(config)
    runner.init_modules()
    return ServerState(runner=runner, queue=JobQueue(folder, 4, None, None), metrics=None, phase="ready")  # type: ignore[arg-type]


def test_models_lists_the_base_and_known_adapters(state: ServerState) -> None:
    route = next(r for r in create_app(state).routes if getattr(r, "path", None) == "/v1/models")
    body = route.endpoint()
    assert [m["id"] for m in body["data"]] == ["wan2.1", "style"]
    assert body["data"][0]["lora"] == {"mode": "unfused", "max_rank": 64}
    assert body["data"][1]["parent"] == "wan2.1" and body["data"][1]["kind"] == "lora"


def test_a_named_adapter_that_cannot_load_fails_the_load_naming_it(tiny_ckpt: Path, tmp_path: Path) -> None:
    """`lora.adapters` are read and matched at load (and cached for the first request): a missing file
    fails `init_modules` in phase `load`, naming the config key and the file, not the first request."""
    from runnerkit.lora import LoRAError

    missing = tmp_path / "gone.safetensors"
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, lora={"adapters": {"style": str(missing)}})))
    with pytest.raises(LoRAError, match=f"`lora.adapters.style`: LoRA adapter '{missing}': no such file") as err:
        runner.init_modules()
    assert error_phase(err.value) == "load"


@pytest.mark.parametrize("case", ["unknown_format", "no_layer_matches"])
def test_bad_adapter_is_refused_at_submission_naming_lora(state: ServerState, tmp_path: Path, case: str) -> None:
    (tmp_path / "adapters").mkdir()
    path = tmp_path / "adapters" / f"{case}.safetensors"  # not under the job's folder (whose paths are hidden)
    save_file({"blocks.0.self_attn.q.weight": torch.zeros(2, 2)} if case == "unknown_format" else
              synthetic_adapter({"transformer_blocks.0.attn.to_q": (64, 64)}, "peft", 2), str(path))
    with pytest.raises(InputError) as exc:
        build_request(state, {"prompt": "x", "lora": [{"path": str(path)}]}, tmp_path / "job")
    assert exc.value.field == "lora" and path.name in str(exc.value), (exc.value.field, str(exc.value))
    assert state.queue.jobs == {}


def test_good_adapter_is_accepted(state: ServerState, tmp_path: Path) -> None:
    layers = WanT2VRunner.lora_layers(state.runner.config, "lightx2v")[0]  # type: ignore[union-attr]
    path = tmp_path / "good.safetensors"
    save_file(synthetic_adapter(layers, "lightx2v", 2), str(path))
    request, _, _ = build_request(state, {"prompt": "x", "lora": [{"path": str(path), "strength": 0.5}]}, tmp_path)
    assert [(a.path, a.strength) for a in request.lora or []] == [(str(path), 0.5)]
