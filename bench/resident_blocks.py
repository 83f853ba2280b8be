"""`offload.resident_blocks`: forward time of a block-streamed Wan transformer per number of blocks kept resident.

The Wan 14B block (dim 5120, 40 heads, ffn 13824: 0.65 GiB of bf16 weights) x `--blocks`, synthetic weights,
streamed from pinned host memory (`offload.mode` block, 2 slots, prefetch 1) through `stream_module`, with
`resident_blocks` in `--resident`, against the same weights all resident. One transformer call on a
`frames` x 60 x 104 latent grid (frames x 1560 tokens) and a 512-token text context; CUDA events (wall
clock on the CPU) over `--iters` calls after 2 untimed ones. Reports the median call, the H2D copies per call
(streamer counter, averaged over all calls), the device's peak allocated GiB, and whether the output equals
the resident model's bit for bit.

    python bench/resident_blocks.py --out $OUT/resident_blocks        # writes resident_blocks.json and .md
    python bench/resident_blocks.py --smoke --out /tmp/resident_blocks # tiny blocks on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, markdown_table, median, timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--resident", type=int, nargs="+", default=[0, 1, 2, 4, 6, 8])
    p.add_argument("--frames", type=int, nargs="+", default=[1, 5, 21])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny blocks on the CPU (checks the script, not a result)")
    args = p.parse_args()

    import torch
    from loguru import logger

    from runnerkit.config import OffloadConfig
    from runnerkit.models.wan.arch import WanTransformerArch
    from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
    from runnerkit.offload.setup import stream_module
    from runnerkit.weights import assign_state_dict, build_on_meta

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    size = ({"dim": 64, "num_heads": 2, "ffn_dim": 128, "text_dim": 32} if args.smoke else
            {"dim": 5120, "num_heads": 40, "ffn_dim": 13824, "text_dim": 4096})
    arch = WanTransformerArch(num_layers=args.blocks, in_dim=16, out_dim=16, **size)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {k: v.shape for k, v in build_on_meta(lambda: WanTransformer3D(arch)).state_dict().items()}
    weights = {k: (torch.randn(s, generator=gen, device=dev, dtype=dtype) * 0.02).cpu() for k, s in shapes.items()}
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if dev.type == "cuda" else (lambda: float("nan"))

    rows: list[dict[str, Any]] = []
    for frames in args.frames:
        g = torch.Generator(device=dev).manual_seed(1)
        grid = (4, 6) if args.smoke else (60, 104)
        x = (torch.randn(1, 16, frames, *grid, generator=g, device=dev, dtype=dtype),  # [B, C, F, H, W]
             torch.tensor([700.0], device=dev),
             torch.randn(1, 512, arch.text_dim, generator=g, device=dev, dtype=dtype))  # [B, L, text_dim]
        tokens = frames * grid[0] * grid[1] // 4

        def run(model: Any, x: tuple[Any, ...] = x) -> tuple[float, Any]:
            with torch.no_grad():
                for _ in range(2):
                    model(*x)
                ms = timed(lambda: model(*x), args.iters, dev)
                return median(ms), model(*x)

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        resident = assign_state_dict(build_on_meta(lambda: WanTransformer3D(arch)), weights, "transformer",
                                     dtype=dtype, keep_fp32=keep_fp32, device=dev).eval()
        ms, want = run(resident)
        rows.append({"tokens": tokens, "mode": "none", "resident_blocks": "-", "ms": ms, "copies": 0.0,
                     "peak_gib": peak(), "equal": True})
        del resident
        for n in args.resident:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            model = build_on_meta(lambda: WanTransformer3D(arch))
            cfg = OffloadConfig(mode="block", resident_blocks=n, pin_memory=not args.smoke)
            streamer = stream_module(model, WanTransformer3D.STREAM_SPEC, cfg, dev, dtype, "transformer",
                                     state_dict=weights)
            ms, got = run(model.eval())
            calls = 2 + args.iters + 1
            rows.append({"tokens": tokens, "mode": "block", "resident_blocks": n, "ms": ms,
                         "copies": streamer.stats()["h2d_copies"] / calls, "peak_gib": peak(),
                         "equal": bool(torch.equal(got, want))})
            streamer.close()
            del model, streamer
        print(json.dumps(rows[-1 - len(args.resident):]), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"device": device_info(), "args": vars(args), "rows": rows},
                                                   indent=1))
    table = markdown_table(["tokens", "mode", "resident_blocks", "call ms (median)", "H2D copies / call",
                            "peak GiB", "equal to none"],
                           [[r["tokens"], r["mode"], r["resident_blocks"], r["ms"], r["copies"], r["peak_gib"],
                             r["equal"]] for r in rows])
    out.with_suffix(".md").write_text(f"# resident_blocks ({device_info().get('gpu', 'cpu')})\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
