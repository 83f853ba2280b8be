"""Single-file names of the LTX-2.5 diffusion decoder -> this package's (diffusers') names.

The release stores the diffusion VAE in one file (`vae/ltx-2.5-video-vae-bf16.safetensors`, the split
layout: bare prefixes, as ComfyUI splits files; a monolith file puts `vae.` in front of each, and both
are read, as ltx-core reads them): the convolutional encoder under `encoder.` (LTX-2.3's names after
the prefix, `vae_keys.py`), the latent statistics under `per_channel_statistics.` and the diffusion
decoder under `decoder.` in Lightricks' names, which differ from diffusers' (`LTX2DiffusionDecoder`'s
`decoder.*`, `latents_mean`, `latents_std`) by:

    t_embedder.mlp.0. / t_embedder.mlp.2.     -> t_embedder.timestep_embedder.linear_1. / linear_2.
    .attn.proj.                               -> .attn.to_out.0.
    .attn.q_norm. / .attn.k_norm.             -> .attn.norm_q. / .attn.norm_k.
    .attn.qkv.weight / .bias [3d, ...]        -> .attn.to_q / to_k / to_v (thirds along dim 0, in order)
    per_channel_statistics.mean-of-means      -> latents_mean (std-of-means -> latents_std)

Checkpoints with static AdaLN gates (`.gate_msa`, `.gate_mlp`, `.gate_ctx`, beside the linear they
gate) have each gate folded into that linear (W <- g W, b <- g b, in float32, rounded once) and
dropped; bundled preview heads (`coarse_*`) are dropped (the release's dev file carries neither), and
so is `decoder.type_emb`, a training-time embedding the shipped file carries and no decoder uses
(ltx-core's network has no such parameter; its loader is not strict).

Sources: Lightricks' loader (github Lightricks/LTX-2 @ 400fd31, packages/ltx-core,
`model/video_vae/model_configurator.py` `_build_diffusion_vae_decoder_sd_ops`: prefixes, renames,
q/k/v split, gate fold, coarse drop); a public third-party loader of the shipped file (`decoder.*`,
`per_channel_statistics.*`, `decoder.type_emb` skipped); diffusers' `scripts/convert_ltx2_to_diffusers.py`
(`LTX_2_5_DIFFUSION_DECODER_RENAME_DICT`, `..._GATE_FOLD_TARGETS`, `convert_ltx2_diffusion_video_vae`).
The key set ltx-core expects is in `test_cases/models/ltx2/data/ltx2.5_release_keys.json.gz`.
"""

from __future__ import annotations

import torch
from torch import Tensor

PREFIXES = ("decoder.", "vae.decoder.")
"""Prefixes of the diffusion decoder's tensors: the release's split VAE file, a monolith file."""
STATISTICS = {"mean-of-means": "latents_mean", "std-of-means": "latents_std"}
"""The latent statistics the decoder un-normalizes with (under `per_channel_statistics.`, or
`vae.per_channel_statistics.`): file name -> our buffer."""
UNUSED = ("coarse_", "type_emb")
"""Decoder tensors (after the prefix) that no decoder reads: preview heads, the training type embedding."""
_RENAMES = (("t_embedder.mlp.0.", "t_embedder.timestep_embedder.linear_1."),
            ("t_embedder.mlp.2.", "t_embedder.timestep_embedder.linear_2."),
            (".attn.proj.", ".attn.to_out.0."), (".attn.q_norm.", ".attn.norm_q."), (".attn.k_norm.", ".attn.norm_k."))
_GATES = (".gate_msa", ".gate_mlp", ".gate_ctx")
_GATE_OF = {".attn.to_out.0.weight": ".gate_msa", ".attn.to_out.0.bias": ".gate_msa",
            ".mlp.w_down.weight": ".gate_mlp", ".mlp.w_down.bias": ".gate_mlp",
            ".context_proj.weight": ".gate_ctx", ".context_proj.bias": ".gate_ctx"}
"""Our (renamed) linear parameter suffix -> the suffix of the gate folded into it."""


def _renamed(key: str) -> str:
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key


def _fold(name: str, value: Tensor, gates: dict[str, Tensor]) -> Tensor:
    """`value` times its gate [out] (rows of a weight, entries of a bias) when the file has one."""
    suffix = next((s for s in _GATE_OF if name.endswith(s)), None)
    gate = None if suffix is None else gates.get(name[: -len(suffix)] + _GATE_OF[suffix])
    if gate is None:
        return value
    g = gate.to(torch.float32)
    return ((g[:, None] if value.ndim == 2 else g) * value.to(torch.float32)).to(value.dtype)


def state_dict_from_single_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`LTX2DiffusionDecoder`'s state dict from the release VAE file's tensors (module docstring);
    other keys (the encoder, statistics the decoder does not use, `UNUSED`) are ignored.

    Args:
        tensors: file key -> tensor (any device, meta included: only shapes are needed to rename).

    Returns:
        our name -> tensor (q/k/v are views of the fused tensor's thirds).

    Raises:
        ValueError: a fused `qkv` tensor whose first dimension is not divisible by 3, naming the key.
    """
    own: dict[str, Tensor] = {}
    out: dict[str, Tensor] = {}
    for key, value in tensors.items():
        name = key.removeprefix("vae.")
        stat = name.removeprefix("per_channel_statistics.")
        if stat in STATISTICS and stat != name:
            out[STATISTICS[stat]] = value
        elif name.startswith("decoder.") and not name[len("decoder."):].startswith(UNUSED):
            own[_renamed(name)] = value
    gates = {k: own.pop(k) for k in [k for k in own if k.endswith(_GATES)]}
    for name, value in own.items():
        if name.endswith((".qkv.weight", ".qkv.bias")):
            if value.shape[0] % 3:
                raise ValueError(f"diffusion decoder: `{name}` has {value.shape[0]} rows, not a multiple of 3 "
                                 "(fused q, k, v)")
            stem, leaf = name.rsplit(".qkv.", 1)
            for proj, part in zip(("to_q", "to_k", "to_v"), value.chunk(3, dim=0)):
                out[f"{stem}.{proj}.{leaf}"] = part
            continue
        out[name] = _fold(name, value, gates)
    return out


__all__ = ["PREFIXES", "STATISTICS", "UNUSED", "state_dict_from_single_file"]
