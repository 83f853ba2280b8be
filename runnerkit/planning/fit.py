"""Will a request fit on its device? Peak-memory estimates and the refusal.

A request that cannot finish is refused before work starts, with the estimate and the limit in
the message, instead of running for minutes and dying of an out-of-memory error (or swapping).
The split of work:

- the family estimates, from its architecture and the request shape, what each stage allocates
  on top of the weights (`DefaultRunner.estimate_memory` -> `MemoryEstimate`: activations,
  caches, kernel workspaces), and the bytes of each module's weights (`module_footprint`);
- this module knows the placement rules of `DefaultRunner.place_modules` (which weights are on
  the device during which stage, for every offload mode) and turns the estimate into a peak:

      peak = max over stages s of (weights on the device during s + activations of s)
      estimate = ceil(peak * (1 + MARGIN)) + OVERHEAD_BYTES[device type]

- `runnerkit.memory.memory_limit` says how many bytes the device offers (or config
  `memory.limit_gib`), and `refusal_message` words the refusal: the request, its shape, the
  estimate with its peak stage, the limit with its source, and what to change.

Placement per offload mode (the same rules as `DefaultRunner.place_modules` and `Placement`;
`test_cases/planning/test_fit.py` checks them against a placed runner):

| mode | weights on a CUDA device during stage s | on the CPU (device = host memory) |
| --- | --- | --- |
| none | every module | every module |
| model | s's module only | every module |
| block / phase | streamed modules: resident part + slots; others: s's module | + streamer host slabs |
| lazy_load | as block, streamed modules only during their stage | the same |
| unload_modules | s's module only | s's module only |
| `offload.resident_modules` (model/block/phase) | those modules always, the rest by the mode | every module |
| `offload.keep_across_stages` | + during s, the modules s `holds` (a transition's transformer) | every module |

(Streamer host slabs: one per unit with storage cpu, one staging slab per slot with storage disk.)

A family whose estimate cannot be computed before loading (`EstimateUnavailable`: the checkpoint's
architecture is not readable yet) is checked once loaded, before each request (one INFO line says
why it waits). A family that gives no estimate is served unchecked (one INFO line at the first check says so):
refusing every request of a family that has not written its formulas would make the check a
barrier to adding families, and the check exists to stop requests that are known not to fit.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.offload import resident_read as resident_batches
from runnerkit.offload.layout import StreamSpec, host_fill_peak, plan_unit_layout, plan_units, split_resident
from runnerkit.offload.pinned import align_up, pinning_disabled_by_env

__all__ = ["MARGIN", "OVERHEAD_BYTES", "PROCESS_HOST_BYTES", "EstimateUnavailable", "Hint", "HostEstimate",
           "MemoryEstimate", "MemoryFitError", "ModuleFootprint", "PeakEstimate", "StageFootprint", "device_weights",
           "host_bytes_of", "host_module_bytes", "lora_slot_bytes", "module_footprint", "overhead_bytes", "peak_of",
           "placement_of", "refusal_message", "streams", "weights_between_stages"]

GIB = 1024**3
MIB = 1024**2

MARGIN = 0.10
"""Fraction added to the formula's peak: allocator rounding (CUDA caching-allocator blocks) and
small tensors the formulas leave out."""
OVERHEAD_BYTES: dict[str, int] = {"cuda": 256 * MIB, "cpu": 512 * MIB}
"""Fixed bytes added to every estimate, by device type. CUDA: cuBLAS/cuDNN workspaces. CPU: the
process's resident memory grows beyond its live tensors: glibc keeps freed blocks below its
dynamic mmap threshold (up to 32 MiB) in its heaps, and oneDNN caches primitives and scratchpads;
measured up to 0.32 GiB above the tensor peak for one request of the tiny test config at
256x256x9 (the whole-request test of the first family's estimate, under test_cases/models/)."""

PROCESS_HOST_BYTES = 2 * GIB
"""Host memory of a CUDA run's process besides the weights it holds: the interpreter, torch's and
the CUDA libraries' code and data, the CUDA context's host side, tokenizers, request tensors on their
way to the media writer. Measured: 0.79 GiB RSS (torch 2.11+cu130 on an H200 host, after a cuBLAS
matmul and an SDPA kernel, transformers imported); 2 GiB leaves room for torch.compile's compiler,
tokenizers and a request's decoded video on the host (81 frames of 720p in float32: 0.8 GiB)."""


def overhead_bytes(device: torch.device) -> int:
    """The fixed part of an estimate on `device` (`OVERHEAD_BYTES`; other devices as CUDA)."""
    return OVERHEAD_BYTES.get(device.type, OVERHEAD_BYTES["cuda"])


class EstimateUnavailable(Exception):
    """A family that has an estimate cannot give it yet: e.g. the checkpoint's architecture is not
    readable before loading (a missing `model_path`: the load then says why). Raised by
    `estimate_memory`; the check then waits for the load, and each request is checked before it runs.
    The message says why."""


class MemoryFitError(ValueError):
    """A request (or warmup shape) whose estimated peak memory exceeds the device's limit.

    An input error (the launch script exits 2): the message names the request, its shape, the
    estimate, the limit, and what to change.
    """


@dataclass(frozen=True)
class ModuleFootprint:
    """Bytes of one pipeline module's weights (parameters and buffers, in their loaded dtypes).

    Attributes:
        weight_bytes: all of the module's weights.
        stream_resident_bytes: block/phase offload of a streamable module: the weights that stay
            on the device (everything outside the streamed units: the units `offload.resident_blocks`
            keeps included). None: the module does not stream (or the offload mode does not stream).
        stream_slot_bytes: all device slots together (`min(gpu_slots, streamed units)` x the largest
            streamed unit).
        stream_host_bytes: host memory of the streamer: the slabs of every unit (storage cpu) or
            one staging slab per slot (storage disk). Counted only when the device is the CPU.
        stream_default: the module streams in mode block/phase when `offload.stream_modules` is
            null (the family's transformers); False: only when listed (e.g. a text encoder).
        stream_moved_bytes: the streamed units' bytes as copied per pass (their raw regions: fp8
            storage and fp8-stored checkpoint tensors at 1 byte + scale); 0 when not streaming.
        device_extra_bytes: bytes the module keeps on the compute device beside its weights, whether
            or not the weights are offloaded or streamed, for as long as the module exists (unfused
            LoRA slots, runnerkit/lora: `lora_slot_bytes`).
        stream_resident_stored_bytes: the resident part as read (fp8-stored weights at 1 byte); None: as loaded.
        stream_load_bytes: the peak host bytes of its load beside the slabs. Storage cpu: `host_fill_peak`;
            storage disk: the largest batch of the resident part as read (`resident_read.batch_bound`: at most
            `RESIDENT_BATCH_BYTES`, or the largest resident tensor with its fp8 scale). None: not computed
            (a footprint built by hand): the whole resident part as read counts (`resident_read_bytes`).
    """

    weight_bytes: int
    stream_resident_bytes: int | None = None
    stream_slot_bytes: int = 0
    stream_host_bytes: int = 0
    stream_default: bool = True
    stream_moved_bytes: int = 0
    device_extra_bytes: int = 0
    stream_resident_stored_bytes: int | None = None
    stream_load_bytes: int | None = None

    @property
    def resident_read_bytes(self) -> int:
        """Bytes of the streamed module's resident part as read from its source (stored dtype)."""
        assert self.stream_resident_bytes is not None, "only a streamed module has a resident part"
        stored = self.stream_resident_stored_bytes
        return self.stream_resident_bytes if stored is None else stored

    @property
    def streams(self) -> bool:
        return self.stream_resident_bytes is not None


@dataclass(frozen=True)
class StageFootprint:
    """What one stage of a request allocates on the device on top of the weights.

    Attributes:
        name: the stage (a profiling stage name, e.g. "text_encoder", "transformer", "vae_decoder", "save").
        module: the module whose weights the stage needs on the device (None: none).
        activation_bytes: the stage's peak of activations, caches, kernel workspaces and the
            request tensors alive during it (latents, embeddings, decoded outputs), in bytes.
        detail: one line on where the bytes come from (shown in logs and refusals).
        holds: modules that stay on the device through this stage under `offload.keep_across_stages` (a
            transition between two denoising stages of the same transformer, e.g. a latent upsampler).
    """

    name: str
    module: str | None
    activation_bytes: int
    detail: str = ""
    holds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hint:
    """A family's advice for a shape that does not fit, e.g. tiled VAE decoding.

    Attributes:
        text: the advice as the refusal words it, e.g. "offload.vae_tiling=true (...)".
        offload: the offload keys it sets, e.g. {"vae_tiling": True}. The memory planner names the advice
            only where its own estimate, with these keys on an evaluated candidate, fits (planning/report.py);
            advice without keys is left out of the plan's refusal (the per-request refusal shows the text).
        stages: the only stages whose memory the advice lowers (e.g. streaming the text encoder: its own
            stage); the per-request refusal shows it only where the peak is in one of them. Empty: any stage.
    """

    text: str
    offload: dict[str, Any] = field(default_factory=dict)
    stages: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryEstimate:
    """A family's estimate for one request shape: module weights and per-stage activations.

    Attributes:
        modules: module name -> its weights (every module of the pipeline).
        stages: the request's stages in order.
        hints: family advice shown when the request is refused (e.g. tiled VAE decoding: `Hint`).
    """

    modules: dict[str, ModuleFootprint]
    stages: tuple[StageFootprint, ...]
    hints: tuple[Hint, ...] = field(default=())


@dataclass(frozen=True)
class PeakEstimate:
    """The estimated peak of one request on its device (bytes).

    Attributes:
        bytes: the estimate compared with the limit: ceil(formula_bytes * (1 + MARGIN)) + overhead_bytes(device).
        formula_bytes: weight_bytes + activation_bytes at the peak stage.
        stage: the stage at the peak.
        weight_bytes: weights on the device during that stage.
        activation_bytes: that stage's activations.
        detail: the stage's own explanation.
        lora_slot_bytes: of `weight_bytes`, the unfused LoRA slots (`ModuleFootprint.device_extra_bytes`).
    """

    bytes: int
    formula_bytes: int
    stage: str
    weight_bytes: int
    activation_bytes: int
    detail: str = ""
    overhead_bytes: int = 0
    lora_slot_bytes: int = 0

    def describe(self, digits: int = 2) -> str:
        """`digits`: decimals of the total (more where it must be told apart from a limit)."""
        slots = f" (of which {self.lora_slot_bytes / GIB:.2f} GiB LoRA slots)" if self.lora_slot_bytes else ""
        return (f"{self.bytes / GIB:.{digits}f} GiB (peak in stage {self.stage}: {self.weight_bytes / GIB:.2f} GiB "
                f"weights{slots} + "
                f"{self.activation_bytes / GIB:.2f} GiB activations{'; ' + self.detail if self.detail else ''}; "
                f"+{MARGIN:.0%} margin + {self.overhead_bytes / GIB:.2f} GiB fixed overhead)")


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of `t` (any device, meta included) if stored in `dtype` (None: its own)."""
    size = torch.empty((), dtype=dtype or t.dtype, device="meta").element_size()
    return t.numel() * size


def module_footprint(module: nn.Module, dtype: torch.dtype, keep_fp32: Callable[[str], bool] = lambda name: False,
                     stream: StreamSpec | None = None, offload: OffloadConfig | None = None,
                     stream_default: bool = True, fp8_stored: Collection[str] = (),
                     lora_rank: int = 0) -> ModuleFootprint:
    """Weight bytes of a module (normally built on the meta device) as the runner loads it.

    Floating parameters are counted in `dtype`, except names for which `keep_fp32` is true
    (float32); buffers in their own dtype. With `stream` and an offload mode of block/phase, the
    streamed units are planned exactly as `offload.setup.stream_module` plans them
    (`plan_units`, `split_resident` for `offload.resident_blocks`, `plan_unit_layout`, one slot = the
    largest streamed unit's raw bytes aligned + its compute region), giving the resident part (kept
    units included, in `dtype`) and the slot bytes (`min(gpu_slots, streamed units)` slots; none when
    every unit is kept). With storage disk, streamed tensors that the checkpoint stores as
    float8_e4m3fn (`fp8_stored`) stream as stored: 1 byte per element + a float32 scale in the raw
    region (slot and staging slab), and a compute region.

    Args:
        module: the network, on the meta device (no memory) or materialized.
        dtype: the load dtype of its floating weights.
        keep_fp32: parameter name -> stays float32.
        stream: the family's stream spec, for a module that can stream.
        offload: the run's offload config (mode, slots, weight_dtype, storage).
        stream_default: see `ModuleFootprint.stream_default` (False for a text encoder).
        fp8_stored: parameter names the checkpoint stores as float8_e4m3fn (their loaded bytes are
            still counted in `dtype`: a resident load upcasts them; read at 1 byte in both storages).
        lora_rank: unfused LoRA slot rank R (config `lora.max_rank` in mode unfused; 0: none): the slots
            of every linear layer become `device_extra_bytes` (`lora_slot_bytes`).
    """
    first = next(module.parameters(), None)
    if first is None or not first.is_meta:  # a materialized module may still change: computed every time
        return _module_footprint(module, dtype, keep_fp32, stream, offload, stream_default, fp8_stored, lora_rank)
    streaming = stream is not None and offload is not None and offload.mode in ("block", "phase")
    # The offload keys `_module_footprint` reads (keep in step with it): the plan asks for one module under
    # hundreds of offload configs (planning/planner.py's rungs, variants and resident-unit counts) that differ
    # mostly in keys it does not read; families build their modules on meta once, so this memo hits.
    read = ((offload.mode, offload.resident_blocks, offload.storage, offload.weight_dtype, offload.gpu_slots,
             resident_batches.RESIDENT_BATCH_BYTES) if streaming and offload is not None else None)
    key = (dtype, keep_fp32, stream if streaming else None, read, stream_default, frozenset(fp8_stored), lora_rank)
    memo = _FOOTPRINTS.setdefault(module, {})
    if key not in memo:
        memo[key] = _module_footprint(module, dtype, keep_fp32, stream, offload, stream_default, fp8_stored, lora_rank)
    return memo[key]


#: meta-built module -> `module_footprint`'s key -> the footprint (weak: a module's entries go with it).
_FOOTPRINTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], ModuleFootprint]] = weakref.WeakKeyDictionary()
#: meta-built module -> its parameter sizes, units and unit layouts (`_module_footprint`).
_PARTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


def _is_meta(module: nn.Module) -> bool:
    first = next(module.parameters(), None)
    return first is not None and first.is_meta


def _module_footprint(module: nn.Module, dtype: torch.dtype, keep_fp32: Callable[[str], bool],
                      stream: StreamSpec | None, offload: OffloadConfig | None, stream_default: bool,
                      fp8_stored: Collection[str], lora_rank: int) -> ModuleFootprint:
    """`module_footprint`, computed. On a meta-built module the parts that depend on the module alone (its
    parameter sizes, its units, each unit's layout) are computed once (`_PARTS`): the plan asks for every
    `offload.resident_blocks` count of the same units."""
    parts = _PARTS.setdefault(module, {}) if _is_meta(module) else {}

    def part(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in parts:
            parts[key] = make()
        return parts[key]

    def measure_parameters() -> tuple[dict[str, int], dict[str, tuple[int, ...]], int]:
        sizes: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, p in module.named_parameters():
            load = p.dtype if not p.dtype.is_floating_point else (torch.float32 if keep_fp32(name) else dtype)
            sizes[name] = tensor_bytes(p, load)
            shapes[name] = tuple(p.shape)
        return sizes, shapes, sum(tensor_bytes(b) for _, b in module.named_buffers())

    sizes, shapes, buffers = part(("sizes", dtype, keep_fp32), measure_parameters)
    total = sum(sizes.values()) + buffers
    extra = lora_slot_bytes(module, lora_rank, dtype, keep_fp32) if lora_rank else 0
    if stream is None or offload is None or offload.mode not in ("block", "phase"):
        return ModuleFootprint(weight_bytes=total, stream_default=stream_default, device_extra_bytes=extra)
    mode = offload.mode
    every = part(("units", mode, stream), lambda: plan_units(module, mode, stream))
    _, units = split_resident(every, stream.resident_units(offload.resident_blocks))  # kept: resident
    as_stored = fp8_stored if offload.storage == "disk" else ()  # storage cpu fills its slabs with upcast weights
    index = {id(u): k for k, u in enumerate(every)}
    layout_key = ("layout", mode, stream, dtype, keep_fp32, offload.weight_dtype, frozenset(as_stored))
    layouts = [part((*layout_key, index[id(u)]),
                    lambda u=u: plan_unit_layout(u, shapes, dtype, offload.weight_dtype, fp8_stored=as_stored))
               for u in units]
    raws = [lay.raw_nbytes for lay in layouts]
    slot = align_up(max(raws, default=0)) + max((lay.compute_nbytes for lay in layouts), default=0)
    slots = min(offload.gpu_slots, len(units))
    streamed = sum(sizes[p] for u in units for p in u.params)
    host = sum(raws) if offload.storage == "cpu" else slots * max(raws, default=0)
    saved = {n: sizes[n] - math.prod(shapes[n]) for n in fp8_stored if n in sizes}  # fp8 is read at 1 byte
    reads = [sum(sizes[p] - saved.get(p, 0) for p in u.params) for u in units]
    resident_read = total - sum(saved.values()) - sum(reads)  # resident fp8 weights are upcast on the device
    if offload.storage == "cpu":
        load = host_fill_peak(resident_read, reads, raws)
    else:  # read in batches, each on the device before the next is read: every resident tensor as stored, an
        # fp8 one with its float32 scale (4 bytes, counted whether or not the checkpoint has one), every buffer
        streamed_names = {p for u in units for p in u.params}
        items = [sizes[n] - saved.get(n, 0) + (4 if n in saved else 0) for n in sizes if n not in streamed_names]
        buffers_read = part(("buffers",), lambda: [tensor_bytes(b) for _, b in module.named_buffers()])
        load = resident_batches.batch_bound(items + buffers_read, resident_batches.RESIDENT_BATCH_BYTES)
    return ModuleFootprint(weight_bytes=total, stream_resident_bytes=total - streamed, stream_slot_bytes=slots * slot,
                           stream_host_bytes=host, stream_default=stream_default, device_extra_bytes=extra,
                           stream_moved_bytes=sum(raws), stream_load_bytes=load,
                           stream_resident_stored_bytes=resident_read if resident_read != total - streamed else None)


def lora_slot_bytes(module: nn.Module, rank: int, dtype: torch.dtype,
                    keep_fp32: Callable[[str], bool] = lambda name: False) -> int:
    """Device bytes of the unfused LoRA slots `runnerkit.lora.attach_slots` gives `module` at rank `rank`:
    per linear layer down [R, in], up [out, R] and bias [out], in the layer's loaded dtype (float32 where
    `keep_fp32` keeps its weight, else `dtype`). Works on a meta-built module."""
    from runnerkit.lora.apply import linear_targets

    total = 0
    for name, lin in linear_targets(module).items():
        size = 4 if keep_fp32(f"{name}.weight") else torch.empty((), dtype=dtype, device="meta").element_size()
        total += (rank * (lin.in_features + lin.out_features) + lin.out_features) * size
    return total


def streams(name: str, footprint: ModuleFootprint, offload: OffloadConfig) -> bool:
    """Does module `name` stream under `offload` (mode block/phase, listed in `stream_modules` or,
    when that is null, a module that streams by default)?"""
    if offload.mode not in ("block", "phase") or not footprint.streams:
        return False
    return name in offload.stream_modules if offload.stream_modules is not None else footprint.stream_default


def _held(name: str, footprint: ModuleFootprint, stage_module: str | None, config: RunnerConfig,
          device: torch.device, holds: Collection[str] = ()) -> int:
    """Weight bytes of module `name` on `device` while the stage of `stage_module` runs (None: between stages);
    `holds`: the stage's `StageFootprint.holds` (on the device as in their own stage under keep_across_stages)."""
    off = config.offload  # mode auto not yet planned: judged as its first candidate, resident
    in_stage = name == stage_module or (off.keep_across_stages and name in holds)
    on_cpu = device.type == "cpu"
    extra = footprint.device_extra_bytes  # on the device while the module exists (LoRA slots)
    if config.unload_modules:
        return footprint.weight_bytes + extra if in_stage else 0
    if streams(name, footprint, off):
        assert footprint.stream_resident_bytes is not None
        part = footprint.stream_resident_bytes + footprint.stream_slot_bytes + extra
        part += footprint.stream_host_bytes if on_cpu else 0
        return part if (in_stage or not off.lazy_load) else 0
    if off.mode in ("none", "auto") or on_cpu or name in (off.resident_modules or ()):
        return footprint.weight_bytes + extra  # resident; on the CPU offloaded modules live in the same memory
    if in_stage:  # model offload: the weights visit the device for their stage
        return footprint.weight_bytes + extra
    return 0 if off.lazy_load else extra  # the slots stay while the module exists (lazy: built for its stage)


def device_weights(estimate: MemoryEstimate, stage_module: str | None, config: RunnerConfig,
                   device: torch.device, holds: Collection[str] = ()) -> dict[str, int]:
    """Module name -> weight bytes on `device` while the stage of `stage_module` runs (None: between
    stages; `holds`: the stage's `StageFootprint.holds`), by the placement rules of the module docstring;
    modules with nothing there are left out."""
    held = {n: _held(n, m, stage_module, config, device, holds) for n, m in estimate.modules.items()}
    return {n: b for n, b in held.items() if b > 0}


def weights_between_stages(estimate: MemoryEstimate, config: RunnerConfig, device: torch.device) -> int:
    """Weight bytes that stay on `device` between requests once the modules are loaded."""
    return sum(device_weights(estimate, None, config, device).values())


def peak_of(estimate: MemoryEstimate, config: RunnerConfig, device: torch.device) -> PeakEstimate:
    """The request's peak on `device`: the largest (weights on the device + activations) over its stages.

    Raises:
        ValueError: a stage names a module the estimate has no footprint for.
    """
    unknown = sorted({s.module for s in estimate.stages if s.module is not None} - set(estimate.modules))
    if unknown:
        raise ValueError(f"memory estimate: stages use modules {unknown} without a footprint; "
                         f"footprints: {sorted(estimate.modules)}")
    best: PeakEstimate | None = None
    for stage in estimate.stages:
        held = device_weights(estimate, stage.module, config, device, stage.holds)
        weights = sum(held.values())
        formula = weights + stage.activation_bytes
        if best is None or formula > best.formula_bytes:
            overhead = overhead_bytes(device)
            best = PeakEstimate(bytes=math.ceil(formula * (1 + MARGIN)) + overhead, formula_bytes=formula,
                                stage=stage.name, weight_bytes=weights, activation_bytes=stage.activation_bytes,
                                detail=stage.detail, overhead_bytes=overhead,
                                lora_slot_bytes=sum(estimate.modules[n].device_extra_bytes for n in held))
    assert best is not None, "a memory estimate needs at least one stage"
    return best


@dataclass(frozen=True)
class HostEstimate:
    """Host memory (RAM) of a run in bytes, by the terms of `host_bytes_of`.

    Attributes:
        bytes: the total compared with the host limit.
        modules: module name -> bytes it keeps in host memory (offloaded weights, streamer slabs);
            modules keeping none are left out.
        transient_bytes: the largest module loaded onto the device through host memory (`transient_module`).
        process_bytes: `PROCESS_HOST_BYTES` (0 on the CPU device, where the device estimate's overhead holds it).
        note: how the total was formed, for logs.
        pinned_bytes: of `bytes`, page-locked: every module's held bytes with `offload.pin_memory` (the
            model offloader's slabs, the streamer's host or staging slabs); the rest is pageable.
    """

    bytes: int
    modules: dict[str, int]
    transient_bytes: int = 0
    transient_module: str | None = None
    process_bytes: int = 0
    note: str = ""
    pinned_bytes: int = 0

    def describe(self) -> str:
        if self.note:
            return f"{self.bytes / GIB:.2f} GiB ({self.note})"
        held = ("held: " + ", ".join(f"{n} {b / GIB:.2f}" for n, b in self.modules.items())
                + f" GiB, {self.pinned_bytes / GIB:.2f} GiB of it pinned") if self.modules else "no weights held"
        load = (f"; + {self.transient_bytes / GIB:.2f} GiB loading {self.transient_module} through host memory"
                if self.transient_bytes else "")
        return f"{self.bytes / GIB:.2f} GiB ({held}{load}; + {self.process_bytes / GIB:.2f} GiB process)"


def host_module_bytes(name: str, footprint: ModuleFootprint, config: RunnerConfig) -> int:
    """Bytes module `name` keeps in host memory between its stages on a CUDA device: a streamed module
    its streamer's slabs (`stream_host_bytes`: every unit with storage cpu, one staging slab per slot
    with disk); a model-offloaded module (mode model, or not streamed in block/phase) all its weights;
    a resident module, and every module under `unload_modules`, none."""
    off = config.offload
    if config.unload_modules or off.mode == "none" or name in (off.resident_modules or ()):
        return 0
    if streams(name, footprint, off):
        return footprint.stream_host_bytes
    return footprint.weight_bytes


def placement_of(name: str, footprint: ModuleFootprint, config: RunnerConfig) -> str:
    """Where module `name` lives under `config` on a CUDA device, in words (the plan's report and `runnerkit plan`):
    'resident', 'visits the device for its stage', 'streamed from pinned host memory' (or 'host memory', 'disk';
    ', built per request' under lazy_load; ', N units resident' with `offload.resident_blocks`), or 'built for its
    stage' (`unload_modules`)."""
    off = config.offload
    if config.unload_modules:
        return "built for its stage"
    if off.mode in ("none", "auto") or name in (off.resident_modules or ()):
        return "resident"
    if streams(name, footprint, off):
        source = "disk" if off.storage == "disk" else "pinned host memory" if off.pin_memory else "host memory"
        words = f"streamed from {source}"
        words += f", {off.resident_blocks} units resident" if off.resident_blocks and footprint.stream_default else ""
        return words + (", built per request" if off.lazy_load else "")
    return "visits the device for its stage"


def host_bytes_of(estimate: MemoryEstimate, config: RunnerConfig, device: torch.device) -> HostEstimate:
    """The host memory a run of `estimate` needs under `config` on `device` (bytes):

        host = sum over modules of host_module_bytes      (offloaded weights, streamer slabs)
             + the largest module loaded onto the device through host memory
                 (resident modules and unload_modules: its weights, read whole from .pth, page by page from
                 safetensors; a streamed module, `stream_load_bytes`: storage disk, the largest batch of its
                 resident part as stored (`resident_read.batch_bound`); storage cpu, the peak of (its state dict
                 left + its slabs so far) - its slabs)
             + PROCESS_HOST_BYTES

    On the CPU the device is the host: the total is the device estimate (`peak_of(...).bytes`).
    No margin is added: slabs are exact sizes (ARCHITECTURE §4) and the constant is rounded up.
    """
    if device.type == "cpu":
        return HostEstimate(bytes=peak_of(estimate, config, device).bytes, modules={},
                            note="the device is the host: its peak estimate")
    held = {n: host_module_bytes(n, m, config) for n, m in estimate.modules.items()}
    off = config.offload
    loaded: dict[str, int] = {}
    for name, m in estimate.modules.items():
        if streams(name, m, off):  # as stored: fp8 weights are upcast on the device
            loaded[name] = m.resident_read_bytes if m.stream_load_bytes is None else m.stream_load_bytes
        elif config.unload_modules or off.mode == "none" or name in (off.resident_modules or ()):
            loaded[name] = m.weight_bytes
    transient_module = max(loaded, key=lambda n: loaded[n]) if loaded else None
    transient = loaded[transient_module] if transient_module is not None else 0
    total = sum(held.values()) + transient + PROCESS_HOST_BYTES
    pinned = sum(held.values()) if off.pin_memory and not pinning_disabled_by_env() else 0
    return HostEstimate(bytes=total, modules={n: b for n, b in held.items() if b > 0}, transient_bytes=transient,
                        transient_module=transient_module, process_bytes=PROCESS_HOST_BYTES, pinned_bytes=pinned)


def refusal_message(what: str, shape: tuple[int, int, int], peak: PeakEstimate, limit_bytes: int, limit_source: str,
                    device: torch.device, config: RunnerConfig, hints: tuple[Hint, ...] = ()) -> str:
    """The one-line reason a request is refused, with what to change.

    Args:
        what: the request, e.g. "request 3 (line 4 of 'r.jsonl')" or "warmup shape [480, 832, 81]".
        shape: (height, width, frames).
    """
    h, w, f = shape
    advice = ["a smaller target_height/target_width/target_video_length"]
    if config.offload.mode == "none" and not config.unload_modules and device.type != "cpu" \
            and peak.weight_bytes > peak.activation_bytes:
        advice.append("offload.mode 'model' or 'block' (weights leave the device between their stages)")
    off = config.offload
    if off.mode in ("block", "phase") and device.type != "cpu" and peak.weight_bytes > peak.activation_bytes:
        if off.resident_blocks:  # weights bound the peak: the kept units are what an explicit plan can shed
            advice.append(f"fewer offload.resident_blocks (now {off.resident_blocks}: "
                          "each kept unit stays on the device)")
        advice.append("offload.mode 'auto' (the fastest plan that fits this device, if one does)")
    if peak.lora_slot_bytes:
        advice.append(f"a smaller lora.max_rank (the unfused LoRA slots take {peak.lora_slot_bytes / GIB:.2f} GiB at "
                      f"rank {config.lora.max_rank if config.lora else '?'}) or lora.mode 'fused' (no slots)")
    advice += [h.text for h in hints if not h.stages or peak.stage in h.stages]
    digits = 2  # enough decimals that the estimate visibly exceeds the limit
    while digits < 6 and round(peak.bytes / GIB, digits) <= round(limit_bytes / GIB, digits):
        digits += 1
    head = (f"{what}: shape {h}x{w}x{f} (height x width x frames) needs an estimated {peak.describe(digits)} on "
            f"{device}, more than the limit of {limit_bytes / GIB:.{digits}f} GiB ({limit_source}).")
    if peak.overhead_bytes >= limit_bytes:  # no shape or setting of this run lowers the process's fixed part
        return (f"{head} No shape or setting fits: the fixed overhead alone is {peak.overhead_bytes / GIB:.2f} GiB. "
                f"Try a device with more memory, or a larger config memory.limit_gib if the device has it "
                f"(memory.check_fit=false turns the check off)")
    return (f"{head} Try {'; or '.join(advice)}. To override: config memory.limit_gib (GiB) or "
            f"memory.check_fit=false")
