"""Unit tests of the server's pieces that need no HTTP: image decoding, retention, API wording, and
the runner's cancellation between decoder chunks (what `DELETE` and `--on_shutdown cancel` use)."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.registry import get_runner_cls
from runnerkit.runners.base import Progress, RequestCancelled
from runnerkit.serve.app import InputError, _api_wording, _decode_image
from runnerkit.serve import jobs
from runnerkit.serve.jobs import Job, JobQueue, Worker
from test_cases.conftest import tiny_config_dict

PNG = bytes.fromhex("89504e470d0a1a0a") + bytes(range(200))  # any bytes: decoding only checks base64


@pytest.mark.parametrize("encode", [
    lambda b: base64.b64encode(b).decode(),
    lambda b: base64.encodebytes(b).decode(),  # MIME: a line break every 76 characters
    lambda b: base64.urlsafe_b64encode(b).decode(),
    lambda b: base64.b64encode(b).decode().rstrip("="),  # unpadded
    lambda b: "data:image/png;base64," + base64.b64encode(b).decode(),
], ids=["standard", "mime", "urlsafe", "unpadded", "data_url"])
def test_image_base64_variants_decode_to_the_same_bytes(encode: Any) -> None:
    assert _decode_image(encode(PNG), "image") == PNG


def test_invalid_base64_names_the_field() -> None:
    with pytest.raises(InputError, match=r"`last_frame` is not valid base64") as exc:
        _decode_image("not base64 at all!", "last_frame")
    assert exc.value.field == "last_frame"


def test_api_wording_hides_server_paths_and_flags(tmp_path: Path) -> None:
    message = (f"`image_path` {str(tmp_path / 'image.bin')!r} is not an image Pillow can read; "
               "`last_frame_path` (--last_frame_path) is required by task 'flf2v': give an image file; "
               f"`extra_image_paths[1]` {str(tmp_path / 'extra_images1.webp')!r} is too small")
    assert _api_wording(message, tmp_path) == ("`image` (uploaded) is not an image Pillow can read; "
                                               "`last_frame` is required by task 'flf2v': send the image as base64 "
                                               "or a file part; `extra_images[1]` (uploaded) is too small")


def _finished(queue: JobQueue, name: str, size: int, when: float) -> Job:
    folder = queue.output_dir / name
    folder.mkdir()
    (folder / "result.mp4").write_bytes(b"x" * size)
    job = Job(id=name, kind="video", request=RequestConfig(prompt="x"), folder=folder, fields={},
              status="completed", completed_at=when)
    queue.jobs[name] = job
    return job


def test_retention_removes_earlier_runs_first_and_always_keeps_the_newest(tmp_path: Path) -> None:
    old = tmp_path / "job_from_an_earlier_run"
    old.mkdir()
    (old / "result.mp4").write_bytes(b"x" * 10)
    os.utime(old, (time.time() - 100, time.time() - 100))
    queue = JobQueue(tmp_path, max_queue=4, keep_jobs=2, keep_bytes=None)
    a = _finished(queue, "job_a", 10, 1.0)
    b = _finished(queue, "job_b", 10, 2.0)
    queue.apply_retention()
    assert not old.exists() and a.folder.exists() and b.folder.exists()  # the earlier run's folder went first
    c = _finished(queue, "job_c", 10, 3.0)
    queue.apply_retention()
    assert (a.expired, b.expired, c.expired) == (True, False, False) and not a.folder.exists()
    queue.keep_bytes = 1  # smaller than any result: only the newest stays
    queue.apply_retention()
    assert (b.expired, c.expired) == (True, False) and c.folder.exists()


def test_a_completing_job_pushes_out_the_oldest_before_its_status_is_seen(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's `_finish` applies the retention a completed job causes before it sets the status, counting
    that job as the newest; a removed job is marked expired before its folder goes (a client never sees
    `content_available` true for a result that is gone, nor a new job completed beside an old one it pushed out)."""
    queue = JobQueue(tmp_path, max_queue=4, keep_jobs=2, keep_bytes=None)
    a = _finished(queue, "job_a", 10, 1.0)
    b = _finished(queue, "job_b", 10, 2.0)
    c = _finished(queue, "job_c", 10, 3.0)
    c.status, c.completed_at = "in_progress", None
    seen: list[tuple[str, bool, bool, str]] = []
    real_rmtree = jobs.shutil.rmtree
    monkeypatch.setattr(jobs.shutil, "rmtree", lambda folder, **kw: (
        seen.append((Path(folder).name, a.expired, a.folder.exists(), c.status)), real_rmtree(folder, **kw)))
    worker = SimpleNamespace(queue=queue, on_done=lambda job: None, runner=None)
    Worker._finish(worker, c, "completed", None, None)  # type: ignore[arg-type]
    assert seen == [("job_a", True, True, "in_progress")]  # expired first, then removed, before c's status
    assert (a.expired, b.expired, c.expired, c.status) == (True, False, False, "completed")
    assert not a.folder.exists() and b.folder.exists() and c.folder.exists()
    scans = []
    monkeypatch.setattr(jobs, "_folder_bytes", lambda folder: scans.append(folder.name) or 10)
    d = _finished(queue, "job_d", 10, 4.0)
    d.status = "in_progress"
    Worker._finish(worker, d, "completed", None, None)  # type: ignore[arg-type]
    assert sorted(scans) == ["job_b", "job_c", "job_d"] and b.expired  # one pass a job: each folder sized once


