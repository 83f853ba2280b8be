"""What the launch script (infer.py) and the server (serve/server.py) share: which errors are the
user's input, their one-line report, and the check that an output path can be written.

Light on purpose (loguru and the standard library only): both entry points import it before
torch, and neither imports the other.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from loguru import logger

from runnerkit.overrides import OVERRIDES

INPUT_ERRORS = (ValueError, NotImplementedError, OSError)  # bad config, request, checkpoint files, modes
#: Failures whose message says all there is (a traceback adds nothing) but that are not the input's:
#: non-finite latents (`runners.default.check_finite_latents`). Exit status 1, one line.
DIAGNOSED_ERRORS = (FloatingPointError,)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The environment torchrun gives every rank; a process without all of it is not a rank of a group."""


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun launch (its whole environment is present)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def in_stage(exc: BaseException) -> str:
    """' in stage NAME' for an exception raised inside a pipeline stage (`Profiler.stage` tags it), else ''."""
    stage = getattr(exc, "runnerkit_stage", None)
    return f" in stage {stage}" if stage else ""


def report_failure(what: str, exc: BaseException) -> None:
    """One clear line for input errors and diagnosed failures (their traceback at DEBUG), naming the pipeline
    stage it was raised in where known (`in_stage`); unexpected errors also get their traceback (and notes)."""
    what += in_stage(exc)
    if isinstance(exc, INPUT_ERRORS + DIAGNOSED_ERRORS):
        logger.error("{}: {}: {}", what, type(exc).__name__, exc)
        logger.opt(exception=exc).debug("traceback")
    else:
        logger.opt(exception=exc).error("{}: {}: {}", what, type(exc).__name__, exc)


def check_writable(path: str, field: str) -> None:
    """Raise ConfigError unless `path` can be created as a file (checked before any loading)."""
    from runnerkit.config import ConfigError

    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise ConfigError(f"`{field}` {path!r} is a folder; give a file path")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"`{field}` {path!r} cannot be created: {str(parent)!r} is a file, not a folder")
    # Create and remove a probe file: permission bits alone pass for root and say nothing of
    # read-only mounts or pseudo file systems such as /proc.
    probe = parent / f".runnerkit-probe-{os.getpid()}"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ConfigError(f"`{field}` {path!r} cannot be created: {str(parent)!r} is not writable ({reason})") from None
        # e.g. /proc: writable by root, yet no new file can exist there (ENOENT)
        raise ConfigError(f"`{field}` {path!r} cannot be created in {str(parent)!r}: that folder cannot hold new files "
                          f"({reason})") from None


#: Runner-config flags of the launch script and the server (argparse attribute -> flag; runnerkit/overrides.py).
CONFIG_FLAGS = {row.name: row.flag for row in OVERRIDES if row.key is not None}


def config_source(args: Any) -> str:
    """Where the runner config came from, for messages: `config FILE`, plus the command-line flags
    that overrode its fields (`config c.json with --device 'cuda'`), or the flags alone."""
    given = [f"{flag} {value!r}" if value is not True else flag
             for attr, flag in CONFIG_FLAGS.items() if (value := getattr(args, attr, None)) not in (None, False)]
    path = getattr(args, "config_json", None)
    if path is None:
        return "config from the command-line flags" + (f" ({', '.join(given)})" if given else "")
    return f"config {path}" + (f" with {', '.join(given)}" if given else "")
