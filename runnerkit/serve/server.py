"""`runnerkit serve`: one runner per process behind HTTP (uvicorn + the FastAPI app of app.py).

    runnerkit serve --config_json CONFIG.json --warmup --port 8000

Start-up: the config file and the output folder are checked first (exit 2 naming the problem,
as the launch script does); then the HTTP port opens, before torch and the model family are
imported (seconds), so `/health/live` answers 200 and `/health/ready` 503 with the phase
(`starting` while importing and building the runner, then `loading`, `warming_up`) at once; the
runner loads and warms up on a background thread. A failing runner check, load or warmup stops
the process with status 2 (bad input: config, checkpoint, unsupported mode) or 1 (anything
else), the phase named in the log. Once ready, a worker thread runs the queued jobs one at a time.

Shutdown (SIGTERM or Ctrl-C): readiness turns 503 (`stopping`), new jobs are refused, queued
jobs are cancelled, the running job finishes (`--on_shutdown finish`, the default) or stops at
its next step or decoder chunk (`cancel`) while its status stays readable, and jobs whose files the
writer thread is writing complete either way (`--max_writes_in_flight`); job status is still
answered for `--drain_grace` seconds (default 3) after the last job ended, so that a polling
client sees the final status; then the port closes and the process exits 0. A signal during
start-up, loading or warmup exits 0 at once; a second signal exits at once with 128 + the signal
number. Job records live in memory only; result files stay in `--output_dir`.

With a `parallel` config, under `torchrun --nproc_per_node N -m runnerkit.infer serve ...`: rank 0
serves HTTP and leads, the other ranks follow (runnerkit/parallel/serving.py, docs/multi_gpu.md);
ready once every rank is warm; a failure on any rank fails the running job and ends every rank
(exit 1); a running job cannot be cancelled (409).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
from collections.abc import Iterator
import threading
import time
from pathlib import Path
from typing import Any

from loguru import logger

#: Seconds the port stays open at shutdown after the last job ended (longer than a client's poll interval:
#: the openai client polls every second).
DRAIN_GRACE_S = 3.0
LOG_FORMAT = "<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runnerkit serve", description=__doc__, allow_abbrev=False,  # no prefix guessing
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_json", required=True, help="runner config (JSON), as for the launch script")
    p.add_argument("--model_cls", help="override the config's model_cls")
    p.add_argument("--task", help="override the config's task")
    p.add_argument("--model_path", help="override the config's checkpoint folder")
    p.add_argument("--device", help="override the config's device (auto, cpu, cuda, cuda:N)")
    p.add_argument("--offload", choices=("none", "model", "block", "phase", "auto"),
                   help="override the config's offload.mode (auto, the default when the config sets none: planned for the config's shape and, with "
                        "--warmup, the warmup shapes, before loading; docs/memory_plan.md)")
    p.add_argument("--warmup", action="store_true", help="warm up before reporting ready")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--max_queue", type=int, default=16, help="jobs that may wait; more get HTTP 429 (default 16)")
    p.add_argument("--output_dir", default="outputs/serve", help="where each job's files go (default outputs/serve)")
    p.add_argument("--keep_jobs", type=int, default=100,
                   help="finished jobs whose files are kept; older ones are deleted (default 100; 0: none)")
    p.add_argument("--keep_gib", type=float, default=None, help="also keep at most this many GiB of job files")
    p.add_argument("--save_tensors", action="store_true", help="also write each job's result.safetensors")
    p.add_argument("--max_writes_in_flight", type=int, default=1, metavar="N",
                   help="jobs whose files a writer thread may still be writing while the next job computes "
                        "(default 1; 0: written inside each job); a job is completed once its files are written")
    p.add_argument("--on_shutdown", choices=("finish", "cancel"), default="finish",
                   help="what SIGTERM does to the running job (default finish)")
    p.add_argument("--drain_grace", type=float, default=DRAIN_GRACE_S,
                   help="at shutdown, seconds job status is still answered after the last job ended, so that a "
                        f"polling client sees its final status (default {DRAIN_GRACE_S:g}; 0: close at once)")
    p.add_argument("--log_level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level=args.log_level, format=LOG_FORMAT)
    for name, value, low in (("--max_queue", args.max_queue, 1), ("--keep_jobs", args.keep_jobs, 0),
                             ("--port", args.port, 0), ("--max_writes_in_flight", args.max_writes_in_flight, 0)):
        if value < low or (name == "--port" and value > 65535):
            logger.error("invalid input: {} must be {} (got {})", name,
                         "in [0, 65535]" if name == "--port" else f">= {low}", value)
            return 2
    if not 0 <= args.drain_grace <= 600:
        logger.error("invalid input: --drain_grace must be in [0, 600] seconds (got {})", args.drain_grace)
        return 2
    if args.keep_gib is not None and args.keep_gib <= 0:
        logger.error("invalid input: --keep_gib must be > 0 (got {})", args.keep_gib)
        return 2
    return serve(args)


def prepare_output_dir(value: str) -> Path:
    """`--output_dir` as an absolute folder, created if missing.

    Raises:
        ConfigError: naming `--output_dir` and the value: it, or a folder above it, is a file; or it
            cannot be created (the OS's reason).
    """
    from runnerkit.config import ConfigError

    output_dir = Path(value).expanduser().absolute()
    existing = next(p for p in (output_dir, *output_dir.parents) if p.exists())
    if not existing.is_dir():
        where = "" if existing == output_dir else f": {str(existing)!r} above it"
        raise ConfigError(f"--output_dir {value!r} is a file, not a folder{where}; give a folder (it is created "
                          "if missing)")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output_dir {value!r} cannot be created: {exc.strerror or exc}") from None
    return output_dir


def check_writers(runner_cls: type, task: str) -> None:
    """Refuse to serve a task whose result writer is missing: a job's result is a .png (image tasks) or an
    .mp4 (video tasks, `runner_cls.RESULT_KINDS`), written by the `media` extra (`media.missing_media_module`);
    without it the server would turn ready and fail every job after running it in full. Checked before
    loading: an image server needs no ffmpeg.

    Raises:
        ConfigError: naming the extra, its pip command and the missing module.
    """
    from runnerkit.config import ConfigError
    from runnerkit.media import MEDIA_EXTRA, missing_media_module

    suffix = ".png" if getattr(runner_cls, "RESULT_KINDS", {}).get(task, "video") == "image" else ".mp4"
    missing = missing_media_module(f"result{suffix}")
    if missing:
        raise ConfigError(f"task {task!r} writes every job's result as a {suffix} and needs {MEDIA_EXTRA}; "
                          f"missing: {missing}")


def default_size_refusal(runner: Any) -> str | None:
    """Why a job that gives no `size` would be refused by a loaded runner under Ulysses (the config's
    default shape has tokens that do not divide by `parallel.ulysses`), or None. A task whose size
    follows the job's image (an edit) has no default to check."""
    from runnerkit.config import RequestConfig

    try:
        runner.check_sequence_split(runner.resolve_request(RequestConfig(prompt="the default size")))
    except NotImplementedError as exc:
        return str(exc)
    except ValueError:  # the request needs an image: its size follows the image
        pass
    return None


def serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
        if importlib.util.find_spec("python_multipart") is None and importlib.util.find_spec("multipart") is None:
            raise ImportError("no python-multipart", name="python-multipart")  # forms (the openai client)
    except ImportError as exc:
        logger.error("runnerkit serve needs the `serve` extra: pip install \"runnerkit[serve]\" (from a checkout: "
                     "pip install -e \".[serve]\"); missing: {}", exc.name)
        return 2
    # Light imports only before the port opens (no torch, no model family): health answers within
    # a second or two, `starting` until the runner exists.
    from runnerkit.config import ConfigError, load_runner_config
    from runnerkit.cli_common import (INPUT_ERRORS, check_default_shape, check_writable, config_source,
                                      report_failure)
    from runnerkit.serve.app import ServerState, create_app
    from runnerkit.serve.jobs import Job, JobQueue

    overrides = {"model_cls": args.model_cls, "task": args.task, "model_path": args.model_path,
                 "device": args.device, "offload.mode": args.offload, "warmup": True if args.warmup else None}
    try:
        config = load_runner_config(args.config_json, overrides, flags={"offload.mode": "--offload"})
        output_dir = prepare_output_dir(args.output_dir)
        check_writable(str(output_dir / "probe.mp4"), "--output_dir")
    except (ConfigError, ValueError, NotImplementedError, OSError) as exc:
        logger.error("invalid input: {}", exc)
        return 2
    if config.parallel is not None:  # under torchrun (runnerkit/parallel/serving.py, docs/multi_gpu.md)
        if os.environ.get("RANK", "0") != "0":  # a follower: no HTTP, runs what rank 0 publishes
            from runnerkit.parallel.serving import follow

            return follow(config, args.log_level)
        if args.on_shutdown == "cancel":
            logger.error("invalid input: --on_shutdown cancel with `parallel`: a running job cannot be cancelled "
                         "under `parallel` (every rank would have to stop at the same step); use --on_shutdown finish")
            return 2
    queue = JobQueue(output_dir, args.max_queue, args.keep_jobs,
                     None if args.keep_gib is None else int(args.keep_gib * 2**30))
    state = ServerState(runner=None, queue=queue, metrics=None)
    server = _Server(uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="warning",
                                    timeout_graceful_shutdown=5))
    status = {"exit": 0}
    worker: dict[str, Any] = {}  # "w": the Worker; "leader": rank 0's Leader under `parallel`

    def job_done(job: Job) -> None:
        state.metrics.observe_job(job.status, job.profile)
        state.metrics.queue_depth.set(queue.depth())
        if queue.dead:
            state.metrics.ready.set(0)
            logger.error("runner died: {}; not ready any more", queue.dead)

    def set_phase(phase: str) -> None:
        state.phase = phase
        logger.info("phase: {}", phase)

    def fail(phase: str, exc: BaseException, error_phase: Any = lambda e: None) -> None:
        phase = error_phase(exc) or phase
        state.phase, state.error = "failed", f"{phase} failed: {type(exc).__name__}: {exc}"
        report_failure(f"{phase} failed", exc)
        status["exit"] = 2 if isinstance(exc, INPUT_ERRORS) else 1
        server.should_exit = True

    def new_runner() -> Any:
        """The runner for `config`, after the checks that would otherwise fail every job (ConfigError)."""
        from runnerkit.registry import get_runner_cls

        runner_cls = get_runner_cls(config.model_cls, config.task)
        check_writers(runner_cls, config.task)
        check_default_shape(runner_cls, config, config_source(args))
        try:
            return runner_cls(config)
        except (ValueError, NotImplementedError) as exc:  # the family refuses the config's settings
            raise ConfigError(f"{config_source(args)}: {exc}") from None

    def load() -> None:
        while not server.started and not server.should_exit:  # the port is open before loading starts
            time.sleep(0.05)
        if server.should_exit:
            return
        host, port = _bound_address(server)
        logger.info("listening on http://{}:{} (live: /health/live, ready: /health/ready)", host, port)
        try:  # torch and the model family: seconds; health answers `starting` meanwhile
            from runnerkit.runners.base import error_phase
            from runnerkit.serve.jobs import Worker
            from runnerkit.serve.metrics import Metrics

            if config.parallel is not None:
                start_parallel()  # the group, then the runner, as rank 0 of it
                return
            runner = new_runner()
        except BaseException as exc:  # noqa: BLE001  (reported, then the process stops)
            fail("start", exc)
            return
        state.metrics = Metrics(runner.device)
        state.runner = runner
        runner.on_phase = set_phase
        runner.overlap_writes(args.max_writes_in_flight)

        def setup() -> bool:
            """On the worker thread, before any job: load and warm up there (per-thread CUDA state), then ready."""
            try:
                runner.init_modules()
            except BaseException as exc:  # noqa: BLE001  (reported, then the process stops)
                fail("load", exc, error_phase)
                return False
            state.metrics.load_seconds.set(runner.profiler.phases.get("load_seconds", 0.0))
            state.metrics.warmup_seconds.set((runner.profiler.warmup or {}).get("seconds", 0.0))
            state.metrics.ready.set(1)
            logger.info("ready: accepting jobs (on thread {!r}, which loaded and warmed the runner)",
                        threading.current_thread().name)
            return True

        worker["w"] = w = Worker(runner, queue, job_done, args.save_tensors, setup=setup)
        w.start()

    def start_parallel() -> None:
        """Rank 0 of a parallel server (runnerkit/parallel/serving.py): join the group, build the runner,
        load, warm up and agree with every rank on the job thread, then ready; each job runs in lockstep."""
        from runnerkit.parallel.driver import RankFailed
        from runnerkit.parallel.driver import refuse_launch
        from runnerkit.parallel.group import ParallelSetupError
        from runnerkit.parallel.serving import CANCEL_REFUSED, Leader
        from runnerkit.serve.jobs import Worker
        from runnerkit.serve.metrics import Metrics

        try:
            leader = worker["leader"] = Leader(config, on_failed=group_failed)
        except ParallelSetupError as exc:
            if "RANK" in os.environ:  # torchrun: the same refusal on every rank, logged once; all exit 2
                refuse_launch(exc, config.parallel.timeout_s)
            fail("start", exc)
            return
        except BaseException as exc:  # noqa: BLE001  anything else: exit 1
            fail("start", exc)
            return
        def build() -> Any:
            built = new_runner()
            built.attach_parallel(leader.group)
            return built

        try:  # a failure here is recorded for the followers too (they wait in the start-up agreement)
            runner = leader.phase("load", build)
        except RankFailed:
            return  # group_failed stops the server
        queue.running_cancel_refused = CANCEL_REFUSED
        runner.overlap_writes(args.max_writes_in_flight)  # rank 0 writes, holding the group's output lock
        state.metrics = Metrics(runner.device)
        state.runner = runner
        runner.on_phase = lambda p: set_phase("waiting_for_ranks" if p == "ready" else p)  # ready once all agree

        def setup() -> bool:
            try:
                leader.init(runner)
            except RankFailed:
                return False
            set_phase("ready")
            refusal = default_size_refusal(runner)
            if refusal is not None:
                logger.warning("the config's default size cannot run here: {}; every job must give `size` (the "
                               "others are refused with 422)", refusal)
            state.metrics.load_seconds.set(runner.profiler.phases.get("load_seconds", 0.0))
            state.metrics.warmup_seconds.set((runner.profiler.warmup or {}).get("seconds", 0.0))
            state.metrics.ready.set(1)
            logger.info("ready: all {} ranks warm, accepting jobs", leader.group.world_size)
            return True

        def run_request(request: Any, index: int) -> None:
            leader.run(runner, request, index)

        worker["w"] = w = Worker(runner, queue, job_done, args.save_tensors, setup=setup, run_request=run_request)
        w.start()

    def group_failed(line: str) -> None:
        """A rank failed (`line` names it and the phase): the running job fails with it, the server turns
        not ready and refuses jobs, answers status for --drain_grace seconds, then exits 1 (every rank does)."""
        from runnerkit.serve.jobs import FINAL

        state.phase, state.error = "failed", line
        queue.dead = queue.dead or f"the parallel group ended: {line}"
        queue.close(cancel_running=False)
        if state.metrics is not None:
            state.metrics.ready.set(0)
        job = queue.running
        if job is not None and job.status not in FINAL:  # its worker may be stuck in a collective (NCCL)
            job.completed_at, job.error = time.time(), f"RankFailed: {line}"
            job.status = "failed"
        status["exit"] = 1

        def close_later() -> None:
            time.sleep(args.drain_grace if state.runner is not None else 0.0)
            server.should_exit = True

        threading.Thread(target=close_later, name="runnerkit-group-failed", daemon=True).start()

    stopping = threading.Event()

    def drain() -> None:
        """While HTTP still answers (readiness 503 `stopping`, job status and content served):
        cancel the queued jobs, finish or cancel the running one, then close the port."""
        cancel = args.on_shutdown == "cancel"
        queue.close(cancel_running=cancel)
        w = worker.get("w")
        if w is not None and w.is_alive():
            if queue.running is not None:
                logger.info("shutting down: {} the running job {}", "cancelling" if cancel else "finishing",
                            queue.running.id)
            w.join()
        if worker.get("leader") is not None:  # after the last job: the followers exit
            worker["leader"].stop()
        if args.drain_grace > 0:  # a client polling a job sees its final status before the port closes
            logger.info("jobs ended: answering status for {:g} s more (--drain_grace), then closing the port",
                        args.drain_grace)
            time.sleep(args.drain_grace)
        server.should_exit = True

    def on_signal(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if stopping.is_set():  # a second signal: stop waiting for the running job
            logger.warning("second {}: exiting now (status {})", name, 128 + signum)
            sys.stderr.flush()
            os._exit(128 + signum)
        stopping.set()
        if state.phase in ("starting", "loading", "warming_up", "waiting_for_ranks"):  # nothing served yet: abandon
            logger.info("{} during {}: stopped before serving", name, state.phase)
            sys.stderr.flush()
            os._exit(0)  # the loader thread runs torch code that cannot be joined or interrupted safely
        logger.info("{}: shutting down (not ready; queued jobs are cancelled)", name)
        state.phase = "stopping"
        state.metrics.ready.set(0)
        threading.Thread(target=drain, name="runnerkit-drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loader = threading.Thread(target=load, name="runnerkit-loader", daemon=True)
    loader.start()
    try:
        server.run()  # returns once drained after SIGTERM / Ctrl-C (on_signal), or when loading failed
    except SystemExit:  # uvicorn exits when it cannot listen (it logged why)
        pass
    if status["exit"] and worker.get("leader") is not None:  # the job thread may wait in a collective on a dead rank
        from runnerkit.parallel.driver import exit_now

        with worker["leader"].group.output_lock:  # a job's files being written end first (the writer holds it)
            exit_now(status["exit"])
    if status["exit"]:
        return status["exit"]
    if not server.started:
        logger.error("could not listen on {}:{} (in use, or not an address of this machine)", args.host, args.port)
        return 1
    logger.info("stopped")
    return 0


class _Server:
    """uvicorn's Server without its own signal handling: uvicorn re-raises a captured SIGTERM once
    it has stopped, which would kill the process before the running job is finished or cancelled;
    `serve` installs handlers that only ask the server to stop."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        return Server(config)


def _bound_address(server: Any) -> tuple[str, int]:
    """The (host, port) uvicorn listens on (the real port when --port 0)."""
    for s in getattr(server, "servers", []):
        for sock in getattr(s, "sockets", []):
            host, port = sock.getsockname()[:2]
            return host, port
    return server.config.host, server.config.port


if __name__ == "__main__":
    sys.exit(main())
