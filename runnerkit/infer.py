"""Launch script: `python -m runnerkit.infer` (console script `runnerkit`).

    runnerkit --config_json configs/<family>/<config>.json --prompt "a cat surfing" \
        --save_result_path outputs/cat.mp4 --warmup

One process: validate config and every request -> build runner -> init_modules (load, lock,
warmup once) -> run each request (a failed request is reported with its index, cleaned up, and the
rest still run; each request's files are written on a writer thread while the next request
computes, `--max_writes_in_flight`, runners/writes.py). With `offload.mode` auto (`--offload auto`)
the offload config is planned for every request's shape before loading (planning/planner.py); every
request's shape is then checked against the device's memory (planning/fit.py). Exit status 0 only if
every request succeeded; 2 for invalid input (a request that cannot fit, or no offload plan that
fits, included); 1 otherwise. Input errors (config, request, checkpoint, unsupported mode) are
reported in one line; unexpected errors also print their traceback.

With a `parallel` config the script runs as one rank under `torchrun` (runnerkit/parallel/driver.py,
docs/multi_gpu.md): every rank loads, warms up and serves each request; rank 0 saves and reports;
a failure on any rank ends every rank with status 1, invalid input every rank with status 2 (reported
once, by rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from typing import TYPE_CHECKING

from loguru import logger

from runnerkit.cli_common import INPUT_ERRORS, check_writable, config_source, report_failure, under_torchrun
from runnerkit.interrupts import (enable_fault_tracebacks, exit_status, install_sigterm_handler, interrupted_line,
                                  restore_sigterm_default)
from runnerkit.overrides import add_flags, config_overrides, request_flags
from runnerkit.progress import PLOT_EXTRA, PROGRESS_MODES, StageBars, install_progress, missing_plot_module

if TYPE_CHECKING:
    from runnerkit.config import RequestConfig
    from runnerkit.runners.base import BaseRunner

# torch, pydantic and the families are imported inside `run`, after the arguments are parsed (a
# typo or --help answers at once) and the signal handlers are in place (Ctrl-C or SIGTERM during
# start-up imports ends with one line, not a traceback).

LOG_FORMAT = "<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}"
REQUEST_FLAGS = request_flags("launch")  # the single request's flags (runnerkit/overrides.py)


def build_parser() -> argparse.ArgumentParser:
    """The launch script's flags. Light: the `--model_cls` choices are read from the family sources
    (`registry.model_cls_names`), so a typo or --help answers without importing torch."""
    from runnerkit.registry import model_cls_names

    p = argparse.ArgumentParser(
        prog="runnerkit", description="Run a runnerkit generation pipeline (load, optional warmup, requests).",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,  # `--infer_step 3` is a typo
        epilog="`runnerkit serve --help`: the HTTP server (jobs, progress, cancellation) over the same configs.\n"
        "`runnerkit plan --help`: the memory plan a config would get on this machine, before downloading.\n\n"
               "example:\n  runnerkit --config_json configs/<family>/<config>.json --prompt 'a corgi surfing' "
               "--save_result_path outputs/corgi.mp4 --warmup\n\n"
               "exit status: 0 all requests succeeded; 1 a request failed (the others still ran) or an "
               "unexpected error; 2 invalid input (config, request, checkpoint, unsupported mode, a request or warmup "
               "shape whose estimated memory exceeds the device's: config memory.limit_gib / memory.check_fit); "
               "130 Ctrl-C, 143 SIGTERM")
    add_flags(p, "launch", ("model_cls", "task", "model_path", "text_encoder_path", "upsampler_path"),
              choices={"model_cls": model_cls_names()})
    p.add_argument("--config_json", help="JSON runner config (CLI flags override its values)")
    add_flags(p, "launch", (*request_flags("launch"), "infer_steps", "device", "offload"))
    p.add_argument("--log_level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="least severe log messages shown (default INFO)")
    add_flags(p, "launch", ("warmup",))
    p.add_argument("--profile_json", help="write the profile report (warmup, per-request stages and steps) here")
    p.add_argument("--requests", help=".jsonl file, one request per line (excludes the single-request flags)")
    p.add_argument("--max_writes_in_flight", type=int, default=1, metavar="N",
                   help="requests whose files (mp4 encode, png, sidecar, tensors) a writer thread may still be "
                        "writing while the next request computes (default 1; 0: written inside each request, "
                        "as before); a request is reported done once its files are written")
    p.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                   help="a bar per denoise stage with steps and ETA on stderr; auto (default): only when stderr is a "
                        "terminal; never on torchrun ranks other than 0 (runnerkit/progress.py)")
    p.add_argument("--plot_steps", metavar="PATH.png",
                   help=f"write a PNG of every request's per-step seconds (warmup excluded); needs {PLOT_EXTRA}")
    return p


def parse_inputs(args: argparse.Namespace) -> tuple[Any, list[RequestConfig]]:
    """Validate the runner config and every request before anything is loaded.

    Raises:
        ConfigError: invalid config or request, conflicting flags, unwritable or repeated output paths.
    """
    from pydantic import ValidationError

    from runnerkit.config import (ConfigError, RequestConfig, format_validation_error, load_runner_config,
                                  lora_flag_fields)
    from runnerkit.admission import Refused, admit, check_default_shape
    from runnerkit.registry import get_runner_cls
    from runnerkit.runners.installers import check_parallel_modes
    overrides = config_overrides(args, "launch")
    if args.config_json is None and args.model_cls is None:
        raise ConfigError("give --config_json FILE (or at least --model_cls and --model_path); see --help")
    config = load_runner_config(args.config_json, overrides, flags={"offload.mode": "--offload"})
    try:
        runner_cls = get_runner_cls(config.model_cls, config.task)
        check_parallel_modes(config, runner_cls.PARALLEL_MODES, runner_cls.__name__)
    except (ValueError, NotImplementedError) as exc:
        raise ConfigError(str(exc)) from None
    if config.synthetic_checkpoint is not None and not config.model_path:  # before loading: the cache folder
        from runnerkit.runners.checkpoints import check_synthetic_cache

        try:
            check_synthetic_cache()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    given = {k: getattr(args, k) for k in REQUEST_FLAGS if getattr(args, k) is not None}
    if args.requests:
        if given:
            raise ConfigError(f"--requests cannot be combined with single-request flags {sorted('--' + k for k in given)}: "
                              "put them on the lines of the requests file")
        requests = requests_from_file(args.requests, runner_cls, config)
    else:
        if "prompt" not in given:
            raise ConfigError("--prompt is required (or --requests FILE.jsonl)")
        if "lora" in given:
            try:  # validated with the request below: its errors name lora[i].strength
                given["lora"] = [lora_flag_fields(x) for x in given["lora"]]
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        try:
            requests = [RequestConfig.model_validate(given)]
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, "request flags")) from None
    check_default_shape(runner_cls, config, config_source(args))
    inputs = {os.path.realpath(p): flag for p, flag in ((args.config_json, "--config_json"), (args.requests, "--requests"))
              if p is not None}
    outputs: dict[str, str] = {}  # real path -> who writes it

    def claim(path: str, field: str, owner: str) -> None:
        check_writable(path, field)
        key = os.path.realpath(os.path.expanduser(path))
        if key in inputs:
            raise ConfigError(f"`{field}` {path!r} ({owner}) would overwrite the {inputs[key]} input file; "
                              "choose another output path")
        if key in outputs:
            raise ConfigError(f"`{field}` {path!r} ({owner}) is also written by {outputs[key]}: every output file "
                              "(media, its .json sidecar, tensor, profile) needs its own path")
        outputs[key] = f"{field} of {owner}"

    if args.profile_json:
        claim(args.profile_json, "--profile_json", "the run")
    if args.plot_steps:
        check_plot_flag(args.plot_steps, config)
        claim(args.plot_steps, "--plot_steps", "the run")
    try:  # fields (shape, images, adapters' files, suffix), output paths, media writer (runnerkit/admission.py)
        requests = admit(runner_cls, config, requests, source="launch", claim=claim)
    except Refused as exc:
        if exc.rule != "fields":
            raise exc.cause from None
        problems = [f"request on {requests[index].source}: {error}" for index, error in exc.problems]
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} of {len(requests)} requests are invalid:\n  " + "\n  ".join(problems)) from None
    return config, requests


def requests_from_file(path: str, runner_cls: Any, config: Any) -> list[Any]:
    """The requests of a `--requests` file. A file with malformed lines is refused naming them together with
    the lines the runner refuses (`validate_request`), in line order: every bad line in one report.

    Raises:
        ConfigError: the file cannot be read, holds no request, or holds invalid lines.
    """
    from runnerkit.config import ConfigError, invalid_lines, read_requests

    requests, bad_lines, lines = read_requests(path)
    if bad_lines:
        for request in requests:
            try:
                runner_cls.validate_request(request, config)
            except ValueError as exc:  # `source` is "line N of 'path'"
                bad_lines.append((int(request.source.split(" ", 2)[1]), f"request on {request.source}: {exc}"))
        raise ConfigError(invalid_lines(bad_lines, lines))
    if not requests:
        raise ConfigError(f"requests file {path!r} holds no request")
    return requests


def check_plot_flag(path: str, config: Any) -> None:
    """Refuse `--plot_steps` before loading: not a .png, matplotlib missing, or a `parallel` run.

    Raises:
        ConfigError: naming the flag, the value and what is allowed.
    """
    from runnerkit.config import ConfigError

    if not path.lower().endswith(".png"):
        raise ConfigError(f"`--plot_steps` {path!r}: the plot is a PNG; give a path ending in .png")
    if missing_plot_module():
        raise ConfigError(f"`--plot_steps` needs {PLOT_EXTRA}; missing: {missing_plot_module()}")
    if config.parallel is not None:
        raise ConfigError("`--plot_steps` is not written under `parallel`; plot the `step_seconds` of --profile_json")


def write_plot(args: argparse.Namespace, runner: BaseRunner) -> bool:
    """Write `--plot_steps` from the run's profile; False if it could not be written."""
    from runnerkit.progress import steps_run, write_step_plot

    try:
        drawn = write_step_plot(args.plot_steps, runner.profiler.report(), steps_run(runner.pipeline.denoise))
        logger.info("step plot of {} request(s) written to {}", drawn, args.plot_steps)
        return True
    except OSError as exc:
        logger.error("could not write --plot_steps {!r}: {}", args.plot_steps, exc)
        return False


