"""Tiled VAE decoding: tile layout, exactness away from seams, convex blending in the overlaps."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.wan.arch import WanVAEArch
from runnerkit.models.wan.vae import WanVAE
from runnerkit.models.wan.vae_tiling import decode_tiled, tile_starts
from runnerkit.weights import assign_state_dict, build_on_meta, synthetic_tensor

ARCH = WanVAEArch(dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1)


@pytest.fixture(scope="module")
def vae() -> WanVAE:
    model = build_on_meta(lambda: WanVAE(ARCH))
    sd = {k: synthetic_tensor(k, tuple(v.shape), 0, torch.float32) for k, v in model.state_dict().items()}
    return assign_state_dict(model, sd, "vae").eval()


@pytest.mark.parametrize(("size", "tile", "overlap", "expected"), [
    (6, 8, 2, [0]), (8, 8, 2, [0]), (10, 4, 1, [0, 3, 6]), (12, 6, 2, [0, 4, 6]), (9, 4, 0, [0, 4, 5])])
def test_tile_starts_cover_the_grid(size: int, tile: int, overlap: int, expected: list[int]) -> None:
    starts = tile_starts(size, tile, overlap)
    assert starts == expected
    assert starts[-1] + min(tile, size) == size
    assert all(b - a <= tile - overlap for a, b in zip(starts, starts[1:]))


def test_overlap_must_be_smaller_than_tile() -> None:
    with pytest.raises(ValueError, match="`overlap`"):
        tile_starts(10, 4, 4)


def test_single_tile_is_bit_identical_to_untiled(vae: WanVAE) -> None:
    z = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(decode_tiled(vae, z, tile=8, overlap=2), vae.decode(z))


def test_tiles_are_exact_away_from_seams_and_convex_in_overlaps(vae: WanVAE) -> None:
    z = torch.randn(1, 16, 2, 4, 10, generator=torch.Generator().manual_seed(1))
    out = decode_tiled(vae, z, tile=6, overlap=2)  # width tiles start at 0 and 4: overlap columns 4..5
    assert out.shape == (1, 3, 5, 32, 80)
    left, right = vae.decode(z[..., 0:6]), vae.decode(z[..., 4:10])
    # latent columns 0..3 only in the left tile, 6..9 only in the right one: exact there
    assert torch.equal(out[..., :32], left[..., :32])
    assert torch.equal(out[..., 48:], right[..., 16:])
    # the overlap (pixels 32..47): a convex blend whose weight moves from the left tile to the right one
    a, b = left[..., 32:48], right[..., :16]
    differs = (a - b).abs() > 1e-3
    t = ((out[..., 32:48] - a) / (b - a))[differs]
    assert differs.any() and t.min() > 0 and t.max() < 1
    ramp = torch.arange(1, 17, dtype=torch.float32) / 17  # right tile's weight per column
    expected = a * (1 - ramp) + b * ramp
    assert torch.allclose(out[..., 32:48], expected, atol=1e-6)
