"""Host-side sources of streamed units: pinned host memory (`HostSource`) or the checkpoint files (`DiskSource`).

A source hands the streamer, for unit j going to slot s, a uint8 CPU tensor [raw_nbytes]
laid out as `layouts[j]` says; the streamer copies it H2D in one copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from loguru import logger

from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.layout import (
    StreamUnit,
    UnitLayout,
    WeightDtype,
    dequantize_fp8_e4m3,
    plan_unit_layout,
    quantize_fp8_e4m3,
)
from runnerkit.offload.pinned import HostSlab, typed_view
from runnerkit.offload.streams import CopyEngine
from runnerkit.weights import CheckpointError, short_list

FP8 = torch.float8_e4m3fn
"""The checkpoint dtype a disk source streams as stored, whatever the compute dtype."""


def _check_scales(scales: Mapping[str, str], fp8_names: frozenset[str], weights: Mapping[str, str],
                  reader: SafetensorsDiskReader) -> None:
    """Every scale (model name -> checkpoint key) exists, is one float32 element and scales an fp8 weight.

    Raises:
        CheckpointError: naming the scale key(s) and the file(s).
    """
    missing = sorted(k for k in scales.values() if k not in reader.index)
    if missing:
        raise CheckpointError(f"disk source: {len(missing)} fp8 scales are not in the checkpoint: {short_list(missing)}")
    bad = [f"{k} ({reader.index[k].dtype}, shape {list(reader.index[k].shape)}) in {reader.index[k].path}"
           for k in scales.values() if reader.index[k].dtype != torch.float32 or reader.index[k].nbytes != 4]
    if bad:
        raise CheckpointError(f"disk source: {len(bad)} fp8 scales are not one float32 element (only per-tensor "
                              f"scales are supported): {short_list(bad)}")
    not_fp8 = [f"{weights[n]} ({reader.index[weights[n]].dtype}) in {reader.index[weights[n]].path}"
               for n in scales if n not in fp8_names]
    if not_fp8:
        raise CheckpointError(f"disk source: {len(not_fp8)} scaled tensors are not float8_e4m3fn, so a scale "
                              f"does not apply: {short_list(not_fp8)}")


class UnitSource(Protocol):
    """What the block streamer reads units from."""

    layouts: list[UnitLayout]

    @property
    def pinned(self) -> bool:
        """True when every buffer `fetch` returns is page-locked (valid after `bind`)."""

    def bind(self, num_slots: int) -> None:
        """Called once by the streamer with its number of device slots."""

    def fetch(self, unit: int, slot: int, engine: CopyEngine) -> torch.Tensor:
        """Host bytes of `unit` (uint8 [layouts[unit].raw_nbytes]) for a copy into `slot`."""

    def reset(self) -> None:
        """Drop any read-ahead: back to the request boundary."""

    def close(self) -> None:
        """Free host memory and file handles."""

    def stats(self) -> dict[str, float]:
        """Source-side counters (host bytes, disk reads)."""


def check_handover(component: str, consume: bool, tensors: Mapping[str, torch.Tensor] | None,
                   scales: Mapping[str, torch.Tensor] | None) -> None:
    """`consume=True` (`HostSource`, `stream_module`) hands `tensors` and `scales` over: their tensors leave
    them as they are copied, so both must be mutable mappings (`scales` may be None).

    Raises:
        TypeError: naming `component` and the types given.
    """
    if consume and not all(isinstance(m, MutableMapping) for m in (tensors, scales if scales is not None else {})):
        raise TypeError(f"{component}: consume=True removes the tensors it copies from `tensors` and `scales`, so "
                        f"both must be mutable mappings; got {type(tensors).__name__} and {type(scales).__name__}")


class HostSource:
    """Streamed weights kept in host memory: one exact-size `HostSlab` per unit, filled once.

    Args:
        units: the streamed units (see `plan_units`).
        tensors: full parameter name -> CPU tensor (model names); only the units' names are read,
            cast to `dtype` (or quantized to fp8) while filling. A `MutableMapping` with `consume`.
        dtype: compute dtype of the streamed weights.
        weight_dtype: "same" (store in `dtype`) or "fp8_e4m3" (store fp8 + float32 scale per
            tensor; upcast on the device before compute, see `layout.py` for the error).
        pin_memory: page-locked slabs where possible (see `HostSlab`).
        scales: name -> float32 scale (one element) of a float8_e4m3fn tensor of `tensors`: that
            tensor is upcast while filling, `dequantize_fp8_e4m3` (float32 product rounded once to
            `dtype`, as a resident load upcasts it), one tensor at a time. Names no unit streams are
            ignored.
        consume: take ownership of `tensors` (and `scales`): each unit name is removed from them
            right after its tensor is copied into its slab, so a tensor nobody else holds is freed
            before the next one is copied. The host then holds, while filling, the slabs so far and
            what is not yet copied (about the module plus one unit), not the slabs beside the whole
            module. Other names are left. False (default): both mappings are only read and the
            caller may drop them after. On an error while filling, the names copied so far are gone.

    Raises:
        CheckpointError: `tensors` lacks unit parameters.
        ValueError: a streamed tensor is not floating point, a scale's tensor is not float8_e4m3fn
            or the scale is not one float32 element, or bad `weight_dtype`.
        TypeError: `consume` with a read-only mapping.
    """

    def __init__(self, units: Sequence[StreamUnit], tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 weight_dtype: WeightDtype = "same", pin_memory: bool = True, *,
                 scales: Mapping[str, torch.Tensor] | None = None, consume: bool = False) -> None:
        start = time.perf_counter()
        missing = [n for u in units for n in u.params if n not in tensors]
        if missing:
            raise CheckpointError(f"host source: {len(missing)} streamed tensors missing: {short_list(missing)}")
        not_float = [n for u in units for n in u.params if not tensors[n].is_floating_point()]
        if not_float:
            raise ValueError(f"host source: streamed tensors must be floating point; got {short_list(not_float)}")
        scaled = {n for u in units for n in u.params if n in (scales or {})}
        bad = [f"{n} ({tensors[n].dtype}, scale {scales[n].dtype} {list(scales[n].shape)})" for n in sorted(scaled)
               if scales is not None and (tensors[n].dtype != FP8 or scales[n].dtype != torch.float32
                                          or scales[n].numel() != 1)]
        if bad:
            raise ValueError(f"host source: a scale applies to a float8_e4m3fn tensor and is one float32 element; "
                             f"got {short_list(bad)}")
        check_handover("host source", consume, tensors, scales)
        owned = [m for m in (tensors, scales) if m is not None] if consume else []
        self.weight_dtype = weight_dtype
        self.layouts = [plan_unit_layout(u, {n: tensors[n].shape for n in u.params}, dtype, weight_dtype)
                        for u in units]
        self.slabs: list[HostSlab] = []
        for layout in self.layouts:
            slab = HostSlab(layout.raw_nbytes, pin_memory=pin_memory, label=layout.module)
            slab_scales = (slab.view(layout.scales_offset, torch.float32, (layout.num_scales,))
                           if layout.scales_offset is not None else None)
            for t in layout.tensors:
                dst = slab.view(t.offset, t.stored_dtype, t.shape)
                src = tensors[t.name]
                if t.name in scaled:
                    assert scales is not None
                    src = dequantize_fp8_e4m3(src, scales[t.name], dtype)
                if t.scale_index is not None:
                    q, scale = quantize_fp8_e4m3(src)
                    dst.copy_(q)
                    slab_scales[t.scale_index] = scale[0]
                    del q
                else:
                    dst.copy_(src)  # casts to the compute dtype
                del src
                for mapping in owned:  # consume: the caller's original goes now, before the next tensor is copied
                    mapping.pop(t.name, None)
            self.slabs.append(slab)
        kinds = sorted({s.kind for s in self.slabs})
        nbytes = sum(s.nbytes for s in self.slabs)
        logger.info(f"host source: {len(self.slabs)} units, {nbytes / 2**30:.3f} GiB ({weight_dtype}, "
                    f"{'/'.join(kinds)}) filled in {time.perf_counter() - start:.2f}s")

    @property
    def pinned(self) -> bool:
        """True when every slab is page-locked."""
        return bool(self.slabs) and all(s.is_pinned for s in self.slabs)

    def bind(self, num_slots: int) -> None:
        """Nothing to allocate: each unit has its own slab."""

    def fetch(self, unit: int, slot: int, engine: CopyEngine) -> torch.Tensor:
        """The unit's slab (read-only after filling, so no wait is needed)."""
        buffer = self.slabs[unit].buffer
        assert buffer is not None, f"host source closed; unit {unit} fetched"
        return buffer

    def reset(self) -> None:
        """Nothing read ahead: host slabs are filled once."""

    def close(self) -> None:
        """Release every slab (call after all copies finished)."""
        for slab in self.slabs:
            slab.release()
        self.slabs = []

    def stats(self) -> dict[str, float]:
        return {"host_bytes": float(sum(s.nbytes for s in self.slabs))}


