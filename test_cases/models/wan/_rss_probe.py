"""Measure one request's peak resident memory in a fresh process (used by test_estimate.py).

    python -m test_cases.models.wan._rss_probe CONFIG.json HEIGHT WIDTH FRAMES OUT.safetensors

Loads the runner, resets the kernel's peak-RSS counter (`/proc/self/clear_refs` "5": VmHWM :=
VmRSS), runs one request, and prints JSON: `rss_before` (VmRSS after loading), `hwm` (VmHWM after
the request), the estimate's `bytes`, `formula_bytes`, `weights_between_stages` and peak `stage`.
Exit status 3 if the peak counter cannot be reset here.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def main(argv: list[str]) -> int:
    config_path, h, w, f, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.registry import get_runner_cls
    from runnerkit.planning import fit

    config = load_runner_config(config_path, {})
    runner = get_runner_cls(config.model_cls)(config)
    runner.init_modules()
    estimate = runner.estimate_memory((h, w, f))
    peak = fit.peak_of(estimate, runner.config, runner.device)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return 3
    rss_before = status_bytes("VmRSS")
    if status_bytes("VmHWM") > rss_before + 8 * 1024**2:
        return 3  # the reset did not take
    runner.run_pipeline(RequestConfig(prompt="a red fox in the snow", target_height=h, target_width=w,
                                      target_video_length=f, save_tensor_path=out), 0)
    print(json.dumps({"rss_before": rss_before, "hwm": status_bytes("VmHWM"), "bytes": peak.bytes,
                      "formula_bytes": peak.formula_bytes, "stage": peak.stage,
                      "weights_between_stages": fit.weights_between_stages(estimate, runner.config, runner.device)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
