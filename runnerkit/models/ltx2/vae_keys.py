"""Key names of the LTX-2 video VAE in the single-file release <-> diffusers' names.

The single-file checkpoints (`ltx-2-19b-*.safetensors`, `ltx-2.3-22b-*.safetensors`) hold the
video VAE under the prefix `vae.` in Lightricks' `ltx-core` names: the encoder's down blocks and
downsamplers are numbered in one list (`encoder.down_blocks.{2i}` = block i's residual blocks,
`{2i+1}` = its downsampler, the last = the mid block), likewise the decoder's (`decoder.up_blocks.0`
= mid block, `{2i+1}` = up block i's upsampler, `{2i+2}` = its residual blocks), residual blocks
are `res_blocks`, the latent statistics `per_channel_statistics.{mean-of-means,std-of-means}` (plus
`channel` and `mean-of-stds`, which nothing reads), and a timestep-conditioned decoder's last
AdaLN is `last_time_embedder` / `last_scale_shift_table`.

Source: diffusers' `convert_ltx2_vae_to_diffusers` (single_file_utils, 0.42.1: LTX-2.0 only, it
has no rule for the 2.3 decoder's `up_blocks.7` / `up_blocks.8`) and `scripts/convert_ltx2_to_diffusers.py`
(`LTX_2_3_VIDEO_VAE_RENAME_DICT` adds them). Here the numbering is computed, so both releases map.
"""

from __future__ import annotations

import re

from torch import Tensor

from runnerkit.models.ltx2.vae_arch import LTX2VideoVAEArch
from runnerkit.weights import CheckpointError

UNUSED_NATIVE_STATS = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")
"""Native statistics diffusers (and this VAE) drop."""

_STATS = {"per_channel_statistics.mean-of-means": "latents_mean", "per_channel_statistics.std-of-means": "latents_std"}
_LAST = {"decoder.last_time_embedder.": "decoder.time_embedder.",
         "decoder.last_scale_shift_table": "decoder.scale_shift_table"}


def _check_arch(arch: LTX2VideoVAEArch) -> None:
    if not all(arch.spatio_temporal_scaling) or not all(arch.decoder_spatio_temporal_scaling):
        raise NotImplementedError("native VAE names are numbered for blocks that all resample (both releases); "
                                  "a block without a resampler shifts the numbering in a way not documented")
    if any(c_in != c_out for c_in, c_out in arch.decoder_up_channels):
        raise NotImplementedError("no release has a channel-changing up block (`conv_in`); its native name is unknown")


def native_to_diffusers_key(key: str, arch: LTX2VideoVAEArch) -> str:
    """One native key (without the `vae.` prefix) -> its diffusers name.

    Raises:
        CheckpointError: a block index outside the architecture.
    """
    for native, name in {**_STATS, **_LAST}.items():
        if key.startswith(native):
            return name + key[len(native):]
    n_enc, n_dec = len(arch.block_out_channels), len(arch.decoder_block_out_channels)
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", key):
        index, rest = int(m[1]), m[2].replace("res_blocks.", "resnets.", 1)
        if index == 2 * n_enc:
            return f"encoder.mid_block.{rest}"
        if index < 2 * n_enc:
            return f"encoder.down_blocks.{index // 2}." + (rest if index % 2 == 0 else f"downsamplers.0.{rest}")
        raise CheckpointError(f"vae: `{key}`: the encoder has {2 * n_enc + 1} native blocks")
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.(.*)", key):
        index, rest = int(m[1]), m[2].replace("res_blocks.", "resnets.", 1)
        if index == 0:
            return f"decoder.mid_block.{rest}"
        if index <= 2 * n_dec:
            block = (index - 1) // 2
            return f"decoder.up_blocks.{block}." + (f"upsamplers.0.{rest}" if index % 2 == 1 else rest)
        raise CheckpointError(f"vae: `{key}`: the decoder has {2 * n_dec + 1} native blocks")
    return key  # conv_in, conv_out, timestep_scale_multiplier: same names


def native_to_diffusers(state_dict: dict[str, Tensor], arch: LTX2VideoVAEArch,
                        prefix: str = "vae.") -> dict[str, Tensor]:
    """The video VAE tensors of a single-file release (keys under `prefix`) in diffusers' names.

    Keys outside `prefix` (transformer, audio VAE, vocoder) and the two unused statistics are
    left out. Tensors are not copied.

    Raises:
        NotImplementedError: an architecture whose native numbering is not known (see `_check_arch`).
        CheckpointError: a block index outside the architecture.
    """
    _check_arch(arch)
    out = {}
    for key, tensor in state_dict.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix):]
        if key not in UNUSED_NATIVE_STATS:
            out[native_to_diffusers_key(key, arch)] = tensor
    return out


def diffusers_to_native(state_dict: dict[str, Tensor], arch: LTX2VideoVAEArch,
                        prefix: str = "vae.") -> dict[str, Tensor]:
    """Inverse of `native_to_diffusers` (without the two unused statistics), for writing
    single-file checkpoints. Raises as `native_to_diffusers`."""
    _check_arch(arch)
    inverse = {v: k for k, v in {**_STATS, **_LAST}.items()}
    out = {}
    for key, tensor in state_dict.items():
        native = next((inverse[d] + key[len(d):] for d in inverse if key.startswith(d)), None)
        m = re.match(r"encoder\.(down_blocks\.(\d+)\.|mid_block\.)(downsamplers\.0\.)?(.*)", key)
        if native is None and m:
            index = 2 * len(arch.block_out_channels) if m[2] is None else 2 * int(m[2]) + (m[3] is not None)
            native = f"encoder.down_blocks.{index}.{m[4].replace('resnets.', 'res_blocks.', 1)}"
        m = re.match(r"decoder\.(up_blocks\.(\d+)\.|mid_block\.)(upsamplers\.0\.)?(.*)", key)
        if native is None and m:
            index = 0 if m[2] is None else 2 * int(m[2]) + (1 if m[3] is not None else 2)
            native = f"decoder.up_blocks.{index}.{m[4].replace('resnets.', 'res_blocks.', 1)}"
        out[prefix + (native or key)] = tensor
    return out
