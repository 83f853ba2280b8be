"""LTX-2.3 22B distilled two-stage on one GPU: per-stage step times, request 1 / request 3 with and
without warmup, block offload against all-resident, peak device memory.

    python3 bench/ltx2.py --ckpt /tmp/ltx22 --write --arms warmup cold block --shapes 512x768x121 \
        --requests 3 --out $OUT/ltx2_h200

`--write` first writes the synthetic 22B checkpoint (diffusers layout, bf16, drawn on the GPU;
runnerkit.models.ltx2.checkpoint_synthetic) unless it is there. Its Gemma-3 text encoder keeps
the real width (3840) and depth (48 layers, so the connectors stack 49 hidden states as for
the 12B model) with a narrow MLP (256) and two heads (~0.15B parameters instead of 12B): the
disk (64 GiB) holds the ~44 GiB transformer, not the 24 GiB Gemma as well. The text encoder's
seconds are therefore far lower than the real model's; every other module has the release size.

Each arm is its own process (runs `worker`): a runner built from the checkpoint with the arm's
settings (warmup: --warmup and offload none; cold: no warmup; block: block offload from pinned
host memory, warmup; compiled: warmup and offload none with regional compile, its compile cache
`--compile_cache` emptied first; compiled_cached: the same, starting from the cache the compiled
arm saved; deterministic, deterministic_cached: those two with `compile.deterministic`), `--requests`
requests per shape, each with its profile (stages, steps, the audit's compilations), peak device memory
and the outputs' digests, compared across the arms of one compile setting (same seed; inductor's timed
tuning can make two compiled processes differ, docs/compile.md).

    python3 bench/ltx2.py --ckpt /tmp/ltx22 --arms warmup compiled compiled_cached --requests 3 --out $OUT/ltx2c
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_worker_flags, fmt_spread, markdown_table, run_worker, spread  # noqa: E402

ARMS: dict[str, dict[str, Any]] = {
    "warmup": {"warmup": True, "offload": {"mode": "none"}},
    "cold": {"warmup": False, "offload": {"mode": "none"}},
    "block": {"warmup": True, "offload": {"mode": "block"}},
    "compiled": {"warmup": True, "offload": {"mode": "none"}, "compile": {"enabled": True}, "fresh_cache": True},
    "compiled_cached": {"warmup": True, "offload": {"mode": "none"}, "compile": {"enabled": True}},
    "deterministic": {"warmup": True, "offload": {"mode": "none"}, "compile": {"enabled": True, "deterministic": True},
                      "fresh_cache": True},
    "deterministic_cached": {"warmup": True, "offload": {"mode": "none"},
                             "compile": {"enabled": True, "deterministic": True}},
}
STAGE1_STEPS = 8


def write_checkpoint(out: Path) -> None:
    import torch

    from runnerkit.models.ltx2.arch import LTX23_22B_ARCH
    from runnerkit.models.ltx2.checkpoint_synthetic import write_synthetic_ltx2

    if (out / "model_index.json").is_file():
        return
    t0 = time.perf_counter()
    write_synthetic_ltx2(LTX23_22B_ARCH, out, 0, torch.bfloat16, "diffusers", generator_device="cuda")
    print(f"synthetic 22B checkpoint {out} written in {time.perf_counter() - t0:.1f} s", flush=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from runnerkit.config import RequestConfig, RunnerConfig
    from runnerkit.models.ltx2.runner import LTX2Runner

    arm = ARMS[args.arm]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    h, w, f = shapes[0]
    compile_cfg: dict[str, Any] = {}
    if "compile" in arm:
        # one cache folder per compile setting: the deterministic pair never empties the other pair's cache
        cache = args.compile_cache + ("_deterministic" if arm["compile"].get("deterministic") else "")
        if arm.get("fresh_cache"):
            shutil.rmtree(cache, ignore_errors=True)
        compile_cfg = {**arm["compile"], "backend": args.compile_backend}
        if args.compile_backend == "inductor":  # the only backend with artifacts to cache
            compile_cfg["cache_dir"] = cache
    config = RunnerConfig(model_cls="ltx2", task="t2av", model_path=args.ckpt, dtype=args.dtype, device=args.device,
                          enable_cfg=False, target_height=h, target_width=w, target_video_length=f, fps=24,
                          warmup=arm["warmup"], offload=arm["offload"], compile=compile_cfg)
    t0 = time.perf_counter()
    runner = LTX2Runner(config)
    runner.init_modules()
    out: dict[str, Any] = {"arm": args.arm, "init_seconds": time.perf_counter() - t0,
                           "load_seconds": runner.profiler.phases.get("load_seconds"),
                           "warmup": runner.profiler.warmup, "requests": []}
    with tempfile.TemporaryDirectory() as tmp:
        index = 0
        for shape in shapes:
            for k in range(args.requests):
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                path = Path(tmp) / f"r{index}.safetensors"
                prof = runner.run_pipeline(RequestConfig(
                    prompt=f"a lighthouse in a storm at night, waves crash, take {k}", seed=42, target_height=shape[0],
                    target_width=shape[1], target_video_length=shape[2], save_tensor_path=str(path)), index)
                tensors = load_file(str(path))
                entry = dict(prof.__dict__)
                entry["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
                entry["digests"] = {key: hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
                                    for key, t in tensors.items()}
                out["requests"].append(entry)
                index += 1
                print(f"{args.arm} {list(shape)} request {k}: {prof.seconds:.2f} s {prof.stages}", flush=True)
    Path(args.result).write_text(json.dumps(out, indent=1, default=str))


def summarize(runs: dict[str, dict[str, Any]], requests: int) -> list[list[Any]]:
    rows = []
    for arm, run in runs.items():
        reqs = run["requests"]
        for start in range(0, len(reqs), requests):
            group = reqs[start:start + requests]
            last = group[-1]
            s1 = [x for r in group[1:] for x in r["steps"][:STAGE1_STEPS]] or group[0]["steps"][:STAGE1_STEPS]
            s2 = [x for r in group[1:] for x in r["steps"][STAGE1_STEPS:]] or group[0]["steps"][STAGE1_STEPS:]
            rows.append([arm, "x".join(map(str, group[0]["shape"])), f"{run['load_seconds'] or 0:.1f}",
                         f"{(run['warmup'] or {}).get('seconds', 0):.1f}",
                         fmt_spread(spread(s1)), fmt_spread(spread(s2)),
                         " ".join(f"{r['seconds']:.2f}" for r in group),
                         f"{group[0]['seconds'] / last['seconds']:.3f}",
                         " ".join(f"{k}={v:.2f}" for k, v in last["stages"].items()),
                         f"{max(r['peak_gib'] for r in group):.1f}",
                         sum(r["audit"]["compilations"] for r in group)])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--write", action="store_true", help="write the synthetic 22B checkpoint first (if absent)")
    p.add_argument("--arms", nargs="+", default=[a for a in ARMS if not a.startswith("deterministic")],
                   choices=list(ARMS), help="default: all but the deterministic pair (CUDA only)")
    p.add_argument("--shapes", nargs="+", default=["512x768x121"])
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--out", required=False)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run with a tiny checkpoint")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile_cache", default=str(Path(tempfile.gettempdir()) / "runnerkit_bench_ltx2_compile"),
                   help="compile.cache_dir of the compiled arms (emptied by `compiled`, reused by `compiled_cached`; "
                   "the deterministic pair uses this path + '_deterministic')")
    p.add_argument("--compile_backend", default="inductor", help="eager: a CPU smoke run of the compiled arms")
    add_worker_flags(p, ARMS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.write:
        write_checkpoint(Path(args.ckpt))
    runs: dict[str, dict[str, Any]] = {}
    for arm in args.arms:
        result = Path(f"{args.out}_{arm}.json")
        runs[arm] = run_worker(Path(__file__), ["--ckpt", args.ckpt, "--shapes", *args.shapes, "--requests",
                                                str(args.requests), "--arm", arm, "--device", args.device,
                                                "--dtype", args.dtype, "--compile_cache", args.compile_cache,
                                                "--compile_backend", args.compile_backend], result)
        Path(f"{args.out}.json").write_text(json.dumps(runs, indent=1, default=str))
    header = ["arm", "shape", "load s", "warmup s", "stage-1 step s (median, min-max)", "stage-2 step s",
              "requests s", "req1/req3", "stages of the last request (s)", "peak GiB", "compilations in requests"]
    table = markdown_table(header, summarize(runs, args.requests))
    lines = []
    groups: dict[str, list[str]] = {}  # arms of one compile setting: their outputs should be bit-identical
    for a in runs:
        groups.setdefault(json.dumps(ARMS[a].get("compile", "eager"), sort_keys=True), []).append(a)
    for group in groups.values():
        digests = {json.dumps([r["digests"] for r in runs[a]["requests"]], sort_keys=True) for a in group}
        if len(group) > 1:
            lines.append(f"outputs bit-identical across the arms {', '.join(group)}: {len(digests) == 1}")
    Path(f"{args.out}.md").write_text(table + "\n\n" + "\n".join(lines) + "\n")
    print(table)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
