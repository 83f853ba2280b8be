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

Damaged files are refused here, with the file and the tensor named, the same way in every offload
mode: `read_safetensors_header` is the one safetensors header check (the all-resident loader and
the disk streaming reader both use it), `check_tensors` the one check of names, shapes and dtypes
against a network, and `read_pth` / `read_json_object` / `safetensors_files` refuse truncated or
garbage `.pth`, JSON and shard index files.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from loguru import logger
from safetensors import safe_open
from torch import nn

M = TypeVar("M", bound=nn.Module)

CPU_ALIGNMENT = 64
"""Byte alignment of every CPU weight a module computes with: the widest x86-64 vector (AVX-512)
and what c10's CPU allocator guarantees for fresh tensors."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, damaged, or does not match the architecture."""


SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors header accepted (bytes); the safetensors library rejects larger ones."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a checkpoint describes it, without its bytes.

    Attributes:
        name: its name in the file (which may differ from the network's name, e.g. diffusers keys).
        path: the file holding it; None when not known (a state dict already in memory).
        dtype: its dtype in the file.
        shape: its shape in the file.
    """

    name: str
    path: Path | None
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorIndexEntry(TensorInfo):
    """A tensor of a safetensors file and where its bytes are: absolute byte `offset` in `path`,
    and `nbytes` (== numel x itemsize)."""

    offset: int
    nbytes: int


def tensor_infos(state_dict: Mapping[str, torch.Tensor], path: Path | None = None) -> dict[str, TensorInfo]:
    """name -> TensorInfo of every tensor of `state_dict` (held in `path`, if known)."""
    return {k: TensorInfo(k, path, v.dtype, tuple(v.shape)) for k, v in state_dict.items()}


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
        CheckpointError: listing missing and unexpected keys, shape mismatches, or tensors whose
            dtype cannot load (see `check_tensors`).
    """
    check_tensors(module.state_dict(keep_vars=True), tensor_infos(state_dict), component)
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


def load_on_meta(factory: Callable[[], M], state_dict: dict[str, torch.Tensor], component: str,
                 dtype: torch.dtype | None = None) -> M:
    """Build a network on the meta device, load `state_dict` strictly (`assign_state_dict`), put it
    in eval mode without gradients, and log one line with its tensors, GiB and seconds.

    Raises:
        CheckpointError: listing missing / unexpected keys or shape mismatches.
    """
    start = time.perf_counter()
    module = build_on_meta(factory)
    assign_state_dict(module, state_dict, component=component, dtype=dtype)
    module.eval().requires_grad_(False)
    gib = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30
    logger.info(f"{component}: loaded {len(state_dict)} tensors ({gib:.3f} GiB) in {time.perf_counter() - start:.2f} s")
    return module

def check_tensors(expected: Mapping[str, torch.Tensor], found: Mapping[str, TensorInfo], component: str) -> None:
    """Refuse checkpoint tensors that cannot load into a network, naming the file and the tensor.

    Loadable means: exactly the network's names, each with the network's shape, and a floating
    dtype exactly where the network has one. Casts between floating dtypes (fp8, bf16, fp16, fp32)
    are legal: weights are cast to the compute dtype when they are bound.

    Args:
        expected: the network's tensors by name (`module.state_dict(keep_vars=True)`, meta is fine).
        found: the checkpoint's tensors by the network's names (`TensorInfo.name` keeps the name in
            the file when a layout renames them).
        component: name used in error messages (e.g. "transformer").

    Raises:
        CheckpointError: listing missing and unexpected names; else the tensors with another shape;
            else the tensors with a non-floating dtype where the network is floating (or the reverse),
            each with its file (when known), the checkpoint's and the model's shape or dtype.
    """
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{component}: checkpoint does not match the architecture; "
            f"missing keys ({len(missing)}): {short_list(missing)}; unexpected keys ({len(unexpected)}): {short_list(unexpected)}"
        )
    bad = [f"{_where(k, info)}: checkpoint {tuple(info.shape)} vs model {tuple(expected[k].shape)}"
           for k, info in found.items() if tuple(info.shape) != tuple(expected[k].shape)]
    if bad:
        raise CheckpointError(f"{component}: shape mismatch for {len(bad)} tensors: {short_list(bad)}")
    bad = [f"{_where(k, info)}: checkpoint {info.dtype} vs model {expected[k].dtype}"
           for k, info in found.items() if info.dtype.is_floating_point != expected[k].dtype.is_floating_point]
    if bad:
        raise CheckpointError(f"{component}: dtype mismatch for {len(bad)} tensors (a floating-point weight cannot "
                              f"come from an integer or bool tensor, nor the reverse): {short_list(bad)}")