def test_a_failing_retention_still_completes_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention raising before the status is set (a folder deleted meanwhile): the job still turns completed."""
    queue = JobQueue(tmp_path, max_queue=4, keep_jobs=2, keep_bytes=None)
    job = _finished(queue, "job_a", 10, 1.0)
    job.status = "in_progress"
    calls: list[object] = []

    def failing(completing: object = None) -> None:
        calls.append(completing)
        if completing is not None:
            raise FileNotFoundError("a folder deleted meanwhile")

    monkeypatch.setattr(queue, "apply_retention", failing)
    Worker._finish(SimpleNamespace(queue=queue, on_done=lambda j: None, runner=None),  # type: ignore[arg-type]
                   job, "completed", None, None)
    assert job.status == "completed" and calls == [job, None]


def test_cancel_between_decoder_chunks_stops_the_decode_and_frees_its_cache(tiny_ckpt: Path) -> None:
    """An observer raising at the second VAE chunk stops the request there (not after the whole
    decode), the VAE's feature cache is released, and the next request is unaffected."""
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, target_video_length=17))
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.init_modules()
    seen: list[Progress] = []

    def cancel_at_second_chunk(p: Progress) -> None:
        seen.append(p)
        if [q.stage for q in seen].count("vae_decoder") == 3:  # stage start, chunk 1, chunk 2
            raise RequestCancelled("stop")

    runner.on_progress = cancel_at_second_chunk
    with pytest.raises(RequestCancelled):
        runner.run_pipeline(RequestConfig(prompt="x"), 0)
    assert [p.stage for p in seen][-3:] == ["vae_decoder"] * 3 and "save" not in [p.stage for p in seen]
    assert runner.vae.feature_cache is None and not {"input_info", "inputs", "stage_modules"} & vars(runner).keys()
    runner.on_progress = None
    out = runner.run_pipeline(RequestConfig(prompt="x"), 1)
    assert out.ok and out.stages["vae_decoder"] > 0


def test_progress_reports_every_stage_step_and_decoder_chunk_in_order(tiny_ckpt: Path) -> None:
    """What `on_progress` sees for one request of the tiny config (4 steps, 9 frames = 3 latent
    frames, so 3 decoder chunks): (stage, step, steps, steps_done, steps_total), exactly."""
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt))
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.init_modules()
    seen: list[tuple[str, int, int, int, int]] = []
    runner.on_progress = lambda p: seen.append((p.stage, p.step, p.steps, p.steps_done, p.steps_total))
    runner.run_pipeline(RequestConfig(prompt="x"), 0)
    assert seen == [("text_encoder", 0, 0, 0, 4), ("transformer", 0, 4, 0, 4),
                    *[("transformer", i, 4, i, 4) for i in range(1, 5)],
                    *[("vae_decoder", 0, 0, 4, 4)] * 4, ("save", 0, 0, 4, 4)]


