"""`runnerkit serve` over an audio+video family: the tiny LTX-2.3 configs (synthetic weights, CPU).

One t2av server (`--warmup --save_tensors`) serves the module: a job sent as JSON (the server's job
API) and one sent by the official `openai` client (a multipart form) both return an mp4 whose
streams, as ffmpeg reads them (not the server's own record), are H.264 video and AAC audio at the
vocoder's sample rate; the job object says so in `audio`. Shapes follow the family's factors
(multiples of 64, 8k + 1 frames), refused naming the field as sent. i2av runs in-process through
`build_request` on an unloaded runner (a second server would double the module's cost): a request
without its first frame is refused naming `image`; one with OpenAI's `input_reference` is taken.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from test_cases.conftest import REPO
from test_cases.serve.test_server import Server, frames, http

T2AV = REPO / "configs" / "ltx2" / "ltx2_t2av_tiny.json"
I2AV = REPO / "configs" / "ltx2" / "ltx2_i2av_tiny.json"
FIRST_FRAME = REPO / "assets" / "examples" / "first_frame.png"
#: The tiny configs' vocoder (with its bandwidth extension) writes 48 kHz stereo.
SAMPLE_RATE = json.loads(T2AV.read_text())["model"]["vocoder"]["output_sampling_rate"]
CHANNELS = json.loads(T2AV.read_text())["model"]["vocoder"]["bwe"]["out_channels"]


def streams(mp4: Path) -> dict[str, str]:
    """`{"Video": line, "Audio": line}`: the stream lines ffmpeg prints for `mp4`, e.g.
    `Stream #0:1[0x2](und): Audio: aac (LC) (mp4a / 0x6134706D), 48000 Hz, stereo, fltp, 98 kb/s`."""
    import imageio_ffmpeg

    proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(mp4)], capture_output=True,
                          text=True)
    found = [re.search(r"Stream #\d+:\d+.*?: (Video|Audio): (.*)", line) for line in proc.stderr.splitlines()]
    lines = [m for m in found if m]
    assert len(lines) == len({m[1] for m in lines}), proc.stderr  # one stream of each kind
    return {m[1]: m[2] for m in lines}


def assert_h264_and_aac(mp4: Path, width: int, height: int) -> None:
    s = streams(mp4)
    assert sorted(s) == ["Audio", "Video"], s
    assert re.match(rf"h264 \(.*, {width}x{height}[ ,].*\b24 fps", s["Video"]), s["Video"]
    assert re.match(rf"aac \(LC\) .*, {SAMPLE_RATE} Hz, {'stereo' if CHANNELS == 2 else 'mono'}, ", s["Audio"]), \
        s["Audio"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The t2av server, started and not waited for (its ~10 s start-up overlaps the in-process test)."""
    root = tmp_path_factory.mktemp("serve_ltx2")
    srv = Server(T2AV, root / "out", root / "cache", "--warmup", "--save_tensors", "--device", "cpu")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(launched: Server) -> Server:
    """The t2av server once ready (after its warmup)."""
    assert launched.wait_port(), launched.log()
    launched.wait_ready()
    return launched


# ---- i2av, in-process (first: the server starts meanwhile) -------------------------------------
def test_i2av_needs_its_first_frame_and_takes_input_reference(launched: Server, tmp_path: Path) -> None:
    """`launched` only starts the t2av server early; this test does not talk to it."""
    from runnerkit.config import load_runner_config
    from runnerkit.registry import get_runner_cls
    from runnerkit.serve.app import InputError, ServerState, build_request
    from runnerkit.serve.jobs import JobQueue

    config = load_runner_config(str(I2AV), {"device": "cpu"})
    runner = get_runner_cls(config.model_cls, config.task)(config)  # not loaded: requests are checked before
    state = ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None)
    with pytest.raises(InputError) as exc:
        build_request(state, {"prompt": "x"}, tmp_path)
    assert (exc.value.field, exc.value.status) == ("image", 422)
    assert str(exc.value).startswith("`image` is required by task 'i2av'") and "`input_reference`" in str(exc.value)
    png = FIRST_FRAME.read_bytes()
    request, shown, resolved = build_request(state, {"prompt": "x", "input_reference": png, "seconds": "1"}, tmp_path)
    assert Path(request.image_path).read_bytes() == png and shown["image"] == f"{len(png)} bytes"
    assert (resolved["height"], resolved["width"], resolved["frames"], resolved["seconds"]) == (128, 192, 25, "1.04167")
    with pytest.raises(InputError) as exc:
        build_request(state, {"prompt": "x", "input_reference": png, "size": "192x96"}, tmp_path)
    assert exc.value.field == "size" and "multiple of 64" in str(exc.value)


