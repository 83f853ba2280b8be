"""Wan2.1 VAE: parity with diffusers' AutoencoderKLWan, key names, feature cache, errors."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.wan.arch import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, WanVAEArch
from runnerkit.models.wan.vae import (
    WanVAE,
    arch_from_diffusers_config,
    arch_to_diffusers_config,
    build_wan_vae,
    diffusers_to_native,
    native_to_diffusers,
)
from runnerkit.weights import CheckpointError, build_on_meta
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers  # noqa: E402

# Released layout (4 levels, 2 residual blocks, time halved at levels 1 and 2) at tiny width:
# the only layout diffusers' single-file converter handles.
ARCH_RELEASE = WanVAEArch(dim=4, z_dim=4, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                          latents_mean=(0.1, -0.7, 0.9, 0.0), latents_std=(1.5, 0.5, 2.8, 1.0))
# Other layout: 3 levels (4x spatial), 1 residual block, time halved at both levels.
ARCH_SMALL = WanVAEArch(dim=8, z_dim=4, dim_mult=(1, 2, 2), num_res_blocks=1, temporal_downsample=(True, True),
                        latents_mean=(-0.3, 0.2, 0.0, 1.1), latents_std=(0.9, 1.7, 1.2, 2.2))
TOL = 1e-4


def random_native_state_dict(arch: WanVAEArch, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in native names: convs ~ N(0, 1/fan_in), gammas ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
    generator = torch.Generator().manual_seed(seed)
    skeleton = build_on_meta(lambda: WanVAE(arch))
    out = {}
    for name, meta in skeleton.state_dict().items():
        noise = torch.randn(meta.shape, generator=generator)
        if name.endswith("gamma"):
            out[name] = 1 + 0.1 * noise
        elif name.endswith("bias"):
            out[name] = 0.1 * noise
        else:
            out[name] = noise / meta[0].numel() ** 0.5  # fan_in = in_channels * kernel volume
    return out


def random_video(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def release_pair() -> tuple[WanVAE, torch.nn.Module]:
    """Our VAE and diffusers' loaded with the same random native weights via diffusers' converter."""
    native = random_native_state_dict(ARCH_RELEASE, seed=0)
    reference = diffusers.AutoencoderKLWan(**arch_to_diffusers_config(ARCH_RELEASE)).eval()
    reference.load_state_dict(convert_wan_vae_to_diffusers(native), strict=True)
    return build_wan_vae(ARCH_RELEASE, native), reference


# ---- parity -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, video_shape", [(ARCH_RELEASE, (1, 3, 9, 16, 24)), (ARCH_SMALL, (2, 3, 5, 8, 12))],
                         ids=["release-layout", "small-layout"])
def test_parity_with_diffusers_weights(arch: WanVAEArch, video_shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    reference = diffusers.AutoencoderKLWan(**arch_to_diffusers_config(arch)).eval()
    with torch.no_grad():  # non-trivial norm gammas and biases, not the init values
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    vae = build_wan_vae(arch, diffusers_to_native(reference.state_dict()))
    video = random_video(video_shape, seed=2)
    B, _, F, H, W = video_shape
    s = 2 ** (len(arch.dim_mult) - 1)

    with torch.no_grad():
        expected_mu = reference.encode(video).latent_dist.mean
    mu = vae.encode_raw(video)
    assert mu.shape == (B, 4, (F - 1) // 4 + 1, H // s, W // s)
    assert (mu - expected_mu).abs().max().item() <= TOL

    latents = torch.randn(B, 4, 3, H // s, W // s, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected_video = reference.decode(latents).sample
    decoded = vae.decode_raw(latents)
    assert decoded.shape == (B, 3, 9, H, W)
    assert (decoded - expected_video).abs().max().item() <= TOL
    assert (decoded.abs() < 1).float().mean() > 0.5, "most values must not be clamped, or parity says little"


def test_native_names_match_diffusers_single_file_converter(release_pair: tuple[WanVAE, torch.nn.Module]) -> None:
    # The reference model was loaded (strictly) through diffusers' own converter from the same
    # native dict ours loaded: equal outputs mean our native names are the released ones.
    vae, reference = release_pair
    video = random_video((1, 3, 5, 16, 16), seed=4)
    with torch.no_grad():
        expected = reference.encode(video).latent_dist.mean
        expected_video = reference.decode(expected).sample
    assert (vae.encode_raw(video) - expected).abs().max().item() <= TOL
    assert (vae.decode_raw(expected) - expected_video).abs().max().item() <= TOL

    native = random_native_state_dict(ARCH_RELEASE, seed=5)
    ours, theirs = native_to_diffusers(native), convert_wan_vae_to_diffusers(native)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k] is theirs[k] for k in ours)


def test_normalized_encode_decode_use_mean_and_std(release_pair: tuple[WanVAE, torch.nn.Module]) -> None:
    vae, _ = release_pair
    mean = torch.tensor(ARCH_RELEASE.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(ARCH_RELEASE.latents_std).view(1, 4, 1, 1, 1)
    video = random_video((1, 3, 5, 16, 16), seed=6)
    latents = vae.encode(video)
    assert latents.dtype == torch.float32
    torch.testing.assert_close(latents, (vae.encode_raw(video) - mean) / std, rtol=0, atol=1e-6)
    decoded = vae.decode(latents)
    torch.testing.assert_close(decoded, vae.decode_raw(latents * std + mean), rtol=0, atol=1e-6)
    assert decoded.shape == (1, 3, 5, 16, 16) and decoded.abs().max() <= 1


def test_one_frame_encodes_like_diffusers(release_pair: tuple[WanVAE, torch.nn.Module]) -> None:
    """A 1-frame video (an i2v request of one frame) is the first chunk alone: no empty chunk of 4."""
    vae, ref = release_pair
    video = random_video((1, 3, 1, 16, 16), seed=8)
    expected = ref.encode(video).latent_dist.mean
    got = vae.encode_raw(video)
    assert got.shape == (1, 4, 1, 2, 2)
    assert (got - expected).abs().max().item() <= TOL


# ---- feature cache ------------------------------------------------------------------------

def test_decode_twice_is_bit_identical_and_leaves_no_cache(release_pair: tuple[WanVAE, torch.nn.Module]) -> None:
    vae, _ = release_pair
    latents = torch.randn(1, 4, 3, 2, 2, generator=torch.Generator().manual_seed(7))
    first = vae.decode(latents)
    assert vae.feature_cache is None
    assert torch.equal(first, vae.decode(latents))
    assert vae.feature_cache is None

    video = random_video((1, 3, 9, 16, 16), seed=8)
    assert torch.equal(vae.encode(video), vae.encode(video))
    assert vae.feature_cache is None


def test_decode_iter_chunks_and_closing(release_pair: tuple[WanVAE, torch.nn.Module]) -> None:
    vae, _ = release_pair
    latents = torch.randn(1, 4, 3, 2, 2, generator=torch.Generator().manual_seed(9))
    chunks = list(vae.decode_iter(latents))
    assert [c.shape[2] for c in chunks] == [1, 4, 4]
    assert torch.equal(torch.cat(chunks, dim=2), vae.decode(latents))

    iterator = vae.decode_iter(latents)
    next(iterator)
    assert vae.feature_cache is not None and len(vae.feature_cache) > 0  # frames carried to chunk 2
    iterator.close()
    assert vae.feature_cache is None

    # clear_cache() mid-iteration frees the frames; the stale iterator fails instead of
    # decoding later chunks without their history.
    iterator = vae.decode_iter(latents)
    next(iterator)
    vae.clear_cache()
    assert vae.feature_cache is None
    with pytest.raises(RuntimeError, match="feature cache was cleared"):
        next(iterator)
    assert torch.equal(vae.decode(latents), torch.cat(chunks, dim=2))


def test_failure_inside_decode_and_encode_leaves_no_cache(release_pair: tuple[WanVAE, torch.nn.Module],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    vae, _ = release_pair
    latents = torch.randn(1, 4, 3, 2, 2, generator=torch.Generator().manual_seed(10))
    video = random_video((1, 3, 5, 16, 16), seed=11)
    expected_video, expected_latents = vae.decode(latents), vae.encode(video)

    for network in (vae.decoder, vae.encoder):
        head_conv = network.head[2]
        original = head_conv.forward
        calls = []

        def fail_on_second_chunk(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return original(*args, **kwargs)

        monkeypatch.setattr(head_conv, "forward", fail_on_second_chunk)
        with pytest.raises(RuntimeError, match="injected failure"):
            vae.decode(latents) if network is vae.decoder else vae.encode(video)
        assert vae.feature_cache is None
        monkeypatch.undo()

    assert torch.equal(vae.decode(latents), expected_video)
    assert torch.equal(vae.encode(video), expected_latents)


# ---- dtype --------------------------------------------------------------------------------

def test_bfloat16_weights_match_diffusers_bfloat16(release_pair: tuple[WanVAE, torch.nn.Module]) -> None:
    vae32, reference = release_pair
    vae16 = build_wan_vae(ARCH_RELEASE, diffusers_to_native(reference.state_dict()), dtype=torch.bfloat16)
    reference16 = diffusers.AutoencoderKLWan(**arch_to_diffusers_config(ARCH_RELEASE)).eval()
    reference16.load_state_dict(reference.state_dict())
    reference16.to(torch.bfloat16)
    video = random_video((1, 3, 5, 8, 16), seed=13)

    mu16 = vae16.encode_raw(video)
    assert mu16.dtype == torch.bfloat16
    with torch.no_grad():
        expected_mu16 = reference16.encode(video.bfloat16()).latent_dist.mean
    assert (mu16.float() - expected_mu16.float()).abs().max().item() <= 1e-2
    assert vae16.encode(video).dtype == torch.float32
    assert (mu16.float() - vae32.encode_raw(video)).abs().max().item() <= 0.05

    latents = torch.randn(1, 4, 2, 1, 2, generator=torch.Generator().manual_seed(14))
    decoded16 = vae16.decode_raw(latents)
    with torch.no_grad():
        expected16 = reference16.decode(latents.bfloat16()).sample
    assert decoded16.dtype == torch.bfloat16
    assert (decoded16.float() - expected16.float()).abs().max().item() <= 1e-2
    # Random deep networks amplify bf16 rounding: the mean error vs float32 stays small.
    assert (decoded16.float() - vae32.decode_raw(latents)).abs().mean().item() <= 0.02
    assert vae16.decode(latents).dtype == torch.float32


# ---- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, match", [
    ((1, 3, 4, 16, 16), "F = 4n \\+ 1"),
    ((1, 3, 5, 12, 16), "multiples of 8"),
    ((1, 3, 5, 16, 20), "multiples of 8"),
    ((1, 4, 5, 16, 16), "B, 3, F, H, W"),
    ((3, 5, 16, 16), "B, 3, F, H, W"),
])
def test_encode_rejects_bad_video(release_pair: tuple[WanVAE, torch.nn.Module], shape: tuple[int, ...],
                                  match: str) -> None:
    vae, _ = release_pair
    with pytest.raises(ValueError, match=f"`video`.*{match}"):
        vae.encode(torch.zeros(shape))


@pytest.mark.parametrize("shape", [(1, 16, 2, 2, 2), (4, 2, 2, 2), (1, 4, 0, 2, 2)])
def test_decode_rejects_bad_latents(release_pair: tuple[WanVAE, torch.nn.Module], shape: tuple[int, ...]) -> None:
    vae, _ = release_pair
    with pytest.raises(ValueError, match=r"`latents` must be \[B, 4, f, h, w\]"):
        vae.decode(torch.zeros(shape))
    with pytest.raises(ValueError, match="`latents`"):
        vae.decode_iter(torch.zeros(shape))  # raised eagerly, not at the first chunk
    assert vae.feature_cache is None


def test_missing_or_unknown_tensor_raises_checkpoint_error() -> None:
    native = random_native_state_dict(ARCH_SMALL, seed=14)
    missing = dict(native)
    del missing["decoder.upsamples.2.resample.1.weight"]
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): decoder\.upsamples\.2\.resample\.1\.weight"):
        build_wan_vae(ARCH_SMALL, missing)
    with pytest.raises(CheckpointError, match="encoder.extra.weight"):
        native_to_diffusers({**native, "encoder.extra.weight": torch.zeros(1)})
    diffusers_sd = native_to_diffusers(native)
    with pytest.raises(CheckpointError, match=r"decoder\.up_blocks\.0\.avg_shortcut\.weight"):
        diffusers_to_native({**diffusers_sd, "decoder.up_blocks.0.avg_shortcut.weight": torch.zeros(1)})


@pytest.mark.parametrize("arch", [ARCH_RELEASE, ARCH_SMALL, WanVAEArch()], ids=["release-layout", "small", "wan2.1"])
def test_key_conversion_round_trip(arch: WanVAEArch) -> None:
    native = build_on_meta(lambda: WanVAE(arch)).state_dict()
    diffusers_sd = native_to_diffusers(native)
    reference = build_on_meta(lambda: diffusers.AutoencoderKLWan(**arch_to_diffusers_config(arch)))
    assert sorted(diffusers_sd) == sorted(reference.state_dict())
    assert all(diffusers_sd[k].shape == v.shape for k, v in reference.state_dict().items())
    back = diffusers_to_native(diffusers_sd)
    assert list(back) == list(native) and all(back[k] is native[k] for k in native)


# ---- config -------------------------------------------------------------------------------

def test_diffusers_config_round_trip_and_defaults() -> None:
    for arch in (ARCH_RELEASE, ARCH_SMALL, WanVAEArch()):
        assert arch_from_diffusers_config(arch_to_diffusers_config(arch)) == arch
    # A released vae/config.json (metadata keys included); absent keys are Wan2.1's defaults.
    released = {"_class_name": "AutoencoderKLWan", "_diffusers_version": "0.33.0.dev0", "attn_scales": [],
                "base_dim": 96, "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "latents_mean": list(WAN21_LATENTS_MEAN),
                "latents_std": list(WAN21_LATENTS_STD), "num_res_blocks": 2,
                "temperal_downsample": [False, True, True], "z_dim": 16}
    assert arch_from_diffusers_config(released) == WanVAEArch()
    assert arch_from_diffusers_config({}) == WanVAEArch()


@pytest.mark.parametrize("key, value", [
    ("is_residual", True), ("decoder_base_dim", 64), ("patch_size", 2), ("in_channels", 12),
    ("scale_factor_spatial", 16), ("attn_scales", [0.5]), ("_class_name", "AutoencoderKL"), ("use_tiling", True),
])
def test_diffusers_config_rejects_unsupported(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        arch_from_diffusers_config({key: value})


def test_arch_checks() -> None:
    with pytest.raises(ValueError, match="`latents_mean` needs `z_dim`=4 values"):  # refused with the config
        WanVAEArch(dim=4, z_dim=4)
    with pytest.raises(ValueError, match="`temporal_downsample` needs one entry per downsampling level"):
        WanVAEArch(dim=4, dim_mult=(1, 2))
    with pytest.raises(NotImplementedError, match="`attn_scales`"):
        WanVAE(WanVAEArch(dim=4, attn_scales=(1.0,)))
    with pytest.raises(NotImplementedError, match="halve time exactly twice"):
        WanVAE(WanVAEArch(dim=4, temporal_downsample=(False, False, True)))