@pytest.mark.parametrize("outcome", ["completed", "cancelled", "failed"])
def test_a_final_status_is_set_after_the_end_time_profile_and_file_cleanup(tmp_path: Path, outcome: str) -> None:
    """The API reads jobs without a lock: when it sees a final status, completed_at, the profile and the error
    are already set, and a cancelled or failed job's files are already gone (a client polling under load once
    saw `completed` with `completed_at` still null)."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from runnerkit.serve.jobs import FINAL, Worker

    @dataclass
    class RecordingJob(Job):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "status" and value in FINAL:  # what a reader sees at the moment the status turns final
                self.__dict__.setdefault("seen", []).append(
                    {"completed_at": self.completed_at is not None, "profile": self.profile is not None,
                     "error": self.error, "files": sorted(p.name for p in self.folder.iterdir())
                     if self.folder.exists() else None})
            object.__setattr__(self, name, value)

    class FakeRunner:
        on_progress = None
        profiler = SimpleNamespace(requests=[])

        def run_pipeline(self, request: RequestConfig, index: int) -> None:
            Path(request.save_result_path).write_bytes(b"mp4")
            self.profiler.requests.append(SimpleNamespace(index=index, seconds=1.0, stages={}, steps=[], memory={},
                                                          audit={}, shape=None, write={}))
            if outcome == "cancelled":
                raise RequestCancelled("cancelled")
            if outcome == "failed":  # as `Profiler.stage` tags an error raised inside a stage
                error = ValueError("bad")
                error.runnerkit_stage = "transformer"  # type: ignore[attr-defined]
                raise error

    folder = tmp_path / "job"
    folder.mkdir()
    job = RecordingJob(id="j", kind="video", request=RequestConfig(prompt="a"), folder=folder, fields={})
    worker = Worker(FakeRunner(), JobQueue(tmp_path, 4, None, None), on_done=lambda j: None,  # type: ignore[arg-type]
                    save_tensors=False)
    worker.run_job(job)
    assert job.status == outcome
    assert job.__dict__["seen"] == [{"completed_at": True, "profile": True,
                                     "error": "ValueError in stage transformer: bad" if outcome == "failed" else None,
                                     "files": ["result.mp4"] if outcome == "completed" else None}]


@pytest.mark.parametrize("how", ["delete", "shutdown"])
def test_a_queued_job_turns_cancelled_after_its_end_time_and_files(tmp_path: Path, how: str) -> None:
    from dataclasses import dataclass

    from runnerkit.serve.jobs import FINAL

    @dataclass
    class RecordingJob(Job):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "status" and value in FINAL:
                self.__dict__["seen"] = (self.completed_at is not None, self.folder.exists())
            object.__setattr__(self, name, value)

    queue = JobQueue(tmp_path, 4, None, None)
    folder = tmp_path / "q"
    folder.mkdir()
    job = RecordingJob(id="q", kind="video", request=RequestConfig(prompt="a"), folder=folder, fields={})
    queue.submit(job)
    if how == "delete":
        queue.cancel(job.id)
    else:
        queue.close(cancel_running=False)
    assert job.status == "cancelled" and job.__dict__["seen"] == (True, False)


def test_a_running_job_is_not_cancelled_when_the_queue_refuses_it(tmp_path: Path) -> None:
    """Under `parallel` (running_cancel_refused set) a cancel of the running job, from DELETE or from an
    images client that went away, leaves it running with no cancel request (every rank must stop at the
    same step, so none does); a queued job is still cancelled."""
    queue = JobQueue(tmp_path, 4, None, None)
    queue.running_cancel_refused = "refused under parallel"
    jobs = []
    for name in ("run", "wait"):
        (tmp_path / name).mkdir()
        jobs.append(Job(id=name, kind="video", request=RequestConfig(prompt="a"), folder=tmp_path / name, fields={}))
    queue.submit(*jobs)
    assert queue.next() is jobs[0]
    queue.cancel("run", "the client disconnected")
    queue.cancel("wait")
    assert (jobs[0].status, jobs[0].cancel.is_set(), jobs[0].as_dict()["cancel_requested"]) == ("in_progress", False,
                                                                                                 False)
    assert jobs[1].status == "cancelled"


def test_progress_stays_below_100_through_decode_and_save(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A job run by the Worker on the real tiny runner (4 steps, 3 decoder chunks): its `progress`, read
    at every progress report, climbs to 95 over the steps, holds 99 while the decoder and the save run,
    and reaches 100 only once the job is completed (`V2`: 100 before decode and save)."""
    from runnerkit.serve.jobs import Worker

    config = load_runner_config(None, tiny_config_dict(tiny_ckpt))
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.init_modules()
    folder = tmp_path / "job_p"
    folder.mkdir()
    job = Job(id="job_p", kind="video", request=RequestConfig(prompt="x"), folder=folder, fields={})
    seen: list[tuple[str, int, str]] = []

    class Observed:  # the runner, with each observer the Worker installs followed by a reading of the job
        def __getattr__(self, name: str) -> Any:
            return getattr(runner, name)

        def __setattr__(self, name: str, value: Any) -> None:
            if name == "on_progress" and value is not None:
                observe = value

                def value(p: Progress) -> None:
                    observe(p)
                    seen.append((p.stage, job.progress_percent(), job.status))
            setattr(runner, name, value)

    queue = JobQueue(tmp_path, 4, None, None)
    queue.submit(job)
    assert queue.next() is job
    Worker(Observed(), queue, on_done=lambda j: None, save_tensors=False).run_job(job)  # type: ignore[arg-type]
    assert seen == [("text_encoder", 0, "in_progress"), ("transformer", 0, "in_progress"),
                    *[("transformer", p, "in_progress") for p in (23, 47, 71, 95)],
                    *[("vae_decoder", 99, "in_progress")] * 4, ("save", 99, "in_progress")]
    assert (job.status, job.progress_percent()) == ("completed", 100)
    assert {k: job.as_dict()[k] for k in ("stage", "step", "steps", "steps_done", "steps_total")} == {
        "stage": "save", "step": 4, "steps": 4, "steps_done": 4, "steps_total": 4}


