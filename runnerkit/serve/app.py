"""The HTTP API of `runnerkit serve` (FastAPI): health, jobs, OpenAI-compatible endpoints, content,
metrics, a page.

Readiness is the warmup: `/health/ready` (and `/health`) answer 503 with the phase (`starting`
while the heavy modules are imported, `loading`, `warming_up`) until `init_modules` returned, 200
after, 503 again if the runner died or the server is stopping; `/health/live` answers 200 while
the process serves HTTP. No job is accepted before ready (503 with Retry-After).

Jobs: `POST /v1/videos` (tasks whose result is a video) or `POST /v1/images` (image results)
queue a job and answer its object at once (OpenAI's `Video` shape plus runnerkit's fields);
`POST /v1/images/generations` and `/v1/images/edits` are OpenAI's synchronous image calls: they
queue `n` jobs (successive seeds), wait for them and answer `{created, data: [{b64_json | url}]}`.
Bodies are JSON objects or multipart / url-encoded forms (what the official `openai` client
sends) of the launch script's request fields, read with their size caps counted as they arrive
(body.py), validated as the launch script validates them (422 naming the field in `param`); any
failure no route answers is a 500 in the same error shape (`type: server_error`). Images travel as base64 in JSON (`image`, `last_frame`,
`extra_images`: a `data:image/...;base64,` URL or bare base64) or as file parts of a form
(`input_reference` is OpenAI's name of the first frame); `size` ("WIDTHxHEIGHT") may replace
`target_width`/`target_height`, `seconds` may replace `target_video_length`; `model` may name the
served `model_cls`. Paths (`image_path`, `save_result_path`, ...) are the server's business and
are refused. `GET /v1/videos/{id}` (or `/v1/images/{id}`): status, progress, timings, profile;
`GET .../content`: the mp4/png; `DELETE`: cancel (queued or running) or forget a finished job;
`GET /v1/videos` lists jobs as OpenAI's cursor pages (`limit`, `order`, `after`).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from loguru import logger

from runnerkit.config import field_path
from runnerkit.serve.body import (EXTRA_IMAGES_FIELD, MAX_IMAGE_BYTES, ClientGone, InputError,  # noqa: F401
                                  read_body)
from runnerkit.serve.body import shown as _shown
from runnerkit.serve.body import form_fields as _form_fields  # noqa: F401  (the form's fields, for tests)
from runnerkit.serve.fields import _decode_image, image_extension  # noqa: F401  (for tests)
from runnerkit.serve.jobs import FINAL, Job, JobQueue, QueueClosed, QueueFull
from runnerkit.serve.request import _api_wording, _frames_of, build_request  # noqa: F401  (the last two for tests)

if TYPE_CHECKING:  # torch and the runners are imported after the port opened (server.py)
    from runnerkit.runners.default import DefaultRunner
    from runnerkit.serve.metrics import Metrics

#: `quality` values of OpenAI's image models: accepted, and they change nothing (the config decides).
QUALITIES = ("auto", "standard", "hd", "low", "medium", "high", "xhigh", "max")
RESPONSE_FORMATS = ("b64_json", "url")
MAX_N = 10  # OpenAI's bound on `n`
#: Fields of OpenAI's synchronous image calls, taken off the body before it is read as a request.
IMAGE_OPTIONS = ("n", "response_format", "quality", "output_format", "stream", "user", "safety_identifier")
PAGE = Path(__file__).with_name("page.html")


@dataclass
class ServerState:
    """What the API reads: the runner (None until the heavy imports are done), its start-up phase,
    the jobs, the metrics (None until then too)."""

    runner: DefaultRunner | None  # every family runner is one (`request_shape`, the request checks)
    queue: JobQueue
    metrics: Metrics | None
    phase: str = "starting"  # starting -> loading -> warming_up -> ready | failed; stopping at shutdown
    error: str | None = None

    @property
    def kind(self) -> str:
        if self.runner is None:
            return "video"
        kinds = getattr(self.runner, "RESULT_KINDS", {})
        return kinds.get(self.runner.config.task, "video")

    def ready(self) -> bool:
        return self.phase == "ready" and self.queue.dead is None and not self.queue.closed


def error(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None,
          **extra: Any) -> JSONResponse:
    """The API's error body, OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` (`param`:
    the body field at fault; `field`: the same, runnerkit's older name; `code`: the HTTP status), plus
    `extra` top-level keys."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": field, "field": field, "code": status},
                         **extra}, status, headers=headers)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state` (the caller runs uvicorn and owns the runner's lifecycle)."""
    # No /docs: its page loads Swagger UI from a CDN (useless offline); docs/server.md documents the API.
    app = FastAPI(title="runnerkit", docs_url=None, redoc_url=None, openapi_url=None)
    kinds = {"video": "videos", "image": "images"}
    _add_error_handlers(app)
    _add_status_routes(app, state)
    submit, job_or_404 = _add_submissions(app, state, kinds)
    for kind, plural in kinds.items():
        add_job_routes(app, state, kind, plural, submit, job_or_404)
    _add_metrics_and_page(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in the API's shape (`error`): HTTP errors, unconvertible parameters, unexpected failures."""


    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(RequestValidationError)
    async def invalid_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A query or path parameter FastAPI could not convert (`limit=abc`): 422 in the API's shape, naming the
        parameter (the first one at fault) and the value as sent."""
        problem = exc.errors()[0]
        where, name = problem["loc"][0], field_path(problem["loc"][1:]) or str(problem["loc"][0])
        msg = problem["msg"][:1].lower() + problem["msg"][1:]
        value = f" {_shown(problem['input'])}" if problem.get("input") is not None else ""
        return error(422, f"`{name}`{value} (a {where} parameter): {msg}", name)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        """Any failure the routes did not answer: 500 in the API's error shape. Starlette re-raises the exception
        after this answer, and uvicorn logs its traceback."""
        logger.error("{} {}: 500: {}: {}", request.method, request.url.path, type(exc).__name__, exc)
        return error(500, f"{request.method} {request.url.path}: internal server error ({type(exc).__name__}: {exc}); "
                          "the server's log has the traceback")


def _not_ready(state: ServerState) -> JSONResponse:
    retry = {"Retry-After": "5"} if state.phase in ("starting", "loading", "warming_up") else None
    return JSONResponse({"status": "not ready", "phase": state.phase, "error": state.error or state.queue.dead},
                        503, headers=retry)


def _not_accepting(state: ServerState) -> JSONResponse:
    retry = {"Retry-After": "5"} if state.phase in ("starting", "loading", "warming_up") else None
    reason = state.error or state.queue.dead or f"the server is {state.phase.replace('_', ' ')}"
    return error(503, f"not accepting jobs: {reason}", headers=retry, phase=state.phase)



def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """Health (live, ready), `/v1/info` and `/v1/models`."""

    @app.get("/health/live")
    def live() -> dict[str, Any]:
        return {"status": "alive", "phase": state.phase}

    @app.get("/health/ready")
    @app.get("/health")
    def ready() -> Any:
        if not state.ready():
            return _not_ready(state)
        return {"status": "ready", "phase": state.phase}

    @app.get("/v1/info")
    def info() -> dict[str, Any]:
        runner = state.runner
        if runner is None:  # still importing: nothing is known of the model yet
            return {"phase": state.phase, "max_queue": state.queue.max_queue}
        cfg = runner.config
        return {"model_cls": cfg.model_cls, "task": cfg.task, "kind": state.kind, "phase": state.phase,
                "image_inputs": [{"image_path": "image", "last_frame_path": "last_frame"}[f]
                                 for f in getattr(runner, "IMAGE_INPUTS", {}).get(cfg.task, ())],
                "extra_images": getattr(runner, "EXTRA_IMAGES", {}).get(cfg.task, 0),
                "defaults": {"target_height": cfg.target_height, "target_width": cfg.target_width,
                             "target_video_length": cfg.target_video_length, "infer_steps": cfg.infer_steps,
                             "seed": cfg.seed},
                # The shapes the family takes (its runner's factors): height and width multiples of
                # `spatial`, frames `temporal` * k + 1; `fps` turns frames into `seconds`.
                "factors": {"spatial": getattr(runner, "SPATIAL_FACTOR", 1),
                            "temporal": getattr(runner, "TEMPORAL_FACTOR", 1)},
                "fps": cfg.fps,
                "attention": runner.profiler.attention,
                "max_queue": state.queue.max_queue}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        """OpenAI's model list: the loaded base model, then the config's known LoRA adapters
        (`lora.adapters`; a request names one in `lora`), each with `parent` the base."""
        runner = state.runner
        if runner is None:
            return {"object": "list", "data": []}
        cfg = runner.config
        base = {"id": cfg.model_cls, "object": "model", "owned_by": "runnerkit", "task": cfg.task,
                "lora": None if cfg.lora is None else {"mode": cfg.lora.mode, "max_rank": cfg.lora.max_rank}}
        adapters = [{"id": name, "object": "model", "owned_by": "runnerkit", "parent": cfg.model_cls,
                     "kind": "lora"} for name in sorted(cfg.lora.adapters if cfg.lora else {})]
        return {"object": "list", "data": [base, *adapters]}


def _add_submissions(app: FastAPI, state: ServerState, kinds: dict[str, str]) -> tuple[Any, Any]:
    """Job submission: OpenAI's synchronous image calls (routes), and the `submit` and `job_or_404` that
    `add_job_routes` gives each result kind."""

    def refuse(kind: str) -> JSONResponse | None:
        """503 before ready or while stopping; 404 naming the right endpoint for the other result kind."""
        if not state.ready():
            return _not_accepting(state)
        if kind != state.kind:
            other = "/v1/videos" if state.kind == "video" else "/v1/images (or OpenAI's /v1/images/generations)"
            return error(404, f"this server's task {state.runner.config.task!r} makes {state.kind}s: POST {other}")
        return None

    def queue_jobs(kind: str, body: dict[str, Any], n: int,
                   options: tuple[str, ...] = ()) -> tuple[list[Job], dict[str, Any]] | JSONResponse:
        """Check and queue the body's job(s): one, or `n` with successive seeds. Returns them and the
        first one's object as queued (the worker may start it before the reply is sent). `options`: the
        endpoint's own fields (build_request)."""
        jobs: list[Job] = []
        try:
            for k in range(n):
                job_id, folder = state.queue.new_folder()
                varied = body if k == 0 else {**body, "seed": jobs[0].resolved["seed"] + k}
                try:
                    req, shown, resolved = build_request(state, varied, folder, options)
                except BaseException:
                    _remove(folder)
                    raise
                jobs.append(Job(id=job_id, kind=kind, request=req, folder=folder, fields=shown, resolved=resolved))
            queued = jobs[0].as_dict()
            state.queue.submit(*jobs)
        except InputError as exc:
            return _drop(jobs, error(exc.status, str(exc), exc.field))
        except QueueFull as exc:
            return _drop(jobs, error(429, str(exc), headers={"Retry-After": "5"}))
        except QueueClosed as exc:
            return _drop(jobs, error(503, f"not accepting jobs: {exc}"))
        state.metrics.queue_depth.set(state.queue.depth())
        return jobs, queued

    async def submit(request: Request, kind: str) -> Response:
        """`POST /v1/videos`, `POST /v1/images`: one queued job, answered at once."""
        if (refused := refuse(kind)) is not None:
            return refused
        try:
            body = await read_body(request)
        except InputError as exc:
            return error(exc.status, str(exc), exc.field)
        except ClientGone:
            return Response(status_code=499)
        done = queue_jobs(kind, body, 1)
        return done if isinstance(done, JSONResponse) else JSONResponse(done[1])

    _add_image_calls(app, state, refuse, queue_jobs)

    def job_or_404(job_id: str, kind: str) -> Job | JSONResponse:
        job = state.queue.get(job_id)
        if job is not None and job.kind == kind:
            return job
        if state.runner is not None and kind != state.kind:  # one server makes one kind: name the other endpoint
            return error(404, f"no {kind} job {job_id!r}: this server's task makes {state.kind}s, "
                              f"see /v1/{kinds[state.kind]}/{job_id}")
        return error(404, f"no {kind} job {job_id!r}")

    return submit, job_or_404


def _add_image_calls(app: FastAPI, state: ServerState, refuse: Any, queue_jobs: Any) -> None:
    """OpenAI's synchronous `images.generate` and `images.edit` (`refuse`, `queue_jobs`: `_add_submissions`')."""

    @app.post("/v1/images/generations")
    @app.post("/v1/images/edits")
    async def images_sync(request: Request) -> Response:
        """OpenAI's `images.generate` / `images.edit`: `n` jobs (successive seeds), waited for; answers
        `{created, data: [{b64_json} | {url}], size, output_format, quality}`. A job that fails or is
        cancelled answers 500 naming it; a client that disconnects cancels the jobs."""
        if (refused := refuse("image")) is not None:
            return refused
        try:
            body = await read_body(request)
            options = _pop_image_options(body)
            n = _pop_n(body)
            if n > state.queue.max_queue:  # never fits, however long the client waits: not 429 (retried)
                raise InputError(f"`n` {n}: n images run as n jobs, and this server queues at most "
                                 f"{state.queue.max_queue} (--max_queue); ask for n <= {state.queue.max_queue}", "n")
        except InputError as exc:
            return error(exc.status, str(exc), exc.field)
        except ClientGone:
            return Response(status_code=499)
        done = queue_jobs("image", body, n, IMAGE_OPTIONS)
        if isinstance(done, JSONResponse):
            return done
        jobs = done[0]
        pngs: dict[str, bytes] = {}
        while any(j.status not in FINAL for j in jobs):
            for j in jobs:  # read each image as soon as it exists: retention may remove it after later jobs
                if j.status == "completed" and j.id not in pngs and options["response_format"] == "b64_json":
                    pngs[j.id] = j.result_path.read_bytes()
            if await request.is_disconnected():
                for j in jobs:
                    state.queue.cancel(j.id, "the client disconnected")
                return Response(status_code=499)
            await asyncio.sleep(0.02)
        bad = [j for j in jobs if j.status != "completed"]
        if bad:
            return error(500, "; ".join(f"job {j.id} {j.status}" + (f": {j.error}" if j.error else "") for j in bad))
        data = []
        for j in jobs:
            if options["response_format"] == "url":
                data.append({"url": f"{str(request.base_url).rstrip('/')}/v1/images/{j.id}/content"})
            else:
                png = pngs.get(j.id) or j.result_path.read_bytes()
                data.append({"b64_json": base64.b64encode(png).decode()})
        return JSONResponse({"created": int(time.time()), "data": data, "size": jobs[0].as_dict()["size"],
                             "output_format": "png", "quality": options["quality"]})


def _add_metrics_and_page(app: FastAPI, state: ServerState) -> None:
    """`/metrics` (Prometheus text; 503 while starting) and the page at `/`."""

    @app.get("/metrics")
    def metrics() -> Response:
        if state.metrics is None:
            return error(503, "no metrics yet: the server is starting", headers={"Retry-After": "5"})
        state.metrics.queue_depth.set(state.queue.depth())
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/")
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))



def _pop_n(body: dict[str, Any]) -> int:
    n = body.pop("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InputError(f"`n` must be an integer in [1, {MAX_N}] (got {_shown(n)}); n images run as n jobs with "
                         "successive seeds", "n")
    return n


def _pop_image_options(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's image options, removed from `body`: `response_format` (`b64_json`, the default, or
    `url`), `quality` (accepted, changes nothing), `output_format` (`png` only), `stream` (false
    only), `user` and `safety_identifier` (ignored).

    Raises:
        InputError: naming the option.
    """
    fmt = body.pop("response_format", None) or "b64_json"
    if fmt not in RESPONSE_FORMATS:
        raise InputError(f"`response_format` must be one of {list(RESPONSE_FORMATS)} (got {_shown(fmt)})",
                         "response_format")
    quality = body.pop("quality", None) or "auto"
    if quality not in QUALITIES:
        raise InputError(f"`quality` must be one of {list(QUALITIES)} (got {_shown(quality)}); it changes nothing "
                         "here: "
                         "the config's steps decide", "quality")
    output_format = body.pop("output_format", None) or "png"
    if output_format != "png":
        raise InputError(f"`output_format` {_shown(output_format)}: this server writes png only", "output_format")
    stream = body.pop("stream", None)
    if stream not in (None, False, "false"):
        raise InputError("`stream`: streamed (partial) images are not offered; leave `stream` unset", "stream")
    body.pop("user", None)
    body.pop("safety_identifier", None)
    return {"response_format": fmt, "quality": quality}


def _drop(jobs: list[Job], reply: JSONResponse) -> JSONResponse:
    """Remove the folders of jobs that were not queued; return `reply`."""
    for job in jobs:
        _remove(job.folder)
    return reply


def add_job_routes(app: FastAPI, state: ServerState, kind: str, plural: str, submit: Any, job_or_404: Any) -> None:
    """POST, list, GET, content and DELETE of one result kind (closures: no parameter leaks into the API)."""

    async def post(request: Request) -> Response:
        return await submit(request, kind)

    def list_jobs(limit: int | None = None, order: str = "desc", after: str | None = None) -> Any:
        """OpenAI's cursor page: `data` newest first (`order=desc`, the default) or oldest first
        (`asc`), at most `limit` jobs (default: all), those after the job `after`; `first_id`,
        `last_id`, `has_more`."""
        if order not in ("asc", "desc"):
            return error(422, f"`order` must be 'asc' or 'desc' (got {order!r})", "order")
        if limit is not None and not 1 <= limit <= 1000:
            return error(422, f"`limit` must be in [1, 1000] (got {limit})", "limit")
        jobs = [j for j in state.queue.list() if j.kind == kind]  # oldest first
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                return error(404, f"`after`: no {kind} job {after!r}", "after")
            jobs = jobs[ids.index(after) + 1:]
        page = jobs if limit is None else jobs[:limit]
        return {"object": "list", "data": [j.as_dict() for j in page],
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                "has_more": len(page) < len(jobs)}

    def get_job(job_id: str) -> Any:
        job = job_or_404(job_id, kind)
        return job if isinstance(job, JSONResponse) else job.as_dict()

    async def content(job_id: str, variant: str | None = None) -> Any:
        # async: no hand-off to a worker thread, so the response built after `open_content` always reaches the
        # client's task and releases the hold when it was sent, failed or was cancelled
        if variant not in (None, kind):
            return error(422, f"`variant` {variant!r}: only the {kind} itself is offered (no thumbnail or "
                              "spritesheet)", "variant")
        job = job_or_404(job_id, kind)
        if isinstance(job, JSONResponse):
            return job
        if job.status in ("queued", "in_progress"):
            return error(409, f"job {job_id} is {job.status}; its content exists once it is completed")
        if job.status != "completed":
            return error(409, f"job {job_id} has status {job.status!r}: it has no content")
        if not state.queue.open_content(job):
            return job_or_404(job_id, kind) if state.queue.get(job_id) is None else error(410, _gone(job_id))
        return _held_file(state.queue, job)

    def delete(job_id: str) -> Any:
        """A finished job: forgotten, its files deleted (`{id, object: "video.deleted", deleted: true}`, as
        OpenAI). A queued or running one: cancelled; answers its object with `deleted: false`."""
        job = job_or_404(job_id, kind)
        if isinstance(job, JSONResponse):
            return job
        if job.status in FINAL:
            state.queue.delete(job_id)
            return {"id": job_id, "object": f"{kind}.deleted", "deleted": True}
        if job.status == "in_progress" and state.queue.running_cancel_refused is not None:
            return error(409, f"job {job_id} is running: {state.queue.running_cancel_refused}")
        was_queued = job.status == "queued"
        job = state.queue.cancel(job_id)
        if job is None:
            return error(404, f"no {kind} job {job_id!r}")
        if was_queued and job.status == "cancelled" and job.started_at is None:
            state.metrics.observe_job("cancelled", None)  # it never reaches the worker
        state.metrics.queue_depth.set(state.queue.depth())
        return {**job.as_dict(), "deleted": False}

    app.add_api_route(f"/v1/{plural}", post, methods=["POST"])
    app.add_api_route(f"/v1/{plural}", list_jobs, methods=["GET"])
    app.add_api_route(f"/v1/{plural}/{{job_id}}", get_job, methods=["GET"])
    app.add_api_route(f"/v1/{plural}/{{job_id}}/content", content, methods=["GET", "HEAD"])  # HEAD: size, type
    app.add_api_route(f"/v1/{plural}/{{job_id}}", delete, methods=["DELETE"])


def _gone(job_id: str) -> str:
    return f"the files of job {job_id} were removed by the retention limit"


def _held_file(queue: JobQueue, job: Job) -> Response:
    """The result file of `job`, whose download `queue.open_content` admitted: released when sent, failed or
    cancelled, or here if the response cannot be built (410 when the file is gone)."""
    try:
        stat = os.stat(job.result_path)
        return _HeldFileResponse(job.result_path, media_type="image/png" if job.kind == "image" else "video/mp4",
                                 filename=f"{job.id}{job.result_path.suffix}", stat_result=stat,
                                 release=lambda: queue.close_content(job))
    except BaseException as exc:
        queue.close_content(job)
        if isinstance(exc, FileNotFoundError):
            return error(410, _gone(job.id))
        raise


class _HeldFileResponse(FileResponse):
    """A `FileResponse` that calls `release` once it was sent, failed or was cancelled (a client gone): the job
    queue removes a result's folder only after the downloads under way ended (`JobQueue.open_content`)."""

    def __init__(self, *args: Any, release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


__all__ = ["InputError", "ServerState", "build_request", "create_app"]
