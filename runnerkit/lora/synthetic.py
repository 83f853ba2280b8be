"""Write a synthetic (deterministic random) LoRA adapter in one of the public layouts.

    python -m runnerkit.lora.synthetic --config CONFIG.json --out distill.safetensors \
        [--layout lightx2v|peft|kohya] [--rank 64] [--alpha 64] [--seed 0] [--dtype bf16]

The layers are those the config's family says a typical adapter covers (`lora_layers` of its
runner: the transformer blocks' linear layers), in the config's architecture; the values are
noise of a small scale, so the adapter changes outputs without blowing them up. For benchmarks
(the real distill adapters' shapes and key names, not their effect) and tests.

Layouts:
    peft:     `transformer.<diffusers-or-native name>.lora_A.weight` [r, in], `.lora_B.weight` [out, r], `.alpha`
    kohya:    `lora_unet_<name with dots as underscores>.lora_down.weight`, `.lora_up.weight`, `.alpha`
    lightx2v: `diffusion_model.<native name>.lora_down.weight`, `.lora_up.weight`, `.alpha`, `.diff_b` [out]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from loguru import logger

LAYOUTS = ("peft", "kohya", "lightx2v")
Layout = Literal["peft", "kohya", "lightx2v"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def synthetic_adapter(layers: Mapping[str, tuple[int, int]], layout: Layout, rank: int, seed: int = 0,
                      alpha: float | None = None, names: Mapping[str, str] | None = None,
                      dtype: torch.dtype = torch.float32, scale: float = 0.5,
                      bias: bool = False) -> dict[str, torch.Tensor]:
    """The adapter's tensors.

    Args:
        layers: layer name (the model's) -> (out_features, in_features).
        layout: see the module docstring.
        rank: r of every pair.
        seed: of a CPU generator (same seed, same tensors on every machine).
        alpha: written as `.alpha` when given (scale alpha / r); None: no alpha key.
        names: model name -> the name to write (peft: e.g. diffusers names); default the model's.
        scale: the update's rough size relative to the layer's input scale.
        bias: also write a bias delta per layer (`lora_B.bias` for peft, `.diff_b` for lightx2v;
            kohya has none).

    Raises:
        ValueError: an unknown `layout`, a non-positive `rank`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {list(LAYOUTS)} (got {layout!r})")
    if rank < 1:
        raise ValueError(f"`rank` must be >= 1 (got {rank})")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    down_s, up_s, bias_s = {"peft": (".lora_A.weight", ".lora_B.weight", ".lora_B.bias"),
                            "kohya": (".lora_down.weight", ".lora_up.weight", None),
                            "lightx2v": (".lora_down.weight", ".lora_up.weight", ".diff_b")}[layout]
    prefix = {"peft": "transformer.", "kohya": "lora_unet_", "lightx2v": "diffusion_model."}[layout]
    for name, (out_f, in_f) in sorted(layers.items()):
        key = (names or {}).get(name, name)
        key = prefix + (key.replace(".", "_") if layout == "kohya" else key)
        out[key + down_s] = (torch.randn(rank, in_f, generator=g) / in_f**0.5).to(dtype)  # [r, in]
        out[key + up_s] = (torch.randn(out_f, rank, generator=g) * scale / rank**0.5).to(dtype)  # [out, r]
        if alpha is not None:
            out[key + ".alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
        if bias and bias_s is not None:
            out[key + bias_s] = (torch.randn(out_f, generator=g) * scale * 0.1).to(dtype)  # [out]
    return out


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import save_file

    from runnerkit.config import ConfigError, load_runner_config
    from runnerkit.files import give_default_mode
    from runnerkit.registry import get_runner_cls

    p = argparse.ArgumentParser(prog="runnerkit.lora.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="runner JSON config whose `model` (or defaults) gives the architecture")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--layout", choices=LAYOUTS, default="lightx2v")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--alpha", type=float, default=None, help="written as each layer's .alpha (default: the rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = p.parse_args(argv)
    if Path(args.out).suffix != ".safetensors":
        logger.error("--out must end in .safetensors (got {!r})", args.out)
        return 2
    try:
        config = load_runner_config(args.config, {})
        runner_cls = get_runner_cls(config.model_cls, config.task)
        layers, names = runner_cls.lora_layers(config, args.layout)
        tensors = synthetic_adapter(layers, args.layout, args.rank, args.seed,
                                    args.alpha if args.alpha is not None else float(args.rank), names, DTYPES[args.dtype])
    except (ConfigError, ValueError, NotImplementedError) as exc:
        logger.error("invalid input: {}", exc)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata={"format": "pt", "runnerkit_synthetic_lora": str(args.seed)})
    give_default_mode(Path(args.out))  # the writer creates 0o600; outputs follow the umask
    logger.info("wrote {} ({} layers, rank {}, layout {})", args.out, len(layers), args.rank, args.layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
