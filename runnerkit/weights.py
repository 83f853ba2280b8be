"""Checkpoint reading and strict loading onto meta-device skeletons.

Networks are built on the meta device (no memory, no init kernels) and receive their weights
with `load_state_dict(assign=True)`, as torchtitan and gpt-fast do. Loading is strict: every
missing or unexpected key is listed in the error.

Readers hand out tensors that may alias the file (safetensors and `torch.load(mmap=True)` map it),
so a tensor starts wherever its bytes sit in the file: the same weights in differently sharded
files start at different alignments. CPU kernels round differently by alignment (MKL's float32
GEMV gives other bits for weights that are not 16-byte aligned on an AVX2 CPU; AVX-512's 64-byte
vectors can make 64 bytes matter), so every weight is bound to a module through `to_compute`,
which gives it contiguous memory of its own at a `CPU_ALIGNMENT`-byte boundary: outputs then
depend on the weights only, not on the checkpoint's layout, shard count or offload mode, and no
loaded weight aliases a file mapping (a checkpoint file truncated while the process serves would
otherwise kill it with SIGBUS at the weight's next use).
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

CPU_ALIGNMENT = 64
"""Byte alignment of every CPU weight a module computes with: the widest x86-64 vector (AVX-512)
and what c10's CPU allocator guarantees for fresh tensors."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match the architecture."""


def build_on_meta(factory: Callable[[], M]) -> M:
    """Build a module on the meta device: parameters get shapes but no storage."""
    with torch.device("meta"):
        return factory()


def assign_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], component: str,
                      dtype: torch.dtype | None = None,
                      keep_fp32: Callable[[str], bool] = lambda name: False, device: torch.device | None = None) -> nn.Module:
    """Load `state_dict` into a meta-built `module` strictly, with `assign=True`.

    Args:
        module: network built with `build_on_meta`.
        state_dict: name -> tensor, in the module's own key names.
        component: name used in error messages (e.g. "transformer").
        dtype: floating dtype to cast weights to; None keeps the checkpoint's dtype.
        keep_fp32: names for which the weight stays float32 whatever `dtype` is (the layers
            the reference keeps in float32: norms, modulation tables, time embedding).
        device: where the weights go (None: where the state dict is); a device other than the CPU
            takes them straight there, without an aligned host copy first.

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
    # Copies (casts, or copies out of the caller's memory) are made tensor by tensor into `cast`:
    # at most one copy of the weights besides the caller's (usually file-mapped) `state_dict`.
    cast = {k: to_compute(v, torch.float32 if keep_fp32(k) else dtype, device) for k, v in state_dict.items()}
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


def to_compute(tensor: torch.Tensor, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
    """`tensor` as a module weight: cast to `dtype`, moved to `device`, and on the CPU in fresh,
    contiguous memory at a `CPU_ALIGNMENT`-byte boundary.

    Args:
        tensor: any shape; e.g. a tensor aliasing a safetensors file mapping, which starts at the
            alignment of its offset in the file (4 bytes for float32 in the worst case).
        dtype: target dtype of floating tensors (None: keep); integer tensors keep theirs.
        device: target device (None: keep).

    Returns:
        On the CPU, a new tensor in memory of its own (one copy), never `tensor` itself: a weight
        left aliasing a checkpoint's file mapping would read whatever the file holds later, and
        kill the process with SIGBUS once the file is truncated. Off the CPU, what `.to` gives
        (device allocators align >= 256 bytes).
    """
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    converted = tensor.to(device=device, dtype=target)
    if converted.device.type != "cpu":
        return converted
    if converted is not tensor and converted.is_contiguous() and converted.data_ptr() % CPU_ALIGNMENT == 0:
        return converted  # `.to` cast it into fresh memory
    out = torch.empty(converted.shape, dtype=converted.dtype)  # c10 allocates CPU tensors 64-byte aligned
    assert out.data_ptr() % CPU_ALIGNMENT == 0, (
        f"the CPU allocator returned {out.data_ptr():#x}, not {CPU_ALIGNMENT}-byte aligned")
    return out.copy_(converted)


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
    """Read every tensor of `files` (one handle open at a time).

    The tensors alias the files' mappings, at whatever alignment their file offsets give: bind
    them to modules through `assign_state_dict` / `to_compute`, which align them.
    """
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
    """Read a `.pth` state dict with `torch.load(weights_only=True)` (no pickled code runs).

    Memory-mapped: a tensor saved as a view of a larger storage starts at its offset in that
    storage (any alignment); bind through `assign_state_dict` / `to_compute`, which align it.
    """
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