def run(args: argparse.Namespace, bars: StageBars | None = None) -> int:
    from runnerkit.config import ConfigError
    from runnerkit.registry import get_runner_cls
    from runnerkit.runners.writes import is_abandoned

    try:
        if args.max_writes_in_flight < 0:
            raise ConfigError(f"`--max_writes_in_flight` must be >= 0 (got {args.max_writes_in_flight}); 0 writes "
                              "each request's files inside the request")
        config, requests = parse_inputs(args)
    except (ConfigError, ValueError, NotImplementedError) as exc:
        if under_torchrun():  # every rank read the same command line: rank 0 alone reports, every rank exits 2
            from runnerkit.config import ParallelConfig
            from runnerkit.parallel.driver import refuse_launch

            refuse_launch(exc, ParallelConfig.model_fields["timeout_s"].default)  # the config's own may be unreadable
        logger.error("invalid input: {}", exc)
        return 2
    if config.parallel is not None:  # under torchrun: one rank of the group (runnerkit/parallel/driver.py)
        from runnerkit.parallel.driver import run_parallel

        def build(c: Any) -> BaseRunner:
            built = get_runner_cls(c.model_cls, c.task)(c)
            built.on_progress = bars  # None on ranks other than 0 (progress_enabled)
            return built

        return run_parallel(args, config, requests, build)
    try:
        runner: BaseRunner = get_runner_cls(config.model_cls, config.task)(config)
    except (ValueError, NotImplementedError) as exc:  # the family refuses the config's settings
        logger.error("invalid input: {}: {}", config_source(args), exc)
        return 2
    runner.on_progress = bars
    failed: list[int] = []

    def request_done(prof: Any, error: BaseException | None) -> None:  # a write on the writer thread may fail
        if error is not None and not is_abandoned(error):
            failed.append(prof.index)
            report_failure(f"request {prof.index} ({requests[prof.index].source}) failed", error)

    runner.on_request_done = request_done
    runner.overlap_writes(args.max_writes_in_flight)
    try:  # before loading: offload.mode auto is planned for every request's shape, then each is checked
        runner.memory_checks.check_requests_fit(requests)
    except (ValueError, NotImplementedError) as exc:  # MemoryFitError; auto without a family estimate
        logger.error("invalid input: {}", exc)
        return 2
    return serve_requests(args, runner, requests, bars, failed)


