"""Steady step against the FLOP floor, compile with and without warmup, cold start with and without the
compile cache, per attention backend (issue 11, "Show").

Each arm runs in its own fresh processes (`--processes`, rounds interleave the arms so drift hits every
arm alike). A process: load the synthetic checkpoint (written first if missing), `init_modules` (with or
without warmup, compile, a compile cache), then `--requests` requests of `--steps` steps at the bench shape,
timed by wall clock (request) and CUDA events (steps). With `--profile`, one more request runs under
torch.profiler and its denoise stage's kernels are summed by kind (attention, GEMM, other); it is left
out of the timings.

The FLOP floor per step is the transformer's matmul and attention FLOPs (2 per multiply-add; CFG = 2
passes) at 790 TFLOP/s, the H200's measured bf16 matmul rate (issue 11). Wan2.1 1.3B at 480x832x81:
0.565 PFLOP, 0.72 s.

Plans (`--plan`):
- `wan13`: Wan2.1 1.3B, 480x832x81, CFG: eager and compiled per attention backend, compiled without
  warmup, compiled with a cold (empty) and a warm (saved) compile cache.
- `wan14`: Wan2.1 14B, eager and compiled per attention backend.
- `qwen`: Qwen-Image 20B, 1328x1328, CFG: eager and compiled, with and without warmup.

`--layers` builds fewer blocks (the floor counts the same blocks), but warmup refuses an architecture
that is not a released flavour (its shapes are per flavour): the 2026-12-02 run of `wan14` with 10
blocks was refused so (bench/results/speed_wan14_h200_refused.log). Keep the full depth with warmup.

    python bench/speed.py --plan wan13 --processes 3 --out $OUT/speed_wan13
    python bench/speed.py --summarize --out bench/results/speed_wan13
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO, GpuClockSampler, borrow_components, copy_config, device_info,  # noqa: E402
                          ensure_synthetic, fmt_spread, markdown_table, median, run_worker, spread)

MATMUL_TFLOPS = 790.0
PROMPT = "a red fox running through fresh snow"

ARMS: dict[str, list[dict[str, Any]]] = {
    "wan13": [
        {"name": "eager sdpa_cudnn", "attention": "sdpa_cudnn"},
        {"name": "eager sdpa_flash", "attention": "sdpa_flash"},
        {"name": "eager flash_attn_4", "attention": "flash_attn_4"},
        {"name": "compiled sdpa_cudnn", "attention": "sdpa_cudnn", "compile": True, "cache": "cudnn"},
        {"name": "compiled flash_attn_4", "attention": "flash_attn_4", "compile": True, "cache": "fa4"},
        {"name": "compiled sdpa_cudnn no-warmup", "attention": "sdpa_cudnn", "compile": True, "warmup": False},
        {"name": "compiled sdpa_cudnn unfused GELU", "attention": "sdpa_cudnn", "compile": True, "cache": "cudnn_unfused",
         "fused": False},
        {"name": "compiled sdpa_cudnn fp8", "attention": "sdpa_cudnn", "compile": True, "cache": "cudnn_fp8",
         "compute_dtype": "fp8", "psnr_vs": "compiled sdpa_cudnn"},
    ],
    "wan14": [
        {"name": "eager sdpa_cudnn", "attention": "sdpa_cudnn"},
        {"name": "compiled sdpa_cudnn", "attention": "sdpa_cudnn", "compile": True, "cache": "cudnn"},
        {"name": "eager flash_attn_4", "attention": "flash_attn_4"},
        {"name": "compiled flash_attn_4", "attention": "flash_attn_4", "compile": True, "cache": "fa4"},
        {"name": "compiled flash_attn_4 fp8", "attention": "flash_attn_4", "compile": True, "cache": "fa4_fp8",
         "compute_dtype": "fp8", "psnr_vs": "compiled flash_attn_4"},
        {"name": "compiled flash_attn_4 tuned", "attention": "flash_attn_4", "compile": True, "cache": "fa4_tuned",
         "tune": True},
    ],
    "qwen": [
        {"name": "eager auto", "attention": "auto"},
        {"name": "compiled auto", "attention": "auto", "compile": True, "cache": "auto"},
        {"name": "compiled auto no-warmup", "attention": "auto", "compile": True, "warmup": False},
    ],
}
"""Arms per plan. `cache`: a compile-cache directory name shared by the arm's processes (the first
process starts with it empty, later ones load what it saved); absent: no compile cache. `fused: False`: the MLP's
GELU as its own kernel (runnerkit/fused.py off), to measure what the fused GEMM epilogue saves. `compute_dtype`:
the config's (fp8: docs/fp8_compute.md). `tune`: `compile.coordinate_descent_tuning` (inductor tunes each
generated kernel's launch configuration at compile time). `psnr_vs`: an arm of the same plan run earlier in each round; every
request's decoded video (same seed) is compared with that arm's, as PSNR in dB (videos in [-1, 1])."""


def wan_flops(t: dict[str, Any], shape: tuple[int, int, int], cfg: bool) -> dict[str, float]:
    """Matmul and attention FLOPs of one Wan2.1 transformer step at `shape` (H, W, frames)."""
    h, w, f = shape
    L = ((f - 1) // 4 + 1) * (h // 16) * (w // 16)  # VAE stride (4, 8, 8), patch (1, 2, 2)
    d, ffn, text = t["dim"], t["ffn_dim"], 512
    matmul = 8 * L * d * d + 4 * L * d * d + 4 * text * d * d + 4 * L * d * ffn  # self qkvo, cross q/o + k/v, FFN
    attn = 4 * L * L * d + 4 * L * text * d
    n = t["num_layers"] * (2 if cfg else 1)
    return {"matmul": matmul * n, "attention": attn * n, "tokens": L}


def qwen_flops(t: dict[str, Any], l_img: int, l_txt: int, cfg: bool) -> dict[str, float]:
    """Matmul and attention FLOPs of one Qwen-Image transformer step (joint attention over L_img + L_txt)."""
    d = t["num_attention_heads"] * t["attention_head_dim"]
    L = l_img + l_txt
    matmul = 8 * L * d * d + 16 * L * d * d  # per stream qkv/out, MLP 4x (each token in its own stream)
    attn = 4 * L * L * d
    n = t["num_layers"] * (2 if cfg else 1)
    return {"matmul": matmul * n, "attention": attn * n, "tokens": L}


def kernel_kind(name: str) -> str:
    """attention, gemm or other, from a CUDA kernel's name (inductor's fused Triton kernels are named after
    the ops around them, `..._flash_attn_4_...` included: always 'other')."""
    low = name.lower()
    if low.startswith("triton_"):
        return "other"
    if any(s in low for s in ("flash", "fmha", "sdpa", "attention", "fort_native", "attn")):
        return "attention"
    if any(s in low for s in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "splitk")):
        return "gemm"
    return "other"


def setup(plan: str, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """(runner config dict without model_path, checkpoint path), the checkpoint written if missing."""
    if args.smoke:  # the tiny architectures on the CPU: checks the script, not a result
        name = "qwen_image/qwen_image_t2i_tiny" if plan == "qwen" else "wan/wan_t2v_tiny"
        cfg = REPO / f"configs/{name}.json"
        return {**json.loads(cfg.read_text()), "device": "cpu", "dtype": "float32"}, ensure_synthetic(
            cfg, Path(args.ckpt_root) / f"smoke_{plan}", dtype="fp32")
    if plan in ("wan13", "wan14"):
        c13 = REPO / "configs/wan/wan_t2v_1.3b.json"
        ck13 = ensure_synthetic(c13, Path(args.ckpt_root) / "wan13", generator_device="cuda")
        if plan == "wan13":
            return json.loads(c13.read_text()), ck13
        c14 = copy_config(REPO / "configs/wan/wan_t2v_14b.json", Path(args.ckpt_root) / f"wan14l{args.layers}.json",
                          **({"num_layers": args.layers} if args.layers else {}))
        ck = ensure_synthetic(c14, Path(args.ckpt_root) / f"wan14l{args.layers}", generator_device="cuda",
                              transformer_only=True)
        borrow_components(ck, ck13)
        return json.loads(c14.read_text()), ck
    import torch

    from bench.qwen_image import bench_model
    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic

    model = bench_model()
    model["transformer"] = {**model["transformer"], "num_layers": args.layers}
    ck = Path(args.ckpt_root) / f"qwen{args.layers}"
    if not (ck / "runnerkit.json").is_file():
        write_synthetic(QwenImageArch.model_validate(model), ck, seed=0, dtype=torch.bfloat16, generator_device="cuda")
    return {"model_cls": "qwen_image", "task": "t2i", "dtype": "bfloat16", "device": "cuda", "target_height": 1328,
            "target_width": 1328, "model": model}, ck


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.registry import get_runner_cls

    arm = json.loads(args.arm)
    if arm.get("fused") is False:
        from runnerkit import fused

        fused.ENABLED = False
    data, ckpt = setup(args.plan, args)
    data.update(model_path=str(ckpt), infer_steps=args.steps, warmup=arm.get("warmup", True),
                attention="auto" if args.smoke else arm["attention"], compute_dtype=arm.get("compute_dtype", "same"))
    if arm.get("compile"):
        tune = arm.get("tune") and not args.smoke  # the CPU refuses it (no Triton kernels to tune)
        data["compile"] = {"enabled": True, **({"coordinate_descent_tuning": True} if tune else {})}
        if arm.get("cache"):
            data["compile"]["cache_dir"] = str(Path(args.ckpt_root) / "compile_cache" / f"{args.plan}_{arm['cache']}")
    t0 = time.perf_counter()
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.init_modules()
    init_s = time.perf_counter() - t0
    out: dict[str, Any] = {"arm": arm, "init_s": init_s, "warmup": runner.profiler.warmup,
                           "attention": runner.profiler.attention,
                           "compile_cache": getattr(runner.profiler, "compile_cache", None), "requests": []}
    work = arm_outputs(args, arm["name"])
    work.mkdir(parents=True, exist_ok=True)
    with GpuClockSampler() as clocks:  # SM clock and power while the timed requests run
        for i in range(args.requests):
            t1 = time.perf_counter()
            prof = runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=i,
                                                     save_tensor_path=str(work / f"r{i}.safetensors")), i)
            out["requests"].append({"index": i, "wall_s": time.perf_counter() - t1, "steps_s": prof.steps,
                                    "stages_s": prof.stages, "audit": prof.audit})
    out["clocks"] = clocks.summary()
    if arm.get("psnr_vs"):
        out["psnr_db"] = [video_psnr(work / f"r{i}.safetensors", arm_outputs(args, arm["psnr_vs"]) / f"r{i}.safetensors")
                          for i in range(args.requests)]
    if args.profile:
        out["profile"] = profile_request(runner, args, work)
    out["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else 0.0
    t = json.loads((ckpt / "runnerkit.json").read_text())["arch"]["transformer"]
    if args.plan == "qwen":
        h, w = data["target_height"], data["target_width"]
        out["flops"] = qwen_flops(t, (h // 16) * (w // 16), out.get("profile", {}).get("text_tokens", 0), True)
    else:
        out["flops"] = wan_flops(t, (480, 832, 81), True)
    out["device"] = device_info()
    return out


def arm_outputs(args: argparse.Namespace, arm_name: str) -> Path:
    """The folder of an arm's saved request tensors (each process of the arm overwrites the last one's)."""
    return Path(args.ckpt_root) / "out" / arm_name.replace(" ", "_")


def video_psnr(path: Path, ref_path: Path) -> float | None:
    """PSNR in dB of the saved 'video' (or 'image') tensor against the reference arm's, both in [-1, 1]
    (peak-to-peak 2); None when the reference arm has not saved that request."""
    import math

    from safetensors.torch import load_file

    if not ref_path.is_file():
        return None
    a, b = load_file(str(path)), load_file(str(ref_path))
    key = "video" if "video" in a else "image"
    mse = (a[key].double() - b[key].double()).pow(2).mean().item()
    return 10 * math.log10(4.0 / mse) if mse > 0 else math.inf


def profile_request(runner: Any, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Kernel time of one request's denoise stage by kind (seconds per step), under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runnerkit.config import RequestConfig

    seen: dict[str, int] = {}
    cuda = torch.cuda.is_available()

    def capture(_m: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        ctx = kw.get("encoder_hidden_states", a[1] if len(a) > 1 else None)
        if ctx is not None and ctx.ndim == 3 and "text_tokens" not in seen:  # [B, L_txt, D]
            seen["text_tokens"] = int(ctx.shape[1])

    hook = runner.modules["transformer"].register_forward_pre_hook(capture, with_kwargs=True) \
        if "transformer" in runner.modules else None
    original = runner.run_denoise_stage
    holder: dict[str, Any] = {}

    def profiled(*a: Any, **kw: Any) -> Any:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            result = original(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
        holder["prof"] = prof
        return result

    runner.run_denoise_stage = profiled
    try:
        runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=99, save_tensor_path=str(work / "p.safetensors")), 99)
    finally:
        runner.run_denoise_stage = original
        if hook is not None:
            hook.remove()
    kinds: dict[str, float] = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    top: list[tuple[str, float]] = []
    for ev in holder["prof"].key_averages():
        us = (getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)) if cuda \
            else ev.self_cpu_time_total  # kernels have no children: self time is the kernel's
        if us <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        kinds[kernel_kind(ev.key)] += us / 1e6 / args.steps
        top.append((ev.key[:140], us / 1e6 / args.steps))
    top.sort(key=lambda x: -x[1])
    return {"per_step_s": kinds, "top_kernels": top[:15], **seen}


def summarize(out: Path) -> None:
    data = json.loads(out.with_suffix(".json").read_text())
    kin = []
    for name, procs in data["arms"].items():
        for p in procs:
            if "profile" not in p:
                continue
            k, fl = dict(p["profile"]["per_step_s"]), p["flops"]
            total = sum(k.values())  # the attention and GEMM kernels are few and all among the top 15 by time
            for kind in ("attention", "gemm"):
                k[kind] = sum(t for name, t in p["profile"]["top_kernels"] if kernel_kind(name) == kind)
            k["other"] = total - k["attention"] - k["gemm"]
            p["profile"]["per_step_s"] = k
            step = median([s for q in p["requests"][1:] for s in q["steps_s"][1:]])
            def rate(flops: float, s: float) -> str:  # no CUDA kernels in a CPU (smoke) profile
                return f"{s:.3f} ({flops / s / 1e12:.0f})" if s > 0 else f"{s:.3f} (n/a)"

            kin.append([name, rate(fl["attention"], k["attention"]), rate(fl["matmul"], k["gemm"]), f"{k['other']:.3f}",
                        f"{sum(k.values()):.3f}", f"{step:.3f}"])
    rows = []
    for name, procs in data["arms"].items():
        ok = [p for p in procs if "error" not in p]
        if not ok:  # every process failed, or none started (the plan's --budget_s ran out first)
            why = "failed: " + procs[0]["error"][:160] if procs else "not run (budget reached)"
            rows.append([name, why] + [""] * 11)
            continue
        fl = ok[0]["flops"]
        floor = (fl["matmul"] + fl["attention"]) / (MATMUL_TFLOPS * 1e12)
        steady = [median([s for q in p["requests"][1:] for s in q["steps_s"][1:]]) for p in ok]
        r1r3 = [p["requests"][0]["wall_s"] / p["requests"][-1]["wall_s"] for p in ok]
        comp1 = [p["requests"][0]["audit"].get("compilations", 0) for p in ok]
        warm = [p["warmup"]["seconds"] if p.get("warmup") else 0.0 for p in ok]
        misses = [(p.get("warmup") or {}).get("compile_cache_misses", "") for p in ok]
        prof = [p["profile"]["per_step_s"] for p in ok if "profile" in p]
        kinds = " / ".join(f"{median([k[x] for k in prof]):.3f}" for x in ("attention", "gemm", "other")) if prof else ""
        att = ok[0]["attention"]["backend"] if ok[0].get("attention") else ""
        clk = [p["clocks"] for p in ok if p.get("clocks")]  # absent in runs before 2026-12-02's second
        clocks = (f"{median([c['sm_mhz']['median'] for c in clk]):.0f} / "
                  f"{median([c['power_w']['median'] for c in clk]):.0f}") if clk else ""
        psnr = [v for p in ok for v in p.get("psnr_db") or [] if v is not None]
        rows.append([name, att, f"{len(ok)}", fmt_spread(spread(steady), 3), f"{median(steady) / floor:.2f}",
                     fmt_spread(spread(r1r3), 3), " ".join(str(c) for c in comp1),
                     " ".join(f"{w:.1f}" for w in warm), " ".join(str(m) for m in misses),
                     " ".join(f"{p['init_s']:.1f}" for p in ok), kinds, clocks,
                     fmt_spread(spread(psnr), 1) if psnr else ""])
        data.setdefault("floor_s", floor)
    text = [f"# {data['title']}", "", f"FLOP floor per step: {data.get('floor_s', 0):.3f} s at {MATMUL_TFLOPS:.0f} "
            "TFLOP/s (bench/speed.py docstring). Cells: median [min–max] over processes; lists: one value per "
            "process in order (the first process of a cached arm starts with an empty cache).", "",
            *([data["note"], ""] if data.get("note") else []),
            markdown_table(["arm", "attention ran", "procs", "steady step s", "step / floor", "request 1 / last request",
                            "compilations in request 1", "warmup s", "cache misses in warmup", "init s",
                            "kernels per step s: attention / GEMM / other",
                            "SM MHz / board W (median of samples in the timed requests)",
                            "video PSNR dB vs its `psnr_vs` arm (same seeds)"], rows), ""]
    if kin:
        text += ["Kernel time per step of one profiled request (torch.profiler, CUDA kernels of the denoise stage, by "
                 "name: attention kernels and GEMMs among the 15 longest kernels, everything else); in brackets the TFLOP/s reached on the step's "
                 "attention and matmul FLOPs:", "",
                 markdown_table(["arm", "attention s (TFLOP/s)", "GEMM s (TFLOP/s)", "other s", "sum s",
                                 "step s (same process)"], kin), ""]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", choices=sorted(ARMS))
    p.add_argument("--arms", default="", help="comma-separated arm names of the plan (default: all)")
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="wan14 / qwen: transformer blocks built (0: all, 40 / 60)")
    p.add_argument("--profile", action="store_true", help="profile one extra request in the last round")
    p.add_argument("--ckpt_root", default="/tmp/speed")
    p.add_argument("--budget_s", type=float, default=560.0, help="start no new process after this many seconds")
    p.add_argument("--out", required=True)
    p.add_argument("--summarize", action="store_true")
    p.add_argument("--keep_cache", action="store_true", help="start from the compile caches earlier runs saved")
    p.add_argument("--smoke", action="store_true", help="tiny architectures on the CPU (checks the script)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--arm", default="")
    p.add_argument("--result", default="")
    args = p.parse_args()
    args.layers = args.layers or {"wan14": 40, "qwen": 60}.get(args.plan or "", 0)
    if not args.summarize and not args.worker and (args.steps < 2 or args.requests < 2):
        p.error(f"--steps {args.steps} --requests {args.requests}: both must be at least 2 (the steady step is "
                "the median of steps 2.. of requests 2..)")
    out = Path(args.out)
    if args.summarize:
        summarize(out)
        return
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args), indent=1))
        return
    t0 = time.perf_counter()
    arms = [a for a in ARMS[args.plan] if not args.arms or a["name"] in args.arms.split(",")]
    shutil.rmtree(Path(args.ckpt_root) / "local_caches", ignore_errors=True)
    for a in arms:
        if a.get("cache") and not args.keep_cache:
            shutil.rmtree(Path(args.ckpt_root) / "compile_cache" / f"{args.plan}_{a['cache']}", ignore_errors=True)
    results: dict[str, list[dict[str, Any]]] = {a["name"]: [] for a in arms}
    out.parent.mkdir(parents=True, exist_ok=True)
    title = {"wan13": "Wan2.1 1.3B, 480x832x81, CFG", "wan14": f"Wan2.1 14B blocks ({args.layers} of 40), "
             "480x832x81, CFG", "qwen": f"Qwen-Image 20B blocks ({args.layers} of 60), 1328x1328, CFG"}[args.plan]
    if args.smoke:
        title = f"SMOKE RUN, not a result: the tiny {args.plan} architecture on the CPU (the plan is {title})"
    for rnd in range(args.processes):
        for a in arms:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget reached: skipping {a['name']} round {rnd}", flush=True)
                continue
            wargs = ["--plan", args.plan, "--arm", json.dumps(a), "--steps", str(args.steps), "--requests",
                     str(args.requests), "--layers", str(args.layers), "--ckpt_root", args.ckpt_root, "--out", args.out,
                     *(["--profile"] if args.profile and rnd == args.processes - 1 else []),
                     *(["--smoke"] if args.smoke else [])]
            t1 = time.perf_counter()
            try:
                # A fresh inductor and Triton cache per process, as on a fresh machine: only `compile.cache_dir`
                # carries compiled code from one process to the next.
                local = Path(args.ckpt_root) / "local_caches" / f"{a['name'].replace(' ', '_')}_{rnd}"
                r = run_worker(Path(__file__), wargs, Path(args.ckpt_root) / "result.json",
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(local / "inductor"),
                                    "TRITON_CACHE_DIR": str(local / "triton")})
            except RuntimeError as exc:
                r = {"error": str(exc)}
            results[a["name"]].append(r)
            print(f"{a['name']} round {rnd}: {time.perf_counter() - t1:.0f} s", {k: r.get(k) for k in ("error", "init_s")},
                  flush=True)
            out.with_suffix(".json").write_text(json.dumps({"title": title, "plan": args.plan, "arms": results}, indent=1))
    summarize(out)


if __name__ == "__main__":
    main()
