"""LTX-2.5 duration head: parity with diffusers 0.42.1 `LTX2DurationHead` (seconds and frame counts),
the single-file layout against `torch.nn.MultiheadAttention`, and the frame-count rule's edges."""

from __future__ import annotations

import math

import pytest
import torch
from loguru import logger

from runnerkit.models.ltx2.duration import (
    TINY_DURATION_HEAD,
    LTX2DurationHead,
    LTX2DurationHeadArch,
    frames_for_duration,
    predict_frames,
    state_dict_from_single_file,
)
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import randn, report

diffusers = require_reference("diffusers")
from diffusers.pipelines.ltx2.duration_head import LTX2DurationHead as RefHead

TOL = 1e-5
"""float32, tiny sizes: both run the same ops (sdpa, tanh GELU) on the same weights."""
ARCH = TINY_DURATION_HEAD


def _pair(seed: int, out_scale: float = 0.01) -> tuple[RefHead, LTX2DurationHead]:
    """diffusers' head with seeded random weights and ours holding them; the output layer is scaled by
    `out_scale` (0.01: the predicted log-duration stays within a few units of its bias)."""
    reference = RefHead(**ARCH.model_dump()).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        reference.mlp_out.weight.mul_(out_scale)
        reference.mlp_out.bias.zero_()
    ours = LTX2DurationHead(ARCH).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


