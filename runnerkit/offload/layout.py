"""Streamed units and their byte layouts; fp8 (e4m3) storage of streamed weights.

A *unit* is what one forward hook streams: all streamed parameters of block i (mode "block")
or of one phase submodule of block i (mode "phase"). The model family names its block list and
its phases in a `StreamSpec` (its transformer class's `STREAM_SPEC`); nothing here assumes a family.
Its *layout* says where each tensor lives in the unit's contiguous bytes:

    raw region (copied H2D, identical in the host slab and the device slot):
        [tensor 0 stored bytes | pad to 256] [tensor 1 ...] ... [fp8 scales float32 [n] | pad]
    compute region (device slot only, weight_dtype="fp8_e4m3"):
        [tensor 0 in the compute dtype | pad] ...

With weight_dtype="same" the stored dtype is the compute dtype and the modules read the raw
region directly (no compute region), except for the names in `fp8_stored`: tensors that the
checkpoint itself stores as float8_e4m3fn (an fp8 release) and that a disk source streams as
stored, each with a float32 scale (the checkpoint's per-tensor scale, or 1.0) and a compute region.

Upcast (the streamer, on the device): fp8 -> compute dtype (exact: every e4m3 value is a bf16,
fp16 and fp32 value), times the float32 scale with the product formed in float32 and rounded
once to the compute dtype: bit-identical to `dequantize_fp8_e4m3`, i.e. to a resident load
`(q.float() * scale).to(dtype)`.

fp8 error: e4m3 keeps 3 mantissa bits, so each weight is rounded with a relative error of at
most 2^-4 (6.25%) when |w| >= absmax * 2^-14 (normal range after scaling by absmax/448);
smaller weights are subnormal (absolute step absmax/448 * 2^-9) or flush to zero. Upcasting is
exact into bf16/fp16/fp32; the product with the scale is formed in float32 and rounded once to
the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from runnerkit.offload.pinned import align_up, plan_offsets

StreamMode = Literal["block", "phase"]
WeightDtype = Literal["same", "fp8_e4m3"]
FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value; the per-tensor scale is absmax / FP8_E4M3_MAX."""


@dataclass(frozen=True)
class StreamSpec:
    """How a model family's transformer (or text encoder) streams: declared by the family, next to its module.

    Attributes:
        blocks_attr: attribute of the model holding the blocks, an `nn.ModuleList`; a dotted
            path reaches into submodules (e.g. "language_model.layers" of a transformers model).
        phases: phase submodule names of each block, in the order `block.forward` calls them
            (mode "phase"); each phase must bracket every use of its weights.
        keep_fp32: full parameter name -> True when the reference keeps it float32; inside
            blocks such tensors stay resident on the device (small tables, norms).
        more_blocks: further block lists (dotted paths) whose blocks run after those of
            `blocks_attr`, in this order: a module with several block stacks (e.g. a text
            connector's video then audio blocks) streams them all as one unit sequence.
        per_step: the module runs at every denoising step (a transformer): `offload.resident_blocks` keeps
            that many of its units on the device. False (a text encoder, a connector: once per request):
            every unit streams whatever `resident_blocks` says, so the device memory it would take goes to
            the modules that copy at every step.
    """

    blocks_attr: str
    phases: tuple[str, ...]
    keep_fp32: Callable[[str], bool]
    more_blocks: tuple[str, ...] = ()
    per_step: bool = True

    def resident_units(self, resident_blocks: int) -> int:
        """The units of a module of this spec that stay resident under `offload.resident_blocks`."""
        return resident_blocks if self.per_step else 0


@dataclass(frozen=True)
class StreamUnit:
    """One streamed unit: the module whose forward hooks drive it and the parameters it streams.

    Attributes:
        module: dotted name of the hooked module, e.g. "blocks.3" or "blocks.3.ffn".
        params: full dotted parameter names, e.g. ("blocks.3.ffn.0.weight", ...).
    """

    module: str
    params: tuple[str, ...]


