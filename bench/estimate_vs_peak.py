"""Memory estimate vs measured peak, per stage, per offload mode (issue 8, item 5).

For each offload mode x shape, one fresh process builds the runner from a synthetic checkpoint
(random weights of the real architecture: every byte count is the real one), takes the family's
estimate before loading (as the launch script does), loads, and serves one request of `--steps`
steps. Around every profiling stage (text_encoder, transformer, vae_decoder, save) it resets the
device's peak counter and reads it after (CUDA: `torch.cuda.max_memory_allocated`, absolute, the
resident weights included), so each stage's measured peak faces the estimate's weights on the
device during that stage + that stage's activations. The memory check itself is off in the
workers (`memory.check_fit: false`): a shape the estimate would refuse is measured anyway.

    python bench/estimate_vs_peak.py --model_path /tmp/w13 --out $OUT/estimate_vs_peak \
        --modes none block --shapes 480 832 81 720 1280 81 --steps 2

Columns: `formula` = weights + activations as the formulas give them (the tight number), `estimate`
= the refusal's number (+10% margin + fixed overhead), `measured` = the stage's peak, ratios
formula / measured and estimate / measured (>= 1 means an upper bound). Writes OUT.json (raw,
per stage) and OUT.md (the table) after every process; `--time_budget_s` stops before a process
that would not fit, `--resume OUT.json` keeps finished processes.

CPU smoke run (tiny config, the measured column from `torch.profiler`'s allocation events plus
the loaded weights; not a result):

    python bench/estimate_vs_peak.py --config configs/wan/wan_t2v_tiny.json --model_path /tmp/rk_tiny \
        --device cpu --synth_dtype fp32 --shapes 32 32 5 --modes none block --steps 1 --out /tmp/smoke/est

`--dry-run`: no weights, no processes: the estimates alone for every mode x shape on `--device`
(cuda needs no GPU here), from the config's architecture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, Deadline, device_info, ensure_synthetic, markdown_table, run_worker  # noqa: E402

GIB = 1024**3
MODES = ("none", "model", "block", "phase")
PROMPT = "a lighthouse in a storm, waves breaking over the rocks"


def run_config(args: argparse.Namespace, mode: str, shape: tuple[int, int, int], **extra: Any) -> Any:
    """The worker's runner config: `--config` with the checkpoint, steps, device, mode and shape."""
    from runnerkit.config import load_runner_config

    h, w, f = shape
    offload: dict[str, Any] = {"mode": mode} if mode != "none" else {}
    if args.vae_tiling:
        offload["vae_tiling"] = True
    return load_runner_config(args.config, {  # None values (e.g. no --steps) keep the config's own
        "model_path": args.model_path, "infer_steps": args.steps, "device": args.device, "target_height": h,
        "target_width": w, "target_video_length": f, "enable_cfg": not args.no_cfg, "offload": offload,
        "memory": {"check_fit": False}, **extra})


def estimate_rows(runner: Any, shape: tuple[int, int, int]) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Per stage: the estimate's weights on the device, activations, formula and estimate (GiB); and the peak."""
    from runnerkit.planning import fit

    estimate = runner.estimate_memory(shape)
    if estimate is None:
        raise SystemExit(f"{type(runner).__name__} gives no memory estimate")
    stages = {}
    for stage in estimate.stages:
        weights = sum(fit.device_weights(estimate, stage.module, runner.config, runner.device).values())
        formula = weights + stage.activation_bytes
        stages[stage.name] = {"weights_gib": weights / GIB, "activations_gib": stage.activation_bytes / GIB,
                              "formula_gib": formula / GIB,
                              "estimate_gib": (formula * (1 + fit.MARGIN) + fit.overhead_bytes(runner.device)) / GIB,
                              "detail": stage.detail}
    peak = fit.peak_of(estimate, runner.config, runner.device)
    return stages, {"stage": peak.stage, "formula_gib": peak.formula_bytes / GIB, "estimate_gib": peak.bytes / GIB}


