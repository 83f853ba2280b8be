"""Wan image-to-video (`i2v`) and first-last-frame-to-video (`flf2v`) runners.

Sources: Wan-Video/Wan2.1 `wan/image2video.py` (WanI2V.generate), `wan/first_last_frame2video.py`
(WanFLF2V.generate), Wan-Video/Wan2.2 `wan/image2video.py`; diffusers `WanImageToVideoPipeline`.
What a request does, after the text encoder of text-to-video:

1. Shape. `target_height` x `target_width` is the target AREA; the aspect ratio comes from the
   (first) image: `lat_h = round(sqrt(area * h / w) // 8 // 2 * 2)` (and `lat_w` with `w / h`),
   the video is `8 lat_h` x `8 lat_w` (`wan_resize_shape`). Each frame is resized to it with
   bicubic interpolation (float32, in [-1, 1]); nothing is cropped. flf2v: a last frame of
   another size is first scaled to cover the first frame's size and center-cropped to it (what
   the reference's `last_frame_resize_ratio` + `center_crop` intend).
2. `image_encoder` (Wan2.1 only): CLIP ViT-H/14 penultimate hidden states of the original
   frame(s) (`clip.py`): [1, 257, 1280] for i2v, [1, 514, 1280] for flf2v (first, then last).
3. `vae_encoder`: the VAE posterior mean (normalised) of the resized frame(s) followed (or
   surrounded) by zeros over the whole clip, concatenated after the temporal mask:
   `y` [1, 4 + 16, F_lat, H/8, W/8] (`conditioning.py`).
4. Denoise as text-to-video, the transformer also taking `clip_context` and `y` on both CFG
   branches (the reference passes the same image inputs with the negative prompt).

Wan2.2 i2v (the A14B MoE release) has no CLIP: its experts take `y` only (`image_context` false),
so its pipeline has no `image_encoder` stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from runnerkit.config import RequestConfig, RunnerConfig
from runnerkit.images import ImageInputError, image_size, read_image
from runnerkit.models.wan.clip import CLIPVisionEncoder
from runnerkit.models.wan.clip import keep_fp32 as clip_keep_fp32
from runnerkit.models.wan.conditioning import conditioning_mask, conditioning_video
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.registry import register_runner
from runnerkit.runners.pipeline import EncoderStage, InputInfo, ModuleSpec, OutputKind, Shape
from runnerkit.runners.request_state import RequestState
from runnerkit.weights import assign_state_dict, build_on_meta

VAE_STRIDE = 8
PATCH = 2


def wan_resize_shape(image_height: int, image_width: int, area: int) -> tuple[int, int]:
    """The video (height, width) Wan makes from an image of this size for a target `area` (pixels).

    `lat = round(sqrt(area * aspect) // 8 // 2 * 2)` per side (aspect h/w for the height, w/h for
    the width; Python floats, as the reference's numpy float64), times 8: multiples of 16 whose
    product is at most `area`.

    Raises:
        ImageInputError: the image is so narrow (or the area so small) that a side is 0.
    """
    aspect = image_height / image_width
    lat_h = round(math.sqrt(area * aspect) // VAE_STRIDE // PATCH * PATCH)
    lat_w = round(math.sqrt(area / aspect) // VAE_STRIDE // PATCH * PATCH)
    if lat_h < 1 or lat_w < 1:
        raise ImageInputError(
            f"an image of height {image_height} x width {image_width} pixels over a target area of {area} pixels "
            f"gives a video of height {lat_h * VAE_STRIDE} x width {lat_w * VAE_STRIDE}: use a less extreme aspect "
            "ratio or a larger `target_height` x `target_width`")
    return lat_h * VAE_STRIDE, lat_w * VAE_STRIDE


def resize_frame(frame: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[3, h, w] -> [3, height, width] by bicubic interpolation (align_corners False, float32)."""
    return F.interpolate(frame[None].float(), size=(height, width), mode="bicubic", align_corners=False)[0]


def fit_last_frame(last: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The last frame scaled to cover `height` x `width` (aspect kept), then center-cropped to it.

    Identity when the sizes already agree (the common case).
    """
    h, w = last.shape[1:]
    if (h, w) == (height, width):
        return last
    ratio = max(width / w, height / h)
    covered = resize_frame(last, max(height, round(h * ratio)), max(width, round(w * ratio)))
    top = (covered.shape[1] - height) // 2
    left = (covered.shape[2] - width) // 2
    return covered[:, top : top + height, left : left + width]


@dataclass
class ConditioningFrames:
    """A request's conditioning image(s): as read (CLIP's input) and resized (the VAE's)."""

    first: torch.Tensor
    """[3, h, w] in [-1, 1], the first image as read."""
    last: torch.Tensor | None
    """flf2v: [3, h, w] the last image, already fitted to the first one's size; else None."""
    first_resized: torch.Tensor
    """[3, H, W] at the video size."""
    last_resized: torch.Tensor | None


#: Image request fields per task (the core checks they are given and readable before loading).
IMAGE_TASK_INPUTS: dict[str, tuple[str, ...]] = {"i2v": ("image_path",), "flf2v": ("image_path", "last_frame_path")}
IMAGE_TASK_RESULTS: dict[str, OutputKind] = {"i2v": "video", "flf2v": "video"}
#: The transformer `model_type` each task needs.
IMAGE_TASK_MODEL_TYPES: dict[str, str] = {"i2v": "i2v", "flf2v": "flf2v"}


class WanImageConditioning:
    """Image conditioning of a Wan runner whose task takes images (`runner.images`, made in `WanT2VRunner.__init__`
    from the runner class's `IMAGE_CONDITIONING`: the i2v / flf2v runners and the Wan2.2 MoE i2v one).

    Gives the image encoder module (when the transformer takes CLIP tokens), the `image_encoder` and
    `vae_encoder` stages, the request shape rule (`shape`), and `clip_context` / `y` in every transformer
    call; the runner's hooks `shape_of`, `image_modules`, `image_stages` and `transformer_inputs` call it.
    The runner class sets `TASKS`, `DEFAULTS`, its warmup opt-in and the tables above.
    """

    def __init__(self, runner: WanT2VRunner) -> None:
        self.runner = runner

    # ---- requests --------------------------------------------------------------------------
    @staticmethod
    def shape(request: RequestConfig, area: Shape) -> Shape:
        """(height, width, frames): `area`'s height x width (the config's `target_height` x `target_width`
        filled in) is the area, the image gives the aspect ratio (`wan_resize_shape`).

        Raises:
            ImageInputError: the image is missing, unreadable, or too narrow for the area.
        """
        area_h, area_w, frames = area
        if request.image_path is None:  # validate_request reports the missing image first
            return area_h, area_w, frames
        image_h, image_w = image_size(request.image_path, "image_path")  # header only: called per check
        return (*wan_resize_shape(image_h, image_w, area_h * area_w), frames)

    # ---- pipeline pieces ------------------------------------------------------------------------
    def takes_clip(self) -> bool:
        assert self.runner.checkpoint is not None, "prepare_load first"
        return bool(self.runner.checkpoint.arch.transformer.image_context)

    def modules(self) -> tuple[ModuleSpec, ...]:
        """The CLIP image encoder, for transformers that attend to CLIP tokens (Wan2.1)."""
        return (ModuleSpec("image_encoder", "image_encoder", build=self.build_image_encoder),) if self.takes_clip() else ()

    def stages(self) -> tuple[EncoderStage, ...]:
        """`image_encoder` (Wan2.1) and `vae_encoder`, both per shape (warmup runs them on each)."""
        clip = (EncoderStage("image_encoder", module="image_encoder", run=self.run_image_encoder, per_shape=True),)
        vae = (EncoderStage("vae_encoder", module="vae", run=self.run_vae_encoder, per_shape=True),)
        return (*(clip if self.takes_clip() else ()), *vae)

    def build_image_encoder(self, device: torch.device) -> CLIPVisionEncoder:
        """The CLIP vision tower with its weights, on `device` (LayerNorms kept in float32)."""
        ckpt = self.runner.checkpoint
        assert ckpt is not None and ckpt.arch.image_encoder is not None, "an i2v / flf2v checkpoint with CLIP"
        model = build_on_meta(lambda: CLIPVisionEncoder(ckpt.arch.image_encoder))
        assign_state_dict(model, ckpt.image_encoder_state_dict(), "image_encoder", dtype=self.runner.dtype,
                          keep_fp32=clip_keep_fp32, device=device)
        return model.to(device).eval().requires_grad_(False)

    # ---- request stages -------------------------------------------------------------------------
    def conditioning_frames(self, info: InputInfo) -> ConditioningFrames:
        """The request's image(s) read and resized to the video size; for warmup, mid-grey frames
        of the warmup shape (only their sizes matter)."""
        last_needed = self.runner.config.task == "flf2v"
        if info.warmup:
            first = torch.zeros(3, info.height, info.width)
            last = first.clone() if last_needed else None
        else:
            assert info.image_path is not None, "validate_request requires image_path"
            first = read_image(info.image_path, "image_path")
            last = None
            if last_needed:
                assert info.last_frame_path is not None, "validate_request requires last_frame_path"
                last = fit_last_frame(read_image(info.last_frame_path, "last_frame_path"), *first.shape[1:])
        return ConditioningFrames(first, last, resize_frame(first, info.height, info.width),
                                  None if last is None else resize_frame(last, info.height, info.width))

    def _with_frames(self, req: RequestState) -> Any:
        inputs = req.inputs
        return inputs if inputs.frames is not None else replace(inputs, frames=self.conditioning_frames(req.info))

    @torch.inference_mode()
    def run_image_encoder(self, req: RequestState) -> Any:
        """CLIP tokens of the frame(s) as read -> `clip_context` [1, 257 * frames, 1280] float32."""
        inputs = self._with_frames(req)
        frames = [inputs.frames.first] + ([inputs.frames.last] if inputs.frames.last is not None else [])
        encoder = req.modules["image_encoder"]
        tokens = torch.cat([encoder.encode(f[None]) for f in frames])  # [n, 257, 1280]
        return replace(inputs, clip_context=tokens.reshape(1, -1, tokens.shape[-1]))

    @torch.inference_mode()
    def run_vae_encoder(self, req: RequestState) -> Any:
        """`y` = cat(temporal mask, normalised VAE latents of the conditioning clip) [1, 4 + z, f, h, w];
        the frames are dropped afterwards."""
        info, inputs = req.info, self._with_frames(req)
        frames = inputs.frames
        video = conditioning_video(frames.first_resized, info.frames, frames.last_resized)  # [3, F, H, W]
        latents = req.modules["vae"].encode(video[None])
        mask = conditioning_mask(info.frames, info.height // VAE_STRIDE, info.width // VAE_STRIDE,
                                 last_frame=frames.last is not None).to(latents.device)
        y = torch.cat([mask[None], latents], dim=1)  # [1, 4 + z, F_lat, h, w]
        return replace(inputs, y=y, frames=None)

    def transformer_inputs(self, req: RequestState) -> dict[str, torch.Tensor]:
        """The image inputs of every transformer call: `y`, and `clip_context` for Wan2.1."""
        inputs = req.inputs
        assert inputs.y is not None, "run the vae_encoder stage first"
        extra = {"y": inputs.y}
        if inputs.clip_context is not None:
            extra["clip_context"] = inputs.clip_context
        return extra


# ---- the Wan2.1 image runners (the Wan2.2 MoE i2v runner is in moe.py) -----------------------------


@register_runner("wan2.1")
class WanI2VRunner(WanT2VRunner):
    """Wan2.1 image-to-video (the I2V-14B-480P / 720P releases, and the tiny `debug` architecture)."""

    TASKS = ("i2v",)
    IMAGE_CONDITIONING = WanImageConditioning
    IMAGE_INPUTS = IMAGE_TASK_INPUTS
    RESULT_KINDS = IMAGE_TASK_RESULTS
    TASK_MODEL_TYPES = IMAGE_TASK_MODEL_TYPES
    #: Wan2.1 i2v (`wan/configs/wan_i2v_14B.py`, `generate.py`): the 480P release's area 480 x 832,
    #: 81 frames at 16 fps, 40 UniPC steps, shift 5.0, guidance 5.0.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": 40, "target_height": 480, "target_width": 832, "target_video_length": 81, "fps": 16,
        "sample_shift": 5.0, "sample_guide_scale": 5.0, "scheduler": "unipc", "scheduler_spacing": "train_range"}

    # ---- warmup opt-in (this class's own) -----------------------------------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("i2v",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> two request shapes (height, width, frames): what Wan's supported sizes give
    #: (an image of that aspect ratio over that area), 480P and 720P.
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((32, 32, 5), (48, 80, 9)),
        # 464, not 480: Wan's rule on a 480:832 image over the 480 x 832 area gives sqrt(399360 * (480 / 832))
        # = 479.99999999999994 in float64, so lat_h = 58 (the reference's own rounding)
        "14B": ((464, 832, 81), (720, 1280, 81)),
    }


