"""Wan2.2 A14B image-to-video at 480x832x81: block offload against all-resident (issue 9).

One arm per invocation (`--arm none` or `--arm block`), in this process: load, warmup, then
`--requests` requests at 480x832x81: an 832x480 input image over the target area 496x832 (Wan's
area rule gives 480x832 from it; over the area 480x832 itself it gives 464x832, float64
rounding of sqrt(399360 * 480/832) = 479.99999999999994, as in the reference), CFG, `--steps` UniPC steps (shift 5.0, boundary 0.900: both experts run). Reports per
request the step seconds (CUDA events), stage seconds, wall seconds and the device peak, and
the ratios first request / steady (median of the later requests) and step time of the arm.
`--summarize` merges the arms' JSON files into one table (OUT.md).

The checkpoint (`--ckpt`, written first if missing, drawn on the GPU) is a runnerkit-layout
Wan2.2 MoE i2v checkpoint at the A14B sizes: umt5-xxl, the Wan2.1 VAE, and two experts of
the 14B transformer with 36 input channels and no CLIP. To fit the device's 64 GiB disk, the
low-noise expert's files are a symlink to the high-noise expert's (same random weights); each
expert is still loaded on its own, so memory and transfer volumes are the real ones.

Warmup runs the class's real path on two shapes of this bench's own subclass
((480, 832, 17), (480, 832, 81)) instead of the A14B table's 720x1280 shape, which would cost
~3 min of device time per arm and is never requested here.

    python bench/moe_i2v.py --arm block --ckpt /tmp/a14b_i2v --out $OUT/moe_i2v_h200
    python bench/moe_i2v.py --summarize --out bench/results/moe_i2v_h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_info, fmt_spread, markdown_table, median, spread  # noqa: E402

SHAPE = (480, 832, 81)
GIB = 1024**3


SMOKE = False  # --smoke: the tiny architecture on the CPU at 48x80x9 (checks the script; not a result)


def a14b_i2v_model() -> dict[str, Any]:
    if SMOKE:
        tiny = json.loads((Path(__file__).resolve().parents[1] / "configs/wan/wan22_moe_i2v_tiny.json").read_text())
        return {**tiny["model"], "transformer": {**tiny["model"]["transformer"], "image_context": False}}
    return {"transformer": {"model_type": "i2v", "image_context": False, "in_dim": 36, "dim": 5120, "ffn_dim": 13824,
                            "freq_dim": 256, "num_heads": 40, "num_layers": 40}}


def write_checkpoint(ckpt: Path) -> float:
    """The A14B i2v MoE checkpoint (runnerkit layout; low-noise expert = symlink). Returns seconds."""
    import torch

    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import SYNTHETIC_MARKER, write_synthetic

    t0 = time.perf_counter()
    arch = WanArch.model_validate(a14b_i2v_model())
    write_synthetic(arch, ckpt, seed=0, dtype=torch.float32 if SMOKE else torch.bfloat16, layout="runnerkit",
                    generator_device="cpu" if SMOKE else "cuda")
    meta = json.loads((ckpt / "runnerkit.json").read_text())
    (ckpt / "runnerkit.json").write_text(json.dumps({**meta, "family": "wan2.2_moe"}, indent=1))
    (ckpt / "transformer_2").symlink_to("transformer", target_is_directory=True)
    marker = json.loads((ckpt / SYNTHETIC_MARKER).read_text())
    (ckpt / SYNTHETIC_MARKER).write_text(json.dumps({**marker, "experts": "transformer_2 -> transformer (symlink)"}))
    return time.perf_counter() - t0


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.images import write_image
    from runnerkit.models.wan.moe import WanMoEI2VRunner

    class BenchI2V(WanMoEI2VRunner):
        """The A14B i2v runner with this bench's warmup shapes (its own opt-in, as every class)."""

        WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("i2v",)
        WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "block")
        WARMUP_SHAPES: ClassVar[dict[str, Any]] = {"A14B": ((480, 832, 17), SHAPE), "debug": ((32, 32, 5), SHAPE)}

    ckpt = Path(args.ckpt)
    write_s = None if (ckpt / "runnerkit.json").is_file() else write_checkpoint(ckpt)
    image = Path(args.work) / "first_frame.png"
    image.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    write_image(image, torch.rand(3, SHAPE[0], SHAPE[1], generator=g) * 2 - 1)
    h, w, f = SHAPE
    h = h + 16 if not SMOKE else h  # the area 496x832: the rule then gives exactly 480x832 (see the docstring)
    config = load_runner_config(None, {
        "model_cls": "wan2.2_moe", "task": "i2v", "model_path": str(ckpt), "device": "cpu" if SMOKE else "cuda",
        "dtype": "float32" if SMOKE else "bfloat16",
        "infer_steps": args.steps, "target_height": h, "target_width": w, "target_video_length": f,
        "warmup": True, "offload": {"mode": args.arm}, "model": a14b_i2v_model()})
    cuda = torch.cuda.is_available() and not SMOKE
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    runner = BenchI2V(config)
    runner.init_modules()
    init_s = time.perf_counter() - t0
    init_peak = torch.cuda.max_memory_allocated() / GIB if cuda else 0.0
    requests = []
    for i in range(args.requests):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        runner.run_pipeline(RequestConfig(prompt="a corgi running on a beach", image_path=str(image), seed=i,
                                          save_tensor_path=str(Path(args.work) / f"r{i}.safetensors")), i)
        wall = time.perf_counter() - t1
        prof = runner.profiler.requests[-1]
        requests.append({"index": i, "wall_s": wall, "steps_s": prof.steps, "stages_s": prof.stages,
                         "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
                         "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else 0.0,
                         "shape": prof.shape})
        assert tuple(prof.shape) == SHAPE, f"request shape {prof.shape}, expected {SHAPE}"
    return {"arm": args.arm, "steps": args.steps, "shape": list(SHAPE), "checkpoint_write_s": write_s,
            "init_s": init_s, "init_peak_alloc_gib": init_peak, "warmup": runner.profiler.warmup,
            "phases": runner.profiler.phases, "requests": requests, "device": device_info()}


