"""LoRA over HTTP: `GET /v1/models` lists the base model and the config's known adapters; a request's
`lora` is checked when it is submitted (422 naming `lora` and the file), before it is queued."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
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


@pytest.mark.parametrize(("name", "why"), [("gone.safetensors", "no such file"),
                                         ("folder", "a directory, not a .safetensors file")])
def test_a_named_adapter_that_cannot_load_fails_the_load_naming_it(tiny_ckpt: Path, tmp_path: Path, name: str,
                                                                   why: str) -> None:
    """`lora.adapters` are read and matched at load (and cached for the first request): a missing file
    (or a directory) fails `init_modules` in phase `load`, naming the config key and the file, not the
    first request."""
    from runnerkit.lora import LoRAError

    missing = tmp_path / name
    (tmp_path / "folder").mkdir()
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, lora={"adapters": {"style": str(missing)}})))
    with pytest.raises(LoRAError, match=f"`lora.adapters.style`: LoRA adapter '{missing}': {why}") as err:
        runner.init_modules()
    assert error_phase(err.value) == "load"


def test_a_named_adapter_under_unload_modules_is_matched_by_the_first_request(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Under `unload_modules` no transformer exists at load (and warmup is refused), so a named adapter
    is read there but matched only when the first request builds the transformer: a warning says so at
    load (the load used to pass in silence), and an adapter for another model fails that request,
    naming the file."""
    from runnerkit.config import RequestConfig
    from runnerkit.lora import LoRAError

    other = tmp_path / "other.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 4)}, str(other))
    config = tiny_config_dict(tiny_ckpt, unload_modules=True, infer_steps=1, lora={"adapters": {"style": str(other)}})
    runner = WanT2VRunner(load_runner_config(None, config))
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        runner.init_modules()
    finally:
        logger.remove(sink)
    assert any(w.startswith("`lora.adapters` ['style'] were read but not matched to ['transformer']: under "
                            "`unload_modules` the transformer is first built by a request") for w in warnings), warnings
    with pytest.raises(LoRAError, match=rf"LoRA adapter '{other}': .*an adapter for another model") as err:
        runner.run_pipeline(RequestConfig(prompt="x", lora=[{"path": "style"}], target_height=32, target_width=32,
                                          target_video_length=5), 0)
    assert error_phase(err.value) == "request 0"


@pytest.mark.parametrize("path", ["/etc/passwd", "adapters/style.safetensors", "STYLE"])
def test_a_request_names_adapters_never_server_paths(state: ServerState, tmp_path: Path, path: str) -> None:
    """Paths are the server's business: a request's `lora` names an adapter of the config's
    `lora.adapters`; any other value (a server file, an existing adapter's path, a wrong name) is a 422
    naming `lora[i].path` and the allowed names, whatever is at that path (nothing is read)."""
    with pytest.raises(InputError) as exc:
        build_request(state, {"prompt": "x", "lora": [{"path": "style"}, {"path": path}]}, tmp_path / "job")
    assert exc.value.field == "lora[1].path" and exc.value.status == 422
    assert str(exc.value) == (f"`lora[1].path` {path!r} is not an adapter name of this server's `lora.adapters` "
                              "(one of ['style']); the server takes names, not file paths")
    assert state.queue.jobs == {}


def test_a_known_adapter_name_is_accepted(state: ServerState, tmp_path: Path) -> None:
    request, _, _ = build_request(state, {"prompt": "x", "lora": [{"path": "style", "strength": 0.5}]}, tmp_path)
    assert [(a.path, a.strength) for a in request.lora or []] == [("style", 0.5)]


def _form(items: list[tuple[str, Any]]) -> dict[str, Any]:
    from runnerkit.serve.app import _form_fields

    return asyncio.run(_form_fields(items))


