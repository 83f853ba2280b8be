"""Key maps and config converters for the Wan2.1 CLIP vision encoder (`clip.py`).

Native names are the vision tower's names in Wan's release file
`models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` without its `visual.` prefix. The other
layout is transformers' `CLIPVisionModel` / `CLIPVisionModelWithProjection` (the `image_encoder/`
folder of the diffusers Wan2.1 I2V / FLF2V releases), whose q/k/v projections are separate and
whose class and position embeddings have no batch axis.

The encoder holds only the blocks it runs (all but the last), so the maps drop, by an explicit
list, what a full checkpoint has beyond them: the last block, the final norm and projection, and
in the release file the whole text tower. Any other unknown key is an error.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from runnerkit.models.wan.arch import CLIPVisionArch
from runnerkit.weights import CheckpointError, short_list

# Block-relative module prefixes: (native, transformers); each maps `.weight` and `.bias`.
_BLOCK_MODULES: tuple[tuple[str, str], ...] = (
    ("norm1", "layer_norm1"), ("attn.proj", "self_attn.out_proj"), ("norm2", "layer_norm2"),
    ("mlp.0", "mlp.fc1"), ("mlp.2", "mlp.fc2"),
)
_HF = "vision_model."  # prefix of CLIPVisionModelWithProjection and of transformers 4 CLIPVisionModel files
_NATIVE_BLOCK = re.compile(r"transformer\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"encoder\.layers\.(\d+)\.(.+)")
_ORIGINAL_BLOCK = re.compile(r"visual\.transformer\.(\d+)\..+")


def _fail(unknown: list[str], source: str) -> None:
    if unknown:
        raise CheckpointError(f"image_encoder: {len(unknown)} keys are not {source} CLIP vision keys: "
                              f"{short_list(sorted(unknown))}")


def original_to_native(sd: dict[str, torch.Tensor], arch: CLIPVisionArch) -> dict[str, torch.Tensor]:
    """Vision-tower tensors of Wan's CLIP `.pth` (whole `XLMRobertaCLIP` state dict), native names.

    Drops the text tower (`textual.*`, `log_scale`), `visual.post_norm.*`, `visual.head` and the
    last block `visual.transformer.{num_layers - 1}.*` (unused for penultimate features).

    Raises:
        CheckpointError: listing every key that is neither a vision-tower key nor one of those.
    """
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    last = arch.num_layers - 1
    for key, tensor in sd.items():
        block = _ORIGINAL_BLOCK.fullmatch(key)
        if key.startswith("textual.") or key in ("log_scale", "visual.head") or key.startswith("visual.post_norm."):
            continue
        if block and int(block.group(1)) == last:
            continue
        if key.startswith("visual."):
            out[key.removeprefix("visual.")] = tensor
        else:
            unknown.append(key)
    _fail(unknown, "Wan original")
    return out


def native_to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native names -> the release file's names (`visual.` prefix); nothing is added back."""
    return {f"visual.{k}": v for k, v in sd.items()}


def hf_to_native(sd: dict[str, torch.Tensor], arch: CLIPVisionArch) -> dict[str, torch.Tensor]:
    """transformers `CLIPVisionModel(WithProjection)` state dict -> native names.

    Keys may carry the `vision_model.` prefix (files saved by transformers 4, the diffusers Wan
    releases, `CLIPVisionModelWithProjection`) or not (transformers 5 `CLIPVisionModel`).
    q/k/v projections are concatenated into `to_qkv`; the class embedding [dim] becomes
    [1, 1, dim] and the position table [L, dim] becomes [1, L, dim]. Dropped: the last layer,
    `post_layernorm`, `visual_projection` and a stored `position_ids` buffer.

    Raises:
        CheckpointError: an unknown key, or a layer with some but not all of q/k/v.
    """
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    block_map = {f"{b}.{p}": f"{a}.{p}" for a, b in _BLOCK_MODULES for p in ("weight", "bias")}
    top = {"embeddings.patch_embedding.weight": "patch_embedding.weight",
           "pre_layrnorm.weight": "pre_norm.weight", "pre_layrnorm.bias": "pre_norm.bias"}
    dropped = {"post_layernorm.weight", "post_layernorm.bias", "embeddings.position_ids"}
    for full_key, tensor in sd.items():
        if full_key == "visual_projection.weight":
            continue
        key = full_key.removeprefix(_HF)
        block = _HF_BLOCK.fullmatch(key)
        if key in dropped or block and int(block.group(1)) == arch.num_layers - 1:
            continue
        if key in top:
            out[top[key]] = tensor
        elif key == "embeddings.class_embedding":
            out["cls_embedding"] = tensor.reshape(1, 1, -1)
        elif key == "embeddings.position_embedding.weight":
            out["pos_embedding"] = tensor.unsqueeze(0)
        elif block and block.group(2) in block_map:
            out[f"transformer.{block.group(1)}.{block_map[block.group(2)]}"] = tensor
        elif block and (m := re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", block.group(2))):
            qkv.setdefault((block.group(1), m.group(2)), {})[m.group(1)] = tensor
        else:
            unknown.append(full_key)
    _fail(unknown, "transformers")
    for (layer, param), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"image_encoder: layer {layer} has self_attn {sorted(parts)}_proj.{param} "
                                  "but not all of q, k, v")
        fused = torch.cat([parts["q"], parts["k"], parts["v"]])  # [3*dim, ...]: Wan views the output as (3, N, d)
        out[f"transformer.{layer}.attn.to_qkv.{param}"] = fused
    return out


