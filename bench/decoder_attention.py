"""The LTX-2.5 diffusion decoder's windowed attention (compiled FlexAttention), timed per call (CUDA only).

Stage 5 of the decoder runs neighborhood attention with an 11x11x11 window over a 4x4-pixel-patch
token grid (512x768 pixels: 128x192 tokens a frame), 4 heads of 64. Each arm runs in a fresh
process (compile state is per process) and calls `diffusion_decoder_layers.attend` on the grids it
names in order, the last one timed; a call whose q holds more than 2^31 elements needs 64-bit
indexing in the generated kernel, and a dynamic kernel compiled for such a call is then reused for
the small ones. Prints milliseconds per call (CUDA events, median of the timed calls) and the window's
FLOPs per second (N x kt*kh*kw keys x head_dim x 4 x heads).

    python bench/decoder_attention.py                      # every arm
    python bench/decoder_attention.py --arm small_after_big
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNEL = (11, 11, 11)
HEADS, HEAD_DIM = 4, 64
SMALL, TARGET, BIG = (25, 64, 96), (25, 128, 192), (342, 128, 192)
ARMS = {
    "small": [SMALL, TARGET],
    "small_after_big": [SMALL, BIG, TARGET],
    "big": [SMALL, TARGET, BIG],
    "big_per_head": [SMALL, TARGET, ("per_head",) + BIG],
}


def _time(fn, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    import torch
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def run_arm(name: str) -> dict:
    import torch

    from runnerkit.models.ltx2.diffusion_decoder_layers import attend, stage_mask

    dev = torch.device("cuda")
    rows = []
    for spec in ARMS[name]:
        per_head = spec[0] == "per_head"
        grid = tuple(spec[1:]) if per_head else tuple(spec)
        n = math.prod(grid)
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
        mask = stage_mask(grid, KERNEL, dev, HEAD_DIM)
        if per_head:
            def call() -> None:
                for h in range(HEADS):
                    attend(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], mask)
        else:
            def call() -> None:
                attend(q, k, v, mask)
        with torch.inference_mode():
            call()
            torch.cuda.synchronize()
            ms = _time(call, 1 if n > 4_000_000 else 5)
        flops = n * math.prod(KERNEL) * HEAD_DIM * 4 * HEADS
        ms_med = sorted(ms)[len(ms) // 2]
        rows.append({"grid": list(grid), "per_head": per_head, "q_elements": n * HEADS * HEAD_DIM, "ms": ms,
                     "window_tflops": round(flops / ms_med / 1e9, 1)})
        del q, k, v, mask
        torch.cuda.empty_cache()
    return {"arm": name, "calls": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=sorted(ARMS), action="append", help="arms to run (default: all)")
    p.add_argument("--child", choices=sorted(ARMS), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(run_arm(a.child)))
        return
    for arm in a.arm or list(ARMS):
        r = subprocess.run([sys.executable, __file__, "--child", arm], capture_output=True, text=True)
        if r.returncode:
            print(json.dumps({"arm": arm, "error": r.stderr[-2000:]}))
        else:
            print(r.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
