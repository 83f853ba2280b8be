"""The neighborhood window's FlexAttention block tables, built from the window's geometry
(runnerkit/models/ltx2/window_blocks.py), against torch's own `create_block_mask` of the same `mask_mod`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.window_blocks import window_block_mask, window_kv_blocks

CPU = torch.device("cpu")


def torch_block_sets(grid: tuple[int, int, int], kernel: tuple[int, int, int], block: int) -> torch.Tensor:
    """[Q, Q] bool: KV blocks torch's `create_block_mask` lists for each query block (partial or full)."""
    n = math.prod(grid)
    mask = create_block_mask(layers.neighborhood_mask_mod(grid, kernel), None, None, n, n, device=CPU, BLOCK_SIZE=block)
    num_q = math.ceil(n / block)
    sets = torch.zeros(num_q, num_q, dtype=torch.bool)
    for num, idx in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        for q in range(num_q):
            sets[q, idx[0, 0, q, :num[0, 0, q]].long()] = True
    return sets


# grids narrower and wider than a block along W, token counts with and without a partial last block,
# kernels equal to the grid, of one token, and window rows spanning several blocks
CASES = [((5, 9, 13), (3, 3, 5), 16), ((4, 7, 200), (3, 3, 11), 128), ((6, 20, 24), (5, 11, 11), 128),
         ((3, 3, 3), (3, 3, 3), 8), ((12, 10, 9), (11, 3, 3), 32), ((2, 5, 7), (1, 1, 1), 4)]


@pytest.mark.parametrize(("grid", "kernel", "block"), CASES, ids=[f"{g}-{k}-{b}" for g, k, b in CASES])
def test_window_blocks_are_exactly_torchs_block_sets(grid: tuple[int, int, int], kernel: tuple[int, int, int],
                                                     block: int) -> None:
    num, indices = window_kv_blocks(grid, kernel, CPU, block)
    want = torch_block_sets(grid, kernel, block)
    got = torch.zeros_like(want)
    for q in range(num.numel()):
        row = indices[q, :num[q]].long()
        assert torch.all(row[1:] > row[:-1]), "each row lists its KV blocks once, ascending"
        got[q, row] = True
    assert torch.equal(got, want)
    assert indices.shape[1] == int(num.max()) and num.dtype == indices.dtype == torch.int32


def test_block_tables_stay_narrow_at_a_warmup_shape() -> None:
    """The LTX-2.5 decoder's stage 5 at 256x384x25 (4x4 pixel patches, an 11^3 window): 1,200 query blocks of
    at most 99 KV blocks each, not torch's dense [1200, 1200] tables over a dense [153600, 153600] mask."""
    mask = window_block_mask((25, 64, 96), (11, 11, 11), CPU, layers.neighborhood_mask_mod((25, 64, 96), (11, 11, 11)))
    assert isinstance(mask, BlockMask)
    assert mask.kv_indices.shape == (1, 1, 1200, 99) and mask.seq_lengths == (153600, 153600)
    assert mask.full_kv_num_blocks is None
    assert torch.equal(mask.kv_num_blocks, torch.full((1, 1, 1200), 99, dtype=torch.int32))


def test_the_flex_path_builds_its_mask_from_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stage_mask` where FlexAttention runs: the geometric tables, never torch's dense construction."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(layers, "uses_flex", lambda device, head_dim: True)
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **k: pytest.fail("dense block-mask construction"))
    grid, kernel = (4, 7, 200), (3, 3, 11)
    mask = layers.stage_mask(grid, kernel, CPU, 64)
    num, indices = window_kv_blocks(grid, kernel, CPU)
    assert torch.equal(mask.kv_num_blocks[0, 0], num) and torch.equal(mask.kv_indices[0, 0], indices)


def test_a_window_larger_than_its_grid_is_refused() -> None:
    with pytest.raises(ValueError, match=r"window kernel \(3, 5, 3\) must be positive and at most the grid "
                                         r"\(4, 4, 9\) on axis H"):
        window_kv_blocks((4, 4, 9), (3, 5, 3), CPU)
