"""LTX-2.5 diffusion video decoder: raw video latents -> pixels by a small denoising model.

Design source: diffusers 0.42.1 `models/autoencoders/ltx2_diffusion_decoder.py`
(`LTX2VideoDiffusionDecoderModel` / `LTX2VideoDiffusionDecoder3d`, a port of Lightricks' LTX-2.5
decoder), driven by `LTX2DiffusionVaeDecoderStep` (modular_pipelines/ltx2/decoders.py, the decode
block of the LTX-2.5 modular pipeline) and `LTX2VideoDiffusionDecodePipeline`; parity-tested
against them. Parameter and buffer names are diffusers' (`decoder.*`, `latents_mean`,
`latents_std`).

The network (channels-last `[B, T, H, W, C]` throughout):
1. The last latent frame is repeated `2 * (stage_kernels[0][0] // 2)` times (NATTEN shifts its
   window inward at the border; the copies move that border past the kept frames).
2. `conv_in` (a linear), then four deterministic stages: neighborhood-attention blocks followed by
   a pixel-shuffle upsampler each ((1,2,2), (2,1,1), (2,2,2), (2,2,2) in the release; a temporal
   x2 drops its duplicate first frame). The padding frames are cropped after stage 4: the result
   is the context grid [B, 8(F-1)+1, 32H/p, 32W/p, C_5] (p the stage-5 patch size).
3. Stage 5 denoises the patchified pixels (p x p space-to-depth) conditioned on that context:
   AdaLN scale/shift from the timestep, the context added through a per-block linear.
The release runs stage 5 once (`num_inference_steps=1`, x0 prediction): the output is its
prediction from pure noise. More steps integrate Euler updates on t = linspace(1, 1/n, n), 0.

Tiled decoding (diffusers' `enable_tiling`: stage 4 and stage 5 per overlapping tile, blended)
is diffusion_decode_tiled.py. Not covered: the NATTEN kernel processor (the FlexAttention window
computes the same attention).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor, nn

from runnerkit.arch import config_file_error
from runnerkit.models.ltx2.diffusion_decoder_layers import (
    DiffusionNABlock,
    Kernel,
    NABlock,
    PixelShuffleUpsampler,
    stage_mask,
)
from runnerkit.models.ltx2.layers import TimestepMLP, timestep_features
from runnerkit.weights import load_on_meta


class LTX2DiffusionDecoderArch(BaseModel):
    """The decoder's architecture in diffusers' config names; defaults are the LTX-2.5 release's
    (diffusers' `LTX2VideoDiffusionDecoderModel` defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    out_channels: int = Field(3, gt=0, description="Pixel channels.")
    latent_channels: int = Field(128, gt=0, description="Video latent channels (the VAE's).")
    patch_size: int = Field(4, gt=0, description="Stage-5 spatial patch size (space-to-depth of the pixels).")
    scaling_factor: float = Field(1.0, gt=0, description="Latent scaling factor (de-normalisation).")
    decoder_head_dim: int = Field(64, gt=0, multiple_of=8, description="Attention head width, every stage.")
    decoder_stage_channels: tuple[int, int, int, int, int] = Field(
        (2048, 1024, 512, 512, 256), description="Width of stages 1-5.")
    decoder_stage_depths: tuple[int, int, int, int, int] = Field((4, 6, 4, 2, 8), description="Blocks per stage.")
    decoder_stage_kernels: tuple[Kernel, Kernel, Kernel, Kernel] = Field(
        ((3, 7, 7), (3, 7, 7), (3, 5, 5), (3, 5, 5)), description="Neighborhood window (T, H, W) of stages 1-4.")
    decoder_upsample_strides: tuple[Kernel, Kernel, Kernel, Kernel] = Field(
        ((1, 2, 2), (2, 1, 1), (2, 2, 2), (2, 2, 2)), description="Pixel-shuffle stride (T, H, W) after stages 1-4.")
    decoder_upsample_channel_reductions: tuple[int, int, int, int] = Field(
        (2, 2, 1, 2), description="Width divisor of each upsampler (stage i+1 width = stage i width / it).")
    decoder_stage5_kernel: Kernel = Field((11, 11, 11), description="Neighborhood window of stage 5.")
    decoder_t_emb_dim: int = Field(384, gt=0, description="Timestep embedding width.")
    decoder_timestep_scale_multiplier: float = Field(1000.0, gt=0, description="t in [0, 1] is multiplied by it.")
    decoder_model_output_type: Literal["x0", "v"] = Field("x0", description="What stage 5 predicts.")
    decoder_num_inference_steps: int = Field(1, ge=1, description="Default number of stage-5 steps.")
    spatial_compression_ratio: int = Field(32, gt=0, description="Pixels per latent cell (H and W).")
    temporal_compression_ratio: int = Field(8, gt=0, description="Frames per latent frame after the first.")

    def model_post_init(self, _context: Any) -> None:
        for i, reduction in enumerate(self.decoder_upsample_channel_reductions):
            expected = self.decoder_stage_channels[i] // reduction
            if self.decoder_stage_channels[i + 1] != expected:
                raise ValueError(f"`decoder_stage_channels[{i + 1}]` must be decoder_stage_channels[{i}] // "
                                 f"decoder_upsample_channel_reductions[{i}] = {expected}, "
                                 f"got {self.decoder_stage_channels[i + 1]}.")

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any],
                              where: str = "diffusion_decoder config") -> LTX2DiffusionDecoderArch:
        """Read diffusers' `diffusion_decoder/config.json` (keys starting with `_` are ignored) as JSON is read:
        lists fill the tuple fields, and nothing is coerced (a string or a float where an int is expected is
        refused).

        Raises:
            ValueError: naming `where` (the file), each bad key, its value and what is allowed (an unknown key,
                a wrong type, a value out of bounds, stage widths that do not follow the reductions).
        """
        fields = {k: v for k, v in config.items() if not k.startswith("_")}
        try:
            return cls.model_validate_json(json.dumps(fields), strict=True)
        except ValidationError as exc:
            raise ValueError(config_file_error(exc, cls, where)) from None

    def to_diffusers_config(self) -> dict[str, Any]:
        """Keyword arguments of diffusers' `LTX2VideoDiffusionDecoderModel`."""
        return self.model_dump()

    @property
    def trailing_pad_frames(self) -> int:
        """Copies of the last latent frame appended before stage 1 (cropped after stage 4)."""
        return self.decoder_stage_kernels[0][0] // 2 * 2


