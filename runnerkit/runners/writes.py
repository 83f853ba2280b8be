"""A request's files: prepared on the compute thread, written inline or on the result writer's thread.

    serve_request, step 5 (runners/default.py)
      max_writes_in_flight 0 (the Python API's default): save_outputs inside the `save` stage, then end_run
      max_writes_in_flight N >= 1 (the launch script's and the server's default is 1):
        save stage:  hand_off -> a free writer slot (waits while N results are in flight)
                               -> prepare_write: the sidecar record and CPU copies of the outputs
                               -> queued; the request's compute ends (end_run) and the next one starts
        writer thread:          media.save_outputs (all-or-nothing, as inline) -> `written`
      the request is done (its log line, `saved`, `seconds`, `on_request_done`) once both its compute
      (run_pipeline's bookkeeping) and its files have ended, whichever ends last (`PendingRequest`).

A write that fails fails its request alone (the observer gets the error; later requests run). Under
`parallel` only rank 0 writes, holding the group's output lock for the whole write as inline saving
does, so a failing group's cleanup (parallel/driver.py) never races a rename.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

from runnerkit.config import REQUEST_DEFAULT_FIELDS
from runnerkit.media import save_outputs as write_outputs
from runnerkit.writer import ResultWriter, WriteAbandoned, WriteFn, WriteOutcome

if TYPE_CHECKING:
    from runnerkit.profiling import RequestProfile
    from runnerkit.runners.base import BaseRunner
    from runnerkit.runners.default import DefaultRunner
    from runnerkit.runners.request_state import RequestState

__all__ = ["PendingRequest", "close_writer", "hand_off", "prepare_write", "replace_writer", "save", "sidecar_record"]


def replace_writer(current: ResultWriter | None, max_in_flight: int) -> ResultWriter | None:
    """A writer thread for `max_in_flight` results in flight (None for 0: files written inline), after
    `current` is closed (`BaseRunner.overlap_writes`).

    Raises:
        ValueError: `max_in_flight` is not an int >= 0.
        RuntimeError: `current` is still writing files.
    """
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 0:
        raise ValueError(f"`max_writes_in_flight` must be an int >= 0 (got {max_in_flight!r}; 0 writes inline)")
    if current is not None:
        if current.in_flight():
            raise RuntimeError(f"files of request(s) {current.in_flight()} are still being written")
        current.close()
    return ResultWriter(max_in_flight) if max_in_flight else None


def sidecar_record(runner: DefaultRunner, req: RequestState) -> dict[str, Any]:
    """The sidecar JSON of a request's result: the request's own values (image paths absolute), the
    prompt the enhancer wrote (`enhanced_prompt`, when it ran), the family's fields (`sidecar_extra`,
    which may read the request's encoded inputs: call it before `end_run`), and the runner config without the request defaults they replace (a sidecar that
    shows `seed: 42` beside the request's seed 7 would mislead)."""
    info = req.info
    enhanced = {"enhanced_prompt": req.enhanced_prompt} if req.enhanced_prompt is not None else {}
    return {"prompt": info.prompt, **enhanced,
            "negative_prompt": info.negative_prompt, "seed": info.seed,
            "height": info.height, "width": info.width, "frames": info.frames,
            **{k: os.path.abspath(v) for k, v in (("image_path", info.image_path),
                                                  ("last_frame_path", info.last_frame_path)) if v},
            **({"extra_image_paths": [os.path.abspath(v) for v in info.extra_image_paths]}
               if info.extra_image_paths else {}),
            **({"lora": [{"path": os.path.abspath(p), "strength": st} for p, st in info.lora]} if info.lora else {}),
            **runner.sidecar_extra(req),
            "config": runner.config.model_dump(mode="json", exclude=set(REQUEST_DEFAULT_FIELDS))}


def prepare_write(runner: DefaultRunner, req: RequestState, outputs: dict[str, torch.Tensor]) -> WriteFn:
    """Everything the request's files need, taken now on the compute thread, as one write call.

    Args:
        outputs: output key -> decoded tensor `[B, ...]` (batch 1) on the compute device.

    Returns:
        `write(checkpoint) -> final paths` (media.save_outputs); it reads nothing of the runner, so
        it may run on the writer thread after `end_run` and while the next request computes.
    """
    assert runner.pipeline is not None, "load_modules first"
    # Copies, never views: `.float().cpu()` returns the decoder's own tensor when it is float32 on the
    # CPU already, and a family may decode into a buffer it reuses for the next request (a VAE cache,
    # a preallocated frame buffer). The writer owns what it writes: [C, ...] float32, contiguous, CPU.
    tensors = {k: v[0].to(device="cpu", dtype=torch.float32, copy=True).contiguous() for k, v in outputs.items()}
    info = req.info
    sidecar = sidecar_record(runner, req)
    specs, fps = runner.pipeline.outputs, runner.config.fps
    result_path, tensor_path = info.save_result_path, info.save_tensor_path

    def write(checkpoint: Callable[[], None]) -> list[str]:
        with torch.inference_mode():  # the writer thread: no autograd records on the request's tensors
            return write_outputs(tensors, specs, result_path=result_path, tensor_path=tensor_path, fps=fps,
                                 sidecar=sidecar, checkpoint=checkpoint)

    return write


