"""Requests per hour with and without the writer thread (`--max_writes_in_flight`), through the launch script.

For one runner config, each arm runs the launch script in a fresh process on the same requests file
(`--requests` requests, prompts and seeds varied, each writing its result file, .mp4 for video tasks
or .png for image ones, with its sidecar, and with `--save_tensors` its .safetensors too), with
`--warmup` and `--profile_json`, and reads the profile back:

- `requests_per_hour`: requests x 3600 / `phases.requests_seconds` (the first request's start until
  the last one was done, its files written; load and warmup excluded);
- the `save` stage (what the request's compute thread spent saving: the whole write inline, the
  hand-off with the writer thread), the writer's seconds per request (`write.seconds`), the waits for
  a free writer slot (`write.wait_seconds`), and the median denoising step (does the writer slow the
  device's steps?).

Arms alternate process by process (0, 1, 0, 1, ...) so a drift of the machine hits both; `--repeats`
processes per arm. Prints one JSON object (and writes it to `--out`.json when given).

    python bench/write_overlap.py --config_json configs/ltx2/ltx23_t2av_22b_distilled.json \
        --model_path $CKPT/ltx-2.3-22b-distilled.safetensors --upsampler_path ... --text_encoder_path ... \
        --requests 6 --repeats 2 --out $OUT/write_overlap_ltx2_h100
    python bench/write_overlap.py --config_json configs/wan/wan_t2v_1_3b.json --model_path $CKPT/wan_1_3b \
        --requests 6 --arms 0 1 2 --out $OUT/write_overlap_wan_h100

`--smoke` runs the tiny Wan config on the CPU (checks the script; not a result).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, device_info, median, run_child, spread  # noqa: E402

#: Prompts cycled over the requests (content changes nothing of the cost; it keeps requests distinct).
PROMPTS = ("a red fox running through fresh snow at dawn", "waves breaking on a pebble beach under a grey sky",
           "a lighthouse on a cliff at night, its beam sweeping the fog", "a busy street market in the rain")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_json", help="the runner config to measure (required unless --smoke)")
    p.add_argument("--model_path", help="passed to the launch script")
    p.add_argument("--text_encoder_path", help="passed to the launch script (single-file releases)")
    p.add_argument("--upsampler_path", help="passed to the launch script (single-file two-stage releases)")
    p.add_argument("--task", help="passed to the launch script")
    p.add_argument("--offload", help="passed to the launch script")
    p.add_argument("--infer_steps", type=int, help="passed to the launch script")
    p.add_argument("--image_path", help="the conditioning image of every request (image-conditioned tasks)")
    p.add_argument("--result_suffix", choices=(".mp4", ".png"), default=None,
                   help="result file kind (default: .mp4, or .png when the config's task makes images)")
    p.add_argument("--requests", type=int, default=6, help="requests per process (default 6)")
    p.add_argument("--repeats", type=int, default=2, help="processes per arm (default 2)")
    p.add_argument("--arms", type=int, nargs="+", default=[0, 1], help="--max_writes_in_flight values (default 0 1)")
    p.add_argument("--save_tensors", action="store_true", help="every request also writes its .safetensors")
    p.add_argument("--no_warmup", action="store_true", help="run without --warmup (the first request compiles)")
    p.add_argument("--out", help="write the JSON to OUT.json and the processes' logs beside it")
    p.add_argument("--smoke", action="store_true", help="the tiny Wan config on the CPU: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.config_json = args.config_json or str(REPO / "configs/wan/wan_t2v_tiny.json")
        args.requests, args.repeats = min(args.requests, 3), 1
    if not args.config_json:
        p.error("--config_json is required (or --smoke)")
    if args.requests < 2:
        p.error("--requests must be >= 2: one request has nothing to overlap its files with")
    return args


def requests_file(args: argparse.Namespace, folder: Path, suffix: str) -> Path:
    lines = []
    for k in range(args.requests):
        line: dict[str, Any] = {"prompt": PROMPTS[k % len(PROMPTS)], "seed": k,
                                "save_result_path": str(folder / f"r{k}{suffix}")}
        if args.save_tensors:
            line["save_tensor_path"] = str(folder / f"r{k}.safetensors")
        if args.image_path:
            line["image_path"] = args.image_path
        lines.append(line)
    path = folder / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def result_suffix(args: argparse.Namespace) -> str:
    if args.result_suffix:
        return args.result_suffix
    task = args.task or json.loads(Path(args.config_json).read_text()).get("task", "")
    return ".png" if task in ("t2i", "i2i") else ".mp4"


def run_arm(args: argparse.Namespace, arm: int, repeat: int, work: Path, logs: Path) -> dict[str, Any]:
    """One launch-script process with `--max_writes_in_flight arm`; what its profile says."""
    folder = work / f"arm{arm}_{repeat}"
    folder.mkdir(parents=True)
    profile = folder / "profile.json"
    cmd = [sys.executable, "-m", "runnerkit", "--config_json", args.config_json,
           "--requests", str(requests_file(args, folder, result_suffix(args))), "--profile_json", str(profile),
           "--max_writes_in_flight", str(arm), "--progress", "off"]
    cmd += [] if args.no_warmup else ["--warmup"]
    for flag in ("model_path", "text_encoder_path", "upsampler_path", "task", "offload", "infer_steps"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag}", str(getattr(args, flag))]
    if args.smoke:
        cmd += ["--device", "cpu"]
    status, wall, peak_rss = run_child(cmd, logs / f"arm{arm}_{repeat}.log")
    if status != 0:
        raise RuntimeError(f"arm {arm} (process {repeat}) exited {status}; see {logs / f'arm{arm}_{repeat}.log'}")
    report = json.loads(profile.read_text())
    reqs = report["requests"]
    seconds = report["phases"]["requests_seconds"]
    steps = [s for r in reqs for s in r["step_seconds"]]
    files = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("r"))
    return {"requests_seconds": seconds, "requests_per_hour": len(reqs) * 3600 / seconds,
            "save_stage_seconds": [r["stage_seconds"].get("save", 0.0) for r in reqs],
            "write_seconds": [r["write"]["seconds"] for r in reqs],
            "write_wait_seconds": [r["write"]["wait_seconds"] for r in reqs],
            "request_seconds": [r["seconds"] for r in reqs], "step_seconds_median": median(steps),
            "all_saved": all(r["saved"] for r in reqs), "output_bytes": files, "process_wall_seconds": wall,
            "peak_host_rss_gib": peak_rss}


def summarize(runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm, results in runs.items():
        arms[str(arm)] = {
            "requests_per_hour": spread([r["requests_per_hour"] for r in results]),
            "requests_seconds": spread([r["requests_seconds"] for r in results]),
            "save_stage_seconds_median": median([s for r in results for s in r["save_stage_seconds"]]),
            "write_seconds_median": median([s for r in results for s in r["write_seconds"]]),
            "write_wait_seconds_median": median([s for r in results for s in r["write_wait_seconds"]]),
            "step_seconds_median": median([r["step_seconds_median"] for r in results]),
            "peak_host_rss_gib": max(r["peak_host_rss_gib"] for r in results),
            "all_saved": all(r["all_saved"] for r in results),
            "processes": results,
        }
    base = arms.get("0", {}).get("requests_per_hour", {}).get("median")
    speedup = {k: v["requests_per_hour"]["median"] / base for k, v in arms.items() if base and k != "0"}
    return {"arms": arms, "speedup_over_inline": speedup}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else None
    logs = out.parent / f"{out.name}_logs" if out else Path(tempfile.mkdtemp(prefix="write_overlap_logs_"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[int, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="write_overlap_") as tmp:
        for repeat in range(args.repeats):
            for arm in args.arms:  # alternating: a drift of the machine hits every arm alike
                runs[arm].append(run_arm(args, arm, repeat, Path(tmp), logs))
                print(f"arm {arm} process {repeat}: {runs[arm][-1]['requests_per_hour']:.1f} requests/hour",
                      file=sys.stderr, flush=True)
    result = {"bench": "write_overlap", "config": args.config_json, "requests_per_process": args.requests,
              "save_tensors": args.save_tensors, "warmup": not args.no_warmup, "smoke": args.smoke,
              "device": device_info() if not args.smoke else "cpu (smoke: not a result)",
              "wall_seconds": round(time.perf_counter() - t0, 1), **summarize(runs)}
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
