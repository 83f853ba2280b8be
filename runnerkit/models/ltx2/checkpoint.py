"""LTX-2 checkpoints: the single-file release and the diffusers folder, loaded into our networks.

Layouts:

- "single_file": one `*.safetensors` holding the transformer, text connectors, video VAE, audio VAE
  and vocoder under the prefixes of `checkpoint_keys` (the safetensors metadata entry `config` holds
  the architecture, in ltx-core's names in Lightricks' files or in runnerkit's sections format,
  `release_config.arch_from_single_file_config`), the x2 latent upsampler in a `.safetensors` of its own
  (diffusers' tensor names; its metadata `config` is the upsampler's), and the Gemma-3 text encoder
  with its tokenizer in a folder of its own (`text_encoder_path`: it must hold a config.json and a
  tokenizer file; its config.json sizes the text connectors of a release config, as in ltx-core; the
  weights are not read here).
- "diffusers": a folder with `transformer/`, `connectors/`, `vae/`, `audio_vae/`, `vocoder/`,
  `latent_upsampler/` (config.json + safetensors, sharded with a `*.safetensors.index.json` or not),
  `text_encoder/` and `tokenizer/`.

Every network is built on the meta device and loaded strictly with `assign=True`; a key mismatch
lists every missing and every unexpected key, in the file's names, with the file(s).

fp8 (float8_e4m3fn) tensors, as Lightricks' `*-fp8.safetensors` releases store the transformer's
linear weights, are supported in two forms: without a scale (the value is the weight), and with a
per-tensor float32 scale stored next to the weight as `<module>.weight_scale` (weight = fp8 x scale),
the ltx-core / ComfyUI convention; a `<module>.input_scale` (activation scale of fp8 matmuls) is
accepted and not used. `state_dict` returns them as fp8 storage plus the scales; `load(dtype=...)`
upcasts them for compute (`fp8 -> float32`, exact, times the scale in float32, rounded once to
`dtype`). Streamed from disk (offload block/phase, storage disk), fp8 block weights cross to the
device as stored, with their scales (`transformer_block_sources().scale_map`), and are upcast there
the same way (`offload.sources.DiskSource`). Not supported: other scale shapes (per-channel,
block-wise), float8_e5m2 with scales.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import ValidationError
from torch import nn

from runnerkit.arch import component_files, refuse_disagreements
from runnerkit.config import format_validation_error
from runnerkit.models.ltx2 import checkpoint_keys as ck
from runnerkit.models.ltx2.arch import COMPONENTS, LTX2Arch
from runnerkit.models.ltx2.audio_arch import LTX2VocoderBWEArch
from runnerkit.models.ltx2.audio_vae import LTX2AudioVAEDecoder
from runnerkit.models.ltx2.connectors import LTX2TextConnectors
from runnerkit.models.ltx2.release_config import arch_from_single_file_config, is_release_config
from runnerkit.models.ltx2.transformer import LTX2Transformer, keep_fp32
from runnerkit.models.ltx2.upsampler import LTX2LatentUpsampler
from runnerkit.models.ltx2.vae import LTX2VideoVAE
from runnerkit.models.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.layout import StreamUnit, plan_units
from runnerkit.weights import (
    CheckpointError,
    TensorIndexEntry,
    assign_state_dict,
    build_on_meta,
    check_tensors,
    read_json_object,
    safetensors_files,
    safetensors_infos,
    safetensors_metadata,
)

Layout = Literal["single_file", "diffusers"]
SCALE_SUFFIX = "weight_scale"
UNUSED_SCALE_SUFFIX = "input_scale"
DIFFUSERS_STEM = "diffusion_pytorch_model"


def network_factory(component: str, arch: LTX2Arch) -> Callable[[], nn.Module]:
    """The constructor of `component`'s network (build it with `weights.build_on_meta`)."""
    vocoder = arch.vocoder
    factories: dict[str, Callable[[], nn.Module]] = {
        "transformer": lambda: LTX2Transformer(arch.transformer),
        "connectors": lambda: LTX2TextConnectors(arch.connectors),
        "vae": lambda: LTX2VideoVAE(arch.vae),
        "audio_vae": lambda: LTX2AudioVAEDecoder(arch.audio_vae),
        "vocoder": lambda: LTX2VocoderWithBWE(vocoder) if isinstance(vocoder, LTX2VocoderBWEArch)
        else LTX2Vocoder(vocoder),
        "latent_upsampler": lambda: LTX2LatentUpsampler(arch.latent_upsampler),
    }
    if component not in factories:
        raise ValueError(f"`component`={component!r}; allowed: {list(factories)}")
    return factories[component]


