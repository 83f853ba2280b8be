"""An audio+video pipeline's .mp4 result (runnerkit/media.py `save_outputs`): one file holding the
H.264 video and an AAC audio stream, checked with ffmpeg itself (stream listing and decoding), the
sidecar's `streams` record, every other result kind unchanged, and a failed mux leaving no file."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.media import MediaWriteError, save_outputs, to_uint8_frames, warm_writers
from runnerkit.runners.pipeline import OutputSpec

imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="the `media` extra (imageio-ffmpeg) is not installed")

F, H, W, FPS, RATE = 9, 32, 32, 24, 24000
AAC_FRAME = 1024  # samples per AAC frame: the encoder's padding is at most one frame
SIDECAR = {"prompt": "a drum", "seed": 7}
VIDEO_AUDIO = (OutputSpec("video", "video"), OutputSpec("audio", "audio", sample_rate=RATE))


def _video(frames: int = F) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1]: a horizontal ramp per channel that shifts with the frame (smooth, so
    H.264 at crf 10 stays close)."""
    x = torch.linspace(-0.8, 0.8, W)[None, None, None, :]  # [1, 1, 1, W]
    shift = torch.linspace(0, 0.2, frames)[None, :, None, None]  # [1, F, 1, 1]
    sign = torch.tensor([1.0, -1.0, 0.5])[:, None, None, None]  # [3, 1, 1, 1]
    return (sign * x + shift).clamp(-1, 1).expand(3, frames, H, W).contiguous()


def _tone(freq: float, samples: int) -> torch.Tensor:
    """[samples] sine of `freq` Hz at RATE, amplitude 0.5."""
    return 0.5 * torch.sin(2 * math.pi * freq * torch.arange(samples, dtype=torch.float64) / RATE).float()


FREQS = (440.0, 660.0)  # channel c's tone; 165 and 247.5 periods in 0.375 s: nearly orthogonal


def _audio(channels: int, samples: int) -> torch.Tensor:
    """[channels, samples] in [-1, 1]: a different tone per channel (a swap would show)."""
    return torch.stack([_tone(FREQS[c], samples) for c in range(channels)])


