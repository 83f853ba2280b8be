"""`LTX2Runner`'s planning hooks: its architecture, Gemma-3's sizes and the fp8 storage read before loading
(from the checkpoint's headers and config, or the configured architecture of a synthetic checkpoint still to
write, or the release sizes where no file exists), and the memory estimate built from them
(models/ltx2/estimate.py); the FLOPs of a step come from `LTX2Compute` (flops.py).
"""

from __future__ import annotations

from pathlib import Path

from runnerkit.models.ltx2.arch import LTX2Arch
from runnerkit.models.ltx2.checkpoint_synthetic import tiny_gemma_sizes
from runnerkit.models.ltx2.estimate import fp8_stored_weights, gemma_fields, ltx2_estimate
from runnerkit.models.ltx2.flops import LTX2Compute
from runnerkit.models.ltx2.plan_sources import absent_sources, fp8_by_name, release_gemma
from runnerkit.planning.fit import EstimateUnavailable, MemoryEstimate
from runnerkit.runners.pipeline import Shape

__all__ = ["LTX2Planning"]


class LTX2Planning(LTX2Compute):
    """The architecture, Gemma-3 sizes, fp8 storage and memory estimate of `LTX2Runner` (mixed into it, before
    `DefaultRunner`, whose `estimate_sources` it extends)."""

    def architecture(self) -> LTX2Arch:
        """The checkpoint's architecture: from the loaded checkpoint; before loading from its headers and
        config (or the configured one, for a synthetic checkpoint still to write).

        Raises:
            EstimateUnavailable: the checkpoint cannot be read before loading (loading then says why).
        """
        if self.checkpoint is not None:
            return self.checkpoint.arch
        if self.checkpoints.absent() and self.arch_override is None:
            raise EstimateUnavailable(self.arch_source)
        try:
            path = self.checkpoints.path()
            if self.checkpoints.arch_from_config(path):
                assert self.arch_override is not None, "a synthetic checkpoint has a configured architecture"
                return self.arch_override
            return self.open_checkpoint(path).arch
        except (ValueError, OSError) as exc:  # CheckpointError included
            raise EstimateUnavailable(f"the checkpoint's architecture cannot be read before loading ({exc})") from None

    def gemma_sizes(self, arch: LTX2Arch) -> dict[str, int]:
        """The Gemma-3 text model's sizes: from the text encoder folder's config.json (the synthetic
        one's sizes while it is still to be written).

        Raises:
            EstimateUnavailable: the config.json cannot be read.
        """
        cfg = self.config
        if self.checkpoint is not None:
            return gemma_fields(self.checkpoint.text_encoder_path)
        path = self.checkpoints.path()
        if self.checkpoints.pending(path):
            return tiny_gemma_sizes(arch)
        folder = Path(cfg.text_encoder_path) if cfg.text_encoder_path is not None else path / "text_encoder"
        if self.checkpoints.absent() and not (folder / "config.json").is_file():
            return release_gemma(arch)  # planning without the files (plan_sources.py)
        return gemma_fields(folder)

    def estimate_sources(self) -> list[str]:
        """Where the estimate before loading takes the architecture, Gemma-3's sizes and fp8 storage from."""
        if self.checkpoint is not None or not self.checkpoints.absent() or self.arch_override is None:
            return super().estimate_sources()
        cfg, path = self.config, self.checkpoints.path()
        folder = Path(cfg.text_encoder_path) if cfg.text_encoder_path is not None else path / "text_encoder"
        return absent_sources(cfg, self.arch_source, folder, self.fp8_transformer_weights())

    def estimate_memory(self, shape: Shape) -> MemoryEstimate:
        """Text encoder, connectors, (VAE encoder,) both denoise stages, the upsampler, both decoders and
        save of `shape` on `self.device` (formulas and the release sizes: models/ltx2/estimate.py).

        Raises:
            EstimateUnavailable: see `architecture` and `gemma_sizes`.
        """
        arch = self.architecture()
        cfg = self.config
        return ltx2_estimate(arch, self.gemma_sizes(arch), shape, cfg.fps, cfg.task, self.dtype, self.device,
                             cfg.offload, self.fp8_transformer_weights(), self.lora_slot_rank())

    def fp8_transformer_weights(self) -> frozenset[str]:
        """The transformer parameters the checkpoint stores as float8_e4m3fn (an fp8 release; streamed from
        disk as stored), from its headers; none for a synthetic checkpoint still to write.

        Raises:
            EstimateUnavailable: the checkpoint cannot be read before loading.
        """
        ckpt = self.checkpoint
        if ckpt is None:
            try:
                path = self.checkpoints.path()
                if self.checkpoints.absent():
                    return fp8_by_name(path, self.architecture())
                if self.checkpoints.pending(path):
                    return frozenset()
                ckpt = self.open_checkpoint(path)
            except (ValueError, OSError) as exc:  # CheckpointError included
                raise EstimateUnavailable(f"the checkpoint's headers cannot be read before loading ({exc})") from None
        return fp8_stored_weights(ckpt)
