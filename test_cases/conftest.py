"""Shared fixtures: the tiny Wan config with a synthetic checkpoint written once per session."""

from __future__ import annotations

import fcntl
import gc
import itertools
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# Two pytest-xdist workers on a 2-core machine, each with PyTorch's default of one intra-op thread per
# core, oversubscribe the cores: OpenMP threads spin waiting for each other, and the measured Qwen-Image
# runner tests took 101 s instead of 28 s. Each worker (and every subprocess a test starts, through the
# environment) gets its share of the cores. Set before torch is imported; a value given by the caller wins.
# Inductor's C++ builds likewise: with one compile thread it builds in the compiling process instead of
# starting a pool of compile workers (each importing torch) that the other worker's core would run.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _share = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ.setdefault(_var, _share)

import torch  # noqa: E402

from runnerkit.config import RunnerConfig, load_runner_config  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "wan" / "wan_t2v_tiny.json"

# A shell that starts the suite in the background (`cmd &`) makes it ignore SIGINT, and an ignored
# signal stays ignored in every subprocess: the Ctrl-C tests would then see runs that never stop.
# A Python handler here is reset to the default at exec, so the subprocesses get Ctrl-C back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_GC_FREEZE, _GC_UNFREEZE, _GC_COLLECT = gc.freeze, gc.unfreeze, gc.collect  # the real ones: some tests replace
# gc.freeze / gc.collect to count calls