def _where(name: str, info: TensorInfo) -> str:
    """`name`, with the tensor's own name in the file (when it differs) and the file (when known)."""
    renamed = f" ({info.name!r} in the file)" if info.name != name else ""
    return f"{name}{renamed}" + (f" in {info.path}" if info.path is not None else "")


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


def own_cpu_memory(module: M) -> M:
    """Rebind every CPU parameter and buffer of `module` to fresh, `CPU_ALIGNMENT`-aligned memory of
    its own (`to_compute`), in place; tensors on other devices are left as they are.

    For modules a library loaded (transformers' `from_pretrained` leaves float32 CPU weights aliasing
    the safetensors mapping, at whatever alignment the file gives): CPU kernels round by alignment,
    and a weight aliasing a file reads whatever the file holds later.

    Returns:
        `module`.
    """
    done: dict[int, torch.Tensor] = {}  # tied tensors (one object under several names) stay tied
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if t is None or t.device.type != "cpu":
            continue
        module_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(module_name)
        if id(t) not in done:
            fresh = to_compute(t.detach())
            done[id(t)] = nn.Parameter(fresh, requires_grad=t.requires_grad) if leaf in owner._parameters else fresh
        if leaf in owner._parameters:
            owner._parameters[leaf] = done[id(t)]
        else:
            owner._buffers[leaf] = done[id(t)]
    return module


