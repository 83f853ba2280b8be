"""Offload keys judged against the family's modules before anything loads or is written
(planning/offload_checks.py): `offload.resident_modules` naming a module the pipeline lacks or one that
streams, `offload.keep_across_stages` on a pipeline with one denoising stage; the run refuses them in its
plan phase (the synthetic checkpoint folder stays empty), `runnerkit plan` with exit 2 and the same line.
And the config's own messages for offload keys (config.py): every inert key with its origin, a list item's
origin, "list" for a list field given a string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from runnerkit.cli import main as cli_main
from runnerkit.config import ConfigError, OffloadConfig, load_runner_config
from runnerkit.models.ltx2.runner import LTX2Runner
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.runners.base import LifecycleError
from runnerkit.planning.fit import MemoryFitError
from test_cases._cli import restore_logger  # noqa: F401 (autouse fixture)
from test_cases.conftest import REPO, TINY_CONFIG
from test_cases.planning.test_planner import BLOCK, plan

WAN_MISSING = ("`offload.resident_modules`=['transformr']: WanT2VRunner (model_cls 'wan2.1', task 't2v') has no "
               "module ['transformr']; modules it can keep resident: ['text_encoder', 'transformer', 'vae']")
WAN_STREAMED = ("`offload.resident_modules`=['vae', 'transformer']: ['transformer'] stream their blocks in "
                "`offload.mode`='block' (streamed: ['transformer']); modules it can keep resident in this mode: "
                "['text_encoder', 'vae'] (or list the modules to stream in `offload.stream_modules` without them)")
WAN_ONE_STAGE = ("`offload.keep_across_stages`=true has no effect: WanT2VRunner (model_cls 'wan2.1', task 't2v') "
                 "has one denoising stage (no module stays on the device across a transition between stages); "
                 "remove it")


def tiny_wan(folder: Path, **offload: Any) -> dict[str, Any]:
    """The tiny Wan config writing its synthetic checkpoint into `folder` (empty), on the CPU."""
    data = json.loads(TINY_CONFIG.read_text())
    data.update(model_path=str(folder), device="cpu", offload=offload)
    return data


@pytest.mark.parametrize("offload, message", [
    ({"mode": "model", "resident_modules": ["transformr"]}, WAN_MISSING),
    ({"mode": "block", "resident_modules": ["vae", "transformer"]}, WAN_STREAMED),
    ({"mode": "model", "keep_across_stages": True}, WAN_ONE_STAGE),
    ({"mode": "auto", "resident_modules": ["transformr"]}, WAN_MISSING),
], ids=["missing", "streamed", "one-stage", "auto-missing"])
def test_the_run_refuses_before_writing_or_loading(tmp_path: Path, offload: dict[str, Any], message: str) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    runner = WanT2VRunner(load_runner_config(None, tiny_wan(folder, **offload)))
    with pytest.raises(ValueError) as err:
        runner.init_modules()
    assert str(err.value) == message
    assert list(folder.iterdir()) == []  # no synthetic checkpoint was written


@pytest.mark.parametrize("offload, message", [
    ({"mode": "model", "resident_modules": ["transformr"]},
     "has no module ['transformr']; modules it can keep resident: ['text_encoder', 'transformer', 'vae']"),
    ({"mode": "block", "resident_modules": ["vae", "transformer"]}, WAN_STREAMED.split(": ", 1)[1]),
], ids=["missing", "streamed"])
def test_without_an_estimate_the_load_refuses_with_the_same_rule(tmp_path: Path, offload: dict[str, Any], message: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A family that gives no estimate before loading: the pipeline description is checked at load by the same
    rule (`check_resident_modules`)."""
    monkeypatch.setattr(WanT2VRunner, "estimate_memory", lambda self, shape: None)
    runner = WanT2VRunner(load_runner_config(None, tiny_wan(tmp_path / "ckpt", **offload)))
    with pytest.raises(ValueError) as err:
        runner.init_modules()
    assert str(err.value).startswith(f"`offload.resident_modules`={offload['resident_modules']}: ")
    assert str(err.value).endswith(message), str(err.value)