@dataclass(frozen=True)
class BlockSource:
    """Where transformer block `index` lives: the file(s) holding its tensors and their keys in the file,
    in the order of the network's state dict."""

    index: int
    files: tuple[Path, ...]
    keys: tuple[str, ...]


@dataclass(frozen=True)
class BlockSources:
    """Disk streaming of the transformer, in the terms `offload.setup.stream_module` takes
    (`files`, `key_map`) plus the streamed units and, per block, its file(s) and keys."""

    files: list[Path]
    key_map: dict[str, str]
    """Every transformer tensor: model name -> key in the file."""
    scale_map: dict[str, str]
    """Every scaled fp8 weight: model name -> key of its float32 per-tensor scale in the file."""
    units: list[StreamUnit]
    """`plan_units(model, "block", LTX2Transformer.STREAM_SPEC)`: streamed parameters per block."""
    blocks: list[BlockSource]


def read_metadata_config(path: Path, component: str) -> dict:
    """The JSON object in the `config` metadata entry of safetensors file `path`.

    Raises:
        CheckpointError: naming `path`: missing, no `config` entry, or not a JSON object.
    """
    if not path.is_file():
        raise CheckpointError(f"{component}: checkpoint file {path} does not exist")
    metadata = safetensors_metadata(path, component)  # a damaged header is refused here, naming the file
    if "config" not in metadata:
        raise CheckpointError(f"{component}: {path} has no `config` metadata entry (has {sorted(metadata)}); "
                              "pass `arch` explicitly")
    try:
        config = json.loads(metadata["config"])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{component}: {path}: metadata `config` is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{component}: {path}: metadata `config` is not a JSON object")
    return config


