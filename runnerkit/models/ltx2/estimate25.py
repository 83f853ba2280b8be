"""Memory estimate of one LTX-2.5 request: LTX-2's (estimate.py) with what LTX-2.5 changes.

`ltx25_estimate` takes `estimate.ltx2_estimate` of the LTX-2 part (the connectors, both denoise
stages, the upsampler, the audio decoder and save are LTX-2's) and changes:

- `text_encoder`: Gemma-4's weights, counted on a meta-built `Gemma4UnifiedTextModel` of its config; when
  `offload.stream_modules` lists it (mode block/phase), its layer streaming planned as `stream_module` plans
  it (`text_encoder_gemma4_stream.GEMMA4_STREAM_SPEC`): the resident part (embedding, final norm; in
  "phase" also the layer norms and scalars) + the slots, as Gemma-3's; its activations with estimate.py's
  Gemma formula at Gemma-4's width, depth and MLP width (the stacked hidden states dominate it);
- `duration_head` (new, after the connectors): its weights; activations the two contexts projected
  to the pooler width and its attention (a few MiB at 1024 tokens) beside the contexts;
- `diffusion_decoder` replaces `vae_decoder`: its weights (the latent statistics as float32 buffers)
  and `estimate_diffusion_decoder.diffusion_decode_bytes` at stage 2's latent grid (with
  `offload.vae_tiling`: `tiled_diffusion_decode_bytes` of the default tiles), plus what LTX-2's
  VAE-decoder stage keeps beside its decode (the contexts, the final latents);
- `vae`: loaded for i2av's encoder only (t2av drops it).

With `conv_decoder` (`video_decoder` "conv") LTX-2's VAE decoder stage and the `vae` weights stay, and the diffusion
decoder is not counted (nor `TILING_HINT` offered).

The refusal hints (list the text encoder, the connectors, or both in `offload.stream_modules`) name
Gemma-4 and its size; without `offload.vae_tiling`, `TILING_HINT` offers the tiled diffusion decode.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace

import torch
from torch import nn

from runnerkit.config import OffloadConfig
from runnerkit.models.ltx2.arch25 import LTX25Arch
from runnerkit.models.ltx2.checkpoint25 import extra_factory
from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling, decode_grids
from runnerkit.models.ltx2.diffusion_decoder import LTX2DiffusionDecoderArch
from runnerkit.models.ltx2.diffusion_decoder_layers import uses_flex
from runnerkit.models.ltx2.duration import LTX2DurationHead
from runnerkit.models.ltx2.estimate import TEXT_TOKENS, _stream_hints, ltx2_estimate, stage_tokens
from runnerkit.models.ltx2.estimate_decoders import vae_decode_bytes
from runnerkit.models.ltx2.estimate_diffusion_decoder import diffusion_decode_bytes, tiled_diffusion_decode_bytes
from runnerkit.planning.fit import Hint, MemoryEstimate, ModuleFootprint, StageFootprint, module_footprint
from runnerkit.runners.pipeline import Shape
from runnerkit.weights import build_on_meta

__all__ = ["TILING_HINT", "duration_head_bytes", "gemma4_footprint", "ltx25_estimate"]

TILING_HINT = Hint("offload.vae_tiling=true (the diffusion decoder's last two stages run on 768 x 768 px x 80-frame "
                   "tiles: its memory then grows with the tile, not the clip)", {"vae_tiling": True})
"""The refusal's advice while `offload.vae_tiling` is off (the memory planner names it where it makes a plan fit)."""


@functools.lru_cache(maxsize=4)
def _meta_gemma4(config_json: str) -> nn.Module:
    """A meta-device `Gemma4UnifiedTextModel` of the text config `config_json` (built once per config)."""
    import transformers

    config = transformers.Gemma4UnifiedTextConfig.from_dict(json.loads(config_json))
    return build_on_meta(lambda: transformers.Gemma4UnifiedTextModel(config))


def gemma4_footprint(text_config: dict, dtype: torch.dtype, offload: OffloadConfig | None = None) -> ModuleFootprint:
    """Gemma-4's text-model weights in `dtype` (`Gemma4UnifiedTextConfig` fields `text_config`): parameters and
    buffers; in offload mode block/phase also its layer streaming (`GEMMA4_STREAM_SPEC`, used when
    `offload.stream_modules` lists "text_encoder": `stream_resident_bytes` the embedding and final norm (+ the
    layer norms and scalars in "phase"), `stream_slot_bytes` the slots of the largest unit)."""
    from runnerkit.models.ltx2.text_encoder_gemma4_stream import GEMMA4_STREAM_SPEC

    model = _meta_gemma4(json.dumps(text_config, sort_keys=True, default=str))
    return module_footprint(model, dtype, stream=GEMMA4_STREAM_SPEC, offload=offload, stream_default=False)


