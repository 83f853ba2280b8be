"""Lightricks' per-component LTX-2.5 release (`Lightricks/LTX-2.5` on Hugging Face): its folders, file names and
the tensor names inside each file, from ours (diffusers') names.

    <root>/diffusion_models/ltx-2.5-22b-distilled-transformer-bf16.safetensors    transformer (+ connectors, see below)
    <root>/text_encoders/gemma4-12b-with-proj-ltx-2.5-bf16.safetensors           Gemma-4 packed, + the projections
    <root>/vae/ltx-2.5-video-vae-bf16.safetensors        the diffusion VAE: conv encoder + diffusion decoder
    <root>/vae/ltx-2.5-video-vae-conv-bf16.safetensors   the convolutional VAE (read with video_decoder "conv": conv_vae25.py)
    <root>/vae/ltx-2.5-audio-vae-bf16.safetensors        audio VAE + vocoder
    <root>/latent_upscale_models/ltx-2.5-latent-spatial-upscaler-x2-bf16-1.0.safetensors
    <root>/model_patches/ltx-2.5-duration-head-bf16.safetensors

File names: as public download scripts, model catalogues and ComfyUI workflows of the release list them
(e.g. `dl diffusion_models/ltx-2.5-22b-distilled-transformer-nvfp4.safetensors`, `vae/ltx-2.5-video-vae-bf16...`,
`model_patches/ltx-2.5-duration-head-bf16.safetensors`); not checked against the repository itself, so the reader
(checkpoint_release25.py) finds every file but the transformer's, the upsampler's and the text encoder's (the
config's paths) by its content in these folders, whatever its name; the writer uses these names.

Tensor names (checked key for key against ltx-core's, test_cases/models/ltx2/data/ltx2.5_release_keys.json.gz):

- transformer file: `model.diffusion_model.*` (checkpoint_keys.py, as LTX-2.3's single file). The text connectors
  (`model.diffusion_model.{video,audio}_embeddings_connector.*`, `text_embedding_projection.*`): ltx-core builds
  them from the transformer file and then the packed text-encoder file, the latter's tensor winning where both have
  one; ltx-trainer says the split packs keep the projections (`text_embedding_projection.*`) in the packed file.
  The sizes agree: the packed file's 26,263,858,182 bytes are Gemma-4 12B's text model in bf16 (23,814,700,640)
  + the two projections (2,312,122,368) + 137,035,174 (the towers' embedders, the tokenizer), while the whole
  connectors (6,344,455,168) would not fit. The writer puts the connectors' 1-D transformers in the transformer
  file and the projections in the packed file (`transformer_file`, `projection_tensors`); the reader takes each
  tensor from either (text_encoder_packed.py).
- packed text-encoder file: text_encoder_packed.py (Gemma-4's config, tokenizer and weights, + the projections).
- diffusion VAE file: bare `encoder.*` (LTX-2.3's VAE encoder names without `vae.`), `per_channel_statistics.*`
  (the latent statistics both halves read) and `decoder.*` in Lightricks' names (diffusion_decoder_keys.py; the
  inverse here: q / k / v fused into `qkv`, `to_out.0` -> `proj`, `norm_q` -> `q_norm`, ...).
- audio file: `audio_vae.*` and `vocoder.*` (ltx-core's `AUDIO_VAE_DECODER_COMFY_KEYS_FILTER` / vocoder filter
  match these prefixes: the monolith's names).
- duration head file: `duration_head.*`, the pooler's attention as `nn.MultiheadAttention` (`in_proj_weight`
  = q, k, v stacked; `out_proj`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runnerkit.models.ltx2 import checkpoint_keys as ck
from runnerkit.models.ltx2.arch25 import LTX25Arch
from runnerkit.models.ltx2.diffusion_decoder_keys import STATISTICS
from runnerkit.models.ltx2.duration import SINGLE_FILE_PREFIX as DURATION_PREFIX

__all__ = ["DTYPE_NAMES", "FOLDERS", "RELEASE_FILES", "audio_file", "duration_file", "projection_tensors",
           "release_files", "transformer_file", "vae_file"]

FOLDERS = ("diffusion_models", "text_encoders", "vae", "latent_upscale_models", "model_patches")
RELEASE_FILES: dict[str, str] = {
    "transformer": "diffusion_models/ltx-2.5-22b-distilled-transformer-bf16.safetensors",
    "video_vae": "vae/ltx-2.5-video-vae-bf16.safetensors",
    "conv_vae": "vae/ltx-2.5-video-vae-conv-bf16.safetensors",
    "audio_vae": "vae/ltx-2.5-audio-vae-bf16.safetensors",
    "latent_upsampler": "latent_upscale_models/ltx-2.5-latent-spatial-upscaler-x2-bf16-1.0.safetensors",
    "duration_head": "model_patches/ltx-2.5-duration-head-bf16.safetensors",
    "text_encoder": "text_encoders/gemma4-12b-with-proj-ltx-2.5-bf16.safetensors",
}
"""What the synthetic writer writes where (relative to the root); the bf16 release's names (`release_files`:
another dtype's)."""
DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
"""The dtype word of a release file name (`-bf16`), per dtype the writer stores."""


