"""Runner registry: (`model_cls`, `task`) -> runner class, explicit dicts filled by a decorator.

A family may serve its tasks with several classes (e.g. text-to-video and image-to-video runners
of one `model_cls`); each class registers the tasks in its `TASKS`.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from runnerkit.runners.base import BaseRunner

R = TypeVar("R", bound="type[BaseRunner]")

#: `model_cls` -> the first class registered under it (the family's primary runner).
RUNNERS: dict[str, type["BaseRunner"]] = {}
#: (`model_cls`, `task`) -> the class serving that task.
TASK_RUNNERS: dict[tuple[str, str], type["BaseRunner"]] = {}

#: Where families live: every package `runnerkit/models/<family>/` with a `runner` module registers
#: its runners when imported. Adding a family = one folder; nothing else names it.
MODELS_PACKAGE = "runnerkit.models"


def family_modules() -> list[str]:
    """The `runner` modules of every family package under runnerkit/models/, sorted."""
    package = importlib.import_module(MODELS_PACKAGE)
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.ispkg and importlib.util.find_spec(f"{MODELS_PACKAGE}.{info.name}.runner") is not None:
            found.append(f"{MODELS_PACKAGE}.{info.name}.runner")
    return sorted(found)


def register_runner(name: str) -> Callable[[R], R]:
    """Class decorator: register a runner under `name` (the config's `model_cls`) for each task
    in its `TASKS`.

    Raises:
        ValueError: the class lists no task, or `name` already has a runner for one of its tasks.
    """

    def wrap(cls: R) -> R:
        tasks = tuple(getattr(cls, "TASKS", ()))
        if not tasks:
            raise ValueError(f"{cls.__qualname__} lists no TASKS; a runner registers the tasks it serves")
        taken = [t for t in tasks if (name, t) in TASK_RUNNERS]
        if taken:
            raise ValueError(f"model_cls {name!r} is already registered for task(s) {taken} by "
                             f"{TASK_RUNNERS[(name, taken[0])].__qualname__}")
        RUNNERS.setdefault(name, cls)
        TASK_RUNNERS.update({(name, t): cls for t in tasks})
        return cls

    return wrap


def load_families() -> dict[str, type["BaseRunner"]]:
    """Import every family package once so their runners are registered; return the registry."""
    for module in family_modules():
        importlib.import_module(module)
    return RUNNERS


def tasks_of(name: str) -> list[str]:
    """Every task registered under `model_cls` `name`, in registration order."""
    load_families()
    return [t for (n, t) in TASK_RUNNERS if n == name]


def get_runner_cls(name: str, task: str | None = None) -> type["BaseRunner"]:
    """The runner class of `model_cls` `name` for `task` (None: the family's primary runner).

    Raises:
        ValueError: unknown name (listing the registered ones) or a task the family does not
            serve (listing its tasks).
    """
    runners = load_families()
    if name not in runners:
        raise ValueError(f"unknown `model_cls` {name!r}; registered: {sorted(runners)}")
    if task is None:
        return runners[name]
    if (name, task) not in TASK_RUNNERS:
        raise ValueError(f"`task` {task!r} is not served by model_cls {name!r}; allowed: {tasks_of(name)}")
    return TASK_RUNNERS[(name, task)]
