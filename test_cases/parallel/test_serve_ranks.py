"""`runnerkit serve` under torchrun on the CPU (gloo, 2 processes, cfg 2): rank 0 serves HTTP and leads,
rank 1 follows (runnerkit/parallel/serving.py).

The ranks are forked from the forkserver of test_multi_rank.py with torchrun's environment
(`start_ranks`), so each rank must end on its own; the tiny Wan t2v config runs 2 steps at 32x32x5 and
32x64x5 (the two warmup shapes). Collectives time out after 20 s and every rank must end within
`TIMEOUT_S`, so a broken test fails instead of hanging. CFG parallel is bit-identical to one process
(test_multi_rank.py), so the served videos are compared bit for bit with one runner that serves the
same two requests in the same order.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.registry import get_runner_cls
from test_cases.conftest import TINY_CONFIG, config_dict
from test_cases.parallel.test_multi_rank import (ERROR_LINE, STEPS, WARMUP_SHAPES, _config, forkserver,  # noqa: F401
                                                 join_ranks, start_ranks)
from test_cases.serve.test_server import http

TIMEOUT_S = 60
JOBS = [{"prompt": "a red fox in the snow", "seed": 7, "target_height": 32, "target_width": 32,
         "target_video_length": 5},
        {"prompt": "ocean waves at dusk", "seed": 3, "target_height": 32, "target_width": 64, "target_video_length": 5}]


@pytest.fixture
def ckpt(tiny_ckpt: Path) -> Path:
    return tiny_ckpt


def _serve_spec(tmp: Path, ckpt: Path, *flags: str, fail: dict[str, Any] | None = None,
                slow_warmup: dict[str, Any] | None = None, slow_step: dict[str, Any] | None = None) -> Path:
    config = _config(ckpt, tmp, {"cfg": 2})
    argv = ["serve", "--config_json", str(config), "--port", "0", "--output_dir", str(tmp / "out"), "--warmup",
            "--save_tensors", *flags]
    (tmp / "spy").mkdir(exist_ok=True)
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"argv": argv, "spy_dir": str(tmp / "spy"), "fail": fail,
                                "warmup_shapes": WARMUP_SHAPES, "slow_warmup": slow_warmup,
                                "slow_step": slow_step}))
    return spec


def _wait_url(log: Path, alive: Any) -> str:
    """The URL rank 0 announced in `log`; fails when `alive()` turns False first."""
    end = time.monotonic() + TIMEOUT_S
    while time.monotonic() < end:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text() if log.exists() else "")
        if m:
            return m.group(1)
        assert alive(), log.read_text()[-3000:]
        time.sleep(0.02)
    raise AssertionError(f"no port in {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _wait_job(url: str, job_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled")) -> dict[str, Any]:
    end = time.monotonic() + TIMEOUT_S
    while time.monotonic() < end:
        job = http("GET", f"{url}/v1/videos/{job_id}").json()
        if job["status"] in until:
            return job
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} not {until} in {TIMEOUT_S} s")


def _wait_ready(url: str) -> None:
    end = time.monotonic() + TIMEOUT_S
    while http("GET", f"{url}/health/ready").status != 200:
        assert time.monotonic() < end, f"not ready in {TIMEOUT_S} s"
        time.sleep(0.02)


def _one_process_videos(ckpt: Path, tmp: Path) -> list[torch.Tensor]:
    """One runner (one thread, as each rank) serving JOBS in order: what a single-process server answers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = config_dict(TINY_CONFIG, ckpt, infer_steps=STEPS)
        runner = get_runner_cls(data["model_cls"], data["task"])(load_runner_config(None, data))
        runner.init_modules()
        for i, job in enumerate(JOBS):
            runner.run_pipeline(RequestConfig(**job, save_tensor_path=str(tmp / f"ref{i}.safetensors")), i)
    finally:
        torch.set_num_threads(threads)
    return [load_file(str(tmp / f"ref{i}.safetensors"))["video"] for i in range(len(JOBS))]


