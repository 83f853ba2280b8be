"""The joint video+audio latents of one LTX-2 denoise stage, as one flat scheduler tensor.

A scheduler holds one tensor per stage (runnerkit/schedulers/base.py); LTX-2 denoises two: the
video latents [1, C, F, H, W] and the audio latents [1, Ca, La, Ma]. A stage holds both as
`[1, N]`, the video part first, each part flattened in the shape its noise is drawn in
(`Scheduler.prepare(noise_shapes=...)`), so that one seed draws exactly the noise diffusers 0.42.1
draws, in the same order:

- stage 1 (`LTX2Pipeline.prepare_latents` / `prepare_audio_latents` without latents): video noise
  [1, C, F, H, W], then audio noise [1, Ca, La, Ma] (both packed afterwards): `packed=False`.
- stage 2 of text-to-video (`prepare_latents` with 5-D latents: normalise, pack, then noise):
  video noise [1, F*H*W, C] and audio noise [1, La, Ca*Ma], both packed: `packed_video=True`.
- stage 2 of image-to-video (`LTX2ImageToVideoPipeline.prepare_latents` noises the 5-D latents
  before packing): video [1, C, F, H, W], audio packed [1, La, Ca*Ma].

Elementwise scheduler math (Euler, the re-noise `(1 - s) x + s noise`) does not care about the
order inside a part, as long as noise and latents share it; `split` and `join` convert between
this flat layout and the canonical video [1, C, F, H, W] / audio [1, Ca, La, Ma] tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from runnerkit.models.ltx2.transformer import pack_audio_latents, pack_video_latents, unpack_audio_latents, \
    unpack_video_latents

__all__ = ["JointLayout"]


@dataclass(frozen=True)
class JointLayout:
    """Where the video and audio parts of a flat `[1, N]` stage tensor are, and in which order.

    Attributes:
        video: (C, F, H, W) video latent channels and grid (patch size 1, as both releases).
        audio: (Ca, La, Ma) audio latent channels, frames and latent mel bins.
        packed_video: the video part is stored as tokens [F*H*W, C] (else [C, F, H, W]).
        packed_audio: the audio part is stored as tokens [La, Ca*Ma] (else [Ca, La, Ma]).
    """

    video: tuple[int, int, int, int]
    audio: tuple[int, int, int]
    packed_video: bool = False
    packed_audio: bool = False

    @property
    def video_numel(self) -> int:
        return math.prod(self.video)

    @property
    def shape(self) -> tuple[int, int]:
        """The flat stage tensor: (1, video elements + audio elements)."""
        return (1, self.video_numel + math.prod(self.audio))

    def noise_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The two noise draws, in the reference's order and shapes (module docstring)."""
        C, F_, H, W = self.video
        Ca, La, Ma = self.audio
        video = (1, F_ * H * W, C) if self.packed_video else (1, C, F_, H, W)
        audio = (1, La, Ca * Ma) if self.packed_audio else (1, Ca, La, Ma)
        return (video, audio)

    def split(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """`[1, N]` -> (video [1, C, F, H, W], audio [1, Ca, La, Ma]), views where the order allows."""
        if tuple(flat.shape) != self.shape:
            raise ValueError(f"joint latents must be {self.shape}, got {tuple(flat.shape)}")
        video_shape, audio_shape = self.noise_shapes()
        video = flat[:, : self.video_numel].reshape(video_shape)
        audio = flat[:, self.video_numel:].reshape(audio_shape)
        C, F_, H, W = self.video
        if self.packed_video:
            video = unpack_video_latents(video, F_, H, W)
        if self.packed_audio:
            audio = unpack_audio_latents(audio, self.audio[2])
        return video, audio

    def join(self, video: Tensor, audio: Tensor) -> Tensor:
        """(video [1, C, F, H, W], audio [1, Ca, La, Ma]) -> `[1, N]` in this layout (float32 kept as given)."""
        if tuple(video.shape) != (1, *self.video) or tuple(audio.shape) != (1, *self.audio):
            raise ValueError(f"video {tuple(video.shape)} / audio {tuple(audio.shape)} do not fit the layout "
                             f"video (1, {self.video}) / audio (1, {self.audio})")
        if self.packed_video:
            video = pack_video_latents(video)
        if self.packed_audio:
            audio = pack_audio_latents(audio)
        return torch.cat([video.reshape(1, -1), audio.reshape(1, -1)], dim=1)
