"""Lightricks' packed Gemma-4 text-encoder file (`text_encoders/gemma4-12b-with-proj-ltx-2.5-bf16.safetensors`).

The LTX-2.5 release ships its text encoder as ONE safetensors file instead of a transformers folder. Its format
(Lightricks' loader, github Lightricks/LTX-2 @ 400fd31, `packages/ltx-core/src/ltx_core/text_encoders/gemma/
gemma_assets.py`, `encoders/encoder_configurator.py`; `ltx-trainer`'s `model_loader.embedding_weight_paths`):

- metadata `gemma_config`: the transformers config.json of the Gemma model, as a JSON string
  (`model_type` "gemma4_unified" for LTX-2.5);
- tensor `tokenizer_json`: the bytes of tokenizer.json as a 1-D uint8 tensor (int8 in some packs: the same bytes);
- sidecar files (tokenizer_config.json, chat_template.jinja, processor_config.json, ...) as uint8 tensors
  `hf_asset__<file name>`, or, in older packs, as metadata strings under the file name; ltx-core requires
  tokenizer_config.json and processor_config.json; runnerkit builds no processor and requires tokenizer_config.json
  only;
- the Gemma weights, in one of the two namings ltx-core accepts (`_gemma4_unified_is_comfy_flat`): ComfyUI's flat
  one (the text model under `model.*`: `model.layers.N.*`, `model.embed_tokens.*`, `model.norm.*`; the towers as
  `vision_model.*`, `multi_modal_projector.*`, `audio_projector.*`), recognised by
  `model.layers.0.post_feedforward_layernorm.weight`; or transformers' (`model.language_model.*`,
  `model.embed_vision.*`, `model.embed_audio.*`, `model.vision_embedder.*`). Only the text model is read; the
  towers and an `lm_head.*` are never read;
- "with-proj": the text connectors' input projections `text_embedding_projection.*` (ltx-trainer: "LTX-2.5 split
  packs move the text projections into the packed text-encoder safetensors"); the connectors' 1-D transformers
  (`model.diffusion_model.{video,audio}_embeddings_connector.*`) may be there too. ltx-core builds the embeddings
  processor from the transformer file and then this file, a key of the later file replacing the same key of the
  earlier (`SafetensorsStateDictLoader.load`): a connector tensor in both is taken from this file
  (checkpoint_release25.py does the same).

Anything else in the file is refused (naming examples). The tokenizer is built from the embedded files exactly as
from a folder (`text_encoder.load_gemma_tokenizer`: transformers' `AutoTokenizer` over tokenizer.json and the
sidecars, written to a temporary folder), so a folder and its packed file tokenize alike; the config goes through
transformers' config class of its `model_type` (as `AutoConfig` reads a config.json).
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from loguru import logger

from runnerkit.config import OffloadConfig
from runnerkit.models.ltx2 import checkpoint_keys as ck
from runnerkit.models.ltx2.connectors_arch import LTX2ConnectorsArch
from runnerkit.models.ltx2.text_encoder import check_fits_connectors, load_gemma_tokenizer
from runnerkit.models.ltx2.text_encoder_gemma4 import (
    MULTIMODAL_TOKEN_FIELDS,
    _Gemma4TextTower,
    gemma4_configs,
    load_gemma4_text_encoder,
)
from runnerkit.models.ltx2.text_encoder_gemma4_stream import GEMMA4_STREAM_SPEC, stream_gemma4_text_encoder
from runnerkit.offload.encoders import hf_skeleton, prefixed_key_map, read_mapped, stream_from_files
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.weights import (
    CheckpointError,
    TensorIndexEntry,
    check_tensors,
    safetensors_header,
    short_list,
    tensor_infos,
    to_compute,
)

__all__ = ["ASSET_PREFIX", "GEMMA_CONFIG_KEY", "NAMINGS", "TOKENIZER_TENSOR", "PackedGemma4", "configs_of",
           "is_packed_file", "load_text_model", "load_tokenizer", "stream_text_model"]

GEMMA_CONFIG_KEY = "gemma_config"
"""Metadata entry holding the Gemma config.json (a JSON string)."""
TOKENIZER_TENSOR = "tokenizer_json"
"""uint8 tensor holding tokenizer.json's bytes."""
ASSET_PREFIX = "hf_asset__"
"""uint8 tensors `hf_asset__<file name>`: the other tokenizer / processor files."""
METADATA_ASSETS = ("tokenizer_config.json", "processor_config.json", "chat_template.jinja", "generation_config.json")
"""Sidecars older packs store as metadata strings (under the file name) instead of tensors."""
REQUIRED_ASSETS = ("tokenizer_config.json",)
"""Sidecars the tokenizer needs (special tokens, class)."""
NAMINGS: dict[str, str] = {"comfy": "model.", "transformers": "model.language_model."}
"""Key naming -> the prefix of the text model's keys (module docstring)."""
COMFY_PROBE = "model.layers.0.post_feedforward_layernorm.weight"
"""A key only the flat (ComfyUI) naming has: ltx-core's test for it."""
UNUSED_PREFIXES: dict[str, tuple[str, ...]] = {
    "comfy": ("vision_model.", "multi_modal_projector.", "audio_projector.", "model.vision_embedder.",
              "model.embed_vision.", "model.embed_audio.", "lm_head."),
    "transformers": ("model.vision_embedder.", "model.embed_vision.", "model.embed_audio.", "lm_head."),
}
"""Per naming: the multimodal towers' (and a language-model head's) prefixes; never read."""
GEMMA4_PACKED_TYPES = ("gemma4_unified",)


