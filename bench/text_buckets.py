"""Text buckets against exact prompt lengths, per attention backend, through the launch script.

Qwen-Image 20B t2i at 1328x1328 (bench/qwen_image.py's checkpoint: the released transformer and VAE,
a 2-layer text encoder of the 7B's width), eager, CFG, `--steps` Euler steps, warmup on. Each arm is
one `python -m runnerkit.infer --warmup --requests FILE --profile_json FILE` process running six
requests over three prompts of different text lengths in the order A B A C B C (bench/first_request.py's
prompts); `--processes N` runs N rounds of the arms, interleaved.

Arms (config keys over the bench config):
- `default`: nothing set (`attention: auto`, `text_buckets: auto`): what a user gets.
- `off`: `text_buckets: off` (exact lengths).  `on`: `text_buckets: on` (padded, whatever the backend).
- `cudnn`: `attention: sdpa_cudnn` (the default's backend where FlashAttention-4 is missing).
- `fa4`: `attention: flash_attn_4` (its `auto` buckets: on); `fa4_off`: and `text_buckets: off`.
  Both skipped, with the reason, where `flash_attn.cute` does not import.

Per arm and process: the backend and buckets the run chose (its profile's `attention`), warmup seconds,
each request's seconds, steps and text-encoder seconds, and the summary: the steady step (median of every
step of the requests whose prompt ran before), the median repeat request, the median new-length
request (the first B and C; the first A is also the run's first request and is left out, as in
first_request.py), their ratio and the new first step / steady step. Prints the JSON and writes it to OUT.json.

    python bench/text_buckets.py --out $OUT/text_buckets_h100
    python bench/text_buckets.py --arms default off on fa4 --processes 2 --out $OUT/text_buckets_h100

`--smoke` runs the tiny architecture on the CPU (checks the script; not a result).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import qwen_image  # noqa: E402
from bench.common import device_info, median, run_child  # noqa: E402
from bench.first_request import ORDER, PROMPTS  # noqa: E402

ARMS: dict[str, dict[str, Any]] = {
    "default": {},
    "off": {"text_buckets": "off"},
    "on": {"text_buckets": "on"},
    "cudnn": {"attention": "sdpa_cudnn"},
    "fa4": {"attention": "flash_attn_4"},
    "fa4_off": {"attention": "flash_attn_4", "text_buckets": "off"},
}
FA4_ARMS = ("fa4", "fa4_off")
PER_ARM_S = 90.0
"""Estimated seconds of one arm's process on an H100 (load ~30 s, warmup <= 15 s, six requests ~20 s at
4 steps, interpreter and imports): `--budget_s` starts no process it would not fit."""


def fa4_missing() -> str | None:
    """Why the FlashAttention-4 arms cannot run in this environment, or None."""
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "flash_attn.cute does not import (pip install 'runnerkit[fa4]')"
    return None


def ensure_checkpoint(ckpt: Path, smoke: bool) -> float | None:
    """Write the bench checkpoint to `ckpt` unless it is there; its seconds, or None."""
    import torch

    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic

    if (ckpt / "runnerkit.json").is_file():
        return None
    t0 = time.perf_counter()
    write_synthetic(QwenImageArch.model_validate(qwen_image.bench_model()), ckpt, seed=0,
                    dtype=torch.float32 if smoke else torch.bfloat16, generator_device="cpu" if smoke else "cuda")
    return time.perf_counter() - t0


def arm_config(arm: str, ckpt: Path, steps: int, smoke: bool) -> dict[str, Any]:
    h, w, _ = (48, 80, 1) if smoke else qwen_image.SHAPE
    return {"model_cls": "qwen_image", "task": "t2i", "model_path": str(ckpt),
            "device": "cpu" if smoke else "cuda", "dtype": "float32" if smoke else "bfloat16",
            "infer_steps": steps, "target_height": h, "target_width": w, "model": qwen_image.bench_model(),
            **ARMS[arm]}


def run_arm(arm: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One process of `arm` through the launch script; its profile's numbers (or its failure)."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "config.json"
    config.write_text(json.dumps(arm_config(arm, Path(args.ckpt), args.steps, args.smoke)))
    requests = work / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": PROMPTS[key], "seed": i}) + "\n" for i, key in enumerate(ORDER)))
    profile, log = work / "profile.json", work / "run.log"
    profile.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "runnerkit.infer", "--config_json", str(config), "--requests", str(requests),
           "--warmup", "--profile_json", str(profile)]
    rc, wall_s, _ = run_child(cmd, log)
    if rc != 0 or not profile.is_file():
        return {"arm": arm, "exit_status": rc, "log_tail": log.read_text(errors="replace")[-3000:]}
    report = json.loads(profile.read_text())
    seen: set[str] = set()
    requests_out = []
    for entry, key in zip(report["requests"], ORDER, strict=True):
        requests_out.append({"index": entry["index"], "prompt": key, "first_of_prompt": key not in seen,
                             "seconds": entry["seconds"], "steps_s": entry["step_seconds"],
                             "text_encoder_s": entry["stage_seconds"].get("text_encoder", 0.0)})
        seen.add(key)
    attention = report["attention"] or {}
    return {"arm": arm, "exit_status": rc, "process_wall_s": wall_s, "attention": attention.get("backend"),
            "text_buckets": attention.get("text_buckets"), "text_buckets_reason": attention.get("text_buckets_reason"),
            "warmup_s": (report["warmup"] or {}).get("seconds"), "requests": requests_out,
            "summary": summarize_requests(requests_out)}


def summarize_requests(requests: list[dict[str, Any]]) -> dict[str, float]:
    """Steady step and request seconds, new-length against repeat (see the module docstring)."""
    repeat = [r for r in requests if not r["first_of_prompt"]]
    new = [r for r in requests if r["first_of_prompt"]][1:]  # B and C (request 0 is also the run's first)
    steady_step = median([s for r in repeat for s in r["steps_s"]])
    return {"steady_step_s": steady_step, "repeat_request_s": median([r["seconds"] for r in repeat]),
            "new_request_s": median([r["seconds"] for r in new]),
            "new_over_repeat_request": median([r["seconds"] for r in new]) / median([r["seconds"] for r in repeat]),
            "new_first_step_over_steady": median([r["steps_s"][0] for r in new]) / steady_step,
            "new_text_encoder_s": median([r["text_encoder_s"] for r in new]),
            "repeat_text_encoder_s": median([r["text_encoder_s"] for r in repeat])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=None,
                   help="default: default off on, and fa4 where flash_attn.cute imports")
    p.add_argument("--processes", type=int, default=1, help="rounds of the arms (one fresh process each)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ckpt", default="/tmp/qwen_image_20b")
    p.add_argument("--work", default="/tmp/text_buckets_work")
    p.add_argument("--budget_s", type=float, default=540.0, help="start no process past this (PER_ARM_S each)")
    p.add_argument("--out", required=True, help="OUT.json: every process's result and the summary")
    p.add_argument("--smoke", action="store_true", help="tiny architecture on the CPU (checks the script only)")
    args = p.parse_args()
    if args.processes < 1:
        p.error(f"--processes {args.processes}: at least 1")
    qwen_image.SMOKE = args.smoke
    missing = fa4_missing()
    arms = args.arms or ["default", "off", "on", *([] if missing else ["fa4"])]
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"arms": arms, "order": ORDER, "steps": args.steps, "device": device_info(),
                              "checkpoint_write_s": ensure_checkpoint(Path(args.ckpt), args.smoke),
                              "skipped": {"fa4": missing} if missing and args.arms is None else {},
                              "runs": {arm: [] for arm in arms}}
    for round_index in range(args.processes):
        for arm in arms:
            if arm in FA4_ARMS and missing:
                result["skipped"][arm] = missing
                continue
            if time.perf_counter() - t0 + PER_ARM_S > args.budget_s:
                result["skipped"].setdefault(arm, f"--budget_s {args.budget_s:g} reached in round {round_index + 1}")
                continue
            run = run_arm(arm, args, Path(args.work) / f"{arm}_{round_index}")
            result["runs"][arm].append(run)
            out.write_text(json.dumps(result, indent=1))  # after every process: a cut-short run keeps what it has
            print(f"round {round_index + 1} {arm}: " + (json.dumps(run["summary"]) if "summary" in run else
                                                      f"exit {run['exit_status']}"), flush=True)
    result["summary"] = {arm: {"attention": [r.get("attention") for r in runs],
                               "text_buckets": [r.get("text_buckets") for r in runs],
                               **{key: [r["summary"][key] for r in runs if "summary" in r]
                                  for key in ("steady_step_s", "repeat_request_s", "new_request_s",
                                              "new_over_repeat_request", "new_first_step_over_steady")}}
                         for arm, runs in result["runs"].items()}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": result["summary"], "skipped": result["skipped"]}, indent=1))
    if any(r.get("exit_status") for runs in result["runs"].values() for r in runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
