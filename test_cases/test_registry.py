"""The registry finds every runner module of a family folder (issue 19, structure): a family may
split its runners over several modules without them importing each other."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from runnerkit import registry


@pytest.fixture
def fake_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A models package `fakemodels` with one family `fam` whose two runner modules do not import
    each other, and a helper module that registers nothing; the registry points at it."""
    family = tmp_path / "fakemodels" / "fam"
    family.mkdir(parents=True)
    (tmp_path / "fakemodels" / "__init__.py").write_text("")
    (family / "__init__.py").write_text("")
    runner = """
        from runnerkit.registry import register_runner

        @register_runner("fake")
        class {cls}:
            TASKS = ("{task}",)
    """
    (family / "runner.py").write_text(textwrap.dedent(runner.format(cls="FakeT2V", task="t2v")))
    (family / "edit.py").write_text(textwrap.dedent(runner.format(cls="FakeEdit", task="edit")))
    (family / "helpers.py").write_text("raise AssertionError('a module that registers nothing is not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "MODELS_PACKAGE", "fakemodels")
    registered = (dict(registry.RUNNERS), dict(registry.TASK_RUNNERS))
    registry.scan_families.cache_clear()
    yield "fakemodels.fam"
    registry.scan_families.cache_clear()
    for name in [m for m in sys.modules if m == "fakemodels" or m.startswith("fakemodels.")]:
        del sys.modules[name]
    registry.RUNNERS.clear(), registry.RUNNERS.update(registered[0])
    registry.TASK_RUNNERS.clear(), registry.TASK_RUNNERS.update(registered[1])


def test_every_module_of_a_family_folder_that_registers_a_runner_is_found(fake_models: str) -> None:
    assert registry.runner_modules() == {f"{fake_models}.edit": ("fake",), f"{fake_models}.runner": ("fake",)}
    assert registry.model_cls_names() == ["fake"]
    assert f"{fake_models}.runner" not in sys.modules  # read from the sources, nothing imported
    assert registry.get_runner_cls("fake", "edit").__name__ == "FakeEdit"
    assert registry.get_runner_cls("fake", "t2v").__name__ == "FakeT2V"
    assert registry.tasks_of("fake") == ["edit", "t2v"]  # module order: sorted names


def test_a_lookup_imports_only_the_modules_that_register_its_name(fake_models: str, tmp_path: Path) -> None:
    """Another family's runner module is not imported for this name (its imports, transformers for a
    text encoder, would be paid by every process of this family); an unknown name lists them all."""
    other = tmp_path / "fakemodels" / "other"
    other.mkdir()
    (other / "__init__.py").write_text("")
    (other / "runner.py").write_text(textwrap.dedent("""
        from runnerkit.registry import register_runner

        @register_runner("other")
        class OtherT2V:
            TASKS = ("t2v",)
    """))
    registry.scan_families.cache_clear()
    assert registry.get_runner_cls("fake", "t2v").__name__ == "FakeT2V"
    assert registry.tasks_of("fake") == ["edit", "t2v"]
    assert "fakemodels.other.runner" not in sys.modules
    with pytest.raises(ValueError, match=r"unknown `model_cls` 'nope'; registered: \[.*'fake', .*'other'"):
        registry.get_runner_cls("nope")
    assert registry.get_runner_cls("other").__name__ == "OtherT2V"


def _add_family(root: Path, family: str, source: str) -> Path:
    """`root/fakemodels/<family>/runner.py` holding `source` (dedented); the registry re-reads the folder."""
    folder = root / "fakemodels" / family
    folder.mkdir(exist_ok=True)
    (folder / "__init__.py").write_text("")
    (folder / "runner.py").write_text(textwrap.dedent(source).lstrip())
    registry.scan_families.cache_clear()
    return folder / "runner.py"


HEADER = "from runnerkit.registry import register_runner\n"
UNREADABLE = {  # source of the broken family's runner.py, the line reported, what it says after `path:line: `
    "syntax error": (HEADER + '\n@register_runner("broken")\nclass Broken:\n    TASKS = ("t2v",\n',
                     5, "cannot be parsed: "),  # the unclosed `(`
    "non-literal": (HEADER + 'NAME = "broken"\n\n\n@register_runner(NAME)\nclass Broken:\n    TASKS = ("t2v",)\n',
                    5, ("class Broken: `register_runner` takes the `model_cls` as a string literal (positional or "
                        "`name=`), got NAME (the registry reads it from the source)")),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_an_unreadable_module_is_one_line_naming_its_file_and_line_and_other_families_still_work(
        fake_models: str, tmp_path: Path, case: str) -> None:
    """A syntax error or a non-literal `model_cls` in one family's module: `--help`'s list (a warning
    naming the file) and the other families' lookups still work; a lookup that misses, or loading
    every family, names the file and line."""
    from loguru import logger
    source, line, what = UNREADABLE[case]
    path = _add_family(tmp_path, "broken", source)
    messages: list[str] = []
    sink = logger.add(messages.append, format="{message}", level="WARNING")
    try:
        assert registry.model_cls_names() == ["fake"]
    finally:
        logger.remove(sink)
    problem = f"{path}:{line}: {what}"
    assert [(m.startswith(problem), m.rstrip().endswith("(its runners are not registered)")) for m in messages] == [
        (True, True)]
    assert registry.get_runner_cls("fake", "t2v").__name__ == "FakeT2V"
    with pytest.raises(ValueError) as missed:
        registry.get_runner_cls("broken")
    assert str(missed.value).startswith(f"unknown `model_cls` 'broken'; registered: ['fake']; not read: {problem}")
    with pytest.raises(ValueError, match=f"family modules that cannot be read: {re.escape(problem)}"):
        registry.load_families()


def test_a_keyword_or_aliased_decorator_is_read(fake_models: str, tmp_path: Path) -> None:
    """`@register_runner(name="...")` and `from ... import register_runner as reg; @reg("...")`
    register what the source reading finds (a name missed by the reading could never be looked up)."""
    _add_family(tmp_path, "kw", """
        from runnerkit.registry import register_runner

        @register_runner(name="kw")
        class KwT2V:
            TASKS = ("t2v",)
    """)
    _add_family(tmp_path, "aliased", """
        from runnerkit.registry import register_runner as reg

        @reg("aliased")
        class AliasedT2V:
            TASKS = ("t2v",)
    """)
    assert registry.runner_modules() == {"fakemodels.aliased.runner": ("aliased",), f"{fake_models}.edit": ("fake",),
                                         f"{fake_models}.runner": ("fake",), "fakemodels.kw.runner": ("kw",)}
    assert registry.unreadable_modules() == []
    assert registry.get_runner_cls("kw", "t2v").__name__ == "KwT2V"
    assert registry.get_runner_cls("aliased", "t2v").__name__ == "AliasedT2V"


def test_a_typo_lists_the_registered_names_without_importing_a_family_that_fails_to_import(
        fake_models: str, tmp_path: Path) -> None:
    _add_family(tmp_path, "other", """
        import a_package_that_is_not_installed
        from runnerkit.registry import register_runner

        @register_runner("other")
        class OtherT2V:
            TASKS = ("t2v",)
    """)
    with pytest.raises(ValueError) as typo:
        registry.get_runner_cls("fak")
    assert str(typo.value) == "unknown `model_cls` 'fak'; registered: ['fake', 'other']"
    assert "fakemodels.other.runner" not in sys.modules


def test_a_duplicate_registration_names_both_classes_with_their_modules(fake_models: str, tmp_path: Path) -> None:
    (tmp_path / "fakemodels" / "fam" / "edit.py").write_text(textwrap.dedent("""
        from runnerkit.registry import register_runner

        @register_runner("fake")
        class FakeEdit:
            TASKS = ("t2v",)
    """))
    with pytest.raises(ValueError) as twice:
        registry.get_runner_cls("fake", "t2v")
    assert str(twice.value) == (f"model_cls 'fake' is already registered for task(s) ['t2v'] by "
                                f"{fake_models}.edit.FakeEdit; not again by {fake_models}.runner.FakeT2V")


def test_the_names_read_from_the_sources_are_the_registered_ones() -> None:
    """The package's own families: what `--help` lists without importing is what the import registers."""
    registry.load_families()
    by_module: dict[str, set[str]] = {}
    for (name, _task), cls in registry.TASK_RUNNERS.items():
        if not cls.__module__.startswith(registry.MODELS_PACKAGE + "."):
            continue  # a test's own runner (test_cases/runners/two_stage.py)
        by_module.setdefault(cls.__module__, set()).add(name)
    assert by_module == {module: set(found) for module, found in registry.runner_modules().items()}
    assert registry.model_cls_names() == sorted({n for names in by_module.values() for n in names})


def test_a_task_is_checked_from_the_sources_before_any_import(fake_models: str, tmp_path: Path) -> None:
    """`check_task` reads the registering classes' `TASKS` literals (the union over the family's modules) without
    importing them, as `get_runner_cls` words it; a class whose tasks are not a literal leaves its name unchecked."""
    registry.check_task("fake", "edit")
    registry.check_task("fake", None)
    with pytest.raises(ValueError,
                       match=r"^`task` 't2x' is not served by model_cls 'fake'; allowed: \['edit', 't2v'\]$"):
        registry.check_task("fake", "t2x")
    assert f"{fake_models}.runner" not in sys.modules
    _add_family(tmp_path, "computed", HEADER + '\n@register_runner("computed")\nclass C:\n    TASKS = tuple(["t2v"])\n')
    registry.check_task("computed", "anything")  # not a literal: `get_runner_cls` decides later
    with pytest.raises(ValueError, match=r"`task` 't2x' is not served by model_cls 'fake'"):
        registry.get_runner_cls("fake", "t2x")  # the same refusal once imported