def test_first_step_metric_observes_each_jobs_first_step() -> None:
    """`runnerkit_first_step_seconds` takes a job's first step, not its last or any other (`V3`)."""
    import torch

    from runnerkit.serve.metrics import Metrics

    metrics = Metrics(torch.device("cpu"))
    metrics.observe_job("completed", {"seconds": 9.0, "steps": [0.5, 2.0, 4.0]})
    metrics.observe_job("completed", {"seconds": 9.0, "steps": [0.25, 8.0]})
    metrics.observe_job("cancelled", {"seconds": 1.0, "steps": []})  # cancelled before its first step
    text = metrics.render()[0].decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["runnerkit_first_step_seconds_count"]) == 2
    assert float(values["runnerkit_first_step_seconds_sum"]) == 0.75
    assert float(values["runnerkit_step_seconds_sum"]) == 14.75
    assert float(values['runnerkit_first_step_seconds_bucket{le="0.5"}']) == 2  # both first steps are <= 0.5 s


def test_an_oversized_image_is_413_naming_the_field() -> None:
    """An image one byte over MAX_IMAGE_BYTES, as base64 or as raw bytes (a form's file part): 413, not 422 (`V4`)."""
    from runnerkit.serve.app import MAX_IMAGE_BYTES

    raw = b"\x89PNG" + bytes(MAX_IMAGE_BYTES - 3)
    for value in (base64.b64encode(raw).decode(), raw):
        with pytest.raises(InputError, match=rf"`image` holds {MAX_IMAGE_BYTES + 1} bytes") as exc:
            _decode_image(value, "image")
        assert (exc.value.status, exc.value.field) == (413, "image")
    assert _decode_image(raw[:-1], "image") == raw[:-1]  # exactly at the limit: accepted


def test_an_upload_is_stored_under_the_extension_of_its_content() -> None:
    """Pillow tells the format from the bytes (the name a client gives is not trusted); not an image: .bin."""
    import io

    from PIL import Image

    from runnerkit.serve.app import image_extension

    def encoded(fmt: str) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format=fmt)
        return buf.getvalue()

    assert [image_extension(encoded(f)) for f in ("PNG", "JPEG", "WEBP", "BMP")] == [".png", ".jpg", ".webp", ".bmp"]
    assert image_extension(b"not an image") == ".bin"


def test_input_reference_is_the_first_frame_and_seconds_the_length(tmp_path: Path) -> None:
    """OpenAI's `input_reference` (a form's file part: bytes) becomes the i2v request's image, stored under
    its real extension; `seconds` becomes frames / fps rounded to 4k + 1 frames; errors name the
    fields as sent. The tiny i2v runner is only built (no checkpoint is read)."""
    import io
    import json

    from PIL import Image

    from runnerkit.serve.app import ServerState, build_request
    from test_cases.conftest import REPO

    data = json.loads((REPO / "configs" / "wan" / "wan_i2v_tiny.json").read_text())
    data.pop("synthetic_checkpoint")
    data.update(model_path=str(tmp_path / "absent"), device="cpu")
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    state = ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")
    buf = io.BytesIO()
    Image.new("RGB", (64, 40), (1, 2, 3)).save(buf, format="JPEG")
    jpeg = buf.getvalue()
    fps = runner.config.fps
    folder = tmp_path / "job"
    folder.mkdir()
    request, shown, resolved = build_request(state, {"prompt": "x", "input_reference": jpeg, "seconds": "1.1"}, folder)
    assert request.image_path == str(folder / "image.jpg") and (folder / "image.jpg").read_bytes() == jpeg
    assert fps == 8  # 1.1 s is 8.8 frames; Wan takes 4k + 1 frames: 9 (1.125 s, each frame shown 1/8 s), the nearest
    assert request.target_video_length == resolved["frames"] == 9 and resolved["seconds"] == "1.125"
    assert shown == {"prompt": "x", "image": f"{len(jpeg)} bytes", "seconds": "1.1"}
    for body, param in (({"image": jpeg}, "input_reference"), ({"seconds": "0"}, "seconds"),
                        ({"seconds": "2", "target_video_length": 9}, "seconds")):
        with pytest.raises(InputError) as exc:
            build_request(state, {"prompt": "x", "input_reference": jpeg, **body}, folder)
        assert exc.value.field == param, exc.value


