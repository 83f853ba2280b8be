"""Qwen-Image 20B text-to-image at 1328x1328: step time, first request after warmup against steady,
block offload against all-resident (issue 10).

One arm per invocation (`--arm none` or `--arm block`), in this process: load, warmup (the 20B
flavour's shapes 1328x1328 and 928x1664), then `--requests` requests at 1328x1328 with true CFG
and `--steps` Euler steps. Reports per request the step seconds (CUDA events), stage seconds,
wall seconds and the device peak. `--summarize` merges the arms' JSON files into one table (OUT.md).

The checkpoint (`--ckpt`, written first if missing, drawn on the GPU) is a runnerkit-layout
checkpoint with the released 20B transformer (60 blocks, 3072 wide, 20.4B parameters, bf16) and
VAE. Its text encoder is a 2-layer Qwen2.5-VL of the 7B's width (3584, so the transformer's
joint attention sees the real text width) with the tiny tokenizer: the 7B encoder would add
~16 GB to the device's 64 GiB disk and only changes the `text_encoder` stage, which is not what
this bench measures.

    python bench/qwen_image.py --arm block --ckpt /tmp/qwen_image_20b --out $OUT/qwen_image_h200
    python bench/qwen_image.py --summarize --out bench/results/qwen_image_h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, fmt_spread, markdown_table, median, spread  # noqa: E402

SHAPE = (1328, 1328, 1)
GIB = 1024**3
SMOKE = False  # --smoke: the tiny architecture on the CPU at 48x80 (checks the script; not a result)
#: Request prompts; `--vary_prompts`: requests 0-1 the first, 2-3 the second (another text length).
PROMPTS = ("a lighthouse on a cliff at dawn, a sign that reads \"runnerkit\"",
           "a bowl of ramen on a wooden table, steam rising, soft window light, shallow depth of field, 35mm photo")
TINY = Path(__file__).resolve().parents[1] / "configs/qwen_image/qwen_image_t2i_tiny.json"


def bench_model() -> dict[str, Any]:
    """The `model` of the bench checkpoint: the released 20B transformer and VAE, a 2-layer text encoder."""
    tiny = json.loads(TINY.read_text())["model"]
    if SMOKE:
        return tiny
    text = {**tiny["text_encoder"], "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_key_value_heads": 4, "mrope_section": [16, 24, 24], "vision_out_hidden_size": 3584}
    return {"transformer": {}, "text_encoder": text, "vae": {}}


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic
    from runnerkit.models.qwen_image.runner import QwenImageRunner

    ckpt = Path(args.ckpt)
    write_s = None
    if not (ckpt / "runnerkit.json").is_file():
        t0 = time.perf_counter()
        write_synthetic(QwenImageArch.model_validate(bench_model()), ckpt, seed=0,
                        dtype=torch.float32 if SMOKE else torch.bfloat16, generator_device="cpu" if SMOKE else "cuda")
        write_s = time.perf_counter() - t0
    h, w, _ = SHAPE
    config = load_runner_config(None, {
        "model_cls": "qwen_image", "task": "t2i", "model_path": str(ckpt), "device": "cpu" if SMOKE else "cuda",
        "dtype": "float32" if SMOKE else "bfloat16", "infer_steps": args.steps, "target_height": h,
        "target_width": w, "warmup": True, "offload": {"mode": args.arm}, "model": bench_model()})
    cuda = torch.cuda.is_available() and not SMOKE
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    runner = QwenImageRunner(config)
    runner.init_modules()
    init_s = time.perf_counter() - t0
    requests = []
    for i in range(args.requests):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        prompt = PROMPTS[i // 2 % len(PROMPTS)] if args.vary_prompts else PROMPTS[0]
        runner.run_pipeline(RequestConfig(prompt=prompt, seed=i,
                                          save_tensor_path=str(Path(args.work) / f"r{i}.safetensors")), i)
        wall = time.perf_counter() - t1
        prof = runner.profiler.requests[-1]
        requests.append({"index": i, "prompt": prompt, "wall_s": wall, "steps_s": prof.steps, "stages_s": prof.stages,
                         "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
                         "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else 0.0,
                         "shape": prof.shape})
        assert tuple(prof.shape) == SHAPE, f"request shape {prof.shape}, expected {SHAPE}"
    return {"arm": args.arm, "steps": args.steps, "shape": list(SHAPE), "checkpoint_write_s": write_s,
            "init_s": init_s, "warmup": runner.profiler.warmup, "phases": runner.profiler.phases,
            "requests": requests, "device": device_info()}


def summarize(out: Path) -> None:
    arms = {arm: json.loads(p.read_text()) for arm in ("none", "block")
            if (p := out.with_name(f"{out.name}_{arm}.json")).is_file()}
    rows = []
    for arm, r in arms.items():
        reqs, steady = r["requests"], r["requests"][1:]
        rows.append([
            {"none": "all-resident", "block": "block offload"}[arm], f"{r['init_s']:.1f}",
            f"{reqs[0]['wall_s']:.2f}", fmt_spread(spread([q["wall_s"] for q in steady]), 2),
            f"{reqs[0]['wall_s'] / median([q['wall_s'] for q in steady]):.3f}",
            fmt_spread(spread(reqs[0]["steps_s"]), 3), fmt_spread(spread([s for q in steady for s in q["steps_s"]]), 3),
            f"{max(q['peak_alloc_gib'] for q in reqs):.1f} / {max(q['peak_reserved_gib'] for q in reqs):.1f}"])
    header = ["arm", "init s (load + warmup)", "request 0 s", "steady requests s", "request 0 / steady",
              "request 0 step s", "steady step s (CFG: 2 forwards)", "device peak GiB (alloc / reserved)"]
    text = [f"# Qwen-Image 20B t2i, {SHAPE[0]}x{SHAPE[1]}, H200 (bench/qwen_image.py)", "",
            markdown_table(header, rows), ""]
    if "none" in arms and "block" in arms:
        def steady_step(arm: str) -> float:
            return median([s for q in arms[arm]["requests"][1:] for s in q["steps_s"]])
        text.append(f"Block offload step / all-resident step: {steady_step('block') / steady_step('none'):.3f} "
                    "(medians of the steady requests' steps).")
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=("none", "block"))
    p.add_argument("--ckpt", default="/tmp/qwen_image_20b")
    p.add_argument("--work", default="/tmp/qwen_image_work")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--out", required=True, help="OUT prefix: OUT_<arm>.json per arm, OUT.md from --summarize")
    p.add_argument("--vary_prompts", action="store_true",
                   help="requests 0-1 use one prompt, 2-3 another of another token count (first-time costs of a new "
                        "text length); the arm's JSON gets the suffix _prompts")
    p.add_argument("--summarize", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny architecture on the CPU (checks the script only)")
    args = p.parse_args()
    if args.smoke:
        global SMOKE, SHAPE
        SMOKE, SHAPE = True, (48, 80, 1)
    out = Path(args.out)
    if args.summarize:
        summarize(out)
        return
    Path(args.work).mkdir(parents=True, exist_ok=True)
    result = run_arm(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = "_prompts" if args.vary_prompts else ""
    out.with_name(f"{out.name}_{args.arm}{suffix}.json").write_text(json.dumps(result, indent=1))
    for q in result["requests"]:
        print(q["index"], f"wall {q['wall_s']:.2f}", "steps", [round(s, 3) for s in q["steps_s"]],
              f"peak {q['peak_alloc_gib']:.1f} GiB", "stages", {k: round(v, 2) for k, v in q["stages_s"].items()})
    print("init", round(result["init_s"], 1), "write", result["checkpoint_write_s"], "warmup",
          {k: result["warmup"].get(k) for k in ("seconds", "shapes")})


if __name__ == "__main__":
    main()
