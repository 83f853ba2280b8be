"""Warmup of `DefaultRunner`: the gate, the dummy requests and the steps it runs (ARCHITECTURE §3).

    check_warmup_supported (the gate, before loading) -> warmup_shapes -> run_warmup
    (-> warmup_infos -> encoders, run_denoise on warmup_steps, decoders) -> after_warmup

BaseRunner.warmup (final) drives these hooks once, inside `init_modules`.

Warmup opt-in is per class: a runner class declares `WARMUP_TASKS`, `WARMUP_SHAPES` and
`WARMUP_OFFLOAD_MODES` in its own class body; they are read from the class `__dict__`, so a
subclass does not inherit the opt-in and must declare its own.

`WarmupMixin` is mixed into `DefaultRunner` (runners/default.py) and reads what that class
supplies: `config`, `device`, `reset_request_state` (BaseRunner hook); `schedulers`, `flavour`,
`select_transformer`, `memory_checks`, `run_encoders`, `run_denoise`, `decode`, the class settings
`DEFAULT_NEGATIVE_PROMPT` and `WARMUP_SEED`, and `_warmup_steps_run` (set in `__init__`, filled by
`run_denoise_stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loguru import logger

from runnerkit import compile as regional_compile
from runnerkit import media, memory
from runnerkit.runners.base import lifecycle_phase
from runnerkit.runners.pipeline import DenoiseStage, InputInfo, Shape
from runnerkit.runners.request_state import RequestState
from runnerkit.schedulers.base import Scheduler

__all__ = ["WARMUP_PROMPT", "WarmupMixin"]

#: Dummy user content of warmup: only its shapes matter (a prompt is padded to the text length).
WARMUP_PROMPT = "warmup"


class WarmupMixin:
    """Warmup of `DefaultRunner`, and what a request at a shape warmup did not run costs (see the
    module docstring)."""

    def log_unwarmed_shape(self, info: InputInfo, index: int) -> None:
        """Say what a request at a shape warmup did not run costs. Eager: a slower first step
        (WARNING). Compiled: warmup's two shapes made the token-count dimensions dynamic, which
        serve sizes >= 2 only (`regional_compile.uncovered_sizes`): INFO when every size of
        `compiled_sizes` is covered, WARNING naming the size when one is not (the request compiles), INFO
        again for a later request with the same uncovered sizes (it reuses what the first one compiled)."""
        shapes = [list(x) for x in self.warmed_shapes]
        if not self.config.compile.enabled:
            logger.warning("request {}: shape {} was not warmed (warmup shapes: {}); expect a slower first step",
                           index, list(info.shape), shapes)
            return
        sizes = self.compiled_sizes(info)
        uncovered = regional_compile.uncovered_sizes(sizes)
        # torch keeps the graphs a request compiled for sizes 0 and 1: a later request with the same
        # such sizes reuses them (the runner's own record; torch's caches are not asked)
        compiled_by: dict[tuple[tuple[str, int], ...], int] = vars(self).setdefault("_uncovered_compiled_by", {})
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

    def compiled_sizes(self, info: InputInfo) -> dict[str, int]:
        """The sizes of the dimensions the compiled blocks see as dynamic after warmup for a request
        `info` (name -> size, e.g. {'transformer tokens': 45}); a family that knows them overrides
        this. Default: none known."""
        return {}

    # ---- warmup ------------------------------------------------------------------------
    def _opt_in(self, name: str) -> Any:
        """A warmup declaration from the runner's own class body (never inherited)."""
        return type(self).__dict__.get(name)

    def warmup_shapes(self) -> tuple[Shape, ...]:
        """The class-constant warmup shapes of this checkpoint's flavour ((h, w, f), two of them)."""
        table = self._opt_in("WARMUP_SHAPES") or {}
        return tuple(table.get(self.flavour(), ()))

    def check_warmup_supported(self) -> None:
        """Refuse anything the warmup path does not support, and warmup shapes that cannot fit.

        Raises:
            NotImplementedError: with the reason (runner, task, offload mode or flavour not covered).
            MemoryFitError: a warmup shape's estimated peak exceeds the device's memory limit.
        """
        cls = type(self).__name__
        if self.config.unload_modules:
            raise NotImplementedError(
                "warmup is refused with `unload_modules`=true: every module is reloaded per request, so "
                "nothing warmup loads would survive to the first request")
        tasks, table, modes = (self._opt_in(n) for n in ("WARMUP_TASKS", "WARMUP_SHAPES", "WARMUP_OFFLOAD_MODES"))
        if tasks is None or table is None or modes is None:
            raise NotImplementedError(
                f"runner class {cls} has not opted in to warmup: it must declare WARMUP_TASKS, WARMUP_SHAPES "
                "and WARMUP_OFFLOAD_MODES in its own class body (opt-in is not inherited from a parent runner)")
        if self.config.task not in tasks:
            raise NotImplementedError(f"warmup of {cls} does not cover task {self.config.task!r} (covered: {list(tasks)})")
        mode = self.config.offload.mode if not self.config.offload.lazy_load else "lazy_load"
        if mode not in modes:
            raise NotImplementedError(
                f"warmup of {cls} does not support offload mode {mode!r} (supported: {list(modes)})")
        with lifecycle_phase("load"):  # reading the checkpoint's architecture is a load problem if it fails
            flavour = self.flavour()
        if flavour not in table:
            raise NotImplementedError(
                f"warmup of {cls} has no shapes for this checkpoint's flavour {flavour!r} "
                f"(recognised flavours: {sorted(table)}); an unrecognised architecture is not warmed")
        assert len(table[flavour]) == 2, f"{cls}.WARMUP_SHAPES[{flavour!r}] must hold exactly two shapes"
        for shape in table[flavour]:  # a warmup shape that cannot fit fails here, before loading
            self.memory_checks.check_fit(shape, f"warmup shape {list(shape)}")

    def runnable_warmup_shapes(self, shapes: Sequence[Shape]) -> tuple[Shape, ...]:
        """Under Ulysses (`parallel.ulysses` K > 1), the warmup shapes whose transformer tokens divide
        by K (`check_sequence_split`); each one dropped is named in a warning (a request of that
        shape is refused as well, so warming it would serve nothing). Otherwise all of `shapes`.

        Raises:
            NotImplementedError: no warmup shape divides (naming their token counts): warmup could
                warm nothing; another K or no `--warmup` is the choice.
        """
        if self.parallel is None or self.parallel.ulysses <= 1:
            return tuple(shapes)
        kept, dropped = [], []
        for shape in shapes:
            try:
                for info in self.warmup_infos(shape):
                    self.check_sequence_split(info)
            except NotImplementedError as exc:
                dropped.append(f"{list(shape)}: {exc}")
                continue
            kept.append(shape)
        if not kept:
            raise NotImplementedError(f"`parallel.ulysses`={self.parallel.ulysses}: no warmup shape of "
                                      f"{type(self).__name__} has tokens that divide ({'; '.join(dropped)}); use "
                                      "another `parallel.ulysses` or run without warmup")
        for why in dropped:
            logger.warning("warmup: skipped shape {} (a request of that shape is refused as well)", why)
        return tuple(kept)

    def warmup_info(self, shape: Shape) -> InputInfo:
        """The dummy request of warmup at `shape`: placeholder prompt, the configured negative prompt."""
        cfg = self.config
        negative = cfg.negative_prompt if cfg.negative_prompt is not None else self.DEFAULT_NEGATIVE_PROMPT
        h, w, f = shape
        return InputInfo(prompt=WARMUP_PROMPT, negative_prompt=negative, seed=self.WARMUP_SEED, height=h, width=w,
                         frames=f, warmup=True)

    def warmup_infos(self, shape: Shape) -> tuple[InputInfo, ...]:
        """The dummy requests warmup runs at `shape` (default: one, `warmup_info`). A family whose
        sequence lengths also follow its inputs (e.g. the number of reference images) returns one
        per input variant, so every kernel shape a request can produce at `shape` is warmed."""
        return (self.warmup_info(shape),)

    def run_warmup(self, shapes: Sequence[Shape]) -> None:
        """Both shapes through the real path: shape-independent encoders (text) once, then per shape
        (and per input variant, `warmup_infos`) the per-shape encoders (images), every denoise stage
        (transitions included) on `warmup_steps`, and the decoders; then the media writers
        (`media.warm_writers`). Nothing is saved; no request profile is written."""
        for sched in self.schedulers.values():
            sched.generator = None  # before any encoder that could draw random numbers
        shared = self.run_encoders(RequestState(self.warmup_info(shapes[0])), per_shape=False)
        for shape in shapes:
            for info in self.warmup_infos(shape):
                try:
                    req = RequestState(info, inputs=shared)
                    self.run_encoders(req, per_shape=True)
                    latents = self.run_denoise(req, warmup=True)
                    if self.decodes_here:  # parallel: the decoders run on rank 0 only, as in a request
                        self.decode(req, latents)
                finally:
                    self.reset_request_state()
        if self.decodes_here:  # the rank that saves results: the writers' imports and first encode
            logger.debug("warmup: media writers warmed: {}", media.warm_writers(self.pipeline.outputs) or "none")

    def warmup_steps(self, req: RequestState, stage: DenoiseStage, sched: Scheduler) -> list[int]:
        """Steps warmup runs in `stage` (after `prepare`): step 0, plus the first step of every
        other MoE expert the stage would choose (every branch runs at least once)."""
        steps, seen = [0], {self.select_transformer(req, stage, 0, sched.timesteps[0:1])}
        for i in range(1, sched.infer_steps):
            expert = self.select_transformer(req, stage, i, sched.timesteps[i : i + 1])
            if expert not in seen:
                seen.add(expert)
                steps.append(i)
        return steps

    def warmup_step_report(self) -> dict[str, list[int]]:
        """Per denoise stage, the steps warmup ran (the same steps on every shape)."""
        return dict(self._warmup_steps_run)

    def after_warmup(self) -> None:
        """Eager default: collect and freeze the gc once (never under lazy load or unload_modules)."""
        if not (self.config.offload.lazy_load or self.config.unload_modules):
            memory.freeze_gc_once()
