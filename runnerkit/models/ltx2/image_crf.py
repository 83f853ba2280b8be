"""i2av's first frame re-compressed as one H.264 frame, through PyAV as the references do.

LTX-2 is trained to condition on frames compressed like video, so its pipelines pass the conditioning
image through libx264 once: Lightricks ltx-pipelines (`utils/media_io`, `preprocess`) and diffusers 0.42.1
(`pipelines/ltx2/utils.py`, `apply_image_conditioning_crf`) both encode with PyAV (`av`): an in-memory mp4,
libx264 at the given CRF with preset veryfast, the RGB frame converted to yuv420p by PyAV's own
`VideoFrame.reformat` (libswscale with PyAV's defaults), decoded back to rgb24 the same way. The colour
conversion is part of the result (ffmpeg's command-line scaler differs from it by up to 12 levels), so
the library is the reference's, not a stand-in: without PyAV, i2av is refused (`missing_pyav`), never
re-compressed another way.
"""

from __future__ import annotations

from io import BytesIO

import numpy as np

PYAV_INSTALL = "pip install av (PyAV, bundles its own ffmpeg libraries; also in the `media` extra)"


def missing_pyav() -> str | None:
    """Why i2av's re-compression cannot run here (PyAV not importable, naming the package and how to
    install it), or None. Checked when an i2av runner is built, before anything loads."""
    try:
        import av  # noqa: F401
    except ImportError:
        return f"task 'i2av' re-compresses its first frame with PyAV, which is not installed: {PYAV_INSTALL}"
    return None


def recompress_h264(image: np.ndarray, crf: int) -> np.ndarray:
    """One RGB frame through H.264 and back (module docstring: the references' exact steps).

    The height and width are first cut to even sizes (yuv420p), as the references do.

    Args:
        image: [H, W, 3] uint8 RGB.
        crf: the H.264 constant rate factor (0 returns `image` unchanged, as the references do).

    Returns:
        [H // 2 * 2, W // 2 * 2, 3] uint8 RGB.

    Raises:
        ValueError: `image` is not [H, W, 3] uint8 of at least 2 x 2, or `crf` is outside [0, 51].
        ModuleNotFoundError: PyAV is not installed (`missing_pyav`'s message).
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 2:
        raise ValueError(f"`image` must be [H, W, 3] uint8 with H, W >= 2, got {image.shape} {image.dtype}")
    if not 0 <= crf <= 51:
        raise ValueError(f"`crf`={crf}: libx264's constant rate factor is 0 (off here) to 51")
    if crf == 0:
        return image
    reason = missing_pyav()
    if reason is not None:
        raise ModuleNotFoundError(reason)
    import av

    H, W = image.shape[0] // 2 * 2, image.shape[1] // 2 * 2
    buffer = BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=1, options={"crf": str(crf), "preset": "veryfast"})
        stream.height, stream.width = H, W
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image[:H, :W]), format="rgb24")
        container.mux(stream.encode(frame.reformat(format="yuv420p")))
        container.mux(stream.encode())  # flush the encoder
    buffer.seek(0)
    with av.open(buffer) as container:
        decoded = next(container.decode(video=0))
        return decoded.to_ndarray(format="rgb24")
