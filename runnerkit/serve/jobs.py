"""Jobs of the HTTP server: records, a bounded FIFO queue, the worker that runs them, retention.

One runner per process serves one job at a time, in submission order, on a worker thread. A job
moves `queued -> in_progress -> completed | failed | cancelled` (or `queued -> cancelled`); its
record (status, progress, timings, profile, error) lives in memory for the process lifetime
only: a restart forgets every job, while the files already written stay in the output folder.

Cancellation: a queued job is removed from the queue and never runs; a running one stops at the
next stage or denoising-step boundary (the worker's `on_progress` raises `RequestCancelled`),
and `run_pipeline` runs `end_run` as after any failure, so the next job starts from the start-up
baseline. If `end_run` itself fails, the runner's state is unknown: the worker stops and the
server reports not ready (`JobQueue.dead`).

Files: with `--max_writes_in_flight` N >= 1 (the default 1) a job's files (mp4 encode, sidecar,
tensors) are written on the runner's writer thread while the next job computes (runnerkit/writer.py);
the job stays `in_progress` (stage `save`, progress 99) until they are written, then turns
`completed`, or `failed` if they could not be (the error names the file; nothing of the job is kept),
in submission order. A cancel then finds no boundary left: the job completes, as during an inline save.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from loguru import logger

from runnerkit.cli_common import in_stage
from runnerkit.config import RequestConfig

if TYPE_CHECKING:  # torch is imported by the worker, after the port opened (server.py)
    from runnerkit.profiling import RequestProfile
    from runnerkit.runners.base import BaseRunner, Progress

Status = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
FINAL: tuple[Status, ...] = ("completed", "failed", "cancelled")


class QueueFull(Exception):
    """The queue holds `max_queue` jobs already (HTTP 429)."""


class QueueClosed(Exception):
    """The server is shutting down or its runner died: no job is accepted (HTTP 503)."""


@dataclass
class Job:
    """One generation job and everything the API reports about it."""

    id: str
    kind: str  # "video" | "image": the result kind of the runner's task
    request: RequestConfig
    folder: Path
    fields: dict[str, Any]  # the submitted request fields (images as their byte counts), for the API
    resolved: dict[str, Any] = field(default_factory=dict)  # seed, height, width, frames (seconds) it runs with
    status: Status = "queued"
    created_at: float = field(default_factory=time.time)  # Unix seconds (float: sub-second order of jobs)
    started_at: float | None = None
    completed_at: float | None = None
    stage: str | None = None
    step: int = 0
    steps: int = 0
    steps_done: int = 0
    steps_total: int = 0
    error: str | None = None
    profile: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None  # the result's audio stream ({codec, sample_rate, channels}), once completed
    expired: bool = False  # its files were removed by the retention limit
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def result_path(self) -> Path:
        return self.folder / ("result.png" if self.kind == "image" else "result.mp4")

    @property
    def tensor_path(self) -> Path:
        return self.folder / "result.safetensors"

    def ran_at(self, shape: list[int], fps: float) -> None:
        """`shape` [height, width, frames] is what the request ran at (its profile's, read once the encoders ran):
        it replaces the admitted shape in `resolved` (and `seconds`, a video's length, with it). A family may
        predict part of a shape after admission (a request that omits its frame count may be admitted at the
        largest count the family's bounds allow and run at the count the family predicts from its prompt)."""
        if not self.resolved or not all(shape):  # [0, 0, 0]: the request failed before its shape was known
            return
        self.resolved.update(height=shape[0], width=shape[1], frames=shape[2])
        if "seconds" in self.resolved:
            self.resolved["seconds"] = clip_seconds(shape[2], fps)

    def progress_percent(self) -> int:
        """0-95 over the denoising steps, 99 once decoding and saving run, 100 when completed."""
        if self.status == "completed":
            return 100
        if self.stage is not None and self.steps_total and self.steps_done >= self.steps_total and self.step == 0:
            return 99  # a decoder or the save is running (or was, when cancelled)
        return int(95 * self.steps_done / self.steps_total) if self.steps_total else 0

    def as_dict(self) -> dict[str, Any]:
        """The job object of the API: OpenAI's `Video` fields (`id`, `object`, `model`, `status`,
        `progress`, `created_at`/`completed_at`/`expires_at` as integer Unix seconds, `size`, `seconds`,
        `prompt`, `error` as `{code, message}`, `remixed_from_video_id`) plus runnerkit's (stage and
        steps, the request and what it runs with, `timestamps` to the sub-second, timings, profile, and
        `audio`: the completed result's audio stream `{codec, sample_rate, channels}`, null when it has
        none or is not completed)."""
        return {
            "id": self.id, "object": self.kind, "model": self.resolved.get("model"), "status": self.status,
            "progress": self.progress_percent(),
            "size": f"{self.resolved['width']}x{self.resolved['height']}" if self.resolved else None,
            "seconds": self.resolved.get("seconds"), "prompt": self.request.prompt,
            "created_at": int(self.created_at), "completed_at": _int_or_none(self.completed_at),
            "expires_at": None, "remixed_from_video_id": None,
            "error": None if self.error is None else {"code": "generation_failed", "message": self.error},
            "stage": self.stage, "step": self.step, "steps": self.steps, "steps_done": self.steps_done,
            "steps_total": self.steps_total, "started_at": _int_or_none(self.started_at),
            "timestamps": {"created_at": self.created_at, "started_at": self.started_at,
                           "completed_at": self.completed_at},
            "cancel_requested": self.cancel.is_set() and self.status not in FINAL,
            "request": self.fields, "resolved": self.resolved,
            "timings": None if self.profile is None else {"seconds": self.profile["seconds"],
                                                          "stages": self.profile["stages"],
                                                          "steps": self.profile["steps"]},
            "profile": self.profile, "audio": self.audio,
            "content_available": self.status == "completed" and not self.expired,
        }


def clip_seconds(frames: int, fps: float) -> str:
    """The length of a clip of `frames` frames at `fps` as the API's `seconds` string: frames / fps (each frame
    is shown 1 / fps s, as the mp4 and the result's sidecar count it), e.g. 25 frames at 24 fps -> "1.04167"."""
    return f"{frames / fps:g}"


def _int_or_none(t: float | None) -> int | None:
    return None if t is None else int(t)


class JobQueue:
    """Job records and the FIFO of queued jobs, bounded by `max_queue` (thread-safe).

    Retention: after a job ends, the oldest results are deleted while more than `keep_jobs`
    results are kept, or they exceed `keep_bytes` (None: no limit), job folders left in the output
    folder by earlier runs first; the newest result is always kept. Records of deleted results
    stay, marked `expired`. A result being downloaded (`open_content`) is removed (by retention or
    DELETE) once its last download ends: no new download starts, the running ones finish.
    """

    def __init__(self, output_dir: Path, max_queue: int, keep_jobs: int | None, keep_bytes: int | None) -> None:
        self.output_dir = output_dir
        self.max_queue = max_queue
        self.keep_jobs = keep_jobs
        self.keep_bytes = keep_bytes
        self.jobs: dict[str, Job] = {}
        self._queue: deque[str] = deque()
        self._lock = threading.Condition()
        self.closed = False
        self.dead: str | None = None  # why the worker stopped (the runner's state is unknown)
        #: Why a running job cannot be cancelled (None: it can; `parallel` sets it, docs/multi_gpu.md).
        self.running_cancel_refused: str | None = None
        self.running: Job | None = None
        self._readers: dict[Path, int] = {}  # a job folder: the downloads of its result under way
        self._doomed: set[Path] = set()  # folders removed (retention, DELETE) while downloaded: deleted by the last
        # Job folders of earlier runs in the same output folder: counted (and removed first) by retention.
        self._orphans = sorted((f for f in output_dir.glob("job_*") if f.is_dir()), key=lambda f: f.stat().st_mtime)

    def new_folder(self) -> tuple[str, Path]:
        job_id = "job_" + uuid.uuid4().hex[:16]
        folder = self.output_dir / job_id
        folder.mkdir(parents=True)
        return job_id, folder

    def submit(self, *jobs: Job) -> None:
        """Queue `jobs`, in order: all of them or none.

        Raises:
            QueueClosed: shutting down or the runner died.
            QueueFull: fewer than `len(jobs)` places are left of `max_queue`.
        """
        with self._lock:
            if self.closed or self.dead:
                raise QueueClosed(self.dead or "the server is shutting down")
            if len(self._queue) + len(jobs) > self.max_queue:
                extra = f" ({len(jobs)} asked for)" if len(jobs) > 1 else ""
                raise QueueFull(f"the queue holds {len(self._queue)} jobs (--max_queue {self.max_queue}){extra}; "
                                "retry later")
            for job in jobs:
                self.jobs[job.id] = job
                self._queue.append(job.id)
            self._lock.notify_all()
            waiting = len(self._queue)
        for job in jobs:
            logger.info("job {} queued ({} waiting)", job.id, waiting)

    def depth(self) -> int:
        with self._lock:
            return len(self._queue)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self.jobs.get(job_id)

    def list(self) -> list[Job]:
        """Every job record, oldest first."""
        with self._lock:
            return list(self.jobs.values())

    def next(self) -> Job | None:
        """The next queued job (blocks); None once closed and empty."""
        with self._lock:
            while not self._queue and not self.closed:
                self._lock.wait()
            if not self._queue:
                return None
            job = self.jobs[self._queue.popleft()]
            job.status, job.started_at = "in_progress", time.time()
            self.running = job
            return job

    def cancel(self, job_id: str, reason: str = "DELETE") -> Job | None:
        """Cancel a queued job (never runs; logged here with `reason`) or ask a running one to stop at its
        next boundary (the worker logs where it stopped)."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or job.status in FINAL:
                return job
            if job.status == "in_progress" and self.running_cancel_refused is not None:
                return job  # it finishes; the caller reports why (HTTP 409)
            job.cancel.set()
            if job.status == "queued":
                self._queue.remove(job_id)
                shutil.rmtree(job.folder, ignore_errors=True)
                job.completed_at = time.time()
                job.status = "cancelled"  # last, as in Worker.run_job
                logger.info("job {} cancelled while queued ({})", job_id, reason)
            return job

    def delete(self, job_id: str) -> bool:
        """Forget a finished job and delete its files."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None or job.status not in FINAL:
                return False
            del self.jobs[job_id]
            busy = self._defer_if_read(job.folder)
        if not busy:
            shutil.rmtree(job.folder, ignore_errors=True)
        return True

    def open_content(self, job: Job) -> bool:
        """A download of `job`'s result starts: False if the result is gone (expired, or the job deleted);
        otherwise its folder stays until the matching `close_content`."""
        with self._lock:
            if job.expired or self.jobs.get(job.id) is not job:
                return False
            self._readers[job.folder] = self._readers.get(job.folder, 0) + 1
            return True

    def close_content(self, job: Job) -> None:
        """A download that `open_content` started ended (sent, failed or cancelled): the folder goes now if it
        was removed meanwhile."""
        with self._lock:
            left = self._readers.pop(job.folder, 1) - 1
            if left:
                self._readers[job.folder] = left
            doomed = not left and job.folder in self._doomed
            if doomed:
                self._doomed.discard(job.folder)
        if doomed:
            shutil.rmtree(job.folder, ignore_errors=True)
            logger.info("{}: removed after its last download", job.folder.name)

    def _defer_if_read(self, folder: Path) -> bool:
        """(Holding the lock.) True if `folder` is being downloaded: its removal then waits for the last one."""
        if self._readers.get(folder, 0) > 0:
            self._doomed.add(folder)
            return True
        return False

    def close(self, cancel_running: bool) -> None:
        """Stop accepting; cancel every queued job, and the running one if `cancel_running`."""
        with self._lock:
            self.closed = True
            for job_id in list(self._queue):
                job = self.jobs[job_id]
                logger.info("job {} cancelled (shutdown)", job_id)
                job.cancel.set()
                shutil.rmtree(job.folder, ignore_errors=True)  # as a DELETE of a queued job does
                job.completed_at = time.time()
                job.status = "cancelled"
            self._queue.clear()
            if cancel_running and self.running is not None:
                self.running.cancel.set()
            self._lock.notify_all()

    def computed(self, job: Job) -> None:
        """`job`'s request stopped computing: it is not the running job any more (its files may still
        be written on the writer thread; the next job may start)."""
        with self._lock:
            if self.running is job:
                self.running = None

    def finish(self, job: Job, retained: bool = False) -> None:
        """`job` ended (its final status is set): apply retention, unless `retained` (already applied for it)."""
        self.computed(job)
        if not retained:
            self.apply_retention()

    def apply_retention(self, completing: Job | None = None) -> None:
        """Delete the oldest results (earlier runs' job folders first) beyond the limits; the newest
        completed job is always kept, whatever its size. `completing`: a job whose result is written and
        whose status is not set yet, counted as the newest (so that a client that sees it completed no
        longer finds what it pushed out). A removed job is marked `expired` before its folder goes."""
        with self._lock:
            done = [j for j in self.jobs.values() if (j.status in FINAL or j is completing) and not j.expired
                    and j.folder.exists()]
        done.sort(key=lambda j: (j is completing, j.completed_at or 0))
        orphans = [f for f in self._orphans if f.exists()]
        entries: list[tuple[Path, Job | None]] = [(f, None) for f in orphans] + [(j.folder, j) for j in done]
        sizes = {folder: _folder_bytes(folder) for folder, _ in entries}
        total = sum(sizes.values())
        while len(entries) > 1 and ((self.keep_jobs is not None and len(entries) > self.keep_jobs)
                                    or (self.keep_bytes is not None and total > self.keep_bytes)):
            folder, job = entries.pop(0)
            with self._lock:
                if job is not None:
                    job.expired = True  # first: its content is no longer offered while the files go
                busy = self._defer_if_read(folder)
            if not busy:
                shutil.rmtree(folder, ignore_errors=True)
            total -= sizes[folder]
            logger.info("retention: removed {} ({} bytes{}{})", folder.name, sizes[folder],
                        "" if job is not None else ", from an earlier run",
                        ", its files once its downloads end" if busy else "")


def _folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder`; a file or the folder removed meanwhile (a DELETE) counts 0."""
    total = 0
    try:
        for f in folder.rglob("*"):
            try:
                total += f.stat().st_size if f.is_file() else 0
            except OSError:
                pass
    except OSError:
        pass
    return total


class Worker(threading.Thread):
    """Runs queued jobs one at a time on the runner, on this thread.

    `setup` (the server: `init_modules`, with warmup, then readiness) runs first on this same thread,
    before any job is taken: PyTorch keeps CUDA library state (cuBLAS handles and workspaces) per
    thread, so a runner warmed on another thread would serve its first job colder than steady
    (`BaseRunner.check_serving_thread`). `setup` returns False when it failed (it reports
    the failure itself): the worker then takes no job. `run_request(request, index)` runs each job's
    request (default `runner.run_pipeline`; under `parallel`, the leader's lockstep run)."""

    def __init__(self, runner: BaseRunner, queue: JobQueue, on_done: Callable[[Job], None],
                 save_tensors: bool, setup: Callable[[], bool] | None = None,
                 run_request: Callable[[RequestConfig, int], Any] | None = None) -> None:
        super().__init__(name="runnerkit-worker", daemon=True)
        self.runner = runner
        self.queue = queue
        self.on_done = on_done
        self.save_tensors = save_tensors
        self.setup = setup
        self.run_request = run_request
        self.index = 0
        self._jobs: dict[int, Job] = {}  # request index -> its job, until the job ends

    def run(self) -> None:
        if self.setup is not None and not self.setup():
            return
        try:
            while (job := self.queue.next()) is not None:
                try:
                    self.run_job(job)
                finally:
                    self.queue.computed(job)  # the next job may start; this one's files may still be written
                if self.queue.dead:
                    return
        except BaseException as exc:  # noqa: BLE001  (the worker itself broke: nothing runs jobs any more)
            self.queue.dead = f"the job worker stopped: {type(exc).__name__}: {exc}"
            self.queue.close(cancel_running=False)
            logger.opt(exception=exc).error("{}", self.queue.dead)
        finally:
            writer = getattr(self.runner, "writer", None)
            if writer is not None:  # jobs whose files are being written end (completed or failed) first
                writer.close()

    def run_job(self, job: Job) -> None:
        """Run `job`'s request. A failed or cancelled job ends here; one whose request succeeded ends in
        `_request_done`: at once when its files were written inline, else once the writer thread wrote
        them (the job stays `in_progress`, stage `save`, while the next job computes)."""
        from runnerkit.runners.base import RequestCancelled, error_phase

        def observe(p: Progress) -> None:
            job.stage, job.step, job.steps = p.stage, p.step, p.steps
            job.steps_done, job.steps_total = p.steps_done, p.steps_total
            if job.cancel.is_set():
                raise RequestCancelled(f"job {job.id} was cancelled")

        request = job.request.model_copy(update={
            "save_result_path": str(job.result_path),
            "save_tensor_path": str(job.tensor_path) if self.save_tensors else None})
        self.runner.on_progress = observe
        self.runner.on_request_done = self._request_done
        index, self.index = self.index, self.index + 1
        self._jobs[index] = job
        logger.info("job {} started (request {})", job.id, index)
        status: Status | None = None  # stays None if a BaseException ends the worker
        error: str | None = None
        computed = False
        try:
            (self.run_request or self.runner.run_pipeline)(request, index)
            computed = True  # it ended in `_request_done`, or will once its files are written
        except RequestCancelled:
            status = "cancelled"
            steps = f" (step {job.step}/{job.steps})" if job.steps else ""  # a stage without steps (a decoder)
            logger.info("job {} cancelled at stage {}{}", job.id, job.stage, steps)
        except Exception as exc:  # the request failed; end_run has cleaned up (else below)
            status, error = "failed", f"{type(exc).__name__}{in_stage(exc)}: {exc}"
            logger.opt(exception=exc).error("job {} failed: {}", job.id, error)
            if getattr(exc, "runnerkit_cleanup_error", None) is not None or (error_phase(exc) or "").endswith("(end_run)"):
                self.queue.dead = f"the runner's cleanup failed after job {job.id}; its state is unknown: {error}"
                self.queue.close(cancel_running=False)
        finally:
            self.runner.on_progress = None
            prof = self.runner.profiler.requests[-1] if self.runner.profiler.requests else None
            self.runner.profiler.requests.clear()  # the job keeps its profile; the process keeps none
            prof = prof if prof is not None and prof.index == index else None
            if not computed and self._jobs.pop(index, None) is not None:  # failed, cancelled, or the worker broke
                self._finish(job, status, error, prof)
        if index in self._jobs and getattr(self.runner, "writer", None) is None:  # inline, not reported: done now
            self._request_done(prof, None, index)

    def _request_done(self, prof: RequestProfile | None, error: BaseException | None, index: int | None = None) -> None:
        """The runner's `on_request_done`: a job's request succeeded and its files were written (`error`
        None), or their write failed. On the writer thread when it wrote them, else on this one."""
        job = self._jobs.pop(prof.index if prof is not None else index, None)
        if job is None:
            return
        status: Status = "completed"
        message = None
        if error is None:
            try:
                job.audio = result_audio(job.result_path)
            except Exception as exc:  # noqa: BLE001  an unreadable sidecar: not the all-or-nothing set promised
                error = exc
        if error is None:
            job.step, job.steps = job.steps_done, job.steps_total  # the last report (the save) is a stage of no steps
            logger.info("job {} completed: {}", job.id, job.result_path)
        else:
            status, message = "failed", f"{type(error).__name__}: {error}"
            logger.opt(exception=error).error("job {} failed: {}", job.id, message)
        self._finish(job, status, message, prof)

    def _finish(self, job: Job, status: Status | None, error: str | None, prof: RequestProfile | None) -> None:
        """The job's last fields, then (completed) the retention it causes, then its status (last: a client
        that sees it, reading without a lock, also sees the end time, profile and error, none of a failed or
        cancelled job's files, and no result the retention removed), then `on_done`."""
        retained = False
        try:
            if prof is not None:
                if job.resolved:
                    job.ran_at(prof.shape, self.runner.config.fps or 1)
                job.profile = {"seconds": prof.seconds, "stages": prof.stages, "steps": prof.steps,
                               "memory": prof.memory, "audit": prof.audit, "shape": prof.shape, "write": prof.write}
            if status != "completed":  # nothing of a failed or cancelled job is kept (nor counted as kept)
                shutil.rmtree(job.folder, ignore_errors=True)
            job.completed_at, job.error = time.time(), error
            if status == "completed":
                try:
                    self.queue.apply_retention(completing=job)  # before the status a client waits for
                    retained = True
                except Exception as exc:  # noqa: BLE001  e.g. a folder deleted meanwhile: the job is done all the same
                    logger.opt(exception=exc).warning("job {}: retention failed ({}): the job completes; the "
                                                      "retention is tried again once its status is set", job.id, exc)
            if status is not None:
                job.status = status
        finally:
            self.queue.finish(job, retained)  # once per job: each pass sizes every kept result folder
            self.on_done(job)


def result_audio(result_path: Path) -> dict[str, Any] | None:
    """The audio stream muxed into a result, as its sidecar's `streams` record says (written by
    `media.save_outputs` only when the file holds one): `{codec, sample_rate, channels}`; None when
    the record names no audio stream, or there is no sidecar (a runner that writes none).

    Raises:
        OSError, ValueError: a sidecar that cannot be read or is not JSON (the job then fails: its
            files are not the all-or-nothing set the writer promises).
    """
    from runnerkit.media import sidecar_path

    path = sidecar_path(result_path)
    if not path.exists():
        return None
    audio = json.loads(path.read_text(encoding="utf-8")).get("streams", {}).get("audio")
    return None if audio is None else {k: audio[k] for k in ("codec", "sample_rate", "channels")}


__all__ = ["FINAL", "Job", "JobQueue", "QueueClosed", "QueueFull", "Worker", "clip_seconds", "result_audio"]
