"""Qwen-Image image editing (task i2i): the Edit and Edit-Plus releases, one or more reference images.

Source: diffusers `QwenImageEditPipeline` and `QwenImageEditPlusPipeline`
(pipelines/qwenimage/pipeline_qwenimage_edit*.py). Per reference image, in request order
(`image_path`, then `extra_image_paths`):

- the vision-language encoder sees it resized to about `edit.vl_image_area` pixels (Edit-Plus:
  384x384; Edit: the VAE size), inside the prompt template (Edit-Plus: each announced as
  `Picture {i}:`), for the prompt and for the negative prompt alike;
- the VAE encodes it resized to about `edit.vae_image_area` pixels (1024x1024), keeping its aspect
  ratio on a 32-pixel grid (`calculate_dimensions`); its packed latents follow the target's in the
  transformer's sequence, on RoPE frame index 1, 2, ... (the target is frame 0), and only the
  target's tokens are denoised.

The output size: `target_height` x `target_width` is the target *area*; the image keeps the aspect
ratio of the last reference (as the reference pipelines do by default): `calculate_dimensions(area,
width / height)`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from runnerkit.config import RequestConfig, RunnerConfig
from runnerkit.images import ImageInputError, image_size, read_pil_image
from runnerkit.models.qwen_image import text_encoder as te
from runnerkit.models.qwen_image.arch import QwenImageArch
from runnerkit.models.qwen_image.checkpoint import QwenCheckpoint
from runnerkit.models.qwen_image.latents import pack_latents
from runnerkit.models.qwen_image.runner import QwenImageRunner, QwenInputs
from runnerkit.models.qwen_image.vae import encode_image
from runnerkit.registry import register_runner
from runnerkit.runners.pipeline import EncoderStage, InputInfo, Shape
from runnerkit.runners.request_state import RequestState

#: Placeholder reference names of warmup's dummy requests (never opened: warmup uses grey images).
WARMUP_REFERENCE = "<warmup reference {}>"
#: Grey of warmup's reference images (mid-range; only their size matters).
WARMUP_GREY = (128, 128, 128)


def resize_to_area(image: Image.Image, area: int) -> Image.Image:
    """`image` resized to about `area` pixels with its aspect ratio, sides multiples of 32
    (`calculate_dimensions`), with Lanczos and no reducing gap, as diffusers' `VaeImageProcessor.resize`."""
    width, height = te.calculate_dimensions(area, image.width / image.height)
    return image.resize((width, height), resample=Image.Resampling.LANCZOS, reducing_gap=None)


def to_pixels(image: Image.Image) -> torch.Tensor:
    """RGB Pillow image -> [3, H, W] float32 in [-1, 1], as diffusers' `VaeImageProcessor.preprocess`
    computes it (`2 * (x / 255) - 1`)."""
    x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)  # [H, W, 3]
    return (2.0 * x - 1.0).permute(2, 0, 1).contiguous()


def reference_fields(info: InputInfo) -> list[str]:
    """The request fields of `info.reference_paths`, in order, for messages."""
    return ["image_path", *(f"extra_image_paths[{k}]" for k in range(len(info.extra_image_paths)))]


def edit_shapes(area: int) -> tuple[Shape, Shape]:
    """(square, 16:9) output shapes a request of target area `area` gives (its warmup shapes)."""
    square = te.calculate_dimensions(area, 1.0)
    wide = te.calculate_dimensions(area, 16 / 9)
    return ((square[1], square[0], 1), (wide[1], wide[0], 1))


