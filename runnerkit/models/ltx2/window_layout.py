"""Token orders of the diffusion decoder's window attention, and the slabs of frames its calls run in.

A stage's tokens form a (T, H, W) grid. Row-major order (`Layout(grid, None)`) puts each grid row of W
tokens after the previous one; a FlexAttention block of 128 queries is then a strip of one or two grid
rows, and the windows of its queries reach kt x kh rows of the grid, 187 KV blocks a query block at the
LTX-2.5 stage-5 grid (128x192 tokens a frame, an 11^3 window) for 1,331 keys each query needs. Tiled
order (`Layout(grid, TILE)`) makes each block a 2x8x8 tile of the grid, padded up to whole tiles: the
windows of one tile reach 55 KV tiles on average there, 3.4x fewer blocks for the kernel to visit.
Padded tokens are never keys (every window lies inside the grid) and padded queries are dropped.

Slabs bound each attention call to `limit` elements of keys (diffusion_decoder_layers.py `INDEX_LIMIT`):
query units (frames, or frames of tiles) [u0, u1) against the key units their windows reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

TILE = (2, 8, 8)
"""Frames, rows and columns of one tile: 128 tokens, one FlexAttention block."""


def window_start(index: Tensor | int, size: int, kernel: int) -> Tensor | int:
    """First position of the window of `index` on an axis of `size`: centred, shifted inward at the border."""
    if isinstance(index, int):
        return max(0, min(index - kernel // 2, size - kernel))
    return torch.clamp(index - kernel // 2, 0, size - kernel)


@dataclass(frozen=True)
class Layout:
    """The order of a (T, H, W) grid's tokens: row-major (`tile` None) or tiles of `tile` (padded grid)."""

    grid: tuple[int, int, int]
    tile: tuple[int, int, int] | None = None

    @property
    def counts(self) -> tuple[int, int, int]:
        """Tiles per axis (the grid itself when row-major)."""
        if self.tile is None:
            return self.grid
        return tuple(math.ceil(g / t) for g, t in zip(self.grid, self.tile))  # type: ignore[return-value]

    @property
    def padded(self) -> tuple[int, int, int]:
        """The grid rounded up to whole tiles."""
        if self.tile is None:
            return self.grid
        return tuple(n * t for n, t in zip(self.counts, self.tile))  # type: ignore[return-value]

    @property
    def unit_frames(self) -> int:
        """Frames of one slab unit: one frame, or one frame of tiles."""
        return 1 if self.tile is None else self.tile[0]

    @property
    def units(self) -> int:
        return self.counts[0]

    @property
    def unit_tokens(self) -> int:
        """Tokens of one unit in this order (padding included)."""
        _, H, W = self.padded
        return self.unit_frames * H * W

    def arrange(self, x: Tensor) -> Tensor:
        """[B, T, H, W, *rest] in grid order -> [B, units * unit_tokens, *rest] in this order (a view when
        row-major and contiguous; a zero-padded copy when tiled)."""
        B, rest = x.shape[0], tuple(x.shape[4:])
        if self.tile is None:
            return x.reshape(B, -1, *rest)
        (T, H, W), (Tp, Hp, Wp) = self.grid, self.padded
        if (Tp, Hp, Wp) != (T, H, W):
            x = F.pad(x, [0, 0] * len(rest) + [0, Wp - W, 0, Hp - H, 0, Tp - T])
        (nT, nH, nW), (tt, th, tw) = self.counts, self.tile
        x = x.reshape(B, nT, tt, nH, th, nW, tw, *rest)
        return x.permute(0, 1, 3, 5, 2, 4, 6, *range(7, 7 + len(rest))).reshape(B, -1, *rest)

    def restore(self, y: Tensor) -> Tensor:
        """[B, units * unit_tokens, *rest] in this order -> [B, T, H, W, *rest] in grid order (padding dropped)."""
        B, rest = y.shape[0], tuple(y.shape[2:])
        T, H, W = self.grid
        if self.tile is None:
            return y.reshape(B, T, H, W, *rest)
        (nT, nH, nW), (tt, th, tw) = self.counts, self.tile
        y = y.reshape(B, nT, nH, nW, tt, th, tw, *rest).permute(0, 1, 4, 2, 5, 3, 6, *range(7, 7 + len(rest)))
        y = y.reshape(B, *self.padded, *rest)
        return y if self.padded == self.grid else y[:, :T, :H, :W]

    def coords(self, idx: Tensor, frame0: Tensor | int) -> tuple[Tensor, Tensor, Tensor]:
        """Grid (t, h, w) of token `idx` of this order, counted from frame `frame0`."""
        _, H, W = self.grid
        if self.tile is None:
            return idx // (H * W) + frame0, (idx // W) % H, idx % W
        (_, nH, nW), (tt, th, tw) = self.counts, self.tile
        size = tt * th * tw
        tile, r = idx // size, idx % size
        return ((tile // (nH * nW)) * tt + r // (th * tw) + frame0, ((tile // nW) % nH) * th + (r // tw) % th,
                (tile % nW) * tw + r % tw)

    def key_units(self, kt: int, u0: int, u1: int) -> tuple[int, int]:
        """The key units [j0, j1) the windows of query units [u0, u1) reach."""
        T, f = self.grid[0], self.unit_frames
        k0 = window_start(u0 * f, T, kt)
        k1 = window_start(min(u1 * f, T) - 1, T, kt) + kt
        return k0 // f, -(-k1 // f)


def window_mask_mod(layout: Layout, kernel: tuple[int, int, int], q_frame0: Tensor | int = 0,
                    k_frame0: Tensor | int = 0):  # type: ignore[no-untyped-def]
    """FlexAttention `mask_mod` of the 3D neighborhood window over tokens in `layout` order; `q_frame0` /
    `k_frame0`: the grid frame of local query / key index 0's unit (a 0-dim tensor keeps one compiled kernel
    for every slab)."""
    T, H, W = layout.grid
    kt, kh, kw = kernel

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_t, q_h, q_w = layout.coords(q_idx, q_frame0)
        k_t, k_h, k_w = layout.coords(kv_idx, k_frame0)
        st, sh, sw = window_start(q_t, T, kt), window_start(q_h, H, kh), window_start(q_w, W, kw)
        return ((k_t >= st) & (k_t < st + kt) & (k_h >= sh) & (k_h < sh + kh)
                & (k_w >= sw) & (k_w < sw + kw))

    return mask_mod


def _even(units: int, count: int) -> list[tuple[int, int]]:
    bounds = [round(i * units / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def attention_slabs(layout: Layout, kt: int, channels: int, limit: int) -> list[tuple[int, int]]:
    """Query unit ranges [u0, u1) covering every unit in order: the fewest even slabs (sizes differing by at most
    one unit; equal slabs share one compiled kernel) whose key units (`Layout.key_units`) each span at most
    `limit` elements (one video's q, k or v of `channels` per token). An uneven split may need one slab fewer.

    Raises:
        ValueError: even one unit's keys exceed `limit` (a frame too large for any slab).
    """
    unit = layout.unit_tokens * channels
    units = layout.units
    if units * unit <= limit:
        return [(0, units)]
    for count in range(max(2, units * unit // limit), units + 1):
        slabs = _even(units, count)
        if all((j1 - j0) * unit <= limit for j0, j1 in (layout.key_units(kt, *s) for s in slabs)):
            return slabs
    T, H, W = layout.grid
    least = min((j1 - j0) * unit for j0, j1 in (layout.key_units(kt, u, u + 1) for u in range(units)))
    raise ValueError(f"the decoder's window attention on a {T}x{H}x{W} token grid of {channels} channels cannot be "
                     f"split under {limit} elements a call: the keys of a single query frame's window hold {least} "
                     f"({kt} frames); decode with tiling (`offload.vae_tiling`) or at a smaller size.")
