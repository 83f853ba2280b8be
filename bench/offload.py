"""Offload and disk streaming: step time, device/host memory and H2D bandwidth per mode (ARCHITECTURE §4).

Each arm runs in its own process on the real architecture with synthetic bf16 weights at the
benchmark shape (480x832x81 -> latents [1, 16, 21, 60, 104]). A "step" is what the runner does
per denoising step: the transformer on the cond and the uncond (CFG) context.

Arms: `none`, `block` (cpu storage), `phase` (cpu storage), `diffusers` (diffusers'
WanTransformer3DModel with the same weights converted in memory, group offloading block_level,
use_stream, record_stream) on the 14B; `disk_mmap` and `disk_pread` (block mode, storage disk) on
the 1.3B with the page cache dropped first, plus the machine's sequential disk read bandwidth.

    python bench/offload.py --ckpt_14b /tmp/w14 --ckpt_13b /tmp/w13 --out bench/results/offload_h200

Writes OUT.json and OUT.md (written after every arm, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, device_info, markdown_table, median, run_worker  # noqa: E402

ARMS_14B = ("none", "block", "phase", "diffusers")
ARMS_DISK = ("disk_mmap", "disk_pread")


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def host_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024**2
    return float("nan")


def storage_read_bytes() -> int:
    """Bytes this process made the kernel fetch from storage (/proc/self/io read_bytes; mmap faults included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def disk_bandwidth(path: Path, limit_bytes: int = 4 * 1024**3) -> float:
    """Sequential read GB/s of `path` (page cache dropped first), 64 MiB reads."""
    dropped = drop_page_cache()
    n = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n < limit_bytes:
            chunk = f.read(64 * 1024**2)
            if not chunk:
                break
            n += len(chunk)
    seconds = time.perf_counter() - t0
    return n / seconds / 1e9 if dropped else float("nan")


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    from runnerkit.config import load_runner_config
    from runnerkit.models.wan.checkpoint import WanCheckpoint
    from runnerkit.models.wan.runner import WanT2VRunner

    arm = args.arm
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    offload: dict[str, Any] = {"none": {}, "block": {"mode": "block"}, "phase": {"mode": "phase"},
                               "diffusers": {}, "disk_mmap": {"mode": "block", "storage": "disk", "reader": "mmap"},
                               "disk_pread": {"mode": "block", "storage": "disk", "reader": "pread"}}[arm]
    cfg = load_runner_config(None, {"model_cls": "wan2.1", "model_path": args.ckpt, "device": args.device,
                                    "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32", "offload": offload})
    runner = WanT2VRunner(cfg)
    runner.checkpoint = WanCheckpoint.open(args.ckpt)
    arch = runner.checkpoint.arch.transformer
    dropped = drop_page_cache() if arm.startswith("disk") else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if arm == "diffusers":
        model = build_diffusers(runner, device, dtype, args.no_stream)
    else:
        model = runner.build_transformer(device)
    load_seconds = time.perf_counter() - t0
    base_alloc = torch.cuda.memory_allocated() / 1024**3 if device.type == "cuda" else 0.0

    h, w, f = args.shape
    gen = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(1, arch.in_dim, (f - 1) // 4 + 1, h // 8, w // 8, generator=gen).to(device, dtype)
    ctx = torch.randn(1, 96, arch.text_dim, generator=gen).to(device, dtype)
    ctx_null = torch.randn(1, 120, arch.text_dim, generator=gen).to(device, dtype)
    t = torch.tensor([999], device=device)

    def forward(context: torch.Tensor) -> torch.Tensor:
        if arm == "diffusers":
            padded = torch.nn.functional.pad(context, (0, 0, 0, arch.text_len - context.shape[1]))
            return model(hidden_states=latents, timestep=t, encoder_hidden_states=padded, return_dict=False)[0]
        return model(latents, t, context)

    times, out = [], None
    streamer = runner.streamer
    reader = getattr(getattr(streamer, "source", None), "reader", None)
    if reader is not None:  # disk arms: warm kernels and libraries first, then make the weights cold again
        with torch.inference_mode():
            forward(ctx)
            forward(ctx_null)
        torch.cuda.synchronize() if device.type == "cuda" else None
        streamer.reset()
        reader.close()  # unmap and close: mapped pages would survive the cache drop
        dropped = drop_page_cache()
    disk_bytes = [reader.bytes_read] if reader is not None else []
    storage_bytes = [storage_read_bytes()]
    with torch.inference_mode():
        for i in range(args.steps + 1):  # step 0 is cold (first copies and kernels; disk arms: cold page cache)
            if device.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
            c0 = time.perf_counter()
            cond = forward(ctx).float()
            uncond = forward(ctx_null).float()
            out = uncond + 5.0 * (cond - uncond)
            if device.type == "cuda":
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / 1000)
            else:
                times.append(time.perf_counter() - c0)
            if reader is not None:
                disk_bytes.append(reader.bytes_read)
            storage_bytes.append(storage_read_bytes())
    stats = streamer.stats() if streamer is not None else {}
    result = {
        "arm": arm, "load_seconds": load_seconds, "page_cache_dropped": dropped,
        "step_seconds": times, "cold_step_s": times[0], "median_step_s": median(times[1:]),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 1024**3 if device.type == "cuda" else 0.0,
        "resident_after_load_gib": base_alloc,
        "host_rss_gib": host_rss_gib(), "streamer": stats,
        "output_sha256": hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest(),
        "streamed_bytes_per_forward": sum(lay.raw_nbytes for lay in streamer.layouts) if streamer else None,
        "disk_bytes_per_step": [b - a for a, b in zip(disk_bytes, disk_bytes[1:])],
        "storage_bytes_per_step": [b - a for a, b in zip(storage_bytes, storage_bytes[1:])],
    }
    Path(args.result).write_text(json.dumps(result, indent=1))


def build_diffusers(runner: Any, device: Any, dtype: Any, no_stream: bool) -> Any:
    """diffusers' WanTransformer3DModel with our weights converted in memory, group offloading on."""
    import torch
    from diffusers import WanTransformer3DModel

    from runnerkit.models.wan import transformer_keys as tk

    arch = runner.checkpoint.arch.transformer
    with torch.device("meta"):
        model = WanTransformer3DModel(**{k: v for k, v in tk.arch_to_diffusers_config(arch).items() if not k.startswith("_")})
    sd = tk.native_to_diffusers(runner.checkpoint.transformer_state_dict())
    fp32 = tuple(WanTransformer3DModel._keep_in_fp32_modules or ())
    sd = {k: v.to(torch.float32 if any(m in k for m in fp32) else dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rope = model.rope  # its tables are non-persistent buffers (still on meta): rebuild them for real
    model.rope = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    model.eval().requires_grad_(False)
    if device.type == "cuda":
        model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=not no_stream, record_stream=not no_stream)
    return model


def write_report(args: argparse.Namespace, results: dict[str, dict[str, Any]], disk_gbps: float) -> None:
    rows = []
    none = results.get("none")
    for arm, r in results.items():
        h2d = r["streamer"].get("h2d_gb_per_s") if r["streamer"] else None
        rows.append([arm, r["median_step_s"], r["cold_step_s"],
                     r["median_step_s"] / none["median_step_s"] if none and arm in ARMS_14B else "",
                     r["peak_allocated_gib"], r["resident_after_load_gib"], r["host_rss_gib"],
                     h2d if h2d is not None else "", r["disk_bytes_per_step"][0] if r["disk_bytes_per_step"] else "",
                     r["output_sha256"][:12]])
    header = ["arm", "median step s", "cold step s", "vs none", "peak device GiB", "device GiB after load",
              "host RSS GiB", "H2D GB/s", "disk bytes in cold step", "output sha256"]
    report = {"device": device_info(), "shape": args.shape, "steps": args.steps, "disk_read_gbps": disk_gbps,
              "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    text = (f"# offload ({report['device']}, shape {args.shape}, step = cond + uncond forward, "
            f"median of {args.steps} steps after a cold step)\n\n{markdown_table(header, rows)}\n\n"
            f"sequential disk read (page cache dropped): {disk_gbps:.3f} GB/s\n"
            + "".join(f"{arm}: cold step {r['cold_step_s']:.3f} s; bytes streamed from the files {r['disk_bytes_per_step'][0]} "
                      f"(bound {r['disk_bytes_per_step'][0] / 1e9 / disk_gbps:.3f} s, ratio "
                      f"{r['cold_step_s'] / (r['disk_bytes_per_step'][0] / 1e9 / disk_gbps):.3f}); bytes fetched from "
                      f"storage {r['storage_bytes_per_step'][0]} (bound {r['storage_bytes_per_step'][0] / 1e9 / disk_gbps:.3f} s, "
                      f"ratio {r['cold_step_s'] / max(r['storage_bytes_per_step'][0] / 1e9 / disk_gbps, 1e-9):.3f})\n"
                      for arm, r in results.items() if r["disk_bytes_per_step"] and disk_gbps == disk_gbps))
    Path(args.out + ".md").write_text(text)
    print(text, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_14b", help="runnerkit checkpoint of the 14B transformer (written if absent)")
    p.add_argument("--ckpt_13b", help="runnerkit checkpoint of the 1.3B (written if absent)")
    p.add_argument("--config_14b", default=str(REPO / "configs/wan/wan_t2v_14b.json"))
    p.add_argument("--config_13b", default=str(REPO / "configs/wan/wan_t2v_1.3b.json"))
    p.add_argument("--arms", nargs="+", default=[*ARMS_14B, *ARMS_DISK])
    p.add_argument("--shape", type=int, nargs=3, default=[480, 832, 81], metavar=("H", "W", "F"))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--generator_device", default="cuda")
    p.add_argument("--no_stream", action="store_true", help="diffusers arm without CUDA streams (CPU smoke runs)")
    p.add_argument("--out", default=str(REPO / "bench/results/offload"))
    p.add_argument("--worker", action="store_true")
    p.add_argument("--arm")
    p.add_argument("--ckpt")
    p.add_argument("--result")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, dict[str, Any]] = {}
    disk_gbps = float("nan")
    for ckpt, config in ((args.ckpt_14b, args.config_14b), (args.ckpt_13b, args.config_13b)):
        if ckpt and not (Path(ckpt) / "runnerkit.json").is_file():
            subprocess.run([sys.executable, "-m", "runnerkit.tools.synth_checkpoint", "--config", config, "--out", ckpt,
                            "--dtype", args.dtype, "--transformer_only", "--generator_device", args.generator_device],
                           check=True, cwd=REPO)
    common = ["--shape", *map(str, args.shape), "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype]
    if args.no_stream:
        common.append("--no_stream")
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms:
            ckpt = args.ckpt_13b if arm in ARMS_DISK else args.ckpt_14b
            if arm in ARMS_DISK and disk_gbps != disk_gbps:  # nan: measure once, before the disk arms
                files = sorted((Path(ckpt) / "transformer").glob("*.safetensors"))
                disk_gbps = disk_bandwidth(files[0])
            try:
                results[arm] = run_worker(Path(__file__), [*common, "--arm", arm, "--ckpt", ckpt], Path(tmp) / f"{arm}.json")
            except RuntimeError as exc:
                print(f"arm {arm} failed: {exc}", flush=True)
                continue
            print(f"{arm}: {results[arm]['median_step_s']:.3f} s/step, peak {results[arm]['peak_allocated_gib']:.2f} GiB",
                  flush=True)
            write_report(args, results, disk_gbps)


if __name__ == "__main__":
    main()