def _call(app: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST `body` as JSON to the app's route `path`, calling its endpoint directly (no HTTP client)."""
    import asyncio
    import json

    from starlette.requests import Request

    raw = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "server": ("t", 80), "scheme": "http", "root_path": ""}
    route = next(r for r in app.routes if getattr(r, "path", None) == path)
    reply = asyncio.run(route.endpoint(Request(scope, receive)))
    return reply.status_code, json.loads(reply.body)


def _image_state(tmp_path: Path, max_queue: int) -> Any:
    from types import SimpleNamespace

    from runnerkit.serve.app import ServerState

    runner = SimpleNamespace(RESULT_KINDS={"t2i": "image"}, config=SimpleNamespace(task="t2i", model_cls="x"))
    queue = JobQueue(tmp_path, max_queue, None, None)
    return ServerState(runner=runner, queue=queue, metrics=None, phase="ready")  # type: ignore[arg-type]


def test_n_above_max_queue_is_422_naming_n_not_429(tmp_path: Path) -> None:
    """`n` images are `n` jobs: above --max_queue they can never fit, so 422 naming `n` (a 429 is retried
    forever by the openai client), refused before anything is queued."""
    from runnerkit.serve.app import create_app

    state = _image_state(tmp_path, max_queue=2)
    app = create_app(state)
    for path in ("/v1/images/generations", "/v1/images/edits"):
        status, body = _call(app, path, {"prompt": "x", "n": 3})
        assert (status, body["error"]["param"]) == (422, "n"), body
        assert "3" in body["error"]["message"] and "--max_queue" in body["error"]["message"]
        assert "retry" not in body["error"]["message"]
    assert state.queue.jobs == {} and not list(tmp_path.iterdir())


def _wan_i2v_state(tmp_path: Path) -> Any:
    """A ServerState over the tiny Wan i2v runner, only built (no checkpoint is read)."""
    import json

    from runnerkit.serve.app import ServerState
    from test_cases.conftest import REPO

    data = json.loads((REPO / "configs" / "wan" / "wan_i2v_tiny.json").read_text())
    data.pop("synthetic_checkpoint")
    data.update(model_path=str(tmp_path / "absent"), device="cpu")
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    return ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")


@pytest.mark.parametrize("seconds", ["0.1", "0.5", "0.62", "1000", "128.2", "3601", "-1", "nan", "four"])
def test_seconds_out_of_range_names_seconds_and_the_range_in_seconds(tmp_path: Path, seconds: str) -> None:
    """`seconds` outside [(TEMPORAL_FACTOR + 1) / fps, MAX_FRAMES / fps] (Wan at 8 fps: 0.625 to 128.125 s, a clip of
    F frames lasting F / fps) is refused
    with one message naming `seconds`, the value and that range: not a `target_video_length` error (a field the
    client never sent), no hidden cap of its own, and a short clip is never silently made one frame."""
    from runnerkit.config import MAX_FRAMES
    from runnerkit.serve.app import _frames_of

    state = _wan_i2v_state(tmp_path)
    fps = state.runner.config.fps
    assert (fps, state.runner.TEMPORAL_FACTOR, MAX_FRAMES) == (8, 4, 1025)
    with pytest.raises(InputError) as exc:
        _frames_of(seconds, state, fps)
    message = str(exc.value)
    assert exc.value.field == "seconds" and "target_video_length`" not in message.split(";")[0], message
    assert f"`seconds` {seconds!r}" in message and "0.625 to 128.125 seconds" in message, message


@pytest.mark.parametrize(("seconds", "frames"), [("0.625", 5), ("0.75", 5), ("1", 9), ("1.1", 9), ("128", 1025),
                                                  ("128.125", 1025), (4, 33)])
def test_seconds_in_range_become_frames(tmp_path: Path, seconds: Any, frames: int) -> None:
    from runnerkit.serve.app import _frames_of

    assert _frames_of(seconds, _wan_i2v_state(tmp_path), 8) == frames



