"""Turn a meta-device network into a block/phase-streamed one (ARCHITECTURE §4).

    streamer = stream_module(model, Family.STREAM_SPEC, cfg, ...)  # resident tensors on the device,
                                                                   # streamed ones in host slabs or on disk
                                                                   # (`cfg.resident_blocks` units stay resident)
    model(...)                                                     # hooks stream blocks through gpu_slots
    streamer.reset()                                               # at every request boundary
    streamer.close()                                               # lazy load: before dropping the model
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from loguru import logger
from torch import nn

from runnerkit import memory
from runnerkit.config import OffloadConfig
from runnerkit.offload import resident_read
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.layout import StreamSpec, dequantize_fp8_e4m3, plan_units, resident_names, split_resident
from runnerkit.offload.pinned import pinning_disabled_by_env
from runnerkit.offload.pread_jobs import resolve_read_threads
from runnerkit.offload.resident_read import read_resident_batches
from runnerkit.offload.sources import DiskSource, HostSource, check_handover
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.weights import CheckpointError, check_tensors, short_list, tensor_infos, to_compute


def pin_memory_enabled(cfg: OffloadConfig) -> bool:
    """Config `pin_memory`, forced off by env RUNNERKIT_DISABLE_PINNED=1."""
    return cfg.pin_memory and not pinning_disabled_by_env()


PAGE_CACHE_SHARE = 0.5
"""`offload.page_cache` auto keeps streamed files cached while all the files this process keeps take at most
this share of the host's available memory (`memory.host_available_bytes`)."""

_PAGE_CACHE_DECIDED: dict[Path, tuple[bool, int]] = {}
"""auto's decision per streamed file (resolved path -> (kept, size in bytes)), made once per process: a
module built again (lazy load, another runner) reads its files as before, and files shared by modules count
once."""