def plan_units(model: nn.Module, mode: StreamMode, spec: StreamSpec) -> list[StreamUnit]:
    """The streamed units of `model`, in execution order.

    Args:
        model: network whose `spec.blocks_attr` and `spec.more_blocks` (dotted paths) are `nn.ModuleList`s
            (may be on the meta device); their units follow one another in that order.
        mode: "block": one unit per block, every parameter of the block except `spec.keep_fp32`
            ones; "phase": one unit per phase submodule of each block, in `spec.phases` order.
        spec: the family's block list, phases and float32 layers.

    Raises:
        ValueError: unknown `mode`, missing block list, no phases (mode "phase") or a missing
            phase submodule.
    """
    if mode not in ("block", "phase"):
        raise ValueError(f"`mode` must be 'block' or 'phase', got {mode!r}")
    if mode == "phase" and not spec.phases:
        raise ValueError(f"mode 'phase' needs phases; the stream spec of {type(model).__name__} declares none")
    units: list[StreamUnit] = []
    for attr in (spec.blocks_attr, *spec.more_blocks):
        try:
            blocks = model.get_submodule(attr)  # a dotted path reaches into submodules
        except AttributeError:
            blocks = None
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"`blocks_attr`={attr!r}: model {type(model).__name__} has no nn.ModuleList there")
        units += _block_units(blocks, attr, mode, spec)
    return units


def _block_units(blocks: nn.ModuleList, attr: str, mode: StreamMode, spec: StreamSpec) -> list[StreamUnit]:
    """The units of one block list `attr` of a model (see `plan_units`)."""
    units: list[StreamUnit] = []
    for i, block in enumerate(blocks):
        prefix = f"{attr}.{i}"
        if mode == "block":
            targets = [(prefix, block)]
        else:
            targets = []
            for phase in spec.phases:
                sub = getattr(block, phase, None)
                if not isinstance(sub, nn.Module):
                    raise ValueError(f"`phases`: block {prefix} has no submodule {phase!r} "
                                     f"(phases={list(spec.phases)})")
                targets.append((f"{prefix}.{phase}", sub))
        for name, module in targets:
            params = tuple(f"{name}.{n}" for n, _ in module.named_parameters()
                           if not spec.keep_fp32(f"{name}.{n}"))
            if params:
                units.append(StreamUnit(name, params))
    return units