def short_list(items: list[str], limit: int = 12) -> str:
    """'a, b, c, ... (+N more)' for error messages that list names."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "") if items else "none"


def loading_info_problems(info: dict) -> list[str]:
    """What transformers' `from_pretrained(..., output_loading_info=True)` reports as not loaded, one
    line per kind (missing, unexpected and mismatched keys, errors; mismatched entries are (name,
    checkpoint shape, model shape)), each listing its keys (`short_list`). Empty: everything loaded."""
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        items = sorted(k if isinstance(k, str) else " ".join(map(str, k)) for k in info.get(kind) or ())
        if items:
            problems.append(f"{kind.replace('_', ' ')} ({len(items)}): {short_list(items)}")
    return problems


# ---- readers: every damaged file is refused here, naming the file (and the tensor) ------------------
def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path` (a config, an index, ...).

    Raises:
        CheckpointError: `{what}: {path} ...` when the file is missing, not UTF-8, not JSON, or not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what}: {path} does not exist")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{what}: {path} is not UTF-8 text (byte {exc.start}); the file is damaged") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{what}: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {path} must hold a JSON object, not {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words ('an array', 'a string', ...)."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def read_safetensors_header(fd: int, path: Path) -> tuple[int, dict[str, TensorIndexEntry]]:
    """Read and check the header of an open safetensors file: the one header check of every loader.

    Format (safetensors spec): 8 bytes little-endian u64 N, N bytes of UTF-8 JSON
    {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the
    tensor bytes; a tensor's bytes are [8 + N + begin, 8 + N + end) of the file. Refused (as the
    safetensors library refuses them): N over MAX_HEADER_BYTES or past the end of the file; a header
    that is not UTF-8, not JSON or not an object; `__metadata__` that is not an object
    of strings; an entry without a known `dtype`, a `shape` of non-negative integers or
    `data_offsets` [begin, end] of integers with begin <= end; end - begin != numel x itemsize; a
    byte range past the end of the file; byte ranges that overlap, leave a hole, or leave bytes after
    the last tensor (the data must be exactly the tensors, one after the other).

    Returns:
        (byte offset where tensor data starts, name -> entry in file order; `offset` is absolute).

    Raises:
        CheckpointError: naming `path`, and the tensor where there is one.
    """
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {n} bytes exceeds {MAX_HEADER_BYTES}; not a safetensors file?")
    if 8 + n > size:
        raise CheckpointError(f"{path}: header length {n} bytes runs past the end of the {size}-byte file; "
                              "the file is truncated or not safetensors")
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise CheckpointError(f"{path}: header truncated ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: header is not UTF-8 (byte {exc.start}); not a safetensors file") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is {_json_kind(header)}, not a JSON object; not a safetensors file")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: header `__metadata__` must be an object of strings (got {str(metadata)[:80]})")
    data_start = 8 + n
    entries = sorted((_header_entry(path, name, meta, data_start) for name, meta in header.items()),
                     key=lambda e: (e.offset, e.nbytes))
    for e in entries:
        if e.offset + e.nbytes > size:
            raise CheckpointError(f"{path}: tensor {e.name!r} bytes [{e.offset}, {e.offset + e.nbytes}) run past the "
                                  f"end of the {size}-byte file; the file is truncated")
    end = data_start  # where the previous tensor's bytes end (absolute)
    for previous, e in zip([None, *entries], entries):
        if e.offset < end:
            assert previous is not None, "the first tensor starts at or after the data start"
            raise CheckpointError(f"{path}: tensor {e.name!r} data_offsets [{e.offset - data_start}, "
                                  f"{e.offset - data_start + e.nbytes}] overlap tensor {previous.name!r} "
                                  f"[{previous.offset - data_start}, {end - data_start}]")
        if e.offset > end:
            raise CheckpointError(f"{path}: bytes [{end - data_start}, {e.offset - data_start}) of the data, before "
                                  f"tensor {e.name!r}, belong to no tensor (safetensors data has no holes)")
        end = e.offset + e.nbytes
    if end != size:
        raise CheckpointError(f"{path}: {size - end} bytes after the last tensor belong to no tensor")
    return data_start, {e.name: e for e in entries}


def _header_entry(path: Path, name: str, meta: Any, data_start: int) -> TensorIndexEntry:
    """One checked header entry of tensor `name` (see `read_safetensors_header`)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: header entry is {_json_kind(meta)}, not a JSON object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in meta]
    if missing:
        raise CheckpointError(f"{where}: header entry lacks {missing} (it has {sorted(meta)})")
    dtype = SAFETENSORS_DTYPES.get(meta["dtype"]) if isinstance(meta["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{where} has dtype {meta['dtype']!r}; supported: {sorted(SAFETENSORS_DTYPES)}")
    shape, offsets = meta["shape"], meta["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int and x >= 0 for x in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end] with integers 0 <= begin <= end")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * torch.empty((), dtype=dtype, device="meta").element_size()
    if end - begin != expected:
        raise CheckpointError(f"{where}: byte range [{begin}, {end}) does not hold {dtype} {shape} ({expected} bytes)")
    return TensorIndexEntry(name=name, path=Path(path), dtype=dtype, shape=tuple(shape), offset=data_start + begin,
                            nbytes=end - begin)


def safetensors_header(path: Path, component: str) -> tuple[dict[str, TensorIndexEntry], dict[str, str]]:
    """The tensors (`safetensors_infos`) and the `__metadata__` object ({} when it has none) of safetensors file
    `path`, its header checked once (`read_safetensors_header`); read, not mapped.

    Raises:
        CheckpointError: naming `component` and `path`: missing or damaged.
    """
    path = Path(path)
    infos = safetensors_infos([path], component)
    fd = os.open(path, os.O_RDONLY)
    try:
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        return infos, json.loads(os.pread(fd, n, 8)).get("__metadata__") or {}
    finally:
        os.close(fd)


def safetensors_metadata(path: Path, component: str) -> dict[str, str]:
    """The `__metadata__` object of safetensors file `path` (`safetensors_header`)."""
    return safetensors_header(path, component)[1]


def safetensors_infos(files: Iterable[Path], component: str) -> dict[str, TensorIndexEntry]:
    """Every tensor of `files` from their checked headers (one short-lived handle at a time).

    Raises:
        CheckpointError: a file is missing or damaged (see `read_safetensors_header`), or a tensor
            is in two files.
    """
    out: dict[str, TensorIndexEntry] = {}
    for path in files:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{component}: checkpoint file {path} does not exist")
        fd = os.open(path, os.O_RDONLY)
        try:
            _, entries = read_safetensors_header(fd, path)
        except CheckpointError as exc:
            raise CheckpointError(f"{component}: {exc}") from None
        finally:
            os.close(fd)
        for name, entry in entries.items():
            if name in out:
                raise CheckpointError(f"{component}: tensor {name!r} appears in two files: {out[name].path} and {path}")
            out[name] = entry
    return out


def read_shard_index(path: Path, component: str = "checkpoint") -> dict[str, str]:
    """The `weight_map` (tensor name -> shard file name) of a `*.safetensors.index.json`.

    Raises:
        CheckpointError: `{component}: shard index {path} ...`: not a JSON object, no `weight_map`
            object of strings, or a shard that is not a `.safetensors` file name in the index's folder.
    """
    what = f"{component}: shard index"
    index = read_json_object(path, what)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{what} {path} has no `weight_map` object of tensor name -> shard file "
                              f"(keys: {sorted(index)})")
    for name, shard in weight_map.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors") and Path(shard).name == shard):
            raise CheckpointError(f"{what} {path} places tensor {name!r} in {shard!r}, which is not a "
                                  ".safetensors file name in the index's folder")
    return weight_map


