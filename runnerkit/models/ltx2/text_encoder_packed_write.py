"""Writing Lightricks' packed Gemma-4 text-encoder format (text_encoder_packed.py) for synthetic release checkpoints.

`pack_gemma4_folder` turns a Gemma-4 transformers folder with its tokenizer (the tiny synthetic one) into the packed
file, `write_packed_gemma4` writes a random Gemma-4 of any size straight into one (the 12B stand-in: no folder, one
tensor in host memory at a time). Both embed the config as metadata `gemma_config`, tokenizer.json as the uint8
tensor `tokenizer_json` and every other `*.json` / `*.jinja` of the tokenizer as `hf_asset__<name>`, and add the
given connector tensors (the release's "with-proj": `text_embedding_projection.*`). The weights are named as the
release's packer names them by default, ComfyUI's flat naming (`model.language_model.*` -> `model.*`, the towers
renamed), or kept in transformers' names (`naming` "transformers"); the reader takes both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from runnerkit.files import give_default_mode
from runnerkit.models.ltx2.text_encoder_packed import ASSET_PREFIX, GEMMA_CONFIG_KEY, TOKENIZER_TENSOR
from runnerkit.weights import SAFETENSORS_DTYPES, safetensors_files

__all__ = ["comfy_name", "pack_gemma4_folder", "write_safetensors_streamed"]

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_COMFY_RENAMES = (("model.language_model.", "model."), ("model.vision_embedder.", "vision_model."),
                  ("model.embed_vision.", "multi_modal_projector."), ("model.embed_audio.", "audio_projector."))

Entry = tuple[tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]
"""(shape, dtype, producer): a tensor to write, made only when its bytes are written."""


def comfy_name(key: str) -> str:
    """A transformers `Gemma4UnifiedForConditionalGeneration` key in ComfyUI's flat naming (the release's)."""
    for theirs, comfy in _COMFY_RENAMES:
        if key.startswith(theirs):
            return comfy + key[len(theirs):]
    return key


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_safetensors_streamed(path: Path, entries: Mapping[str, Entry], metadata: dict[str, str]) -> None:
    """A safetensors file of `entries` written tensor by tensor (the header from the shapes first), so only one
    tensor is in host memory at a time. Tensors are laid out widest dtype first (then by name), as the safetensors
    library lays them out, so every tensor's bytes are aligned to its element size.

    Raises:
        ValueError: a producer's tensor differs from its entry's shape or dtype (naming it).
    """
    order = sorted(entries, key=lambda k: (-entries[k][1].itemsize, k))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key in order:
        shape, dtype, _ = entries[key]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for key in order:
            shape, dtype, produce = entries[key]
            tensor = produce()
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{key}: produced {tensor.dtype} {list(tensor.shape)}, planned {dtype} {list(shape)}")
            f.write(_bytes(tensor))
    give_default_mode(path)


def _uint8(data: bytes) -> Entry:
    return (len(data),), torch.uint8, lambda: torch.frombuffer(bytearray(data), dtype=torch.uint8)


def asset_entries(tokenizer_folder: Path) -> dict[str, Entry]:
    """tokenizer.json as `tokenizer_json` and the folder's other `*.json` / `*.jinja` (config.json excepted) as
    `hf_asset__<name>` (ltx-core's packer collects the same files)."""
    out = {TOKENIZER_TENSOR: _uint8((tokenizer_folder / "tokenizer.json").read_bytes())}
    for file in sorted([*tokenizer_folder.glob("*.json"), *tokenizer_folder.glob("*.jinja")]):
        if file.name not in ("config.json", "tokenizer.json") and not file.name.endswith(".index.json"):
            out[ASSET_PREFIX + file.name] = _uint8(file.read_bytes())
    return out


def write_packed_gemma4(out: Path, config: dict, weights: Mapping[str, Entry], tokenizer_folder: Path,
                        projection: Mapping[str, torch.Tensor], naming: str = "comfy") -> Path:
    """The packed file `out`: `weights` (transformers' names, renamed per `naming`: "comfy" or "transformers"),
    `projection` (connector tensors, as named in the release), the tokenizer files of `tokenizer_folder` and
    `config` as metadata `gemma_config`.

    Raises:
        ValueError: `naming` is neither "comfy" nor "transformers".
    """
    if naming not in ("comfy", "transformers"):
        raise ValueError(f"`naming` must be 'comfy' or 'transformers', got {naming!r}")
    rename = comfy_name if naming == "comfy" else (lambda key: key)
    entries = {rename(k): e for k, e in weights.items()}
    entries |= {k: (tuple(v.shape), v.dtype, lambda v=v: v) for k, v in projection.items()}
    entries |= asset_entries(tokenizer_folder)
    write_safetensors_streamed(out, entries, {"format": "pt", GEMMA_CONFIG_KEY: json.dumps(config)})
    return out


def pack_gemma4_folder(folder: Path, out: Path, projection: Mapping[str, torch.Tensor],
                       naming: str = "comfy") -> Path:
    """Pack a Gemma-4 transformers folder holding its tokenizer (config.json, `*.safetensors`, tokenizer.json,
    tokenizer_config.json, ...) into the packed file `out` (`write_packed_gemma4`); its tensors are read one at a
    time."""
    weights: dict[str, Entry] = {}
    for file in safetensors_files(folder, component="text_encoder"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 -- safe_open is not a Mapping
                sliced = handle.get_slice(key)
                dtype = SAFETENSORS_DTYPES[sliced.get_dtype()]
                weights[key] = (tuple(sliced.get_shape()), dtype,
                                lambda file=file, key=key: _read_one(file, key))
    config = json.loads((folder / "config.json").read_text())
    return write_packed_gemma4(out, config, weights, folder, projection, naming)


def _read_one(file: Path, key: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(key)
