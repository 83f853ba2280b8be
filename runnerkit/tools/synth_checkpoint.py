"""Write a synthetic (deterministic random) checkpoint for a runner config's architecture.

    python -m runnerkit.tools.synth_checkpoint --config CONFIG.json --out /data/ckpt \
        [--dtype bf16] [--layout LAYOUT] [--seed 0] [--generator_device cuda] [--fp8_blocks scaled]

The family of the config's `model_cls` writes it (`write_synthetic_checkpoint` of its runner, in
one of its `CHECKPOINT_LAYOUTS`); large transformers are generated and written shard by shard,
so a big checkpoint never needs its full size in RAM. The weights are noise: outputs are noise,
but every operator, shape and byte count is the real one (for warmup, offload and benchmarks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from loguru import logger
from pydantic import ValidationError

from runnerkit.config import ConfigError, format_validation_error, load_runner_config
from runnerkit.interrupts import exit_status, install_sigterm_handler, restore_sigterm_default
from runnerkit.registry import get_runner_cls
from runnerkit.synthetic import synthetic_seed_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    install_sigterm_handler()
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # the partial folder is already removed by the writer
        logger.error("interrupted; no checkpoint was written")
        return exit_status(exc)
    finally:
        restore_sigterm_default()  # done: a SIGTERM during shutdown ends the process quietly


def _main(argv: list[str] | None) -> int:
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}")
    p = argparse.ArgumentParser(prog="runnerkit.tools.synth_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="runner JSON config whose `model` (or defaults) gives the architecture")
    p.add_argument("--out", required=True, help="output folder: new, empty, or an earlier synthetic checkpoint (replaced)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of transformer and text encoder weights")
    p.add_argument("--layout", default=None, help="checkpoint layout of the family (e.g. runnerkit, original, diffusers; "
                   "default: the one the family writes for `synthetic_checkpoint`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator_device", default="cpu", help="draw the random values on this device (cuda: fast)")
    p.add_argument("--transformer_only", action="store_true", help="write only the transformer (runnerkit layout)")
    p.add_argument("--fp8_blocks", choices=("plain", "scaled"), default=None,
                   help="families whose writer has an fp8 release layout: store the transformer blocks' linear "
                   "weights as float8_e4m3fn, without (plain) or with a per-tensor `weight_scale` (scaled), as "
                   "fp8 releases do; other families exit 2")
    p.add_argument("--force", action="store_true", help="replace --out even if it holds files that are not a checkpoint")
    args = p.parse_args(argv)
    out = Path(args.out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        logger.error("--out {!r} is a file; give a folder", args.out)
        return 2
    try:
        config = load_runner_config(args.config, {"synthetic_checkpoint": {"seed": args.seed}})
        family = get_runner_cls(config.model_cls, config.task)
        if not family.CHECKPOINT_LAYOUTS:  # the class declares the layouts its `write_synthetic_checkpoint` writes
            raise ConfigError(f"`model_cls` {config.model_cls!r} cannot write synthetic checkpoints")
        if args.layout is None:
            args.layout = family.SYNTHETIC_LAYOUT
        if args.layout not in family.CHECKPOINT_LAYOUTS:
            raise ConfigError(f"--layout {args.layout!r} is not a layout of {config.model_cls!r}; "
                              f"allowed: {list(family.CHECKPOINT_LAYOUTS)}")
        earlier_synthetic = out.is_dir() and synthetic_seed_of(out) is not None
    except (ConfigError, ValueError) as exc:
        logger.error("{}", exc)
        return 2
    if out.is_dir() and any(out.iterdir()) and not earlier_synthetic and not args.force:
        logger.error("--out {!r} is a non-empty folder that holds no synthetic checkpoint; refusing to delete it "
                     "(pass --force to replace its contents)", args.out)
        return 2
    try:
        t0 = time.perf_counter()
        extra = {"fp8_blocks": args.fp8_blocks} if args.fp8_blocks else {}  # only families that write fp8 take it
        family.write_synthetic_checkpoint(config, out, args.seed, DTYPES[args.dtype], args.layout,
                                          generator_device=args.generator_device,
                                          transformer_only=args.transformer_only, replace=True, **extra)
    except ValidationError as exc:
        logger.error("{}", format_validation_error(exc, f"`model` of {args.config!r}"))
        return 2
    except TypeError as exc:
        if not extra or "fp8_blocks" not in str(exc):
            raise
        logger.error("--fp8_blocks: `model_cls` {!r} does not write fp8 checkpoints ({})", config.model_cls, exc)
        return 2
    except (ConfigError, ValueError, NotImplementedError, OSError, RuntimeError) as exc:
        logger.error("{}: {}", type(exc).__name__, exc)
        return 2
    logger.info("synthetic checkpoint written to {} in {:.1f} s", out, time.perf_counter() - t0)
    return 0

if __name__ == "__main__":
    sys.exit(main())