class PendingRequest:
    """A request whose compute and whose files end on two threads: the second to end reports it.

    `report(error)` runs once, after both `computed(True)` and `written(...)`, with the write's error
    (None when every file was written). After `computed(False)` (the request failed or its `end_run`
    did: `run_pipeline` raised that to its caller) nothing is reported, whatever the write does.
    """

    def __init__(self, report: Callable[[BaseException | None], None]) -> None:
        self._report = report
        self._lock = threading.Lock()
        self._computed: bool | None = None
        self._written = False
        self._error: BaseException | None = None

    def computed(self, ok: bool) -> None:
        with self._lock:
            self._computed = ok
            due = ok and self._written
        if due:
            self._report(self._error)

    def written(self, error: BaseException | None) -> None:
        with self._lock:
            self._written, self._error = True, error
            due = self._computed is True
        if due:
            self._report(error)


def save(runner: DefaultRunner, req: RequestState, prof: RequestProfile, outputs: dict[str, torch.Tensor]) -> None:
    """Step 5 of a request, in its `save` stage: queue its files for the writer thread (`hand_off`: a free
    writer slot, then the sidecar and CPU copies), or, without a writer or with nothing to save, write
    them now (`runner.save_outputs`) and log each path. Inline under `parallel` the group's output lock
    is held, so a failing group's cleanup (parallel/driver.py) never races the renames."""
    info = req.info
    if runner.writer is not None and (info.save_result_path or info.save_tensor_path):
        with runner.profiler.stage("save"):
            return hand_off(runner, prof, functools.partial(prepare_write, runner, req, outputs))
    with runner.profiler.stage("save"), runner.parallel.output_lock if runner.parallel is not None else nullcontext():
        paths = runner.save_outputs(req, outputs)
        prof.saved = True  # before logging: an interrupt from here on leaves the request finished
    for path in paths:
        logger.info("saved {}", path)


def hand_off(runner: BaseRunner, prof: RequestProfile, prepare: Callable[[], WriteFn]) -> None:
    """Queue the request's files on `runner.writer` (waiting for a free slot; `prepare` runs once one
    is taken, so at most `max_writes_in_flight` results are held in host memory) and leave its
    report to whichever of its compute and its write ends last (`prof.pending_write`)."""
    writer = runner.writer
    assert writer is not None, "hand_off needs the writer thread (max_writes_in_flight >= 1)"
    pending = PendingRequest(lambda error: runner.report_request_done(prof, error))
    prof.write = {"overlapped": True, "seconds": 0.0, "wait_seconds": 0.0}
    lock = runner.parallel.output_lock if runner.parallel is not None else None
    prof.pending_write = pending
    try:
        prof.write["wait_seconds"] = round(writer.submit(prof.index, prepare, lambda o: written(prof, pending, o),
                                                         lock), 4)
    except BaseException:
        if prof.index not in writer.in_flight():  # nothing was queued: the request ends as any failed one
            prof.pending_write = None
        raise


def written(prof: RequestProfile, pending: PendingRequest, outcome: WriteOutcome) -> None:
    """On the writer thread: record how the request's files ended, then hand over to `pending`."""
    prof.write["seconds"] = round(outcome.seconds, 4)
    error = outcome.error
    if error is None:
        prof.saved = True
        for path in outcome.paths:
            logger.info("saved {}", path)
    else:
        if getattr(error, "runnerkit_phase", None) is None:
            error.runnerkit_phase = f"request {prof.index} (write)"  # type: ignore[attr-defined]
            error.add_note(f"[runnerkit] raised during phase: request {prof.index} (write)")
        prof.ok, prof.error = False, f"{type(error).__name__}: {error}"
    pending.written(error)


def close_writer(writer: ResultWriter, interrupted: bool = False) -> None:
    """Close the writer (main thread), completing the writes in flight: their requests' compute has
    ended, and they are at most `max_writes_in_flight`. An interrupt while waiting abandons them: each
    stops at its next file boundary and its temporary files are removed; further interrupts wait for
    that cleanup, so no partial file remains either way. `interrupted`: a first Ctrl-C or SIGTERM
    already ended the run (the completion is then logged, with how to abandon it)."""
    pending = writer.in_flight()
    if pending and interrupted:
        logger.warning("interrupted: completing the files of request(s) {} (interrupt again to abandon them)", pending)
    abandoned = False
    while True:
        try:
            writer.close()
            return
        except KeyboardInterrupt:
            if not abandoned:
                abandoned = True
                stopped, again = writer.abandon(), " again" if interrupted else ""
                if stopped:
                    logger.warning("interrupted{}: abandoning the files of request(s) {}; their temporary files are "
                                   "removed", again, stopped)
                else:  # every write had ended: nothing to abandon, no file left unfinished
                    logger.warning("interrupted{}: no request's files are being written", again)


def is_abandoned(error: BaseException | None) -> bool:
    """Whether a request's write error is an abandonment (a second interrupt), not a failure to report."""
    return isinstance(error, WriteAbandoned)
