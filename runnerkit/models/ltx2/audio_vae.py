"""LTX-2 audio VAE decoder (latents -> mel spectrogram) and the audio latent layout of the pipeline.

Design and numerics follow diffusers 0.42.1 `AutoencoderKLLTX2Audio` (decoder half,
`models/autoencoders/autoencoder_kl_ltx2_audio.py`, itself a port of Lightricks' LTX-2 audio VAE):
a 2D convolutional decoder over (time, mel bins), mirroring a 3-level encoder, with convolutions
that pad only on the past side of the causal axis (time, in the release) and per-position RMS
("pixel") norms. The latent statistics and the token layout are those of `LTX2Pipeline`
(`pipelines/ltx2/pipeline_ltx2.py`): audio latents [B, C, L, M] travel through the transformer as
L tokens of C x M features, normalised per feature with the VAE's `latents_mean` / `latents_std`.

State-dict keys are diffusers' (`decoder.*`, `latents_mean`, `latents_std`); a diffusers
`audio_vae` state dict loads after dropping its `encoder.*` keys (`decoder_state_dict`). The
encoder (audio -> latents, for audio conditioning) is not written here.

Not covered (later LTX releases): LTX-2.5's Gemma-4 text path, its duration head, the diffusion
decoder and DFR layouts; none touches the audio VAE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.attention import AttentionUser
from runnerkit.models.ltx2.audio_arch import LATENT_DOWNSAMPLE, LTX2AudioVAEArch

NORM_EPS = 1e-6


# ---- latent layout (LTX2Pipeline) -----------------------------------------------------------

def audio_latent_length(num_frames: int, frame_rate: float, arch: LTX2AudioVAEArch) -> int:
    """Audio latent frames for a video of `num_frames` at `frame_rate` fps: the video's duration
    times 25 latents per second, rounded (LTX2Pipeline; 121 frames at 24 fps -> 126)."""
    return round(num_frames / frame_rate * arch.latents_per_second)


def audio_latent_shape(batch_size: int, num_frames: int, frame_rate: float,
                       arch: LTX2AudioVAEArch) -> tuple[int, int, int, int]:
    """Shape [B, latent_channels, L, latent_mel_bins] of the audio noise LTX2Pipeline draws (then packs)
    for a video of `num_frames` at `frame_rate` fps: (1, 8, 126, 16) for 121 frames at 24 fps."""
    return (batch_size, arch.latent_channels, audio_latent_length(num_frames, frame_rate, arch), arch.latent_mel_bins)


def pack_audio_latents(latents: Tensor) -> Tensor:
    """[B, C, L, M] -> [B, L, C * M] transformer tokens (feature index c * M + m)."""
    return latents.transpose(1, 2).flatten(2, 3)  # [B, L, C, M] -> [B, L, C*M]


def unpack_audio_latents(tokens: Tensor, latent_mel_bins: int) -> Tensor:
    """[B, L, C * M] tokens -> [B, C, L, M] latents, M = `latent_mel_bins` (inverse of `pack_audio_latents`)."""
    return tokens.unflatten(2, (-1, latent_mel_bins)).transpose(1, 2)  # [B, L, C, M] -> [B, C, L, M]


def normalize_audio_latents(tokens: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """(tokens - mean) / std per feature; tokens [B, L, C*M], mean and std [C*M] (cast to tokens' dtype)."""
    return (tokens - mean.to(tokens)) / std.to(tokens)


def denormalize_audio_latents(tokens: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """tokens * std + mean per feature: the transformer's audio tokens back to VAE latent values."""
    return tokens * std.to(tokens) + mean.to(tokens)


# ---- layers ---------------------------------------------------------------------------------

def pixel_norm(x: Tensor, eps: float = NORM_EPS) -> Tensor:
    """RMS over channels at every position: [B, C, T, M] -> same shape."""
    return x / torch.sqrt(x.pow(2).mean(dim=1, keepdim=True) + eps)


class PixelNorm(nn.Module):
    """`pixel_norm` as a module (no weights), standing where a GroupNorm would."""

    def forward(self, x: Tensor) -> Tensor:
        return pixel_norm(x)


def make_norm(arch: LTX2AudioVAEArch, channels: int) -> nn.Module:
    return nn.GroupNorm(32, channels, eps=NORM_EPS) if arch.norm_type == "group" else PixelNorm()


def causal_padding(kernel: int, axis: str) -> tuple[int, int, int, int]:
    """F.pad amounts (left, right, top, bottom) for a stride-1 `kernel` x `kernel` convolution that keeps
    the size: all of it before the first row (`height`) or column (`width*`), else split (larger half after)."""
    total = kernel - 1
    half = (total // 2, total - total // 2)
    if axis == "height":
        return (*half, total, 0)
    if axis in ("width", "width-compatibility"):
        return (total, 0, *half)
    return (*half, *half)


class CausalConv2d(nn.Module):
    """Conv2d (stride 1, size kept) padded on one side of the causal axis; key `conv` as diffusers."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, axis: str) -> None:
        super().__init__()
        self.padding = causal_padding(kernel, axis)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C_in, T, M] -> [B, C_out, T, M]."""
        return self.conv(F.pad(x, self.padding))


class ResnetBlock(nn.Module):
    """norm -> SiLU -> conv3 -> norm -> SiLU -> conv3, plus the input (a 1x1 conv when channels change)."""

    def __init__(self, arch: LTX2AudioVAEArch, in_channels: int, out_channels: int) -> None:
        super().__init__()
        axis = arch.causality_axis
        self.norm1 = make_norm(arch, in_channels)
        self.conv1 = CausalConv2d(in_channels, out_channels, 3, axis)
        self.norm2 = make_norm(arch, out_channels)
        self.conv2 = CausalConv2d(out_channels, out_channels, 3, axis)
        self.nin_shortcut = CausalConv2d(in_channels, out_channels, 1, axis) if in_channels != out_channels else None

    def forward(self, x: Tensor) -> Tensor:
        """[B, C_in, T, M] -> [B, C_out, T, M]."""
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(AttentionUser):
    """Single-head self-attention over all (time, mel) positions with 1x1-conv projections (unused by
    the releases: `attn_resolutions` None, `mid_block_add_attention` false)."""

    def __init__(self, arch: LTX2AudioVAEArch, channels: int) -> None:
        super().__init__()
        self.norm = make_norm(arch, channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, T, M] -> [B, C, T, M]; softmax(q k^T / sqrt(C)) v over the T*M positions."""
        B, C, T, M = x.shape
        h = self.norm(x)
        q, k, v = (proj(h).flatten(2).transpose(1, 2).unsqueeze(1) for proj in (self.q, self.k, self.v))  # [B, 1, T*M, C]
        out = self.attention_fn(q, k, v)  # [B, 1, T*M, C]
        out = out.squeeze(1).transpose(1, 2).reshape(B, C, T, M)
        return x + self.proj_out(out)


class Upsample(nn.Module):
    """Nearest 2x on both axes, then a 3x3 conv; with `height` causality the first (padding) row is
    dropped, so T -> 2T - 1 (the causal frame count 4L - 3 after two of them)."""

    def __init__(self, arch: LTX2AudioVAEArch, channels: int) -> None:
        super().__init__()
        self.axis = arch.causality_axis
        self.conv = CausalConv2d(channels, channels, 3, self.axis)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, T, M] -> [B, C, 2T (- 1 for height causality), 2M (- 1 for width causality)]."""
        x = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        if self.axis == "height":
            return x[:, :, 1:]
        if self.axis == "width":
            return x[:, :, :, 1:]
        return x  # "none" and "width-compatibility" keep every position


class Level(nn.Module):
    """One resolution level of the decoder: `block` (residual blocks), `attn`, optional `upsample`."""

    def __init__(self, blocks: list[ResnetBlock], attns: list[AttnBlock], upsample: Upsample | None) -> None:
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList(attns)
        self.upsample = upsample  # None at the finest level (no key, as diffusers)

    def forward(self, x: Tensor) -> Tensor:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        return x if self.upsample is None else self.upsample(x)


class Mid(nn.Module):
    """Middle of the decoder: residual block, optional attention, residual block."""

    def __init__(self, arch: LTX2AudioVAEArch, channels: int) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(arch, channels, channels)
        self.attn_1 = AttnBlock(arch, channels) if arch.mid_block_add_attention else nn.Identity()
        self.block_2 = ResnetBlock(arch, channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class AudioDecoder(nn.Module):
    """Latents [B, C_lat, L, M_lat] -> spectrogram [B, output_channels, T, mel_bins] (diffusers `LTX2AudioDecoder`).

    Levels are stored finest first (`up.0` is the last to run) and run coarsest first.
    """

    def __init__(self, arch: LTX2AudioVAEArch) -> None:
        super().__init__()
        self.arch = arch
        levels = len(arch.ch_mult)
        channels = arch.base_channels * arch.ch_mult[-1]
        self.conv_in = CausalConv2d(arch.latent_channels, channels, 3, arch.causality_axis)
        self.mid = Mid(arch, channels)
        attn_at = set(arch.attn_resolutions or ())
        resolution = arch.resolution // 2 ** (levels - 1)
        up: list[Level] = []
        for level in reversed(range(levels)):
            out = arch.base_channels * arch.ch_mult[level]
            blocks, attns = [], []
            for _ in range(arch.num_res_blocks + 1):
                blocks.append(ResnetBlock(arch, channels, out))
                channels = out
                if resolution in attn_at:
                    attns.append(AttnBlock(arch, channels))
            upsample = Upsample(arch, channels) if level != 0 else None
            if level != 0:
                resolution *= 2
            up.insert(0, Level(blocks, attns, upsample))
        self.up = nn.ModuleList(up)
        self.norm_out = make_norm(arch, channels)
        self.conv_out = CausalConv2d(channels, arch.output_channels, 3, arch.causality_axis)

    def forward(self, latents: Tensor) -> Tensor:
        """[B, C_lat, L, M_lat] -> [B, output_channels, max(4L - 3, 1), mel_bins].

        The network's output is cropped to that size and, where smaller (width causality drops
        mel columns), zero-padded, as diffusers does.
        """
        _, _, L, M = latents.shape
        frames = max(L * LATENT_DOWNSAMPLE - (LATENT_DOWNSAMPLE - 1), 1)
        mel_bins = self.arch.mel_bins if self.arch.mel_bins is not None else M
        x = self.mid(self.conv_in(latents))
        for level in reversed(self.up):
            x = level(x)
        x = self.conv_out(F.silu(self.norm_out(x)))  # [B, out, T', M']
        x = x[:, :, :frames, :mel_bins]
        return F.pad(x, (0, mel_bins - x.shape[3], 0, frames - x.shape[2]))


class LTX2AudioVAEDecoder(nn.Module):
    """The decoder half of the LTX-2 audio VAE with its latent statistics.

    Keys: `decoder.*`, `latents_mean`, `latents_std` ([base_channels] each: one value per packed
    audio-token feature), as in diffusers' `AutoencoderKLLTX2Audio`.
    """

    def __init__(self, arch: LTX2AudioVAEArch) -> None:
        super().__init__()
        self.arch = arch
        self.decoder = AudioDecoder(arch)
        self.register_buffer("latents_mean", torch.zeros(arch.base_channels))
        self.register_buffer("latents_std", torch.ones(arch.base_channels))

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Mel spectrogram of VAE latents (diffusers `audio_vae.decode(z).sample`).

        Args:
            latents: [B, latent_channels, L, latent_mel_bins], de-normalised (VAE latent values);
                moved to the weights' device and dtype.

        Returns:
            [B, output_channels, 4L - 3, mel_bins] log-mel spectrogram in the weight dtype.
        """
        weight = self.decoder.conv_in.conv.weight
        return self.decoder(latents.to(device=weight.device, dtype=weight.dtype))

    @torch.no_grad()
    def decode_tokens(self, tokens: Tensor) -> Tensor:
        """Spectrogram of the transformer's audio tokens, as LTX2Pipeline ends: de-normalise, unpack, decode.

        Args:
            tokens: [B, L, latent_channels * latent_mel_bins] normalised audio tokens.

        Returns:
            [B, output_channels, 4L - 3, mel_bins].
        """
        latents = denormalize_audio_latents(tokens, self.latents_mean, self.latents_std)
        return self.decode(unpack_audio_latents(latents, self.arch.latent_mel_bins))

    def forward(self, latents: Tensor) -> Tensor:
        return self.decode(latents)


def decoder_state_dict(audio_vae_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The entries of a diffusers `AutoencoderKLLTX2Audio` state dict that `LTX2AudioVAEDecoder` loads:
    all but the encoder's (`encoder.*`)."""
    return {k: v for k, v in audio_vae_state_dict.items() if not k.startswith("encoder.")}
