"""Key maps and config converters between the Wan2.1 transformer layouts.

Native names are the original Wan2.1 release names (`WanModel`, Wan-Video/Wan2.1). The diffusers
names are those of `diffusers.WanTransformer3DModel` (diffusers 0.3x-0.4x,
`models/transformers/transformer_wan.py`). Both maps are explicit tables; every key must be
listed, so an unknown key is an error, never silently dropped.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from runnerkit.models.wan.arch import WAN_CLIP_DIM, WAN_CLIP_TOKENS, WanTransformerArch
from runnerkit.weights import CheckpointError, short_list

# Module prefixes outside the blocks: (native, diffusers). Each maps both `.weight` and `.bias`.
_TOP_MODULES: tuple[tuple[str, str], ...] = (
    ("patch_embedding", "patch_embedding"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("head.head", "proj_out"),
    # i2v / flf2v image projection (Wan `MLPProj`), kept here so the layouts stay complete.
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
)
_TOP_PARAMS: tuple[tuple[str, str], ...] = (
    ("head.modulation", "scale_shift_table"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
)
# Module prefixes inside `blocks.N.`. Note the swap: Wan's affine cross-attention LayerNorm is
# `norm3`, diffusers calls it `norm2` (the non-affine norms have no parameters in either).
_BLOCK_MODULES: tuple[tuple[str, str], ...] = (
    *((f"self_attn.{a}", f"attn1.{b}") for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"),
                                                    ("norm_q", "norm_q"), ("norm_k", "norm_k"))),
    *((f"cross_attn.{a}", f"attn2.{b}") for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"),
                                                     ("norm_q", "norm_q"), ("norm_k", "norm_k"),
                                                     ("k_img", "add_k_proj"), ("v_img", "add_v_proj"),
                                                     ("norm_k_img", "norm_added_k"))),
    ("norm3", "norm2"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
)
_BLOCK_PARAMS: tuple[tuple[str, str], ...] = (("modulation", "scale_shift_table"),)


def _table(modules: tuple[tuple[str, str], ...], params: tuple[tuple[str, str], ...]) -> dict[str, str]:
    table = {f"{a}.{p}": f"{b}.{p}" for a, b in modules for p in ("weight", "bias")}
    table.update(dict(params))
    assert len(set(table.values())) == len(table), "key map must be one-to-one"
    return table


_TOP_TO_DIFFUSERS = _table(_TOP_MODULES, _TOP_PARAMS)
_BLOCK_TO_DIFFUSERS = _table(_BLOCK_MODULES, _BLOCK_PARAMS)
_TOP_TO_NATIVE = {v: k for k, v in _TOP_TO_DIFFUSERS.items()}
_BLOCK_TO_NATIVE = {v: k for k, v in _BLOCK_TO_DIFFUSERS.items()}
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")


def _rename(sd: dict[str, torch.Tensor], top: dict[str, str], block: dict[str, str], source: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, tensor in sd.items():
        match = _BLOCK_KEY.fullmatch(key)
        if match and match.group(2) in block:
            out[f"blocks.{match.group(1)}.{block[match.group(2)]}"] = tensor
        elif key in top:
            out[top[key]] = tensor
        else:
            unknown.append(key)
    if unknown:
        # Block keys that other blocks have and a block lacks (optional keys, such as i2v's, are in all
        # blocks or none): most often what an unknown key was meant to be.
        blocks: dict[str, set[str]] = {}
        for key in sd:
            if match := _BLOCK_KEY.fullmatch(key):
                blocks.setdefault(match.group(1), set()).add(match.group(2))
        common = set().union(*blocks.values()) & set(block) if blocks else set()
        missing = sorted(f"blocks.{i}.{name}" for i, names in blocks.items() for name in common - names)
        raise CheckpointError(f"transformer: {len(unknown)} keys are not {source} Wan transformer keys: "
                              f"{short_list(sorted(unknown))}" +
                              (f"; missing in their blocks ({len(missing)}): {short_list(missing)}" if missing else ""))
    return out


def diffusers_to_native(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a diffusers `WanTransformer3DModel` state dict to the original Wan names.

    Raises:
        CheckpointError: listing every key that is not a diffusers Wan transformer key.
    """
    return _rename(sd, _TOP_TO_NATIVE, _BLOCK_TO_NATIVE, "diffusers")


