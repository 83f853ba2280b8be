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

The process is one `Server` (load_config -> run: the port, the loader thread, uvicorn until drained);
its flags that override the config come from the override table (runnerkit/overrides.py).

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

from runnerkit.overrides import OVERRIDES, add_flags, config_overrides

#: Seconds the port stays open at shutdown after the last job ended (longer than a client's poll interval:
#: the openai client polls every second).
DRAIN_GRACE_S = 3.0
LOG_FORMAT = "<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}"


def build_parser() -> argparse.ArgumentParser:
    from runnerkit.registry import model_cls_names  # read from the family sources: no torch

    p = argparse.ArgumentParser(prog="runnerkit serve", description=__doc__, allow_abbrev=False,  # no prefix guessing
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_json", required=True, help="runner config (JSON), as for the launch script")
    add_flags(p, "serve", (row.name for row in OVERRIDES if "serve" in row.where),  # runnerkit/overrides.py
              choices={"model_cls": model_cls_names()})
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--max_queue", type=int, default=16, help="jobs that may wait; more get HTTP 429 (default 16)")
    p.add_argument("--output_dir", default="outputs/serve", help="where each job's files go (default outputs/serve)")
    p.add_argument("--keep_jobs", type=int, default=100,
                   help="finished jobs whose files are kept; older ones are deleted (default 100; 0: only the newest "
                        "result, until the next job replaces it)")
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
    """Serve until a shutdown (see the module docstring); the exit status."""
    server = Server(args)
    status = server.load_config()
    return status if status is not None else server.run()


class Server:
    """One `runnerkit serve` process: the config and output folder checked (`load_config`), the port opened
    and the runner loaded and warmed behind it (`run`, `load`, on the loader thread), jobs run by a worker
    thread once ready, and a signal drains it (`on_signal` -> `drain`, on the drain thread).

    Threads: the main thread runs uvicorn; `runnerkit-loader` builds the runner and starts the worker, which
    loads and warms it up (per-thread CUDA state) and then runs the jobs; `runnerkit-drain` waits for the
    running job at shutdown; `runnerkit-group-failed` closes the port after a rank failed (`parallel`).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.exit = 0  # the process's exit status once uvicorn returns
        self.stopping = threading.Event()  # the first signal arrived
        self.worker: Any = None  # the job Worker (runnerkit/serve/jobs.py)
        self.leader: Any = None  # rank 0's Leader under `parallel`
        self.config: Any = None
        self.state: Any = None
        self.queue: Any = None
        self.http: Any = None  # uvicorn's server (`_Server`)

    # ---- start-up: checks, then the port, then the runner behind it ------------------------------------------
    def load_config(self) -> int | None:
        """Check the web stack, the config and `--output_dir`, and make the app; the exit status of a refusal
        (2), a follower rank's status (`parallel`, rank > 0), or None to serve."""
        args = self.args
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
        from runnerkit.cli_common import check_writable
        from runnerkit.config import ConfigError, load_runner_config
        from runnerkit.registry import check_model_cls, check_task
        from runnerkit.serve.app import ServerState, create_app
        from runnerkit.serve.jobs import JobQueue

        try:
            self.config = load_runner_config(args.config_json, config_overrides(args, "serve"),
                                             flags={"offload.mode": "--offload"})
            check_model_cls(self.config.model_cls)  # from the family sources: before the port opens
            check_task(self.config.model_cls, self.config.task)
            output_dir = prepare_output_dir(args.output_dir)
            check_writable(str(output_dir / "probe.mp4"), "--output_dir")
        except (ConfigError, ValueError, NotImplementedError, OSError) as exc:
            logger.error("invalid input: {}", exc)
            return 2
        if self.config.parallel is not None:  # under torchrun (runnerkit/parallel/serving.py, docs/multi_gpu.md)
            if os.environ.get("RANK", "0") != "0":  # a follower: no HTTP, runs what rank 0 publishes
                from runnerkit.parallel.serving import follow

                return follow(self.config, args.log_level)
            if args.on_shutdown == "cancel":
                logger.error("invalid input: --on_shutdown cancel with `parallel`: a running job cannot be cancelled "
                             "under `parallel` (every rank would have to stop at the same step); use --on_shutdown "
                             "finish")
                return 2
        self.queue = JobQueue(output_dir, args.max_queue, args.keep_jobs,
                              None if args.keep_gib is None else int(args.keep_gib * 2**30))
        self.state = ServerState(runner=None, queue=self.queue, metrics=None)
        self.http = _Server(uvicorn.Config(create_app(self.state), host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=5))
        return None

    def run(self) -> int:
        """Install the signal handlers, start the loader thread, serve HTTP until drained or failed; the exit status."""
        args, http = self.args, self.http
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        threading.Thread(target=self.load, name="runnerkit-loader", daemon=True).start()
        try:
            http.run()  # returns once drained after SIGTERM / Ctrl-C (on_signal), or when loading failed
        except SystemExit:  # uvicorn exits when it cannot listen (it logged why)
            pass
        if self.exit and self.leader is not None:  # the job thread may wait in a collective on a dead rank
            from runnerkit.parallel.driver import exit_now

            with self.leader.group.output_lock:  # a job's files being written end first (the writer holds it)
                exit_now(self.exit)
        if self.exit:
            return self.exit
        if not http.started:
            logger.error("could not listen on {}:{} (in use, or not an address of this machine)", args.host, args.port)
            return 1
        logger.info("stopped")
        return 0

    def load(self) -> None:
        """On the loader thread, once the port is open: build the runner and start the worker, which loads and
        warms it up (`setup`); under `parallel`, `start_parallel`."""
        http = self.http
        while not http.started and not http.should_exit:  # the port is open before loading starts
            time.sleep(0.05)
        if http.should_exit:
            return
        host, port = _bound_address(http)
        logger.info("listening on http://{}:{} (live: /health/live, ready: /health/ready)", host, port)
        try:  # torch and the model family: seconds; health answers `starting` meanwhile
            from runnerkit.runners.base import error_phase  # noqa: F401  (torch: imported here, reported as `start`)
            from runnerkit.serve.jobs import Worker
            from runnerkit.serve.metrics import Metrics  # noqa: F401

            if self.config.parallel is not None:
                self.start_parallel()  # the group, then the runner, as rank 0 of it
                return
            runner = self.new_runner()
        except BaseException as exc:  # noqa: BLE001  (reported, then the process stops)
            self.fail("start", exc)
            return
        self.attach(runner, self.set_phase)
        self.worker = Worker(runner, self.queue, self.job_done, self.args.save_tensors, setup=self.setup)
        self.worker.start()

    def new_runner(self) -> Any:
        """The runner for the config, after the checks that would otherwise fail every job (ConfigError)."""
        from runnerkit.admission import check_default_shape
        from runnerkit.cli_common import config_source
        from runnerkit.config import ConfigError
        from runnerkit.registry import get_runner_cls

        config, args = self.config, self.args
        runner_cls = get_runner_cls(config.model_cls, config.task)
        check_writers(runner_cls, config.task)
        check_default_shape(runner_cls, config, config_source(args))
        try:
            return runner_cls(config)
        except (ValueError, NotImplementedError) as exc:  # the family refuses the config's settings
            raise ConfigError(f"{config_source(args)}: {exc}") from None

    def attach(self, runner: Any, on_phase: Any) -> None:
        """Make `runner` the served one: its metrics, its phases reported as the server's."""
        from runnerkit.serve.metrics import Metrics

        self.state.metrics = Metrics(runner.device)
        self.state.runner = runner
        runner.on_phase = on_phase
        runner.overlap_writes(self.args.max_writes_in_flight)

    def setup(self) -> bool:
        """On the worker thread, before any job: load and warm up there (per-thread CUDA state), then ready."""
        from runnerkit.runners.base import error_phase

        runner = self.state.runner
        try:
            runner.init_modules()
        except BaseException as exc:  # noqa: BLE001  (reported, then the process stops)
            self.fail("load", exc, error_phase)
            return False
        self.ready()
        logger.info("ready: accepting jobs (on thread {!r}, which loaded and warmed the runner)",
                    threading.current_thread().name)
        return True

    def ready(self) -> None:
        """The load and warmup metrics, then readiness."""
        runner, metrics = self.state.runner, self.state.metrics
        metrics.load_seconds.set(runner.profiler.phases.get("load_seconds", 0.0))
        metrics.warmup_seconds.set((runner.profiler.warmup or {}).get("seconds", 0.0))
        metrics.ready.set(1)

    # ---- under `parallel`: rank 0 (runnerkit/parallel/serving.py) -----------------------------------------------
    def start_parallel(self) -> None:
        """Rank 0 of a parallel server: join the group, build the runner, load, warm up and agree with every
        rank on the job thread, then ready; each job runs in lockstep."""
        from runnerkit.parallel.driver import RankFailed, refuse_launch
        from runnerkit.parallel.group import ParallelSetupError
        from runnerkit.parallel.serving import CANCEL_REFUSED, Leader
        from runnerkit.serve.jobs import Worker

        try:
            self.leader = leader = Leader(self.config, on_failed=self.group_failed)
        except ParallelSetupError as exc:
            if "RANK" in os.environ:  # torchrun: the same refusal on every rank, logged once; all exit 2
                refuse_launch(exc, self.config.parallel.timeout_s)
            self.fail("start", exc)
            return
        except BaseException as exc:  # noqa: BLE001  anything else: exit 1
            self.fail("start", exc)
            return

        def build() -> Any:
            built = self.new_runner()
            built.attach_parallel(leader.group)
            return built

        try:  # a failure here is recorded for the followers too (they wait in the start-up agreement)
            runner = leader.phase("load", build)
        except RankFailed:
            return  # group_failed stops the server
        self.queue.running_cancel_refused = CANCEL_REFUSED
        # rank 0 writes, holding the group's output lock; ready once all agree
        self.attach(runner, lambda p: self.set_phase("waiting_for_ranks" if p == "ready" else p))
        self.worker = Worker(runner, self.queue, self.job_done, self.args.save_tensors, setup=self.setup_parallel,
                             run_request=lambda request, index: leader.run(runner, request, index))
        self.worker.start()

    def setup_parallel(self) -> bool:
        """On the job thread: every rank loads and warms up (`Leader.init`), then ready."""
        from runnerkit.parallel.driver import RankFailed

        runner = self.state.runner
        try:
            self.leader.init(runner)
        except RankFailed:
            return False
        self.set_phase("ready")
        refusal = default_size_refusal(runner)
        if refusal is not None:
            logger.warning("the config's default size cannot run here: {}; every job must give `size` (the "
                           "others are refused with 422)", refusal)
        self.ready()
        logger.info("ready: all {} ranks warm, accepting jobs", self.leader.group.world_size)
        return True

    def group_failed(self, line: str) -> None:
        """A rank failed (`line` names it and the phase): the running job fails with it, the server turns
        not ready and refuses jobs, answers status for --drain_grace seconds, then exits 1 (every rank does)."""
        from runnerkit.serve.jobs import FINAL

        state, queue = self.state, self.queue
        state.phase, state.error = "failed", line
        queue.dead = queue.dead or f"the parallel group ended: {line}"
        queue.close(cancel_running=False)
        if state.metrics is not None:
            state.metrics.ready.set(0)
        job = queue.running
        if job is not None and job.status not in FINAL:  # its worker may be stuck in a collective (NCCL)
            job.completed_at, job.error = time.time(), f"RankFailed: {line}"
            job.status = "failed"
        self.exit = 1

        def close_later() -> None:
            time.sleep(self.args.drain_grace if state.runner is not None else 0.0)
            self.http.should_exit = True

        threading.Thread(target=close_later, name="runnerkit-group-failed", daemon=True).start()

    # ---- jobs, phases, failures ---------------------------------------------------------------------------------
    def job_done(self, job: Any) -> None:
        metrics, queue = self.state.metrics, self.queue
        metrics.observe_job(job.status, job.profile)
        metrics.queue_depth.set(queue.depth())
        if queue.dead:
            metrics.ready.set(0)
            logger.error("runner died: {}; not ready any more", queue.dead)

    def set_phase(self, phase: str) -> None:
        self.state.phase = phase
        logger.info("phase: {}", phase)

    def fail(self, phase: str, exc: BaseException, error_phase: Any = lambda e: None) -> None:
        """Start-up failed in `phase` (or the phase `error_phase` finds in `exc`): reported, exit 2 for input
        errors, else 1; the port closes."""
        from runnerkit.cli_common import INPUT_ERRORS, report_failure

        phase = error_phase(exc) or phase
        self.state.phase, self.state.error = "failed", f"{phase} failed: {type(exc).__name__}: {exc}"
        report_failure(f"{phase} failed", exc)
        self.exit = 2 if isinstance(exc, INPUT_ERRORS) else 1
        self.http.should_exit = True

    # ---- shutdown -----------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """While HTTP still answers (readiness 503 `stopping`, job status and content served):
        cancel the queued jobs, finish or cancel the running one, then close the port."""
        args, queue = self.args, self.queue
        cancel = args.on_shutdown == "cancel"
        queue.close(cancel_running=cancel)
        w = self.worker
        if w is not None and w.is_alive():
            if queue.running is not None:
                logger.info("shutting down: {} the running job {}", "cancelling" if cancel else "finishing",
                            queue.running.id)
            w.join()
        if self.leader is not None:  # after the last job: the followers exit
            self.leader.stop()
        if args.drain_grace > 0:  # a client polling a job sees its final status before the port closes
            logger.info("jobs ended: answering status for {:g} s more (--drain_grace), then closing the port",
                        args.drain_grace)
            time.sleep(args.drain_grace)
        self.http.should_exit = True

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM / SIGINT: the first drains (or exits 0 before serving); a second exits at once (128 + signum)."""
        name = signal.Signals(signum).name
        if self.stopping.is_set():  # a second signal: stop waiting for the running job
            logger.warning("second {}: exiting now (status {})", name, 128 + signum)
            sys.stderr.flush()
            os._exit(128 + signum)
        self.stopping.set()
        state = self.state
        if state.phase in ("starting", "loading", "warming_up", "waiting_for_ranks"):  # nothing served yet: abandon
            logger.info("{} during {}: stopped before serving", name, state.phase)
            sys.stderr.flush()
            os._exit(0)  # the loader thread runs torch code that cannot be joined or interrupted safely
        logger.info("{}: shutting down (not ready; queued jobs are cancelled)", name)
        state.phase = "stopping"
        state.metrics.ready.set(0)
        threading.Thread(target=self.drain, name="runnerkit-drain", daemon=True).start()


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
