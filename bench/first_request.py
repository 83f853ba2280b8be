"""First requests at steady speed (issue 22, items 1 and 2): new prompt lengths, the server's first job.

Qwen-Image 20B t2i at 1328x1328 (bench/qwen_image.py's checkpoint: the released transformer and
VAE, a 2-layer text encoder of the 7B's width), eager, CFG, warmup on, `--steps` Euler steps.

- `--arm prompts --text_buckets auto|off`: one process, six requests over three prompts of
  different text lengths in the order A B A C B C. Each request's first step, text-encoder stage
  and wall time, split into the first of its prompt and the repeats (steady).
- `--arm server`: a real `runnerkit serve --warmup` on the GPU, three jobs of one prompt through
  `POST /v1/images/generations`, each job's timings read back from `GET /v1/images/{id}`: job 1 /
  job 3 and job 1's first step against the steady steps.

    python bench/first_request.py --arm prompts --text_buckets off --out $OUT/first_request_h200
    python bench/first_request.py --arm prompts --text_buckets auto --out $OUT/first_request_h200
    python bench/first_request.py --arm server --processes 3 --out $OUT/first_request_h200
    python bench/first_request.py --summarize --out $OUT/first_request_h200

`--smoke` runs the tiny architecture on the CPU (checks the script; not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import qwen_image  # noqa: E402
from bench.common import device_info, fmt_spread, markdown_table, median, spread  # noqa: E402
from bench.serve_load import http  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: Three prompts of different text lengths (A < B < C tokens).
PROMPTS = {
    "A": "a red kite over a beach",
    "B": "a lighthouse on a cliff at dawn, waves breaking on black rocks below, gulls in the wind, "
         "a sign on the door that reads \"runnerkit\", warm light in the top window",
    "C": "a bowl of ramen on a wooden table in a small shop at night, steam rising into the light of a paper "
         "lantern, a pair of chopsticks resting on the rim, rain on the window behind it, neon signs blurred "
         "in the street outside, a cat asleep on the next stool, soft film grain, shallow depth of field, "
         "35mm photo, muted colours, a calm and quiet mood",
}
ORDER = "ABACBC"


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    h, w, _ = qwen_image.SHAPE if not args.smoke else (48, 80, 1)
    cfg: dict[str, Any] = {
        "model_cls": "qwen_image", "task": "t2i", "model_path": str(args.ckpt),
        "device": "cpu" if args.smoke else "cuda", "dtype": "float32" if args.smoke else "bfloat16",
        "infer_steps": args.steps, "target_height": h, "target_width": w, "warmup": True,
        "model": qwen_image.bench_model()}
    if args.text_buckets != "default":
        cfg["text_buckets"] = args.text_buckets
    return cfg


def ensure_checkpoint(args: argparse.Namespace) -> float | None:
    import torch

    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic

    if (Path(args.ckpt) / "runnerkit.json").is_file():
        return None
    t0 = time.perf_counter()
    write_synthetic(QwenImageArch.model_validate(qwen_image.bench_model()), Path(args.ckpt), seed=0,
                    dtype=torch.float32 if args.smoke else torch.bfloat16,
                    generator_device="cpu" if args.smoke else "cuda")
    return time.perf_counter() - t0


def run_prompts(args: argparse.Namespace) -> dict[str, Any]:
    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.models.qwen_image.runner import QwenImageRunner

    write_s = ensure_checkpoint(args)
    runner = QwenImageRunner(load_runner_config(None, base_config(args)))
    t0 = time.perf_counter()
    runner.init_modules()
    init_s = time.perf_counter() - t0
    requests, seen = [], set()
    for i, key in enumerate(ORDER):
        t1 = time.perf_counter()
        runner.run_pipeline(RequestConfig(prompt=PROMPTS[key], seed=i), i)
        prof = runner.profiler.requests[-1]
        requests.append({"index": i, "prompt": key, "first_of_prompt": key not in seen,
                         "wall_s": time.perf_counter() - t1, "steps_s": prof.steps, "stages_s": prof.stages})
        seen.add(key)
        print(f"request {i} ({key}): {requests[-1]['wall_s']:.3f} s, first step {prof.steps[0]:.3f} s, "
              f"text encoder {prof.stages.get('text_encoder', 0):.4f} s", flush=True)
    return {"arm": "prompts", "text_buckets": runner.config.text_buckets, "checkpoint_write_s": write_s,
            "init_s": init_s, "warmup": runner.profiler.warmup, "attention": runner.profiler.attention,
            "requests": requests, "device": device_info()}


def run_server(args: argparse.Namespace) -> dict[str, Any]:
    write_s = ensure_checkpoint(args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    config = work / "server_config.json"
    config.write_text(json.dumps(base_config(args)))
    log = work / "server.log"
    cmd = [sys.executable, "-m", "runnerkit.infer", "serve", "--config_json", str(config), "--port", "0",
           "--warmup", "--output_dir", str(work / "jobs")]
    t0 = time.perf_counter()
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ}, stdout=subprocess.DEVNULL, stderr=sink)
    try:
        url = None
        while proc.poll() is None and time.perf_counter() - t0 < args.ready_timeout_s:
            m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
            url = url or (m.group(1) if m else None)
            if url and http("GET", url + "/health/ready")[0] == 200:
                break
            time.sleep(0.2)
        else:
            raise SystemExit(f"the server did not become ready:\n{log.read_text(errors='replace')[-3000:]}")
        ready_s = time.perf_counter() - t0
        jobs = []
        for i in range(3):
            status, _, body = http("POST", url + "/v1/images/generations",
                                   {"prompt": PROMPTS["B"], "response_format": "url", "seed": i})
            if status != 200:
                raise SystemExit(f"job {i + 1}: HTTP {status}: {body[:500]!r}")
            job_id = json.loads(body)["data"][0]["url"].rstrip("/").split("/")[-2]
            status, _, body = http("GET", f"{url}/v1/images/{job_id}")
            timings = json.loads(body)["timings"]
            jobs.append({"job": i + 1, "id": job_id, "seconds": timings["seconds"], "steps_s": timings["steps"],
                         "stages_s": timings["stages"]})
            print(f"job {i + 1}: {timings['seconds']:.3f} s, first step {timings['steps'][0]:.3f} s, "
                  f"text encoder {timings['stages'].get('text_encoder', 0):.4f} s", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    threads = re.findall(r"request from another thread[^\n]*", log.read_text(errors="replace"))
    return {"arm": "server", "checkpoint_write_s": write_s, "ready_s": ready_s, "jobs": jobs,
            "thread_warnings": threads, "device": device_info()}


def runs_of(path: Path) -> list[dict[str, Any]]:
    """The process runs a result file holds: `--processes N` writes {"runs": [...]}, earlier files one run."""
    r = json.loads(path.read_text())
    return r["runs"] if "runs" in r else [r]


def prompts_row(label: str, r: dict[str, Any]) -> tuple[list[Any], float, float]:
    """One process's table row, its new/repeat request ratio and its new first step / steady step."""
    attention = (r.get("attention") or {}).get("backend", "not recorded")
    first = [q for q in r["requests"] if q["first_of_prompt"]][1:]  # request 0's prompt is warmup's length
    steady = [q for q in r["requests"] if not q["first_of_prompt"]]
    steady_step = median([s for q in steady for s in q["steps_s"][1:]] + [q["steps_s"][0] for q in steady])
    request_ratio = median([q["wall_s"] for q in first]) / median([q["wall_s"] for q in steady])
    step_ratio = median([q["steps_s"][0] for q in first]) / steady_step
    return [label, attention, f"{(r['warmup'] or {}).get('seconds', 0):.1f}",
            fmt_spread(spread([q["steps_s"][0] for q in first])), fmt_spread(spread([q["steps_s"][0] for q in steady])),
            fmt_spread(spread([q["stages_s"].get("text_encoder", 0) for q in first]), 4),
            fmt_spread(spread([q["stages_s"].get("text_encoder", 0) for q in steady]), 4),
            fmt_spread(spread([q["wall_s"] for q in first])), fmt_spread(spread([q["wall_s"] for q in steady])),
            f"{request_ratio:.3f}", f"{step_ratio:.3f}"], request_ratio, step_ratio


