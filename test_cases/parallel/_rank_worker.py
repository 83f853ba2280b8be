"""One rank of a parallel test run: `python -m torch.distributed.run ... -m test_cases.parallel._rank_worker SPEC`.

SPEC is a JSON file: {"argv": [runnerkit flags], "spy_dir": folder or null, "fail": {"rank": R, "phase":
"load" | "warmup" | "request" | "end_run", "step": N, "wait_for": path} or null (end_run: the rank's
request cleanup raises once `wait_for` exists), "kill": {"rank": R, "step": N} or null (the rank
SIGKILLs itself before its request's step N), "warmup_shapes": [[h, w, f], [h, w, f]] or null, "slow_warmup" and
"slow_step": {"rank": R, "seconds": S} or null}. The rank installs a collective spy (every `CollectiveCall`
with the lifecycle phase it ran in, written to spy_dir/rank{R}.json when the run returns), injects the
failure or the delays (slow_warmup: at the end of warmup, after its last collective; slow_step: before each
denoising step of a request), touches spy_dir/warm{R} when its warmup returned, then runs
`runnerkit.infer.main(argv)` and exits with its status.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


PRELOAD = ["torch", "torch.distributed", "safetensors.torch", "runnerkit.infer", "runnerkit.models.wan.runner",
           "runnerkit.parallel.driver", "runnerkit.runners.default", "runnerkit.serve.server", "runnerkit.serve.app",
           "runnerkit.parallel.serving", "uvicorn", "fastapi"]
"""What the test's forkserver imports once, so each rank forks with them loaded (seconds per rank saved)."""


def rank_main(spec_path: str, rank: int, world: int, port: int, log_path: str) -> None:
    """Entry of a rank forked by the tests: torchrun's environment, stdout/stderr to `log_path`, then `main`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.exit(main(spec_path))


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    from runnerkit import infer, memory
    from runnerkit.models.wan.runner import WanT2VRunner
    from runnerkit.parallel import collective_hooks
    from runnerkit.runners.default import DefaultRunner

    memory.freeze_gc_once = lambda: None  # type: ignore[assignment]  # the test process's gc is its own business
    calls: list[list[Any]] = []
    where = {"phase": "load"}
    original_load = DefaultRunner.load_modules

    def spy(call: Any) -> None:
        calls.append([where["phase"], call.op, call.group, list(call.shape)])

    collective_hooks.append(spy)
    if spec.get("warmup_shapes"):
        WanT2VRunner.WARMUP_SHAPES = {"debug": tuple(tuple(s) for s in spec["warmup_shapes"])}  # type: ignore[misc]

    run_warmup, run_pipeline = DefaultRunner.run_warmup, DefaultRunner.run_denoise
    fail = spec.get("fail") or {}

    def load_modules(self: DefaultRunner) -> None:
        if fail.get("rank") == rank and fail.get("phase") == "load":
            raise RuntimeError("injected load failure")
        original_load(self)

    slow, slow_step = spec.get("slow_warmup") or {}, spec.get("slow_step") or {}

    def spy_warmup(self: DefaultRunner, shapes: Any) -> None:
        where["phase"] = "warmup"
        run_warmup(self, shapes)
        if slow.get("rank") == rank:  # after warmup's last collective: the other ranks are warm, this one not yet
            time.sleep(slow["seconds"])
        where["phase"] = "requests"
        if spec.get("spy_dir"):
            Path(spec["spy_dir"], f"warm{rank}").touch()

    def spy_denoise(self: DefaultRunner, req: Any, warmup: bool = False) -> Any:
        where["phase"] = "warmup" if warmup else "requests"
        return run_pipeline(self, req, warmup)

    steps = {"n": 0}
    run_step, end_run = WanT2VRunner.run_step, DefaultRunner.end_run
    kill = spec.get("kill") or {}

    def failing_end_run(self: DefaultRunner) -> None:
        end_run(self)
        if fail.get("rank") == rank and fail.get("phase") == "end_run":
            deadline = time.monotonic() + 60
            while not Path(fail["wait_for"]).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            raise RuntimeError("injected failure after rank 0 saved")

    def failing_step(self: WanT2VRunner, *args: Any) -> Any:
        steps["n"] += 1
        phase = "warmup" if args[0].info.warmup else "request"  # args[0]: the RequestState
        if fail.get("rank") == rank and fail.get("phase") == phase and steps["n"] >= fail.get("step", 1):
            raise RuntimeError(f"injected {phase} failure")
        if kill.get("rank") == rank and phase == "request" and steps["n"] >= kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if slow_step.get("rank") == rank and phase == "request":
            time.sleep(slow_step["seconds"])
        return run_step(self, *args)

    DefaultRunner.load_modules = load_modules  # type: ignore[method-assign]
    DefaultRunner.run_warmup = spy_warmup  # type: ignore[method-assign]
    DefaultRunner.run_denoise = spy_denoise  # type: ignore[method-assign]
    WanT2VRunner.run_step = failing_step  # type: ignore[method-assign]
    DefaultRunner.end_run = failing_end_run  # type: ignore[method-assign]
    status = infer.main(spec["argv"])
    if spec.get("spy_dir"):
        Path(spec["spy_dir"], f"rank{rank}.json").write_text(json.dumps(calls))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
