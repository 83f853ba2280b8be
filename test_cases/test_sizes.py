"""Size limits of the package (structure): no file in runnerkit/ above `MAX_FILE_LINES` lines, no
function above `MAX_FUNCTION_LINES` lines, and the default runner (the request path and the hooks a
family overrides) within `DEFAULT_RUNNER_LINES`.

A file's lines are its `str.splitlines()`; a function's run from its `def` line to its last line
(decorators not counted), nested functions and methods counted on their own as well. Everything is
parsed with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import runnerkit

PACKAGE_DIR = Path(runnerkit.__file__).parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
DEFAULT_RUNNER_LINES = 400

# Entries allowed over the limits: an entry that no longer exceeds a limit fails the test, so the list only
# shrinks.
ALLOWED_OVER: frozenset[str] = frozenset()


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in `tree`, nested ones included."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None, name
                found.append((name, node.end_lineno - node.lineno + 1))
            found += _functions(node, f"{name}.")
        else:
            found += _functions(node, prefix)
    return found


def oversized(root: Path) -> dict[str, int]:
    """Every file of the package at `root` over `MAX_FILE_LINES` ("runnerkit/x.py": lines) and every
    function over `MAX_FUNCTION_LINES` ("runnerkit/x.py::Class.method": lines); keys relative to
    `root`'s parent, with forward slashes."""
    over: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        key = path.relative_to(root.parent).as_posix()
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_FILE_LINES:
            over[key] = len(text.splitlines())
        for name, lines in _functions(ast.parse(text, filename=str(path))):
            if lines > MAX_FUNCTION_LINES:
                over[f"{key}::{name}"] = lines
    return over


def test_the_size_check_flags_files_and_functions_past_the_limits_only(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "at_limit.py").write_text("x = 1\n" * MAX_FILE_LINES)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))

    def body(indent: int, lines: int) -> str:
        return (" " * indent + "x = 1\n") * lines

    (pkg / "funcs.py").write_text(
        "def fits():\n" + body(4, MAX_FUNCTION_LINES - 1)  # 80 lines with its def
        + "class C:\n"
        + "    @staticmethod\n"  # decorators do not count
        + "    def method():\n" + body(8, MAX_FUNCTION_LINES)  # 81
        + "async def outer():\n"
        + "    def inner():\n" + body(8, MAX_FUNCTION_LINES - 1)  # inner: 80, outer: 81
    )
    assert oversized(pkg) == {
        "pkg/sub/long.py": MAX_FILE_LINES + 1,
        "pkg/funcs.py::C.method": MAX_FUNCTION_LINES + 1,
        "pkg/funcs.py::outer": MAX_FUNCTION_LINES + 1,
    }


def test_no_file_or_function_of_runnerkit_exceeds_the_size_limits() -> None:
    over = oversized(PACKAGE_DIR)
    new = {k: n for k, n in over.items() if k not in ALLOWED_OVER}
    assert not new, (f"over the size limits ({MAX_FILE_LINES} lines a file, {MAX_FUNCTION_LINES} a function): "
                     + ", ".join(f"{k} ({n} lines)" for k, n in sorted(new.items()))
                     + "; split them (a file: move a self-contained part to a module of its own; a function: "
                     "named steps)")
    stale = sorted(ALLOWED_OVER - set(over))
    assert not stale, f"ALLOWED_OVER lists entries within the limits now: {stale}; remove them"


def test_the_default_runner_holds_the_request_path_and_hook_declarations_only() -> None:
    """What is not the request path or a hook declaration lives in a module or object of its own
    (warmup, memory checks, loading, adapters, parallelism, writes): the file stays small."""
    lines = len((PACKAGE_DIR / "runners" / "default.py").read_text().splitlines())
    assert lines <= DEFAULT_RUNNER_LINES, f"runners/default.py has {lines} lines (at most {DEFAULT_RUNNER_LINES})"
