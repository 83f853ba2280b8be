"""A tiny two-stage image family, to show the pipeline description is the right seam.

    text encoder -> stage 1 (Euler, low resolution) -> latent upsampler (2x)
    -> stage 2 (UniPC, from the upsampled latents at strength 0.5) -> image decoder -> PNG

It overrides no lifecycle verb and no request path: it describes its pipeline and fills in the
small hooks, and the unchanged base machinery serves it (requests, warmup, profiling, placement).
Weights are drawn from a private generator (never the global RNG), so two runners are identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from runnerkit.registry import RUNNERS, register_runner
from runnerkit.runners.default import DefaultRunner
from runnerkit.planning.fit import MemoryEstimate, StageFootprint, module_footprint
from runnerkit.runners.request_state import RequestState
from runnerkit.runners.pipeline import (
    DecoderStage,
    DenoiseStage,
    EncoderStage,
    ModuleSpec,
    OutputSpec,
    Pipeline,
    Shape,
)

NAME = "two_stage_test"
C, D, L = 4, 8, 8  # latent channels, text width, text tokens


def _init(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval().requires_grad_(False)


class ToyTextEncoder(nn.Module):
    """UTF-8 bytes of the prompt (first L, zero-padded) -> [1, L, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, D)

    def forward(self, text: str) -> torch.Tensor:
        ids = list(text.encode())[:L] + [0] * max(0, L - len(text.encode()))
        return self.embed(torch.tensor([ids], device=self.embed.weight.device))


class ToyDenoiser(nn.Module):
    """latents [B, C, h, w], timestep [B], context [B, L, D] -> velocity [B, C, h, w]."""

    def __init__(self) -> None:
        super().__init__()
        self.ctx = nn.Linear(D, C)
        self.time = nn.Linear(1, C)
        self.blocks = nn.ModuleList([nn.Conv2d(C, C, 3, padding=1) for _ in range(2)])

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        bias = self.ctx(context.mean(1)) + self.time(t.float()[:, None] / 1000)  # [B, C]
        h = x + bias[:, :, None, None]
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


