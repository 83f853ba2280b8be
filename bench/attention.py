"""Attention backends at Wan2.1 1.3B, 480x832x81 with CFG: steady step time per backend (issue 11, item 3).

One backend per process (`--backend`), in this process: load the synthetic 1.3B checkpoint
(written first if missing), one request of `--steps` UniPC steps without warmup, step times from
CUDA events. The steady step is the median of steps 2..N (step 1 pays first-call costs). The FLOP
floor is issue 11's count: ~0.57 PFLOP per CFG step at this shape, 0.72 s at the H200's measured
bf16 matmul rate (~790 TFLOP/s). `--summarize` merges the backends' JSON files into OUT.md.

    python bench/attention.py --backend sdpa_cudnn --ckpt /tmp/wan13 --out $OUT/attention_h200
    python bench/attention.py --summarize --out bench/results/attention_h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, device_info, ensure_synthetic, fmt_spread, markdown_table, median, spread  # noqa: E402

FLOOR_S = 0.72  # issue 11: 0.57 PFLOP per CFG step at 480x832x81 (1.3B) / 790 TFLOP/s
BACKENDS = ("sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn_4")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.models.wan.runner import WanT2VRunner

    ckpt = ensure_synthetic(REPO / "configs/wan/wan_t2v_1.3b.json", Path(args.ckpt), generator_device="cuda")
    data = json.loads((REPO / "configs/wan/wan_t2v_1.3b.json").read_text())
    data.update(model_path=str(ckpt), infer_steps=args.steps, attention=args.backend)
    t0 = time.perf_counter()
    runner = WanT2VRunner(load_runner_config(None, data))
    runner.init_modules()
    init_s = time.perf_counter() - t0
    runner.run_pipeline(RequestConfig(prompt="a red fox running through fresh snow", seed=0,
                                      save_tensor_path=str(Path(args.work) / f"{args.backend}.safetensors")), 0)
    prof = runner.profiler.requests[-1]
    return {"backend": args.backend, "attention": runner.profiler.attention, "steps_s": prof.steps,
            "stages_s": prof.stages, "init_s": init_s,
            "peak_alloc_gib": torch.cuda.max_memory_allocated() / 1024**3, "device": device_info()}


def summarize(out: Path) -> None:
    rows = []
    for name in BACKENDS:
        path = out.with_name(f"{out.name}_{name}.json")
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        if "error" in r:
            rows.append([name, "refused: " + r["error"][:120], "", "", ""])
            continue
        steady = r["steps_s"][1:]
        rows.append([name, r["attention"]["backend"], fmt_spread(spread(steady), 3), f"{median(steady) / FLOOR_S:.2f}",
                     f"{r['steps_s'][0]:.3f}"])
    text = ["# Attention backends, Wan2.1 1.3B 480x832x81 with CFG, H200 (bench/attention.py)", "",
            markdown_table(["config `attention`", "ran", "steady step s (steps 2..N)", "step / FLOP floor (0.72 s)",
                            "step 1 s"], rows), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS)
    p.add_argument("--ckpt", default="/tmp/wan13")
    p.add_argument("--work", default="/tmp/attention_work")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--summarize", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    if args.summarize:
        summarize(out)
        return
    Path(args.work).mkdir(parents=True, exist_ok=True)
    try:
        result = run(args)
    except NotImplementedError as exc:  # the backend cannot run here: the refusal is the result
        result = {"backend": args.backend, "error": str(exc)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(f"{out.name}_{args.backend}.json").write_text(json.dumps(result, indent=1))
    print(args.backend, {k: v for k, v in result.items() if k in ("error", "steps_s", "attention", "init_s")})


if __name__ == "__main__":
    main()
