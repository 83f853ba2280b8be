"""Cold start: does warmup make request 1 as fast as request 3? (issue: warmup, ARCHITECTURE §3)

Two arms, each in fresh processes (`--procs` per arm, interleaved), `--requests` requests per process,
all at the benchmark shape (a warmup shape of the flavour): `no_warmup` and `warmup`. Every
process runs with deterministic algorithms (`torch.use_deterministic_algorithms(True)`, cuDNN
benchmark off), so request 1's output can be compared bit for bit across arms (SHA-256 of the
decoded float32 video).

    python bench/cold_start.py --config configs/wan/wan_t2v_1.3b.json --model_path /tmp/wan13b \
        --steps 5 --procs 3 --out bench/results/cold_start_h200

Every ratio (step 1 / median of steps 3..last of request 1; request 1 / last request) is computed
inside each process, then reported as median [min–max] across the processes of its arm.
Processes run in rounds (one per arm per round); `--time_budget_s` stops before a round that
would not fit. CPU smoke run (tiny config; not a result):

    python bench/cold_start.py --config configs/wan/wan_t2v_tiny.json --model_path /tmp/rk_tiny \
        --shape 48 80 9 --device cpu --synth_dtype fp32 --out /tmp/smoke/cold_start

Writes OUT.json (all raw numbers) and OUT.md (the table).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO, Deadline, add_worker_flags, device_info, ensure_synthetic, fmt_spread,  # noqa: E402
                          markdown_table, median, run_worker, spread)


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    from safetensors.torch import load_file

    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.registry import get_runner_cls

    h, w, f = args.shape
    config = load_runner_config(args.config, {
        "model_path": args.model_path, "infer_steps": args.steps, "warmup": args.arm == "warmup",
        "target_height": h, "target_width": w, "target_video_length": f, "device": args.device})
    t0 = time.perf_counter()
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.init_modules()
    init_seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"arm": args.arm, "init_seconds": init_seconds, "warmup": runner.profiler.warmup,
                           "load_seconds": runner.profiler.phases.get("load_seconds"), "requests": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.requests):
            tensor_path = Path(tmp) / f"r{i}.safetensors"
            prof = runner.run_pipeline(RequestConfig(prompt=f"a lighthouse in a storm, take {i}", seed=42,
                                                     save_tensor_path=str(tensor_path)), i)
            video = load_file(str(tensor_path))["video"]
            entry = dict(prof.__dict__)
            entry["sha256"] = hashlib.sha256(video.numpy().tobytes()).hexdigest()
            out["requests"].append(entry)
    Path(args.result).write_text(json.dumps(out, indent=1))


def summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], list[list[Any]]]:
    """Per arm: every ratio is computed per process, then its median and min–max across processes."""
    rows, summary = [], {}
    for arm, procs in runs.items():
        r1 = [p["requests"][0] for p in procs]
        rl = [p["requests"][-1] for p in procs]
        rest = [median(r["steps"][2:]) for r in r1]  # steps 3..last of request 1, per process
        s = {
            "processes": len(procs),
            "step1_s": spread([r["steps"][0] for r in r1]),
            "step2_s": spread([r["steps"][1] for r in r1]),
            "median_step3_last_s": spread(rest),
            "step1_over_rest": spread([r["steps"][0] / m for r, m in zip(r1, rest)]),
            "request1_s": spread([r["seconds"] for r in r1]),
            "request_last_s": spread([r["seconds"] for r in rl]),
            "request1_over_request_last": spread([a["seconds"] / b["seconds"] for a, b in zip(r1, rl)]),
            "warmup_s": spread([p["warmup"]["seconds"] for p in procs]) if procs[0]["warmup"] else None,
            "warmup_plus_request1_s": spread([p["warmup"]["seconds"] + r["seconds"] for p, r in zip(procs, r1)])
            if procs[0]["warmup"] else None,
            "memory_before_warmup": procs[0]["warmup"]["memory_before"] if procs[0]["warmup"] else None,
            "memory_after_warmup": procs[0]["warmup"]["memory_after"] if procs[0]["warmup"] else None,
            "request1_sha256": sorted({r["sha256"] for r in r1}),
            "audit_request1": [r["audit"] for r in r1],
        }
        summary[arm] = s
        rows.append([arm, len(procs), fmt_spread(s["step1_s"]), fmt_spread(s["median_step3_last_s"]),
                     fmt_spread(s["step1_over_rest"]), fmt_spread(s["request1_s"]), fmt_spread(s["request_last_s"]),
                     fmt_spread(s["request1_over_request_last"]),
                     fmt_spread(s["warmup_s"], 2) if s["warmup_s"] else "–"])
    return summary, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs/wan/wan_t2v_1.3b.json"))
    p.add_argument("--model_path", required=True, help="checkpoint folder; a synthetic one is written there if absent")
    p.add_argument("--shape", type=int, nargs=3, default=[480, 832, 81], metavar=("H", "W", "F"))
    p.add_argument("--steps", type=int, default=5, help="denoising steps per request (>= 5: step 1 vs steps 3..last)")
    p.add_argument("--procs", type=int, default=3, help="fresh processes per arm (>= 3 for a spread)")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--synth_dtype", default="bf16")
    p.add_argument("--time_budget_s", type=float, help="start no process round that would end after this many seconds")
    p.add_argument("--out", default=str(REPO / "bench/results/cold_start"))
    add_worker_flags(p, ["no_warmup", "warmup"])
    p.add_argument("--resume", help="an earlier OUT.json whose finished processes are kept")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.steps < 3:
        p.error(f"`--steps` must be >= 3 (step 1 is compared with steps 3..last); got {args.steps}")
    deadline = Deadline(args.time_budget_s)
    ensure_synthetic(Path(args.config), Path(args.model_path), args.synth_dtype,
                     "cuda" if args.device.startswith("cuda") else "cpu")
    common = ["--config", args.config, "--model_path", args.model_path, "--steps", str(args.steps),
              "--requests", str(args.requests), "--device", args.device, "--shape", *map(str, args.shape)]
    runs: dict[str, list[dict[str, Any]]] = {"no_warmup": [], "warmup": []}
    if args.resume and Path(args.resume).is_file():  # continue a run cut short by a time limit
        runs = json.loads(Path(args.resume).read_text())["raw"]
    seconds: dict[str, list[float]] = {"no_warmup": [], "warmup": []}  # wall seconds of each process
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.procs):
            estimate = 1.1 * sum(max(s or [0.0]) for s in seconds.values())
            if not deadline.fits(estimate):  # rounds are whole: every arm keeps the same number of processes
                print(f"time budget: {deadline.left():.0f} s left, a round of processes takes ~{estimate:.0f} s; "
                      f"stopping after {n} rounds", flush=True)
                break
            for arm in ("no_warmup", "warmup"):  # interleaved: drifts hit both arms alike
                if len(runs[arm]) > n:
                    continue
                t0 = time.perf_counter()
                res = run_worker(Path(__file__), [*common, "--arm", arm], Path(tmp) / f"{arm}{n}.json")
                seconds[arm].append(time.perf_counter() - t0)
                runs[arm].append(res)
                print(f"{arm} process {n} ({seconds[arm][-1]:.0f} s): request seconds "
                      f"{[round(r['seconds'], 3) for r in res['requests']]}", flush=True)
                write_report(args, runs)  # after every process, so a cut-short run keeps what it measured


def write_report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    done = {arm: procs for arm, procs in runs.items() if procs}
    report: dict[str, Any] = {"device": device_info(), "shape": args.shape, "steps": args.steps,
                              "procs_per_arm": {arm: len(p) for arm, p in runs.items()},
                              "requests": args.requests, "raw": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if len(done) < 2:
        Path(args.out + ".json").write_text(json.dumps(report, indent=1))
        return
    summary, rows = summarize(done)
    identical = summary["no_warmup"]["request1_sha256"] == summary["warmup"]["request1_sha256"] and \
        len(summary["warmup"]["request1_sha256"]) == 1
    last = args.requests
    header = ["arm", "processes", "step 1 s", "median step 3..last s", "step 1 / rest", "request 1 s",
              f"request {last} s", f"request 1 / request {last}", "warmup s"]
    report.update(summary=summary, request1_bit_identical_across_arms=identical)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    text = (f"# cold start ({report['device']}, shape {args.shape}, {args.steps} steps, "
            f"{args.requests} requests per process)\n\n"
            "Each cell: median [min–max] (n = processes) of the per-process value; a ratio is computed inside "
            "each process (request 1 of that process against its own later steps / last request), then "
            "summarized across processes.\n\n"
            f"{markdown_table(header, rows)}\n\n"
            f"request 1 bit-identical with and without warmup (deterministic algorithms): {identical}\n"
            f"memory before warmup (process 1): {summary['warmup']['memory_before_warmup']}\n"
            f"memory after warmup (process 1): {summary['warmup']['memory_after_warmup']}\n"
            f"audit of request 1 (warmup arm, per process): {summary['warmup']['audit_request1']}\n")
    Path(args.out + ".md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
