"""The parallel launch's own lifecycle (runnerkit/parallel/driver.py `run_parallel`) in one process.

A stand-in group and runner record what the driver calls, in order; `exit_now` is replaced by a
recorder (the real one ends the process). What is checked: every request's Ulysses split is checked
after init and before the first request runs; an interrupt (the launcher's SIGTERM after a failed
peer exited) is reported as that peer's failure when one is recorded, as an interrupt otherwise.
The multi-process behaviour (collectives, a failing rank ending the group) is in test_multi_rank.py.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runnerkit.interrupts import Terminated
from runnerkit.parallel import driver

PEER_LINE = "rank 1 failed during request 0: RuntimeError: injected"
NO_FILES = SimpleNamespace(save_tensor_path=None, save_result_path=None, source="command line")  # writes nothing


class Group:
    """The rank-0 side of a two-rank group: a store that holds `failures` (rank -> line)."""

    rank, world_size = 0, 2

    def __init__(self, failures: dict[int, str], dead: tuple[int, ...] = ()) -> None:
        self.recorded, self.dead = failures, dead
        self.calls: list[str] = []
        self.output_lock = threading.Lock()

    def failures(self, wait_s: float = 0.0) -> dict[int, str]:
        return dict(self.recorded)

    def record_failure(self, line: str, rank: int | None = None) -> None:
        self.recorded[self.rank if rank is None else rank] = line

    def dead_ranks(self) -> list[int]:
        return [r for r in self.dead if r not in self.recorded]

    def mark_ended(self) -> None:
        self.calls.append("ended")

    def agree(self, ok: bool, what: str) -> bool:
        self.calls.append(f"agree {what}" if ok else f"agree {what}: refused")
        return ok

    def reporter(self) -> int:
        return 0

    def _store(self) -> Any:
        return SimpleNamespace(set=lambda key, value: None, check=lambda keys: True)

    def close(self) -> None:
        self.calls.append("close")


class Runner:
    """Records the driver's calls; `fail_in` names the call that raises `exc`."""

    def __init__(self, calls: list[str], fail_in: str | None = None, exc: BaseException | None = None) -> None:
        self.calls, self.fail_in, self.exc = calls, fail_in, exc
        self.profiler = SimpleNamespace(requests=[], phases={})
        self.writer, self.on_request_done, self.max_writes_in_flight = None, None, None

    def overlap_writes(self, max_in_flight: int) -> None:
        self.max_writes_in_flight = max_in_flight

    def finish_writes(self) -> None:
        self._call("finish_writes")

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_in:
            assert self.exc is not None
            raise self.exc

    def attach_parallel(self, group: Any) -> None:
        self._call("attach_parallel")

    @property
    def memory_checks(self) -> Runner:  # the runner's memory checks (planning/checks.py), recorded here too
        return self

    def check_requests_fit(self, requests: Any) -> None:
        self._call("check_requests_fit")

    def init_modules(self) -> None:
        self._call("init_modules")

    def check_requests_split(self, requests: Any) -> None:
        self._call("check_requests_split")

    def run_pipeline(self, request: Any, index: int) -> None:
        self._call(f"run_pipeline {index}")
        self.profiler.requests.append(SimpleNamespace(saved=True))


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`launch(group, runner, n_requests)` -> (exit status, ERROR lines, whether interrupts were ignored)."""
    from loguru import logger

    def run(group: Group, runner: Runner, n_requests: int) -> tuple[int, list[str], bool]:
        exits: list[int] = []
        ignored: list[bool] = []
        errors: list[str] = []
        monkeypatch.setattr(driver, "init_from_env", lambda parallel, device: group)
        monkeypatch.setattr(driver, "start_watcher", lambda group, stop, launch: None)
        monkeypatch.setattr(driver, "exit_now", exits.append)
        monkeypatch.setattr(driver, "ignore_interrupts", lambda: ignored.append(True))
        monkeypatch.setattr(driver, "SECONDARY_GRACE_S", 0.0)
        monkeypatch.setattr(driver, "_reported", [])
        sink = logger.add(lambda m: errors.append(m.record["message"]), level="ERROR")
        try:
            status = driver.run_parallel(SimpleNamespace(), SimpleNamespace(parallel=None, device="cpu"),
                                         [NO_FILES] * n_requests, lambda config: runner)
        finally:
            logger.remove(sink)
        assert exits == ([status] if status else []), exits  # a failure or interrupt ends the process at once
        return status, errors, bool(ignored)

    return run


def test_every_request_split_is_checked_after_init_before_any_runs(launch: Any) -> None:
    group = Group({})
    runner = Runner(group.calls)
    assert launch(group, runner, 2) == (0, [], False)
    assert group.calls == ["attach_parallel", "check_requests_fit", "init_modules", "check_requests_split",
                           "agree init", "run_pipeline 0", "agree request 0", "run_pipeline 1",
                           "agree request 1", "finish_writes", "agree writes", "ended", "close"]


def test_a_failed_write_on_rank_0_fails_its_request_alone_and_every_rank_exits_1(launch: Any) -> None:
    """Rank 0's writer thread reports request 0's files as failed (while request 1 runs): request 1 still
    runs on every rank, rank 0 names the failed request, and the last agreement makes every rank exit 1."""
    from runnerkit.media import MediaWriteError

    group = Group({})

    class WritingRunner(Runner):
        def run_pipeline(self, request: Any, index: int) -> None:
            super().run_pipeline(request, index)
            if index == 1:  # request 0's write ends while request 1 computes
                self.on_request_done(SimpleNamespace(index=0), MediaWriteError("could not write `save_result_path`"))

    runner = WritingRunner(group.calls)
    status, errors, _ = launch(group, runner, 2)
    assert runner.max_writes_in_flight == 0  # (these args give no --max_writes_in_flight: inline)
    assert (status, errors) == (1, ["request 0 (command line) failed: MediaWriteError: could not write "
                                    "`save_result_path`", "1 of 2 requests failed: [0]"])
    assert group.calls == ["attach_parallel", "check_requests_fit", "init_modules", "check_requests_split",
                           "agree init", "run_pipeline 0", "agree request 0", "run_pipeline 1", "agree request 1",
                           "finish_writes", "agree writes: refused", "ended", "ended", "close"]


def test_a_refused_split_is_invalid_input_before_any_request(launch: Any) -> None:
    """Every rank tells the others through the init agreement, rank 0 logs it as invalid input, every
    rank ends with 2 (interrupts ignored first: the launcher's SIGTERM follows the first rank's exit)."""
    group = Group({})
    runner = Runner(group.calls, "check_requests_split", NotImplementedError("request 1 (command line): 45 tokens"))
    assert launch(group, runner, 2) == (2, ["invalid input: request 1 (command line): 45 tokens"], True)
    assert group.calls == ["attach_parallel", "check_requests_fit", "init_modules", "check_requests_split",
                           "agree init: refused", "ended"]
    assert group.recorded == {}  # not a rank's failure: nothing for the watchers to report


def test_sigterm_after_a_peer_failed_reports_the_peer(launch: Any) -> None:
    """The launcher's SIGTERM reaches rank 0 while a peer's failure is recorded: rank 0 prints the
    peer's line and exits 1 (it used to log "interrupted before any request ran")."""
    group = Group({1: PEER_LINE})
    status, errors, ignored = launch(group, Runner(group.calls, "run_pipeline 0", Terminated()), 1)
    assert (status, ignored) == (1, True)
    assert errors == [f"{PEER_LINE}; ending all 2 ranks"]


