"""Warmup's frame-count sweep for LTX-2.5, whose frame count is known only after a request's text is encoded.

Eager, a request at a frame count warmup had not run paid a one-time cost on an H100 (bench/results/ltx25_h100_s11.md):
0.25-0.4 s on the first step of each denoise stage and 0.15-0.2 s in the audio decoder, 5% of a 121-frame request
at 512x768. Only the first step paid, and a repeat of the count did not: state built on first use per shape
(most likely the attention and convolution plans of the new token counts; `bench/first_count.py` measures the
transformer's part alone), which the two class warmup shapes cannot hold for the other 56 counts at 512x768.

So after the two shapes, at the larger one's size, every frame count the duration bounds allow (25, 33, ..., 473 at
24 fps for the release) that warmup has not run goes through:

    stage 1 step 0 -> latent upsampler -> stage 2 step 0, with the transformer cut to its first block
    (`LTX2Transformer.first_blocks`: every block runs the same operators at the same shapes), the
    transformer held on the device for the whole sweep (model offload copies it once, not per count);
    then the audio decoder at each count, on zero latents of the count's shape, held likewise.

The video decoder is not swept: the diffusion decoder's FlexAttention is compiled with dynamic shapes at warmup's two
counts and served the next count at its steady time (the same H100 run). The convolutional VAE decoder
(`video_decoder` "conv") would need a whole decode per count (seconds each at 512x768, minutes for the sweep) to
remove a first-use cost not measured yet; it is not swept either. Requests at another size pay the cost per new
count as before (a warning names the shape). The swept shapes count as warmed (`requests[].audit.warmed_shape`)
and the profile's `warmup.frame_counts` records them (docs/profile.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

from runnerkit.runners.loading import module_on_device
from runnerkit.runners.pipeline import Shape
from runnerkit.runners.request_state import RequestState

if TYPE_CHECKING:
    from runnerkit.models.ltx2.runner25 import LTX25Runner

__all__ = ["SWEEP_KEY", "sweep_counts", "warm_frame_counts"]

SWEEP_KEY = "frame_count_sweep"
"""`RequestState.derived` key marking a sweep request: step 0 of each stage, the transformer's first block only."""


def sweep_counts(bounds: tuple[int, int], step: int, shapes: Sequence[Shape]) -> tuple[tuple[int, int], list[int]]:
    """The sweep's (height, width), the largest warmup shape's, and its frame counts: every count from `bounds`
    (the smallest and largest frame count a prediction gives, `LTX25Runner.frame_bounds`) in steps of `step` (the
    temporal grid) that no warmup shape of that size ran, ascending."""
    height, width, _ = max(shapes, key=lambda s: s[0] * s[1])
    done = {f for h, w, f in shapes if (h, w) == (height, width)}
    return (height, width), [f for f in range(bounds[0], bounds[1] + 1, step) if f not in done]


def warm_frame_counts(runner: LTX25Runner, shared: Any, shapes: Sequence[Shape]) -> None:
    """Run the sweep (module docstring) after warmup ran `shapes`; `shared` is what warmup's shape-independent
    encoders gave (`Warmup.run`). Adds the swept shapes to `runner.warmups.also_warmed` and
    `{"frame_counts": {"size", "counts", "seconds"}}` to its report."""
    assert runner.pipeline is not None, "load_modules first"
    (height, width), counts = sweep_counts(runner.frame_bounds(runner.config), runner.TEMPORAL_FACTOR, shapes)
    if not counts:
        return
    start = time.perf_counter()
    infos = [runner.warmup_info((height, width, f)) for f in counts]
    try:  # the per-shape encoders (i2av: the first frame) depend on the size alone: once
        inputs = runner.run_encoders(RequestState(infos[0], inputs=shared), per_shape=True)
    finally:
        runner.reset_request_state()
    with ExitStack() as held:
        for name in dict.fromkeys(n for stage in runner.pipeline.denoise for n in stage.transformers):
            held.enter_context(module_on_device(runner.placement, name))
        for info in infos:
            req = RequestState(info, inputs=inputs, derived={SWEEP_KEY: True}, step_log_level="DEBUG")
            try:
                runner.run_denoise(req, warmup=True)
            finally:
                runner.reset_request_state()
    if runner.decodes_here:
        for decoder in (d for d in runner.pipeline.decoders if d.output != "video"):
            with module_on_device(runner.placement, decoder.module):
                for info in infos:
                    req = RequestState(info, inputs=inputs)
                    latents = torch.zeros(runner.pipeline.denoise[-1].latent_shape(info), device=runner.device)
                    with runner.profiler.stage(decoder.name), module_on_device(runner.placement, decoder.module, req):
                        decoder.run(req, latents)
    seconds = time.perf_counter() - start
    runner.warmups.also_warmed += [(height, width, f) for f in counts]
    runner.warmups.also_warmed_note = f"frame counts {counts[0]}..{counts[-1]} at {height}x{width}, swept"
    runner.warmups.report["frame_counts"] = {"size": [height, width], "counts": counts, "seconds": round(seconds, 3)}
    logger.info("warmup: {} more frame counts ({}..{}) at {}x{} in {:.2f} s: one step per stage through the first "
                "transformer block, and the audio decoder", len(counts), counts[0], counts[-1], height, width, seconds)
