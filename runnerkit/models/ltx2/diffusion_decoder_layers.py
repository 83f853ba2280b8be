"""Layers of the LTX-2.5 diffusion video decoder: 3D neighborhood attention with an absolute 3D
RoPE, the tiled SwiGLU MLP, the two block kinds and the channels-last pixel-shuffle upsampler.

Design source: diffusers 0.42.1 `models/autoencoders/ltx2_diffusion_decoder.py` (port of the
Lightricks LTX-2.5 decoder, which calls NATTEN's `na3d`). Parameter names are diffusers'. All
tensors are channels-last: `[B, T, H, W, C]` (T frames, H/W grid rows/columns of the stage).

Neighborhood attention: every query attends to exactly `kernel` positions per axis, a window
centred on it and shifted inward at the grid border (NATTEN's rule, no truncation). On CUDA it
runs as FlexAttention with a block mask (compiled: the uncompiled kernel materialises every
score), its tokens in 2x8x8 tiles (window_layout.py) and no call past `INDEX_LIMIT` elements;
elsewhere the same window is a dense boolean mask for `scaled_dot_product_attention` (fine at
test sizes only: the mask is `[N, N]`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.models.ltx2.window_blocks import block_mask, slab_key_frames, tiled_kv_blocks
from runnerkit.models.ltx2.window_layout import TILE, Layout, attention_slabs, window_mask_mod

SWIGLU_TILE_TOKENS = 16384
"""Tokens per SwiGLU tile (the reference's `_SWIGLU_TILE_SIZE`): bounds the three hidden-width
tensors live at once independently of the resolution; the result is the untiled one up to
matmul reduction order."""

Kernel = tuple[int, int, int]


def swiglu_hidden_dim(dim: int, mlp_ratio: float = 4.0) -> int:
    """Hidden width of a SwiGLU: `dim * mlp_ratio` rounded up to a multiple of 16."""
    return (int(dim * mlp_ratio) + 15) // 16 * 16


def rope_dim_split(head_dim: int) -> tuple[int, int, int]:
    """Channels of `head_dim` rotated by the (T, H, W) positions: a quarter (even) to T, the rest
    halved between H and W with both halves even.

    Raises:
        ValueError: `head_dim` not a multiple of 8.
    """
    if head_dim % 8 != 0:
        raise ValueError(f"`head_dim` must be a multiple of 8, got {head_dim}.")
    dim_t = (head_dim // 4) // 2 * 2
    dim_hw = (head_dim - dim_t) // 2
    if dim_hw % 2 != 0:
        dim_t -= 2
        dim_hw = (head_dim - dim_t) // 2
    return dim_t, dim_hw, dim_hw


def _angles(positions: Tensor, d: int, base: float) -> Tensor:
    """RoPE angles [n, d/2] (float32, radians) of `positions` [n] for `d` rotated channels."""
    inv_freqs = (1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d)).float()
    return positions[:, None] * inv_freqs[None, :]


def _rotate(x: Tensor, positions: Tensor, base: float, axis: int) -> Tensor:
    """Rotate the interleaved pairs of `x` [B, T, H, W, heads, d] by `positions` along `axis` (1-3)."""
    d = x.shape[-1]
    shape = [1, 1, 1, 1, 1, d // 2]
    shape[axis] = positions.shape[0]
    angles = _angles(positions, d, base).reshape(shape)  # broadcast over B, heads
    pairs = x.unflatten(-1, (d // 2, 2)).float()  # [..., d/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def _rope_3d_one_pass(x: Tensor, base: float) -> Tensor:
    """`apply_rope_3d` as one elementwise pass over `x` [B, T, H, W, heads, head_dim] (half precision):
    the per-axis angles gathered into one float32 table [T, H, W, head_dim/2] shared by the heads, each
    pair rotated as (e, o) -> (e cos - o sin, o cos + e sin). Run eagerly, the same floats as the per-axis
    form; compiled, within inductor's rounding. What a compiled region runs, where the per-axis form's
    concatenation of float32 results makes inductor keep them (two activations of float32 beside the
    projection and the output)."""
    d = x.shape[-1]
    T, H, W = x.shape[1:4]
    tables = []
    for axis, (n, width) in enumerate(zip((T, H, W), rope_dim_split(d))):
        shape = [1, 1, 1, 1, 1, width // 2, 1]
        shape[axis + 1] = n
        positions = torch.arange(n, dtype=torch.float32, device=x.device)
        tables.append(_angles(positions, width, base).reshape(shape).expand(1, T, H, W, 1, width // 2, 1))
    angles = torch.cat(tables, dim=-2)  # [1, T, H, W, 1, d/2, 1]
    pairs = x.unflatten(-1, (d // 2, 2)).float()  # [..., d/2, (e, o)]
    sign = torch.tensor([-1.0, 1.0], device=x.device)
    rotated = pairs * angles.cos() + pairs.flip(-1) * (angles.sin() * sign)
    return rotated.to(x.dtype).flatten(-2)


def apply_rope_3d(x: Tensor, base: float = 10000.0) -> Tensor:
    """Absolute 3D RoPE on `x` [B, T, H, W, heads, head_dim]: positions are the 0-based grid
    indices (only relative offsets matter inside a local window); float32 math, `x.dtype` out.
    Eager, one axis's channels at a time (float32 temporaries of one chunk); compiled in half
    precision, one elementwise pass (`_rope_3d_one_pass`)."""
    if torch.compiler.is_compiling() and x.dtype != torch.float32:
        return _rope_3d_one_pass(x, base)
    dim_t, dim_h, _ = rope_dim_split(x.shape[-1])
    T, H, W = x.shape[1:4]
    pos = [torch.arange(n, dtype=torch.float32, device=x.device) for n in (T, H, W)]
    return torch.cat([_rotate(x[..., :dim_t], pos[0], base, 1),
                      _rotate(x[..., dim_t:dim_t + dim_h], pos[1], base, 2),
                      _rotate(x[..., dim_t + dim_h:], pos[2], base, 3)], dim=-1)


def neighborhood_mask_mod(grid: tuple[int, int, int], kernel: Kernel, q_frame0: int | Tensor = 0,
                          k_frame0: int | Tensor = 0) -> Callable[..., Tensor]:
    """FlexAttention `mask_mod` of the 3D neighborhood window on a row-major (T, H, W) token grid;
    `q_frame0` / `k_frame0`: the grid frame of local query / key index 0 (window_layout.py)."""
    return window_mask_mod(Layout(tuple(grid)), kernel, q_frame0, k_frame0)


def dense_neighborhood_mask(grid: tuple[int, int, int], kernel: Kernel, device: torch.device,
                            frames: tuple[int, int] | None = None) -> Tensor:
    """The neighborhood window as a boolean [Nq, Nk] mask over row-major tokens, True where a query (row) may
    attend to a key (column): the whole grid (N = T*H*W each), or the query frames `frames` = [t0, t1)
    against the key frames their windows reach (`slab_key_frames`)."""
    T, H, W = grid
    t0, t1 = frames or (0, T)
    k0, k1 = slab_key_frames(T, kernel[0], t0, t1)
    iq = torch.arange((t1 - t0) * H * W, device=device)
    ik = torch.arange((k1 - k0) * H * W, device=device)
    return neighborhood_mask_mod(grid, kernel, t0, k0)(None, None, iq[:, None], ik[None, :])


INDEX_LIMIT = 2**31 - 1
"""The most elements one attention operand may span. Past it inductor's FlexAttention kernel indexes in 64 bits,
and that variant, once compiled, also serves every smaller call: on an H100 the decoder's stage-5 window attention
at 25x128x192 tokens took 1.78 s a call instead of 0.22 s after one call over 2^31 elements, and 24.0 s instead of
3.0 s at 342x128x192 (bench/decoder_attention.py; bench/results/ltx25_h100_s10.md). Longer grids are split into
slabs of frames (window_layout.py `attention_slabs`)."""



@dataclass(frozen=True)
class Slab:
    """Query units [u0, u1) of a layout (frames, or frames of tiles), the key units [j0, j1) their windows reach,
    their token ranges in the layout's order, and the mask (a FlexAttention `BlockMask` or a dense boolean
    [Nq, Nk] tensor)."""

    units: tuple[int, int]
    key_units: tuple[int, int]
    queries: tuple[int, int]
    keys: tuple[int, int]
    mask: object


@dataclass(frozen=True)
class WindowMask:
    """The window attention of one stage's grid: its token order and its slabs (one slab: the whole grid)."""

    layout: Layout
    kernel: Kernel
    slabs: tuple[Slab, ...]
    limit: int


