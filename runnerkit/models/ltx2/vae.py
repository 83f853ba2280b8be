"""LTX-2 / LTX-2.3 video VAE: 32x spatial, 8x temporal compression to 128 latent channels.

Design source: Lightricks LTX-2 (`ltx-core` video VAE), as ported by diffusers 0.42.1
(`AutoencoderKLLTX2Video`, `models/autoencoders/autoencoder_kl_ltx2.py`); parity-tested against
it. Module and parameter names are diffusers', so a diffusers `vae/` folder's state dict loads
strictly. In the single-file release the same tensors sit under the `vae.` prefix with Lightricks'
own names (`vae.decoder.up_blocks.N`, `res_blocks`, `per_channel_statistics.mean-of-means`);
diffusers' `convert_ltx2_vae_to_diffusers` gives the mapping (the loader comes in a later round).

Latents normalisation (diffusers' LTX-2 pipelines): the transformer works on
(z - latents_mean) * scaling_factor / latents_std; the VAE decodes and encodes raw z.
`decode` / `encode` here include that step; `decode_raw` / `encode_mean` do not.

Tiling (not implemented): diffusers offers spatial tiles (`enable_tiling()`: 512 px tiles every
448 px, 64 px linear blend) and frame-wise tiles (`use_framewise_decoding`: 3 latent frames every
latent frame, an 8-frame blend). Both are approximations: the decoder has no causal feature cache
(it pads time symmetrically, and space by reflect / zeros), so a tile sees other context at its
borders than the whole decode does and the blend hides the seam. A chunked decode therefore cannot
be bit-identical to the untiled one; matching diffusers' tiled output would mean reproducing its
tile grid and blends exactly (a loop and two blends, ~80 lines). diffusers' `LTX2Pipeline` does
not tile unless asked.

Not covered: LTX-2.5's diffusion decoder (`LTX2VideoDiffusionDecoderModel`), DFR, the duration
head and Gemma-4 (other networks of later releases).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.models.ltx2.vae_arch import STRIDES, LTX2VideoVAEArch, PaddingMode
from runnerkit.models.ltx2.vae_blocks import (
    CausalConv3d,
    ResnetBlock3d,
    TimeEmbedder,
    Upsampler3d,
    make_downsampler,
    pixel_norm,
)
from runnerkit.weights import load_on_meta


def normalize_latents(latents: Tensor, mean: Tensor, std: Tensor, scaling_factor: float = 1.0) -> Tensor:
    """Raw VAE latents -> the transformer's: (z - mean) * scaling_factor / std per channel.

    Args:
        latents: [B, C, F, H, W]; mean, std: [C] (cast to the latents' device and dtype, as diffusers).
    """
    mean = mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    std = std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    return (latents - mean) * scaling_factor / std


def denormalize_latents(latents: Tensor, mean: Tensor, std: Tensor, scaling_factor: float = 1.0) -> Tensor:
    """The transformer's latents -> raw VAE latents: z * std / scaling_factor + mean per channel."""
    mean = mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    std = std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    return latents * std / scaling_factor + mean


class DownBlock(nn.Module):
    """Encoder stage: residual blocks at the input width, then one downsampler to the output width."""

    def __init__(self, in_channels: int, out_channels: int, layers: int, downsample: str | None,
                 arch: LTX2VideoVAEArch) -> None:
        super().__init__()
        causal, pad = arch.encoder_causal, arch.encoder_spatial_padding_mode
        self.resnets = nn.ModuleList(ResnetBlock3d(in_channels, in_channels, causal, pad, arch.resnet_norm_eps)
                                     for _ in range(layers))
        self.downsamplers = None
        if downsample is not None:
            self.downsamplers = nn.ModuleList([make_downsampler(downsample, in_channels, out_channels, causal, pad)])

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        for downsampler in self.downsamplers or ():
            x = downsampler(x)
        return x


class MidBlock(nn.Module):
    """Residual blocks at one width; with timestep conditioning, embeds the timestep for them."""

    def __init__(self, channels: int, layers: int, causal: bool, pad: PaddingMode, eps: float,
                 inject_noise: bool = False, timestep_conditioning: bool = False) -> None:
        super().__init__()
        self.time_embedder = TimeEmbedder(4 * channels) if timestep_conditioning else None
        self.resnets = nn.ModuleList(ResnetBlock3d(channels, channels, causal, pad, eps, inject_noise,
                                                   timestep_conditioning) for _ in range(layers))

    def forward(self, x: Tensor, timestep: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        temb = None if self.time_embedder is None else self.time_embedder(timestep, x.dtype)  # [B, 4C, 1, 1, 1]
        for resnet in self.resnets:
            x = resnet(x, temb, generator)
        return x


class UpBlock(nn.Module):
    """Decoder stage: [channel-changing residual block], one depth-to-space upsampler, residual blocks."""

    def __init__(self, index: int, in_channels: int, out_channels: int, arch: LTX2VideoVAEArch) -> None:
        super().__init__()
        rev = len(arch.decoder_block_out_channels) - 1 - index  # per-block tuples are in encoder order
        causal, pad, eps = arch.decoder_causal, arch.decoder_spatial_padding_mode, arch.resnet_norm_eps
        noise, cond = arch.decoder_inject_noise[rev], arch.timestep_conditioning
        factor = arch.upsample_factor[rev]
        self.time_embedder = TimeEmbedder(4 * in_channels) if cond else None
        self.conv_in = None
        if in_channels != out_channels:
            self.conv_in = ResnetBlock3d(in_channels, out_channels, causal, pad, eps, noise, cond)
        self.upsamplers = None
        if arch.decoder_spatio_temporal_scaling[rev]:
            stride = STRIDES[arch.upsample_type[index]]  # decoder order: diffusers does not reverse it
            self.upsamplers = nn.ModuleList([Upsampler3d(out_channels * factor, stride, arch.upsample_residual[rev],
                                                         factor, causal, pad)])
        self.resnets = nn.ModuleList(ResnetBlock3d(out_channels, out_channels, causal, pad, eps, noise, cond)
                                     for _ in range(arch.decoder_layers_per_block[rev]))

    def forward(self, x: Tensor, timestep: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        if self.conv_in is not None:
            x = self.conv_in(x, None, generator)  # only built without timestep conditioning (see the arch)
        temb = None if self.time_embedder is None else self.time_embedder(timestep, x.dtype)  # [B, 4C, 1, 1, 1]
        for upsampler in self.upsamplers or ():
            x = upsampler(x)
        for resnet in self.resnets:
            x = resnet(x, temb, generator)
        return x


class LTX2VideoEncoder(nn.Module):
    """Video -> posterior mean (diffusers `LTX2VideoEncoder3d`, mean half of its output)."""

    def __init__(self, arch: LTX2VideoVAEArch) -> None:
        super().__init__()
        self.arch = arch
        causal, pad = arch.encoder_causal, arch.encoder_spatial_padding_mode
        patch_channels = arch.in_channels * arch.patch_size**2 * arch.patch_size_t
        self.conv_in = CausalConv3d(patch_channels, arch.latent_channels, causal, pad)
        channels = arch.latent_channels
        blocks = []
        for i, width in enumerate(arch.block_out_channels):
            kind = arch.downsample_type[i] if arch.spatio_temporal_scaling[i] else None
            blocks.append(DownBlock(channels, width, arch.layers_per_block[i], kind, arch))
            channels = width
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(channels, arch.layers_per_block[-1], causal, pad, arch.resnet_norm_eps)
        # latent means + one shared log-variance channel (diffusers repeats it to 128 channels)
        self.conv_out = CausalConv3d(channels, arch.latent_channels + 1, causal, pad)

    def forward(self, video: Tensor) -> Tensor:
        """[B, 3, F, H, W] in [-1, 1] -> posterior mean [B, 128, (F - 1) / 8 + 1, H / 32, W / 32]."""
        B, C, Fr, H, W = video.shape
        p, pt = self.arch.patch_size, self.arch.patch_size_t
        x = video.reshape(B, C, Fr // pt, pt, H // p, p, W // p, p)  # [B, C, F', pt, H', p, W', p]
        # channel order (c, pt, p along W, p along H), as the released conv_in weights expect
        x = x.permute(0, 1, 3, 7, 5, 2, 4, 6).flatten(1, 4)  # [B, C*pt*p*p, F', H', W']
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        x = self.conv_out(F.silu(pixel_norm(x)))  # [B, 129, f, h, w]
        return x[:, : self.arch.latent_channels]


class LTX2VideoDecoder(nn.Module):
    """Raw latents -> video (diffusers `LTX2VideoDecoder3d`)."""

    def __init__(self, arch: LTX2VideoVAEArch) -> None:
        super().__init__()
        self.arch = arch
        causal, pad, eps = arch.decoder_causal, arch.decoder_spatial_padding_mode, arch.resnet_norm_eps
        width = arch.decoder_block_out_channels[-1]
        self.conv_in = CausalConv3d(arch.latent_channels, width, causal, pad)
        self.mid_block = MidBlock(width, arch.decoder_layers_per_block[-1], causal, pad, eps,
                                  arch.decoder_inject_noise[-1], arch.timestep_conditioning)
        self.up_blocks = nn.ModuleList(UpBlock(i, c_in, c_out, arch)
                                       for i, (c_in, c_out) in enumerate(arch.decoder_up_channels))
        out_width = arch.decoder_up_channels[-1][1]
        self.conv_out = CausalConv3d(out_width, arch.out_channels * arch.patch_size**2 * arch.patch_size_t, causal, pad)
        self.time_embedder: TimeEmbedder | None = None
        self.scale_shift_table: nn.Parameter | None = None
        self.timestep_scale_multiplier: nn.Parameter | None = None
        if arch.timestep_conditioning:
            self.timestep_scale_multiplier = nn.Parameter(torch.tensor(1000.0))
            self.time_embedder = TimeEmbedder(2 * out_width)
            self.scale_shift_table = nn.Parameter(torch.zeros(2, out_width))

    def forward(self, latents: Tensor, timestep: Tensor | None = None,
                generator: torch.Generator | None = None) -> Tensor:
        """Decode raw (not normalised) latents.

        Args:
            latents: [B, 128, f, h, w].
            timestep: [B] decode timestep, required iff the arch has `timestep_conditioning`.
            generator: drives `decoder_inject_noise` (None: the global RNG, as diffusers' decoder).

        Returns:
            [B, 3, 8 (f - 1) + 1, 32 h, 32 w], roughly in [-1, 1] (not clamped).
        """
        if self.timestep_scale_multiplier is not None:
            if timestep is None:
                raise ValueError("`timestep` is required: this VAE decoder is timestep-conditioned")
            timestep = timestep * self.timestep_scale_multiplier
        x = self.conv_in(latents)
        x = self.mid_block(x, timestep, generator)
        for block in self.up_blocks:
            x = block(x, timestep, generator)
        x = pixel_norm(x)
        if self.time_embedder is not None:
            emb = self.time_embedder(timestep, x.dtype).unflatten(1, (2, -1))  # [B, 2, C, 1, 1, 1]
            shift, scale = (emb + self.scale_shift_table[None, :, :, None, None, None]).unbind(dim=1)
            x = x * (1 + scale) + shift
        x = self.conv_out(F.silu(x))  # [B, 3*pt*p*p, f', h', w']
        B, _, Fr, H, W = x.shape
        p, pt = self.arch.patch_size, self.arch.patch_size_t
        x = x.reshape(B, -1, pt, p, p, Fr, H, W)  # [B, 3, pt, p (along W), p (along H), f', h', w']
        return x.permute(0, 1, 5, 2, 6, 4, 7, 3).flatten(6, 7).flatten(4, 5).flatten(2, 3)  # [B, 3, F, H, W]


class LTX2VideoVAE(nn.Module):
    """`encoder`, `decoder` and the per-channel latent statistics (`latents_mean`, `latents_std`).

    Build with `build_ltx2_video_vae` (meta device + strict load of diffusers-named weights).
    """

    def __init__(self, arch: LTX2VideoVAEArch) -> None:
        super().__init__()
        self.arch = arch
        self.encoder = LTX2VideoEncoder(arch)
        self.decoder = LTX2VideoDecoder(arch)
        self.register_buffer("latents_mean", torch.zeros(arch.latent_channels))
        self.register_buffer("latents_std", torch.ones(arch.latent_channels))

    def _check(self, x: Tensor, name: str, channels: int, frames_step: int, size_step: int) -> None:
        if x.ndim != 5 or x.shape[1] != channels:
            raise ValueError(f"`{name}` must be [B, {channels}, F, H, W], got {tuple(x.shape)}")
        _, _, Fr, H, W = x.shape
        if (Fr - 1) % frames_step or H % size_step or W % size_step:
            raise ValueError(f"`{name}` of shape {tuple(x.shape)}: frames must be {frames_step}k + 1 and height, "
                             f"width multiples of {size_step}")

    # ---- encode ------------------------------------------------------------------------

    @torch.no_grad()
    def encode_mean(self, video: Tensor) -> Tensor:
        """Posterior mean, not normalised (diffusers `vae.encode(x).latent_dist.mode()`).

        Args:
            video: [B, 3, F, H, W] in [-1, 1], F = 8k + 1 (1 for an image), H and W multiples of 32;
                cast to the weights' device and dtype.

        Returns:
            [B, 128, (F - 1) / 8 + 1, H / 32, W / 32] in the weight dtype.

        Raises:
            ValueError: wrong rank, channels, frame count or size.
        """
        a = self.arch
        self._check(video, "video", a.in_channels, a.temporal_compression, a.spatial_compression)
        weight = self.encoder.conv_in.conv.weight
        return self.encoder(video.to(weight.device, weight.dtype))

    def encode(self, video: Tensor) -> Tensor:
        """Normalised latents of `video` as the i2v pipeline conditions on them: float32,
        (mean - latents_mean) / latents_std (diffusers' i2v normalises without `scaling_factor`,
        which is 1.0 in both releases). Shapes as `encode_mean`. diffusers first rounds the image
        to the transformer's dtype (`prompt_embeds.dtype`); pass it in that dtype to match."""
        mu = self.encode_mean(video).float()
        return normalize_latents(mu, self.latents_mean, self.latents_std)

    # ---- decode ------------------------------------------------------------------------

    @torch.no_grad()
    def decode_raw(self, latents: Tensor, timestep: Tensor | None = None,
                   generator: torch.Generator | None = None) -> Tensor:
        """Decode raw latents (diffusers `vae.decode(z, timestep).sample`, untiled).

        Args:
            latents: [B, 128, f, h, w], cast to the weights' device and dtype.
            timestep: [B] decode timestep; required iff `arch.timestep_conditioning`.
            generator: for `decoder_inject_noise` only.

        Returns:
            [B, 3, 8 (f - 1) + 1, 32 h, 32 w] in the weight dtype.

        Raises:
            ValueError: wrong rank or channels, a missing `timestep`, or (reflect padding, LTX-2.0)
                a latent height or width of 1.
        """
        self._check(latents, "latents", self.arch.latent_channels, 1, 1)
        if self.arch.decoder_spatial_padding_mode == "reflect" and min(latents.shape[-2:]) < 2:
            raise ValueError(f"`latents` of shape {tuple(latents.shape)}: the decoder pads space by 'reflect', which "
                             "needs a latent height and width of at least 2 (64 pixels)")
        weight = self.decoder.conv_in.conv.weight
        if timestep is not None:
            timestep = timestep.to(weight.device, weight.dtype)
        return self.decoder(latents.to(weight.device, weight.dtype), timestep, generator)

    def decode(self, latents: Tensor, timestep: float = 0.0, noise_scale: float | None = None,
               noise: Tensor | None = None) -> Tensor:
        """Decode the transformer's (normalised) latents as diffusers' `LTX2Pipeline` does.

        Timestep-conditioned VAEs only (no release): latents = (1 - s) latents + s noise with
        s = `noise_scale` (default: `timestep`), then the decoder sees `timestep`. Otherwise
        `timestep`, `noise_scale` and `noise` are ignored, as in the pipeline.

        Args:
            latents: [B, 128, f, h, w] normalised; the de-normalisation runs in their dtype (the
                pipeline's: `prompt_embeds.dtype`), then they are cast to the weights' dtype.
            noise: [B, 128, f, h, w], the pipeline's `randn_tensor` draw (it draws even at s = 0).

        Returns:
            [B, 3, 8 (f - 1) + 1, 32 h, 32 w] in the weight dtype, not clamped.
        """
        t = None
        if self.arch.timestep_conditioning:
            if noise is None:
                raise ValueError("`noise` is required: this VAE decoder is timestep-conditioned")
            scale = timestep if noise_scale is None else noise_scale
            B = latents.shape[0]
            t = torch.full((B,), timestep, device=latents.device, dtype=latents.dtype)
            s = torch.full((B,), scale, device=latents.device, dtype=latents.dtype)[:, None, None, None, None]
            latents = (1 - s) * latents + s * noise.to(latents.device, latents.dtype)
        z = denormalize_latents(latents, self.latents_mean, self.latents_std, self.arch.scaling_factor)
        weight = self.decoder.conv_in.conv.weight
        return self.decode_raw(z.to(weight.dtype), t)


def build_ltx2_video_vae(arch: LTX2VideoVAEArch, state_dict: dict[str, Tensor],
                         dtype: torch.dtype | None = None) -> LTX2VideoVAE:
    """Build `LTX2VideoVAE` on the meta device and load `state_dict` (diffusers names) strictly.

    Args:
        arch: the architecture.
        state_dict: diffusers `AutoencoderKLLTX2Video` key names.
        dtype: weight dtype; None keeps the checkpoint's.

    Raises:
        CheckpointError: listing missing / unexpected keys or shape mismatches.
    """
    return load_on_meta(lambda: LTX2VideoVAE(arch), state_dict, component="vae", dtype=dtype)
