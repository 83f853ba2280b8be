"""The Qwen-Image VAE: the Wan2.1 causal 3D VAE run on single images (one frame, 8x spatial, 16 channels).

Source: diffusers 0.42.1 `AutoencoderKLQwenImage` (models/autoencoders/autoencoder_kl_qwenimage.py)
is the Wan2.1 VAE with Qwen-Image's weights: same modules, same parameter names and shapes as
`AutoencoderKLWan` (Wan2.1, non-residual; checked by test_cases/models/qwen_image/
test_vae_scheduler.py), so the network is the shared `runnerkit.nets.causal_vae3d.CausalVAE3D` and the
key converters are its. What differs is the config (`input_channels` instead of `in_channels` / `out_channels`, no
`scale_factor_*`, no `is_residual`) and how the Qwen-Image pipelines use it on images:

- encode (`QwenImageEditPipeline` / `QwenImageEditPlusPipeline._encode_vae_image`): posterior mean
  (`retrieve_latents(..., sample_mode="argmax")`), then `(z - mean) / std` per channel.
- decode (`QwenImagePipeline.__call__` after the loop): latents cast to the VAE dtype,
  `z / (1 / std) + mean`, `vae.decode(z)` (clamped to [-1, 1] inside), frame 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runnerkit.models.qwen_image.arch import QwenImageVAEArch
from runnerkit.nets import causal_vae3d
from runnerkit.nets.causal_vae3d import CausalVAE3D, build_causal_vae3d, check_arch

__all__ = ["arch_from_diffusers_config", "arch_to_diffusers_config", "build_qwen_vae", "decode_latents",
           "diffusers_to_native", "encode_image", "native_to_diffusers"]

DIFFUSERS_CLASS = "AutoencoderKLQwenImage"

# diffusers `AutoencoderKLQwenImage` config key -> `QwenImageVAEArch` field: AutoencoderKLWan's keys.
_CONFIG_FIELDS = causal_vae3d.DIFFUSERS_CONFIG_FIELDS
# Keys with no arch field: accepted when their value is one this VAE runs. `dropout` only acts
# in training, so any value in [0, 1) is accepted and ignored.
_CONFIG_CHECKED = ("dropout", "input_channels")


# ---- config ------------------------------------------------------------------------------

def arch_from_diffusers_config(config: dict[str, Any]) -> QwenImageVAEArch:
    """`QwenImageVAEArch` from an `AutoencoderKLQwenImage` config (a `vae/config.json` as a dict).

    Absent keys take diffusers' defaults, which are Qwen-Image's. `_`-prefixed metadata
    (`_diffusers_version`, `_use_default_values`, ...) is ignored except `_class_name`.

    Raises:
        ValueError: naming the key: an unknown key; `_class_name` other than
            'AutoencoderKLQwenImage'; `input_channels` other than 3; `dropout` outside [0, 1);
            a value `QwenImageVAEArch` refuses (lengths of `latents_mean` / `latents_std` /
            `temperal_downsample`); or one `CausalVAE3D` cannot run (non-empty `attn_scales`, a
            temporal compression other than 4, a non-positive `latents_std`).
    """
    known = {*_CONFIG_FIELDS, *_CONFIG_CHECKED}
    unknown = sorted(k for k in config if k not in known and not k.startswith("_"))
    if unknown:
        raise ValueError(f"unknown {DIFFUSERS_CLASS} config keys {unknown}; allowed: "
                         f"{sorted([*_CONFIG_FIELDS, *_CONFIG_CHECKED])} and `_`-prefixed metadata")
    if config.get("_class_name", DIFFUSERS_CLASS) != DIFFUSERS_CLASS:
        raise ValueError(f"`_class_name` must be {DIFFUSERS_CLASS!r}; got {config['_class_name']!r}")
    if config.get("input_channels", 3) != 3:
        raise ValueError(f"`input_channels` must be 3 (RGB); got {config['input_channels']!r}")
    dropout = config.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"`dropout` must be a number in [0, 1) (ignored at inference); got {dropout!r}")
    arch = QwenImageVAEArch(**{field: config[key] for key, field in _CONFIG_FIELDS.items() if key in config})
    try:
        check_arch(arch)
    except NotImplementedError as exc:
        raise ValueError(str(exc)) from exc
    return arch


def arch_to_diffusers_config(arch: QwenImageVAEArch) -> dict[str, Any]:
    """`AutoencoderKLQwenImage` config equivalent to `arch` (JSON-ready: tuples become lists).

    `AutoencoderKLQwenImage(**config)` builds the same network; `_class_name` is included.

    Raises:
        ValueError / NotImplementedError: as `check_arch`, for an arch `CausalVAE3D` cannot run.
    """
    check_arch(arch)
    config: dict[str, Any] = {"_class_name": DIFFUSERS_CLASS}
    for key, field in _CONFIG_FIELDS.items():
        value = getattr(arch, field)
        config[key] = list(value) if isinstance(value, tuple) else value
    config["dropout"] = 0.0
    config["input_channels"] = 3
    return config


# ---- weights -----------------------------------------------------------------------------

def diffusers_to_native(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an `AutoencoderKLQwenImage` state dict to the shared VAE's native names (tensors shared).

    The parameter names of `AutoencoderKLQwenImage` equal those of `AutoencoderKLWan` (Wan2.1),
    so this is the shared VAE's converter.

    Raises:
        CheckpointError: listing the keys that are not such names (the message names the AutoencoderKLWan layout).
    """
    return causal_vae3d.diffusers_to_native(state_dict)


