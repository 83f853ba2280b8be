"""Run the launch script (or the synthetic-checkpoint tool) and signal the process at one phase.

    python _signal_driver.py PHASE SIGNAL ARGV...     one case, in this process
    python _signal_driver.py --cases CASES.json       many cases, each in a child forked from this one

PHASE: imports | load | warmup | denoise | decode | tensor_write | media_write | synthetic_write, and
tensor_write_inline | media_write_inline (hooked as without the suffix).
The signal is sent with `os.kill` to the process running the case, so Python handles it at its
next bytecode, as it would a signal from outside arriving at that moment. Used by test_signals.py only.

`--cases` runs every case but `imports` (which must start without torch): this process imports
the launch script once, then forks one child per case, at most `parallel` at a time. A child is
a process of its own, as a fresh `python _signal_driver.py PHASE ...` would be from its first
line of `main` on: its own signal dispositions (the defaults, as in a fresh interpreter, until
`main` installs its handlers), working folder, stdout (/dev/null) and stderr (the case's file),
and its exit status is what `main` returns, after the atexit callbacks, as at interpreter exit;
an exception out of `main` prints its traceback and exits 1 (a KeyboardInterrupt ends the child
by SIGINT, as it ends an interpreter). What it saves is one torch import (~5 s of CPU) per case.
CASES.json: {"parallel": N, "results": PATH, "cases": [{"phase", "sig", "argv", "cwd", "stderr"}, ...]};
PATH gets {"PHASE SIG": exit status as `subprocess` reports it (-N: killed by signal N)}.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any


def fire(phase: str, sig: int) -> None:
    sys.stderr.write(f"driver: fired {signal.Signals(sig).name} at {phase}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), sig)


def on_call(owner: Any, name: str, nth: int, phase: str, sig: int, after: bool = False) -> None:
    """Signal on the `nth` call of `owner.name` (before it runs, or right after it returns)."""
    real = getattr(owner, name)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth and not after:
            fire(phase, sig)
        result = real(*args, **kwargs)
        if calls[0] == nth and after:
            fire(phase, sig)
        return result

    setattr(owner, name, wrapped)


class _SignalOnImport(importlib.abc.MetaPathFinder):
    """Signals once, when `torch` is first imported (start-up imports of the launch script)."""

    def __init__(self, sig: int) -> None:
        self.sig = sig

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch":
            sys.meta_path.remove(self)
            fire("imports", self.sig)
        return None


def run_case(phase: str, sig: int, argv: list[str]) -> int:
    """Arm the signal at `phase` and run the tool; returns its exit status."""
    if phase == "imports":
        assert "torch" not in sys.modules
        sys.meta_path.insert(0, _SignalOnImport(sig))
        from runnerkit.infer import main as infer_main

        return infer_main(argv)
    if phase == "synthetic_write":
        from runnerkit import synthetic
        from runnerkit.tools.synth_checkpoint import main as synth_main

        on_call(synthetic, "save_file", 1, phase, sig, after=True)
        return synth_main(argv)

    from runnerkit import media
    from runnerkit.infer import main as infer_main
    from runnerkit.models.wan.runner import WanT2VRunner

    if phase == "load":
        on_call(WanT2VRunner, "build_vae", 1, phase, sig)
    elif phase == "warmup":
        on_call(WanT2VRunner, "run_step", 1, phase, sig)  # the first step ever run is warmup's
    elif phase == "denoise":
        on_call(WanT2VRunner, "run_step", 4, phase, sig)  # 2 steps per request: request 1, step 2
    elif phase == "decode":
        on_call(WanT2VRunner, "run_vae_decoder", 2, phase, sig)
    elif phase in ("tensor_write", "tensor_write_inline"):  # _inline: the launch flags hold --max_writes_in_flight 0
        on_call(media, "save_file", 2, phase, sig, after=True)
    elif phase in ("media_write", "media_write_inline"):
        on_call(media, "save_media", 2, phase, sig, after=True)
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    return infer_main(argv)


def _child(case: dict[str, Any]) -> None:
    """In a forked child: the case's folder and stderr, then `run_case`, then exit as an interpreter would."""
    os.chdir(case["cwd"])
    err = os.open(case["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    out = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    status = 1
    try:
        try:
            status = run_case(case["phase"], getattr(signal, case["sig"]), case["argv"])
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                status = exc.code or 0
            else:  # as the interpreter does: the message to stderr, exit 1
                print(exc.code, file=sys.stderr)
                status = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
            traceback.print_exc()
            status = 1
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run_cases(spec_path: str) -> int:
    """Fork one child per case (never `imports`), `parallel` at a time; write their exit statuses."""
    spec = json.loads(open(spec_path).read())
    import runnerkit.infer  # noqa: F401 - the imports every child shares
    import runnerkit.media  # noqa: F401
    import runnerkit.models.wan.runner  # noqa: F401
    import runnerkit.synthetic  # noqa: F401
    import runnerkit.tools.synth_checkpoint  # noqa: F401

    # a thread of this process would not exist in the children (and could hold a lock they need)
    assert threading.active_count() == 1, threading.enumerate()
    pending = list(spec["cases"])
    assert all(case["phase"] != "imports" for case in pending), "imports cases start without torch: run them alone"
    running: dict[int, str] = {}
    statuses: dict[str, int] = {}
    while pending or running:
        while pending and len(running) < spec["parallel"]:
            case = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(case)
            running[pid] = f"{case['phase']} {case['sig']}"
        pid, wait_status = os.wait()
        statuses[running.pop(pid)] = os.waitstatus_to_exitcode(wait_status)
    with open(spec["results"], "w") as f:
        json.dump(statuses, f)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--cases":
        sys.exit(run_cases(sys.argv[2]))
    sys.exit(run_case(sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3:]))