def test_seconds_start_at_the_familys_shortest_clip(tmp_path: Path) -> None:
    """LTX-2.5 (the release's bounds: no `model`) takes at least 25 frames at 24 fps (`shortest_clip`): `seconds`
    from 25 / 24 s, refused below naming `seconds` and that range without the one-frame hint (it takes no single
    frame); Wan's range starts at TEMPORAL_FACTOR + 1 frames and keeps the hint."""
    import json

    from runnerkit.serve.app import ServerState, _frames_of
    from test_cases.conftest import REPO

    data = json.loads((REPO / "configs" / "ltx2" / "ltx25_t2av_22b_distilled.json").read_text())
    data.update(device="cpu")
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task).for_plan(config)  # the release's files are absent here
    state = ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")
    assert runner.shortest_clip(config) == 25 and _frames_of("1.05", state, 24) == 25
    with pytest.raises(InputError) as exc:
        _frames_of("0.5", state, 24)
    message = str(exc.value)
    assert exc.value.field == "seconds" and "from 1.04167 to 42.7083 seconds (25 to 1025 frames at 24 fps" in message
    assert "single frame" not in message, message
    with pytest.raises(InputError, match=r"0.625 to 128.125 seconds \(5 to 1025 frames .*single frame"):
        _frames_of("0.5", _wan_i2v_state(tmp_path), 8)

def _qwen_edit_state(tmp_path: Path) -> Any:
    """A ServerState over the tiny Qwen-Image edit runner (i2i: `image` and up to 2 `extra_images`), only
    built (no checkpoint is read)."""
    import json

    from runnerkit.serve.app import ServerState
    from test_cases.conftest import REPO

    data = json.loads((REPO / "configs" / "qwen_image" / "qwen_image_edit_tiny.json").read_text())
    data.pop("synthetic_checkpoint")
    data.update(model_path=str(tmp_path / "absent"), device="cpu")
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    return ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")


def _png(side: int = 64) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.effect_noise((side, side), 50).convert("RGB").save(buf, format="PNG")  # noise: a few KB, as a real upload
    return buf.getvalue()


@pytest.mark.parametrize("field", ["mask", "prompt", "quality", "response_format", "output_format", "n", "size"])
def test_a_refused_file_part_is_named_without_echoing_its_bytes(tmp_path: Path, field: str) -> None:
    """images.edit's `mask` (or a file part sent as any other field) is refused naming the field and
    "an uploaded file of N bytes", never the file's contents."""
    from runnerkit.serve.app import _pop_image_options, _pop_n, build_request

    state = _qwen_edit_state(tmp_path)
    png = _png()
    folder = tmp_path / "job"
    folder.mkdir()
    body = {"prompt": "x", "image": png, field: png}
    with pytest.raises(InputError) as exc:
        _pop_image_options(body)
        _pop_n(body)
        build_request(state, body, folder)
    message = str(exc.value)
    assert exc.value.field == field and f"an uploaded file of {len(png)} bytes" in message, message
    assert "PNG" not in message and "\\x" not in message and len(message) < 300, message


@pytest.mark.parametrize(("parts", "param", "says"), [
    (4, "image", "`image` holds 4 images; task 'i2i' takes at most 3 (the image and 2 references)"),
    (9, "image", "`image` holds 9 images; a request takes at most 8 (the image and 7 references)"),
    ("bad second", "image[1]", "`image[1]` (uploaded) is not an image"),
])
def test_images_edit_image_parts_are_named_as_sent(tmp_path: Path, parts: Any, param: str, says: str) -> None:
    """images.edit sends every image as an `image[]` part (the first the image, the others references): an error
    about the references names `image` / `image[k]` as sent, never `extra_images`, which the client did not send."""
    import asyncio

    from runnerkit.serve.app import _form_fields, build_request

    state = _qwen_edit_state(tmp_path)
    png = _png()
    images = [png, b"not an image"] if parts == "bad second" else [png] * parts
    body = asyncio.run(_form_fields([("prompt", "x"), *[("image[]", im) for im in images]]))
    folder = tmp_path / "job"
    folder.mkdir()
    with pytest.raises(InputError) as exc:
        build_request(state, body, folder)
    assert exc.value.field == param and says in str(exc.value), (exc.value.field, str(exc.value))
    assert "extra_images" not in str(exc.value)
    _, shown, _ = build_request(state, asyncio.run(_form_fields([("prompt", "x"), ("image[]", png), ("image[]", png)])),
                                folder)  # two parts: the image and one reference, reported as before
    assert shown == {"prompt": "x", "image": f"{len(png)} bytes", "extra_images": [f"{len(png)} bytes"]}


@pytest.mark.parametrize("reason", ["DELETE", "the client disconnected"])
def test_a_queued_job_cancelled_logs_one_info_line(tmp_path: Path, reason: str) -> None:
    """Cancelling a queued job (DELETE, or images.generate's client gone) logs one INFO line with the job id,
    that it was queued and why; a second cancel of the same job logs nothing more."""
    from loguru import logger

    queue = JobQueue(tmp_path, 4, None, None)
    folder = tmp_path / "job_q"
    folder.mkdir()
    job = Job(id="job_q", kind="image", request=RequestConfig(prompt="a"), folder=folder, fields={})
    queue.submit(job)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(f"{m.record['level'].name} {m.record['message']}"), level="DEBUG")
    try:
        queue.cancel(job.id, reason)
        queue.cancel(job.id, reason)
    finally:
        logger.remove(sink)
    assert job.status == "cancelled"
    assert lines == [f"INFO job job_q cancelled while queued ({reason})"], lines


