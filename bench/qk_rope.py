"""Formulations of the Wan blocks' q/k RMSNorm + RoPE as inductor compiles them (issue 22, item 3).

The kernel that fuses the self-attention's q (or k) RMSNorm with RoPE is the largest non-matmul kernel of
a compiled Wan 14B step (0.097 s of 0.257 s, bench/results/speed_wan14_layout_h200.md), about 3.4x the time
of its memory traffic (read q, write q, bf16). Each formulation here is compiled alone (inductor
defaults) on one CFG pass's tokens at 480x832x81 and timed with CUDA events; GB/s counts q read once and
written once. Eager results are compared with the model's formulation (`stack`, max abs difference).

- `stack` (the model's `apply_rope`): even/odd channels unbound, rotated, stacked back.
- `flip`: `x * C + swap(x) * S` with tables expanded to the head width (C = cos per pair repeated,
  S = (-sin, +sin) per pair) and `swap` exchanging the two channels of each pair (`flip(-1)`): the same
  products and sums, so eager values are the same bits.
- `two kernels`: the RMSNorm's inverse RMS [B, L, 1] computed first (a graph break keeps inductor from
  fusing it), then RoPE as a pointwise kernel that reads q again.
- `rotate-half`: RoPE on head halves (`x * C + cat(x2, x1) * S`), which the model could use if the q and k
  projections' output channels (and their biases, RMSNorm weights and LoRA B rows) were permuted per head
  to (evens, odds) at load: attention scores do not depend on the order of a head's channels. Timed on
  permuted inputs; its output, permuted back, is compared with `stack`.

    python bench/qk_rope.py --out $OUT/qk_rope         # writes qk_rope.json and qk_rope.md
    python bench/qk_rope.py --smoke --out /tmp/qk_rope
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import check_timing_args, device_info, fmt_spread, markdown_table, median, spread, timed  # noqa: E402

FLAVOURS = {"14B": (5120, 40, 40), "1.3B": (1536, 12, 30)}  # dim, heads, blocks
TOKENS = 32760
EPS = 1e-6


def formulations() -> dict[str, Callable[..., Any]]:
    import torch

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * w

    def stack(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, C: torch.Tensor,
              S: torch.Tensor, heads: int) -> torch.Tensor:
        x0, x1 = rms(q, w).unflatten(-1, (heads, -1, 2)).unbind(-1)  # [B, L, N, d/2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2).to(q.dtype)

    def flip(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, C: torch.Tensor,
             S: torch.Tensor, heads: int) -> torch.Tensor:
        x = rms(q, w).unflatten(-1, (heads, -1))  # [B, L, N, d]
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0) per pair
        return (x * C + swapped * S).to(q.dtype)

    @torch.compiler.disable
    def inverse_rms(q: torch.Tensor) -> torch.Tensor:
        x = q.float()
        return torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS)

    def two_kernels(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, C: torch.Tensor,
                    S: torch.Tensor, heads: int) -> torch.Tensor:
        r = inverse_rms(q)
        x0, x1 = (q.float() * r * w).unflatten(-1, (heads, -1, 2)).unbind(-1)
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2).to(q.dtype)

    def rotate_half(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, C: torch.Tensor,
                    S: torch.Tensor, heads: int) -> torch.Tensor:
        # q, w with each head's channels permuted to (evens, odds); C = (cos, cos), S = (-sin, sin) per head half
        x = rms(q, w).unflatten(-1, (heads, -1))  # [B, L, N, d]
        x1, x2 = x.chunk(2, dim=-1)
        return (x * C + torch.cat([x2, x1], -1) * S).to(q.dtype)

    return {"stack": stack, "flip": flip, "two kernels": two_kernels, "rotate-half": rotate_half}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--flavours", nargs="+", default=["14B", "1.3B"], choices=list(FLAVOURS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script, not a result)")
    args = p.parse_args()
    out = check_timing_args(p, args)

    import torch

    dev = torch.device("cpu" if args.smoke else "cuda")
    forms = formulations()
    results: dict[str, Any] = {}
    for flavour in args.flavours:
        dim, heads, blocks = (64, 4, 2) if args.smoke else FLAVOURS[flavour]
        L, d = (40 if args.smoke else TOKENS), dim // heads
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, L, dim, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(dim, device=dev, generator=g)
        angles = torch.rand(L, 1, d // 2, device=dev, generator=g) * 6.28
        cos, sin = angles.cos(), angles.sin()  # [L, 1, d/2]
        C = cos.repeat_interleave(2, dim=-1)  # [L, 1, d]
        S = torch.stack([-sin, sin], -1).flatten(-2)  # [L, 1, d]
        perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)]).to(dev)  # a head's (evens, odds)
        full = (torch.arange(heads, device=dev)[:, None] * d + perm).flatten()  # [dim]
        back = torch.argsort(perm)  # a head's channels back in their order
        halves = (q[..., full], w[full], cos, sin, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1), heads)
        inputs = {name: halves if name == "rotate-half" else (q, w, cos, sin, C, S, heads) for name in forms}

        def unpermute(name: str, out: torch.Tensor) -> torch.Tensor:
            return out[..., back] if name == "rotate-half" else out

        torch._dynamo.reset()
        compiled = {name: torch.compile(f) for name, f in forms.items()}
        times: dict[str, list[float]] = {name: [] for name in forms}
        with torch.inference_mode():
            ref = forms["stack"](*inputs["stack"]).float()
            diff = {n: (unpermute(n, f(*inputs[n])).float() - ref).abs().max().item() for n, f in forms.items()}
            compiled_diff = {n: (unpermute(n, f(*inputs[n])).float() - ref).abs().max().item()
                             for n, f in compiled.items()}
            for _ in range(args.rounds):
                for name, f in compiled.items():
                    for _ in range(3):
                        f(*inputs[name])
                    times[name] += timed(lambda: f(*inputs[name]), args.iters, dev)  # noqa: B023
        nbytes = 2 * q.numel() * q.element_size()
        ms = {name: median(t) for name, t in times.items()}
        results[flavour] = {"tokens": L, "dim": dim, "heads": heads, "ms": times,
                            "gb_s": {n: nbytes / (v / 1000) / 1e9 for n, v in ms.items()},
                            "s_per_step": {n: v * blocks * 2 * 2 / 1000 for n, v in ms.items()},
                            "eager_max_abs_vs_stack": diff, "compiled_max_abs_vs_eager_stack": compiled_diff}
        print(flavour, {n: round(v, 4) for n, v in ms.items()}, diff, flush=True)

    out.with_suffix(".json").write_text(json.dumps({"device": device_info(), "flavours": results}, indent=1))
    title = "q/k RMSNorm + RoPE formulations, compiled by inductor"
    if args.smoke:
        title = "SMOKE RUN, not a result: tiny shapes on the CPU"
    rows = [[flavour, name, fmt_spread(spread(r["ms"][name]), 4), f"{r['gb_s'][name]:.0f}",
             f"{r['s_per_step'][name]:.3f}", f"{r['eager_max_abs_vs_stack'][name]:.3g}",
             f"{r['compiled_max_abs_vs_eager_stack'][name]:.3g}"] for flavour, r in results.items() for name in r["ms"]]
    text = [f"# {title}", "", f"One projection (q or k) of 1 x {TOKENS} tokens; {args.rounds} rounds x {args.iters} "
            "calls; s / step = ms x blocks x 2 CFG passes x 2 (q and k).", "",
            markdown_table(["flavour", "formulation", "ms per call", "GB/s", "s / step", "eager max abs vs stack",
                            "compiled max abs vs eager stack"], rows), ""]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