# ---- t2av over HTTP ------------------------------------------------------------------------------
def test_a_t2av_job_returns_an_mp4_with_h264_and_aac_and_says_so(server: Server, tmp_path: Path) -> None:
    job_id = server.submit({"prompt": "waves on a beach", "seed": 3, "size": "192x128", "target_video_length": 25})
    job = server.wait_job(job_id)
    assert (job["status"], job["resolved"]["frames"], job["seconds"]) == ("completed", 25, "1.04167"), job
    assert job["audio"] == {"codec": "aac", "sample_rate": SAMPLE_RATE, "channels": CHANNELS}, job
    content = server.get(f"/v1/videos/{job_id}/content")
    assert content.status == 200 and content.headers["content-type"] == "video/mp4"
    mp4 = tmp_path / "result.mp4"
    mp4.write_bytes(content.body)
    assert_h264_and_aac(mp4, 192, 128)
    assert frames(mp4) == 25
    with safe_open(str(server.out_dir / job_id / "result.safetensors"), "pt") as f:  # --save_tensors: both outputs
        assert sorted(f.keys()) == ["audio", "video"]
        assert f.get_slice("audio").get_shape()[0] == CHANNELS and f.get_slice("video").get_shape()[:2] == [3, 25]
    info = server.get("/v1/info").json()
    assert (info["task"], info["kind"], info["factors"], info["fps"]) == ("t2av", "video",
                                                                        {"spatial": 64, "temporal": 8}, 24), info


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client marks its videos calls
def test_the_openai_client_gets_the_audio_track(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    video = client.videos.create_and_poll(prompt="a drum solo", size="128x64", seconds="0.4", poll_interval_ms=20)
    content = client.videos.download_content(video.id).content
    assert (video.status, video.model, video.size, video.seconds) == ("completed", "ltx2", "128x64", "0.375"), video
    assert video.model_dump()["audio"] == {"codec": "aac", "sample_rate": SAMPLE_RATE, "channels": CHANNELS}
    mp4 = server.out_dir / video.id / "result.mp4"
    assert content == mp4.read_bytes()
    assert_h264_and_aac(mp4, 128, 64)
    assert frames(mp4) == 9  # "0.4" s at 24 fps: 9.6 frames, the nearest 8k + 1 is 9 (9 / 24 = 0.375 s)


@pytest.mark.parametrize("body,param,says", [
    ({"size": "200x128"}, "size", "`size`'s width must be a multiple of 64 (got 200)"),
    ({"target_height": 96}, "target_height", "`target_height` must be a multiple of 64 (got 96)"),
    ({"target_video_length": 13}, "target_video_length", "`target_video_length` must be 8n+1, e.g. 9, 17, 81 (got 13)"),
    ({"seconds": "0.2"}, "seconds", "from 0.375 to"),  # below the shortest clip (9 frames at 24 fps)
    ({"image": base64.b64encode(FIRST_FRAME.read_bytes()).decode()}, "image", "`image` is not used by task 't2av'"),
], ids=["size", "height", "frames", "seconds", "image"])
def test_shapes_off_the_family_factors_are_refused_naming_the_field(server: Server, body: dict[str, Any],
                                                                    param: str, says: str) -> None:
    before = len(server.get("/v1/videos").json()["data"])
    r = http("POST", server.url + "/v1/videos", {"prompt": "x", **body})
    err = r.json()["error"]
    assert (r.status, err["param"], err["type"]) == (422, param, "invalid_request_error"), r.body
    assert says in err["message"], err["message"]
    assert len(server.get("/v1/videos").json()["data"]) == before  # nothing was queued

