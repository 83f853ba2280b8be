"""The CUDA caching allocator's settings (runnerkit/allocator.py, config `memory.expandable_segments`): applied
once before loading, only on CUDA, never over the environment's own settings, and never by a runner that only
plans. PyTorch's setter is replaced by a recorder (this machine has no CUDA); the GPU effect is measured in
bench/results/allocator_h100.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runnerkit import allocator
from runnerkit.config import load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from test_cases.conftest import tiny_config_dict

CUDA = torch.device("cuda")


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The settings strings handed to PyTorch's allocator setter, in order; no allocator variable set."""
    calls: list[str] = []
    monkeypatch.setattr(allocator, "_setter", lambda: calls.append)
    for name in allocator.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_expandable_segments_are_set_on_cuda(applied: list[str]) -> None:
    line = allocator.configure_cuda_allocator(CUDA, True)
    assert applied == ["expandable_segments:True"]
    assert line is not None and "expandable segments" in line


def test_nothing_is_set_off_cuda_or_when_the_config_says_false(applied: list[str]) -> None:
    assert allocator.configure_cuda_allocator(torch.device("cpu"), True) is None
    line = allocator.configure_cuda_allocator(CUDA, False)
    assert applied == []
    assert line == "CUDA allocator: PyTorch's default segments (`memory.expandable_segments` false)"


@pytest.mark.parametrize("name", allocator.ENV_VARS)
def test_the_environments_settings_are_kept(applied: list[str], monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "max_split_size_mb:512")
    line = allocator.configure_cuda_allocator(CUDA, True)
    assert applied == []
    assert line == (f"CUDA allocator: the environment's settings kept ({name}='max_split_size_mb:512'); "
                    "`memory.expandable_segments` not applied")


def test_pytorchs_setter_exists() -> None:
    """The private setter the module calls is in this PyTorch (a rename would otherwise surface only on a GPU)."""
    assert callable(allocator._setter())


@pytest.mark.parametrize("expandable", [True, False])
def test_a_run_sets_the_allocator_once_before_loading(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                      expandable: bool) -> None:
    events: list[object] = []
    monkeypatch.setattr(allocator, "configure_cuda_allocator",
                        lambda device, flag: events.append(("allocator", device.type, flag)))
    load = WanT2VRunner.load_modules
    monkeypatch.setattr(WanT2VRunner, "load_modules", lambda self: (events.append("load"), load(self))[1])
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, memory={"expandable_segments": expandable}))
    WanT2VRunner(config).init_modules()
    assert events == [("allocator", "cpu", expandable), "load"]


def test_a_runner_that_only_plans_leaves_the_allocator_alone(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[object] = []
    monkeypatch.setattr(allocator, "configure_cuda_allocator", lambda device, flag: events.append(flag))
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, offload={"mode": "auto"}))
    runner = WanT2VRunner.for_plan(config)
    assert runner.memory_checks.plan_memory(()) is not None  # a plan was made
    assert events == []


def test_each_line_is_logged_once_per_process(applied: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_logged", set())
    logged: list[str] = []
    monkeypatch.setattr(allocator.logger, "info", logged.append)
    for _ in range(2):
        allocator.configure_cuda_allocator(CUDA, True)
    allocator.configure_cuda_allocator(CUDA, False)
    assert applied == ["expandable_segments:True"] * 2  # applied each time: cheap, and the process's state
    assert [line.split(" (")[0] for line in logged] == ["CUDA allocator: expandable segments",
                                                         "CUDA allocator: PyTorch's default segments"]
