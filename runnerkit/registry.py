"""Runner registry: (`model_cls`, `task`) -> runner class, explicit dicts filled by a decorator.

A family may serve its tasks with several classes (e.g. text-to-video and image-to-video runners
of one `model_cls`); each class registers the tasks in its `TASKS`.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from runnerkit.runners.base import BaseRunner

R = TypeVar("R", bound="type[BaseRunner]")

#: `model_cls` -> the first class registered under it (the family's primary runner).
RUNNERS: dict[str, type["BaseRunner"]] = {}
#: (`model_cls`, `task`) -> the class serving that task.
TASK_RUNNERS: dict[tuple[str, str], type["BaseRunner"]] = {}

#: Where families live: every package `runnerkit/models/<family>/`. Each module of a family folder
#: that registers runners (`@register_runner(...)` on a class) is imported at the first lookup of a
#: `model_cls` it registers, so a family may split its runners over several modules without them
#: importing each other, and a run imports its own family only (another family's imports, e.g.
#: transformers for its text encoder, cost every process ~1.5 s of CPU at start-up).
#: Adding a family = one folder; nothing else names it.
MODELS_PACKAGE = "runnerkit.models"


@functools.cache
def runner_modules() -> dict[str, tuple[str, ...]]:
    """Module -> the `model_cls` names it registers, for every module of every family folder under
    runnerkit/models/ that registers a runner, sorted by module name.

    Found by reading the sources with `ast` (nothing is imported, torch included), so the launch
    script can list the names before it parses its arguments: a decorator `@register_runner("name")`
    (a string literal) on a class.
    """
    package = importlib.import_module(MODELS_PACKAGE)  # runnerkit/models/__init__.py: no imports
    found: dict[str, tuple[str, ...]] = {}
    for family in pkgutil.iter_modules(package.__path__):
        if not family.ispkg:
            continue
        folder = Path(family.module_finder.path) / family.name  # type: ignore[union-attr]
        for info in pkgutil.iter_modules([str(folder)]):
            source = folder / f"{info.name}.py"
            if info.ispkg or not source.is_file():
                continue
            text = source.read_text(encoding="utf-8")
            if "register_runner" not in text:  # no decorator can name it: skip the parse (most modules)
                continue
            names = _registered_names(ast.parse(text, filename=str(source)))
            if names:
                found[f"{MODELS_PACKAGE}.{family.name}.{info.name}"] = names
    return dict(sorted(found.items()))


def _registered_names(tree: ast.Module) -> tuple[str, ...]:
    """The `model_cls` names of the `@register_runner("name")` class decorators in a module, in order."""
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for deco in node.decorator_list:
            func = deco.func if isinstance(deco, ast.Call) else None
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called == "register_runner":
                assert isinstance(deco, ast.Call)
                arg = deco.args[0] if deco.args else None
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    raise TypeError(f"class {node.name}: `register_runner` takes the `model_cls` as a string literal "
                                    "(the registry reads it from the source)")
                names.append(arg.value)
    return tuple(names)


def family_modules() -> list[str]:
    """Every module of the family folders that registers runners, sorted (`runner_modules`)."""
    return list(runner_modules())


def model_cls_names() -> list[str]:
    """Every registered `model_cls`, sorted, without importing any family (`runner_modules`)."""
    return sorted({name for names in runner_modules().values() for name in names})


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


def load_families(name: str | None = None) -> dict[str, type["BaseRunner"]]:
    """Import the modules of the family folders that register runners under `model_cls` `name`
    (every such module when None; each once; `runner_modules`); return the registry."""
    for module, names in runner_modules().items():
        if name is None or name in names:
            importlib.import_module(module)
    return RUNNERS


def tasks_of(name: str) -> list[str]:
    """Every task registered under `model_cls` `name`, in registration order."""
    load_families(name)
    return [t for (n, t) in TASK_RUNNERS if n == name]


def get_runner_cls(name: str, task: str | None = None) -> type["BaseRunner"]:
    """The runner class of `model_cls` `name` for `task` (None: the family's primary runner).

    Raises:
        ValueError: unknown name (listing the registered ones) or a task the family does not
            serve (listing its tasks).
    """
    runners = load_families(name)
    if name not in runners:
        raise ValueError(f"unknown `model_cls` {name!r}; registered: {sorted(load_families())}")
    if task is None:
        return runners[name]
    if (name, task) not in TASK_RUNNERS:
        raise ValueError(f"`task` {task!r} is not served by model_cls {name!r}; allowed: {tasks_of(name)}")
    return TASK_RUNNERS[(name, task)]