class ToyUpsampler(nn.Module):
    """latents [B, C, h, w] -> [B, C, 2h, 2w]."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(C, C, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.interpolate(x, scale_factor=2, mode="nearest"))


class ToyDecoder(nn.Module):
    """latents [B, C, h, w] -> image [B, 3, 8h, 8w] in [-1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(C, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(nn.functional.interpolate(self.proj(x), scale_factor=8, mode="nearest"))


class TwoStageImageRunner(DefaultRunner):
    """Text-to-image in two denoise stages with a latent upsampler between them."""

    TASKS = ("t2i",)
    SPATIAL_FACTOR = 16
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": 4, "target_height": 32, "target_width": 64, "target_video_length": 1, "fps": 1,
        "sample_shift": 3.0, "sample_guide_scale": 4.0, "scheduler": "euler",
        "scheduler_spacing": "diffusers"}
    RESULT_KINDS = {"t2i": "image"}
    STAGE2_STEPS = 6
    STAGE2_STRENGTH = 0.5

    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("t2i",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model")
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {"toy": ((32, 32, 1), (32, 64, 1))}

    @classmethod
    def validate_shape(cls, height: int, width: int, frames: int) -> None:
        super().validate_shape(height, width, 1)
        if frames != 1:
            raise ValueError(f"`target_video_length` must be 1 for an image (got {frames})")

    def prepare_load(self) -> None:
        """Nothing to read: the weights come from fixed seeds."""

    MODULES: ClassVar[dict[str, type[nn.Module]]] = {"text_encoder": ToyTextEncoder, "transformer": ToyDenoiser,
                                                     "transformer_2": ToyDenoiser, "upsampler": ToyUpsampler,
                                                     "decoder": ToyDecoder}

    def estimate_memory(self, shape: Shape) -> MemoryEstimate:
        """A deliberately simple estimate (float32): a denoiser step keeps at most 8 latent-size tensors,
        the decoder its 1/8-resolution projection plus two full images, saving three images."""
        h, w, _ = shape
        with torch.device("meta"):
            modules = {name: module_footprint(factory(), torch.float32) for name, factory in self.MODULES.items()}
        lat1, lat2, image = C * (h // 16) * (w // 16) * 4, C * (h // 8) * (w // 8) * 4, 3 * h * w * 4
        return MemoryEstimate(modules=modules, stages=(
            StageFootprint("text_encoder", "text_encoder", 2 * L * D * 4),
            StageFootprint("stage1", "transformer", 8 * lat1),
            StageFootprint("upsampler", "upsampler", lat1 + 2 * lat2),
            StageFootprint("stage2", "transformer_2", 8 * lat2),
            StageFootprint("image_decoder", "decoder", lat2 + 2 * image),
            StageFootprint("save", None, 3 * image)))

    def flavour(self) -> str | None:
        return "toy"

    def describe_pipeline(self) -> Pipeline:
        cfg = self.config

        def latents(scale: int) -> Any:
            return lambda info: (1, C, info.height // scale, info.width // scale)

        def build(factory: Any, seed: int) -> Any:
            return lambda device: _init(factory(), seed).to(device)

        return Pipeline(
            modules=(ModuleSpec("text_encoder", "text_encoder", build=build(ToyTextEncoder, 1)),
                     ModuleSpec("transformer", "transformer", build=build(ToyDenoiser, 2)),
                     ModuleSpec("transformer_2", "transformer", build=build(ToyDenoiser, 3)),
                     ModuleSpec("upsampler", "upsampler", build=build(ToyUpsampler, 4)),
                     ModuleSpec("decoder", "decoder", build=build(ToyDecoder, 5))),
            encoders=(EncoderStage("text_encoder", module="text_encoder", run=self.run_text_encoder),),
            denoise=(DenoiseStage("stage1", transformers=("transformer",), steps=cfg.infer_steps,
                                  scheduler=cfg.scheduler, shift=cfg.sample_shift, spacing=cfg.scheduler_spacing,
                                  latent_shape=latents(16)),
                     DenoiseStage("stage2", transformers=("transformer_2",), steps=self.STAGE2_STEPS,
                                  scheduler="unipc", shift=1.0, spacing="diffusers", latent_shape=latents(8),
                                  strength=self.STAGE2_STRENGTH, transition="upsampler")),
            decoders=(DecoderStage("image_decoder", module="decoder", output="image", run=self.run_decoder),),
            outputs=(OutputSpec("image", "image"),),
        )

    @torch.inference_mode()
    def run_text_encoder(self, req: RequestState) -> dict[str, torch.Tensor]:
        """The request's inputs: {"cond", "uncond"} -> [1, L, D]. Returned, never kept on the runner (it
        lives in the request's `RequestState`; a family's `clear_request_state` is for caches across steps)."""
        encoder = req.modules["text_encoder"]
        return {"cond": encoder(req.info.prompt), "uncond": encoder(req.info.negative_prompt)}

    @torch.inference_mode()
    def run_step(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: torch.Tensor,
                 timestep: torch.Tensor, step_index: int) -> torch.Tensor:
        cond = model(latents, timestep, req.inputs["cond"])
        uncond = model(latents, timestep, req.inputs["uncond"])
        return uncond + self.config.sample_guide_scale * (cond - uncond)

    @torch.inference_mode()
    def run_decoder(self, req: RequestState, latents: torch.Tensor) -> torch.Tensor:
        return req.modules["decoder"](latents)  # [1, 3, H, W]


if NAME not in RUNNERS:  # the test modules may import this file more than once
    register_runner(NAME)(TwoStageImageRunner)


def config_dict(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """A runner config of the two-stage family on the CPU (its weights need no checkpoint)."""
    return {"model_cls": NAME, "task": "t2i", "model_path": str(tmp_path), "dtype": "float32", "device": "cpu",
            **overrides}
