"""i2av's first-frame H.264 re-compression against diffusers 0.42.1's `apply_image_conditioning_crf` (PyAV,
a port of Lightricks ltx-pipelines' `media_io.preprocess`): pixel for pixel, and refused without PyAV."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from runnerkit.models.ltx2.image_crf import missing_pyav, recompress_h264
from test_cases._reference import require_reference


def picture(height: int, width: int) -> np.ndarray:
    """Saturated colours, edges and noise: the colour conversion and the chroma subsampling both show."""
    rng = np.random.default_rng(3)
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x // 7 + y // 5) % 2) * 255],
                     axis=-1).astype(np.int64)
    image += rng.integers(-40, 41, image.shape)
    return image.clip(0, 255).astype(np.uint8)


@pytest.mark.parametrize(("height", "width", "crf"), [(48, 80, 33), (37, 51, 33), (64, 64, 18)])
def test_matches_diffusers_pixel_for_pixel(height: int, width: int, crf: int) -> None:
    """Odd sizes are cut to even ones first, as the reference does."""
    require_reference("av")
    require_reference("diffusers")
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

    image = picture(height, width)
    ours = recompress_h264(image, crf)
    expected = apply_image_conditioning_crf(image, crf)
    assert ours.shape == expected.shape == (height // 2 * 2, width // 2 * 2, 3)
    assert np.array_equal(ours, expected)
    assert not np.array_equal(ours, image[: height // 2 * 2, : width // 2 * 2])  # it did compress


def test_crf_zero_is_the_identity_and_bad_crf_is_refused() -> None:
    """Neither needs PyAV."""
    image = picture(9, 9)
    assert recompress_h264(image, 0) is image
    with pytest.raises(ValueError, match="`crf`=52"):
        recompress_h264(image, 52)


def test_without_pyav_i2av_is_refused_naming_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No silent fallback to another encoder: the re-compression raises, and an i2av runner is refused when
    it is built (before anything loads), both naming PyAV and how to install it."""
    from runnerkit.config import load_runner_config
    from runnerkit.models.ltx2.runner import LTX2Runner

    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    assert missing_pyav() is not None and "pip install av" in str(missing_pyav())
    with pytest.raises(ModuleNotFoundError, match="PyAV, which is not installed: pip install av"):
        recompress_h264(picture(8, 8), 33)
    configs = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
    config = load_runner_config(configs / "ltx2_i2av_tiny.json", {"device": "cpu", "model_path": str(tmp_path / "m")})
    with pytest.raises(ValueError, match="task 'i2av' re-compresses its first frame with PyAV"):
        LTX2Runner(config)
    t2av = load_runner_config(configs / "ltx2_t2av_tiny.json", {"device": "cpu", "model_path": str(tmp_path / "m")})
    LTX2Runner(t2av)  # t2av does not need it
    assert LTX2Runner.for_plan(config).plan_only  # nor does a memory plan of i2av (`runnerkit plan`)