def test_ready_after_every_rank_is_warm_jobs_match_one_process_and_sigterm_ends_every_rank(
        ckpt: Path, tmp_path: Path, forkserver: Any) -> None:  # noqa: F811
    """Rank 1's warmup ends 1.5 s after its last collective (a window the 20 ms poll
    sees even on a loaded 2-core machine, where 0.5 s was once missed): `/health/ready` answers 503
    (`waiting_for_ranks` once rank 0 is warm) until rank 1 is warm too, and never 200 before. Two jobs
    give one process's videos bit for bit; a running job refuses DELETE (409). SIGTERM to rank 0 ends
    both ranks with 0."""
    spec = _serve_spec(tmp_path, ckpt, "--drain_grace", "0", slow_warmup={"rank": 1, "seconds": 1.5},
                       slow_step={"rank": 1, "seconds": 0.15})
    procs, logs = start_ranks(forkserver, 2, spec)
    try:
        url = _wait_url(logs[0], lambda: all(p.exitcode is None for p in procs))
        warm1, phases = tmp_path / "spy" / "warm1", []
        end = time.monotonic() + TIMEOUT_S
        while time.monotonic() < end:
            reply = http("GET", f"{url}/health/ready")
            rank1_warm = warm1.exists()  # after the reply: a 200 needs rank 1 warm before it was sent
            phases.append(reply.json()["phase"])
            if reply.status == 200:
                assert rank1_warm, "ready before rank 1 was warm"
                break
            time.sleep(0.02)
        assert phases[-1] == "ready", phases[-5:]
        assert "waiting_for_ranks" in phases, sorted(set(phases))  # rank 0 was warm, rank 1 not yet
        ids = [http("POST", f"{url}/v1/videos", body).json()["id"] for body in JOBS]
        _wait_job(url, ids[0], until=("in_progress",))  # its steps take 0.15 s more on rank 1
        refused = http("DELETE", f"{url}/v1/videos/{ids[0]}")
        assert refused.status == 409, refused.body
        assert "cannot be cancelled under `parallel`" in refused.json()["error"]["message"]
        jobs = [_wait_job(url, i) for i in ids]
        assert [j["status"] for j in jobs] == ["completed", "completed"], jobs
        refs = _one_process_videos(ckpt, tmp_path)
        for job_id, ref in zip(ids, refs):
            assert torch.equal(load_file(str(tmp_path / "out" / job_id / "result.safetensors"))["video"], ref)
        os.kill(procs[0].pid, signal.SIGTERM)
        ranks = join_ranks(procs, logs, TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
    assert [r[0] for r in ranks] == [0, 0], [r[1][-2000:] for r in ranks]
    assert "all 2 ranks stopped" in ranks[0][1]
    assert "ERROR" not in ranks[1][1], ranks[1][1][-2000:]


def test_a_rank_failing_in_a_job_fails_the_job_and_ends_every_rank(ckpt: Path, tmp_path: Path,
                                                                   forkserver: Any) -> None:  # noqa: F811
    """Rank 1 raises in the job's first denoising step: the job fails on rank 0 naming rank 1 and the
    phase, readiness turns 503 `failed` with the same line, no file of the job is kept, and both ranks
    exit 1 within the bound (after --drain_grace 1 s)."""
    spec = _serve_spec(tmp_path, ckpt, "--drain_grace", "1", fail={"rank": 1, "phase": "request", "step": 1})
    procs, logs = start_ranks(forkserver, 2, spec)
    line = "rank 1 failed during request 0: RuntimeError: injected request failure"
    try:
        url = _wait_url(logs[0], lambda: all(p.exitcode is None for p in procs))
        _wait_ready(url)
        job_id = http("POST", f"{url}/v1/videos", JOBS[0]).json()["id"]
        job = _wait_job(url, job_id)
        ready = http("GET", f"{url}/health/ready")
        ranks = join_ranks(procs, logs, TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
    assert job["status"] == "failed" and job["error"]["message"] == f"RankFailed: {line}", job
    assert ready.status == 503 and ready.json()["phase"] == "failed" and ready.json()["error"] == line, ready.body
    assert [r[0] for r in ranks] == [1, 1], [r[1][-2000:] for r in ranks]
    assert ERROR_LINE.findall(ranks[0][1]) == [f"{line}; ending all 2 ranks",
                                              f"job {job_id} failed: RankFailed: {line}",
                                              f"runner died: the parallel group ended: {line}; not ready any more"]
    assert ERROR_LINE.findall(ranks[1][1]) == [], ranks[1][1][-2000:]
    assert not (tmp_path / "out" / job_id).exists()


@pytest.mark.parametrize(("fail", "line"), [
    ({"rank": 1, "phase": "warmup", "step": 2}, "rank 1 failed during warmup: RuntimeError: injected warmup failure"),
    ({"rank": 0, "phase": "load"}, "rank 0 failed during load: RuntimeError: injected load failure"),
], ids=["rank1-warmup", "rank0-load"])
def test_a_rank_failing_at_start_up_never_turns_ready_and_ends_every_rank(ckpt: Path, tmp_path: Path,
                                                                          forkserver: Any,  # noqa: F811
                                                                          fail: dict[str, Any], line: str) -> None:
    """Rank 1 raises in warmup's second step (after a collective ran), or rank 0 (the server) at load:
    `/health/ready` never answers 200; it answers 503 `failed` with the line naming the rank and the
    phase, then both ranks exit 1."""
    spec = _serve_spec(tmp_path, ckpt, "--drain_grace", "1", fail=fail)
    procs, logs = start_ranks(forkserver, 2, spec)
    replies = []
    try:
        url = _wait_url(logs[0], lambda: all(p.exitcode is None for p in procs))
        end = time.monotonic() + TIMEOUT_S
        while procs[0].exitcode is None and time.monotonic() < end:
            try:
                reply = http("GET", f"{url}/health/ready", timeout=5)
            except OSError:  # the port closed: rank 0 is exiting
                break
            replies.append((reply.status, reply.json()["phase"], reply.json().get("error")))
            time.sleep(0.02)
        ranks = join_ranks(procs, logs, TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
    assert [r[0] for r in ranks] == [1, 1], [r[1][-2000:] for r in ranks]
    assert all(status == 503 for status, _, _ in replies), set(replies)
    assert (503, "failed", line) in replies, set(replies)
    assert ERROR_LINE.findall(ranks[0][1]) == [f"{line}; ending all 2 ranks"], ranks[0][1][-3000:]


def test_sigterm_to_every_rank_finishes_the_running_job_then_ends_every_rank(ckpt: Path, tmp_path: Path,
                                                                          forkserver: Any) -> None:  # noqa: F811
    """What torchrun does with its SIGTERM: forward it to every rank. During a running job: the follower
    keeps following, rank 0 finishes the job (--on_shutdown finish), cancels the queued one, tells the
    follower to stop; both exit 0 and the finished job's video is kept."""
    spec = _serve_spec(tmp_path, ckpt, "--drain_grace", "0", slow_step={"rank": 1, "seconds": 0.15})
    procs, logs = start_ranks(forkserver, 2, spec)
    try:
        url = _wait_url(logs[0], lambda: all(p.exitcode is None for p in procs))
        _wait_ready(url)
        ids = [http("POST", f"{url}/v1/videos", body).json()["id"] for body in JOBS]
        _wait_job(url, ids[0], until=("in_progress",))
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        ranks = join_ranks(procs, logs, TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
    assert [r[0] for r in ranks] == [0, 0], [r[1][-2000:] for r in ranks]
    assert f"job {ids[0]} completed" in ranks[0][1] and f"job {ids[1]} cancelled (shutdown)" in ranks[0][1]
    assert "all 2 ranks stopped" in ranks[0][1]
    assert (tmp_path / "out" / ids[0] / "result.safetensors").exists()
    assert "ERROR" not in ranks[1][1], ranks[1][1][-2000:]


@pytest.mark.parametrize(("rank", "flags", "expected"), [
    ("0", ["--on_shutdown", "cancel"], "--on_shutdown cancel with `parallel`: a running job cannot be cancelled"),
    ("1", [], "`parallel` is set but the environment lacks ['WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT']"),
])
def test_serve_refuses_a_parallel_start_it_cannot_serve(ckpt: Path, tmp_path: Path, capsys: Any,
                                                        monkeypatch: pytest.MonkeyPatch, rank: str, flags: list[str],
                                                        expected: str) -> None:
    """Exit 2 with one line, before any port or process group: `--on_shutdown cancel` under `parallel`
    (rank 0), and a follower (RANK 1) started without the rest of torchrun's environment."""
    from runnerkit.serve.server import main

    for key in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", rank)
    config = _config(ckpt, tmp_path, {"cfg": 2})
    status = main(["--config_json", str(config), "--port", "0", "--output_dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert status == 2, err
    assert expected in err, err
    assert "listening on" not in err


def test_followers_exit_when_rank_0_is_killed(ckpt: Path, tmp_path: Path, forkserver: Any) -> None:  # noqa: F811
    """SIGKILL of rank 0 while the group idles (no stop message, no failure record): the follower finds
    the rendezvous store gone at its next poll and exits 1 with one line, instead of waiting forever."""
    spec = _serve_spec(tmp_path, ckpt, "--drain_grace", "0")
    procs, logs = start_ranks(forkserver, 2, spec)
    try:
        _wait_ready(_wait_url(logs[0], lambda: all(p.exitcode is None for p in procs)))
        os.kill(procs[0].pid, signal.SIGKILL)
        ranks = join_ranks(procs, logs, TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
    assert [r[0] for r in ranks] == [-signal.SIGKILL, 1], ranks[1][1][-2000:]
    errors = ERROR_LINE.findall(ranks[1][1])
    assert len(errors) == 1, errors
    assert errors[0].startswith("rank 1: rank 0 is gone (the rendezvous store does not answer"), errors


def test_a_follower_keeps_no_job_profile_between_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower serves jobs for the process lifetime: each job's profile is dropped after the job (rank 0
    keeps the job's), so what it holds does not grow with the jobs served. `follow` in this process, over a
    fake group whose store holds 5 request messages and a stop."""
    import signal as signal_mod
    from types import SimpleNamespace

    import runnerkit.registry
    from runnerkit.parallel import serving

    messages = {serving.MESSAGE_KEY.format(seq=i): json.dumps({"op": "request", "index": i,
                                                               "request": {"prompt": f"job {i}", "seed": i}})
                for i in range(5)}
    messages[serving.MESSAGE_KEY.format(seq=5)] = json.dumps({"op": "stop"})
    store = SimpleNamespace(check=lambda keys: all(k in messages for k in keys), get=lambda key: messages[key],
                            add=lambda key, n: messages.setdefault(key, n))
    group = SimpleNamespace(rank=1, world_size=2, _store=lambda: store, agree=lambda ok, phase: True,
                            close=lambda: None, failures=lambda wait_s=0.0: {})
    held: list[int] = []  # profiles the runner holds as each job starts

    class Runner:
        def __init__(self, config: Any) -> None:
            self.profiler = SimpleNamespace(requests=[])

        def attach_parallel(self, group: Any) -> None:
            pass

        def init_modules(self) -> None:
            pass

        def run_pipeline(self, request: RequestConfig, index: int) -> None:
            held.append(len(self.profiler.requests))
            self.profiler.requests.append(SimpleNamespace(index=index, seconds=1.0, steps=[0.5] * 1000))

    monkeypatch.setattr(serving, "init_from_env", lambda parallel, device: group)
    monkeypatch.setattr(serving, "start_watcher", lambda group, stop: None)
    monkeypatch.setattr(signal_mod, "signal", lambda sig, handler: None)
    monkeypatch.setattr(runnerkit.registry, "get_runner_cls", lambda model_cls, task: Runner)
    config = SimpleNamespace(parallel=object(), device="cpu", model_cls="wan2.1", task="t2v")
    assert serving.follow(config, "WARNING") == 0
    assert held == [0, 0, 0, 0, 0]
    assert messages[serving.STOPPED_KEY] == 1


def test_a_wrong_world_size_is_reported_once_by_rank_0_of_the_server(ckpt: Path, tmp_path: Path) -> None:
    """`runnerkit serve` under torchrun with ulysses 4 on 2 processes: rank 0 alone logs the refusal,
    every rank exits 2 (as the launch script does: test_multi_rank.py), no HTTP server starts."""
    import subprocess
    import sys

    from test_cases.parallel.test_multi_rank import REPO, _env, _free_port

    config = _config(ckpt, tmp_path, {"ulysses": 4})
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "runnerkit.infer", "serve", "--config_json", str(config),
                          "--port", "0", "--output_dir", str(tmp_path / "out")], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    output = run.stdout + run.stderr
    assert ERROR_LINE.findall(output) == ["invalid input: `parallel` = cfg 1 x ulysses 4 needs 4 processes, but "
                                          "WORLD_SIZE is 2: use `torchrun --nproc_per_node 4` or change "
                                          "`parallel`"], output
    ranks = re.findall(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)", output)
    assert sorted(ranks) == [("0", "2"), ("1", "2")], output
    assert "Uvicorn running" not in output