def split_resident(units: Sequence[StreamUnit], n: int) -> tuple[list[StreamUnit], list[StreamUnit]]:
    """(kept, streamed): `n` of `units` stay on the device (config `offload.resident_blocks`), the others stream.

    Even spread: of U units, the k-th kept one (k = 0 .. n-1) is unit floor((2k + 1) * U / (2n)), the middle
    of the k-th of n equal stretches of the sequence, so resident units sit between streamed ones and the
    copy of the next streamed unit overlaps their compute too (also across the step wrap: the last stretch
    keeps a unit near the end). E.g. U = 10: n = 1 keeps [5]; n = 2 keeps [2, 7]; n = 3 keeps [1, 5, 8];
    U = 4, n = 3 keeps [0, 2, 3]. n >= U keeps every unit (nothing streams); n = 0 keeps none. Both lists
    keep the execution order of `units`.

    Raises:
        ValueError: `n` < 0.
    """
    if n < 0:
        raise ValueError(f"`resident_blocks` must be >= 0, got {n}")
    total = len(units)
    n = min(n, total)
    kept_index = {(2 * k + 1) * total // (2 * n) for k in range(n)}  # n distinct indices: the stretches are >= 1 long
    kept = [u for i, u in enumerate(units) if i in kept_index]
    streamed = [u for i, u in enumerate(units) if i not in kept_index]
    return kept, streamed


def resident_names(model: nn.Module, units: Sequence[StreamUnit]) -> list[str]:
    """Every parameter and persistent buffer name of `model` that no unit streams (load these yourself)."""
    streamed = {p for u in units for p in u.params}
    return [n for n in model.state_dict(keep_vars=True) if n not in streamed]


@dataclass(frozen=True)
class TensorPlacement:
    """One tensor of a unit: its name, shape, dtypes and byte offsets.

    Attributes:
        name: full parameter name.
        shape: tensor shape.
        dtype: compute dtype (what the module sees).
        stored_dtype: dtype of the bytes copied H2D (== dtype, or float8_e4m3fn).
        offset: byte offset in the raw region.
        nbytes: stored bytes.
        compute_offset: byte offset in the compute region, None when stored == compute dtype.
        scale_index: index into the unit's float32 scales, None without fp8.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stored_dtype: torch.dtype
    offset: int
    nbytes: int
    compute_offset: int | None
    scale_index: int | None


@dataclass(frozen=True)
class UnitLayout:
    """Byte layout of one unit (see module docstring). All sizes in bytes, exact."""

    module: str
    tensors: tuple[TensorPlacement, ...]
    raw_nbytes: int
    compute_nbytes: int
    scales_offset: int | None

    @property
    def num_scales(self) -> int:
        return sum(1 for t in self.tensors if t.scale_index is not None)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def plan_unit_layout(unit: StreamUnit, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype,
                     weight_dtype: WeightDtype = "same", fp8_stored: Collection[str] = ()) -> UnitLayout:
    """Place `unit`'s tensors (shapes from `shapes`) in raw and compute regions.

    Args:
        weight_dtype: "same": tensors stored in `dtype`; "fp8_e4m3": every tensor stored fp8 (quantized
            at load, `quantize_fp8_e4m3`).
        fp8_stored: with "same", names whose bytes stay float8_e4m3fn as the checkpoint stores them
            (1 byte per element + a float32 scale; upcast into the compute region). Names not in
            `unit` are ignored (one set may serve every unit).

    Raises:
        ValueError: unknown `weight_dtype`, or fp8 with a non-floating compute `dtype`.
    """
    if weight_dtype not in ("same", "fp8_e4m3"):
        raise ValueError(f"`weight_dtype` must be 'same' or 'fp8_e4m3', got {weight_dtype!r}")
    is_fp8 = [weight_dtype == "fp8_e4m3" or n in fp8_stored for n in unit.params]
    if any(is_fp8) and not dtype.is_floating_point:
        raise ValueError(f"fp8-stored weights need a floating compute dtype, got {dtype}")
    stored = [torch.float8_e4m3fn if f else dtype for f in is_fp8]
    stored_sizes = [_numel(shapes[n]) * _itemsize(s) for n, s in zip(unit.params, stored)]
    raw_offsets, tensors_end = plan_offsets(stored_sizes)
    num_scales = sum(is_fp8)
    scales_offset = tensors_end if num_scales else None
    raw_nbytes = tensors_end + align_up(4 * num_scales)
    # compute region: the fp8-stored tensors only, in the compute dtype
    offs, compute_nbytes = plan_offsets([_numel(shapes[n]) * _itemsize(dtype)
                                         for n, f in zip(unit.params, is_fp8) if f])
    compute_offsets = iter(offs)
    scale_indices = iter(range(num_scales))
    tensors = tuple(
        TensorPlacement(name=n, shape=tuple(int(d) for d in shapes[n]), dtype=dtype, stored_dtype=stored[i],
                        offset=raw_offsets[i], nbytes=stored_sizes[i],
                        compute_offset=next(compute_offsets) if is_fp8[i] else None,
                        scale_index=next(scale_indices) if is_fp8[i] else None)
        for i, n in enumerate(unit.params))
    return UnitLayout(unit.module, tensors, raw_nbytes, compute_nbytes, scales_offset)


def quantize_fp8_e4m3(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor symmetric fp8 quantization.

    Args:
        weight: any floating tensor.

    Returns:
        (q float8_e4m3fn, same shape; scale float32 [1]) with weight ~= q.float() * scale,
        scale = absmax / 448 (1.0 for an all-zero tensor).
    """
    w = weight.detach().to(torch.float32)
    absmax = w.abs().amax() if w.numel() else torch.zeros(())
    scale = torch.where(absmax > 0, absmax / FP8_E4M3_MAX, torch.ones_like(absmax)).reshape(1)
    q = (w / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_e4m3(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q * scale` rounded once to `dtype`: bit-identical to what the streamer computes in a slot."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def host_fill_peak(left: int, reads: Sequence[int], slabs: Sequence[int]) -> int:
    """The most host bytes a storage-cpu load that hands its state dict over (`stream_module(..., consume=True)`:
    the resident part moved to the device, then `HostSource` fills the unit slabs) holds beyond all the slabs.

    `left`: the state dict's bytes outside the units (freed as they are moved); `reads[j]`: unit j's tensors
    as read; `slabs[j]`: its slab. Held at the start: the whole state dict, no slab; once unit j's slab is
    allocated: slabs 0..j and the tensors of units j.. (unit j's freed one by one as they are copied). With
    slabs of the tensors' own size this is about max(left, the largest unit).
    """
    peak, pending, later = left + sum(reads) - sum(slabs), 0, 0
    for read, slab in zip(reversed(reads), reversed(slabs)):  # unit j: reads[j:] still held, slabs[j+1:] not yet
        pending += read
        peak, later = max(peak, pending - later), later + slab
    return peak
