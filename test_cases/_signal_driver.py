"""Run the launch script (or the synthetic-checkpoint tool) and signal this process at one phase.

    python _signal_driver.py PHASE SIGNAL ARGV...

PHASE: imports | load | warmup | denoise | decode | tensor_write | media_write | synthetic_write.
The signal is sent with `os.kill` to this process, so Python handles it at its next bytecode, as
it would a signal from outside arriving at that moment. Used by test_signals.py only.
"""

from __future__ import annotations

import importlib.abc
import os
import signal
import sys
from typing import Any

PHASE, SIG, ARGV = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3:]


def fire() -> None:
    sys.stderr.write(f"driver: fired {signal.Signals(SIG).name} at {PHASE}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), SIG)


def on_call(owner: Any, name: str, nth: int, after: bool = False) -> None:
    """Signal on the `nth` call of `owner.name` (before it runs, or right after it returns)."""
    real = getattr(owner, name)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth and not after:
            fire()
        result = real(*args, **kwargs)
        if calls[0] == nth and after:
            fire()
        return result

    setattr(owner, name, wrapped)


class _SignalOnImport(importlib.abc.MetaPathFinder):
    """Signals once, when `torch` is first imported (start-up imports of the launch script)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch":
            sys.meta_path.remove(self)
            fire()
        return None


if PHASE == "synthetic_write":
    from runnerkit import synthetic
    from runnerkit.tools.synth_checkpoint import main

    on_call(synthetic, "save_file", 1, after=True)
    sys.exit(main(ARGV))

if PHASE == "imports":
    assert "torch" not in sys.modules
    sys.meta_path.insert(0, _SignalOnImport())
    from runnerkit.infer import main

    sys.exit(main(ARGV))

from runnerkit import media  # noqa: E402
from runnerkit.infer import main  # noqa: E402
from runnerkit.models.wan.runner import WanT2VRunner  # noqa: E402

if PHASE == "load":
    on_call(WanT2VRunner, "build_vae", 1)
elif PHASE == "warmup":
    on_call(WanT2VRunner, "run_step", 1)  # the first step ever run is warmup's
elif PHASE == "denoise":
    on_call(WanT2VRunner, "run_step", 4)  # 2 steps per request: request 1, step 2
elif PHASE == "decode":
    on_call(WanT2VRunner, "run_vae_decoder", 2)
elif PHASE == "tensor_write":
    on_call(media, "save_file", 2, after=True)
elif PHASE == "media_write":
    on_call(media, "save_media", 2, after=True)
else:
    raise SystemExit(f"unknown phase {PHASE!r}")
sys.exit(main(ARGV))
