"""The flags of `runnerkit plan` (runnerkit/tools/plan.py), in a module that imports neither torch nor a family,
so that `--help` and a bad flag are answered at once: the `runnerkit` command (cli.py, infer.py) parses the flags
here first and imports the plan only for a command line that parses."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["build_parser"]


def _gib_flag(flag: str) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"`{flag}` must be a positive number of GiB, e.g. 24 (got {text!r})")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="runnerkit plan", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The memory plan a config would get on this machine, or on given limits, before anything "
                    "loads and without its checkpoint (docs/memory_plan.md).",
        epilog="example:\n  runnerkit plan --config_json configs/<family>/<config>.json --device_gib 24 "
               "--host_gib 64\n\n"
               "exit status: 0 the run would start with this plan; 1 the run would be refused (nothing fits: the "
               "output says what would); 2 invalid input")
    p.add_argument("--config_json", required=True, help="JSON runner config (a real-size one needs no checkpoint)")
    p.add_argument("--device_gib", type=_gib_flag("--device_gib"),
                   help="GPU memory to plan for, GiB (as config memory.limit_gib; default: this machine's CUDA "
                        "device: free + held, less 1 GiB for the CUDA libraries)")
    p.add_argument("--host_gib", type=_gib_flag("--host_gib"),
                   help="host memory to plan for, GiB (as config memory.host_limit_gib; default: available "
                        "memory, cgroup limits included)")
    p.add_argument("--device_name",
                   help="the GPU whose compute the estimated request time assumes, as CUDA names it, e.g. 'NVIDIA "
                        "H100 80GB HBM3' (default: this machine's CUDA device; none: no compute estimate, plans "
                        "ranked by copy seconds; known names: planning/compute.py DEVICE_PEAKS)")
    p.add_argument("--offload", choices=("none", "model", "block", "phase", "auto"),
                   help="offload mode, replacing the config's offload.mode (as the launch script's --offload)")
    p.add_argument("--target_height", type=int, help="plan for this default height instead of the config's")
    p.add_argument("--target_width", type=int, help="plan for this default width instead of the config's")
    p.add_argument("--target_video_length", type=int, help="plan for this default frame count instead of the config's")
    p.add_argument("--warmup", action="store_true", help="add the warmup shapes (as the launch script's --warmup)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object (the profile's memory_plan "
                                                       "with estimated_request_seconds, fits, refusal, modules' bytes)")
    p.add_argument("--log_level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="least severe log messages shown on stderr (default WARNING; INFO adds the planner's log)")
    return p
