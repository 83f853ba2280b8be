"""bench/: spreads over processes, per-round pairing of cross-arm ratios, the storage byte count."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from bench import cold_start, offload
from bench.common import drop_page_cache, fmt_spread, spread, storage_read_bytes


def test_spread_is_median_min_max_over_values_without_nan() -> None:
    s = spread([3.0, 1.0, float("nan"), 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert fmt_spread(s) == "2.000 [1.000–3.000] (n=3)"
    assert spread([])["n"] == 0 and math.isnan(spread([])["median"])


def _launch_proc(transformer_s: float, request_s: float) -> dict[str, Any]:
    req = {"seconds": request_s, "stages": {"transformer": transformer_s}, "steps": [1.0, 1.0, 1.0],
           "memory": {"peak_allocated_gib": 1.0}, "sha256": "x"}
    return {"requests": [req], "host_peak_rss_gib": 1.0}


def test_cross_arm_ratio_pairs_process_n_with_process_n() -> None:
    # any other pairing than by index gives a ratio other than 1.1 somewhere
    results = {"none": [_launch_proc(t, 2 * t) for t in (1.0, 2.0, 4.0)],
               "block": [_launch_proc(1.1 * t, 2.2 * t) for t in (1.0, 2.0, 4.0)]}
    ratios = offload.summarize_offload(results, requests=1)["ratios"]["block / none"]["request1"]
    for key in ("transformer_s", "request_s"):
        assert ratios[key]["n"] == 3
        assert ratios[key]["min"] == pytest.approx(1.1) and ratios[key]["max"] == pytest.approx(1.1)


def test_cold_start_ratio_is_per_process() -> None:
    def proc(r1: float, r3: float, steps: list[float]) -> dict[str, Any]:
        mk = lambda s: {"seconds": s, "steps": steps, "sha256": "h", "audit": {}}  # noqa: E731
        return {"warmup": None, "requests": [mk(r1), mk(1.0), mk(r3)]}

    procs = [proc(2.0, 1.0, [2.0, 1.0, 1.0, 1.0]), proc(6.0, 4.0, [3.0, 1.0, 1.0, 1.0]), proc(3.0, 3.0, [1.0] * 4)]
    summary, _ = cold_start.summarize({"no_warmup": procs})
    s = summary["no_warmup"]
    assert s["request1_over_request_last"]["values"] == [2.0, 1.5, 1.0]  # not median(r1) / median(r3) = 1.0
    assert s["step1_over_rest"]["values"] == [2.0, 3.0, 1.0]


def test_storage_read_bytes_counts_reads_from_storage_not_from_the_page_cache(tmp_path: Path) -> None:
    if storage_read_bytes() < 0 or not drop_page_cache():
        pytest.skip("needs /proc/self/io and root to drop the page cache")
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(32 * 2**20))
    assert drop_page_cache()
    before = storage_read_bytes()
    assert len(path.read_bytes()) == 32 * 2**20
    cold = storage_read_bytes() - before
    before = storage_read_bytes()
    path.read_bytes()
    warm = storage_read_bytes() - before
    if cold == 0:
        pytest.skip("this filesystem does not account reads in /proc/self/io (e.g. tmpfs)")
    assert cold >= 32 * 2**20
    assert warm < 2**20


def test_a_failed_process_leaves_its_round_out_instead_of_shifting_the_pairs() -> None:
    none = [_launch_proc(t, t) | {"round": n} for n, t in enumerate((1.0, 2.0, 4.0))]
    block = [_launch_proc(1.1 * t, 1.1 * t) | {"round": n} for n, t in ((0, 1.0), (2, 4.0))]  # round 1 failed
    r = offload.summarize_offload({"none": none, "block": block}, requests=1)["ratios"]["block / none"]["request1"]
    assert r["transformer_s"]["n"] == 2 and r["transformer_s"]["max"] == pytest.approx(1.1)


# ---- estimate_vs_peak.py: its CPU-side logic (the GPU run is bench/DEVICE_RUN.md, command 4) ------------
def _bench(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    """`python bench/estimate_vs_peak.py ARGS` from the repository root, its `main` called in this process
    (its worker processes, one per mode x shape, are still fresh ones); an error exit raises SystemExit."""
    import sys

    from test_cases.conftest import REPO

    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first on its import
    from bench import estimate_vs_peak  # path

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["bench/estimate_vs_peak.py", *args])
    estimate_vs_peak.main()


def test_estimate_vs_peak_dry_run_tabulates_every_mode_and_shape(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    _bench(monkeypatch, "--dry-run", "--out", str(tmp_path / "dry"))
    report = json.loads((tmp_path / "dry.json").read_text())
    cells = {(r["mode"], tuple(r["shape"])): r for r in report["results"]}
    assert set(cells) == {(m, s) for m in ("none", "block") for s in ((480, 832, 81), (720, 1280, 81))}
    none, block = cells["none", (480, 832, 81)], cells["block", (480, 832, 81)]
    assert block["stages"]["transformer"]["weights_gib"] < 0.1 * none["stages"]["transformer"]["weights_gib"]
    assert none["estimate"]["stage"] == "vae_decoder"
    assert "| none | 480x832x81 cfg | vae_decoder |" in (tmp_path / "dry.md").read_text()


def test_estimate_vs_peak_measures_stages_on_the_cpu(tiny_ckpt: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from test_cases.conftest import REPO

    _bench(monkeypatch, "--config", str(REPO / "configs/wan/wan_t2v_tiny.json"), "--model_path", str(tiny_ckpt), "--device", "cpu",
           "--shapes", "32", "32", "5", "--modes", "none", "--steps", "1", "--out", str(tmp_path / "smoke"))
    (result,) = json.loads((tmp_path / "smoke.json").read_text())["results"]
    assert set(result["stages"]) == {"text_encoder", "transformer", "vae_decoder", "save"}
    assert all(s["measured_gib"] > 0 and s["formula_over_measured"] >= 1.0 for s in result["stages"].values())
    assert result["estimate_over_measured"] >= 1.0


def test_clock_sampler_reports_nvml_clock_and_power_while_active(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import time
    import types

    from bench.common import GpuClockSampler

    readings = iter([(1980.0, 690_000), (1755.0, 700_000)] + [(1700.0, 650_000)] * 1000)
    current: dict[str, Any] = {}

    def clock(_h: object, _kind: int) -> int:
        current["r"] = next(readings)
        return int(current["r"][0])

    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: "gpu0", NVML_CLOCK_SM=1,
                                 nvmlDeviceGetClockInfo=clock, nvmlDeviceGetPowerUsage=lambda _h: current["r"][1])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuClockSampler(period_s=0.001) as s:
        while len(s.samples) < 3:
            time.sleep(0.001)
    n = len(s.samples)
    time.sleep(0.01)
    assert len(s.samples) == n  # stopped at exit
    assert s.samples[:2] == [(1980.0, 690.0), (1755.0, 700.0)]
    summary = s.summary()
    assert summary["sm_mhz"]["max"] == 1980.0 and summary["power_w"]["max"] == 700.0 and summary["sm_mhz"]["n"] == n


def test_clock_sampler_without_nvml_samples_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from bench.common import GpuClockSampler

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with GpuClockSampler(period_s=0.001) as s:
        pass
    assert s.samples == [] and s.summary() == {}
