"""Runs the launch script with a requests file while checkpoint files change under it (test_truncation.py).

    python -m test_cases._truncation_driver PLAN.json -- <runnerkit flags>

PLAN.json is a list of events, each {"after": "step" | "request", "count": N, "action": A, "file": PATH}:
after the N-th denoising step (`Scheduler.step_post`, counted over the whole process, from 1) or
after the end of the N-th request (`end_run`, from 1), the action is applied to the file:

- "truncate": cut the file in place to half its size (what `truncate -s` or a writer that opens
  with O_TRUNC does to a file another process maps); "empty": cut it to 0 bytes;
- "rewrite": overwrite the last 256 bytes in place with other values (same size, new mtime);
- "replace": write a larger file with other contents next to it and rename it over the path;
- "restore": write the original bytes back in place (same inode);
- "restore_rename": write the original bytes to a new file and rename it over the path.

The original bytes are read when the driver starts. Each applied event is printed to stdout as
`EVENT <after> <count> <action>`, so a test can tell how far the process got.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runnerkit.infer import main
from runnerkit.runners.default import DefaultRunner
from runnerkit.schedulers.base import Scheduler


def apply(action: str, path: Path, original: bytes) -> None:
    if action == "truncate":
        os.truncate(path, len(original) // 2)
    elif action == "empty":
        os.truncate(path, 0)
    elif action == "rewrite":
        with open(path, "r+b") as f:
            f.seek(len(original) - 256)
            f.write(bytes(255 - b for b in original[-256:]))
    elif action == "replace":
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(original[:-256] + bytes(255 - b for b in original[-256:]) + b"\0" * 4096)
        os.replace(tmp, path)
    elif action == "restore":
        with open(path, "r+b") as f:
            f.write(original)
            f.truncate(len(original))
    elif action == "restore_rename":
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(original)
        os.replace(tmp, path)
    else:
        raise ValueError(f"unknown action {action!r}")


def install(events: list[dict[str, Any]], patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Count steps and requests and apply `events`; `patch` sets the class attributes (a test's
    `monkeypatch.setattr` undoes them after an in-process run)."""
    originals = {e["file"]: Path(e["file"]).read_bytes() for e in events}
    counts = {"step": 0, "request": 0}

    def fire(after: str) -> None:
        counts[after] += 1
        for e in events:
            if e["after"] == after and e["count"] == counts[after]:
                apply(e["action"], Path(e["file"]), originals[e["file"]])
                print(f"EVENT {after} {counts[after]} {e['action']}", flush=True)

    step_post, end_run = Scheduler.step_post, DefaultRunner.end_run

    def counted_step_post(self: Scheduler, noise_pred: Any) -> None:
        step_post(self, noise_pred)
        fire("step")

    def counted_end_run(self: DefaultRunner) -> None:
        end_run(self)
        fire("request")

    patch(Scheduler, "step_post", counted_step_post)
    patch(DefaultRunner, "end_run", counted_end_run)


if __name__ == "__main__":
    split = sys.argv.index("--")
    install(json.loads(Path(sys.argv[1]).read_text()))
    sys.exit(main(sys.argv[split + 1:]))
