"""Memory and FLOPs of a Qwen-Image request from the architecture alone (no weights): the memory plan and
the request check before loading (planning/fit.py, planning/planner.py) and the plan's time model
(planning/compute.py).

Weights: every module built on the meta device (nothing allocated) and counted by `fit.module_footprint`
as the runner loads it: the transformer in the run's dtype (its float32 layers kept), Qwen2.5-VL as
`transformers.Qwen2_5_VLForConditionalGeneration` (with its language-model head) when it is loaded whole,
as `Qwen2_5_VLModel` (no head) with its decoder layers streamed when `offload.stream_modules` lists it
(`text_encoder.STREAM_SPEC`), the VAE in float32.

Activations are upper bounds, counted per token of the widths alive at once (units: bytes; s = bytes per
element of the compute dtype, 4 for float32 tables and norms). Text tokens: the 1024-token prompt limit +
the 34-token template (`TEXT_TOKENS`; + the vision tokens of the references for editing), so a longer
prompt never exceeds the estimate; image tokens L = (H/16)(W/16) (+ the references' for editing, each
bounded by the larger of the target's and `vae_image_area`'s tokens).

- text encoder, once per prompt (prompt and negative prompt one after the other, batch 1): the embedding
  and every hidden state kept ((layers + 1) T H s), a layer's largest transient (SwiGLU 3 T I s, the
  float32 RMSNorm copies 2 T H 4) and the head's float32 logits T V 4.
- transformer step (both CFG branches at once: block streaming's one pass): per token of each stream the
  residual, its modulated copy, q, k, v, their RoPE'd float32 copies, the joint attention output and the
  MLP's 4D hidden and GELU output: `STEP_WIDTHS` D-wide tensors in s + 4 float32 ones, x 2 branches; the
  float32 RoPE tables (L x head_dim), the attention kernel's workspace, the text context and
  `SCHEDULER_LATENT_COPIES` latent-sized float32 tensors.
- VAE decode: the causal 3D decoder walked layer by layer (runnerkit/nets/causal_vae3d_estimate.py
  `vae_chunk_bytes`, which
  counts a later latent frame of a video: two cached frames of every causal convolution's input, four
  output frames), taken for the one frame of an image: half its feature cache, a quarter of its largest
  transient, + the image. Measured on the H200 at 1328x1328 (bench/results/qwen_image_h200_none.json):
  53.76 GiB peak allocated - 39.43 GiB of weights = 14.33 GiB; this bound: 14.4 GiB. Editing adds the
  encode of the references (bounded by the decode of the same size).
- save: the image in float32 (CPU: 3 copies, as Wan's).

FLOPs of one step (2 per multiply-add, every CFG pass, bench/speed.py `qwen_flops`): per block and stream
the q, k, v, o projections 8 L D^2 and the 4x MLP 16 L D^2, the joint attention 4 (Li + Lt)^2 D. The
time model counts `FLOP_TEXT_TOKENS` text tokens (a typical prompt fills the first bucket).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import transformers
from torch import nn

from runnerkit.config import OffloadConfig
from runnerkit.models.qwen_image import text_encoder as te
from runnerkit.models.qwen_image.arch import QwenImageArch, QwenImageTransformerArch
from runnerkit.models.qwen_image.transformer import QwenImageTransformer2D, keep_fp32
from runnerkit.nets.causal_vae3d import CausalVAE3D
from runnerkit.nets.causal_vae3d_estimate import vae_chunk_bytes, video_bytes
from runnerkit.planning.workspaces import F32, sdpa_workspace
from runnerkit.planning.fit import MemoryEstimate, ModuleFootprint, StageFootprint, module_footprint
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.compute import StageFlops
from runnerkit.weights import build_on_meta

if TYPE_CHECKING:
    from runnerkit.config import RunnerConfig

__all__ = [
    "FLOP_TEXT_TOKENS",
    "TEXT_TOKENS",
    "footprints",
    "image_decode_bytes",
    "qwen_denoise_flops",
    "qwen_estimate",
    "qwen_step_flops",
]

TEXT_TOKENS = 1024 + 34
"""Text tokens a prompt can take: the 1024-token limit (`text_encoder.TOKENIZER_MAX_LENGTH`) + the template."""
FLOP_TEXT_TOKENS = 64
"""Text tokens the time model counts: the first text bucket (`QwenImageRunner.TEXT_BUCKETS`), a typical prompt."""
STEP_WIDTHS = 14
"""D-wide tensors in the compute dtype alive per token in a block (module docstring): residual, modulated
input, q, k, v, attention output, its projection, the MLP's 4D hidden and GELU output (8), minus one shared."""
SCHEDULER_LATENT_COPIES = 8
"""Latent-sized float32 tensors of the denoising loop (latents, noise prediction, the two CFG outputs, the
scheduler's step temporaries), as Wan's estimate counts them."""


