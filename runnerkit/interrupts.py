"""SIGTERM handled like Ctrl-C: both stop the run through the same cleanup path.

`docker stop`, Kubernetes and systemd send SIGTERM; Python's default would kill the process
without running any `finally`, leaving temporary files behind. `install_sigterm_handler` makes
SIGTERM raise `Terminated`, a `KeyboardInterrupt`, so every `finally`/cleanup that handles
Ctrl-C also handles it; the launch script then exits 143 (128 + SIGTERM) instead of 130.

Only the main thread gets the `KeyboardInterrupt`. The result writer's thread (runnerkit/writer.py)
is never interrupted: the launch script completes the files of requests already computed after the
first signal and abandons them after a second (runners/writes.py `close_writer`), so a write in
flight ends complete or with its temporary files removed, never half-written.

Fatal signals (SIGBUS, SIGSEGV, ...) cannot be recovered from in Python; `enable_fault_tracebacks`
makes the launch script print every thread's Python traceback before the process dies of one, so
such a death is not silent: e.g. the mmap disk reader's residual race, a checkpoint file cut
while a tensor is copied out of its mapping (runnerkit/offload/disk.py), ends in the reader's `_read`.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from types import FrameType


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated("SIGTERM")


def install_sigterm_handler() -> None:
    """Make SIGTERM raise `Terminated` in the main thread (call from the main thread)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def restore_sigterm_default() -> None:
    """SIGTERM back to the default action (end the process, exit 143), once the work is done and
    written: a SIGTERM during interpreter shutdown then ends the process quietly instead of
    raising `Terminated` inside atexit callbacks (a traceback that looks like a crash)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def exit_status(exc: KeyboardInterrupt) -> int:
    """143 for SIGTERM, 130 for Ctrl-C (SIGINT), as shells report them."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)


def interrupted_line(exc: KeyboardInterrupt, finished: int, total: int) -> str:
    """The launch script's line for an interrupted run: the signal, the phase it hit and how many
    requests finished (`interrupted (SIGTERM during request 1); 1 of 3 requests finished`)."""
    phase = getattr(exc, "runnerkit_phase", None)  # runners.base.error_phase
    return (f"interrupted ({'SIGTERM' if exit_status(exc) == 143 else 'Ctrl-C'}{f' during {phase}' if phase else ''}); "
            f"{finished} of {total} requests finished")


def enable_fault_tracebacks() -> None:
    """Print all threads' tracebacks to stderr on a fatal signal (`faulthandler`), unless already
    on (`python -X faulthandler`, pytest). The process still dies of the signal (exit -7 for SIGBUS)."""
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
