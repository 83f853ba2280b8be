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
def scan_families() -> tuple[dict[str, tuple[str, ...]], dict[str, str], dict[str, frozenset[str] | None]]:
    """Read every module of every family folder under runnerkit/models/ whose source names
    `register_runner` (with `ast`: nothing is imported, torch included, so the launch script can
    list the names before it parses its arguments).

    Returns:
        (module -> the `model_cls` names it registers, sorted by module; module -> one line
        `path:line: what is wrong` for each module that cannot be read: a syntax error, or a
        `register_runner` whose `model_cls` is not a string literal; `model_cls` -> the tasks its
        registering classes list as a `TASKS` literal in their own body, None where one does not). An
        unreadable module is left out of the names and logged as a warning here; a lookup that misses reports it
        (`get_runner_cls`), so the other families still run and `--help` still lists them.
    """
    package = importlib.import_module(MODELS_PACKAGE)  # runnerkit/models/__init__.py: no imports
    found: dict[str, tuple[str, ...]] = {}
    unreadable: dict[str, str] = {}
    tasks: dict[str, frozenset[str] | None] = {}
    for family in pkgutil.iter_modules(package.__path__):
        if not family.ispkg:
            continue
        folder = Path(family.module_finder.path) / family.name  # type: ignore[union-attr]
        for info in pkgutil.iter_modules([str(folder)]):
            source = folder / f"{info.name}.py"
            if info.ispkg or not source.is_file():
                continue
            module = f"{MODELS_PACKAGE}.{family.name}.{info.name}"
            try:
                text = source.read_text(encoding="utf-8")
                if "register_runner" not in text:  # no decorator can name it: skip the parse (most modules)
                    continue
                registrations = _registrations(ast.parse(text, filename=str(source)))
            except _NotLiteral as exc:
                unreadable[module] = f"{_shown(source)}:{exc.lineno}: {exc}"
            except (SyntaxError, ValueError) as exc:  # ValueError: undecodable bytes, a null byte
                line = getattr(exc, "lineno", None) or 1
                unreadable[module] = f"{_shown(source)}:{line}: cannot be parsed: {getattr(exc, 'msg', exc)}"
            else:
                if registrations:
                    found[module] = tuple(name for name, _ in registrations)
                for name, listed in registrations:
                    known = tasks.get(name, frozenset())
                    tasks[name] = None if known is None or listed is None else known | listed
    if unreadable:
        from loguru import logger
        for problem in unreadable.values():
            logger.warning(f"{problem} (its runners are not registered)")
    return dict(sorted(found.items())), dict(sorted(unreadable.items())), tasks


def runner_modules() -> dict[str, tuple[str, ...]]:
    """Module -> the `model_cls` names it registers, for every readable module of every family
    folder that registers a runner, sorted by module name (`scan_families`)."""
    return scan_families()[0]


def unreadable_modules() -> list[str]:
    """One line `path:line: what is wrong` per family module that cannot be read (`scan_families`)."""
    return list(scan_families()[1].values())


class _NotLiteral(TypeError):
    def __init__(self, message: str, lineno: int) -> None:
        super().__init__(message)
        self.lineno = lineno


def _shown(source: Path) -> str:
    """`source` relative to the working directory when under it (runnerkit/models/<family>/runner.py)."""
    try:
        return str(source.relative_to(Path.cwd()))
    except ValueError:
        return str(source)


