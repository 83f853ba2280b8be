"""Block / phase weight streaming through a few device slots (ARCHITECTURE §4).

Each streamed unit (a block, or a phase of a block) has a fixed device slot, `j % gpu_slots`;
its parameters are re-bound once, at construction, as views into that slot, so module code
runs unchanged. Forward hooks on each unit's module move the bytes:

    pre-hook(j):  issue deferred prefetches whose slot is free; issue j's copy if it was not
                  prefetched; compute waits for it (GPU-side); fp8: upcast into the slot's
                  compute region; prefetch j+1 .. j+depth, wrapping from the last unit of step i
                  to the first units of step i+1 (modulo). A re-entry of j skips all of this.
    post-hook(j): mark compute done for j's slot (the slot's next copy waits for it).

Re-entry: a unit entered again while it is the current one (its pre-hook runs again with no other
unit's pre-hook in between, e.g. the uncond CFG branch right after the cond one through the same
block) computes with the bytes already in its slot: nothing is fetched, waited for, upcast or
prefetched again; the slot is busy again until that entry's post-hook marks compute done. So a
model that runs its CFG branches block by block (a transformer's `forward_branches`, docs/cfg_one_pass.md)
moves every unit once per step, not once per branch.

A prefetch into a slot whose unit has been issued (or entered) but not computed yet is deferred
(only happens across the step wrap when `num_units % gpu_slots != 0`; pick gpu_slots dividing the
unit count for full overlap there). It is issued in that unit's post-hook once the unit has been
entered `entries_per_unit` times in a row (1, or n inside `with streamer.entries(n)`), else at
the next pre-hook of another unit. The declaration is only a hint for that overlap: a unit
entered more often than declared finds its slot overwritten and is fetched again (correct, slower);
one entered less often has its deferred prefetch issued at the next unit's pre-hook.

Request boundary (`reset()`): nothing issued. reset waits for every copy and every marked
compute, forgets the events, and empties the slot table, so the streamer is in exactly the
state of a freshly built one: `state() == {"next_prefetch": 0, "issued": [], "in_flight": 0,
"pending": [], "slots": [None, ...]}`. The first unit of the next request is issued in its own
pre-hook (one unit's copy not overlapped per request; the last step's wrap prefetch is dropped).

Design source: diffusers group offloading (hooks + prefetch on a side stream), LightX2V
block/phase offload (slot rotation, wrap-around prefetch); restated, not copied.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from loguru import logger
from torch import nn
from torch.utils.hooks import RemovableHandle

from runnerkit.offload.layout import StreamUnit, UnitLayout
from runnerkit.offload.pinned import align_up, typed_view
from runnerkit.offload.sources import UnitSource
from runnerkit.offload.streams import CopyEngine, SyncCopyEngine, make_copy_engine
from runnerkit.weights import CheckpointError


# The hooks move bytes and mutate Python state: never traced by torch.compile (a graph break at
# each unit boundary; compile the units' own forwards).
@torch.compiler.disable
def _pre_hook(ref: weakref.ref, unit: int, module: nn.Module, args: Any) -> None:
    streamer = ref()
    if streamer is None:
        raise RuntimeError(f"block streamer of unit {unit} was garbage-collected without close()")
    streamer._before(unit)


@torch.compiler.disable
def _post_hook(ref: weakref.ref, unit: int, module: nn.Module, args: Any, output: Any) -> None:
    streamer = ref()
    if streamer is None:
        raise RuntimeError(f"block streamer of unit {unit} was garbage-collected without close()")
    streamer._after(unit)


def _detach(model_ref: weakref.ref, handles: list[RemovableHandle], names: list[str]) -> None:
    """Remove the hooks and re-bind streamed parameters to meta tensors (frees the slot views)."""
    for h in handles:
        h.remove()
    handles.clear()
    model = model_ref()
    if model is None:
        return
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        p = module._parameters[leaf]
        if p is not None and not p.is_meta:
            module._parameters[leaf] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                    requires_grad=False)
    names.clear()


class BlockStreamer:
    """Streams units of a model's weights from a host source through `gpu_slots` device slots.

    Args:
        model: the network (usually a meta-device skeleton with its resident tensors loaded);
            every unit's parameters are replaced by views into device slots.
        units: the streamed units in execution order (`plan_units`, less the units
            `split_resident` keeps). Empty when every unit stays resident: then no slot, hook
            or copy engine work; `reset`, `close`, `state` and `stats` still answer.
        source: `HostSource` or `DiskSource` built for the same `units`.
        device: device of the slots ("cuda", "cuda:0", or "cpu" for tests).
        gpu_slots: device slots (>= 2); unit j uses slot j % gpu_slots; each slot holds the
            largest unit (phase units differ in size).
        prefetch_depth: units copied ahead of the computing one, in [1, gpu_slots - 1].
        copy_engine: injected engine (tests); default `make_copy_engine(device, slots, source.pinned)`.

    Raises:
        ValueError: `gpu_slots` < 2, `prefetch_depth` outside [1, gpu_slots - 1], or a unit
            parameter that is not a parameter of `model`.
        CheckpointError: a source tensor's shape differs from the model parameter's.

    Memory: min(gpu_slots, units) x (largest raw unit + largest compute region) bytes on the device.
    """

    def __init__(self, model: nn.Module, units: Sequence[StreamUnit], source: UnitSource,
                 device: torch.device | str, gpu_slots: int = 2, prefetch_depth: int = 1,
                 copy_engine: CopyEngine | None = None) -> None:
        start = time.perf_counter()
        if gpu_slots < 2:
            raise ValueError(f"`gpu_slots` must be >= 2 (one slot computes while the next is copied), got {gpu_slots}")
        if not 1 <= prefetch_depth <= gpu_slots - 1:
            raise ValueError(f"`prefetch_depth` must be in [1, gpu_slots - 1] = [1, {gpu_slots - 1}], got "
                             f"{prefetch_depth}: a deeper prefetch would overwrite the slot still computing")
        if len(source.layouts) != len(units):
            raise ValueError(f"`source` has {len(source.layouts)} unit layouts but `units` has {len(units)}")
        self.device = torch.device(device)
        self.units = list(units)
        self.layouts: list[UnitLayout] = source.layouts
        self.num_units = len(units)
        self.num_slots = min(gpu_slots, self.num_units)
        self.prefetch_depth = prefetch_depth
        self.source = source
        if self.num_units and self.num_units % self.num_slots:
            logger.info(f"{self.num_units} units over {self.num_slots} slots: the copy of unit 0 at the step "
                        "wrap waits for the last unit's compute (choose gpu_slots dividing the unit count)")
        self._check_model(model)

        # Slot buffers: [raw region | compute region], sized for the largest unit.
        raw = max((layout.raw_nbytes for layout in self.layouts), default=0)
        self._compute_base = align_up(raw)
        self.slot_nbytes = self._compute_base + max((layout.compute_nbytes for layout in self.layouts), default=0)
        self._slots: list[torch.Tensor] = [torch.empty(self.slot_nbytes, dtype=torch.uint8, device=self.device)
                                           for _ in range(self.num_slots)]
        source.bind(self.num_slots)
        if copy_engine is None:  # no unit: nothing is ever copied (no CUDA stream, no pageable-copy notice)
            copy_engine = make_copy_engine(self.device, self.num_slots, source.pinned) if units else SyncCopyEngine(0)
        self.engine: CopyEngine = copy_engine

        # Re-bind every streamed parameter as a view into its unit's slot.
        self._names: list[str] = []
        for j, layout in enumerate(self.layouts):
            buf = self._slots[j % self.num_slots]
            for t in layout.tensors:
                offset = t.offset if t.compute_offset is None else self._compute_base + t.compute_offset
                module_name, _, leaf = t.name.rpartition(".")
                model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(
                    typed_view(buf, offset, t.dtype, t.shape), requires_grad=False)
                self._names.append(t.name)

        self._handles: list[RemovableHandle] = []
        ref = weakref.ref(self)
        for j, unit in enumerate(self.units):
            module = model.get_submodule(unit.module)
            self._handles.append(module.register_forward_pre_hook(functools.partial(_pre_hook, ref, j)))
            self._handles.append(module.register_forward_hook(functools.partial(_post_hook, ref, j)))
        self._model = weakref.ref(model)
        self._finalizer = weakref.finalize(self, _detach, self._model, self._handles, self._names)
        self.reentries = 0  # pre-hooks that found their unit current (request-independent counter)
        self.entries_per_unit = 1  # consecutive entries of each unit per pass (`entries`)
        self._clear_state()
        logger.info(f"block streamer: {self.num_units} units, {self.num_slots} slots x "
                    f"{self.slot_nbytes / 2**30:.3f} GiB on {self.device}, prefetch depth {prefetch_depth}, "
                    f"{type(self.engine).__name__}, built in {time.perf_counter() - start:.2f}s")

    def _check_model(self, model: nn.Module) -> None:
        seen: set[str] = set()
        for layout in self.layouts:
            for t in layout.tensors:
                if t.name in seen:
                    raise ValueError(f"parameter {t.name!r} is in two units")
                seen.add(t.name)
                module_name, _, leaf = t.name.rpartition(".")
                try:
                    p = model.get_submodule(module_name)._parameters.get(leaf)
                except AttributeError:
                    p = None
                if p is None:
                    raise ValueError(f"`units`: {t.name!r} is not a parameter of {type(model).__name__}")
                if tuple(p.shape) != t.shape:
                    raise CheckpointError(f"streamed tensor {t.name!r}: source shape {list(t.shape)} vs model "
                                          f"{list(p.shape)}")

    # -- state machine --

    def _clear_state(self) -> None:
        self._slot_unit: list[int | None] = [None] * self.num_slots  # unit whose bytes the slot holds
        self._busy = [False] * self.num_slots  # issued and not yet computed
        self._upcast_done = [False] * self.num_slots
        self._pending: dict[int, int] = {}  # slot -> unit to issue once the slot's unit computed (post/pre-hook)
        self._next = 0  # next unit the prefetcher would issue
        self._current: int | None = None  # unit of the last pre-hook (a re-entry candidate)
        self._entered = 0  # consecutive entries of `_current` so far

    def _issue(self, unit: int) -> None:
        slot = unit % self.num_slots
        layout = self.layouts[unit]
        src = self.source.fetch(unit, slot, self.engine)
        self.engine.h2d(slot, self._slots[slot][:layout.raw_nbytes], src, label=layout.module)
        self._slot_unit[slot] = unit
        self._busy[slot] = True
        self._upcast_done[slot] = False

    def _prefetch(self, unit: int) -> None:
        slot = unit % self.num_slots
        if self._slot_unit[slot] == unit:
            return  # already issued (or still there)
        if self._busy[slot]:
            self._pending[slot] = unit  # the slot's current unit has not computed yet
            return
        self._issue(unit)

    def _before(self, unit: int) -> None:
        slot = unit % self.num_slots
        if unit == self._current and self._slot_unit[slot] == unit:
            self._busy[slot] = True  # re-entry: same bytes, computing again until this entry's post-hook
            self._entered += 1
            self.reentries += 1
            return
        self._current, self._entered = unit, 1
        for s, pending in list(self._pending.items()):  # deferred prefetches whose slot has computed
            if not self._busy[s]:
                del self._pending[s]
                if self._slot_unit[s] != pending:
                    self._issue(pending)
        if self._slot_unit[slot] != unit:
            self._issue(unit)  # first unit of a request (or out of order)
        self.engine.wait_copy(slot)
        if not self._upcast_done[slot]:
            self._upcast(unit, slot)
        for d in range(1, self.prefetch_depth + 1):
            self._prefetch((unit + d) % self.num_units)
        self._next = (unit + self.prefetch_depth + 1) % self.num_units

    def _after(self, unit: int) -> None:
        slot = unit % self.num_slots
        self.engine.mark_compute_done(slot)
        self._busy[slot] = False
        pending = self._pending.get(slot)
        if pending is not None and self._entered >= self.entries_per_unit:  # no re-entry announced: issue now
            del self._pending[slot]
            if self._slot_unit[slot] != pending:
                self._issue(pending)

    def _upcast(self, unit: int, slot: int) -> None:
        """fp8 -> compute dtype on the compute stream, for the unit's fp8-stored tensors (the others are
        used in place): view.copy_(q) (exact), view.mul_(scale) with a float32 [1] scale, so the product
        is formed in float32 and rounded once (= `dequantize_fp8_e4m3`, = a resident load)."""
        layout = self.layouts[unit]
        if layout.scales_offset is not None:
            buf = self._slots[slot]
            scales = typed_view(buf, layout.scales_offset, torch.float32, (layout.num_scales,))
            for t in layout.tensors:
                if t.scale_index is None or t.compute_offset is None:
                    continue  # stored in the compute dtype: the module reads the raw region
                dst = typed_view(buf, self._compute_base + t.compute_offset, t.dtype, t.shape)
                dst.copy_(typed_view(buf, t.offset, t.stored_dtype, t.shape))
                dst.mul_(scales[t.scale_index:t.scale_index + 1])  # [1] float32: the product is formed in fp32
        self._upcast_done[slot] = True

    @contextmanager
    def entries(self, n: int) -> Iterator[None]:
        """Inside the block, each unit is entered `n` times in a row per pass (a forward that runs
        its `n` CFG branches block by block); restored on exit, also on an error.

        A hint for the wrap prefetch only (see the module docstring); re-entries are detected
        whatever it says.

        Raises:
            ValueError: `n` < 1.
        """
        if n < 1:
            raise ValueError(f"`n` (entries per unit) must be >= 1, got {n}")
        previous, self.entries_per_unit = self.entries_per_unit, n
        try:
            yield
        finally:
            self.entries_per_unit = previous

    # -- lifecycle --

    def reset(self) -> None:
        """Bring the streamer to the request boundary: no copy in flight, nothing issued, events cleared.

        Waits (host) for the copy stream and for each slot's last marked compute; call it
        between requests and after warmup, never inside a forward.
        """
        start = time.perf_counter()
        self.source.reset()  # background reads may wait on copy events: drain them first
        self.engine.reset()
        self._clear_state()
        logger.debug(f"block streamer reset to the request boundary in {time.perf_counter() - start:.4f}s")

    def state(self) -> dict[str, Any]:
        """{"next_prefetch": int, "issued": [units issued, not yet computed], "in_flight": int,
        "pending": [deferred units], "slots": [unit held by each slot or None]}."""
        return {"next_prefetch": self._next,
                "issued": sorted(u for s, u in enumerate(self._slot_unit) if u is not None and self._busy[s]),
                "in_flight": self.engine.in_flight(),
                "pending": sorted(self._pending.values()),
                "slots": list(self._slot_unit)}

    def stats(self) -> dict[str, float]:
        """H2D copies/bytes/seconds/GB/s (engine), source counters, slot sizes in bytes, and
        `reentries` (unit entries served from the bytes already in their slot, since construction)."""
        out = {f"h2d_{k}": v for k, v in self.engine.stats().items()}
        out.update(self.source.stats())
        out.update({"units": float(self.num_units), "slots": float(self.num_slots),
                    "slot_bytes": float(self.slot_nbytes), "reentries": float(self.reentries)})
        return out

    def streams(self, module: nn.Module) -> bool:
        """True when `module` is the model this streamer streams (and `close()` was not called)."""
        return self._finalizer.alive and self._model() is module

    def close(self) -> None:
        """Wait for copies, remove hooks, re-bind streamed params to meta, free slots and host memory.

        After `close()` the streamer holds no slot, slab or model reference; calling it twice
        is a no-op.
        """
        if not self._finalizer.alive:
            return
        self.engine.reset()
        self._finalizer()  # _detach: hooks removed, params back on meta
        self._slots = []
        self.source.close()
        self._clear_state()
        logger.info("block streamer closed: hooks removed, slots and host memory released")
