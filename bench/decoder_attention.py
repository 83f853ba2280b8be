"""The LTX-2.5 diffusion decoder's window attention (compiled FlexAttention), and whole decodes, timed (CUDA only).

Stage 5 of the decoder runs neighborhood attention with an 11x11x11 window over a 4x4-pixel-patch
token grid (512x768 pixels: 128x192 tokens a frame), 4 heads of 64. Each arm runs in a fresh
process (compile state is per process):

- `attention` arms call `diffusion_decoder_layers.neighborhood_attention` (tile order) on the grids they
  name in order, each timed after one untimed call. `raw_*` arms run it without slabs (no operand limit:
  the state before the slab split, where a call over 2^31 elements compiles a 64-bit-index kernel that
  then serves the small grid too); `tiled` with slabs. The row-major order these were first compared with
  is gone from the code; its numbers stay in bench/results/ltx25_h100_s10.md.
- `decoder_*` arms decode release-size random weights (bfloat16) at 512x768 (latents 16x24), each decode timed
  (the first includes FlexAttention's compile): `decoder_tiled` at 25, 25, 473 and again 25 output frames;
  `decoder_eager` and `decoder_regions` (the decoder's declared regions compiled by inductor, runnerkit/compile.py
  `compile_regions`) at 25, 121, 25, 121 and 57 (a count neither ran before: its compilations are counted);
  `decoder_profile` lists the operators of one 25-frame decode by device time.

Prints one JSON line per arm: milliseconds per call (CUDA events) and the window's FLOPs per second
(N x kt*kh*kw keys x head_dim x 4 x heads).

    python bench/decoder_attention.py                      # every arm
    python bench/decoder_attention.py --arm tiled --arm decoder_tiled
    python bench/decoder_attention.py --arm decoder_eager --arm decoder_regions
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNEL = (11, 11, 11)
HEADS, HEAD_DIM = 4, 64
SMALL, TARGET, BIG = (25, 64, 96), (25, 128, 192), (342, 128, 192)
ATTENTION_ARMS = {
    "raw_small_after_big": [SMALL, BIG, TARGET],
    "tiled": [SMALL, TARGET, BIG, TARGET],
}
DECODER_FRAMES = {"decoder_tiled": (25, 25, 473, 25), "decoder_eager": (25, 121, 25, 121, 57),
                  "decoder_regions": (25, 121, 25, 121, 57)}
DECODER_ARMS = (*DECODER_FRAMES, "decoder_profile")
ARMS = [*ATTENTION_ARMS, *DECODER_ARMS]


def _time(fn, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    import torch
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(round(start.elapsed_time(end), 2))
    return out


def attention_arm(name: str) -> dict:
    import torch

    from runnerkit.models.ltx2 import diffusion_decoder_layers as layers

    dev = torch.device("cuda")
    rows = []
    for grid in ATTENTION_ARMS[name]:
        n = math.prod(grid)
        q, k, v = (torch.randn(1, *grid, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
        limit = 2**62 if name.startswith("raw") else None  # raw: one call, however many elements
        mask = layers.stage_mask(grid, KERNEL, dev, HEAD_DIM, HEADS * HEAD_DIM, limit=limit)
        call = functools.partial(layers.neighborhood_attention, q, k, v, KERNEL, mask)
        with torch.inference_mode():
            call()
            torch.cuda.synchronize()
            ms = _time(call, 1 if n > 4_000_000 else 5)
        flops = n * math.prod(KERNEL) * HEAD_DIM * 4 * HEADS
        ms_med = sorted(ms)[len(ms) // 2]
        rows.append({"grid": list(grid), "slabs": len(mask.slabs), "ms": ms,
                     "window_tflops": round(flops / ms_med / 1e9, 1)})
        del q, k, v, mask, call
        torch.cuda.empty_cache()
    return {"arm": name, "calls": rows}


def decoder_arm(name: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from runnerkit.compile import compile_regions
    from runnerkit.config import CompileConfig
    from runnerkit.models.ltx2.diffusion_decode import decode_video
    from runnerkit.models.ltx2.diffusion_decoder import LTX25_DIFFUSION_DECODER, LTX2DiffusionDecoder

    with torch.device("cuda"):
        model = LTX2DiffusionDecoder(LTX25_DIFFUSION_DECODER).to(torch.bfloat16).eval()
    if name == "decoder_profile":
        return {"arm": name, "top_cuda_ops": profile_decode(model)}
    if name == "decoder_regions":
        compile_regions(model, CompileConfig(enabled=True))
    rows = []
    for frames in DECODER_FRAMES[name]:
        graphs = counters["stats"]["unique_graphs"]
        latents = torch.randn(1, 128, (frames - 1) // 8 + 1, 16, 24, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.inference_mode():
            video = decode_video(model, latents, generator=0)
        torch.cuda.synchronize()
        rows.append({"frames": frames, "shape": list(video.shape), "s": round(time.perf_counter() - start, 3),
                     "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                     "graphs_compiled": counters["stats"]["unique_graphs"] - graphs})
        del video
    return {"arm": name, "decodes": rows}


def profile_decode(model, frames: int = 25, top: int = 20) -> list[dict]:  # type: ignore[no-untyped-def]
    """The device time of one whole decode by operator (torch.profiler), after an untimed one: where the time
    outside the window attention goes (the CPU noise draw shows as the gap, not as an operator)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runnerkit.models.ltx2.diffusion_decode import decode_video

    latents = torch.randn(1, 128, (frames - 1) // 8 + 1, 16, 24, device="cuda")
    with torch.inference_mode():
        decode_video(model, latents, generator=0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            decode_video(model, latents, generator=0)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:top]
    rows = [{"op": e.key[:80], "calls": e.count, "self_device_ms": round(e.self_device_time_total / 1e3, 1),
             "cpu_ms": round(e.cpu_time_total / 1e3, 1)} for e in events]
    return [{"wall_s": round(wall, 3)}, *rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=ARMS, action="append", help="arms to run (default: all)")
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(decoder_arm(a.child) if a.child in DECODER_ARMS else attention_arm(a.child)))
        return
    for arm in a.arm or ARMS:
        r = subprocess.run([sys.executable, __file__, "--child", arm], capture_output=True, text=True)
        if r.returncode:
            print(json.dumps({"arm": arm, "error": r.stderr[-2000:]}), flush=True)
        else:
            print(r.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
