"""Shared pieces of the tests that run the launch script in-process (`runnerkit.infer.main`).

A test module imports `restore_logger` and `no_gc_freeze` (autouse fixtures: importing them into
the module's namespace activates them there) and calls `run_cli`."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from loguru import logger

from runnerkit import memory


@pytest.fixture(autouse=True)
def restore_logger() -> Any:
    """`main` binds loguru to the `sys.stderr` of its call (a capsys buffer here); rebind afterwards."""
    yield
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="DEBUG")


@pytest.fixture(autouse=True)
def no_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process warmups must not freeze the test process's gc (nor consume the once-per-process freeze)."""
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str]:
    """Run `main` in-process; returns (exit status, everything it wrote to stderr)."""
    from runnerkit.infer import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err
