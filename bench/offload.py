"""Offload and disk streaming: whole requests per offload mode, diffusers' arms, cold disk steps (ARCHITECTURE §4).

Every arm runs in fresh processes (`--procs` per arm, in rounds: one process of every arm per
round), on the real per-block architecture with synthetic bf16 weights at the benchmark shape
(480x832x81 -> latents [1, 16, 21, 60, 104]), CFG on (two transformer forwards per step).

What each arm times
- `none`, `block`, `phase` (cpu storage, pinned, 2 slots, prefetch 1): the launch script itself,
  `python -m runnerkit.infer --config_json C --requests R.jsonl --profile_json P`, `--requests`
  requests of `--steps` UniPC steps each. From the profile of every request: `seconds` (the whole
  request: text encoder, denoise, VAE decode, tensor save), `stages.transformer` (scheduler
  prepare + every step + the synchronize that ends the stage: the first block copy of the request
  is inside it), `steps` (CUDA events around step_pre + both CFG forwards + step_post) and
  `memory.peak_allocated_gib`. The process's peak host RSS comes from `wait4`. As the runner places
  them, block/phase keep the text encoder and VAE in pinned host memory and copy each to the device
  for its stage (those copies are in the whole request, not in the transformer stage); `none` keeps
  everything resident. The saved tensor's SHA-256 is compared across arms.
- `diffusers_resident`, `diffusers_group`: diffusers' WanTransformer3DModel with the same
  synthetic weights converted in memory, all on the device, or with group offloading
  (block_level, 1 block per group, use_stream, record_stream). diffusers has no Wan pipeline
  for runnerkit checkpoints, so a worker times what runnerkit's `transformer` stage holds and
  nothing else: runnerkit's UniPC scheduler `prepare`, then per step `step_pre`, the diffusers
  transformer on the cond and the uncond context (both [1, 512, 4096], the zero-padded length
  runnerkit's model pads to), the CFG combine in float32, `step_post`, then a synchronize;
  steps timed with the same CUDA-event timer (`runnerkit.profiling.StepTimer`). Text embeddings
  are random (only their shape matters to time). `--requests` such requests per process.
- `disk_mmap`, `disk_pread` (1.3B, block mode, `storage: disk`): a worker builds the streamed
  transformer, runs one warm step (kernels and libraries loaded), measures the sequential read
  bandwidth of a checkpoint shard, then `--disk_steps` cold steps, each after closing the
  reader (unmapping) and dropping the page cache. A step here is the transformer on both CFG
  contexts plus the combine. Bytes are `/proc/self/io` read_bytes of the worker (all threads)
  across the step, for both readers and for the bandwidth measurement alike; the disk bound
  of a step is those bytes / the sequential GB/s measured in the same process.

Ratios are computed per process (a request against its own process's numbers) or per round
(an arm's process n against the reference arm's process n, which ran next to it), then reported
as median [min–max] over processes. `--num_layers_14b` (default 6) builds the 14B architecture
(dim 5120, 40 heads, ffn 13824: the 14B block) with fewer blocks, to fit the device budget:
per-block compute and copy sizes are the 14B's; whole-request ratios are diluted less by the
text encoder and VAE than they would be with 40 blocks (those take the same seconds, the
transformer stage 6.7x shorter).

    python bench/offload.py --ckpt_13b /tmp/w13 --ckpt_14b /tmp/w14l6 --out bench/results/offload_h200_14b \
        --arms none block phase diffusers_resident diffusers_group
    python bench/offload.py --ckpt_13b /tmp/w13 --out bench/results/offload_h200_disk --arms disk_mmap disk_pread

CPU smoke run (tiny config; not a result):

    python bench/offload.py --config_14b configs/wan/wan_t2v_tiny.json --config_13b configs/wan/wan_t2v_tiny.json \
        --num_layers_14b 3 --ckpt_13b /tmp/rk_tiny --ckpt_14b /tmp/rk_tiny3 --shape 48 80 9 --device cpu \
        --dtype fp32 --generator_device cpu --out /tmp/smoke/offload

Writes OUT.json (raw numbers and summary) and OUT.md, after every process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO, Deadline, add_worker_flags, borrow_components, copy_config, device_info,  # noqa: E402
                          drop_page_cache, ensure_synthetic, fmt_spread, markdown_table, median, run_child,
                          run_worker, sequential_read_gbps, spread, storage_read_bytes)

LAUNCH_ARMS: dict[str, dict[str, Any]] = {"none": {}, "block": {"mode": "block"}, "phase": {"mode": "phase"}}
DIFFUSERS_ARMS = ("diffusers_resident", "diffusers_group")
DISK_ARMS: dict[str, str] = {"disk_mmap": "mmap", "disk_pread": "pread"}
ALL_ARMS = (*LAUNCH_ARMS, *DIFFUSERS_ARMS, *DISK_ARMS)
PROMPT = "a lighthouse in a storm, waves breaking over the rocks"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


# ---- launch-script arms (none / block / phase) -------------------------------------------
def run_launch_arm(arm: str, args: argparse.Namespace, ckpt: str, tmp: Path) -> dict[str, Any]:
    """One `python -m runnerkit.infer` process of `arm`; per request: profile entry + SHA-256 of the saved tensor."""
    h, w, f = args.shape
    config = {"model_cls": "wan2.1", "task": "t2v", "model_path": ckpt, "dtype": DTYPES[args.dtype],
              "device": args.device, "infer_steps": args.steps, "target_height": h, "target_width": w,
              "target_video_length": f, "enable_cfg": True, "scheduler": "unipc", "offload": LAUNCH_ARMS[arm]}
    cfg_path, req_path, prof_path = tmp / f"{arm}.config.json", tmp / f"{arm}.requests.jsonl", tmp / f"{arm}.profile.json"
    cfg_path.write_text(json.dumps(config, indent=1))
    tensors = [tmp / f"{arm}.r{i}.safetensors" for i in range(args.requests)]
    req_path.write_text("".join(json.dumps({"prompt": PROMPT, "seed": 42, "save_tensor_path": str(t)}) + "\n"
                                for t in tensors))
    prof_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "runnerkit.infer", "--config_json", str(cfg_path), "--requests", str(req_path),
           "--profile_json", str(prof_path)]
    rc, wall, rss = run_child(cmd, tmp / f"{arm}.log")
    if rc != 0:
        sys.stderr.write((tmp / f"{arm}.log").read_text()[-6000:])
        raise RuntimeError(f"launch script of arm {arm} failed with exit status {rc}")
    profile = json.loads(prof_path.read_text())
    requests = []
    for entry, tensor in zip(profile["requests"], tensors):
        requests.append({"seconds": entry["seconds"], "stages": entry["stage_seconds"], "steps": entry["step_seconds"],
                         "memory": entry["memory"], "shape": entry["shape"]}
                        | {"sha256": hashlib.sha256(tensor.read_bytes()).hexdigest()})
        tensor.unlink()
    return {"arm": arm, "kind": "launch", "command": cmd, "config": config, "process_seconds": wall,
            "host_peak_rss_gib": rss, "phases": profile["phases"], "requests": requests}


# ---- diffusers arms (worker) --------------------------------------------------------------
def build_diffusers(runner: Any, device: Any, dtype: Any, group_offload: bool) -> Any:
    """diffusers' WanTransformer3DModel with our weights converted in memory; all on `device`, or group offloading."""
    import torch
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from runnerkit.models.wan import transformer_keys as tk

    arch = runner.checkpoint.arch.transformer
    with torch.device("meta"):
        model = WanTransformer3DModel(**{k: v for k, v in tk.arch_to_diffusers_config(arch).items() if not k.startswith("_")})
    sd = tk.native_to_diffusers(runner.checkpoint.transformer_state_dict())
    fp32 = tuple(WanTransformer3DModel._keep_in_fp32_modules or ())
    sd = {k: v.to(torch.float32 if any(m in k for m in fp32) else dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    del sd
    rope = model.rope  # its tables are non-persistent buffers (still on meta): rebuild them for real
    model.rope = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    model.eval().requires_grad_(False)
    if not group_offload:
        return model.to(device)
    use_stream = device.type == "cuda"  # CUDA streams only exist there (CPU smoke runs: plain onload)
    model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1, use_stream=use_stream, record_stream=use_stream)
    return model


def diffusers_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runnerkit.config import load_runner_config
    from runnerkit.memory import synchronize
    from runnerkit.models.wan.checkpoint import WanCheckpoint
    from runnerkit.models.wan.runner import WanT2VRunner
    from runnerkit.profiling import StepTimer
    from runnerkit.schedulers import SCHEDULERS

    device, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = load_runner_config(None, {"model_cls": "wan2.1", "model_path": args.ckpt, "device": args.device,
                                    "dtype": DTYPES[args.dtype], "infer_steps": args.steps, "scheduler": "unipc"})
    runner = WanT2VRunner(cfg)
    runner.checkpoint = WanCheckpoint.open(args.ckpt)
    arch, vae = runner.checkpoint.arch.transformer, runner.checkpoint.arch.vae
    t0 = time.perf_counter()
    model = build_diffusers(runner, device, dtype, group_offload=args.arm == "diffusers_group")
    synchronize(device)
    load_seconds = time.perf_counter() - t0
    resident = torch.cuda.memory_allocated(device) / 1024**3 if device.type == "cuda" else 0.0
    h, w, f = args.shape
    latent_shape = (1, vae.z_dim, (f - 1) // 4 + 1, h // 8, w // 8)
    gen = torch.Generator("cpu").manual_seed(0)
    ctx = torch.randn(1, arch.text_len, arch.text_dim, generator=gen).to(device, dtype)  # [1, 512, 4096]
    ctx_null = torch.randn(1, arch.text_len, arch.text_dim, generator=gen).to(device, dtype)
    scale = float(runner.config.sample_guide_scale)  # the family's default, resolved by the runner

    def forward(latents: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=latents, timestep=t, encoder_hidden_states=context, return_dict=False)[0]

    requests = []
    with torch.inference_mode():
        for _ in range(args.requests):
            sched = SCHEDULERS[runner.config.scheduler](shift=runner.config.sample_shift,
                                                        spacing=runner.config.scheduler_spacing)
            timer = StepTimer(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            sched.prepare(latent_shape, args.steps, 42, device, dtype)  # = runnerkit's transformer stage
            for i in range(args.steps):
                with timer.step():
                    latents, t = sched.step_pre(i)
                    cond = forward(latents, t, ctx).float()
                    uncond = forward(latents, t, ctx_null).float()
                    sched.step_post(uncond + scale * (cond - uncond))
            synchronize(device)
            stage = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else 0.0
            requests.append({"stages": {"transformer": stage}, "steps": timer.seconds(),
                             "memory": {"peak_allocated_gib": peak},
                             "sha256": hashlib.sha256(sched.latents.float().cpu().numpy().tobytes()).hexdigest()})
    import diffusers

    return {"arm": args.arm, "kind": "diffusers", "diffusers": diffusers.__version__, "load_seconds": load_seconds,
            "resident_after_load_gib": resident, "requests": requests,
            "group_offload": {"offload_type": "block_level", "num_blocks_per_group": 1,
                              "use_stream": device.type == "cuda", "record_stream": device.type == "cuda"}
            if args.arm == "diffusers_group" else None}


# ---- disk arms (worker) -------------------------------------------------------------------
def disk_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runnerkit.config import load_runner_config
    from runnerkit.memory import synchronize
    from runnerkit.models.wan.checkpoint import WanCheckpoint
    from runnerkit.models.wan.runner import WanT2VRunner

    device, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    offload = {"mode": "block", "storage": "disk", "reader": DISK_ARMS[args.arm]}
    cfg = load_runner_config(None, {"model_cls": "wan2.1", "model_path": args.ckpt, "device": args.device,
                                    "dtype": DTYPES[args.dtype], "offload": offload})
    runner = WanT2VRunner(cfg)
    runner.checkpoint = WanCheckpoint.open(args.ckpt)
    arch, vae = runner.checkpoint.arch.transformer, runner.checkpoint.arch.vae
    model, streamer = runner.stream_transformer()
    reader = streamer.source.reader
    h, w, f = args.shape
    gen = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(1, vae.z_dim, (f - 1) // 4 + 1, h // 8, w // 8, generator=gen).to(device, dtype)
    ctx = torch.randn(1, 96, arch.text_dim, generator=gen).to(device, dtype)
    ctx_null = torch.randn(1, 120, arch.text_dim, generator=gen).to(device, dtype)
    t = torch.tensor([999], device=device)

    def step() -> torch.Tensor:
        cond, uncond = model(latents, t, ctx).float(), model(latents, t, ctx_null).float()
        return uncond + 5.0 * (cond - uncond)

    with torch.inference_mode():
        t0 = time.perf_counter()
        step()  # warm: kernels, libraries, allocator
        synchronize(device)
        warm_seconds = time.perf_counter() - t0
        bandwidth = sequential_read_gbps(runner.checkpoint.transformer_files()[0])
        seconds, storage, streamed, dropped, out = [], [], [], [], None
        for _ in range(args.disk_steps):
            streamer.reset()
            reader.close()  # unmap and close: mapped pages would survive the cache drop
            dropped.append(drop_page_cache())
            b0, f0 = storage_read_bytes(), reader.bytes_read
            t0 = time.perf_counter()
            out = step()
            synchronize(device)
            seconds.append(time.perf_counter() - t0)
            storage.append(storage_read_bytes() - b0)
            streamed.append(reader.bytes_read - f0)
    gbps = bandwidth["gbps"]
    bound = [b / 1e9 / gbps if gbps == gbps and b > 0 else float("nan") for b in storage]
    return {"arm": args.arm, "kind": "disk", "reader": DISK_ARMS[args.arm], "warm_step_s": warm_seconds,
            "sequential_read": bandwidth, "cold_step_s": seconds, "storage_bytes": storage,
            "reader_bytes": streamed, "page_cache_dropped": dropped, "bound_s": bound,
            "ratio_to_bound": [s / b for s, b in zip(seconds, bound)], "streamer": streamer.stats(),
            "output_sha256": hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()}


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    result = diffusers_worker(args) if args.arm in DIFFUSERS_ARMS else disk_worker(args)
    Path(args.result).write_text(json.dumps(result, indent=1))


# ---- summary ------------------------------------------------------------------------------
def request_metrics(proc: dict[str, Any], index: int) -> dict[str, float]:
    r = proc["requests"][index]
    return {"request_s": r.get("seconds", float("nan")), "transformer_s": r["stages"]["transformer"],
            "step1_s": r["steps"][0], "median_step_s": median(r["steps"]),
            "median_step2_last_s": median(r["steps"][1:]), "peak_gib": r["memory"].get("peak_allocated_gib", float("nan"))}


CROSS_RATIOS = (  # (name, arm, reference arm)
    ("block / none", "block", "none"),
    ("phase / none", "phase", "none"),
    ("diffusers group offload / diffusers all-resident", "diffusers_group", "diffusers_resident"),
    ("diffusers all-resident / runnerkit none", "diffusers_resident", "none"),
    ("runnerkit block / diffusers group offload", "block", "diffusers_group"),
)


def by_round(procs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """round index -> process (a failed process leaves its round out of the pairs, not shifted)."""
    return {p.get("round", i): p for i, p in enumerate(procs)}


def summarize_offload(results: dict[str, list[dict[str, Any]]], requests: int) -> dict[str, Any]:
    """Per arm and request index: spreads over processes; cross-arm ratios per round (process n vs process n)."""
    out: dict[str, Any] = {"arms": {}, "ratios": {}}
    for arm, procs in results.items():
        if arm in DISK_ARMS or not procs:
            continue
        per_req = {}
        for i in range(requests):
            ms = [request_metrics(p, i) for p in procs]
            per_req[f"request{i + 1}"] = {k: spread([m[k] for m in ms]) for k in ms[0]} | {
                "step1_over_median_rest": spread([m["step1_s"] / m["median_step2_last_s"] for m in ms]),
                "sha256": sorted({p["requests"][i]["sha256"] for p in procs})}
        out["arms"][arm] = {"processes": len(procs), "requests": per_req,
                            "host_peak_rss_gib": spread([p.get("host_peak_rss_gib", float("nan")) for p in procs])}
    for name, arm, ref in CROSS_RATIOS:
        if not results.get(arm) or not results.get(ref):
            continue
        entry = {}
        for i in range(requests):
            mine, theirs = by_round(results[arm]), by_round(results[ref])
            pairs = [(request_metrics(mine[n], i), request_metrics(theirs[n], i)) for n in sorted(mine.keys() & theirs.keys())]
            entry[f"request{i + 1}"] = {k: spread([a[k] / b[k] for a, b in pairs])
                                        for k in ("request_s", "transformer_s", "median_step_s", "step1_s")}
        out["ratios"][name] = entry
    return out


def summarize_disk(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out = {}
    for arm, procs in results.items():
        if arm not in DISK_ARMS or not procs:
            continue
        out[arm] = {"processes": len(procs), "cold_steps_per_process": len(procs[0]["cold_step_s"]),
                    "cold_step_s": spread([median(p["cold_step_s"]) for p in procs]),
                    "storage_gb_per_cold_step": spread([median(p["storage_bytes"]) / 1e9 for p in procs]),
                    "reader_gb_per_cold_step": spread([median(p["reader_bytes"]) / 1e9 for p in procs]),
                    "sequential_gbps": spread([p["sequential_read"]["gbps"] for p in procs]),
                    "bound_s": spread([median(p["bound_s"]) for p in procs]),
                    "ratio_to_bound": spread([median(p["ratio_to_bound"]) for p in procs]),
                    "ratio_to_bound_all_steps": spread([r for p in procs for r in p["ratio_to_bound"]]),
                    "warm_step_s": spread([p["warm_step_s"] for p in procs]),
                    "page_cache_dropped": all(all(p["page_cache_dropped"]) for p in procs),
                    "output_sha256": sorted({p["output_sha256"] for p in procs})}
    return out


def describe_arch(t: dict[str, Any] | None) -> str:
    if not t:
        return "?"
    return f"dim {t['dim']}, ffn {t['ffn_dim']}, {t['num_heads']} heads, {t['num_layers']} blocks"


def write_report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], arch: dict[str, Any]) -> None:
    offload = summarize_offload(results, args.requests)
    disk = summarize_disk(results)
    report = {"device": device_info(), "shape": args.shape, "steps": args.steps, "requests": args.requests,
              "disk_steps": args.disk_steps, "transformer_arch": arch, "procs_per_arm": {a: len(p) for a, p in results.items()},
              "summary": {"offload": offload, "disk": disk}, "raw": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    last = f"request{args.requests}"
    parts = [f"# offload ({report['device']}, shape {args.shape}, CFG)\n",
             "Each cell: median [min–max] (n = processes) of a per-process value; a cross-arm ratio pairs "
             "process n of an arm with process n of the reference arm (same round). See the docstring of "
             "bench/offload.py for what each arm times.\n"]
    if offload["arms"]:
        parts.append(f"## Requests ({args.requests} per process, {args.steps} steps each; transformer "
                     f"{describe_arch(arch.get('14b'))}); request {args.requests} of each process\n")
        rows = []
        for arm, s in offload["arms"].items():
            r = s["requests"][last]
            rows.append([arm, s["processes"], fmt_spread(r["request_s"]), fmt_spread(r["transformer_s"]),
                         fmt_spread(r["median_step_s"]), fmt_spread(r["step1_s"]),
                         fmt_spread(r["step1_over_median_rest"]), fmt_spread(r["peak_gib"], 2),
                         fmt_spread(s["host_peak_rss_gib"], 1), ", ".join(h[:12] for h in r["sha256"])])
        parts.append(markdown_table(["arm", "processes", "whole request s", "transformer stage s", "median step s",
                                     "step 1 s", "step 1 / median of steps 2..last", "peak device GiB", "host peak RSS GiB (process)", "output sha256"], rows))
        rows = []
        for name, e in offload["ratios"].items():
            for i in range(args.requests):
                r = e[f"request{i + 1}"]
                rows.append([name, i + 1, fmt_spread(r["request_s"]), fmt_spread(r["transformer_s"]),
                             fmt_spread(r["median_step_s"]), fmt_spread(r["step1_s"])])
        parts.append("\n## Ratios (per round)\n")
        parts.append(markdown_table(["ratio", "request", "whole request", "transformer stage", "median step",
                                     "step 1"], rows))
        parts.append("\n(whole request: launch-script arms only; diffusers arms time the transformer stage only)")
    if disk:
        rows = [[arm, s["processes"], s["cold_steps_per_process"], fmt_spread(s["cold_step_s"]),
                 fmt_spread(s["storage_gb_per_cold_step"], 2), fmt_spread(s["sequential_gbps"]),
                 fmt_spread(s["bound_s"]), fmt_spread(s["ratio_to_bound"]), fmt_spread(s["reader_gb_per_cold_step"], 2),
                 fmt_spread(s["warm_step_s"]), s["page_cache_dropped"]] for arm, s in disk.items()]
        parts.append(f"\n## Disk streaming (transformer {describe_arch(arch.get('13b'))}, block mode, cold steps)\n")
        parts.append("Per process: median over its cold steps; bytes = `/proc/self/io` read_bytes across the step "
                     "(same source for both readers and for the sequential-read bandwidth); bound = bytes / that "
                     "process's sequential GB/s.\n")
        parts.append(markdown_table(["reader", "processes", "cold steps each", "cold step s", "GB read from storage",
                                     "sequential GB/s", "bound s", "cold step / bound", "GB the reader asked for",
                                     "warm step s", "page cache dropped"], rows))
    text = "\n".join(parts) + "\n"
    Path(args.out + ".md").write_text(text)
    print(text, flush=True)


# ---- main ---------------------------------------------------------------------------------
def prepare_checkpoints(args: argparse.Namespace) -> dict[str, Any]:
    """Write the synthetic checkpoints the chosen arms need (skipped if present); returns their architectures."""
    need_13b = any(a in DISK_ARMS for a in args.arms) or any(a in LAUNCH_ARMS for a in args.arms)
    need_14b = any(a in LAUNCH_ARMS or a in DIFFUSERS_ARMS for a in args.arms)
    arch: dict[str, Any] = {}
    if need_13b:
        if not args.ckpt_13b:
            raise SystemExit("--ckpt_13b is needed (disk arms stream it; launch arms borrow its text encoder and VAE)")
        ensure_synthetic(Path(args.config_13b), Path(args.ckpt_13b), args.dtype, args.generator_device)
        arch["13b"] = json.loads((Path(args.ckpt_13b) / "runnerkit.json").read_text())["arch"]["transformer"]
    if need_14b:
        if not args.ckpt_14b:
            raise SystemExit("--ckpt_14b is needed for the launch-script and diffusers arms")
        ckpt = Path(args.ckpt_14b)
        config = Path(args.config_14b)
        if args.num_layers_14b:
            config = copy_config(config, ckpt.with_name(ckpt.name + ".config.json"), num_layers=args.num_layers_14b)
        ensure_synthetic(config, ckpt, args.dtype, args.generator_device, transformer_only=True)
        blocks = json.loads((ckpt / "runnerkit.json").read_text())["arch"]["transformer"]["num_layers"]
        if args.num_layers_14b and blocks != args.num_layers_14b:
            raise SystemExit(f"{ckpt} holds {blocks} blocks, not --num_layers_14b {args.num_layers_14b}: "
                             "give another --ckpt_14b or delete it")
        if any(a in LAUNCH_ARMS for a in args.arms):
            borrow_components(ckpt, Path(args.ckpt_13b))
        arch["14b"] = json.loads((ckpt / "runnerkit.json").read_text())["arch"]["transformer"]
    return arch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_14b", help="14B-block transformer checkpoint (written, transformer only, if absent)")
    p.add_argument("--ckpt_13b", help="1.3B checkpoint (written in full if absent): disk arms; text encoder/VAE donor")
    p.add_argument("--config_14b", default=str(REPO / "configs/wan/wan_t2v_14b.json"))
    p.add_argument("--config_13b", default=str(REPO / "configs/wan/wan_t2v_1.3b.json"))
    p.add_argument("--num_layers_14b", type=int, default=6, help="blocks of the 14B architecture (0: the config's)")
    p.add_argument("--arms", nargs="+", default=list(ALL_ARMS), choices=ALL_ARMS)
    p.add_argument("--procs", type=int, default=3, help="fresh processes per arm (>= 3 for a spread)")
    p.add_argument("--steps", type=int, default=5, help="denoising steps per request")
    p.add_argument("--requests", type=int, default=2, help="requests per process (each reported; the last is the warm one)")
    p.add_argument("--disk_steps", type=int, default=5, help="cold steps per disk process")
    p.add_argument("--shape", type=int, nargs=3, default=[480, 832, 81], metavar=("H", "W", "F"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--generator_device", default="cuda", help="where synthetic weights are drawn")
    p.add_argument("--time_budget_s", type=float, help="start no round of processes that would end after this many seconds")
    p.add_argument("--out", default=str(REPO / "bench/results/offload"))
    p.add_argument("--resume", help="an earlier OUT.json: its processes are kept, missing rounds are run")
    add_worker_flags(p)
    p.add_argument("--ckpt")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    deadline = Deadline(args.time_budget_s)
    arch = prepare_checkpoints(args)
    common = ["--shape", *map(str, args.shape), "--steps", str(args.steps), "--requests", str(args.requests),
              "--disk_steps", str(args.disk_steps), "--device", args.device, "--dtype", args.dtype]
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    if args.resume:  # continue a run cut short by a time limit: its finished processes are kept
        earlier = json.loads(Path(args.resume).read_text())["raw"]
        results.update({arm: procs for arm, procs in earlier.items() if arm in results})
    seconds: dict[str, float] = {}  # wall seconds of an arm's last process
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.procs):
            todo = [arm for arm in args.arms if n not in by_round(results[arm])]
            if not todo:
                continue
            estimate = 1.1 * sum(seconds.values())
            if not deadline.fits(estimate):  # whole rounds only: every arm keeps the same number of processes
                print(f"time budget: {deadline.left():.0f} s left, a round takes ~{estimate:.0f} s; stopping after "
                      f"{n} rounds", flush=True)
                break
            for arm in todo:
                t0 = time.perf_counter()
                try:
                    if arm in LAUNCH_ARMS:
                        res = run_launch_arm(arm, args, args.ckpt_14b, Path(tmp))
                    else:
                        ckpt = args.ckpt_13b if arm in DISK_ARMS else args.ckpt_14b
                        res = run_worker(Path(__file__), [*common, "--arm", arm, "--ckpt", ckpt], Path(tmp) / f"{arm}.json")
                except RuntimeError as exc:
                    print(f"arm {arm} process {n} failed: {exc}", flush=True)
                    continue
                seconds[arm] = time.perf_counter() - t0
                res["wall_seconds"], res["round"] = seconds[arm], n
                results[arm].append(res)
                print(f"{arm} process {n}: {seconds[arm]:.0f} s", flush=True)
                write_report(args, results, arch)


if __name__ == "__main__":
    main()
