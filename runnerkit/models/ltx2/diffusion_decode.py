"""The LTX-2.5 diffusion decoder's own denoising loop: raw latents -> pixels in [-1, 1].

Reference: diffusers 0.42.1 `LTX2DiffusionVaeDecoderStep` (modular_pipelines/ltx2/decoders.py, the
decode block of the LTX-2.5 modular pipeline), `LTX2VideoDiffusionDecodePipeline`
(pipelines/ltx2/pipeline_ltx2_diffusion_decode.py) and `LTX2VideoDiffusionDecoder3d.forward` /
`.denoise`. What they do, in order:

1. De-normalise the transformer's latents with the latent statistics (`z * std / scaling_factor +
   mean` per channel; the VAE's statistics when a VAE is loaded, else the decoder's identical
   buffers), cast to the decoder's dtype.
2. Stages 1-4 build the context once.
3. Draw the pixel noise x_1 [B, 3, 8(F-1)+1, 32H, 32W] with `randn_tensor(shape, generator,
   dtype=decoder dtype)`: on the generator's device (a CPU generator draws on the CPU, then the
   tensor moves) and directly in the decoder's dtype. (PyTorch's CPU bfloat16 draw equals the
   float32 draw rounded when the element count is a multiple of 16, which every pixel canvas
   is: H_px is a multiple of 32; a count with a remainder differs in its tail.) The generator is the pipeline's own: in the LTX-2.5 pipeline the one that already
   drew the initial video and audio latents, so the decoder's noise is its next draw; standalone
   whatever generator the caller passes. No decode timestep, no noise added to the latents.
4. No scheduler object is used (the decode pipeline registers one, `decode` never reads it):
   t_i = linspace(1, 1/n, n) float32, then 0. n = 1 with x0 prediction (the release) returns the
   stage-5 prediction at t = 1 as it is. Otherwise, for each step, in float32:
   v = (x_t - x0) / t_i for x0 prediction (the model output itself for "v"),
   x_{t_{i+1}} = x_t - (t_i - t_{i+1}) v, cast back to the decoder dtype after each step.
5. With `tiling` (config `offload.vae_tiling`) and latents larger than a tile, steps 2-4 run per
   tile (diffusion_decode_tiled.py, diffusers' `enable_tiling` path).
6. The pipeline's `postprocess_video` maps the result to [0, 1] by `(x / 2 + 0.5).clamp(0, 1)`;
   `decode_video` returns the same pixels before that map, clamped to [-1, 1] (the project's
   tensor convention): reference pixels = (decode_video(...) + 1) / 2.
"""

from __future__ import annotations

import time

import torch
from loguru import logger
from torch import Tensor

from runnerkit.memory import synchronize

from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling, decode_tiled
from runnerkit.models.ltx2.diffusion_decoder import (
    LTX2DiffusionDecoder,
    decode_timesteps,
    denoise_pixels,
)
from runnerkit.models.ltx2.vae import denormalize_latents


@torch.no_grad()
def decode_video(model: LTX2DiffusionDecoder, latents: Tensor, generator: torch.Generator | int,
                 num_inference_steps: int | None = None, normalized: bool = True,
                 latents_mean: Tensor | None = None, latents_std: Tensor | None = None,
                 scaling_factor: float | None = None, tiling: DecoderTiling | None = None) -> Tensor:
    """Decode video latents with the diffusion decoder (the reference's decode block end to end).

    Args:
        model: the decoder, on its device and dtype.
        latents: [B, C_lat, F, H, W]; normalised (the transformer's) when `normalized`, else raw.
        generator: the request's CPU generator (its next draw is the pixel noise), or a seed for a
            fresh `torch.Generator("cpu").manual_seed(seed)` (the decode pipeline called alone).
        num_inference_steps: stage-5 steps; None takes the checkpoint's
            `decoder_num_inference_steps` (1 in the release).
        normalized: whether to de-normalise first.
        latents_mean, latents_std, scaling_factor: the statistics to de-normalise with (the
            VAE's); None takes the decoder's own buffers and config.
        tiling: tile sizes of a tiled decode (diffusion_decode_tiled.py), used when the latents are
            larger than one tile (`DecoderTiling.applies`); None decodes whole.

    Returns:
        [B, 3, 8(F-1)+1, 32H, 32W] float32 pixels in [-1, 1] (release ratios), on `latents.device`.

    Raises:
        ValueError: `num_inference_steps` < 1, a generator not on the CPU, or latents too small
            for a stage's attention window (release: F >= 3 and H, W >= 7 latent cells).
    """
    if isinstance(generator, int):
        generator = torch.Generator("cpu").manual_seed(generator)
    if generator.device.type != "cpu":
        raise ValueError(f"`generator` must be a CPU generator (noise is drawn on the CPU), got {generator.device}.")
    steps = model.arch.decoder_num_inference_steps if num_inference_steps is None else num_inference_steps
    decode_timesteps(steps)  # validates before any work
    dtype = next(model.decoder.parameters()).dtype
    if normalized:
        mean = model.latents_mean if latents_mean is None else latents_mean
        std = model.latents_std if latents_std is None else latents_std
        scale = model.arch.scaling_factor if scaling_factor is None else scaling_factor
        latents = denormalize_latents(latents, mean, std, scale)
    latents = latents.to(dtype)
    if tiling is not None and tiling.applies(model.arch, tuple(latents.shape[2:])):
        return decode_tiled(model.decoder, latents, generator, steps, tiling)
    clock = _StepClock(latents.device)
    context = model.decoder.context(latents)  # [B, T, H/p, W/p, C_5]
    B, T, Hc, Wc, _ = context.shape
    p = model.arch.patch_size
    clock.done(f"context (stages 1-4) of latents {list(latents.shape[2:])}")
    shape = (B, model.arch.out_channels, T, Hc * p, Wc * p)
    x_t = torch.randn(shape, generator=generator, dtype=dtype).to(latents.device)
    video = denoise_pixels(model.decoder, context, x_t, steps,
                           on_step=lambda i, n: clock.done(f"stage-5 step {i}/{n} at {list(shape[2:])} pixels"))
    return video.float().clamp(-1.0, 1.0)


class _StepClock:
    """Logs (INFO) the seconds of each part of a whole decode, the device synchronized at each mark: where a
    long decode spends its time (the context's stages, each pixel step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last = time.perf_counter()

    def done(self, what: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        logger.info("diffusion decoder: {} in {:.2f} s", what, now - self.last)
        self.last = now


def warm_whole_decode(model: LTX2DiffusionDecoder, latents: Tensor, tiling: DecoderTiling) -> None:
    """Warmup's extra decode with tiling on: zero latents of the warmed request's batch, width and height
    with the most frames a decode takes whole (`tiling.tile_frames // r_t` latent frames, 73 output frames
    by default). Its stage-4 grid is the largest any tile or whole decode of that size runs on (a tiled
    clip's tiles are shorter), so the warmed token counts span those of every predicted frame count at
    that size (docs/ltx2.md, "Tiled diffusion decode"). Its noise comes from a generator of its own (the
    request's draws are untouched); the result is dropped.

    Args:
        model: the decoder, on its device and dtype.
        latents: [B, C_lat, F, H, W] the warmed request's latents (only B, C_lat, H, W are read).
        tiling: the tile sizes.
    """
    B, C, _, H, W = latents.shape
    frames = tiling.tile_frames // model.arch.temporal_compression_ratio
    zeros = torch.zeros((B, C, frames, H, W), dtype=torch.float32, device=latents.device)
    decode_video(model, zeros, torch.Generator("cpu").manual_seed(0), normalized=False, tiling=tiling)
