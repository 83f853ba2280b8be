"""LTX-2 vocoders: mel spectrogram -> stereo waveform.

Design and numerics follow diffusers 0.42.1 `pipelines/ltx2/vocoder.py`:

- LTX-2 (19B), `LTX2Vocoder`: a HiFi-GAN generator (Kong et al. 2020, arXiv 2010.05646):
  conv_in, then per level a LeakyReLU, a transposed-convolution upsampler and the mean of parallel
  multi-receptive-field residual blocks; LeakyReLU, conv_out, tanh. 100 mel frames/s -> 24 kHz.
- LTX-2.3 (22B), `LTX2VocoderWithBWE`: the same generator in its BigVGAN form (Lee et al. 2022,
  arXiv 2206.04658: SnakeBeta activations inside 2x anti-aliasing up/down filters, no final
  tanh) making 16 kHz audio, then a bandwidth extender: the log-mel of that waveform (causal STFT
  with the checkpoint's DFT and mel bases) drives a second generator whose output is a residual
  over a 3x windowed-sinc resampling of the 16 kHz waveform; the sum is clamped to [-1, 1] (48 kHz).

Dtype: these modules compute in their weights' dtype, as diffusers does. Lightricks' reference
(`ltx_core/model/audio_vae/vocoder.py`, `VocoderWithBWE.forward`) runs the whole 2.3 vocoder in
float32 (autocast) whatever the weights' dtype, because bf16 accumulation through its ~100
sequential convolutions degrades the spectrum; load this vocoder in float32 (0.5 GB) to match it.
Otherwise the reference's 2.3 forward is diffusers' (same padding to whole STFT hops, clamp, crop).

State-dict keys are diffusers' (`conv_in`, `upsamplers.i`, `resnets.j.convs1.k`,
`resnets.j.acts1.k.act.alpha`, `...upsample.filter`, `vocoder.*`, `bwe_generator.*`, `mel_stft.*`);
the anti-aliasing filters and STFT bases are persistent buffers loaded from the checkpoint, the
resampler's filter is computed (`init_non_persistent_buffers`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.models.ltx2.audio_arch import LTX2VocoderArch, LTX2VocoderBWEArch

SNAKE_EPS = 1e-9


def kaiser_sinc_lowpass(cutoff: float, half_width: float, size: int) -> Tensor:
    """Windowed-sinc low-pass FIR of `size` taps, unit DC gain, Kaiser window (BigVGAN's `kaiser_sinc_filter1d`).

    Args:
        cutoff: cut-off frequency as a fraction of the sample rate (0 < cutoff <= 0.5).
        half_width: transition half-width, same unit; sets the window's beta (Kaiser's formula
            for the attenuation of a filter of that transition band).

    Returns:
        [size] float32.
    """
    half = size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    cpu = torch.device("cpu")  # also inside a meta-device build: a few taps, replaced by the checkpoint's
    window = torch.kaiser_window(size, beta=beta, periodic=False, device=cpu)
    # Tap times, centred: half-integers for an even size.
    t = torch.arange(-half, half, device=cpu) + 0.5 if size % 2 == 0 else torch.arange(size, device=cpu) - half
    x = 2 * cutoff * t
    sinc = torch.where(x == 0, torch.ones_like(x), torch.sin(math.pi * x) / math.pi / x)
    taps = 2 * cutoff * window * sinc
    return taps / taps.sum()


def hann_sinc_lowpass(ratio: int, zero_crossings: int = 6, rolloff: float = 0.99) -> Tensor:
    """Interpolation filter of a `ratio`x resampler (torchaudio-style Hann-windowed sinc).

    Returns:
        [2 * width * ratio + 1] float32 taps on the CPU, width = ceil(zero_crossings / rolloff) input samples.
    """
    width = math.ceil(zero_crossings / rolloff)
    t = (torch.arange(2 * width * ratio + 1, device="cpu") / ratio - width) * rolloff
    window = torch.cos(t.clamp(-zero_crossings, zero_crossings) * math.pi / zero_crossings / 2) ** 2
    return torch.sinc(t) * window * rolloff / ratio


class UpSample1d(nn.Module):
    """Upsample by `ratio`: replicate-pad, zero-stuffing transposed conv with a low-pass filter, crop.

    Kaiser filter (the anti-aliasing activations) or Hann filter (the BWE resampler); key `filter` [1, 1, K].
    """

    def __init__(self, ratio: int, kernel_size: int, window: str = "kaiser", persistent: bool = True) -> None:
        super().__init__()
        self.ratio = ratio
        self.window = window
        if window == "hann":
            self.kernel_size = 2 * math.ceil(6 / 0.99) * ratio + 1
            self.pad = math.ceil(6 / 0.99)
            self.crop = (2 * self.pad * ratio, self.kernel_size - ratio)
        else:
            self.kernel_size = kernel_size
            self.pad = kernel_size // ratio - 1
            self.crop = (self.pad * ratio + (kernel_size - ratio) // 2, self.pad * ratio + (kernel_size - ratio + 1) // 2)
        taps = hann_sinc_lowpass(ratio) if window == "hann" else kaiser_sinc_lowpass(0.5 / ratio, 0.6 / ratio, kernel_size)
        self.register_buffer("filter", taps.view(1, 1, -1), persistent=persistent)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, N] -> [B, C, ratio * N]."""
        C = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        taps = self.filter.to(x) if self.window == "hann" else self.filter
        x = self.ratio * F.conv_transpose1d(x, taps.expand(C, -1, -1), stride=self.ratio, groups=C)
        return x[..., self.crop[0]:-self.crop[1]]