def test_images_generate_client_gone_cancels_its_queued_jobs_and_logs_why(tmp_path: Path) -> None:
    """The endpoint itself (no HTTP client): the client disconnects while its 2 jobs wait in the queue (no
    worker runs); both are cancelled, each with one INFO line naming the disconnect."""
    import asyncio
    import json
    from types import SimpleNamespace

    from loguru import logger
    from starlette.requests import Request

    from runnerkit.serve.app import create_app

    state = _qwen_edit_state(tmp_path)
    state.metrics = SimpleNamespace(queue_depth=SimpleNamespace(set=lambda v: None))
    raw = json.dumps({"prompt": "x", "n": 2, "image": base64.b64encode(_png()).decode()}).encode()
    sent = []

    async def receive() -> dict[str, Any]:
        sent.append(1)
        if len(sent) == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/images/edits", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "server": ("t", 80), "scheme": "http"}
    route = next(r for r in create_app(state).routes if getattr(r, "path", None) == "/v1/images/edits")
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO",
                      filter=lambda r: "cancelled" in r["message"])
    try:
        reply = asyncio.run(route.endpoint(Request(scope, receive)))
    finally:
        logger.remove(sink)
    jobs = state.queue.list()
    assert reply.status_code == 499 and [j.status for j in jobs] == ["cancelled"] * 2
    assert lines == [f"job {j.id} cancelled while queued (the client disconnected)" for j in jobs], lines


def test_output_dir_that_is_a_file_is_named_a_file(tmp_path: Path) -> None:
    """`--output_dir` naming an existing file (or a path under one) says it is a file, not a folder (not the
    OS's "cannot be created: File exists"); a missing folder is created."""
    from runnerkit.config import ConfigError
    from runnerkit.serve.server import prepare_output_dir

    file = tmp_path / "passwd"
    file.write_text("x")
    with pytest.raises(ConfigError, match=r"--output_dir '.*passwd' is a file, not a folder; ") as exc:
        prepare_output_dir(str(file))
    assert "File exists" not in str(exc.value)
    with pytest.raises(ConfigError, match=rf"is a file, not a folder: {str(file)!r} above it"):
        prepare_output_dir(str(file / "out"))
    assert prepare_output_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()


class _NoHttp:
    """Stands for uvicorn's server: 'listening' at once, runs until the loader asks it to exit."""

    def __init__(self, config: Any) -> None:
        self.config, self.started, self.should_exit, self.servers = config, True, False, []

    def run(self) -> None:
        deadline = time.monotonic() + 120
        while not self.should_exit and time.monotonic() < deadline:
            time.sleep(0.02)


@pytest.mark.parametrize("config, refused", [("configs/wan/wan_t2v_tiny.json", True),
                                             ("configs/qwen_image/qwen_image_t2i_tiny.json", False)])
