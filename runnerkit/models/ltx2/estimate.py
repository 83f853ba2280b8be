"""Peak memory of an LTX-2 / LTX-2.3 request (t2av, i2av), from the architecture and the request shape.

The runner's placement (planning/fit.py) turns this into a peak per offload mode; this module gives
the bytes of each module's weights and each stage's activations. Units: bytes; `s` = bytes per
element of the model dtype (every module, Gemma-3 included, is loaded in it), float32 = 4.

Weights (`footprints`): each network's parameters and buffers counted on a meta-device build
(`checkpoint.network_factory`, as the loader builds them), the transformer with the block/phase
stream plan of `LTX2Transformer.STREAM_SPEC`, the text connectors with that of
`LTX2TextConnectors.STREAM_SPEC` (used when `offload.stream_modules` lists "connectors": their 1D
blocks stream, LTX-2.3's resident part is then the 2.15 GiB of projections and registers, + 0.75 GiB
of slots); Gemma-3's text model from its folder's config.json
(`gemma_parameters`: embedding + 48 x (q, k, v, o, gated MLP, 4 norms, q/k norms) + final norm; the
vision tower is never loaded). Module -> stage: text_encoder (Gemma-3), connectors (text_connectors),
transformer (stage1, stage2), latent_upsampler (the transition), vae (vae_encoder in i2av,
vae_decoder), audio_decoder (audio VAE + vocoder).

Checked against the releases (bf16, the tests assert the counts):
- LTX-2.3 transformer 18,988,838,144 parameters (35.4 GiB) + text connectors 3,172,227,584 (5.9 GiB):
  22.16 B together, Lightricks' "22B" (the release file keeps the connectors under
  `model.diffusion_model.` with the transformer; ~44 GB in bf16). Audio-named parameters (the audio
  stream and both audio<->video attentions): 5.74 B. Video VAE 0.73 B, latent upsampler 0.50 B,
  audio VAE + vocoder 0.16 B.
- LTX-2 (19B) transformer 18,876,174,592 (+ 1.43 B connectors).
- Gemma-3 12B text model 11,766,034,176 (21.9 GiB; transformers 5.23's `Gemma3TextModel` on meta
  gives the same count), ~24 GB with the vision tower the release folder also holds.
So at offload none an LTX-2.3 request holds ~65.8 GiB of weights; Gemma-3 alone is 21.9 GiB: whole on
the device for its stage unless `offload.stream_modules` lists "text_encoder" (mode block/phase), which
streams its 48 layers (the resident part is then the 2.0 GiB token embedding and the final norm).

Activations per stage (request shape (H, W, F); latent frames F' = (F - 1) / 8 + 1; video tokens
F' x H/64 x W/64 in stage 1 (half size), F' x H/32 x W/32 in stage 2; audio tokens round(F / fps x 25),
the same in both stages; text tokens 1024: prompts are padded to diffusers' max_sequence_length).
Every formula counts the tensors alive at once in this package's forward code, read line by line as
models/wan/estimate.py reads Wan's (an argument lives for the call it is passed to, a local until it
is rebound, and a caller's `x = block(x)` keeps the block's input until the block returns):
- text_encoder: Gemma-3 keeps its 49 hidden states [1, 1024, 3840] and the encoder stacks them
  (2 copies), or the 49 + the largest layer transient (gated MLP 3 x [1024, 15360], float32 norms);
- text_connectors: on the stacked states H: input, RMS-normed copy, `zeros_like`, `where` (4H), or
  input + features (alive until the connectors return) + the 1D blocks of the widest stream;
- stage1 / stage2 (`transformer_step_bytes`), one step (the peak repeats every step), per token of
  each stream (width D: video 4096, audio 2048): `pre.x` and the block's input (2sD), the RoPE
  tables (self: D float32, audio<->video: 2048 float32), i2av's per-token AdaLN ([L, 9D] table, its
  [L, D] embedding, the block's [L, 9, D] rows); plus the largest block transient:
  - self-attention at the RoPE of k: modulated input, q before and after RoPE, k, v (5sD) + RoPE's
    float32 temporaries (x.float(), the half products, the stacked result: 12 bytes per channel),
    or at the output projection: input, q, k, v, gated output, its flattened copy, output (7sD);
  - text cross-attention: the stream, its norm, modulated input, q, gated output and its copy,
    output (7sD);
  - audio<->video attention (width 2048): the stream, its norm (alive to the block's end), the
    modulated input, then k before and after RoPE and v at the audio width + RoPE's temporaries,
    or q, gated, flattened + the output;
  - FFN: the stream, its audio<->video norm, input and the 4D hidden (GELU fused into the GEMM on
    CUDA; unfused on the CPU: linear and GELU outputs, 2 x 4D).
  Both streams' peaks are added (an upper bound: they do not coincide; audio has ~126 tokens). Plus
  the modulated text contexts, their k and v (4 x [1024, D + Da]), the scheduler's joint float32
  latents (`SCHEDULER_LATENT_COPIES`), stage 1's RoPE tables (still cached in stage 2) and the
  attention kernel's workspace (planning/workspaces.py `sdpa_workspace`);
- latent_upsampler, vae_encoder (i2av), vae_decoder, audio_decoder: estimate_decoders.py (the VAE
  decodes all frames at once: a layer-by-layer walk of the decoder at the full video size); the
  audio decoder stage also holds the decoded float32 video;
- save: the decoded video and waveform (x3 on the CPU: the float->uint8 and serialization copies).
The encoded prompt (the two contexts, [1024, 4096 + 2048]) and i2av's image latents stay alive
from the connectors to the end of the request.

At 512x768x121 (LTX-2.3, bf16, CUDA, t2av): 1536 / 6144 video tokens (128 KiB each), 126 audio
tokens; a step's activations are 0.26 / 0.88 GiB (i2av 0.49 / 1.77), the VAE decode 5.37 GiB, the
connectors 1.45 GiB. Peaks: offload none 65.8 GiB of weights + the VAE decode = 78.5 GiB with the
margin; model 40.1 GiB (stage 2); block 27.6 / phase 26.6 GiB (the text encoder's stage: Gemma-3
whole + the transformer's resident part and slots). No mode fits a 16 GiB GPU: Gemma-3 12B alone is
21.9 GiB in bf16.

Checked on the CPU against `torch.profiler`'s allocation peaks (formula / measured, toy widths):
transformer step 1.03-1.11 at 1152 video tokens, float32 and bf16, LTX-2.3 and 2.0 switches (1.41 at
288 tokens in bf16, where the attention kernel's fixed workspace dominates), VAE decode 1.000-1.003
(both in test_cases/models/ltx2/test_estimate.py); Gemma-3 through transformers 5.23 1.18-1.21 and the
connectors 1.15-1.22 (checked by hand: transformers' import alone is over the tests' budget); a whole
tiny request, stage by stage, 1.008 at its peak (bench/estimate_vs_peak.py's CPU smoke run). On
CUDA: bench/estimate_vs_peak.py (bench/DEVICE_RUN.md §9), not yet run for LTX-2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import torch
from torch import nn

from runnerkit.config import OffloadConfig
from runnerkit.models.ltx2.arch import LTX2Arch
from runnerkit.models.ltx2.audio_vae import audio_latent_length
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint, network_factory
from runnerkit.models.ltx2.checkpoint_synthetic import fp8_block_weight
from runnerkit.models.ltx2.connectors import LTX2TextConnectors
from runnerkit.models.ltx2.estimate_decoders import (
    audio_decode_bytes,
    upsampler_bytes,
    vae_decode_bytes,
    vae_encode_bytes,
    video_bytes,
)
from runnerkit.models.ltx2.transformer import LTX2Transformer, keep_fp32
from runnerkit.planning.workspaces import F32, sdpa_workspace
from runnerkit.planning.fit import (
    EstimateUnavailable,
    Hint,
    MemoryEstimate,
    ModuleFootprint,
    StageFootprint,
    module_footprint,
    streams,
)
from runnerkit.runners.pipeline import Shape
from runnerkit.weights import CheckpointError, build_on_meta, read_json_object

__all__ = ["GEMMA_DEFAULTS", "SCHEDULER_LATENT_COPIES", "TEXT_TOKENS", "footprints", "fp8_release_weights",
           "fp8_stored_weights",
           "gemma_fields",
           "gemma_footprint", "gemma_parameters", "ltx2_estimate", "stage_tokens", "transformer_step_bytes"]

TEXT_TOKENS = 1024
"""Prompt tokens after padding (diffusers' `max_sequence_length`): Gemma-3 and the connectors always
see 1024 tokens, and so does the transformer's text context."""
SCHEDULER_LATENT_COPIES = 8
"""Joint-latent-size float32 tensors alive in a step: the scheduler's latents, the model-dtype copy
and its packed tokens, the velocity, its float32 copy, unpacking and join, Euler's update."""
GEMMA_DEFAULTS: dict[str, int] = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                                  "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                                  "head_dim": 256}
"""transformers' `Gemma3TextConfig` defaults (5.23) for the fields a config.json may leave out."""


# ---- weights ----------------------------------------------------------------------------------
def gemma_fields(folder: Path) -> dict[str, int]:
    """The Gemma-3 text model's sizes from `folder/config.json` (a `Gemma3ForConditionalGeneration`
    folder: its `text_config`; a `Gemma3TextModel` folder: the top level), transformers' defaults
    filling what it omits.

    Raises:
        EstimateUnavailable: the file is missing or unreadable (loading then says why).
    """
    try:
        config = read_json_object(Path(folder) / "config.json", "text_encoder")
    except CheckpointError as exc:
        raise EstimateUnavailable(f"the Gemma-3 config cannot be read before loading ({exc})") from None
    text = config.get("text_config", config) if config.get("model_type") == "gemma3" else config
    if not isinstance(text, dict):
        raise EstimateUnavailable(f"text_encoder: {folder}/config.json: `text_config` is not an object")
    fields = {k: text.get(k, default) for k, default in GEMMA_DEFAULTS.items()}
    bad = sorted(k for k, v in fields.items() if not isinstance(v, int) or v <= 0)
    if bad:
        raise EstimateUnavailable(f"text_encoder: {folder}/config.json: {bad} must be positive integers")
    return fields


def gemma_parameters(g: dict[str, int]) -> int:
    """Parameters of transformers' `Gemma3TextModel` of sizes `g` (`gemma_fields`): the embedding, per
    layer q/o (D x heads x head_dim), k/v (D x kv_heads x head_dim), the gated MLP (3 x D x I), four
    D-wide norms and the q/k norms, and the final norm; no biases."""
    D, I, hd = g["hidden_size"], g["intermediate_size"], g["head_dim"]
    layer = 2 * D * g["num_attention_heads"] * hd + 2 * D * g["num_key_value_heads"] * hd + 3 * D * I + 4 * D + 2 * hd
    return g["vocab_size"] * D + g["num_hidden_layers"] * layer + D


def gemma_footprint(g: dict[str, int], dtype: torch.dtype, offload: OffloadConfig) -> ModuleFootprint:
    """The Gemma-3 text model's weights (`gemma_parameters`); in offload mode block/phase also its layer
    streaming (`text_encoder.STREAM_SPEC`, used when `offload.stream_modules` lists "text_encoder"),
    planned on a meta-device `Gemma3TextModel` of sizes `g` as `stream_module` plans it."""
    if offload.mode not in ("block", "phase"):
        return ModuleFootprint(gemma_parameters(g) * torch.empty((), dtype=dtype, device="meta").element_size(),
                               stream_default=False)
    from runnerkit.models.ltx2.text_encoder import STREAM_SPEC

    model = _meta_gemma(tuple(sorted(g.items())))
    planned = module_footprint(model, dtype, stream=STREAM_SPEC, offload=offload, stream_default=False)
    assert planned.stream_resident_bytes is not None, "mode block/phase plans the stream"
    # the same total as in every other mode: the parameters (the RoPE tables' few KiB left out)
    total = gemma_parameters(g) * torch.empty((), dtype=dtype, device="meta").element_size()
    streamed = planned.weight_bytes - planned.stream_resident_bytes
    return dataclasses.replace(planned, weight_bytes=total, stream_resident_bytes=total - streamed)


@functools.lru_cache(maxsize=4)
def _meta_gemma(sizes: tuple[tuple[str, int], ...]) -> nn.Module:
    """A meta-device `Gemma3TextModel` of `sizes` (built once per sizes: the planner asks for many configs)."""
    import transformers

    config = transformers.Gemma3TextConfig(**dict(sizes))
    return build_on_meta(lambda: transformers.Gemma3TextModel(config))


@functools.lru_cache(maxsize=16)
def _meta(component: str, arch: LTX2Arch) -> nn.Module:
    return build_on_meta(network_factory(component, arch))


def fp8_stored_weights(ckpt: LTX2Checkpoint) -> frozenset[str]:
    """The transformer parameters (our names) that `ckpt` stores as float8_e4m3fn, from its headers."""
    return ckpt.fp8_weights("transformer", list(_meta("transformer", ckpt.arch).state_dict(keep_vars=True)))


def fp8_release_weights(arch: LTX2Arch) -> frozenset[str]:
    """The transformer parameters (our names) an fp8 release stores as float8_e4m3fn: the blocks' 2-D linear
    weights (`checkpoint_synthetic.fp8_block_weight`); for a checkpoint whose headers cannot be read."""
    return frozenset(n for n, p in _meta("transformer", arch).named_parameters() if fp8_block_weight(n, tuple(p.shape)))


@functools.lru_cache(maxsize=512)  # the memory planner judges hundreds of offload configs
def footprints(arch: LTX2Arch, gemma: tuple[tuple[str, int], ...], dtype: torch.dtype,
               offload: OffloadConfig, fp8_stored: frozenset[str] = frozenset(),
               lora_rank: int = 0) -> dict[str, ModuleFootprint]:
    """Weight bytes of every module as the runner loads it, in `dtype` (meta builds, nothing allocated);
    `gemma`: `gemma_fields(...).items()` as a tuple; `fp8_stored`: the transformer's parameters (our names)
    that the checkpoint stores as float8_e4m3fn (streamed from disk as stored: `fit.module_footprint`);
    `lora_rank`: the transformer's unfused LoRA slot rank (0: none)."""
    s = torch.empty((), dtype=dtype, device="meta").element_size()
    out = {"text_encoder": gemma_footprint(dict(gemma), dtype, offload)}
    out["connectors"] = module_footprint(_meta("connectors", arch), dtype, stream=LTX2TextConnectors.STREAM_SPEC,
                                         offload=offload, stream_default=False)
    out["transformer"] = module_footprint(_meta("transformer", arch), dtype, keep_fp32, LTX2Transformer.STREAM_SPEC,
                                          offload, fp8_stored=fp8_stored, lora_rank=lora_rank)
    out["latent_upsampler"] = module_footprint(_meta("latent_upsampler", arch), dtype)
    out["vae"] = module_footprint(_meta("vae", arch), dtype)
    audio = (module_footprint(_meta(c, arch), dtype).weight_bytes for c in ("audio_vae", "vocoder"))
    out["audio_decoder"] = ModuleFootprint(sum(audio))
    return out


# ---- activations ------------------------------------------------------------------------------
def stage_tokens(arch: LTX2Arch, shape: Shape, fps: int, stage: int) -> tuple[tuple[int, int, int], int, int]:
    """(video latent grid (F', h, w), video tokens, audio tokens) of `stage` (1: half size, 2: full size)."""
    height, width, frames = shape
    vae, t = arch.vae, arch.transformer
    scale = vae.spatial_compression * (2 if stage == 1 else 1)
    grid = ((frames - 1) // vae.temporal_compression + 1, height // scale, width // scale)
    video = (grid[0] // t.patch_size_t) * (grid[1] // t.patch_size) * (grid[2] // t.patch_size)
    audio = audio_latent_length(frames, fps, arch.audio_vae) // t.audio_patch_size_t
    return grid, video, audio


def _token_bytes(dim: int, av_dim: int, s: int, rows: int, per_token_timestep: bool, cpu: bool) -> tuple[int, int]:
    """(alive through the step, largest block transient) per token of one stream of width `dim`; `av_dim`:
    the audio<->video attention width; `rows`: AdaLN rows per block (9 with LTX-2.3's text-query modulation)."""
    rope = 3 * F32  # apply_rope's float32 temporaries, bytes per channel
    # pre.x and the block's input (the caller's `video, audio = block(video, audio)` keeps it); RoPE cos/sin
    base = 2 * s * dim + F32 * dim + F32 * av_dim
    if per_token_timestep:
        base += (2 * rows + 1) * s * dim  # per-token AdaLN table, its embedding, the block's modulation rows
    self_attn = max(5 * s * dim + rope * dim, 7 * s * dim)  # the stream is still the block's input here
    cross = 2 * s * dim + 5 * s * dim  # stream, its norm; modulated input, q, gated output, its copy, output
    av = 2 * s * dim + s * dim + max(3 * s * av_dim + rope * av_dim, 3 * s * av_dim + s * dim)
    ffn = 2 * s * dim + s * dim + 4 * s * dim * (2 if cpu else 1)  # stream, its a<->v norm; input, hidden
    return base, max(self_attn, cross, av, ffn)


def transformer_step_bytes(arch: LTX2Arch, video_tokens: int, audio_tokens: int, s: int, device_type: str,
                           per_token_timestep: bool = False) -> tuple[int, str]:
    """Activation peak of one transformer call (batch 1, no CFG) and a one-line detail (module docstring).

    Args:
        video_tokens, audio_tokens: sequence lengths of the two streams.
        s: bytes per element of the compute dtype.
        device_type: "cpu" or "cuda".
        per_token_timestep: i2av (the clean first frame's tokens get timestep 0).
    """
    t = arch.transformer
    D, Da, av = t.inner_dim, t.audio_inner_dim, t.audio_cross_attention_dim
    cpu = device_type == "cpu"
    v_base, v_peak = _token_bytes(D, av, s, 9 if t.cross_attn_mod else 6, per_token_timestep, cpu)
    a_base, a_peak = _token_bytes(Da, av, s, 9 if t.audio_cross_attn_mod else 6, False, cpu)
    text = 4 * TEXT_TOKENS * (D + Da) * s  # modulated contexts (+ a temporary), k and v (the inputs: the caller's)
    inputs = (video_tokens * t.in_channels + audio_tokens * t.audio_in_channels) * s
    heads = max(t.num_attention_heads, t.audio_num_attention_heads)
    workspace = sdpa_workspace(device_type, heads, video_tokens, t.attention_head_dim, s)
    total = video_tokens * (v_base + v_peak) + audio_tokens * (a_base + a_peak) + text + inputs + workspace
    kib = 1024
    return total, (f"transformer: {video_tokens} video tokens x {(v_base + v_peak) / kib:.0f} KiB + {audio_tokens} "
                   f"audio tokens x {(a_base + a_peak) / kib:.0f} KiB")


def text_encoder_bytes(g: dict[str, int], s: int) -> int:
    """Gemma-3 on one prompt of `TEXT_TOKENS` tokens with every hidden state kept, then their stack."""
    T, D, I = TEXT_TOKENS, g["hidden_size"], g["intermediate_size"]
    states = (g["num_hidden_layers"] + 1) * T * D * s
    layer = 3 * T * I * s + 3 * F32 * T * D + T * D * s  # gated MLP, float32 RMSNorm copies, the layer input
    masks = 2 * T * T * s  # full and sliding-window attention masks
    return max(states + layer, 2 * states) + masks


def connectors_bytes(arch: LTX2Arch, g: dict[str, int], s: int) -> int:
    """The connectors on the stacked states H (the input among them): feature extraction (input, RMS-normed
    copy, `zeros_like`, `where`: 4H), or the features (alive until the connectors return) beside the
    input while the 1D transformer blocks run (16 copies of the widest stream: attention, the unfused
    FFN hidden on the CPU) and the two contexts."""
    T = TEXT_TOKENS
    states = (g["num_hidden_layers"] + 1) * T * g["hidden_size"] * s
    c = arch.connectors
    widest = max(c.width("video"), c.width("audio"))
    return max(4 * states, 2 * states + T * (16 * widest + c.width("video") + c.width("audio")) * s)


def _stream_hints(modules: dict[str, ModuleFootprint], offload: OffloadConfig, gemma_bytes: int,
                  gemma: str = "Gemma-3") -> tuple[Hint, ...]:
    """Advice for a refusal: list the text encoder (`gemma`, `gemma_bytes` whole), the connectors, or both in
    `offload.stream_modules` (each hint keeps the modules already streamed; the planner offers one only where
    it then fits, a request's refusal only where the peak is in the stage of a module it streams)."""
    listed = tuple(offload.stream_modules or ("transformer",))
    missing = [m for m in ("text_encoder", "connectors") if not streams(m, modules[m], offload)]
    words = {"text_encoder": f"the {gemma} text encoder, {gemma_bytes / 2**30:.1f} GiB, then streams its layers "
                             "instead of visiting the device whole for its stage",
             "connectors": f"the text connectors, {modules['connectors'].weight_bytes / 2**30:.1f} GiB, then stream "
                           "their 1D blocks"}
    stage_of = {"text_encoder": "text_encoder", "connectors": "text_connectors"}
    hints = []
    for added in [[m] for m in missing] + ([missing] if len(missing) > 1 else []):
        names = listed + tuple(m for m in added if m not in listed)
        hints.append(Hint(f"offload.mode 'block' with offload.stream_modules {list(names)} ("
                          + "; ".join(words[m] for m in added) + ")", {"mode": "block", "stream_modules": names},
                          tuple(stage_of[m] for m in added)))
    return tuple(hints)


def ltx2_estimate(arch: LTX2Arch, gemma: dict[str, int], shape: Shape, fps: int, task: str, dtype: torch.dtype,
                  device: torch.device, offload: OffloadConfig,
                  fp8_stored: frozenset[str] = frozenset(), lora_rank: int = 0) -> MemoryEstimate:
    """The memory estimate of one LTX-2 request of `shape` (height, width, frames) at `fps` on `device`.

    Args:
        gemma: the text encoder's sizes (`gemma_fields`).
        task: "t2av" or "i2av" (i2av: the VAE encoder stage and per-token timesteps).
        fp8_stored: the transformer parameters the checkpoint stores as float8_e4m3fn
            (`LTX2Checkpoint.fp8_weights`; an fp8 release's block weights).
    """
    height, width, frames = shape
    s = torch.empty((), dtype=dtype, device="meta").element_size()
    dev = device.type
    i2av = task == "i2av"
    t = arch.transformer
    context = TEXT_TOKENS * (t.caption_channels * 2 if t.use_prompt_embeddings else t.inner_dim + t.audio_inner_dim) * s
    grid1, video1, audio1 = stage_tokens(arch, shape, fps, 1)
    grid2, video2, audio2 = stage_tokens(arch, shape, fps, 2)
    latents1 = (video1 * t.in_channels + audio1 * t.audio_in_channels) * F32
    latents2 = (video2 * t.in_channels + audio2 * t.audio_in_channels) * F32
    rope1 = video1 * F32 * (t.inner_dim + t.audio_cross_attention_dim)  # stage 1's cached tables, still in stage 2
    step1, detail1 = transformer_step_bytes(arch, video1, audio1, s, dev, i2av)
    step2, detail2 = transformer_step_bytes(arch, video2, audio2, s, dev, i2av)
    decode, decode_detail = vae_decode_bytes(arch.vae, grid2, s, dev)
    video = video_bytes(frames, height, width)
    wave = math.ceil(frames / fps * arch.vocoder.output_sampling_rate) * arch.audio_vae.output_channels * F32
    image: tuple[StageFootprint, ...] = ()
    image_latents = 0
    if i2av:
        image_latents = arch.vae.latent_channels * grid1[1] * grid1[2] * F32
        image = (StageFootprint("vae_encoder", "vae", vae_encode_bytes(arch.vae, height // 2, width // 2, s) + context,
                                "vae encode of the first frame at the stage-1 size"),)
    kept = context + image_latents
    modules = footprints(arch, tuple(gemma.items()), dtype, offload, fp8_stored, lora_rank)
    return MemoryEstimate(
        modules=modules,
        stages=(
            StageFootprint("text_encoder", "text_encoder", text_encoder_bytes(gemma, s),
                           f"gemma-3 on {TEXT_TOKENS} tokens, {gemma['num_hidden_layers'] + 1} hidden states kept"),
            StageFootprint("text_connectors", "connectors", connectors_bytes(arch, gemma, s) + context,
                           "connectors on the stacked hidden states"),
            *image,
            StageFootprint("stage1", "transformer", step1 + kept + SCHEDULER_LATENT_COPIES * latents1, detail1),
            StageFootprint("latent_upsampler", "latent_upsampler",
                           upsampler_bytes(arch, grid1, s, dev) + kept + latents1 + latents2, "x2 latent upsampler",
                           holds=("transformer",)),
            StageFootprint("stage2", "transformer", step2 + kept + rope1 + SCHEDULER_LATENT_COPIES * latents2, detail2),
            StageFootprint("vae_decoder", "vae", decode + kept + latents2, decode_detail),
            StageFootprint("audio_decoder", "audio_decoder",
                           audio_decode_bytes(arch, audio2, s) + kept + latents2 + video, "audio vae + vocoder"),
            StageFootprint("save", None, (3 if dev == "cpu" else 1) * (video + wave), "the decoded video and audio"),
        ),
        hints=_stream_hints(modules, offload, gemma_parameters(gemma) * s),
    )