def native_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an original-Wan state dict to diffusers `WanTransformer3DModel` names.

    Raises:
        CheckpointError: listing every key that is not an original Wan transformer key.
    """
    return _rename(sd, _TOP_TO_DIFFUSERS, _BLOCK_TO_DIFFUSERS, "original")


# ---------------------------------------------------------------------------------------------
# Configs

# `WanModel.__init__` defaults: what Wan uses for a key its config.json leaves out (the release
# configs omit the five `ignore_for_config` keys, which Wan's loader never reads).
_ORIGINAL_DEFAULTS: dict[str, Any] = {
    "model_type": "t2v", "patch_size": (1, 2, 2), "text_len": 512, "in_dim": 16, "dim": 2048,
    "ffn_dim": 8192, "freq_dim": 256, "text_dim": 4096, "out_dim": 16, "num_heads": 16,
    "num_layers": 32, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
}
_ORIGINAL_IGNORED = ("patch_size", "cross_attn_norm", "qk_norm", "text_dim", "window_size")
_ORIGINAL_RELEASE_KEYS = ("dim", "eps", "ffn_dim", "freq_dim", "in_dim", "model_type", "num_heads",
                          "num_layers", "out_dim", "text_len")
# `WanTransformer3DModel.__init__` defaults (diffusers), used for keys a config leaves out.
_DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
_METADATA_KEYS = ("_class_name", "_diffusers_version", "_name_or_path")
_CLIP_DIM = WAN_CLIP_DIM  # CLIP ViT-H/14 features (i2v / flf2v image conditioning)
_FLF2V_IMAGE_TOKENS = 2 * WAN_CLIP_TOKENS  # first + last frame CLIP tokens


def _merged(d: dict[str, Any], defaults: dict[str, Any], class_name: str, source: str) -> dict[str, Any]:
    unknown = sorted(set(d) - set(defaults) - set(_METADATA_KEYS))
    if unknown:
        raise ValueError(f"{source} config: unknown keys {unknown}; allowed: {sorted(defaults)}")
    if d.get("_class_name", class_name) != class_name:
        raise ValueError(f"{source} config: `_class_name`={d['_class_name']!r}, expected {class_name!r}")
    return {**defaults, **{k: v for k, v in d.items() if k not in _METADATA_KEYS}}


def arch_from_original_config(d: dict[str, Any], image_context: bool | None = None) -> WanTransformerArch:
    """Read Wan's `config.json` (`WanModel`); missing keys take `WanModel`'s defaults.

    `image_context`: whether i2v weights attend to CLIP tokens. Wan2.1 and Wan2.2 i2v configs
    look alike (`model_type` "i2v", `in_dim` 36); the caller knows the release (Wan2.2: False).
    None: the architecture's default (true for i2v / flf2v).

    Raises:
        ValueError: an unknown key, `_class_name` other than "WanModel", local attention
            (`window_size` other than (-1, -1)), or a value the arch rejects.
    """
    c = _merged(d, _ORIGINAL_DEFAULTS, "WanModel", "Wan original")
    if tuple(c["window_size"]) != (-1, -1):
        raise ValueError(f"Wan original config: `window_size`={c['window_size']!r}; only (-1, -1) (global attention) is supported")
    del c["window_size"]
    if image_context is not None and c["model_type"] != "t2v":
        c["image_context"] = image_context
    return WanTransformerArch(**c)


def arch_to_original_config(arch: WanTransformerArch) -> dict[str, Any]:
    """Wan's `config.json` for `arch`: the release keys, plus any ignored key that differs from
    `WanModel`'s default (runnerkit reads those back; Wan's own loader ignores them)."""
    values = arch.model_dump()
    config: dict[str, Any] = {"_class_name": "WanModel", **{k: values[k] for k in _ORIGINAL_RELEASE_KEYS}}
    for key in _ORIGINAL_IGNORED:
        if key in values and values[key] != _ORIGINAL_DEFAULTS[key]:
            config[key] = list(values[key]) if isinstance(values[key], tuple) else values[key]
    return config


def arch_from_diffusers_config(d: dict[str, Any], text_len: int = 512) -> WanTransformerArch:
    """Read a diffusers `WanTransformer3DModel` `config.json`; missing keys take diffusers' defaults.

    Args:
        d: the config dict.
        text_len: context length; diffusers keeps it in the pipeline (`max_sequence_length`,
            512), not in the transformer config.

    Raises:
        ValueError: an unknown key, a `qk_norm` other than "rms_norm_across_heads", a
            `rope_max_seq_len` other than 1024, or image settings that match no Wan2.1 task.
    """
    c = _merged(d, _DIFFUSERS_DEFAULTS, "WanTransformer3DModel", "diffusers")
    if c["qk_norm"] != "rms_norm_across_heads":
        raise ValueError(f"diffusers config: `qk_norm`={c['qk_norm']!r}; only 'rms_norm_across_heads' is supported")
    if c["rope_max_seq_len"] != 1024:
        raise ValueError(f"diffusers config: `rope_max_seq_len`={c['rope_max_seq_len']!r}; only 1024 is supported")
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    image = (c["image_dim"], c["added_kv_proj_dim"], c["pos_embed_seq_len"])
    tasks = {(None, None, None): "t2v", (_CLIP_DIM, dim, None): "i2v", (_CLIP_DIM, dim, _FLF2V_IMAGE_TOKENS): "flf2v"}
    if image not in tasks:
        raise ValueError(
            f"diffusers config: (`image_dim`, `added_kv_proj_dim`, `pos_embed_seq_len`)={image} matches no Wan task; "
            f"allowed: {sorted(tasks.items(), key=str)}"
        )
    out_dim = c["out_channels"] or c["in_channels"]
    # Wan2.2 i2v: no image settings, but the conditioning channels `y` widen the input (36 > 16).
    model_type = "i2v" if tasks[image] == "t2v" and c["in_channels"] > out_dim else tasks[image]
    return WanTransformerArch(
        model_type=model_type, image_context=image != (None, None, None), patch_size=tuple(c["patch_size"]), text_len=text_len,
        in_dim=c["in_channels"], dim=dim, ffn_dim=c["ffn_dim"], freq_dim=c["freq_dim"],
        text_dim=c["text_dim"], out_dim=out_dim,
        num_heads=c["num_attention_heads"], num_layers=c["num_layers"], qk_norm=True,
        cross_attn_norm=c["cross_attn_norm"], eps=c["eps"],
    )


def arch_to_diffusers_config(arch: WanTransformerArch) -> dict[str, Any]:
    """diffusers `WanTransformer3DModel` config for `arch` (`text_len` is not part of it).

    Raises:
        ValueError: `arch.qk_norm` is False (diffusers' `WanAttention` always applies q/k RMSNorm).
    """
    if not arch.qk_norm:
        raise ValueError("`qk_norm`=False cannot be expressed in diffusers (WanAttention always applies q/k RMSNorm)")
    image = bool(arch.image_context)
    return {
        "_class_name": "WanTransformer3DModel",
        "patch_size": list(arch.patch_size),
        "num_attention_heads": arch.num_heads,
        "attention_head_dim": arch.dim // arch.num_heads,
        "in_channels": arch.in_dim,
        "out_channels": arch.out_dim,
        "text_dim": arch.text_dim,
        "freq_dim": arch.freq_dim,
        "ffn_dim": arch.ffn_dim,
        "num_layers": arch.num_layers,
        "cross_attn_norm": arch.cross_attn_norm,
        "qk_norm": "rms_norm_across_heads",
        "eps": arch.eps,
        "image_dim": _CLIP_DIM if image else None,
        "added_kv_proj_dim": arch.dim if image else None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": _FLF2V_IMAGE_TOKENS if arch.model_type == "flf2v" else None,
    }
