"""Activation peaks of the LTX-2 networks around the transformer: the video VAE (decode of the whole
video, encode of the i2av frame), the x2 latent upsampler and the audio decoder (audio VAE + vocoder).

Formulas follow this package's forward code (vae.py, vae_blocks.py, upsampler.py, audio_vae.py,
vocoder.py), read as models/wan/estimate.py reads Wan's: an argument stays alive for the call it is
passed to, a local until it is rebound. Units: bytes; `s` = bytes per element of the weights' dtype
(the runner loads every module in the model dtype, so the decoders compute in it too).

Video VAE decode. The LTX-2 decoder is not causal and keeps no feature cache: diffusers' pipeline,
and this runner, decode the whole latent video in one call (no temporal chunks, no tiles), so every
layer's activation is the full video's at that layer's resolution. The estimate walks the decoder
built on the meta device (channels, strides and block order are the code's own) with the request's
latent grid, and at every convolution adds what is alive at once:
- residual block: its input (kept for the residual), the pixel-norm output, its SiLU (the argument
  of the convolution), the convolution's time-padded copy (`torch.cat` of the first and last frame
  around the input: F + 2 frames), its output, and the convolution workspace; a spatial padding
  mode other than zeros (LTX-2.0: reflect) adds `F.pad`'s copy;
- depth-to-space upsampler: its input, the padded copy, the convolution output (prod(stride) /
  factor times the input's channels) and the depth-to-space copy of it (LTX-2.0's residual adds
  the unfolded input, its repeat and the sum);
- the output convolution, the unpatchify copy, then the runner's `.float()` and `.clamp()`
  (two float32 videos at once).
Convolution workspace from planning/workspaces.py (`conv_workspace`): on the CPU the
im2col buffer or oneDNN's reorder, on CUDA 2 x the padded input + the weights (calibrated on Wan's
VAE on the H200; to check for this decoder with bench/estimate_vs_peak.py, bench/DEVICE_RUN.md §9).
The decoder's `x = block(x)` keeps each block's input alive until the block returns, and an
upsampler's output is a view of its depth-to-space copy (its first frames dropped): both are counted.
The peak is in a residual block of the last up block, at the full frame count and a quarter of the
output height and width (the VAE's 4x4 patch): for LTX-2.3 at 512x768x121, 128 channels x 121 x 128 x
192 = 0.71 GiB per activation in bf16; 7 of them (input, norm, SiLU, padded copy, output, CUDA
workspace 2 x padded) + the up block's input: 5.37 GiB. On the CPU the walk bounds the measured peak
within 0.3% (test_cases/models/ltx2/test_estimate.py).
"""

from __future__ import annotations

import functools
import math

from runnerkit.models.ltx2.arch import LTX2Arch
from runnerkit.models.ltx2.audio_arch import LATENT_DOWNSAMPLE, LTX2VocoderArch, LTX2VocoderBWEArch
from runnerkit.models.ltx2.vae import LTX2VideoDecoder, LTX2VideoVAE
from runnerkit.models.ltx2.vae_arch import LTX2VideoVAEArch
from runnerkit.models.ltx2.vae_blocks import CausalConv3d, ResnetBlock3d, Upsampler3d
from runnerkit.planning.workspaces import F32, conv_workspace
from runnerkit.weights import build_on_meta

__all__ = ["ENCODE_COPIES", "UPSAMPLER_COPIES", "VOCODER_COPIES", "audio_decode_bytes", "upsampler_bytes",
           "vae_decode_bytes", "vae_encode_bytes", "video_bytes"]

ENCODE_COPIES = 16
"""i2av's one conditioning frame through the encoder: this many copies of its largest activation
(with the causal time padding: 3 frames), a bound of a residual block's ~5 copies + padded input +
workspace. Small at any size (one frame at half the output size); never a request's peak."""
UPSAMPLER_COPIES = 8
"""Latent upsampler: copies of its widest activation (mid channels at the doubled size) alive in a
residual block: conv, GroupNorm and SiLU outputs, the input kept for the residual, the per-frame
reshape copies around the x2 stage."""
VOCODER_COPIES = 16
"""Vocoder: copies of one level's activation (channels x samples; the product stays about constant
over the levels) in a level: the input, the three parallel residual branches and their stack, the
2x anti-aliased activation's up-sampled temporaries inside a branch."""


@functools.lru_cache(maxsize=8)
def _meta_decoder(arch: LTX2VideoVAEArch) -> LTX2VideoDecoder:
    return build_on_meta(lambda: LTX2VideoVAE(arch)).decoder


def video_bytes(frames: int, height: int, width: int, element: int = F32) -> int:
    """A decoded video [3, F, H, W] of `element` bytes per value."""
    return 3 * frames * height * width * element