def serve_requests(args: argparse.Namespace, runner: BaseRunner, requests: list[RequestConfig],
                   bars: StageBars | None, failed: list[int]) -> int:
    """init_modules (load, warmup), the adapters' check, every request in order, then the profile and plot;
    the exit status (`failed`: the indices of failed requests, which the writer thread's reports join)."""
    from runnerkit.runners.base import error_phase
    from runnerkit.runners.writes import close_writer

    profile_failed = False
    try:
        try:
            runner.init_modules()
        except Exception as exc:  # load or warmup: nothing can be served
            report_failure(f"{error_phase(exc) or 'load'} failed", exc)
            return 2 if isinstance(exc, INPUT_ERRORS) else 1
        try:  # once the transformer's layers are known: every request's adapters matched to them
            runner.check_adapters(requests)
        except ValueError as exc:  # runnerkit.lora.LoRAError, naming the file
            logger.error("invalid input: {}", exc)
            return 2
        started = time.perf_counter()
        for index, request in enumerate(requests):
            try:
                runner.run_pipeline(request, index)
            except Exception as exc:
                failed.append(index)
                if bars is not None:  # the failure's lines below the bar's last state, not redrawn around it
                    bars.close()
                report_failure(f"request {index} ({request.source}) failed", exc)
        runner.finish_writes()  # the last requests' files (each request is reported once they are written)
        runner.profiler.phases["requests_seconds"] = round(time.perf_counter() - started, 4)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: nothing more runs; partial files are already removed
        if bars is not None:
            bars.close()
        if runner.writer is not None:  # computed requests' files complete (a second interrupt abandons them)
            close_writer(runner.writer, interrupted=True)
        logger.error("{}", interrupted_line(exc, sum(r.saved for r in runner.profiler.requests), len(requests)))
        return exit_status(exc)
    finally:
        if runner.writer is not None:  # also after an unexpected error: nothing is left half-written
            close_writer(runner.writer)
        if args.profile_json and runner.profiler.phases:  # written once init succeeded, also after a failure
            try:
                runner.profiler.write(args.profile_json)
                logger.info("profile written to {}", args.profile_json)
            except OSError as exc:
                logger.error("could not write --profile_json {!r}: {}", args.profile_json, exc)
                profile_failed = True
        if args.plot_steps and runner.profiler.phases:
            profile_failed = not write_plot(args, runner) or profile_failed
    if failed:  # sorted: a failed write is reported when it ends, after later requests may have failed
        logger.error("{} of {} requests failed: {}", len(failed), len(requests), sorted(failed))
        return 1
    return 1 if profile_failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # `runnerkit serve ...`: the HTTP server (runnerkit/serve/server.py)
        from runnerkit.serve.server import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["plan"]:  # `runnerkit plan ...`, also as `python -m runnerkit.infer plan ...` (README)
        from runnerkit.tools.plan_args import build_parser as plan_parser

        plan_parser().parse_args(argv[1:])  # --help and bad flags are answered before torch loads
        from runnerkit.tools.plan import main as plan_main

        return plan_main(argv[1:])
    logger.remove()
    logger.add(sys.stderr, level="INFO", format=LOG_FORMAT)
    install_sigterm_handler()
    enable_fault_tracebacks()
    try:
        args = build_parser().parse_args(argv)
        if args.log_level != "INFO":
            logger.remove()
            logger.add(sys.stderr, level=args.log_level, format=LOG_FORMAT)
        return run(args, install_progress(args.progress, args.log_level, LOG_FORMAT))
    except KeyboardInterrupt as exc:  # during start-up imports or argument parsing
        logger.error("interrupted before any request ran")
        return exit_status(exc)
    finally:
        restore_sigterm_default()  # done: a SIGTERM during shutdown ends the process quietly


if __name__ == "__main__":
    sys.exit(main())
