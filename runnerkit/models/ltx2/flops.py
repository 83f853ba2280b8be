"""FLOPs of one LTX-2 denoising step per stage, from the architecture alone (the planner's time model,
planning/compute.py). 2 FLOPs per multiply-add.

Per block and pass, each attention with Lq queries of width Dq over Lk keys of width Dk at inner width
E (heads x head size): q and out projections 4 Lq Dq E, k and v 4 Lk Dk E, scores and values 4 Lq Lk E.
A block holds (transformer_blocks.py): video self-attention (Lv, D), audio self-attention (La, Da), the
text cross-attentions of both streams (Lk = `estimate.TEXT_TOKENS` text tokens), audio-to-video
(video queries over the audio tokens) and video-to-audio at the audio width, and the FFNs of both
streams (16 L D^2 each: D -> 4D -> D). Stage 1 runs at half the height and width (`stage_tokens`).
Gates, modulation, norms, RoPE and the patch/unpatch projections are below 1 % and left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runnerkit.models.ltx2.arch import LTX2Arch
from runnerkit.models.ltx2.estimate import TEXT_TOKENS, stage_tokens
from runnerkit.runners.pipeline import Shape
from runnerkit.planning.compute import StageFlops

if TYPE_CHECKING:
    from runnerkit.config import RunnerConfig

__all__ = ["ltx2_denoise_flops", "ltx2_step_flops"]


def _attention(lq: int, dq: int, lk: int, dk: int, inner: int) -> int:
    return 4 * lq * dq * inner + 4 * lk * dk * inner + 4 * lq * lk * inner


def ltx2_step_flops(arch: LTX2Arch, shape: Shape, fps: int, stage: int, passes: int) -> float:
    """FLOPs of one step of `stage` (1: half size, 2: full size) at `shape` (height, width, frames) with
    `passes` CFG passes (module docstring)."""
    t = arch.transformer
    _, lv, la = stage_tokens(arch, shape, fps, stage)
    D, Da, T = t.inner_dim, t.audio_inner_dim, TEXT_TOKENS
    av = t.audio_num_attention_heads * t.audio_attention_head_dim  # audio<->video attention width
    block = (_attention(lv, D, lv, D, D) + _attention(la, Da, la, Da, Da)
             + _attention(lv, D, T, t.cross_attention_dim, D) + _attention(la, Da, T, t.audio_cross_attention_dim, Da)
             + _attention(lv, D, la, Da, av) + _attention(la, Da, lv, D, av)
             + 16 * lv * D * D + 16 * la * Da * Da)
    return float(block * t.num_layers * passes)


def ltx2_denoise_flops(arch: LTX2Arch, config: RunnerConfig, shape: Shape,
                       stage_steps: tuple[int, int]) -> tuple[StageFlops, ...]:
    """Stage 1's `stage_steps[0]` distilled steps at half size, then stage 2's `stage_steps[1]` at full size
    (`ltx2_step_flops` at `shape` (height, width, frames), `config.fps`, CFG passes from `enable_cfg`)."""
    passes = 2 if config.enable_cfg else 1
    first, second = stage_steps
    return (StageFlops("stage1", first, ltx2_step_flops(arch, shape, config.fps, 1, passes)),
            StageFlops("stage2", second, ltx2_step_flops(arch, shape, config.fps, 2, passes)))
