"""Activation peak of the LTX-2.5 diffusion decoder (models/ltx2/estimate_diffusion_decoder.py)
against the peak measured on the CPU (`torch.profiler` allocation events replayed in time order).

The attention kernel is replaced by an output-only stand-in laid out as the query (what compiled
FlexAttention allocates) and the stage masks by row-major ones holding no mask tensor (`_no_mask`): the CPU
path's dense [N, N] mask is counted apart (`estimate25.dense_mask_bytes`), and the CUDA path has none.
Float32, where the CPU runs the same allocations as CUDA (in bfloat16 the CPU's RMSNorm upcasts to float32
internally, CUDA's fused kernel does not).
Configs: the peak in a stage-5 block (wide stage 5), in a deterministic block's untiled MLP (wide stage 1; with
the MLP tiled it peaks at the unpatchify), and at the unpatchify (narrow stage 5); the SwiGLU tiled (64 or 4 tokens:
the attention point binds) and untiled. The tiled decode's cases below have the attention point of a deterministic
block bind (wide stages 3 and 4).
"""

from __future__ import annotations

import math
import shutil
from typing import Any

import pytest
import torch

from runnerkit.models.ltx2 import diffusion_decoder as dd
from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.diffusion_decode import decode_video
from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling
from runnerkit.models.ltx2.diffusion_decoder import (
    LTX25_DIFFUSION_DECODER,
    TINY_LTX25_DIFFUSION_DECODER,
    LTX2DiffusionDecoder,
    LTX2DiffusionDecoderArch,
)
from runnerkit.models.ltx2.diffusion_decoder_layers import Slab
from runnerkit.models.ltx2.estimate_diffusion_decoder import (
    BLOCK_COPIES,
    diffusion_decode_bytes,
    tiled_diffusion_decode_bytes,
)
from runnerkit.models.ltx2.window_layout import Layout
from test_cases._memory import peak_tensor_bytes
from test_cases.models.ltx2._parity import randn

TINY = TINY_LTX25_DIFFUSION_DECODER.model_dump()
ARCHS = {
    "wide-stage5": LTX2DiffusionDecoderArch(**{**TINY, "decoder_stage_channels": (64, 64, 64, 64, 64),
                                               "decoder_upsample_channel_reductions": (1, 1, 1, 1)}),
    "wide-stage1": LTX2DiffusionDecoderArch(**{**TINY, "decoder_stage_channels": (512, 64, 64, 64, 8),
                                               "decoder_upsample_channel_reductions": (8, 1, 1, 8)}),
    "tiny": TINY_LTX25_DIFFUSION_DECODER,
    "wide-stage4": LTX2DiffusionDecoderArch(**{**TINY, "decoder_stage_channels": (256, 256, 256, 256, 8),
                                               "decoder_upsample_channel_reductions": (1, 1, 1, 32),
                                               "decoder_stage_depths": (0, 0, 0, 2, 2)}),
    "wide-stage3": LTX2DiffusionDecoderArch(**{**TINY, "decoder_stage_channels": (256, 256, 256, 32, 8),
                                               "decoder_upsample_channel_reductions": (1, 1, 8, 4)}),
}
CASES = [("wide-stage5", 64, "stage 5 block"), ("wide-stage5", None, "stage 5 block"),
         ("wide-stage1", 4, "unpatchify"), ("wide-stage1", None, "stage 4 block"),
         ("tiny", 64, "unpatchify"), ("wide-stage4", None, "stage 4 block")]


def compiled_key_bytes(tokens: int, width: int, batch: int, s: int, head_dim: int) -> int:
    """Bytes the compiled key region (`NeighborhoodAttention.key` under `compile.enabled`, half precision)
    allocates beside its input, `tokens` (B x T x H x W) of `width` channels: k's projection and output, the
    RMS norm's float32 statistics per head and the RoPE's float32 angle table [T, H, W, head_dim/2], shared
    by the batch and the heads (`_rope_3d_one_pass`)."""
    return 2 * tokens * width * s + tokens * width // head_dim * 4 + tokens // batch * head_dim // 2 * 4


def _no_mask(grid: tuple[int, int, int], kernel: tuple[int, int, int], *args: object) -> layers.WindowMask:
    """A row-major whole-grid mask holding no mask tensor: the measured walk allocates none (`attend` is an
    output-only stand-in)."""
    whole = Slab((0, grid[0]), (0, grid[0]), (0, 0), (0, 0), None)
    return layers.WindowMask(Layout(grid), kernel, (whole,), layers.INDEX_LIMIT)


