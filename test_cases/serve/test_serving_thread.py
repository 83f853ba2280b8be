"""Warmup runs on the thread that serves jobs (issue 22, item 2).

PyTorch keeps CUDA library state (cuBLAS handles and workspaces) per thread: a runner warmed on
one thread and serving on another pays that state's creation in its first request. The server
therefore runs `init_modules` (load and warmup) on its job worker thread, before it takes jobs,
and a runner warns once when a request comes from a thread other than the one that initialised it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from loguru import logger

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.registry import get_runner_cls
from test_cases.conftest import tiny_config_dict, write_config
from test_cases.serve.test_server import Server

WARNING_TEXT = "per-thread CUDA library state"
SMALL = {"infer_steps": 2, "target_height": 32, "target_width": 32, "target_video_length": 5}
"""The tiny Wan config at its smallest: only which thread runs what matters here."""


def test_server_warms_up_and_serves_jobs_on_one_thread(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A spy (test_cases/serve/_thread_spy_driver.py) records the thread of `init_modules`, `warmup`
    and every `run_pipeline` in the real server: one thread, the job worker, not the HTTP one."""
    spy = tmp_path / "threads.txt"
    cfg = write_config(tmp_path / "tiny.json", tiny_config_dict(tiny_ckpt, **SMALL))
    server = Server(cfg, tmp_path / "out", tmp_path / "cache", "--warmup", module="test_cases.serve._thread_spy_driver",
                    extra_env={"THREAD_SPY": str(spy)})
    try:
        assert server.wait_port(), server.log()
        server.wait_ready()
        ids = [server.submit({"prompt": f"job {n}", "seed": n}) for n in range(2)]
        jobs = [server.wait_job(i) for i in ids]
    finally:
        server.stop()
    log = server.log()
    assert [j["status"] for j in jobs] == ["completed", "completed"], log
    calls = [line.split(" ", 2) for line in spy.read_text().splitlines()]
    assert [c[0] for c in calls] == ["init_modules", "warmup", "run_pipeline", "run_pipeline"], calls
    assert len({c[1] for c in calls}) == 1, f"init, warmup and jobs ran on different threads: {calls}"
    assert calls[0][2] == "runnerkit-worker", calls
    assert "ready: accepting jobs (on thread 'runnerkit-worker'" in log, log
    assert WARNING_TEXT not in log, log


@pytest.fixture
def warnings_seen() -> list[str]:
    seen: list[str] = []
    sink = logger.add(lambda m: seen.append(str(m)), level="WARNING", format="{message}")
    yield seen
    logger.remove(sink)


def test_a_request_from_another_thread_warns_once(tiny_ckpt: Path, warnings_seen: list[str]) -> None:
    """Python API: init_modules on this thread; a request here warns nothing, the first from another
    thread warns once (naming both threads), a second from another thread warns no more."""
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, **SMALL))
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.init_modules()

    def from_thread(index: int, name: str) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                runner.run_pipeline(RequestConfig(prompt="x"), index)
            except BaseException as exc:  # noqa: BLE001  (re-raised on the test's thread)
                errors.append(exc)

        t = threading.Thread(target=run, name=name)
        t.start()
        t.join()
        if errors:
            raise errors[0]

    runner.run_pipeline(RequestConfig(prompt="x"), 0)
    assert [w for w in warnings_seen if WARNING_TEXT in w] == []
    from_thread(1, "other-1")
    thread_warnings = [w for w in warnings_seen if WARNING_TEXT in w]
    assert len(thread_warnings) == 1, warnings_seen
    assert "request 1: runs on thread 'other-1'" in thread_warnings[0]
    assert f"ran on thread {threading.current_thread().name!r}" in thread_warnings[0]
    from_thread(2, "other-2")
    assert len([w for w in warnings_seen if WARNING_TEXT in w]) == 1, warnings_seen