def page_cache_kept(files: Sequence[Path], setting: str) -> tuple[bool, str]:
    """Whether a pread reader of `files` keeps their pages in the page cache (`offload.page_cache`), and why.

    auto: files decided before keep their decision; the others are kept when their size plus that of the
    files already kept is at most `PAGE_CACHE_SHARE` of the host's available memory (the smaller of
    MemAvailable and what a cgroup memory limit leaves), and dropped otherwise or where the available memory
    is unknown. A reader keeps its files' pages only if every one of them is kept.

    Raises:
        OSError: a file that cannot be `stat`ed (`stream_module` then lets the reader name it).
    """
    if setting != "auto":
        return setting == "keep", f"offload.page_cache={setting}"
    paths = [Path(f).resolve() for f in files]
    if all(p in _PAGE_CACHE_DECIDED for p in paths):
        kept = all(_PAGE_CACHE_DECIDED[p][0] for p in paths)
        return kept, "as decided for these files earlier in this process"
    new = {p: p.stat().st_size for p in paths if p not in _PAGE_CACHE_DECIDED}
    available = memory.host_available_bytes()
    keep = False
    if available is not None:
        total = sum(size for kept, size in _PAGE_CACHE_DECIDED.values() if kept) + sum(new.values())
        keep = total <= PAGE_CACHE_SHARE * available[0]
    _PAGE_CACHE_DECIDED.update({p: (keep, size) for p, size in new.items()})
    if available is None:
        return False, "the host's available memory is unknown"
    kept = keep and all(_PAGE_CACHE_DECIDED[p][0] for p in paths)
    words = (f"{total / memory.GIB:.2f} GiB of files kept with these against {available[0] / memory.GIB:.2f} GiB "
             f"available ({available[1]})")
    return kept, words if keep else f"{words}: more than {PAGE_CACHE_SHARE:.0%}"


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move the buffers the skeleton already holds outside the state dict (non-persistent ones computed
    at build time, e.g. a transformers model's RoPE `inv_freq`) to `device`, dtype and values unchanged."""
    for name, buf in list(model.named_buffers()):
        if buf is not None and not buf.is_meta and buf.device != torch.device(device):
            module_name, _, leaf = name.rpartition(".")
            model.get_submodule(module_name)._buffers[leaf] = buf.to(device)


Batch = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
"""Resident tensors read together: (model name -> host tensor as stored, model name -> the float32 scalar
scale of a resident float8_e4m3fn weight)."""


class _ResidentRead(NamedTuple):
    """What step 1 of `stream_module` (`_read_resident`) hands on."""

    batches: Iterable[Batch]
    """The resident tensors, batch by batch. Storage "disk": each batch is read from the files only when the
    previous one was consumed (`resident_read.read_resident_batches`); storage "cpu": one batch of all."""
    reader: SafetensorsDiskReader | None
    """Storage "disk": the reader the streamed units are fetched with; None for storage "cpu"."""
    key_map: dict[str, str] | None
    """Storage "disk": model name -> file name (identity when the caller gave none); None for storage "cpu"."""


def _read_resident(expected: Mapping[str, torch.Tensor], resident: list[str], cfg: OffloadConfig, component: str,
                   state_dict: Mapping[str, torch.Tensor] | None, files: list[Path] | None,
                   key_map: Mapping[str, str] | None, shared_files: bool, scale_map: Mapping[str, str],
                   scales: Mapping[str, torch.Tensor], consume: bool) -> _ResidentRead:
    """Step 1 of `stream_module`: check the checkpoint against the model, then hand on the resident tensors.

    Decides whether the checkpoint fits `expected` (the model's state dict: names, shapes, floating
    dtypes; storage "disk": from the headers, before any weight is read, only `key_map`'s keys when
    `shared_files`, scale tensors left out). Storage "disk" reads nothing here: its batches (at most
    `resident_read.RESIDENT_BATCH_BYTES` as stored, or the largest tensor; fp8 scales with their weights)
    are read as `_load_resident` asks for them, with short-lived handles, all closed before any block
    fetch opens a long-lived one. Storage "cpu" with `consume`: the resident names leave `state_dict`
    (and `scales`).

    Raises:
        CheckpointError: as `stream_module`.
    """
    if cfg.storage == "cpu":
        assert state_dict is not None, "storage cpu needs the state dict"
        assert not scale_map, "storage cpu takes its scales as tensors (`scales`)"
        check_tensors(expected, tensor_infos(state_dict), component)
        batch = ({n: state_dict[n] for n in resident}, {n: scales[n].reshape(()) for n in resident if n in scales})
        if consume:  # the caller's mappings hand the resident tensors over: `_load_resident` frees them one by one
            assert isinstance(state_dict, MutableMapping) and isinstance(scales, MutableMapping)
            for n in resident:
                state_dict.pop(n)
                scales.pop(n, None)
        return _ResidentRead([batch], None, None)
    assert files is not None, "storage disk needs the checkpoint files"
    key_map = dict(key_map or {n: n for n in expected})
    kept: tuple[bool, str] | None = None  # pread: whether the files' pages stay in the page cache, and why
    if cfg.reader == "pread":
        try:
            kept = page_cache_kept(files, cfg.page_cache)
        except OSError:  # a file that cannot be stat'ed: the reader names it (CheckpointError)
            pass
    dropped = kept is not None and not kept[0] and hasattr(os, "posix_fadvise")  # else the pages stay cached
    threads = resolve_read_threads(cfg.read_threads, from_disk=dropped)
    reader = SafetensorsDiskReader(files, reader=cfg.reader,  # checks the files (CheckpointError)
                                   read_threads=threads if cfg.reader == "pread" else 1)
    if cfg.reader == "pread":
        keep, why = kept if kept is not None else page_cache_kept(files, cfg.page_cache)
        reader.drop_pages = reader.drop_pages and not keep
        logger.info("{}: page cache of the streamed files {}: {}", component, "kept" if keep else
                    "dropped after each read", why)
    inverse = {v: k for k, v in key_map.items()}
    scale_keys = set(scale_map.values())
    # names, shapes and dtypes from the headers, before any weight is read
    check_tensors(expected, {inverse.get(n, n): entry for n, entry in reader.index.items()
                             if (not shared_files or n in inverse) and n not in scale_keys}, component)
    resident_scales = {n: scale_map[n] for n in resident if n in scale_map}
    batches = read_resident_batches(reader, resident, key_map, resident_scales, resident_read.RESIDENT_BATCH_BYTES)
    return _ResidentRead(batches, reader, key_map)


def _load_resident(model: nn.Module, batches: Iterable[Batch], spec: StreamSpec, dtype: torch.dtype,
                   device: torch.device) -> None:
    """Step 2 of `stream_module`: put the resident tensors on `device` in their compute dtype
    (`spec.keep_fp32` names in float32, scaled fp8 upcast), then the buffers outside the state dict.

    Batch by batch: every tensor of a batch is on the device, and the batch's dicts emptied (its host
    copies dropped), before the next batch is asked for (storage "disk": read).
    """
    # one tensor at a time onto the device, its host copy dropped as it goes: the host holds at most one
    # batch as stored. Off the CPU the tensor crosses as stored and is cast on the device (a blocking copy
    # that casts would make a host copy in the compute dtype first). to_compute: resident CPU weights 64-byte
    # aligned whatever their file offsets (streamed ones are too: slabs and slots place them at ALIGNMENT
    # offsets of allocator- or page-aligned buffers). Scaled fp8 outside the units is upcast as a resident
    # load does (`dequantize_fp8_e4m3`), on the compute device.
    cast: dict[str, torch.Tensor] = {}
    on_host = torch.device(device).type == "cpu"
    for tensors, scales in batches:
        for n in list(tensors):
            t = tensors.pop(n)
            target = torch.float32 if spec.keep_fp32(n) else dtype
            if n in scales:
                t = dequantize_fp8_e4m3(t.to(device), scales.pop(n).to(device), target)
            cast[n] = to_compute(t if on_host else t.to(device), target, device)
            del t
        del tensors, scales  # nothing of this batch stays on the host while the next is read
    model.load_state_dict(cast, strict=False, assign=True)
    init = getattr(model, "init_non_persistent_buffers", None)
    if init is not None:
        init()
    _buffers_to(model, device)


def stream_module(model: nn.Module, spec: StreamSpec, cfg: OffloadConfig, device: torch.device,
                  dtype: torch.dtype, component: str, state_dict: Mapping[str, torch.Tensor] | None = None,
                  files: list[Path] | None = None, key_map: Mapping[str, str] | None = None,
                  shared_files: bool = False, scale_map: Mapping[str, str] | None = None,
                  scales: Mapping[str, torch.Tensor] | None = None, consume: bool = False) -> BlockStreamer:
    """Load the resident part of meta-built `model` onto `device` and stream its blocks.

    Args:
        model: network on the meta device.
        spec: the family's stream spec (block list, phases, float32 layers), e.g. the
            `STREAM_SPEC` of the transformer class; `spec.keep_fp32` names are loaded in
            float32 and, inside blocks, stay resident (small tables, norms).
        cfg: offload config (`mode` block/phase, `storage`, slots, prefetch, reader, weight_dtype,
            `resident_blocks`: that many units, spread evenly (`layout.split_resident`), are loaded
            like the resident tensors, once, in the compute dtype (also with weight_dtype fp8_e4m3),
            and only the others stream; all of them when it is >= the unit count: the streamer then
            has no unit, slot or hook).
        state_dict: all tensors in model names (storage "cpu"); float8_e4m3fn ones are upcast (the
            scale of `scales`, or none) as they are loaded or copied into their host slab.
        files, key_map: the checkpoint's safetensors files and model name -> file name (storage "disk").
        shared_files: the files also hold other networks' tensors (a single-file release): only the
            keys of `key_map` are checked and read (the caller has checked the rest of the file).
        scale_map: storage "disk": model name -> file name of the float32 per-tensor scale of its
            float8_e4m3fn weight (weight = fp8 x scale). Streamed fp8 weights, scaled or not, stream as
            stored and are upcast on the device (`DiskSource`); resident ones are upcast here, the same
            way (`dequantize_fp8_e4m3`: float32 product, rounded once).
        scales: storage "cpu": model name -> float32 scale (one element) of its float8_e4m3fn weight in
            `state_dict`; upcast the same way, one tensor at a time (resident ones on the device,
            streamed ones into their slab: `HostSource`), so the host never holds the upcast module.
        consume: storage "cpu": take ownership of `state_dict` and `scales` (mutable mappings): every
            tensor leaves them once it is on the device or in its host slab, so a tensor nobody else
            holds is freed at once: no unit is held twice but the one being copied (`HostSource`;
            docs/host_memory.md). Default False: both are only read.

    Buffers outside the state dict: created by `model.init_non_persistent_buffers()` when the model
    has it, or computed when the skeleton was built (then moved to `device` as they are).

    Raises:
        CheckpointError: a damaged safetensors file (storage "disk"), missing or unexpected
            tensors (listed), wrong shapes or non-floating dtypes (`weights.check_tensors`, naming
            the file and the tensor), checked before any weight is read; a tensor left on the meta
            device (neither loaded nor streamed nor computed), listed.
        TypeError: `consume` with a `state_dict` or `scales` that is not a mutable mapping.
        ValueError: a scale of `scales` whose tensor is not float8_e4m3fn (`HostSource`).

    Streamed tensors stored in another floating dtype than `dtype` are cast as resident ones are:
    once into the host slabs (storage "cpu"), at every fetch into the staging slab (storage "disk"),
    except float8_e4m3fn ones with storage "disk", which cross H2D as stored and are upcast on the device.
    """
    assert cfg.mode in ("block", "phase"), f"stream_module needs mode block/phase, got {cfg.mode}"
    check_handover(component, consume, state_dict, scales)
    assert not (scales and cfg.storage == "disk"), "storage disk reads its scales from the files (`scale_map`)"
    scales = scales if scales is not None else {}
    pin = pin_memory_enabled(cfg)
    planned = plan_units(model, cfg.mode, spec)
    kept, units = split_resident(planned, spec.resident_units(cfg.resident_blocks))  # kept units load below with the resident tensors
    resident = resident_names(model, units)
    scale_map = dict(scale_map or {})
    read = _read_resident(model.state_dict(keep_vars=True), resident, cfg, component, state_dict, files, key_map,
                          shared_files, scale_map, scales, consume)
    _load_resident(model, read.batches, spec, dtype, device)
    reader, key_map = read.reader, read.key_map
    if cfg.storage == "cpu":
        assert state_dict is not None, "storage cpu needs the state dict"
        source = HostSource(units, state_dict, dtype, cfg.weight_dtype, pin_memory=pin, scales=scales, consume=consume)
    else:
        assert reader is not None, "storage disk reads through a disk reader"
        source = DiskSource(units, reader, dtype, key_map=key_map, pin_memory=pin, scale_map=scale_map)
    streamer = BlockStreamer(model, units, source, device, cfg.gpu_slots, cfg.prefetch_depth)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        streamer.close()
        raise CheckpointError(f"{component}: {len(left)} tensors are neither loaded nor streamed (still on the meta "
                              f"device): {short_list(left)}; a non-persistent buffer must be computed when the "
                              "skeleton is built (`init_non_persistent_buffers`, or `offload.encoders.hf_skeleton`)")
    logger.info("{}: {} streaming of {} units from {}, {} of {} units resident (offload.resident_blocks={}; "
                "host memory pinned: {}, slots={}, prefetch={}, reader={})", component, cfg.mode, len(units),
                cfg.storage, len(kept), len(planned), cfg.resident_blocks, source.pinned, streamer.num_slots,
                cfg.prefetch_depth, _reader_name(reader))
    return streamer


def _reader_name(reader: SafetensorsDiskReader | None) -> str:
    """How a streamer reads, for its log line: '-' (host memory), 'mmap', 'pread, N read threads'."""
    if reader is None:
        return "-"
    threads = reader.read_threads
    return f"pread, {threads} read thread{'s' if threads > 1 else ''}" if reader.reader == "pread" else reader.reader
