"""Shared pieces of the tests that run the launch script in-process (`runnerkit.infer.main`).

A test module imports `restore_logger` and `no_gc_freeze` (autouse fixtures: importing them into
the module's namespace activates them there) and calls `run_cli`."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
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


def run_launch_script(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, script: Path,
                      args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """A shell launcher (scripts/<family>/*.sh) run by bash, its `python -m runnerkit.infer ...` run here.

    bash runs `script` with `args` from `cwd` under `env` with a `python` (and `python3`) first on the
    PATH that only records its arguments; those must start `-m runnerkit.infer`, and the rest is handed
    to `main` in this process (from `cwd`, with `env`'s variables set), the interpreter start-up being
    the one part not run. Returns (exit status, what `main` wrote to stderr)."""
    with tempfile.TemporaryDirectory() as folder:  # not in `cwd`: tests list what the run left there
        stub = Path(folder)
        record = stub / "argv"
        for name in ("python", "python3"):
            (stub / name).write_text(f'#!/usr/bin/env bash\nprintf \'%s\\0\' "$@" > {shlex.quote(str(record))}\n')
            (stub / name).chmod(0o755)
        proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=cwd, timeout=60,
                              env={**env, "PATH": f"{stub}{os.pathsep}{env['PATH']}"})
        assert proc.returncode == 0 and record.is_file(), f"{script} exited {proc.returncode}: {proc.stderr}"
        argv = record.read_text().split("\0")[:-1]
    assert argv[:2] == ["-m", "runnerkit.infer"], argv
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(cwd)
    return run_cli(capsys, *argv[2:])
