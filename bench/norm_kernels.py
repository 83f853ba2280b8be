"""The row-fused norm kernels (runnerkit/fused_norm.py) against the unfused ops, eager and compiled by inductor,
at one Wan transformer block's shapes (issue 22, item 3).

Part 1, per operation of a block (one CFG pass's tokens): the unfused ops eager, the unfused ops compiled
by inductor (default options, then with coordinate-descent tuning), and the Triton kernel; CUDA events over
`--iters` calls after 3 untimed ones, arms alternating in `--rounds` rounds. GB/s counts each input read
once and each output written once (the traffic floor); "s / step" is the per-call time times the calls of
one denoising step (blocks x 2 CFG passes; x 2 more for q and k).

Part 2, one whole block (random weights, bf16, the float32 tables of the checkpoint), compiled as the
runner compiles it (regional, inductor defaults), fused kernels off and on: block time per call and the
largest difference of their outputs (float32 residual stream).

    python bench/norm_kernels.py --out $OUT/norm_kernels         # writes norm_kernels.json and .md
    python bench/norm_kernels.py --smoke --out /tmp/norm_kernels  # tiny shapes on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, fmt_spread, markdown_table, median, spread, timed  # noqa: E402

# Wan2.1 14B at 480x832x81: 21 x 30 x 52 latent patches, dim 5120, 40 heads, FFN 13824, 40 blocks
SHAPE = {"tokens": 32760, "dim": 5120, "heads": 40, "ffn_dim": 13824, "blocks": 40}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention", default="sdpa_cudnn", help="backend of the whole-block part")
    p.add_argument("--no_block", action="store_true", help="skip part 2")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script, not a result)")
    args = p.parse_args()

    import torch

    from runnerkit import fused_norm as fn

    dev = torch.device("cpu" if args.smoke else "cuda")
    shape = dict(SHAPE, tokens=24, dim=64, heads=4, ffn_dim=96) if args.smoke else dict(SHAPE)
    L, D, N, blocks = shape["tokens"], shape["dim"], shape["heads"], shape["blocks"]
    bf16, f32 = torch.bfloat16, torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*size: int, dtype: torch.dtype = f32) -> torch.Tensor:
        return torch.randn(*size, device=dev, dtype=f32, generator=g).to(dtype)

    x, y = rand(1, L, D), rand(1, L, D, dtype=bf16)
    table = rand(1, 6, D) * 0.1
    shift, scale, gate = table[:, 0:1], table[:, 1:2], table[:, 2:3]
    w, b, wq = rand(D), rand(D), rand(D)
    cos, sin = rand(L, 1, D // N // 2), rand(L, 1, D // N // 2)
    q = rand(1, L, D, dtype=bf16)
    eps = 1e-6
    # name: (function, bytes moved, calls per step)
    ops: dict[str, tuple[Callable[[], Any], int, int]] = {
        "norm1 + modulation": (lambda: fn.residual_norm(x, scale=scale, shift=shift, eps=eps, out_dtype=bf16),
                               L * D * (4 + 2), blocks * 2),
        "residual + gate, norm3 (affine)": (
            lambda: fn.residual_norm(x, y=y, gate=gate, weight=w, bias=b, eps=eps, out_dtype=bf16),
            L * D * (4 + 2 + 4 + 2), blocks * 2),
        "residual, norm2 + modulation": (
            lambda: fn.residual_norm(x, y=y, scale=scale, shift=shift, eps=eps, out_dtype=bf16),
            L * D * (4 + 2 + 4 + 2), blocks * 2),
        "q/k RMSNorm + RoPE": (lambda: fn.rms_norm_rope(q, wq, cos, sin, eps=eps, num_heads=N, out_dtype=bf16),
                               L * D * (2 + 2), blocks * 2 * 2),
    }
    arms = ["eager unfused", "compiled unfused", "compiled unfused tuned", "fused"]
    results: dict[str, Any] = {}
    import torch._inductor.config as inductor_config

    with torch.inference_mode():
        for name, (op, nbytes, calls) in ops.items():
            compiled = {"compiled unfused": torch.compile(op), "compiled unfused tuned": None}
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for _ in range(args.rounds):
                for arm in arms:
                    fn.ENABLED = arm == "fused"
                    if arm == "compiled unfused tuned":
                        if args.smoke:
                            continue  # the CPU has no Triton kernels to tune
                        with inductor_config.patch(coordinate_descent_tuning=True):
                            torch._dynamo.reset()
                            compiled[arm] = compiled[arm] or torch.compile(op)
                            call = compiled[arm]
                            for _ in range(3):
                                call()
                    else:
                        call = compiled.get(arm) or op
                        for _ in range(3):
                            call()
                    times[arm] += timed(call, args.iters, dev)
            fn.ENABLED = True
            torch._dynamo.reset()
            ms = {arm: median(t) for arm, t in times.items() if t}
            results[name] = {"ms": times, "bytes": nbytes, "calls_per_step": calls,
                             "gb_s": {arm: nbytes / (v / 1000) / 1e9 for arm, v in ms.items()},
                             "s_per_step": {arm: v * calls / 1000 for arm, v in ms.items()}}
            print(name, {arm: round(v, 3) for arm, v in ms.items()}, flush=True)

        block_result = None if args.no_block else whole_block(args, shape, dev)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"device": device_info(), "shape": shape, "ops": results,
                                                    "block": block_result}, indent=1))
    rows = []
    for name, r in results.items():
        for arm in arms:
            if r["ms"][arm]:
                rows.append([name, arm, fmt_spread(spread(r["ms"][arm]), 3), f"{r['gb_s'][arm]:.0f}",
                             f"{r['s_per_step'][arm]:.3f}"])
    title = f"Row-fused norm kernels, Wan 14B block shapes ({L} tokens x {D}, {N} heads)"
    if args.smoke:
        title = "SMOKE RUN, not a result: tiny shapes on the CPU, where the fused arm runs the unfused ops"
    text = [f"# {title}", "", f"{args.rounds} rounds x {args.iters} timed calls per arm; ms: median [min-max] over "
            "all calls; GB/s: inputs read once + outputs written once over the median time.", "",
            markdown_table(["operation", "arm", "ms per call", "GB/s", "s / step"], rows), ""]
    if block_result:
        text += [f"Whole block compiled (inductor defaults, attention {block_result['attention']}): "
                 f"unfused {fmt_spread(spread(block_result['ms']['unfused']), 2)} ms, fused "
                 f"{fmt_spread(spread(block_result['ms']['fused']), 2)} ms per call; x {blocks * 2} calls a step: "
                 f"{block_result['saved_s_per_step']:.3f} s saved a step. Outputs: max abs difference "
                 f"{block_result['max_abs']:.3g} (output max abs {block_result['out_max_abs']:.3g}).", ""]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")


def whole_block(args: argparse.Namespace, shape: dict[str, int], dev: Any) -> dict[str, Any]:
    """One block compiled with the fused kernels off and on (fresh compiles): ms per call and output difference."""
    import torch

    from runnerkit import attention
    from runnerkit import fused_norm as fn
    from runnerkit.models.wan.arch import WanTransformerArch
    from runnerkit.models.wan.transformer import WanAttentionBlock, keep_fp32

    arch = WanTransformerArch(dim=shape["dim"], num_heads=shape["heads"], ffn_dim=shape["ffn_dim"], num_layers=1)
    torch.manual_seed(0)
    block = WanAttentionBlock(arch)
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.copy_(torch.randn_like(param) * (0.02 if param.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0))
            if not keep_fp32(name):
                param.data = param.data.to(torch.bfloat16)
    block.to(dev)
    name = "sdpa" if args.smoke else args.attention
    for module in block.modules():
        if isinstance(module, attention.AttentionUser):
            module.attention_fn = attention.backend_fn(name)
    L, D, d = shape["tokens"], shape["dim"], shape["dim"] // shape["heads"]
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, L, D, device=dev, generator=g)
    time_mod = torch.randn(1, 6, D, device=dev, generator=g) * 0.1
    context = torch.randn(1, 512, D, device=dev, generator=g).to(torch.bfloat16)
    angles = torch.rand(L, 1, d // 2, device=dev, generator=g) * 6.28
    rope = (angles.cos(), angles.sin())
    outs, times = {}, {"unfused": [], "fused": []}
    torch._dynamo.reset()
    compiled = torch.compile(WanAttentionBlock.forward)  # one graph per value of fn.ENABLED (a guarded global)
    call = lambda: compiled(block, x, time_mod, context, rope)  # noqa: E731
    for round_ in range(args.rounds):
        for arm in times:
            fn.ENABLED = arm == "fused"
            if round_ == 0:
                outs[arm] = call().float()
            for _ in range(2):
                call()
            times[arm] += timed(call, args.iters, dev)
    print("block", {arm: round(median(t), 3) for arm, t in times.items()}, flush=True)
    fn.ENABLED = True
    saved_ms = median(times["unfused"]) - median(times["fused"])
    return {"attention": name, "ms": times, "saved_s_per_step": saved_ms * shape["blocks"] * 2 / 1000,
            "max_abs": (outs["fused"] - outs["unfused"]).abs().max().item(),
            "out_max_abs": outs["unfused"].abs().max().item()}


if __name__ == "__main__":
    main()
