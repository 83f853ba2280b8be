"""SIGTERM and Ctrl-C (SIGINT) at every phase of a run: exit status, the report line, the files left.

Each case runs the launch script in a process of its own through `_signal_driver.py`, which makes
the process signal itself at one phase (start-up imports, load, warmup, the denoising loop, the VAE
decode, the tensor write, the media write, the synthetic-checkpoint write). A signal sent from
inside a C/Rust call (the safetensors writer, ffmpeg's pipe) is handled when that call returns:
the driver sends it right after the real call, exactly where Python then handles it. The
`imports` cases start a fresh interpreter; the others run in children forked from one driver
process that imported the launch script once (each child still a process of its own, with the
default signal dispositions until `main` installs its handlers: see the driver's docstring).

Expected everywhere: exit 143 (SIGTERM) / 130 (Ctrl-C), one "interrupted" line and no traceback,
request 0's files complete, nothing of the interrupted request, no `.partial-*` file or folder. The
write phases run twice: `*_inline` with `--max_writes_in_flight 0` (the files written inside the
request: the interrupted write leaves nothing of request 1), and with the default writer thread (the
signal lands in the main thread while request 1's files are written beside it: they are completed,
so both requests finish; a second interrupt, which abandons them, is test_writer.py's).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
import pytest
from safetensors.torch import load_file

from test_cases.conftest import REPO, built_once_per_run, tiny_config_dict, write_config

DRIVER = Path(__file__).with_name("_signal_driver.py")
STATUS = {"SIGTERM": 143, "SIGINT": 130}
REPORTED = {"SIGTERM": "SIGTERM", "SIGINT": "Ctrl-C"}


CONFIG_OVERRIDES = {"infer_steps": 2}
RUN_ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # runs go in parallel: no thread fights


def _argv(phase: str, config: Path, folder: Path) -> list[str]:
    if phase == "synthetic_write":
        return ["--config", str(REPO / "configs/wan/wan_t2v_tiny.json"), "--out", str(folder / "ckpt"), "--dtype", "fp32"]
    reqs = _requests(folder)
    argv = ["--config_json", str(config), "--requests", str(reqs), "--profile_json", str(folder / "profile.json")]
    return argv + (["--warmup"] if phase == "warmup" else []) + (["--max_writes_in_flight", "0"]
                                                                  if phase.endswith("_inline") else [])


# (phase, signal) cases; SIGINT and SIGTERM share one path (`Terminated` is a KeyboardInterrupt),
# so Ctrl-C is checked at a few phases and SIGTERM at all of them.
CASES = [(phase, "SIGTERM") for phase in ("imports", "load", "warmup", "denoise", "decode", "tensor_write",
                                          "media_write", "tensor_write_inline", "media_write_inline",
                                          "synthetic_write")]
CASES += [(phase, "SIGINT") for phase in ("imports", "denoise", "tensor_write", "tensor_write_inline",
                                          "synthetic_write")]


@pytest.fixture(scope="module")
def runs(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Any]]:
    """Every case: (phase, signal) -> (its folder, CompletedProcess-like). The `imports` cases run as
    fresh subprocesses (torch not imported yet); the others in children of one driver process that
    imported the launch script once (`_signal_driver.py --cases`), three at a time, beside them.
    Run once per pytest run (`built_once_per_run`): both xdist workers read the same cases."""
    root = built_once_per_run(tmp_path_factory, "signals", lambda folder: _run_cases(tiny_ckpt, folder))
    statuses = json.loads((root / "statuses.json").read_text())
    return {(phase, sig): (root / f"{phase}-{sig}", subprocess.CompletedProcess(
        [str(DRIVER), phase, sig], statuses[f"{phase} {sig}"], "", (root / f"{phase}-{sig}.stderr").read_text()))
        for phase, sig in CASES}


def _run_cases(tiny_ckpt: Path, root: Path) -> None:
    """Runs every case in `root`: case folders `root/<phase>-<sig>`, each case's stderr in
    `root/<phase>-<sig>.stderr`, the exit statuses in `root/statuses.json` ("<phase> <sig>": status)."""
    config = write_config(root / "config.json", tiny_config_dict(tiny_ckpt, **CONFIG_OVERRIDES))
    folders = {case: root / f"{case[0]}-{case[1]}" for case in CASES}
    for folder in folders.values():
        folder.mkdir()
    fresh = {case: subprocess.Popen([sys.executable, str(DRIVER), *case, *_argv(case[0], config, folders[case])],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=folders[case],
                                    env=RUN_ENV)
             for case in CASES if case[0] == "imports"}
    forked = [case for case in CASES if case[0] != "imports"]
    spec = {"parallel": 3, "results": str(root / "forked.json"),
            "cases": [{"phase": phase, "sig": sig, "argv": _argv(phase, config, folders[phase, sig]),
                       "cwd": str(folders[phase, sig]), "stderr": str(root / f"{phase}-{sig}.stderr")}
                      for phase, sig in forked]}
    (root / "cases.json").write_text(json.dumps(spec))
    driver = subprocess.run([sys.executable, str(DRIVER), "--cases", str(root / "cases.json")], capture_output=True,
                            text=True, cwd=root, env=RUN_ENV, timeout=600)
    assert driver.returncode == 0, driver.stderr
    statuses = json.loads((root / "forked.json").read_text())
    for (phase, sig), proc in fresh.items():
        _, err = proc.communicate(timeout=300)
        (root / f"{phase}-{sig}.stderr").write_text(err)
        statuses[f"{phase} {sig}"] = proc.returncode
    (root / "statuses.json").write_text(json.dumps(statuses))


def _partials(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if "partial" in p.name]


def _requests(folder: Path) -> Path:
    """Two requests, each writing an mp4 (+ sidecar) and a tensor file."""
    lines = [{"prompt": f"p{i}", "seed": i, "save_result_path": str(folder / f"r{i}.mp4"),
              "save_tensor_path": str(folder / f"r{i}.safetensors")} for i in range(2)]
    path = folder / "reqs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# phase -> requests finished when the run ends (the driver fires in request 1 where a request runs)
PHASES = {"imports": 0, "load": 0, "warmup": 0, "denoise": 1, "decode": 1, "tensor_write_inline": 1,
          "media_write_inline": 1, "tensor_write": 2, "media_write": 2}
FILES = {n: [f"r{i}.{ext}" for i in range(n) for ext in ("json", "mp4", "safetensors")] for n in (0, 1, 2)}


@pytest.mark.parametrize(("phase", "sig"), [c for c in CASES if c[0] != "synthetic_write"])
def test_signal_at_phase(runs: dict[tuple[str, str], tuple[Path, Any]], phase: str, sig: str) -> None:
    finished = PHASES[phase]
    folder, proc = runs[phase, sig]
    err = proc.stderr
    assert proc.returncode == STATUS[sig], err
    assert "Traceback" not in err and f"driver: fired {sig} at {phase}" in err, err
    if phase == "imports":
        assert "interrupted before any request ran" in err, err
    elif finished == 2:  # the signal hit the main thread after request 1's hand-off: in its end_run, its last
        # bookkeeping (no phase), or the wait for its files
        assert re.search(rf"interrupted \({REPORTED[sig]}( during request 1( \((end_run|write)\))?)?\); 2 of 2 "
                         "requests finished", err), err
        assert "interrupted: completing the files of request(s) [1]" in err or "saved " + str(folder / "r1") in err, err
    else:
        during = {"load": "load", "warmup": "warmup"}.get(phase, "request 1")  # the phase the signal hit
        assert f"interrupted ({REPORTED[sig]} during {during}); {finished} of 2 requests finished" in err, err
    written = sorted(p.name for p in folder.iterdir() if p.name not in ("reqs.jsonl", "profile.json"))
    assert written == FILES[finished], err
    assert not _partials(folder)
    for i in range(finished):  # the finished requests' files are complete
        assert load_file(folder / f"r{i}.safetensors")["video"].shape == (3, 9, 48, 80)
        assert json.loads((folder / f"r{i}.json").read_text())["seed"] == i
        assert (folder / f"r{i}.mp4").read_bytes()[4:8] == b"ftyp"
    profile = folder / "profile.json"
    if phase in ("imports", "load"):
        assert not profile.exists()  # nothing was loaded: no profile to report
    else:  # the profile reports what ran, also when interrupted
        report = json.loads(profile.read_text())
        assert [r["saved"] for r in report["requests"]] == {0: [], 1: [True, False], 2: [True, True]}[finished]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_during_synthetic_checkpoint_write(runs: dict[tuple[str, str], tuple[Path, Any]], sig: str) -> None:
    """The signal arrives while the first shard is written: the tool exits 143/130 and leaves nothing."""
    folder, proc = runs["synthetic_write", sig]
    assert proc.returncode == STATUS[sig], proc.stderr
    assert f"driver: fired {sig} at synthetic_write" in proc.stderr and "Traceback" not in proc.stderr
    assert "interrupted; no checkpoint was written" in proc.stderr
    assert list(folder.iterdir()) == []