def is_packed_file(path: str | Path) -> bool:
    """Whether `text_encoder_path` names a packed file (a `.safetensors` path) rather than a transformers folder."""
    return Path(path).suffix == ".safetensors"


def read_header(path: Path) -> tuple[dict[str, TensorIndexEntry], dict[str, str]]:
    """The tensors and the `__metadata__` object of safetensors file `path` (`weights.safetensors_header`).

    Raises:
        CheckpointError: naming `path`: missing or damaged.
    """
    if not path.is_file():
        raise CheckpointError(f"text_encoder: packed Gemma-4 file {path} does not exist")
    return safetensors_header(path, "text_encoder")  # a damaged header is refused here, naming the file


@dataclass(frozen=True)
class PackedGemma4:
    """A checked packed Gemma-4 file: its config, the naming of its weights and its tensors by role (headers only;
    `open` reads no tensor)."""

    path: Path
    config: dict
    """The embedded config.json (`gemma_config`)."""
    naming: str
    """"comfy" or "transformers" (`NAMINGS`)."""
    text: dict[str, TensorIndexEntry] = field(repr=False)
    """The text model's tensors, by file key."""
    connectors: dict[str, TensorIndexEntry] = field(repr=False)
    """The text connectors' tensors it carries (`checkpoint_keys.CONNECTOR_PREFIXES`), by file key."""
    unused: dict[str, TensorIndexEntry] = field(repr=False)
    """The towers' and head's tensors (never read)."""
    assets: dict[str, TensorIndexEntry | str] = field(repr=False)
    """Embedded file name -> its uint8 tensor, or the metadata string (`METADATA_ASSETS`); tokenizer.json included."""

    @classmethod
    def open(cls, path: str | Path) -> PackedGemma4:
        """Read and check the file's header (module docstring).

        Raises:
            CheckpointError: naming the file and what is wrong: missing or damaged, no `gemma_config` metadata (or
                not a JSON object, or a `model_type` other than gemma4_unified), no `tokenizer_json` tensor, a
                required sidecar missing, no text-model weights in either naming, or tensors of no known role
                (examples listed).
        """
        path = Path(path)
        infos, metadata = read_header(path)
        where = f"text_encoder: packed Gemma-4 file {path}"
        if GEMMA_CONFIG_KEY not in metadata:
            raise CheckpointError(f"{where} has no `{GEMMA_CONFIG_KEY}` metadata entry (the Gemma config.json; "
                                  f"metadata holds {sorted(metadata)})")
        try:
            config = json.loads(metadata[GEMMA_CONFIG_KEY])
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{where}: metadata `{GEMMA_CONFIG_KEY}` is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{where}: metadata `{GEMMA_CONFIG_KEY}` is not a JSON object")
        if config.get("model_type") not in GEMMA4_PACKED_TYPES:
            raise CheckpointError(f"{where}: `{GEMMA_CONFIG_KEY}` has `model_type`={config.get('model_type')!r}; "
                                  f"allowed: {list(GEMMA4_PACKED_TYPES)} (Gemma-4 unified, LTX-2.5)")
        if TOKENIZER_TENSOR not in infos:
            raise CheckpointError(f"{where} has no `{TOKENIZER_TENSOR}` tensor (tokenizer.json's bytes)")
        assets: dict[str, TensorIndexEntry | str] = {"tokenizer.json": infos[TOKENIZER_TENSOR]}
        assets |= {name: metadata[name] for name in METADATA_ASSETS if name in metadata}
        assets |= {k.removeprefix(ASSET_PREFIX): e for k, e in infos.items() if k.startswith(ASSET_PREFIX)}
        missing = [name for name in REQUIRED_ASSETS if name not in assets]
        if missing:
            raise CheckpointError(f"{where} lacks the sidecar(s) {missing} (tensor `{ASSET_PREFIX}<name>` or a "
                                  "metadata string)")
        for name, entry in assets.items():
            if isinstance(entry, TensorIndexEntry) and (entry.dtype not in (torch.uint8, torch.int8)
                                                        or len(entry.shape) != 1):
                raise CheckpointError(f"{where}: embedded file {name!r} is a {entry.dtype} {list(entry.shape)} "
                                      "tensor; a 1-D uint8 (or int8) tensor of its bytes is expected")
        naming = "comfy" if COMFY_PROBE in infos else "transformers"
        prefix = NAMINGS[naming]
        text, connectors, unused, unknown = {}, {}, {}, []
        for key, entry in infos.items():
            if key == TOKENIZER_TENSOR or key.startswith(ASSET_PREFIX):
                continue
            if key.startswith(ck.CONNECTOR_PREFIXES):
                connectors[key] = entry
            elif key.startswith(UNUSED_PREFIXES[naming]):
                unused[key] = entry
            elif key.startswith(prefix):
                text[key] = entry
            else:
                unknown.append(key)
        if not text:
            raise CheckpointError(f"{where} holds no Gemma-4 text-model weights: neither "
                                  f"`{COMFY_PROBE}` (ComfyUI's flat naming) nor keys under `{NAMINGS['transformers']}`")
        if unknown:
            raise CheckpointError(f"{where}: {len(unknown)} tensors of no known role ({naming} naming: text model "
                                  f"`{prefix}*`, towers {list(UNUSED_PREFIXES[naming])}, connectors "
                                  f"{list(ck.CONNECTOR_PREFIXES)}): {short_list(sorted(unknown), 5)}")
        return cls(path, config, naming, text, connectors, unused, assets)

    # ---- config and tokenizer ------------------------------------------------------------------
    def configs(self) -> tuple[transformers.Gemma4UnifiedTextConfig, tuple[int, ...]]:
        """The text config and the multimodal placeholder ids of the embedded config (as
        `text_encoder_gemma4.gemma4_configs` of a folder).

        Raises:
            CheckpointError: transformers refuses the config, naming the file.
        """
        try:
            config = transformers.CONFIG_MAPPING[self.config["model_type"]].from_dict(dict(self.config))
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"text_encoder: transformers cannot read `{GEMMA_CONFIG_KEY}` of {self.path}: "
                                  f"{exc}") from None
        placeholders = tuple(getattr(config, f) for f in MULTIMODAL_TOKEN_FIELDS if getattr(config, f, None) is not None)
        return config.get_text_config(), placeholders

    def asset_bytes(self) -> dict[str, bytes]:
        """Every embedded file's bytes (tokenizer.json and the sidecars), by file name."""
        tensors = {f"{ASSET_PREFIX}{n}" if n != "tokenizer.json" else TOKENIZER_TENSOR: n
                   for n, e in self.assets.items() if isinstance(e, TensorIndexEntry)}
        read = read_mapped([self.path], {k: k for k in tensors})
        out = {n: e.encode() for n, e in self.assets.items() if isinstance(e, str)}
        return out | {name: read[key].view(torch.uint8).numpy().tobytes() for key, name in tensors.items()}

    def tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """The embedded tokenizer, loaded as `load_gemma_tokenizer` loads a folder holding the same files.

        Raises:
            CheckpointError: as `load_gemma_tokenizer`, naming the file.
        """
        with tempfile.TemporaryDirectory(prefix="runnerkit-gemma4-tokenizer-") as tmp:
            for name, data in self.asset_bytes().items():
                if Path(name).name != name or name in ("", ".", ".."):
                    raise CheckpointError(f"text_encoder: {self.path}: embedded file name {name!r} is not a plain "
                                          "file name")
                (Path(tmp) / name).write_bytes(data)
            try:
                return load_gemma_tokenizer(tmp)
            except CheckpointError as exc:
                raise CheckpointError(f"{exc} (the tokenizer embedded in {self.path})") from None

    # ---- weights -------------------------------------------------------------------------------
    def key_map(self, names: list[str]) -> dict[str, str]:
        """Text-model name -> key in the file (the naming's prefix + the name).

        Raises:
            CheckpointError: naming the file: text-model tensors it lacks, or text keys the model has no tensor for
                (each listed with examples).
        """
        kmap = prefixed_key_map(names, self.text, (("", (NAMINGS[self.naming],)),), "text_encoder", self.path)
        unexpected = sorted(set(self.text) - set(kmap.values()))
        if unexpected:
            raise CheckpointError(f"text_encoder: {self.path}: {len(unexpected)} unexpected text-model tensors (the "
                                  f"config's model has none of these names): {short_list(unexpected, 5)}")
        return kmap

    def _skeleton(self, dtype: torch.dtype, connectors: LTX2ConnectorsArch | None) -> torch.nn.Module:
        text_config, _ = self.configs()
        if connectors is not None:
            check_fits_connectors(text_config, connectors, self.path, "Gemma-4")
        text_config._attn_implementation = "sdpa"  # as the folder loaders ask transformers
        return hf_skeleton(lambda: _Gemma4TextTower(text_config), dtype)

    def load(self, dtype: torch.dtype, device: torch.device | str,
             connectors: LTX2ConnectorsArch | None = None) -> transformers.Gemma4UnifiedTextModel:
        """The Gemma-4 text model with the file's weights (`text_encoder_gemma4.load_gemma4_text_encoder`'s
        counterpart: the same tensors as from the folder the file was packed from). Host memory: the text model's
        weights once, plus one tensor (each is read, then cast into aligned memory of its own, one at a time).

        Raises:
            CheckpointError: naming the file: a model that does not fit `connectors`, missing or unexpected
                text-model tensors, wrong shapes or dtypes.
        """
        start = time.perf_counter()
        model = self._skeleton(dtype, connectors)
        state = read_mapped([self.path], self.key_map(list(model.state_dict(keep_vars=True))))
        device = torch.device(device)
        try:
            check_tensors(model.state_dict(keep_vars=True), tensor_infos(state), "text_encoder")
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (in the packed file {self.path})") from None
        for name in list(state):  # one tensor at a time: the read copy is freed as its cast copy replaces it
            state[name] = to_compute(state[name], dtype, device)
        model.load_state_dict(state, strict=True, assign=True)
        model = model.to(device).eval().requires_grad_(False)  # the non-persistent buffers (RoPE tables) too
        gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        logger.info(f"text_encoder: loaded Gemma-4 text model from the packed file {self.path} ({self.naming} "
                    f"naming, {gib:.3f} GiB, {dtype}, {device}); left {len(self.unused)} tower tensors unread; "
                    f"{time.perf_counter() - start:.2f} s")
        return model

    def stream(self, offload: OffloadConfig, device: torch.device, dtype: torch.dtype,
               connectors: LTX2ConnectorsArch | None = None
               ) -> tuple[transformers.Gemma4UnifiedTextModel, BlockStreamer]:
        """The text model with its layers streamed (`text_encoder_gemma4_stream.GEMMA4_STREAM_SPEC`) from host
        memory or from this file's byte ranges (storage "disk"); only the text model's keys are read.

        Raises:
            CheckpointError: as `load`.
        """
        model = self._skeleton(dtype, connectors)
        key_map = self.key_map(list(model.state_dict(keep_vars=True)))
        try:
            streamer = stream_from_files(model, GEMMA4_STREAM_SPEC, offload, device, dtype, "text_encoder",
                                         [self.path], key_map)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (in the packed file {self.path})") from None
        return model, streamer