@pytest.mark.parametrize("name, tile, where", CASES, ids=[f"{n}-tile{t}" for n, t, _ in CASES])
@pytest.mark.parametrize("shape", [(1, 8, 2, 1, 3), (2, 8, 3, 2, 4)], ids=["1x2x1x3", "2x3x2x4"])
def test_formula_bounds_measured_peak(monkeypatch: pytest.MonkeyPatch, name: str, tile: int | None, where: str,
                                      shape: tuple[int, ...]) -> None:
    monkeypatch.setattr(layers, "attend", lambda q, k, v, mask: torch.empty_like(q))
    monkeypatch.setattr(layers, "stage_mask", _no_mask)
    monkeypatch.setattr(dd, "stage_mask", _no_mask)
    if tile is not None:
        monkeypatch.setattr(layers, "SWIGLU_TILE_TOKENS", tile)
    arch = ARCHS[name]
    torch.manual_seed(0)
    model = LTX2DiffusionDecoder(arch).eval().requires_grad_(False)
    latents = randn(*shape, seed=0)
    with torch.inference_mode():
        measured = peak_tensor_bytes(lambda: decode_video(model, latents, generator=0))
    measured += latents.numel() * 4  # allocated before profiling; the formula counts the caller's latents
    formula, detail = diffusion_decode_bytes(arch, shape[2:], 4, batch=shape[0])
    if shape[0] == 1 or name != "wide-stage1":  # at batch 2 wide-stage1 peaks at the unpatchify
        assert where in detail
    # within 0.1% below (scratch of a few bytes the walk does not model: norms' statistics) to 0.3% above
    assert 0.999 <= formula / measured <= 1.003, f"{formula} / {measured} = {formula / measured:.5f} ({detail})"


@pytest.mark.parametrize("name, tile, where", CASES, ids=[f"{n}-tile{t}" for n, t, _ in CASES])
def test_the_tiled_token_order_stays_under_the_formula(monkeypatch: pytest.MonkeyPatch, name: str, tile: int | None,
                                                       where: str) -> None:
    """FlexAttention's tiled order (CUDA) copies q, k, v and the output into another order; made one at a time
    (diffusion_decoder_layers.py `NeighborhoodAttention.forward`), each grid-order tensor freed at once, the copies
    stay under the row-major walk's peak, which the formula models (and which the tiled walk then reaches too).
    Tiles of 1 x 1 x 3 tokens (every grid's W here is a multiple of 3): no padding; the padding of 2x8x8 tiles (a
    few percent of a frame at release sizes) is not measured here. On such tiles the reorder is a view, so each
    `arrange` and `restore` is made a copy here, as 2x8x8 tiles make it."""
    def tiled(grid: tuple[int, int, int], kernel: tuple[int, int, int], *args: object) -> layers.WindowMask:
        assert grid[2] % 3 == 0, grid
        return layers.WindowMask(Layout(grid, (1, 1, 3)), kernel, _no_mask(grid, kernel).slabs, layers.INDEX_LIMIT)

    def copying(reorder: Any) -> Any:
        return lambda layout, x: reorder(layout, x).clone(memory_format=torch.contiguous_format)

    monkeypatch.setattr(Layout, "arrange", copying(Layout.arrange))
    monkeypatch.setattr(Layout, "restore", copying(Layout.restore))
    monkeypatch.setattr(layers, "attend", lambda q, k, v, mask: torch.empty_like(q))
    monkeypatch.setattr(layers, "stage_mask", tiled)
    monkeypatch.setattr(dd, "stage_mask", tiled)
    if tile is not None:
        monkeypatch.setattr(layers, "SWIGLU_TILE_TOKENS", tile)
    torch.manual_seed(0)
    model = LTX2DiffusionDecoder(ARCHS[name]).eval().requires_grad_(False)
    latents = randn(1, 8, 2, 1, 3, seed=0)
    with torch.inference_mode():
        measured = peak_tensor_bytes(lambda: decode_video(model, latents, generator=0)) + latents.numel() * 4
    formula, detail = diffusion_decode_bytes(ARCHS[name], (2, 1, 3), 4, batch=1)
    assert 0.999 <= formula / measured <= 1.003, f"{formula} / {measured} = {formula / measured:.5f} ({detail})"


