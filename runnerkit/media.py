"""Writing results: mp4/png/wav media (media library imported only here), tensors, sidecar JSON.

`save_outputs` is what runners call: every output of a pipeline goes to the tensor file under its
key, the primary one to the result file (by its kind), and all files of a request are written
under temporary names and renamed into place together (a failure leaves no partial file). An .mp4
result of a pipeline with a primary video and an audio output (an audio+video family) holds both:
H.264 video and an AAC audio stream.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file

from runnerkit.files import give_default_mode, write_error_reason

if TYPE_CHECKING:
    from runnerkit.runners.pipeline import OutputSpec


#: Sample rates (Hz) ffmpeg's native AAC encoder takes; an mp4's audio stream must have one.
AAC_SAMPLE_RATES: tuple[int, ...] = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025,
                                     8000, 7350)

#: The module of the `media` extra that writing a result file needs, by suffix (.wav: the stdlib).
MEDIA_MODULES: dict[str, str] = {".mp4": "imageio_ffmpeg", ".png": "imageio.v3"}
#: How to install it, for the errors that name a missing module.
MEDIA_EXTRA = "the `media` extra: pip install \"runnerkit[media]\" (from a checkout: pip install -e \".[media]\")"



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


def save_media(video: torch.Tensor, path: str | Path, fps: int, audio_wav: str | Path | None = None) -> None:
    """Write [3, F, H, W] in [-1, 1] as H.264 mp4 (yuv420p) or, for .png, the first frame.

    Args:
        video: [3, F, H, W] float in [-1, 1].
        path: .mp4 or .png target.
        fps: frames per second of the mp4.
        audio_wav: a 16-bit PCM .wav (`save_audio`) to mux into the mp4 as an AAC stream (ffmpeg's
            native `aac` encoder) at the wav's sample rate and channel count, both passed to ffmpeg
            so that it fails rather than resample or remix; .mp4 only. Both streams start at 0 s and
            are kept whole (no `-shortest`): audio shorter or longer than the video stays as it is,
            and the container lasts as long as the longer stream.

    Raises:
        MediaWriteError: the encoder failed (its exit status or signal and last message line), or
            the wav's sample rate is not one of `AAC_SAMPLE_RATES`.
        ValueError: `audio_wav` given for a .png target.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = to_uint8_frames(video).numpy()
    if path.suffix.lower() == ".png":
        if audio_wav is not None:
            raise ValueError(f"`audio_wav` can only be muxed into an .mp4 (got target {str(path)!r})")
        import imageio.v3 as iio  # imported only when writing

        iio.imwrite(path, frames[0])
        return
    import imageio_ffmpeg  # brings its own ffmpeg binary; imported only when writing

    F, H, W, _ = frames.shape
    # ffmpeg run directly (not imageio_ffmpeg.write_frames) so that its exit status is checked: a
    # full disk, a file-size limit or an unwritable target fails the write instead of leaving a
    # truncated mp4. crf 10 = imageio's quality 8 for libx264.
    video_in = ["-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{W}x{H}", "-pix_fmt", "rgb24", "-r", str(fps),
                "-i", "-"]
    video_out = ["-vcodec", "libx264", "-pix_fmt", "yuv420p", "-crf", "10"]
    if audio_wav is None:
        streams = [*video_in, "-an", *video_out]
    else:  # input 0: the frames on stdin, input 1: the wav; no -shortest, both streams stay whole
        with wave.open(str(audio_wav), "rb") as f:
            rate, channels = f.getframerate(), f.getnchannels()
        if rate not in AAC_SAMPLE_RATES:  # ffmpeg's own message would only say that nothing was written
            raise MediaWriteError(f"the audio's sample rate {rate} Hz cannot be stored as AAC (allowed: "
                                  f"{', '.join(map(str, AAC_SAMPLE_RATES))})")
        streams = [*video_in, "-i", str(audio_wav), "-map", "0:v:0", "-map", "1:a:0", *video_out,
                   "-acodec", "aac", "-ar", str(rate), "-ac", str(channels)]
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", *streams, str(path)]
    # A session of its own: a Ctrl-C at the terminal reaches this process alone, which decides: inline, the
    # KeyboardInterrupt ends `_run_encoder` (which kills the encoder); on the writer thread the result of a request
    # whose compute ended is completed (runnerkit/writer.py) instead of dying with the terminal's signal.
    proc = _run_encoder(cmd, frames.tobytes())
    if proc.returncode != 0:
        if proc.returncode < 0:
            reason = f"the encoder was killed by {signal.Signals(-proc.returncode).name}"
            if -proc.returncode == signal.SIGXFSZ:
                reason += " (file size limit exceeded)"
        else:
            last = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
            message = last[0].replace(str(path), "<file>")
            if audio_wav is not None:
                message = message.replace(str(audio_wav), "<audio>")
            reason = f"the encoder exited with status {proc.returncode}: {message[:200]}"
            if shutil.disk_usage(path.parent).free < 2**20:  # ffmpeg may only say it wrote nothing
                reason += f" (the file system of {str(path.parent)!r} is full)"
        raise MediaWriteError(reason)


