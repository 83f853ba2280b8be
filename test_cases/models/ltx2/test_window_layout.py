"""The tiled token order of the diffusion decoder's FlexAttention (window_layout.py): arrange / restore, the
coordinates its `mask_mod` reads, and attention in that order equal to row-major attention (FlexAttention run
eagerly on the CPU, against SDPA with the dense row-major mask), for one call and a whole decode."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.diffusion_decode import decode_video
from runnerkit.models.ltx2.diffusion_decoder import TINY_LTX25_DIFFUSION_DECODER, LTX2DiffusionDecoder
from runnerkit.models.ltx2.window_layout import TILE, Layout

CPU = torch.device("cpu")
GRIDS = [(5, 9, 11), (4, 16, 16), (3, 3, 3), (1, 8, 8)]


def _positions(grid: tuple[int, int, int], B: int = 2) -> torch.Tensor:
    """[B, T, H, W, 3] holding each token's (t, h, w) + 1 (so that padding, 0, is told apart)."""
    t, h, w = torch.meshgrid(*(torch.arange(n) + 1 for n in grid), indexing="ij")
    return torch.stack([t, h, w], dim=-1)[None].expand(B, *grid, 3).contiguous()


@pytest.mark.parametrize("grid", GRIDS, ids=[str(g) for g in GRIDS])
def test_arrange_puts_each_tile_in_one_block_and_restore_inverts_it(grid: tuple[int, int, int]) -> None:
    layout = Layout(grid, TILE)
    x = _positions(grid)
    tiled = layout.arrange(x)  # [B, units * unit_tokens, 3]
    assert tiled.shape == (2, layout.units * layout.unit_tokens, 3)
    idx = torch.arange(tiled.shape[1])
    real = tiled[0].sum(-1) > 0
    want = torch.stack(layout.coords(idx, 0), dim=-1) + 1
    assert torch.equal(tiled[0][real], want[real]), "coords() names the grid position arrange() put there"
    assert int(real.sum()) == x[0].numel() // 3 and torch.all(tiled[0][~real] == 0)
    tiles = want.reshape(-1, 128, 3)
    assert torch.all(tiles.amax(1) - tiles.amin(1) < torch.tensor(TILE)), "a block is one 2x8x8 tile"
    assert torch.equal(layout.restore(tiled), x)


def test_row_major_arrange_is_a_view() -> None:
    x = _positions((3, 4, 5))
    assert Layout((3, 4, 5)).arrange(x).data_ptr() == x.data_ptr()


def _eager_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlexAttention with the tiled block tables on the CPU: the eager kernel (it materialises the scores)."""
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    monkeypatch.setattr(layers, "uses_flex", lambda device, head_dim: True)
    monkeypatch.setattr(layers, "_compiled_flex", lambda: flex_attention)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("limit", [None, 3 * 512 * 16], ids=["whole", "slabs"])
def test_tiled_flex_attention_equals_row_major_dense_attention(monkeypatch: pytest.MonkeyPatch,
                                                               limit: int | None, B: int) -> None:
    grid, kernel, heads, d = (7, 10, 12), (3, 5, 5), 2, 8
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, *grid, heads, d, generator=g, dtype=torch.float64) for _ in range(3))
    want = layers.neighborhood_attention(q, k, v, kernel, layers.stage_mask(grid, kernel, CPU, d, heads * d))
    _eager_flex(monkeypatch)
    mask = layers.stage_mask(grid, kernel, CPU, d, heads * d, limit=limit)
    # padded to 8x16x16: 4 units of 2 frames, 512 tokens x 16 channels each; 3 units of keys a call make 2 slabs
    assert mask.layout == Layout(grid, TILE) and len(mask.slabs) == (1 if limit is None else 2)
    got = layers.neighborhood_attention(q, k, v, kernel, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_whole_decode_in_tiled_order_equals_the_row_major_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny decoder end to end, every stage's attention through tiled FlexAttention (padded grids: the tiny
    grids are narrower than a tile), against the dense row-major path."""
    torch.manual_seed(0)
    model = LTX2DiffusionDecoder(TINY_LTX25_DIFFUSION_DECODER).double().eval()
    latents = torch.randn(1, 8, 3, 1, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = decode_video(model, latents, generator=3)
    _eager_flex(monkeypatch)
    layouts = []
    stage_mask = layers.stage_mask

    def recording(*args: object, **kwargs: object) -> layers.WindowMask:
        layouts.append((mask := stage_mask(*args, **kwargs)).layout)
        return mask

    import runnerkit.models.ltx2.diffusion_decoder as dd
    monkeypatch.setattr(dd, "stage_mask", recording)
    got = decode_video(model, latents, generator=3)
    assert layouts and all(layout.tile == TILE for layout in layouts)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
