"""BaseRunner: the lifecycle template and every guarantee it holds (ARCHITECTURE §2, §3).

    runner = get_runner_cls(config.model_cls, config.task)(config)   # family defaults resolved, config validated
    runner.init_modules()                # once: memory plan (offload.mode auto) -> warmup gate -> load_modules
                                         #       -> config lock -> compile cache -> warmup
    runner.run_pipeline(request, index)  # one request; end_run() always runs after it

`init_modules`, `warmup` and `run_pipeline` are final: a subclass that defines one of them is
refused when the class is created. Families fill in hooks (`load_modules`, `serve_request`,
`run_warmup`, `end_run`, ...); warmup's gate, shapes and report come from the `Warmup` the runner
holds (`warmups`, runners/warmup.py); the guarantees stay here:

- `init_modules` runs once (a second call raises); the config is deeply frozen at the lock.
- `warmup` runs at most once, only inside `init_modules`, behind its gate; the request state
  (schedulers, generators, inputs, caches) is reset in `finally`.
- `run_pipeline` tags every error with its phase (`load`, `warmup`, `request N`), writes the
  request profile, always runs `end_run`, and never lets a cleanup error hide the request's
  error (the cleanup error is attached to it as a note and logged with its traceback).
- `run_pipeline` on another thread than the one that ran `init_modules` (and warmup) logs one
  WARNING per runner: per-thread CUDA library state makes that thread's first request slower
  (`check_serving_thread`; docs/prompt_lengths.md).

Observers (a server, a progress bar) set `on_phase` (called with "loading", "warming_up",
"ready" as `init_modules` goes), `on_progress` (called with a `Progress` at every request
stage and after every denoising step; it may raise `RequestCancelled` to stop the request at
that boundary, after which `end_run` cleans up as after any failure) and `on_request_done`
(called with the request's profile once it is done, files included; `report_request_done`).

Files: written in the `save` stage, or after `overlap_writes(N)` on the writer thread while the next
request computes (runners/writes.py); the request is then reported once its files are written.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import torch
from loguru import logger

from runnerkit import compile as regional_compile
from runnerkit import memory
from runnerkit.config import (FAMILY_DEFAULTED, REVALIDATED, ConfigLockedError, RunnerConfig, deep_freeze,
                              fill_family_defaults)
from runnerkit.memory import snapshot
from runnerkit.profiling import Profiler, RequestProfile, compile_seconds, dynamo_counts, inductor_cache_counts
from runnerkit.runners.checkpoints import CheckpointSource
from runnerkit.runners.pipeline import Shape
from runnerkit.runners.progress_report import Progress, RequestCancelled  # observers' types, named here too
from runnerkit.weights import CheckpointError
from runnerkit.writer import ResultWriter

if TYPE_CHECKING:
    from runnerkit.runners.warmup import Warmup

__all__ = ["BaseRunner", "ConfigLockedError", "LifecycleError", "Progress", "RequestCancelled", "error_phase",
           "lifecycle_phase", "resolve_device"]

FINAL_METHODS = ("init_modules", "warmup", "run_pipeline")


class LifecycleError(RuntimeError):
    """A lifecycle verb was called out of order (a second init_modules, a request before init, ...)."""


def error_phase(exc: BaseException) -> str | None:
    """The lifecycle phase (`load`, `warmup`, `request N`) an exception was raised in, if known."""
    return getattr(exc, "runnerkit_phase", None)


@contextmanager
def lifecycle_phase(name: str) -> Iterator[None]:
    """Tag any exception leaving the block with the phase `name` (keeps its type and traceback)."""
    try:
        yield
    except BaseException as exc:
        if error_phase(exc) is None:
            exc.runnerkit_phase = name  # type: ignore[attr-defined]
            exc.add_note(f"[runnerkit] raised during phase: {name}")
        raise


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda if available else cpu; 'cuda' without CUDA raises ValueError."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device` is {spec!r} but CUDA is not available; use 'cpu' or 'auto'")
    return device


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MemoryPlanning(Protocol):
    """What the lifecycle and the entry points ask of a runner's memory checks (planning/checks.py)."""

    def plan_memory(self, shapes: Sequence[Shape]) -> Any:
        """Resolve `offload.mode` auto into a concrete config for `shapes` before loading; a no-op otherwise."""

    def check_requests_fit(self, requests: Sequence[Any]) -> None:
        """Before loading: raise `planning.fit.MemoryFitError` if a request cannot fit in the device's memory."""


