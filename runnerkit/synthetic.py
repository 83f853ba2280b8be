"""Writing synthetic checkpoints (deterministic random weights), shared by every family.

A family's writer fills a private temporary folder (`partial_folder`) with its layout, writing
large networks shard by shard (`write_sharded`), then `finish` renames it into place atomically:
an interrupted or failed writer leaves nothing behind, and two processes writing the same
checkpoint at once both end with one intact folder. Every synthetic checkpoint holds
`SYNTHETIC_MARKER` (its seed, layout and dtype, `write_marker`), which `synthetic_seed_of` and
`synthetic_dtype_of` read.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any
from pathlib import Path

import torch
from loguru import logger
from safetensors.torch import save_file

from runnerkit.files import give_default_mode
from runnerkit.weights import CheckpointError, synthetic_tensor

SHARD_BYTES = 2 * 1024**3
"""Largest safetensors shard `write_sharded` writes (bytes)."""
SYNTHETIC_MARKER = "runnerkit_synthetic.json"
"""Written into every synthetic checkpoint, in every layout: {"seed", "layout", "dtype", "weights": "random", ...}."""


def write_marker(folder: Path, seed: int, layout: str, dtype: torch.dtype) -> None:
    """Write `SYNTHETIC_MARKER` into `folder`: the seed, layout and dtype the weights are drawn with (the values
    depend on all three, so a run that asks for another seed or dtype refuses the folder: `synthetic_seed_of`,
    `synthetic_dtype_of`)."""
    marker = {"seed": seed, "layout": layout, "dtype": str(dtype).removeprefix("torch."), "weights": "random"}
    (Path(folder) / SYNTHETIC_MARKER).write_text(json.dumps(marker))


def synthetic_seed_of(path: Path) -> int | None:
    """The seed of a synthetic checkpoint at `path`, or None if it holds no synthetic weights.

    Raises:
        CheckpointError: the marker file is unreadable.
    """
    if not (Path(path) / SYNTHETIC_MARKER).is_file():
        return None
    marker = _marker(path)
    seed = marker.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        got = f"`seed` is {seed!r}" if "seed" in marker else "`seed` is missing"
        raise CheckpointError(f"{Path(path) / SYNTHETIC_MARKER} is unreadable: its {got}, not an integer; delete "
                              f"{path} to write it again")
    return seed


def _marker(path: Path) -> dict[str, Any]:
    """The JSON object of `SYNTHETIC_MARKER` in `path` (which holds one).

    Raises:
        CheckpointError: not JSON, or not a JSON object.
    """
    marker = Path(path) / SYNTHETIC_MARKER
    try:
        data = json.loads(marker.read_text())
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{marker} is unreadable ({exc}); delete {path} to write it again") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{marker} is unreadable: it holds a JSON {type(data).__name__}, not an object; "
                              f"delete {path} to write it again")
    return data


def synthetic_dtype_of(path: Path) -> str | None:
    """The dtype name ('bfloat16', 'float32', ...) a synthetic checkpoint at `path` was written in; None if it
    holds no synthetic weights or its marker predates the dtype (`write_marker`).

    Raises:
        CheckpointError: the marker file is unreadable.
    """
    if not (Path(path) / SYNTHETIC_MARKER).is_file():
        return None
    dtype = _marker(path).get("dtype")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"{Path(path) / SYNTHETIC_MARKER} is unreadable: its `dtype` is {dtype!r}, not one of "
                              f"'float32', 'bfloat16', 'float16'; delete {path} to write it again")
    return dtype


def partial_folder(out: Path) -> Path:
    """A new private temporary folder beside `out` (one per writer, so concurrent writers never mix)."""
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def write_sharded(shapes: Mapping[str, tuple[int, ...]], rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                  folder: Path, stem: str, seed: int, dtype: torch.dtype, keep_fp32: Callable[[str], bool],
                  generator_device: str = "cpu") -> None:
    """Generate tensors one by one (`weights.synthetic_tensor`, values depending only on name and
    seed) and write safetensors shards of at most `SHARD_BYTES` under file names `rename` gives
    (plus a `<stem>.safetensors.index.json` when there are several). Peak host memory is about
    one shard. `keep_fp32(name)`: that tensor is written in float32 instead of `dtype`."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = [0]
    plan: list[list[str]] = [[]]
    for name, shape in shapes.items():  # plan first so the shard count is known for the names
        nbytes = torch.Size(shape).numel() * (4 if keep_fp32(name) else torch.empty(0, dtype=dtype).element_size())
        if sizes[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            plan.append([])
            sizes.append(0)
        plan[-1].append(name)
        sizes[-1] += nbytes
    n = len(plan)
    # Renames can depend on the whole key set (e.g. a VAE's decoder grouping): map all names once.
    probes = {k: torch.empty(0) for k in shapes}  # distinct objects: map old -> new names by identity
    renamed = {id(v): k for k, v in rename(probes).items()}
    file_name = {k: renamed[id(v)] for k, v in probes.items()}
    weight_map: dict[str, str] = {}
    for i, shard_names in enumerate(plan):
        fname = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        shard = {name: synthetic_tensor(name, shapes[name], seed, torch.float32 if keep_fp32(name) else dtype,
                                        generator_device) for name in shard_names}
        shard = {file_name[k]: v for k, v in shard.items()}
        save_file({k: v.contiguous() for k, v in shard.items()}, str(folder / fname))
        give_default_mode(folder / fname)
        weight_map.update({k: fname for k in shard})
        del shard
    if n > 1:
        (folder / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=1))


def save_pretrained_here(model: Any, folder: Path, **kwargs: Any) -> None:
    """`model.save_pretrained(folder, **kwargs)` (a transformers model) in this process whatever its
    torch.distributed rank. transformers (5.x) writes nothing on a rank other than 0 once a process
    group exists (`should_save_on_this_rank`); every rank of a parallel run writes its own temporary
    folder (`partial_folder`) and the first complete one is renamed into place (`finish`), so a rank
    that skipped the write could publish a folder without its text encoder."""
    from transformers.utils import logging as hf_logging

    model.should_save_on_this_rank = lambda is_main_process: True  # an instance attribute shadows the method
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the writer logs one line per checkpoint instead of shard progress bars
    try:
        model.save_pretrained(folder, **kwargs)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def finish(tmp: Path, out: Path, seed: int, layout: str, replace: bool, announce: bool = True) -> Path:
    """Move the completed temporary folder `tmp` to `out` (atomic rename); returns `out`.

    `replace`: delete an existing `out` first (the caller has checked it may). A concurrent writer
    that finished the same seed first wins (its identical checkpoint is kept).

    Raises:
        CheckpointError: `out` exists, is not empty and holds no synthetic checkpoint of `seed`.
    """
    if replace and out.exists():
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)  # atomic; succeeds onto a missing or empty folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if synthetic_seed_of(out) == seed:  # another process finished the same checkpoint first
            logger.info("synthetic checkpoint {} was written by another process meanwhile; using it", out)
            return out
        raise CheckpointError(f"cannot write a synthetic checkpoint to {out}: the folder is not empty") from None
    if announce:  # a writer building on this one (e.g. an MoE layout) announces the final folder itself
        logger.warning("wrote a SYNTHETIC checkpoint of RANDOM weights (seed {}, {} layout) to {}: its output is noise",
                       seed, layout, out)
    return out
