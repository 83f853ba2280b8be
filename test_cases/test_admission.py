"""Request admission (runnerkit/admission.py): one path for the launch script, the server and the parallel
driver, each rule once per request; the override-flag table (runnerkit/overrides.py) that the launch
script's flags, the server's flags and the server body's fields are built from; the server's shutdown
order (runnerkit/serve/server.py `Server.drain`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runnerkit.admission import RULES, AdmittedRequest, Refused, admit
from runnerkit.config import RequestConfig, RunnerConfig, load_runner_config
from runnerkit.overrides import OVERRIDES, body_name
from runnerkit.runners.default import DefaultRunner
from test_cases._cli import no_gc_freeze, restore_logger, run_cli  # noqa: F401  (autouse fixtures)
from test_cases.conftest import tiny_config_dict, write_config


@pytest.fixture
def field_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The `fields` rule's calls (`validate_request`, the family overrides included), one entry per call: the
    request's prompt."""
    calls: list[str] = []
    original = DefaultRunner.validate_request.__func__  # type: ignore[attr-defined]

    def counted(cls: type, request: RequestConfig, config: RunnerConfig) -> None:
        calls.append(request.prompt)
        original(cls, request, config)

    monkeypatch.setattr(DefaultRunner, "validate_request", classmethod(counted))
    yield calls


def test_the_launch_script_checks_each_requests_fields_once(tiny_ckpt: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             field_checks: list[str]) -> None:
    """Before loading (admission), never again when the request runs (`resolve_request` takes the admitted
    request as checked)."""
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt))
    lines = tmp_path / "r.jsonl"
    lines.write_text("\n".join(json.dumps({"prompt": p, "save_tensor_path": str(tmp_path / f"{p}.safetensors")})
                               for p in ("first", "second")))
    rc, err = run_cli(capsys, "--config_json", cfg, "--requests", lines)
    assert rc == 0, err
    assert field_checks == ["first", "second"]
    assert (tmp_path / "first.safetensors").is_file() and (tmp_path / "second.safetensors").is_file()


@pytest.fixture(scope="module")
def loaded(tiny_ckpt: Path) -> Any:
    from runnerkit.models.wan.runner import WanT2VRunner

    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt)))
    runner.init_modules()
    return runner


