"""The registry finds every runner module of a family folder (issue 19, structure): a family may
split its runners over several modules without them importing each other."""

from __future__ import annotations

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
    registry.runner_modules.cache_clear()
    yield "fakemodels.fam"
    registry.runner_modules.cache_clear()
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
    registry.runner_modules.cache_clear()
    assert registry.get_runner_cls("fake", "t2v").__name__ == "FakeT2V"
    assert registry.tasks_of("fake") == ["edit", "t2v"]
    assert "fakemodels.other.runner" not in sys.modules
    with pytest.raises(ValueError, match=r"unknown `model_cls` 'nope'; registered: \[.*'fake', .*'other'"):
        registry.get_runner_cls("nope")
    assert registry.get_runner_cls("other").__name__ == "OtherT2V"


def test_a_model_cls_that_is_not_a_string_literal_is_refused_naming_the_class(fake_models: str, tmp_path: Path) -> None:
    (tmp_path / "fakemodels" / "fam" / "edit.py").write_text(textwrap.dedent("""
        from runnerkit.registry import register_runner
        NAME = "fake"

        @register_runner(NAME)
        class FakeEdit:
            TASKS = ("edit",)
    """))
    with pytest.raises(TypeError, match="class FakeEdit: `register_runner` takes the `model_cls` as a string literal"):
        registry.runner_modules()


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
