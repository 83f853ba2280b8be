"""Architecture descriptions of the Wan2.1 networks, in runnerkit's own names.

Each class holds the numbers that define one network; the defaults are the public Wan2.1
release values (Wan-Video/Wan2.1, `wan/configs/` and `wan/modules/*.py`). They are read from a
checkpoint (our `runnerkit.json`, Wan's `config.json`, or diffusers' `*/config.json`) or given
under the `model` key of a runnerkit JSON config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from runnerkit.arch import Arch
from runnerkit.nets.causal_vae3d_arch import RELEASE_LATENTS_MEAN, RELEASE_LATENTS_STD, CausalVAE3DArch

# Per-channel statistics of the Wan2.1 VAE latent space (Wan2.1 `wan/modules/vae.py`, WanVAE).
WAN21_LATENTS_MEAN: tuple[float, ...] = RELEASE_LATENTS_MEAN
WAN21_LATENTS_STD: tuple[float, ...] = RELEASE_LATENTS_STD

WAN_CLIP_DIM = 1280
"""Width of the CLIP ViT-H/14 image features that condition the i2v / flf2v transformers."""
WAN_CLIP_TOKENS = 257
"""CLIP tokens per image: the class token and 16 x 16 patches of 14 pixels (224 x 224 input)."""


class WanTransformerArch(Arch):
    """Wan2.1 diffusion transformer (`WanModel`); defaults are the 1.3B model."""

    model_type: Literal["t2v", "i2v", "flf2v"] = Field("t2v", description="Task family of the weights.")
    image_context: bool | None = Field(
        None, description="Whether the blocks attend to CLIP image tokens (image cross-attention, `img_emb`): "
        "Wan2.1 i2v / flf2v true, Wan2.2 i2v false (it conditions through `y` only), t2v false. "
        "Omitted: true for i2v / flf2v, false for t2v.")
    patch_size: tuple[int, int, int] = Field((1, 2, 2), strict=False, description="(t, h, w) patch of the latent grid.")
    text_len: int = Field(512, gt=0, description="Context length the text embeddings are padded to.")
    in_dim: int = Field(16, gt=0, description="Latent channels in.")
    dim: int = Field(1536, gt=0, description="Hidden size.")
    ffn_dim: int = Field(8960, gt=0, description="FFN inner size.")
    freq_dim: int = Field(256, gt=0, description="Sinusoidal timestep embedding size.")
    text_dim: int = Field(4096, gt=0, description="Text encoder output size.")
    out_dim: int = Field(16, gt=0, description="Latent channels out.")
    num_heads: int = Field(12, gt=0, description="Attention heads.")
    num_layers: int = Field(30, gt=0, description="Transformer blocks.")
    qk_norm: bool = Field(True, description="RMSNorm on queries and keys.")
    cross_attn_norm: bool = Field(True, description="LayerNorm (affine) before cross-attention.")
    eps: float = Field(1e-6, gt=0, description="Norm epsilon.")

    @model_validator(mode="before")
    @classmethod
    def _default_image_context(cls, data: Any, info: ValidationInfo) -> Any:
        partial = bool(info.context and info.context.get("partial"))
        if isinstance(data, dict) and data.get("image_context") is None and not partial:
            data = {**data, "image_context": data.get("model_type", "t2v") in ("i2v", "flf2v")}
        return data

    @model_validator(mode="after")
    def _heads_divide_dim(self, info: ValidationInfo) -> WanTransformerArch:
        if self._check(info, "dim", "num_heads") and self.dim % self.num_heads or (self.dim // self.num_heads) % 2:  # RoPE rotates pairs of head channels
            raise ValueError(f"`dim`={self.dim} must be `num_heads`={self.num_heads} times an even head size")
        image = self.model_type != "t2v"
        if self._check(info, "model_type", "in_dim", "out_dim") and image and self.in_dim <= self.out_dim:
            raise ValueError(f"`model_type`={self.model_type!r} takes the conditioning channels `y` after the latents: "
                             f"`in_dim`={self.in_dim} must exceed `out_dim`={self.out_dim} (Wan2.1: 36 = 16 + 4 + 16)")
        return self


class CLIPVisionArch(Arch):
    """CLIP vision tower as Wan2.1 i2v / flf2v use it (open-clip xlm-roberta-large ViT-huge-14, visual
    part: pre-norm, exact GELU, class token); defaults are the released ViT-H/14."""

    image_size: int = Field(224, gt=0, description="Input side in pixels (images are resized to it).")
    patch_size: int = Field(14, gt=0, description="Square patch side in pixels.")
    dim: int = Field(1280, gt=0, description="Width.")
    ffn_dim: int = Field(5120, gt=0, description="MLP inner size (4 x dim).")
    num_heads: int = Field(16, gt=0)
    num_layers: int = Field(32, gt=1, description="Blocks in the checkpoint; the encoder runs all but the last.")
    eps: float = Field(1e-5, gt=0, description="LayerNorm epsilon.")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> CLIPVisionArch:
        if self._check(info, "dim", "num_heads") and self.dim % self.num_heads:
            raise ValueError(f"`dim`={self.dim} must be a multiple of `num_heads`={self.num_heads}")
        if self._check(info, "image_size", "patch_size") and self.image_size % self.patch_size:
            raise ValueError(f"`image_size`={self.image_size} must be a multiple of `patch_size`={self.patch_size}")
        return self


class UMT5Arch(Arch):
    """UMT5 encoder as Wan uses it (`umt5-xxl` encoder only); defaults are umt5-xxl."""

    vocab_size: int = Field(256384, gt=0)
    dim: int = Field(4096, gt=0, description="Model width.")
    dim_attn: int = Field(4096, gt=0, description="Attention inner width (heads * head_dim).")
    dim_ffn: int = Field(10240, gt=0, description="Gated-GELU FFN inner width.")
    num_heads: int = Field(64, gt=0)
    num_layers: int = Field(24, gt=0)
    num_buckets: int = Field(32, gt=0, description="Relative position buckets.")
    max_distance: int = Field(128, gt=0, description="Largest relative distance with its own bucket range.")
    eps: float = Field(1e-6, gt=0)
    text_len: int = Field(512, gt=0, description="Tokens per prompt (padded/truncated).")

    @model_validator(mode="after")
    def _heads_divide_attention(self, info: ValidationInfo) -> UMT5Arch:
        if self._check(info, "dim_attn", "num_heads") and self.dim_attn % self.num_heads:
            raise ValueError(f"`dim_attn`={self.dim_attn} must be a multiple of `num_heads`={self.num_heads}")
        return self


WanVAEArch = CausalVAE3DArch
"""Wan2.1 causal 3D VAE (`WanVAE_`): the shared network's architecture (runnerkit/nets/), whose
defaults are the released Wan2.1 VAE."""


class WanArch(Arch):
    """The networks of a Wan pipeline: text encoder, transformer, VAE and, for the transformers
    with image cross-attention (Wan2.1 i2v / flf2v), the CLIP image encoder."""

    transformer: WanTransformerArch = WanTransformerArch()
    text_encoder: UMT5Arch = UMT5Arch()
    vae: WanVAEArch = WanVAEArch()
    image_encoder: CLIPVisionArch | None = Field(
        None, description="CLIP vision tower; present exactly when `transformer.image_context` is true. "
        "Omitted: the released CLIP ViT-H/14 (the `CLIPVisionArch` defaults) when the transformer attends to "
        "image tokens, as the original layout reads it; else none.")

    @model_validator(mode="after")
    def _image_encoder_fits(self, info: ValidationInfo) -> WanArch:
        if not self._check(info, "transformer", "image_encoder") or self.transformer.image_context is None:
            return self  # a partial override: checked once merged with the checkpoint's architecture
        wants = self.transformer.image_context
        if wants and "image_encoder" not in self.model_fields_set:  # omitted: the released CLIP
            return self.model_copy(update={"image_encoder": CLIPVisionArch()})
        if wants and self.image_encoder is None:
            raise ValueError(f"`transformer.model_type`={self.transformer.model_type!r} attends to CLIP image tokens "
                             "(`image_context` true): `image_encoder` (the CLIP vision tower) is needed")
        if not wants and self.image_encoder is not None:
            raise ValueError(f"`image_encoder` is given but the transformer (`model_type`="
                             f"{self.transformer.model_type!r}, `image_context` false) takes no CLIP image tokens: remove it")
        return self
