"""The launch script's progress bar (`--progress`) and step-time plot (`--plot_steps`), runnerkit/progress.py.

The bar is looked for in what a terminal receives: the launch script and the server run as real
processes whose stderr is a pseudo-terminal (python's `pty`), or a pipe. The plot's data is read
where matplotlib receives it (a spy on `Axes.plot`) and compared with the profile report's steps.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from matplotlib.axes import Axes
from safetensors.torch import load_file

from runnerkit import progress
from runnerkit.progress import progress_enabled, stage_boundaries, steps_run, write_step_plot
from runnerkit.runners.base import Progress
from test_cases._cli import no_gc_freeze, restore_logger, run_cli  # noqa: F401 (autouse fixtures)
from test_cases.conftest import REPO, tiny_config_dict, write_config

STEPS = 4  # the tiny config's (configs/wan/wan_t2v_tiny.json)
REQUESTS = [{"prompt": "a red fox in the snow", "seed": 1},
            {"prompt": "ocean waves", "seed": 2, "target_height": 32, "target_width": 32, "target_video_length": 5}]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BAR_DESC = re.compile(r"request (\d+) (\w+):\s+\d+%\|")  # tqdm's left part: `request 0 transformer:  50%|`


@pytest.fixture(scope="module")
def config_path(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("progress_cfg") / "tiny.json", tiny_config_dict(tiny_ckpt))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "COLUMNS", "LINES")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUNNERKIT_CACHE": str(tmp_path / "cache")}


def _requests_file(tmp_path: Path, tag: str) -> tuple[Path, list[Path]]:
    outs = [tmp_path / f"{tag}{n}.safetensors" for n in range(len(REQUESTS))]
    path = tmp_path / f"{tag}.jsonl"
    path.write_text("".join(json.dumps({**r, "save_tensor_path": str(o)}) + "\n" for r, o in zip(REQUESTS, outs)))
    return path, outs


def _open_pty(rows: int, cols: int) -> tuple[int, int]:
    """(master, slave) of a pseudo-terminal of `rows` x `cols` (0 x 0: one that reports no size)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    return master, slave


def _drain(master: int, until: Any = None, timeout: float = 180) -> str:
    """Read a pty's master until the other side closes (or `until(text)` holds); returns the text."""
    chunks, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every slave end is closed
                break
            if not data:
                break
            chunks.append(data)
            if until is not None and until(b"".join(chunks).decode(errors="replace")):
                break
    return b"".join(chunks).decode(errors="replace")


