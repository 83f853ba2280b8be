"""The runner's memory checks (planning/checks.py `MemoryChecks`, `runner.memory_checks`): a request's fit is
checked once, whichever entry point it came through. The launch script checks every request before loading
(`check_requests_fit`), the server at admission (the `fit` rule), and the runner before a request's first stage
only what was not checked yet (the Python API's requests; an admitted request records the shape it was checked
for in `AdmittedRequest.fit_checked`). Counted with a spy on `MemoryChecks.check_fit`, on the tiny Wan config
(its family gives an estimate, so each check is a real one) on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runnerkit.admission import AdmittedRequest, admit
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.planning import fit
from runnerkit.planning.checks import MemoryChecks
from test_cases._cli import no_gc_freeze, restore_logger, run_cli  # noqa: F401  (autouse fixtures)
from test_cases.conftest import tiny_config_dict, write_config

SHAPE = (48, 80, 9)  # the tiny config's default shape
MEMORY = {"limit_gib": 8.0}  # a fixed budget: every check below is made against it, and passes


@pytest.fixture
def fit_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, int, int], str]]:
    """Every `check_fit` call, (shape, what), in order."""
    calls: list[tuple[tuple[int, int, int], str]] = []
    original = MemoryChecks.check_fit

    def counted(self: MemoryChecks, shape: tuple[int, int, int], what: str) -> Any:
        calls.append((tuple(shape), what))
        return original(self, shape, what)

    monkeypatch.setattr(MemoryChecks, "check_fit", counted)
    return calls


def test_the_launch_script_checks_a_requests_fit_once(tiny_ckpt: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       fit_checks: list[tuple[tuple[int, int, int], str]]) -> None:
    """Before loading (`check_requests_fit`), not again before the request's first stage."""
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt, memory=MEMORY))
    out = tmp_path / "o.safetensors"
    rc, err = run_cli(capsys, "--config_json", cfg, "--prompt", "a fox", "--save_tensor_path", out)
    assert rc == 0, err
    assert fit_checks == [(SHAPE, "request 0 (command line)")]
    assert out.is_file()


@pytest.fixture(scope="module")
def loaded(tiny_ckpt: Path) -> WanT2VRunner:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, memory=MEMORY)))
    runner.init_modules()
    return runner


def test_the_python_api_checks_a_requests_fit_once(loaded: WanT2VRunner, tmp_path: Path,
                                                    fit_checks: list[tuple[tuple[int, int, int], str]]) -> None:
    """A plain `RequestConfig` (nothing admitted it): checked before its first stage, once."""
    loaded.run_pipeline(RequestConfig(prompt="a fox", save_tensor_path=str(tmp_path / "o.safetensors")), 3)
    assert fit_checks == [(SHAPE, "request 3")]


def test_a_server_job_is_checked_once_at_admission(loaded: WanT2VRunner, tmp_path: Path,
                                                   fit_checks: list[tuple[tuple[int, int, int], str]]) -> None:
    from runnerkit.serve.app import ServerState, build_request
    from runnerkit.serve.jobs import JobQueue

    state = ServerState(runner=loaded, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")
    request, _, _ = build_request(state, {"prompt": "job", "seed": 3, "size": "80x48"}, tmp_path)
    assert isinstance(request, AdmittedRequest) and request.fit_checked == SHAPE
    loaded.run_pipeline(request, 0)
    assert fit_checks == [(SHAPE, "request")]


def test_an_admitted_request_is_checked_again_only_at_another_shape_or_without_an_earlier_estimate(
        tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch,
        fit_checks: list[tuple[tuple[int, int, int], str]]) -> None:
    """`check_request` skips only the shape the request was checked for with an estimate: a request whose check
    before loading had no estimate yet (`fit.EstimateUnavailable`: it waits for the load) is checked before its
    first stage, and records it then."""
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, memory=MEMORY)))
    request, = admit(WanT2VRunner, runner.config, [RequestConfig(prompt="a fox")], source="launch",
                     claim=lambda *a: None)
    real_estimate = WanT2VRunner.estimate_memory

    def unavailable(self: WanT2VRunner, shape: Any) -> Any:
        raise fit.EstimateUnavailable("the architecture is read at load")

    monkeypatch.setattr(WanT2VRunner, "estimate_memory", unavailable)
    runner.memory_checks.check_requests_fit([request])
    assert request.fit_checked is None
    monkeypatch.setattr(WanT2VRunner, "estimate_memory", real_estimate)
    assert runner.memory_checks.check_request(request, SHAPE, "request 0") is not None
    assert request.fit_checked == SHAPE
    assert runner.memory_checks.check_request(request, SHAPE, "request 0") is None  # recorded: not again
    assert runner.memory_checks.check_request(request, (32, 32, 5), "request 0") is not None  # another shape
    assert fit_checks == [(SHAPE, "request 0 (command line)"), (SHAPE, "request 0"), ((32, 32, 5), "request 0")]
