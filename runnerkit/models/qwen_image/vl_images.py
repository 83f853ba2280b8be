"""Qwen-Image Edit's reference images for the vision-language encoder: the size each is resized to.

Follows diffusers 0.42 `QwenImageEditPipeline` and `QwenImageEditPlusPipeline`
(`calculate_dimensions`, `VaeImageProcessor.resize`).
"""

from __future__ import annotations

import math
from typing import Literal

import PIL.Image

EditVariant = Literal["edit", "edit_plus"]

VL_AREA: dict[str, int] = {"edit": 1024 * 1024, "edit_plus": 384 * 384}
"""Pixel area the VL-encoder image is resized to: Edit uses the VAE-size image, Edit-Plus a small one
(diffusers `CONDITION_IMAGE_SIZE`)."""


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height) with about `target_area` pixels and aspect `ratio` = width / height, each
    rounded to a multiple of 32 (Python's round: halves to even), as diffusers' Qwen-Image Edit and
    Edit-Plus pipelines compute it (`calculate_dimensions`)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def vl_image_size(width: int, height: int, variant: EditVariant) -> tuple[int, int]:
    """(width, height) the reference resizes a `width` x `height` input image to before the VL encoder.

    Edit: the ~1024 x 1024-area size (the same image the VAE encodes). Edit-Plus: the ~384 x 384-area
    "condition" size, per image. The processor then snaps it to multiples of 28 (`smart_resize`).
    """
    return calculate_dimensions(VL_AREA[variant], width / height)


def resize_for_vl(image: PIL.Image.Image, variant: EditVariant) -> PIL.Image.Image:
    """`image` resized to `vl_image_size` with PIL's Lanczos filter (no reducing gap), as diffusers'
    `VaeImageProcessor.resize` does for a PIL image (its default `resample="lanczos"`)."""
    width, height = vl_image_size(*image.size, variant)
    return image.resize((width, height), resample=PIL.Image.Resampling.LANCZOS, reducing_gap=None)


__all__ = ["VL_AREA", "EditVariant", "calculate_dimensions", "resize_for_vl", "vl_image_size"]
