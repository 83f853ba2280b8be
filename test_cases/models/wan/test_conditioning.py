"""Wan2.1 i2v / flf2v conditioning: mask and pixel clip against diffusers' `prepare_latents`."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from runnerkit.models.wan.conditioning import conditioning_mask, conditioning_video
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")


class _RecordingVAE(torch.nn.Module):
    """Stands in for diffusers' VAE: records the clip it is asked to encode, returns zero latents."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the module a device and a dtype
        self.config = SimpleNamespace(latents_mean=[0.0] * 16, latents_std=[1.0] * 16, z_dim=16)
        self.seen: list[torch.Tensor] = []

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def encode(self, video: torch.Tensor) -> SimpleNamespace:
        self.seen.append(video)
        B, _, F, H, W = video.shape
        return SimpleNamespace(latents=torch.zeros(B, 16, (F - 1) // 4 + 1, H // 8, W // 8))


def _diffusers_condition(frames: int, first: torch.Tensor,
                         last: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [4, F_lat, h, w], clip sent to the VAE [3, F, H, W]) from `WanImageToVideoPipeline.prepare_latents`."""
    vae = _RecordingVAE()
    pipe = SimpleNamespace(vae=vae, vae_scale_factor_temporal=4, vae_scale_factor_spatial=8,
                           config=SimpleNamespace(expand_timesteps=False))
    _, condition = diffusers.WanImageToVideoPipeline.prepare_latents(
        pipe, first[None], 1, 16, first.shape[1], first.shape[2], frames, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(0), None, None if last is None else last[None])
    return condition[0, :4], vae.seen[0][0]


@pytest.mark.parametrize("frames", [5, 17, 81])
@pytest.mark.parametrize("flf2v", [False, True], ids=["i2v", "flf2v"])
def test_matches_diffusers_prepare_latents(frames: int, flf2v: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    first = torch.rand(3, 32, 48, generator=gen) * 2 - 1
    last = torch.rand(3, 32, 48, generator=gen) * 2 - 1 if flf2v else None
    mask, video = _diffusers_condition(frames, first, last)
    ours = conditioning_mask(frames, 4, 6, last_frame=flf2v)
    assert ours.shape == ((4, (frames - 1) // 4 + 1, 4, 6)) and ours.dtype == torch.float32
    assert torch.equal(ours, mask)
    assert torch.equal(conditioning_video(first, frames, last), video)


def test_golden_mask() -> None:
    i2v = conditioning_mask(9, 1, 1, last_frame=False)[..., 0, 0]  # [4, 3]
    assert i2v.tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]
    flf2v = conditioning_mask(9, 1, 1, last_frame=True)[..., 0, 0]
    assert flf2v.tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 1]]


def test_errors() -> None:
    with pytest.raises(ValueError, match=re.escape("`num_frames`=8 must be 4n + 1")):
        conditioning_mask(8, 2, 2, last_frame=False)
    with pytest.raises(ValueError, match=re.escape("`num_frames`=1 must be 4n + 1 with n >= 1")):
        conditioning_mask(1, 2, 2, last_frame=True)
    with pytest.raises(ValueError, match=re.escape("`last` must have the shape of `first` (3, 4, 4)")):
        conditioning_video(torch.zeros(3, 4, 4), 5, torch.zeros(3, 4, 6))
    with pytest.raises(ValueError, match=re.escape("`first` must be [3, H, W]")):
        conditioning_video(torch.zeros(1, 3, 4, 4), 5)
