"""The neighborhood window's FlexAttention block tables in tile order, built from the window's geometry
(runnerkit/models/ltx2/window_blocks.py), against torch's own `create_block_mask` of the same `mask_mod`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.window_blocks import slab_key_frames, tiled_kv_blocks
from runnerkit.models.ltx2.window_layout import TILE, Layout, window_mask_mod

CPU = torch.device("cpu")


def assert_tables_list(num: torch.Tensor, indices: torch.Tensor, want: torch.Tensor) -> None:
    """KV tables [Q], [Q, width] list exactly the blocks of `want` [Q, K], each row once and ascending, no wider
    than its fullest row, in int32."""
    got = torch.zeros_like(want)
    for q in range(num.numel()):
        row = indices[q, :num[q]].long()
        assert torch.all(row[1:] > row[:-1]), "each row lists its KV blocks once, ascending"
        got[q, row] = True
    assert torch.equal(got, want)
    assert indices.shape[1] == int(num.max()) and num.dtype == indices.dtype == torch.int32


def test_a_slab_reaches_exactly_the_key_frames_of_its_windows() -> None:
    # T = 20, kt = 5: query frame t's window starts at clamp(t - 2, 0, 15)
    assert slab_key_frames(20, 5, 0, 4) == (0, 6)
    assert slab_key_frames(20, 5, 8, 12) == (6, 14)
    assert slab_key_frames(20, 5, 16, 20) == (14, 20)
    assert slab_key_frames(20, 20, 7, 9) == (0, 20)


def test_block_tables_stay_narrow_at_a_warmup_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LTX-2.5 decoder's stage 5 at 256x384x25 (4x4 pixel patches, an 11^3 window), where FlexAttention runs:
    1,248 query tiles (25 frames padded to 26) of at most 63 KV tiles each, not torch's dense [1248, 1248] tables
    over a dense [159744, 159744] mask."""
    monkeypatch.setattr(layers, "uses_flex", lambda device, head_dim: True)
    (slab,) = layers.stage_mask((25, 64, 96), (11, 11, 11), CPU, 64, 256).slabs
    mask = slab.mask
    assert isinstance(mask, BlockMask)
    assert mask.kv_indices.shape == (1, 1, 1248, 63) and mask.seq_lengths == (159744, 159744)
    assert mask.full_kv_num_blocks is None and int(mask.kv_num_blocks.max()) == 63


def test_the_flex_path_builds_its_mask_from_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stage_mask` where FlexAttention runs: tokens in `TILE` order and the geometric tables of that order, never
    torch's dense construction."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(layers, "uses_flex", lambda device, head_dim: True)
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **k: pytest.fail("dense block-mask construction"))
    grid, kernel = (4, 7, 200), (3, 3, 11)
    mask = layers.stage_mask(grid, kernel, CPU, 64, 128)
    assert mask.layout == Layout(grid, TILE)
    (slab,) = mask.slabs
    num, indices = tiled_kv_blocks(mask.layout, kernel, CPU)
    assert torch.equal(slab.mask.kv_num_blocks[0, 0], num) and torch.equal(slab.mask.kv_indices[0, 0], indices)


def torch_tiled_block_sets(layout: Layout, kernel: tuple[int, int, int],
                           units: tuple[int, int] | None = None) -> torch.Tensor:
    """[Q, K] bool: the blocks torch's `create_block_mask` lists for the window's `mask_mod` in tiled order."""
    u0, u1 = units or (0, layout.units)
    j0, j1 = layout.key_units(kernel[0], u0, u1)
    f, per_unit, block = layout.unit_frames, layout.unit_tokens, math.prod(layout.tile)
    nq, nk = (u1 - u0) * per_unit, (j1 - j0) * per_unit
    mask = create_block_mask(window_mask_mod(layout, kernel, u0 * f, j0 * f), None, None, nq, nk, device=CPU,
                             BLOCK_SIZE=block)
    sets = torch.zeros(nq // block, nk // block, dtype=torch.bool)
    for num, idx in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        for q in range(nq // block):
            sets[q, idx[0, 0, q, :num[0, 0, q]].long()] = True
    return sets


# tiles of 2x8x8 (the shipped one) and smaller; grids padded on every axis or none; slabs at the start, middle
# and end; windows equal to the grid, of one token, and wider than a tile
TILED = [((5, 9, 11), (3, 3, 5), TILE, None), ((4, 16, 16), (3, 5, 5), TILE, None),
         ((9, 20, 19), (5, 11, 11), TILE, None),
         ((9, 20, 19), (5, 11, 11), TILE, (1, 3)), ((7, 6, 10), (3, 3, 3), (2, 2, 4), (0, 2)),
         ((7, 6, 10), (7, 3, 3), (2, 2, 4), (3, 4)), ((6, 5, 7), (1, 1, 1), (1, 2, 2), (2, 5)),
         ((3, 3, 3), (3, 3, 3), (1, 2, 2), None)]


@pytest.mark.parametrize(("grid", "kernel", "tile", "units"), TILED, ids=[f"{g}-{k}-{t}-{u}" for g, k, t, u in TILED])
def test_tiled_blocks_are_exactly_torchs_block_sets(grid: tuple[int, int, int], kernel: tuple[int, int, int],
                                                    tile: tuple[int, int, int], units: tuple[int, int] | None) -> None:
    layout = Layout(grid, tile)
    num, indices = tiled_kv_blocks(layout, kernel, CPU, units)
    want = torch_tiled_block_sets(layout, kernel, units)
    assert_tables_list(num, indices, want)


def test_tiled_order_visits_few_blocks_at_the_release_stage5_grid() -> None:
    """At 25x128x192 tokens with an 11^3 window: 54.8 KV blocks a query block on average in 2x8x8 tiles (187 in
    row-major order, the order before tiles: the reason for them)."""
    tiled, _ = tiled_kv_blocks(Layout((25, 128, 192), TILE), (11, 11, 11), CPU)
    assert round(float(tiled.float().mean()), 1) == 54.8


@pytest.mark.parametrize(("kernel", "units", "message"), [
    ((3, 5, 3), None, r"window kernel \(3, 5, 3\) must be positive and at most the grid \(4, 4, 9\) on axis H"),
    ((3, 3, 3), (1, 1), r"query units \(1, 1\) must be a non-empty range inside the layout's 2 units"),
    ((3, 3, 3), (1, 3), r"query units \(1, 3\) must be a non-empty range inside the layout's 2 units")])
def test_a_window_larger_than_its_grid_or_an_empty_slab_is_refused(kernel: tuple[int, int, int],
                                                                  units: tuple[int, int] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiled_kv_blocks(Layout((4, 4, 9), TILE), kernel, CPU, units)