@pytest.fixture(autouse=True)
def _gc_walks_only_the_tests_objects() -> Iterator[None]:
    """Garbage collections during a test walk only the objects made since it started.

    A full collection walks every tracked object of the process: this one holds torch, dynamo,
    inductor, transformers, pytest and what earlier tests left (over a million objects, ~0.3 s a
    walk and growing through the session), and the code under test collects often (lazy_load at
    every per-stage drop of the transformer, `freeze_gc_once` after a warmup, tests before weakref
    checks), besides Python's own full collections. Objects older than the test are parked in the
    permanent generation (`gc.freeze`) while it runs and put back after it (`gc.unfreeze`), where
    the next collections see them again. Everything the test makes is collected as before, and its
    garbage once more at its end, before the unfreeze (a walk of the test's own objects only): the
    next test's freeze would otherwise park it, and the next, so that cyclic garbage (a runner, its
    tensors) would outlive its test by many. A freeze the code under test makes (`freeze_gc_once`
    unpatched) is undone with it at the end, so no test inherits another's."""
    _GC_FREEZE()
    try:
        yield
    finally:
        _GC_COLLECT()
        _GC_UNFREEZE()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic checkpoints without a model_path go to a per-session temp cache, never ~/.cache."""
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path_factory.getbasetemp() / "rk_cache"))


_TEST_NUMBER = itertools.count()


@pytest.fixture(autouse=True)
def _isolated_compiler(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test compiles into caches of its own and leaves torch's compiler as it found it
    (`isolated_compiler`); its folder is under the session's temp folder, created only if
    something compiles."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:60]
    with isolated_compiler(tmp_path_factory.getbasetemp() / "torch_caches" / f"{next(_TEST_NUMBER):05d}_{name}"):
        yield


@contextmanager
def isolated_compiler(folder: Path) -> Iterator[None]:
    """torch's compiler state private to the block, restored after it:

    - `TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR` point into `folder` (subprocesses inherit
      them), and inductor's in-process caches are emptied first, as `torch._inductor.utils.
      fresh_cache` does: torch memoises its local cache path (`get_local_cache_path`) and every C++
      library it built, so a new `TORCHINDUCTOR_CACHE_DIR` alone would still reuse an earlier test's.
    - inductor's and dynamo's configs are restored after the block, key by key.
    - the vector ISA inductor picks is read again: torch memoises `valid_vec_isa_list()`, and the
      AVX-512 and AMX classes their `__bool__`, at the first use under the `cpp.vec_isa_ok` of that
      moment, so a test's scalar C++ (`cpp.vec_isa_ok=False`) made later tests' AVX-512 unusable,
      and a vectorised compile made a later test's `cpp.vec_isa_ok=False` vectorised all the same.
    - torch's portable-cache recorder (`torch.compiler.save_cache_artifacts`) is emptied: it holds
      every artifact the process compiled, so a compile-cache entry would carry earlier tests' graphs.
    - the default dtype is restored.
    """
    import torch._dynamo.config
    import torch._inductor.config

    env = {key: os.environ.get(key) for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    _reset_compiler_caches()
    configs = [torch._dynamo.config, torch._inductor.config]
    saved = [cfg.get_config_copy() for cfg in configs]
    dtype = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        for cfg, before in zip(configs, saved):
            for key, value in cfg.get_config_copy().items():
                if key in before and value is not before[key] and value != before[key]:
                    setattr(cfg, key, before[key])
        _reset_compiler_caches()
        for key, value in env.items():  # torch writes TORCHINDUCTOR_CACHE_DIR back when it reads it
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _reset_compiler_caches() -> None:
    """Inductor's in-process caches emptied, where inductor was imported (nothing to do otherwise)."""
    if "torch._inductor.utils" in sys.modules:
        sys.modules["torch._inductor.utils"].clear_caches()
    if "torch._inductor.cpu_vec_isa" in sys.modules:  # the ISA list, and the AVX-512/AMX checks memoised
        isa = sys.modules["torch._inductor.cpu_vec_isa"]  # per instance whatever `cpp.vec_isa_ok` says
        isa.valid_vec_isa_list.cache_clear()
        for cls in vars(isa).values():
            if isinstance(cls, type) and hasattr(cls.__dict__.get("__bool__"), "cache_clear"):
                cls.__dict__["__bool__"].cache_clear()
    if "torch.compiler._cache" in sys.modules:
        sys.modules["torch.compiler._cache"].CacheArtifactManager.clear()


@pytest.fixture(autouse=True)
def _loguru_sinks_restored() -> Iterator[None]:
    with restored_loguru_sinks():
        yield


@contextmanager
def restored_loguru_sinks() -> Iterator[None]:
    """Loguru sinks the block (a test, or the code it calls: the launch script's `main` replaces the
    sinks with one on the `sys.stderr` of that moment, pytest's capture of that test) adds or
    removes are undone after it. A sink left on a closed capture stream made every later log line
    print 'I/O operation on closed file'. loguru has no public list of its sinks: their ids are read
    from its core. After a change, the one sink left writes to `sys.stderr` as it is at each line."""
    from loguru import logger

    before = set(logger._core.handlers)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if set(logger._core.handlers) != before:  # type: ignore[attr-defined]
            logger.remove()
            logger.add(lambda message: sys.stderr.write(message), level="DEBUG")


def built_once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that `build(folder)` fills once per pytest run, shared by the xdist workers.

    For the costly results a module's tests only read (subprocess runs, a first compile): with
    `--dist worksteal` a worker that steals tests of such a module would otherwise build its module
    fixture a second time. The first worker to get here builds the folder under the run's temp root
    (the parent of every worker's basetemp) holding an exclusive lock; the other waits on the lock
    and reads it (it would have spent the same time building). A folder without its completion mark
    (a build that raised) is built again, so the failure shows in each worker's tests. Without xdist,
    the folder is the session's own (nothing to share). The tests must not write into the folder:
    they copy what they change."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent / "built_once"
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic checkpoint (runnerkit layout, float32) of the tiny config's architecture."""
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import write_synthetic

    data = json.loads(TINY_CONFIG.read_text())
    path = tmp_path_factory.mktemp("ckpt") / "wan_tiny"
    write_synthetic(WanArch.model_validate(data["model"]), path, seed=0, dtype=torch.float32)
    return path


def tiny_config_dict(ckpt: Path, **overrides: Any) -> dict[str, Any]:
    """The tiny JSON config pointing at `ckpt` (no synthetic writing), with overrides, on the CPU."""
    return config_dict(TINY_CONFIG, ckpt, **overrides)


def config_dict(config: Path, ckpt: Path, **overrides: Any) -> dict[str, Any]:
    """The JSON config `config` pointing at `ckpt` (no synthetic writing), with overrides (dicts
    merged one level deep), on the CPU."""
    data = json.loads(config.read_text())
    data.pop("synthetic_checkpoint")
    data.update(model_path=str(ckpt), device="cpu")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


@pytest.fixture
def tiny_config(tiny_ckpt: Path) -> RunnerConfig:
    return load_runner_config(None, tiny_config_dict(tiny_ckpt))


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def fresh_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's compile caches and runnerkit's compiled block forwards emptied (compilation counts
    start from zero), and no real gc freeze (tests build many runners in one process)."""
    import gc

    from runnerkit import compile as regional_compile
    from runnerkit import memory

    torch._dynamo.reset()
    regional_compile._COMPILED.clear()
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)

