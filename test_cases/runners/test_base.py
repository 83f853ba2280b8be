"""The lifecycle guarantees BaseRunner holds for every family: final verbs, once-only init and
warmup, a deeply frozen config, phase tags, end_run always, and cleanup errors never hiding the
request's own error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from runnerkit import memory
from runnerkit.config import ConfigLockedError, RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.registry import RUNNERS, family_modules, get_runner_cls, register_runner
from runnerkit.runners.base import LifecycleError, error_phase, lifecycle_phase
from test_cases.conftest import tiny_config_dict
from test_cases.runners.two_stage import TwoStageImageRunner, config_dict


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", True)


def toy(tmp_path: Path, **overrides: Any) -> TwoStageImageRunner:
    return TwoStageImageRunner(load_runner_config(None, config_dict(tmp_path, **overrides)))


@pytest.mark.parametrize("verb", ["init_modules", "warmup", "run_pipeline"])
def test_final_verbs_cannot_be_overridden(verb: str) -> None:
    with pytest.raises(TypeError, match=rf"overrides {verb}: these lifecycle verbs are final"):
        type("Sneaky", (WanT2VRunner,), {verb: lambda self, *a: None})


@pytest.mark.parametrize("verb", ["init_modules", "warmup", "run_pipeline"])
def test_final_verbs_cannot_come_from_a_mixin(verb: str) -> None:
    """DefaultRunner takes hooks from mixins listed before BaseRunner; a mixin is refused a final verb too."""
    mixin = type("SneakyMixin", (), {verb: lambda self, *a: None})
    with pytest.raises(TypeError, match=rf"overrides {verb}: these lifecycle verbs are final"):
        type("Sneaky", (mixin, WanT2VRunner), {})


def test_init_modules_runs_once(tmp_path: Path, mocker: Any) -> None:
    runner = toy(tmp_path, warmup=True)
    load = mocker.spy(TwoStageImageRunner, "load_modules")
    warm = mocker.spy(TwoStageImageRunner, "run_warmup")
    runner.init_modules()
    with pytest.raises(LifecycleError, match="init_modules runs once per runner and already ran"):
        runner.init_modules()
    assert load.call_count == 1 and warm.call_count == 1


def test_failed_init_cannot_be_retried_or_serve(tmp_path: Path, mocker: Any) -> None:
    runner = toy(tmp_path)
    mocker.patch.object(TwoStageImageRunner, "prepare_load", side_effect=OSError("disk gone"))
    with pytest.raises(OSError) as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "load"
    with pytest.raises(LifecycleError, match="state: failed"):
        runner.init_modules()
    with pytest.raises(LifecycleError, match="init_modules completed"):
        runner.run_pipeline(RequestConfig(prompt="x"), 0)


def test_request_before_init_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LifecycleError, match=r"init_modules completed \(state: new\)"):
        toy(tmp_path).run_pipeline(RequestConfig(prompt="x"), 0)


@pytest.mark.parametrize("warmup", [True, False])
def test_config_is_locked_right_after_load_modules_before_cache_and_warmup(tmp_path: Path, warmup: bool) -> None:
    """Inside load_modules the config still takes resolved values; from the first step after it (the
    compile cache, built from the config) and through all of warmup, it refuses changes: nested
    values of `model` raise when written, and `update_config` is refused."""
    runner = toy(tmp_path, warmup=warmup, model={"arch": {"widths": [8]}})
    seen: list[tuple[str, str]] = []

    def try_change(where: str) -> None:
        for what, change in (("model", lambda: runner.config.model["arch"]["widths"].append(16)),
                             ("update_config", lambda: runner.update_config(infer_steps=3))):
            try:
                change()
            except ConfigLockedError:
                seen.append((where, f"{what} locked"))
            else:
                seen.append((where, f"{what} CHANGED"))

    real_load, real_cache, real_warmup = runner.load_modules, runner._load_compile_cache, runner.run_warmup

    def load() -> None:
        real_load()
        runner.update_config(sample_shift=3.0)  # a value resolved while loading: still accepted here

    def cache() -> None:
        try_change("compile cache")
        real_cache()

    def run_warmup(shapes: Any) -> None:
        try_change("warmup")
        real_warmup(shapes)

    runner.load_modules, runner._load_compile_cache, runner.run_warmup = load, cache, run_warmup  # type: ignore[method-assign]
    runner.init_modules()
    locked = [(w, f"{what} locked") for w in ["compile cache", "warmup"][:2 if warmup else 1]
              for what in ("model", "update_config")]
    assert seen == locked
    assert runner.config.model["arch"]["widths"] == [8] and runner.config.infer_steps == 4


def test_config_is_deeply_frozen_after_load(tiny_ckpt: Path) -> None:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt)))
    runner.init_modules()
    model = runner.config.model
    assert model["transformer"]["num_layers"] == 2  # resolved during load
    with pytest.raises(ConfigLockedError):
        model["transformer"]["num_layers"] = 3
    with pytest.raises(ConfigLockedError):
        model["vae"]["dim_mult"].append(4)
    with pytest.raises(ConfigLockedError):
        model.pop("vae")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        runner.config.offload.mode = "block"  # type: ignore[misc]
    with pytest.raises(ConfigLockedError, match="infer_steps"):
        runner.update_config(infer_steps=8)
    assert runner.config.infer_steps == 4 and model["transformer"]["num_layers"] == 2
    assert runner.config.model_dump(mode="json")["model"]["vae"]["dim_mult"] == [1, 2, 2, 2]  # still serialisable


def test_every_request_error_is_tagged_and_end_run_always_runs(tmp_path: Path, mocker: Any) -> None:
    runner = toy(tmp_path)
    end_run = mocker.spy(TwoStageImageRunner, "end_run")
    mocker.patch.object(TwoStageImageRunner, "run_decoder", side_effect=ValueError("bad decode"))
    runner.init_modules()  # the pipeline description holds the (patched) decoder from here on
    with pytest.raises(ValueError, match="bad decode") as exc:
        runner.run_pipeline(RequestConfig(prompt="x"), 4)
    assert error_phase(exc.value) == "request 4" and end_run.call_count == 1
    assert runner.profiler.requests[-1].error == "ValueError: bad decode" and not runner.profiler.requests[-1].ok
    assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys()


def test_cleanup_error_never_hides_the_request_error(tmp_path: Path, mocker: Any) -> None:
    runner = toy(tmp_path)
    mocker.patch.object(TwoStageImageRunner, "run_decoder", side_effect=ValueError("bad decode"))
    runner.init_modules()
    mocker.patch.object(TwoStageImageRunner, "clear_request_state", side_effect=RuntimeError("cleanup broke"))
    with pytest.raises(ValueError, match="bad decode") as exc:
        runner.run_pipeline(RequestConfig(prompt="x"), 2)
    assert error_phase(exc.value) == "request 2"
    assert any("end_run also failed" in n and "RuntimeError: cleanup broke" in n for n in exc.value.__notes__)
    assert str(exc.value.runnerkit_cleanup_error) == "cleanup broke"


def test_cleanup_error_alone_fails_the_request(tmp_path: Path, mocker: Any) -> None:
    runner = toy(tmp_path)
    runner.init_modules()
    mocker.patch.object(TwoStageImageRunner, "clear_request_state", side_effect=RuntimeError("cleanup broke"))
    with pytest.raises(RuntimeError, match="cleanup broke") as exc:
        runner.run_pipeline(RequestConfig(prompt="x"), 1)
    assert error_phase(exc.value) == "request 1 (end_run)"
    assert runner.profiler.requests[-1].ok is False


def test_phase_tag_keeps_type_and_first_phase() -> None:
    with pytest.raises(KeyError) as exc:
        with lifecycle_phase("request 2"), lifecycle_phase("inner"):
            raise KeyError("x")
    assert error_phase(exc.value) == "inner"
    assert exc.value.__notes__ == ["[runnerkit] raised during phase: inner"]


def test_registry_finds_families_by_folder_and_rejects_duplicates() -> None:
    assert "runnerkit.models.wan.runner" in family_modules()
    with pytest.raises(ValueError, match="already registered"):
        register_runner("wan2.1")(WanT2VRunner)
    with pytest.raises(ValueError, match=r"unknown `model_cls` 'nope'; registered: \[.*'wan2.1'.*\]"):
        get_runner_cls("nope")
    assert RUNNERS["wan2.1"] is WanT2VRunner


def test_unknown_task_is_refused(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"`task` 'i2v' is not served by WanT2VRunner \(model_cls 'wan2.1'\); its tasks: \['t2v'\]"):
        WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, task="i2v")))
    with pytest.raises(ValueError, match=r"`task` 'x2v' is not served by model_cls 'wan2.1'; allowed: \['t2v', 'i2v', 'flf2v'\]"):
        get_runner_cls("wan2.1", "x2v")


def test_registry_maps_each_task_to_its_runner_class() -> None:
    from runnerkit.models.wan.i2v import WanFLF2VRunner, WanI2VRunner
    from runnerkit.models.wan.moe import WanMoEI2VRunner, WanMoERunner

    assert [get_runner_cls("wan2.1", t) for t in ("t2v", "i2v", "flf2v")] == [WanT2VRunner, WanI2VRunner, WanFLF2VRunner]
    assert [get_runner_cls("wan2.2_moe", t) for t in ("t2v", "i2v")] == [WanMoERunner, WanMoEI2VRunner]
    assert get_runner_cls("wan2.1") is WanT2VRunner  # no task: the family's first (primary) runner
    with pytest.raises(ValueError,
                       match=r"already registered for task\(s\) \['i2v'\] by runnerkit\.models\.wan\.i2v\.WanI2VRunner"):
        register_runner("wan2.1")(WanI2VRunner)


def test_every_runner_class_has_one_base_up_to_base_runner() -> None:
    """The family chain is BaseRunner -> DefaultRunner -> family (-> variant): every class in a registered
    runner's MRO up to BaseRunner has exactly one base. Checkpoints, warmup, memory checks and a family's
    estimates are objects or functions the runner holds and calls, never mixins."""
    from runnerkit.registry import TASK_RUNNERS, load_families
    from runnerkit.runners.base import BaseRunner
    from runnerkit.runners.default import DefaultRunner

    load_families()
    runners = set(TASK_RUNNERS.values())
    assert len(runners) >= 9 and all(DefaultRunner in r.__mro__ for r in runners)  # every family's, variants too
    chain = {k for r in runners for k in r.__mro__[:r.__mro__.index(BaseRunner) + 1]}
    several = {k.__qualname__: [b.__qualname__ for b in k.__bases__] for k in chain if len(k.__bases__) != 1}
    assert several == {}, f"runner classes with several bases (class: bases): {several}"


def test_core_names_no_family() -> None:
    """Everything outside runnerkit/models/ learns what is family-specific from the family."""
    import re

    root = Path(__file__).resolve().parents[2] / "runnerkit"
    paths = [p for p in root.rglob("*") if p.suffix in (".py", ".html") and p.relative_to(root).parts[0] != "models"]
    assert root / "serve" / "page.html" in paths and root / "synthetic.py" in paths and len(paths) > 40
    offenders = [f"{p.relative_to(root)}:{n}: {line.strip()}" for p in paths
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"\b([Ww]an|WAN|[Qq]wen|QWEN|[Ll]tx|LTX)(?![a-z])", line)]
    assert offenders == []


def test_unexpected_error_prints_traceback_input_error_does_not(tiny_ckpt: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str], mocker: Any) -> None:
    import json

    from runnerkit.infer import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(tiny_config_dict(tiny_ckpt)))
    mocker.patch.object(WanT2VRunner, "run_step", side_effect=ZeroDivisionError("a bug"))
    assert main(["--config_json", str(cfg), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a bug" in err
    assert main(["--config_json", str(cfg), "--prompt", "x", "--target_height", "33"]) == 2
    err = capsys.readouterr().err
    assert "`target_height` must be a multiple of 16" in err and "Traceback" not in err


def test_request_error_outside_cuda_keeps_its_type(tmp_path: Path, mocker: Any) -> None:
    runner = toy(tmp_path)
    runner.init_modules()
    mocker.patch.object(TwoStageImageRunner, "run_step", side_effect=torch.cuda.OutOfMemoryError("oom"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        runner.run_pipeline(RequestConfig(prompt="x"), 0)
