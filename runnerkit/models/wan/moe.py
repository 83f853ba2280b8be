"""Wan2.2 MoE runners (the A14B releases, t2v and i2v): two experts in one denoising loop.

Source: Wan-Video/Wan2.2 `wan/text2video.py` (WanT2V.generate) and `wan/configs/wan_t2v_A14B.py`;
diffusers `WanPipeline` with `transformer_2` and `boundary_ratio`. Each step runs one expert,
chosen on the step's timestep `t` (an integer in [0, 1000)):

    t >= boundary * num_train_timesteps  ->  `transformer`   (high-noise expert, the early steps)
    t <  boundary * num_train_timesteps  ->  `transformer_2` (low-noise expert, the late steps)

with its own CFG scale. Public defaults (t2v A14B): boundary 0.875, shift 12.0, 40 steps,
guidance 4.0 (high-noise) and 3.0 (low-noise); (i2v A14B, Wan2.2 `wan/configs/wan_i2v_A14B.py`):
boundary 0.900, shift 5.0, 40 steps, guidance 3.5 for both. Order of the pair: runnerkit's
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
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import LAYOUTS
from runnerkit.models.wan.i2v import IMAGE_TASK_INPUTS, IMAGE_TASK_MODEL_TYPES, IMAGE_TASK_RESULTS, WanImageConditioning
from runnerkit.models.wan.moe_checkpoint import EXPERTS, WanMoECheckpoint, write_synthetic_moe
from runnerkit.models.wan.runner import WanT2VRunner, flavour_of
from runnerkit.models.wan.tokenizer import WanTokenizer
from runnerkit.models.wan.transformer import WanTransformer3D
from runnerkit.registry import register_runner
from runnerkit.runners.pipeline import DenoiseStage, ModuleSpec, Shape
from runnerkit.runners.request_state import RequestState

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

    STREAM_MODULES: ClassVar[tuple[str, ...]] = ("text_encoder", *EXPERTS)

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        self.moe_checkpoint: WanMoECheckpoint | None = None

    @staticmethod
    def check_guidance_settings(config: RunnerConfig) -> None:
        """One guidance scale (both experts) or a pair [high-noise, low-noise]; any `boundary` in (0, 1)."""

    @staticmethod
    def parse_arch(model: dict[str, Any] | None, partial: bool = False) -> WanArch:
        """As `WanT2VRunner.parse_arch`, with Wan2.2's rule: i2v experts take no CLIP image tokens
        (`transformer.image_context` false unless the config says otherwise, which is then refused)."""
        model = dict(model or {})
        transformer = dict(model.get("transformer") or {})
        if transformer.get("model_type", "t2v") != "t2v" and "image_context" not in transformer:
            model["transformer"] = {**transformer, "image_context": False}
        return WanT2VRunner.parse_arch(model, partial)

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
    def open_checkpoint(self, path: Path, raw: bool = False) -> WanMoECheckpoint:
        """The MoE checkpoint at `path` (`raw`: without the config's `model` over it); both expert
        folders must be there (checked before any weight is read)."""
        return WanMoECheckpoint.open(path, override=None if raw else self.config.model)

    def prepare_load(self) -> None:
        """Checkpoint (both experts) checked, its architecture and the resolved `boundary` into the
        config, the tokenizer. The high-noise expert's view serves the shared text encoder and VAE.

        Raises:
            CheckpointError: an expert folder is missing, or a file is missing or damaged (named).
        """
        self.check_task_fits()
        self.moe_checkpoint = moe = self.checkpoints.locate()
        self.check_checkpoint_files(moe)
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

    def transformer_names(self) -> tuple[str, ...]:
        return EXPERTS

    def transformer_specs(self) -> tuple[ModuleSpec, ...]:
        """Both experts, high-noise first, each built (or streamed) from its own folder; the
        pipeline's one denoise stage picks one per step (`select_transformer`)."""
        moe = self.moe_checkpoint
        assert moe is not None, "prepare_load first"
        return tuple(ModuleSpec(name, "transformer",
                                build=partial(self.build_transformer, checkpoint=moe.experts[name], name=name),
                                stream=partial(self.stream_transformer, moe.experts[name], name),
                                blocks=WanTransformer3D.STREAM_SPEC.blocks_attr, fp8_skip=WanTransformer3D.FP8_SKIP)
                     for name in EXPERTS)

    # ---- the expert and guidance of a step ---------------------------------------------------
    def boundary_timestep(self, stage: DenoiseStage) -> float:
        """`boundary * num_train_timesteps` (875 for the t2v default)."""
        assert self.config.boundary is not None, "prepare_load resolves the boundary"
        return self.config.boundary * self.schedulers[stage.name].num_train_timesteps

    def select_transformer(self, req: RequestState, stage: DenoiseStage, step_index: int,
                           timestep: torch.Tensor) -> str:
        """High-noise `transformer` while `t >= boundary * num_train_timesteps`, else low-noise
        `transformer_2` (Wan2.2 `_prepare_model_for_timestep`; diffusers WanPipeline)."""
        t = float(timestep.flatten()[0])
        return EXPERTS[0] if t >= self.boundary_timestep(stage) else EXPERTS[1]

    def guide_scale(self, req: RequestState, stage: DenoiseStage, step_index: int, timestep: torch.Tensor) -> float:
        """The CFG scale of the step's expert: `sample_guide_scale` [high-noise, low-noise] (one number: both)."""
        scale = self.config.sample_guide_scale
        if not isinstance(scale, tuple):
            return float(scale)  # type: ignore[arg-type]
        return float(scale[EXPERTS.index(self.select_transformer(req, stage, step_index, timestep))])

    def sidecar_extra(self, req: RequestState) -> dict[str, Any]:
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


@register_runner("wan2.2_moe")
class WanMoEI2VRunner(WanMoERunner):
    """Wan2.2 MoE image-to-video (the I2V-A14B release): experts with 36 input channels that take
    the first frame through the VAE latents `y` only (no CLIP image encoder; i2v.py)."""

    TASKS = ("i2v",)
    IMAGE_CONDITIONING = WanImageConditioning
    IMAGE_INPUTS = IMAGE_TASK_INPUTS
    RESULT_KINDS = IMAGE_TASK_RESULTS
    TASK_MODEL_TYPES = IMAGE_TASK_MODEL_TYPES
    #: Wan2.2 i2v A14B (`wan/configs/wan_i2v_A14B.py`, `generate.py`): area 720 x 1280, 81 frames at
    #: 16 fps, 40 UniPC steps, shift 5.0, guidance 3.5 for both experts.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": 40, "target_height": 720, "target_width": 1280, "target_video_length": 81, "fps": 16,
        "sample_shift": 5.0, "sample_guide_scale": (3.5, 3.5), "scheduler": "unipc", "scheduler_spacing": "train_range"}
    #: Expert switch of Wan2.2 i2v A14B (`boundary = 0.900`).
    DEFAULT_BOUNDARY: ClassVar[float] = 0.900

    # ---- warmup opt-in (this class's own) -----------------------------------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("i2v",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> two request shapes (height, width, frames): Wan2.2's supported i2v sizes 480P and 720P.
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((32, 32, 5), (48, 80, 9)),
        "A14B": ((464, 832, 81), (720, 1280, 81)),  # 464: see WanI2VRunner.WARMUP_SHAPES
    }
