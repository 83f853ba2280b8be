"""Print the "Measured on an H200" bullet lines of bench/results/summary.md from the benchmark JSONs.

    python bench/readme_lines.py --cold_start bench/results/cold_start_h200.json \
        --offload bench/results/offload_h200_14b.json --disk bench/results/offload_h200_disk.json

Every ratio is printed as median [min–max] over processes, as in the tables. Missing files are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import fmt_spread  # noqa: E402


def s(x: dict[str, Any] | None, digits: int = 3) -> str:
    """median [min–max] without the process count (the line states it once)."""
    return fmt_spread(x, digits).rsplit(" (n=", 1)[0] if x else "–"


def cold_start_line(report: dict[str, Any]) -> str:
    w, nw = report["summary"]["warmup"], report["summary"]["no_warmup"]
    h, wd, f = report["shape"]
    n, last = min(report["procs_per_arm"].values()), report["requests"]
    ident = "bit-identical" if report.get("request1_bit_identical_across_arms") else "NOT bit-identical"
    return (f"- Warmup, Wan2.1 1.3B at {h}×{wd}×{f}, {report['steps']} steps, {n} processes per arm: with warmup, "
            f"request 1 / request {last} = {s(w['request1_over_request_last'])} and step 1 / median of steps 3..last = "
            f"{s(w['step1_over_rest'])} (without: {s(nw['request1_over_request_last'])} and {s(nw['step1_over_rest'])}); "
            f"warmup takes {s(w['warmup_s'], 1)} s once; request 1 {ident} with and without warmup.")


def offload_lines(report: dict[str, Any]) -> list[str]:
    off = report["summary"]["offload"]
    t = report["transformer_arch"].get("14b", {})
    last = f"request{report['requests']}"
    arms, ratios = off["arms"], off["ratios"]
    n = min(a["processes"] for a in arms.values())
    h, w, f = report["shape"]
    lines = []
    if "block / none" in ratios:
        b, p = ratios["block / none"][last], ratios.get("phase / none", {}).get(last)
        peak = {a: s(arms[a]["requests"][last]["peak_gib"], 1) for a in ("none", "block", "phase") if a in arms}
        lines.append(
            f"- Offload, Wan2.1 14B blocks (dim {t.get('dim')}, {t.get('num_layers')} of the 40 blocks, to fit the "
            f"device budget) at {h}×{w}×{f}, {report['steps']} steps, CFG, through the launch script, request "
            f"{report['requests']} of each of {n} processes per arm: block / none = {s(b['request_s'])} for the whole "
            f"request and {s(b['transformer_s'])} for the transformer stage (first block copy included)"
            + (f"; phase / none = {s(p['request_s'])} and {s(p['transformer_s'])}" if p else "")
            + f"; peak device GiB none {peak.get('none')}, block {peak.get('block')}, phase {peak.get('phase')}.")
    if "diffusers group offload / diffusers all-resident" in ratios:
        g = ratios["diffusers group offload / diffusers all-resident"][last]
        version = next((p["diffusers"] for p in report["raw"].get("diffusers_group", [])), "?")
        line = (f"- diffusers {version} on the same weights: group offloading / all-resident = "
                f"{s(g['transformer_s'])} (transformer stage)")
        if "runnerkit block / diffusers group offload" in ratios:
            r = ratios["runnerkit block / diffusers group offload"][last]
            line += f"; runnerkit block / diffusers group offloading = {s(r['transformer_s'])}"
        if "diffusers all-resident / runnerkit none" in ratios:
            r = ratios["diffusers all-resident / runnerkit none"][last]
            line += f"; diffusers all-resident / runnerkit none = {s(r['transformer_s'])} (the model ports differ)"
        lines.append(line + ".")
    return lines


def disk_line(report: dict[str, Any]) -> str:
    d = report["summary"]["disk"]
    n = min(v["processes"] for v in d.values())
    parts = [f"`{arm.removeprefix('disk_')}` {s(v['ratio_to_bound'], 2)} ({s(v['storage_gb_per_cold_step'], 2)} GB read)"
             for arm, v in d.items()]
    first = next(iter(d.values()))
    return (f"- Disk streaming, 1.3B, block mode, cold page cache ({n} processes × {first['cold_steps_per_process']} "
            f"cold steps per reader): cold step / (bytes read from storage / sequential {s(first['sequential_gbps'], 2)} "
            "GB/s) = "
            + ", ".join(parts) + "; bytes are `/proc/self/io` read_bytes for both readers.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cold_start")
    p.add_argument("--offload")
    p.add_argument("--disk")
    args = p.parse_args()
    def load(path: str | None) -> dict[str, Any] | None:
        return json.loads(Path(path).read_text()) if path and Path(path).is_file() else None

    lines = []
    if (r := load(args.cold_start)) and "summary" in r:
        lines.append(cold_start_line(r))
    if (r := load(args.offload)) and r["summary"]["offload"]["arms"]:
        lines += offload_lines(r)
    if (r := load(args.disk)) and r["summary"]["disk"]:
        lines.append(disk_line(r))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
