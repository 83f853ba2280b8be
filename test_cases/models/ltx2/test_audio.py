"""LTX-2 audio VAE decoder, audio latent layout and vocoders: parity with diffusers 0.42.1, keys, configs."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runnerkit.models.ltx2.audio_arch import (
    LTX2_AUDIO_VAE,
    LTX2_VOCODER,
    LTX23_VOCODER,
    TINY_AUDIO_VAE,
    TINY_VOCODER,
    TINY_VOCODER_BWE,
    LTX2AudioVAEArch,
    LTX2VocoderArch,
    LTX2VocoderBWEArch,
)
from runnerkit.models.ltx2.audio_vae import (
    LTX2AudioVAEDecoder,
    audio_latent_length,
    audio_latent_shape,
    decoder_state_dict,
    normalize_audio_latents,
    pack_audio_latents,
)
from runnerkit.models.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from runnerkit.weights import assign_state_dict, build_on_meta
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder as RefVocoder
from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE as RefVocoderWithBWE

pytestmark = pytest.mark.filterwarnings(
    # diffusers' LTX2VocoderWithBWE reads `self.hop_length` (a deprecated config alias) when it pads to whole hops
    "ignore:Accessing config attribute `hop_length`:FutureWarning")

TOL = 1e-4
WIDTH_CAUSAL = LTX2AudioVAEArch(**{**TINY_AUDIO_VAE.model_dump(), "causality_axis": "width"})
"""Mel-axis causality: the decoder loses mel columns and zero-pads them back."""
GROUP_ATTN = LTX2AudioVAEArch(base_channels=128, ch_mult=(1, 1), num_res_blocks=1, latent_channels=32, mel_bins=16,
                              norm_type="group", causality_axis="none", mid_block_add_attention=True,
                              attn_resolutions=(128,))
"""GroupNorm, no causality, attention in the middle and at the finest level (no release uses these)."""


def _perturbed(factory: Callable[[], torch.nn.Module], scale: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """A diffusers model built from a seeded init (the global RNG is restored after), then every parameter
    moved off its init (norm weights, Snake alphas too), so parity covers them all."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = factory()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def _bwe_diffusers_config(arch: LTX2VocoderBWEArch) -> dict[str, Any]:
    """The flat `LTX2VocoderWithBWE` config of `arch` (extender keys prefixed `bwe_`)."""
    first = arch.vocoder.model_dump(exclude={"output_sampling_rate"})
    second = {f"bwe_{k}": v for k, v in arch.bwe.model_dump(exclude={"output_sampling_rate"}).items()}
    return {**first, **second, **arch.model_dump(exclude={"vocoder", "bwe"})}


# ---- audio VAE decoder ----------------------------------------------------------------------

