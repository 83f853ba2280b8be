"""LTX-2 / LTX-2.3 / LTX-2.5 audio+video diffusion transformer, in diffusers' key names.

Design and numerics follow diffusers 0.42.1 `LTX2VideoTransformer3DModel`
(models/transformers/transformer_ltx2.py; Lightricks LTX-2, ltx-core `LTXModel`): two token
streams, video (patchified latents [B, F*H*W, 128] -> width 4096) and audio (mel latents
[B, L, 8*16] -> width 2048), run through 48 shared blocks (`transformer_blocks.py`): each stream
attends to itself, to its text context and to the other stream, with AdaLN modulation from the
timestep. The video timestep may be per token (i2av: the conditioned first frame's tokens get
timestep 0). LTX-2.0 projects the text with caption projections here; LTX-2.3 receives
connector-projected text, gates every attention per head, and modulates its text attention with
sigma (`prompt_adaln`). See `transformer_arch.py` for the switches.

LTX-2.5's transformer is LTX-2.3's with a bias-free video FFN and (2.5.1+) a learned keyframe
embedding: `keyframes_abs_pos_embedding` [1, D], added after `proj_in` to the video tokens that
`video_keyframes_mask` marks (tokens whose latent frame encodes a single pixel frame: the causal
first frame, generated keyframe slots). The text/image-to-video path passes no mask, so the
parameter is loaded and kept but has no effect there.

Not covered: a static prompt modulation (`use_prompt_adaln_single` false, no release uses it;
`from_diffusers_config` refuses it), DFR and keyframe-slot pipelines; the guidance inputs of the non-distilled pipelines: STG (`perturbed_attn` runs
without perturbation), modality isolation, IC-LoRA video self-attention masks.

State-dict keys and shapes are exactly diffusers': a diffusers-layout checkpoint loads with
`load_state_dict(strict=True)` (build on the meta device, load with assign=True).

Layout for the offload engine: `forward` is `embed` -> `transformer_blocks[i](...)` for each
block -> `head`; all of a block's weights are used inside `transformer_blocks[i].forward`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.models.ltx2.rope import RopeTable, audio_positions, rope_table, video_positions
from runnerkit.models.ltx2.transformer_arch import LTX2TransformerArch
from runnerkit.models.ltx2.transformer_blocks import AdaLNSingle, LTX2Block
from runnerkit.offload.layout import StreamSpec

MASK_BIAS = -10000.0
"""Additive attention bias on padded text keys (diffusers' value; exp underflows to 0 in float32)."""


def keep_fp32(name: str) -> bool:
    """Whether the parameter `name` stays float32 whatever the weight dtype: never for LTX-2
    (diffusers' model has no `_keep_in_fp32_modules`; the release stores everything in bf16 or fp8)."""
    return False


class CaptionProjection(nn.Module):
    """LTX-2.0 text projection: Linear -> tanh GELU -> Linear (diffusers `PixArtAlphaTextProjection`)."""

    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


@dataclass
class LTX2Embedded:
    """What `LTX2Transformer.embed` hands to the blocks (keyword names of `LTX2Block.forward`) and the head."""

    video: Tensor
    audio: Tensor
    context: Tensor
    audio_context: Tensor
    temb: Tensor
    audio_temb: Tensor
    av_temb: Tensor
    audio_av_temb: Tensor
    av_gate_temb: Tensor
    audio_av_gate_temb: Tensor
    prompt_temb: Tensor | None
    audio_prompt_temb: Tensor | None
    rope: RopeTable
    audio_rope: RopeTable
    av_rope: RopeTable
    audio_av_rope: RopeTable
    mask: Tensor | None
    audio_mask: Tensor | None
    embedded: Tensor
    """[B, Tv, D] video timestep embedding (output-layer modulation)."""
    audio_embedded: Tensor
    """[B, Ta, Da] audio timestep embedding."""

    def block_inputs(self) -> dict[str, Tensor | RopeTable | None]:
        """Keyword arguments of `LTX2Block.forward` except the two streams."""
        return {k: v for k, v in vars(self).items() if k not in ("video", "audio", "embedded", "audio_embedded")}


def pack_video_latents(latents: Tensor, patch_size: int = 1, patch_size_t: int = 1) -> Tensor:
    """Patchify: [B, C, F, H, W] -> [B, f*h*w, C*pt*p*p] tokens in (f, h, w) order (f = F / pt, ...)."""
    B, C, F_, H, W = latents.shape
    p, pt = patch_size, patch_size_t
    x = latents.reshape(B, C, F_ // pt, pt, H // p, p, W // p, p)  # [B, C, f, pt, h, p, w, p]
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(B, (F_ // pt) * (H // p) * (W // p), C * pt * p * p)


def unpack_video_latents(tokens: Tensor, frames: int, height: int, width: int, patch_size: int = 1,
                         patch_size_t: int = 1) -> Tensor:
    """Unpatchify: [B, f*h*w, C*pt*p*p] -> [B, C, f*pt, h*p, w*p]; frames/height/width are f, h, w (patched)."""
    B = tokens.shape[0]
    p, pt = patch_size, patch_size_t
    x = tokens.reshape(B, frames, height, width, -1, pt, p, p)  # [B, f, h, w, C, pt, p, p]
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # [B, C, f, pt, h, p, w, p]
    return x.reshape(B, x.shape[1], frames * pt, height * p, width * p)


def pack_audio_latents(latents: Tensor) -> Tensor:
    """Audio latents [B, C, L, M] (channels, frames, mel bins) -> tokens [B, L, C*M]."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio_latents(tokens: Tensor, mel_bins: int) -> Tensor:
    """Tokens [B, L, C*M] -> audio latents [B, C, L, M]."""
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


class LTX2Transformer(nn.Module):
    """diffusers `LTX2VideoTransformer3DModel` (LTX-2.0, 2.3 or 2.5 after `arch`), same state-dict keys."""

    STREAM_SPEC: ClassVar[StreamSpec] = StreamSpec(
        blocks_attr="transformer_blocks",
        phases=("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn",
                "ff", "audio_ff"),
        keep_fp32=keep_fp32)
    """Block/phase offload: `transformer_blocks[i]` and its phases in call order (scale-shift tables stay resident
    in phase mode)."""

    def __init__(self, arch: LTX2TransformerArch) -> None:
        super().__init__()
        self.arch = arch
        dim, adim = arch.inner_dim, arch.audio_inner_dim
        self.proj_in = nn.Linear(arch.in_channels, dim)
        self.audio_proj_in = nn.Linear(arch.audio_in_channels, adim)
        if arch.use_prompt_embeddings:
            self.caption_projection = CaptionProjection(arch.caption_channels, dim)
            self.audio_caption_projection = CaptionProjection(arch.caption_channels, adim)
        self.time_embed = AdaLNSingle(dim, 9 if arch.cross_attn_mod else 6)
        self.audio_time_embed = AdaLNSingle(adim, 9 if arch.audio_cross_attn_mod else 6)
        # audio<->video attention: scale/shift (a2v, v2a) and gate per stream
        self.av_cross_attn_video_scale_shift = AdaLNSingle(dim, 4)
        self.av_cross_attn_audio_scale_shift = AdaLNSingle(adim, 4)
        self.av_cross_attn_video_a2v_gate = AdaLNSingle(dim, 1)
        self.av_cross_attn_audio_v2a_gate = AdaLNSingle(adim, 1)
        self.scale_shift_table = nn.Parameter(torch.randn(2, dim) / dim**0.5)  # output rows: shift, scale
        self.audio_scale_shift_table = nn.Parameter(torch.randn(2, adim) / adim**0.5)
        if arch.prompt_modulation:
            self.prompt_adaln = AdaLNSingle(dim, 2)
            self.audio_prompt_adaln = AdaLNSingle(adim, 2)
        if arch.use_keyframes_abs_pos_embedding:  # LTX-2.5.1+: zeros until loaded, as in the reference
            self.keyframes_abs_pos_embedding = nn.Parameter(torch.zeros(1, dim))
        self.transformer_blocks = nn.ModuleList([LTX2Block(arch) for _ in range(arch.num_layers)])
        self.proj_out = nn.Linear(dim, arch.out_channels)
        self.audio_proj_out = nn.Linear(adim, arch.audio_out_channels)
        self._rope_cache: dict[tuple[object, ...], tuple[RopeTable, ...]] = {}
        self._block_limit: int | None = None

    @contextmanager
    def first_blocks(self, count: int) -> Iterator[None]:
        """Inside the `with` block, `forward` runs only the first `count` transformer blocks (the input
        embedding and the output head as always), so its output is not the model's. For warmup's frame-count
        sweep (count_sweep.py): every block runs the same operators at the same shapes. Restored on exit, also
        on an error.

        Raises:
            ValueError: `count` < 1, or more than the model's blocks.
        """
        if not 1 <= count <= len(self.transformer_blocks):
            raise ValueError(f"`count` must be 1..{len(self.transformer_blocks)} (the model's blocks), got {count}")
        previous, self._block_limit = self._block_limit, count
        try:
            yield
        finally:
            self._block_limit = previous

    @property
    def blocks(self) -> nn.ModuleList:
        """The blocks (`transformer_blocks`, diffusers' name), under the name other families use."""
        return self.transformer_blocks

    @property
    def head_dims(self) -> tuple[int, ...]:
        """Head sizes of the attentions, for the backend probe (`runnerkit.attention.resolve` takes one):
        video self/text attention at `attention_head_dim` (128), audio and audio<->video at
        `audio_attention_head_dim` (64)."""
        return tuple(sorted({self.arch.attention_head_dim, self.arch.audio_attention_head_dim}))

    def clear_cache(self) -> None:
        """Drop the per-shape RoPE tables (request-specific state; warmup isolation needs this)."""
        self._rope_cache.clear()

    @torch.compiler.disable
    def rope_tables(self, grid: tuple[int, int, int], audio_frames: int, fps: float,
                    device: torch.device) -> tuple[RopeTable, RopeTable, RopeTable, RopeTable]:
        """(video, audio, video a<->v, audio a<->v) RoPE tables for a latent grid (F, H, W), `audio_frames`
        audio latent frames and the video frame rate (cached per shape, fps and device)."""
        key = (grid, audio_frames, float(fps), device)
        if key not in self._rope_cache:
            a = self.arch
            v_spans = video_positions(*grid, (a.patch_size_t, a.patch_size, a.patch_size), a.vae_scale_factors,
                                      a.causal_offset, fps, device)  # [3, Lv, 2]
            a_spans = audio_positions(audio_frames, a.audio_patch_size_t, a.audio_scale_factor, a.causal_offset,
                                      a.audio_hop_length, a.audio_sampling_rate, device)  # [1, La, 2]
            table = partial(rope_table, theta=a.rope_theta, double_precision=a.rope_double_precision,
                            kind=a.rope_type)
            av_base = (float(max(a.pos_embed_max_pos, a.audio_pos_embed_max_pos)),)
            self._rope_cache[key] = (
                table(v_spans, (a.pos_embed_max_pos, a.base_height, a.base_width), a.inner_dim,
                      a.num_attention_heads),
                table(a_spans, (a.audio_pos_embed_max_pos,), a.audio_inner_dim, a.audio_num_attention_heads),
                # audio<->video: time only, at the audio width; each side grouped by its own stream's heads
                table(v_spans[:1], av_base, a.audio_cross_attention_dim, a.num_attention_heads),
                table(a_spans, av_base, a.audio_cross_attention_dim, a.audio_num_attention_heads),
            )
        return self._rope_cache[key]  # type: ignore[return-value]

    def check_inputs(self, video: Tensor, audio: Tensor, context: Tensor, audio_context: Tensor,
                     timestep: Tensor, audio_timestep: Tensor | None, sigma: Tensor | None,
                     masks: tuple[Tensor | None, Tensor | None], grid: tuple[int, int, int], audio_frames: int,
                     use_cross_timestep: bool) -> None:
        """Raise ValueError naming the argument when an input does not fit (see `forward`)."""
        a = self.arch
        B = video.shape[0]
        f, h, w = grid
        for name, size, patch in (("num_frames", f, a.patch_size_t), ("height", h, a.patch_size),
                                  ("width", w, a.patch_size), ("audio_num_frames", audio_frames, a.audio_patch_size_t)):
            if size <= 0 or size % patch:
                raise ValueError(f"`{name}`={size} must be a positive multiple of its patch size {patch}")
        Lv = (f // a.patch_size_t) * (h // a.patch_size) * (w // a.patch_size)
        if video.ndim != 3 or video.shape[1:] != (Lv, a.in_channels):
            raise ValueError(f"`hidden_states` must be [B, {Lv}, {a.in_channels}] for the latent grid {grid}, "
                             f"got {tuple(video.shape)}")
        La = audio_frames // a.audio_patch_size_t
        if audio.shape != (B, La, a.audio_in_channels):
            raise ValueError(f"`audio_hidden_states` must be [{B}, {La}, {a.audio_in_channels}], "
                             f"got {tuple(audio.shape)}")
        text_dim = a.caption_channels if a.use_prompt_embeddings else a.cross_attention_dim
        audio_text_dim = a.caption_channels if a.use_prompt_embeddings else a.audio_cross_attention_dim
        for name, x, width in (("encoder_hidden_states", context, text_dim),
                               ("audio_encoder_hidden_states", audio_context, audio_text_dim)):
            if x.ndim != 3 or x.shape[0] != B or x.shape[2] != width:
                raise ValueError(f"`{name}` must be [{B}, L, {width}], got {tuple(x.shape)}")
        for name, mask, x in (("encoder_attention_mask", masks[0], context),
                              ("audio_encoder_attention_mask", masks[1], audio_context)):
            if mask is not None and mask.shape != x.shape[:2]:
                raise ValueError(f"`{name}` must be [B, L] = {tuple(x.shape[:2])} like its text, "
                                 f"got {tuple(mask.shape)}")
        if timestep.shape not in ((B,), (B, Lv)):
            raise ValueError(f"`timestep` must be [B] or per token [B, {Lv}], got {tuple(timestep.shape)}")
        if audio_timestep is None and timestep.ndim == 2:
            raise ValueError("`audio_timestep` [B] is required when `timestep` is per token")
        if audio_timestep is not None and audio_timestep.shape not in ((B,), (B, La)):
            raise ValueError(f"`audio_timestep` must be [B] or [B, {La}], got {tuple(audio_timestep.shape)}")
        if (a.prompt_modulation or use_cross_timestep) and (sigma is None or sigma.shape != (B,)):
            raise ValueError(f"`sigma` [B] is required (LTX-2.3 prompt modulation or `use_cross_timestep`), got "
                             f"{None if sigma is None else tuple(sigma.shape)}")

    def embed(self, hidden_states: Tensor, audio_hidden_states: Tensor, encoder_hidden_states: Tensor,
              audio_encoder_hidden_states: Tensor, timestep: Tensor, audio_timestep: Tensor | None,
              sigma: Tensor | None, audio_sigma: Tensor | None, encoder_attention_mask: Tensor | None,
              audio_encoder_attention_mask: Tensor | None, grid: tuple[int, int, int], audio_frames: int,
              fps: float, use_cross_timestep: bool, video_keyframes_mask: Tensor | None = None) -> LTX2Embedded:
        """Project the tokens and text, embed the timesteps, build masks and RoPE (see `forward`)."""
        self.check_inputs(hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                          timestep, audio_timestep, sigma, (encoder_attention_mask, audio_encoder_attention_mask),
                          grid, audio_frames, use_cross_timestep)
        a = self.arch
        B = hidden_states.shape[0]
        audio_timestep = timestep if audio_timestep is None else audio_timestep
        audio_sigma = sigma if audio_sigma is None else audio_sigma
        video = self.add_keyframes_embedding(self.proj_in(hidden_states), video_keyframes_mask)  # [B, Lv, D]
        audio = self.audio_proj_in(audio_hidden_states)  # [B, La, Da]

        temb, embedded = self.time_embed(timestep, B)  # [B, Tv, rows*D], [B, Tv, D]
        audio_temb, audio_embedded = self.audio_time_embed(audio_timestep, B)
        prompt_temb = audio_prompt_temb = None
        if a.prompt_modulation:
            assert sigma is not None and audio_sigma is not None, "check_inputs requires `sigma` here"
            prompt_temb = self.prompt_adaln(sigma, B)[0]  # [B, 1, 2D]
            audio_prompt_temb = self.audio_prompt_adaln(audio_sigma, B)[0]
        # audio<->video modulation: each stream's own timestep, or (LTX-2.3 pipelines) the other stream's sigma
        gate_factor = a.cross_attn_timestep_scale_multiplier / a.timestep_scale_multiplier
        video_t, audio_t = timestep, audio_timestep
        if use_cross_timestep:
            assert sigma is not None and audio_sigma is not None, "check_inputs requires `sigma` here"
            video_t, audio_t = audio_sigma, sigma
        av_temb = self.av_cross_attn_video_scale_shift(video_t, B)[0]  # [B, T, 4D]
        av_gate_temb = self.av_cross_attn_video_a2v_gate(video_t * gate_factor, B)[0]  # [B, T, D]
        audio_av_temb = self.av_cross_attn_audio_scale_shift(audio_t, B)[0]
        audio_av_gate_temb = self.av_cross_attn_audio_v2a_gate(audio_t * gate_factor, B)[0]

        context, audio_context = encoder_hidden_states, audio_encoder_hidden_states
        if a.use_prompt_embeddings:
            context = self.caption_projection(context)  # [B, Lt, D]
            audio_context = self.audio_caption_projection(audio_context)  # [B, Lt, Da]

        def additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
            if mask is None:
                return None
            return ((1 - mask.to(dtype)) * MASK_BIAS)[:, None, None, :]  # [B, 1, 1, Lt]

        rope, audio_rope, av_rope, audio_av_rope = self.rope_tables(grid, audio_frames, fps, hidden_states.device)
        return LTX2Embedded(
            video, audio, context, audio_context, temb, audio_temb, av_temb, audio_av_temb, av_gate_temb,
            audio_av_gate_temb, prompt_temb, audio_prompt_temb, rope, audio_rope, av_rope, audio_av_rope,
            additive(encoder_attention_mask, video.dtype), additive(audio_encoder_attention_mask, audio.dtype),
            embedded, audio_embedded)

    def add_keyframes_embedding(self, video: Tensor, mask: Tensor | None) -> Tensor:
        """Add `keyframes_abs_pos_embedding` [1, D] to the projected video tokens [B, Lv, D] where `mask`
        [B, Lv, 1] is > 0; unchanged when `mask` is None or the model has no embedding (pre-2.5.1 arch:
        the mask is ignored, as in the reference).

        Raises: ValueError when the mask is not [B, Lv, 1]."""
        if mask is None or not self.arch.use_keyframes_abs_pos_embedding:
            return video
        if mask.shape != (*video.shape[:2], 1):
            raise ValueError(f"`video_keyframes_mask` must be [B, Lv, 1] = {(*video.shape[:2], 1)}, "
                             f"got {tuple(mask.shape)}")
        marker = (mask > 0).to(video.dtype)
        return video + marker * self.keyframes_abs_pos_embedding.to(video.dtype)

    def head(self, video: Tensor, audio: Tensor, embedded: Tensor, audio_embedded: Tensor) -> tuple[Tensor, Tensor]:
        """Output layer: LayerNorm, AdaLN (shift, scale) from the timestep embedding, Linear, per stream."""
        outs = []
        for x, emb, table, proj in ((video, embedded, self.scale_shift_table, self.proj_out),
                                    (audio, audio_embedded, self.audio_scale_shift_table, self.audio_proj_out)):
            values = table.to(emb.dtype) + emb[:, :, None]  # [B, T, 2, dim]
            shift, scale = values[:, :, 0], values[:, :, 1]
            x = F.layer_norm(x, x.shape[-1:], eps=1e-6)
            outs.append(proj(x * (1 + scale) + shift))
        return outs[0], outs[1]

    def forward(self, hidden_states: Tensor, audio_hidden_states: Tensor, encoder_hidden_states: Tensor,
                audio_encoder_hidden_states: Tensor, timestep: Tensor, num_frames: int, height: int, width: int,
                audio_num_frames: int, fps: float = 24.0, audio_timestep: Tensor | None = None,
                sigma: Tensor | None = None, audio_sigma: Tensor | None = None,
                encoder_attention_mask: Tensor | None = None, audio_encoder_attention_mask: Tensor | None = None,
                use_cross_timestep: bool | None = None,
                video_keyframes_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Predict the video and audio velocities of one denoising step.

        Args:
            hidden_states: [B, Lv, in_channels] packed video latents (`pack_video_latents`), Lv = F*H*W / patch.
            audio_hidden_states: [B, La, audio_in_channels] packed audio latents (`pack_audio_latents`).
            encoder_hidden_states: [B, Lt, D] video text context from the connectors (LTX-2.3), or
                [B, Lt, caption_channels] (LTX-2.0, projected here).
            audio_encoder_hidden_states: [B, Lt, Da] audio text context (LTX-2.0: caption_channels).
            timestep: [B], or per token [B, Lv] (i2av: 0 on the conditioned frame's tokens), already
                scaled (sigma x 1000 in the pipelines).
            num_frames, height, width: the video latent grid (before patching), for RoPE.
            audio_num_frames: audio latent frames, for RoPE.
            fps: frame rate of the video (RoPE time in seconds).
            audio_timestep: [B] or [B, La]; None: `timestep` (which must then be [B]).
            sigma: [B] scalar timestep of the step: drives LTX-2.3's text modulation and, with
                `use_cross_timestep`, the audio<->video modulation (the pipelines pass the step's timestep).
            audio_sigma: [B]; None: `sigma`.
            encoder_attention_mask, audio_encoder_attention_mask: [B, Lt], 1 on real text tokens,
                0 on padding; None: no padding.
            use_cross_timestep: audio<->video AdaLN from the other stream's sigma (True) or from each
                stream's own timestep (False); None: the checkpoint's version (`arch.cross_timestep`: LTX-2.3
                True, LTX-2.0 False, diffusers' legacy path).
            video_keyframes_mask: [B, Lv, 1], > 0 on the video tokens that receive the learned
                `keyframes_abs_pos_embedding` (LTX-2.5.1+; tokens whose latent frame is a single pixel frame);
                None (the t2av/i2av runner path): no token marked. Ignored by a model without the embedding.

        Returns:
            (video [B, Lv, out_channels], audio [B, La, audio_out_channels]) in the weights' dtype.

        Raises:
            ValueError: an input shape does not fit (the message names the argument).

        Source: diffusers 0.42.1 `LTX2VideoTransformer3DModel.forward`; the keyframe marker as ltx-core's
        `apply_keyframes_absolute_embedding` (github Lightricks/LTX-2 @ 400fd31, `transformer_args.py`).
        """
        if use_cross_timestep is None:
            use_cross_timestep = self.arch.cross_timestep
        pre = self.embed(hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states,
                         timestep, audio_timestep, sigma, audio_sigma, encoder_attention_mask,
                         audio_encoder_attention_mask, (num_frames, height, width), audio_num_frames, fps,
                         use_cross_timestep, video_keyframes_mask)
        video, audio = pre.video, pre.audio
        inputs = pre.block_inputs()
        blocks = self.transformer_blocks if self._block_limit is None else self.transformer_blocks[:self._block_limit]
        for block in blocks:
            video, audio = block(video, audio, **inputs)
        return self.head(video, audio, pre.embedded, pre.audio_embedded)
