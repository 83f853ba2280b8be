"""The HTTP API of `runnerkit serve` (FastAPI): health, jobs, content, metrics, a page.

Readiness is the warmup: `/health/ready` (and `/health`) answer 503 with the phase (`loading`,
`warming_up`) until `init_modules` returned, 200 after, 503 again if the runner died or the
server is stopping; `/health/live` answers 200 while the process serves HTTP. No job is accepted
before ready (503 with Retry-After).

Jobs (OpenAI's video-job shape): `POST /v1/videos` (tasks whose result is a video) or
`POST /v1/images/generations` (image results) with a JSON body of the launch script's request
fields, validated as the launch script validates them (422 naming the field). Images travel in
the body as base64 (`image`, `last_frame`: a `data:image/...;base64,` URL or bare base64);
`size` ("WIDTHxHEIGHT") may replace `target_width`/`target_height`; `model` may name the
served `model_cls`. Paths (`image_path`, `save_result_path`, ...) are the server's business and
are refused. `GET /v1/videos/{id}` (or `/v1/images/{id}`): status, progress, timings, profile;
`GET .../content`: the mp4/png; `DELETE`: cancel (queued or running) or forget a finished job.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import ValidationError

from runnerkit.config import RequestConfig, format_validation_error
from runnerkit.runners.base import BaseRunner
from runnerkit.serve.jobs import FINAL, Job, JobQueue, QueueClosed, QueueFull
from runnerkit.serve.metrics import Metrics

#: Request fields the server sets itself (never from the body).
SERVER_FIELDS = ("save_result_path", "save_tensor_path", "image_path", "last_frame_path")
#: Body fields that carry an image (base64) -> the request field it becomes.
IMAGE_FIELDS = {"image": "image_path", "last_frame": "last_frame_path"}
MAX_IMAGE_BYTES = 32 * 1024**2
PAGE = Path(__file__).with_name("page.html")


@dataclass
class ServerState:
    """What the API reads: the runner, its start-up phase, the jobs, the metrics."""

    runner: BaseRunner
    queue: JobQueue
    metrics: Metrics
    phase: str = "starting"  # starting -> loading -> warming_up -> ready | failed; stopping at shutdown
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def kind(self) -> str:
        kinds = getattr(self.runner, "RESULT_KINDS", {})
        return kinds.get(self.runner.config.task, "video")

    def ready(self) -> bool:
        return self.phase == "ready" and self.queue.dead is None and not self.queue.closed


class InputError(Exception):
    """A request the server refuses (HTTP `status`), naming the field."""

    def __init__(self, message: str, field: str | None = None, status: int = 422) -> None:
        super().__init__(message)
        self.field, self.status = field, status


def error(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field, "code": status}}, status, headers=headers)


def _first_field(exc: ValidationError) -> str | None:
    errors = exc.errors()
    return ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None


def _decode_image(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise InputError(f"`{name}` must be a base64 string or a data:image/...;base64, URL", name)
    data = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"`{name}` is not valid base64", name) from None
    if not raw:
        raise InputError(f"`{name}` is empty", name)
    if len(raw) > MAX_IMAGE_BYTES:
        raise InputError(f"`{name}` holds {len(raw)} bytes; at most {MAX_IMAGE_BYTES} are accepted", name, 413)
    return raw


def build_request(state: ServerState, body: Any, folder: Path) -> tuple[RequestConfig, dict[str, Any]]:
    """The body as a `RequestConfig` checked as the launch script checks a request; images saved
    into `folder`. Returns it and the fields the job reports.

    Raises:
        InputError: naming the field (422; 413 for an oversized image).
    """
    if not isinstance(body, dict):
        raise InputError("the body must be a JSON object of request fields")
    body = dict(body)
    for name in SERVER_FIELDS:
        if name in body:
            hint = f"; send the image itself as `{'image' if name == 'image_path' else 'last_frame'}` (base64)" \
                if name in ("image_path", "last_frame_path") else ""
            raise InputError(f"`{name}` is set by the server, not by a request{hint}", name)
    model = body.pop("model", None)
    if model is not None and model != state.runner.config.model_cls:
        raise InputError(f"`model` {model!r}: this server serves {state.runner.config.model_cls!r}", "model")
    size = body.pop("size", None)
    if size is not None:
        m = re.fullmatch(r"(\d+)x(\d+)", str(size))
        if m is None:
            raise InputError(f"`size` must be WIDTHxHEIGHT, e.g. \"832x480\" (got {size!r})", "size")
        if "target_width" in body or "target_height" in body:
            raise InputError("give `size` or `target_width`/`target_height`, not both", "size")
        body["target_width"], body["target_height"] = int(m.group(1)), int(m.group(2))
    images = {name: _decode_image(body.pop(name), name) for name in IMAGE_FIELDS if name in body}
    shown = dict(body)
    for name, raw in images.items():
        path = folder / f"{name}.bin"
        path.write_bytes(raw)
        body[IMAGE_FIELDS[name]] = str(path)
        shown[name] = f"{len(raw)} bytes"
    try:
        request = RequestConfig.model_validate(body)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc, "request"), _first_field(exc)) from None
    runner = state.runner
    try:
        type(runner).validate_request(request, runner.config)  # type: ignore[attr-defined]
    except ValueError as exc:
        found = re.search(r"`(\w+)`", str(exc))
        name = found.group(1) if found else None
        name = {v: k for k, v in IMAGE_FIELDS.items()}.get(name or "", name)
        raise InputError(str(exc).replace("image_path", "image").replace("last_frame_path", "last_frame")
                         .replace("(--image)", "").replace("(--last_frame)", ""), name) from None
    shape = runner.request_shape(request)  # type: ignore[attr-defined]
    try:
        runner.check_fit(shape, "request")  # type: ignore[attr-defined]
    except ValueError as exc:  # MemoryFitError
        raise InputError(str(exc), "target_height") from None
    return request, shown


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state` (the caller runs uvicorn and owns the runner's lifecycle)."""
    app = FastAPI(title="runnerkit", docs_url="/docs", redoc_url=None)
    kinds = {"video": ("videos", "video"), "image": ("images", "image")}

    def not_ready() -> JSONResponse:
        retry = {"Retry-After": "5"} if state.phase in ("starting", "loading", "warming_up") else None
        return JSONResponse({"status": "not ready", "phase": state.phase, "error": state.error or state.queue.dead},
                            503, headers=retry)

    @app.get("/health/live")
    def live() -> dict[str, Any]:
        return {"status": "alive", "phase": state.phase}

    @app.get("/health/ready")
    @app.get("/health")
    def ready() -> Any:
        if not state.ready():
            return not_ready()
        return {"status": "ready", "phase": state.phase}

    @app.get("/v1/info")
    def info() -> dict[str, Any]:
        cfg = state.runner.config
        return {"model_cls": cfg.model_cls, "task": cfg.task, "kind": state.kind, "phase": state.phase,
                "image_inputs": [{"image_path": "image", "last_frame_path": "last_frame"}[f]
                                 for f in getattr(state.runner, "IMAGE_INPUTS", {}).get(cfg.task, ())],
                "defaults": {"target_height": cfg.target_height, "target_width": cfg.target_width,
                             "target_video_length": cfg.target_video_length, "infer_steps": cfg.infer_steps,
                             "seed": cfg.seed},
                "max_queue": state.queue.max_queue}

    async def submit(request: Request, kind: str) -> Response:
        if kind != state.kind:
            other = "/v1/videos" if state.kind == "video" else "/v1/images/generations"
            return error(404, f"this server's task {state.runner.config.task!r} makes {state.kind}s: POST {other}")
        if not state.ready():
            return not_ready()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(422, f"malformed JSON body: {exc}")
        job_id, folder = state.queue.new_folder()
        try:
            req, shown = build_request(state, body, folder)
        except InputError as exc:
            _remove(folder)
            return error(exc.status, str(exc), exc.field)
        job = Job(id=job_id, kind=kind, request=req, folder=folder, fields=shown)
        try:
            state.queue.submit(job)
        except QueueFull as exc:
            _remove(folder)
            return error(429, str(exc), headers={"Retry-After": "5"})
        except QueueClosed as exc:
            _remove(folder)
            return error(503, f"not accepting jobs: {exc}")
        state.metrics.queue_depth.set(state.queue.depth())
        return JSONResponse(job.as_dict())

    def job_or_404(job_id: str, kind: str) -> Job | JSONResponse:
        job = state.queue.get(job_id)
        if job is None or job.kind != kind:
            return error(404, f"no {kind} job {job_id!r}")
        return job

    for kind, (plural, obj) in kinds.items():
        post_path = "/v1/videos" if kind == "video" else "/v1/images/generations"

        async def post(request: Request, _kind: str = kind) -> Response:
            return await submit(request, _kind)

        def list_jobs(_kind: str = kind) -> dict[str, Any]:
            return {"object": "list", "data": [j.as_dict() for j in state.queue.list() if j.kind == _kind]}

        def get_job(job_id: str, _kind: str = kind) -> Any:
            job = job_or_404(job_id, _kind)
            return job if isinstance(job, JSONResponse) else job.as_dict()

        def content(job_id: str, _kind: str = kind) -> Any:
            job = job_or_404(job_id, _kind)
            if isinstance(job, JSONResponse):
                return job
            if job.status != "completed":
                return error(409, f"job {job_id} is {job.status}; content exists once it is completed")
            if job.expired or not job.result_path.is_file():
                return error(410, f"the files of job {job_id} were removed by the retention limit")
            return FileResponse(job.result_path, media_type="image/png" if _kind == "image" else "video/mp4",
                                filename=f"{job_id}{job.result_path.suffix}")

        def delete(job_id: str, _kind: str = kind) -> Any:
            job = job_or_404(job_id, _kind)
            if isinstance(job, JSONResponse):
                return job
            if job.status in FINAL:
                state.queue.delete(job_id)
                return {"id": job_id, "object": _kind, "deleted": True}
            job = state.queue.cancel(job_id)
            if job is not None and job.status == "cancelled" and job.started_at is None:
                state.metrics.observe_job("cancelled", None)  # ended without running: the worker never sees it
            state.metrics.queue_depth.set(state.queue.depth())
            return job.as_dict() if job is not None else error(404, f"no {_kind} job {job_id!r}")

        app.add_api_route(post_path, post, methods=["POST"])
        app.add_api_route(f"/v1/{plural}", list_jobs, methods=["GET"])
        app.add_api_route(f"/v1/{plural}/{{job_id}}", get_job, methods=["GET"])
        app.add_api_route(f"/v1/{plural}/{{job_id}}/content", content, methods=["GET"])
        app.add_api_route(f"/v1/{plural}/{{job_id}}", delete, methods=["DELETE"])

    @app.get("/metrics")
    def metrics() -> Response:
        state.metrics.queue_depth.set(state.queue.depth())
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/")
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    return app


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


__all__ = ["InputError", "ServerState", "build_request", "create_app"]
