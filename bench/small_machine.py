"""LTX-2.3 22B distilled (fp8 single file) on a "small machine" simulated on one H200: `offload.mode auto`
with the device capped to 16 or 8 GiB and the plan made for 32 GiB of host RAM (issue 21).

    python3 bench/small_machine.py --ckpt /tmp/ltx23fp8 --write --arms 16 --out $OUT/small_machine_h200

`--write` first writes the synthetic checkpoint (unless present), drawn on the GPU: the release's
single file with the transformer blocks' linear weights in float8_e4m3fn with per-tensor scales (as
Lightricks' fp8 file), the latent upsampler file, and a Gemma-3 text encoder of the release's size
(12B, bf16, `gemma="release"`), so the text encoder must stream too.

Each arm is its own process (`--worker`): `torch.cuda.set_per_process_memory_fraction` caps the
caching allocator at the arm's GiB (a hard limit: going above it raises out-of-memory), config
`memory.limit_gib` tells the planner the same number and `memory.host_limit_gib` 32 GiB of host RAM;
`offload.mode: auto` then chooses the plan (logged, and kept in the profile's `memory_plan`); warmup on;
`--requests` t2av requests at 512x768x121 (8 stage-1 steps at half size + 3 stage-2 steps).
Measured per request: seconds, stages, step times (CUDA events), peak device memory (allocated and
reserved), peak host RSS (VmHWM, reset per request), bytes fetched from storage (/proc/self/io
read_bytes: the page cache does not count) per denoising step; and once, the disk's sequential read
bandwidth with the page cache dropped (`bench.common.sequential_read_gbps`), so the disk-bound ratio
= step seconds / (storage bytes per step / disk bandwidth): 1.0 means the step takes exactly as long
as reading its bytes. Outputs' digests are compared across arms.
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

from bench.common import (  # noqa: E402
    add_worker_flags,
    drop_page_cache,
    fmt_spread,
    markdown_table,
    sequential_read_gbps,
    spread,
    storage_read_bytes,
    worker_command,
)

STAGE1_STEPS = 8
HOST_LIMIT_GIB = 32.0
SHAPE = (512, 768, 121)


def write_checkpoint(out: Path) -> None:
    import torch

    from runnerkit.models.ltx2.arch import LTX23_22B_ARCH
    from runnerkit.models.ltx2.checkpoint_synthetic import write_synthetic_ltx2

    if out.is_dir():
        return
    t0 = time.perf_counter()
    write_synthetic_ltx2(LTX23_22B_ARCH, out, 0, torch.bfloat16, "single_file", fp8_blocks="scaled",
                         generator_device="cuda", gemma="release")
    sizes = {p.name: p.stat().st_size for p in out.rglob("*") if p.is_file()}
    print(f"synthetic fp8 22B checkpoint {out} written in {time.perf_counter() - t0:.1f} s, "
          f"{sum(sizes.values()) / 2**30:.1f} GiB", flush=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from runnerkit import memory
    from runnerkit.config import RequestConfig, RunnerConfig
    from runnerkit.models.ltx2.checkpoint_synthetic import SINGLE_FILE, UPSAMPLER_FILE
    from runnerkit.models.ltx2.runner import LTX2Runner

    cap = float(args.arm)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
    ckpt = Path(args.ckpt)
    h, w, f = SHAPE
    config = RunnerConfig(
        model_cls="ltx2", task="t2av", model_path=str(ckpt / SINGLE_FILE), upsampler_path=str(ckpt / UPSAMPLER_FILE),
        text_encoder_path=str(ckpt / "text_encoder"), dtype="bfloat16", device="cuda", enable_cfg=False,
        target_height=h, target_width=w, target_video_length=f, fps=24, warmup=True,
        offload={"mode": "auto"}, memory={"limit_gib": cap, "host_limit_gib": HOST_LIMIT_GIB})
    result = Path(args.result)
    out: dict[str, Any] = {"arm": args.arm, "cap_gib": cap, "requests": []}

    def save() -> None:
        result.write_text(json.dumps(out, indent=1, default=str))

    t0 = time.perf_counter()
    try:
        runner = LTX2Runner(config)
        runner.init_modules()
    except BaseException as e:  # the plan's refusal or a load/warmup failure: recorded, the arm ends
        out["error"] = f"{type(e).__name__}: {e}"
        save()
        raise
    out.update({"init_seconds": time.perf_counter() - t0, "load_seconds": runner.profiler.phases.get("load_seconds"),
                "warmup": runner.profiler.warmup, "plan": runner.profiler.report().get("memory_plan"),
                "offload": runner.config.offload.model_dump(mode="json"),
                "init_peak_rss_gib": memory.host_memory().peak_rss_gib,
                "init_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30})
    save()
    print(f"arm {args.arm} GiB: plan {out['offload']}", flush=True)

    def streamed_disk(key: str = "disk_bytes_read") -> dict[str, float]:
        return {name: st.stats().get(key, 0.0) for name, st in runner.streamers.items()}

    counters = ("disk_bytes_read", "disk_seconds", "disk_read_calls", "disk_gap_bytes_read")

    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.requests):
            torch.cuda.reset_peak_memory_stats()
            memory.reset_host_peak()
            path = Path(tmp) / f"r{k}.safetensors"
            read0, disk0 = storage_read_bytes(), {c: streamed_disk(c) for c in counters}
            prof = runner.run_pipeline(RequestConfig(
                prompt=f"a lighthouse in a storm at night, waves crash, take {k}", seed=42, target_height=h,
                target_width=w, target_video_length=f, save_tensor_path=str(path)), k)
            read = storage_read_bytes() - read0
            used = {c: {n: v - disk0[c].get(n, 0.0) for n, v in streamed_disk(c).items()} for c in counters}
            disk = used["disk_bytes_read"]
            tensors = load_file(str(path))
            entry = dict(prof.__dict__)
            entry.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                         peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                         peak_rss_gib=memory.host_memory().peak_rss_gib, storage_bytes=read,
                         streamer_disk_bytes=disk, streamer_disk_seconds=used["disk_seconds"],
                         streamer_read_calls=used["disk_read_calls"], streamer_gap_bytes=used["disk_gap_bytes_read"],
                         digests={key: hashlib.sha256(t.float().numpy().tobytes()).hexdigest()[:16]
                                  for key, t in tensors.items()})
            out["requests"].append(entry)
            save()
            print(f"{args.arm} GiB request {k}: {prof.seconds:.2f} s, {read / 1e9:.1f} GB read "
                  f"({ {n: round(b / 1e9, 2) for n, b in disk.items()} } by the streamers), "
                  f"peak {entry['peak_reserved_gib']:.2f} GiB reserved, RSS {entry['peak_rss_gib']:.2f} GiB, "
                  f"steps {[round(x, 2) for x in prof.steps]}, {prof.stages}", flush=True)


def summarize(runs: dict[str, dict[str, Any]], disk_gbps: float) -> list[list[Any]]:
    rows = []
    for arm, run in runs.items():
        reqs = run.get("requests") or []
        if not reqs:
            rows.append([f"{arm} GiB", run.get("error", "no request finished")] + ["-"] * 12)
            continue
        steps = [x for r in reqs[1:] or reqs for x in r["steps"]]
        s1 = [x for r in reqs[1:] or reqs for x in r["steps"][:STAGE1_STEPS]]
        s2 = [x for r in reqs[1:] or reqs for x in r["steps"][STAGE1_STEPS:]]
        last = reqs[-1]
        # bytes the transformer's streamer read per denoising step (the text encoder's reads excluded)
        bytes_per_step = last.get("streamer_disk_bytes", {}).get("transformer", 0.0) / max(len(last["steps"]), 1)
        step = sum(last["stages"].get(s, 0.0) for s in ("stage1", "stage2")) / max(len(last["steps"]), 1)
        ratio = step / (bytes_per_step / (disk_gbps * 1e9)) if disk_gbps == disk_gbps and bytes_per_step else float("nan")
        off = run["offload"]
        plan = f"{off['mode']}/{off['storage']}/{off.get('reader')}, stream {off.get('stream_modules')}"
        rows.append([f"{arm} GiB", plan, f"{run['load_seconds'] or 0:.1f}", f"{(run['warmup'] or {}).get('seconds', 0):.1f}",
                     fmt_spread(spread(s1)), fmt_spread(spread(s2)), " ".join(f"{r['seconds']:.1f}" for r in reqs),
                     f"{reqs[0]['seconds'] / last['seconds']:.3f}" if len(reqs) > 1 else "-",
                     f"{max(r['peak_allocated_gib'] for r in reqs):.2f} / {max(r['peak_reserved_gib'] for r in reqs):.2f}",
                     f"{max(r['peak_rss_gib'] for r in reqs):.1f}", f"{bytes_per_step / 1e9:.2f}", f"{ratio:.2f}",
                     " ".join(f"{k}={v:.1f}" for k, v in last["stages"].items()), len(steps)])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--write", action="store_true", help="write the synthetic fp8 22B checkpoint first (if absent)")
    p.add_argument("--arms", nargs="+", default=["16", "8"], help="device caps in GiB, one process each")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--out")
    add_worker_flags(p)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.write:
        write_checkpoint(Path(args.ckpt))
    from runnerkit.models.ltx2.checkpoint_synthetic import SINGLE_FILE

    disk = sequential_read_gbps(Path(args.ckpt) / SINGLE_FILE, 4 * 1024**3)
    print(f"disk: {disk}", flush=True)
    runs: dict[str, dict[str, Any]] = {}
    for arm in args.arms:
        drop_page_cache()
        result = Path(f"{args.out}_{arm}.json")
        with open(f"{args.out}_{arm}.log", "w") as log:  # the arm's own log; partial JSON survives a failure
            rc = subprocess.run(worker_command(Path(__file__), ["--ckpt", args.ckpt, "--requests", str(args.requests),
                                                                "--arm", arm], result),
                                stdout=log, stderr=subprocess.STDOUT).returncode
        runs[arm] = json.loads(result.read_text()) if result.is_file() else {}
        runs[arm]["exit_status"] = rc
        print(f"arm {arm}: exit {rc}", flush=True)
        Path(f"{args.out}.json").write_text(json.dumps({"disk": disk, "runs": runs}, indent=1, default=str))
    header = ["device cap", "plan (mode/storage/reader, streamed)", "load s", "warmup s", "stage-1 step s",
              "stage-2 step s", "requests s", "req1/req2", "peak GiB alloc / reserved", "peak RSS GiB",
              "GB read / step", "disk-bound ratio", "stages of the last request (s)", "steps"]
    table = markdown_table(header, summarize(runs, disk["gbps"]))
    digests = {arm: [r["digests"] for r in run["requests"]] for arm, run in runs.items()}
    same = len({json.dumps(d, sort_keys=True) for d in digests.values()}) == 1
    text = f"{table}\n\ndisk sequential read {disk['gbps']:.2f} GB/s (page cache dropped: {disk['page_cache_dropped']}); " \
           f"outputs bit-identical across arms: {same}; uid {os.getuid()}\n"
    Path(f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
