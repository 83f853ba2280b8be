"""Write a synthetic (deterministic random) checkpoint for a runner config's architecture.

    python -m runnerkit.tools.synth_checkpoint --config configs/wan/wan_t2v_1.3b.json --out /data/wan13b \
        [--dtype bf16] [--layout runnerkit|original|diffusers] [--seed 0]

The transformer is generated and written shard by shard (at most ~2 GiB of tensors in memory),
so a 14B checkpoint never needs its full size in RAM. The weights are noise: outputs are noise,
but every operator, shape and byte count is the real one (for warmup, offload and benchmarks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from loguru import logger

from runnerkit.config import ConfigError, load_runner_config
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import LAYOUTS, write_synthetic

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="runnerkit.tools.synth_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="runner JSON config whose `model` (or defaults) gives the architecture")
    p.add_argument("--out", required=True, help="output folder (replaced if it exists)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of transformer and text encoder weights")
    p.add_argument("--layout", choices=LAYOUTS, default="runnerkit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator_device", default="cpu", help="draw the random values on this device (cuda: fast)")
    p.add_argument("--transformer_only", action="store_true", help="write only the transformer (runnerkit layout)")
    args = p.parse_args(argv)
    try:
        config = load_runner_config(args.config, {"synthetic_checkpoint": {"seed": args.seed}})
    except ConfigError as exc:
        logger.error("{}", exc)
        return 2
    if config.model_cls != "wan2.1":
        logger.error("`model_cls` {!r}: synthetic checkpoints are implemented for 'wan2.1' only", config.model_cls)
        return 2
    arch = WanArch.model_validate(config.model or {})
    t0 = time.perf_counter()
    write_synthetic(arch, Path(args.out), args.seed, DTYPES[args.dtype], args.layout,
                    generator_device=args.generator_device, transformer_only=args.transformer_only)
    logger.info("synthetic checkpoint written in {:.1f} s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