class DownSample1d(nn.Module):
    """Low-pass filter (Kaiser sinc, key `filter`) and keep every `ratio`-th sample, replicate padding."""

    def __init__(self, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.padding = (kernel_size // 2 + kernel_size % 2 - 1, kernel_size // 2)
        self.register_buffer("filter", kaiser_sinc_lowpass(0.5 / ratio, 0.6 / ratio, kernel_size).view(1, 1, -1))

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, N] -> [B, C, N / ratio]."""
        C = x.shape[1]
        x = F.pad(x, self.padding, mode="replicate")
        return F.conv1d(x, self.filter.expand(C, -1, -1), stride=self.ratio, groups=C)


class Snake(nn.Module):
    """Snake (x + sin^2(a x) / a) or SnakeBeta (x + sin^2(a x) / b), per channel, a = exp(alpha), b = exp(beta)."""

    def __init__(self, channels: int, use_beta: bool) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels)) if use_beta else None

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, N] -> [B, C, N]."""
        alpha = self.alpha.exp()[:, None]  # [C, 1]
        amplitude = alpha if self.beta is None else self.beta.exp()[:, None]
        return x + (1.0 / (amplitude + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


class AntiAliasAct(nn.Module):
    """Activation at twice the sample rate: `upsample`, `act`, `downsample` (BigVGAN's Activation1d)."""

    def __init__(self, act: nn.Module, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.upsample = UpSample1d(ratio, kernel_size)
        self.act = act
        self.downsample = DownSample1d(ratio, kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.downsample(self.act(self.upsample(x)))


def make_act(arch: LTX2VocoderArch, channels: int, use_beta: bool | None = None) -> nn.Module:
    """The activation of `arch` (Snake with beta unless `use_beta` says otherwise), anti-aliased if asked."""
    if arch.act_fn == "leaky_relu":
        act: nn.Module = nn.LeakyReLU(arch.leaky_relu_negative_slope)
    else:
        act = Snake(channels, use_beta=arch.act_fn == "snakebeta" if use_beta is None else use_beta)
    return AntiAliasAct(act, arch.antialias_ratio, arch.antialias_kernel_size) if arch.antialias else act


class ResBlock(nn.Module):
    """Residual stack: for each dilation d, x += conv(act(conv_d(act(x)))) ("same" padding, kernel k)."""

    def __init__(self, arch: LTX2VocoderArch, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, dilation=d, padding="same") for d in dilations)
        self.acts1 = nn.ModuleList(make_act(arch, channels) for _ in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding="same") for _ in dilations)
        self.acts2 = nn.ModuleList(make_act(arch, channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C, N] -> [B, C, N]."""
        for act1, conv1, act2, conv2 in zip(self.acts1, self.convs1, self.acts2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class LTX2Vocoder(nn.Module):
    """Mel spectrogram -> waveform generator (diffusers `LTX2Vocoder`)."""

    def __init__(self, arch: LTX2VocoderArch) -> None:
        super().__init__()
        self.arch = arch
        self.conv_in = nn.Conv1d(arch.in_channels, arch.hidden_channels, 7, padding=3)
        self.upsamplers = nn.ModuleList()
        self.resnets = nn.ModuleList()
        channels = arch.hidden_channels
        for stride, kernel in zip(arch.upsample_factors, arch.upsample_kernel_sizes):
            self.upsamplers.append(nn.ConvTranspose1d(channels, channels // 2, kernel, stride=stride,
                                                      padding=(kernel - stride) // 2))
            channels //= 2
            for k, dilations in zip(arch.resnet_kernel_sizes, arch.resnet_dilations):
                self.resnets.append(ResBlock(arch, channels, k, dilations))
        if arch.act_fn == "leaky_relu":
            self.act_out: nn.Module = nn.LeakyReLU()  # slope 0.01, not the config's: as the original code
        else:
            self.act_out = make_act(arch.model_copy(update={"antialias": True}), channels, use_beta=True)
        self.conv_out = nn.Conv1d(channels, arch.out_channels, 7, padding=3, bias=arch.final_bias)

    def forward(self, mel: Tensor) -> Tensor:
        """Waveform of a mel spectrogram.

        Args:
            mel: [B, C, T, M] (the audio VAE's output: C channels, T frames, M mel bins), C * M = `in_channels`.

        Returns:
            [B, out_channels, T * prod(upsample_factors)], in [-1, 1] with a tanh/clamp `final_act_fn`.
        """
        x = mel.transpose(2, 3).flatten(1, 2)  # [B, C, M, T] -> [B, C*M, T]
        x = self.conv_in(x)
        per_level = len(self.arch.resnet_kernel_sizes)
        for i, upsampler in enumerate(self.upsamplers):
            if self.arch.act_fn == "leaky_relu":  # the Snake variants activate inside the residual blocks only
                x = F.leaky_relu(x, self.arch.leaky_relu_negative_slope)
            x = upsampler(x)
            branches = self.resnets[i * per_level:(i + 1) * per_level]
            x = torch.stack([block(x) for block in branches]).mean(dim=0)  # mean of the parallel blocks
        x = self.conv_out(self.act_out(x))
        if self.arch.final_act_fn == "tanh":
            x = torch.tanh(x)
        elif self.arch.final_act_fn == "clamp":
            x = x.clamp(-1, 1)
        return x


class CausalSTFT(nn.Module):
    """Magnitude STFT as a strided conv with the checkpoint's windowed DFT basis (`forward_basis`
    [2F, 1, n_fft]: real rows then imaginary rows), left padding only. `inverse_basis` is carried
    for the checkpoint's sake and unused."""

    def __init__(self, filter_length: int, hop_length: int, window_length: int) -> None:
        super().__init__()
        self.hop_length = hop_length
        self.left_pad = max(0, window_length - hop_length)
        freqs = filter_length // 2 + 1
        self.register_buffer("forward_basis", torch.zeros(2 * freqs, 1, filter_length))
        self.register_buffer("inverse_basis", torch.zeros(2 * freqs, 1, filter_length))

    def forward(self, wave: Tensor) -> Tensor:
        """[B, N] -> magnitude [B, F, N' / hop] (N' = N + window - hop)."""
        spec = F.conv1d(F.pad(wave.unsqueeze(1), (self.left_pad, 0)), self.forward_basis, stride=self.hop_length)
        real, imag = spec.chunk(2, dim=1)  # [B, F, frames] each
        return torch.sqrt(real ** 2 + imag ** 2)


class MelSTFT(nn.Module):
    """Log-mel spectrogram with the checkpoint's mel filterbank (`mel_basis` [mels, F]), floor 1e-5."""

    def __init__(self, arch: LTX2VocoderBWEArch) -> None:
        super().__init__()
        self.stft_fn = CausalSTFT(arch.filter_length, arch.hop_length, arch.window_length)
        self.register_buffer("mel_basis", torch.zeros(arch.num_mel_channels, arch.filter_length // 2 + 1))

    def forward(self, wave: Tensor) -> Tensor:
        """[B, N] -> [B, mels, frames]."""
        magnitude = self.stft_fn(wave)
        return torch.log(torch.matmul(self.mel_basis.to(magnitude.dtype), magnitude).clamp(min=1e-5))


class LTX2VocoderWithBWE(nn.Module):
    """LTX-2.3 vocoder: 16 kHz generator, then bandwidth extension to 48 kHz (diffusers `LTX2VocoderWithBWE`)."""

    def __init__(self, arch: LTX2VocoderBWEArch) -> None:
        super().__init__()
        self.arch = arch
        self.vocoder = LTX2Vocoder(arch.vocoder)
        self.bwe_generator = LTX2Vocoder(arch.bwe)
        self.mel_stft = MelSTFT(arch)
        self.resampler = UpSample1d(arch.output_sampling_rate // arch.input_sampling_rate, 0, window="hann",
                                    persistent=False)

    def init_non_persistent_buffers(self) -> None:
        """Put the resampler's filter (not in checkpoints; computed at build) next to the loaded weights
        (called by `assign_state_dict` after a meta-device build)."""
        self.resampler.filter = hann_sinc_lowpass(self.resampler.ratio).view(1, 1, -1).to(
            self.vocoder.conv_in.weight.device)

    def forward(self, mel: Tensor) -> Tensor:
        """Waveform of a mel spectrogram.

        Args:
            mel: [B, C, T, M] from the audio VAE, C * M = the first vocoder's `in_channels`.

        Returns:
            [B, out_channels, T * prod(vocoder.upsample_factors) * rate ratio] in [-1, 1], at `output_sampling_rate`.
        """
        wave = self.vocoder(mel)  # [B, C, N] at the input rate
        B, C, N = wave.shape
        hop = self.arch.hop_length
        wave = F.pad(wave, (0, -N % hop))  # whole STFT frames
        mel_bwe = self.mel_stft(wave.flatten(0, 1)).unflatten(0, (B, C))  # [B, C, mels, frames]
        residual = self.bwe_generator(mel_bwe.transpose(2, 3))  # takes [B, C, frames, mels]
        out = (residual + self.resampler(wave)).clamp(-1, 1)
        return out[..., :N * self.arch.output_sampling_rate // self.arch.input_sampling_rate]
