"""`runnerkit serve` under torchrun: rank 0 serves HTTP and leads, the other ranks follow (docs/multi_gpu.md).

    torchrun --nproc_per_node N -m runnerkit.infer serve --config_json C.json --warmup --port 8000

Rank 0 (runnerkit/serve/server.py with a `Leader`): opens the port, joins the group, loads and warms
up on its job thread, then agrees with every rank ("init": one all-reduce) before `/health/ready`
answers 200. For each job it takes off the queue it first publishes the request, then runs it and
agrees once more ("request i"). Ranks > 0 (`follow`): no HTTP; the same load, warmup and agreement,
then a loop: read the next message, run the request in lockstep, agree; "stop" ends the loop.

How the requests travel: through the rendezvous store (torchrun's TCPStore, hosted by rank 0), not
through a collective. Rank 0 sets `runnerkit/serve/msg/{seq}` to a JSON message; each follower polls
for the next sequence number every POLL_S seconds. Waiting for the next job therefore never runs
into the collective timeout (`parallel.timeout_s` bounds every collective; a server may idle for
days), costs no GPU work, and a follower notices at its next poll that rank 0 is gone (the store
answers no more): it exits 1. Rank 0 deletes message `seq - 1` when it publishes `seq` (every rank
has agreed on it by then). Requests hold file paths (the job's uploaded images, rank 0's output
folder): the ranks must share one filesystem, which one host (one pod) gives.

Failures: as in the launch script (driver.py), any rank's failure ends the group. A follower's
phase records its line in the store and exits 1; rank 0's watcher (or its own failing collective)
finds the line, and the server fails the running job with it, turns not ready (`failed`, the line
as its error), stops accepting, answers status for `--drain_grace` seconds and exits 1. A rank
whose state after a failure inside a collective is unknown never serves another request.

Cancellation: a running job cannot be cancelled (DELETE answers 409): stopping every rank at the
same step would need one more collective per step. Queued jobs are cancelled as without
`parallel`; `--on_shutdown cancel` is refused at start.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from loguru import logger

from runnerkit.parallel.driver import (WATCH_INTERVAL_S, RankFailed, exit_now, quiet_other_ranks, refuse_launch, report,
                                       run_phase, start_watcher, wait_until_reported)
from runnerkit.parallel.group import ParallelGroup, ParallelSetupError, init_from_env

__all__ = ["CANCEL_REFUSED", "MESSAGE_KEY", "POLL_S", "STOPPED_KEY", "Leader", "LeaderGone", "follow"]

MESSAGE_KEY = "runnerkit/serve/msg/{seq}"
STOPPED_KEY = "runnerkit/serve/stopped"
POLL_S = 0.02
"""How often an idle follower asks the store for the next message (one small TCP request)."""
STOP_WAIT_S = 30.0
"""How long rank 0 waits at shutdown for every follower to read "stop" before it exits anyway."""
CANCEL_REFUSED = ("a running job cannot be cancelled under `parallel` (every rank would have to stop at the same "
                  "step); it finishes, then DELETE removes it")


class Leader:
    """Rank 0's side of a parallel server: the group, the messages to the followers, the failure watch.

    Raises (constructor):
        ParallelSetupError: the launch does not match `parallel` (init_from_env's checks).
    """

    def __init__(self, config: Any, on_failed: Callable[[str], None]) -> None:
        self.group: ParallelGroup = init_from_env(config.parallel, config.device)
        if self.group.rank != 0:
            raise ParallelSetupError(f"Leader on rank {self.group.rank}: only rank 0 serves HTTP")
        self.on_failed = on_failed
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._stop_watch = threading.Event()
        threading.Thread(target=self._watch, name="runnerkit-rank-watch", daemon=True).start()

    # -- failures -------------------------------------------------------------------------
    def fail(self, line: str) -> None:
        """The group failed (`line` names the rank and phase): log it once and tell the server once."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed = line
        report(self.group, line)
        self.on_failed(line)

    def _watch(self) -> None:
        while not self._stop_watch.wait(WATCH_INTERVAL_S):
            found = {r: line for r, line in self.group.failures().items() if r != 0}
            if found:
                self.fail(found[min(found)])
                return

    def phase(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` as phase `name` of the group (driver.run_phase); a failure on any rank calls `fail`.

        Raises:
            RankFailed: its message is the group's failure line.
        """
        try:
            return run_phase(self.group, name, fn)
        except RankFailed as exc:
            self.fail(str(exc))
            raise

    # -- lockstep -------------------------------------------------------------------------
    def init(self, runner: Any) -> None:
        """On the job thread: load and warm up (`init_modules`), then agree that every rank is warm."""
        self.phase("load", runner.init_modules)
        self.phase("init", lambda: self.group.agree(True, "init"))

    def run(self, runner: Any, request: Any, index: int) -> None:
        """Publish request `index` to the followers, run it here, agree that it succeeded everywhere.

        Raises:
            RankFailed: the request failed on some rank (the message names it).
        """
        self._publish({"op": "request", "index": index, "request": request.model_dump(mode="json")})
        self.phase(f"request {index}", lambda: runner.run_pipeline(request, index))
        self.phase(f"request {index}", lambda: self.group.agree(True, f"request {index}"))

    def _publish(self, message: dict[str, Any]) -> None:
        store = self.group._store()
        if self._seq:
            store.delete_key(MESSAGE_KEY.format(seq=self._seq - 1))
        store.set(MESSAGE_KEY.format(seq=self._seq), json.dumps(message))
        self._seq += 1

    def stop(self) -> bool:
        """At shutdown, after the last job: tell the followers to exit, wait (bounded) until each read it,
        then leave the group. Returns whether every follower confirmed."""
        self._stop_watch.set()
        if self.failed is not None:
            return False
        store = self.group._store()
        self._publish({"op": "stop"})
        deadline = time.monotonic() + STOP_WAIT_S
        while (done := store.add(STOPPED_KEY, 0)) < self.group.world_size - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if done < self.group.world_size - 1:
            logger.warning("shutdown: {} of {} followers confirmed the stop within {:g} s", done,
                           self.group.world_size - 1, STOP_WAIT_S)
            return False
        logger.info("shutdown: all {} ranks stopped", self.group.world_size)
        self.group.close()
        return True


class LeaderGone(RuntimeError):
    """The rendezvous store answers no more: rank 0 exited without a stop (killed)."""


def _next_message(group: ParallelGroup, seq: int) -> dict[str, Any]:
    """Wait (polling, no timeout) for rank 0's message `seq`.

    Raises:
        LeaderGone: the store answers no more.
    """
    key = MESSAGE_KEY.format(seq=seq)
    store = group._store()
    while True:
        try:
            if store.check([key]):
                return json.loads(store.get(key))
        except Exception as exc:  # noqa: BLE001 - the store lives in rank 0's process
            raise LeaderGone(f"rank 0 is gone (the rendezvous store does not answer: {exc})") from None
        time.sleep(POLL_S)


def follow(config: Any, log_level: str) -> int:
    """One rank > 0 of a parallel server (see the module docstring): no HTTP; load, warm up, agree, then
    run each request rank 0 publishes, until "stop".

    Returns:
        0 after rank 0's stop; 2 for a launch that does not match `parallel`; 1 after any rank's failure
        (the process exits at once then) or when rank 0 vanished without a stop.
    """
    from runnerkit.config import RequestConfig
    from runnerkit.registry import get_runner_cls

    try:
        group = init_from_env(config.parallel, config.device)
    except ParallelSetupError as exc:
        refuse_launch(exc, config.parallel.timeout_s)  # rank 0 alone logs it; under torchrun every rank exits 2
        return 2
    quiet_other_ranks(group, log_level)
    serving, signalled = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not serving.is_set():  # nothing served yet: as rank 0 does during start-up
            exit_now(0)
        if signalled.is_set():
            logger.warning("rank {}: second {}: exiting now", group.rank, signal.Signals(signum).name)
            exit_now(128 + signum)
        signalled.set()
        logger.info("rank {}: {}: waiting for rank 0's stop (it finishes the running job)", group.rank,
                    signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):  # torchrun forwards its SIGTERM to every rank
        signal.signal(sig, on_signal)
    stop = threading.Event()
    start_watcher(group, stop)
    try:
        runner = run_phase(group, "load", lambda: get_runner_cls(config.model_cls, config.task)(config))
        runner.attach_parallel(group)
        run_phase(group, "load", runner.init_modules)
        run_phase(group, "init", lambda: group.agree(True, "init"))
        serving.set()
        seq = 0
        while (message := _next_message(group, seq))["op"] != "stop":
            index = message["index"]
            request = RequestConfig.model_validate(message["request"])
            run_phase(group, f"request {index}", lambda: runner.run_pipeline(request, index))
            run_phase(group, f"request {index}", lambda: group.agree(True, f"request {index}"))
            runner.profiler.requests.clear()  # rank 0 keeps the job's profile; this rank keeps none
            seq += 1
    except RankFailed:
        wait_until_reported(group)
        exit_now(1)
    except LeaderGone as exc:  # rank 0 vanished between jobs (killed): nothing to report to
        logger.error("rank {}: {}; exiting", group.rank, exc)
        exit_now(1)
    finally:
        stop.set()
    store = group._store()
    group.close()
    store.add(STOPPED_KEY, 1)
    logger.complete()
    sys.stderr.flush()
    return 0
