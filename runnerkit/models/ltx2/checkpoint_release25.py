"""LTX-2.5's per-component release (release25_names.py): the files located, indexed and loaded into our networks.

Config keys (as LTX-2.3's single file): `model_path` the transformer file in `<root>/diffusion_models/`,
`upsampler_path` the x2 latent upsampler file, `text_encoder_path` the release's packed Gemma-4 file
(`text_encoders/gemma4-12b-with-proj-ltx-2.5-bf16.safetensors`, text_encoder_packed.py) or a Gemma-4 transformers
folder with its tokenizer (`gemma4_unified`); omitted, the packed file is found by content in `<root>/text_encoders/`
(the one file there with a `tokenizer_json` tensor and `gemma_config` metadata). The rest is found by content in the
root's folders, whatever the files are called:

- `vae/`: the diffusion VAE file (the one with `decoder.conv_in_x_t.weight`): the video VAE's encoder and latent
  statistics (the `vae` component: our `LTX2VideoVAE` without its convolutional decoder, which LTX-2.5 does not
  run) and the diffusion decoder (`diffusion_decoder`, diffusion_decoder_keys.py); the audio file (the one with
  `audio_vae.*` keys): the audio VAE decoder and the vocoder. With `video_decoder` "conv" the conv VAE file instead
  of the diffusion VAE (conv_vae25.py `find_conv_vae`): the whole `vae` (encoder, conv decoder, statistics), as
  ltx-core builds both halves from the one video VAE file it is given; the diffusion VAE file is then not read.
- `model_patches/`: the duration head file (the one with `duration_head.*` keys).
- the text connectors: each tensor from the packed text-encoder file if it has it, else from the transformer file
  (ltx-core reads the transformer file, then the packed file, the later file's tensor replacing the earlier's);
  with a Gemma-4 folder: from the transformer file, else from a `.safetensors` directly in `text_encoders/`.

Architecture (unless the config's `model` gives it): the transformer file's `config` metadata, LTX-2's part as
`release_config.arch_from_single_file_config` reads it (ltx-core's format: Gemma-4's width and depth from
`text_encoder_path`'s config.json; or runnerkit's sections format, which the synthetic writer stores, with the
duration head's and decoder's sections); ltx-core's format gives the duration head and the diffusion decoder the
release's sizes (`LTX25_DURATION_HEAD`, `LTX25_DIFFUSION_DECODER`; every shape is checked at load). A split
release's transformer file may leave out the `vae`, `audio_vae` and `vocoder` sections (ltx-trainer's
`is_split_transformer`: its metadata declares `transformer` and `scheduler` only); those it lacks take the
release's sizes (`LTX25_22B_ARCH`: LTX-2.3's video VAE encoder, audio VAE and vocoder), checked shape by shape at
load like the rest.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runnerkit.models.ltx2 import checkpoint_keys as ck
from runnerkit.models.ltx2.arch import COMPONENTS
from runnerkit.models.ltx2.arch25 import EXTRA_COMPONENTS, LTX25Arch
from runnerkit.models.ltx2.checkpoint import _arch, _check_tokenizer, network_factory, read_metadata_config
from runnerkit.models.ltx2.checkpoint25 import LTX25Checkpoint, extra_factory
from runnerkit.models.ltx2.conv_vae25 import find_conv_vae
from runnerkit.models.ltx2.diffusion_decoder import LTX25_DIFFUSION_DECODER
from runnerkit.models.ltx2.diffusion_decoder_keys import state_dict_from_single_file as decoder_state_dict
from runnerkit.models.ltx2.duration import LTX25_DURATION_HEAD
from runnerkit.models.ltx2.duration import state_dict_from_single_file as duration_state_dict
from runnerkit.models.ltx2.ltx25_arch import LTX25_22B_ARCH
from runnerkit.models.ltx2.release25_names import VAE_PREFIX
from runnerkit.models.ltx2.release_config import arch_from_single_file_config, is_release_config
from runnerkit.models.ltx2.text_encoder_packed import (
    GEMMA_CONFIG_KEY,
    TOKENIZER_TENSOR,
    PackedGemma4,
    is_packed_file,
    read_header,
)
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.weights import (
    CheckpointError,
    TensorIndexEntry,
    assign_state_dict,
    build_on_meta,
    read_json_object,
    safetensors_infos,
)

__all__ = ["LTX25ReleaseCheckpoint", "find_packed_text_encoder", "open_ltx25", "release_root"]

_DIFFUSION_VAE_KEY = "decoder.conv_in_x_t.weight"
_VAE_STATS_IGNORED = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")


def release_root(transformer: Path) -> Path:
    """The release's root folder: the one holding `diffusion_models/` with the transformer file.

    Raises:
        CheckpointError: the file is not in a `diffusion_models/` folder (naming the layout).
    """
    if transformer.parent.name != "diffusion_models":
        raise CheckpointError(f"LTX-2.5: `model_path` {transformer} must be the transformer file in the release's "
                              "`diffusion_models/` folder (its siblings `vae/` and `model_patches/` hold the VAEs "
                              "and the duration head), or a diffusers folder")
    return transformer.parent.parent


def _with_keys(folder: Path, wanted: str, prefix: bool = False) -> list[Path]:
    """The `.safetensors` files directly in `folder` whose header holds the key `wanted` (or a key starting with
    it, `prefix`): sorted by name."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return [f for f in files if any((k.startswith(wanted) if prefix else k == wanted)
                                    for k in safetensors_infos([f], f.parent.name))]


