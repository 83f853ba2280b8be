"""Peak host memory of a piece of work, measured in a fresh interpreter.

A test process that has run other tests carries their allocator state (heaps, arenas, thresholds), which can
decide whether a freed tensor's pages go back to the OS; a fresh interpreter measures the work alone, whatever
ran before. Linux only: the peak is VmHWM, reset to the current VmRSS through /proc/self/clear_refs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CAN_MEASURE = os.path.exists("/proc/self/clear_refs")
"""Whether this machine can reset and read a process's peak RSS."""

_PRELUDE = '''
import json


def _kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def measure(work):
    """Run `work()`; print {"grown": peak RSS growth in bytes, **what work returned} as the last line."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    baseline = _kib("VmRSS") * 1024
    result = work() or {}
    print(json.dumps({"grown": _kib("VmHWM") * 1024 - baseline, **result}))
'''


def peak_growth(code: str) -> dict:
    """Run `code` (which calls `measure(work)` once) in a fresh interpreter from the repository root; the
    dict `measure` printed. Raises AssertionError with the child's output when it fails."""
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], cwd=REPO, capture_output=True, check=False,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
