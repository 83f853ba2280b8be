"""Architecture descriptions of the Wan2.1 networks, in runnerkit's own names.

Each class holds the numbers that define one network; the defaults are the public Wan2.1
release values (Wan-Video/Wan2.1, `wan/configs/` and `wan/modules/*.py`). They are read from a
checkpoint (our `runnerkit.json`, Wan's `config.json`, or diffusers' `*/config.json`) or given
under the `model` key of a runnerkit JSON config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

# Per-channel statistics of the Wan2.1 VAE latent space (Wan2.1 `wan/modules/vae.py`, WanVAE).
WAN21_LATENTS_MEAN: tuple[float, ...] = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENTS_STD: tuple[float, ...] = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)

WAN_CLIP_DIM = 1280
"""Width of the CLIP ViT-H/14 image features that condition the i2v / flf2v transformers."""
WAN_CLIP_TOKENS = 257
"""CLIP tokens per image: the class token and 16 x 16 patches of 14 pixels (224 x 224 input)."""


class _Arch(BaseModel):
    # strict: "64" is not an int, true is not a layer count; JSON lists still fill tuple fields
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def _check(self, info: ValidationInfo, *fields: str) -> bool:
        """Whether to check a rule between `fields`: always for a whole architecture; for a partial
        override (validation context {"partial": True}) only if it gives every one of them (the
        others come from the checkpoint and are checked after merging)."""
        partial = bool(info.context and info.context.get("partial"))
        return not partial or set(fields) <= self.model_fields_set


class WanTransformerArch(_Arch):
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


class CLIPVisionArch(_Arch):
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


class UMT5Arch(_Arch):
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


class WanVAEArch(_Arch):
    """Wan2.1 causal 3D VAE (`WanVAE_`); defaults are the released Wan2.1 VAE."""

    dim: int = Field(96, gt=0, description="Base channel count.")
    z_dim: int = Field(16, gt=0, description="Latent channels.")
    dim_mult: tuple[int, ...] = Field((1, 2, 4, 4), strict=False, description="Channel multipliers per level.")
    num_res_blocks: int = Field(2, gt=0)
    attn_scales: tuple[float, ...] = Field((), strict=False, description="Scales with an attention block (Wan2.1: none).")
    temporal_downsample: tuple[bool, ...] = Field((False, True, True), strict=False, description="Levels that halve time.")
    latents_mean: tuple[float, ...] = Field(WAN21_LATENTS_MEAN, strict=False, description="Per-channel latent mean.")
    latents_std: tuple[float, ...] = Field(WAN21_LATENTS_STD, strict=False, description="Per-channel latent std.")

    @model_validator(mode="after")
    def _consistent_levels(self, info: ValidationInfo) -> WanVAEArch:
        if self._check(info, "temporal_downsample", "dim_mult") and len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"`temporal_downsample` needs one entry per downsampling level, "
                             f"len(`dim_mult`) - 1 = {len(self.dim_mult) - 1} (got {len(self.temporal_downsample)})")
        for name in ("latents_mean", "latents_std"):
            if self._check(info, name, "z_dim") and len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"`{name}` needs `z_dim`={self.z_dim} values (got {len(getattr(self, name))})")
        return self


class WanArch(_Arch):
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
