"""The diffusion decoder's window attention split into slabs of query frames, so that no attention call spans more
than `INDEX_LIMIT` elements (diffusion_decoder_layers.py `attention_slabs`, `stage_mask`, `neighborhood_attention`):
the slabs' bounds, and the result equal to the whole grid's, for one call and for a whole decode."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.ltx2 import diffusion_decoder_layers as layers
from runnerkit.models.ltx2.diffusion_decode import decode_video
from runnerkit.models.ltx2.diffusion_decoder import TINY_LTX25_DIFFUSION_DECODER, LTX2DiffusionDecoder
from runnerkit.models.ltx2.window_layout import TILE, Layout, attention_slabs

CPU = torch.device("cpu")


LAYOUTS = [(Layout((473, 128, 192), TILE), 11, 256, 2**31 - 1), (Layout((473, 128, 192)), 11, 256, 2**31 - 1),
           (Layout((25, 10, 10)), 11, 10, 20_000), (Layout((7, 1, 1)), 3, 10, 30), (Layout((40, 1, 1)), 1, 7, 70),
           (Layout((5, 1, 1)), 5, 3, 10**9), (Layout((25, 9, 13), TILE), 5, 4, 20_000)]


@pytest.mark.parametrize(("layout", "kt", "channels", "limit"), LAYOUTS, ids=[str(i) for i in range(len(LAYOUTS))])
def test_slabs_cover_every_unit_once_and_their_keys_stay_under_the_limit(layout: Layout, kt: int, channels: int,
                                                                         limit: int) -> None:
    slabs = attention_slabs(layout, kt, channels, limit)
    unit = layout.unit_tokens * channels
    assert slabs[0][0] == 0 and slabs[-1][1] == layout.units
    assert all(a[1] == b[0] for a, b in zip(slabs, slabs[1:])) and all(u0 < u1 for u0, u1 in slabs)
    for u0, u1 in slabs:
        j0, j1 = layout.key_units(kt, u0, u1)
        assert (j1 - j0) * unit <= limit
    sizes = [u1 - u0 for u0, u1 in slabs]
    assert max(sizes) - min(sizes) <= 1
    # the fewest even slabs: the even split into one slab fewer does not fit
    if len(slabs) > 1:
        n = len(slabs) - 1
        fewer = [(round(i * layout.units / n), round((i + 1) * layout.units / n)) for i in range(n)]
        assert max((lambda j: j[1] - j[0])(layout.key_units(kt, *f)) for f in fewer) * unit > limit


def test_the_release_stage5_grid_at_473_frames_takes_two_slabs() -> None:
    """512x768 pixels: 128x192 tokens of 256 channels a frame; 473 frames span 2.98e9 elements, so two slabs:
    of frames (row-major) or of frames of 2x8x8 tiles (237 units of 2 frames, the last padded)."""
    assert attention_slabs(Layout((473, 128, 192)), 11, 256, 2**31 - 1) == [(0, 236), (236, 473)]
    assert attention_slabs(Layout((473, 128, 192), TILE), 11, 256, 2**31 - 1) == [(0, 118), (118, 237)]
    assert attention_slabs(Layout((121, 128, 192), TILE), 11, 256, 2**31 - 1) == [(0, 61)]


def test_a_frame_too_large_for_any_slab_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the decoder's window attention on a 20x1x1 token grid of 100 channels "
                                         r"cannot be split under 1000 elements a call: the keys of a single query "
                                         r"frame's window hold 1100 \(11 frames\); decode with tiling "
                                         r"\(`offload.vae_tiling`\) or at a smaller size"):
        attention_slabs(Layout((20, 1, 1)), 11, 100, 1000)


FRAME = 4 * 5 * 16
"""Elements of one frame of q below: a 4x5 grid of 2 heads of 8."""


def _qkv(B: int, grid: tuple[int, int, int], heads: int, d: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(B, *grid, heads, d, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize(("B", "limit", "slabs", "per_item"),
                         [(1, 5 * FRAME, 4, True), (2, 24 * FRAME, 1, False), (2, 12 * FRAME, 1, True),
                          (3, 6 * FRAME, 3, True)],
                         ids=["slabs", "whole-batch", "per-video", "per-video-slabs"])
def test_sliced_attention_equals_the_whole_grids(monkeypatch: pytest.MonkeyPatch, B: int, limit: int, slabs: int,
                                                 per_item: bool) -> None:
    """Every query keeps its window's keys, so slabs of frames (and one video a call, where the batch spans more
    than the limit) give the whole grid's attention, up to the summation order of the softmax; the slabs of
    12 frames with a 3-frame window: 5 frames of keys a call make 4 slabs of 3, 6 frames make 3 of 4."""
    grid, kernel, heads, d = (12, 4, 5), (3, 3, 3), 2, 8
    q, k, v = _qkv(B, grid, heads, d)
    whole = layers.stage_mask(grid, kernel, CPU, d, heads * d, limit=10**12)
    assert len(whole.slabs) == 1
    want = layers.neighborhood_attention(q, k, v, kernel, whole)
    sliced = layers.stage_mask(grid, kernel, CPU, d, heads * d, limit=limit)
    assert len(sliced.slabs) == slabs
    calls = []
    attend = layers.attend
    monkeypatch.setattr(layers, "attend", lambda q, k, v, m: calls.append((q.shape, k.numel())) or attend(q, k, v, m))
    got = layers.neighborhood_attention(q, k, v, kernel, sliced)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert len(calls) == slabs * (B if per_item else 1)
    assert all(q_shape[0] == (1 if per_item else B) and k_numel <= limit for q_shape, k_numel in calls)


def test_a_whole_decode_with_slabbed_attention_equals_the_unsliced_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny decoder end to end (context stages and stage 5) with `INDEX_LIMIT` small enough to slice every
    stage's attention: the pixels of the unsliced decode."""
    torch.manual_seed(0)
    model = LTX2DiffusionDecoder(TINY_LTX25_DIFFUSION_DECODER).double().eval()
    latents = torch.randn(1, 8, 3, 1, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = decode_video(model, latents, generator=3)
    made = []
    stage_mask = layers.stage_mask

    def counting(*args: object, **kwargs: object) -> layers.WindowMask:
        made.append(mask := stage_mask(*args, **kwargs))
        return mask

    import runnerkit.models.ltx2.diffusion_decoder as dd
    monkeypatch.setattr(dd, "stage_mask", counting)
    monkeypatch.setattr(layers, "INDEX_LIMIT", 3000)
    got = decode_video(model, latents, generator=3)
    assert any(len(m.slabs) > 1 for m in made), [len(m.slabs) for m in made]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