class StagePeaks:
    """Measures each profiling stage's peak: CUDA from the allocator's peak counter (absolute), CPU from
    `torch.profiler` allocation events (the stage's tensors) plus the loaded weights."""

    def __init__(self, runner: Any) -> None:
        import torch

        self.torch = torch
        self.device = runner.device
        self.peaks: dict[str, float] = {}
        self.loaded = sum(t.numel() * t.element_size() for m in runner.modules.values()
                          for t in (*m.parameters(), *m.buffers()))
        self._stage = runner.profiler.stage
        runner.profiler.stage = self.stage  # the runner's stage timer, wrapped for this process only

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        torch = self.torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            with self._stage(name):
                yield
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, self._stage(name):
                yield
            events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]")
            live = top = 0
            for _, nbytes in events:
                live += nbytes
                top = max(top, live)
            peak = self.loaded + top
        self.peaks[name] = max(self.peaks.get(name, 0.0), peak / GIB)


def worker(args: argparse.Namespace) -> None:
    import torch

    from runnerkit.config import RequestConfig
    from runnerkit.registry import get_runner_cls

    shape = tuple(args.shape)
    config = run_config(args, args.mode, shape)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    stages, peak = estimate_rows(runner, shape)  # before loading, from the checkpoint's architecture
    t0 = time.perf_counter()
    runner.init_modules()
    load_s = time.perf_counter() - t0
    cuda = runner.device.type == "cuda"
    loaded = torch.cuda.memory_allocated(runner.device) / GIB if cuda else None
    meter = StagePeaks(runner)
    with tempfile.TemporaryDirectory() as tmp:
        prof = runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=42, save_tensor_path=f"{tmp}/v.safetensors"), 0)
    for name, row in stages.items():
        measured = meter.peaks.get(name)
        row["measured_gib"] = measured
        row["formula_over_measured"] = row["formula_gib"] / measured if measured else None
        row["estimate_over_measured"] = row["estimate_gib"] / measured if measured else None
    request_peak = max(meter.peaks.values())
    out = {"mode": args.mode, "shape": list(shape), "cfg": not args.no_cfg, "vae_tiling": args.vae_tiling,
           "steps": args.steps, "load_s": load_s, "request_s": prof.seconds, "loaded_gib": loaded,
           "stages": stages, "estimate": peak, "measured_request_peak_gib": request_peak,
           "profile_peak_allocated_gib": prof.memory.get("peak_allocated_gib"),
           "estimate_over_measured": peak["estimate_gib"] / request_peak,
           "formula_over_measured": peak["formula_gib"] / request_peak}
    Path(args.result).write_text(json.dumps(out, indent=1))


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def table(results: list[dict[str, Any]]) -> str:
    header = ["mode", "shape", "stage", "weights GiB", "activations GiB", "formula GiB", "estimate GiB",
              "measured GiB", "formula / measured", "estimate / measured"]
    rows = []
    for r in results:
        shape = "x".join(map(str, r["shape"])) + (" cfg" if r["cfg"] else "") + (" tiled" if r["vae_tiling"] else "")
        for name, s in r["stages"].items():
            rows.append([r["mode"], shape, name, fmt(s["weights_gib"]), fmt(s["activations_gib"]), fmt(s["formula_gib"]),
                         fmt(s["estimate_gib"]), fmt(s.get("measured_gib")), fmt(s.get("formula_over_measured"), 3),
                         fmt(s.get("estimate_over_measured"), 3)])
        if "measured_request_peak_gib" in r:
            rows.append([r["mode"], shape, f"**request** (peak in {r['estimate']['stage']})", "", "",
                         fmt(r["estimate"]["formula_gib"]), fmt(r["estimate"]["estimate_gib"]),
                         fmt(r["measured_request_peak_gib"]), fmt(r["formula_over_measured"], 3),
                         fmt(r["estimate_over_measured"], 3)])
    return markdown_table(header, rows)


