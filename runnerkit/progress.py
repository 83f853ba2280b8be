"""The launch script's terminal progress bar (`--progress`) and step-time plot (`--plot_steps`).

The bar is one tqdm bar per denoise stage of a request, e.g.

    request 0 transformer: 100%|██████████| 4/4 [00:01<00:00, 2.91step/s]

driven by the runner's `on_progress` observer (runners/base.py `Progress`), which is called on
host-side stage and step boundaries and never during warmup (warmup logs its steps, no bar). One bar
per denoise stage: a stage whose experts share its steps is one bar, a two-stage family shows two. The bar holds
no tensor and imports no torch: it adds no device synchronization and cannot touch RNG or compute.

Its ETA is tqdm's: the steps left over a smoothed rate of those host-side step boundaries. On CUDA
the host runs ahead of the device until the launch queue fills, so the first steps' rate can be
optimistic; the profile's step seconds (CUDA events read at the request's end) are the exact ones.

While a bar is drawn, loguru lines go through `tqdm.write` (the bar is cleared, the line printed,
the bar redrawn), and the per-step lines the bar replaces are shown only at `--log_level DEBUG`.
`auto` draws the bar only when stderr is a terminal; under torchrun only rank 0 draws one. The
server (`runnerkit serve`) draws none: its jobs report their progress (`GET /v1/videos/{id}`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from tqdm import tqdm

if TYPE_CHECKING:
    from runnerkit.runners.base import Progress

ProgressMode = Literal["auto", "on", "off"]
PROGRESS_MODES: tuple[ProgressMode, ...] = ("auto", "on", "off")
PLOT_EXTRA = 'the `plot` extra (pip install -e ".[plot]")'
#: The `extra` key a denoising step's log line carries (runners/default.py): the line the bar replaces.
STEP_LINE = "denoise_step"


def progress_enabled(mode: ProgressMode, stream: IO[str]) -> bool:
    """Whether the launch script draws the bar: never on a torchrun rank other than 0 (every rank would
    draw its own over the others'), else `on`, `off`, or for `auto` whether `stream` is a terminal.

    Raises:
        ValueError: `mode` is not one of `PROGRESS_MODES`.
    """
    if mode not in PROGRESS_MODES:
        raise ValueError(f"`--progress` {mode!r}: allowed {list(PROGRESS_MODES)}")
    if os.environ.get("RANK", "0") != "0":
        return False
    if mode == "auto":
        return stream.isatty()
    return mode == "on"


def _size(stream: IO[str]) -> tuple[int, int]:
    """(columns, lines) of the terminal `stream` writes to; zeros when it reports none or is no terminal."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):  # not a file descriptor's stream, or not a terminal
        return 0, 0
    return size.columns, size.lines


class StageBars:
    """`on_progress` observer: a bar per denoise stage, closed when another stage starts or the
    request ends (`close`)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._bar: tqdm | None = None
        self._key: tuple[int, str] | None = None  # (request index, stage) of the open bar

    @property
    def live(self) -> bool:
        """True while a bar is on the terminal."""
        return self._bar is not None

    def __call__(self, p: Progress) -> None:
        if p.steps == 0:  # an encoder, transition, decoder or save starts: no bar for it
            self.close()
            return
        if self._key != (p.index, p.stage):
            self.close()
            sized = min(_size(self.stream)) > 0  # a terminal of no size (some ptys): tqdm would draw nothing
            self._bar = tqdm(total=p.steps, desc=f"request {p.index} {p.stage}", unit="step", file=self.stream,
                             dynamic_ncols=sized, ncols=None if sized else 80, nrows=None if sized else 24,
                             leave=True)
            self._key = (p.index, p.stage)
        assert self._bar is not None, "opened above"
        if self._bar.total != p.steps:  # a stage started at `strength` < 1 runs fewer steps than scheduled
            self._bar.total = p.steps
        self._bar.update(p.step - self._bar.n)

    def close(self) -> None:
        """Close the open bar (its last state stays on the terminal)."""
        if self._bar is not None:
            self._bar.close()
        self._bar, self._key = None, None

    def write(self, message: str) -> None:
        """A loguru sink: the line printed above the bar."""
        tqdm.write(message, file=self.stream, end="")

    def log_filter(self, show_steps: bool) -> Callable[[dict[str, Any]], bool]:
        """A loguru filter dropping the per-step lines while a bar shows them (unless `show_steps`)."""
        return lambda record: show_steps or not (self.live and record["extra"].get(STEP_LINE, False))


def install_progress(mode: ProgressMode, log_level: str, log_format: str) -> StageBars | None:
    """Bars on stderr when `progress_enabled`, with loguru's stderr sink routed through them; None
    (the logger left as it is) otherwise."""
    if not progress_enabled(mode, sys.stderr):
        return None
    from loguru import logger

    bars = StageBars(sys.stderr)
    logger.remove()
    logger.add(bars.write, level=log_level, format=log_format, colorize=sys.stderr.isatty(),
               filter=bars.log_filter(show_steps=log_level == "DEBUG"))
    return bars


# ---- step-time plot ---------------------------------------------------------------------------
def missing_plot_module() -> str | None:
    """'matplotlib' when it cannot be imported (the `plot` extra is not installed), else None."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # in sys.modules as None: blocked
        found = False
    return None if found else "matplotlib"


def steps_run(denoise: Sequence[Any]) -> list[tuple[str, int]]:
    """(name, steps run) of a pipeline's denoise stages (`DenoiseStage`); a stage started at `strength`
    runs the last round(steps * strength) of its steps (`Scheduler.prepare`)."""
    return [(s.name, round(s.steps * s.strength)) for s in denoise]


def stage_boundaries(stages: Sequence[tuple[str, int]]) -> list[tuple[int, str]]:
    """(steps before it, name) of every denoise stage after the first, from (name, steps run) in order."""
    out, done = [], 0
    for k, (name, steps) in enumerate(stages):
        if k:
            out.append((done, name))
        done += steps
    return out


def step_series(report: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """(label, step seconds) of every request of a profile report (`Profiler.report`) that ran a step;
    warmup is not among its requests."""
    series = []
    for r in report["requests"]:
        if r["step_seconds"]:
            h, w, f = r["shape"]
            label = f"request {r['index']} ({h}x{w}x{f})" + ("" if r["ok"] else " failed")
            series.append((label, list(r["step_seconds"])))
    return series


def write_step_plot(path: str | Path, report: dict[str, Any], stages: Sequence[tuple[str, int]]) -> int:
    """Write a PNG of per-step seconds (x: step, y: seconds, a line per request, a dashed line where
    each later denoise stage starts) to `path`, atomically; returns the number of requests drawn.

    Raises:
        ModuleNotFoundError: matplotlib is missing (`--plot_steps` refuses that before loading).
        OSError: the file could not be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend or figures
    from matplotlib.figure import Figure

    series = step_series(report)
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, seconds in series:
        ax.plot(range(1, len(seconds) + 1), seconds, marker="o", markersize=3, label=label)
    for before, name in stage_boundaries(stages):
        ax.axvline(before + 0.5, color="grey", linestyle="--", linewidth=1)
        ax.annotate(name, (before + 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", color="grey", fontsize=8)
    ax.set_xlabel("denoising step")
    ax.set_ylabel("seconds")
    ax.set_title(f"step time per request ({report['device']})")
    if series:
        ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(series)
