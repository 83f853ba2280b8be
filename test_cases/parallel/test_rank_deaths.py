"""A rank that fails after rank 0 saved, or dies without a word, on the CPU (gloo, 2 ranks, cfg 2).

The ranks are forked as in test_multi_rank.py (torchrun's environment, no launcher: each rank has to
end on its own). What is checked: a request that fails on any rank after rank 0 wrote its files
leaves none of them (media, sidecar, tensor, temporary names included), as one process does; a
rank killed by SIGKILL is named by rank 0 in one fixed line, and the survivor exits 1.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_cases.conftest import REPO
from test_cases.parallel.test_multi_rank import (ERROR_LINE, TIMEOUT_S, _argv, _config, _env, _free_port, _spec, ckpt,
                                                 forkserver, launch_ranks)

__all__ = ["ckpt", "forkserver"]  # fixtures shared with test_multi_rank.py

DIED = ("rank 1 died without reporting during request 0: its process ended without recording a failure (killed by a "
        "signal such as SIGKILL or the OOM killer, or crashed); ending all 2 ranks")


def test_a_rank_failing_after_rank_0_saved_leaves_no_file(ckpt: Path, tmp_path: Path, forkserver: Any) -> None:
    """Rank 1's request cleanup raises once rank 0 has renamed the request's last file into place:
    rank 0 removes the mp4, its sidecar and the tensor file, logs the failure and the removal, and
    both ranks exit 1."""
    out = tmp_path / "out"
    tensor, video, sidecar = out / "fox.safetensors", out / "fox.mp4", out / "fox.json"
    argv = _argv(_config(ckpt, tmp_path, {"cfg": 2}), tensor, warmup=False) + ["--save_result_path", str(video)]
    fail = {"rank": 1, "phase": "end_run", "wait_for": str(sidecar)}
    ranks = launch_ranks(forkserver, 2, _spec(tmp_path, argv, fail))
    assert [r[0] for r in ranks] == [1, 1], [r[1][-2000:] for r in ranks]
    log = ranks[0][1]
    assert sorted(p.name for p in out.iterdir()) == [], log[-3000:]
    assert ERROR_LINE.findall(log) == ["rank 1 failed during request 0 (end_run): RuntimeError: injected failure after "
                                       "rank 0 saved; ending all 2 ranks"], log[-3000:]
    assert f"request 0: removed its files {[str(tensor), str(video), str(sidecar)]} (the request failed on the " \
           "group)" in log, log[-3000:]


def test_a_killed_rank_is_named_by_rank_0(ckpt: Path, tmp_path: Path, forkserver: Any) -> None:
    """Rank 1 SIGKILLs itself before its request's second step, while rank 0 waits in that step's
    CFG all-gather: rank 0 prints one fixed line naming rank 1 and the phase and exits 1 (as for any
    failure, docs/multi_gpu.md); nothing is saved."""
    out = tmp_path / "video.safetensors"
    spec = _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"cfg": 2}), out, warmup=False))
    spec.write_text(spec.read_text()[:-1] + ', "kill": {"rank": 1, "step": 2}}')
    ranks = launch_ranks(forkserver, 2, spec)
    assert [r[0] for r in ranks] == [1, -9], [r[1][-2000:] for r in ranks]
    assert ERROR_LINE.findall(ranks[0][1]) == [DIED], ranks[0][1][-3000:]
    assert not out.exists()


def test_a_killed_rank_is_named_under_torchrun(ckpt: Path, tmp_path: Path) -> None:
    """The same death under torchrun, which sends rank 0 SIGTERM once it reaps rank 1: rank 0 still
    prints the one fixed line (not "interrupted (SIGTERM ...)") and exits 1; torchrun's summary holds
    the signal (rank 1 `exitcode : -9`) and torchrun exits 1."""
    out = tmp_path / "video.safetensors"
    spec = _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"cfg": 2}), out, warmup=False))
    spec.write_text(spec.read_text()[:-1] + ', "kill": {"rank": 1, "step": 2}}')
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "test_cases.parallel._rank_worker", str(spec)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert ERROR_LINE.findall(output) == [DIED], output
    ranks = re.findall(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)", output)
    assert sorted(ranks) == [("0", "1"), ("1", "-9")], output
    assert not out.exists()


def test_a_killed_rank_0_is_named_by_rank_1(ckpt: Path, tmp_path: Path) -> None:
    """Rank 0 SIGKILLs itself before its request's second step, under torchrun (whose agent hosts the
    store, so it outlives rank 0): rank 1, the lowest rank alive, prints the one fixed line naming
    rank 0 and exits 1."""
    out = tmp_path / "video.safetensors"
    spec = _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"cfg": 2}), out, warmup=False))
    spec.write_text(spec.read_text()[:-1] + ', "kill": {"rank": 0, "step": 2}}')
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "test_cases.parallel._rank_worker", str(spec)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    output = run.stdout + run.stderr
    assert ERROR_LINE.findall(output) == [DIED.replace("rank 1 died", "rank 0 died")], output
    assert re.search(r"\| rank 1 \| ERROR\s+\| rank 0 died without reporting", output), output
    ranks = re.findall(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)", output)
    assert sorted(ranks) == [("0", "-9"), ("1", "1")], output
    assert not out.exists()
