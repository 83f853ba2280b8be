"""The FlexAttention block mask of the 3D neighborhood window, built from the window's geometry.

`torch.nn.attention.flex_attention.create_block_mask` evaluates the `mask_mod` on every (query, key)
pair: a dense [N, N] tensor and its int64 block sums. At the LTX-2.5 decoder's stage 5 (a 4x4 pixel
patch per token) a 256x384x25 clip has N = 153,600 tokens, and that construction asks for 176 GiB;
a 512x768x473 clip has N = 11.6 M. Here the blocks are derived from the window's extent instead:

- tokens are row-major over (T, H, W); a grid row (t, h) is W consecutive tokens;
- the queries of one query block that lie in one grid row share their t- and h-windows, and their
  w-windows (centred, shifted inward at the border, sliding by at most one column per query) cover
  one contiguous column range [a, b);
- so the keys they may attend to are, for each of the kt x kh rows (t', h') of that window, the
  flat range [t' H W + h' W + a, t' H W + h' W + b): every KV block that range touches holds at
  least one allowed pair, and no other block does.

Every listed block is a partial block (the kernel applies `mask_mod` inside it), none "full": the
window is narrower than a block along W at every shipped kernel, so a block that every pair of a
query block may attend to is rare; listing it as partial gives the same attention, only masked.
`kv_indices` is [1, 1, query blocks, the most KV blocks any query block needs] (not the dense
[.., query blocks, KV blocks] of `create_block_mask`), built in bounded chunks of grid rows. The dense
width would be (N/128)^2 int32, 31 GiB at the 473-frame stage-5 grid. Compiled FlexAttention on CUDA
takes the narrow tables (torch 2.11; test_diffusion_decoder_gpu.py); the BlockMask docs show the dense
shape, and CPU inductor with dynamic shapes refuses narrow ones ("KV seqlen must be smaller than the
block_mask size"), which the CPU path never meets (it uses a dense mask).

The tile order's tables (`tiled_kv_blocks`, window_layout.py): each query block is one tile, and its KV
tiles are, per axis, those between the windows of the tile's first and last real token; their product.

Tests: test_cases/models/ltx2/test_window_blocks.py (the block sets equal `create_block_mask`'s on
grids and kernels of every shape class, in both orders).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import Tensor

from runnerkit.models.ltx2.window_layout import Layout, window_start

BLOCK_SIZE = 128
"""FlexAttention's default sparse block (tokens per query and per KV block)."""

CHUNK_ELEMENTS = 1 << 24
"""Candidate (query block, KV block) pairs enumerated at once: bounds the builder's temporaries
(~16 M int64, 128 MiB each) whatever the grid."""


def slab_key_frames(T: int, kt: int, t0: int, t1: int) -> tuple[int, int]:
    """The key frames [k0, k1) the windows of query frames [t0, t1) reach on a grid of T frames (`Layout.key_units`
    of the row-major order, whose units are frames)."""
    return Layout((T, 1, 1)).key_units(kt, t0, t1)