def test_the_one_pass_rope_gives_the_per_axis_floats(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_rope_3d_one_pass` (what a compiled half-precision region runs) equals the eager per-axis RoPE bit for
    bit, run eagerly: the same angles, the pair rotation's products and sums in the same order. Eager keeps the
    per-axis form in every dtype (its chunked float32 temporaries are what the estimate's RoPE point models)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = randn(2, 5, 6, 7, 3, 64, seed=1).to(dtype)
        assert torch.equal(layers._rope_3d_one_pass(x, 10000.0), layers.apply_rope_3d(x)), dtype

    def refused(*args: object) -> None:
        raise AssertionError("eager ran the one-pass RoPE")

    monkeypatch.setattr(layers, "_rope_3d_one_pass", refused)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        layers.apply_rope_3d(randn(1, 2, 3, 4, 2, 64, seed=2).to(dtype))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler (g++ or c++ on PATH)")
@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("batch", [1, 2])
def test_the_compiled_key_region_allocates_what_the_formula_counts(batch: int) -> None:
    """Compiled by inductor in bfloat16, the key region allocates k's projection, the norm's statistics, the
    RoPE's angle table (once for the batch) and the output (`compiled_key_bytes`). The per-axis RoPE compiled
    keeps its three float32 rotated chunks as well (two activations more: measured 1.15 stage-5 activations
    over eager's peak on an H100), so a compiled region dispatches to the one-pass form. (Under ~1,500 tokens
    CPU inductor's allocations can exceed the formula by small buffers; 384 tokens match.)"""
    torch.manual_seed(0)
    attn = layers.NeighborhoodAttention(256, (3, 3, 3), 64).to(torch.bfloat16).eval().requires_grad_(False)
    x = randn(batch, 4, 8, 12, 256, seed=0).to(torch.bfloat16)
    key = torch.compile(attn.key, backend="inductor")
    with torch.inference_mode():
        want = attn.key(x)
        got = key(x)
        measured = peak_tensor_bytes(lambda: key(x), min_events=2)
    torch.testing.assert_close(got, want, rtol=0, atol=2**-5)  # inductor's float32 math, rounded to bfloat16
    formula = compiled_key_bytes(batch * 4 * 8 * 12, 256, batch, 2, 64)
    assert 0.999 <= formula / measured <= 1.003, f"{formula} / {measured} = {formula / measured:.5f}"


@pytest.mark.parametrize("width, head_dim", [(256, 64), (64, 64), (2048, 64), (8, 8), (96, 24)])
def test_the_compiled_key_region_stays_under_the_norm_point(width: int, head_dim: int) -> None:
    """Beside the block's tensors and q (BLOCK_COPIES - 3 activations), the compiled key region stays under
    eager's norm point (BLOCK_COPIES activations and the statistics): the estimate needs no point for it."""
    tokens, batch, s = 2 * 3 * 5 * 7, 2, 2
    a = tokens * width * s
    norm_point = BLOCK_COPIES * a + tokens * width // head_dim * 4
    assert (BLOCK_COPIES - 3) * a + compiled_key_bytes(tokens, width, batch, s, head_dim) <= norm_point


def test_release_peak() -> None:
    """LTX-2.5 at 512x768x121 (latents 16x16x24) in bfloat16: the peak is in a stage-5 block."""
    peak, detail = diffusion_decode_bytes(LTX25_DIFFUSION_DECODER, (16, 16, 24), 2)
    a5 = 121 * 128 * 192 * 256 * 2  # one stage-5 activation
    assert detail.startswith("diffusion decode peak in stage 5 block: 121 frames, stage-5 activation 1.42 GiB")
    latents = 2 * 128 * 16 * 16 * 24 * 4 + 128 * 16 * 16 * 24 * 2 + 128 * 18 * 16 * 24 * 2  # f32 x2, cast, padded
    context = 69 * 64 * 96 * 8 * 256 * 2  # stage-4 grid x (2, 2, 2) x 256 channels: the shuffle's storage
    canvas = 3 * 121 * 512 * 768 * 2
    modulation = 256 * 4 + 384 * 2 + 2 * 7 * 256 * 2
    c = 121 * 128 * 192 * 256 * 24 // 64  # k's W chunk (24 of 64 head channels)
    rope = 5 * a5 + (a5 - 2 * c) + 4 * c + 2 * (c // 2) * 4 + 4 * c  # block tensors, T/H chunks, f32 temps
    assert peak == latents + context + canvas + modulation + rope == 14_021_501_696
    with pytest.raises(ValueError, match=r"latent grid \(f \+ 2 padding frames, h, w\) = \(3, 6, 7\) is smaller"):
        diffusion_decode_bytes(LTX25_DIFFUSION_DECODER, (1, 6, 7), 2)


# tiled: tiny latents (4, 3, 4) -> 3 temporal x 2 x 2 tiles (test_diffusion_decode_tiled.py's sizes), (5, 4, 4) -> 4 x 2
# x 2 tiles, the largest in the second row; the peak in a tile's stage-5 block (wide stage 5), in stage 3 on the
# whole latent (wide stages 1-3), at a tile's unpatchify, and in the trailing tile's stage 4 (wide, two blocks; the
# ghost frames make it the largest) with one spatial tile
SMALL_TILES = DecoderTiling(tile_height=32, tile_width=32, tile_frames=12, stride_height=24, stride_width=24,
                            stride_frames=8)
FRAME_TILES = DecoderTiling(tile_height=64, tile_width=64, tile_frames=12, stride_height=64, stride_width=64,
                            stride_frames=8)
TILED_CASES = [("wide-stage5", SMALL_TILES, "stage 5 block"), ("wide-stage3", SMALL_TILES, "stage 3 block"),
               ("tiny", SMALL_TILES, "unpatchify"), ("wide-stage4", FRAME_TILES, "stage 4 block")]


@pytest.mark.parametrize("name, tiling, where", TILED_CASES, ids=[n for n, _, _ in TILED_CASES])
@pytest.mark.parametrize("shape", [(1, 8, 4, 3, 4), (2, 8, 5, 4, 4)], ids=["1x4x3x4", "2x5x4x4"])
def test_tiled_formula_bounds_measured_peak(monkeypatch: pytest.MonkeyPatch, name: str, tiling: DecoderTiling,
                                            where: str, shape: tuple[int, ...]) -> None:
    monkeypatch.setattr(layers, "attend", lambda q, k, v, mask: torch.empty_like(q))
    monkeypatch.setattr(layers, "stage_mask", _no_mask)
    monkeypatch.setattr(dd, "stage_mask", _no_mask)
    monkeypatch.setattr(layers, "SWIGLU_TILE_TOKENS", 4 if name == "wide-stage3" else 64)
    arch = ARCHS[name]
    torch.manual_seed(0)
    model = LTX2DiffusionDecoder(arch).eval().requires_grad_(False)
    latents = randn(*shape, seed=0)
    with torch.inference_mode():
        measured = peak_tensor_bytes(lambda: decode_video(model, latents, generator=0, tiling=tiling))
    measured += latents.numel() * 4
    formula, detail = tiled_diffusion_decode_bytes(arch, shape[2:], 4, tiling, batch=shape[0])
    assert detail.startswith(f"tiled diffusion decode peak in {where}")
    assert 0.999 <= formula / measured <= 1.003, f"{formula} / {measured} = {formula / measured:.5f} ({detail})"


def test_release_tiled_peak() -> None:
    """512x768x473 (latents 60x16x24) in bfloat16 with the default tiles: nine 80-frame tiles, 11.4 GiB against
    50.5 GiB whole; a latent within one tile is the untiled estimate."""
    tiled, detail = tiled_diffusion_decode_bytes(LTX25_DIFFUSION_DECODER, (60, 16, 24), 2, DecoderTiling())
    whole = diffusion_decode_bytes(LTX25_DIFFUSION_DECODER, (60, 16, 24), 2)[0]
    assert detail.startswith("tiled diffusion decode peak in stage 5 block: 9 tiles, the largest stage-5 grid "
                             "80x128x192")
    assert (round(tiled / 2**30, 2), round(whole / 2**30, 2)) == (11.36, 50.47)
    assert tiled_diffusion_decode_bytes(LTX25_DIFFUSION_DECODER, (4, 16, 24), 2, DecoderTiling()) == \
        diffusion_decode_bytes(LTX25_DIFFUSION_DECODER, (4, 16, 24), 2)


def test_the_dense_window_mask_counts_only_where_flexattention_does_not_run() -> None:
    """`estimate25.dense_mask_bytes`: the path without FlexAttention (the CPU; heads under 16 on CUDA) holds an
    [N, N] boolean mask at the largest stage grid (stage 5's here); FlexAttention's block tables are not counted."""
    from runnerkit.models.ltx2.diffusion_decode_tiled import decode_grids
    from runnerkit.models.ltx2.estimate25 import dense_mask_bytes

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    latents = (4, 16, 24)  # 25 frames at 512x768
    stage5 = decode_grids(LTX25_DIFFUSION_DECODER, latents, None)[0][1]
    assert stage5 == (25, 128, 192)
    assert dense_mask_bytes(LTX25_DIFFUSION_DECODER, latents, cpu, None) == (25 * 128 * 192) ** 2
    assert dense_mask_bytes(LTX25_DIFFUSION_DECODER, latents, cuda, None) == 0
    tiny = ARCHS["tiny"]  # heads of 8: the dense mask on CUDA too
    n = max(math.prod(g) for pair in decode_grids(tiny, (2, 1, 3), None) for g in pair)
    assert dense_mask_bytes(tiny, (2, 1, 3), cuda, None) == n * n > 0