# ---- a folder or a packed file ---------------------------------------------------------------------
def configs_of(path: str | Path) -> tuple[transformers.Gemma4UnifiedTextConfig, tuple[int, ...]]:
    """The text config and placeholder ids of a Gemma-4 folder (`text_encoder_gemma4.gemma4_configs`) or a packed
    file (`PackedGemma4.configs`).

    Raises:
        CheckpointError: naming the folder or file (as those two and `PackedGemma4.open`).
    """
    return PackedGemma4.open(path).configs() if is_packed_file(path) else gemma4_configs(path)


def text_config_dict(path: str | Path) -> dict[str, Any]:
    """`configs_of(path)[0].to_dict()`, read once per version of the file it comes from (the packed file, or the
    folder's config.json: keyed on its path, size and modification time), since a planner estimates hundreds of
    candidate plans with it. Each call returns its own top-level dict.

    Raises:
        CheckpointError: as `configs_of` (nothing is cached then).
    """
    path = Path(path)
    source = path if is_packed_file(path) else path / "config.json"
    try:
        st = source.stat()
        stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    return dict(_text_config_dict(str(path), stamp))


@functools.lru_cache(maxsize=16)
def _text_config_dict(path: str, stamp: tuple[int, int] | None) -> dict[str, Any]:
    return configs_of(path)[0].to_dict()