def _tokens(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (randn(batch, 6, ARCH.video_cross_attention_dim, seed=seed),
            randn(batch, 5, ARCH.audio_cross_attention_dim, seed=seed + 1))


@pytest.mark.parametrize("modalities", ["both", "video", "audio"])
def test_seconds_match_diffusers(modalities: str) -> None:
    for seed in range(3):
        reference, ours = _pair(seed, out_scale=0.1)
        video, audio = _tokens(3, seed=10 + seed)
        video = None if modalities == "audio" else video
        audio = None if modalities == "video" else audio
        with torch.no_grad():
            expected, got = reference(video, audio), ours(video, audio)
        assert got.shape == expected.shape == (3,)
        assert report(f"duration seconds ({modalities}, seed {seed})", got, expected) <= TOL * expected.abs().max()


def test_predicted_frames_match_diffusers() -> None:
    """Eight random heads and prompts, their MLP bias shifted so the predictions span the bounds."""
    seen = set()
    for seed, log_shift in enumerate([-2.0, -0.5, 0.0, 0.7, 1.3, 1.9, 2.6, 3.5]):
        reference, ours = _pair(seed)
        with torch.no_grad():
            reference.mlp_out.bias += log_shift
            ours.mlp_out.bias += log_shift
        video, audio = _tokens(1, seed=20 + seed)
        for fps, bounds in [(24.0, (1.0, 20.0)), (25.0, (2.0, 6.0)), (30.0, (0.5, 12.0))]:
            expected = reference.predict_num_frames(video, audio, frame_rate=fps, temporal_compression_ratio=8,
                                                    min_seconds=bounds[0], max_seconds=bounds[1])
            assert predict_frames(ours, video, audio, fps, 8, *bounds) == expected, (seed, fps, bounds)
            seen.add(expected)
    assert len(seen) >= 12  # clamped at both bounds and in between


# ---- the frame-count rule ----------------------------------------------------------------------

EDGES = [  # seconds, fps, r, min_s, max_s -> frames
    (5.0, 24.0, 8, 1.0, 20.0, 113),  # 120 frames snapped down to 8 * 14 + 1
    (121 / 24, 24.0, 8, 1.0, 20.0, 121),  # on the grid: kept
    (0.2, 24.0, 8, 1.0, 20.0, 25),  # clamped to 24, snapped to 17 < 24: one step up
    (100.0, 24.0, 8, 1.0, 20.0, 473),  # clamped to 480, snapped down
    (20.0, 24.0, 8, 1.0, 20.0, 473),  # the upper bound itself
    (12.25, 2.0, 1, 1.0, 20.0, 24),  # 24.5 rounds half to even: down
    (12.75, 2.0, 1, 1.0, 20.0, 26),  # 25.5 rounds half to even: up
    (1.01, 24.0, 8, 1.0, 1.02, 25),  # [24, 24] holds no 8k + 1: the nearer grid point (25, not 17)
    (0.79, 24.0, 8, 19 / 24, 23 / 24, 17),  # [19, 23] holds no 8k + 1: 17 is nearer 19 than 25 is
    (0.001, 24.0, 8, 0.01, 20.0, 1),  # min_frames floored at 1, 0 frames clamped to 1
    (0.001, 24.0, 1, 0.01, 20.0, 1),  # the same on a grid of 1
]


@pytest.mark.parametrize(("seconds", "fps", "r", "low", "high", "frames"), EDGES)
def test_frame_rule_edges(seconds: float, fps: float, r: int, low: float, high: float, frames: int) -> None:
    assert frames_for_duration(seconds, fps, r, low, high) == frames
    reference = RefHead(**ARCH.model_dump())
    reference.forward = lambda video, audio: torch.tensor([seconds], dtype=torch.float64)
    assert reference.predict_num_frames(torch.zeros(1, 1, ARCH.video_cross_attention_dim), frame_rate=fps,
                                        temporal_compression_ratio=r, min_seconds=low, max_seconds=high) == frames


def test_windows_without_a_grid_point_warn() -> None:
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING")
    try:
        assert frames_for_duration(1.01, 24.0, 8, 1.0, 1.02) == 25
        assert frames_for_duration(5.0, 24.0, 8, 1.0, 20.0) == 113
        assert frames_for_duration(0.79, 24.0, 8, 19 / 24, 23 / 24) == 17
    finally:
        logger.remove(sink)
    assert len(messages) == 2 and "nearest, 25 frames" in messages[0] and "nearest, 17 frames" in messages[1]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"frame_rate": 0.0}, "`frame_rate` must be a positive finite number, got 0.0"),
    ({"temporal_compression_ratio": 0}, "`temporal_compression_ratio` must be >= 1, got 0"),
    ({"min_seconds": 5.0, "max_seconds": 5.0}, r"`min_seconds` \(5.0\) must be less than `max_seconds` \(5.0\)"),
    ({"seconds": math.nan}, "`seconds` must be finite, got nan"),
])
def test_frame_rule_refuses_bad_input(kwargs: dict, message: str) -> None:
    args = {"seconds": 3.0, "frame_rate": 24.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        frames_for_duration(**args)


def test_bad_head_inputs_are_refused() -> None:
    _, ours = _pair(0)
    video, audio = _tokens(2, seed=1)
    with pytest.raises(ValueError, match="needs `video_tokens`, `audio_tokens` or both"):
        ours()
    with pytest.raises(ValueError, match="`video_tokens` batch 2 != `audio_tokens` batch 1"):
        ours(video, audio[:1])
    with pytest.raises(ValueError, match="one prompt at a time; got a batch of 2"):
        predict_frames(ours, video, audio, 24.0)
    with pytest.raises(ValueError, match="`pooler_hidden_dim`=10 must be a multiple of `num_pooler_heads`=4"):
        LTX2DurationHeadArch(pooler_hidden_dim=10)


# ---- single-file layout ------------------------------------------------------------------------

def test_single_file_layout_matches_multihead_attention() -> None:
    """ltx-core's pooler is `nn.MultiheadAttention(batch_first=True)`: its weights, mapped by
    `state_dict_from_single_file`, must pool exactly as it does."""
    width, heads = ARCH.pooler_hidden_dim, ARCH.num_pooler_heads
    mha = torch.nn.MultiheadAttention(width, heads, batch_first=True).eval()
    _, ours = _pair(3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in mha.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    single_file = {f"duration_head.{k}": v for k, v in ours.state_dict().items()
                   if not k.startswith("attention_pooler.to_")}
    single_file.update({f"duration_head.attention_pooler.cross_attn.{k}": v for k, v in mha.state_dict().items()})
    single_file["vae.other"] = torch.zeros(1)
    ours.load_state_dict(state_dict_from_single_file(single_file), strict=True)
    tokens = randn(2, 7, width, seed=5)
    queries = ours.attention_pooler.query_tokens.detach().unsqueeze(0).expand(2, -1, -1)
    with torch.no_grad():
        expected, _ = mha(queries, tokens, tokens, need_weights=False)
        got = ours.attention_pooler(tokens)
    assert report("pooler vs nn.MultiheadAttention", got, expected) <= TOL
    with pytest.raises(KeyError, match="`duration_head.attention_pooler.cross_attn.in_proj_bias` is missing"):
        state_dict_from_single_file({k: v for k, v in single_file.items() if not k.endswith("in_proj_bias")})
