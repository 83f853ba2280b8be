"""fp8 compute (config `compute_dtype: fp8`, runnerkit/fp8_compute.py) against bf16, block-level, Wan2.1
1.3B or 14B at 480x832x81 (issue 22, item 4).

A stack of `--blocks` Wan transformer blocks (random weights at the architecture's sizes, or the first
blocks of a checkpoint with `--model_path`) runs one CFG pass's tokens (32760 video tokens, 512 text
tokens) in three arms: float32 (the reference of the distance), bf16, and fp8 (bf16 model dtype, the
blocks' linears converted as the runner converts them). Per arm: `--iters` timed calls of the whole
stack after 3 untimed ones, arms alternating over `--rounds` rounds; the step estimate is the
per-block median x the model's blocks x 2 CFG passes. `--compile` adds compiled arms (inductor,
regional compile as the runner does it: one compiled block forward).

Distance: the stack's output (the float32 residual stream after `--blocks` blocks) of bf16 and of
fp8 against float32, as SNR in dB (10 log10 |ref|^2 / |arm - ref|^2) and the cosine similarity. The
decoded video's PSNR needs the whole pipeline: run the launch script twice with the same seed,
`compute_dtype` same and fp8, and compare the saved tensors (docs/fp8_compute.md).

    python bench/fp8_compute.py --model 1.3b --out $OUT/fp8_compute_1.3b        # writes .json and .md
    python bench/fp8_compute.py --model 14b --blocks 4 --compile --out $OUT/fp8_compute_14b
    python bench/fp8_compute.py --smoke --out /tmp/fp8_smoke                      # CPU, tiny: checks the script
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, fmt_spread, markdown_table, median, spread, timed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"1.3b": REPO / "configs/wan/wan_t2v_1.3b.json", "14b": REPO / "configs/wan/wan_t2v_14b.json",
           "tiny": REPO / "configs/wan/wan_t2v_tiny.json"}
TOKENS, TEXT_TOKENS = 32760, 512  # 480x832x81: latent 21 x 60 x 104, patch 1x2x2 -> 21*30*52 tokens


def build_blocks(arch: Any, n: int, model_path: str | None, seed: int) -> Any:
    """`n` Wan blocks in float32 on the CPU: the checkpoint's first ones, or random (Wan's init scales)."""
    import torch
    from torch import nn

    from runnerkit.models.wan.transformer import WanAttentionBlock

    torch.manual_seed(seed)
    blocks = nn.ModuleList(WanAttentionBlock(arch) for _ in range(n))
    if model_path is None:
        for m in blocks.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)  # Wan's own init of its linears
                nn.init.normal_(m.bias, std=0.02)
        return blocks.float().eval().requires_grad_(False)
    from runnerkit.models.wan.checkpoint import WanCheckpoint

    sd = WanCheckpoint.open(Path(model_path), override=None).transformer_state_dict()
    own = {}
    for key, value in sd.items():
        parts = key.split(".")
        if parts[0] == "blocks" and int(parts[1]) < n:
            own[key.removeprefix("blocks.")] = value.float()
    blocks.load_state_dict(own, strict=True)
    return blocks.float().eval().requires_grad_(False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=["1.3b", "14b"], default="1.3b")
    p.add_argument("--model_path", default=None, help="Wan checkpoint folder: its first blocks instead of random ones")
    p.add_argument("--blocks", type=int, default=4, help="blocks in the timed stack")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="add inductor-compiled bf16 and fp8 arms")
    p.add_argument("--smoke", action="store_true",
                   help="the tiny architecture on the CPU (checks the script, not a result)")
    args = p.parse_args()

    import torch

    from runnerkit import fp8_compute
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.transformer import keep_fp32

    dev = torch.device("cpu" if args.smoke else "cuda")
    name = "tiny" if args.smoke else args.model
    arch = WanArch.model_validate(json.loads(CONFIGS[name].read_text())["model"]).transformer
    tokens, text = (96, 512) if args.smoke else (TOKENS, TEXT_TOKENS)
    why, bias_in_gemm = fp8_compute.probe(dev, torch.bfloat16)
    if why is not None:
        sys.exit(f"fp8 compute cannot run here: {why}")

    base = build_blocks(arch, args.blocks, args.model_path, seed=0)
    head = arch.dim // arch.num_heads
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, arch.dim, generator=gen)  # float32 residual stream
    time_mod = torch.randn(1, 6, arch.dim, generator=gen) * 0.1
    context = torch.randn(1, text, arch.dim, generator=gen)
    angles = torch.randn(tokens, 1, head // 2, generator=gen)  # [L, 1, head_dim / 2]
    inputs = [t.to(dev) for t in (x, time_mod, context, angles.cos(), angles.sin())]

    def arm(dtype: torch.dtype, fp8: bool) -> Any:
        blocks = copy.deepcopy(base)
        for pname, param in blocks.named_parameters():  # what Wan keeps float32 stays so, as the runner loads it
            if not keep_fp32(f"blocks.{pname}"):
                param.data = param.data.to(dtype)
        if fp8:
            fp8_compute.convert_blocks(torch.nn.ModuleDict({"blocks": blocks}), "blocks", (), dtype, bias_in_gemm)
        return blocks.to(dev)

    def run(blocks: Any, compiled: bool = False) -> Callable[[], Any]:
        # compiled: one compiled block forward shared by every block, as runnerkit/compile.py installs it
        fwd = torch.compile(type(blocks[0]).forward) if compiled else type(blocks[0]).forward
        xs, tm, ctx, cos, sin = inputs

        def call() -> Any:
            h = xs
            for b in blocks:
                h = fwd(b, h, tm, ctx, (cos, sin))
            return h

        return call

    arms: dict[str, Callable[[], Any]] = {}
    with torch.inference_mode():
        arms["float32"] = run(arm(torch.float32, False))
        ref = arms["float32"]().float()
        arms["bf16"] = run(arm(torch.bfloat16, False))
        arms["fp8"] = run(arm(torch.bfloat16, True))
        if args.compile:
            arms["bf16 compiled"] = run(arm(torch.bfloat16, False), compiled=True)
            arms["fp8 compiled"] = run(arm(torch.bfloat16, True), compiled=True)
        distance = {}
        for k, fn in arms.items():
            if k == "float32":
                continue
            out = fn().float()
            err = (out - ref).pow(2).sum().item()
            distance[k] = {"snr_db": 10 * math.log10(ref.pow(2).sum().item() / err) if err > 0 else math.inf,
                           "cosine": torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()}
        timed_arms = [k for k in arms if k != "float32"]
        ms: dict[str, list[float]] = {k: [] for k in timed_arms}
        for _ in range(args.rounds):
            for k in timed_arms:
                for _ in range(3):
                    arms[k]()
                ms[k] += timed(arms[k], args.iters, dev)
    per_block = {k: median(v) / args.blocks for k, v in ms.items()}
    step_s = {k: v * arch.num_layers * 2 / 1000 for k, v in per_block.items()}
    results = {"model": name, "arch": arch.model_dump(mode="json"), "tokens": tokens, "text_tokens": text,
               "blocks": args.blocks, "random_weights": args.model_path is None, "bias_in_gemm": bias_in_gemm,
               "ms_per_stack": ms, "ms_per_block": per_block, "step_s_estimate": step_s,
               "distance_vs_float32": distance}
    for k in timed_arms:
        print(k, f"{per_block[k]:.3f} ms/block", f"{step_s[k]:.3f} s/step", distance[k], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"device": device_info(), **results}, indent=1))
    rows = [[k, fmt_spread(spread([v / args.blocks for v in ms[k]]), 3), f"{step_s[k]:.3f}",
             f"{step_s['bf16'] / step_s[k]:.3f}", f"{distance[k]['snr_db']:.2f}", f"{distance[k]['cosine']:.6f}"]
            for k in timed_arms]
    title = f"Wan2.1 {name}: fp8 compute vs bf16, {args.blocks} blocks, {tokens} tokens (one CFG pass)"
    if args.smoke:
        title = "SMOKE RUN, not a result: the tiny architecture on the CPU"
    weights = "random" if args.model_path is None else "checkpoint"
    text_md = [f"# {title}", "",
               f"{args.rounds} rounds x {args.iters} timed calls per arm; {weights} "
               f"weights; step = ms/block x {arch.num_layers} blocks x 2 CFG passes; SNR and cosine of the stack's "
               "output against the float32 stack.", "",
               markdown_table(["arm", "ms / block", "s / step (est.)", "speed-up vs bf16", "SNR dB vs fp32", "cosine"],
                              rows), ""]
    out.with_suffix(".md").write_text("\n".join(text_md) + "\n")
    print("\n".join(text_md))


if __name__ == "__main__":
    main()
