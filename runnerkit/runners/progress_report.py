"""Progress of `DefaultRunner`'s requests for an observer (`on_progress`, `Progress`):
where the request is, in profiling stages and denoising steps over every denoise stage.

The launch script's progress bar (runnerkit/progress.py) and the server's job status read these
reports; an observer may raise `RequestCancelled` to stop the request at the boundary it was told of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runnerkit.runners.pipeline import InputInfo

if TYPE_CHECKING:
    from runnerkit.runners.default import DefaultRunner

__all__ = ["Progress", "RequestCancelled", "report_progress"]


@dataclass(frozen=True)
class Progress:
    """Where a request is: the stage running and the denoising steps done.

    Attributes:
        index: the request's index (`run_pipeline(request, index)`).
        stage: the profiling stage that starts (or, after a step, the denoise stage running).
        step: steps done in the current denoise stage (0 at a stage start).
        steps: steps of the current denoise stage (0 outside denoising).
        steps_done: steps done over every denoise stage of the request.
        steps_total: steps of every denoise stage of the request.
    """

    index: int
    stage: str
    step: int = 0
    steps: int = 0
    steps_done: int = 0
    steps_total: int = 0


class RequestCancelled(Exception):
    """Raised by an `on_progress` observer to stop the running request at a stage or step boundary."""


def report_progress(runner: DefaultRunner, info: InputInfo, stage: str, step: int = 0, steps: int = 0) -> None:
    """Tell `runner.on_progress` where the request is (never during warmup; nothing before the pipeline
    is described).

    `stage` is a profiling stage that starts, or the denoise stage that finished step `step` of `steps`;
    `steps_done` counts the steps of every denoise stage before it (decoders and save: every step).
    """
    if runner.on_progress is None or info.warmup or runner.pipeline is None:
        return
    before, total = runner.pipeline.step_offsets
    done = before.get(stage, total) + step  # decoders and save: every step is done
    current = runner.profiler.current
    runner.on_progress(Progress(index=current.index if current is not None else 0, stage=stage, step=step,
                                steps=steps, steps_done=done, steps_total=total))
