"""Launch script: `python -m runnerkit.infer` (console script `runnerkit`).

    runnerkit --config_json configs/wan/wan_t2v_tiny.json --prompt "a cat surfing" \
        --save_result_path outputs/cat.mp4 --warmup

One process: validate config and every request -> build runner -> init_modules (load, lock,
warmup once) -> run each request (a failed request is reported with its index, cleaned up, and the
rest still run). Exit status 0 only if every request succeeded; 2 for invalid input; 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loguru import logger
from pydantic import ValidationError

from runnerkit.config import ConfigError, RequestConfig, format_validation_error, load_requests, load_runner_config
from runnerkit.registry import get_runner_cls, load_families
from runnerkit.runners.base import BaseRunner, error_phase

REQUEST_FLAGS = ("prompt", "negative_prompt", "image_path", "last_frame_path", "seed", "target_height",
                 "target_width", "target_video_length", "save_result_path", "save_tensor_path")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runnerkit", description="Run a runnerkit generation pipeline.")
    p.add_argument("--model_cls", choices=sorted(load_families()), help="registered model family")
    p.add_argument("--task", help="task of the model family, e.g. t2v")
    p.add_argument("--model_path", help="checkpoint folder (runnerkit, original Wan, or diffusers layout)")
    p.add_argument("--config_json", help="JSON runner config (CLI flags override its values)")
    p.add_argument("--prompt")
    p.add_argument("--negative_prompt")
    p.add_argument("--image_path")
    p.add_argument("--last_frame_path")
    p.add_argument("--seed", type=int)
    p.add_argument("--target_height", type=int)
    p.add_argument("--target_width", type=int)
    p.add_argument("--target_video_length", type=int, help="frames; 4n+1 for Wan")
    p.add_argument("--save_result_path", help=".mp4 video or .png image (+ sidecar .json)")
    p.add_argument("--save_tensor_path", help=".safetensors: key 'video' float32 [C, F, H, W] in [-1, 1]")
    p.add_argument("--warmup", action="store_true", help="run the one-time warmup before the first request")
    p.add_argument("--profile_json", help="write the profile report (warmup, per-request stages and steps) here")
    p.add_argument("--requests", help=".jsonl file, one request per line (excludes the single-request flags)")
    return p


def parse_inputs(args: argparse.Namespace) -> tuple[Any, list[RequestConfig]]:
    """Validate the runner config and every request before anything is loaded.

    Raises:
        ConfigError: invalid config or request, or conflicting flags.
    """
    overrides = {"model_cls": args.model_cls, "task": args.task, "model_path": args.model_path,
                 "warmup": True if args.warmup else None}
    config = load_runner_config(args.config_json, overrides)
    runner_cls = get_runner_cls(config.model_cls)
    given = {k: getattr(args, k) for k in REQUEST_FLAGS if getattr(args, k) is not None}
    if args.requests:
        if given:
            raise ConfigError(f"--requests cannot be combined with single-request flags {sorted('--' + k for k in given)}: "
                              "put them on the lines of the requests file")
        requests = load_requests(args.requests)
    else:
        if "prompt" not in given:
            raise ConfigError("--prompt is required (or --requests FILE.jsonl)")
        try:
            requests = [RequestConfig.model_validate(given)]
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, "request flags")) from None
    for n, req in enumerate(requests):
        try:
            runner_cls.validate_shape(req.target_height or config.target_height, req.target_width or config.target_width,
                                      req.target_video_length or config.target_video_length)
        except ValueError as exc:
            raise ConfigError(f"request {n}: {exc}") from None
    return config, requests


def run(args: argparse.Namespace) -> int:
    try:
        config, requests = parse_inputs(args)
        runner: BaseRunner = get_runner_cls(config.model_cls)(config)
    except (ConfigError, ValueError, NotImplementedError) as exc:
        logger.error("invalid input: {}", exc)
        return 2
    try:
        runner.init_modules()
    except Exception as exc:  # load or warmup: nothing can be served
        phase = error_phase(exc) or "load"
        logger.error("{} failed: {}: {}", phase, type(exc).__name__, exc)
        logger.opt(exception=exc).debug("traceback")
        return 2 if isinstance(exc, (ValueError, NotImplementedError)) else 1
    failed = []
    for index, request in enumerate(requests):
        try:
            runner.run_pipeline(request, index)
        except Exception as exc:
            failed.append(index)
            logger.error("request {} failed: {}: {}", index, type(exc).__name__, exc)
            logger.opt(exception=exc).debug("traceback")
    if args.profile_json:
        runner.profiler.write(args.profile_json)
        logger.info("profile written to {}", args.profile_json)
    if failed:
        logger.error("{} of {} requests failed: {}", len(failed), len(requests), failed)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}")
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