def test_a_server_job_is_checked_once_from_its_body_to_its_result(loaded: Any, tmp_path: Path,
                                                                   field_checks: list[str]) -> None:
    """`build_request` admits the body's request (fields, fit, split: the split rule resolves it without
    checking its fields again), and running it checks nothing twice."""
    from runnerkit.serve.app import ServerState, build_request
    from runnerkit.serve.jobs import JobQueue

    state = ServerState(runner=loaded, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")
    request, _, resolved = build_request(state, {"prompt": "job", "seed": 3}, tmp_path)
    assert isinstance(request, AdmittedRequest) and request.seed == 3 and resolved["seed"] == 3
    loaded.run_pipeline(request, 0)
    assert field_checks == ["job"]


def test_the_parallel_rule_and_the_python_api(loaded: Any, field_checks: list[str]) -> None:
    """The parallel driver's split rule resolves the launch's admitted requests without checking them again; a
    request that no entry point admitted (the Python API) is still checked when it is resolved."""
    requests = admit(type(loaded), loaded.config, [RequestConfig(prompt="a"), RequestConfig(prompt="b")],
                     source="launch", claim=lambda *a: None)
    assert field_checks == ["a", "b"]
    assert admit(loaded, None, requests, source="parallel") == requests
    assert field_checks == ["a", "b"]
    with pytest.raises(ValueError, match=r"`target_height` must be a multiple of 16 \(got 50\)"):
        loaded.resolve_request(RequestConfig(prompt="python", target_height=50))
    assert field_checks == ["a", "b", "python"]


class _Recorder:
    """A runner class and runner in one: records the rules' calls; `refuse` maps a prompt to the call that
    refuses it."""

    calls: list[str] = []
    refuse: dict[str, str] = {}

    @classmethod
    def validate_request(cls, request: RequestConfig, config: Any) -> None:
        cls._call("fields", request)

    @classmethod
    def _call(cls, name: str, request: RequestConfig) -> None:
        cls.calls.append(f"{name} {request.prompt}")
        if cls.refuse.get(request.prompt) == name:
            raise (NotImplementedError if name == "split" else ValueError)(f"{name} refuses {request.prompt}")

    def check_adapters(self, requests: list[RequestConfig]) -> None:
        self._call("adapters", requests[0])

    def request_shape(self, request: RequestConfig) -> tuple[int, int, int]:
        return (16, 16, 5)

    @property
    def memory_checks(self) -> _Recorder:  # the runner's memory checks (planning/checks.py), recorded here too
        return self

    def check_request(self, request: RequestConfig, shape: tuple[int, int, int], what: str) -> None:
        self._call("fit", request)

    def resolve_request(self, request: RequestConfig) -> RequestConfig:
        return request

    def check_sequence_split(self, request: RequestConfig) -> None:
        self._call("split", request)


@pytest.fixture
def recorder() -> _Recorder:
    _Recorder.calls, _Recorder.refuse = [], {}
    return _Recorder()


def test_each_entry_point_applies_its_rules_in_order_each_to_every_request_first(recorder: _Recorder) -> None:
    requests = [RequestConfig(prompt="a", lora=[{"path": "x"}])]
    admitted = admit(recorder, None, requests, source="server")
    assert recorder.calls == ["fields a", "adapters a", "fit a", "split a"]
    assert [r.prompt for r in admitted] == ["a"] and all(isinstance(r, AdmittedRequest) for r in admitted)
    assert admitted[0].model_dump() == requests[0].model_dump()
    assert admitted[0].model_fields_set == requests[0].model_fields_set and admitted[0].source == "command line"
    assert [name for name, _ in RULES["server"]] == ["fields", "adapters", "fit", "split"]
    assert [name for name, _ in RULES["launch"]] == ["fields", "outputs", "writer"]


def test_the_fields_rule_reports_every_refused_request_and_stops_the_later_rules(recorder: _Recorder) -> None:
    recorder.refuse.update(a="fields", c="fields")
    claimed: list[str] = []
    with pytest.raises(Refused) as refused:
        admit(_Recorder, None, [RequestConfig(prompt=p) for p in "abc"], source="launch",
              claim=lambda path, field, owner: claimed.append(path))
    assert refused.value.rule == "fields" and [i for i, _ in refused.value.problems] == [0, 2]
    assert [str(e) for _, e in refused.value.problems] == ["fields refuses a", "fields refuses c"]
    assert recorder.calls == ["fields a", "fields b", "fields c"] and claimed == []


def test_a_later_rule_names_the_request_it_refused(recorder: _Recorder) -> None:
    recorder.refuse.update(b="split")
    with pytest.raises(Refused) as refused:
        admit(recorder, None, [RequestConfig(prompt="a"), RequestConfig(prompt="b")], source="server")
    assert (refused.value.rule, [i for i, _ in refused.value.problems]) == ("split", [1])
    assert isinstance(refused.value.cause, NotImplementedError) and str(refused.value) == "split refuses b"
    assert recorder.calls == ["fields a", "fields b", "fit a", "fit b", "split a", "split b"]
    with pytest.raises(ValueError, match=r"`source` 'cli' is not an entry point; one of \['launch', 'parallel', "):
        admit(recorder, None, [], source="cli")


# ---- the override table ----------------------------------------------------------------------------------
def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions if action.option_strings}


