"""LTX-2.5's convolutional video VAE file (`vae/ltx-2.5-video-vae-conv-bf16.safetensors`): found, told apart from the
diffusion VAE, and written by the synthetic writer.

Lightricks' release ships two video VAE files in `vae/`: the diffusion VAE (`ltx-2.5-video-vae-bf16.safetensors`: the
conv encoder and the diffusion decoder) and this one, ltx-core's `CausalVideoAutoencoder`, which ComfyUI workflows and
one-stage pipelines decode with. ltx-core (github.com/Lightricks/LTX-2 @ 400fd31,
`packages/ltx-core/src/ltx_core/model/video_vae/model_configurator.py`) picks the decoder from the file it is given:
`is_diffusion_video_vae` reads the `config` metadata's `vae._class_name` (absent: `_CONV_VAE_CLASS_NAME`
"CausalVideoAutoencoder"), builds `ConvVideoDecoder` for that class and `DiffusionVideoDecoder` otherwise, and maps
the file's bare keys with `VAE_ENCODER_COMFY_KEYS_FILTER` / `VAE_DECODER_COMFY_KEYS_FILTER` (`encoder.*`,
`decoder.*`, `per_channel_statistics.*`, which both halves read). ltx-pipelines builds the image encoder and the
decoder from that one file (`ModelPaths.video_vae`, `VideoDecoder`).

The network is LTX-2.3's video VAE: ltx-core's configurators on LTX-2.3's `vae` config with that class name build
exactly the 170 tensors of LTX-2.3's monolith `vae.*` with the prefix dropped (84 encoder, 84 decoder, 2
statistics), whose bf16 bytes (1,452,212,450) are the release file's size (1,452,269,922) less a 57 KB header. So
runnerkit reads it as its `LTX2VideoVAE` (vae.py), LTX-2.3's names without `vae.` (`conv_vae_file`).

Finding it (`find_conv_vae`): by content, whatever the file is called: the one file in `vae/` whose header has the
conv decoder's first convolution `decoder.conv_in.conv.weight` (the diffusion decoder's is `decoder.conv_in.weight`
beside `decoder.conv_in_x_t.weight`; the audio file has `audio_vae.*` only). Where its metadata names
`vae._class_name`, it must be ltx-core's conv class: a file whose keys and metadata disagree is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from runnerkit.models.ltx2.arch25 import LTX25Arch
from runnerkit.models.ltx2.release25_names import RELEASE_FILES, vae_encoder_names
from runnerkit.weights import CheckpointError, safetensors_infos, safetensors_metadata

__all__ = ["CONV_VAE_CLASS", "CONV_VAE_FILE", "conv_vae_file", "conv_vae_metadata", "find_conv_vae", "vae_class_name"]

CONV_VAE_CLASS = "CausalVideoAutoencoder"
"""ltx-core's `_CONV_VAE_CLASS_NAME`: the `config` metadata's `vae._class_name` of a convolutional VAE file."""
CONV_VAE_FILE = RELEASE_FILES["conv_vae"]
"""Where the synthetic writer puts the conv VAE under the release root (the bf16 release's name)."""
CONV_DECODER_KEY = "decoder.conv_in.conv.weight"
"""The conv decoder's first convolution (ltx-core `ConvVideoDecoder.conv_in`, a `CausalConv3d`)."""


def vae_class_name(path: Path) -> str | None:
    """The `config` metadata's `vae._class_name` of `path` (None: no such entry; ltx-core then takes the conv class).

    Raises:
        CheckpointError: the `config` entry is not a JSON object, naming the file.
    """
    raw = safetensors_metadata(path, "vae").get("config")
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"vae: {path}: metadata `config` is not valid JSON: {exc}") from None
    vae = config.get("vae") if isinstance(config, dict) else None
    return vae.get("_class_name") if isinstance(vae, dict) else None


def find_conv_vae(folder: Path) -> Path:
    """The release's conv VAE file in `folder` (the root's `vae/`; module docstring).

    Raises:
        CheckpointError: no file or several with the conv decoder's keys (naming the folder and the files; the
            diffusion VAE is not a conv one), or one whose metadata names another VAE class (naming the file).
    """
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    found = [f for f in files if CONV_DECODER_KEY in safetensors_infos([f], "vae")]
    if len(found) != 1:
        raise CheckpointError(f"video_decoder 'conv': {len(found)} files in {folder} hold the convolutional VAE "
                              f"(`{CONV_DECODER_KEY}`; {[f.name for f in found] or 'the folder has ' + str([f.name for f in files])}"
                              "); exactly one must (the release's ltx-2.5-video-vae-conv-bf16.safetensors)")
    kind = vae_class_name(found[0])
    if kind is not None and kind != CONV_VAE_CLASS:
        raise CheckpointError(f"vae: {found[0]} has the convolutional decoder's keys but its metadata `config` names "
                              f"vae._class_name {kind!r}, not {CONV_VAE_CLASS!r} (ltx-core would build another "
                              "decoder from it)")
    return found[0]


def conv_vae_file(vae: dict[str, Tensor], arch: LTX25Arch) -> dict[str, Tensor]:
    """The conv VAE file's tensors from our whole video VAE's state dict (encoder, decoder, latent statistics):
    LTX-2.3's monolith names without `vae.`."""
    return {key: vae[name] for name, key in vae_encoder_names(list(vae), arch).items()}


def conv_vae_metadata(arch: LTX25Arch) -> dict[str, str]:
    """The synthetic conv file's metadata: `config` {"vae": {"_class_name": "CausalVideoAutoencoder", ...}}, the rest
    of the section our video VAE's diffusers config (runnerkit's sections format, as the transformer file's)."""
    section: dict[str, Any] = {"_class_name": CONV_VAE_CLASS, **arch.to_sections()["vae"]}
    return {"config": json.dumps({"vae": section}), "model_version": "synthetic-2.5-conv-vae"}