def _ffmpeg(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", *args], capture_output=True)


def _streams(path: Path) -> list[str]:
    """The stream lines ffmpeg prints for `path` (`-i` alone: exit status 1, no output file given)."""
    proc = _ffmpeg("-i", str(path))
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "At least one output file must be specified" in err, err
    return re.findall(r"^\s*Stream #0:\d.*$", err, flags=re.M)


def _decode_audio(path: Path, channels: int) -> torch.Tensor:
    """The mp4's audio stream decoded by ffmpeg at its own rate and layout -> [channels, n] in [-1, 1]."""
    proc = _ffmpeg("-v", "error", "-i", str(path), "-map", "0:a:0", "-f", "s16le", "-acodec", "pcm_s16le", "-")
    assert proc.returncode == 0, proc.stderr.decode()
    pcm = torch.frombuffer(bytearray(proc.stdout), dtype=torch.int16)
    return pcm.reshape(-1, channels).T.float() / 32767.0  # [n, C] interleaved -> [C, n]


def _decode_video(path: Path) -> torch.Tensor:
    """The mp4's video stream decoded by ffmpeg -> [frames, H, W, 3] uint8."""
    proc = _ffmpeg("-v", "error", "-i", str(path), "-map", "0:v:0", "-f", "rawvideo", "-pix_fmt", "rgb24", "-")
    assert proc.returncode == 0, proc.stderr.decode()
    return torch.frombuffer(bytearray(proc.stdout), dtype=torch.uint8).reshape(-1, H, W, 3)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.numel(), b.numel())
    a, b = a[:n].double(), b[:n].double()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize(("channels", "samples"), [(2, RATE * F // FPS), (1, RATE * F // FPS), (2, 2 * RATE * F // FPS),
                                                   (2, RATE * F // FPS // 2 - 500)],
                         ids=["stereo", "mono", "audio-longer-than-video", "audio-shorter-than-video"])
def test_mp4_holds_h264_video_and_aac_audio(tmp_path: Path, channels: int, samples: int) -> None:
    video, audio = _video(), _audio(channels, samples)
    mp4, tensors = tmp_path / "x.mp4", tmp_path / "x.safetensors"
    written = save_outputs({"video": video, "audio": audio}, VIDEO_AUDIO, str(mp4), str(tensors), fps=FPS,
                           sidecar=SIDECAR)
    assert written == [str(tensors), str(mp4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.mp4", "x.safetensors"]  # no wav left

    # What the file holds, as ffmpeg lists it.
    streams = _streams(mp4)
    assert len(streams) == 2, streams
    assert re.search(rf"Stream #0:0.*Video: h264 .*yuv420p.*, {W}x{H}[ ,].*{FPS} fps", streams[0]), streams
    layout = {1: "mono", 2: "stereo"}[channels]
    assert re.search(rf"Stream #0:1.*Audio: aac .*, {RATE} Hz, {layout}, ", streams[1]), streams

    # Both streams whole (no -shortest): every frame and every sample, whichever is longer.
    frames = _decode_video(mp4)
    assert frames.shape == (F, H, W, 3)
    err = (frames.float() - to_uint8_frames(video).float()).abs().mean().item()
    assert err < 4, f"decoded frames far from the tensor (mean abs error {err:.2f} of 255)"
    decoded = _decode_audio(mp4, channels)
    assert abs(decoded.shape[1] - samples) <= AAC_FRAME, (decoded.shape, samples)
    for c in range(channels):  # each channel carries its own tone, in place and at its level
        assert _corr(decoded[c], audio[c]) > 0.95, c
        rms = decoded[c, :samples].pow(2).mean().sqrt().item()
        assert rms == pytest.approx(0.5 / math.sqrt(2), rel=0.05), (c, rms)
        if channels == 2:
            assert abs(_corr(decoded[c], audio[1 - c])) < 0.1, c

    # The sidecar says what the file holds; the tensor file keeps both outputs bit for bit.
    assert json.loads(mp4.with_suffix(".json").read_text()) == {**SIDECAR, "streams": {
        "video": {"key": "video", "codec": "h264", "frames": F, "height": H, "width": W, "fps": FPS,
                  "seconds": F / FPS},
        "audio": {"key": "audio", "codec": "aac", "sample_rate": RATE, "channels": channels, "samples": samples,
                  "seconds": samples / RATE}}}
    saved = load_file(str(tensors))
    assert saved.keys() == {"video", "audio"}
    assert torch.equal(saved["video"], video) and torch.equal(saved["audio"], audio)


def test_video_only_mp4_has_no_audio_stream_and_no_streams_record(tmp_path: Path) -> None:
    mp4 = tmp_path / "x.mp4"
    save_outputs({"video": _video()}, (OutputSpec("video", "video"),), str(mp4), None, fps=FPS, sidecar=SIDECAR)
    streams = _streams(mp4)
    assert len(streams) == 1 and "Video: h264" in streams[0], streams
    assert _decode_video(mp4).shape == (F, H, W, 3)
    assert json.loads(mp4.with_suffix(".json").read_text()) == SIDECAR
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.mp4"]


def test_one_frame_png_beside_audio_is_the_frame_alone(tmp_path: Path) -> None:
    import imageio.v3 as iio

    video, audio = _video(frames=1), _audio(2, 1000)
    png, tensors = tmp_path / "x.png", tmp_path / "x.safetensors"
    save_outputs({"video": video, "audio": audio}, VIDEO_AUDIO, str(png), str(tensors), fps=FPS, sidecar=SIDECAR)
    assert torch.equal(torch.from_numpy(iio.imread(png)), to_uint8_frames(video)[0])
    assert json.loads(png.with_suffix(".json").read_text()) == SIDECAR
    assert load_file(str(tensors)).keys() == {"video", "audio"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.png", "x.safetensors"]


def test_primary_audio_is_a_wav_alone(tmp_path: Path) -> None:
    audio = _audio(2, 3000)
    wav = tmp_path / "x.wav"
    save_outputs({"audio": audio, "video": _video()}, VIDEO_AUDIO[::-1], str(wav), None, fps=FPS, sidecar=SIDECAR)
    with wave.open(str(wav), "rb") as f:
        assert (f.getnchannels(), f.getframerate(), f.getsampwidth(), f.getnframes()) == (2, RATE, 2, 3000)
    assert json.loads(wav.with_suffix(".json").read_text()) == SIDECAR
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.wav"]


# An encoder that writes part of its target, then fails naming the audio input it was given (and
# whether that wav held anything), as ffmpeg names a bad input.
PARTIAL_ENCODER = """#!/bin/sh
prev=; wav=missing
for a; do
  if [ "$prev" = "-i" ] && [ "$a" != "-" ]; then if [ -s "$a" ]; then wav=$a; else wav="empty $a"; fi; fi
  prev=$a; last=$a
done
head -c 1000 /dev/zero > "$last"
echo "$wav: Invalid data found when processing input" >&2
exit 1
"""


@pytest.mark.parametrize(("encoder", "rate", "reason"), [
    ("false", RATE, "the encoder exited with status 1: no message"),
    ("partial", RATE, "the encoder exited with status 1: <audio>: Invalid data found when processing input"),
    ("ffmpeg", 25000, "the audio's sample rate 25000 Hz cannot be stored as AAC (allowed: 96000, 88200, 64000, "
                      "48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)"),
], ids=["false", "partial-write", "rate-not-aac"])
def test_failed_mux_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoder: str, rate: int,
                                   reason: str) -> None:
    if encoder == "false":
        monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: shutil.which("false"))
    elif encoder == "partial":
        script = tmp_path / "bin" / "ffmpeg"
        script.parent.mkdir()
        script.write_text(PARTIAL_ENCODER)
        script.chmod(0o755)
        monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(script))
    out = tmp_path / "out"
    specs = (OutputSpec("video", "video"), OutputSpec("audio", "audio", sample_rate=rate))
    with pytest.raises(MediaWriteError) as info:
        save_outputs({"video": _video(), "audio": _audio(2, 9000)}, specs, str(out / "x.mp4"),
                     str(out / "x.safetensors"), fps=FPS, sidecar=SIDECAR)
    assert str(info.value) == (f"could not write `save_result_path` {str(out / 'x.mp4')!r}: {reason}; nothing was "
                               "saved for this request")
    assert list(out.iterdir()) == []  # no partial mp4, no tensor file, no sidecar, no temporary wav


def test_the_encoder_runs_at_a_lower_cpu_priority_and_gets_every_frame(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder (a stand-in recording its niceness after reading stdin, as ffmpeg reads the frames) runs
    `ENCODER_NICENESS` below this process's priority: on the writer thread it leaves the cores to the thread
    launching the next request's GPU work. It still receives every frame's bytes."""
    import os

    from runnerkit.media import ENCODER_NICENESS, save_media

    seen = tmp_path / "seen"
    script = tmp_path / "bin" / "ffmpeg"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\nbytes=$(wc -c)\necho "$bytes $(nice)" > {seen}\nfor last; do :; done\n'
                      'echo mp4 > "$last"\n')
    script.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(script))
    video = _video()
    save_media(video, tmp_path / "x.mp4", FPS)
    received, niceness = map(int, seen.read_text().split())
    assert received == video.shape[1] * video.shape[2] * video.shape[3] * 3
    assert niceness == min(19, os.getpriority(os.PRIO_PROCESS, 0) + ENCODER_NICENESS)


@pytest.mark.parametrize(("specs", "warmed"), [
    ((OutputSpec("video", "video"), OutputSpec("audio", "audio", sample_rate=RATE)), ["png", "mp4"]),
    ((OutputSpec("image", "image"),), ["png"]),
    ((OutputSpec("audio", "audio", sample_rate=RATE),), []),  # stdlib wave: nothing to warm
])
def test_warm_writers_warms_the_primary_outputs_writers_and_writes_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, specs: tuple[OutputSpec, ...], warmed: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert warm_writers(specs) == warmed
    assert list(tmp_path.iterdir()) == []


def test_warm_writers_without_the_media_extra_warms_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing writer module is left out (a request that needs it is refused by name), not an error."""
    monkeypatch.setitem(sys.modules, "imageio.v3", None)  # `import imageio.v3` raises ImportError
    assert warm_writers((OutputSpec("video", "video"),)) == []