@dataclass
class LTX2Checkpoint:
    """A located checkpoint: layout, paths, architecture and the tensor index of its files."""

    layout: Layout
    path: Path
    """The single `.safetensors` file, or the diffusers folder."""
    arch: LTX2Arch
    upsampler_path: Path
    """The upsampler `.safetensors` (single file), or the `latent_upsampler/` folder (diffusers)."""
    text_encoder_path: Path
    """The Gemma-3 folder (transformers `save_pretrained` layout)."""
    _index: dict[str, dict[str, TensorIndexEntry]] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path, upsampler_path: str | Path | None = None,
             text_encoder_path: str | Path | None = None, arch: LTX2Arch | None = None) -> LTX2Checkpoint:
        """A `.safetensors` file is the single-file layout (then `upsampler_path` and `text_encoder_path` are
        required), a folder the diffusers layout. `arch` replaces the architecture read from the checkpoint.

        Raises:
            CheckpointError: a missing file or folder (naming the path), a damaged header, a config that
                the architecture refuses, or single-file keys under no known prefix (listed).
        """
        path = Path(path)
        if path.suffix == ".safetensors":
            if upsampler_path is None or text_encoder_path is None:
                raise CheckpointError(f"single-file checkpoint {path}: `upsampler_path` and `text_encoder_path` "
                                      "are required (the release ships them as separate files)")
            return cls._open_single_file(path, Path(upsampler_path), Path(text_encoder_path), arch)
        return cls._open_diffusers(path, arch)

    @classmethod
    def _open_single_file(cls, path: Path, upsampler: Path, text_encoder: Path,
                          arch: LTX2Arch | None) -> LTX2Checkpoint:
        if not upsampler.is_file():
            raise CheckpointError(f"latent_upsampler: upsampler file {upsampler} does not exist")
        _check_text_encoder(text_encoder)
        _check_tokenizer(text_encoder, "the Gemma-3 folder (`text_encoder_path`)")
        if arch is None:
            config = read_metadata_config(path, "checkpoint")
            up_config = read_metadata_config(upsampler, "latent_upsampler")
            gemma = None
            if is_release_config(config):  # ltx-core sizes the text connectors' input from the Gemma-3 config
                gemma = read_json_object(text_encoder / "config.json", "text_encoder")
            arch = _arch(lambda: arch_from_single_file_config(config, up_config, str(path), gemma),
                         f"metadata `config` of {path} and {upsampler}")
        infos = safetensors_infos([path], "checkpoint")
        stray = sorted(k for k in infos if ck.owner(k) is None)
        if stray:
            raise CheckpointError(f"{path}: {len(stray)} tensors under no known prefix (LTX-2.5 parts such as "
                                  f"`duration_head.` are not covered): {stray}")
        index: dict[str, dict[str, TensorIndexEntry]] = {c: {} for c in COMPONENTS}
        for key, entry in infos.items():
            index[str(ck.owner(key))][key] = entry
        index["latent_upsampler"] = dict(safetensors_infos([upsampler], "latent_upsampler"))
        return cls("single_file", path, arch, upsampler, text_encoder, index)

    @classmethod
    def _open_diffusers(cls, path: Path, arch: LTX2Arch | None) -> LTX2Checkpoint:
        if not path.is_dir():
            raise CheckpointError(f"`model_path` {path} is neither a .safetensors file nor a folder")
        for sub in (*COMPONENTS, "text_encoder", "tokenizer"):
            if not (path / sub).is_dir():
                raise CheckpointError(f"diffusers checkpoint {path}: folder {path / sub} does not exist")
        _check_text_encoder(path / "text_encoder")
        _check_tokenizer(path / "tokenizer", "tokenizer folder")
        if arch is None:
            arch = _arch(lambda: LTX2Arch.from_diffusers_folder(path), f"config.json files of {path}")
        index = {}
        for component in COMPONENTS:
            files = safetensors_files(path / component, component=component)
            if not files:
                raise CheckpointError(f"{component}: no .safetensors files in {path / component}")
            index[component] = dict(safetensors_infos(files, component))
        return cls("diffusers", path, arch, path / "latent_upsampler", path / "text_encoder", index)

    @property
    def tokenizer_path(self) -> Path:
        """The Gemma-3 tokenizer folder: `tokenizer/` (diffusers), or the Gemma folder itself (single file:
        google/gemma-3-12b-it holds its tokenizer next to the model)."""
        return self.path / "tokenizer" if self.layout == "diffusers" else self.text_encoder_path

    # ---- names ----------------------------------------------------------------------------------
    def key_map(self, component: str, names: list[str]) -> dict[str, str]:
        """model name -> key in the file (identity for the diffusers layout and the upsampler)."""
        if self.layout == "diffusers" or component == "latent_upsampler":
            return {n: n for n in names}
        return ck.native_names(component, names, self.arch)

    def files(self, component: str) -> list[Path]:
        """The safetensors file(s) holding `component`."""
        return sorted({e.path for e in self._index[component].values()})

    def _ignored(self, component: str, key: str) -> bool:
        if self.layout == "single_file":
            return ck.ignored(component, key)
        return component == "audio_vae" and key.startswith("encoder.")  # our audio VAE is its decoder

    def _plan(self, component: str,
              module: nn.Module | None = None) -> tuple[nn.Module, dict[str, str], dict[str, str]]:
        """(meta-built network, model name -> file key, model name -> file key of its fp8 scale), after
        checking the file keys against the network: every missing and unexpected key is listed.
        `module`: the caller's meta-built network of this architecture (built here if None)."""
        module = module if module is not None else build_on_meta(network_factory(component, self.arch))
        expected = module.state_dict(keep_vars=True)
        kmap = self.key_map(component, list(expected))
        infos = self._index[component]
        scales = {n: k[: -len("weight")] + SCALE_SUFFIX for n, k in kmap.items()
                  if k.endswith(".weight") and k[: -len("weight")] + SCALE_SUFFIX in infos}
        claimed = set(kmap.values()) | set(scales.values())
        claimed |= {k[: -len("weight")] + UNUSED_SCALE_SUFFIX for k in kmap.values() if k.endswith(".weight")}
        missing = [k for k in kmap.values() if k not in infos]
        unexpected = sorted(k for k in infos if k not in claimed and not self._ignored(component, k))
        if missing or unexpected:
            raise CheckpointError(f"{component}: {', '.join(map(str, self.files(component)))} does not match the "
                                  f"architecture; missing keys ({len(missing)}): {missing}; "
                                  f"unexpected keys ({len(unexpected)}): {unexpected}")
        check_tensors(expected, {n: infos[k] for n, k in kmap.items()}, component)
        for n, s in scales.items():
            entry, scale = infos[kmap[n]], infos[s]
            if entry.dtype != torch.float8_e4m3fn or scale.shape not in ((), (1,)):
                raise CheckpointError(f"{component}: {s!r} in {scale.path}: a scale {scale.shape} of a {entry.dtype} "
                                      "weight; only per-tensor scales of float8_e4m3fn weights are supported")
        return module, kmap, scales

    # ---- loading --------------------------------------------------------------------------------
    def state_dict(self, component: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(model name -> tensor as stored, fp8 included; model name -> float32 scale of its fp8 weight).

        Raises:
            CheckpointError: see `_plan`; a damaged or changed file.
        """
        _, kmap, scales = self._plan(component)
        return self._read_planned(component, kmap, scales)

    def _read_planned(self, component: str, kmap: dict[str, str],
                      scales: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`state_dict` of a component already planned (`_plan`'s key maps)."""
        wanted = list(kmap.values()) + list(scales.values())
        by_file: dict[Path, list[str]] = {}
        for key in wanted:
            by_file.setdefault(self._index[component][key].path, []).append(key)
        loaded: dict[str, torch.Tensor] = {}
        for path, keys in by_file.items():  # one reader (and at most one open handle) at a time
            reader = SafetensorsDiskReader([path])
            try:
                loaded.update(reader.load_tensors(keys))
            finally:
                reader.close()
        return ({n: loaded[k] for n, k in kmap.items()},
                {n: loaded[s].float().reshape(()) for n, s in scales.items()})

    def fp8_weights(self, component: str, names: list[str]) -> frozenset[str]:
        """The names among `names` (model names) that the checkpoint stores as float8_e4m3fn, from the
        headers (nothing read; names the checkpoint lacks are left out)."""
        infos = self._index[component]
        return frozenset(n for n, k in self.key_map(component, names).items()
                         if k in infos and infos[k].dtype == torch.float8_e4m3fn)

    def read_tensors(self, component: str, names: list[str]) -> dict[str, torch.Tensor]:
        """Only the tensors `names` (model names) of `component`, as stored (e.g. the VAE's latent
        statistics, without reading its weights).

        Raises:
            CheckpointError: a name the checkpoint does not hold (listed).
        """
        kmap = self.key_map(component, names)
        missing = [n for n in names if kmap[n] not in self._index[component]]
        if missing:
            raise CheckpointError(f"{component}: {', '.join(map(str, self.files(component)))} holds no {missing}")
        reader = SafetensorsDiskReader(sorted({self._index[component][kmap[n]].path for n in names}))
        try:
            loaded = reader.load_tensors([kmap[n] for n in names])
        finally:
            reader.close()
        return {n: loaded[kmap[n]] for n in names}

    def load(self, component: str, dtype: torch.dtype | None = None, device: torch.device | None = None) -> nn.Module:
        """`component`'s network with the checkpoint's weights (built on meta, strict, assign=True).

        Args:
            dtype: compute dtype of floating weights (None: as stored); the transformer's float32 layers
                (`transformer.keep_fp32`) stay float32. fp8 weights are upcast (module docstring).
            device: where the weights go (None: the CPU).

        Raises:
            CheckpointError: see `_plan`.
            ValueError: scaled fp8 weights without a `dtype` (a scale cannot be kept in an nn.Linear).
        """
        module, kmap, scale_keys = self._plan(component)  # one meta build and key check per load
        tensors, scales = self._read_planned(component, kmap, scale_keys)
        if scales and dtype is None:
            raise ValueError(f"{component}: {len(scales)} fp8 weights carry scales; pass `dtype` to upcast them")
        fp32 = keep_fp32 if component == "transformer" else (lambda name: False)
        for name, scale in scales.items():
            tensors[name] = (tensors[name].float() * scale).to(torch.float32 if fp32(name) else dtype)
        return assign_state_dict(module, tensors, component, dtype, fp32, device)

    def stream_sources(self, component: str,
                       module: nn.Module | None = None) -> tuple[list[Path], dict[str, str], dict[str, str]]:
        """(files, model name -> key in the files, model name -> key of its fp8 scale) of `component`,
        the terms in which `offload.setup.stream_module` streams it from disk; `module`: its meta-built
        network (built here if None). Nothing is read but the headers.

        Raises:
            CheckpointError: see `_plan`.
        """
        _, kmap, scales = self._plan(component, module)
        return self.files(component), kmap, scales

    def transformer_block_sources(self, module: LTX2Transformer | None = None) -> BlockSources:
        """The transformer's block layout for streaming from disk; `module`: the meta-built transformer that
        will stream (built here if None; passing it saves a second build per streamed transformer).

        Raises:
            CheckpointError: see `_plan`.
        """
        module, kmap, scales = self._plan("transformer", module)
        blocks_attr = LTX2Transformer.STREAM_SPEC.blocks_attr
        infos = self._index["transformer"]
        blocks = []
        for i in range(self.arch.transformer.num_layers):
            keys = tuple(k for n, k in kmap.items() if n.startswith(f"{blocks_attr}.{i}."))
            blocks.append(BlockSource(i, tuple(sorted({infos[k].path for k in keys})), keys))
        return BlockSources(self.files("transformer"), kmap, scales,
                            plan_units(module, "block", LTX2Transformer.STREAM_SPEC), blocks)


#: Files of which a tokenizer folder must hold one (a Gemma-3 download has both).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _check_text_encoder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"text_encoder: Gemma-3 folder {path} does not exist or has no config.json")


def _check_tokenizer(path: Path, where: str) -> None:
    """transformers' `AutoTokenizer` builds an empty tokenizer from a folder with only a config.json
    (every prompt then encodes to nothing), so a folder without a tokenizer file is refused here."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"tokenizer: {where} {path} holds none of {list(TOKENIZER_FILES)}")


C = TypeVar("C", bound="LTX2Checkpoint")


def open_checked(open_: Callable[[LTX2Arch | None], C], path: Path, model: dict[str, Any] | None,
                 parse: Callable[[], LTX2Arch]) -> C:
    """The checkpoint at `path` opened with its own architecture (`open_(None)`), the config's `model` checked
    against it: the checkpoint's config wins, and a `model` field with another value is an error. A single
    file whose `config` metadata cannot give the whole architecture (a release without the `vae`, `audio_vae`,
    `vocoder` sections) takes the config's (`open_(parse())`): there the checkpoint says nothing to compare.

    Raises:
        CheckpointError: a `model` field differs from the checkpoint's config, naming the field, both values and
            the files; the opener's errors.
    """
    if model is None:
        return open_(None)
    try:
        ckpt = open_(None)
    except CheckpointError:
        if path.is_dir():
            raise
        return open_(parse())
    where = component_files(path) if path.is_dir() else f"the `config` metadata of {path}"
    try:
        refuse_disagreements(model, ckpt.arch, where)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return ckpt


def _arch(read: Callable[[], LTX2Arch], where: str) -> LTX2Arch:
    try:
        return read()
    except ValidationError as exc:
        raise CheckpointError(format_validation_error(exc, f"architecture in {where}")) from None
    except (ValueError, NotImplementedError, TypeError) as exc:
        raise CheckpointError(f"architecture in {where}: {exc}") from None