def window_kv_blocks(grid: tuple[int, int, int], kernel: tuple[int, int, int], device: torch.device,
                     block: int = BLOCK_SIZE, frames: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """For each query block of the row-major (T, H, W) grid, the KV blocks holding at least one pair
    the neighborhood window allows.

    Args:
        grid: (T, H, W) tokens per axis; kernel: window (kt, kh, kw), each <= the grid's axis.
        device: where the tables are built and returned.
        block: tokens per query and per KV block.
        frames: query frames [t0, t1) of a slab, against the key frames [k0, k1) their windows reach
            (`slab_key_frames`), each side indexed from its first frame; None for the whole grid.

    Returns:
        kv_num_blocks [Q] int32 (Q = ceil(Nq / block) query blocks) and kv_indices [Q, width] int32:
        row q lists its KV blocks in ascending order in its first kv_num_blocks[q] entries (the rest 0).

    Raises:
        ValueError: a kernel axis larger than its grid axis, or not positive.
    """
    T, H, W = grid
    kt, kh, kw = kernel
    for axis, size, k in zip("THW", grid, kernel):
        if not 0 < k <= size:
            raise ValueError(f"window kernel {kernel} must be positive and at most the grid {grid} on axis {axis}")
    t0, t1 = frames or (0, T)
    if not 0 <= t0 < t1 <= T:
        raise ValueError(f"query frames {frames} must be a non-empty range inside the grid's {T} frames")
    k0, k1 = slab_key_frames(T, kt, t0, t1)
    hw = H * W
    num_q, num_kv = math.ceil((t1 - t0) * hw / block), math.ceil((k1 - k0) * hw / block)
    rows = torch.arange((t1 - t0) * H, device=device)  # the slab's grid rows, from its first frame
    first_qb, last_qb = (rows * W) // block, ((rows + 1) * W - 1) // block
    span_q = int((last_qb - first_qb).max()) + 1
    # (grid row, query block) pairs: the query block's queries that lie in the row
    qb = first_qb[:, None] + torch.arange(span_q, device=device)[None, :]
    row = rows[:, None].expand_as(qb)
    keep = qb <= last_qb[:, None]
    qb, row = qb[keep], row[keep]
    col_lo = torch.clamp(qb * block - row * W, min=0)
    col_hi = torch.clamp((qb + 1) * block - row * W, max=W) - 1
    a, b = window_start(col_lo, W, kw), window_start(col_hi, W, kw) + kw  # the union of their w-windows
    st, sh = window_start(t0 + row // H, T, kt) - k0, window_start(row % H, H, kh)  # key frames counted from k0
    span_kv = math.ceil((int((b - a).max()) - 1) / block) + 1 if b.numel() else 1  # KV blocks one range touches
    per_pair = kt * kh * (span_kv + 1)
    chunk = max(1, CHUNK_ELEMENTS // per_pair)
    dt = torch.arange(kt, device=device)
    dh = torch.arange(kh, device=device)
    steps = torch.arange(span_kv + 1, device=device)
    found = []
    for lo in range(0, qb.numel(), chunk):
        s = slice(lo, lo + chunk)
        base = ((st[s, None, None] + dt[None, :, None]) * hw + (sh[s, None, None] + dh[None, None, :]) * W)  # [P, kt, kh]
        first = (base + a[s, None, None]) // block
        last = (base + b[s, None, None] - 1) // block
        kv = first[..., None] + steps  # [P, kt, kh, span+1]
        valid = kv <= last[..., None]
        keys = (qb[s, None, None, None] * num_kv + kv)[valid]
        found.append(torch.unique(keys))
    keys = torch.unique(torch.cat(found))  # sorted: by query block, then KV block
    q_of, kv_of = keys // num_kv, keys % num_kv
    counts = torch.bincount(q_of, minlength=num_q)
    offsets = torch.cumsum(counts, 0) - counts
    width = int(counts.max())
    kv_indices = torch.zeros(num_q, width, dtype=torch.int32, device=device)
    kv_indices[q_of, torch.arange(keys.numel(), device=device) - offsets[q_of]] = kv_of.to(torch.int32)
    return counts.to(torch.int32), kv_indices


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


def window_block_mask(grid: tuple[int, int, int], kernel: tuple[int, int, int], device: torch.device,
                      mask_mod: Callable[..., Tensor], block: int = BLOCK_SIZE,
                      frames: tuple[int, int] | None = None) -> object:
    """The FlexAttention `BlockMask` of the window on the row-major `grid`, from `window_kv_blocks` (of the
    query frames `frames` when given); `mask_mod` (the window's, with the slab's frame offsets) masks inside
    each block."""
    num, indices = window_kv_blocks(grid, kernel, device, block, frames)
    T, H, W = grid
    t0, t1 = frames or (0, T)
    k0, k1 = slab_key_frames(T, kernel[0], t0, t1)
    return block_mask(num, indices, (t1 - t0) * H * W, (k1 - k0) * H * W, mask_mod, block)


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
        kv_num_blocks [Q] int32 and kv_indices [Q, width] int32 (ascending, then 0), as `window_kv_blocks`.
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
