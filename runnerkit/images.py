"""Reading conditioning images (image-to-video and image-editing tasks), through Pillow.

Every image input is checked before anything loads (`check_image`: the file exists and Pillow
decodes it whole), so a missing, truncated or non-image file is refused at start-up with the
request field and the path, never after minutes of loading. `read_image` gives the tensor the
families work from: RGB, [3, H, W], float32 in [-1, 1], computed as torchvision's
`to_tensor(img).sub_(0.5).div_(0.5)` (the conversion reference pipelines use) without torchvision.

The image is taken as it is displayed: an EXIF orientation tag is applied (as diffusers'
`load_image` does; a phone photo is not turned sideways). 8-bit images of any mode (RGB, RGBA,
palette, grayscale, CMYK, ...) are converted to RGB; 16-bit grayscale is scaled from its 16-bit
range; 32-bit integer and float images have no fixed range and are refused, naming the mode.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

_EXIF_ORIENTATION = 0x0112
#: Pillow modes without a defined value range (refused: the pixels cannot be mapped to [-1, 1]).
RANGELESS_MODES = ("I", "F")


class ImageInputError(ValueError):
    """An image input cannot be used: missing, not a file, or not an image Pillow decodes."""


def _open(path: str | Path, field: str) -> Image.Image:
    """The decoded image at `path` (`field` names the request field in errors).

    Raises:
        ImageInputError: missing, a folder, unreadable, not an image, truncated or too large.
    """
    p = Path(path)
    if not p.exists():
        raise ImageInputError(f"`{field}` {str(path)!r}: no such file")
    if not p.is_file():
        raise ImageInputError(f"`{field}` {str(path)!r} is not a file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # reported below, not printed raw
            img = Image.open(p)
            img.load()  # decode the whole image: a truncated file fails here, not after loading
    except UnidentifiedImageError:
        raise ImageInputError(f"`{field}` {str(path)!r} is not an image Pillow can read "
                              "(PNG, JPEG, WebP, BMP, ... expected)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageInputError(f"`{field}` {str(path)!r} is too large to decode safely: {exc}") from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated data, permission denied, broken header
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ImageInputError(f"`{field}` {str(path)!r} cannot be decoded: {reason}") from None
    if img.width < 1 or img.height < 1:
        raise ImageInputError(f"`{field}` {str(path)!r} has no pixels ({img.width}x{img.height})")
    if img.mode in RANGELESS_MODES:
        raise ImageInputError(f"`{field}` {str(path)!r} has Pillow mode {img.mode!r} (32-bit integer or float "
                              "pixels, no fixed value range); save it as an 8-bit or 16-bit image")
    return ImageOps.exif_transpose(img)


def check_image(path: str | Path, field: str) -> tuple[int, int]:
    """Decode the image at `path` once and return its (height, width) in pixels, as displayed
    (after its EXIF orientation).

    Raises:
        ImageInputError: naming `field` and `path` (see `_open`).
    """
    with _open(path, field) as img:
        return img.height, img.width


def image_size(path: str | Path, field: str) -> tuple[int, int]:
    """(height, width) as displayed, from the header and the EXIF orientation only (no decode):
    for shape rules that run on every validation; `check_image` is the full check.

    Raises:
        ImageInputError: missing, not a file, or not an image Pillow can identify.
    """
    p = Path(path)
    if not p.is_file():
        raise ImageInputError(f"`{field}` {str(path)!r}: " + ("no such file" if not p.exists() else "not a file"))
    try:
        with Image.open(p) as img:
            width, height = img.size
            rotated = _orientation(img) in (5, 6, 7, 8)  # exif_transpose swaps height and width
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageInputError(f"`{field}` {str(path)!r} is not an image Pillow can read") from None
    return (width, height) if rotated else (height, width)


def _orientation(img: Image.Image) -> int | None:
    """The EXIF orientation from what the header gave (`getexif` of a PNG would decode the image to
    find a late eXIf chunk; one after the pixels is then missed here, and applied by `read_image`)."""
    if img.format == "PNG":
        raw = img.info.get("exif")
        if not raw:
            return None
        exif = Image.Exif()
        exif.load(raw)
        return exif.get(_EXIF_ORIENTATION)
    return img.getexif().get(_EXIF_ORIENTATION)


def read_image(path: str | Path, field: str) -> torch.Tensor:
    """The image at `path` as RGB [3, H, W] float32 in [-1, 1] (alpha dropped, palettes expanded).

    Raises:
        ImageInputError: naming `field` and `path` (see `_open`).
    """
    with _open(path, field) as img:
        if img.mode.startswith("I;16"):  # 16-bit grayscale: its own range, then the same mapping
            gray = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).div(65535)
            return gray.expand(3, -1, -1).contiguous().sub_(0.5).div_(0.5)
        rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)  # [H, W, 3]
    pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()  # [3, H, W] uint8
    return pixels.to(torch.float32).div(255).sub_(0.5).div_(0.5)


def read_pil_image(path: str | Path, field: str) -> Image.Image:
    """The image at `path` as an 8-bit RGB Pillow image (EXIF orientation applied, alpha dropped),
    for processors that take Pillow images; 16-bit images are scaled to 8 bits (value / 257).

    Raises:
        ImageInputError: naming `field` and `path` (see `_open`).
    """
    with _open(path, field) as img:
        if img.mode.startswith("I;16"):
            gray = np.round(np.asarray(img, dtype=np.float32) / 257.0).astype(np.uint8)  # [H, W]
            return Image.fromarray(gray, mode="L").convert("RGB")
        return img.convert("RGB")


def write_image(path: str | Path, pixels: torch.Tensor) -> None:
    """Save [3, H, W] values in [-1, 1] as an 8-bit RGB PNG (tests and examples make inputs with it)."""
    if pixels.ndim != 3 or pixels.shape[0] != 3:
        raise ValueError(f"`pixels` must be [3, H, W], got shape {tuple(pixels.shape)}")
    data = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(data, mode="RGB").save(path)


__all__ = ["ImageInputError", "check_image", "image_size", "read_image", "write_image"]