def native_to_hf(sd: dict[str, torch.Tensor], prefix: str = _HF) -> dict[str, torch.Tensor]:
    """Native names -> transformers `CLIPVisionModel` names (`to_qkv` split into q/k/v).

    Args:
        sd: native state dict.
        prefix: "vision_model." (the released files, `CLIPVisionModelWithProjection`) or ""
            (a transformers 5 `CLIPVisionModel`'s own `state_dict`).

    Raises:
        CheckpointError: listing every key that is not a native CLIP vision key.
    """
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    block_map = {f"{a}.{p}": f"{b}.{p}" for a, b in _BLOCK_MODULES for p in ("weight", "bias")}
    top = {"patch_embedding.weight": f"{prefix}embeddings.patch_embedding.weight",
           "pre_norm.weight": f"{prefix}pre_layrnorm.weight", "pre_norm.bias": f"{prefix}pre_layrnorm.bias"}
    for key, tensor in sd.items():
        block = _NATIVE_BLOCK.fullmatch(key)
        layer = f"{prefix}encoder.layers.{block.group(1)}." if block else ""
        if key in top:
            out[top[key]] = tensor
        elif key == "cls_embedding":
            out[f"{prefix}embeddings.class_embedding"] = tensor.reshape(-1)
        elif key == "pos_embedding":
            out[f"{prefix}embeddings.position_embedding.weight"] = tensor.squeeze(0)
        elif block and block.group(2) in block_map:
            out[layer + block_map[block.group(2)]] = tensor
        elif block and block.group(2) in ("attn.to_qkv.weight", "attn.to_qkv.bias"):
            param = block.group(2).rsplit(".", 1)[1]
            for name, part in zip("qkv", tensor.chunk(3)):
                out[f"{layer}self_attn.{name}_proj.{param}"] = part
        else:
            unknown.append(key)
    _fail(unknown, "native")
    return out


# ---------------------------------------------------------------------------------------------
# Configs

# `CLIPVisionConfig` keys that change the vision tower, and the value runnerkit requires.
_HF_REQUIRED: dict[str, Any] = {"hidden_act": "gelu", "num_channels": 3}


def arch_from_hf_config(d: dict[str, Any]) -> CLIPVisionArch:
    """Read a transformers `CLIPVisionConfig` dict (`image_encoder/config.json` of diffusers' Wan I2V).

    Keys that do not change the forward pass (dropouts, initialisers, `projection_dim`,
    metadata) are ignored; missing architecture keys are an error, not a default.

    Raises:
        ValueError: a missing size key, `hidden_act` other than "gelu", `num_channels` other than 3.
    """
    for key, value in _HF_REQUIRED.items():
        if d.get(key, value) != value:
            raise ValueError(f"CLIP vision config: `{key}`={d[key]!r}; only {value!r} is supported (Wan's ViT-H/14)")
    names = {"image_size": "image_size", "patch_size": "patch_size", "dim": "hidden_size",
             "ffn_dim": "intermediate_size", "num_heads": "num_attention_heads", "num_layers": "num_hidden_layers"}
    missing = sorted(v for v in names.values() if v not in d)
    if missing:
        raise ValueError(f"CLIP vision config: missing keys {missing}")
    return CLIPVisionArch(**{k: d[v] for k, v in names.items()}, eps=float(d.get("layer_norm_eps", 1e-5)))


def arch_to_hf_config(arch: CLIPVisionArch) -> dict[str, Any]:
    """transformers `CLIPVisionConfig` kwargs for `arch` (`CLIPVisionConfig(**arch_to_hf_config(arch))`)."""
    return {"hidden_size": arch.dim, "intermediate_size": arch.ffn_dim, "num_attention_heads": arch.num_heads,
            "num_hidden_layers": arch.num_layers, "image_size": arch.image_size, "patch_size": arch.patch_size,
            "layer_norm_eps": arch.eps, "hidden_act": "gelu", "num_channels": 3}