def _launch_in_pty(argv: Sequence[str], tmp_path: Path, rows: int = 30, cols: int = 100) -> tuple[int, str]:
    """Run the launch script with stdin/stdout/stderr on a pseudo-terminal; (exit status, terminal text)."""
    master, slave = _open_pty(rows, cols)
    proc = subprocess.Popen([sys.executable, "-m", "runnerkit", *argv], cwd=REPO, env=_env(tmp_path),
                            stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        text = _drain(master)
        return proc.wait(timeout=60), text
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _videos(paths: list[Path]) -> list[torch.Tensor]:
    return [load_file(str(p))["video"] for p in paths]


# ---- the bar in a terminal, none in a pipe ------------------------------------------------------
def test_bar_in_a_terminal_and_none_in_a_pipe(config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The terminal run is a process of its own on a pty; the pipe run is `main` here, its stderr
    pytest's capture (not a terminal), under the same environment."""
    tty_reqs, tty_outs = _requests_file(tmp_path, "tty")
    rc, text = _launch_in_pty(["--config_json", str(config_path), "--requests", str(tty_reqs), "--warmup"], tmp_path)
    assert rc == 0, text
    # one bar per request's denoise stage, finished at 4/4 with a rate and an ETA field
    assert sorted(set(BAR_DESC.findall(text))) == [("0", "transformer"), ("1", "transformer")], text
    for index in (0, 1):
        assert re.search(rf"request {index} transformer: 100%\|[^\r\n]*\| {STEPS}/{STEPS} "
                         r"\[\d\d:\d\d<\d\d:\d\d, +[\d.]+(step/s|s/step)\]", text), text
    assert "\r" in text
    # warmup: its step lines and no bar; the requests' step lines are replaced by the bar
    assert len(re.findall(r"warmup \[\d+, \d+, \d+\]: transformer step 1/4", text)) == 2, text
    assert not re.search(r"\| (?!warmup)[^|\n]*transformer step \d/4", text), text

    pipe_reqs, pipe_outs = _requests_file(tmp_path, "pipe")
    env = _env(tmp_path)
    for key in {*os.environ, *env}:
        if key not in env:
            monkeypatch.delenv(key)
        elif os.environ.get(key) != env[key]:
            monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(REPO)
    rc, err = run_cli(capsys, "--config_json", config_path, "--requests", pipe_reqs, "--warmup")
    assert rc == 0, err
    assert "\r" not in err and "step/s" not in err and "s/step" not in err
    assert BAR_DESC.findall(err) == [] and "█" not in err
    assert len(re.findall(r"\| transformer step \d/4", err)) == 2 * STEPS, err
    # the bar touches neither RNG nor compute
    for with_bar, without in zip(_videos(tty_outs), _videos(pipe_outs)):
        assert torch.equal(with_bar, without)


def test_bar_on_a_terminal_of_no_size(config_path: Path, tmp_path: Path) -> None:
    """A pty that reports 0 x 0 (as `script` without a terminal gives): tqdm alone would draw nothing."""
    rc, text = _launch_in_pty(["--config_json", str(config_path), "--prompt", "a cat"], tmp_path, 0, 0)
    assert rc == 0, text
    assert re.search(rf"request 0 transformer: 100%\|[^\r\n]*\| {STEPS}/{STEPS} \[", text), text


def test_progress_on_forces_the_bar_off_a_terminal(config_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    rc, err = run_cli(capsys, "--config_json", config_path, "--prompt", "a cat", "--progress", "on")
    assert rc == 0, err
    descs = BAR_DESC.findall(err)
    assert descs and set(descs) == {("0", "transformer")}, err
    assert f"| {STEPS}/{STEPS} [" in err
    rc, err = run_cli(capsys, "--config_json", config_path, "--prompt", "a cat", "--progress", "off")
    assert rc == 0, err
    assert BAR_DESC.findall(err) == [] and "\r" not in err


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("rank, mode, tty, shown", [
    (None, "auto", True, True), (None, "auto", False, False), (None, "on", False, True), (None, "off", True, False),
    ("0", "auto", True, True), ("1", "auto", True, False), ("3", "on", True, False)])
def test_progress_enabled(monkeypatch: pytest.MonkeyPatch, rank: str | None, mode: Any, tty: bool,
                          shown: bool) -> None:
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert progress_enabled(mode, _Stream(tty)) is shown  # type: ignore[arg-type]


def test_unknown_progress_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, "--progress", "always", "--prompt", "x")
    assert exc.value.code == 2
    assert "argument --progress: invalid choice: 'always'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"`--progress` 'yes': allowed \['auto', 'on', 'off'\]"):
        progress_enabled("yes", _Stream(True))  # type: ignore[arg-type]


def test_bars_follow_stages_and_requests() -> None:
    """One bar per (request, denoise stage): opened at the stage's start, closed by any other stage."""
    import io

    stream = io.StringIO()
    bars = progress.StageBars(stream)
    events = [Progress(0, "text_encoder"), Progress(0, "stage1", 0, 3), Progress(0, "stage1", 1, 3),
              Progress(0, "stage1", 3, 3), Progress(0, "upsampler", 0, 0, 3, 5), Progress(0, "stage2", 0, 2),
              Progress(0, "stage2", 1, 1), Progress(0, "vae_decoder", 0, 0, 4, 4)]
    live = []
    for p in events:
        bars(p)
        live.append(bars.live)
    assert live == [False, True, True, True, False, True, True, False]
    text = stream.getvalue()
    assert "request 0 stage1: 100%" in text and "| 3/3 [" in text
    assert "request 0 stage2: 100%" in text and "| 1/1 [" in text  # strength < 1: fewer steps than scheduled
    # a request that stopped mid-stage: the next request's stage gets a bar of its own
    stream.seek(0)
    stream.truncate()
    for p in (Progress(1, "stage1", 0, 3), Progress(1, "stage1", 2, 3), Progress(2, "stage1", 0, 3),
              Progress(2, "stage1", 1, 3)):
        bars(p)
    bars.close()
    assert sorted(set(BAR_DESC.findall(stream.getvalue()))) == [("1", "stage1"), ("2", "stage1")]
    assert "request 1 stage1:  67%" in stream.getvalue() and "request 2 stage1:  33%" in stream.getvalue()


# ---- the server draws none ------------------------------------------------------------------------
def test_server_shows_no_bar(config_path: Path, tmp_path: Path) -> None:
    from test_cases.serve.test_server import http

    master, slave = _open_pty(30, 100)
    proc = subprocess.Popen([sys.executable, "-m", "runnerkit", "serve", "--config_json", str(config_path), "--port",
                             "0", "--output_dir", str(tmp_path / "out"), "--drain_grace", "0"],
                            cwd=REPO, env=_env(tmp_path), stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        text = _drain(master, until=lambda t: "listening on http" in t, timeout=90)
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
        assert url, text
        end = time.monotonic() + 90
        while http("GET", url.group(1) + "/health/ready").status != 200 and time.monotonic() < end:
            text += _drain(master, timeout=0.2)
        job = http("POST", url.group(1) + "/v1/videos", {"prompt": "a cat", "seed": 1}).json()["id"]
        end = time.monotonic() + 120
        while (reply := http("GET", f"{url.group(1)}/v1/videos/{job}").json())["status"] in ("queued", "in_progress") \
                and time.monotonic() < end:
            text += _drain(master, timeout=0.2)
        proc.terminate()
        text += _drain(master, timeout=30)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert reply["status"] == "completed", reply
    assert f"job {job} completed" in text, text
    assert BAR_DESC.findall(text) == [] and "step/s" not in text and "s/step" not in text, text
    assert len(re.findall(r"\| transformer step \d/4", text)) == STEPS, text


# ---- the plot -------------------------------------------------------------------------------------
def test_plot_is_a_png_of_the_profiles_steps(config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             mocker: Any) -> None:
    reqs, _ = _requests_file(tmp_path, "plot")
    png, profile = tmp_path / "plots" / "steps.png", tmp_path / "profile.json"
    plot = mocker.spy(Axes, "plot")
    rc, err = run_cli(capsys, "--config_json", config_path, "--requests", reqs, "--warmup", "--profile_json", profile,
                      "--plot_steps", png, "--progress", "off")
    assert rc == 0, err
    assert f"step plot of 2 request(s) written to {png}" in err
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    requests = json.loads(profile.read_text())["requests"]
    assert [len(r["step_seconds"]) for r in requests] == [STEPS, STEPS]
    # one line per request (warmup's steps are not among them), x 1..4, y the profile's seconds exactly
    assert len(plot.call_args_list) == 2
    for call, req in zip(plot.call_args_list, requests):
        _, x, y = call.args
        assert list(x) == list(range(1, STEPS + 1))
        assert list(y) == req["step_seconds"]
        assert call.kwargs["label"] == f"request {req['index']} ({'x'.join(map(str, req['shape']))})"
    assert sorted(p.name for p in png.parent.iterdir()) == ["steps.png"]  # no partial file left


def test_plot_marks_stage_boundaries(tmp_path: Path, mocker: Any) -> None:
    report = {"device": "cpu", "requests": [
        {"index": 0, "shape": [64, 64, 9], "ok": True, "step_seconds": [0.5, 0.25, 0.125, 1.0, 2.0]},
        {"index": 1, "shape": [64, 64, 9], "ok": False, "step_seconds": [0.75]},
        {"index": 2, "shape": [64, 64, 9], "ok": False, "step_seconds": []}]}
    plot, vline = mocker.spy(Axes, "plot"), mocker.spy(Axes, "axvline")
    assert write_step_plot(tmp_path / "p.png", report, [("stage1", 3), ("stage2", 2)]) == 2
    assert [(list(c.args[1]), list(c.args[2]), c.kwargs["label"]) for c in plot.call_args_list] == [
        ([1, 2, 3, 4, 5], [0.5, 0.25, 0.125, 1.0, 2.0], "request 0 (64x64x9)"),
        ([1], [0.75], "request 1 (64x64x9) failed")]
    assert [c.args[1] for c in vline.call_args_list] == [3.5]
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_SIGNATURE


def test_stage_boundaries_and_steps_run() -> None:
    from types import SimpleNamespace

    assert stage_boundaries([("transformer", 50)]) == []
    assert stage_boundaries([("stage1", 8), ("stage2", 3), ("stage3", 2)]) == [(8, "stage2"), (11, "stage3")]
    stages = [SimpleNamespace(name="stage1", steps=8, strength=1.0), SimpleNamespace(name="stage2", steps=10,
                                                                                     strength=0.3)]
    assert steps_run(stages) == [("stage1", 8), ("stage2", 3)]


@pytest.mark.parametrize("flag, blocked, message", [
    ("steps.png", True, '`--plot_steps` needs the `plot` extra (pip install -e ".[plot]"); missing: matplotlib'),
    ("steps.jpg", False, "`--plot_steps` {path!r}: the plot is a PNG; give a path ending in .png")])
def test_plot_flag_refused_before_loading(config_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch, mocker: Any, flag: str, blocked: bool,
                                          message: str) -> None:
    from runnerkit.runners.default import DefaultRunner

    if blocked:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    load = mocker.spy(DefaultRunner, "load_modules")
    path = tmp_path / flag
    rc, err = run_cli(capsys, "--config_json", config_path, "--prompt", "a cat", "--plot_steps", path)
    assert rc == 2, err
    assert f"invalid input: {message.format(path=str(path))}" in err
    assert load.call_count == 0 and not path.exists()


# ---- no synchronization ---------------------------------------------------------------------------
def test_progress_module_holds_no_tensor() -> None:
    """The bar cannot synchronize a device, draw random numbers or compute: it never imports torch."""
    tree = ast.parse(Path(progress.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "torch" not in imported and "numpy" not in imported, sorted(imported)
    assert "synchronize" not in Path(progress.__file__).read_text()