def test_a_two_stage_pipeline_takes_keep_across_stages(tmp_path: Path) -> None:
    """LTX-2 holds its transformer through the upsampler: the key is accepted before loading."""
    data = json.loads((REPO / "configs/ltx2/ltx2_t2av_tiny.json").read_text())
    data.update(model_path=str(tmp_path / "ckpt"), device="cpu", offload={"mode": "model", "keep_across_stages": True})
    runner = LTX2Runner(load_runner_config(None, data))
    assert runner.memory_checks.plan_memory(()) is None  # checked, accepted, not a plan (mode model)
    data["offload"] = {"mode": "model", "resident_modules": ["upsampler"]}
    with pytest.raises(ValueError, match=r"has no module \['upsampler'\]; modules it can keep resident: \["
                                         r"'text_encoder', 'connectors', 'transformer', 'latent_upsampler', 'vae', "
                                         r"'audio_decoder'\]"):
        LTX2Runner(load_runner_config(None, data)).memory_checks.plan_memory(())


@pytest.mark.parametrize("offload, message", [
    ({"mode": "model", "resident_modules": ["transformr"]}, WAN_MISSING),
    ({"mode": "model", "keep_across_stages": True}, WAN_ONE_STAGE),
], ids=["missing", "one-stage"])
def test_runnerkit_plan_refuses_with_exit_2(tmp_path: Path, offload: dict[str, Any], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_wan(tmp_path / "absent", **offload)))
    assert cli_main(["plan", "--config_json", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"invalid input: {config}: {message}" in " ".join(captured.err.split())


def test_auto_leaves_out_the_candidates_that_stream_a_resident_module() -> None:
    """`resident_modules: [transformer]` with mode auto: block streaming streams the transformer, so its rungs are
    left out (else every unit resident beside the other modules would copy nothing and be taken, and the load
    would refuse it); model offload with the transformer resident is the plan."""
    result = plan(80, 64, resident_modules=["transformer"])
    assert result.offload == OffloadConfig(mode="model", resident_modules=["transformer"])
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{message}")
    try:
        with pytest.raises(MemoryFitError):  # 12 GiB: model offload does not fit, the rest is left out
            plan(12, 64, resident_modules=["transformer"])
    finally:
        logger.remove(sink)
    name = BLOCK.replace("transformers)", "transformers; resident transformer)")
    assert (f"memory plan candidate: {name}: excluded: `offload.resident_modules` keeps ['transformer'] resident, "
            "which this candidate streams\n") in lines


# ---- the config's own messages ------------------------------------------------------------------
def refusal(offload: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        load_runner_config(REPO / "configs/wan/wan_t2v_1.3b.json", {"offload": offload})
    return str(err.value)


def test_every_inert_key_is_named_with_its_origin() -> None:
    msg = refusal({"mode": "none", "gpu_slots": 3, "reader": "pread"})
    assert ("offload: `offload.gpu_slots` has no effect with `offload.mode`='none' (set for: `offload.gpu_slots`, "
            "`offload.reader`); remove them or choose a mode that uses them") in msg, msg
    origins = msg.splitlines()[-1]
    for key, value in (("gpu_slots", "3"), ("reader", "'pread'"), ("mode", "'none'")):
        assert f"`offload.{key}`={value} from the command line (--offload)" in origins, msg


def test_a_list_item_of_the_wrong_type_names_its_origin() -> None:
    msg = refusal({"mode": "block", "stream_modules": ["transformer", 3]})
    assert msg.splitlines()[1:] == [
        "  offload.stream_modules[1]: Input should be a valid string (got 3)",
        "    (`offload.stream_modules`=['transformer', 3] from the command line (--offload))"], msg


def test_a_string_for_a_list_says_list() -> None:
    msg = refusal({"mode": "model", "resident_modules": "transformer"})
    assert "  offload.resident_modules: Input should be a valid list (got 'transformer')" in msg.splitlines(), msg
    assert "tuple" not in msg


def test_the_planning_runner_is_still_refused_init() -> None:
    config = load_runner_config(None, tiny_wan(Path("absent")))
    with pytest.raises(LifecycleError):
        WanT2VRunner.for_plan(config).init_modules()
