"""The neighborhood window's FlexAttention block tables, built from the window's geometry
(runnerkit/models/ltx2/window_blocks.py), against torch's own `create_block_mask` of the same `mask_mod`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.window_blocks import slab_key_frames, tiled_kv_blocks, window_block_mask, window_kv_blocks
from runnerkit.models.ltx2.window_layout import TILE, Layout, window_mask_mod

CPU = torch.device("cpu")


def torch_block_sets(grid: tuple[int, int, int], kernel: tuple[int, int, int], block: int,
                     frames: tuple[int, int] | None = None) -> torch.Tensor:
    """[Q, K] bool: KV blocks torch's `create_block_mask` lists for each query block (partial or full), of the
    whole grid or of the query frames `frames` against the key frames their windows reach."""
    T, H, W = grid
    t0, t1 = frames or (0, T)
    k0, k1 = slab_key_frames(T, kernel[0], t0, t1)
    nq, nk = (t1 - t0) * H * W, (k1 - k0) * H * W
    mask_mod = layers.neighborhood_mask_mod(grid, kernel, t0, k0)
    mask = create_block_mask(mask_mod, None, None, nq, nk, device=CPU, BLOCK_SIZE=block)
    num_q = math.ceil(nq / block)
    sets = torch.zeros(num_q, math.ceil(nk / block), dtype=torch.bool)
    for num, idx in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        for q in range(num_q):
            sets[q, idx[0, 0, q, :num[0, 0, q]].long()] = True
    return sets


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


# grids narrower and wider than a block along W, token counts with and without a partial last block,
# kernels equal to the grid, of one token, and window rows spanning several blocks
CASES = [((5, 9, 13), (3, 3, 5), 16), ((4, 7, 200), (3, 3, 11), 128), ((6, 20, 24), (5, 11, 11), 128),
         ((3, 3, 3), (3, 3, 3), 8), ((12, 10, 9), (11, 3, 3), 32), ((2, 5, 7), (1, 1, 1), 4)]


@pytest.mark.parametrize(("grid", "kernel", "block"), CASES, ids=[f"{g}-{k}-{b}" for g, k, b in CASES])
def test_window_blocks_are_exactly_torchs_block_sets(grid: tuple[int, int, int], kernel: tuple[int, int, int],
                                                     block: int) -> None:
    num, indices = window_kv_blocks(grid, kernel, CPU, block)
    want = torch_block_sets(grid, kernel, block)
    assert_tables_list(num, indices, want)


# slabs of query frames: at the start, in the middle, at the end (windows shifted inward), a single frame, a slab
# whose windows reach the whole grid, and a window of one frame
SLABS = [((9, 5, 13), (3, 3, 5), 16, (0, 3)), ((9, 5, 13), (3, 3, 5), 16, (3, 6)), ((9, 5, 13), (5, 3, 5), 16, (6, 9)),
         ((12, 10, 9), (11, 3, 3), 32, (4, 5)), ((6, 7, 30), (5, 3, 11), 64, (1, 5)), ((8, 4, 6), (1, 3, 3), 8, (2, 7))]


@pytest.mark.parametrize(("grid", "kernel", "block", "frames"), SLABS,
                         ids=[f"{g}-{k}-{b}-{f}" for g, k, b, f in SLABS])
def test_a_slabs_blocks_are_exactly_torchs_block_sets(grid: tuple[int, int, int], kernel: tuple[int, int, int],
                                                      block: int, frames: tuple[int, int]) -> None:
    """Query frames [t0, t1) against the key frames [k0, k1) their windows reach, each indexed from its first
    frame: the same block sets as torch's construction of the offset `mask_mod`."""
    num, indices = window_kv_blocks(grid, kernel, CPU, block, frames)
    want = torch_block_sets(grid, kernel, block, frames)
    assert_tables_list(num, indices, want)


def test_a_slab_reaches_exactly_the_key_frames_of_its_windows() -> None:
    # T = 20, kt = 5: query frame t's window starts at clamp(t - 2, 0, 15)
    assert slab_key_frames(20, 5, 0, 4) == (0, 6)
    assert slab_key_frames(20, 5, 8, 12) == (6, 14)
    assert slab_key_frames(20, 5, 16, 20) == (14, 20)
    assert slab_key_frames(20, 20, 7, 9) == (0, 20)


@pytest.mark.parametrize("frames", [(0, 0), (3, 2), (-1, 2), (4, 10)])
def test_an_empty_or_outside_slab_is_refused(frames: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=r"query frames .* must be a non-empty range inside the grid's 9 frames"):
        window_kv_blocks((9, 5, 13), (3, 3, 5), CPU, 16, frames)


def test_block_tables_stay_narrow_at_a_warmup_shape() -> None:
    """The LTX-2.5 decoder's stage 5 at 256x384x25 (4x4 pixel patches, an 11^3 window): 1,200 query blocks of
    at most 99 KV blocks each, not torch's dense [1200, 1200] tables over a dense [153600, 153600] mask."""
    mask = window_block_mask((25, 64, 96), (11, 11, 11), CPU, layers.neighborhood_mask_mod((25, 64, 96), (11, 11, 11)))
    assert isinstance(mask, BlockMask)
    assert mask.kv_indices.shape == (1, 1, 1200, 99) and mask.seq_lengths == (153600, 153600)
    assert mask.full_kv_num_blocks is None
    assert torch.equal(mask.kv_num_blocks, torch.full((1, 1, 1200), 99, dtype=torch.int32))


@pytest.mark.parametrize("tile", [TILE, None], ids=["tiled", "row-major"])
def test_the_flex_path_builds_its_mask_from_the_window(monkeypatch: pytest.MonkeyPatch,
                                                       tile: tuple[int, int, int] | None) -> None:
    """`stage_mask` where FlexAttention runs: the geometric tables of its token order (`FLEX_TILE`), never torch's
    dense construction."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(layers, "uses_flex", lambda device, head_dim: True)
    monkeypatch.setattr(layers, "FLEX_TILE", tile)
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **k: pytest.fail("dense block-mask construction"))
    grid, kernel = (4, 7, 200), (3, 3, 11)
    mask = layers.stage_mask(grid, kernel, CPU, 64, 128)
    assert mask.layout == Layout(grid, tile)
    (slab,) = mask.slabs
    num, indices = window_kv_blocks(grid, kernel, CPU) if tile is None else tiled_kv_blocks(mask.layout, kernel, CPU)
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


def test_tiled_order_visits_fewer_blocks_at_the_release_stage5_grid() -> None:
    """At 25x128x192 tokens with an 11^3 window: 187 KV blocks a query block in row-major order, 54.8 on average
    in 2x8x8 tiles (the reason for the tiled order)."""
    grid, kernel = (25, 128, 192), (11, 11, 11)
    raster, _ = window_kv_blocks(grid, kernel, CPU)
    tiled, _ = tiled_kv_blocks(Layout(grid, TILE), kernel, CPU)
    assert float(raster.float().mean()) == 187.0
    assert round(float(tiled.float().mean()), 1) == 54.8


def test_a_window_larger_than_its_grid_is_refused() -> None:
    with pytest.raises(ValueError, match=r"window kernel \(3, 5, 3\) must be positive and at most the grid "
                                         r"\(4, 4, 9\) on axis H"):
        window_kv_blocks((4, 4, 9), (3, 5, 3), CPU)
