"""`runnerkit` (runnerkit/infer.py) under torchrun: every rank runs the same lifecycle, rank 0
reports, a failure anywhere ends the group (ARCHITECTURE §7).

    init_from_env -> build runner -> attach_parallel -> memory_checks.check_requests_fit -> init_modules
    (load, warmup: the same collectives in the same order on every rank)
    -> admission's split rule (check_requests_split: every request's tokens divide by `parallel.ulysses`,
       before any runs; runnerkit/admission.py)
    -> agree("init") (a request that does not split: rank 0 logs "invalid input", every rank exits 2)
    -> for each request: run_pipeline -> agree("request i")
    -> rank 0: finish_writes -> agree("writes") (every rank exits 1 when a request's files failed)
    -> exit 0

Each rank reads the same command line, so the requests are the same on every rank (no broadcast);
rank 0 alone decodes, writes the outputs and the profile, and logs INFO lines (the other ranks log
WARNING and above, unless `--log_level` asks for another level).

Failures: the rank whose phase raised first (the primary failure) records one line in the
rendezvous store (`ParallelGroup.record_failure`) and exits 1. A watcher thread on every rank
polls the store: rank 0 logs the line ("rank R failed during PHASE: Type: message") and every
rank exits 1 at once, also from inside a collective that waits for the dead rank. A rank whose
collective failed because a peer died finds the peer's record (its own error is secondary) and
reports nothing of its own. Nothing waits longer than `parallel.timeout_s` (a collective on a hung
peer raises after it; its rank then records that timeout as the failure). A SIGTERM or Ctrl-C (the
launcher sends SIGTERM to the others once a failed rank exits) is reported as the peer's failure
when one is recorded, else rank 0 logs the interrupt and every rank exits 143 or 130.

A rank that dies without a record (SIGKILL, the OOM killer, a crash) is found through the store's
process records (`ParallelGroup.dead_ranks`, ranks on the same host): the survivor that notices
(its watcher, its broken collective, or the launcher's SIGTERM) records `died_line` for it, and
rank 0 prints that fixed line and every survivor exits 1. When rank 0 itself died, the lowest rank
still alive prints it (`ParallelGroup.reporter`; only under torchrun, whose agent hosts the store:
a store hosted by rank 0 ends with it). A request counts as finished once every rank agreed on it
(and rank 0 wrote its files); until the agreement a failure or interrupt removes the files rank 0
wrote for it.

Files: with `--max_writes_in_flight` N >= 1 (default 1) rank 0 writes a request's files on its writer
thread while every rank computes the next request (runners/writes.py); the writer holds the group's
output lock for each whole write, as the inline save does, so `end_rank` (which takes it) never sees
half a file set: a write in flight ends first, then the running request's files are removed. A write
that fails fails its request alone (rank 0 names it); the others run, and every rank exits 1 after
the last (`agree("writes")`). An interrupt completes the files in flight before rank 0 reports (a
second interrupt abandons them, leaving nothing of them).
"""

from __future__ import annotations

import functools
import glob
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from runnerkit.cli_common import report_failure, under_torchrun
from runnerkit.interrupts import exit_status, interrupted_line
from runnerkit.parallel.group import SETUP_REFUSED_KEY, ParallelGroup, ParallelSetupError, agent_store, init_from_env

__all__ = ["run_parallel"]

WATCH_INTERVAL_S = 0.1
"""How often each rank's watcher polls the store for another rank's failure."""
SECONDARY_GRACE_S = 0.5
"""How long a rank whose phase failed waits for a peer's record before it counts its own error as the first."""
REPORTED_KEY = "runnerkit/reported"
_report_lock = threading.Lock()
_reported: list[str] = []


def report(group: ParallelGroup, line: str) -> None:
    """The reporting rank (`ParallelGroup.reporter`: rank 0, unless it died without a word) logs the
    group's failure line once (the main thread and the watcher may both see it)."""
    if group.reporter() != group.rank:
        return
    with _report_lock:
        if _reported:
            return
        _reported.append(line)
    logger.error("{}; ending all {} ranks", line, group.world_size)
    try:
        group._store().set(REPORTED_KEY, "1")
    except Exception:  # noqa: BLE001 - nothing more to tell
        pass


class RankFailed(Exception):
    """This rank's phase failed (the line is recorded or another rank's record was found); its
    message is the group's failure line ("rank R failed during PHASE: Type: message")."""