@register_runner("qwen_image")
class QwenImageEditRunner(QwenImageRunner):
    """Qwen-Image-Edit / Edit-Plus image editing (20B, and the tiny `debug` architecture)."""

    TASKS = ("i2i",)
    #: diffusers QwenImageEdit(Plus)Pipeline defaults: 50 steps, true CFG scale 4.0, output area
    #: 1024x1024 with the last reference's aspect ratio.
    DEFAULTS: ClassVar[dict[str, Any]] = {**QwenImageRunner.DEFAULTS, "target_height": 1024, "target_width": 1024}
    RESULT_KINDS = {"i2i": "image"}
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {"i2i": ("image_path",)}
    #: Edit-Plus takes up to 3 references (the checkpoint's `edit.max_images`; Edit: 1, checked per request).
    EXTRA_IMAGES: ClassVar[dict[str, int]] = {"i2i": 2}
    #: Edit prompts run unpadded (no text buckets yet: their length follows the reference images'
    #: token counts, ~1300 tokens for one Edit reference; docs/prompt_lengths.md).
    TEXT_BUCKETS: ClassVar[tuple[int, ...] | None] = None

    # ---- warmup opt-in (declared here; not inherited) --------------------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("i2i",)
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> (square, 16:9) outputs of the default target area (debug: 64x64, 20B: 1024x1024).
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": edit_shapes(64 * 64),
        "20B": edit_shapes(1024 * 1024),
    }

    @classmethod
    def shape_of(cls, request: RequestConfig, config: RunnerConfig) -> Shape:
        """Output (height, width, 1): the target area with the last reference image's aspect ratio.

        Raises:
            ValueError: naming `target_height` x `target_width` when their area is too small for any output.
            ImageInputError: naming the reference whose aspect ratio leaves a side below 32 pixels.
        """
        area = (request.target_height or config.target_height) * (request.target_width or config.target_width)
        frames = request.target_video_length or config.target_video_length
        refs = [request.image_path, *(request.extra_image_paths or [])]
        last = refs[-1]
        if last is None:  # validate_request has refused the request already; a neutral shape for messages
            return (request.target_height or config.target_height, request.target_width or config.target_width, frames)
        if min(te.calculate_dimensions(area, 1.0)) < 32:  # too small whatever the image: the size's fault
            raise ValueError(f"`target_height` x `target_width` = {area} pixels is too small a target area for an "
                             "edit: even a square output would have a side under 32 pixels; give a larger area "
                             "(32 x 32 = 1024 pixels is enough)")
        field = "image_path" if len(refs) == 1 else f"extra_image_paths[{len(refs) - 2}]"
        height, width = image_size(last, field)
        w, h = te.calculate_dimensions(area, width / height)
        if w < 32 or h < 32:
            raise ImageInputError(f"`{field}`: an image of width {width} x height {height} pixels over a target area "
                                  f"of {area} pixels gives an output of width {w} x height {h}: use a less extreme "
                                  "aspect ratio or a larger `target_height` x `target_width`")
        return (h, w, frames)

    @classmethod
    def validate_request(cls, request: RequestConfig, config: RunnerConfig) -> None:
        """As the base, and the reference count within the checkpoint's `edit.max_images` (read
        from its config files, or the configured architecture of a synthetic checkpoint).

        Raises:
            ValueError: naming the field (`extra_image_paths` when the checkpoint takes fewer references).
        """
        super().validate_request(request, config)
        given = 1 + len(request.extra_image_paths or [])
        most = cls.max_references(config)
        if most is not None and given > most:
            raise ValueError(f"`extra_image_paths`: this checkpoint ({'Edit' if most == 1 else 'Edit-Plus'}) takes at "
                             f"most {most} reference image(s) in all; the request gives {given}")

    @staticmethod
    def max_references(config: RunnerConfig) -> int | None:
        """`edit.max_images` of the checkpoint (the config's `model` over it); None if unreadable
        (the load then says why)."""
        try:
            if config.model_path and Path(config.model_path).is_dir() and any(Path(config.model_path).iterdir()):
                edit = QwenCheckpoint.open(config.model_path, override=config.model).arch.edit
            else:  # a synthetic checkpoint still to write: the configured architecture
                edit = QwenImageArch.model_validate(config.model or {}).edit
        except (ValueError, OSError):
            return None
        return edit.max_images if edit is not None else None

    def warmup_infos(self, shape: Shape) -> tuple[InputInfo, ...]:
        """One dummy request per reference count warmup covers at `shape`: one and (Edit-Plus) two
        references, so both sequence lengths an edit produces are warmed."""
        assert self.checkpoint is not None and self.checkpoint.arch.edit is not None, "load_modules first"
        base = self.warmup_info(shape)
        counts = (1, 2) if self.checkpoint.arch.edit.max_images >= 2 else (1,)
        return tuple(replace(base, image_path=WARMUP_REFERENCE.format(1),
                             extra_image_paths=tuple(WARMUP_REFERENCE.format(k + 1) for k in range(1, n)))
                     for n in counts)

    def reference_grids(self, info: InputInfo) -> list[tuple[int, int, int]]:
        """The references' patch grids from their displayed sizes (image headers and EXIF orientation,
        no decode), as `run_vae_encoder` will make them: each resized to `vae_image_area` with its
        aspect ratio (`resize_to_area`), then 16 pixels a token side. Warmup's grey references have
        the output's size.

        Raises:
            ImageInputError: a reference that is missing or not an image, naming its field.
        """
        edit = self.checkpoint.arch.edit if self.checkpoint is not None else None
        assert edit is not None, "load_modules first"
        if info.warmup:
            sizes = [(info.height, info.width)] * len(info.reference_paths)
        else:
            sizes = [image_size(path, name) for path, name in zip(info.reference_paths, reference_fields(info))]
        grids = []
        for height, width in sizes:
            w, h = te.calculate_dimensions(edit.vae_image_area, width / height)
            grids.append((1, h // 16, w // 16))
        return grids

    def encoder_stages(self) -> tuple[EncoderStage, ...]:
        """The text encoder reads the references too: both stages run per request (and per warmup shape)."""
        return (EncoderStage("text_encoder", module="text_encoder", run=self.run_text_encoder, per_shape=True),
                EncoderStage("vae_encoder", module="vae", run=self.run_vae_encoder, per_shape=True))

    def reference_images(self, info: InputInfo) -> list[Image.Image]:
        """The request's reference images as RGB Pillow images (warmup: grey ones of the output's size)."""
        if info.warmup:
            return [Image.new("RGB", (info.width, info.height), WARMUP_GREY) for _ in info.reference_paths]
        return [read_pil_image(path, name) for path, name in zip(info.reference_paths, reference_fields(info))]

    @torch.inference_mode()
    def run_text_encoder(self, req: RequestState) -> QwenInputs:
        """Prompt (and negative prompt) with the references seen by the VL encoder -> [1, L, D] each;
        the references at their VAE size kept for the VAE encoder."""
        edit = self.checkpoint.arch.edit if self.checkpoint is not None else None
        assert edit is not None, "load_modules first"
        info = req.info
        images = self.reference_images(info)
        vl_area = edit.vl_image_area if edit.variant == "edit_plus" else edit.vae_image_area
        vl_images = [resize_to_area(img, vl_area) for img in images]
        encoder = self.prompt_encoder(req)
        embeds = [encoder.encode_edit(p, vl_images, edit.variant)[None] for p in self.prompts(info)]
        vae_images = [to_pixels(resize_to_area(img, edit.vae_image_area))[None, :, None]  # [1, 3, 1, h, w]
                      for img in images]
        return QwenInputs(prompt_embeds=embeds[0], negative_embeds=embeds[1] if len(embeds) > 1 else None,
                          vae_images=vae_images)

    @torch.inference_mode()
    def run_vae_encoder(self, req: RequestState) -> QwenInputs:
        """Each reference -> normalised posterior-mean latents, packed and concatenated [1, sum L_i, 64]."""
        inputs: QwenInputs = req.inputs
        vae = req.modules["vae"]
        packed, shapes = [], []
        for pixels in inputs.vae_images:
            _, _, _, h, w = pixels.shape
            latents = encode_image(vae, pixels[:, :, 0].to(self.device, torch.float32))  # [1, z, 1, h/8, w/8]
            packed.append(pack_latents(latents).to(self.dtype))  # [1, h/16 * w/16, 4z]
            shapes.append((1, h // 16, w // 16))
        inputs.ref_latents = torch.cat(packed, dim=1)
        inputs.ref_shapes = shapes
        inputs.vae_images = []  # the pixels are not needed any more
        return inputs

    def sidecar_extra(self, req: RequestState) -> dict[str, Any]:
        assert isinstance(req.inputs, QwenInputs), "run the encoders first"
        return {"reference_latent_grids": [list(s[1:]) for s in req.inputs.ref_shapes]}