@cache
def _compiled_flex() -> Callable[..., Tensor]:
    """FlexAttention compiled once for the process (automatic dynamic shapes: the decoder meets
    five token grids per video shape, more than a static compile's recompile limit allows).
    The CPU tests take the dense-mask path."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


FLEX_MIN_HEAD_DIM = 16
"""The smallest head size inductor lowers FlexAttention for ("NYI: embedding dimension of the query, key, and
value must be at least 16", torch 2.11 on an H100); smaller heads (the tiny test configs') take the dense mask."""


def uses_flex(device: torch.device, head_dim: int) -> bool:
    """Whether the decoder's attention on `device` with heads of `head_dim` runs compiled FlexAttention with a
    `BlockMask` (CUDA, heads of at least `FLEX_MIN_HEAD_DIM`) rather than SDPA with a dense [N, N] mask."""
    return device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM


def attend(q: Tensor, k: Tensor, v: Tensor, mask: object) -> Tensor:
    """The attention kernel on q [B, heads, Nq, d], k and v [B, heads, Nk, d] (scale 1), chosen by one slab's
    mask: compiled FlexAttention for a `BlockMask`, `scaled_dot_product_attention` for a dense boolean
    [Nq, Nk] mask. Returns [B, heads, Nq, d]."""
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    return _compiled_flex()(q, k, v, block_mask=mask, scale=1.0)


def stage_mask(grid: tuple[int, int, int], kernel: Kernel, device: torch.device, head_dim: int,
               channels: int, limit: int | None = None) -> WindowMask:
    """The window masks of one (grid, kernel), shared by every block of a stage.

    Where `uses_flex(device, head_dim)`: tokens in `TILE` order and FlexAttention `BlockMask`s built from the
    window's geometry (window_blocks.py; `create_block_mask` would build the dense [N, N] mask); elsewhere
    row-major tokens and dense boolean masks. One slab per `attention_slabs` range: one video's q of `channels`
    (= heads x head_dim) per token, at most `limit` elements of keys a call (None: `INDEX_LIMIT`).

    Raises:
        ValueError: a grid axis smaller than its kernel (NATTEN's window must fit), or a frame too large for
            any slab (`attention_slabs`).
    """
    if any(g < k for g, k in zip(grid, kernel)):
        raise ValueError(f"neighborhood attention needs the (T, H, W) grid {tuple(grid)} to be at least its kernel "
                         f"{tuple(kernel)} on every axis; decode a larger video.")
    flex = uses_flex(device, head_dim)
    layout = Layout(tuple(grid), TILE if flex else None)
    limit = INDEX_LIMIT if limit is None else limit
    per_unit, f = layout.unit_tokens, layout.unit_frames
    slabs = []
    for u0, u1 in attention_slabs(layout, kernel[0], channels, limit):
        j0, j1 = layout.key_units(kernel[0], u0, u1)
        # FlexAttention reads the slab's frame offsets from tensors: one compiled kernel for whole grids and slabs
        q0, k0 = u0 * f, j0 * f
        if flex:
            q0, k0 = torch.tensor(q0, device=device), torch.tensor(k0, device=device)
        mask_mod = window_mask_mod(layout, kernel, q0, k0)
        nq, nk = (u1 - u0) * per_unit, (j1 - j0) * per_unit
        if not flex:
            iq, ik = torch.arange(nq, device=device), torch.arange(nk, device=device)
            mask = mask_mod(None, None, iq[:, None], ik[None, :])
        else:
            tables = tiled_kv_blocks(layout, kernel, device, (u0, u1))
            mask = block_mask(*tables, nq, nk, mask_mod, math.prod(layout.tile))
        slabs.append(Slab((u0, u1), (j0, j1), (u0 * per_unit, u1 * per_unit), (j0 * per_unit, j1 * per_unit), mask))
    return WindowMask(layout, tuple(kernel), tuple(slabs), limit)


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, mask: WindowMask) -> Tensor:
    """Window attention over tokens in `mask.layout` order (`Layout.arrange`): q, k, v [B, N, heads, d] (the query
    already scaled) -> [B, N, heads * d] in the same order. Where one video's tensors span more than `mask.limit`
    elements, one video and one slab a call, written into the output in place; the result is the whole grid's
    (each query's keys are the same)."""
    B, N, heads, d = q.shape

    def run(qs: Tensor, ks: Tensor, vs: Tensor, m: object) -> Tensor:  # [b, n, heads, d] -> [b, n, heads * d]
        out = attend(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), m)  # [b, heads, n, d]
        return out.transpose(1, 2).reshape(qs.shape[0], qs.shape[1], heads * d)

    whole = q.numel() <= mask.limit
    if whole and len(mask.slabs) == 1:
        return run(q, k, v, mask.slabs[0].mask)
    out = q.new_empty(B, N, heads * d)
    for items in [slice(None)] if whole else [slice(b, b + 1) for b in range(B)]:
        for slab in mask.slabs:
            (q0, q1), (k0, k1) = slab.queries, slab.keys
            out[items, q0:q1] = run(q[items, q0:q1], k[items, k0:k1], v[items, k0:k1], slab.mask)
    return out