def stream_record(video: torch.Tensor, video_key: str, fps: int, audio: torch.Tensor, audio_key: str,
                  sample_rate: int) -> dict[str, dict[str, Any]]:
    """The sidecar's `streams` record of an mp4 holding video [3, F, H, W] and audio [channels,
    samples]: per stream its output key (in the tensor file), codec, sizes and seconds."""
    _, F, H, W = video.shape
    C, N = audio.shape
    return {"video": {"key": video_key, "codec": "h264", "frames": F, "height": H, "width": W, "fps": fps,
                      "seconds": F / fps},
            "audio": {"key": audio_key, "codec": "aac", "sample_rate": sample_rate, "channels": C, "samples": N,
                      "seconds": N / sample_rate}}


class MediaWriteError(OSError):
    """An output file could not be written (the message says why, without the encoder's raw output)."""


def warm_writers(specs: Sequence["OutputSpec"]) -> list[str]:
    """Pay the media writers' one-time costs now (warmup) instead of in the first request's save stage:
    importing imageio and its pillow plugin and encoding a first png (8x8, in memory), and locating
    imageio-ffmpeg's binary for a video output. Measured through the server on the H200 before this
    ran in warmup: job 1's save stage took 0.49 s against 0.41-0.43 s for jobs 2-3, with every GPU
    stage equal (bench/results/first_request_h200.md). Returns what was warmed; a writer whose
    module is missing (the `media` extra) is left out: a request that needs it is refused by name.

    Args:
        specs: the pipeline's outputs (the first is the primary result, as in `save_outputs`).
    """
    warmed: list[str] = []
    kinds = {s.kind for s in specs[:1]}
    try:
        if kinds & {"image", "video"}:  # an image result, or a one-frame video saved as png
            import imageio.v3 as iio

            iio.imwrite("<bytes>", np.zeros((8, 8, 3), np.uint8), extension=".png")
            warmed.append("png")
        if "video" in kinds:
            import imageio_ffmpeg

            imageio_ffmpeg.get_ffmpeg_exe()
            warmed.append("mp4")
    except ImportError:
        pass
    return warmed


#: How much lower than this process's the encoder's CPU priority is (`nice` increment). libx264 starts about
#: 1.5 threads per core; at equal priority they take the cores from the thread that launches the next
#: request's GPU work while results are written on the writer thread (runnerkit/writer.py). Lowered, the
#: encoder gets every core the compute thread leaves idle, and alone (writes inline) it runs as fast as before.
ENCODER_NICENESS = 10


