"""Architecture of the causal 3D video VAE (`causal_vae3d.py`), in runnerkit's own names.

Defaults are the released 2.1 VAE's (4x temporal, 8x spatial compression to 16 latent
channels): diffusers' `AutoencoderKLWan` config defaults. A family that runs this network with
other weights subclasses `CausalVAE3DArch` to give its own latent statistics.
"""

from __future__ import annotations

from pydantic import Field, ValidationInfo, model_validator

from runnerkit.arch import Arch

# Per-channel statistics of the released 2.1 VAE's latent space (diffusers `AutoencoderKLWan`
# `latents_mean` / `latents_std` defaults).
RELEASE_LATENTS_MEAN: tuple[float, ...] = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
RELEASE_LATENTS_STD: tuple[float, ...] = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)


class CausalVAE3DArch(Arch):
    """Causal 3D VAE (diffusers `AutoencoderKLWan`, non-residual); defaults are the released 2.1 VAE."""

    dim: int = Field(96, gt=0, description="Base channel count.")
    z_dim: int = Field(16, gt=0, description="Latent channels.")
    dim_mult: tuple[int, ...] = Field((1, 2, 4, 4), strict=False, description="Channel multipliers per level.")
    num_res_blocks: int = Field(2, gt=0)
    attn_scales: tuple[float, ...] = Field((), strict=False, description="Scales with an attention block (release: none).")
    temporal_downsample: tuple[bool, ...] = Field((False, True, True), strict=False, description="Levels that halve time.")
    latents_mean: tuple[float, ...] = Field(RELEASE_LATENTS_MEAN, strict=False, description="Per-channel latent mean.")
    latents_std: tuple[float, ...] = Field(RELEASE_LATENTS_STD, strict=False, description="Per-channel latent std.")

    @model_validator(mode="after")
    def _consistent_levels(self, info: ValidationInfo) -> CausalVAE3DArch:
        if self._check(info, "temporal_downsample", "dim_mult") and len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"`temporal_downsample` needs one entry per downsampling level, "
                             f"len(`dim_mult`) - 1 = {len(self.dim_mult) - 1} (got {len(self.temporal_downsample)})")
        for name in ("latents_mean", "latents_std"):
            if self._check(info, name, "z_dim") and len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"`{name}` needs `z_dim`={self.z_dim} values (got {len(getattr(self, name))})")
        return self
