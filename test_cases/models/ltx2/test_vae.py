"""LTX-2 video VAE: parity with diffusers' AutoencoderKLLTX2Video (decoder, encoder, the
pipelines' latent normalisation), key names, release sizes, input errors."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.ltx2.vae import LTX2VideoVAE, build_ltx2_video_vae
from runnerkit.models.ltx2.vae_arch import (
    LTX2_VIDEO_VAE,
    LTX23_VIDEO_VAE,
    TINY_LTX2_VIDEO_VAE,
    TINY_LTX23_VIDEO_VAE,
    LTX2VideoVAEArch,
)
from runnerkit.weights import build_on_meta
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import randn, report

diffusers = require_reference("diffusers")
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline  # noqa: E402
from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import LTX2ImageToVideoPipeline  # noqa: E402

TOL = 1e-4


def variant(base: LTX2VideoVAEArch, **changes: object) -> LTX2VideoVAEArch:
    return LTX2VideoVAEArch(**{**base.model_dump(), **changes})


VARIANTS = {
    # 2.0: 3 residual spatiotemporal up blocks, reflect padding, non-causal decoder
    "ltx2.0": TINY_LTX2_VIDEO_VAE,
    # 2.3: 4 plain up blocks (spatiotemporal x2, temporal, spatial), zeros padding, other widths
    "ltx2.3": TINY_LTX23_VIDEO_VAE,
    # switches no release sets: causal decoder, non-causal encoder, a stride-2 conv downsampler
    "causal-decoder": variant(TINY_LTX2_VIDEO_VAE, decoder_causal=True, encoder_causal=False,
                              downsample_type=("spatial", "temporal", "spatiotemporal", "conv")),
    # decode-timestep AdaLN and noise injection (LTX-Video 0.9.x style) in some decoder blocks; uneven
    # depths, so an entry read from the wrong end of the encoder-order tuples changes the network
    "timestep-noise": variant(TINY_LTX23_VIDEO_VAE, timestep_conditioning=True,
                              decoder_inject_noise=(True, False, False, True, True),
                              decoder_layers_per_block=(1, 2, 1, 1, 2)),
}


def reference_vae(arch: LTX2VideoVAEArch, seed: int) -> torch.nn.Module:
    """diffusers' VAE from `arch` with perturbed weights and random latent statistics."""
    torch.manual_seed(seed)
    reference = diffusers.AutoencoderKLLTX2Video(**arch.to_diffusers_config()).eval()
    with torch.no_grad():  # non-trivial biases, noise scales and tables, not the init values
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
        reference.latents_mean.copy_(0.5 * torch.randn(arch.latent_channels))
        reference.latents_std.copy_(0.5 + 1.5 * torch.rand(arch.latent_channels))
    return reference


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request: pytest.FixtureRequest) -> tuple[str, LTX2VideoVAE, torch.nn.Module]:
    arch = VARIANTS[request.param]
    reference = reference_vae(arch, seed=0)
    return request.param, build_ltx2_video_vae(arch, dict(reference.state_dict())), reference


# ---- decoder ------------------------------------------------------------------------------

def test_decoder_parity(pair: tuple[str, LTX2VideoVAE, torch.nn.Module]) -> None:
    name, vae, reference = pair
    latents = randn(2, 8, 2, 2, 3, seed=1)  # 9 frames, 64 x 96 pixels: both compressions run, non-square
    timestep = torch.tensor([0.05, 0.3]) if vae.arch.timestep_conditioning else None
    torch.manual_seed(7)  # diffusers' noise injection draws from the global RNG
    with torch.no_grad():
        expected = reference.decode(latents, timestep).sample
    torch.manual_seed(7)
    decoded = vae.decode_raw(latents, timestep)
    assert decoded.shape == (2, 3, 9, 64, 96)
    assert report(f"decoder {name}", decoded, expected) <= TOL


def test_pipeline_decode_denormalizes(pair: tuple[str, LTX2VideoVAE, torch.nn.Module]) -> None:
    # The pipeline's own de-normalisation (LTX2Pipeline._denormalize_latents) then diffusers' decode.
    name, vae, reference = pair
    latents = randn(1, 8, 2, 2, 3, seed=2)
    noise = randn(1, 8, 2, 2, 3, seed=3)
    timestep = None
    expected_in = latents
    if vae.arch.timestep_conditioning:  # LTX2Pipeline.__call__: blend with noise at the decode timestep
        timestep = torch.tensor([0.05])
        expected_in = (1 - 0.025) * latents + 0.025 * noise
    raw = LTX2Pipeline._denormalize_latents(expected_in, reference.latents_mean, reference.latents_std,
                                           reference.config.scaling_factor)
    torch.manual_seed(8)
    with torch.no_grad():
        expected = reference.decode(raw, timestep).sample
    torch.manual_seed(8)
    decoded = vae.decode(latents, timestep=0.05, noise_scale=0.025, noise=noise)
    assert report(f"pipeline decode {name}", decoded, expected) <= TOL


