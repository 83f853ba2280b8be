"""Helpers shared by the GPU benchmarks: synthetic checkpoints, subprocess arms, tables."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def ensure_synthetic(config_path: Path, out: Path, dtype: str = "bf16", generator_device: str = "cpu") -> Path:
    """Write the config architecture's synthetic checkpoint to `out` once (skipped if present)."""
    if (out / "runnerkit.json").is_file():
        return out
    subprocess.run([sys.executable, "-m", "runnerkit.tools.synth_checkpoint", "--config", str(config_path),
                    "--out", str(out), "--dtype", dtype, "--generator_device", generator_device], check=True, cwd=REPO)
    return out


def run_worker(script: Path, args: list[str], result: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `script --worker ...` in a fresh process; return the JSON it wrote to `result`."""
    full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    proc = subprocess.run([sys.executable, str(script), "--worker", "--result", str(result), *args],
                          cwd=REPO, env=full_env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise RuntimeError(f"worker {args} failed with exit status {proc.returncode}")
    return json.loads(result.read_text())


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 1024**3, 1)
    return info
