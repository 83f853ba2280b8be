"""The request field `enhance_prompt` and the config section `prompt_enhancer`, family-neutral: a runner class
without a prompt enhancer (`PROMPT_ENHANCER` False, the tiny Wan runner here) refuses both, each entry point at
admission with the field, its value and why; a class with one refuses the field until the config loads it; the
sidecar records the enhanced prompt beside the user's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from runnerkit.admission import admitted
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.runners.request_state import RequestState
from test_cases._cli import no_gc_freeze, restore_logger, run_cli  # noqa: F401  (autouse fixtures)
from test_cases.conftest import tiny_config_dict, write_config

NO_ENHANCER = "`enhance_prompt`=true: model_cls 'wan2.1' (task 't2v') has no prompt enhancer"


@pytest.fixture(scope="module")
def loaded(tiny_ckpt: Path) -> Any:
    from runnerkit.models.wan.runner import WanT2VRunner

    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt)))
    runner.init_modules()
    return runner


def test_the_launch_script_refuses_the_flag_and_a_requests_line(tiny_ckpt: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt))
    out = tmp_path / "x.safetensors"
    rc, err = run_cli(capsys, "--config_json", cfg, "--prompt", "a fox", "--enhance_prompt", "--save_tensor_path", out)
    assert rc == 2 and NO_ENHANCER in err, err
    lines = tmp_path / "r.jsonl"
    lines.write_text(json.dumps({"prompt": "plain", "save_tensor_path": str(tmp_path / "p.safetensors")}) + "\n"
                     + json.dumps({"prompt": "fox", "enhance_prompt": True,
                                   "save_tensor_path": str(tmp_path / "f.safetensors")}) + "\n")
    rc, err = run_cli(capsys, "--config_json", cfg, "--requests", lines)
    assert rc == 2 and NO_ENHANCER in err and "line 2" in err, err
    assert not out.exists() and list(tmp_path.glob("*.safetensors")) == []  # refused before anything ran


def test_the_server_and_the_python_api_refuse_it(loaded: Any, tmp_path: Path) -> None:
    from runnerkit.serve.app import ServerState, build_request
    from runnerkit.serve.body import InputError
    from runnerkit.serve.jobs import JobQueue

    state = ServerState(runner=loaded, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")
    with pytest.raises(InputError, match=NO_ENHANCER.replace("(", r"\(").replace(")", r"\)")) as refused:
        build_request(state, {"prompt": "job", "enhance_prompt": True}, tmp_path)
    assert refused.value.field == "enhance_prompt" and refused.value.status == 422
    request, _, _ = build_request(state, {"prompt": "job", "enhance_prompt": False}, tmp_path)
    assert request.enhance_prompt is False
    with pytest.raises(ValueError, match="has no prompt enhancer; remove the field"):
        loaded.resolve_request(RequestConfig(prompt="python", enhance_prompt=True))
    assert loaded.resolve_request(RequestConfig(prompt="python")).enhance_prompt is False
    # an admitted request is resolved as given (a runner with an enhancer admits it): the field reaches the hooks
    assert loaded.resolve_request(admitted(RequestConfig(prompt="python", enhance_prompt=True))).enhance_prompt


def test_a_form_part_true_or_false_is_a_bool() -> None:
    from runnerkit.serve.body import form_fields

    fields = asyncio.run(form_fields([("prompt", "p"), ("enhance_prompt", " True ")]))
    assert fields == {"prompt": "p", "enhance_prompt": True}
    assert asyncio.run(form_fields([("enhance_prompt", "false")])) == {"enhance_prompt": False}
    assert asyncio.run(form_fields([("enhance_prompt", "yes")])) == {"enhance_prompt": "yes"}  # refused by the model


def test_the_config_section_is_refused_without_an_enhancer(tiny_ckpt: Path) -> None:
    from runnerkit.models.wan.runner import WanT2VRunner

    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, prompt_enhancer={}))
    with pytest.raises(ValueError, match=r"`prompt_enhancer` is not read by 'wan2.1' task 't2v': it has no prompt "
                                         r"enhancer; remove the section"):
        WanT2VRunner(config)


def test_a_runner_class_with_an_enhancer_needs_the_config_section(tiny_ckpt: Path) -> None:
    """The class declares an enhancer (`PROMPT_ENHANCER`); the request is admitted only once the config loads it."""
    from runnerkit.models.wan.runner import WanT2VRunner

    class WithEnhancer(WanT2VRunner):
        PROMPT_ENHANCER = True

    request = RequestConfig(prompt="fox", enhance_prompt=True)
    without = load_runner_config(None, tiny_config_dict(tiny_ckpt))
    with pytest.raises(ValueError, match=r"`enhance_prompt`=true: the runner's config does not load the prompt "
                                         r"enhancer of 'wan2.1'; add a `prompt_enhancer` section"):
        WithEnhancer.validate_request(request, without)
    WithEnhancer.validate_request(request, load_runner_config(None, tiny_config_dict(tiny_ckpt, prompt_enhancer={})))
    WanT2VRunner.validate_request(RequestConfig(prompt="fox"), without)  # false: never refused


def test_the_sidecar_keeps_both_prompts(loaded: Any) -> None:
    from runnerkit.runners.writes import sidecar_record

    info = loaded.resolve_request(RequestConfig(prompt="a fox"))
    plain = sidecar_record(loaded, RequestState(info))
    assert plain["prompt"] == "a fox" and "enhanced_prompt" not in plain
    enhanced = sidecar_record(loaded, RequestState(info, enhanced_prompt="A red fox trots through snow."))
    assert enhanced["prompt"] == "a fox" and enhanced["enhanced_prompt"] == "A red fox trots through snow."
    assert list(enhanced)[:3] == ["prompt", "enhanced_prompt", "negative_prompt"]
