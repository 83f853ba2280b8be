"""The Wan VAE decode under a tight allocator cap: how much room above its own peak its convolutions need.

A plan that fills the device to its estimate leaves the caching allocator little slack. cuDNN picks each
convolution's algorithm at run time and, when the fastest one's workspace cannot be allocated, falls back to
one that needs less: the decode still runs, slower, with a lower peak. This bench measures where that starts.

One fresh process per arm (the convolution plans cuDNN caches per process would carry over otherwise). The
Wan2.1 VAE at its release size (random weights, float32 as the runner builds it), latents of `--shape`
(default 480x832x81: [1, 16, 21, 60, 104]). Arm `free`: no cap; the decode's peak allocated above weights and
latents is its need. Arm `+S` (GiB, may be negative): the allocator capped (`set_per_process_memory_fraction`)
at weights + latents + need + S. Each arm decodes twice (the first picks the algorithms under the cap) and
reports the second's seconds and peak. The formula's figure (`models/wan/estimate.vae_decode_bytes`, CUDA) is
printed beside them.

    python3 bench/conv_workspace.py --slack -1 -0.5 0 0.25 0.5 1 2 --out $OUT/conv_workspace_h100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, markdown_table, run_worker  # noqa: E402

GIB = 1024**3


def latent_shape(height: int, width: int, frames: int) -> tuple[int, int, int, int, int]:
    """The Wan2.1 VAE's latents for a video of `height` x `width` x `frames`: [1, 16, (F-1)/4+1, H/8, W/8]."""
    return (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One arm: build, optionally cap, decode twice; the second decode's seconds and peak."""
    import torch

    from runnerkit.models.wan.arch import WanVAEArch
    from runnerkit.models.wan.vae import WanVAE

    dev = torch.device("cuda")
    torch.manual_seed(0)
    vae = WanVAE(WanVAEArch()).to(dev, torch.float32).eval()
    latents = torch.randn(latent_shape(*args.shape), device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    cap = None
    if args.slack is not None:
        cap = base + int((args.need_gib + args.slack) * GIB)
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(dev).total_memory)
    out: dict[str, Any] = {"slack_gib": args.slack, "base_gib": base / GIB, "cap_gib": cap / GIB if cap else None}
    seconds, peaks = [], []
    with torch.inference_mode():
        for _ in range(2):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            video = vae.decode(latents)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            peaks.append((torch.cuda.max_memory_allocated() - base) / GIB)
            del video
    out.update(seconds=seconds, need_gib=peaks, reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    return out


def formula_gib(shape: tuple[int, int, int]) -> float:
    """The Wan estimate's VAE decode activations on CUDA for `shape` (height, width, frames), GiB."""
    from runnerkit.models.wan.arch import WanVAEArch
    from runnerkit.models.wan.estimate import vae_decode_bytes

    _, _, f, h, w = latent_shape(*shape)
    return vae_decode_bytes(WanVAEArch(), (f, h, w), "cuda")[0] / GIB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, default=[480, 832, 81], metavar=("H", "W", "F"),
                   help="the decoded video's height, width and frames (default 480 832 81)")
    p.add_argument("--slack", type=float, nargs="+", default=[-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 2.0],
                   help="GiB above the uncapped decode's need that the cap allows, one arm each")
    p.add_argument("--out", type=Path, help="OUT.json and OUT.md are written (required)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--need_gib", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--arm_slack", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.slack = args.arm_slack
        args.result.write_text(json.dumps(worker(args)))
        return
    if args.out is None:
        p.error("--out is required")
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/conv_workspace.py measures the CUDA caching allocator: it needs a CUDA device")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shape = ["--shape", *map(str, args.shape)]
    free = run_worker(Path(__file__), shape, args.out.with_suffix(".free.json"))
    need = free["need_gib"][1]
    arms = [free]
    for s in args.slack:
        try:
            arms.append(run_worker(Path(__file__), [*shape, "--arm_slack", str(s), "--need_gib", str(need)],
                                   args.out.with_suffix(f".{s}.json")))
        except RuntimeError as e:  # the cap below the slowest algorithm's need: out of memory
            arms.append({"slack_gib": s, "error": str(e)})
        print(json.dumps(arms[-1]), flush=True)
    result = {"device": device_info(), "shape": args.shape, "formula_gib": formula_gib(tuple(args.shape)),
              "arms": arms}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    rows = [["free" if a.get("slack_gib") is None else f"{a['slack_gib']:+.2f}",
             f"{a['cap_gib']:.2f}" if a.get("cap_gib") else "-",
             f"{a['seconds'][1]:.3f}" if "seconds" in a else a.get("error", "")[:40],
             f"{a['need_gib'][1]:.3f}" if "need_gib" in a else "-",
             f"{a['reserved_gib']:.2f}" if "reserved_gib" in a else "-"] for a in arms]
    table = markdown_table(["slack (GiB)", "cap (GiB)", "decode (s)", "peak above weights (GiB)", "peak reserved"],
                           rows)
    text = (f"Wan2.1 VAE decode {args.shape[0]}x{args.shape[1]}x{args.shape[2]}, float32, "
            f"formula {result['formula_gib']:.3f} GiB, uncapped need {need:.3f} GiB\n\n{table}\n")
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
