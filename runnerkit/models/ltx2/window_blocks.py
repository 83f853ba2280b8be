"""The FlexAttention block mask of the 3D neighborhood window, built from the window's geometry.

`torch.nn.attention.flex_attention.create_block_mask` evaluates the `mask_mod` on every (query, key)
pair: a dense [N, N] tensor and its int64 block sums. At the LTX-2.5 decoder's stage 5 (a 4x4 pixel
patch per token) a 256x384x25 clip has N = 153,600 tokens, and that construction asks for 176 GiB;
a 512x768x473 clip has N = 11.6 M. Here the blocks are derived from the window's extent instead, in
the tile order FlexAttention runs in (window_layout.py: each 128-token block is one tile of the grid):
a query tile's KV tiles are, per axis, those between the windows of the tile's first and last real
token, and their product (`tiled_kv_blocks`). At the release's stage-5 grid a query block visits 54.8
KV blocks on average, against 187 in row-major order (the order before tiles; ltx25_h100_s10.md
measured the attention 2.9x faster in tiles).

Every listed block is a partial block (the kernel applies `mask_mod` inside it), none "full": listing
a full block as partial gives the same attention, only masked. `kv_indices` is [1, 1, query blocks,
the most KV blocks any query block needs] (not the dense [.., query blocks, KV blocks] of
`create_block_mask`). The dense width would be (N/128)^2 int32, 31 GiB at the 473-frame stage-5 grid.
Compiled FlexAttention on CUDA takes the narrow tables (torch 2.11; test_diffusion_decoder_gpu.py); the
BlockMask docs show the dense shape, and CPU inductor with dynamic shapes refuses narrow ones ("KV seqlen
must be smaller than the block_mask size"), which the CPU path never meets (it uses a dense mask).

Tests: test_cases/models/ltx2/test_window_blocks.py (the block sets equal `create_block_mask`'s on
grids, kernels, tiles and slabs of every shape class).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from runnerkit.models.ltx2.window_layout import Layout, window_start

BLOCK_SIZE = 128
"""FlexAttention's default sparse block (tokens per query and per KV block)."""

def slab_key_frames(T: int, kt: int, t0: int, t1: int) -> tuple[int, int]:
    """The key frames [k0, k1) the windows of query frames [t0, t1) reach on a grid of T frames (`Layout.key_units`
    of the row-major order, whose units are frames): the dense-mask path's slabs."""
    return Layout((T, 1, 1)).key_units(kt, t0, t1)


def block_mask(num: Tensor, indices: Tensor, nq: int, nk: int, mask_mod: Callable[..., Tensor],
               block: int = BLOCK_SIZE) -> object:
    """A FlexAttention `BlockMask` (B and heads broadcast) from KV tables [Q], [Q, width] of partial blocks
    over nq queries and nk keys; `mask_mod` masks inside each block. Forward only: no transposed
    (query-block) tables are built where torch lets them be skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    takes = inspect.signature(BlockMask.from_kv_blocks).parameters
    extra = {"compute_q_blocks": False} if "compute_q_blocks" in takes else {}
    return BlockMask.from_kv_blocks(num[None, None], indices[None, None], BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(nq, nk), **extra)


def tiled_kv_blocks(layout: Layout, kernel: tuple[int, int, int], device: torch.device,
                    units: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """For each query tile of a tiled `layout` (one block each, in the layout's order), the key tiles holding at
    least one pair the window allows: per axis the tiles between the window of the tile's first and last real
    token, and their product.

    Args:
        layout: a tiled `Layout` (tile tokens = the block size); kernel: window (kt, kh, kw) <= the grid.
        device: where the tables are built and returned.
        units: query frames of tiles [u0, u1) of a slab, against the key units their windows reach
            (`Layout.key_units`), each side indexed from its first unit; None for the whole grid.

    Returns:
        kv_num_blocks [Q] int32 (Q query tiles) and kv_indices [Q, width] int32: row q lists its KV tiles in
        ascending order in its first kv_num_blocks[q] entries (the rest 0), width the fullest row's count.

    Raises:
        ValueError: a kernel axis larger than its grid axis, or not positive; an empty or outside `units`.
    """
    grid, counts, tile = layout.grid, layout.counts, layout.tile
    for axis, size, k in zip("THW", grid, kernel):
        if not 0 < k <= size:
            raise ValueError(f"window kernel {kernel} must be positive and at most the grid {grid} on axis {axis}")
    u0, u1 = units or (0, counts[0])
    if not 0 <= u0 < u1 <= counts[0]:
        raise ValueError(f"query units {units} must be a non-empty range inside the layout's {counts[0]} units")
    j0 = layout.key_units(kernel[0], u0, u1)[0]
    cands, valids = [], []
    for axis, (size, t, k) in enumerate(zip(grid, tile, kernel)):
        first, n = (u0, u1 - u0) if axis == 0 else (0, counts[axis])
        i = torch.arange(first, first + n, device=device)
        lo = window_start(i * t, size, k)  # first key coordinate of the tile's windows
        hi = window_start(torch.clamp((i + 1) * t, max=size) - 1, size, k) + k - 1  # last key coordinate
        origin = j0 * t if axis == 0 else 0
        lo, hi = (lo - origin) // t, (hi - origin) // t
        cand = lo[:, None] + torch.arange(int((hi - lo).max()) + 1, device=device)  # [n, span]
        cands.append(cand)
        valids.append(cand <= hi[:, None])
    (ct, ch, cw), (vt, vh, vw) = cands, valids
    nH, nW = counts[1], counts[2]
    keys = ((ct[:, None, None, :, None, None] * nH + ch[None, :, None, None, :, None]) * nW
            + cw[None, None, :, None, None, :])
    valid = vt[:, None, None, :, None, None] & vh[None, :, None, None, :, None] & vw[None, None, :, None, None, :]
    q = ct.shape[0] * nH * nW
    keys, valid = keys.reshape(q, -1), valid.reshape(q, -1)
    keys = torch.sort(torch.where(valid, keys, torch.iinfo(keys.dtype).max), dim=1).values
    num = valid.sum(1)
    width = int(num.max())
    keys = keys[:, :width]
    keys = torch.where(torch.arange(width, device=device) < num[:, None], keys, 0)
    return num.to(torch.int32), keys.to(torch.int32)