def test_sigterm_after_a_peer_died_names_the_peer(launch: Any) -> None:
    """The launcher's SIGTERM follows a peer's death without a record (SIGKILL): rank 0 names the
    rank in one fixed line, records it for the other survivors, and exits 1, not 143."""
    line = ("rank 1 died without reporting during request 0: its process ended without recording a failure (killed "
            "by a signal such as SIGKILL or the OOM killer, or crashed)")
    group = Group({}, dead=(1,))
    status, errors, ignored = launch(group, Runner(group.calls, "run_pipeline 0", Terminated()), 1)
    assert (status, errors, ignored) == (1, [f"{line}; ending all 2 ranks"], True)
    assert group.recorded == {1: line}


@pytest.mark.parametrize(("exc", "status", "line"), [
    (Terminated(), 143, "interrupted (SIGTERM during request 1); 1 of 2 requests finished"),
    (KeyboardInterrupt(), 130, "interrupted (Ctrl-C during request 1); 1 of 2 requests finished"),
])
def test_an_interrupt_without_a_failure_is_reported_as_one(launch: Any, exc: KeyboardInterrupt, status: int,
                                                           line: str) -> None:
    exc.runnerkit_phase = "request 1"  # type: ignore[attr-defined]  # as runners.base.lifecycle_phase tags it
    group = Group({})
    assert launch(group, Runner(group.calls, "run_pipeline 1", exc), 2) == (status, [line], True)


def test_ignore_interrupts_ignores_sigterm_and_sigint() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        driver.ignore_interrupts()
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == (signal.SIG_IGN, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


def test_a_failed_requests_files_are_removed_temporary_names_included(tmp_path: Path) -> None:
    """The running request's final files and this process's temporary ones (media.py's
    `.{stem}.partial-{pid}-*`) go; another request's files and another process's temporary files stay."""
    import os

    request = SimpleNamespace(save_tensor_path=str(tmp_path / "a.safetensors"),
                              save_result_path=str(tmp_path / "a.mp4"))
    names = ["a.safetensors", "a.mp4", "a.json", f".a.partial-{os.getpid()}-0a1b2c.mp4", "b.mp4",
             ".a.partial-1-0a1b2c.mp4"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    launch = driver.Launch(phase="request 0", files=driver.request_files(request))
    driver.remove_request_files(launch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.partial-1-0a1b2c.mp4", "b.mp4"]
    assert launch.files == []
