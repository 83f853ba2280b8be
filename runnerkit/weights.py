"""Checkpoint reading and strict loading onto meta-device skeletons.

Networks are built on the meta device (no memory, no init kernels) and receive their weights
with `load_state_dict(assign=True)`, as torchtitan and gpt-fast do. Loading is strict: every
missing or unexpected key is listed in the error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from torch import nn

M = TypeVar("M", bound=nn.Module)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match the architecture."""


def build_on_meta(factory: Callable[[], M]) -> M:
    """Build a module on the meta device: parameters get shapes but no storage."""
    with torch.device("meta"):
        return factory()


def assign_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], component: str,
                      dtype: torch.dtype | None = None,
                      keep_fp32: Callable[[str], bool] = lambda name: False) -> nn.Module:
    """Load `state_dict` into a meta-built `module` strictly, with `assign=True`.

    Args:
        module: network built with `build_on_meta`.
        state_dict: name -> tensor, in the module's own key names.
        component: name used in error messages (e.g. "transformer").
        dtype: floating dtype to cast weights to; None keeps the checkpoint's dtype.
        keep_fp32: names for which the weight stays float32 whatever `dtype` is (the layers
            the reference keeps in float32: norms, modulation tables, time embedding).

    Raises:
        CheckpointError: listing missing and unexpected keys, or shape mismatches.
    """
    expected = {k: v for k, v in module.state_dict(keep_vars=True).items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{component}: checkpoint does not match the architecture; "
            f"missing keys ({len(missing)}): {short_list(missing)}; unexpected keys ({len(unexpected)}): {short_list(unexpected)}"
        )
    bad = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
           for k, v in state_dict.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        raise CheckpointError(f"{component}: shape mismatch for {len(bad)} tensors: {short_list(bad)}")
    cast = {}
    for k, v in state_dict.items():
        if v.is_floating_point():
            target = torch.float32 if keep_fp32(k) else (dtype or v.dtype)
            v = v.to(target)
        cast[k] = v
    module.load_state_dict(cast, strict=True, assign=True)
    # Buffers that are not in the state dict (non-persistent) are still on meta: the module
    # must re-create them itself (e.g. RoPE tables) in `init_non_persistent_buffers`.
    init = getattr(module, "init_non_persistent_buffers", None)
    if init is not None:
        init()
    leftover = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftover:
        raise CheckpointError(f"{component}: tensors left on the meta device after loading: {short_list(leftover)}")
    return module


def short_list(items: list[str], limit: int = 12) -> str:
    """'a, b, c, ... (+N more)' for error messages that list names."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "") if items else "none"


def safetensors_files(folder: Path, stem: str | None = None) -> list[Path]:
    """The safetensors files of a folder (a sharded set named by an index json, or all of them)."""
    folder = Path(folder)
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob(f"{stem}*.safetensors" if stem else "*.safetensors"))
    return files


def read_safetensors(files: Iterable[Path], component: str) -> dict[str, torch.Tensor]:
    """Read every tensor of `files` into CPU memory (one handle open at a time)."""
    files = list(files)
    if not files:
        raise CheckpointError(f"{component}: no .safetensors files found (is the checkpoint folder complete?)")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        if not Path(path).is_file():
            raise CheckpointError(f"{component}: checkpoint file {path} does not exist")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in out:
                        raise CheckpointError(f"{component}: tensor {key!r} appears in two files (second: {path})")
                    out[key] = f.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{component}: cannot read {path} ({type(exc).__name__}: {exc}); the file is "
                                  "truncated or not safetensors") from None
    return out


def read_pth(path: Path, component: str) -> dict[str, torch.Tensor]:
    """Read a `.pth` state dict with `torch.load(weights_only=True)` (no pickled code runs)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{component}: checkpoint file {path} does not exist")
    sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(sd, dict):
        raise CheckpointError(f"{component}: {path} does not hold a state dict (got {type(sd).__name__})")
    return sd


def synthetic_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype,
                     generator_device: str = "cpu") -> torch.Tensor:
    """A deterministic random tensor for `name` (independent of file, shard and layout).

    Scale: weights with >= 2 dims ~ N(0, 1/fan_in); norm gains (`*norm*.weight`, `gamma`) ~ 1 + N(0, 0.05^2);
    AdaLN modulation tables ~ N(0, 1/dim); biases and other vectors ~ N(0, 0.02^2). The values are
    noise: a pipeline with them produces noise, but runs every real operator on realistic scales.
    `generator_device`="cuda" draws on the GPU (much faster for 14B-class models; other values
    than the CPU generator's, equally deterministic); the result is returned on the CPU.
    """
    import zlib

    gen = torch.Generator(generator_device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    x = torch.randn(shape, generator=gen, dtype=torch.float32, device=generator_device)
    leaf = name.rsplit(".", 1)[-1]
    if "modulation" in name or "scale_shift_table" in name:
        x = x / shape[-1] ** 0.5
    elif leaf == "gamma" or ("norm" in name and leaf == "weight" and len(shape) == 1):
        x = 1.0 + 0.05 * x
    elif leaf == "bias" or len(shape) < 2:
        x = 0.02 * x
    else:
        fan_in = 1
        for s in shape[1:]:
            fan_in *= s
        x = x / fan_in**0.5
    return x.to(dtype).cpu()