def _run_encoder(cmd: list[str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    """Run the encoder `cmd` with `stdin` at `ENCODER_NICENESS` below this process's priority, in a session of
    its own; its completed process (stderr captured). The priority is set just after the start (no
    `preexec_fn`, unsafe in a threaded process), before the frames are sent; a priority the system refuses
    (no permission) leaves it as it is."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + ENCODER_NICENESS)
    except OSError:
        pass
    try:
        _, err = proc.communicate(stdin)
    except BaseException:  # Ctrl-C / SIGTERM while encoding: no encoder outlives the write
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, None, err)


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
                 tensor_path: str | None, fps: int, sidecar: dict[str, Any],
                 checkpoint: Callable[[], None] | None = None) -> list[str]:
    """Write one request's outputs, all-or-nothing; returns the final paths written.

    A primary "video" output written to an .mp4 beside an "audio" output (the first one of kind
    "audio" among the others) gives one mp4 with both streams: H.264 video and AAC audio at the
    output's sample rate and the tensor's channel count, each kept whole (`save_media`). The audio
    goes through a temporary 16-bit PCM wav beside the result, removed whether or not the write
    succeeds, and the sidecar gains a `streams` record (`stream_record`). Every other case writes
    the primary output alone.

    Args:
        outputs: output key -> tensor without batch dim (video [3, F, H, W], image [3, H, W],
            audio [channels, samples]), values in [-1, 1].
        specs: the pipeline's outputs; the first is primary and goes to `result_path`.
        result_path: .mp4 (video, with an audio stream as above; .png for one frame), .png (image)
            or .wav (audio), with a sidecar .json.
        tensor_path: .safetensors holding every output under its key.
        fps: frames per second of a video result.
        sidecar: the record written beside `result_path` (seed, prompt, resolved config, ...).
        checkpoint: called before each file and before the files are renamed into place; what it
            raises stops the write, which then leaves nothing (the result writer's abandonment,
            runnerkit/writer.py). None: nothing is checked.

    Raises:
        MediaWriteError: a file could not be written (naming its field and final path); nothing
            of the request is left behind.
        whatever `checkpoint` raises, after the temporary files are removed.
    """
    check = checkpoint if checkpoint is not None else (lambda: None)
    with atomic_outputs() as out:
        check()
        if tensor_path:
            with _naming_failures("save_tensor_path", tensor_path):
                save_tensors(outputs, out.temp(tensor_path))
        if result_path:
            primary = specs[0]
            tensor = outputs[primary.key]
            audio = None  # the audio output muxed into an mp4 result beside the primary video
            if primary.kind == "video" and Path(result_path).suffix.lower() == ".mp4":
                audio = next((s for s in specs[1:] if s.kind == "audio"), None)
            record = sidecar
            check()
            with _naming_failures("save_result_path", result_path):
                tmp = out.temp(result_path)
                if audio is not None:
                    assert audio.sample_rate is not None, f"audio output {audio.key!r} needs a sample_rate"
                    wav = out.scratch(result_path, ".wav")
                    save_audio(outputs[audio.key], wav, audio.sample_rate)
                    save_media(tensor, tmp, fps=fps, audio_wav=wav)
                    record = {**sidecar, "streams": stream_record(tensor, primary.key, fps, outputs[audio.key],
                                                                  audio.key, audio.sample_rate)}
                elif primary.kind == "video":
                    save_media(tensor, tmp, fps=fps)
                elif primary.kind == "image":
                    save_image(tensor, tmp)
                else:
                    assert primary.sample_rate is not None, f"audio output {primary.key!r} needs a sample_rate"
                    save_audio(tensor, tmp, primary.sample_rate)
            check()
            with _naming_failures("sidecar .json of save_result_path", sidecar_path(result_path)):
                write_sidecar(out.temp(sidecar_path(result_path)), record)
        check()  # the last point where the files can still be dropped
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
    """Files of one request, written under temporary names and renamed into place together, and
    scratch files (an encoder's inputs) removed at the end either way."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, Path]] = []  # (temporary, final)
        self.scratch_files: list[Path] = []  # never renamed into place

    def temp(self, final: str | Path) -> Path:
        """A temporary path beside `final` with the same suffix (writers pick formats by suffix)."""
        tmp = self._partial_name(final, Path(final).suffix)
        self.pending.append((tmp, Path(final)))
        return tmp

    def scratch(self, beside: str | Path, suffix: str) -> Path:
        """A temporary path beside `beside` with `suffix`, removed when the request's files are done,
        written or not (e.g. the wav an mp4's audio stream is encoded from)."""
        tmp = self._partial_name(beside, suffix)
        self.scratch_files.append(tmp)
        return tmp

    @staticmethod
    def _partial_name(final: str | Path, suffix: str) -> Path:
        final = Path(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f".{final.stem}.partial-{os.getpid()}-{uuid.uuid4().hex[:6]}{suffix}")


@contextmanager
def atomic_outputs() -> Iterator[OutputSet]:
    """All-or-nothing outputs: on success every temporary file is renamed to its final name; on
    failure (or interrupt) the temporary files are removed and no final file is touched. Scratch
    files are removed in both cases."""
    outputs = OutputSet()
    try:
        try:
            yield outputs
        except BaseException:
            for tmp, _ in outputs.pending:
                tmp.unlink(missing_ok=True)
            raise
        for tmp, final in outputs.pending:
            os.replace(tmp, final)
    finally:
        for tmp in outputs.scratch_files:
            tmp.unlink(missing_ok=True)