# ---- encoder ------------------------------------------------------------------------------

def test_encoder_parity(pair: tuple[str, LTX2VideoVAE, torch.nn.Module]) -> None:
    name, vae, reference = pair
    video = torch.rand(1, 3, 9, 32, 64, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.no_grad():
        expected = reference.encode(video).latent_dist.mode()
    mean = vae.encode_mean(video)
    assert mean.shape == (1, 8, 2, 1, 2)
    assert report(f"encoder {name}", mean, expected) <= TOL


def test_i2v_first_frame_latents(pair: tuple[str, LTX2VideoVAE, torch.nn.Module]) -> None:
    # LTX2ImageToVideoPipeline.prepare_latents: encode(image[:, :, None]).mode(), normalised without scaling.
    name, vae, reference = pair
    image = torch.rand(2, 3, 1, 32, 64, generator=torch.Generator().manual_seed(5)) * 2 - 1
    with torch.no_grad():
        mode = reference.encode(image).latent_dist.mode()
    expected = LTX2ImageToVideoPipeline._normalize_latents(mode, reference.latents_mean, reference.latents_std)
    latents = vae.encode(image)
    assert latents.dtype == torch.float32 and latents.shape == (2, 8, 1, 1, 2)
    assert report(f"i2v latents {name}", latents, expected) <= TOL


# ---- names, configs, release sizes --------------------------------------------------------

def test_config_round_trip(pair: tuple[str, LTX2VideoVAE, torch.nn.Module]) -> None:
    name, vae, reference = pair
    assert LTX2VideoVAEArch.from_diffusers_config(dict(reference.config)) == vae.arch
    assert sorted(vae.state_dict()) == sorted(reference.state_dict())


@pytest.mark.parametrize("arch", [LTX2_VIDEO_VAE, LTX23_VIDEO_VAE], ids=["ltx2.0-19b", "ltx2.3-22b"])
def test_release_sizes_match_diffusers(arch: LTX2VideoVAEArch) -> None:
    # Built on the meta device: the release-size shapes cost no memory.
    with torch.device("meta"):
        reference = diffusers.AutoencoderKLLTX2Video(**arch.to_diffusers_config())
    ours = build_on_meta(lambda: LTX2VideoVAE(arch))
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == expected
    assert (arch.spatial_compression, arch.temporal_compression) == (32, 8)
    assert (reference.spatial_compression_ratio, reference.temporal_compression_ratio) == (32, 8)


def test_diffusers_bool_fields_and_ratio_check() -> None:
    config = {**TINY_LTX2_VIDEO_VAE.to_diffusers_config(), "decoder_inject_noise": False,
              "upsample_residual": True, "_class_name": "AutoencoderKLLTX2Video"}
    assert LTX2VideoVAEArch.from_diffusers_config(config) == TINY_LTX2_VIDEO_VAE
    with pytest.raises(ValueError, match="spatial_compression_ratio"):
        LTX2VideoVAEArch.from_diffusers_config({**config, "spatial_compression_ratio": 64})
    with pytest.raises(ValueError, match="decoder_layers_per_block"):
        variant(TINY_LTX2_VIDEO_VAE, decoder_layers_per_block=(1, 1, 1))


def test_input_errors(pair: tuple[str, LTX2VideoVAE, torch.nn.Module]) -> None:
    _, vae, _ = pair
    with pytest.raises(ValueError, match="8k \\+ 1"):
        vae.encode_mean(torch.zeros(1, 3, 8, 32, 32))
    with pytest.raises(ValueError, match="multiples of 32"):
        vae.encode_mean(torch.zeros(1, 3, 1, 48, 32))
    with pytest.raises(ValueError, match="latents"):
        vae.decode_raw(torch.zeros(1, 4, 1, 1, 1))
    if vae.arch.decoder_spatial_padding_mode == "reflect":  # LTX-2.0: a 1-latent-wide side cannot reflect
        with pytest.raises(ValueError, match="reflect"):
            vae.decode_raw(torch.zeros(1, 8, 1, 1, 2))
