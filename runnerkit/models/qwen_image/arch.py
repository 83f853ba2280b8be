"""Architecture descriptions of the Qwen-Image networks, in runnerkit's own names.

Defaults are the public Qwen-Image (20B) release values: diffusers
`QwenImageTransformer2DModel` / `AutoencoderKLQwenImage` configs of `Qwen/Qwen-Image`, and
the Qwen2.5-VL-7B text encoder (`text_encoder/config.json`). They are read from a checkpoint
(`runnerkit.json`, or diffusers' `*/config.json`) or given under the `model` key of a
runnerkit JSON config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from runnerkit.arch import Arch
from runnerkit.models.qwen_image.text_encoder import QwenVLArch
from runnerkit.nets.causal_vae3d_arch import RELEASE_LATENTS_MEAN, RELEASE_LATENTS_STD, CausalVAE3DArch

# Per-channel latent statistics of the Qwen-Image VAE (diffusers `AutoencoderKLQwenImage` defaults,
# the values of `Qwen/Qwen-Image` `vae/config.json`): the same numbers as Wan2.1's.
QWEN_LATENTS_MEAN: tuple[float, ...] = RELEASE_LATENTS_MEAN
QWEN_LATENTS_STD: tuple[float, ...] = RELEASE_LATENTS_STD


class QwenImageTransformerArch(Arch):
    """Qwen-Image dual-stream MMDiT (diffusers `QwenImageTransformer2DModel`); defaults are the 20B model."""

    patch_size: int = Field(2, gt=0, description="Spatial patch of the latents (2x2).")
    in_channels: int = Field(64, gt=0, description="Packed latent channels: VAE z_dim x patch_size^2.")
    out_channels: int = Field(16, gt=0, description="Latent channels predicted per pixel of the patch grid.")
    num_layers: int = Field(60, gt=0, description="Dual-stream blocks.")
    attention_head_dim: int = Field(128, gt=0)
    num_attention_heads: int = Field(24, gt=0)
    joint_attention_dim: int = Field(3584, gt=0, description="Width of the text encoder's hidden states.")
    axes_dims_rope: tuple[int, int, int] = Field((16, 56, 56), strict=False,
                                                 description="RoPE dims of the (frame, height, width) axes.")
    zero_cond_t: bool = Field(False, description="Qwen-Image-Edit-2511: reference-image tokens modulated with t = 0.")

    @property
    def inner_dim(self) -> int:
        """Model width: heads x head size (3072 for the 20B model)."""
        return self.num_attention_heads * self.attention_head_dim

    @model_validator(mode="after")
    def _rope_fits_heads(self, info: ValidationInfo) -> QwenImageTransformerArch:
        if self._check(info, "axes_dims_rope", "attention_head_dim"):
            if sum(self.axes_dims_rope) != self.attention_head_dim:
                raise ValueError(f"`axes_dims_rope` {list(self.axes_dims_rope)} must sum to `attention_head_dim`="
                                 f"{self.attention_head_dim}")
            if any(d % 2 for d in self.axes_dims_rope):
                raise ValueError(f"`axes_dims_rope` {list(self.axes_dims_rope)} must be even numbers")
        if self._check(info, "in_channels", "out_channels", "patch_size") and \
                self.in_channels != self.out_channels * self.patch_size ** 2:
            raise ValueError(f"`in_channels`={self.in_channels} must be `out_channels` x `patch_size`^2 = "
                             f"{self.out_channels * self.patch_size ** 2}")
        return self


class QwenImageVAEArch(CausalVAE3DArch):
    """Qwen-Image VAE: the Wan2.1 causal 3D VAE architecture with Qwen-Image's weights and latent statistics."""

    latents_mean: tuple[float, ...] = Field(QWEN_LATENTS_MEAN, strict=False, description="Per-channel latent mean.")
    latents_std: tuple[float, ...] = Field(QWEN_LATENTS_STD, strict=False, description="Per-channel latent std.")


class QwenEditArch(Arch):
    """How an image-editing checkpoint conditions on its reference images (diffusers
    `QwenImageEditPipeline` / `QwenImageEditPlusPipeline`)."""

    variant: Literal["edit", "edit_plus"] = Field(
        "edit_plus", description="Edit: one reference image; Edit-Plus (2509, 2511): one or more, each announced "
                                 "to the text encoder as `Picture {i}:`.")
    vl_image_area: int = Field(384 * 384, gt=0, description="Pixels of each reference image given to the "
                               "vision-language encoder (Edit-Plus; Edit gives it the VAE-sized image).")
    vae_image_area: int = Field(1024 * 1024, gt=0, description="Pixels of each reference image the VAE encodes.")
    max_images: int = Field(3, ge=1, description="Reference images a request may give (Edit: 1).")

    @model_validator(mode="after")
    def _edit_takes_one(self, info: ValidationInfo) -> QwenEditArch:
        if self._check(info, "variant", "max_images") and self.variant == "edit" and self.max_images != 1:
            raise ValueError(f"`max_images`={self.max_images}: the Edit variant takes exactly one reference image")
        return self


class QwenImageArch(Arch):
    """The networks of a Qwen-Image pipeline and, for the editing releases, how they take references."""

    transformer: QwenImageTransformerArch = QwenImageTransformerArch()
    text_encoder: QwenVLArch = QwenVLArch()
    vae: QwenImageVAEArch = QwenImageVAEArch()
    edit: QwenEditArch | None = Field(None, description="Image editing (task i2i); None: a text-to-image checkpoint.")

    @model_validator(mode="after")
    def _text_width_fits(self, info: ValidationInfo) -> QwenImageArch:
        if self._check(info, "transformer", "text_encoder") and \
                self.transformer.joint_attention_dim != self.text_encoder.hidden_size:
            raise ValueError(f"`transformer.joint_attention_dim`={self.transformer.joint_attention_dim} must equal "
                             f"`text_encoder.hidden_size`={self.text_encoder.hidden_size}")
        if self._check(info, "transformer", "vae") and \
                self.transformer.out_channels != self.vae.z_dim:
            raise ValueError(f"`transformer.out_channels`={self.transformer.out_channels} must equal "
                             f"`vae.z_dim`={self.vae.z_dim}")
        return self
