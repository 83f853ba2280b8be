"""The MLP with its tanh GELU fused into the first GEMM (runnerkit/fused.py) against the unfused ops, eager
bf16, at the MLP shapes of the bench plans of bench/speed.py (issue 11, item 4).

Per shape: the block's MLP (Linear -> tanh GELU -> Linear) on one CFG pass's tokens, timed with CUDA
events over `--iters` calls after 3 untimed ones, fused and unfused alternating in `--rounds` rounds.
The per-step figure is the per-call difference times blocks times CFG passes (2): what the fused
GELU saves per denoising step if nothing else changes. Eager only: compiled, inductor emits the
unfused GELU as one pointwise kernel of the same traffic, and keeps the fused GEMM as an extern call.

    python bench/fused_ffn.py --out $OUT/fused_ffn     # writes fused_ffn.json and fused_ffn.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, fmt_spread, markdown_table, median, spread, timed  # noqa: E402

SHAPES = {
    # name: (tokens per CFG pass, dim, hidden, blocks)
    "Wan2.1 1.3B 480x832x81": (32760, 1536, 8960, 30),
    "Wan2.1 14B 480x832x81": (32760, 5120, 13824, 40),
    "Qwen-Image 1328x1328 (image stream)": (6889, 3072, 12288, 60),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script, not a result)")
    args = p.parse_args()

    import torch

    from runnerkit import fused
    from runnerkit.fused import TanhGELUMLP

    dev = torch.device("cpu" if args.smoke else "cuda")
    results = {}
    for name, (tokens, dim, hidden, blocks) in SHAPES.items():
        if args.smoke:
            tokens, dim, hidden = tokens // 256, dim // 16, hidden // 16
        mlp = TanhGELUMLP(dim, hidden, dim).to(dev, torch.bfloat16)
        x = torch.randn(1, tokens, dim, device=dev, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {"fused": [], "unfused": []}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for arm in times:
                    fused.ENABLED = arm == "fused"
                    for _ in range(3):
                        mlp(x)
                    times[arm] += timed(lambda: mlp(x), args.iters, dev)
        fused.ENABLED = True
        saved_ms = median(times["unfused"]) - median(times["fused"])
        results[name] = {"tokens": tokens, "dim": dim, "hidden": hidden, "blocks": blocks, "ms": times,
                         "saved_ms_per_call": saved_ms, "saved_s_per_step": saved_ms * blocks * 2 / 1000}
        print(name, {k: round(median(v), 3) for k, v in times.items()}, flush=True)
        del mlp, x
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"device": device_info(), "shapes": results}, indent=1))
    rows = [[name, f"{r['tokens']} x {r['dim']} -> {r['hidden']}", fmt_spread(spread(r["ms"]["unfused"]), 3),
             fmt_spread(spread(r["ms"]["fused"]), 3), f"{r['saved_ms_per_call']:.3f}",
             f"{r['blocks']} x 2", f"{r['saved_s_per_step']:.3f}"] for name, r in results.items()]
    title = "MLP with the GELU fused into its first GEMM (bf16, eager)"
    if args.smoke:  # the CPU runs the unfused ops in both arms
        title = "SMOKE RUN, not a result: shapes / 16-256 on the CPU, where both arms run the unfused ops"
    text = [f"# {title}", "",
            f"{args.rounds} rounds x {args.iters} timed calls per arm; cells: median [min-max] ms per call.", "",
            markdown_table(["shape", "tokens x dim -> hidden", "unfused ms", "fused ms", "saved ms / call",
                            "calls per step", "saved s / step"], rows), ""]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