def _openai_form(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The text parts the official `openai` client sends for `body` in a multipart request, in wire order:
    its own serializer (`_serialize_multipartform`: repeated keys grouped, one key's values in a row)."""
    openai = pytest.importorskip("openai", reason="the official openai client is not installed")
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9")
    data = client._serialize_multipartform(body)
    return [(k, v) for k, vs in data.items() for v in (vs if isinstance(vs, list) else [vs])]


@pytest.mark.parametrize(("lora", "expect"), [
    ([{"path": "style", "strength": 0.5}, {"path": "style", "strength": -1}], [("style", 0.5), ("style", -1.0)]),
    ([{"path": "style"}, {"path": "style"}], [("style", 1.0), ("style", 1.0)]),
    ([{"strength": 0.25, "path": "style"}], [("style", 0.25)]),  # strength key first: its part comes first
])
def test_a_forms_lora_as_the_openai_client_sends_it(state: ServerState, tmp_path: Path, lora: list[dict[str, Any]],
                                                   expect: list[tuple[str, float]]) -> None:
    """A multipart body (images.edit; videos.create always) carries `extra_body={"lora": [...]}` as the
    client's `lora[][path]` / `lora[][strength]` parts, every path before every strength: the same
    adapters and strengths as the JSON body; also one `lora` part holding the JSON list."""
    items = _openai_form({"prompt": "x", "lora": lora})
    for body in (_form(items), _form([("prompt", "x"), ("lora", json.dumps(lora))])):
        request, _, _ = build_request(state, body, tmp_path)
        assert [(a.path, a.strength) for a in request.lora or []] == expect


def test_strengths_that_cannot_be_paired_are_a_422_not_a_guess() -> None:
    """Two adapters, one strength: the client's parts cannot say whose it is (it sent both paths first)."""
    items = _openai_form({"prompt": "x", "lora": [{"path": "style", "strength": 0.5}, {"path": "other"}]})
    assert [k for k, _ in items] == ["prompt", "lora[][path]", "lora[][path]", "lora[][strength]"]
    with pytest.raises(InputError) as exc:
        _form(items)
    assert exc.value.field == "lora" and "2 `lora[][path]` and 1 `lora[][strength]` parts, which cannot be paired" \
        in str(exc.value) and "one form part holding the JSON list" in str(exc.value)


@pytest.mark.parametrize(("items", "says"), [
    ([("lora[][strength]", "0.5")], "0 `lora[][path]` and 1 `lora[][strength]` parts"),
    ([("lora[][path]", "style"), ("lora[][strength]", "0.5"), ("lora[][strength]", "2")],
     "1 `lora[][path]` and 2 `lora[][strength]` parts"),
    ([("lora", '[{"path": "style"}]'), ("lora[][path]", "style")], "`lora` is given twice in the form"),
    ([("lora[][path]", "style"), ("lora", '[{"path": "style"}]')], "`lora` is given twice in the form"),
    ([("lora", "style")],
     "`lora` as a form part must be a JSON list of {\"path\": name, \"strength\": x} (got 'style')"),
    ([("lora[][path]", b"\x89PNG")], "`lora[][path]` must be a text part, not an uploaded file of 4 bytes"),
])
def test_a_malformed_forms_lora_is_a_422_naming_lora(items: list[tuple[str, Any]], says: str) -> None:
    with pytest.raises(InputError) as exc:
        _form([("prompt", "x"), *items])
    assert exc.value.field == "lora" and exc.value.status == 422 and says in str(exc.value), str(exc.value)


def test_a_forms_strength_that_is_not_a_number_is_named(state: ServerState, tmp_path: Path) -> None:
    body = _form([("prompt", "x"), ("lora[][path]", "style"), ("lora[][strength]", "strong")])
    with pytest.raises(InputError) as exc:
        build_request(state, body, tmp_path)
    says = "lora[0].strength: Input should be a valid number (got 'strong')"
    assert exc.value.status == 422 and says in str(exc.value), str(exc.value)
    assert exc.value.field == "lora[0].strength"


def test_an_adapter_error_names_the_adapters_never_their_server_paths(state: ServerState, tiny_ckpt: Path,
                                                                      tmp_path: Path) -> None:
    """3 x the rank-4 `style` is rank 12 > `lora.max_rank` 8: the 422 says so by name, not by server path."""
    path = state.runner.config.lora.adapters["style"]  # type: ignore[union-attr]
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(
        tiny_ckpt, lora={"max_rank": 8, "adapters": {"style": path}})))
    runner.init_modules()
    small = ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None,  # type: ignore[arg-type]
                        phase="ready")
    with pytest.raises(InputError) as exc:
        build_request(small, {"prompt": "x", "lora": [{"path": "style"}] * 3}, tmp_path / "job")
    message = str(exc.value)
    assert exc.value.field == "lora" and "summed rank 12" in message and "'style'" in message, message
    assert path not in message and str(Path(path).parent) not in message, message


def test_a_named_adapter_damaged_after_start_is_the_servers_error_never_its_path(tiny_ckpt: Path,
                                                                                  tmp_path: Path) -> None:
    """The file behind a configured name breaks while the server runs: the client did nothing wrong,
    so the answer is a 500 naming the adapter, not a 422 and never the server's path."""
    from runnerkit.config import RequestConfig

    path = tmp_path / "style.safetensors"
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, lora={"adapters": {"style": str(path)}}))
    save_file(synthetic_adapter(WanT2VRunner.lora_layers(config, "lightx2v")[0], "lightx2v", 2), str(path))
    runner = WanT2VRunner(config)
    runner.init_modules()
    small = ServerState(runner=runner, queue=JobQueue(tmp_path / "q", 4, None, None), metrics=None,  # type: ignore[arg-type]
                        phase="ready")
    path.write_bytes(b"\x00" * 64)  # damaged on disk after start-up
    with pytest.raises(InputError) as exc:
        build_request(small, {"prompt": "x", "lora": [{"path": "style"}]}, tmp_path / "job")
    message = str(exc.value)
    assert exc.value.status == 500 and exc.value.field == "lora", (exc.value.status, message)
    assert "'style'" in message and str(path) not in message and str(tmp_path) not in message, message
    runner.check_adapters([RequestConfig(prompt="x")])  # a request without adapters is untouched
