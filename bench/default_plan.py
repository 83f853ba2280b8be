"""A shipped real-size config with no offload keys (the default plan), through the launch script,
on the whole device or under a cap; records the plan, the kept budget against what the device offers
at every later check, request times, step times and peaks.

    python3 bench/default_plan.py --ckpt /tmp/ltx23fp8 --write --arms full --requests 2 --out $OUT/default_plan_h100
    python3 bench/default_plan.py --family wan14 --ckpt /tmp/wan14 --write --arms full 24 --host_gib 64 --out $OUT/wan14

`--family` (default `ltx23`): `ltx23` is configs/ltx2/ltx23_t2av_22b_distilled.json at 512x768x121 (below);
`wan14` configs/wan/wan_t2v_14b.json at 480x832x81 and `qwen20` configs/qwen_image/qwen_image_t2i_20b.json at
1328x1328, each with `--steps` denoising steps (default 8) and its synthetic checkpoint written by
`runnerkit.tools.synth_checkpoint` (full size, text encoder included).

`--write` writes the synthetic fp8 single file with a Gemma-3 of the release's 12B size
(`bench/small_machine.py`'s writer). Each arm is a fresh process (`--worker`) that runs
`runnerkit.infer.main` on `configs/ltx2/ltx23_t2av_22b_distilled.json` (no `offload` key), with the
synthetic paths and a requests file of `--requests` t2av requests at 512x768x121 and warmup. Arm
`full`: the whole device, nothing configured. Arm `N` (GiB): `torch.cuda.set_per_process_memory_fraction`
caps the allocator at N GiB, and the config adds `memory.limit_gib` N and `memory.host_limit_gib` (`--host_gib`,
32). `--repeat K`: K processes per arm. A thread samples /proc/self/status every 0.1 s: the peaks of RssAnon
(anonymous: heap, pinned slabs), RssFile (mapped file pages: the page cache of mmap reads, reclaimable) and
RssShmem, and of RssAnon + RssShmem at one sample (what the host estimate bounds), set against the plan's host
estimate.
A spy on the runner's memory checks (planning/checks.py `MemoryChecks.check_fit`, and `check_request` as each
request starts, which does not check again what the launch script checked before loading) records the kept
budget and what a re-read of the device (free + reserved) would give: the drift the CUDA libraries cause after
loading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_worker_flags, ensure_synthetic, worker_command
from bench.small_machine import SHAPE

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
FAMILIES: dict[str, dict[str, Any]] = {
    "ltx23": {"config": REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json", "shape": SHAPE},
    "wan14": {"config": REPO / "configs/wan/wan_t2v_14b.json", "shape": (480, 832, 81)},
    "qwen20": {"config": REPO / "configs/qwen_image/qwen_image_t2i_20b.json", "shape": (1328, 1328, 1)},
}


def _paths(family: str, ckpt: Path) -> list[str]:
    """The launch script's checkpoint flags for `family`'s synthetic checkpoint at `ckpt`."""
    if family != "ltx23":
        return ["--model_path", str(ckpt)]
    from runnerkit.models.ltx2.checkpoint_synthetic import SINGLE_FILE, UPSAMPLER_FILE

    return ["--model_path", str(ckpt / SINGLE_FILE), "--upsampler_path", str(ckpt / UPSAMPLER_FILE),
            "--text_encoder_path", str(ckpt / "text_encoder")]


def worker(args: argparse.Namespace) -> None:
    import torch

    from runnerkit import infer, memory
    from runnerkit.planning.checks import MemoryChecks

    result, out_dir = Path(args.result), Path(args.result).with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[args.family]
    data = json.loads(family["config"].read_text())
    if args.family != "ltx23":
        data["infer_steps"] = args.steps
    if args.arm != "full":
        cap = float(args.arm)
        torch.cuda.set_per_process_memory_fraction(cap * GIB / torch.cuda.get_device_properties(0).total_memory)
        data["memory"] = {"limit_gib": cap, "host_limit_gib": args.host_gib}
    config = out_dir / "config.json"
    config.write_text(json.dumps(data))
    h, w, f = family["shape"]
    words = " ".join(["and the waves crash on the black rocks below"] * (args.prompt_words // 9))
    lines = [{"prompt": f"a lighthouse in a storm at night, take {k} {words}".strip(), "seed": 42, "target_height": h,
              "target_width": w, "save_tensor_path": str(out_dir / f"r{k}.safetensors"),
              **({"target_video_length": f} if f > 1 else {})} for k in range(args.requests)]
    requests = out_dir / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    checks: list[dict[str, Any]] = []
    real_check, real_request = MemoryChecks.check_fit, MemoryChecks.check_request

    def record(self: Any, what: str) -> None:
        budget = self.device_budget()
        reread = memory.memory_limit(self.memory_device())
        checks.append({"what": what, "budget_gib": budget.bytes / GIB if budget else None,
                       "device_offers_gib": reread.bytes / GIB if reread else None,
                       "reserved_gib": torch.cuda.memory_reserved() / GIB, "t": time.perf_counter()})

    def spy(self: Any, shape: Any, what: str) -> Any:
        record(self, what)
        return real_check(self, shape, what)

    def spy_request(self: Any, request: Any, shape: Any, what: str) -> Any:
        record(self, f"{what} starts")
        return real_request(self, request, shape, what)

    MemoryChecks.check_fit = spy  # type: ignore[method-assign]
    MemoryChecks.check_request = spy_request  # type: ignore[method-assign]
    peaks = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0, "VmRSS": 0, "RssAnon+RssShmem": 0}
    stop = threading.Event()

    def sample() -> None:  # each field's peak, and the peak of anonymous + shared (pinned) at one sample
        while not stop.wait(0.1):
            now = {}
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in peaks:
                    now[key] = int(rest.split()[0]) * 1024
            now["RssAnon+RssShmem"] = now.get("RssAnon", 0) + now.get("RssShmem", 0)
            for key, value in now.items():
                peaks[key] = max(peaks[key], value)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ckpt = Path(args.ckpt)
    profile = out_dir / "profile.json"
    t0 = time.perf_counter()
    rc = infer.main(["--config_json", str(config), *_paths(args.family, ckpt),
                     "--requests", str(requests), "--profile_json", str(profile), "--warmup"])
    stop.set()
    sampler.join()
    report = json.loads(profile.read_text()) if profile.is_file() else {}
    out = {"arm": args.arm, "exit_status": rc, "seconds": time.perf_counter() - t0, "checks": checks,
           "memory_plan": report.get("memory_plan"), "warmup": report.get("warmup"),
           "load_seconds": (report.get("phases") or {}).get("load_seconds"),
           "requests": [{k: r.get(k) for k in ("index", "seconds", "stage_seconds", "step_seconds", "memory", "ok")}
                        for r in report.get("requests", [])],
           "max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
           "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
           "peak_rss_gib": memory.host_memory().peak_rss_gib,
           "sampled_peaks_gib": {k: v / GIB for k, v in peaks.items()}}
    result.write_text(json.dumps(out, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="ltx23",
                   help="ltx23: the LTX-2.3 22B fp8 release at 512x768x121; wan14: Wan2.1 14B at 480x832x81; qwen20: "
                        "Qwen-Image 20B at 1328x1328")
    p.add_argument("--ckpt", required=True, help="the synthetic checkpoint's folder (written there with --write)")
    p.add_argument("--write", action="store_true", help="write the family's synthetic checkpoint first (if absent)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps a request (wan14, qwen20)")
    p.add_argument("--prompt_words", type=int, default=0,
                   help="lengthen each prompt by about this many words (the text encoder's stage at a long prompt)")
    p.add_argument("--arms", nargs="+", default=["full"], help="'full' or a device cap in GiB, one process each")
    p.add_argument("--requests", type=int, default=2, help="requests a process serves after warmup")
    p.add_argument("--host_gib", type=float, default=32.0, help="memory.host_limit_gib of a capped arm")
    p.add_argument("--repeat", type=int, default=1, help="processes per arm")
    p.add_argument("--out", help="the files prefix: OUT_<arm>.json and .log per process (required)")
    add_worker_flags(p)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.out:
        p.error("--out is required")
    if args.write:  # in a process of its own: the arms must find the device as a fresh run does
        if args.family == "ltx23":
            code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from pathlib import Path; "
                    f"from bench.small_machine import write_checkpoint; write_checkpoint(Path({args.ckpt!r}))")
            subprocess.run([sys.executable, "-c", code], check=True)
        else:
            ensure_synthetic(FAMILIES[args.family]["config"], Path(args.ckpt), generator_device="cuda")
    failed = []
    for arm in args.arms:
        for k in range(args.repeat):
            name = f"{args.out}_{arm}" + (f"_p{k}" if args.repeat > 1 else "")
            if _run_arm(args, arm, Path(f"{name}.json"), Path(f"{name}.log")):
                failed.append(name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their .log files say why)")


def _run_arm(args: argparse.Namespace, arm: str, result: Path, log_path: Path) -> int:
    """One arm's process; prints its plan, checks, requests and peaks. Returns the launch script's exit status
    (the worker's own where it wrote no result)."""
    extra = ["--host_gib", str(args.host_gib)]
    with open(log_path, "w") as log:
        rc = subprocess.run(worker_command(Path(__file__), ["--family", args.family, "--ckpt", args.ckpt,
                                                            "--requests", str(args.requests), "--steps",
                                                            str(args.steps), "--prompt_words", str(args.prompt_words),
                                                            "--arm", arm, *extra], result),
                            check=False, stdout=log, stderr=subprocess.STDOUT).returncode
    run = json.loads(result.read_text()) if result.is_file() else {"exit_status": rc}
    status = run["exit_status"] if rc == 0 else rc
    plan = run.get("memory_plan") or {}
    if status:
        errors = [line for line in log_path.read_text(errors="replace").splitlines() if "ERROR" in line or "Error" in line]
        print(f"arm {arm} ({result.name}): exit {status}: {errors[-1] if errors else 'see ' + str(log_path)}", flush=True)
        return status
    print(f"arm {arm} ({result.name}): exit {status}, plan {plan.get('candidate')} (estimate {plan.get('device_gib')} "
          f"of {plan.get('device_limit_gib')} GiB: {plan.get('device_limit_source')}; host {plan.get('host_gib')} "
          f"(pinned {plan.get('host_pinned_gib')}) of {plan.get('host_limit_gib')}; request copies "
          f"{plan.get('request_copy_seconds_estimate')} s), load {run.get('load_seconds')}, "
          f"warmup {(run.get('warmup') or {}).get('seconds')}", flush=True)
    for c in run.get("checks", []):
        print(f"  check {c['what']}: budget {c['budget_gib']:.3f} GiB, device offers {c['device_offers_gib']:.3f} "
              f"GiB, reserved {c['reserved_gib']:.2f}", flush=True)
    for r in run.get("requests", []):
        steps = r.get("step_seconds") or []
        first = [(steps[0], statistics.median(steps[1:8])), (steps[8], statistics.median(steps[9:]))] \
            if args.family == "ltx23" and len(steps) == 11 else [(steps[0], statistics.median(steps[1:]))] \
            if len(steps) > 1 else []
        print(f"  request {r['index']}: {r['seconds']:.2f} s, steps {[round(s, 3) for s in steps]}, "
              f"first/steady per stage {[round(a / b, 3) for a, b in first]}, "
              f"stages { {k: round(v, 2) for k, v in (r['stage_seconds'] or {}).items()} }, "
              f"memory {r['memory']}", flush=True)
    print(f"  peaks: allocated {run.get('max_allocated_gib')}, reserved {run.get('max_reserved_gib')}, "
          f"RSS {run.get('peak_rss_gib')}, sampled {run.get('sampled_peaks_gib')}", flush=True)
    return 0

if __name__ == "__main__":
    main()