def failure_line(rank: int, phase: str, exc: BaseException) -> str:
    """The one line rank 0 prints for a failure."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"rank {rank} failed during {phase}: {type(exc).__name__}{': ' + message if message else ''}"


def exit_now(status: int) -> None:
    """End this process at once (a thread cannot interrupt a blocked collective otherwise)."""
    logger.complete()
    os._exit(status)


def died_line(rank: int, phase: str) -> str:
    """The one line rank 0 prints for a rank whose process vanished without a record (a signal's
    number or name cannot be read from a process that is not this one's child)."""
    return (f"rank {rank} died without reporting during {phase}: its process ended without recording a failure "
            "(killed by a signal such as SIGKILL or the OOM killer, or crashed)")


def group_failure(group: ParallelGroup, phase: str, wait_s: float = 0.0) -> str | None:
    """The group's failure line, waiting up to `wait_s` for one: another rank's record, else a rank
    on this host that died without one (`died_line`, recorded here so that every survivor tells the
    same story), else None."""
    deadline = time.monotonic() + wait_s
    while True:
        others = {r: line for r, line in group.failures().items() if r != group.rank}
        if others:
            return others[min(others)]
        dead = group.dead_ranks()
        if dead:
            line = died_line(dead[0], phase)
            group.record_failure(line, rank=dead[0])
            return line
        if time.monotonic() >= deadline:
            return None
        time.sleep(WATCH_INTERVAL_S / 2)


@dataclass
class Launch:
    """What the watcher and the failure paths of a launch read from the main thread."""

    phase: str = "load"
    """The lifecycle phase the main thread is in (named in a `died_line`)."""
    files: list[Path] = field(default_factory=list)
    """The running request's output files (rank 0), from its start until every rank agreed on it."""
    finished: int = 0
    """Requests every rank finished."""


def request_files(request: Any) -> list[Path]:
    """The files `request` writes on rank 0: the tensor file, the media file and its sidecar .json."""
    from runnerkit.media import sidecar_path

    paths = [Path(request.save_tensor_path)] if request.save_tensor_path else []
    if request.save_result_path:
        paths += [Path(request.save_result_path), sidecar_path(request.save_result_path)]
    return paths


def remove_request_files(launch: Launch) -> None:
    """Remove the running request's files, final or still under their temporary names (media.py's
    `.{stem}.partial-{pid}-*`), as a failed request leaves nothing in one process. Callers hold
    `group.output_lock`, so no file is being renamed into place meanwhile."""
    removed = []
    for final in launch.files:
        for path in [final, *final.parent.glob(f".{glob.escape(final.stem)}.partial-{os.getpid()}-*")]:
            try:
                path.unlink()
                removed.append(str(path))
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.error("could not remove {} of the failed request: {}", path, exc)
    launch.files = []
    if removed:
        logger.warning("{}: removed its files {} (the request failed on the group)", launch.phase, removed)


def end_rank(group: ParallelGroup, launch: Launch | None, status: int) -> None:
    """A failed or interrupted launch ends here: the running request's files go, the store learns
    this rank ends in order, and the process exits at once."""
    with group.output_lock:
        if launch is not None:
            remove_request_files(launch)
        group.mark_ended()
        exit_now(status)


def _watch(group: ParallelGroup, stop: threading.Event, launch: Launch | None) -> None:
    while not stop.wait(WATCH_INTERVAL_S):
        if launch is not None:  # a launch also notices a peer that died without a record
            line = group_failure(group, launch.phase)
        else:
            found = {r: line for r, line in group.failures().items() if r != group.rank}
            line = found[min(found)] if found else None
        if line is None:
            continue
        report(group, line)
        end_rank(group, launch, 1)


def run_phase(group: ParallelGroup, phase: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`; on failure decide whether it is the group's first, record it, and raise RankFailed."""
    try:
        return fn()
    except Exception as exc:
        from runnerkit.runners.base import error_phase

        where = error_phase(exc) or phase
        first = group_failure(group, where, wait_s=SECONDARY_GRACE_S)
        if first is not None:  # a peer failed or died first; this rank's error (a broken collective) follows
            logger.debug("rank {}: {} after the group failed ({}): {}", group.rank, where, first, exc)
            report(group, first)
            raise RankFailed(first) from exc
        line = failure_line(group.rank, where, exc)
        logger.opt(exception=exc).debug("rank {}: {}", group.rank, line)
        group.record_failure(line)
        report(group, line)
        raise RankFailed(line) from exc


def wait_until_reported(group: ParallelGroup) -> None:
    """On a rank > 0 that failed: give rank 0 up to SECONDARY_GRACE_S to read this rank's record
    (and log it) before this process exits and the launcher reaps the group."""
    if group.rank == 0:
        return
    deadline = time.monotonic() + SECONDARY_GRACE_S
    while time.monotonic() < deadline:
        try:
            if group._store().check([REPORTED_KEY]):
                return
        except Exception:  # noqa: BLE001 - the store went away with rank 0
            return
        time.sleep(WATCH_INTERVAL_S)


def start_watcher(group: ParallelGroup, stop: threading.Event, launch: Launch | None = None) -> None:
    """The thread that ends this rank (exit 1) once another rank recorded a failure, or, with
    `launch`, once a rank on this host died without one (removing `launch`'s running request files)."""
    threading.Thread(target=_watch, args=(group, stop, launch), name="runnerkit-rank-watch", daemon=True).start()


def quiet_other_ranks(group: ParallelGroup, log_level: str) -> None:
    """Ranks > 0 log WARNING and above (rank 0 tells the story once), unless `log_level` asks otherwise."""
    if group.rank == 0 or log_level != "INFO":
        return
    import sys

    logger.remove()
    fmt = f"<green>{{time:HH:mm:ss}}</green> | rank {group.rank} | <level>{{level: <7}}</level> | {{message}}"
    logger.add(sys.stderr, level="WARNING", format=fmt)


def ignore_interrupts() -> None:
    """This rank is ending (exit 1, 130 or 143): a SIGTERM or Ctrl-C from now on (the launcher signals
    the survivors once a rank exits) must not turn its report into an interrupt's. Main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def refuse_launch(exc: Exception, timeout_s: float) -> None:
    """End a launch refused before its group exists (invalid config or request, or a launch that
    does not match `parallel`): every rank sees the same launch, so rank 0 alone logs the refusal
    and every rank exits 2.

    Under torchrun the ranks first meet in its agent's store (up to `timeout_s`): the launcher
    sends SIGTERM to every rank still running once the first one exits, and a rank still importing
    would then end as an interrupt (143, a second line) instead of with the refusal. Without
    torchrun's environment (one process) it only logs and returns.
    """
    if not under_torchrun():  # one process, or a partial environment: no group
        logger.error("invalid input: {}", exc)
        return
    ignore_interrupts()  # from here the launcher's SIGTERM must not turn status 2 into 143
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        logger.error("invalid input: {}", exc)
    store = agent_store(timeout_s)
    if store is not None:
        key = SETUP_REFUSED_KEY.format(attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        deadline = time.monotonic() + timeout_s
        try:
            arrived = store.add(key, 1)
            while arrived < world and time.monotonic() < deadline:
                time.sleep(0.05)
                arrived = store.add(key, 0)
        except Exception as wait_error:  # noqa: BLE001 - the agent went away: nothing left to wait for
            logger.debug("rank {}: the other ranks did not all reach the refusal: {}", rank, wait_error)
    exit_now(2)


def plan_refusal(runner: Any, requests: Sequence[Any]) -> Exception | None:
    """The input error of the memory plan and the requests' fit check (a request that cannot fit, a plan
    nothing fits, offload keys no plan can take), or None. Every rank plans the same config and requests
    before loading, so each rank knows it and rank 0 tells it (`refuse_launch`), without a collective."""
    from runnerkit.planning.fit import MemoryFitError

    try:
        runner.memory_checks.check_requests_fit(requests)
    except (MemoryFitError, ValueError, NotImplementedError) as exc:
        return exc
    return None


def split_refusal(runner: Any, requests: Sequence[Any]) -> Exception | None:
    """The input error of the first request whose tokens `parallel.ulysses` cannot split, or None.
    The same on every rank (the same requests), so it is each rank's to know, and rank 0's to tell."""
    from runnerkit.admission import Refused, admit

    try:
        admit(runner, None, requests, source="parallel")  # the launch script admitted the rest before loading
    except Refused as exc:
        return exc.cause
    return None


def run_parallel(args: Any, config: Any, requests: Sequence[Any], build: Callable[[Any], Any]) -> int:
    """The lifecycle of one rank (see the module docstring). `build(config)` makes the runner.

    Returns:
        0 when every rank served every request; 2 for a launch that does not match `parallel` or a
        request whose tokens do not split; 1 after any failure on any rank.
    """
    try:
        group = init_from_env(config.parallel, config.device)
    except ParallelSetupError as exc:
        refuse_launch(exc, config.parallel.timeout_s)  # under torchrun: ends this rank with status 2
        return 2
    quiet_other_ranks(group, getattr(args, "log_level", "INFO"))
    launch = Launch()
    stop = threading.Event()
    start_watcher(group, stop, launch)
    unwritten: list[int] = []  # rank 0: requests whose files could not be written (or were abandoned)
    built: list[Any] = []

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        launch.phase = name
        return run_phase(group, name, fn)

    status = 1
    try:
        runner = phase("load", lambda: build(config))
        built.append(runner)
        runner.attach_parallel(group)
        if group.rank == 0:  # the rank that writes: its files overlap the next request (all ranks compute it)
            runner.on_request_done = functools.partial(write_done, requests, unwritten)
            runner.overlap_writes(getattr(args, "max_writes_in_flight", 0))
        refused = phase("plan", lambda: plan_refusal(runner, requests))
        if refused is not None:  # the same plan and estimates on every rank: rank 0 tells, every rank exits 2
            stop.set()
            refuse_launch(refused, config.parallel.timeout_s)
            return 2  # reached only without torchrun's environment (tests)
        phase("load", runner.init_modules)
        refused = phase("request check", lambda: split_refusal(runner, requests))
        if refused is not None:  # every rank ends with 2 once they met: the launcher's SIGTERM must not make it 143
            ignore_interrupts()
        if not phase("init", lambda: group.agree(refused is None, "init")):
            stop.set()
            if group.rank == 0:
                logger.error("invalid input: {}", refused or "a request's tokens do not split on another rank")
            end_rank(group, launch, 2)
            return 2  # reached only where `exit_now` does not end the process (tests)
        status = serve_requests(args, group, launch, runner, requests, phase, unwritten)
    except RankFailed:
        ignore_interrupts()
        status = 1
        wait_until_reported(group)
    except KeyboardInterrupt as exc:  # Ctrl-C, or the launcher's SIGTERM once a failed or dead peer exited
        ignore_interrupts()
        first = group_failure(group, launch.phase, wait_s=SECONDARY_GRACE_S)
        if first is not None:  # the peer's failure is the run's story, not an interrupt
            report(group, first)
            status = 1
        else:
            status = exit_status(exc)
            if group.rank == 0:
                if built and built[0].writer is not None:  # computed requests' files complete (again: abandoned)
                    from runnerkit.runners.writes import close_writer

                    close_writer(built[0].writer, interrupted=True)
                finished = launch.finished - len([i for i in set(unwritten) if i < launch.finished])
                logger.error("{}", interrupted_line(exc, finished, len(requests)))
    finally:
        stop.set()
    if status:  # (a write in flight ends first: `end_rank` waits for the output lock the writer holds)
        end_rank(group, launch, status)  # a clean shutdown would wait on the dead peers in destroy_process_group
    group.mark_ended()
    group.close()
    return status


def serve_requests(args: Any, group: Any, launch: Launch, runner: Any, requests: Sequence[Any],
                   phase: Callable[[str, Callable[[], Any]], Any], unwritten: list[int]) -> int:
    """Every request in lockstep (each agreed on by every rank), rank 0's last writes and its profile; 0 when
    every request's files were written, else 1 (rank 0 names the requests whose files failed: `unwritten`)."""
    started = time.perf_counter()
    for index, request in enumerate(requests):
        launch.files = request_files(request) if group.rank == 0 else []
        phase(f"request {index}", lambda: runner.run_pipeline(request, index))
        phase(f"request {index}", lambda: group.agree(True, f"request {index}"))
        launch.files, launch.finished = [], launch.finished + 1  # every rank finished it: the files stay
    if group.rank == 0:
        phase("writes", runner.finish_writes)  # the last requests' files (the writer holds the output lock)
        runner.profiler.phases["requests_seconds"] = round(time.perf_counter() - started, 4)
    # one failed write fails its request alone; every rank then exits 1, as after a failed request
    written = phase("writes", lambda: group.agree(not unwritten, "writes"))
    if group.rank == 0 and getattr(args, "profile_json", None):
        runner.profiler.write(args.profile_json)
        logger.info("profile written to {}", args.profile_json)
    if written:
        return 0
    if group.rank == 0:
        logger.error("{} of {} requests failed: {}", len(unwritten), len(requests), sorted(unwritten))
    return 1


def write_done(requests: Sequence[Any], unwritten: list[int], prof: Any, error: BaseException | None) -> None:
    """Rank 0's report of a request whose files were written (`error` None) or failed: a failed write fails its
    request alone (`unwritten`), named unless an interrupt abandoned it."""
    from runnerkit.runners.writes import is_abandoned

    if error is not None:
        unwritten.append(prof.index)
        if not is_abandoned(error):
            report_failure(f"request {prof.index} ({requests[prof.index].source}) failed", error)
