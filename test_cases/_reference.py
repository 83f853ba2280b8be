"""Import a reference package for parity tests.

With RUNNERKIT_REQUIRE_REFERENCE=1 (set by .ci/run) a missing reference package is an error,
so parity can never be skipped silently in CI; otherwise the test module is skipped.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_reference(name: str) -> ModuleType:
    """Return the imported module `name`, or skip/fail the calling test module if it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("RUNNERKIT_REQUIRE_REFERENCE") == "1":
            raise ImportError(
                f"reference package {name!r} is required for parity tests (RUNNERKIT_REQUIRE_REFERENCE=1): {exc}"
            ) from exc
        pytest.skip(f"reference package {name!r} not installed", allow_module_level=True)
        raise  # unreachable; pytest.skip raises
