"""Single-file (Lightricks ltx-core) tensor names of every LTX-2 network, from diffusers' names.

A single-file release (`ltx-2-19b-dev.safetensors`, `ltx-2.3-22b-*.safetensors`) holds, by key prefix:

    model.diffusion_model.                      transformer (transformer_keys.py renames)
    model.diffusion_model.video_embeddings_connector.,
    model.diffusion_model.audio_embeddings_connector.   text connectors' 1-D transformers
    text_embedding_projection.                  connectors' input projection(s) (`aggregate_embed` in 2.0,
                                                `video_aggregate_embed` / `audio_aggregate_embed` in 2.3)
    vae.                                        video VAE (vae_keys.py numbering)
    audio_vae.                                  audio VAE (encoder + decoder; statistics renamed)
    vocoder.                                    vocoder (HiFi-GAN names: ups, resblocks, conv_pre, conv_post)

Sources: diffusers 0.42.1 `loaders/single_file_utils.py` (transformer, VAE, audio VAE prefixes and
renames) and `scripts/convert_ltx2_to_diffusers.py` (vocoder and connector renames; the 2.0 projection
read as top-level `text_embedding_projection.aggregate_embed.weight`; the 2.3 vocoder's `act_post` and
`downsample.lowpass`). Checked against Lightricks' loader (github Lightricks/LTX-2 @ 400fd31,
`packages/ltx-core`): the release key sets its networks expect are listed, with their source, in
`test_cases/models/ltx2/data/` and load here key for key (2.3 vocoder: `vocoder.vocoder.*`,
`vocoder.bwe_generator.*` with BigVGAN's `act_post` and `downsample.lowpass.filter`, and
`vocoder.mel_stft.*`; the resampler's filter is computed, and accepted unread if a file has it).

The loader maps the other way by building the network on meta and naming each of its tensors here,
so one function per direction suffices.
"""

from __future__ import annotations

import re

import torch

from runnerkit.models.ltx2 import transformer_keys as tk
from runnerkit.models.ltx2 import vae_keys as vk
from runnerkit.models.ltx2.arch import LTX2Arch

TRANSFORMER_PREFIX = tk.ORIGINAL_PREFIX
PROJECTION_PREFIX = "text_embedding_projection."
CONNECTOR_PREFIXES = (TRANSFORMER_PREFIX + "video_embeddings_connector.",
                      TRANSFORMER_PREFIX + "audio_embeddings_connector.", PROJECTION_PREFIX)
PREFIXES: dict[str, tuple[str, ...]] = {
    "transformer": (TRANSFORMER_PREFIX,), "connectors": CONNECTOR_PREFIXES, "vae": ("vae.",),
    "audio_vae": ("audio_vae.",), "vocoder": ("vocoder.",),
}
"""component -> prefixes of its single-file keys (transformer: minus the connectors')."""

_STATS = {"latents_mean": "per_channel_statistics.mean-of-means", "latents_std": "per_channel_statistics.std-of-means"}
_VOCODER = (("upsamplers", "ups"), ("resnets", "resblocks"), ("conv_in", "conv_pre"), ("conv_out", "conv_post"),
            ("act_out", "act_post"))
_LOWPASS = ".downsample.filter"
"""BigVGAN's anti-aliasing down-sampler keeps its filter one level deeper (`downsample.lowpass.filter`)."""
_IGNORED = {
    # tensors of the file that no network of ours reads
    "vae": re.compile(r"vae\.per_channel_statistics\.(channel|mean-of-stds)$"),
    "audio_vae": re.compile(r"audio_vae\.(encoder\.|per_channel_statistics\.(channel|mean-of-stds)$)"),
    # the 2.3 bandwidth extender's resampling filter: computed at build (ltx-core, diffusers and ComfyUI keep it
    # out of their state dicts); accepted and not read should a file carry it
    "vocoder": re.compile(r"vocoder\.resampler\.filter$"),
}


def owner(key: str) -> str | None:
    """The component a single-file key belongs to, or None for a prefix no component has."""
    if key.startswith(CONNECTOR_PREFIXES):
        return "connectors"
    for component, prefixes in PREFIXES.items():
        if key.startswith(prefixes):
            return component
    return None


def ignored(component: str, key: str) -> bool:
    """Whether single-file `key` of `component` is one our networks do not read (the audio VAE encoder,
    unused latent statistics); such keys are neither loaded nor reported as unexpected."""
    pattern = _IGNORED.get(component)
    return bool(pattern and pattern.match(key))


def _words(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    parts = name.split(".")
    table = dict(pairs)
    return ".".join(table.get(p, p) for p in parts)


def connectors_native(name: str) -> str:
    """Single-file key of a diffusers `LTX2TextConnectors` key."""
    for proj, native in (("video_text_proj_in.", "video_aggregate_embed."),
                         ("audio_text_proj_in.", "audio_aggregate_embed."), ("text_proj_in.", "aggregate_embed.")):
        if name.startswith(proj):
            return PROJECTION_PREFIX + native + name[len(proj):]
    modality, rest = name.split("_connector.", 1)
    rest = _words(rest, (("transformer_blocks", "transformer_1d_blocks"), ("norm_q", "q_norm"), ("norm_k", "k_norm")))
    return f"{TRANSFORMER_PREFIX}{modality}_embeddings_connector.{rest}"


def audio_vae_native(name: str) -> str:
    """Single-file key of a diffusers `AutoencoderKLLTX2Audio` key (decoder and statistics)."""
    return "audio_vae." + _STATS.get(name, name)


def vocoder_native(name: str) -> str:
    """Single-file key of a diffusers `LTX2Vocoder` / `LTX2VocoderWithBWE` key (ltx-core's `Vocoder` /
    `VocoderWithBWE` attribute names: `ups`, `resblocks`, `conv_pre`, `act_post`, `conv_post`,
    `...downsample.lowpass.filter`)."""
    native = _words(name, _VOCODER)
    if native.endswith(_LOWPASS):
        native = native[: -len(_LOWPASS)] + ".downsample.lowpass.filter"
    return "vocoder." + native


def native_names(component: str, names: list[str], arch: LTX2Arch) -> dict[str, str]:
    """diffusers (= our module's) name -> single-file key, for every name of `component`'s network."""
    if component == "transformer":
        return {n: tk.original_name(n) for n in names}
    if component == "vae":
        probes = {n: torch.empty(0) for n in names}  # distinct objects: match names by identity
        renamed = {id(v): k for k, v in vk.diffusers_to_native(probes, arch.vae).items()}
        return {n: renamed[id(v)] for n, v in probes.items()}
    convert = {"connectors": connectors_native, "audio_vae": audio_vae_native, "vocoder": vocoder_native}[component]
    return {n: convert(n) for n in names}
