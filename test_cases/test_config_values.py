"""Config values checked before anything loads: a JSON key given twice (config file, requests lines), and a fixed
`sample_sigmas` table against the settings it replaces and the scheduler that runs it (runnerkit/config.py,
runnerkit/json_strict.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runnerkit.admission import check_default_shape
from runnerkit.config import ConfigError, RunnerConfig, load_runner_config, read_requests
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.planning.host_advice import accepted
from runnerkit.schedulers.unipc import FlowUniPCScheduler

REPO = Path(__file__).resolve().parents[1]
TINY = json.loads((REPO / "configs/wan/wan_t2v_tiny.json").read_text())
TABLE = [1.0, 0.75, 0.5, 0.25]


def _config(tmp_path: Path, drop: tuple[str, ...] = (), **changes: Any) -> RunnerConfig:
    data = {k: v for k, v in TINY.items() if k not in drop} | changes
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    return load_runner_config(path, {})


def test_a_config_file_naming_a_key_twice_is_refused_naming_it(tmp_path: Path) -> None:
    """At the top level and inside a section; `json` alone would keep the last value silently."""
    path = tmp_path / "c.json"
    path.write_text('{"model_cls": "wan2.1", "infer_steps": 4, "infer_steps": 7}')
    with pytest.raises(ConfigError) as exc:
        load_runner_config(path, {})
    assert str(exc.value) == (f"config file {str(path)!r}: key 'infer_steps' appears twice in one JSON object "
                              "(values 4 and 7): keep one")
    path.write_text('{"model_cls": "wan2.1", "offload": {"mode": "block", "mode": "none"}}')
    with pytest.raises(ConfigError, match="key 'mode' appears twice in one JSON object of `offload` "):
        load_runner_config(path, {})
    path.write_text('{"model_cls": "wan2.1", "x": ' + "[" * 3000 + "]" * 3000 + "}")  # past json's recursion
    with pytest.raises(ConfigError, match="is not valid UTF-8 JSON: maximum recursion depth exceeded"):
        load_runner_config(path, {})


def test_a_requests_line_naming_a_key_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    """Every bad line is reported (the duplicate beside a line pydantic refuses); the good line is kept."""
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "a", "seed": 1}\n{"prompt": "b", "seed": 1, "seed": 2}\n{"prompt": 5}\n'
                    + "[" * 5000 + "]" * 5000 + "\n")  # a line too deep for `json`: refused as pydantic refuses it
    requests, problems, lines = read_requests(path)
    assert [r.prompt for r in requests] == ["a"] and lines == 4 and [n for n, _ in problems] == [2, 3, 4]
    assert "recursion limit exceeded" in problems[2][1], problems[2]
    assert problems[0][1] == (f"request on line 2 of {str(path)!r}: key 'seed' appears twice in one JSON object "
                              "(values 1 and 2): keep one")
    assert "prompt" in problems[1][1] and "Input should be a valid string" in problems[1][1], problems


@pytest.mark.parametrize("table", [[0.5, 1.0, 0.2, 0.1], [1.0, 0.5, 0.5, 0.1], [1.5, 0.5, 0.2, 0.1],
                                   [0.9, 0.5, 0.2, 0.0], [0.9, 0.5, 0.2, -0.1]])
def test_sample_sigmas_must_decrease_inside_0_1(tmp_path: Path, table: list[float]) -> None:
    with pytest.raises(ConfigError) as exc:
        _config(tmp_path, ("sample_shift",), sample_sigmas=table, scheduler="euler")
    assert f"sample_sigmas: `sample_sigmas` must be strictly decreasing values in (0, 1] (got {table})" in str(
        exc.value), exc.value


@pytest.mark.parametrize("given", [("sample_shift",), ("scheduler_spacing",), ("sample_shift", "scheduler_spacing")])
def test_sample_sigmas_beside_the_settings_it_replaces_is_refused(tmp_path: Path, given: tuple[str, ...]) -> None:
    """A table replaces `sample_shift` and `scheduler_spacing`: set beside it they would do nothing."""
    values = {"sample_shift": 9.0, "scheduler_spacing": "diffusers"}
    with pytest.raises(ConfigError) as exc:
        _config(tmp_path, ("sample_shift",), sample_sigmas=TABLE, scheduler="euler", **{k: values[k] for k in given})
    named = " and ".join(f"`{k}`" for k in given)
    assert (f"`sample_sigmas` is used as given, so {named} would do nothing: remove "
            f"{'them' if len(given) > 1 else 'it'} (or remove `sample_sigmas`)") in str(exc.value), exc.value


def test_a_table_from_1_runs_with_euler_and_the_family_fills_what_it_replaces(tmp_path: Path) -> None:
    """Without the replaced settings the config is accepted; the runner's config gets the family's defaults for them
    (no error although they now sit beside the table), and a later change of it or a planner trial is accepted."""
    config = _config(tmp_path, ("sample_shift",), sample_sigmas=TABLE, scheduler="euler")
    runner = WanT2VRunner.for_plan(config)
    assert runner.config.sample_sigmas == tuple(TABLE) and runner.config.sample_shift == WanT2VRunner.DEFAULTS[
        "sample_shift"] and runner.config.scheduler_spacing == WanT2VRunner.DEFAULTS["scheduler_spacing"]
    runner.update_config(seed=7)
    assert runner.config.seed == 7 and accepted(runner.config, {"offload.mode": "model"})


def test_unipc_refuses_a_table_from_1_also_as_the_family_default(tmp_path: Path) -> None:
    """UniPC's log-SNR is -inf at sigma 1: refused when the config names 'unipc' (config error), when the family's
    default scheduler is 'unipc' (building the runner, naming the default), and by the scheduler itself."""
    with pytest.raises(ConfigError) as exc:
        _config(tmp_path, ("sample_shift",), sample_sigmas=TABLE)  # the tiny config names "unipc"
    assert ("`sample_sigmas` starts at 1.0, but `scheduler` 'unipc' needs every sigma below 1 (its log-SNR is -inf "
            "at 1): start the table below 1, or set `scheduler` 'euler'") in str(exc.value), exc.value
    config = _config(tmp_path, ("sample_shift", "scheduler"), sample_sigmas=TABLE)
    with pytest.raises(ValueError) as exc:
        WanT2VRunner.for_plan(config)
    assert str(exc.value).startswith("invalid config with the family's defaults:\n  (top level): `sample_sigmas` "
                                     "starts at 1.0, but `scheduler` 'unipc'"), exc.value
    assert "(`scheduler`='unipc', wan2.1's default)" in str(exc.value), exc.value
    with pytest.raises(ConfigError) as refused:  # the launch script's and the server's check before loading
        check_default_shape(WanT2VRunner, config, "config c.json")
    assert str(refused.value) == f"config c.json: {exc.value}", refused.value  # not blamed on the default shape
    assert WanT2VRunner.for_plan(_config(tmp_path, ("sample_shift", "scheduler"), sample_sigmas=[0.99, 0.75, 0.5,
                                                                                                  0.25]))
    with pytest.raises(ValueError, match="UniPC needs every sigma below 1"):
        FlowUniPCScheduler(spacing="train_range", sigmas=TABLE)
