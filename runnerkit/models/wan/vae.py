"""Wan2.1 causal 3D video VAE: 4x temporal and 8x spatial compression to 16 latent channels.

Source: `WanVAE_` / `WanVAE` of Wan-Video/Wan2.1 (`wan/modules/vae.py`). The network, its
strict loader and the key converters to and from diffusers' `AutoencoderKLWan` are shared with
other families (runnerkit/nets/causal_vae3d.py: `CausalVAE3D`, whose native key names are those
of the released `Wan2.1_VAE.pth`); this module gives them Wan's names and translates Wan's
diffusers config (`arch_from_diffusers_config` / `arch_to_diffusers_config`).
"""

from __future__ import annotations

from typing import Any

from runnerkit.models.wan.arch import WanVAEArch
from runnerkit.nets.causal_vae3d import (
    DIFFUSERS_CONFIG_FIELDS,
    ENCODE_CHUNK_FRAMES,
    check_arch,
    diffusers_to_native,
    native_to_diffusers,
)
from runnerkit.nets.causal_vae3d import CausalVAE3D as WanVAE
from runnerkit.nets.causal_vae3d import build_causal_vae3d as build_wan_vae

__all__ = ["DIFFUSERS_CONFIG_FIELDS", "ENCODE_CHUNK_FRAMES", "WanVAE", "arch_from_diffusers_config",
           "arch_to_diffusers_config", "build_wan_vae", "check_arch", "diffusers_to_native", "native_to_diffusers"]

# ---- diffusers config <-> arch -----------------------------------------------------------

# Further keys accepted when their value is what the Wan2.1 VAE is (checked below); `dropout`
# only matters in training.
_CONFIG_CHECKED = ("dropout", "decoder_base_dim", "is_residual", "in_channels", "out_channels", "patch_size",
                   "scale_factor_temporal", "scale_factor_spatial")


def arch_from_diffusers_config(config: dict[str, Any]) -> WanVAEArch:
    """`WanVAEArch` from an `AutoencoderKLWan` config (a `vae/config.json`).

    Absent keys take diffusers' defaults, which are Wan2.1's. `dropout` is accepted and ignored
    (inference only); `_`-prefixed metadata is ignored except `_class_name`.

    Raises:
        ValueError: naming an unknown key, or a value this Wan2.1 VAE does not support:
            `_class_name` other than AutoencoderKLWan, `decoder_base_dim` != `base_dim`,
            `is_residual` (the Wan2.2 VAE), `patch_size`, channels other than 3, scale factors
            that disagree with `dim_mult` / `temperal_downsample`, non-empty `attn_scales`.
    """
    unknown = sorted(k for k in config
                     if k not in DIFFUSERS_CONFIG_FIELDS and k not in _CONFIG_CHECKED and not k.startswith("_"))
    if unknown:
        raise ValueError(f"unknown AutoencoderKLWan config keys {unknown}; allowed: "
                         f"{sorted([*DIFFUSERS_CONFIG_FIELDS, *_CONFIG_CHECKED])} and `_`-prefixed metadata")
    if config.get("_class_name", "AutoencoderKLWan") != "AutoencoderKLWan":
        raise ValueError(f"`_class_name` must be 'AutoencoderKLWan'; got {config['_class_name']!r}")
    arch = WanVAEArch(**{field: config[key] for key, field in DIFFUSERS_CONFIG_FIELDS.items() if key in config})
    allowed_values = {
        "decoder_base_dim": (None, arch.dim),
        "is_residual": (False,),
        "in_channels": (3,),
        "out_channels": (3,),
        "patch_size": (None,),
        "scale_factor_temporal": (None, 2 ** sum(arch.temporal_downsample)),
        "scale_factor_spatial": (None, 2 ** (len(arch.dim_mult) - 1)),
    }
    for key, allowed in allowed_values.items():
        if key in config and config[key] not in allowed:
            raise ValueError(f"`{key}` = {config[key]!r} is not supported by the Wan2.1 VAE; allowed: "
                             f"{' or '.join(repr(a) for a in allowed)}")
    try:
        check_arch(arch)
    except NotImplementedError as exc:
        raise ValueError(str(exc)) from exc
    return arch


def arch_to_diffusers_config(arch: WanVAEArch) -> dict[str, Any]:
    """`AutoencoderKLWan` config equivalent to `arch` (JSON-ready: tuples become lists).

    Raises:
        ValueError / NotImplementedError: as `check_arch`, for an arch `WanVAE` cannot run.
    """
    check_arch(arch)
    config: dict[str, Any] = {key: getattr(arch, field) for key, field in DIFFUSERS_CONFIG_FIELDS.items()}
    config = {key: list(value) if isinstance(value, tuple) else value for key, value in config.items()}
    config["dropout"] = 0.0
    config["scale_factor_temporal"] = 2 ** sum(arch.temporal_downsample)
    config["scale_factor_spatial"] = 2 ** (len(arch.dim_mult) - 1)
    return config
