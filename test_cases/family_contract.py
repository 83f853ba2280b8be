"""The family contract: the lifecycle guarantees every family's tiny config keeps, written once.

A family's test file describes itself with a `Family` (its runner class, tiny config, requests,
offload modes, and hooks for what only it has) and subclasses `FamilyContract` with it; pytest
collects the contract's tests in that file, parametrized over the family's modes:

    class TestContract(FamilyContract):
        family = Family(name="wan2.1 t2v", runner_cls=WanT2VRunner, config=..., ...)

    @pytest.fixture(scope="module")  # optional: by default the contract serves the requests cold itself
    def family_reference(...) -> list[dict[str, Tensor]]: ...  # the cold `none` outputs

What the contract checks (ARCHITECTURE §3-4, §8):
- warmup is opt-in and gated: `unload_modules`, a subclass that did not opt in itself, and an
  offload mode the class does not list are refused with `NotImplementedError` naming the reason,
  in the `warmup` phase, before anything loads;
- every offload mode the family supports gives outputs bit-identical to a cold `offload.mode: none`
  runner, with and without warmup (warmup runs iff asked), for requests served one after another;
- after warmup and after every request the runner is at the start-up baseline: no request state
  (`input_info`, `inputs`, generators), schedulers equal to fresh ones, nothing on the device
  between stages, streamers at a request boundary, and its `__dict__` exactly as after
  `init_modules` (every key, and every value by identity, two levels into containers; only the
  log-once flags of `ONCE_PER_RUNNER` may flip), naming what leaked; plus the family's own checks
  (`Family.boundary`). The same `__dict__` holds during a request too (at each request's first
  denoising step: the request lives in its `RequestState`, never on the runner; `PER_STAGE`
  aside), and every
  `RequestState` (warmup's included) is freed once its request returned or raised (a weak
  reference to it is dead). All of it after requests that succeed, one that fails in its first
  denoising step and one an `on_progress` observer cancels after it; the next request then equals a
  fresh runner's, and neither left a file;
- the plan's CPU estimate covers the measured peak of a request, and not by too much
  (`Family.estimate_request`; skipped, saying so, for a family without an estimate);
- reference parity through the family's hook (`Family.parity`), skipped without the reference
  package unless RUNNERKIT_REQUIRE_REFERENCE=1.

The reference outputs: a family's module-scoped fixture `family_reference` if it defines one (e.g.
reused from its other tests), else the contract serves `Family.requests` on a cold `offload.mode:
none` runner itself (`reference_outputs`).

This module is a helper (no `test_` prefix): only the families' subclasses are collected.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.planning import fit
from runnerkit.runners.base import Progress, RequestCancelled, error_phase
from runnerkit.runners.default import DefaultRunner
from test_cases._memory import peak_tensor_bytes

Outputs = dict[str, torch.Tensor]
MIB = 1024**2


@dataclass(frozen=True)
class Family:
    """One family (one runner class and task) as the contract drives it.

    Attributes:
        name: shown in failure messages.
        runner_cls: the registered runner class under test.
        checkpoint: name of the pytest fixture giving the tiny checkpoint's path (module or session
            scope: the default reference is served once per family).
        config: (checkpoint path, **overrides) -> the tiny JSON config dict on the CPU.
        requests: served in this order by every mode (at least two shapes: the warmup shapes); the
            first is also the one that fails and the one that is cancelled.
        outputs: the keys of the saved `--save_tensor_path` file ('video', 'image', 'audio').
        shapes: per request, key -> the saved tensor's shape (checked in every mode); None: unchecked.
        modes: mode name -> config overrides, every offload mode the family supports (a `none`
            entry runs `none` again, e.g. warmed, against the cold reference). A mode with
            `unload_modules` is checked to be refused under warmup instead.
        warmup_arms: which of (without, with) warmup each mode runs; a family whose cold modes are
            checked elsewhere may run the warm arm only.
        boundary: the family's own request-boundary checks (e.g. its RoPE cache is empty).
        after_mode: (mode name, runner) -> None, the family's checks of a mode once its requests
            are served (e.g. a lazily built transformer is gone).
        estimate_request: a request (its shape given) whose measured CPU peak of live tensors the
            plan must cover: what it reserves above the resident weights (formula + `fit.MARGIN`,
            without the fixed process overhead) >= measured; None: the family has no estimate
            (the test is skipped, naming why).
        estimate_loosest: the largest formula / measured ratio accepted (how tight the formula is).
        parity: (the test's pytest request, tmp folder) -> None, the family's end-to-end parity
            check against its reference package (fixtures through `request.getfixturevalue`);
            None: no hook.
        reference_package: the package `parity` needs (skipped without it unless
            RUNNERKIT_REQUIRE_REFERENCE=1).
    """

    name: str
    runner_cls: type[DefaultRunner]
    checkpoint: str
    config: Callable[..., dict[str, Any]]
    requests: tuple[RequestConfig, ...]
    outputs: tuple[str, ...]
    modes: Mapping[str, Mapping[str, Any]]
    shapes: tuple[dict[str, tuple[int, ...]], ...] | None = None
    warmup_arms: tuple[bool, ...] = (False, True)
    boundary: Callable[[Any], None] | None = None
    after_mode: Callable[[str, Any], None] | None = None
    estimate_request: RequestConfig | None = None
    estimate_loosest: float = 4.0
    parity: Callable[[pytest.FixtureRequest, Path], None] | None = None
    reference_package: str | None = None


# ---- the request boundary --------------------------------------------------------------------
def fingerprint(value: Any, depth: int = 0) -> Any:
    """A comparable stand-in for an attribute value: plain values as they are, containers item by
    item (two levels deep), every other object (modules, tensors, schedulers) by identity."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if depth < 2 and isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(fingerprint(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return "dict", tuple((repr(k), fingerprint(v, depth + 1)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return type(value).__name__, tuple(sorted(repr(v) for v in value))
    return type(value).__name__, id(value)


def runner_state(runner: Any) -> dict[str, Any]:
    """The runner's `__dict__`, each value fingerprinted (`fingerprint`)."""
    return {name: fingerprint(value) for name, value in vars(runner).items()}


#: Runner attributes a request may change, and why that is not request state: each may only go
#: from False to True, once per runner.
ONCE_PER_RUNNER: dict[str, str] = {
    "_fit_unchecked_logged": "the 'requests are served unchecked' notice (no estimate) is logged once per runner",
    "_fit_deferred_logged": "the 'fit checked once loaded' notice is logged once per runner",
}


#: Runner attributes that may differ from the start-up state during a request (never after it), and why.
PER_STAGE: dict[str, str] = {
    "streamers": "`offload.lazy_load`: the streamed module and its streamer are built per stage and dropped after it",
}


def leaks(baseline: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs from `baseline`: attributes added, removed or changed, one line each, sorted
    (a `ONCE_PER_RUNNER` flag going from False to True excepted)."""
    lines = [f"added `{k}`: {now[k]!r}" for k in now.keys() - baseline.keys()]
    lines += [f"removed `{k}`" for k in baseline.keys() - now.keys()]
    lines += [f"changed `{k}`: {baseline[k]!r} -> {now[k]!r}" for k in baseline.keys() & now.keys()
              if baseline[k] != now[k] and not (k in ONCE_PER_RUNNER and (baseline[k], now[k]) == (False, True))]
    return sorted(lines)


def scheduler_state(sched: Any) -> dict[str, Any]:
    """A scheduler's attributes, tensors as (shape, dtype, values)."""
    return {k: ("tensor", tuple(v.shape), v.dtype, v.flatten().tolist()) if isinstance(v, torch.Tensor) else v
            for k, v in vars(sched).items()}


class RequestSpy:
    """The family's `run_step`, wrapped on its class (an instance attribute would itself change
    `vars(runner)`): a weak reference to every `RequestState` a step ran with (warmup's too), the
    runner's `__dict__` at each request's first step compared with `baseline` once that is set, a
    step that fails on demand (`fail_step`) and an `on_progress` observer (`observe`) that cancels
    after the first step on demand (`cancel`)."""

    def __init__(self, cls: type[DefaultRunner], monkeypatch: pytest.MonkeyPatch) -> None:
        self.states: list[weakref.ref[Any]] = []
        self.baseline: dict[str, Any] | None = None
        self.during: list[str] = []  # what differed from `baseline` inside a request
        self.fail_step = False
        self.cancel = False
        real_step = cls.run_step

        def run_step(runner: Any, req: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not self.states or self.states[-1]() is not req:  # the request's (or warmup shape's) first step
                self.states.append(weakref.ref(req))
                if self.baseline is not None:
                    now = runner_state(runner)
                    self.during += leaks(self.baseline, {k: self.baseline[k] if k in PER_STAGE and k in self.baseline
                                                         else v for k, v in now.items()})
            if self.fail_step:  # after the encoders and the scheduler's prepare
                raise RuntimeError("injected step failure")
            return real_step(runner, req, *args, **kwargs)

        monkeypatch.setattr(cls, "run_step", run_step)

    def observe(self, progress: Progress) -> None:
        if self.cancel and progress.steps_done == 1:
            raise RequestCancelled("cancelled by the contract")

    def check(self, name: str, when: str) -> None:
        """Every `RequestState` seen is freed, and nothing of a request was on the runner during it."""
        gc.collect()
        alive = [i for i, ref in enumerate(self.states) if ref() is not None]
        assert alive == [], f"{name}, {when}: RequestState(s) {alive} (in order of first step) still referenced"
        assert self.during == [], f"{name}, {when}: request state on the runner during a request:\n" + \
            "\n".join(self.during)


def assert_request_boundary(family: Family, runner: Any, baseline: dict[str, Any] | None, when: str,
                            spy: RequestSpy | None = None) -> None:
    """The start-up baseline (see the module docstring); `baseline` is `runner_state` after
    `init_modules` (None: only the named checks); `spy`: also every `RequestState` freed and the
    runner untouched during the requests (`RequestSpy.check`)."""
    left = [name for name in ("input_info", "inputs", "stage_modules", "request") if hasattr(runner, name)]
    assert left == [], f"{family.name}, {when}: request state on the runner: {left}"
    assert runner.pipeline is not None
    for stage in runner.pipeline.denoise:
        sched = runner.schedulers[stage.name]
        assert sched.generator is None, f"{family.name}, {when}: stage {stage.name}'s generator left"
        assert scheduler_state(sched) == scheduler_state(runner.build_scheduler(stage)), \
            f"{family.name}, {when}: stage {stage.name}'s scheduler is not a fresh one"
    assert runner.placement is not None and runner.placement.on_device_now() == set(), \
        f"{family.name}, {when}: modules left on the device: {runner.placement.on_device_now()}"
    for name, streamer in runner.streamers.items():
        state = streamer.state()
        assert (state["next_prefetch"], state["issued"], state["in_flight"]) == (0, [], 0), \
            f"{family.name}, {when}: streamer {name} is not at a request boundary: {state}"
    if baseline is not None:
        leaked = leaks(baseline, runner_state(runner))
        assert leaked == [], f"{family.name}, {when}: the runner kept request state:\n" + "\n".join(leaked)
    if family.boundary is not None:
        family.boundary(runner)
    if spy is not None:
        spy.check(family.name, when)


# ---- building and serving ----------------------------------------------------------------------
def make_runner(family: Family, ckpt: Path, cls: type[DefaultRunner] | None = None, **overrides: Any) -> Any:
    """The family's runner (or `cls`) on its tiny config with `overrides`; not initialised."""
    return (cls or family.runner_cls)(load_runner_config(None, family.config(ckpt, **overrides)))


def serve(runner: Any, request: RequestConfig, path: Path, index: int) -> Outputs:
    """One request through `run_pipeline`, saved as tensors to `path`; the saved tensors."""
    runner.run_pipeline(request.model_copy(update={"save_tensor_path": str(path)}), index)
    return load_file(str(path))


def serve_all(family: Family, runner: Any, folder: Path, tag: str, baseline: dict[str, Any] | None,
              spy: RequestSpy | None = None) -> list[Outputs]:
    """The family's requests in order, the request boundary checked after each."""
    out = []
    for i, request in enumerate(family.requests):
        outputs = serve(runner, request, folder / f"{tag}_{i}.safetensors", i)
        assert sorted(outputs) == sorted(family.outputs), f"{family.name}: saved {sorted(outputs)}"
        assert_request_boundary(family, runner, baseline, f"{tag}, after request {i}", spy)
        out.append(outputs)
    return out


# ---- the contract --------------------------------------------------------------------------------
class FamilyContract:
    """The contract's tests; a family's test file subclasses this with `family` set, and may define the
    module-scoped fixture `family_reference` beside the class (its cold `offload.mode: none` outputs of
    `family.requests`, e.g. reused from its other tests); without one the contract serves them itself."""

    family: ClassVar[Family]

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "mode" in metafunc.fixturenames:
            metafunc.parametrize("mode", list(self.family.modes))
        if "warmup" in metafunc.fixturenames:
            metafunc.parametrize("warmup", list(self.family.warmup_arms),
                                 ids=["warmup" if w else "cold" for w in self.family.warmup_arms])

    @pytest.fixture(autouse=True)
    def _no_real_gc_freeze(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An eager warmup freezes the gc once per process: never the test process's."""
        from runnerkit import memory

        monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)

    @pytest.fixture
    def request_spy(self, monkeypatch: pytest.MonkeyPatch) -> RequestSpy:
        return RequestSpy(self.family.runner_cls, monkeypatch)

    @pytest.fixture(scope="class")
    @classmethod
    def contract_reference(cls, request: pytest.FixtureRequest,
                           tmp_path_factory: pytest.TempPathFactory) -> list[Outputs]:
        """The family's `family_reference` fixture if it defines one, else its requests served cold here."""
        try:
            return request.getfixturevalue("family_reference")
        except pytest.FixtureLookupError:
            return reference_outputs(cls.family, cls.ckpt(request), tmp_path_factory.mktemp("reference"))

    @classmethod
    def ckpt(cls, request: pytest.FixtureRequest) -> Path:
        return request.getfixturevalue(cls.family.checkpoint)

    # 1. warmup: opt-in and its gates, before anything loads
    @pytest.mark.parametrize("gate", ["unload_modules", "not_opted_in", "offload_mode"])
    def test_warmup_gate_refuses_before_loading(self, request: pytest.FixtureRequest, mocker: Any, gate: str) -> None:
        family, base = self.family, self.family.runner_cls
        declared = {n: base.__dict__[n] for n in ("WARMUP_TASKS", "WARMUP_SHAPES", "WARMUP_OFFLOAD_MODES")}
        cls, overrides, reason = {
            "unload_modules": (base, {"unload_modules": True}, r"`unload_modules`=true"),
            "not_opted_in": (type(f"Unlisted{base.__name__}", (base,), {}), {},
                             rf"Unlisted{base.__name__} has not opted in .* not inherited"),
            "offload_mode": (type(f"NoModes{base.__name__}", (base,), {**declared, "WARMUP_OFFLOAD_MODES": ()}), {},
                             r"does not support offload mode 'none' \(supported: \[\]\)"),
        }[gate]
        runner = make_runner(family, self.ckpt(request), cls, warmup=True, **overrides)
        load, run_warmup = mocker.spy(cls, "load_modules"), mocker.spy(cls, "run_warmup")
        with pytest.raises(NotImplementedError, match=reason) as exc:
            runner.init_modules()
        assert error_phase(exc.value) == "warmup"
        assert (load.call_count, run_warmup.call_count) == (0, 0), f"{family.name}: {gate} refused after loading"

    # 2. every offload mode, with and without warmup, equals a cold `none` runner; 3. state reset
    def test_mode_is_bit_identical_to_none(self, request: pytest.FixtureRequest, tmp_path: Path, mocker: Any,
                                           contract_reference: list[Outputs], request_spy: RequestSpy, mode: str,
                                           warmup: bool) -> None:
        family, overrides = self.family, self.family.modes[mode]
        runner = make_runner(family, self.ckpt(request), warmup=warmup, **overrides)
        run_warmup = mocker.spy(family.runner_cls, "run_warmup")
        if warmup and overrides.get("unload_modules"):
            with pytest.raises(NotImplementedError, match="unload_modules"):
                runner.init_modules()
            return
        runner.init_modules()
        assert run_warmup.call_count == int(warmup), f"{family.name}, {mode}: run_warmup ran {run_warmup.call_count}x"
        assert (runner.profiler.warmup is not None) == warmup
        baseline = request_spy.baseline = runner_state(runner)
        assert_request_boundary(family, runner, None, f"{mode}, after init", request_spy)
        # one dummy request per shape warmup ran (the class shapes and those a family's sweep adds)
        assert len(request_spy.states) == (len(runner.warmed_shapes) if warmup else 0)
        got = serve_all(family, runner, tmp_path, mode, baseline, request_spy)
        if family.shapes is not None:
            assert [{k: tuple(o[k].shape) for k in family.outputs} for o in got] == list(family.shapes), mode
        for i, (outputs, want) in enumerate(zip(got, contract_reference, strict=True)):
            for key in family.outputs:
                a, b = outputs[key], want[key]
                assert a.shape == b.shape and torch.equal(a, b), \
                    f"{family.name}, {mode}, request {i}: {key} differs (max {(a - b).abs().max().item()})"
        if warmup:
            assert all(r.audit["warmed_shape"] for r in runner.profiler.requests), f"{family.name}: a cold shape"
        if family.after_mode is not None:
            family.after_mode(mode, runner)

    # 3b. a failed and a cancelled request leave nothing behind, and the next request is served normally
    def test_failed_and_cancelled_requests_leave_the_start_up_state(
            self, request: pytest.FixtureRequest, tmp_path: Path, contract_reference: list[Outputs],
            request_spy: RequestSpy) -> None:
        runner = make_runner(self.family, self.ckpt(request))
        check_failed_and_cancelled(self.family, runner, request_spy, tmp_path, contract_reference[0])

    # 4. the plan's CPU estimate against the measured peak
    def test_cpu_estimate_bounds_the_measured_peak(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        family = self.family
        if family.estimate_request is None:
            pytest.skip(f"{family.name} has no memory estimate (`estimate_memory` returns None)")
        runner = make_runner(family, self.ckpt(request))
        runner.init_modules()
        req = family.estimate_request
        shape = runner.request_shape(req)  # the config's default shape where the request gives none
        estimate = runner.estimate_memory(shape)
        peak = fit.peak_of(estimate, runner.config, torch.device("cpu"))
        # above the weights that stay between requests (loaded before the measurement): what the plan
        # reserves (formula + MARGIN, the fixed process overhead aside), and the formula itself
        resident = fit.weights_between_stages(estimate, runner.config, torch.device("cpu"))
        reserved, formula = peak.bytes - peak.overhead_bytes - resident, peak.formula_bytes - resident
        measured = peak_tensor_bytes(lambda: serve(runner, req, tmp_path / "estimate.safetensors", 0))
        said = f"{family.name} at {list(shape)}: formula {formula / MIB:.2f} MiB, reserved {reserved / MIB:.2f} MiB " \
               f"({peak.stage}), measured {measured / MIB:.2f} MiB"
        assert reserved >= measured, f"{said}: the plan reserves less than the request used"
        assert formula <= family.estimate_loosest * measured, f"{said}: looser than x{family.estimate_loosest}"


    # 5. reference parity
    def test_reference_parity(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        from test_cases._reference import require_reference

        family = self.family
        if family.parity is None:
            pytest.skip(f"{family.name} gives no reference-parity hook")
        if family.reference_package is not None:
            require_reference(family.reference_package)
        family.parity(request, tmp_path)


def check_failed_and_cancelled(family: Family, runner: Any, spy: RequestSpy, folder: Path,
                               want: Outputs | None) -> None:
    """On `runner` (not initialised; its class is `spy`'s): `family.requests[0]` fails in its first
    denoising step, then is cancelled by an `on_progress` observer after that step, then served. After
    each: the start-up state, `vars(runner)` included, and every `RequestState` freed; no file written
    by the two that did not finish; the third's outputs equal `want` (a fresh runner's; None: unchecked).
    Also usable for a family's variants that do not run the whole contract."""
    first = family.requests[0]
    runner.on_progress = spy.observe  # run-level state: set before the baseline
    runner.init_modules()
    baseline = spy.baseline = runner_state(runner)
    states_before = len(spy.states)  # warmup's
    spy.fail_step = True  # inside the denoising loop, after the encoders and `prepare`
    with pytest.raises(RuntimeError, match="injected step failure") as exc:
        serve(runner, first, folder / "failed.safetensors", 0)
    spy.fail_step = False
    assert error_phase(exc.value) == "request 0"
    del exc  # its traceback's frames hold the request's state
    assert_request_boundary(family, runner, baseline, "after a failed request", spy)
    spy.cancel = True  # after the first step: the scheduler is mid-schedule
    with pytest.raises(RequestCancelled):
        serve(runner, first, folder / "cancelled.safetensors", 1)
    spy.cancel = False
    assert_request_boundary(family, runner, baseline, "after a cancelled request", spy)
    assert [p.name for p in folder.iterdir() if p.name.startswith(("failed", "cancelled"))] == [], \
        f"{family.name}: files left by the requests that did not finish"
    again = serve(runner, first, folder / "again.safetensors", 2)
    assert_request_boundary(family, runner, baseline, "after the request that followed", spy)
    assert len(spy.states) - states_before == 3, f"{family.name}: {len(spy.states) - states_before} RequestStates " \
                                                 "for 3 requests"
    for key in family.outputs if want is not None else ():
        assert torch.equal(again[key], want[key]), \
            f"{family.name}: {key} after a failed and a cancelled request differs from a fresh runner's"


def reference_outputs(family: Family, ckpt: Path, folder: Path) -> list[Outputs]:
    """The cold `offload.mode: none` outputs of `family.requests` (the request boundary checked)."""
    runner = make_runner(family, ckpt)
    runner.init_modules()
    return serve_all(family, runner, folder, "none", runner_state(runner))
