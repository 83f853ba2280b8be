"""Wan2.1 14B with a 4-step distill LoRA on the GPU (issue 23): step time against the base step, the
adapter switch cost, request 1 / request 3, fused and unfused.

configs/wan/wan_t2v_14b_distill4.json (4 Euler steps, CFG off, 480x832x81) on bench/speed.py's synthetic
14B checkpoint, with a synthetic rank-64 adapter in the LightX2V layout (`runnerkit.lora.synthetic`: the
released adapter's key names and shapes, not its effect). One process per arm and `--procs` rounds;
each process, after warmup, serves in order:

    r0 A, r1 A, r2 A, r3 none, r4 A, r5 none        (A: the adapter at strength 1)

- request 1 / request 3: r0 / r2 (both with the adapter);
- LoRA step: the steps of r1 and r2; base step: the steps of r3 and r5 (same process, same shape);
- switch cost: r4 (adapter on after a request without) and r3 (off after one with) against the
  steady request of the same kind (r1-r2 and r5), in seconds of wall time.

    python bench/lora_distill.py --out $OUT/lora_distill_h200
    python bench/lora_distill.py --summarize --out bench/results/lora_distill_h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO, add_worker_flags, device_info, fmt_spread, markdown_table, median,  # noqa: E402
                          run_worker, spread)

ARMS = ("unfused", "fused")
SEQUENCE = ("A", "A", "A", None, "A", None)
PROMPT = "a red fox running through fresh snow"


def checkpoint(args: argparse.Namespace) -> Path:
    from bench import speed

    ns = argparse.Namespace(smoke=args.smoke, ckpt_root=args.ckpt_root, layers=0)
    _, ck = speed.setup("wan13" if args.smoke else "wan14", ns)
    return ck


def config(args: argparse.Namespace, ck: Path, mode: str) -> dict[str, Any]:
    data = json.loads((REPO / "configs/wan/wan_t2v_14b_distill4.json").read_text())
    if args.smoke:  # the tiny architecture on the CPU: checks the script, not a result
        tiny = json.loads((REPO / "configs/wan/wan_t2v_tiny.json").read_text())
        data.update(model=tiny["model"], device="cpu", dtype="float32", target_height=32, target_width=32,
                    target_video_length=5)
    adapter = Path(args.ckpt_root) / ("lora_smoke.safetensors" if args.smoke else "distill4_r64.safetensors")
    data.update(model_path=str(ck), warmup=True, attention="auto")
    data["lora"] = {**data["lora"], "mode": mode, "adapters": {"A": str(adapter)}}
    return data


def write_adapter(args: argparse.Namespace, ck: Path) -> None:
    from runnerkit.lora.synthetic import main as synth

    cfg = Path(args.ckpt_root) / "distill_config.json"
    data = config(args, ck, "unfused")
    cfg.write_text(json.dumps(data))
    adapter = Path(data["lora"]["adapters"]["A"])
    if not adapter.is_file() and synth(["--config", str(cfg), "--out", str(adapter), "--layout", "lightx2v",
                                        "--rank", "4" if args.smoke else "64"]) != 0:
        raise SystemExit("the synthetic adapter could not be written")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.registry import get_runner_cls

    ck = checkpoint(args)
    t0 = time.perf_counter()
    cfg = load_runner_config(None, config(args, ck, args.arm))
    runner = get_runner_cls(cfg.model_cls, cfg.task)(cfg)
    runner.init_modules()
    out: dict[str, Any] = {"arm": args.arm, "init_s": time.perf_counter() - t0, "warmup": runner.profiler.warmup,
                           "attention": runner.profiler.attention, "requests": []}
    work = Path(args.ckpt_root) / "out"
    work.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(SEQUENCE):
        lora = [{"path": name}] if name else None
        t1 = time.perf_counter()
        prof = runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=0, lora=lora,
                                                 save_tensor_path=str(work / f"{args.arm}_{i}.safetensors")), i)
        out["requests"].append({"index": i, "lora": name, "wall_s": time.perf_counter() - t1,
                                "steps_s": prof.steps, "stages_s": prof.stages, "audit": prof.audit})
    from safetensors.torch import load_file

    videos = [load_file(str(work / f"{args.arm}_{i}.safetensors"))["video"] for i in range(len(SEQUENCE))]
    out["base_requests_equal"] = bool(torch.equal(videos[3], videos[5]))
    out["lora_requests_equal"] = bool(torch.equal(videos[0], videos[4]))
    out["adapter_changes_output"] = not torch.equal(videos[0], videos[3])
    out["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else 0.0
    out["device"] = device_info()
    return out


def summarize(out: Path) -> None:
    data = json.loads(out.with_suffix(".json").read_text())
    rows = []
    for arm, procs in data["arms"].items():
        ok = [p for p in procs if "error" not in p]
        if not ok:
            rows.append([arm, "failed: " + (procs[0]["error"][:160] if procs else "not run")] + [""] * 8)
            continue

        def steps(p: dict[str, Any], idx: tuple[int, ...]) -> float:
            return median([s for i in idx for s in p["requests"][i]["steps_s"]])

        lora = [steps(p, (1, 2)) for p in ok]
        base = [steps(p, (3, 5)) for p in ok]
        wall = [[r["wall_s"] for r in p["requests"]] for p in ok]
        on = [w[4] - median(w[1:3]) for w in wall]
        off = [w[3] - w[5] for w in wall]
        rows.append([arm, ok[0]["attention"]["backend"] if ok[0].get("attention") else "", str(len(ok)),
                     fmt_spread(spread(base), 3), fmt_spread(spread(lora), 3),
                     fmt_spread(spread([a / b for a, b in zip(lora, base)]), 3),
                     fmt_spread(spread(on), 2), fmt_spread(spread(off), 2),
                     fmt_spread(spread([w[0] / w[2] for w in wall]), 3),
                     " ".join(str(sum(r["audit"].get("compilations", 0) for r in p["requests"])) for p in ok),
                     " ".join(f"{p['base_requests_equal']}/{p['lora_requests_equal']}/{p['adapter_changes_output']}"
                              for p in ok),
                     " ".join(f"{p['peak_alloc_gib']:.1f}" for p in ok)])
    text = [f"# {data['title']}", "",
            "Cells: median [min–max] over processes. Switch on: the request with the adapter after one without, "
            "minus the steady request with it; switch off: the request without after one with, minus the "
            "steady request without. Equal: base requests r3 = r5 / adapter requests r0 = r4 / the adapter "
            "changes the output (bit for bit).", "",
            markdown_table(["lora.mode", "attention", "procs", "base step s", "LoRA step s", "LoRA / base",
                            "switch on s", "switch off s", "request 1 / request 3", "compilations in requests",
                            "equal (base/adapter/changes)", "peak alloc GiB"], rows), ""]
    text += [f"- {n}" for n in data.get("notes", [])] + ([""] if data.get("notes") else [])
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--ckpt_root", default="/tmp/speed")
    p.add_argument("--budget_s", type=float, default=540.0, help="start no new process after this many seconds")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run (default: all)")
    p.add_argument("--merge", default="", help="an earlier run's JSON whose arms this run's results join")
    p.add_argument("--summarize", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny architecture on the CPU (checks the script only)")
    add_worker_flags(p, ARMS)
    args = p.parse_args()
    out = Path(args.out)
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return
    if args.summarize:
        summarize(out)
        return
    t0 = time.perf_counter()
    ck = checkpoint(args)
    write_adapter(args, ck)
    title = ("SMOKE (tiny Wan on the CPU, rank 4: checks the script, not a result)" if args.smoke else
             "Wan2.1 14B, 4-step distill LoRA (rank 64, LightX2V layout), 480x832x81, CFG off, warmup")
    data: dict[str, Any] = {"title": f"{title} (bench/lora_distill.py)", "arms": {a: [] for a in ARMS}}
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        for arm, procs in earlier["arms"].items():
            data["arms"][arm].extend(procs)
        data["notes"] = earlier.get("notes", [])
    out.parent.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.procs):
        for arm in [a for a in ARMS if a in args.arms.split(",")]:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget reached: {arm} round {rnd} not started", flush=True)
                continue
            extra = ["--out", str(out), "--ckpt_root", args.ckpt_root, "--arm", arm] + (["--smoke"] if args.smoke else [])
            result = out.with_name(f"{out.name}_{arm}{rnd}.tmp.json")
            try:
                data["arms"][arm].append(run_worker(Path(__file__), extra, result))
            except RuntimeError as exc:
                data["arms"][arm].append({"error": str(exc)})
            result.unlink(missing_ok=True)
            print(f"{arm} round {rnd} done at {time.perf_counter() - t0:.0f} s", flush=True)
            out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    summarize(out)


if __name__ == "__main__":
    main()