def _audio_vae_pair(arch: LTX2AudioVAEArch, seed: int = 0) -> tuple[torch.nn.Module, LTX2AudioVAEDecoder]:
    reference = _perturbed(lambda: diffusers.AutoencoderKLLTX2Audio(**arch.model_dump()), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    reference.latents_mean.copy_(torch.randn(arch.base_channels, generator=gen))
    reference.latents_std.copy_(0.5 + torch.rand(arch.base_channels, generator=gen))
    ours = build_on_meta(lambda: LTX2AudioVAEDecoder(LTX2AudioVAEArch.from_diffusers_config(dict(reference.config))))
    return reference, assign_state_dict(ours, decoder_state_dict(reference.state_dict()), "audio_vae").eval()


@pytest.mark.parametrize("arch", [TINY_AUDIO_VAE, WIDTH_CAUSAL, GROUP_ATTN], ids=["release-layout", "width-causal",
                                                                                 "group-norm-attention"])
def test_audio_vae_decode_parity(arch: LTX2AudioVAEArch) -> None:
    reference, ours = _audio_vae_pair(arch)
    latents = torch.randn(2, arch.latent_channels, 5, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.decode(latents).sample
    got = ours.decode(latents)
    err = (got - expected).abs().max().item()
    print(f"audio VAE decode {arch.norm_type}/{arch.causality_axis}: max abs err {err:.2e}")
    assert got.shape == expected.shape == (2, 2, 17, arch.mel_bins)  # 4 * 5 - 3 frames
    assert err <= TOL


def test_decode_tokens_is_the_pipeline_tail() -> None:
    """Transformer audio tokens -> spectrogram exactly as LTX2Pipeline ends: de-normalise with the
    VAE's statistics, unpack to [B, C, L, M], decode."""
    reference, ours = _audio_vae_pair(TINY_AUDIO_VAE, seed=3)
    L, M = 6, TINY_AUDIO_VAE.latent_mel_bins
    tokens = torch.randn(2, L, TINY_AUDIO_VAE.latent_channels * M, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        latents = LTX2Pipeline._denormalize_audio_latents(tokens, reference.latents_mean, reference.latents_std)
        latents = LTX2Pipeline._unpack_audio_latents(latents, L, num_mel_bins=M)
        expected = reference.decode(latents, return_dict=False)[0]
    got = ours.decode_tokens(tokens)
    err = (got - expected).abs().max().item()
    print(f"audio tokens -> mel (de-normalise, unpack, decode): max abs err {err:.2e}")
    assert err <= TOL


def test_pack_and_normalize_match_the_pipeline() -> None:
    """The stage-2 path (LTX2Pipeline.prepare_audio_latents with 4D latents) packs, then normalises."""
    reference, _ = _audio_vae_pair(TINY_AUDIO_VAE, seed=5)
    latents = torch.randn(2, 4, 6, 4, generator=torch.Generator().manual_seed(6))
    expected = LTX2Pipeline._normalize_audio_latents(LTX2Pipeline._pack_audio_latents(latents),
                                                     reference.latents_mean, reference.latents_std)
    got = normalize_audio_latents(pack_audio_latents(latents), reference.latents_mean, reference.latents_std)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("num_frames, fps, expected", [(121, 24.0, 126), (9, 24.0, 9), (121, 30.0, 101), (1, 24.0, 1)])
def test_audio_latent_length(num_frames: int, fps: float, expected: int) -> None:
    # LTX2Pipeline: round(num_frames / frame_rate * sample_rate / hop_length / 4); 25 latents/s in the release.
    assert audio_latent_length(num_frames, fps, LTX2_AUDIO_VAE) == expected


def test_audio_noise_is_drawn_as_the_pipeline_draws_it() -> None:
    """Same generator, same shape, same packing: LTX2Pipeline.prepare_audio_latents' initial noise."""
    pipeline_like = SimpleNamespace(audio_vae_mel_compression_ratio=4, _pack_audio_latents=LTX2Pipeline._pack_audio_latents)
    expected = LTX2Pipeline.prepare_audio_latents(
        pipeline_like, batch_size=2, num_channels_latents=8, audio_latent_length=126, num_mel_bins=64,
        dtype=torch.float32, device=torch.device("cpu"), generator=torch.Generator().manual_seed(10))
    shape = audio_latent_shape(2, 121, 24.0, LTX2_AUDIO_VAE)
    assert shape == (2, 8, 126, 16)
    got = pack_audio_latents(torch.randn(shape, generator=torch.Generator().manual_seed(10)))
    assert got.shape == (2, 126, 128) and torch.equal(got, expected)


# ---- vocoders -------------------------------------------------------------------------------

def test_vocoder_20_parity() -> None:
    reference = _perturbed(lambda: RefVocoder(**TINY_VOCODER.model_dump()))
    arch = LTX2VocoderArch.from_diffusers_config(dict(reference.config))
    assert arch == TINY_VOCODER
    ours = assign_state_dict(build_on_meta(lambda: LTX2Vocoder(arch)), dict(reference.state_dict()), "vocoder").eval()
    mel = torch.randn(2, 2, 7, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(mel)
    got = ours(mel)
    err = (got - expected).abs().max().item()
    print(f"vocoder 2.0: max abs err {err:.2e}")
    assert got.shape == (2, 2, 7 * 8)
    assert err <= TOL
    assert (expected.abs() < 0.99).float().mean() > 0.9, "tanh must not saturate, or parity says little"


def _bwe_pair() -> tuple[torch.nn.Module, LTX2VocoderWithBWE]:
    """diffusers' and our 2.3 vocoder, with random STFT and mel bases (zeros at init: loaded from the checkpoint)."""
    reference = _perturbed(lambda: RefVocoderWithBWE(**_bwe_diffusers_config(TINY_VOCODER_BWE)), scale=0.05)
    state = reference.state_dict()
    gen = torch.Generator().manual_seed(8)
    for name in ("mel_stft.mel_basis", "mel_stft.stft_fn.forward_basis", "mel_stft.stft_fn.inverse_basis"):
        state[name] = 0.3 * torch.rand(state[name].shape, generator=gen)
    reference.load_state_dict(state)
    arch = LTX2VocoderBWEArch.from_diffusers_config(dict(reference.config))
    assert arch == TINY_VOCODER_BWE
    ours = build_on_meta(lambda: LTX2VocoderWithBWE(arch))
    return reference, assign_state_dict(ours, dict(state), "vocoder").eval()


@pytest.fixture(scope="module")
def bwe_pair() -> tuple[torch.nn.Module, LTX2VocoderWithBWE]:
    return _bwe_pair()


@pytest.mark.parametrize("frames", [8, 5], ids=["whole-stft-frames", "padded-to-stft-hop"])
def test_vocoder_23_bandwidth_extension_parity(bwe_pair: tuple[torch.nn.Module, LTX2VocoderWithBWE],
                                               frames: int) -> None:
    """5 mel frames give 50 samples at 16 kHz, not a multiple of the STFT hop (8): the padded branch."""
    reference, ours = bwe_pair
    mel = torch.randn(2, 2, frames, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = reference(mel)
    got = ours(mel)
    err = (got - expected).abs().max().item()
    print(f"vocoder 2.3 (BWE), {frames} mel frames: max abs err {err:.2e}")
    assert got.shape == (2, 2, frames * 10 * 3)
    assert err <= TOL
    assert (expected.abs() < 1).float().mean() > 0.9, "most samples must not be clamped, or parity says little"


def test_resampler_filter_is_rebuilt_after_a_meta_build(bwe_pair: tuple[torch.nn.Module, LTX2VocoderWithBWE]) -> None:
    reference, ours = bwe_pair
    assert "resampler.filter" not in ours.state_dict()
    assert torch.equal(ours.resampler.filter, reference.resampler.filter)


# ---- release sizes and configs --------------------------------------------------------------

def _meta_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["audio_vae", "vocoder_20", "vocoder_23"])
def test_release_sizes_have_diffusers_keys_and_shapes(name: str) -> None:
    """Release architectures (diffusers' conversion-script configs) on the meta device: same keys and shapes."""
    with torch.device("meta"):
        if name == "audio_vae":
            reference = diffusers.AutoencoderKLLTX2Audio()  # its defaults are the release config
            ours: torch.nn.Module = LTX2AudioVAEDecoder(LTX2AudioVAEArch.from_diffusers_config(dict(reference.config)))
            expected = decoder_state_dict(reference.state_dict())
            assert LTX2AudioVAEArch.from_diffusers_config(dict(reference.config)) == LTX2_AUDIO_VAE
        elif name == "vocoder_20":
            reference = RefVocoder(**LTX2_VOCODER.model_dump())
            ours, expected = LTX2Vocoder(LTX2_VOCODER), reference.state_dict()
        else:
            reference = RefVocoderWithBWE(**_bwe_diffusers_config(LTX23_VOCODER))
            ours, expected = LTX2VocoderWithBWE(LTX23_VOCODER), reference.state_dict()
            assert LTX2VocoderBWEArch.from_diffusers_config(dict(reference.config)) == LTX23_VOCODER
    assert _meta_shapes(ours) == {k: tuple(v.shape) for k, v in expected.items()}
    print(f"{name}: {sum(p.numel() for p in ours.parameters()):,} parameters")


def test_release_rates() -> None:
    assert LTX2_VOCODER.hop == 240 and LTX2_VOCODER.output_sampling_rate == 24000  # 100 mel frames/s
    assert LTX23_VOCODER.vocoder.hop == 160 and LTX23_VOCODER.bwe.hop == 240  # 16 kHz, then 80 x 3
    assert LTX2_AUDIO_VAE.latents_per_second == 25.0


def test_unknown_config_key_is_refused() -> None:
    with pytest.raises(ValueError, match="does not know: \\['new_switch'\\]"):
        LTX2AudioVAEArch.from_diffusers_config({**dict(diffusers.AutoencoderKLLTX2Audio(base_channels=32, ch_mult=(1,),
                                                latent_channels=2, mel_bins=64).config), "new_switch": 1})
    with pytest.raises(ValueError, match="does not know"):
        LTX2VocoderArch.from_diffusers_config({"bwe_hidden_channels": 8})


def test_arch_validation() -> None:
    with pytest.raises(ValueError, match="`causality_axis`='none'"):
        LTX2AudioVAEArch(norm_type="group")
    with pytest.raises(ValueError, match="packed audio tokens"):
        LTX2AudioVAEArch(base_channels=64)
    with pytest.raises(NotImplementedError, match="antialias"):
        LTX2VocoderArch(antialias=True)
    with pytest.raises(ValueError, match="hop_length"):
        LTX2VocoderBWEArch(hop_length=100)


def _bf16_check(name: str, got: torch.Tensor, expected: torch.Tensor, truth: torch.Tensor) -> None:
    """bf16 `got` (ours) against diffusers' bf16 `expected`, both measured from the float32 `truth`: ours
    must be as close to it as diffusers' (within 2x: bf16 kernels may round differently with alignment)."""
    ours, theirs = ((t.float() - truth).abs().max().item() for t in (got, expected))
    print(f"bf16 {name}: ours - diffusers {(got.float() - expected.float()).abs().max().item():.2e}; "
          f"from float32: ours {ours:.2e}, diffusers {theirs:.2e}")
    assert got.dtype == torch.bfloat16 and ours <= 2 * theirs + 1e-6


def test_bfloat16_follows_diffusers_rounding() -> None:
    """In bf16 weights (the release dtype) the same ops in the same order: bit-equal to diffusers' bf16
    on the development machine; the test asks for no more than diffusers' own bf16 error."""
    reference, ours = _audio_vae_pair(TINY_AUDIO_VAE, seed=12)
    vocoder_ref, vocoder = _bwe_pair()
    tokens = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(13))

    def run_reference(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            latents = LTX2Pipeline._denormalize_audio_latents(tokens, reference.latents_mean, reference.latents_std)
            mel = reference.decode(LTX2Pipeline._unpack_audio_latents(latents, 6, num_mel_bins=4)).sample
            return mel, vocoder_ref(mel)

    mel_truth, wave_truth = run_reference(tokens)
    for model in (reference, ours, vocoder_ref, vocoder):
        model.to(torch.bfloat16)
    mel_expected, wave_expected = run_reference(tokens.to(torch.bfloat16))
    mel, wave = ours.decode_tokens(tokens.to(torch.bfloat16)), vocoder(mel_expected)
    _bf16_check("mel", mel, mel_expected, mel_truth)
    with torch.no_grad():
        wave_truth = vocoder_ref.float()(mel_expected.float())  # the vocoder's own truth, from the bf16 mel
    _bf16_check("waveform", wave, wave_expected, wave_truth)