def neighborhood_attention(q: Tensor, k: Tensor, v: Tensor, kernel: Kernel, mask: WindowMask | None = None) -> Tensor:
    """Softmax attention of each query over its 3D neighborhood window, no extra scaling.

    Args:
        q, k, v: [B, T, H, W, heads, head_dim] (the query already carries 1/sqrt(head_dim)).
        kernel: window (T, H, W); each must be <= the grid's size on that axis.
        mask: a prebuilt `stage_mask` for this grid and kernel (one per stage), or None to build it.

    Returns:
        [B, T, H, W, heads * head_dim] (`windowed_attention` in the mask's token order).
    """
    B, T, H, W, heads, d = q.shape
    if mask is None:
        mask = stage_mask((T, H, W), kernel, q.device, d, heads * d)
    arrange = mask.layout.arrange
    return mask.layout.restore(windowed_attention(arrange(q), arrange(k), arrange(v), mask))


class NeighborhoodAttention(nn.Module):
    """QKV projections, per-head RMSNorm of q and k, q scaled by 1/sqrt(head_dim), 3D RoPE on q
    and k (in that order, as the reference), windowed attention, output projection.

    `query` and `key` are compiled regions (runnerkit/compile.py `compile_regions`, with `compile.enabled`): tensor
    functions of the input alone, so one graph with dynamic sizes serves every stage and grid."""

    COMPILED_REGIONS = ("query", "key")

    def __init__(self, dim: int, kernel: Kernel, head_dim: int) -> None:
        super().__init__()
        if dim % head_dim != 0:
            raise ValueError(f"width {dim} must be a multiple of `head_dim` {head_dim}.")
        rope_dim_split(head_dim)  # validates head_dim
        self.heads, self.head_dim, self.kernel = dim // head_dim, head_dim, tuple(kernel)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)

    def query(self, x: Tensor) -> Tensor:
        """x: [B, T, H, W, C] -> q [B, T, H, W, heads, head_dim]: projected, RMS-normed per head, scaled by
        1/sqrt(head_dim), rotated by the 3D RoPE."""
        return apply_rope_3d(self.norm_q(self.to_q(x).unflatten(-1, (-1, self.head_dim))) * self.head_dim**-0.5)

    def key(self, x: Tensor) -> Tensor:
        """x: [B, T, H, W, C] -> k [B, T, H, W, heads, head_dim]: projected, RMS-normed per head, rotated."""
        return apply_rope_3d(self.norm_k(self.to_k(x).unflatten(-1, (-1, self.head_dim))))

    def forward(self, x: Tensor, mask: WindowMask | None = None) -> Tensor:
        """x: [B, T, H, W, C] -> [B, T, H, W, C]; `mask` from `stage_mask` (built here when None).

        Raises:
            ValueError: a grid axis smaller than its kernel (NATTEN's window must fit; `stage_mask`).
        """
        T, H, W = x.shape[1:4]
        if mask is None:
            mask = stage_mask((T, H, W), self.kernel, x.device, self.head_dim, self.heads * self.head_dim)
        arrange = mask.layout.arrange  # row-major: a view; tiled: a copy, the grid-order tensor freed at once
        q = arrange(self.query(x))
        k = arrange(self.key(x))
        v = arrange(self.to_v(x).unflatten(-1, (-1, self.head_dim)))
        out = windowed_attention(q, k, v, mask)  # [B, N, C] in the mask's token order
        del q, k, v
        return self.to_out[0](mask.layout.restore(out))


