"""Layer streaming of text encoders: skeletons of transformers models, checkpoint key maps, loading.

A text encoder streams its repeated layers through the same machinery as a transformer
(`setup.stream_module`, ARCHITECTURE §4); what differs is only how its skeleton is built and how
its checkpoint names its tensors:

    model = hf_skeleton(lambda: transformers.Gemma3TextModel(config), dtype)  # meta parameters,
                                                                              # RoPE tables computed
    key_map = prefixed_key_map(names, reader_index, RULES, "text_encoder", folder)
    streamer = stream_from_files(model, SPEC, offload, device, dtype, "text_encoder", files, key_map)

The encoder's files may hold tensors the streamed module does not take (a language-model head, a
vision tower): only the keys of `key_map` are checked and read, in both storages.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from runnerkit.config import OffloadConfig
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.layout import StreamSpec
from runnerkit.offload.setup import stream_module
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.weights import CheckpointError, short_list

M = TypeVar("M", bound=nn.Module)

KeyRules = Sequence[tuple[str, Sequence[str]]]
"""(model name prefix, file name prefixes to try in order): a model name starting with the first is
looked up in the files as each second prefix + the rest of the name."""


def hf_skeleton(factory: Callable[[], M], dtype: torch.dtype) -> M:
    """A transformers model built as `from_pretrained(..., dtype=dtype)` builds it, without weights.

    `factory` runs on the meta device with `dtype` as torch's default dtype (transformers' init
    context: buffers created from Python floats get that dtype). Non-persistent buffers (RoPE
    `inv_freq`, Gemma-3's `embed_scale`) are then materialized on the CPU and filled by the model's
    own `initialize_weights()`, the step `from_pretrained` runs for them after loading; parameters stay
    on the meta device (their initializers do nothing there). `stream_module` moves the buffers to
    the device.

    Returns:
        The model, in eval mode without gradients; every parameter on the meta device.

    Raises:
        TypeError: the model is not a transformers `PreTrainedModel` (no `initialize_weights`).
    """
    import transformers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = factory()
    finally:
        torch.set_default_dtype(previous)
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"hf_skeleton builds transformers models; got {type(model).__name__}")
    for name, buf in list(model.named_non_persistent_buffers()):
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._buffers[leaf] = torch.empty_like(buf, device="cpu")
    model.initialize_weights()
    return model.eval().requires_grad_(False)


def prefixed_key_map(names: Sequence[str], available: Collection[str], rules: KeyRules, component: str,
                     where: Path | str) -> dict[str, str]:
    """Model name -> name in the checkpoint files, by prefix rules (`KeyRules`).

    Args:
        names: the streamed module's tensor names (`state_dict` keys).
        available: the tensor names of the files (e.g. `SafetensorsDiskReader.index`).
        rules: tried in order; the first rule whose model prefix matches decides the candidates.
        where: the folder or file named in errors.

    Raises:
        CheckpointError: naming `where` and the model names no candidate was found for (listed).
    """
    out: dict[str, str] = {}
    missing = []
    for name in names:
        for model_prefix, file_prefixes in rules:
            if name.startswith(model_prefix):
                rest = name[len(model_prefix):]
                found = next((p + rest for p in file_prefixes if p + rest in available), None)
                break
        else:
            found = None
        if found is None:
            missing.append(name)
        else:
            out[name] = found
    if missing:
        raise CheckpointError(f"{component}: {where} lacks {len(missing)} tensors of the streamed module (model "
                              f"names): {short_list(missing)}")
    return out


def read_mapped(files: Sequence[Path], key_map: Mapping[str, str], reader: str = "mmap") -> dict[str, torch.Tensor]:
    """The tensors of `key_map` (model name -> file name) read from `files` into fresh CPU tensors,
    by model name; other tensors of the files are not read. No file handle stays open.

    Raises:
        CheckpointError: a damaged or missing file, or a name the files lack.
    """
    disk = SafetensorsDiskReader(files, reader=reader)  # type: ignore[arg-type]
    try:
        loaded = disk.load_tensors(key_map.values())
    finally:
        disk.close()
    return {name: loaded[key] for name, key in key_map.items()}


def stream_from_files(model: nn.Module, spec: StreamSpec, cfg: OffloadConfig, device: torch.device,
                      dtype: torch.dtype, component: str, files: Sequence[Path],
                      key_map: Mapping[str, str]) -> BlockStreamer:
    """`stream_module` of a meta-built encoder whose tensors are the `key_map` entries of `files`.

    Storage "cpu": those tensors are read once (`read_mapped`) into the resident weights and the host
    slabs, each read tensor freed once copied (`stream_module`'s `consume`: no unit is held twice but
    the one being copied); storage "disk": the streamer reads the layers from the files at every
    fetch. Other
    tensors of the files (a head, a vision tower the module does not hold) are neither checked nor read.

    Raises:
        CheckpointError: see `stream_module` and `read_mapped`.
    """
    if cfg.storage == "cpu":
        return stream_module(model, spec, cfg, device, dtype, component,
                             state_dict=read_mapped(files, key_map, cfg.reader), consume=True)
    return stream_module(model, spec, cfg, device, dtype, component, files=list(files), key_map=key_map,
                         shared_files=True)


__all__ = ["KeyRules", "hf_skeleton", "prefixed_key_map", "read_mapped", "stream_from_files"]
