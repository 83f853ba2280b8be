"""Regional compile with warmup at Wan2.1 1.3B, 480x832x81 with CFG (issue 11, item 1).

One process: load the synthetic 1.3B checkpoint (written first if missing), warmup with
`compile.enabled` (inductor; the flavour's shapes 320x320x17 and 480x832x81), then `--requests`
requests of `--steps` UniPC steps. Reports the warmup seconds (where the compilation went), per
request the steps (CUDA events), wall seconds and the compile audit, and request 1 / request 3.
Compare the steady step with bench/results/attention_h200.md (eager, same shape).

    python bench/compile.py --ckpt /tmp/wan13 --out $OUT/compile_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, device_info, ensure_synthetic, median  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    from runnerkit.config import RequestConfig, load_runner_config
    from runnerkit.models.wan.runner import WanT2VRunner

    ckpt = ensure_synthetic(REPO / "configs/wan/wan_t2v_1.3b.json", Path(args.ckpt), generator_device="cuda")
    data = json.loads((REPO / "configs/wan/wan_t2v_1.3b.json").read_text())
    data.update(model_path=str(ckpt), infer_steps=args.steps, warmup=True, compile={"enabled": True})
    t0 = time.perf_counter()
    runner = WanT2VRunner(load_runner_config(None, data))
    runner.init_modules()
    init_s = time.perf_counter() - t0
    requests = []
    for i in range(args.requests):
        t1 = time.perf_counter()
        prof = runner.run_pipeline(RequestConfig(prompt="a red fox running through fresh snow", seed=i,
                                                 save_tensor_path=str(Path(args.work) / f"r{i}.safetensors")), i)
        requests.append({"index": i, "wall_s": time.perf_counter() - t1, "steps_s": prof.steps,
                         "stages_s": prof.stages, "audit": prof.audit})
    return {"init_s": init_s, "warmup": runner.profiler.warmup, "phases": runner.profiler.phases,
            "attention": runner.profiler.attention, "requests": requests,
            "request1_over_request3": requests[0]["wall_s"] / requests[-1]["wall_s"],
            "steady_step_s": median([s for q in requests[1:] for s in q["steps_s"][1:]]), "device": device_info()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="/tmp/wan13")
    p.add_argument("--work", default="/tmp/compile_work")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("init_s", "request1_over_request3", "steady_step_s")}))
    print("warmup", {k: result["warmup"].get(k) for k in ("seconds", "shapes")} if result["warmup"] else None)
    for q in result["requests"]:
        print(q["index"], f"wall {q['wall_s']:.2f}", [round(s, 3) for s in q["steps_s"]], q["audit"])


if __name__ == "__main__":
    main()
