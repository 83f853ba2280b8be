"""Helpers shared by the GPU benchmarks: synthetic checkpoints, subprocess arms, spreads, tables."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED_COMPONENTS = ("text_encoder", "vae", "tokenizer")  # what a transformer-only checkpoint borrows


def ensure_synthetic(config_path: Path, out: Path, dtype: str = "bf16", generator_device: str = "cpu",
                     transformer_only: bool = False) -> Path:
    """Write the config architecture's synthetic checkpoint to `out` once (skipped if present: a runnerkit
    layout's `runnerkit.json`, or any layout's synthetic marker)."""
    from runnerkit.synthetic import SYNTHETIC_MARKER

    if (out / "runnerkit.json").is_file() or (out / SYNTHETIC_MARKER).is_file():
        return out
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "runnerkit.tools.synth_checkpoint", "--config", str(config_path),
                    "--out", str(out), "--dtype", dtype, "--generator_device", generator_device,
                    *(["--transformer_only"] if transformer_only else [])], check=True, cwd=REPO)
    print(f"synthetic checkpoint {out} written in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def borrow_components(ckpt: Path, donor: Path) -> None:
    """Make the transformer-only checkpoint `ckpt` complete with symlinks to `donor`'s text encoder,
    VAE and tokenizer (synthetic values depend only on tensor name and seed, so a full write of
    `ckpt` would hold the same bytes there).

    Raises:
        ValueError: the two checkpoints' text encoder or VAE architectures (or seeds) differ.
    """
    mine, theirs = (json.loads((p / "runnerkit.json").read_text()) for p in (ckpt, donor))
    for key in ("text_encoder", "vae"):
        if mine["arch"][key] != theirs["arch"][key]:
            raise ValueError(f"cannot borrow `{key}` from {donor}: architectures differ")
    if mine.get("synthetic_seed") != theirs.get("synthetic_seed"):
        raise ValueError(f"cannot borrow from {donor}: synthetic seeds differ")
    for name in SHARED_COMPONENTS:
        link = ckpt / name
        if link.is_symlink() or not link.exists():
            if link.is_symlink():
                link.unlink()
            link.symlink_to((donor / name).absolute(), target_is_directory=True)


def copy_config(src: Path, dst: Path, **transformer: int) -> Path:
    """`src` runner config with `model.transformer` fields replaced (e.g. num_layers), written to `dst`."""
    data = json.loads(src.read_text())
    if transformer:
        data.setdefault("model", {}).setdefault("transformer", {}).update(transformer)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(data, indent=1))
    return dst


def python_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def add_worker_flags(p: argparse.ArgumentParser, arms: Sequence[str] | None = None) -> None:
    """The flags of the worker protocol (`worker_command`): `--worker` (run one arm in this process),
    `--arm` (which; `arms`: its choices) and `--result` (the JSON file the worker writes)."""
    p.add_argument("--worker", action="store_true", help="(internal) run one arm in this process")
    p.add_argument("--arm", choices=list(arms) if arms is not None else None, help="(internal) the worker's arm")
    p.add_argument("--result", help="(internal) the JSON file the worker writes")


def worker_command(script: Path, args: list[str], result: Path) -> list[str]:
    """`script --worker --result RESULT ARGS` in this interpreter: one arm in a fresh process."""
    return [sys.executable, str(script), "--worker", "--result", str(result), *args]


def run_worker(script: Path, args: list[str], result: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `script --worker ...` in a fresh process; return the JSON it wrote to `result`."""
    proc = subprocess.run(worker_command(script, args, result),
                          cwd=REPO, env={**python_env(), **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise RuntimeError(f"worker {args} failed with exit status {proc.returncode}")
    return json.loads(result.read_text())


def run_child(cmd: list[str], log: Path) -> tuple[int, float, float]:
    """Run `cmd` from the repository root, its output to `log`.

    Returns:
        (exit status, wall seconds, peak resident host memory of the child in GiB from wait4's rusage).
    """
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=python_env(), stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss / 1024**2  # ru_maxrss: KiB on Linux


def drop_page_cache() -> bool:
    """`sync; echo 3 > /proc/sys/vm/drop_caches` (root only); False if not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def storage_read_bytes() -> int:
    """Bytes this process (all its threads) made the kernel fetch from storage: `/proc/self/io` read_bytes.

    Counts reads that reach the block layer, page faults of mappings included, and nothing the page
    cache served; the one byte count used for every reader. -1 if the kernel has no I/O accounting.
    """
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return -1


def sequential_read_gbps(path: Path, limit_bytes: int = 2 * 1024**3) -> dict[str, Any]:
    """Sequential read of `path` (64 MiB reads) after dropping the page cache.

    GB/s = storage bytes (`/proc/self/io` read_bytes, the same source as the disk arms) / seconds;
    the bytes Python received are kept beside it. NaN if the page cache could not be dropped.
    """
    dropped = drop_page_cache()
    got, b0 = 0, storage_read_bytes()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while got < limit_bytes:
            chunk = f.read(64 * 1024**2)
            if not chunk:
                break
            got += len(chunk)
    seconds = time.perf_counter() - t0
    storage = storage_read_bytes() - b0
    gbps = storage / seconds / 1e9 if dropped and storage > 0 else float("nan")
    return {"gbps": gbps, "storage_bytes": storage, "bytes_returned": got, "seconds": seconds, "page_cache_dropped": dropped}


def timed(fn: Callable[[], object], iters: int, dev: Any) -> list[float]:
    """Milliseconds of each of `iters` calls (runnerkit's StepTimer: CUDA events on CUDA, wall clock on the CPU)."""
    from runnerkit.profiling import StepTimer

    timer = StepTimer(dev)
    for _ in range(iters):
        with timer.step():
            fn()
    return [s * 1000 for s in timer.seconds()]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def spread(xs: list[float]) -> dict[str, Any]:
    """Median, min and max of per-process values (and the values, in process order)."""
    xs = [float(x) for x in xs if x == x]  # drop NaN
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "values": []}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def fmt_spread(s: dict[str, Any], digits: int = 3) -> str:
    """`median [min–max] (n)` for a table cell."""
    if not s or not s.get("n"):
        return "–"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}] (n={s['n']})"


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Deadline:
    """Wall-clock budget of a benchmark: start another process only if its estimated time still fits."""

    def __init__(self, seconds: float | None) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.perf_counter() - self.t0)

    def fits(self, estimate: float) -> bool:
        return estimate <= self.left()


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 1024**3, 1)
    return info