LTX25_DIFFUSION_DECODER = LTX2DiffusionDecoderArch()
"""The LTX-2.5 release (diffusers' defaults)."""

TINY_LTX25_DIFFUSION_DECODER = LTX2DiffusionDecoderArch(
    latent_channels=8, decoder_head_dim=8, decoder_stage_channels=(32, 16, 16, 16, 8),
    decoder_stage_depths=(1, 1, 1, 1, 2), decoder_stage_kernels=((3, 1, 3), (3, 1, 3), (3, 1, 3), (3, 1, 3)),
    decoder_upsample_strides=((1, 2, 2), (2, 1, 1), (2, 1, 1), (2, 2, 2)),
    decoder_upsample_channel_reductions=(2, 1, 1, 2), decoder_stage5_kernel=(3, 3, 5), decoder_t_emb_dim=16,
    spatial_compression_ratio=16)
"""Test size: the release's temporal strides (8x) and patch size, 16x spatial, narrow widths,
small non-cubic windows; a latent of H >= 1, W >= 3 and F >= 2 fits every window."""


class LTX2DiffusionDecoder3d(nn.Module):
    """The network under `decoder.*`: deterministic stages 1-4 and the stage-5 denoiser."""

    def __init__(self, arch: LTX2DiffusionDecoderArch) -> None:
        super().__init__()
        self.arch = arch
        ch, head = arch.decoder_stage_channels, arch.decoder_head_dim
        self.conv_in = nn.Linear(arch.latent_channels, ch[0])
        self.det_stages = nn.ModuleList(
            nn.ModuleList(NABlock(ch[i], arch.decoder_stage_kernels[i], head) for _ in range(arch.decoder_stage_depths[i]))
            for i in range(4))
        self.upsamples = nn.ModuleList(
            PixelShuffleUpsampler(ch[i], arch.decoder_upsample_strides[i], arch.decoder_upsample_channel_reductions[i])
            for i in range(4))
        self.t_embedder = nn.Module()
        self.t_embedder.timestep_embedder = TimestepMLP(arch.decoder_t_emb_dim)
        pixel_channels = arch.out_channels * arch.patch_size**2
        self.conv_in_x_t = nn.Linear(pixel_channels, ch[4])
        self.shared_adaln = nn.Module()
        self.shared_adaln.proj = nn.Linear(arch.decoder_t_emb_dim, DiffusionNABlock.NUM_MOD * ch[4])
        self.diff_blocks = nn.ModuleList(
            DiffusionNABlock(ch[4], arch.decoder_stage5_kernel, ch[4], head) for _ in range(arch.decoder_stage_depths[4]))
        self.norm_out = nn.RMSNorm(ch[4], eps=1e-6)
        self.conv_out = nn.Linear(ch[4], pixel_channels)

    def context(self, latents: Tensor) -> Tensor:
        """Stages 1-4: raw latents [B, C_lat, F, H, W] -> context [B, 8(F-1)+1, 32H/p, 32W/p, C_5]
        (release strides and patch size p = 4).

        Raises:
            ValueError: a stage's grid smaller than its window (the latent is too small).
        """
        return self.stage_4(self.features(latents))

    def features(self, latents: Tensor) -> Tensor:
        """Stages 1-3 (the padding frames appended, kept): raw latents [B, C_lat, F, H, W] ->
        [B, 4(F + pad - 1) + 1, 8H, 8W, C_4] in the release (the input of the last stage, which a
        tiled decode runs per tile: diffusion_decode_tiled.py)."""
        pad = self.arch.trailing_pad_frames
        if pad:
            latents = torch.cat([latents, latents[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        x = self.conv_in(latents.permute(0, 2, 3, 4, 1))  # [B, F+pad, H, W, C_1]
        for blocks, upsample in zip(self.det_stages[:-1], self.upsamples[:-1]):
            x = self._stage(blocks, x)
            x = upsample(x)
        return x

    def stage_4(self, x: Tensor, drop_leading_frame: bool = True, crop_padding: bool = True) -> Tensor:
        """The last deterministic stage: `features` output [B, T, H, W, C_4] (or a tile of it) ->
        context [B, T_5, H_5, W_5, C_5]. The defaults are the whole video's; a temporal tile that
        does not start at frame 0 keeps the upsampler's leading frame (`drop_leading_frame` False:
        its first input frame is an interior one), and only the tile that holds the video's end
        has padding frames to crop."""
        x = self._stage(self.det_stages[-1], x)
        x = self.upsamples[-1](x, drop_leading_frame=drop_leading_frame)
        pad = self.arch.trailing_pad_frames
        if pad and crop_padding:
            x = x[:, :-pad * self.arch.temporal_compression_ratio]
        return x

    @staticmethod
    def _stage(blocks: nn.ModuleList, x: Tensor) -> Tensor:
        """A deterministic stage's blocks on x [B, T, H, W, C], one window mask shared by them."""
        attn = blocks[0].attn if len(blocks) else None
        mask = (stage_mask(tuple(x.shape[1:4]), attn.kernel, x.device, attn.head_dim, x.shape[-1])
                if attn is not None else None)
        for block in blocks:
            x = block(x, mask)
        return x

    def predict(self, context: Tensor, x_t: Tensor, t: Tensor) -> Tensor:
        """One stage-5 evaluation.

        Args:
            context: [B, T, H/p, W/p, C_5] from `context`.
            x_t: [B, 3, T, H, W] noisy pixels.
            t: [B] float32 noise level in [0, 1].

        Returns:
            [B, 3, T, H, W] prediction (x0 or velocity, per `decoder_model_output_type`).
        """
        B, C, T, H, W = x_t.shape
        p = self.arch.patch_size
        features = timestep_features(self.arch.decoder_timestep_scale_multiplier * t).to(context.dtype)
        t_emb = self.t_embedder.timestep_embedder(features)  # [B, D_t]
        modulation = self.shared_adaln.proj(torch.nn.functional.silu(t_emb))
        modulation = modulation.view(B, DiffusionNABlock.NUM_MOD, -1)  # [B, 7, C_5]
        # space-to-depth, channels packed (c, w-offset, h-offset) as the reference
        x = x_t.reshape(B, C, T, H // p, p, W // p, p).permute(0, 2, 3, 5, 1, 6, 4)  # [B, T, H/p, W/p, C, pw, ph]
        x = self.conv_in_x_t(x.reshape(B, T, H // p, W // p, C * p * p))  # [B, T, H/p, W/p, C_5]
        mask = (stage_mask((T, H // p, W // p), self.arch.decoder_stage5_kernel, x.device,
                           self.arch.decoder_head_dim, x.shape[-1]) if self.diff_blocks else None)
        for block in self.diff_blocks:
            x = block(x, context, modulation, mask)
        x = self.conv_out(self.norm_out(x))  # [B, T, H/p, W/p, C*p*p]
        x = x.view(B, T, H // p, W // p, C, p, p).permute(0, 4, 1, 2, 6, 3, 5)  # [B, C, T, H/p, ph, W/p, pw]
        return x.reshape(B, C, T, H, W)


class LTX2DiffusionDecoder(nn.Module):
    """Top level with diffusers' names: `decoder.*` plus the latent statistics buffers
    `latents_mean` / `latents_std` [C_lat] (float32; the same values as the video VAE's)."""

    def __init__(self, arch: LTX2DiffusionDecoderArch) -> None:
        super().__init__()
        self.arch = arch
        self.decoder = LTX2DiffusionDecoder3d(arch)
        self.register_buffer("latents_mean", torch.zeros(arch.latent_channels))
        self.register_buffer("latents_std", torch.ones(arch.latent_channels))

    def pixel_shape(self, latents_shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
        """[B, 3, F_px, H_px, W_px] decoded from latents of `latents_shape` [B, C, F, H, W]:
        F_px = r_t (F - 1) + 1, H_px = r_h H, W_px = r_w W with r the product of the upsample
        strides (times the patch size spatially): 8, 32, 32 in the release."""
        B, _, F, H, W = latents_shape
        a = self.arch
        r_t, r_h, r_w = (math.prod(s[axis] for s in a.decoder_upsample_strides) for axis in range(3))
        return (B, a.out_channels, r_t * (F - 1) + 1, r_h * a.patch_size * H, r_w * a.patch_size * W)


def build_ltx2_diffusion_decoder(arch: LTX2DiffusionDecoderArch, state_dict: dict[str, Tensor],
                                 dtype: torch.dtype | None = None) -> LTX2DiffusionDecoder:
    """Build on the meta device and load `state_dict` (diffusers' `diffusion_decoder/` names) strictly.

    Raises:
        CheckpointError: listing missing / unexpected keys or shape mismatches.
    """
    return load_on_meta(lambda: LTX2DiffusionDecoder(arch), state_dict, component="diffusion_decoder", dtype=dtype)


def decode_timesteps(num_inference_steps: int) -> Tensor:
    """The decoder's noise levels t_0..t_{n-1} = linspace(1, 1/n, n), [n] float32 (t_n = 0 implied).

    Raises:
        ValueError: `num_inference_steps` < 1.
    """
    if num_inference_steps < 1:
        raise ValueError(f"`num_inference_steps` must be >= 1, got {num_inference_steps}.")
    return torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps, dtype=torch.float32)


@torch.no_grad()
def denoise_pixels(decoder: LTX2DiffusionDecoder3d, context: Tensor, x_t: Tensor, num_inference_steps: int,
                   on_step: Callable[[int, int], None] | None = None) -> Tensor:
    """Stage-5 loop from the noise `x_t` [B, 3, T, H, W] (decoder dtype) given `context`
    [B, T, H/p, W/p, C_5]; returns the pixels [B, 3, T, H, W] in the decoder dtype, unclamped.
    `on_step(i, n)`: called after step i (1-based) of n, e.g. to log its time."""
    B = x_t.shape[0]
    timesteps = decode_timesteps(num_inference_steps).to(x_t.device)
    x0_output = decoder.arch.decoder_model_output_type == "x0"
    if num_inference_steps == 1 and x0_output:
        out = decoder.predict(context, x_t, timesteps[:1].expand(B))
        if on_step is not None:
            on_step(1, 1)
        return out
    for i in range(num_inference_steps):
        t = timesteps[i].expand(B)
        t_next = timesteps[i + 1] if i + 1 < num_inference_steps else torch.zeros_like(t)
        out = decoder.predict(context, x_t, t).float()
        x = x_t.float()
        if x0_output:
            out = (x - out) / t.view(B, 1, 1, 1, 1)  # velocity from the x0 prediction
        x_t = (x - (t - t_next).view(-1, 1, 1, 1, 1) * out).to(x_t.dtype)
        if on_step is not None:
            on_step(i + 1, num_inference_steps)
    return x_t