def _one(files: list[Path], what: str, folder: Path) -> Path:
    if len(files) != 1:
        raise CheckpointError(f"LTX-2.5 release: {len(files)} files in {folder} hold {what} ({[f.name for f in files]})"
                              "; exactly one must")
    return files[0]


class LTX25ReleaseCheckpoint(LTX25Checkpoint):
    """The per-component release (module docstring), `layout` "single_file" (the transformer file's names)."""

    @classmethod
    def open_release(cls, transformer: Path, upsampler: Path, text_encoder: Path | None,
                     arch: LTX25Arch | None = None, video_decoder: str = "diffusion") -> LTX25ReleaseCheckpoint:
        """Locate every file and index its tensors by component (headers only); `arch` replaces the architecture
        read from the transformer file's metadata; `text_encoder` None: the packed file in `text_encoders/`;
        `video_decoder` "conv": the video VAE is the conv VAE file.

        Raises:
            CheckpointError: a missing file or folder, none or several files of one kind (naming the folder),
                tensors under no known prefix, a packed text-encoder file that is not one (text_encoder_packed.py
                `PackedGemma4.open`), a config the architecture refuses.
        """
        root = release_root(transformer)
        for path, kind in ((transformer, "transformer"), (upsampler, "latent_upsampler")):
            if not path.is_file():
                raise CheckpointError(f"{kind}: release file {path} does not exist")
        if text_encoder is None:
            text_encoder = find_packed_text_encoder(root)
        packed = PackedGemma4.open(text_encoder) if is_packed_file(text_encoder) else None
        if packed is None and not (text_encoder / "config.json").is_file():
            raise CheckpointError(f"text_encoder: `text_encoder_path` {text_encoder} is neither the release's packed "
                                  "Gemma-4 file (.safetensors) nor a Gemma-4 transformers folder with a config.json")
        if packed is None:
            _check_tokenizer(text_encoder, "the Gemma-4 folder (`text_encoder_path`)")
        conv = video_decoder == "conv"
        vae = (find_conv_vae(root / "vae") if conv
               else _one(_with_keys(root / "vae", _DIFFUSION_VAE_KEY), "the diffusion VAE", root / "vae"))
        audio = _one(_with_keys(root / "vae", "audio_vae.", prefix=True), "the audio VAE", root / "vae")
        head = _one(_with_keys(root / "model_patches", "duration_head.", prefix=True), "the duration head",
                    root / "model_patches")
        index: dict[str, dict[str, TensorIndexEntry]] = {c: {} for c in (*COMPONENTS, *EXTRA_COMPONENTS)}
        for key, entry in safetensors_infos([transformer], "transformer").items():
            owner = ck.owner(key)
            if owner not in ("transformer", "connectors"):
                raise CheckpointError(f"{transformer}: tensor {key!r} is neither the transformer's nor the text "
                                      "connectors'")
            index[owner][key] = entry
        if packed is not None:  # ltx-core: the packed file's tensor replaces the transformer file's
            index["connectors"] |= packed.connectors
        elif not index["connectors"]:  # the connectors beside a Gemma-4 folder (ltx-core reads either place)
            for file in _with_keys(root / "text_encoders", ck.CONNECTOR_PREFIXES[0], prefix=True):
                index["connectors"] |= {k: e for k, e in safetensors_infos([file], "connectors").items()
                                        if ck.owner(k) == "connectors"}
        for key, entry in safetensors_infos([vae], "vae").items():
            index["diffusion_decoder" if key.startswith("decoder.") and not conv else "vae"][key] = entry
        if not conv:
            index["diffusion_decoder"] |= {k: e for k, e in index["vae"].items()
                                           if k.startswith("per_channel_statistics.")}
        for key, entry in safetensors_infos([audio], "audio_vae").items():
            index[ck.owner(key) or "audio_vae"][key] = entry
        index["duration_head"] = dict(safetensors_infos([head], "duration_head"))
        index["latent_upsampler"] = dict(safetensors_infos([upsampler], "latent_upsampler"))
        if arch is None:
            arch = _release_arch(transformer, upsampler, text_encoder)
        return cls("single_file", transformer, arch, upsampler, text_encoder, index)

    def key_map(self, component: str, names: list[str]) -> dict[str, str]:
        """`LTX2Checkpoint.key_map`; the video VAE's keys bare (the split file has no `vae.` prefix)."""
        kmap = super().key_map(component, names)
        return {n: k.removeprefix(VAE_PREFIX) for n, k in kmap.items()} if component == "vae" else kmap

    def _ignored(self, component: str, key: str) -> bool:
        if component == "vae":
            return key.startswith(_VAE_STATS_IGNORED)
        return super()._ignored(component, key)

    def _plan(self, component: str,
              module: nn.Module | None = None) -> tuple[nn.Module, dict[str, str], dict[str, str]]:
        """`LTX25Checkpoint._plan`; the video VAE without its convolutional decoder (the file holds the diffusion
        decoder instead); the duration head and the decoder have no one-to-one names (`load` maps them)."""
        if component in EXTRA_COMPONENTS:
            raise CheckpointError(f"{component}: the release file's tensors are mapped whole (fused q / k / v); "
                                  "use `load` or `state_dict`")
        if component == "vae" and module is None and not any(k.startswith("decoder.") for k in self._index["vae"]):
            module = build_on_meta(network_factory("vae", self.arch))
            module.decoder = None  # type: ignore[assignment]  # the diffusion decoder decodes (not the conv VAE file)
        return super()._plan(component, module)

    def state_dict(self, component: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`LTX2Checkpoint.state_dict`; the duration head and the diffusion decoder mapped from the release's names
        (duration.py, diffusion_decoder_keys.py)."""
        if component not in EXTRA_COMPONENTS:
            return super().state_dict(component)
        keys = sorted(self._index[component])
        reader = SafetensorsDiskReader(self.files(component))
        try:
            tensors = reader.load_tensors(keys)
        finally:
            reader.close()
        try:
            mapped = duration_state_dict(tensors) if component == "duration_head" else decoder_state_dict(tensors)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{component}: {', '.join(map(str, self.files(component)))}: {exc}") from None
        return mapped, {}

    def load(self, component: str, dtype: torch.dtype | None = None, device: torch.device | None = None) -> nn.Module:
        """`LTX2Checkpoint.load`; the duration head and the diffusion decoder strictly from `state_dict`."""
        if component == "vae":  # the video VAE file named (the diffusion VAE's or the conv VAE's)
            try:
                return super().load(component, dtype, device)
            except CheckpointError as exc:
                raise CheckpointError(f"{', '.join(map(str, self.files('vae')))}: {exc}") from None
        if component not in EXTRA_COMPONENTS:
            return super().load(component, dtype, device)
        assert isinstance(self.arch, LTX25Arch), "an LTX-2.5 checkpoint has an LTX25Arch"
        return assign_state_dict(extra_factory(component, self.arch), self.state_dict(component)[0], component,
                                 dtype, device=device)


def open_ltx25(path: str | Path, upsampler_path: str | Path | None = None, text_encoder_path: str | Path | None = None,
               arch: LTX25Arch | None = None, video_decoder: str = "diffusion") -> LTX25Checkpoint:
    """An LTX-2.5 checkpoint: the release whose transformer file `path` is (then `upsampler_path` is required;
    `text_encoder_path` the packed file or a Gemma-4 folder, None: found in the root's `text_encoders/`), else the
    diffusers folder `path` (`LTX25Checkpoint.open`; its `vae/` holds the conv decoder too); `arch` replaces the
    architecture read from it; `video_decoder` "conv": the release's video VAE is the conv VAE file
    (`LTX25ReleaseCheckpoint.open_release`).

    Raises:
        CheckpointError: a release file without `upsampler_path`; as `LTX25ReleaseCheckpoint.open_release` and
            `LTX25Checkpoint.open`.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        return LTX25Checkpoint.open(path, upsampler_path, text_encoder_path, arch)
    if upsampler_path is None:
        raise CheckpointError(f"LTX-2.5 release file {path}: `upsampler_path` is required (the release ships the "
                              "upsampler as a separate file)")
    return LTX25ReleaseCheckpoint.open_release(path, Path(upsampler_path),
                                               None if text_encoder_path is None else Path(text_encoder_path), arch,
                                               video_decoder)


def find_packed_text_encoder(root: Path) -> Path:
    """The packed Gemma-4 file in `<root>/text_encoders/`, by content: the one `.safetensors` there with a
    `tokenizer_json` tensor and `gemma_config` metadata.

    Raises:
        CheckpointError: none or several such files (naming the folder; give `text_encoder_path`).
    """
    folder = root / "text_encoders"
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    why_not = {f: _not_packed(f) for f in files}  # "" for a packed file
    found = [f for f in files if not why_not[f]]
    if len(found) != 1:
        why = "".join(f"; {f.name} is not one: {why_not[f]}" for f in files if why_not[f])
        raise CheckpointError(f"LTX-2.5 release: {len(found)} packed Gemma-4 files in {folder} "
                              f"({[f.name for f in found]}){why}; exactly one must be there, or give "
                              "`text_encoder_path`")
    return found[0]


def _not_packed(file: Path) -> str:
    """Why `file` is not a packed Gemma-4 text-encoder file ("" when it is one: a `tokenizer_json` tensor and
    `gemma_config` metadata; its header read once)."""
    try:
        keys, metadata = read_header(file)
    except CheckpointError as exc:
        return str(exc)
    missing = ([f"no `{TOKENIZER_TENSOR}` tensor"] if TOKENIZER_TENSOR not in keys else []) + (
        [f"no `{GEMMA_CONFIG_KEY}` metadata entry"] if GEMMA_CONFIG_KEY not in metadata else [])
    return " and ".join(missing)


def _release_arch(transformer: Path, upsampler: Path, text_encoder: Path) -> LTX25Arch:
    """The architecture from the transformer and upsampler files' `config` metadata (module docstring)."""
    config = read_metadata_config(transformer, "transformer")
    up_config = read_metadata_config(upsampler, "latent_upsampler")
    release = is_release_config(config)
    gemma = None
    if release:  # ltx-core sizes the connectors' input from the Gemma config (a packed file's `gemma_config`)
        gemma = (PackedGemma4.open(text_encoder).config if is_packed_file(text_encoder)
                 else read_json_object(text_encoder / "config.json", "text_encoder"))
    ours = {k: config.pop(k) for k in EXTRA_COMPONENTS if k in config}
    base = _arch(lambda: arch_from_single_file_config(config, up_config, str(transformer), gemma,
                                                      defaults=LTX25_22B_ARCH if release else None),
                 f"metadata `config` of {transformer} and {upsampler}")
    sections = {**base.to_sections(), "duration_head": LTX25_DURATION_HEAD.model_dump(mode="json"),
                "diffusion_decoder": LTX25_DIFFUSION_DECODER.model_dump(mode="json"), **ours}
    return _arch(lambda: LTX25Arch.from_sections(sections, str(transformer)),  # type: ignore[return-value]
                 f"metadata `config` of {transformer}")
