"""BaseRunner: the lifecycle template (ARCHITECTURE §2).

    runner = build_runner(config)        # registry lookup, config validated
    runner.init_modules()                # load_modules -> config lock -> warmup (once)
    runner.run_pipeline(request, index)  # one request; end_run() always runs after it

Families override `load_modules`, the `run_*` stage methods and `run_warmup`; `init_modules` is
final (a subclass that defines it is rejected at class creation). Every error leaves with the
phase it came from (`load`, `warmup`, `request N`) in its notes and in `error_phase(exc)`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from loguru import logger

from runnerkit.config import RunnerConfig
from runnerkit.memory import snapshot
from runnerkit.profiling import Profiler


class ConfigLockedError(RuntimeError):
    """The runner's config was changed after `load_modules` (it is locked from then on)."""


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


class BaseRunner(ABC):
    """Owns a pipeline's modules and lifecycle. Subclasses must not override `init_modules`."""

    #: Tasks this runner serves (validated at build time).
    TASKS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "init_modules" in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} overrides init_modules; override load_modules/run_warmup instead")

    def __init__(self, config: RunnerConfig) -> None:
        if config.task not in self.TASKS:
            raise ValueError(f"`task` {config.task!r} is not served by model_cls {config.model_cls!r}; allowed: {list(self.TASKS)}")
        self._config = config
        self._config_locked = False
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.profiler = Profiler(self.device)
        self.input_info: Any = None
        self.inputs: Any = None

    # -- config ---------------------------------------------------------------------------
    @property
    def config(self) -> RunnerConfig:
        return self._config

    def update_config(self, **changes: Any) -> None:
        """Record values resolved while loading (e.g. the architecture); refused after the lock."""
        if self._config_locked:
            raise ConfigLockedError(f"config is locked after load_modules; refused change of {sorted(changes)}")
        self._config = RunnerConfig.model_validate({**self._config.model_dump(exclude_unset=True), **changes})

    # -- lifecycle ------------------------------------------------------------------------
    def init_modules(self) -> None:
        """Load modules, lock the config, run the one-time warmup (a no-op without --warmup)."""
        if self.config.warmup:
            with lifecycle_phase("warmup"):
                self.check_warmup_supported()  # refuse before anything is loaded
        with lifecycle_phase("load"):
            t0 = time.perf_counter()
            self.load_modules()
            seconds = time.perf_counter() - t0
            self.profiler.phases["load_seconds"] = seconds
            logger.info("load: {:.2f} s, {}", seconds, snapshot(self.device).describe())
        self._config_locked = True
        logger.info("resolved config: {}", self.config.model_dump_json())
        with lifecycle_phase("warmup"):
            self.warmup()

    @abstractmethod
    def load_modules(self) -> None:
        """Family hook: build encoders, transformer(s), VAE and scheduler."""

    @abstractmethod
    def check_warmup_supported(self) -> None:
        """Raise NotImplementedError with the reason if warmup cannot run for this runner/config."""

    @abstractmethod
    def warmup(self) -> None:
        """One-time warmup (no-op unless config.warmup); a second call is a no-op."""

    @abstractmethod
    def run_pipeline(self, request: Any, index: int = 0) -> Any:
        """Serve one request; must call `end_run` in `finally`."""

    @abstractmethod
    def end_run(self) -> None:
        """Request-level cleanup: back to the start-up baseline."""