class _Walk:
    """Running peak of the decoder's live bytes (see the module docstring)."""

    def __init__(self, device_type: str, s: int) -> None:
        self.device_type, self.s = device_type, s
        self.peak = 0

    def at(self, live: int) -> None:
        self.peak = max(self.peak, live)

    def conv(self, conv: CausalConv3d, shape: tuple[int, int, int, int], held: int) -> tuple[int, tuple[int, ...]]:
        """A `CausalConv3d` on [C, T, H, W] with `held` bytes alive around it (its input among them);
        returns its output's bytes and shape [C', T', H', W']."""
        s, c = self.s, conv.conv
        C, T, H, W = shape
        k = conv.time_kernel
        st, sh, sw = c.stride
        ph, pw = c.padding[1], c.padding[2]
        padded = C * (T + k - 1) * H * W * s  # torch.cat with the repeated edge frames
        spatial = C * (T + k - 1) * (H + 2 * ph) * (W + 2 * pw) * s if c.padding_mode != "zeros" else 0
        out_shape = (c.out_channels, (T - 1) // st + 1, (H - 1) // sh + 1, (W - 1) // sw + 1)
        positions = math.prod(out_shape[1:])
        out = c.out_channels * positions * s
        kernel = math.prod(c.kernel_size)
        weights = c.weight.numel() * s
        ws = conv_workspace(self.device_type, (1, C, T + k - 1, H + 2 * ph, W + 2 * pw), spatial or padded, positions,
                            kernel, weights, out, s)
        self.at(held + padded + spatial + out + ws)
        return out, out_shape

    def pixel_norm_act(self, a: int, held: int) -> None:
        """pixel_norm (x**2 beside its input, then the normalised copy) and SiLU, `held` including the input."""
        self.at(held + a)  # x**2
        self.at(held + 2 * a)  # normalised + SiLU (the convolution's argument)

    def resnet(self, block: ResnetBlock3d, shape: tuple[int, int, int, int], held: int,
               stored: int | None = None) -> tuple[int, int, int, int]:
        """A residual block on [C, T, H, W]; `stored`: the bytes of its input's storage when the input is a
        view of a larger tensor (an upsampler's output without its dropped frames)."""
        s = self.s
        C, T, H, W = shape
        a_in = C * T * H * W * s
        held_in = held + (stored or a_in)  # the input, kept for the residual
        self.pixel_norm_act(a_in, held_in)
        a, out_shape = self.conv(block.conv1, shape, held_in + 2 * a_in)  # h and SiLU(h) alive
        self.pixel_norm_act(a, held_in + a)
        self.conv(block.conv2, out_shape, held_in + 2 * a)  # type: ignore[arg-type]
        self.at(held_in + 2 * a)  # h + x
        if block.conv_shortcut is not None:  # LayerNorm over channels (movedim copy) + 1x1x1 conv
            self.at(held_in + a + a_in + a)
        return out_shape  # type: ignore[return-value]

    def upsample(self, block: Upsampler3d, shape: tuple[int, int, int, int], held: int,
                 stored: int | None = None) -> tuple[tuple[int, int, int, int], int]:
        """A depth-to-space upsampler; returns the output's shape and its storage's bytes (the output is a
        view without the first stride - 1 frames of the depth-to-space copy)."""
        C, T, H, W = shape
        a_in = C * T * H * W * self.s
        held_in = held + (stored or a_in)
        out, _ = self.conv(block.conv, shape, held_in)
        self.at(held_in + 2 * out)  # depth_to_space copy beside the convolution's output
        if block.residual:  # depth_to_space(x).repeat(...) + the sum
            self.at(held_in + out + a_in + out)
            self.at(held_in + 3 * out)
        st, sh, sw = block.stride
        return (block.conv.conv.out_channels // (st * sh * sw), st * T - (st - 1), sh * H, sw * W), out


def vae_decode_bytes(arch: LTX2VideoVAEArch, latent_fhw: tuple[int, int, int], s: int,
                     device_type: str) -> tuple[int, str]:
    """Activation peak of decoding latents [1, C, f, h, w] to the float32 video [1, 3, 8(f-1)+1, 32h, 32w]
    (the runner's `.float().clamp()` included; the caller's own tensors not), and a one-line detail."""
    decoder = _meta_decoder(arch)
    walk = _Walk(device_type, s)
    f, h, w = latent_fhw
    held = arch.latent_channels * f * h * w * s  # the latents cast to the weights' dtype, alive throughout
    _, shape = walk.conv(decoder.conv_in, (arch.latent_channels, f, h, w), held)
    x: tuple[int, int, int, int] = shape  # type: ignore[assignment]
    stored: int | None = None  # bytes of x's storage when x is a view of a larger tensor
    for block in (decoder.mid_block, *decoder.up_blocks):
        # the decoder's `x = block(x)` keeps the block's input alive until the block returns
        block_in = stored or math.prod(x) * s
        layers = [block.conv_in] if getattr(block, "conv_in", None) is not None else []
        layers += [*(getattr(block, "upsamplers", None) or ()), *block.resnets]
        for k, layer in enumerate(layers):
            outer = held + (block_in if k else 0)  # the first layer counts its input (the block's) itself
            if isinstance(layer, Upsampler3d):
                x, stored = walk.upsample(layer, x, outer, stored)
            else:
                x, stored = walk.resnet(layer, x, outer, stored), None  # type: ignore[arg-type]
    a = math.prod(x) * s
    walk.pixel_norm_act(a, held + (stored or a))
    out, (_, frames, hp, wp) = walk.conv(decoder.conv_out, x, held + 2 * a)
    walk.at(held + 2 * out)  # unpatchify (permute + flatten) copy
    p = arch.patch_size
    video_s = video_bytes(frames, hp * p, wp * p, s)
    video = video_bytes(frames, hp * p, wp * p)
    walk.at(held + video_s + video)  # .float()
    walk.at(held + 2 * video)  # .clamp() beside the float copy
    gib = 2**30
    return walk.peak, f"vae decode of {frames} frames at once (video {video / gib:.2f} GiB float32)"


def vae_encode_bytes(arch: LTX2VideoVAEArch, height: int, width: int, s: int) -> int:
    """i2av: one frame of `height` x `width` through the encoder (`ENCODE_COPIES`), plus the frame itself."""
    p = arch.patch_size
    widest = max(arch.latent_channels * (height // p) * (width // p),
                 *(c * (height // (p * 2 ** (i + 1))) * (width // (p * 2 ** (i + 1)))
                   for i, c in enumerate(arch.block_out_channels)))
    return ENCODE_COPIES * 3 * widest * s + video_bytes(1, height, width)


def upsampler_bytes(arch: LTX2Arch, latent_fhw: tuple[int, int, int], s: int, device_type: str) -> int:
    """The x2 latent upsampler on stage-1 latents [1, C, f, h, w] (`UPSAMPLER_COPIES` + the workspace of
    a 3x3x3 convolution at the doubled size), with the float32 latents it de-normalises and the upsampled
    result normalised again."""
    f, h, w = latent_fhw
    up = arch.latent_upsampler
    mid = up.mid_channels
    widest = mid * f * (2 * h) * (2 * w) * s
    positions = f * (2 * h) * (2 * w)
    workspace = conv_workspace(device_type, (1, mid, f + 2, 2 * h + 2, 2 * w + 2), widest, positions, 27,
                               mid * mid * 27 * s, widest, s)
    latents = up.in_channels * f * h * w * F32
    # float32 latents: in and its de-normalised copy; out (4x the positions): raw, cast, normalised
    return UPSAMPLER_COPIES * widest + workspace + 2 * latents + 3 * 4 * latents


def _generator_level(arch: LTX2VocoderArch, frames: int) -> int:
    """Elements of the widest level of one vocoder generator on `frames` input frames."""
    length, channels, widest = frames, arch.hidden_channels, arch.hidden_channels * frames
    for factor in arch.upsample_factors:
        length, channels = length * factor, channels // 2
        widest = max(widest, channels * length * (arch.antialias_ratio if arch.antialias else 1))
    return widest


def audio_decode_bytes(arch: LTX2Arch, audio_frames: int, s: int) -> int:
    """Audio VAE decode of `audio_frames` latent frames to the mel spectrogram, then the vocoder
    (and LTX-2.3's bandwidth extender) to the waveform (float32 out)."""
    vae = arch.audio_vae
    mel_frames = max(audio_frames * LATENT_DOWNSAMPLE - (LATENT_DOWNSAMPLE - 1), 1)
    mel_bins = vae.mel_bins or vae.latent_mel_bins * LATENT_DOWNSAMPLE
    # bound: the widest level's channels at the full mel resolution (an upsampler's nearest-doubled input
    # reaches it), ~8 copies in a residual block
    vae_peak = 8 * vae.base_channels * max(vae.ch_mult) * mel_frames * mel_bins * s
    vocoder = arch.vocoder
    if isinstance(vocoder, LTX2VocoderBWEArch):
        samples = mel_frames * vocoder.vocoder.hop
        bwe_frames = -(-samples // vocoder.hop_length)
        widest = max(_generator_level(vocoder.vocoder, mel_frames), _generator_level(vocoder.bwe, bwe_frames))
        rate = vocoder.output_sampling_rate // vocoder.input_sampling_rate
        waves = (samples + 3 * samples * rate) * vae.output_channels * F32
    else:
        widest = _generator_level(vocoder, mel_frames)
        waves = 2 * mel_frames * vocoder.hop * vae.output_channels * F32
    mel = vae.output_channels * mel_frames * mel_bins * s
    return max(vae_peak, VOCODER_COPIES * widest * s + mel) + waves

