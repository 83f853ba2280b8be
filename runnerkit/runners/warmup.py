"""Warmup of `DefaultRunner`: the gate, the dummy requests and the steps it runs (ARCHITECTURE §3).

    check_supported (the gate, before loading) -> shapes -> runnable_shapes -> runner.run_warmup
    (-> run: warmup_infos -> encoders, run_denoise on stage_steps, decoders) -> step_report -> after

`Warmup` is an object the runner creates and holds (`runner.warmups`); BaseRunner.warmup (final)
drives it once, inside `init_modules`. What a family may change stays a hook on the runner
(runners/default.py): `run_warmup`, `warmup_infos`, `warmup_steps`, `compiled_sizes`; the defaults
of those hooks are here (`run`, `info`, `first_steps`, and none known).

Warmup opt-in is per class: a runner class declares `WARMUP_TASKS`, `WARMUP_SHAPES` and
`WARMUP_OFFLOAD_MODES` in its own class body; they are read from the class `__dict__` (`opt_in`),
so a subclass does not inherit the opt-in and must declare its own.

What it reads from the runner: `config`, `device`, `parallel`, `pipeline`, `schedulers`, `flavour`,
`select_transformer`, `memory_checks`, `check_sequence_split`, `run_encoders`, `run_denoise`, `decode`,
`decodes_here`, `reset_request_state`, the hooks above and `DEFAULT_NEGATIVE_PROMPT`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from loguru import logger

from runnerkit import compile as regional_compile
from runnerkit import media, memory
from runnerkit.runners.base import lifecycle_phase
from runnerkit.runners.pipeline import DenoiseStage, InputInfo, Shape
from runnerkit.runners.request_state import RequestState
from runnerkit.schedulers.base import Scheduler

if TYPE_CHECKING:
    from runnerkit.runners.default import DefaultRunner

__all__ = ["WARMUP_PROMPT", "WARMUP_SEED", "Warmup"]

#: Dummy user content of warmup: only its shapes matter (a prompt is padded to the text length).
WARMUP_PROMPT = "warmup"
#: Seed of warmup's own noise; the generator is dropped after warmup, so requests never see it.
WARMUP_SEED = 0


class Warmup:
    """Warmup of one runner, and what a request at a shape warmup did not run costs (see the module
    docstring).

    Attributes:
        steps_run: per denoise stage, the steps warmup ran (filled by `stage_steps`; the same on every shape).
    """

    def __init__(self, runner: DefaultRunner) -> None:
        self.runner = runner
        self.steps_run: dict[str, list[int]] = {}
        #: shapes a family's `run_warmup` warmed beyond the class shapes (e.g. a sweep of sequence lengths), for the
        #: requests' `warmed_shape` audit; and what it adds to the profile's warmup section
        self.also_warmed: list[Shape] = []
        self.also_warmed_note = ""  # what `also_warmed` is, for the log lines (e.g. "frame counts 25..465 at ...")
        self.report: dict[str, Any] = {}
        #: uncovered compiled sizes (sorted (name, size) pairs) -> the request that compiled graphs for them
        self.uncovered_compiled_by: dict[tuple[tuple[str, int], ...], int] = {}

    # ---- the gate and the shapes ---------------------------------------------------------------
    def opt_in(self, name: str) -> Any:
        """A warmup declaration from the runner's own class body (never inherited); None if absent."""
        return type(self.runner).__dict__.get(name)

    def shapes(self) -> tuple[Shape, ...]:
        """The class-constant warmup shapes of this checkpoint's flavour ((h, w, f), two of them)."""
        table = self.opt_in("WARMUP_SHAPES") or {}
        return tuple(table.get(self.runner.flavour(), ()))

    def check_supported(self) -> None:
        """Refuse anything the warmup path does not support, and warmup shapes that cannot fit.

        Raises:
            NotImplementedError: with the reason (runner, task, offload mode or flavour not covered).
            MemoryFitError: a warmup shape's estimated peak exceeds the device's memory limit.
        """
        runner, config = self.runner, self.runner.config
        cls = type(runner).__name__
        if config.unload_modules:
            raise NotImplementedError(
                "warmup is refused with `unload_modules`=true: every module is reloaded per request, so "
                "nothing warmup loads would survive to the first request")
        tasks, table, modes = (self.opt_in(n) for n in ("WARMUP_TASKS", "WARMUP_SHAPES", "WARMUP_OFFLOAD_MODES"))
        if tasks is None or table is None or modes is None:
            raise NotImplementedError(
                f"runner class {cls} has not opted in to warmup: it must declare WARMUP_TASKS, WARMUP_SHAPES "
                "and WARMUP_OFFLOAD_MODES in its own class body (opt-in is not inherited from a parent runner)")
        if config.task not in tasks:
            raise NotImplementedError(f"warmup of {cls} does not cover task {config.task!r} (covered: {list(tasks)})")
        mode = config.offload.mode if not config.offload.lazy_load else "lazy_load"
        if mode not in modes:
            raise NotImplementedError(
                f"warmup of {cls} does not support offload mode {mode!r} (supported: {list(modes)})")
        with lifecycle_phase("load"):  # reading the checkpoint's architecture is a load problem if it fails
            flavour = runner.flavour()
        if flavour not in table:
            raise NotImplementedError(
                f"warmup of {cls} has no shapes for this checkpoint's flavour {flavour!r} "
                f"(recognised flavours: {sorted(table)}); an unrecognised architecture is not warmed")
        assert len(table[flavour]) == 2, f"{cls}.WARMUP_SHAPES[{flavour!r}] must hold exactly two shapes"
        for shape in table[flavour]:  # a warmup shape that cannot fit fails here, before loading
            runner.memory_checks.check_fit(shape, f"warmup shape {list(shape)}")

    def runnable_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        """Under Ulysses (`parallel.ulysses` K > 1), the warmup shapes whose transformer tokens divide
        by K (`check_sequence_split`); each one dropped is named in a warning (a request of that
        shape is refused as well, so warming it would serve nothing). Otherwise all of `shapes`.

        Raises:
            NotImplementedError: no warmup shape divides (naming their token counts): warmup could
                warm nothing; another K or no `--warmup` is the choice.
        """
        runner = self.runner
        if runner.parallel is None or runner.parallel.ulysses <= 1:
            return tuple(shapes)
        kept, dropped = [], []
        for shape in shapes:
            try:
                for info in runner.warmup_infos(shape):
                    runner.check_sequence_split(info)
            except NotImplementedError as exc:
                dropped.append(f"{list(shape)}: {exc}")
                continue
            kept.append(shape)
        if not kept:
            raise NotImplementedError(f"`parallel.ulysses`={runner.parallel.ulysses}: no warmup shape of "
                                      f"{type(runner).__name__} has tokens that divide ({'; '.join(dropped)}); use "
                                      "another `parallel.ulysses` or run without warmup")
        for why in dropped:
            logger.warning("warmup: skipped shape {} (a request of that shape is refused as well)", why)
        return tuple(kept)

    # ---- the run ------------------------------------------------------------------------------
    def info(self, shape: Shape) -> InputInfo:
        """The dummy request of warmup at `shape`: placeholder prompt, the configured negative prompt."""
        cfg = self.runner.config
        negative = cfg.negative_prompt if cfg.negative_prompt is not None else self.runner.DEFAULT_NEGATIVE_PROMPT
        h, w, f = shape
        return InputInfo(prompt=WARMUP_PROMPT, negative_prompt=negative, seed=WARMUP_SEED, height=h, width=w,
                         frames=f, warmup=True)

    def run(self, shapes: Sequence[Shape]) -> Any:
        """Both shapes through the real path: shape-independent encoders (text) once, then per shape
        (and per input variant, the runner's `warmup_infos`) the per-shape encoders (images), every
        denoise stage (transitions included) on `stage_steps`, and the decoders; then the media writers
        (`media.warm_writers`). Nothing is saved; no request profile is written. Returns the
        shape-independent encoders' outputs (the family's inputs type), for a family's `run_warmup` to
        reuse."""
        runner = self.runner
        for sched in runner.schedulers.values():
            sched.generator = None  # before any encoder that could draw random numbers
        shared = runner.run_encoders(RequestState(runner.warmup_info(shapes[0])), per_shape=False)
        for shape in shapes:
            for info in runner.warmup_infos(shape):
                try:
                    req = RequestState(info, inputs=shared)
                    runner.run_encoders(req, per_shape=True)
                    latents = runner.run_denoise(req, warmup=True)
                    if runner.decodes_here:  # parallel: the decoders run on rank 0 only, as in a request
                        runner.decode(req, latents)
                finally:
                    runner.reset_request_state()
        if runner.decodes_here:  # the rank that saves results: the writers' imports and first encode
            assert runner.pipeline is not None, "load_modules sets the pipeline"
            logger.debug("warmup: media writers warmed: {}", media.warm_writers(runner.pipeline.outputs) or "none")
        return shared

    def first_steps(self, req: RequestState, stage: DenoiseStage, sched: Scheduler) -> list[int]:
        """Steps warmup runs in `stage` (after `prepare`) by default: step 0, plus the first step of every
        other MoE expert the stage would choose (every branch runs at least once)."""
        select = self.runner.select_transformer
        steps, seen = [0], {select(req, stage, 0, sched.timesteps[0:1])}
        for i in range(1, sched.infer_steps):
            expert = select(req, stage, i, sched.timesteps[i : i + 1])
            if expert not in seen:
                seen.add(expert)
                steps.append(i)
        return steps

    def stage_steps(self, req: RequestState, stage: DenoiseStage, sched: Scheduler) -> list[int]:
        """The steps warmup runs in `stage`: the runner's `warmup_steps` hook, recorded for the profile."""
        order = self.runner.warmup_steps(req, stage, sched)
        self.steps_run.setdefault(stage.name, order)  # the class shapes' (a family's later sweep may run fewer)
        return order

    def step_report(self) -> dict[str, list[int]]:
        """Per denoise stage, the steps warmup ran (the same steps on every shape)."""
        return dict(self.steps_run)

    def after(self) -> None:
        """Eager default: collect and freeze the gc once (never under lazy load or unload_modules)."""
        if not (self.runner.config.offload.lazy_load or self.runner.config.unload_modules):
            memory.freeze_gc_once()

    def with_report(self, entry: dict[str, Any]) -> dict[str, Any]:
        """The profile's warmup section: `entry` and what the family's `run_warmup` added (`report`, new keys only)."""
        clash = sorted(entry.keys() & self.report.keys())
        assert not clash, f"a family's warmup report would overwrite the warmup section's {clash}"
        return {**entry, **self.report}

    def warmed_text(self) -> str:
        """The shapes warmup ran, for a log line: the class shapes, then how many a family's sweep added, and what."""
        warmed = self.runner.warmed_shapes
        text = str([list(x) for x in warmed[:len(warmed) - len(self.also_warmed)]])
        return f"{text} and {len(self.also_warmed)} more ({self.also_warmed_note})" if self.also_warmed else text

    # ---- requests at a shape warmup did not run ----------------------------------------------
    def log_unwarmed_shape(self, info: InputInfo, index: int) -> None:
        """After a warmup, say what a request at a shape it did not run costs (nothing for a warmed shape,
        or without warmup). Eager: a slower first step
        (WARNING). Compiled: warmup's two shapes made the token-count dimensions dynamic, which
        serve sizes >= 2 only (`regional_compile.uncovered_sizes`): INFO when every size of the
        runner's `compiled_sizes` is covered, WARNING naming the size when one is not (the request
        compiles), INFO again for a later request with the same uncovered sizes (it reuses what the
        first one compiled)."""
        warmed = self.runner.warmed_shapes  # () unless a warmup ran
        if not warmed or info.shape in warmed:
            return
        shapes = self.warmed_text()
        if not self.runner.config.compile.enabled:
            logger.warning("request {}: shape {} was not warmed (warmup shapes: {}); expect a slower first step",
                           index, list(info.shape), shapes)
            return
        sizes = self.runner.compiled_sizes(info)
        uncovered = regional_compile.uncovered_sizes(sizes)
        # torch keeps the graphs a request compiled for sizes 0 and 1: a later request with the same
        # such sizes reuses them (the runner's own record; torch's caches are not asked)
        compiled_by = self.uncovered_compiled_by
        earlier = compiled_by.get(tuple(sorted(uncovered.items()))) if uncovered else None
        if earlier is not None:
            logger.info("request {}: shape {} is not a warmup shape ({}) and gives the compiled blocks {}, which "
                        "request {} compiled graphs for; the request's audit reports any compilation", index,
                        list(info.shape), shapes, ", ".join(f"{n} {v}" for n, v in uncovered.items()), earlier)
        elif uncovered:
            compiled_by[tuple(sorted(uncovered.items()))] = index
            logger.warning("request {}: shape {} is not a warmup shape ({}) and gives the compiled blocks {}: torch "
                           "compiles sizes 0 and 1 as graphs of their own (dynamic dimensions serve sizes >= {}), so "
                           "this request compiles; expect a slower first step", index, list(info.shape), shapes,
                           ", ".join(f"{n} {v}" for n, v in uncovered.items()), regional_compile.MIN_DYNAMIC_SIZE)
        elif sizes:
            logger.info("request {}: shape {} is not a warmup shape ({}); the compiled blocks cover it: it differs in "
                        "dynamic dimensions only ({}, each >= {}); the request's audit reports any compilation", index,
                        list(info.shape), shapes, ", ".join(f"{n} {v}" for n, v in sizes.items()),
                        regional_compile.MIN_DYNAMIC_SIZE)
        else:
            logger.info("request {}: shape {} is not a warmup shape ({}); the compiled blocks cover shapes that differ "
                        "in their dynamic dimensions only, at sizes >= {}; the request's audit reports any "
                        "compilation", index, list(info.shape), shapes, regional_compile.MIN_DYNAMIC_SIZE)