def native_to_diffusers(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a state dict in the shared VAE's native names to `AutoencoderKLQwenImage` names (tensors shared).

    Raises:
        CheckpointError: listing the keys that are not native names of the shared VAE.
    """
    return causal_vae3d.native_to_diffusers(state_dict)


def build_qwen_vae(arch: QwenImageVAEArch, state_dict_native: dict[str, Tensor],
                   dtype: torch.dtype = torch.float32) -> CausalVAE3D:
    """Build the Qwen-Image VAE on the meta device and load `state_dict_native` strictly.

    Args:
        arch: the architecture (its `latents_mean` / `latents_std` are the normalisation
            statistics `encode_image` / `decode_latents` apply).
        state_dict_native: the shared VAE's native names (convert diffusers weights with
            `diffusers_to_native`).
        dtype: weight dtype (float32 or bfloat16).

    Raises:
        CheckpointError: listing missing / unexpected keys or shape mismatches.
    """
    return build_causal_vae3d(arch, state_dict_native, dtype=dtype)


# ---- images <-> normalised latents --------------------------------------------------------

def encode_image(vae: CausalVAE3D, image: Tensor) -> Tensor:
    """Normalised latents of a reference image, as the Qwen-Image Edit / Edit-Plus pipelines compute them.

    Posterior mean (nothing sampled), then `(z - mean) / std` per channel in float32: that is
    `CausalVAE3D.encode` on a one-frame video, so the statistics are applied once, here.

    Args:
        image: [B, 3, H, W] in [-1, 1], H and W multiples of 8 (the Edit pipelines resize to
            multiples of 32 before this).

    Returns:
        [B, z_dim, 1, H / 8, W / 8] float32.

    Raises:
        ValueError: `image` is not [B, 3, H, W], or H / W are not positive multiples of 8.
    """
    if image.ndim != 4 or image.shape[1] != 3:
        raise ValueError(f"`image` must be [B, 3, H, W]; got shape {tuple(image.shape)}")
    return vae.encode(image.unsqueeze(2))  # [B, 3, 1, H, W] -> [B, z, 1, H/8, W/8]


@torch.no_grad()
def decode_latents(vae: CausalVAE3D, latents: Tensor) -> Tensor:
    """Decode normalised latents to images, as `QwenImagePipeline` does after the denoising loop.

    Order of diffusers' pipeline: cast the latents to the VAE's dtype, de-normalise in that
    dtype as `z / (1 / std) + mean`, decode, keep frame 0. The clamp to [-1, 1] happens inside
    the VAE decode (`CausalVAE3D.decode_raw`, as `AutoencoderKLQwenImage._decode`); diffusers'
    `image_processor.postprocess` then maps to [0, 1] with `(x / 2 + 0.5).clamp(0, 1)`, which is
    the caller's job here.

    Args:
        latents: [B, z_dim, 1, h, w] normalised (as the scheduler / `unpack_latents` give them).

    Returns:
        [B, 3, 8h, 8w] float32 in [-1, 1].

    Raises:
        ValueError: `latents` is not [B, z_dim, 1, h, w] floating.
    """
    if latents.ndim != 5 or latents.shape[1] != vae.z_dim or latents.shape[2] != 1:
        raise ValueError(f"`latents` must be [B, {vae.z_dim}, 1, h, w]; got shape {tuple(latents.shape)}")
    if not latents.is_floating_point():
        raise ValueError(f"`latents` must be a floating tensor; got dtype {latents.dtype}")
    weight = vae.conv2.weight
    z = latents.to(device=weight.device, dtype=weight.dtype)
    # The statistics in the VAE dtype, and the std inverted before dividing, as diffusers does
    # (x / (1 / s) and x * s differ in the last bit).
    mean = torch.tensor(vae.arch.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    std_inv = 1.0 / torch.tensor(vae.arch.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
    z = z / std_inv + mean  # [B, z, 1, h, w], not normalised
    video = vae.decode_raw(z)  # [B, 3, 1, 8h, 8w], clamped to [-1, 1]
    return video[:, :, 0].float()  # [B, 3, 8h, 8w]
