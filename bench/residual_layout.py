"""One Wan transformer block with its float32 residual stream channel-major (the strides `transpose(1, 2).float()`
left before 2026-12-03) against row-major (what `WanTransformer3D.embed` hands the blocks now), eager and
compiled as the runner compiles a block (issue 22, item 3).

Random weights at a flavour's block shapes (bf16, the checkpoint's float32 tables), one CFG pass's tokens
at 480x832x81; CUDA events over `--iters` calls after 2 untimed ones, layouts alternating in `--rounds`
rounds. With `--profile`, one call per layout runs under torch.profiler and its CUDA kernels are summed by
name (the 12 longest). "s / step" is the per-call time times blocks x 2 CFG passes.

    python bench/residual_layout.py --out $OUT/residual_layout     # writes residual_layout.json and .md
    python bench/residual_layout.py --smoke --out /tmp/residual_layout
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import check_timing_args, device_info, fmt_spread, markdown_table, median, spread, timed  # noqa: E402

FLAVOURS = {  # name: (dim, heads, ffn_dim, blocks); 480x832x81 is 21 x 30 x 52 = 32760 tokens
    "14B": (5120, 40, 13824, 40),
    "1.3B": (1536, 12, 8960, 30),
}
TOKENS = 32760


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--flavours", nargs="+", default=["14B"], choices=list(FLAVOURS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention", default="sdpa_cudnn")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script, not a result)")
    args = p.parse_args()
    out = check_timing_args(p, args)

    import torch

    from runnerkit import attention
    from runnerkit.models.wan.arch import WanTransformerArch
    from runnerkit.models.wan.transformer import WanAttentionBlock, keep_fp32

    dev = torch.device("cpu" if args.smoke else "cuda")
    results: dict[str, Any] = {}
    for flavour in args.flavours:
        dim, heads, ffn_dim, blocks = (64, 4, 96, 2) if args.smoke else FLAVOURS[flavour]
        L = 48 if args.smoke else TOKENS
        torch.manual_seed(0)
        block = WanAttentionBlock(WanTransformerArch(dim=dim, num_heads=heads, ffn_dim=ffn_dim, num_layers=1))
        with torch.no_grad():
            for name, param in block.named_parameters():
                param.copy_(torch.randn_like(param) * (0.02 if param.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0))
                if not keep_fp32(name):
                    param.data = param.data.to(torch.bfloat16)
        block.to(dev)
        backend = "sdpa" if args.smoke else args.attention
        for module in block.modules():
            if isinstance(module, attention.AttentionUser):
                module.attention_fn = attention.backend_fn(backend)
        g = torch.Generator(device=dev).manual_seed(1)
        row_major = torch.randn(1, L, dim, device=dev, generator=g)
        channel_major = row_major.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (L*dim, 1, L)
        time_mod = torch.randn(1, 6, dim, device=dev, generator=g) * 0.1
        context = torch.randn(1, 512, dim, device=dev, generator=g).to(torch.bfloat16)
        angles = torch.rand(L, 1, dim // heads // 2, device=dev, generator=g) * 6.28
        rope = (angles.cos(), angles.sin())
        torch._dynamo.reset()
        compiled = torch.compile(WanAttentionBlock.forward)
        arms = {f"{mode} {layout}": (fn, x) for mode, fn in (("eager", WanAttentionBlock.forward), ("compiled", compiled))
                for layout, x in (("channel-major", channel_major), ("row-major", row_major))}
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        outs: dict[str, Any] = {}
        kernels: dict[str, list[tuple[str, float]]] = {}
        with torch.inference_mode():
            for round_ in range(args.rounds):
                for arm, (fn, x) in arms.items():
                    call = lambda: fn(block, x, time_mod, context, rope)  # noqa: E731, B023
                    if round_ == 0:
                        outs[arm] = call().float()
                    for _ in range(2):
                        call()
                    times[arm] += timed(call, args.iters, dev)
            if args.profile and not args.smoke:
                for arm, (fn, x) in arms.items():
                    kernels[arm] = profile_kernels(lambda: fn(block, x, time_mod, context, rope))  # noqa: B023
        ms = {arm: median(t) for arm, t in times.items()}
        ref = outs["eager channel-major"]
        results[flavour] = {
            "tokens": L, "dim": dim, "blocks": blocks, "attention": backend, "ms": times,
            "s_per_step": {arm: v * blocks * 2 / 1000 for arm, v in ms.items()},
            "max_abs_vs_eager_channel_major": {arm: (o - ref).abs().max().item() for arm, o in outs.items()},
            "kernels_ms": kernels}
        print(flavour, {arm: round(v, 3) for arm, v in ms.items()}, flush=True)
        del block, row_major, channel_major, outs
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    out.with_suffix(".json").write_text(json.dumps({"device": device_info(), "flavours": results}, indent=1))
    title = "Wan block: residual stream channel-major vs row-major"
    if args.smoke:
        title = "SMOKE RUN, not a result: tiny shapes on the CPU"
    text = [f"# {title}", "", f"One block, 1 x {TOKENS} tokens (480x832x81, one CFG pass), attention "
            f"{args.attention}; {args.rounds} rounds x {args.iters} calls per arm, ms: median [min-max].", ""]
    for flavour, r in results.items():
        rows = [[arm, fmt_spread(spread(t), 3), f"{r['s_per_step'][arm]:.3f}",
                 f"{r['max_abs_vs_eager_channel_major'][arm]:.3g}"] for arm, t in r["ms"].items()]
        text += [f"## {flavour} (dim {r['dim']}, {r['blocks']} blocks)", "",
                 markdown_table(["arm", "ms per block call", "s / step (x blocks x 2)", "max abs vs eager channel-major"],
                                rows), ""]
        for arm, ks in r["kernels_ms"].items():
            text += [f"{arm}, profiled call, longest kernels (ms): " + "; ".join(f"`{n[:70]}` {v:.3f}" for n, v in ks), ""]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")


def profile_kernels(call: Any, top: int = 12) -> list[tuple[str, float]]:
    """CUDA kernel time (ms) by name of one call, the `top` longest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.device_time / 1000
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


if __name__ == "__main__":
    main()
