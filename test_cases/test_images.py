"""Image inputs (runnerkit/images.py): modes Pillow reads are converted as documented, rangeless
modes are refused, the EXIF orientation is applied, oversized images are refused cleanly."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runnerkit.images import ImageInputError, check_image, image_size, read_image


def test_eight_bit_rgb_is_to_tensor_mapping(tmp_path: Path) -> None:
    data = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3) * 4
    Image.fromarray(data, "RGB").save(tmp_path / "a.png")
    expected = torch.from_numpy(data).permute(2, 0, 1).float().div(255).sub(0.5).div(0.5)
    assert torch.equal(read_image(tmp_path / "a.png", "image_path"), expected)


def test_sixteen_bit_grayscale_keeps_its_range(tmp_path: Path) -> None:
    data = np.array([[0, 32768, 65535]], dtype=np.uint16)
    Image.fromarray(data).save(tmp_path / "g.png")
    assert Image.open(tmp_path / "g.png").mode.startswith("I;16")
    got = read_image(tmp_path / "g.png", "image_path")
    expected = torch.tensor([0, 32768, 65535], dtype=torch.float32).div(65535).sub(0.5).div(0.5)
    assert got.shape == (3, 1, 3)
    assert torch.equal(got[0, 0], expected) and torch.equal(got[1], got[0]) and torch.equal(got[2], got[0])


def test_float_image_is_refused_naming_the_mode(tmp_path: Path) -> None:
    Image.fromarray(np.full((4, 4), 0.5, dtype=np.float32)).save(tmp_path / "f.tiff")
    with pytest.raises(ImageInputError, match=r"`image_path` .*f\.tiff' has Pillow mode 'F'"):
        read_image(tmp_path / "f.tiff", "image_path")


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    img = Image.new("RGB", (6, 4), (255, 0, 0))
    img.putpixel((0, 0), (0, 0, 255))  # top-left marker
    exif = img.getexif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise
    img.save(tmp_path / "r.png", exif=exif)
    assert check_image(tmp_path / "r.png", "image_path") == (6, 4)  # (height, width) as displayed
    assert image_size(tmp_path / "r.png", "image_path") == (6, 4)  # the same from the header alone
    got = read_image(tmp_path / "r.png", "image_path")
    assert got.shape == (3, 6, 4)
    assert got[:, 0, 3].tolist() == [-1.0, -1.0, 1.0]  # the marker moved to the top-right corner


# The EXIF orientations as the TIFF/EXIF spec defines them: the stored [H, W, C] pixels -> as displayed.
DISPLAYED = {
    1: lambda a: a,
    2: np.fliplr,  # mirrored left-right
    3: lambda a: np.rot90(a, 2),  # rotated 180
    4: np.flipud,  # mirrored top-bottom
    5: lambda a: a.transpose(1, 0, 2),  # transposed (mirrored about the main diagonal)
    6: lambda a: np.rot90(a, -1),  # rotated 90 clockwise
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),  # transversed (mirrored about the anti-diagonal)
    8: lambda a: np.rot90(a, 1),  # rotated 90 counter-clockwise
}


@pytest.mark.parametrize("orientation", sorted(DISPLAYED))
@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_every_exif_orientation_gives_the_displayed_size_and_pixels(tmp_path: Path, orientation: int,
                                                                    fmt: str) -> None:
    """Real EXIF written by Pillow, a non-square image (3 x 5 stored): `image_size` (header only),
    `check_image` and `read_image` all give the image as displayed; PNG pixels match the spec's
    transform exactly (JPEG is lossy: its size only)."""
    stored = np.random.default_rng(orientation).integers(0, 256, (3, 5, 3), dtype=np.uint8)
    img = Image.fromarray(stored, "RGB")
    exif = img.getexif()
    exif[0x0112] = orientation
    path = tmp_path / f"o{orientation}.{fmt}"
    img.save(path, exif=exif, **({"quality": 95} if fmt == "jpeg" else {}))
    with Image.open(path) as check:
        assert check.getexif().get(0x0112) == orientation  # the file really carries it
    displayed = np.ascontiguousarray(DISPLAYED[orientation](stored))
    size = displayed.shape[:2]
    assert image_size(path, "image_path") == size
    assert check_image(path, "image_path") == size
    got = read_image(path, "image_path")
    assert tuple(got.shape) == (3, *size)
    if fmt == "png":
        assert torch.equal(got, torch.from_numpy(displayed).permute(2, 0, 1).float().div(255).sub(0.5).div(0.5))


def test_decompression_bomb_warning_is_an_input_error_not_a_raw_warning(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    Image.new("RGB", (40, 40)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 1600 pixels: over the warning threshold
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a raw warning would fail here
        with pytest.raises(ImageInputError, match=r"`image_path` .*big\.png' is too large to decode safely"):
            check_image(tmp_path / "big.png", "image_path")


def test_image_size_reads_the_header_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Image.new("RGB", (7, 3)).save(tmp_path / "a.png")
    Image.init()  # import every format plugin first (some build images when imported)
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("image_size decoded the pixels"))
    assert image_size(tmp_path / "a.png", "image_path") == (3, 7)
    (tmp_path / "t.png").write_text("not an image")
    with pytest.raises(ImageInputError, match=r"`image_path` .*t\.png' is not an image"):
        image_size(tmp_path / "t.png", "image_path")