def release_files(dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """`RELEASE_FILES` with the dtype word of `dtype` in each name (`-bf16` -> `-fp32` for float32 weights): a
    file's name says the dtype it holds, as the release's own names do (`-bf16`, `-fp8`, `-nvfp4`).

    Raises:
        ValueError: `dtype` is not one of `DTYPE_NAMES`, naming it and those allowed.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"`dtype` {dtype} has no release file name; allowed: {[str(d) for d in DTYPE_NAMES]}")
    word = DTYPE_NAMES[dtype]
    return {k: v.replace("-bf16", f"-{word}") for k, v in RELEASE_FILES.items()}


VAE_PREFIX = "vae."
_STAT_FILE = {ours: f"per_channel_statistics.{name}" for name, ours in STATISTICS.items()}
_DECODER_RENAMES = (("t_embedder.timestep_embedder.linear_1.", "t_embedder.mlp.0."),
                    ("t_embedder.timestep_embedder.linear_2.", "t_embedder.mlp.2."),
                    (".attn.to_out.0.", ".attn.proj."), (".attn.norm_q.", ".attn.q_norm."),
                    (".attn.norm_k.", ".attn.k_norm."))


def transformer_file(transformer: dict[str, Tensor], connectors: dict[str, Tensor],
                     arch: LTX25Arch) -> dict[str, Tensor]:
    """The transformer file's tensors from our transformer's and connectors' state dicts (module docstring): the
    connectors' 1-D transformers, not their projections (`projection_tensors`)."""
    out = {ck.native_names("transformer", [n], arch)[n]: v for n, v in transformer.items()}
    native = {ck.connectors_native(n): v for n, v in connectors.items()}
    return out | {k: v for k, v in native.items() if not k.startswith(ck.PROJECTION_PREFIX)}


def projection_tensors(connectors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The connectors' input projections (`text_embedding_projection.*`) that the packed text-encoder file carries,
    from our connectors' state dict."""
    native = {ck.connectors_native(n): v for n, v in connectors.items()}
    return {k: v for k, v in native.items() if k.startswith(ck.PROJECTION_PREFIX)}


def vae_encoder_names(names: list[str], arch: LTX25Arch) -> dict[str, str]:
    """Our video VAE's encoder and statistics names -> the diffusion VAE file's bare keys."""
    native = ck.native_names("vae", names, arch)
    return {n: native[n].removeprefix(VAE_PREFIX) for n in names}


def vae_file(vae: dict[str, Tensor], decoder: dict[str, Tensor], arch: LTX25Arch) -> dict[str, Tensor]:
    """The diffusion VAE file's tensors: our video VAE's encoder and latent statistics (its conv decoder left out)
    and our diffusion decoder's state dict (its own statistics left out: the file has one pair)."""
    kept = [n for n in vae if not n.startswith("decoder.")]
    out = {key: vae[n] for n, key in vae_encoder_names(kept, arch).items()}
    for name, value in decoder.items():
        if name in _STAT_FILE or ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        if ".attn.to_q." in name:
            stem, leaf = name.split(".attn.to_q.")
            name = f"{stem}.attn.qkv.{leaf}"
            value = torch.cat([decoder[f"{stem}.attn.to_{p}.{leaf}"] for p in "qkv"])
        for ours, theirs in _DECODER_RENAMES:
            name = name.replace(ours, theirs)
        out[name] = value
    return out


def audio_file(audio_vae: dict[str, Tensor], vocoder: dict[str, Tensor], arch: LTX25Arch) -> dict[str, Tensor]:
    """The audio file's tensors (`audio_vae.*`, `vocoder.*`) from our audio VAE decoder's and vocoder's."""
    out = {ck.native_names("audio_vae", [n], arch)[n]: v for n, v in audio_vae.items()}
    return out | {ck.native_names("vocoder", [n], arch)[n]: v for n, v in vocoder.items()}


def duration_file(head: dict[str, Tensor]) -> dict[str, Tensor]:
    """The duration head file's tensors from our head's state dict (the inverse of
    `duration.state_dict_from_single_file`)."""
    out, fused = {}, "attention_pooler.cross_attn."
    for name, value in head.items():
        if name.startswith(("attention_pooler.to_k.", "attention_pooler.to_v.")):
            continue
        kind = name.rsplit(".", 1)[-1]
        if name.startswith("attention_pooler.to_q."):
            name, value = f"{fused}in_proj_{kind}", torch.cat(
                [head[f"attention_pooler.to_{p}.{kind}"] for p in "qkv"])
        elif name.startswith("attention_pooler.to_out."):
            name = f"{fused}out_proj.{kind}"
        out[DURATION_PREFIX + name] = value
    return out
