"""Real interrupts against the threaded pread reader, in a fresh process (`test_pread_threads.py` runs this).

    python -m test_cases.offload._pread_signal_driver DIR TRIALS SEED

Writes an 8 MiB safetensors file of 32 tensors under DIR, reads it with `read_threads` 4 in jobs of 16 KiB
(`read_many`, through the file's long-lived handle, into fixed destinations) while SIGALRM raises
KeyboardInterrupt at a random moment of each read (a seeded RNG, up to 1.2x one read's time). Per trial it
records every worker `preadv` call's end time; an interrupted read whose workers still ended a call after the
interrupt reached the caller counts as a late write. Afterwards one read must equal the file and `close` must
leave no read thread. Prints one JSON line: trials, interrupted, completed, late_writes, wrong, other (exceptions
other than the interrupt), threads_left. A hang (a lock an interrupt left held) shows as the process not ending.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from runnerkit.offload import pread_jobs
from runnerkit.offload.disk import SafetensorsDiskReader


def main(folder: Path, trials: int, seed: int) -> dict[str, int]:
    pread_jobs.MIN_JOB_BYTES = 16 << 10
    gen = torch.Generator().manual_seed(seed)
    sd = {f"t{i}": torch.randn(64 << 10, generator=gen) for i in range(32)}
    save_file(sd, str(folder / "m.safetensors"))
    reader = SafetensorsDiskReader([folder / "m.safetensors"], reader="pread", read_threads=4)
    dsts = {n: torch.empty(t.numel() * 4, dtype=torch.uint8) for n, t in sd.items()}
    reads = list(dsts.items())
    caller, real, ends = threading.get_ident(), os.preadv, []

    def recording(fd: int, views: list[memoryview], offset: int) -> int:
        try:
            return real(fd, views, offset)
        finally:
            if threading.get_ident() != caller:
                ends.append(time.monotonic_ns())

    os.preadv = recording
    armed = False

    def alarm(signum: int, frame: object) -> None:
        if armed:
            raise KeyboardInterrupt("alarm")

    signal.signal(signal.SIGALRM, alarm)
    reader.read_many(reads)  # opens the long-lived handle
    start = time.perf_counter()
    reader.read_many(reads)  # its time calibrates the alarms
    one = time.perf_counter() - start
    rng = random.Random(seed)
    stats = dict(trials=trials, interrupted=0, completed=0, late_writes=0, wrong=0, other=0)
    for _ in range(trials):
        ends.clear()
        raised = None
        try:
            armed = True
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, one * 1.2))
            reader.read_many(reads)
            armed = False
            stats["completed"] += 1
        except KeyboardInterrupt:
            raised = time.monotonic_ns()
            armed = False
            stats["interrupted"] += 1
        except BaseException:  # noqa: BLE001  counted: the test fails on any
            armed = False
            stats["other"] += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
        if raised is not None:
            time.sleep(0.002)
            stats["late_writes"] += any(end > raised for end in ends)
    reader.read_many(reads)
    stats["wrong"] = sum(not torch.equal(dsts[n].view(torch.float32), sd[n]) for n in sd)
    reader.close()
    stats["threads_left"] = sum(t.name.startswith("runnerkit-pread") for t in threading.enumerate())
    return stats


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))), flush=True)