def swiglu_tiles(n: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges of `SWIGLU_TILE_TOKENS` covering `n` tokens; a last range of one token joins the
    one before it (a compiled region serves sizes >= 2 from its dynamic graph, runnerkit/compile.py
    `MIN_DYNAMIC_SIZE`)."""
    size = SWIGLU_TILE_TOKENS
    tiles = [(start, min(start + size, n)) for start in range(0, n, size)]
    if len(tiles) > 1 and tiles[-1][1] - tiles[-1][0] == 1:
        tiles[-2:] = [(tiles[-2][0], n)]
    return tiles


class SwiGLU(nn.Module):
    """`w_down(silu(w_gate(x)) * w_up(x))`, evaluated `SWIGLU_TILE_TOKENS` tokens at a time (`swiglu_tiles`);
    `tile` is a compiled region (`compile.enabled`)."""

    COMPILED_REGIONS = ("tile",)

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w_up = nn.Linear(dim, hidden_dim, bias=False)
        self.w_gate = nn.Linear(dim, hidden_dim, bias=False)
        self.w_down = nn.Linear(hidden_dim, dim, bias=False)

    def tile(self, x: Tensor) -> Tensor:
        """x: [B, n, C] -> [B, n, C]."""
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, *grid, C] -> same shape."""
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        tiles = swiglu_tiles(flat.shape[1])
        if len(tiles) == 1:
            return self.tile(flat).reshape(x.shape)
        out = torch.empty_like(flat)
        for start, stop in tiles:
            out[:, start:stop] = self.tile(flat[:, start:stop])
        return out.reshape(x.shape)


class NABlock(nn.Module):
    """Pre-norm neighborhood-attention block of the deterministic stages (ungated residuals)."""

    def __init__(self, dim: int, kernel: Kernel, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.attn = NeighborhoodAttention(dim, kernel, head_dim)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = SwiGLU(dim, swiglu_hidden_dim(dim))

    def forward(self, x: Tensor, mask: WindowMask | None = None) -> Tensor:
        """x: [B, T, H, W, C] -> same shape."""
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class DiffusionNABlock(nn.Module):
    """Stage-5 block: adds the projected context, then attention and MLP with AdaLN scale/shift
    (the shared modulation plus this block's `scale_shift_table`), residuals ungated."""

    NUM_MOD = 7
    """Modulation chunks: (scale, shift, gate) x (attention, MLP) + a context gate; only the four
    scale/shift chunks 0, 1, 3, 4 are read (the reference folded the gates into the weights)."""

    def __init__(self, dim: int, kernel: Kernel, context_channels: int, head_dim: int) -> None:
        super().__init__()
        self.context_proj = nn.Linear(context_channels, dim)
        self.scale_shift_table = nn.Parameter(torch.zeros(self.NUM_MOD, dim))
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.attn = NeighborhoodAttention(dim, kernel, head_dim)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = SwiGLU(dim, swiglu_hidden_dim(dim))

    def forward(self, x: Tensor, context: Tensor, modulation: Tensor, mask: WindowMask | None = None) -> Tensor:
        """x: [B, T, H, W, C]; context: [B, T, H, W, C_ctx]; modulation: [B, 7, C] -> [B, T, H, W, C]."""
        mod = (modulation + self.scale_shift_table)[:, :, None, None, None, :]  # [B, 7, 1, 1, 1, C]
        scale_msa, shift_msa, scale_mlp, shift_mlp = mod[:, 0], mod[:, 1], mod[:, 3], mod[:, 4]
        x = x + self.context_proj(context)
        x = x + self.attn(self.norm1(x) * (1 + scale_msa) + shift_msa, mask)
        return x + self.mlp(self.norm2(x) * (1 + scale_mlp) + shift_mlp)


class PixelShuffleUpsampler(nn.Module):
    """Linear to `prod(stride) * C_out` channels, then a channels-last pixel shuffle by `stride`
    (T, H, W). A temporal stride of 2 makes a duplicate first frame, dropped by default (causal
    1 -> 1 + 2(T-1) frame mapping)."""

    def __init__(self, in_channels: int, stride: Kernel, reduction: int) -> None:
        super().__init__()
        self.stride = tuple(stride)
        self.out_channels = in_channels // reduction
        self.proj = nn.Linear(in_channels, math.prod(self.stride) * self.out_channels)

    def forward(self, x: Tensor, drop_leading_frame: bool = True) -> Tensor:
        """x: [B, T, H, W, C] -> [B, T*st (-1), H*sh, W*sw, C_out]."""
        B, T, H, W, _ = x.shape
        st, sh, sw = self.stride
        x = self.proj(x).view(B, T, H, W, self.out_channels, st, sh, sw)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4)  # [B, T, st, H, sh, W, sw, C_out]
        x = x.reshape(B, T * st, H * sh, W * sw, self.out_channels)
        return x[:, 1:] if st == 2 and drop_leading_frame else x