def load_text_model(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                    connectors: LTX2ConnectorsArch | None = None) -> transformers.Gemma4UnifiedTextModel:
    """The Gemma-4 text model of a folder (`text_encoder_gemma4.load_gemma4_text_encoder`) or a packed file
    (`PackedGemma4.load`): the same tensors from a folder and its packed file.

    Raises:
        CheckpointError: naming the folder or file (as those two).
    """
    if is_packed_file(path):
        return PackedGemma4.open(path).load(dtype, device, connectors)
    return load_gemma4_text_encoder(path, dtype, device, connectors)


def stream_text_model(path: str | Path, offload: OffloadConfig, device: torch.device, dtype: torch.dtype,
                      connectors: LTX2ConnectorsArch | None = None
                      ) -> tuple[transformers.Gemma4UnifiedTextModel, BlockStreamer]:
    """The Gemma-4 text model of a folder (`text_encoder_gemma4_stream.stream_gemma4_text_encoder`) or a packed
    file (`PackedGemma4.stream`) with its layers streamed; close the streamer before dropping the model.

    Raises:
        CheckpointError: naming the folder or file (as those two).
    """
    if is_packed_file(path):
        return PackedGemma4.open(path).stream(offload, device, dtype, connectors)
    return stream_gemma4_text_encoder(path, offload, device, dtype, connectors)


def load_tokenizer(path: str | Path) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of a folder (`text_encoder.load_gemma_tokenizer`) or the one a packed file embeds
    (`PackedGemma4.tokenizer`: loaded the same way from the same files).

    Raises:
        CheckpointError: naming the folder or file (as those two).
    """
    return PackedGemma4.open(path).tokenizer() if is_packed_file(path) else load_gemma_tokenizer(path)
