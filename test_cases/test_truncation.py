"""Checkpoint files truncated, rewritten or replaced while the launch script serves requests (issue 8, item 4).

Each case runs the launch script through `test_cases._truncation_driver`, which changes a file
after a given denoising step or request. mmap cases run `python -m runnerkit` in a subprocess:
the default mmap reader used to die of SIGBUS (exit -7) there, which must show as a failed
assertion, never take pytest down; the pread case runs `main` in-process (it cannot fault).

What the user gets (docs/offload.md): the request that was streaming when a file changed fails
with one line naming the file and the change; the process goes on; a later request fails the
same way while the file stays changed, and runs, bit-identical to the first request of a fresh
process, once the file has its original bytes again (restored in place or by rename).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file

from runnerkit.infer import main
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import write_synthetic
from test_cases._truncation_driver import install
from test_cases.conftest import REPO, TINY_CONFIG, tiny_config_dict

REQUEST = {"prompt": "a red fox in the snow", "seed": 1, "target_height": 16, "target_width": 16,
           "target_video_length": 1}
STEPS = 2  # per request; the driver counts steps over the whole process (a failed request stops early)


@pytest.fixture(autouse=True)
def _restore_logger() -> Any:
    """An in-process `main` binds loguru to the `sys.stderr` of its call (a capsys buffer); rebind afterwards."""
    yield
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="DEBUG")


def serve(tmp_path: Path, config: dict[str, Any], events: list[dict[str, Any]], requests: int,
          in_process: tuple[pytest.MonkeyPatch, pytest.CaptureFixture[str]] | None = None
          ) -> tuple[subprocess.CompletedProcess[str], list[Path]]:
    """Run `requests` copies of REQUEST in one launch-script process while `events` change files
    (in this process through `main` when `in_process` gives the test's monkeypatch and capsys)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    outs = [tmp_path / f"out{i}.safetensors" for i in range(requests)]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps({**REQUEST, "save_tensor_path": str(o)}) + "\n"
                                                     for o in outs))
    flags = ["--config_json", str(tmp_path / "config.json"), "--requests", str(tmp_path / "requests.jsonl"),
             "--infer_steps", str(STEPS)]
    if in_process is not None:
        monkeypatch, capsys = in_process
        install(events, monkeypatch.setattr)
        capsys.readouterr()
        rc = main(flags)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["main", *flags], rc, out, err), outs
    (tmp_path / "plan.json").write_text(json.dumps(events))
    proc = subprocess.run([sys.executable, "-m", "test_cases._truncation_driver", str(tmp_path / "plan.json"), "--",
                           *flags], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode >= 0, (f"the server died of signal {signal.Signals(-proc.returncode).name} "
                                  f"(events applied: {proc.stdout!r}); stderr tail:\n{proc.stderr[-3000:]}")
    return proc, outs


def failure_line(stderr: str, index: int) -> str:
    lines = [ln for ln in stderr.splitlines() if f"request {index} (line {index + 1} of" in ln and " failed" in ln]
    assert len(lines) == 1, f"request {index}: expected one failure line, got {lines}\n{stderr[-3000:]}"
    return lines[0]


@pytest.mark.parametrize("reader", ["mmap", "pread"])
def test_streamed_file_changes_fail_only_the_affected_requests(tiny_ckpt: Path, tmp_path: Path, reader: str,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Phase streaming from disk (6 units, 2 slots: every step reads the file again), 8 requests:

    | request | the transformer file                                   | outcome                     |
    | 0       | as loaded                                              | runs                        |
    | 1       | truncated to half after its first step                 | fails at its second step    |
    | 2       | still truncated                                        | fails at its first read     |
    | 3       | original bytes written back in place before it         | runs, equal to request 0    |
    | 4       | last 256 bytes rewritten in place (same size) after its first step | fails            |
    | 5       | original bytes renamed over it before it               | runs, equal to request 0    |
    | 6       | a larger file renamed over it after its first step     | fails                       |
    | 7       | original bytes written back in place before it         | runs, equal to request 0    |
    """
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    target = ckpt / "transformer" / "model.safetensors"
    size = target.stat().st_size
    events = [  # steps 1-2: request 0; 3: request 1 (fails); request 2 fails before a step; 4-5: request 3; ...
        {"after": "step", "count": 3, "action": "truncate"},
        {"after": "request", "count": 3, "action": "restore"},
        {"after": "step", "count": 6, "action": "rewrite"},
        {"after": "request", "count": 5, "action": "restore_rename"},
        {"after": "step", "count": 9, "action": "replace"},
        {"after": "request", "count": 7, "action": "restore"},
    ]
    config = tiny_config_dict(ckpt, offload={"mode": "phase", "storage": "disk", "reader": reader})
    proc, outs = serve(tmp_path, config, [{**e, "file": str(target)} for e in events], 8,
                       in_process=(monkeypatch, capsys) if reader == "pread" else None)

    assert proc.stdout.split("\n")[:-1] == [f"EVENT {e['after']} {e['count']} {e['action']}" for e in events]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "4 of 8 requests failed: [1, 2, 4, 6]" in proc.stderr
    assert "Traceback" not in proc.stderr, "a changed file is an input error: one line, no traceback"
    prefix = f"CheckpointChangedError: checkpoint file {target} changed while runnerkit streams from it: "
    expected = {
        1: f"truncated (size {size} -> {size // 2} bytes); before reading",
        2: f"truncated (size {size} -> {size // 2} bytes); is not taken back: its size is {size // 2} bytes",
        4: f"modified in place (same size, {size} bytes; modification time changed); before reading",
        6: f"replaced by another file (size {size} -> {size + 4096} bytes); before reading",
    }
    for index, change in expected.items():
        line = failure_line(proc.stderr, index)
        if "before reading" in change and prefix + change not in line:
            # the read-ahead of the request's next unit may be in flight when the file changes after a step
            # (pread drops each batch's pages before its closing check): then the change is seen after it
            change = change.replace("before reading", "after reading")
        assert prefix + change in line, line
        assert " failed in stage transformer: CheckpointChangedError" in line, line  # the stage that read it
        assert not outs[index].exists(), f"request {index} failed but wrote {outs[index]}"
    first = load_file(str(outs[0]))["video"]
    assert first.shape == (3, 1, 16, 16) and first.std() > 1e-3
    for index in (3, 5, 7):
        assert torch.equal(load_file(str(outs[index]))["video"], first), f"request {index} differs from request 0"


def test_cpu_weights_do_not_alias_checkpoint_files(tmp_path: Path) -> None:
    """Offload mode none on the CPU, original Wan layout (the text encoder and VAE are `.pth` files,
    whose tensors `torch.load(mmap=True)` maps 64-byte aligned): every checkpoint file is truncated
    to 0 bytes after request 0's first step, and both requests still run, with equal outputs.
    (Weights bound to modules while still aliasing the mapping died of SIGBUS here.)"""
    data = json.loads(TINY_CONFIG.read_text())
    ckpt = tmp_path / "ckpt"
    write_synthetic(WanArch.model_validate(data["model"]), ckpt, seed=0, dtype=torch.float32, layout="original")
    files = sorted(p for p in ckpt.rglob("*") if p.suffix in (".pth", ".safetensors"))
    assert {p.suffix for p in files} == {".pth", ".safetensors"}, files
    events = [{"after": "step", "count": 1, "action": "empty", "file": str(p)} for p in files]
    proc, outs = serve(tmp_path, tiny_config_dict(ckpt, model=data["model"]), events, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(p.stat().st_size == 0 for p in files)
    assert torch.equal(load_file(str(outs[1]))["video"], load_file(str(outs[0]))["video"])


def test_launch_script_enables_fault_tracebacks(mocker: Any) -> None:
    """`main` turns on the fault handler (tested to print in test_disk_changes.py) before anything runs."""
    from runnerkit import infer

    spy = mocker.spy(infer, "enable_fault_tracebacks")
    with pytest.raises(SystemExit):
        infer.main(["--help"])
    assert spy.call_count == 1