def write_report(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    report = {"device": device_info(), "config": args.config, "steps": args.steps, "dry_run": args.dry_run,
              "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    steps = f"{args.steps} steps" if args.steps else "the config's steps"
    text = (f"# memory estimate vs measured peak ({report['device']}, {Path(args.config).name}, "
            f"{steps}{', dry run: estimates only' if args.dry_run else ''})\n\n"
            "Per stage: weights on the device during the stage + the stage's activations (formula), the "
            "refusal's estimate (+10% margin + fixed overhead), and the stage's measured peak "
            "(max_memory_allocated, weights included). A ratio >= 1 is an upper bound.\n\n" + table(results) + "\n")
    Path(f"{out}.md").write_text(text)
    return text


def dry_run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Estimates only, from the config's architecture (no checkpoint, no process, no GPU needed)."""
    import torch

    from runnerkit.registry import get_runner_cls

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for shape in args.shape_list:
                # a synthetic checkpoint still to be written: the family reads the architecture from the config
                config = run_config(args, mode, shape, device="cpu", model_path=f"{tmp}/absent",
                                    synthetic_checkpoint={"seed": 0})
                runner = get_runner_cls(config.model_cls, config.task)(config)
                runner.device = torch.device(args.device)  # estimate for the target device without owning one
                stages, peak = estimate_rows(runner, shape)
                results.append({"mode": mode, "shape": list(shape), "cfg": not args.no_cfg,
                                "vae_tiling": args.vae_tiling, "stages": stages, "estimate": peak})
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs/wan/wan_t2v_1.3b.json"))
    p.add_argument("--model_path", help="checkpoint folder; a synthetic one is written there if absent")
    p.add_argument("--shapes", type=int, nargs="+", default=[480, 832, 81, 720, 1280, 81],
                   help="height width frames, repeated for several shapes")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["none", "block"])
    p.add_argument("--steps", type=int, help="denoising steps per request (the step peak repeats; default: the "
                   "config's, e.g. LTX-2's fixed 8 + 3)")
    p.add_argument("--no_cfg", action="store_true", help="one branch per step instead of CFG's two")
    p.add_argument("--vae_tiling", action="store_true", help="offload.vae_tiling in every arm")
    p.add_argument("--device", default="cuda")
    p.add_argument("--synth_dtype", default="bf16")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="estimates only: no weights, no processes")
    p.add_argument("--time_budget_s", type=float, help="start no process that would end after this many seconds")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", str(REPO / "bench/results")), "estimate_vs_peak"))
    p.add_argument("--resume", help="an earlier OUT.json whose finished processes are kept")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--shape", type=int, nargs=3)
    p.add_argument("--result")
    args = p.parse_args()
    if len(args.shapes) % 3:
        p.error(f"`--shapes` takes height width frames triples; got {len(args.shapes)} numbers")
    args.shape_list = [tuple(args.shapes[i:i + 3]) for i in range(0, len(args.shapes), 3)]
    if args.worker:
        worker(args)
        return
    if args.dry_run:
        print(write_report(args, dry_run(args)), flush=True)
        return
    if not args.model_path:
        p.error("`--model_path` is required (except with --dry-run)")
    deadline = Deadline(args.time_budget_s)
    ensure_synthetic(Path(args.config), Path(args.model_path), args.synth_dtype,
                     "cuda" if args.device.startswith("cuda") else "cpu")
    results: list[dict[str, Any]] = []
    if args.resume and Path(args.resume).is_file():
        results = json.loads(Path(args.resume).read_text())["results"]
    done = {(r["mode"], tuple(r["shape"])) for r in results}
    steps = ["--steps", str(args.steps)] if args.steps else []
    common = ["--config", args.config, "--model_path", args.model_path, *steps,
              "--device", args.device, *(["--no_cfg"] if args.no_cfg else []),
              *(["--vae_tiling"] if args.vae_tiling else [])]
    seconds: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shape_list:
            for mode in args.modes:
                if (mode, shape) in done:
                    continue
                if seconds and not deadline.fits(1.2 * max(seconds)):
                    print(f"time budget: {deadline.left():.0f} s left, a process takes ~{max(seconds):.0f} s; stopping",
                          flush=True)
                    print(write_report(args, results), flush=True)
                    return
                t0 = time.perf_counter()
                res = run_worker(Path(__file__), [*common, "--mode", mode, "--shape", *map(str, shape)],
                                 Path(tmp) / f"{mode}_{'x'.join(map(str, shape))}.json")
                seconds.append(time.perf_counter() - t0)
                results.append(res)
                print(f"{mode} {list(shape)} ({seconds[-1]:.0f} s): estimate {res['estimate']['estimate_gib']:.2f} GiB, "
                      f"measured {res['measured_request_peak_gib']:.2f} GiB", flush=True)
                write_report(args, results)  # after every process: a cut-short run keeps what it measured
    print(write_report(args, results), flush=True)


if __name__ == "__main__":
    main()