@functools.lru_cache(maxsize=8)
def _meta(kind: str, arch: QwenImageArch) -> nn.Module:
    """A network of `arch` on the meta device, once per architecture (a 20B transformer takes ~1 s to build)."""
    if kind == "transformer":
        return build_on_meta(lambda: QwenImageTransformer2D(arch.transformer))
    if kind == "vae":
        return build_on_meta(lambda: CausalVAE3D(arch.vae))
    config = arch.text_encoder.to_hf_config()
    with torch.device("meta"):
        if kind == "text_encoder":
            return transformers.Qwen2_5_VLForConditionalGeneration(config)
        return transformers.Qwen2_5_VLModel(config)  # streamed: no language-model head


def footprints(arch: QwenImageArch, dtype: torch.dtype, offload: OffloadConfig,
               lora_rank: int = 0) -> dict[str, ModuleFootprint]:
    """Weight bytes of the text encoder, the transformer and the VAE as the runner loads them (module docstring)."""
    streamed = module_footprint(_meta("text_encoder_streamed", arch), dtype, stream=te.STREAM_SPEC, offload=offload,
                                stream_default=False)
    whole = module_footprint(_meta("text_encoder", arch), dtype).weight_bytes
    listed = offload.mode in ("block", "phase") and "text_encoder" in (offload.stream_modules or ())
    text = streamed if listed else ModuleFootprint(  # not streamed: loaded whole, head included
        whole, streamed.stream_resident_bytes, streamed.stream_slot_bytes, streamed.stream_host_bytes, False,
        streamed.stream_moved_bytes)
    return {"text_encoder": text,
            "transformer": module_footprint(_meta("transformer", arch), dtype, keep_fp32,
                                            QwenImageTransformer2D.STREAM_SPEC, offload, lora_rank=lora_rank),
            "vae": module_footprint(_meta("vae", arch), torch.float32)}


def image_decode_bytes(arch: QwenImageArch, h: int, w: int, device_type: str) -> tuple[int, str]:
    """Activation peak of decoding one h x w latent frame to an image, and a detail (module docstring)."""
    cache, chunk = vae_chunk_bytes(arch.vae, h, w, device_type)
    image = video_bytes(1, 8 * h, 8 * w)
    gib = 2**30
    return (cache // 2 + image + chunk // 4,
            f"vae: cache {cache / 2 / gib:.2f} GiB + image {image / gib:.2f} GiB + layer {chunk / 4 / gib:.2f} GiB")


