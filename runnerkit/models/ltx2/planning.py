"""`LTX2Runner`'s planning hooks, as functions of the runner (its `architecture`, `estimate_sources`,
`estimate_memory`, `gemma_sizes` and `fp8_transformer_weights` are these): its architecture, Gemma-3's sizes
and the fp8 storage read before loading (from the checkpoint's headers and config, or the configured
architecture of a synthetic checkpoint still to write, or the release sizes where no file exists), and the
memory estimate built from them (models/ltx2/estimate.py); the FLOPs of a step are flops.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from runnerkit.models.ltx2.arch import LTX2Arch
from runnerkit.models.ltx2.checkpoint_synthetic import tiny_gemma_sizes
from runnerkit.models.ltx2.estimate import fp8_stored_weights, gemma_fields, ltx2_estimate
from runnerkit.models.ltx2.plan_sources import absent_sources, fp8_by_name, release_gemma
from runnerkit.planning.checks import default_sources
from runnerkit.planning.fit import EstimateUnavailable, MemoryEstimate
from runnerkit.runners.pipeline import Shape

if TYPE_CHECKING:
    from runnerkit.models.ltx2.runner import LTX2Runner

__all__ = ["architecture", "estimate_memory", "estimate_sources", "fp8_transformer_weights", "gemma_sizes"]


def architecture(runner: LTX2Runner) -> LTX2Arch:
    """The checkpoint's architecture: from the loaded checkpoint; before loading from its headers and
    config (or the configured one, for a synthetic checkpoint still to write).

    Raises:
        EstimateUnavailable: the checkpoint cannot be read before loading (loading then says why).
    """
    if runner.checkpoint is not None:
        return runner.checkpoint.arch
    if runner.checkpoints.absent() and runner.arch_override is None:
        raise EstimateUnavailable(runner.arch_source)
    try:
        path = runner.checkpoints.path()
        if runner.checkpoints.arch_from_config(path):
            assert runner.arch_override is not None, "a synthetic checkpoint has a configured architecture"
            return runner.arch_override
        return runner.open_checkpoint(path).arch
    except (ValueError, OSError) as exc:  # CheckpointError included
        raise EstimateUnavailable(f"the checkpoint's architecture cannot be read before loading ({exc})") from None


def gemma_sizes(runner: LTX2Runner, arch: LTX2Arch) -> dict[str, int]:
    """The Gemma-3 text model's sizes: from the text encoder folder's config.json (the synthetic
    one's sizes while it is still to be written).

    Raises:
        EstimateUnavailable: the config.json cannot be read.
    """
    cfg = runner.config
    if runner.checkpoint is not None:
        return gemma_fields(runner.checkpoint.text_encoder_path)
    path = runner.checkpoints.path()
    if runner.checkpoints.pending(path):
        return tiny_gemma_sizes(arch)
    folder = Path(cfg.text_encoder_path) if cfg.text_encoder_path is not None else path / "text_encoder"
    if runner.checkpoints.absent() and not (folder / "config.json").is_file():
        return release_gemma(arch)  # planning without the files (plan_sources.py)
    return gemma_fields(folder)


def estimate_sources(runner: LTX2Runner) -> list[str]:
    """Where the estimate before loading takes the architecture, Gemma-3's sizes and fp8 storage from."""
    if runner.checkpoint is not None or not runner.checkpoints.absent() or runner.arch_override is None:
        return default_sources(runner.config)
    cfg, path = runner.config, runner.checkpoints.path()
    folder = Path(cfg.text_encoder_path) if cfg.text_encoder_path is not None else path / "text_encoder"
    return absent_sources(cfg, runner.arch_source, folder, fp8_transformer_weights(runner))


def estimate_memory(runner: LTX2Runner, shape: Shape) -> MemoryEstimate:
    """Text encoder, connectors, (VAE encoder,) both denoise stages, the upsampler, both decoders and
    save of `shape` on `runner.device` (formulas and the release sizes: models/ltx2/estimate.py).

    Raises:
        EstimateUnavailable: see `architecture` and `gemma_sizes`.
    """
    arch = architecture(runner)
    cfg = runner.config
    return ltx2_estimate(arch, gemma_sizes(runner, arch), shape, cfg.fps, cfg.task, runner.dtype, runner.device,
                         cfg.offload, fp8_transformer_weights(runner), runner.lora_slot_rank())


def fp8_transformer_weights(runner: LTX2Runner) -> frozenset[str]:
    """The transformer parameters the checkpoint stores as float8_e4m3fn (an fp8 release; streamed from
    disk as stored), from its headers; none for a synthetic checkpoint still to write.

    Raises:
        EstimateUnavailable: the checkpoint cannot be read before loading.
    """
    ckpt = runner.checkpoint
    if ckpt is None:
        try:
            path = runner.checkpoints.path()
            if runner.checkpoints.absent():
                return fp8_by_name(path, architecture(runner))
            if runner.checkpoints.pending(path):
                return frozenset()
            ckpt = runner.open_checkpoint(path)
        except (ValueError, OSError) as exc:  # CheckpointError included
            raise EstimateUnavailable(f"the checkpoint's headers cannot be read before loading ({exc})") from None
    return fp8_stored_weights(ckpt)