class BaseRunner(ABC):
    """Owns a pipeline's modules and lifecycle; holds the lifecycle guarantees (see module doc)."""

    #: Tasks this runner serves (validated at build time).
    TASKS: ClassVar[tuple[str, ...]] = ()
    #: The family's defaults of the run settings the config leaves at None (config.FAMILY_DEFAULTED):
    #: resolution, frames, fps, steps, shift, guidance, scheduler.
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    #: True for a runner built by `for_plan`: it plans memory and never loads (set before `__init__` runs).
    plan_only: bool = False
    _planned_device: torch.device | None = None
    #: The runner's warmup (runners/warmup.py): its gate, shapes, step report and what follows it; made
    #: by the runner class's `__init__` (DefaultRunner), driven by `warmup` (and its gate by `init_modules`).
    warmups: Warmup
    #: The memory plan and fit checks (the subclass's `__init__` makes them; planning/checks.py `MemoryChecks`).
    memory_checks: MemoryPlanning
    #: Checkpoint layouts `write_synthetic_checkpoint` can write (runnerkit.tools.synth_checkpoint); (): none.
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = ()
    #: The layout of the synthetic checkpoint the runner writes itself (`synthetic_checkpoint`).
    SYNTHETIC_LAYOUT: ClassVar[str] = "runnerkit"
    #: The family has a prompt enhancer (config `prompt_enhancer` loads it; requests ask with `enhance_prompt`).
    PROMPT_ENHANCER: ClassVar[bool] = False
    #: The config's `video_decoder` choices the family reads, its default first; (): it refuses the key.
    VIDEO_DECODERS: ClassVar[tuple[str, ...]] = ()
    #: The configured architecture (a pydantic model; the family sets it in `__init__`): the synthetic
    #: checkpoint's, keyed into its cache folder (runners/checkpoints.py); None: the checkpoint's own.
    arch_override: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The class body, and every non-runner class ahead of BaseRunner in the MRO (runners take no mixins, a test
        # walks the registry): one would replace a final verb unnoticed. Runner parents were checked when created.
        mro = cls.__mro__
        own = [k for k in mro[:mro.index(BaseRunner)] if k is cls or not issubclass(k, BaseRunner)]
        overridden = [m for m in FINAL_METHODS if any(m in k.__dict__ for k in own)]
        if overridden:
            raise TypeError(
                f"{cls.__qualname__} overrides {', '.join(overridden)}: these lifecycle verbs are final in BaseRunner "
                "(they hold the once-only, phase-tagging, profiling and cleanup guarantees); describe the pipeline "
                "and override the hooks instead (load_modules, describe_pipeline, run_warmup, clear_request_state)")
        unknown = sorted(set(cls.__dict__.get("DEFAULTS", {})) - set(FAMILY_DEFAULTED))
        if unknown:
            raise TypeError(f"{cls.__qualname__}.DEFAULTS names {unknown}; family defaults are for {list(FAMILY_DEFAULTED)}")

    def __init__(self, config: RunnerConfig) -> None:
        config.refuse_inert_settings()
        config = self.resolve_config(config)
        if config.task not in self.TASKS:
            raise ValueError(f"`task` {config.task!r} is not served by {type(self).__name__} (model_cls "
                             f"{config.model_cls!r}); its tasks: {list(self.TASKS)}")
        self._config = config
        self._config_locked = False
        self._lifecycle = "new"  # new -> initialising -> ready | failed
        self._warmup_ran = False
        #: the shapes warmup ran (the runnable class shapes, then a family's extra: `Warmup.also_warmed`); () without it
        self.warmed_shapes: tuple[Shape, ...] = ()
        #: (ident, name) of the thread that ran `init_modules` (and so warmup); see `check_serving_thread`.
        self.init_thread: tuple[int, str] | None = None
        self._thread_warned = False
        self.device = self._planned_device if self._planned_device is not None else resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        #: Where the checkpoint is, written first if synthetic (runners/checkpoints.py; `open_checkpoint` reads it).
        self.checkpoints = CheckpointSource(self)
        self.profiler = Profiler(self.device)
        #: The compile cache entry of this run (`compile.cache_dir`), opened after the config lock.
        self.compile_cache: regional_compile.CompileCache | None = None
        #: Observers (see the module docstring); None: nobody listens.
        self.on_phase: Callable[[str], None] | None = None
        self.on_progress: Callable[[Progress], None] | None = None
        self.on_request_done: Callable[[RequestProfile, BaseException | None], None] | None = None
        #: Writes requests' files while the next request computes (`overlap_writes`); None: inline.
        self.writer: ResultWriter | None = None
        #: This rank's process group under `parallel` (`attach_parallel`); None: one process.
        self.parallel: Any = None

    @classmethod
    def for_plan(cls, config: RunnerConfig, device: torch.device | None = None) -> Self:
        """A runner of `config` that only plans its memory (`runnerkit plan`, runnerkit/tools/plan.py): built
        without reading weights, and without needing the checkpoint files (a family then takes the architecture
        its config gives or implies; `plan_only` is true from the start of `__init__`). `init_modules` refuses it.

        Args:
            device: the device to plan for, which this machine need not have (e.g. `cuda` on a CPU-only host);
                None: the config's `device`, resolved as for a run.

        Raises:
            ValueError, NotImplementedError: what building the runner raises (the family's settings checks).
        """
        runner = cls.__new__(cls)
        runner.plan_only = True
        runner._planned_device = device
        runner.__init__(config)
        return runner

    def overlap_writes(self, max_in_flight: int) -> None:
        """Write each request's files on the writer thread while the next request computes, at most
        `max_in_flight` results in flight (runnerkit/writer.py, runners/writes.py); 0: inline, inside
        the request's `save` stage (the default). Call before the first request, and `finish_writes`
        (or `writer.close()`) after the last: a request is done, `on_request_done`, once its files are.

        Raises:
            ValueError: `max_in_flight` is not an int >= 0.
            RuntimeError: files of an earlier request are still being written.
        """
        from runnerkit.runners.writes import replace_writer

        self.writer = replace_writer(self.writer, max_in_flight)

    def finish_writes(self) -> None:
        """Wait until the files of every request handed to the writer thread are written and each such
        request was reported (`on_request_done`); a no-op when files are written inline. A
        KeyboardInterrupt while waiting is tagged `request N (write)`, N the oldest request in flight."""
        if self.writer is None:
            return
        pending = self.writer.in_flight()
        with lifecycle_phase(f"request {pending[0]} (write)") if pending else nullcontext():
            self.writer.drain()

    def attach_parallel(self, group: Any) -> None:
        """Run as one rank of `group` (runnerkit/parallel/group.py `ParallelGroup`): its device replaces
        the config's (cuda:LOCAL_RANK or cpu). Only before `init_modules`.

        Raises:
            LifecycleError: `init_modules` already started.
        """
        if self._lifecycle != "new":
            raise LifecycleError(f"attach_parallel must come before init_modules (state: {self._lifecycle})")
        self.parallel = group
        self.device = group.device
        self.profiler = Profiler(self.device)

    # -- config ---------------------------------------------------------------------------
    @classmethod
    def resolve_config(cls, config: RunnerConfig) -> RunnerConfig:
        """`config` with every family-defaulted setting left at None filled from `DEFAULTS`.

        Raises:
            ValueError: the family's defaults miss a setting the config leaves unset.
        """
        unset = [k for k in FAMILY_DEFAULTED if getattr(config, k) is None]
        missing = [k for k in unset if k not in cls.DEFAULTS]
        if missing:
            raise ValueError(f"model_cls {config.model_cls!r} has no default for {missing}; set them in the config")
        return fill_family_defaults(config, {k: cls.DEFAULTS[k] for k in unset})

    @property
    def config(self) -> RunnerConfig:
        """The run config: validated, with the family's defaults; deeply frozen after `load_modules`."""
        return self._config

    def update_config(self, **changes: Any) -> None:
        """Record values resolved while loading (e.g. the architecture); refused after the lock.

        Raises:
            ConfigLockedError: after `load_modules` returned.
        """
        if self._config_locked:
            raise ConfigLockedError(f"config is locked after load_modules; refused change of {sorted(changes)}")
        self._config = RunnerConfig.model_validate({**self._config.model_dump(exclude_unset=True), **changes},
                                                   context={REVALIDATED: True})

    @contextmanager
    def config_trial(self, **changes: Any) -> Iterator[None]:
        """Inside the block `config` reads `changes` (e.g. the offload config of a candidate the memory planner
        judges through the family's estimate, planning/checks.py); restored after it. Before the lock only."""
        assert not self._config_locked, "a trial config is for planning, before loading"
        saved = self._config
        self._config = saved.model_copy(update=changes)
        try:
            yield
        finally:
            self._config = saved

    def _lock_config(self) -> None:
        # pydantic models are frozen already; the free-form `model` dict is frozen here, recursively.
        self._config = self._config.model_copy(update={"model": deep_freeze(self._config.model)})
        self._config_locked = True

    # -- lifecycle (final) ------------------------------------------------------------------
    def init_modules(self) -> None:
        """Resolve `offload.mode` auto (`memory_checks.plan_memory`, unless `check_requests_fit` did already), load
        modules, lock the config, load the compile cache (`compile.cache_dir`), run the one-time warmup
        (a no-op without `warmup`; with a compile cache it saves the entry after it).

        Raises:
            LifecycleError: called a second time (build a new runner to reload), or on a `for_plan` runner.
            whatever planning, loading or warmup raises, tagged with phase `plan`, `load` or `warmup`.
        """
        if self._lifecycle != "new":
            raise LifecycleError(f"init_modules runs once per runner and already ran (state: {self._lifecycle}); "
                                 "build a new runner to load again")
        if self.plan_only:
            raise LifecycleError("this runner was built by `for_plan` to plan memory only and never loads; build "
                                 "the runner class itself to run")
        self._lifecycle = "initialising"
        current = threading.current_thread()
        self.init_thread = (current.ident or 0, current.name)
        try:
            self._phase("loading")
            with lifecycle_phase("plan"):  # before the warmup gate: it reads the offload mode
                self.memory_checks.plan_memory(())
            if self.config.warmup:
                with lifecycle_phase("warmup"):
                    self.warmups.check_supported()  # refuse before anything is loaded
            with lifecycle_phase("load"):
                t0 = time.perf_counter()
                try:
                    self.load_modules()
                except CheckpointError as exc:  # a damaged file: say how to repair what can be rewritten
                    hint = self.checkpoints.repair_hint()
                    if hint and len(exc.args) == 1:
                        exc.args = (f"{exc.args[0]}; {hint}",)  # same exception: its type, traceback and phase stay
                    raise
                trimmed = memory.trim_host_heap()  # freed heap pages back to the kernel (docs/host_memory.md)
                seconds = self.profiler.phases["load_seconds"] = time.perf_counter() - t0
                logger.info("load: {:.2f} s, {}; freed heap returned: {}", seconds, snapshot(self.device).describe(),
                            "n/a (no malloc_trim)" if trimmed is None else f"{trimmed:.2f} GiB")
            self._lock_config()
            logger.info("resolved config: {}", self.config.model_dump_json())
            with lifecycle_phase("load"):
                self._load_compile_cache()
            if self.config.warmup:
                self._phase("warming_up")
            with lifecycle_phase("warmup"):
                self.warmup()
        except BaseException:
            self._lifecycle = "failed"
            raise
        self._lifecycle = "ready"
        self._phase("ready")

    def check_serving_thread(self, index: int) -> bool:
        """Whether request `index` runs on the thread that ran `init_modules` (and warmup). If not, log
        one WARNING per runner (the first such request): per-thread CUDA library state (cuBLAS
        handles and workspaces, which PyTorch keeps per thread) was created by warmup on the other
        thread, so this thread's first request creates its own and runs slower than steady
        (measured: request 0's first step 1.44-1.50 s against 1.39 s, its text encoder 0.08-0.10 s
        against 0.03 s, on the H200). `runnerkit serve` warms up on its job thread; a Python API
        user should call `init_modules` on the thread that will call `run_pipeline`."""
        current = threading.current_thread()
        if self.init_thread is None or current.ident == self.init_thread[0]:
            return True
        if not self._thread_warned:
            self._thread_warned = True
            logger.warning("request {}: runs on thread {!r}, but init_modules{} ran on thread {!r}: per-thread CUDA "
                           "library state (cuBLAS handles, workspaces) warmed there is not this thread's, so this "
                           "thread's first request runs slower than steady; call init_modules on the thread that "
                           "serves requests (warned once per runner)", index, current.name,
                           " and warmup" if self.config.warmup else "", self.init_thread[1])
        return False

    def text_buckets(self) -> tuple[int, ...]:
        """The text lengths (tokens) prompts are padded to (docs/prompt_lengths.md); () when prompts run
        unpadded. DefaultRunner reads `text_buckets` and the family's default."""
        return ()

    def _load_compile_cache(self) -> None:
        """With `compile.cache_dir`: load this run's entry into torch's caches before warmup compiles
        (runnerkit/compile.py, `CompileCache`; logs why when there is none; never raises on a bad cache)."""
        cfg = self.config.compile
        if not (cfg.enabled and cfg.cache_dir is not None):
            return
        fields = regional_compile.cache_fields(
            runner=type(self), model=json.loads(self.config.model_dump_json(include={"model"}))["model"],
            dtype=self.config.dtype, cfg=cfg, attention=(self.profiler.attention or {}).get("backend"),
            offload=self.config.offload, device=self.device, text_buckets=self.text_buckets(),
            lora="off" if self.config.lora is None or self.config.lora.mode == "fused" else
            f"unfused/r{self.config.lora.max_rank}", compute_dtype=self.config.compute_dtype,
            ulysses=1 if self.config.parallel is None else self.config.parallel.ulysses)
        self.compile_cache = regional_compile.CompileCache(cfg.cache_dir, fields)
        self.compile_cache.load(will_save=self.config.warmup)
        self.profiler.compile_cache = self.compile_cache.report()

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def warmup(self) -> None:
        """The one-time warmup: the gate (`warmups.check_supported`), then `run_warmup` on the class-constant
        shapes this run can serve (`warmups.runnable_shapes`), then `warmups.after` (ARCHITECTURE §3).

        A no-op without `config.warmup`. Runs only inside `init_modules`, at most once. Afterwards
        the request state is the start-up baseline (`reset_request_state`: schedulers fresh with
        generator None, family caches cleared; warmup's `RequestState`s dropped), also on failure.

        Raises:
            LifecycleError: called outside `init_modules` or a second time.
            NotImplementedError: the gate refuses this runner, task, flavour or mode.
        """
        if self._lifecycle != "initialising":
            raise LifecycleError("warmup runs only inside init_modules (once); it cannot be called directly")
        if self._warmup_ran:
            raise LifecycleError("warmup already ran on this runner; it runs at most once")
        if not self.config.warmup:
            return
        warmups = self.warmups
        warmups.check_supported()
        shapes = warmups.runnable_shapes(warmups.shapes())
        before = self._memory_report()
        memory.reset_device_peak(self.device)  # the `after` report's and the summary line's peak: warmup's own
        graphs0, compile0, (hits0, misses0) = dynamo_counts()[0], compile_seconds(), inductor_cache_counts()
        t0 = time.perf_counter()
        self._warmup_ran = True
        try:
            with memory.oom_note(self.device, "warmup"):
                self.run_warmup(shapes)
        finally:
            self.reset_request_state()
        memory.synchronize(self.device)
        seconds = time.perf_counter() - t0
        hits1, misses1 = inductor_cache_counts()
        if self.compile_cache is not None:  # what warmup compiled (or loaded), for the next start-up
            self.compile_cache.save()
            self.profiler.compile_cache = self.compile_cache.report()
        warmups.after()
        self.warmed_shapes = (*shapes, *warmups.also_warmed)
        after = self._memory_report()
        self.profiler.warmup = warmups.with_report({
            "seconds": round(seconds, 4),
            "shapes": [list(s) for s in shapes],
            "steps_per_shape": warmups.step_report(),
            "compilations": dynamo_counts()[0] - graphs0,
            "compile_seconds": round(compile_seconds() - compile0, 3),
            "compile_cache_hits": hits1 - hits0,
            "compile_cache_misses": misses1 - misses0,
            "memory_before": before,
            "memory_after": after,
        })
        logger.info("warmup: {:.2f} s over shapes {}{}; {}", seconds, warmups.warmed_text(),
                    f"; inductor graphs: {hits1 - hits0} from a cache, {misses1 - misses0} generated"
                    if self.config.compile.enabled else "", memory.snapshot(self.device).describe())

    def _memory_report(self) -> dict[str, float | str]:
        """Device memory (CUDA only: zeros on the CPU would mislead) and host memory, GiB."""
        device = memory.snapshot(self.device).as_dict() if self.device.type == "cuda" else {}
        return {**device, **memory.host_memory().as_dict()}

    def run_pipeline(self, request: Any, index: int = 0) -> RequestProfile:
        """Serve one request through `serve_request`, then `end_run` (always); report it done before
        returning, or, while the writer thread still writes its files (`overlap_writes`), once it wrote them.

        Raises whatever the request raises, tagged with phase `request {index}` (a CUDA OOM gets a
        note separating live allocated memory from the allocator's reserved cache). If `end_run`
        fails too, its error is attached to the request's error as a note and logged; if only
        `end_run` fails, its error is raised, tagged `request {index} (end_run)`.

        Raises:
            LifecycleError: `init_modules` has not completed.
        """
        if self._lifecycle != "ready":
            raise LifecycleError(f"run_pipeline needs a runner whose init_modules completed (state: {self._lifecycle})")
        self.check_serving_thread(index)
        prof = self.profiler.begin_request(index, self.profile_stages())
        graphs0, _ = dynamo_counts()
        compile0 = compile_seconds()
        recompiles0, reasons0 = regional_compile.recompile_state()
        reserved0 = memory.snapshot(self.device).reserved_gib
        memory.reset_device_peak(self.device)
        memory.reset_host_peak()
        t0 = prof.started = time.perf_counter()
        error: BaseException | None = None
        try:
            with lifecycle_phase(f"request {index}"), memory.oom_note(self.device, f"request {index}"):
                self.serve_request(request, index, prof)
        except BaseException as exc:
            error = exc
            prof.ok, prof.error = False, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            cleanup_error = self._end_run_reporting(index, error)
            prof.seconds = time.perf_counter() - t0
            graphs1, _ = dynamo_counts()
            recompiles1, reasons1 = regional_compile.recompile_state()
            snap = memory.snapshot(self.device)
            prof.memory = {k: v for k, v in self._memory_report().items() if k not in ("free_gib", "host_available_gib")}
            prof.audit = {
                "compilations": graphs1 - graphs0,
                "recompilations": recompiles1 - recompiles0,
                "recompile_reasons": regional_compile.new_reasons(reasons0, reasons1),
                "compile_seconds": round(compile_seconds() - compile0, 3),
                "reserved_growth_gib": round(snap.reserved_gib - reserved0, 4),
                "warmed_shape": tuple(prof.shape) in set(self.warmed_shapes),  # the shape that ran
            }
            self.profiler.end_request()
            if prof.audit["compilations"] or prof.audit["recompilations"]:
                logger.warning("request {}: shape {} compiled {} graph(s) ({} recompilations) in {:.2f} s during the "
                               "request{}", index, prof.shape, prof.audit["compilations"], prof.audit["recompilations"],
                               prof.audit["compile_seconds"], "" if prof.audit["warmed_shape"] else
                               " (a shape warmup did not cover)" if self._warmup_ran else " (no warmup ran: --warmup)")
            if cleanup_error is not None and error is None:
                prof.ok, prof.error = False, f"end_run: {type(cleanup_error).__name__}: {cleanup_error}"
            if not prof.write:  # written inline (in the `save` stage), or nothing written
                prof.write = {"overlapped": False, "seconds": round(prof.stages.get("save", 0.0), 4),
                              "wait_seconds": 0.0}
            if prof.pending_write is not None:  # its files are on the writer thread: the later of the two reports
                prof.pending_write.computed(error is None and cleanup_error is None)
            if cleanup_error is not None and error is None:
                raise cleanup_error
        if prof.pending_write is None:
            self.report_request_done(prof, None)
        return prof

    def report_request_done(self, prof: RequestProfile, error: BaseException | None) -> None:
        """Request `prof.index` is done: its compute, and its files (`error` None: written, or none to
        write; else why they were not). Logs its line and calls `on_request_done`. Runs at the end of
        `run_pipeline`, or, when the writer thread still wrote its files then, on that thread once they
        are written (`prof.seconds` then counts up to that moment: the files overlapped later requests)."""
        if prof.pending_write is not None:
            prof.seconds = time.perf_counter() - prof.started
        if error is None:
            logger.info("request {}: {:.2f} s, stages {}{}", prof.index, prof.seconds,
                        {k: None if v is None else round(v, 3) for k, v in prof.stages.items()},
                        f", its files written in {prof.write['seconds']:.2f} s on the writer thread"
                        if prof.write.get("overlapped") else "")
        if self.on_request_done is not None:
            self.on_request_done(prof, error)
        elif error is not None:
            logger.error("request {}: its files could not be written: {}: {}", prof.index, type(error).__name__, error)

    def _end_run_reporting(self, index: int, error: BaseException | None) -> BaseException | None:
        """Run `end_run`; return its exception (tagged) instead of letting it replace `error`."""
        try:
            with lifecycle_phase(f"request {index} (end_run)"):
                self.end_run()
        except BaseException as cleanup:
            if error is None:
                return cleanup
            error.add_note(f"[runnerkit] end_run also failed after this error: {type(cleanup).__name__}: {cleanup}")
            error.runnerkit_cleanup_error = cleanup  # type: ignore[attr-defined]
            logger.opt(exception=cleanup).error("request {}: end_run failed after the request failed: {}: {}",
                                                index, type(cleanup).__name__, cleanup)
        return None

    # -- hooks ------------------------------------------------------------------------------
    def open_checkpoint(self, path: Path, raw: bool = False) -> Any:
        """Family hook: the checkpoint at `path`, no weight read (`raw`: without the config's `model` over its
        architecture); `checkpoints.locate()` opens it. Raises CheckpointError naming what is missing."""
        raise NotImplementedError(f"{type(self).__name__} must implement open_checkpoint(path, raw) to read its "
                                  "checkpoint layouts (runners/checkpoints.py only locates and writes them)")

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Family hook: write deterministic random weights of `config`'s architecture to `out`, in `layout`
        (one of `CHECKPOINT_LAYOUTS`; runnerkit.tools.synth_checkpoint, `synthetic_checkpoint`)."""
        raise NotImplementedError(f"{cls.__name__} cannot write synthetic checkpoints")

    @classmethod
    def shortest_clip(cls, config: RunnerConfig) -> int:
        """Family hook: the fewest frames a video request may give besides one (the server's `seconds` range;
        one frame where `validate_request` takes it): `TEMPORAL_FACTOR` + 1 unless the family needs more."""
        return getattr(cls, "TEMPORAL_FACTOR", 1) + 1

    @classmethod
    def lora_layers(cls, config: RunnerConfig, layout: str) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """Family hook for the synthetic adapter writer (runnerkit/lora/synthetic.py): the linear layers a
        typical adapter of `config`'s architecture covers, name -> (out, in), and their names in `layout`."""
        raise NotImplementedError(f"{cls.__name__} cannot describe its LoRA layers for a synthetic adapter")

    @abstractmethod
    def load_modules(self) -> None:
        """Family hook: build encoders, transformer(s), decoders and schedulers."""

    @abstractmethod
    def serve_request(self, request: Any, index: int, prof: RequestProfile) -> None:
        """The request path (DefaultRunner: encoders -> denoise stages -> decoders -> save)."""

    @abstractmethod
    def end_run(self) -> None:
        """Request-level cleanup: back to the start-up baseline (runs after every request)."""

    @abstractmethod
    def reset_request_state(self) -> None:
        """Drop every piece of request state (also after warmup): schedulers, inputs, caches."""

    @abstractmethod
    def profile_stages(self) -> tuple[str, ...]:
        """The profiling stages of one request, in order."""

    def check_adapters(self, requests: Sequence[Any]) -> None:
        """After `init_modules`: raise ValueError naming the file if a request's LoRA adapters cannot
        be applied (DefaultRunner matches them to the transformer, runnerkit/lora). Default: this
        runner takes no adapters, so a request carrying `lora` is refused."""
        if any(getattr(r, "lora", None) for r in requests):
            raise ValueError(f"`lora`: {type(self).__name__} does not apply LoRA adapters")

    @abstractmethod
    def run_warmup(self, shapes: Sequence[Shape]) -> None:
        """Drive the real request path on `shapes` (never `run_pipeline`)."""