def _references(arch: QwenImageArch, shape: Shape, images: int) -> tuple[int, int]:
    """(image tokens, vision tokens of the text encoder) of `images` reference images at most."""
    if arch.edit is None or not images:
        return 0, 0
    height, width, _ = shape
    per_image = max((height // 16) * (width // 16), arch.edit.vae_image_area // 256)
    vl_area = arch.edit.vl_image_area if arch.edit.variant == "edit_plus" else arch.edit.vae_image_area
    vision = math.ceil(vl_area / (arch.text_encoder.patch_size * arch.text_encoder.spatial_merge_size) ** 2) + 2
    return images * per_image, images * vision


def qwen_estimate(arch: QwenImageArch, shape: Shape, dtype: torch.dtype, device: torch.device, enable_cfg: bool,
                  offload: OffloadConfig, images: int = 0, lora_rank: int = 0) -> MemoryEstimate:
    """The memory estimate of one request of `shape` (height, width, 1) with `images` reference images
    (editing; 0 for text-to-image) on `device` (module docstring)."""
    height, width, _ = shape
    s = torch.empty((), dtype=dtype, device="meta").element_size()
    dev = device.type
    t, vl = arch.transformer, arch.text_encoder
    ref_tokens, vision_tokens = _references(arch, shape, images)
    T = TEXT_TOKENS + vision_tokens
    H, I, V = vl.hidden_size, vl.intermediate_size, vl.vocab_size
    text = (vl.num_hidden_layers + 1) * T * H * s + 3 * T * I * s + 2 * T * H * F32 + T * V * F32
    branches = 2 if enable_cfg else 1
    context = branches * T * H * s
    D = t.inner_dim
    L = (height // 16) * (width // 16) + ref_tokens
    per_token = STEP_WIDTHS * D * s + 4 * D * F32
    step = branches * (L + T) * per_token + (L + T) * t.attention_head_dim * F32
    step += branches * sdpa_workspace(dev, t.num_attention_heads, L + T, t.attention_head_dim, s)
    latent = (1, height // 8, width // 8)
    latents = SCHEDULER_LATENT_COPIES * arch.vae.z_dim * math.prod(latent) * F32
    decode, decode_detail = image_decode_bytes(arch, height // 8, width // 8, dev)
    image = video_bytes(1, height, width)
    encode: tuple[StageFootprint, ...] = ()
    if images:
        bound, _ = image_decode_bytes(arch, max(height, 1024) // 8, max(width, 1024) // 8, dev)
        encode = (StageFootprint("vae_encoder", "vae", bound + context, "vae encode of the references "
                                                                         "(bounded by a decode of their size)"),)
    return MemoryEstimate(
        modules=footprints(arch, dtype, offload, lora_rank),
        stages=(
            StageFootprint("text_encoder", "text_encoder", text + context,
                           f"qwen2.5-vl on {T} tokens, {vl.num_hidden_layers + 1} hidden states kept"),
            *encode,
            StageFootprint("transformer", "transformer", step + context + latents,
                           f"transformer: {L} image + {T} text tokens x {branches} branch(es)"),
            StageFootprint("vae_decoder", "vae", decode + latents // SCHEDULER_LATENT_COPIES, decode_detail),
            StageFootprint("save", None, (3 if dev == "cpu" else 1) * image, "the decoded image"),
        ))


def qwen_step_flops(arch: QwenImageTransformerArch, image_tokens: int, text_tokens: int, passes: int) -> float:
    """FLOPs of one denoising step (module docstring) over `image_tokens` + `text_tokens` with `passes` CFG passes."""
    D, L = arch.inner_dim, image_tokens + text_tokens
    return float((24 * L * D * D + 4 * L * L * D) * arch.num_layers * passes)


def qwen_denoise_flops(arch: QwenImageArch, config: RunnerConfig, shape: Shape,
                       image_inputs: int) -> tuple[StageFlops, ...]:
    """The one denoising stage of a Qwen-Image runner: `infer_steps` steps of `qwen_step_flops` at `shape`
    (height, width, frames), with the reference images' tokens when the task takes `image_inputs` images (one
    reference image, as most edits give)."""
    refs, _ = _references(arch, shape, image_inputs)
    tokens = (shape[0] // 16) * (shape[1] // 16) + refs
    flops = qwen_step_flops(arch.transformer, tokens, FLOP_TEXT_TOKENS, 2 if config.enable_cfg else 1)
    return (StageFlops("transformer", config.infer_steps or 1, flops),)