def _listed_tasks(node: ast.ClassDef) -> frozenset[str] | None:
    """The class body's own `TASKS = (...)` of string literals; None if it has none (inherited, computed)."""
    for stmt in node.body:
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        else:
            targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "TASKS" for t in targets):
            value = stmt.value
            if isinstance(value, (ast.Tuple, ast.List)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
                return frozenset(e.value for e in value.elts)
            return None
    return None


def _registrations(tree: ast.Module) -> tuple[tuple[str, frozenset[str] | None], ...]:
    """The `model_cls` names of the `@register_runner("name")` class decorators in a module, in order, each with
    the tasks its class lists (`_listed_tasks`).

    The decorator is recognised as `register_runner`, `<module>.register_runner`, or the `as` name
    of a `from ... import register_runner as <alias>`; its `model_cls` is the first positional
    argument or the `name=` keyword, a string literal.

    Raises:
        _NotLiteral: a recognised decorator whose `model_cls` is not a string literal (with its line).
    """
    aliases = {"register_runner"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                                     for a in node.names if a.name == "register_runner" and a.asname}
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for deco in node.decorator_list:
            func = deco.func if isinstance(deco, ast.Call) else None
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called == "register_runner" or (isinstance(func, ast.Name) and called in aliases):
                assert isinstance(deco, ast.Call)
                keyword = [k.value for k in deco.keywords if k.arg == "name"]
                arg = deco.args[0] if deco.args else keyword[0] if keyword else None
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    got = ast.unparse(arg) if arg is not None else "no `model_cls`"
                    raise _NotLiteral(f"class {node.name}: `register_runner` takes the `model_cls` as a string "
                                      f"literal (positional or `name=`), got {got} (the registry reads it from "
                                      "the source)", deco.lineno)
                names.append((arg.value, _listed_tasks(node)))
    return tuple(names)


def family_modules() -> list[str]:
    """Every readable module of the family folders that registers runners, sorted (`runner_modules`)."""
    return list(runner_modules())


def model_cls_names() -> list[str]:
    """Every registered `model_cls`, sorted, without importing any family (`runner_modules`; an
    unreadable module is left out, with a warning)."""
    return sorted({name for names in runner_modules().values() for name in names})


def check_task(name: str, task: str | None) -> None:
    """Refuse a `task` that the classes registering `model_cls` `name` do not list, read from the family sources
    (`scan_families`) without importing any family, and the tasks of classes already registered: what a server
    checks before it opens its port. Nothing is refused where a class registering `name` in the sources lists its
    tasks otherwise than as a literal, or where no source registers it (`get_runner_cls` decides then).

    Raises:
        ValueError: naming the task, the `model_cls` and the tasks allowed (as `get_runner_cls`).
    """
    listed = scan_families()[2].get(name)
    if task is None or listed is None:
        return
    allowed = listed | {t for (n, t) in TASK_RUNNERS if n == name}  # no import (`tasks_of` would import)
    if task not in allowed:
        raise ValueError(f"`task` {task!r} is not served by model_cls {name!r}; allowed: {sorted(allowed)}")


def check_model_cls(name: str) -> None:
    """Refuse a `model_cls` that no family source registers (`model_cls_names`) and no imported class has
    registered, without importing any family: what a server checks before it opens its port.

    Raises:
        ValueError: naming the value, the registered names and the family modules that cannot be read.
    """
    if name not in RUNNERS and name not in model_cls_names():  # RUNNERS: also classes registered at run time
        unread = "".join(f"; not read: {problem}" for problem in unreadable_modules())
        raise ValueError(f"unknown `model_cls` {name!r}; registered: {model_cls_names()}{unread}")


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
            first = TASK_RUNNERS[(name, taken[0])]
            raise ValueError(f"model_cls {name!r} is already registered for task(s) {taken} by "
                             f"{first.__module__}.{first.__qualname__}; not again by "
                             f"{cls.__module__}.{cls.__qualname__}")
        RUNNERS.setdefault(name, cls)
        TASK_RUNNERS.update({(name, t): cls for t in tasks})
        return cls

    return wrap


def load_families(name: str | None = None) -> dict[str, type["BaseRunner"]]:
    """Import the modules of the family folders that register runners under `model_cls` `name`
    (every such module when None; each once; `runner_modules`); return the registry.

    Raises:
        ValueError: `name` is None and a family module cannot be read (one line per module,
            `path:line: what is wrong`).
    """
    for module, names in runner_modules().items():
        if name is None or name in names:
            importlib.import_module(module)
    if name is None and unreadable_modules():
        raise ValueError("family modules that cannot be read: " + "; ".join(unreadable_modules()))
    return RUNNERS


def tasks_of(name: str) -> list[str]:
    """Every task registered under `model_cls` `name`, in registration order."""
    load_families(name)
    return [t for (n, t) in TASK_RUNNERS if n == name]


def get_runner_cls(name: str, task: str | None = None) -> type["BaseRunner"]:
    """The runner class of `model_cls` `name` for `task` (None: the family's primary runner).

    Raises:
        ValueError: unknown name (listing the registered ones, read from the sources: no other
            family is imported) or a task the family does not serve (listing its tasks); either
            also names the family modules that cannot be read (`path:line: what is wrong`).
    """
    check_model_cls(name)
    runners = load_families(name)
    unread = "".join(f"; not read: {problem}" for problem in unreadable_modules())
    if name not in runners:  # the source registers it, its import did not
        sources = [m for m, names in runner_modules().items() if name in names]
        raise ValueError(f"`model_cls` {name!r} is registered in {sources} but importing it did not register it"
                         f"{unread}")
    if task is None:
        return runners[name]
    if (name, task) not in TASK_RUNNERS:
        raise ValueError(f"`task` {task!r} is not served by model_cls {name!r}; allowed: {tasks_of(name)}{unread}")
    return TASK_RUNNERS[(name, task)]
