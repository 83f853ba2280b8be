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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import ValidationError

from runnerkit.config import RequestConfig, format_validation_error
from runnerkit.runners.base import BaseRunner
from runnerkit.serve.jobs import FINAL, Job, JobQueue, QueueClosed, QueueFull
from runnerkit.serve.metrics import Metrics

#: Request fields the server sets itself (never from the body).
SERVER_FIELDS = ("save_result_path", "save_tensor_path", "image_path", "last_frame_path", "extra_image_paths")
#: Body fields that carry an image (base64) -> the request field it becomes.
IMAGE_FIELDS = {"image": "image_path", "last_frame": "last_frame_path"}
#: Body field carrying a list of further reference images (base64) -> `extra_image_paths`.
EXTRA_IMAGES_FIELD = "extra_images"
MAX_IMAGE_BYTES = 32 * 1024**2
MAX_BODY_BYTES = 3 * MAX_IMAGE_BYTES  # two base64 images (4/3 of their bytes) and the fields
PAGE = Path(__file__).with_name("page.html")


@dataclass
class ServerState:
    """What the API reads: the runner, its start-up phase, the jobs, the metrics."""

    runner: BaseRunner
    queue: JobQueue
    metrics: Metrics
    phase: str = "starting"  # starting -> loading -> warming_up -> ready | failed; stopping at shutdown
    error: str | None = None

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


def error(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None,
          **extra: Any) -> JSONResponse:
    """The API's error body: `{"error": {"message", "field", "code"}}` (+ `extra` top-level keys)."""
    return JSONResponse({"error": {"message": message, "field": field, "code": status}, **extra}, status,
                        headers=headers)


def _first_field(exc: ValidationError) -> str | None:
    errors = exc.errors()
    return ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None


def _decode_image(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise InputError(f"`{name}` must be a base64 string or a data:image/...;base64, URL", name)
    data = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    data = re.sub(r"\s+", "", data)  # MIME-wrapped base64 (line breaks every 76 characters)
    data += "=" * (-len(data) % 4)  # unpadded base64
    try:
        altchars = b"-_" if ("-" in data or "_" in data) else None  # URL-safe alphabet
        raw = base64.b64decode(data, altchars=altchars, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"`{name}` is not valid base64 (standard or URL-safe alphabet, optionally a "
                         "data:image/...;base64, URL)", name) from None
    if not raw:
        raise InputError(f"`{name}` is empty", name)
    if len(raw) > MAX_IMAGE_BYTES:
        raise InputError(f"`{name}` holds {len(raw)} bytes; at most {MAX_IMAGE_BYTES} are accepted", name, 413)
    return raw


def build_request(state: ServerState, body: Any, folder: Path) -> tuple[RequestConfig, dict[str, Any], dict[str, Any]]:
    """The body as a `RequestConfig` checked as the launch script checks a request; images saved
    into `folder`. Returns it, the fields the job reports, and the values it runs with (seed,
    height, width, frames).

    Raises:
        InputError: naming the field (422; 413 for an oversized image).
    """
    if not isinstance(body, dict):
        raise InputError("the body must be a JSON object of request fields")
    body = dict(body)
    for name in SERVER_FIELDS:
        if name in body:
            sent_as = {**{v: k for k, v in IMAGE_FIELDS.items()}, "extra_image_paths": EXTRA_IMAGES_FIELD}
            hint = f"; send the image itself as `{sent_as[name]}` (base64)" if name in sent_as else ""
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
    extra = body.pop(EXTRA_IMAGES_FIELD, None)
    if extra is not None and (not isinstance(extra, list) or not extra):
        raise InputError(f"`{EXTRA_IMAGES_FIELD}` must be a non-empty list of base64 images", EXTRA_IMAGES_FIELD)
    extra_raw = [_decode_image(v, f"{EXTRA_IMAGES_FIELD}[{k}]") for k, v in enumerate(extra or [])]
    shown = dict(body)
    for name, raw in images.items():
        path = folder / f"{name}.bin"
        path.write_bytes(raw)
        body[IMAGE_FIELDS[name]] = str(path)
        shown[name] = f"{len(raw)} bytes"
    if extra_raw:
        paths = [folder / f"{EXTRA_IMAGES_FIELD}{k}.bin" for k in range(len(extra_raw))]
        for path, raw in zip(paths, extra_raw):
            path.write_bytes(raw)
        body["extra_image_paths"] = [str(p) for p in paths]
        shown[EXTRA_IMAGES_FIELD] = [f"{len(raw)} bytes" for raw in extra_raw]
    try:
        request = RequestConfig.model_validate(body)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc, "request"), _first_field(exc)) from None
    runner = state.runner
    try:
        type(runner).validate_request(request, runner.config)  # type: ignore[attr-defined]
    except ValueError as exc:
        found = re.search(r"`(\w+(?:\[\d+\])?)`", str(exc))
        name = found.group(1) if found else None
        name = {**{v: k for k, v in IMAGE_FIELDS.items()}, "extra_image_paths": EXTRA_IMAGES_FIELD}.get(name or "", name)
        if name is not None and name.startswith("extra_image_paths["):
            name = EXTRA_IMAGES_FIELD + name[len("extra_image_paths"):]
        raise InputError(_api_wording(str(exc), folder), name) from None
    shape = runner.request_shape(request)  # type: ignore[attr-defined]
    try:
        runner.check_fit(shape, "request")  # type: ignore[attr-defined]
    except ValueError as exc:  # MemoryFitError: the shape as a whole
        raise InputError(str(exc)) from None
    cfg = runner.config
    resolved = {"model": cfg.model_cls, "seed": request.seed if request.seed is not None else cfg.seed,
                "height": shape[0], "width": shape[1], "frames": shape[2]}
    return request, shown, resolved