def server_ratios(r: dict[str, Any]) -> tuple[float, float, float]:
    """job 1 / job 3, job 1's first step / the steady step (the median step of jobs 2-3), and job 1's first
    step / the first steps of jobs 2-3 (a job's first step runs before the board reaches its power cap)."""
    jobs = r["jobs"]
    return (jobs[0]["seconds"] / jobs[-1]["seconds"],
            jobs[0]["steps_s"][0] / median([s for j in jobs[1:] for s in j["steps_s"]]),
            jobs[0]["steps_s"][0] / median([j["steps_s"][0] for j in jobs[1:]]))


def summarize(out: Path) -> str:
    lines = ["# First requests at steady speed: new prompt lengths, the server's first job (bench/first_request.py)", ""]
    rows, spreads = [], []
    # earlier runs kept under a dated name: (file suffix, label)
    for suffix, buckets in (("off", "off"), ("auto_cudnn_2026-12-02", "auto, 2026-12-02 (before FA4 took masks)"),
                            ("auto", "auto")):
        p = out.with_name(f"{out.name}_prompts_{suffix}.json")
        if not p.is_file():
            continue
        runs = runs_of(p)
        per = [prompts_row(buckets if len(runs) == 1 else f"{buckets}, process {i + 1}", r) for i, r in enumerate(runs)]
        rows += [row for row, _, _ in per]
        if len(runs) > 1:
            spreads.append(f"text_buckets {buckets}, {len(runs)} processes: new / repeat request "
                           f"{fmt_spread(spread([x for _, x, _ in per]))}, new first step / steady step "
                           f"{fmt_spread(spread([y for _, _, y in per]))}")
    if rows:
        lines += ["## New prompt lengths (six requests A B A C B C; 'new' = the first B and C, 'repeat' = later ones)", "",
                  markdown_table(["text_buckets", "attention ran", "warmup s", "new: first step s", "repeat: first step s",
                                  "new: text encoder s", "repeat: text encoder s", "new: request s",
                                  "repeat: request s", "new / repeat request", "new first step / steady step"], rows), "",
                  *[f"{line}; " if i < len(spreads) - 1 else line for i, line in enumerate(spreads)],
                  *([""] if spreads else [])]
    p = out.with_name(f"{out.name}_server.json")
    if p.is_file():
        runs = runs_of(p)
        lines += ["## The server's first job (three jobs of one prompt after `--warmup` readiness)", ""]
        table = []
        for i, r in enumerate(runs):
            table += [[i + 1, j["job"], f"{j['seconds']:.3f}", f"{j['steps_s'][0]:.3f}",
                       " ".join(f"{s:.3f}" for s in j["steps_s"]), f"{j['stages_s'].get('text_encoder', 0):.4f}"]
                      for j in r["jobs"]]
        lines += [markdown_table(["process", "job", "seconds", "first step s", "steps s", "text encoder s"], table), ""]
        ratios = [server_ratios(r) for r in runs]
        lines += [f"job 1 / job 3 = {fmt_spread(spread([a for a, _, _ in ratios]), 4)}; job 1's first step / steady "
                  f"step (jobs 2-3) = {fmt_spread(spread([b for _, b, _ in ratios]), 4)}, / the first steps of jobs 2-3 = "
                  f"{fmt_spread(spread([c for _, _, c in ratios]), 4)}; ready after "
                  f"{fmt_spread(spread([r['ready_s'] for r in runs]), 1)} s; thread warnings in the server logs: "
                  f"{sum(len(r['thread_warnings']) for r in runs)}", ""]
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=("prompts", "server"))
    p.add_argument("--text_buckets", default="default", help="'auto', 'off' or 'default' (the config's default)")
    p.add_argument("--ckpt", default="/tmp/qwen_image_20b")
    p.add_argument("--work", default="/tmp/first_request_work")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ready_timeout_s", type=float, default=400)
    p.add_argument("--out", required=True, help="OUT prefix: OUT_prompts_<buckets>.json, OUT_server.json, OUT.md")
    p.add_argument("--processes", type=int, default=1, help="fresh processes of the arm, one after another")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    p.add_argument("--summarize", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny architecture on the CPU (checks the script only)")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        qwen_image.SMOKE = True
    if args.summarize:
        print(summarize(out))
        return
    if args.arm not in ("prompts", "server"):
        p.error("--arm or --summarize is required")
    if args.processes < 1:
        p.error(f"--processes {args.processes}: at least 1")
    if args.one:  # one process of a --processes N run: its result to the file the parent reads
        Path(args.one).write_text(json.dumps(run_prompts(args) if args.arm == "prompts" else run_server(args)))
        return
    runs = []
    for i in range(args.processes):  # each in a fresh process
        result_file = Path(args.work) / f"process_{i}.json"
        result_file.parent.mkdir(parents=True, exist_ok=True)
        rc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", str(result_file)], cwd=REPO).returncode
        if rc:
            raise SystemExit(f"process {i + 1} of {args.processes} exited {rc} (its error is above); "
                             f"{len(runs)} finished process(es) kept")
        runs.append(json.loads(result_file.read_text()))
        buckets = runs[0].get("text_buckets")
        name = (f"{out.name}_prompts_{buckets if isinstance(buckets, str) else 'list'}" if args.arm == "prompts"
                else f"{out.name}_server")
        # written after every process: a run cut short keeps the processes it finished
        out.with_name(name + ".json").write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=1))
        print(f"process {i + 1} of {args.processes} done", flush=True)
    print(summarize(out))


if __name__ == "__main__":
    main()
