"""The package's import graph has no cycle, and no family imports another (structure).

Every module under runnerkit/ is parsed with `ast` (nothing is imported), and each import of a
runnerkit module becomes an edge: module-level and function-level imports alike (a function-level
import is still a dependency: the launch script and the server took names from each other that
way), absolute and relative. Left out: imports under `if TYPE_CHECKING:` (never run) and the
implicit import of a parent package (`runnerkit.offload/__init__` re-exports its children, which
Python runs first without a cycle). The family check counts `if TYPE_CHECKING:` imports too: a
family that names another's types still depends on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import runnerkit

PACKAGE_DIR = Path(runnerkit.__file__).parent


def package_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the package."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree` that can run (any depth; `if TYPE_CHECKING:` bodies skipped
    unless `type_checking`)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """runnerkit module -> the runnerkit modules it imports (also under `if TYPE_CHECKING:` when
    `type_checking`)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if node.level:  # relative: from the module's package, `level` - 1 packages up
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in modules else source)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One import cycle as [a, b, ..., a] among the nodes `within` (default: all), or None
    (depth-first search in sorted order, for a stable answer)."""
    nodes = set(graph) if within is None else within
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, set()) & nodes):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (each strongly connected component
    of more than one module), so every circle is reported at once."""
    reach = {n: _reachable(graph, n) for n in graph}
    groups: list[set[str]] = []
    for node in sorted(graph):
        group = {m for m in reach[node] if node in reach[m]}
        if len(group) > 1 and group not in groups:
            groups.append(group)
    return [cycle for group in groups if (cycle := find_cycle(graph, group)) is not None]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def family_of(module: str) -> str | None:
    """The family folder a module belongs to (`runnerkit.models.<family>...`), or None for the core."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["runnerkit", "models"] else None


def cross_family_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge `a -> b` where `a` and `b` belong to different families, sorted."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if family_of(a) and family_of(b) and family_of(a) != family_of(b))


def test_the_package_imports_form_no_cycle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_graph_sees_function_level_relative_and_from_imports() -> None:
    """The walker itself: the edges a cycle could hide in are found (known imports of the package)."""
    graph = import_graph()
    assert "runnerkit.serve.server" in graph["runnerkit.infer"]  # function-level (in `main`)
    assert "runnerkit.models.wan.text_encoder" in graph["runnerkit.models.wan.runner"]  # `from pkg import module`
    assert "runnerkit.offload.disk" in graph["runnerkit.offload"]  # package __init__
    assert "runnerkit.runners.base" not in graph["runnerkit.registry"]  # only under `if TYPE_CHECKING:`


def test_find_cycle_names_the_modules_of_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set()}
    assert find_cycle(graph) == ["b", "c", "b"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}}
    assert find_cycles(two) == [["a", "b", "a"], ["c", "d", "e", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_family_imports_another_family() -> None:
    """Families share through the core (runnerkit/arch.py, rope.py, nets/, ...), never with each other."""
    graph = import_graph(type_checking=True)
    assert {family_of(m) for m in graph} >= {None, "wan", "qwen_image", "ltx2"}  # the scan sees every family
    offenders = cross_family_imports(graph)
    assert offenders == [], "a family imports another family's module:\n" + "\n".join(offenders)


def test_cross_family_imports_names_each_offending_edge() -> None:
    graph = {"runnerkit.models.x.runner": {"runnerkit.models.y.vae", "runnerkit.models.x.arch", "runnerkit.arch"},
             "runnerkit.models.y.vae": {"runnerkit.nets.causal_vae3d"}, "runnerkit.models.x.arch": set(),
             "runnerkit.registry": {"runnerkit.models.x.runner"}, "runnerkit.models": set()}
    assert cross_family_imports(graph) == ["runnerkit.models.x.runner -> runnerkit.models.y.vae"]
    assert family_of("runnerkit.models") is None and family_of("runnerkit.models.x") == "x"
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runnerkit.models.y import vae\n")
    assert [len(_imports(typed, type_checking=t)) for t in (False, True)] == [1, 2]  # the family check sees it