def summarize(out: Path) -> None:
    arms = {}
    for arm in ("none", "block"):
        path = out.with_name(f"{out.name}_{arm}.json")
        if path.is_file():
            arms[arm] = json.loads(path.read_text())
    rows = []
    for arm, r in arms.items():
        reqs = r["requests"]
        steady = reqs[1:]
        steps_all = [s for q in steady for s in q["steps_s"]]
        first_steps = reqs[0]["steps_s"]
        rows.append([
            {"none": "all-resident", "block": "block offload"}[arm],
            f"{r['init_s']:.1f}",
            f"{reqs[0]['wall_s']:.2f}",
            fmt_spread(spread([q["wall_s"] for q in steady]), 2),
            f"{reqs[0]['wall_s'] / median([q['wall_s'] for q in steady]):.3f}",
            fmt_spread(spread(first_steps), 3),
            fmt_spread(spread(steps_all), 3),
            f"{reqs[0]['stages_s']['transformer']:.2f} / {median([q['stages_s']['transformer'] for q in steady]):.2f}",
            f"{max(q['peak_alloc_gib'] for q in reqs):.1f} / {max(q['peak_reserved_gib'] for q in reqs):.1f}",
        ])
    header = ["arm", "init s (load + warmup)", "request 0 s", "steady requests s", "request 0 / steady",
              "request 0 step s", "steady step s", "transformer stage s (req 0 / steady)",
              "device peak GiB (alloc / reserved)"]
    text = [f"# Wan2.2 A14B i2v, {SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]}, H200 (bench/moe_i2v.py)", "",
            markdown_table(header, rows), ""]
    if "none" in arms and "block" in arms:
        def steady_steps(arm: str) -> float:
            return median([s for q in arms[arm]["requests"][1:] for s in q["steps_s"]])
        text.append(f"Block offload step / all-resident step: {steady_steps('block') / steady_steps('none'):.3f} "
                    "(medians of the steady requests' steps).")
    (out.with_suffix(".md")).write_text("\n".join(text) + "\n")
    print("\n".join(text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=("none", "block"))
    p.add_argument("--ckpt", default="/tmp/a14b_i2v")
    p.add_argument("--work", default="/tmp/moe_i2v_work")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--out", required=True, help="OUT prefix: OUT_<arm>.json per arm, OUT.md from --summarize")
    p.add_argument("--summarize", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny architecture on the CPU (checks the script only)")
    args = p.parse_args()
    if args.smoke:
        global SMOKE, SHAPE
        SMOKE, SHAPE = True, (48, 80, 9)
    out = Path(args.out)
    if args.summarize:
        summarize(out)
        return
    result = run_arm(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(f"{out.name}_{args.arm}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1)[:3000])
    for q in result["requests"]:
        print(q["index"], f"wall {q['wall_s']:.2f}", "steps", [round(s, 3) for s in q["steps_s"]],
              f"peak {q['peak_alloc_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
