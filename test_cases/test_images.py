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