class DiskSource:
    """Streamed weights read from the checkpoint's safetensors files at every fetch.

    File bytes are streamed as they are where a tensor's checkpoint dtype is the compute dtype, and
    where it is float8_e4m3fn (an fp8 release): those fp8 bytes are read into the raw region and
    copied H2D as they are (1 byte per element), with a float32 per-tensor scale (the checkpoint's,
    named by `scale_map`, or 1.0) in the unit's scales; the streamer upcasts them on the device
    (`layout.py`: fp8 -> float32 x scale, rounded once: the weights of a resident load). Any other
    floating tensor stored in another dtype (a float16 tensor in a float32 checkpoint, a float32
    checkpoint run in bfloat16) is read into a scratch buffer and cast on the CPU into the staging
    slab at every fetch: the same round-to-nearest cast as resident loading (`weights.to_compute`),
    so every mode gives the same weights, at a CPU cost per fetch (one INFO line counts them).
    Each device slot has one host staging slab (pinned where possible); a staging slab is
    refilled only after its previous H2D copy has read it (host waits for that single copy's event).

    Args:
        units: the streamed units (model parameter names).
        reader: the checkpoint's `SafetensorsDiskReader` (its long-lived handles open at the
            first fetch; `close()` closes them).
        dtype: compute dtype of the streamed weights.
        key_map: model name -> checkpoint name, for names that differ (default: identical).
        weight_dtype: must be "same" (a checkpoint's own fp8 streams as stored with "same").
        pin_memory: page-locked staging slabs where possible.
        read_ahead: read the next unit on a background thread while the current one is used.
        scale_map: model name -> checkpoint name of the float32 per-tensor scale of its
            float8_e4m3fn weight (weight = fp8 x scale; one element, shape [] or [1]). Names
            that no unit streams are ignored (the caller applies those to resident weights).

    Raises:
        NotImplementedError: `weight_dtype` is not "same".
        CheckpointError: tensors or scales missing from the checkpoint; a streamed tensor whose
            checkpoint dtype is not floating (naming the file and the tensor: no cast makes it a
            weight); a scale that is not one float32 element, or the scale of a tensor that is not
            float8_e4m3fn.
    """

    def __init__(self, units: Sequence[StreamUnit], reader: SafetensorsDiskReader, dtype: torch.dtype,
                 key_map: Mapping[str, str] | None = None, weight_dtype: WeightDtype = "same",
                 pin_memory: bool = True, read_ahead: bool = True,
                 scale_map: Mapping[str, str] | None = None) -> None:
        if weight_dtype != "same":
            raise NotImplementedError(f"`weight_dtype`={weight_dtype!r} with disk storage: the checkpoint's bytes "
                                      "are streamed as they are (its own float8_e4m3fn weights included, with "
                                      "weight_dtype 'same'); use storage 'cpu' to quantize to fp8 at load")
        key_map = dict(key_map or {})
        self.reader = reader
        self.pin_memory = pin_memory
        self._ckpt_names = [[key_map.get(n, n) for n in u.params] for u in units]
        missing = [c for names in self._ckpt_names for c in names if c not in reader.index]
        if missing:
            raise CheckpointError(f"disk source: {len(missing)} streamed tensors are not in the checkpoint: "
                                  f"{short_list(missing)}")
        entries = [reader.index[c] for names in self._ckpt_names for c in names]
        bad = [e for e in entries if not e.dtype.is_floating_point]
        if bad:
            raise CheckpointError(f"disk source: {len(bad)} streamed tensors are not floating point, so no cast makes "
                                  "them weights: " + short_list([f"{e.name} ({e.dtype}) in {e.path}" for e in bad]))
        streamed = {n: c for u, names in zip(units, self._ckpt_names) for n, c in zip(u.params, names)}
        #: model names whose float8_e4m3fn bytes stream as stored (upcast on the device)
        self.fp8_names = frozenset(n for n, c in streamed.items() if reader.index[c].dtype == FP8)
        #: model name -> checkpoint name of its scale (streamed fp8 tensors only; the others get 1.0)
        self.scale_names = {n: k for n, k in (scale_map or {}).items() if n in streamed}
        _check_scales(self.scale_names, self.fp8_names, {n: streamed[n] for n in self.scale_names}, reader)
        #: per unit, the checkpoint names read into a scratch buffer and cast to `dtype` at each fetch
        self._casts = [{c for c in names if reader.index[c].dtype not in (dtype, FP8)} for names in self._ckpt_names]
        cast = [e for e in entries if e.dtype not in (dtype, FP8)]
        if cast:
            logger.info("disk source: {} of {} streamed tensors are stored in another dtype than the compute dtype {} "
                        "({:.3f} GiB, e.g. {}): cast on the CPU at every fetch (a checkpoint in {} streams its bytes "
                        "as they are)", len(cast), len(entries), dtype, sum(e.nbytes for e in cast) / 2**30,
                        short_list([f"{e.name} ({e.dtype})" for e in cast]), dtype)
        if self.fp8_names:
            fp8_bytes = sum(e.nbytes for e in entries if e.dtype == FP8)
            logger.info("disk source: {} of {} streamed tensors are float8_e4m3fn ({:.3f} GiB, {} with a scale): "
                        "streamed as stored, upcast to {} on the device", len(self.fp8_names), len(entries),
                        fp8_bytes / 2**30, len(self.scale_names), dtype)
        self.layouts = [plan_unit_layout(u, {n: reader.index[c].shape for n, c in zip(u.params, names)}, dtype,
                                         fp8_stored=self.fp8_names)
                        for u, names in zip(units, self._ckpt_names)]
        self.staging: list[HostSlab] = []
        # Read-ahead: while unit j is copied and computed, one background thread reads unit j+1 from
        # disk into the next staging slab, so disk reads overlap compute instead of stalling the
        # pre-hook. Reads are serialized by a lock (one reader at a time, one handle per file).
        self.read_ahead = read_ahead
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: dict[int, tuple[Future, int]] = {}  # unit -> (its background read, staging slot)
        self._lock = threading.Lock()
        self._at_boundary = True  # no read since construction or `reset`: re-check the files first

    @property
    def pinned(self) -> bool:
        """True when every staging slab is page-locked."""
        return bool(self.staging) and all(s.is_pinned for s in self.staging)

    def bind(self, num_slots: int) -> None:
        """Allocate one staging slab per slot, of the largest unit's size (none without units)."""
        size = max((layout.raw_nbytes for layout in self.layouts), default=0)
        self.staging = [HostSlab(size, pin_memory=self.pin_memory, label=f"staging{s}") for s in range(num_slots)]

    def _read_unit(self, unit: int, slot: int, engine: CopyEngine) -> None:
        buffer = self.staging[slot].buffer
        assert buffer is not None, f"disk source closed; unit {unit} fetched"
        engine.wait_copy_host(slot)  # the slab's previous H2D copy must have read it
        layout = self.layouts[unit]
        reads, casts, unit_scales = [], [], []
        for t, name in zip(layout.tensors, self._ckpt_names[unit]):
            dst = buffer[t.offset:t.offset + t.nbytes]
            if name in self._casts[unit]:  # stored in another dtype: read aside, cast into the slab
                entry = self.reader.index[name]
                raw = torch.empty(entry.nbytes, dtype=torch.uint8)  # allocator-aligned for any dtype view
                reads.append((name, raw))
                casts.append((raw.view(entry.dtype).view(t.shape), dst.view(t.dtype).view(t.shape)))
            else:  # the compute dtype, or float8_e4m3fn: the file's bytes as they are
                reads.append((name, dst))
            if t.scale_index is not None:
                assert layout.scales_offset is not None, f"{layout.module}: an fp8 tensor without a scales region"
                at = layout.scales_offset + 4 * t.scale_index
                scale_key = self.scale_names.get(t.name)
                if scale_key is None:
                    unit_scales.append(t.scale_index)  # fp8 without a scale: the value is the weight
                else:
                    reads.append((scale_key, buffer[at:at + 4]))  # one float32
        with self._lock:
            self.reader.read_many(reads)
        if unit_scales:
            assert layout.scales_offset is not None, f"{layout.module}: fp8 tensors without a scales region"
            scales = typed_view(buffer, layout.scales_offset, torch.float32, (layout.num_scales,))
            scales[unit_scales] = 1.0
        for src, dst in casts:
            dst.copy_(src)  # round to nearest, as `.to(dtype)` in resident loading

    def fetch(self, unit: int, slot: int, engine: CopyEngine) -> torch.Tensor:
        """The unit's tensors in the slot's staging slab (read ahead in the background, or read now);
        then start reading the next unit into the next unit's slot. Fetches out of order (a streamed
        unit fetched again after its slot was reused) stay correct: a read-ahead of another unit into
        the same slab is finished and dropped first, and no read-ahead starts into a slab that
        another read-ahead is filling.

        The first fetch after a request boundary first re-checks the checkpoint files
        (`SafetensorsDiskReader.revalidate`): a file changed between requests fails this request
        only if it no longer has the indexed layout.

        Raises:
            CheckpointChangedError: a checkpoint file changed while this request streams from it
                (or between requests, to another layout); raised by the fetch of the unit whose
                read saw it, also when a background read saw it. The source stays usable:
                `reset()` (the request boundary) drops every read in flight.
        """
        if self._at_boundary:
            self._at_boundary = False
            with self._lock:
                self.reader.revalidate()
        ahead = self._ahead.pop(unit, None)
        if ahead is not None and ahead[1] == slot:
            ahead[0].result()  # re-raises a failed background read here
        else:
            if ahead is not None:
                ahead[0].result()
            # Out of order (e.g. a unit fetched again): a read-ahead of another unit into this staging
            # slab would overwrite it; let it finish and forget it (its unit is read again when fetched).
            for other, (future, s) in list(self._ahead.items()):
                if s == slot:
                    future.exception()
                    del self._ahead[other]
            self._read_unit(unit, slot, engine)
        if self.read_ahead and len(self.staging) > 1:
            nxt = (unit + 1) % len(self.layouts)
            nslot = nxt % len(self.staging)  # the streamer's slot of unit nxt
            if nslot != slot and nxt not in self._ahead and all(s != nslot for _, s in self._ahead.values()):
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runnerkit-disk-read")
                self._ahead[nxt] = (self._executor.submit(self._read_unit, nxt, nslot, engine), nslot)
        buffer = self.staging[slot].buffer
        assert buffer is not None, f"disk source closed; unit {unit} fetched"
        return buffer[:self.layouts[unit].raw_nbytes]

    def settle(self) -> None:
        """Wait for the read-ahead in flight and keep it (the next fetch of its unit uses it): its bytes are
        then in `stats()`, which counts a read when it completes (tests and benchmarks read counts here)."""
        for future, _ in list(self._ahead.values()):
            future.exception()  # a failed read raises at the fetch of its unit, as without settle

    def reset(self) -> None:
        """Wait for and drop any read-ahead (its bytes are not used): the request boundary."""
        pending, self._ahead = list(self._ahead.values()), {}
        for future, _ in pending:
            future.exception()  # wait; an error of a read nobody needs is dropped (the next read sees it again)
        with self._lock:
            self.reader.drop_cached()  # pread: the page cache the kernel's read-ahead left (docs/host_memory.md)
        self._at_boundary = True

    def close(self) -> None:
        """Stop read-ahead, close the reader's long-lived handles and release the staging slabs."""
        self.reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.reader.close()
        for slab in self.staging:
            slab.release()
        self.staging = []

    def stats(self) -> dict[str, float]:
        s = self.reader.stats()
        return {"disk_bytes_read": s["bytes_read"], "disk_seconds": s["seconds"], "disk_gb_per_s": s["gb_per_s"],
                "disk_read_calls": s["read_calls"], "disk_gap_bytes_read": s["gap_bytes_read"]}

