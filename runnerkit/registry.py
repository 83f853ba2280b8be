"""Runner registry: `model_cls` name -> runner class, an explicit dict filled by a decorator."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from runnerkit.runners.base import BaseRunner

R = TypeVar("R", bound="type[BaseRunner]")

RUNNERS: dict[str, type["BaseRunner"]] = {}

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
    """Class decorator: register a runner under `name` (the config's `model_cls`).

    Raises:
        ValueError: if `name` is already registered.
    """

    def wrap(cls: R) -> R:
        if name in RUNNERS:
            raise ValueError(f"model_cls {name!r} is already registered by {RUNNERS[name].__qualname__}")
        RUNNERS[name] = cls
        return cls

    return wrap


def load_families() -> dict[str, type["BaseRunner"]]:
    """Import every family package once so their runners are registered; return the registry."""
    for module in family_modules():
        importlib.import_module(module)
    return RUNNERS


def get_runner_cls(name: str) -> type["BaseRunner"]:
    """Look up a runner class by `model_cls`.

    Raises:
        ValueError: unknown name, listing the registered ones.
    """
    runners = load_families()
    if name not in runners:
        raise ValueError(f"unknown `model_cls` {name!r}; registered: {sorted(runners)}")
    return runners[name]