def safetensors_files(folder: Path, stem: str | None = None, component: str = "checkpoint") -> list[Path]:
    """The safetensors files of a folder: the shards its `*.safetensors.index.json` names (their
    headers checked against it), or every `{stem}*.safetensors` when there is no index.

    Raises:
        CheckpointError: starting with `component`: the index is damaged (see `read_shard_index`),
            names a shard that does not exist or is damaged, or places a tensor in a shard whose
            header lacks it.
    """
    folder = Path(folder)
    index = sorted(folder.glob("*.safetensors.index.json"))
    if not index:
        return sorted(folder.glob(f"{stem}*.safetensors" if stem else "*.safetensors"))
    weight_map = read_shard_index(index[0], component)
    files = [folder / name for name in sorted(set(weight_map.values()))]
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{component}: shard index {index[0]} names shard {path.name}, which does not exist")
        held = safetensors_infos([path], component)
        lacking = sorted(name for name, shard in weight_map.items() if shard == path.name and name not in held)
        if lacking:
            raise CheckpointError(f"{component}: shard index {index[0]} places {len(lacking)} tensors in {path.name}, "
                                  f"whose header lacks them: {short_list(lacking)}")
    return files


def read_safetensors(files: Iterable[Path], component: str) -> dict[str, torch.Tensor]:
    """Read every tensor of `files` (one handle open at a time).

    Every header is checked first by `read_safetensors_header`, as the disk streaming reader checks
    it, so a damaged file is refused with the same message in every offload mode. The tensors alias
    the files' mappings, at whatever alignment their file offsets give: bind them to modules through
    `assign_state_dict` / `to_compute`, which align them.

    Raises:
        CheckpointError: no files; a file missing or damaged, naming it (and the tensor); a tensor
            in two files.
    """
    files = list(files)
    if not files:
        raise CheckpointError(f"{component}: no .safetensors files found (is the checkpoint folder complete?)")
    safetensors_infos(files, component)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        except Exception as exc:  # what the header check lets through and the safetensors library still refuses
            raise CheckpointError(f"{component}: cannot read {path} ({type(exc).__name__}: {exc}); the file is "
                                  "truncated or not safetensors") from None
    return out


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6 is a zip archive


def read_pth(path: Path, component: str) -> dict[str, torch.Tensor]:
    """Read a `.pth` state dict with `torch.load(weights_only=True)` (no pickled code runs).

    Memory-mapped (zip format; the legacy format is read whole): a tensor saved as a view of a larger
    storage starts at its offset in that storage (any alignment); bind through `assign_state_dict` /
    `to_compute`, which align it.

    Raises:
        CheckpointError: naming `path`: missing; truncated or not a torch checkpoint (torch's own
            error on one line); not a flat dict of name -> tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{component}: checkpoint file {path} does not exist")
    with open(path, "rb") as f:
        zipped = f.read(4) == _ZIP_MAGIC
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipped)
    except MemoryError:
        raise
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError, OSError, ... for damaged files
        detail = ": " + str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise CheckpointError(f"{component}: cannot read {path} ({path.stat().st_size} bytes): the file is truncated "
                              f"or not a torch checkpoint ({type(exc).__name__}{detail})") from None
    if not isinstance(sd, dict):
        raise CheckpointError(f"{component}: {path} does not hold a state dict (got {type(sd).__name__})")
    bad = [f"{k!r} ({type(v).__name__})" for k, v in sd.items()
           if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if bad:
        raise CheckpointError(f"{component}: {path} is not a state dict of name -> tensor; entries that are not "
                              f"tensors: {short_list(bad)}")
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


def marked_layout(path: Path) -> Literal["runnerkit", "diffusers"] | None:
    """The layout a checkpoint folder names by its marker file (`runnerkit.json`: runnerkit,
    `model_index.json`: diffusers), or None (a family may then look for a layout of its own).

    Raises:
        CheckpointError: `path` is missing or not a folder.
    """
    if not path.is_dir():
        raise CheckpointError(f"`model_path` {str(path)!r} does not exist or is not a folder "
                              "(set `synthetic_checkpoint` to write random weights there)")
    if (path / "runnerkit.json").is_file():
        return "runnerkit"
    if (path / "model_index.json").is_file():
        return "diffusers"
    return None

