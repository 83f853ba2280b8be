"""Writing results: mp4/png/wav media (media library imported only here), tensors, sidecar JSON.

`save_outputs` is what runners call: every output of a pipeline goes to the tensor file under its
key, the primary one to the result file (by its kind), and all files of a request are written
under temporary names and renamed into place together (a failure leaves no partial file).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import uuid
import wave
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from runnerkit.files import give_default_mode, write_error_reason

if TYPE_CHECKING:
    from runnerkit.runners.pipeline import OutputSpec


#: The module of the `media` extra that writing a result file needs, by suffix (.wav: the stdlib).
MEDIA_MODULES: dict[str, str] = {".mp4": "imageio_ffmpeg", ".png": "imageio.v3"}


def missing_media_module(path: str | Path) -> str | None:
    """The module that writing the result file `path` needs (`MEDIA_MODULES`) if it cannot be
    imported (the `media` extra is not installed); None if nothing is missing. The launch script
    checks this before loading, so a missing extra costs no compute."""
    module = MEDIA_MODULES.get(Path(path).suffix.lower())
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ImportError:
        return module
    return None


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] float in [-1, 1] -> [F, H, W, 3] uint8 (round to nearest)."""
    C, F, H, W = video.shape
    if C != 3:
        raise ValueError(f"`video` must have 3 channels, [3, F, H, W] (got shape {tuple(video.shape)})")
    x = ((video.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).contiguous()  # [F, H, W, 3]


def save_media(video: torch.Tensor, path: str | Path, fps: int) -> None:
    """Write [3, F, H, W] in [-1, 1] as H.264 mp4 (yuv420p) or, for .png, the first frame."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = to_uint8_frames(video).numpy()
    if path.suffix.lower() == ".png":
        import imageio.v3 as iio  # imported only when writing

        iio.imwrite(path, frames[0])
        return
    import imageio_ffmpeg  # brings its own ffmpeg binary; imported only when writing

    F, H, W, _ = frames.shape
    # ffmpeg run directly (not imageio_ffmpeg.write_frames) so that its exit status is checked: a
    # full disk, a file-size limit or an unwritable target fails the write instead of leaving a
    # truncated mp4. crf 10 = imageio's quality 8 for libx264.
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-f", "rawvideo", "-vcodec", "rawvideo",
           "-s", f"{W}x{H}", "-pix_fmt", "rgb24", "-r", str(fps), "-i", "-", "-an", "-vcodec", "libx264",
           "-pix_fmt", "yuv420p", "-crf", "10", str(path)]
    proc = subprocess.run(cmd, input=frames.tobytes(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        if proc.returncode < 0:
            reason = f"the encoder was killed by {signal.Signals(-proc.returncode).name}"
            if -proc.returncode == signal.SIGXFSZ:
                reason += " (file size limit exceeded)"
        else:
            last = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
            reason = f"the encoder exited with status {proc.returncode}: {last[0].replace(str(path), '<file>')[:200]}"
            if shutil.disk_usage(path.parent).free < 2**20:  # ffmpeg may only say it wrote nothing
                reason += f" (the file system of {str(path.parent)!r} is full)"
        raise MediaWriteError(reason)


class MediaWriteError(OSError):
    """An output file could not be written (the message says why, without the encoder's raw output)."""


def save_image(image: torch.Tensor, path: str | Path) -> None:
    """Write [3, H, W] in [-1, 1] as an 8-bit RGB png."""
    import imageio.v3 as iio  # imported only when writing

    iio.imwrite(Path(path), to_uint8_frames(image[:, None])[0].numpy())


def save_audio(audio: torch.Tensor, path: str | Path, sample_rate: int) -> None:
    """Write [channels, samples] in [-1, 1] as 16-bit PCM .wav (stdlib `wave`)."""
    C, N = audio.shape
    pcm = (audio.float().clamp(-1, 1) * 32767.0).round().to(torch.int16).T.contiguous()  # [N, C] interleaved
    with wave.open(str(path), "wb") as f:
        f.setnchannels(C)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(pcm.numpy().tobytes())


def save_tensor(video: torch.Tensor, path: str | Path, key: str = "video") -> None:
    """Write the float32 tensor ([C, F, H, W] for 'video', [C, H, W] for 'image') to a .safetensors file."""
    save_tensors({key: video}, path)


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write float32 copies of `tensors` (key -> tensor) to one .safetensors file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous().cpu() for k, v in tensors.items()}, str(path))
    give_default_mode(path)  # the writer creates 0o600; every other output follows the umask


