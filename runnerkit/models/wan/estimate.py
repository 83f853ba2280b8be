"""Peak memory of a Wan2.1 text-to-video request, from the architecture and the request shape.

Every formula counts the tensors that are alive at once in this package's own forward code
(transformer.py, text_encoder.py, nets/causal_vae3d*.py / vae_tiling.py), read line by line:
an argument stays alive for the length of the call it is passed to, a local until it is
rebound, and `a * b + c` keeps one temporary at a time. Kernel workspaces are from measurement
(CPU, torch 2.13) or bounded (CUDA). `test_cases/models/wan/test_estimate.py` checks each
formula against the peak of tensor allocations measured with `torch.profiler` on the CPU
(upper bound, and how tight); `bench/estimate_vs_peak.py` against `torch.cuda.max_memory_allocated`.

Units: bytes. `s` = bytes per element of the compute dtype (bf16: 2, float32: 4), `e` = 4 (the
VAE and every norm, modulation and RoPE table run in float32).

Transformer, one forward (CFG runs the two branches one after the other, batch 1; the cond
output waits for the uncond one). Per token, in block i >= 1 (block 0 holds less), with D =
dim, F = ffn_dim, d = head_dim, live across the block: the embedded tokens `pre.x` (4D), the
block input (4D) and the RoPE tables cos/sin (4d). Under block streaming both branches run
through each block in one pass (`WanTransformer3D.forward_branches`): the other branch's
residual stream (4D) takes the place of `pre.x`, which that path drops, so the per-token count
and this estimate are the same for both paths (test_estimate.py measures both); the second
embedded text context fits in the 4 context copies counted below; i2v / flf2v add the second
branch's embedded image tokens (L_img x D float32) to the transformer stage. On top of that, the largest of
- self-attention, at the SDPA call: modulated input 4D (+ sD cast) + q, k after RMSNorm 2x4D
  (2sD without qk_norm) + v sD + q, k after RoPE 2x4D + q, k cast 2sD (when s != 4) + output sD;
- cross-attention: current x 4D + self-attention output sD + norm3 4D (+ sD cast) + q 4D +
  RMSNorm temporaries 2x4D + output 2sD;
- FFN, at the GELU: current x 4D + self-attention output sD + FFN input sD + 2sF (Linear1 out,
  GELU out).
Plus per forward: scaled-dot-product-attention workspace (CPU flash kernel: per thread 256 x 512
scores in float32, and in s when s != 4, plus a 256 x d output tile; CUDA flash/memory-efficient
kernels: a float32 log-sum-exp per head and token, no L x L matrix), the patch embedding (its
output, the float32 copy, and on the CPU the im2col buffer of `slow_conv3d`), the text context,
and the outputs kept for CFG (3 float32 latent-size tensors).

Text encoder (UMT5), batch 2 with CFG (prompt and negative prompt together), L = text_len:
per block the input, the attention bias [B, H, L, L] (and the embedding output it comes from),
then the larger of attention (norm out, q, k, v, output, its reshape) and the FFN (norm out,
fc1, gate, GELU: 3F), plus the float32 RMSNorm temporaries and the relative-position buckets.

VAE decoder (causal, one latent frame at a time): walked layer by layer on a meta-built
decoder, so channels and levels are the code's own. Alive at the peak: the feature cache (two
frames of the input of every causal 3x3x3 convolution and upsample time convolution, at its
level's resolution), the decoded frames so far (the whole video at the last chunk), and the
largest layer transient of a later chunk (4 output frames per latent frame): inside a
residual block's convolution, input + activation + cache tail + [cache, x] concatenation +
its padded copy + output + convolution workspace; inside an upsampler, the reshaped input +
its nearest-upsampled copy + the convolution output. Convolution workspace on the CPU: the
im2col buffer (C_in * k^3 x output positions) of the slow kernels PyTorch picks when
N * C * T * H <= 20480 (measured: `slow_conv3d_forward`, `_slow_conv2d_forward`), else the
oneDNN reorder of input and weights (measured <= input + weights + half the larger of input and
output); on CUDA 2 x input + weights (cuDNN picks its algorithm and workspace at run time; the
bound is calibrated on the H200 runs, see planning/workspaces.py). With
`offload.vae_tiling`, the same for one tile (all frames), plus the full video accumulator,
its weight map and the final division. Decode ends with the concatenation: 2 x the video.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runnerkit.config import OffloadConfig
from runnerkit.models.wan import text_encoder as te
from runnerkit.models.wan import vae_tiling
from runnerkit.models.wan.arch import CLIPVisionArch, UMT5Arch, WanArch, WanTransformerArch, WanVAEArch
from runnerkit.models.wan.clip import CLIPVisionEncoder
from runnerkit.models.wan.clip import keep_fp32 as clip_keep_fp32
from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
from runnerkit.models.wan.vae import WanVAE
from runnerkit.nets.causal_vae3d_estimate import vae_chunk_bytes, video_bytes
from runnerkit.planning.workspaces import F32, sdpa_workspace
from runnerkit.planning.fit import Hint, MemoryEstimate, ModuleFootprint, StageFootprint, module_footprint
from runnerkit.runners.pipeline import Shape
from runnerkit.weights import build_on_meta

#: Latent-size float32 tensors the scheduler and the CFG combine keep during a step (latents,
#: UniPC's two model outputs and last sample, the noise prediction, the combine's temporaries).
SCHEDULER_LATENT_COPIES = 8


# ---- transformer ------------------------------------------------------------------------------
def transformer_tokens(arch: WanTransformerArch, latent_fhw: tuple[int, int, int]) -> int:
    """Sequence length L = (f/pt)(h/ph)(w/pw) of a latent grid (f, h, w)."""
    return math.prod(n // p for n, p in zip(latent_fhw, arch.patch_size))


def transformer_step_bytes(arch: WanTransformerArch, latent_fhw: tuple[int, int, int], s: int,
                           device_type: str) -> tuple[int, str]:
    """Activation peak of one denoising step (both CFG branches, batch 1 each) and a one-line detail.

    Args:
        latent_fhw: latent (frames, height, width).
        s: bytes per element of the compute dtype.
        device_type: "cpu" or "cuda".
    """
    D, Fd, N = arch.dim, arch.ffn_dim, arch.num_heads
    d = D // N
    L = transformer_tokens(arch, latent_fhw)
    cast = s if s != F32 else 0  # a .to(dtype) that copies
    qk = 2 * F32 * D if arch.qk_norm else 2 * s * D
    base = 2 * F32 * D + F32 * d  # pre.x + block input + RoPE cos/sin
    self_attn = F32 * D + cast * D + qk + s * D + 2 * F32 * D + 2 * cast * D + s * D
    cross_attn = F32 * D + s * D + F32 * D + cast * D + F32 * D + 2 * F32 * D + 2 * s * D
    ffn = F32 * D + s * D + s * D + 2 * s * Fd
    per_token = base + max(self_attn, cross_attn, ffn)
    patch = math.prod(arch.patch_size)
    embed = L * (s * D + F32 * D + (arch.in_dim * patch * s if device_type == "cpu" else 0))
    outputs = 3 * L * arch.out_dim * patch * F32  # head output, unpatchify copy, the cond branch kept for CFG
    context = 4 * arch.text_len * max(arch.text_dim, D) * s
    total = L * per_token + max(embed, sdpa_workspace(device_type, N, L, d, s)) + outputs + context
    return total, f"transformer: {L} tokens x {per_token / 1024:.1f} KiB"


# ---- text encoder -----------------------------------------------------------------------------
def text_encoder_bytes(arch: UMT5Arch, batch: int, s: int, device_type: str) -> int:
    """Activation peak of encoding `batch` prompts padded to `arch.text_len` (UMT5 encoder)."""
    B, L, D, Da, H, Fd = batch, arch.text_len, arch.dim, arch.dim_attn, arch.num_heads, arch.dim_ffn
    bias = B * H * L * L * s  # the padding-masked position bias, alive through the block
    norm_tmp = B * L * D * (2 * F32 + s)  # float32 RMSNorm temporaries
    attention = B * L * (2 * D * s + 5 * Da * s)  # input, norm out, q, k, v, output, reshape
    ffn = B * L * (3 * D * s + 3 * Fd * s)  # input, x + attn, norm out, fc1, gate/GELU, product
    # CUDA: the memory-efficient kernel takes the bias as is; 2 float32 [B, H, L, L] bound the math fallback
    workspace = sdpa_workspace(device_type, H, L, Da // H, s) if device_type == "cpu" else 2 * B * H * L * L * F32
    making_bias = H * L * L * s + bias + B * L * D * s  # the embedding output while masked_fill makes the bias
    blocks = max(making_bias, bias + max(attention + workspace, ffn) + norm_tmp)
    buckets = L * L * 8  # int64 relative-position buckets, alive through the forward
    # computing the buckets keeps up to 7 int64/float32 [L, L] temporaries alive (measured 6.6), before the blocks
    return max(7 * buckets, blocks + buckets) + B * L * D * s


# ---- VAE decoder ------------------------------------------------------------------------------
# the decoder walk (vae_chunk_bytes) is the shared network's: runnerkit/nets/causal_vae3d_estimate.py


def vae_decode_bytes(arch: WanVAEArch, latent_fhw: tuple[int, int, int], device_type: str,
                     tiling: bool = False) -> tuple[int, str]:
    """Activation peak of decoding latents [1, z, f, h, w] to [1, 3, 4(f-1)+1, 8h, 8w], and a detail."""
    f, h, w = latent_fhw
    scale = 2 ** (len(arch.dim_mult) - 1)
    frames = 4 * (f - 1) + 1
    video = video_bytes(frames, h * scale, w * scale)
    ys = vae_tiling.tile_starts(h, vae_tiling.TILE_LATENT, vae_tiling.OVERLAP_LATENT)
    xs = vae_tiling.tile_starts(w, vae_tiling.TILE_LATENT, vae_tiling.OVERLAP_LATENT)
    if not tiling or (len(ys) == 1 and len(xs) == 1):
        cache, chunk = vae_chunk_bytes(arch, h, w, device_type)
        total = max(cache + video + chunk, 2 * video)
        gib = 2**30
        return total, f"vae: cache {cache / gib:.2f} GiB + video {video / gib:.2f} GiB + layer {chunk / gib:.2f} GiB"
    th, tw = min(vae_tiling.TILE_LATENT, h), min(vae_tiling.TILE_LATENT, w)
    tile, _ = vae_decode_bytes(arch, (f, th, tw), device_type, tiling=False)
    tile_video = video_bytes(frames, th * scale, tw * scale)
    weight_map = h * scale * w * scale * F32
    total = video + weight_map + max(tile, 2 * tile_video) + video  # last term: `out / weight`
    return total, f"vae (tiled {th}x{tw}): tile {tile / 2**30:.2f} GiB + video 2x{video / 2**30:.2f} GiB"


# ---- the request ------------------------------------------------------------------------------
_NETWORKS: dict[type, Callable[[Any], nn.Module]] = {
    WanTransformerArch: WanTransformer3D, UMT5Arch: te.UMT5Encoder, WanVAEArch: WanVAE,
    CLIPVisionArch: CLIPVisionEncoder}


@functools.lru_cache(maxsize=16)
def _meta_network(arch: WanTransformerArch | UMT5Arch | WanVAEArch | CLIPVisionArch) -> nn.Module:
    """The network of a component architecture built on the meta device, once per architecture (the plan
    asks for every offload candidate's footprints: a 14B transformer takes ~1 s to build)."""
    network = next(cls for kind, cls in _NETWORKS.items() if isinstance(arch, kind))
    return build_on_meta(lambda: network(arch))


@functools.lru_cache(maxsize=16)
def footprints(arch: WanArch, dtype: torch.dtype, offload: OffloadConfig,
               transformers: tuple[str, ...] = ("transformer",), lora_rank: int = 0) -> dict[str, ModuleFootprint]:
    """Weight bytes of every module as the Wan runners load them (meta-built, nothing allocated):
    text encoder, CLIP image encoder (Wan2.1 i2v / flf2v), each transformer (MoE: one per expert,
    same architecture, each with its unfused LoRA slots of rank `lora_rank`) and the VAE."""
    transformer, encoder, vae = (_meta_network(a) for a in (arch.transformer, arch.text_encoder, arch.vae))
    out = {"text_encoder": module_footprint(encoder, dtype, te.keep_fp32, te.UMT5Encoder.STREAM_SPEC, offload,
                                            stream_default=False)}
    if arch.image_encoder is not None:
        out["image_encoder"] = module_footprint(_meta_network(arch.image_encoder), dtype, clip_keep_fp32)
    step = module_footprint(transformer, dtype, keep_fp32, WanTransformer3D.STREAM_SPEC, offload, lora_rank=lora_rank)
    out.update({name: step for name in transformers})
    out["vae"] = module_footprint(vae, torch.float32)
    return out


def clip_bytes(arch: CLIPVisionArch, images: int, s: int) -> int:
    """CLIP on `images` frames: the float32 residual stream and one block's attention and MLP
    ([n, L, dim] x 4, scores [n, heads, L, L], MLP [n, L, ffn]) + the preprocessed pixels."""
    tokens = (arch.image_size // arch.patch_size) ** 2 + 1
    stream = 4 * images * tokens * arch.dim * F32
    block = images * (arch.num_heads * tokens * tokens + 3 * tokens * arch.dim + tokens * arch.ffn_dim) * s
    return stream + block + images * 3 * arch.image_size**2 * F32


def wan_t2v_estimate(arch: WanArch, shape: Shape, dtype: torch.dtype, device: torch.device, enable_cfg: bool,
                     offload: OffloadConfig, transformers: tuple[str, ...] = ("transformer",),
                     image_frames: int = 0, lora_rank: int = 0) -> MemoryEstimate:
    """The memory estimate of one Wan request of `shape` (height, width, frames).

    Stages: text_encoder (UMT5 on the prompt and, with CFG, the negative prompt); for image tasks
    (`image_frames` 1 for i2v, 2 for flf2v) image_encoder (CLIP, Wan2.1 only) and vae_encoder
    (bounded by the decode of the same latents: the encoder mirrors the decoder with fewer
    channels at full resolution; + the conditioning clip); transformer (one step: the peak
    repeats every step; image tasks add `y` and the CLIP tokens); vae_decoder; save (the decoded
    video until it is written; on the CPU also the float->uint8 conversion and the serialization
    copies: 3 x the video). `transformers`: the module names of the denoising transformer(s).
    `lora_rank`: unfused LoRA slot rank (config `lora`; 0: none), kept on the device beside each
    transformer (`fit.lora_slot_bytes`).
    """
    height, width, frames = shape
    s = torch.empty((), dtype=dtype, device="meta").element_size()
    dev = device.type
    latent = ((frames - 1) // 4 + 1, height // 8, width // 8)
    latent_bytes = arch.vae.z_dim * math.prod(latent) * F32
    context = (2 if enable_cfg else 1) * arch.text_encoder.text_len * arch.text_encoder.dim * s
    text = text_encoder_bytes(arch.text_encoder, 2 if enable_cfg else 1, s, dev)
    step, step_detail = transformer_step_bytes(arch.transformer, latent, s, dev)
    decode, decode_detail = vae_decode_bytes(arch.vae, latent, dev, tiling=offload.vae_tiling)
    video = video_bytes(frames, height, width)
    image_stages: tuple[StageFootprint, ...] = ()
    conditioning = 0
    if image_frames:
        y_bytes = (arch.transformer.in_dim - arch.transformer.out_dim) * math.prod(latent) * F32
        clip_tokens = 0
        if arch.image_encoder is not None:
            clip_tokens = image_frames * ((arch.image_encoder.image_size // arch.image_encoder.patch_size) ** 2 + 1)
            image_stages += (StageFootprint("image_encoder", "image_encoder",
                                            clip_bytes(arch.image_encoder, image_frames, s) + context,
                                            f"CLIP on {image_frames} frame(s)"),)
        encode, _ = vae_decode_bytes(arch.vae, latent, dev, tiling=False)
        image_stages += (StageFootprint("vae_encoder", "vae", encode + video + y_bytes + context,
                                        "vae encode of the conditioning clip (bounded by its decode)"),)
        conditioning = y_bytes + clip_tokens * 1280 * F32
        if enable_cfg and offload.mode == "block":  # one pass: both branches' embedded image tokens at once
            conditioning += clip_tokens * arch.transformer.dim * F32
    hints = () if offload.vae_tiling else (Hint("offload.vae_tiling=true (the VAE decodes 256-px tiles: its memory "
                                                "then grows with the tile, not the frame)", {"vae_tiling": True}),)
    return MemoryEstimate(
        modules=footprints(arch, dtype, offload, transformers, lora_rank),
        stages=(
            StageFootprint("text_encoder", "text_encoder", text + context, "umt5 on the prompt(s)"),
            *image_stages,
            StageFootprint("transformer", transformers[0],
                           step + context + conditioning + SCHEDULER_LATENT_COPIES * latent_bytes, step_detail),
            StageFootprint("vae_decoder", "vae", decode + latent_bytes, decode_detail),
            StageFootprint("save", None, (3 if dev == "cpu" else 1) * video, "the decoded video"),
        ),
        hints=hints,
    )
