"""Nothing of a request lives on the runner after it (runners/request_state.py, ARCHITECTURE §8).

For each family's tiny config on the CPU: the runner's attributes (`vars(runner)`: names and the
identity of each value) after `init_modules` are exactly those after a request that succeeded, one
that failed in its first denoising step, and one an observer cancelled after it; and the request's `RequestState`
itself is gone (a weak reference to it is dead) once `run_pipeline` returned or raised.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.images import write_image
from runnerkit.registry import get_runner_cls
from runnerkit.runners.base import Progress, RequestCancelled
from runnerkit.runners.default import DefaultRunner
from test_cases.conftest import REPO

#: family -> (tiny config, whether its task takes an image, the request's (height, width, frames)); two
#: steps where the family lets the config choose (LTX-2's are its distilled sigmas: 8 + 3)
FAMILIES: dict[str, tuple[str, bool, tuple[int, int, int]]] = {
    "wan_t2v": ("wan/wan_t2v_tiny.json", False, (32, 32, 5)),
    "wan_i2v": ("wan/wan_i2v_tiny.json", True, (32, 32, 5)),
    "wan22_moe_i2v": ("wan/wan22_moe_i2v_tiny.json", True, (32, 32, 5)),
    "qwen_image_t2i": ("qwen_image/qwen_image_t2i_tiny.json", False, (32, 32, 1)),
    "ltx2_i2av": ("ltx2/ltx2_i2av_tiny.json", True, (64, 64, 9)),
}
#: Run-level flags that say a once-per-runner log line was written (the first request may write it):
#: whether, never what, so no request's state; compared as booleans, not by identity.
SAID_ONCE = ("_fit_unchecked_logged", "_fit_deferred_logged", "_thread_warned")


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)


def snapshot(runner: DefaultRunner) -> dict[str, int | bool]:
    """Every attribute of the runner, by name, with the identity of its value (`SAID_ONCE`: any bool)."""
    return {name: isinstance(value, bool) if name in SAID_ONCE else id(value) for name, value in vars(runner).items()}


class Harness:
    """Class-level spies (an instance attribute would itself change `vars(runner)`): the request state
    each request ran with (weakly held), a step that fails on demand, an observer that cancels on demand."""

    def __init__(self, runner: DefaultRunner, monkeypatch: pytest.MonkeyPatch) -> None:
        self.states: list[weakref.ref[Any]] = []
        self.fail_step = False
        self.cancel = False
        real_step = type(runner).run_step

        def run_step(runner_: Any, req: Any, *args: Any) -> torch.Tensor:
            if not self.states or self.states[-1]() is not req:
                self.states.append(weakref.ref(req))
            if self.fail_step:  # the first step: after the encoders and the scheduler's prepare
                raise RuntimeError("injected step failure")
            return real_step(runner_, req, *args)

        monkeypatch.setattr(type(runner), "run_step", run_step)

    def observe(self, progress: Progress) -> None:
        if self.cancel and progress.steps_done == 1:
            raise RequestCancelled("cancelled by the test")


def build(family: str, tmp_path: Path) -> tuple[DefaultRunner, Callable[[int], RequestConfig]]:
    config_file, takes_image, (height, width, frames) = FAMILIES[family]
    steps = {} if family.startswith("ltx2") else {"infer_steps": 2}
    config = load_runner_config(REPO / "configs" / config_file, {"device": "cpu", **steps})
    runner = get_runner_cls(config.model_cls, config.task)(config)
    image = tmp_path / "first.png"
    if takes_image:
        write_image(image, torch.rand(3, height, width, generator=torch.Generator().manual_seed(1)) * 2 - 1)

    def request(seed: int) -> RequestConfig:
        return RequestConfig(prompt="a fox in the snow", seed=seed, image_path=str(image) if takes_image else None,
                             target_height=height, target_width=width, target_video_length=frames,
                             save_tensor_path=str(tmp_path / f"out{seed}.safetensors"))

    return runner, request


def assert_request_dropped(harness: Harness) -> None:
    gc.collect()
    assert harness.states, "no step ran"
    assert harness.states[-1]() is None, "the request's RequestState is still referenced after the request"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_nothing_of_a_request_remains_on_the_runner(family: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    runner, request = build(family, tmp_path)
    harness = Harness(runner, monkeypatch)
    runner.on_progress = harness.observe  # set before the baseline: the observer is run-level state
    runner.init_modules()
    baseline = snapshot(runner)

    runner.run_pipeline(request(1), 0)  # success
    assert (tmp_path / "out1.safetensors").is_file()
    assert snapshot(runner) == baseline
    assert_request_dropped(harness)

    harness.fail_step = True  # failure inside the denoising loop
    with pytest.raises(RuntimeError, match="injected step failure"):
        runner.run_pipeline(request(2), 1)
    harness.fail_step = False
    assert snapshot(runner) == baseline
    assert_request_dropped(harness)

    harness.cancel = True  # an observer's cancel after the first step (the scheduler is mid-schedule)
    with pytest.raises(RequestCancelled):
        runner.run_pipeline(request(3), 2)
    harness.cancel = False
    assert snapshot(runner) == baseline
    assert_request_dropped(harness)
    assert len(harness.states) == 3