def save_outputs(outputs: dict[str, torch.Tensor], specs: Sequence["OutputSpec"], result_path: str | None,
                 tensor_path: str | None, fps: int, sidecar: dict[str, Any]) -> list[str]:
    """Write one request's outputs, all-or-nothing; returns the final paths written.

    Args:
        outputs: output key -> tensor without batch dim (video [3, F, H, W], image [3, H, W],
            audio [channels, samples]), values in [-1, 1].
        specs: the pipeline's outputs; the first is primary and goes to `result_path`.
        result_path: .mp4 (video; .png for one frame), .png (image) or .wav (audio), with a sidecar .json.
        tensor_path: .safetensors holding every output under its key.
        fps: frames per second of a video result.
        sidecar: the record written beside `result_path` (seed, prompt, resolved config, ...).
    """
    with atomic_outputs() as out:
        if tensor_path:
            with _naming_failures("save_tensor_path", tensor_path):
                save_tensors(outputs, out.temp(tensor_path))
        if result_path:
            primary = specs[0]
            tensor = outputs[primary.key]
            with _naming_failures("save_result_path", result_path):
                tmp = out.temp(result_path)
                if primary.kind == "video":
                    save_media(tensor, tmp, fps=fps)
                elif primary.kind == "image":
                    save_image(tensor, tmp)
                else:
                    assert primary.sample_rate is not None, f"audio output {primary.key!r} needs a sample_rate"
                    save_audio(tensor, tmp, primary.sample_rate)
            with _naming_failures("sidecar .json of save_result_path", sidecar_path(result_path)):
                write_sidecar(out.temp(sidecar_path(result_path)), sidecar)
    return [p for p in (tensor_path, result_path) if p]


@contextmanager
def _naming_failures(field: str, final: str | Path) -> Iterator[None]:
    """Turn a failed write into MediaWriteError naming the final path (never the temporary one)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        if isinstance(exc, MediaWriteError):
            reason = str(exc)
        else:  # OSError: its strerror; safetensors' Rust I/O error: the OS message inside it
            reason = write_error_reason(exc)
        raise MediaWriteError(f"could not write `{field}` {str(final)!r}: {reason}; nothing was saved for "
                              "this request") from None


def sidecar_path(media_path: str | Path) -> Path:
    """The sidecar JSON of a media file: same folder and stem, suffix .json."""
    return Path(media_path).with_suffix(".json")


def write_sidecar(path: str | Path, record: dict[str, Any]) -> None:
    """Write `record` (seed, prompt, resolved config) as UTF-8 JSON to `path`."""
    Path(path).write_text(json.dumps(record, indent=2, default=str, ensure_ascii=False), encoding="utf-8")


class OutputSet:
    """Files of one request, written under temporary names and renamed into place together."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, Path]] = []  # (temporary, final)

    def temp(self, final: str | Path) -> Path:
        """A temporary path beside `final` with the same suffix (writers pick formats by suffix)."""
        final = Path(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.stem}.partial-{os.getpid()}-{uuid.uuid4().hex[:6]}{final.suffix}")
        self.pending.append((tmp, final))
        return tmp


@contextmanager
def atomic_outputs() -> Iterator[OutputSet]:
    """All-or-nothing outputs: on success every temporary file is renamed to its final name; on
    failure (or interrupt) the temporary files are removed and no final file is touched."""
    outputs = OutputSet()
    try:
        yield outputs
    except BaseException:
        for tmp, _ in outputs.pending:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in outputs.pending:
        os.replace(tmp, final)