@register_runner("wan2.1")
class WanFLF2VRunner(WanT2VRunner):
    """Wan2.1 first-last-frame-to-video (the FLF2V-14B-720P release, and the tiny `debug` architecture)."""

    TASKS = ("flf2v",)
    IMAGE_CONDITIONING = WanImageConditioning
    IMAGE_INPUTS = IMAGE_TASK_INPUTS
    RESULT_KINDS = IMAGE_TASK_RESULTS
    TASK_MODEL_TYPES = IMAGE_TASK_MODEL_TYPES
    #: Wan2.1 flf2v (`wan/configs/wan_flf2v_14B.py`, `generate.py`): area 720 x 1280, 81 frames at
    #: 16 fps, 50 UniPC steps, shift 16.0, guidance 5.0.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": 50, "target_height": 720, "target_width": 1280, "target_video_length": 81, "fps": 16,
        "sample_shift": 16.0, "sample_guide_scale": 5.0, "scheduler": "unipc", "scheduler_spacing": "train_range"}

    @classmethod
    def validate_request(cls, request: RequestConfig, config: RunnerConfig) -> None:
        """The core checks, plus: at least two frames (first and last differ)."""
        super().validate_request(request, config)
        frames = request.target_video_length or cls.resolve_config(config).target_video_length
        if frames < 5:
            raise ValueError(f"`target_video_length` must be at least 5 for flf2v (first and last frame), got {frames}")

    # ---- warmup opt-in (this class's own) -----------------------------------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("flf2v",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((32, 32, 5), (48, 80, 9)),
        "14B": ((720, 1280, 81), (1280, 720, 81)),
    }


__all__ = ["IMAGE_TASK_INPUTS", "IMAGE_TASK_MODEL_TYPES", "IMAGE_TASK_RESULTS", "ConditioningFrames",
           "WanFLF2VRunner", "WanI2VRunner", "WanImageConditioning", "fit_last_frame", "resize_frame",
           "wan_resize_shape"]
