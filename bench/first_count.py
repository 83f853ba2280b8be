"""The one-time cost of a new frame count in LTX-2.5's transformer (eager), and whether warmup's one-block pass at
that count (runnerkit/models/ltx2/count_sweep.py) removes it.

The release transformer's widths (`LTX25_22B`) with `--layers` blocks, bf16, random weights, on CUDA, attention as
`attention: auto` resolves it; stage-2 grids at 512x768 (latents 16x24 per frame), 1024 text tokens, 25 audio latent
frames a second (stage 2's grids: stage 1's are those of half the size). In one process:

    warm:   256x384x25 and 512x768x473, twice each (warmup's two shapes)
    cold:   each `--cold` count: the first call, then the second (a request at a count warmup did not run)
    swept:  each `--swept` count: one call through the first block (`first_blocks(1)`), then the first and second
            full calls

    python3 bench/first_count.py [--layers 4] [--cold 121 257] [--swept 169 313]

Prints one JSON line per call: arm, frames, call (first/second), ms.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from runnerkit import attention
from runnerkit.models.ltx2.transformer import LTX2Transformer
from runnerkit.models.ltx2.transformer_arch import LTX25_22B

TEXT_TOKENS = 1024


def inputs(arch: object, frames: int, device: torch.device, size: tuple[int, int] = (512, 768)) -> dict[str, object]:
    """One stage-2 call's keyword inputs at `size` x `frames` (random values; only the shapes matter)."""
    grid = ((frames - 1) // 8 + 1, size[0] // 32, size[1] // 32)
    audio = round(frames / 24 * 25)
    t = torch.tensor([500.0], device=device)
    randn = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    return {"hidden_states": randn(1, grid[0] * grid[1] * grid[2], arch.in_channels),
            "audio_hidden_states": randn(1, audio, arch.audio_in_channels),
            "encoder_hidden_states": randn(1, TEXT_TOKENS, arch.cross_attention_dim),
            "audio_encoder_hidden_states": randn(1, TEXT_TOKENS, arch.audio_cross_attention_dim),
            "timestep": t, "sigma": t, "num_frames": grid[0], "height": grid[1], "width": grid[2],
            "audio_num_frames": audio, "fps": 24.0}


def timed(model: LTX2Transformer, kw: dict[str, object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model(**kw)
    torch.cuda.synchronize()
    model.clear_cache()  # RoPE tables are per request
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cold", type=int, nargs="*", default=[121, 257])
    parser.add_argument("--swept", type=int, nargs="*", default=[169, 313])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/first_count.py needs a CUDA device (the first-use costs it measures are CUDA's)")
    device = torch.device("cuda")
    arch = LTX25_22B.model_copy(update={"num_layers": args.layers})
    with torch.device(device):
        model = LTX2Transformer(arch).to(torch.bfloat16).eval()
    backend = attention.resolve("auto", device, torch.bfloat16, arch.attention_head_dim)
    attention.install(model, backend)
    print(json.dumps({"backend": backend.name, "layers": args.layers, "device": torch.cuda.get_device_name()}))
    for size, frames in (((256, 384), 25), ((512, 768), 473)) * 2:  # warmup's two shapes, stage 2
        ms = timed(model, inputs(arch, frames, device, size))
        print(json.dumps({"arm": "warm", "size": list(size), "frames": frames, "ms": round(ms, 2)}))
    for frames in args.cold:
        kw = inputs(arch, frames, device)
        for call in ("first", "second"):
            print(json.dumps({"arm": "cold", "frames": frames, "call": call, "ms": round(timed(model, kw), 2)}))
    for frames in args.swept:
        kw = inputs(arch, frames, device)
        with model.first_blocks(1):
            one = timed(model, kw)
        print(json.dumps({"arm": "swept", "frames": frames, "call": "one_block", "ms": round(one, 2)}))
        for call in ("first", "second"):
            print(json.dumps({"arm": "swept", "frames": frames, "call": call, "ms": round(timed(model, kw), 2)}))


if __name__ == "__main__":
    main()
