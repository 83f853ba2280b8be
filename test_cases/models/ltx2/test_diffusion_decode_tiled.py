"""LTX-2.5 diffusion decoder, tiled (diffusion_decode_tiled.py): parity with diffusers'
`LTX2VideoDiffusionDecoderModel.enable_tiling` decode at tile sizes small enough that the tiles
overlap in frames, rows and columns (a merged temporal and column remnant included), for one x0 step
(per-tile noise) and more steps (one shared canvas); the reference's tile intervals; the untiled
decode unchanged when the latents fit one tile.

Tolerance: float32, tiny widths, 1e-5 absolute."""

from __future__ import annotations

import warnings

import pytest
import torch

from runnerkit.models.ltx2.diffusion_decode import decode_video
from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling, decode_grids, tile_intervals, tile_plan
from runnerkit.models.ltx2.diffusion_decoder import (
    LTX25_DIFFUSION_DECODER,
    TINY_LTX25_DIFFUSION_DECODER,
    LTX2DiffusionDecoderArch,
    build_ltx2_diffusion_decoder,
)
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import randn, report
from test_cases.models.ltx2.test_diffusion_decoder import reference_decoder

diffusers = require_reference("diffusers")
from diffusers.models.autoencoders.ltx2_diffusion_decoder import _tile_intervals

TOL = 1e-5
# tiny arch: a feature cell is 2 frames x 8 x 8 px; latents (4, 3, 4) -> features 13 x 6 x 8 cells
# -> tiles of 6 / 4 / 4 cells every 4 / 3 / 3: frames (0,6) (4,10) (8,13), rows (0,4) (3,6),
# columns (0,4) (3,8) (the remnants 1 frame and 2 columns merged)
SMALL = DecoderTiling(tile_height=32, tile_width=32, tile_frames=12, stride_height=24, stride_width=24,
                      stride_frames=8)
LATENTS = (1, 8, 4, 3, 4)


def _pair(steps: int, output: str):
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    arch = LTX2DiffusionDecoderArch(**{**TINY_LTX25_DIFFUSION_DECODER.model_dump(),
                                       "decoder_num_inference_steps": steps, "decoder_model_output_type": output})
    reference = reference_decoder(arch)
    return build_ltx2_diffusion_decoder(arch, dict(reference.state_dict())), reference


@pytest.mark.parametrize("steps, output", [(1, "x0"), (2, "x0"), (2, "v")])
def test_tiled_parity(steps: int, output: str) -> None:
    ours, reference = _pair(steps, output)
    reference.enable_tiling(**{f"tile_sample_{'min_' if k.startswith('tile') else 'stride_'}"
                               f"{'num_frames' if k.endswith('frames') else k.split('_')[1]}": v
                               for k, v in vars(SMALL).items()})
    plan = tile_plan(ours.arch, LATENTS[2:], SMALL)
    assert plan.tiles == ([(0, 6), (4, 10), (8, 13)], [(0, 4), (3, 6)], [(0, 4), (3, 8)])
    z = randn(*LATENTS, seed=3)
    gen_ref, gen_ours = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    with torch.no_grad():
        expected = reference.decode(z, generator=gen_ref).sample.clamp(-1, 1)
    got = decode_video(ours, z, generator=gen_ours, normalized=False, tiling=SMALL)
    untiled = decode_video(ours, z, generator=11, normalized=False)
    assert got.shape == untiled.shape == (1, 3, 25, 48, 64) and got.dtype == torch.float32
    assert report(f"tiled decode {steps} steps {output}", got, expected) <= TOL
    assert (got - untiled).abs().max() > 1e-2  # the tiles really differ from the whole decode
    # the generator drew what the reference drew (per tile: 12 tiles; or one canvas)
    assert torch.equal(torch.randn(4, generator=gen_ours), torch.randn(4, generator=gen_ref))