def _api_wording(message: str, folder: Path) -> str:
    """A launch-script message in the API's terms: body fields, not flags or server paths."""
    for body_field, request_field in IMAGE_FIELDS.items():
        message = message.replace(f"`{request_field}` (--{request_field}) is required",
                                  f"`{body_field}` is required")
        message = message.replace(f"`{request_field}`", f"`{body_field}`")
        message = message.replace(repr(str(folder / f"{body_field}.bin")), "(uploaded)")
        message = message.replace(f"{folder / body_field}.bin", "(uploaded)")
    message = message.replace("`extra_image_paths", f"`{EXTRA_IMAGES_FIELD}")
    message = re.sub("'?" + re.escape(str(folder / EXTRA_IMAGES_FIELD)) + r"\d+\.bin'?", "(uploaded)", message)
    return message.replace("give an image file", "send the image as base64")


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state` (the caller runs uvicorn and owns the runner's lifecycle)."""
    # No /docs: its page loads Swagger UI from a CDN (useless offline); the README documents the API.
    app = FastAPI(title="runnerkit", docs_url=None, redoc_url=None, openapi_url=None)
    kinds = {"video": "videos", "image": "images"}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    def not_ready() -> JSONResponse:
        retry = {"Retry-After": "5"} if state.phase in ("starting", "loading", "warming_up") else None
        return JSONResponse({"status": "not ready", "phase": state.phase, "error": state.error or state.queue.dead},
                            503, headers=retry)

    def not_accepting() -> JSONResponse:
        retry = {"Retry-After": "5"} if state.phase in ("starting", "loading", "warming_up") else None
        reason = state.error or state.queue.dead or f"the server is {state.phase.replace('_', ' ')}"
        return error(503, f"not accepting jobs: {reason}", headers=retry, phase=state.phase)

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
                "attention": state.runner.profiler.attention,
                "max_queue": state.queue.max_queue}

    async def submit(request: Request, kind: str) -> Response:
        if kind != state.kind:
            other = "/v1/videos" if state.kind == "video" else "/v1/images/generations"
            return error(404, f"this server's task {state.runner.config.task!r} makes {state.kind}s: POST {other}")
        if not state.ready():
            return not_accepting()
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return error(413, f"the body holds {length} bytes; at most {MAX_BODY_BYTES} are accepted")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return error(413, f"the body holds {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(422, f"malformed JSON body: {exc}")
        job_id, folder = state.queue.new_folder()
        try:
            req, shown, resolved = build_request(state, body, folder)
        except InputError as exc:
            _remove(folder)
            return error(exc.status, str(exc), exc.field)
        job = Job(id=job_id, kind=kind, request=req, folder=folder, fields=shown, resolved=resolved)
        reply = job.as_dict()  # as queued: the worker may start it before this reply is sent
        try:
            state.queue.submit(job)
        except QueueFull as exc:
            _remove(folder)
            return error(429, str(exc), headers={"Retry-After": "5"})
        except QueueClosed as exc:
            _remove(folder)
            return error(503, f"not accepting jobs: {exc}")
        state.metrics.queue_depth.set(state.queue.depth())
        return JSONResponse(reply)

    def job_or_404(job_id: str, kind: str) -> Job | JSONResponse:
        job = state.queue.get(job_id)
        if job is None or job.kind != kind:
            return error(404, f"no {kind} job {job_id!r}")
        return job

    for kind, plural in kinds.items():
        add_job_routes(app, state, kind, plural, submit, job_or_404)

    @app.get("/metrics")
    def metrics() -> Response:
        state.metrics.queue_depth.set(state.queue.depth())
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/")
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    return app


def add_job_routes(app: FastAPI, state: ServerState, kind: str, plural: str, submit: Any, job_or_404: Any) -> None:
    """POST, list, GET, content and DELETE of one result kind (closures: no parameter leaks into the API)."""

    async def post(request: Request) -> Response:
        return await submit(request, kind)

    def list_jobs() -> dict[str, Any]:
        return {"object": "list", "data": [j.as_dict() for j in state.queue.list() if j.kind == kind]}

    def get_job(job_id: str) -> Any:
        job = job_or_404(job_id, kind)
        return job if isinstance(job, JSONResponse) else job.as_dict()

    def content(job_id: str) -> Any:
        job = job_or_404(job_id, kind)
        if isinstance(job, JSONResponse):
            return job
        if job.status in ("queued", "in_progress"):
            return error(409, f"job {job_id} is {job.status}; its content exists once it is completed")
        if job.status != "completed":
            return error(409, f"job {job_id} is {job.status}: it has no content")
        if job.expired or not job.result_path.is_file():
            return error(410, f"the files of job {job_id} were removed by the retention limit")
        return FileResponse(job.result_path, media_type="image/png" if kind == "image" else "video/mp4",
                            filename=f"{job_id}{job.result_path.suffix}")

    def delete(job_id: str) -> Any:
        job = job_or_404(job_id, kind)
        if isinstance(job, JSONResponse):
            return job
        if job.status in FINAL:
            state.queue.delete(job_id)
            return {"id": job_id, "object": kind, "deleted": True}
        was_queued = job.status == "queued"
        job = state.queue.cancel(job_id)
        if job is None:
            return error(404, f"no {kind} job {job_id!r}")
        if was_queued and job.status == "cancelled" and job.started_at is None:
            state.metrics.observe_job("cancelled", None)  # it never reaches the worker
        state.metrics.queue_depth.set(state.queue.depth())
        return job.as_dict()

    post_path = "/v1/videos" if kind == "video" else "/v1/images/generations"
    app.add_api_route(post_path, post, methods=["POST"])
    app.add_api_route(f"/v1/{plural}", list_jobs, methods=["GET"])
    app.add_api_route(f"/v1/{plural}/{{job_id}}", get_job, methods=["GET"])
    app.add_api_route(f"/v1/{plural}/{{job_id}}/content", content, methods=["GET"])
    app.add_api_route(f"/v1/{plural}/{{job_id}}", delete, methods=["DELETE"])


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


__all__ = ["InputError", "ServerState", "build_request", "create_app"]
