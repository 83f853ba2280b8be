"""Warmup of the Wan2.1 text-to-video runner (ARCHITECTURE §3), on the tiny CPU config."""

from __future__ import annotations

import ast
import gc
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from runnerkit import media, memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.runners.base import LifecycleError, error_phase
from runnerkit.schedulers import SCHEDULERS
from test_cases.conftest import tiny_config_dict

REPO = Path(__file__).resolve().parents[3]


def make_runner(ckpt: Path, cls: type[WanT2VRunner] = WanT2VRunner, **overrides: Any) -> WanT2VRunner:
    return cls(load_runner_config(None, tiny_config_dict(ckpt, **overrides)))


def scheduler_state(sched: Any) -> dict[str, Any]:
    """The scheduler's attributes, tensors turned into comparable tuples."""
    out = {}
    for k, v in vars(sched).items():
        out[k] = ("tensor", tuple(v.shape), v.dtype, v.flatten().tolist()) if isinstance(v, torch.Tensor) else v
    return out


def assert_start_up_baseline(runner: WanT2VRunner) -> None:
    fresh = SCHEDULERS[runner.config.scheduler](shift=runner.config.sample_shift,
                                                spacing=runner.config.scheduler_spacing)
    assert scheduler_state(runner.scheduler) == scheduler_state(fresh)
    assert runner.scheduler.generator is None
    assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys()
    assert runner.transformer._rope_cache == {}
    assert runner.vae.feature_cache is None


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count gc.freeze calls without freezing the test process; reset the once-flag."""
    calls: list[int] = []
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append(1))
    return calls


# ---- gates (the ones every family has: test_offload.py::TestFamilyContract) ---------------------
class NoTaskVariant(WanT2VRunner):
    WARMUP_TASKS = ("i2v",)
    WARMUP_OFFLOAD_MODES = ("none",)
    WARMUP_SHAPES = WanT2VRunner.WARMUP_SHAPES


@pytest.mark.parametrize(
    ("cls", "overrides", "reason"),
    [
        (NoTaskVariant, {}, r"does not cover task 't2v'"),
        (WanT2VRunner, {"model": {"transformer": {"dim": 32}}}, r"no shapes for this checkpoint's flavour None"),
    ],
)
def test_gates_refuse_before_anything_runs(tiny_ckpt: Path, tmp_path: Path, mocker: Any, cls: type, overrides: dict,
                                           reason: str) -> None:
    ckpt = tiny_ckpt
    if "model" in overrides:  # a checkpoint whose own config says that architecture (a `model` must agree with it)
        ckpt = tmp_path / "ckpt"
        shutil.copytree(tiny_ckpt, ckpt)
        meta = json.loads((ckpt / "runnerkit.json").read_text())
        meta["arch"]["transformer"].update(overrides["model"]["transformer"])
        (ckpt / "runnerkit.json").write_text(json.dumps(meta))
    runner = make_runner(ckpt, cls, warmup=True, **overrides)
    load = mocker.spy(cls, "load_modules")
    run_warmup = mocker.spy(cls, "run_warmup")
    with pytest.raises(NotImplementedError, match=reason) as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "warmup"  # the warmup gate, checked before loading (no device work)
    assert load.call_count == 0 and run_warmup.call_count == 0
    assert runner.transformer is None


def test_warmup_cannot_be_called_directly(tiny_ckpt: Path, mocker: Any) -> None:
    runner = make_runner(tiny_ckpt, warmup=True)
    spy = mocker.spy(WanT2VRunner, "run_warmup")
    with pytest.raises(LifecycleError, match="only inside init_modules"):
        runner.warmup()  # before init_modules
    runner.init_modules()
    assert spy.call_count == 1
    with pytest.raises(LifecycleError, match="only inside init_modules"):
        runner.warmup()  # after: warmup runs at most once
    assert spy.call_count == 1


def test_shape_table_is_class_constant_and_covers_shipped_configs() -> None:
    import json

    table = WanT2VRunner.__dict__["WARMUP_SHAPES"]
    for flavour, shapes in table.items():
        assert len(shapes) == 2, flavour
        (h0, w0, _), (h1, w1, _) = shapes
        assert h0 == w0, f"{flavour}: first shape must be square"
        assert h1 != w1, f"{flavour}: second shape must be non-square"
        for h, w, f in shapes:
            WanT2VRunner.validate_shape(h, w, f)
    assert (480, 832, 81) in table["1.3B"]
    shipped = {"wan_t2v_tiny.json": "debug", "wan_t2v_1.3b.json": "1.3B", "wan_t2v_14b.json": "14B"}
    for name, flavour in shipped.items():
        cfg = json.loads((REPO / "configs" / "wan" / name).read_text())
        assert (cfg["target_height"], cfg["target_width"], cfg["target_video_length"]) in table[flavour], name


# ---- the real path, in order ----------------------------------------------------------------
def test_warmup_drives_real_path_in_order(tiny_ckpt: Path, mocker: Any) -> None:
    runner = make_runner(tiny_ckpt, warmup=True)
    calls: list[str] = []
    orig_load = runner.load_modules

    def load_and_instrument() -> None:
        orig_load()
        sched, model = runner.scheduler, runner.transformer
        for name, obj, attr in [("prepare", sched, "prepare"), ("step_pre", sched, "step_pre"),
                                ("step_post", sched, "step_post"), ("decode", runner.vae, "decode_iter")]:
            real = getattr(obj, attr)

            def wrapper(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
                calls.append(_name)
                return _real(*a, **k)

            setattr(obj, attr, wrapper)
        model.register_forward_pre_hook(lambda m, args: calls.append(f"infer{tuple(args[0].shape[2:])}"))

    runner.load_modules = load_and_instrument  # type: ignore[method-assign]
    run_pipeline = mocker.spy(WanT2VRunner, "run_pipeline")
    save = mocker.spy(WanT2VRunner, "save_outputs")
    real_encode = runner.run_text_encoder

    def counting_encode(*a: Any, **k: Any) -> Any:
        calls.append("encode")
        return real_encode(*a, **k)

    runner.run_text_encoder = counting_encode  # type: ignore[method-assign]
    real_writers = media.warm_writers

    def counting_writers(specs: Any) -> list[str]:
        calls.append(f"writers{tuple(s.kind for s in specs)}")
        return real_writers(specs)

    mocker.patch.object(media, "warm_writers", counting_writers)
    runner.init_modules()

    (h0, w0, f0), (h1, w1, f1) = WanT2VRunner.WARMUP_SHAPES["debug"]
    g0 = ((f0 - 1) // 4 + 1, h0 // 16, w0 // 16)
    g1 = ((f1 - 1) // 4 + 1, h1 // 16, w1 // 16)
    # latent grid seen by the model: [F', H/8, W/8] -> infer hook shows latent [F', H/8, W/8]
    l0 = (g0[0], h0 // 8, w0 // 8)
    l1 = (g1[0], h1 // 8, w1 // 8)
    per_shape = lambda lat: ["prepare", "step_pre", f"infer{lat}", f"infer{lat}", "step_post", "decode"]  # noqa: E731
    # text encoded once, cond + uncond each shape, then the media writers once (the first request's save stage)
    assert calls == ["encode", *per_shape(l0), *per_shape(l1), "writers('video',)"]
    assert run_pipeline.call_count == 0 and save.call_count == 0
    assert runner.profiler.warmup["shapes"] == [[h0, w0, f0], [h1, w1, f1]]
    assert runner.profiler.warmup["steps_per_shape"] == {"transformer": [0]}
    assert set(runner.profiler.warmup) == {"seconds", "shapes", "steps_per_shape", "compilations", "compile_seconds",
                                          "compile_cache_hits", "compile_cache_misses", "memory_before", "memory_after"}


def test_decoder_iterator_is_consumed_fully(tiny_ckpt: Path) -> None:
    runner = make_runner(tiny_ckpt, warmup=True)
    consumed: list[int] = []

    class Chunks:
        def __init__(self, video: torch.Tensor) -> None:
            self.video = video

        def __iter__(self) -> Any:
            for i in range(self.video.shape[2]):
                consumed.append(i)
                yield self.video[:, :, i : i + 1]
            consumed.append(-1)  # reached only if the iterator is exhausted

    real = WanT2VRunner.run_vae_decoder
    # the real decoder yields chunks too: wrap their concatenation
    runner.run_vae_decoder = lambda req, latents: Chunks(torch.cat(list(real(runner, req, latents)), dim=2))  # type: ignore[method-assign]
    runner.init_modules()
    assert consumed.count(-1) == 2  # both shapes' decoders ran to the end


def test_state_after_warmup_is_start_up_baseline(tiny_ckpt: Path, _no_real_gc_freeze: list[int]) -> None:
    runner = make_runner(tiny_ckpt, warmup=True)
    runner.init_modules()
    assert_start_up_baseline(runner)
    assert _no_real_gc_freeze == [1]  # eager path: frozen once


@pytest.mark.parametrize(("overrides", "freezes"), [
    ({"warmup": True}, [1]),
    ({"warmup": True, "offload": {"mode": "block", "storage": "disk", "lazy_load": True}}, []),
    ({}, []),
], ids=["warmup", "warmup-lazy_load", "no-warmup"])
def test_gc_is_frozen_once_after_an_eager_warmup_and_never_otherwise(
        tiny_ckpt: Path, tmp_path: Path, _no_real_gc_freeze: list[int], overrides: dict[str, Any],
        freezes: list[int]) -> None:
    """gc.freeze (counted at the gc module itself, the once-flag reset) runs exactly once, after an
    eager warmup; never under lazy load (the transformer is rebuilt per request: freezing would pin
    every request's garbage), never without warmup, and never during a request."""
    runner = make_runner(tiny_ckpt, **overrides)
    runner.init_modules()
    assert _no_real_gc_freeze == freezes
    _video(runner, _request(1, target_height=32, target_width=32, target_video_length=5), tmp_path, "a")
    assert _no_real_gc_freeze == freezes


def test_exception_in_decoder_leaves_clean_state_and_names_warmup(tiny_ckpt: Path) -> None:
    runner = make_runner(tiny_ckpt, warmup=True)

    def broken_decoder(req: Any, latents: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("decoder exploded")

    runner.run_vae_decoder = broken_decoder  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="decoder exploded") as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "warmup"
    assert any("warmup" in note for note in exc.value.__notes__)
    assert_start_up_baseline(runner)


# ---- isolation: same seed => same output, with or without warmup -------------------------------
def _request(seed: int, **kw: Any) -> RequestConfig:
    return RequestConfig(prompt=kw.pop("prompt", "a red fox in the snow"), seed=seed, **kw)


def _video(runner: WanT2VRunner, request: RequestConfig, tmp_path: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    out = tmp_path / f"{name}.safetensors"
    runner.run_pipeline(request.model_copy(update={"save_tensor_path": str(out)}), 0)
    return load_file(str(out))["video"]


def test_same_seed_bit_identical_with_and_without_warmup(tiny_ckpt: Path, tmp_path: Path) -> None:
    cold = make_runner(tiny_ckpt)
    cold.init_modules()
    warm = make_runner(tiny_ckpt, warmup=True)
    warm.init_modules()
    for i, shape in enumerate([(48, 80, 9), (32, 32, 5)]):  # both warmup shapes, default first
        h, w, f = shape
        req = _request(7 + i, target_height=h, target_width=w, target_video_length=f)
        a = _video(cold, req, tmp_path, f"cold{i}")
        b = _video(warm, req, tmp_path, f"warm{i}")
        assert torch.equal(a, b)
        assert warm.profiler.requests[-1].audit["warmed_shape"] is True


def test_consecutive_requests_after_warmup_equal_isolated_runs(tiny_ckpt: Path, tmp_path: Path) -> None:
    reqs = [_request(1), _request(2, prompt="a boat", target_height=32, target_width=32, target_video_length=5),
            _request(3, negative_prompt="blurry")]
    warm = make_runner(tiny_ckpt, warmup=True)
    warm.init_modules()
    served = [_video(warm, r, tmp_path, f"served{i}") for i, r in enumerate(reqs)]
    assert_start_up_baseline(warm)
    for i, r in enumerate(reqs):
        fresh = make_runner(tiny_ckpt)
        fresh.init_modules()
        assert torch.equal(served[i], _video(fresh, r, tmp_path, f"iso{i}")), f"request {i}"
    assert not torch.equal(served[0], served[2])


def test_failed_request_is_cleaned_and_next_request_unaffected(tiny_ckpt: Path, tmp_path: Path) -> None:
    runner = make_runner(tiny_ckpt, warmup=True)
    runner.init_modules()
    expected = _video(runner, _request(5), tmp_path, "ref")
    real_step = runner.run_step
    boom = {"armed": True}

    def failing_step(req: Any, stage: Any, model: Any, latents: torch.Tensor, timestep: torch.Tensor,
                     i: int) -> torch.Tensor:
        if boom["armed"] and i == 2:
            raise torch.cuda.OutOfMemoryError("simulated OOM")
        return real_step(req, stage, model, latents, timestep, i)

    runner.run_step = failing_step  # type: ignore[method-assign]
    with pytest.raises(torch.cuda.OutOfMemoryError) as exc:
        runner.run_pipeline(_request(9), 3)
    assert error_phase(exc.value) == "request 3"
    [note] = [n for n in exc.value.__notes__ if "out of memory during request 3" in n]
    if runner.device.type == "cuda":
        assert "allocated" in note and "reserved" in note, note
    else:
        assert "cpu: host RSS" in note, note
    assert_start_up_baseline(runner)
    boom["armed"] = False
    assert torch.equal(_video(runner, _request(5), tmp_path, "after"), expected)


# ---- memory -----------------------------------------------------------------------------------
def _empty_cache_calls(tree: ast.AST) -> list[tuple[ast.AST, list[ast.AST]]]:
    """Every reference to a name or attribute `empty_cache`, with its enclosing nodes (outermost first)."""
    found = []

    def walk(node: ast.AST, parents: list[ast.AST]) -> None:
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name == "empty_cache" or (isinstance(node, ast.alias) and node.name == "empty_cache"):
            found.append((node, parents))
        for child in ast.iter_child_nodes(node):
            walk(child, [*parents, node])

    walk(tree, [])
    return found


def test_no_unconditional_empty_cache_in_package() -> None:
    """The whole package, memory.py and every helper included: `empty_cache` is referenced in one
    place only, inside `memory.maybe_empty_cache`, under its pressure test (an `if`)."""
    allowed, offenders = [], []
    for path in sorted((REPO / "runnerkit").rglob("*.py")):
        for node, parents in _empty_cache_calls(ast.parse(path.read_text())):
            funcs = [p.name for p in parents if isinstance(p, ast.FunctionDef)]
            guarded = any(isinstance(p, ast.If) for p in parents)
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if path.name == "memory.py" and funcs == ["maybe_empty_cache"] and guarded:
                allowed.append(where)
            else:
                offenders.append(where)
    assert offenders == [] and len(allowed) == 1, (offenders, allowed)


@pytest.mark.parametrize("overrides", [{}, {"offload": {"mode": "model"}},
                                       {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}}])
def test_empty_cache_never_called_on_cpu_machine(tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 overrides: dict[str, Any]) -> None:
    """At run time (warmup, requests, per-stage teardown): a spy on torch.cuda.empty_cache stays silent
    on a CUDA-less machine, where maybe_empty_cache has nothing to empty."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    runner = make_runner(tiny_ckpt, warmup=True, **overrides)
    runner.init_modules()
    _video(runner, _request(1), tmp_path, "a")
    _video(runner, _request(2, target_height=32, target_width=32, target_video_length=5), tmp_path, "b")
    assert calls == []


GIB = 1024**3
LAZY = {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}}
# (free, reserved, allocated) GiB of a fake CUDA device; the thresholds below: free < 2, reclaimable > 4
# ("tight": free between the two thresholds, so swapped thresholds would decide otherwise)
STATES = {"spare": (40.0, 10.0, 9.0), "low_free": (1.0, 10.0, 9.0), "tight": (3.0, 10.0, 9.0)}


@pytest.mark.parametrize(("overrides", "state", "emptied"), [
    ({}, "spare", False), ({}, "low_free", True), (LAZY, "tight", False)],
    ids=["spare", "low_free", "lazy-tight"])
def test_cache_emptied_exactly_where_device_memory_pressure_says(
        tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any], state: str,
        emptied: bool) -> None:
    """On a CPU-only machine maybe_empty_cache returns before its decision, so a spy on
    torch.cuda.empty_cache could never fire. Here every call is decided as on a CUDA device whose
    memory queries (torch.cuda.mem_get_info / memory_reserved / memory_allocated) report `state`: the
    branch that empties is reachable, the configured thresholds decide, and the spy fires exactly at
    the calls whose decision is 'empty' (the end of a request, a per-stage module dropped under lazy
    load; never between warmup and the request)."""
    free, reserved, allocated = STATES[state]
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free * GIB), int(80 * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(allocated * GIB))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: int(allocated * GIB))
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    real = memory.maybe_empty_cache

    def as_on_cuda(device: torch.device, reason: str, *args: Any, **kwargs: Any) -> bool:
        calls.append(reason)
        return real(cuda, reason, *args, **kwargs)

    monkeypatch.setattr(memory, "maybe_empty_cache", as_on_cuda)
    runner = make_runner(tiny_ckpt, warmup=True, memory={"empty_cache_min_free_gib": 2.0,
                                                         "empty_cache_min_reclaimable_gib": 4.0}, **overrides)
    runner.init_modules()
    warmup_calls = list(calls)
    calls.append("request")
    _video(runner, _request(1, target_height=32, target_width=32, target_video_length=5), tmp_path, "a")
    then = ["empty_cache"] if emptied else []
    drop = ["drop per-stage transformer", *then] if overrides else []  # lazy load: the transformer torn down
    assert warmup_calls == drop * 2  # once per warmup shape, nothing else
    assert calls[len(warmup_calls):] == ["request", *drop, "end_run", *then]


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate(),
                              "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state_all()
    return states


def _same_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return (torch.equal(a["torch_cpu"], b["torch_cpu"]) and a["python"] == b["python"]
            and all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
                    for x, y in zip(a["numpy"], b["numpy"], strict=True))
            and all(torch.equal(x, y) for x, y in zip(a.get("torch_cuda", []), b.get("torch_cuda", []), strict=True)))


@pytest.mark.parametrize("overrides", [{}, {"offload": {"mode": "phase"}}])
def test_warmup_leaves_every_global_rng_unchanged(tiny_ckpt: Path, overrides: dict[str, Any]) -> None:
    """torch's CPU (and CUDA) generator, Python's `random` and NumPy's RNG are exactly as before
    warmup, and the scheduler's generator is None: warmup draws only from its own generator."""
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    runner = make_runner(tiny_ckpt, warmup=True, **overrides)
    before = _rng_states()
    runner.init_modules()
    assert runner.profiler.warmup is not None  # warmup really ran
    assert _same_rng(before, _rng_states())
    assert runner.scheduler.generator is None


def test_warmup_and_first_step_never_empty_cache(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between warmup and the first formal transformer step, cache emptying only goes through
    maybe_empty_cache, and with memory to spare it keeps the cache."""
    decisions: list[tuple[str, bool]] = []
    real = memory.maybe_empty_cache

    def recording(device: torch.device, reason: str, *a: Any, **k: Any) -> bool:
        acted = real(device, reason, *a, **k)
        decisions.append((reason, acted))
        return acted

    monkeypatch.setattr(memory, "maybe_empty_cache", recording)
    first_step: list[int] = []
    runner = make_runner(tiny_ckpt, warmup=True)
    runner.init_modules()
    assert decisions == []  # nothing emptied (or even considered) between warmup and the request
    real_step = runner.run_step
    runner.run_step = lambda *a: (first_step.append(len(decisions)), real_step(*a))[1]  # type: ignore
    runner.run_pipeline(_request(1), 0)
    assert first_step[0] == 0 and decisions == [("end_run", False)]


@pytest.mark.parametrize(("free", "reserved", "allocated", "expect"),
                         [(40.0, 10.0, 9.0, False), (1.0, 10.0, 9.0, True), (40.0, 30.0, 5.0, True)])
def test_maybe_empty_cache_acts_only_under_pressure(monkeypatch: pytest.MonkeyPatch, free: float, reserved: float,
                                                    allocated: float, expect: bool) -> None:
    emptied: list[int] = []
    monkeypatch.setattr(memory, "snapshot", lambda d: memory.MemorySnapshot(allocated, reserved, allocated, free))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    acted = memory.maybe_empty_cache(torch.device("cuda"), "test", min_free_gib=2.0, min_reclaimable_gib=16.0)
    assert acted is expect and emptied == ([1] if expect else [])
