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

import torch
from torch import Tensor

from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling, decode_tiled
from runnerkit.models.ltx2.diffusion_decoder import LTX2DiffusionDecoder, LTX2DiffusionDecoder3d
from runnerkit.models.ltx2.vae import denormalize_latents


def decode_timesteps(num_inference_steps: int) -> Tensor:
    """The decoder's noise levels t_0..t_{n-1} = linspace(1, 1/n, n), [n] float32 (t_n = 0 implied).

    Raises:
        ValueError: `num_inference_steps` < 1.
    """
    if num_inference_steps < 1:
        raise ValueError(f"`num_inference_steps` must be >= 1, got {num_inference_steps}.")
    return torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps, dtype=torch.float32)


@torch.no_grad()
def denoise_pixels(decoder: LTX2DiffusionDecoder3d, context: Tensor, x_t: Tensor, num_inference_steps: int) -> Tensor:
    """Stage-5 loop from the noise `x_t` [B, 3, T, H, W] (decoder dtype) given `context`
    [B, T, H/p, W/p, C_5]; returns the pixels [B, 3, T, H, W] in the decoder dtype, unclamped."""
    B = x_t.shape[0]
    timesteps = decode_timesteps(num_inference_steps).to(x_t.device)
    x0_output = decoder.arch.decoder_model_output_type == "x0"
    if num_inference_steps == 1 and x0_output:
        return decoder.predict(context, x_t, timesteps[:1].expand(B))
    for i in range(num_inference_steps):
        t = timesteps[i].expand(B)
        t_next = timesteps[i + 1] if i + 1 < num_inference_steps else torch.zeros_like(t)
        out = decoder.predict(context, x_t, t).float()
        x = x_t.float()
        if x0_output:
            out = (x - out) / t.view(B, 1, 1, 1, 1)  # velocity from the x0 prediction
        x_t = (x - (t - t_next).view(-1, 1, 1, 1, 1) * out).to(x_t.dtype)
    return x_t


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
    context = model.decoder.context(latents)  # [B, T, H/p, W/p, C_5]
    B, T, Hc, Wc, _ = context.shape
    p = model.arch.patch_size
    shape = (B, model.arch.out_channels, T, Hc * p, Wc * p)
    x_t = torch.randn(shape, generator=generator, dtype=dtype).to(latents.device)
    video = denoise_pixels(model.decoder, context, x_t, steps)
    return video.float().clamp(-1.0, 1.0)