def _check_surface(parser: argparse.ArgumentParser, surface: str) -> list[str]:
    """The parser's override flags as the table says them: name, type and help; returns the names in order."""
    options = _options(parser)
    keys = set(RunnerConfig.model_fields) | set(RequestConfig.model_fields) | {"offload"}
    in_parser = [dest for dest in options if dest in keys]
    rows = [row for row in OVERRIDES if surface in row.where]
    assert sorted(in_parser) == sorted(row.name for row in rows), surface
    for row in rows:
        action = options[row.name]
        if row.type is bool:
            assert isinstance(action, argparse._StoreTrueAction), row.name
        else:
            assert action.type is (None if row.type is str else row.type), row.name
        expected = row.serve_help if surface == "serve" and row.serve_help else row.help
        assert action.help == expected, row.name
    return in_parser


def test_the_three_surfaces_agree_with_the_override_table() -> None:
    from runnerkit.infer import build_parser
    from runnerkit.serve.fields import INPUT_REFERENCE, SERVER_FIELDS, accepted_fields
    from runnerkit.serve.server import build_parser as build_serve_parser

    launch = _check_surface(build_parser(), "launch")
    assert launch == [row.name for row in OVERRIDES if "launch" in row.where]  # the table's order, for --help
    assert _check_surface(build_serve_parser(), "serve") == ["model_cls", "task", "model_path", "device", "offload",
                                                             "warmup"]
    # every request field is in the table: either the body takes it or the server sets it
    body_rows = [row.name for row in OVERRIDES if "body" in row.where]
    assert sorted(set(body_rows) | set(SERVER_FIELDS)) == sorted(RequestConfig.model_fields)
    runner = SimpleNamespace(config=SimpleNamespace(task="t", lora=object()),
                             IMAGE_INPUTS={"t": ("image_path", "last_frame_path")}, EXTRA_IMAGES={"t": 2})
    expected = [body_name(name) for name in body_rows]
    expected.insert(expected.index("image") + 1, INPUT_REFERENCE)
    assert accepted_fields(runner, "video") == [*expected, "size", "seconds", "model"]
    assert accepted_fields(runner, "image", ("n",)) == [
        "prompt", "negative_prompt", "image", "last_frame", "extra_images", "seed", "target_height", "target_width",
        "target_video_length", "lora", "enhance_prompt", "size", "model", "n"]


def test_a_flag_overrides_the_config_key_the_table_names(tmp_path: Path) -> None:
    from runnerkit.infer import build_parser
    from runnerkit.overrides import config_overrides
    from runnerkit.serve.server import build_parser as build_serve_parser

    args = build_parser().parse_args(["--offload", "block", "--infer_steps", "3", "--warmup"])
    assert config_overrides(args, "launch") == {
        "model_cls": None, "task": None, "model_path": None, "text_encoder_path": None, "upsampler_path": None,
        "infer_steps": 3, "device": None, "offload.mode": "block", "warmup": True}
    args = build_serve_parser().parse_args(["--config_json", "c.json", "--device", "cpu"])
    assert config_overrides(args, "serve") == {"model_cls": None, "task": None, "model_path": None,
                                               "device": "cpu", "offload.mode": None, "warmup": None}


# ---- the server's shutdown --------------------------------------------------------------------------------
def test_drain_cancels_the_queue_then_waits_for_the_job_then_stops_the_ranks_then_closes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from runnerkit.serve import server as server_mod

    calls: list[str] = []
    server = server_mod.Server(argparse.Namespace(on_shutdown="cancel", drain_grace=0.5))
    server.queue = SimpleNamespace(close=lambda cancel_running: calls.append(f"close cancel={cancel_running}"),
                                   running=None)
    server.worker = SimpleNamespace(is_alive=lambda: True, join=lambda: calls.append("join"))
    server.leader = SimpleNamespace(stop=lambda: calls.append("leader stop"))
    server.http = SimpleNamespace(should_exit=False)
    monkeypatch.setattr(server_mod.time, "sleep", lambda s: calls.append(f"sleep {s}"))
    server.drain()
    assert calls == ["close cancel=True", "join", "leader stop", "sleep 0.5"] and server.http.should_exit
