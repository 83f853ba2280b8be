"""LTX-2.5 diffusion decoder: parity with diffusers' LTX2VideoDiffusionDecoderModel (one forward,
two shapes), its decode loop end to end through LTX2VideoDiffusionDecodePipeline (1-step x0 as
released, multi-step x0 and v), the generator hand-over, strict loading and the release size.

Tolerance: float32, tiny widths, 1e-5 absolute (measured errors ~1e-6)."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from runnerkit.models.ltx2.diffusion_decode import decode_timesteps, decode_video
from runnerkit.models.ltx2.diffusion_decoder import (
    LTX25_DIFFUSION_DECODER,
    TINY_LTX25_DIFFUSION_DECODER,
    LTX2DiffusionDecoder,
    LTX2DiffusionDecoderArch,
    build_ltx2_diffusion_decoder,
)
from runnerkit.weights import CheckpointError, build_on_meta
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import randn, report

diffusers = require_reference("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoDiffusionDecoderModel
from diffusers.pipelines.ltx2.pipeline_ltx2_diffusion_decode import LTX2VideoDiffusionDecodePipeline

TOL = 1e-5
ARCH = TINY_LTX25_DIFFUSION_DECODER
# latents [B, C, F, H, W]: one frame pair, and a batch of two with three frames (B, F, W vary)
SHAPES = [(1, 8, 2, 1, 3), (2, 8, 3, 1, 3)]
# release parameter count (diffusers' defaults built on meta; weights only, buffers not included)
RELEASE_PARAMS = 417_133_616


def reference_decoder(arch: LTX2DiffusionDecoderArch) -> LTX2VideoDiffusionDecoderModel:
    """A diffusers decoder with non-trivial random weights and latent statistics (seeded)."""
    torch.manual_seed(0)
    reference = LTX2VideoDiffusionDecoderModel(**arch.to_diffusers_config()).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
        reference.latents_mean.copy_(0.5 * torch.randn(arch.latent_channels))
        reference.latents_std.copy_(0.5 + torch.rand(arch.latent_channels))
    return reference


@pytest.fixture(scope="module")
def pair() -> tuple[LTX2DiffusionDecoder, LTX2VideoDiffusionDecoderModel]:
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    reference = reference_decoder(ARCH)
    return build_ltx2_diffusion_decoder(ARCH, dict(reference.state_dict())), reference


@pytest.mark.parametrize("shape", SHAPES, ids=["1x2x1x3", "2x3x1x3"])
def test_forward_parity(pair: tuple[LTX2DiffusionDecoder, LTX2VideoDiffusionDecoderModel],
                        shape: tuple[int, ...]) -> None:
    """Context (stages 1-4) and one stage-5 prediction at t = 0.7, against the reference."""
    ours, reference = pair
    z = randn(*shape, seed=1)
    B, _, F, H, W = shape
    with torch.no_grad():
        context_ref = reference.decoder.forward_stage_4(reference.decoder.forward_stages_1_to_3(z))
        context = ours.decoder.context(z)
        assert context.shape == (B, 8 * (F - 1) + 1, 4 * H, 4 * W, 8)
        assert report("decoder context", context, context_ref) <= TOL
        x_t = randn(*ours.pixel_shape(shape), seed=2)
        t = torch.tensor([0.7, 0.3][:B])
        expected = reference.decoder.forward_diffusion_step(context_ref, x_t, t)
        got = ours.decoder.predict(context_ref, x_t, t)
    assert got.shape == (B, 3, 8 * (F - 1) + 1, 16 * H, 16 * W)
    assert report("decoder stage-5 prediction", got, expected) <= TOL


def test_a_one_token_mlp_tail_joins_the_tile_before_and_matches(
        pair: tuple[LTX2DiffusionDecoder, LTX2VideoDiffusionDecoderModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """SwiGLU tiles of 11 tokens here and in diffusers: stage 1's 12 tokens run as one tile of 12 here (no one-token
    tile for a compiled region to specialise on), as 11 + 1 in diffusers; the other stages' 48, 84, 156 and 432
    tokens tile alike; the context and the stage-5 prediction still match the reference."""
    from diffusers.models.autoencoders import ltx2_diffusion_decoder as reference_module

    from runnerkit.models.ltx2 import diffusion_decoder_layers as layers

    monkeypatch.setattr(layers, "SWIGLU_TILE_TOKENS", 11)
    monkeypatch.setattr(reference_module, "_SWIGLU_TILE_SIZE", 11)
    assert layers.swiglu_tiles(12) == [(0, 12)] and layers.swiglu_tiles(11) == [(0, 11)]
    assert layers.swiglu_tiles(48) == [(0, 11), (11, 22), (22, 33), (33, 44), (44, 48)]
    assert layers.swiglu_tiles(23) == [(0, 11), (11, 23)]
    ours, reference = pair
    tiles: list[int] = []
    real = layers.SwiGLU.tile
    monkeypatch.setattr(layers.SwiGLU, "tile", lambda self, x: tiles.append(x.shape[1]) or real(self, x))
    z = randn(*SHAPES[0], seed=1)
    with torch.no_grad():
        context_ref = reference.decoder.forward_stage_4(reference.decoder.forward_stages_1_to_3(z))
        assert report("decoder context, 11-token tiles", ours.decoder.context(z), context_ref) <= TOL
        x_t = randn(*ours.pixel_shape(SHAPES[0]), seed=2)
        t = torch.tensor([0.7])
        expected = reference.decoder.forward_diffusion_step(context_ref, x_t, t)
        got = ours.decoder.predict(context_ref, x_t, t)
    assert report("decoder stage-5 prediction, 11-token tiles", got, expected) <= TOL
    assert tiles[:6] == [12, 11, 11, 11, 11, 4], tiles  # stage 1 whole (11 + 1 joined), stage 2's 48 in tiles
    assert 1 not in tiles


@pytest.mark.parametrize("steps, output", [(1, "x0"), (3, "x0"), (2, "v")])
def test_decode_pipeline_parity(steps: int, output: str) -> None:
    """decode_video == LTX2VideoDiffusionDecodePipeline(output_type="pt") end to end: latent
    de-normalisation with the decoder's statistics, noise from the same seeded generator, the
    loop, and the [0, 1] map; the generator is left in the same state (one draw of the noise)."""
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    arch = LTX2DiffusionDecoderArch(**{**ARCH.model_dump(), "decoder_num_inference_steps": steps,
                                       "decoder_model_output_type": output})
    reference = reference_decoder(arch)
    ours = build_ltx2_diffusion_decoder(arch, dict(reference.state_dict()))
    pipe = LTX2VideoDiffusionDecodePipeline(diffusion_decoder=reference, scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    latents = randn(1, 8, 2, 1, 3, seed=3)
    gen_ref, gen_ours = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    expected = pipe(latents, generator=gen_ref, output_type="pt").frames  # [B, F, 3, H, W] in [0, 1]
    video = decode_video(ours, latents, generator=gen_ours)  # [B, 3, F, H, W] in [-1, 1]
    assert video.shape == (1, 3, 9, 16, 48) and video.dtype == torch.float32
    assert report(f"decode {steps} steps {output}", video.permute(0, 2, 1, 3, 4) / 2 + 0.5, expected) <= TOL
    assert torch.equal(torch.randn(4, generator=gen_ours), torch.randn(4, generator=gen_ref))


def test_decode_seed_is_a_fresh_cpu_generator(pair: tuple[LTX2DiffusionDecoder, LTX2VideoDiffusionDecoderModel]) -> None:
    ours, _ = pair
    latents = randn(1, 8, 2, 1, 3, seed=4)
    by_seed = decode_video(ours, latents, generator=5, num_inference_steps=1)
    by_generator = decode_video(ours, latents, generator=torch.Generator().manual_seed(5), num_inference_steps=1)
    other = decode_video(ours, latents, generator=6, num_inference_steps=1)
    assert torch.equal(by_seed, by_generator)
    assert not torch.equal(by_seed, other)


def test_timesteps_and_errors(pair: tuple[LTX2DiffusionDecoder, LTX2VideoDiffusionDecoderModel]) -> None:
    ours, _ = pair
    assert decode_timesteps(1).tolist() == [1.0]
    assert decode_timesteps(4).tolist() == [1.0, 0.75, 0.5, 0.25]
    with pytest.raises(ValueError, match="`num_inference_steps` must be >= 1, got 0"):
        decode_video(ours, randn(1, 8, 2, 1, 3, seed=0), generator=0, num_inference_steps=0)
    with pytest.raises(ValueError, match=r"grid \(4, 1, 2\) to be at least its kernel \(3, 1, 3\)"):
        decode_video(ours, randn(1, 8, 2, 1, 2, seed=0), generator=0)
    with pytest.raises(ValueError, match="must be a CPU generator"):
        decode_video(ours, randn(1, 8, 2, 1, 3, seed=0), generator=SimpleNamespace(device=torch.device("cuda")))
    with pytest.raises(ValueError, match=r"`decoder_stage_channels\[1\]` must be .* = 16, got 8"):
        LTX2DiffusionDecoderArch(**{**ARCH.model_dump(), "decoder_stage_channels": (32, 8, 8, 8, 4)})


def test_strict_loading(pair: tuple[LTX2DiffusionDecoder, LTX2VideoDiffusionDecoderModel]) -> None:
    _, reference = pair
    state = dict(reference.state_dict())
    missing = {k: v for k, v in state.items() if k != "decoder.diff_blocks.1.scale_shift_table"}
    with pytest.raises(CheckpointError, match=r"decoder\.diff_blocks\.1\.scale_shift_table"):
        build_ltx2_diffusion_decoder(ARCH, missing)
    with pytest.raises(CheckpointError, match=r"decoder\.extra\.weight"):
        build_ltx2_diffusion_decoder(ARCH, {**state, "decoder.extra.weight": torch.zeros(2)})


def test_release_parameters() -> None:
    """The release architecture is diffusers' defaults: same tensor names and shapes on meta."""
    ours = build_on_meta(lambda: LTX2DiffusionDecoder(LTX25_DIFFUSION_DECODER))
    with torch.device("meta"):
        reference = LTX2VideoDiffusionDecoderModel()
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == RELEASE_PARAMS
    assert LTX2DiffusionDecoderArch.from_diffusers_config(
        {"_class_name": "LTX2VideoDiffusionDecoderModel", **reference.config}) == LTX25_DIFFUSION_DECODER