def duration_head_bytes(head: LTX2DurationHead, s: int) -> int:
    """Activations of the head on the two 1024-token contexts: both projections to the pooler width with their
    modality sum, the concatenation, k and v (6 x 2T x P), the pooled queries (a few KiB)."""
    P = head.arch.pooler_hidden_dim
    return 6 * 2 * TEXT_TOKENS * P * s + 4 * head.arch.num_queries * P * s


@functools.lru_cache(maxsize=8)
def _meta_extra(component: str, arch: LTX25Arch) -> nn.Module:
    return extra_factory(component, arch)


def dense_mask_bytes(decoder: LTX2DiffusionDecoderArch, latent_fhw: tuple[int, int, int], device: torch.device,
                     tiling: DecoderTiling | None) -> int:
    """The decoder's dense boolean window mask where FlexAttention does not run (`uses_flex`: the CPU, heads under
    16): [N, N] at the largest stage grid a decode (or a tile) runs, alive through that stage (its slabs' masks
    together are no larger); 0 where FlexAttention runs."""
    if uses_flex(device, decoder.decoder_head_dim):
        return 0
    n = max(math.prod(grid) for pair in decode_grids(decoder, latent_fhw, tiling) for grid in pair)
    return n * n


def ltx25_estimate(arch: LTX25Arch, text_config: dict, shape: Shape, fps: int, task: str, dtype: torch.dtype,
                   device: torch.device, offload: OffloadConfig, fp8_stored: frozenset[str] = frozenset(),
                   lora_rank: int = 0, conv_decoder: bool = False) -> MemoryEstimate:
    """The memory estimate of one LTX-2.5 request of `shape` (height, width, frames) at `fps` on `device`
    (module docstring); `text_config`: the Gemma-4 text config's fields (config.json's `text_config`);
    `conv_decoder`: the video VAE's convolutional decoder decodes, not the diffusion decoder."""
    gemma = {"hidden_size": text_config["hidden_size"], "intermediate_size": text_config["intermediate_size"],
             "num_hidden_layers": text_config["num_hidden_layers"], "vocab_size": text_config["vocab_size"],
             "num_attention_heads": text_config["num_attention_heads"],
             "num_key_value_heads": text_config["num_key_value_heads"], "head_dim": text_config["head_dim"]}
    base = ltx2_estimate(arch.base(), gemma, shape, fps, task, dtype, device, offload, fp8_stored, lora_rank)
    s = torch.empty((), dtype=dtype, device="meta").element_size()
    modules = dict(base.modules)
    modules["text_encoder"] = gemma4_footprint(text_config, dtype, offload)
    head = _meta_extra("duration_head", arch)
    modules["duration_head"] = module_footprint(head, dtype)
    if not conv_decoder:
        modules["diffusion_decoder"] = module_footprint(_meta_extra("diffusion_decoder", arch), dtype)
        if task != "i2av":
            del modules["vae"]
    grid2 = stage_tokens(arch, shape, fps, 2)[0]
    t = arch.transformer  # the video and audio contexts, kept through the request (as estimate.py counts them)
    context = TEXT_TOKENS * (t.caption_channels * 2 if t.use_prompt_embeddings else t.inner_dim + t.audio_inner_dim) * s
    stages: list[StageFootprint] = []
    for stage in base.stages:
        if stage.name == "text_encoder":
            stage = replace(stage, detail=stage.detail.replace("gemma-3", "gemma-4"))
        if stage.name == "vae_decoder" and not conv_decoder:  # the same tensors kept beside it; the diffusion decode instead of the VAE's
            kept = stage.activation_bytes - vae_decode_bytes(arch.vae, grid2, s, device.type)[0]
            tiling = DecoderTiling() if offload.vae_tiling else None
            decode, detail = (tiled_diffusion_decode_bytes(arch.diffusion_decoder, grid2, s, tiling)
                              if tiling else diffusion_decode_bytes(arch.diffusion_decoder, grid2, s))
            mask = dense_mask_bytes(arch.diffusion_decoder, grid2, device, tiling)
            if mask:
                detail += f"; the dense window mask of the path without FlexAttention {mask / 2**30:.2f} GiB"
            stage = StageFootprint("diffusion_decoder", "diffusion_decoder", decode + kept + mask, detail)
        stages.append(stage)
        if stage.name == "text_connectors":
            head_bytes = duration_head_bytes(head, s)  # type: ignore[arg-type]
            stages.append(StageFootprint("duration_head", "duration_head", context + head_bytes,
                                         "duration head on the two contexts"))
    hints = _stream_hints(modules, offload, modules["text_encoder"].weight_bytes, "Gemma-4")
    if not (offload.vae_tiling or conv_decoder):
        hints += (TILING_HINT,)
    return MemoryEstimate(modules=modules, stages=tuple(stages), hints=hints)