def test_untiled_when_one_tile() -> None:
    """Latents within one tile decode whole, bit for bit (the default tiles at a tiny latent too)."""
    ours, _ = _pair(1, "x0")
    z = randn(*LATENTS, seed=4)
    whole = decode_video(ours, z, generator=5, normalized=False)
    big = DecoderTiling(tile_height=48, tile_width=64, tile_frames=32, stride_height=48, stride_width=64,
                        stride_frames=32)
    assert not big.applies(ours.arch, LATENTS[2:]) and SMALL.applies(ours.arch, LATENTS[2:])
    assert torch.equal(decode_video(ours, z, generator=5, normalized=False, tiling=big), whole)
    assert torch.equal(decode_video(ours, z, generator=5, normalized=False, tiling=DecoderTiling()), whole)


@pytest.mark.parametrize("length, tile, stride, min_size", [(13, 6, 4, 3), (8, 4, 3, 3), (6, 4, 3, 2), (5, 6, 4, 3),
                                                            (237, 40, 28, 6), (64, 96, 88, 5), (41, 40, 28, 6),
                                                            (30, 10, 10, 11)])
def test_tile_intervals(length: int, tile: int, stride: int, min_size: int) -> None:
    assert tile_intervals(length, tile, stride, min_size) == _tile_intervals(length, tile, stride, min_size)


def test_release_plan_and_errors() -> None:
    """512x768x473 (latents 60 x 16 x 24) with the default tiles: one spatial tile, nine temporal ones,
    the last a 13-frame remnant; blends 24 frames and 64 px."""
    plan = tile_plan(LTX25_DIFFUSION_DECODER, (60, 16, 24), DecoderTiling())
    assert (plan.frames, plan.height, plan.width, plan.ghost, plan.scale) == (237, 64, 96, 8, (2, 8, 8))
    assert plan.tiles[0] == [(s, min(s + 40, 237)) for s in range(0, 224, 28)] + [(224, 237)]
    assert plan.tiles[1:] == ([(0, 64)], [(0, 96)]) and plan.blends == (24, 64, 64)
    with pytest.raises(ValueError, match=r"`stride_frames` must be in \[1, tile_frames=80\], got 96"):
        DecoderTiling(stride_frames=96)


def _tokens(grid: tuple[int, int, int]) -> int:
    return grid[0] * grid[1] * grid[2]


def test_warmup_covers_every_tile_at_the_configs_size() -> None:
    """With tiling on, the 22B-2.5 warmup (256x384x25: decoded whole; 512x768x473: nine tiles of three shapes;
    at each size also `warm_whole_decode`'s 10 latent frames, the largest whole decode, whose 45-frame stage-4
    grid tops every tile's) spans the stage-4 and stage-5 token counts of every tile of every frame count a
    prediction can give at 512x768 (each between two warmed counts; the compiled FlexAttention's only varying
    size is the token count). At 256x384 seven counts (129, 185, ... 465 frames) end in an 18-frame tile below
    the smallest warmed counts (a size the dynamic kernel has not run)."""
    from runnerkit.models.ltx2.runner25 import LTX25Runner

    arch, tiling = LTX25_DIFFUSION_DECODER, DecoderTiling()

    def latent(h: int, w: int, frames: int) -> tuple[int, int, int]:
        return ((frames - 1) // 8 + 1, h // 32, w // 32)

    warmed = [g for h, w, f in LTX25Runner.WARMUP_SHAPES["22B-2.5"]
              for g in decode_grids(arch, latent(h, w, f), tiling) + decode_grids(arch, latent(h, w, 73), tiling)]
    assert [g5 for _, g5 in warmed] == [(25, 64, 96), (73, 64, 96), (26, 128, 192), (79, 128, 192), (80, 128, 192),
                                        (73, 128, 192)]
    assert max(g4 for g4, _ in warmed) == (45, 64, 96)
    lows = [min(_tokens(g[i]) for g in warmed) for i in (0, 1)]
    highs = [max(_tokens(g[i]) for g in warmed) for i in (0, 1)]
    outside: dict[tuple[int, int], list[int]] = {}
    for h, w in ((512, 768), (256, 384)):
        for frames in range(25, 474, 8):
            for grids in decode_grids(arch, latent(h, w, frames), tiling):
                if any(not lows[i] <= _tokens(grids[i]) <= highs[i] for i in (0, 1)):
                    outside.setdefault((h, w), []).append(frames)
    assert outside == {(256, 384): list(range(129, 474, 56))}
    assert decode_grids(arch, latent(256, 384, 129), tiling)[0] == ((17, 32, 48), (18, 64, 96))