def test_without_ffmpeg_a_video_server_exits_2_before_loading_and_an_image_server_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], config: str,
        refused: bool) -> None:
    """A job's result is an .mp4 (video tasks) or a .png (image tasks): without its writer the server would turn
    ready and fail every job after running it in full, so it refuses to load, naming the extra and the module.
    An image server needs no ffmpeg (the GPU machine has none: the Qwen-Image server bench ran there)."""
    import signal
    import sys

    from runnerkit.config import ConfigError
    from runnerkit.runners.default import DefaultRunner
    from runnerkit.serve import server

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # what an uninstalled module looks like to imports
    monkeypatch.setattr(server, "_Server", _NoHttp)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # serve's handlers stay out of the test process

    def no_load(self: Any) -> None:
        raise ConfigError("load reached")

    monkeypatch.setattr(DefaultRunner, "load_modules", no_load)
    rc = server.main(["--config_json", config, "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    if refused:
        assert ("start failed: ConfigError: task 't2v' writes every job's result as a .mp4 and needs the `media` "
                'extra: pip install "runnerkit[media]" (from a checkout: pip install -e ".[media]"); missing: '
                "imageio_ffmpeg") in err and "load reached" not in err, err
    else:
        assert "load failed: ConfigError: load reached" in err and "media" not in err, err


def test_without_imageio_an_image_server_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from runnerkit.config import ConfigError
    from runnerkit.models.qwen_image.runner import QwenImageRunner
    from runnerkit.serve.server import check_writers

    check_writers(QwenImageRunner, "t2i")
    monkeypatch.setitem(sys.modules, "imageio", None)
    monkeypatch.setitem(sys.modules, "imageio.v3", None)
    with pytest.raises(ConfigError, match=r"task 't2i' writes every job's result as a \.png .*missing: imageio\.v3$"):
        check_writers(QwenImageRunner, "t2i")


@pytest.mark.parametrize("field, value, needle", [
    ("target_video_length", 8, "`target_video_length` must be 4n+1"),
    ("target_height", 50, "target_height"),
])
def test_a_config_whose_default_shape_is_invalid_exits_2_before_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], field: str, value: int,
        needle: str) -> None:
    """Every job that leaves the shape out would get 422 for a field its client never sent: the launch script
    refuses such a config at start (runnerkit/cli_common.py `check_default_shape`), and so does the server."""
    import json
    import signal

    from runnerkit.config import ConfigError
    from runnerkit.runners.default import DefaultRunner
    from runnerkit.serve import server

    data = json.loads((Path(__file__).resolve().parents[2] / "configs/wan/wan_t2v_tiny.json").read_text())
    cfg = tmp_path / "bad_shape.json"
    cfg.write_text(json.dumps({**data, field: value}))
    monkeypatch.setattr(server, "_Server", _NoHttp)
    monkeypatch.setattr(signal, "signal", lambda *a: None)

    def no_load(self: Any) -> None:
        raise ConfigError("load reached")

    monkeypatch.setattr(DefaultRunner, "load_modules", no_load)
    rc = server.main(["--config_json", str(cfg), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"start failed: ConfigError: config {cfg}: " in err and needle in err, err
    assert "(the default shape of every request)" in err and "load reached" not in err, err


def test_a_config_the_runner_refuses_names_the_flags_that_overrode_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`runnerkit serve --device cuda` without CUDA: the start fails (exit 2) naming the file and the flag
    the value came from, as the launch script says it (runnerkit/cli_common.py `config_source`)."""
    import signal

    import torch

    from runnerkit.serve import server

    cfg = Path(__file__).resolve().parents[2] / "configs/wan/wan_t2v_tiny.json"
    monkeypatch.setattr(server, "_Server", _NoHttp)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = server.main(["--config_json", str(cfg), "--device", "cuda", "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (f"start failed: ConfigError: config {cfg} with --device 'cuda': `device` is 'cuda' but CUDA is not "
            "available; use 'cpu' or 'auto'") in err, err


def _serve_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                   **changes: str) -> str:
    """`runnerkit serve` on the tiny Wan config with `changes`: asserts exit 2 and no HTTP server made; its stderr."""
    import json

    from runnerkit.serve import server

    data = json.loads((Path(__file__).resolve().parents[2] / "configs/wan/wan_t2v_tiny.json").read_text())
    cfg = tmp_path / "typo.json"
    cfg.write_text(json.dumps({**data, **changes}))
    made: list[Any] = []
    monkeypatch.setattr(server, "_Server", lambda *a, **k: made.append(a))
    rc = server.main(["--config_json", str(cfg), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and made == [], err
    return err


def test_an_unknown_model_cls_exits_2_before_the_port_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A `model_cls` no family registers is refused while the config is read (from the family sources, before
    the HTTP server is made), naming the value and the registered names, as the launch script refuses it."""
    err = _serve_refused(tmp_path, monkeypatch, capsys, model_cls="wan2.l")
    assert "invalid input: unknown `model_cls` 'wan2.l'; registered: [" in err and "'wan2.1'" in err, err
    assert "listening" not in err, err


def test_a_task_the_family_does_not_serve_exits_2_before_the_port_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A `task` the `model_cls`'s runners do not list is refused while the config is read (from the family
    sources, before the HTTP server is made), naming the task and the ones allowed."""
    err = _serve_refused(tmp_path, monkeypatch, capsys, task="t2av")
    assert ("invalid input: `task` 't2av' is not served by model_cls 'wan2.1'; "
            "allowed: ['flf2v', 'i2v', 't2v']") in err, err
    assert "listening" not in err, err


def test_serve_flags_take_only_a_registered_model_cls(capsys: pytest.CaptureFixture[str]) -> None:
    """`runnerkit serve --model_cls` lists the families as choices (read from their sources), as the launch
    script's does: a typo is argparse's usage error, exit 2."""
    from runnerkit.registry import model_cls_names
    from runnerkit.serve.server import build_parser

    assert build_parser().parse_args(["--config_json", "c.json", "--model_cls", "wan2.1"]).model_cls == "wan2.1"
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--config_json", "c.json", "--model_cls", "wan2.l"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --model_cls: invalid choice: 'wan2.l'" in err, err
    assert all(repr(name) in err for name in model_cls_names()), err