class GpuClockSampler:
    """SM clock (MHz) and board power (W) of GPU 0 sampled every `period_s` through NVML while active.

    `with GpuClockSampler() as s: ...` then `s.summary()`: {"sm_mhz": spread, "power_w": spread} of the
    samples, or {} where NVML (the nvidia-ml-py package) or a GPU is missing. It explains a kernel that
    runs slower in one process than in another (clocks drop under sustained power).
    """

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML or no GPU: sample nothing
            self._nvml = None

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.wait(self.period_s):
            self.samples.append((float(nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM)),
                                 nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0))  # mW -> W

    def __enter__(self) -> GpuClockSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {}
        return {"sm_mhz": spread([s[0] for s in self.samples]), "power_w": spread([s[1] for s in self.samples])}


def check_timing_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """`--iters`/`--rounds` >= 1, a CUDA device unless `--smoke`, and `--out`'s folder made, before a timing run
    starts (`p.error` otherwise: a folder that cannot be made is found now, not after minutes of device time).
    Returns `--out` as a Path."""
    if args.iters < 1 or args.rounds < 1:
        p.error(f"--iters and --rounds must be >= 1 (got {args.iters}, {args.rounds})")
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"--out {args.out!r}: its folder cannot be created: {exc.strerror or exc}")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA device (--smoke runs tiny shapes on the CPU)")
    return out
