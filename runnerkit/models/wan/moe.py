"""Wan2.2 MoE text-to-video runner (the A14B release): two experts in one denoising loop.

Source: Wan-Video/Wan2.2 `wan/text2video.py` (WanT2V.generate) and `wan/configs/wan_t2v_A14B.py`;
diffusers `WanPipeline` with `transformer_2` and `boundary_ratio`. Each step runs one expert,
chosen on the step's timestep `t` (an integer in [0, 1000)):

    t >= boundary * num_train_timesteps  ->  `transformer`   (high-noise expert, the early steps)
    t <  boundary * num_train_timesteps  ->  `transformer_2` (low-noise expert, the late steps)

with its own CFG scale. Public defaults (t2v A14B): boundary 0.875, shift 12.0, 40 steps,
guidance 4.0 (high-noise) and 3.0 (low-noise). Order of the pair: runnerkit's
`sample_guide_scale` is [high-noise, low-noise] (as diffusers' `guidance_scale`,
`guidance_scale_2`); Wan2.2's `sample_guide_scale = (3.0, 4.0)` is (low-noise, high-noise).

Placement: both experts are pipeline modules. With `offload.mode: model` only the expert in
use is on the device (the loop moves the other one out before the switch); with block/phase
streaming each expert streams its own blocks through its own streamer; under `lazy_load` each
expert is built for its run of steps and torn down after.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from loguru import logger

from runnerkit.config import RunnerConfig
from runnerkit.models.wan.checkpoint import LAYOUTS
from runnerkit.models.wan.moe_checkpoint import EXPERTS, WanMoECheckpoint, write_synthetic_moe
from runnerkit.models.wan.runner import WanT2VRunner, flavour_of
from runnerkit.models.wan.tokenizer import WanTokenizer
from runnerkit.registry import register_runner
from runnerkit.runners.pipeline import (
    DecoderStage,
    DenoiseStage,
    EncoderStage,
    InputInfo,
    ModuleSpec,
    OutputSpec,
    Pipeline,
    Shape,
)

#: Wan2.1 flavour of the experts' architecture -> MoE flavour name.
MOE_FLAVOURS: dict[str, str] = {"debug": "debug", "14B": "A14B"}


@register_runner("wan2.2_moe")
class WanMoERunner(WanT2VRunner):
    """Wan2.2 MoE text-to-video: high-noise expert `transformer`, low-noise expert `transformer_2`."""

    TASKS = ("t2v",)
    #: Wan2.2 t2v A14B defaults (`wan_t2v_A14B.py`, `generate.py`): 720x1280, 81 frames at 16 fps,
    #: 40 UniPC steps, shift 12.0, guidance [high-noise 4.0, low-noise 3.0].
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": 40, "target_height": 720, "target_width": 1280, "target_video_length": 81, "fps": 16,
        "sample_shift": 12.0, "sample_guide_scale": (4.0, 3.0), "scheduler": "unipc", "scheduler_spacing": "train_range"}
    #: Expert switch of Wan2.2 t2v A14B (`boundary = 0.875`), used when neither the config nor the
    #: checkpoint (diffusers `boundary_ratio`) gives one.
    DEFAULT_BOUNDARY: ClassVar[float] = 0.875
    RESULT_KINDS = {"t2v": "video"}
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {"t2v": ()}

    # ---- warmup opt-in (this class's own; not inherited from WanT2VRunner) --------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("t2v",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> (small/square, production/non-square) shapes as (height, width, frames).
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((32, 32, 5), (48, 80, 9)),
        "A14B": ((480, 480, 17), (720, 1280, 81)),
    }

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        self.moe_checkpoint: WanMoECheckpoint | None = None

    @staticmethod
    def check_guidance_settings(config: RunnerConfig) -> None:
        """One guidance scale (both experts) or a pair [high-noise, low-noise]; any `boundary` in (0, 1)."""

    # ---- synthetic checkpoints ------------------------------------------------------------
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = LAYOUTS

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Random weights of `config.model`'s architecture, both experts, in `layout` (moe_checkpoint.py)."""
        if options.pop("transformer_only", False):
            raise ValueError("`transformer_only` is not available for wan2.2_moe: its checkpoints are written whole")
        write_synthetic_moe(cls.parse_arch(config.model), out, seed, dtype, layout,  # type: ignore[arg-type]
                            boundary=config.boundary, **options)

    # ---- loading -----------------------------------------------------------------------
    def open_checkpoint(self, path: Path) -> WanMoECheckpoint:
        """The MoE checkpoint at `path`; both expert folders must be there (checked before any weight is read)."""
        return WanMoECheckpoint.open(path, override=self.config.model)

    def prepare_load(self) -> None:
        """Checkpoint (both experts) checked, its architecture and the resolved `boundary` into the
        config, the tokenizer. The high-noise expert's view serves the shared text encoder and VAE.

        Raises:
            CheckpointError: an expert folder is missing, or a file is missing or damaged (named).
        """
        self.moe_checkpoint = moe = self.locate_checkpoint()
        moe.check_files()
        self.checkpoint = moe.experts["transformer"]
        boundary = self.config.boundary if self.config.boundary is not None else (moe.boundary or self.DEFAULT_BOUNDARY)
        logger.info("MoE checkpoint {} ({} layout), flavour {}, boundary {} (high-noise expert for t >= {:g})",
                    moe.path, moe.layout, self.flavour(), boundary, boundary * 1000)
        self.update_config(model=moe.arch.model_dump(mode="json"), model_path=str(moe.path), boundary=boundary)
        self.tokenizer = WanTokenizer.from_file(self.checkpoint.tokenizer_path())

    def flavour(self) -> str | None:
        """`debug` or `A14B`, from the experts' (shared) architecture."""
        if self.moe_checkpoint is not None:
            return MOE_FLAVOURS.get(flavour_of(self.moe_checkpoint.arch.transformer) or "")
        return MOE_FLAVOURS.get(super().flavour() or "")

    def describe_pipeline(self) -> Pipeline:
        """UMT5 -> one denoise stage over the two experts (CFG, scale per expert) -> VAE decoder -> video."""
        cfg, moe = self.config, self.moe_checkpoint
        assert moe is not None, "prepare_load first"
        experts = tuple(
            ModuleSpec(name, "transformer",
                       build=partial(self.build_transformer, checkpoint=moe.experts[name], name=name),
                       stream=partial(self.stream_transformer, moe.experts[name], name))
            for name in EXPERTS)
        return Pipeline(
            modules=(ModuleSpec("text_encoder", "text_encoder", build=self.build_text_encoder), *experts,
                     ModuleSpec("vae", "decoder", build=self.build_vae)),
            encoders=(EncoderStage("text_encoder", module="text_encoder", run=self.run_text_encoder),),
            denoise=(DenoiseStage("transformer", transformers=EXPERTS, steps=cfg.infer_steps,
                                  scheduler=cfg.scheduler, shift=cfg.sample_shift, spacing=cfg.scheduler_spacing,
                                  latent_shape=self.latent_shape),),
            decoders=(DecoderStage("vae_decoder", module="vae", output="video", run=self.run_vae_decoder),),
            outputs=(OutputSpec("video", "video"),),
        )

    # ---- the expert and guidance of a step ---------------------------------------------------
    def boundary_timestep(self, stage: DenoiseStage) -> float:
        """`boundary * num_train_timesteps` (875 for the t2v default)."""
        assert self.config.boundary is not None, "prepare_load resolves the boundary"
        return self.config.boundary * self.schedulers[stage.name].num_train_timesteps

    def select_transformer(self, stage: DenoiseStage, step_index: int, timestep: torch.Tensor) -> str:
        """High-noise `transformer` while `t >= boundary * num_train_timesteps`, else low-noise
        `transformer_2` (Wan2.2 `_prepare_model_for_timestep`; diffusers WanPipeline)."""
        t = float(timestep.flatten()[0])
        return EXPERTS[0] if t >= self.boundary_timestep(stage) else EXPERTS[1]

    def guide_scale(self, stage: DenoiseStage, step_index: int, timestep: torch.Tensor) -> float:
        """The CFG scale of the step's expert: `sample_guide_scale` [high-noise, low-noise] (one number: both)."""
        scale = self.config.sample_guide_scale
        if not isinstance(scale, tuple):
            return float(scale)  # type: ignore[arg-type]
        return float(scale[EXPERTS.index(self.select_transformer(stage, step_index, timestep))])

    def sidecar_extra(self, info: InputInfo) -> dict[str, Any]:
        """The expert switch the request ran with."""
        return {"boundary": self.config.boundary}

    def clear_request_state(self) -> None:
        """Each expert's per-grid RoPE tables and the VAE feature cache are request state."""
        for name in EXPERTS:
            expert = self.modules.get(name)
            if expert is not None:
                expert.clear_cache()  # type: ignore[operator]
        if self.vae is not None:
            self.vae.clear_cache()