def test_noise_drawn_in_decoder_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16 the pixel noise is the reference's bit for bit: the generator's next draw, on
    the CPU, in bfloat16 (for a canvas a float32 draw rounded is the same: its size is a multiple
    of 16, see diffusion_decode.py)."""
    reference = reference_decoder(ARCH).to(torch.bfloat16)
    ours = build_ltx2_diffusion_decoder(ARCH, dict(reference.state_dict()))
    drawn: dict[str, torch.Tensor] = {}

    def capture(name: str):  # records x_t and skips stage 5
        return lambda *args, **_: drawn.setdefault(name, args[2] if len(args) == 4 else args[1])

    monkeypatch.setattr(reference.decoder, "denoise", capture("reference"))
    monkeypatch.setattr("runnerkit.models.ltx2.diffusion_decode.denoise_pixels", capture("ours"))
    latents = randn(1, 8, 2, 1, 3, seed=6)
    with torch.no_grad():
        reference.decode(latents.to(torch.bfloat16), generator=torch.Generator().manual_seed(7))
    decode_video(ours, latents, generator=7, normalized=False)
    assert drawn["ours"].dtype == drawn["reference"].dtype == torch.bfloat16
    assert torch.equal(drawn["ours"], drawn["reference"])


def test_the_window_attention_kernel_follows_the_device_and_head_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlexAttention (a `BlockMask`) only on CUDA with heads of at least 16 (inductor lowers no smaller head);
    elsewhere, and for the tiny configs' 8-wide heads on CUDA, SDPA with the dense window mask, whose output is
    the windowed softmax itself."""
    from runnerkit.models.ltx2 import diffusion_decoder_layers as layers

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert layers.uses_flex(cuda, 64) and layers.uses_flex(cuda, 16)
    assert not layers.uses_flex(cuda, 8) and not layers.uses_flex(cpu, 64)
    monkeypatch.setattr(layers, "_compiled_flex", lambda: pytest.fail("FlexAttention called for a dense mask"))
    grid, kernel = (2, 3, 3), (1, 3, 3)
    (slab,) = layers.stage_mask(grid, kernel, cpu, 64, 128).slabs
    mask = slab.mask
    assert isinstance(mask, torch.Tensor) and mask.shape == (18, 18)
    q, k, v = (torch.randn(1, 2, 18, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(layers.attend(q, k, v, mask), scores.softmax(-1) @ v, rtol=1e-5, atol=1e-6)


def test_a_whole_decode_logs_the_seconds_of_its_context_and_each_pixel_step() -> None:
    """Where a long decode spends its time: one INFO line for the context (stages 1-4) and one per stage-5
    step, in order, each with its seconds (the device synchronized at each mark)."""
    from loguru import logger

    ours = build_ltx2_diffusion_decoder(ARCH, dict(reference_decoder(ARCH).state_dict()))
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO", format="{message}")
    try:
        decode_video(ours, randn(1, 8, 2, 1, 3, seed=6), generator=7, normalized=False, num_inference_steps=3)
    finally:
        logger.remove(sink)
    marks = [re.sub(r" in \d+\.\d\d s$", "", line) for line in lines if line.startswith("diffusion decoder: ")]
    assert len(marks) == 4 and all(re.search(r" in \d+\.\d\d s$", line) for line in lines[-4:]), lines
    assert marks[0] == "diffusion decoder: context (stages 1-4) of latents [2, 1, 3]", marks
    assert [m.split(" at ")[0] for m in marks[1:]] == [f"diffusion decoder: stage-5 step {i}/3" for i in (1, 2, 3)]
