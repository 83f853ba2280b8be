"""Read a disk-streamed module's resident part in bounded batches (storage "disk", docs/host_memory.md).

The resident part (every tensor outside the streamed units: non-block weights and the units
`offload.resident_blocks` keeps) is read batch by batch, and each batch goes to the device before the
next is read, so the host holds at most one batch as stored:

    for tensors, scales in read_resident_batches(reader, names, key_map, scale_map):
        ...  # each tensor to the device, its host copy dropped, before the loop reads the next batch

A batch is a run of tensors in file order (file, then byte offset: the reader coalesces neighbours into
large reads), at most `batch_bound` bytes as stored: `RESIDENT_BATCH_BYTES`, or the largest single tensor
when that is larger. An fp8 weight's scale is read in the same batch as its weight. The memory planner
counts the same bound (`planning/fit.py`, `ModuleFootprint.stream_load_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.weights import CheckpointError, short_list

__all__ = ["RESIDENT_BATCH_BYTES", "batch_bound", "plan_batches", "read_resident_batches"]

RESIDENT_BATCH_BYTES = 256 * 1024**2
"""Bytes (as stored) of one batch of resident tensors read from disk. Measured on synthetic bf16 files
(bench/results/resident_read_cpu.md): 256 MiB batches read at the rate of one whole-part read; one read per
tensor is 4-10x slower on small tensors (a handle, two identity checks and a read call each, no coalescing)."""


def batch_bound(item_bytes: Sequence[int], budget: int = RESIDENT_BATCH_BYTES) -> int:
    """The most bytes one batch holds: `budget`, or the largest item (a tensor with its scale) if larger;
    never more than all items together. Bytes as stored."""
    return min(sum(item_bytes), max(budget, max(item_bytes, default=0)))


def plan_batches(item_bytes: Sequence[int], budget: int = RESIDENT_BATCH_BYTES) -> list[list[int]]:
    """Split items (bytes each, in read order) into consecutive batches of at most `batch_bound` bytes.

    Greedy: an item joins the current batch while the batch stays within the bound, else starts the next.

    Returns:
        Batches of indices into `item_bytes`, in order; every index in exactly one batch.

    Raises:
        ValueError: `budget` < 1.
    """
    if budget < 1:
        raise ValueError(f"`budget` must be at least 1 byte, got {budget}")
    bound = batch_bound(item_bytes, budget)
    batches: list[list[int]] = []
    held = 0
    for i, nbytes in enumerate(item_bytes):
        if batches and held + nbytes <= bound:
            batches[-1].append(i)
            held += nbytes
        else:
            batches.append([i])
            held = nbytes
    return batches


def read_resident_batches(reader: SafetensorsDiskReader, names: Sequence[str], key_map: Mapping[str, str],
                          scale_map: Mapping[str, str], budget: int = RESIDENT_BATCH_BYTES
                          ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Read the tensors `names` (model names) batch by batch, a batch only when the previous one was consumed.

    Args:
        reader: the module's disk reader; each batch is one `load_tensors` call (short-lived handles, closed
            before it returns).
        names: the resident part's model names (`layout.resident_names`).
        key_map: model name -> file name (names it lacks are read under their own name).
        scale_map: model name -> file name of its float8_e4m3fn weight's float32 scale; read with the weight.
        budget: bytes of a batch as stored (`batch_bound`).

    Yields:
        (model name -> host tensor as stored, model name -> scalar float32 scale of its fp8 weight), one pair
        per batch. The generator keeps no reference to a batch it handed out: once the caller drops the
        tensors, the host holds none of them.

    Raises:
        CheckpointError: names (or scales) the checkpoint lacks, listed, at the call (before any weight is
            read); while iterating, as `load_tensors`.
    """
    keys = {n: key_map.get(n, n) for n in names}
    needed = [*keys.values(), *(scale_map[n] for n in names if n in scale_map)]
    missing = [k for k in needed if k not in reader.index]
    if missing:
        raise CheckpointError(f"disk reader: {len(missing)} tensors are not in the checkpoint: {short_list(missing)}")
    position = {path: i for i, path in enumerate(reader.files)}

    def where(name: str) -> tuple[int, int]:
        entry = reader.index[keys[name]]
        return position[entry.path], entry.offset

    order = sorted(names, key=where)  # file order: neighbours are read together
    sizes = [reader.index[keys[n]].nbytes + (reader.index[scale_map[n]].nbytes if n in scale_map else 0)
             for n in order]
    return _batches(reader, [[order[i] for i in batch] for batch in plan_batches(sizes, budget)], keys, scale_map)


def _batches(reader: SafetensorsDiskReader, batches: list[list[str]], keys: Mapping[str, str],
             scale_map: Mapping[str, str]) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """The generator of `read_resident_batches`: reads a batch when asked for it."""
    for names in batches:
        yield _read_batch(reader, names, keys, scale_map)  # nothing of the batch stays in this frame


def _read_batch(reader: SafetensorsDiskReader, names: list[str], keys: Mapping[str, str],
                scale_map: Mapping[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One batch: its tensors and their scales, by model name (no other reference to them remains)."""
    scaled = [n for n in names if n in scale_map]
    loaded = reader.load_tensors([keys[n] for n in names] + [scale_map[n] for n in scaled])
    return ({n: loaded[keys[n]] for n in names}, {n: loaded[scale_map[n]].reshape(()) for n in scaled})
