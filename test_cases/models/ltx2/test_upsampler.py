"""LTX-2 latent upsampler: parity with diffusers' LTX2LatentUpsamplerModel, with
LTX2LatentUpsamplePipeline's latent handling (de-normalisation, AdaIN, tone mapping) and with the
documented two-stage chain (stage 1 latents -> upsample -> stage 2 normalisation)."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.ltx2.upsampler import (
    LTX2_LATENT_UPSAMPLER,
    LTX23_LATENT_UPSAMPLER,
    TINY_LTX2_LATENT_UPSAMPLER,
    LTX2LatentUpsampler,
    LTX2LatentUpsamplerArch,
    build_ltx2_latent_upsampler,
    upsample_latents,
    upsample_normalized_latents,
)
from runnerkit.models.ltx2.vae_arch import TINY_LTX2_VIDEO_VAE
from runnerkit.weights import build_on_meta
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import randn, report

diffusers = require_reference("diffusers")
from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline, LTX2Pipeline  # noqa: E402
from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel  # noqa: E402

TOL = 1e-4
LAYOUTS = {
    "ltx2.0-rational": TINY_LTX2_LATENT_UPSAMPLER,
    "ltx2.3-plain": LTX2LatentUpsamplerArch(**{**TINY_LTX2_LATENT_UPSAMPLER.model_dump(),
                                               "use_rational_resampler": False}),
}


def reference_upsampler(arch: LTX2LatentUpsamplerArch, seed: int) -> LTX2LatentUpsamplerModel:
    torch.manual_seed(seed)
    reference = LTX2LatentUpsamplerModel(**arch.to_diffusers_config()).eval()
    with torch.no_grad():  # non-trivial GroupNorm affines and biases
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return reference


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def pair(request: pytest.FixtureRequest) -> tuple[str, LTX2LatentUpsampler, LTX2LatentUpsamplerModel]:
    arch = LAYOUTS[request.param]
    reference = reference_upsampler(arch, seed=0)
    return request.param, build_ltx2_latent_upsampler(arch, dict(reference.state_dict())), reference


@pytest.fixture(scope="module")
def vae() -> torch.nn.Module:
    """A tiny diffusers VAE: the upsample pipeline reads only its latent statistics and config."""
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLLTX2Video(**TINY_LTX2_VIDEO_VAE.to_diffusers_config()).eval()
    vae.latents_mean.copy_(0.5 * torch.randn(8))
    vae.latents_std.copy_(0.5 + 1.5 * torch.rand(8))
    return vae


def test_module_parity(pair: tuple[str, LTX2LatentUpsampler, LTX2LatentUpsamplerModel]) -> None:
    name, ours, reference = pair
    assert ("upsampler.conv.weight" in reference.state_dict()) == ours.arch.use_rational_resampler
    latents = randn(2, 8, 3, 2, 3, seed=2)  # 3 latent frames, non-square
    with torch.no_grad():
        expected = reference(latents)
    got = ours(latents)
    assert got.shape == (2, 8, 3, 4, 6)
    assert report(f"upsampler {name}", got, expected) <= TOL


@pytest.mark.parametrize("normalized, adain, tone_map", [(False, 0.0, 0.0), (True, 0.0, 0.0), (True, 0.7, 0.6),
                                                         (False, 1.0, 0.0), (False, 0.0, 1.0)])
def test_pipeline_latent_handling(pair: tuple[str, LTX2LatentUpsampler, LTX2LatentUpsamplerModel],
                                  vae: torch.nn.Module, normalized: bool, adain: float, tone_map: float) -> None:
    name, ours, reference = pair
    pipe = LTX2LatentUpsamplePipeline(vae=vae, latent_upsampler=reference)
    latents = 2 * randn(1, 8, 2, 2, 3, seed=3)
    expected = pipe(latents=latents, latents_normalized=normalized, adain_factor=adain,
                    tone_map_compression_ratio=tone_map, output_type="latent", return_dict=False)[0]
    got = upsample_latents(ours, latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor,
                           latents_normalized=normalized, adain_factor=adain, tone_map_compression_ratio=tone_map)
    assert report(f"upsample pipeline {name} normalized={normalized} adain={adain} tone_map={tone_map}",
                  got, expected) <= TOL


def test_two_stage_transition(pair: tuple[str, LTX2LatentUpsampler, LTX2LatentUpsamplerModel],
                              vae: torch.nn.Module) -> None:
    # diffusers' documented chain: stage 1 output_type="latent" de-normalises, the upsample pipeline
    # takes them with latents_normalized=False, stage 2's prepare_latents normalises 5-D latents.
    name, ours, reference = pair
    stage1 = randn(1, 8, 2, 2, 3, seed=4)  # normalised, as the transformer leaves them
    mean, std, scale = vae.latents_mean, vae.latents_std, vae.config.scaling_factor
    raw = LTX2Pipeline._denormalize_latents(stage1, mean, std, scale)
    pipe = LTX2LatentUpsamplePipeline(vae=vae, latent_upsampler=reference)
    upsampled = pipe(latents=raw, latents_normalized=False, output_type="latent", return_dict=False)[0]
    expected = LTX2Pipeline._normalize_latents(upsampled, mean, std, scale)
    got = upsample_normalized_latents(ours, stage1, mean, std, scale)
    assert got.shape == (1, 8, 2, 4, 6)
    assert report(f"two-stage transition {name}", got, expected) <= TOL


@pytest.mark.parametrize("arch", [LTX2_LATENT_UPSAMPLER, LTX23_LATENT_UPSAMPLER], ids=["ltx2.0", "ltx2.3"])
def test_release_sizes_and_names_match_diffusers(arch: LTX2LatentUpsamplerArch) -> None:
    with torch.device("meta"):
        reference = LTX2LatentUpsamplerModel(**arch.to_diffusers_config())
    ours = build_on_meta(lambda: LTX2LatentUpsampler(arch))
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == expected
    assert LTX2LatentUpsamplerArch.from_diffusers_config(dict(reference.config)) == arch


def test_config_errors() -> None:
    config = LTX2_LATENT_UPSAMPLER.to_diffusers_config()
    for key, value in (("temporal_upsample", True), ("dims", 2), ("rational_spatial_scale", 1.5)):
        with pytest.raises(NotImplementedError, match=key):
            LTX2LatentUpsamplerArch.from_diffusers_config({**config, key: value})
    with pytest.raises(ValueError, match="mid_channels"):
        LTX2LatentUpsamplerArch(mid_channels=48)
    with pytest.raises(ValueError, match="tone_map_compression_ratio"):
        upsample_latents(build_on_meta(lambda: LTX2LatentUpsampler(TINY_LTX2_LATENT_UPSAMPLER)),
                         torch.zeros(1, 8, 1, 1, 1), torch.zeros(8), torch.ones(8), tone_map_compression_ratio=2.0)
