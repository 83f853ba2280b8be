"""Regional compile (runnerkit/compile.py) on the CPU, counting compilations with torch's `eager`
backend (it traces and guards like inductor, without generating kernels): warmup compiles, a
request at a warmed shape or one differing only in dynamic dimensions compiles nothing, a request
without warmup reports what it compiled, compiled = eager output, streaming and lazy load share
the compiled code, unsupported combinations are refused. inductor's output against eager is in
test_compile_cache.py (it reuses that file's first start-up instead of compiling once more)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit import compile as regional_compile
from runnerkit.config import CompileConfig, OffloadConfig, RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.models.wan.transformer import WanTransformer3D
from runnerkit.runners.building import ModuleBuilder
from test_cases.conftest import tiny_config_dict

COMPILE = {"compile": {"enabled": True, "backend": "eager"}}
WARMED = [(48, 80, 9), (32, 32, 5)]
DYNAMIC_ONLY = [(32, 48, 9), (64, 64, 13)]  # other token counts, frames and sizes: dynamic dimensions after warmup


pytestmark = pytest.mark.usefixtures("fresh_compiler")


def make(ckpt: Path, **overrides: Any) -> WanT2VRunner:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(ckpt, **overrides)))
    runner.init_modules()
    return runner


def request(runner: WanT2VRunner, shape: tuple[int, int, int], out: Path, index: int = 0) -> tuple[dict[str, Any],
                                                                                                  torch.Tensor]:
    h, w, f = shape
    path = out / f"r{index}_{h}x{w}x{f}.safetensors"
    prof = runner.run_pipeline(RequestConfig(prompt="a fox", seed=3, target_height=h, target_width=w,
                                             target_video_length=f, save_tensor_path=str(path)), index)
    return prof.audit, load_file(str(path))["video"]


def test_without_warmup_the_first_request_compiles_and_says_so(tiny_ckpt: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from loguru import logger

    handler = logger.add(caplog.handler, level="WARNING", format="{message}")
    try:
        runner = make(tiny_ckpt, **COMPILE)
        first, _ = request(runner, WARMED[0], tmp_path, 0)
        second, _ = request(runner, WARMED[0], tmp_path, 1)
        other, _ = request(runner, WARMED[1], tmp_path, 2)  # a second shape: the automatic-dynamic recompile
    finally:
        logger.remove(handler)
    assert first["compilations"] >= 1 and first["compile_seconds"] > 0 and first["recompilations"] == 0, first
    assert second["compilations"] == 0 and second["compile_seconds"] == 0.0, second
    assert other["recompilations"] == 1 and other["compilations"] >= 1, other
    assert other["recompile_reasons"] and "WanAttentionBlock" in other["recompile_reasons"][0], other
    assert any("request 0: shape [48, 80, 9] compiled" in r.getMessage() and "no warmup ran" in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.fixture(scope="module")
def eager_video(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """The uncompiled video of the request at WARMED[0] (the reference of the compiled runs below)."""
    return request(make(tiny_ckpt), WARMED[0], tmp_path_factory.mktemp("eager"))[1]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_output_equals_eager(tiny_ckpt: Path, tmp_path: Path, backend: str, eager_video: torch.Tensor) -> None:
    """The eager-backend traces run the same kernels: the video is bit-identical (inductor's
    tolerance: test_compile_cache.py on the CPU, bench/ on the GPU)."""
    _, compiled = request(make(tiny_ckpt, compile={"enabled": True, "backend": backend}), WARMED[0], tmp_path)
    assert torch.equal(eager_video, compiled)


@pytest.mark.parametrize("offload", [{"mode": "block"}, {"mode": "block", "storage": "disk", "lazy_load": True}],
                         ids=["block", "lazy"])
def test_streaming_and_lazy_load_share_the_compiled_code(tiny_ckpt: Path, tmp_path: Path, offload: dict[str, Any],
                                                         eager_video: torch.Tensor,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make(tiny_ckpt, warmup=True, offload=offload, **COMPILE)
    built: list[weakref.ref[WanTransformer3D]] = []
    real = ModuleBuilder.stream

    def tracked(builder: ModuleBuilder, spec: Any) -> Any:
        module = real(builder, spec)
        built.append(weakref.ref(module))
        return module

    monkeypatch.setattr(ModuleBuilder, "stream", tracked)  # the runner's builder streams every module
    for i in range(2):
        audit, video = request(runner, WARMED[0], tmp_path, i)
        assert audit["compilations"] == 0 and audit["recompilations"] == 0, audit
        assert torch.equal(video, eager_video)
    if offload.get("lazy_load"):  # the transformer rebuilt per request is freed after it, compiled code and all
        assert len(built) == 2
        gc.collect()
        assert [r() for r in built] == [None, None]


@pytest.mark.parametrize("overrides, reason", [
    ({"offload": {"mode": "phase"}}, "phase hooks run inside a block's forward"),
    ({"offload": {"mode": "block"}, "compile": {"enabled": True, "mode": "reduce-overhead"}}, "CUDA graphs"),
    ({"offload": {"mode": "model"}, "compile": {"enabled": True, "mode": "reduce-overhead"}},
     "`offload.mode`='model' .* old device addresses"),
    ({"unload_modules": True, "compile": {"enabled": True, "mode": "reduce-overhead"}},
     "`unload_modules` .* old device addresses"),
    ({"compile": {"enabled": True, "mode": "reduce-overhead"}}, "does nothing on device 'cpu'"),
    ({"compile": {"enabled": True, "coordinate_descent_tuning": True}},
     "`compile.coordinate_descent_tuning` does nothing on device 'cpu'"),
    ({"compile": {"enabled": True, "deterministic": True}}, "`compile.deterministic` does nothing on device 'cpu'"),
    ({"offload": {"mode": "block", "storage": "disk", "lazy_load": True}, "compile": {"enabled": True, "mode":
     "reduce-overhead"}}, "CUDA graphs"),
])
def test_unsupported_combinations_are_refused_with_the_reason(tiny_ckpt: Path, overrides: dict[str, Any],
                                                              reason: str) -> None:
    overrides = {"compile": {"enabled": True}, **overrides}
    with pytest.raises(NotImplementedError, match=reason):
        WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, **overrides)))



@pytest.mark.parametrize("compile_cfg, field", [
    ({"backend": "eager"}, "compile.backend"),
    ({"coordinate_descent_tuning": True}, "compile.coordinate_descent_tuning"),
    ({"enabled": True, "backend": "eager", "mode": "max-autotune"}, "compile.mode"),
    ({"enabled": True, "backend": "aot_eager", "coordinate_descent_tuning": True}, "compile.coordinate_descent_tuning"),
    ({"enabled": True, "mode": "max-autotune-no-cudagraphs", "coordinate_descent_tuning": True},
     "compile.coordinate_descent_tuning"),
    ({"deterministic": True}, "compile.deterministic"),
    ({"enabled": True, "backend": "eager", "deterministic": True}, "compile.deterministic"),
])
def test_compile_settings_that_do_nothing_are_refused(tiny_ckpt: Path, compile_cfg: dict[str, Any], field: str) -> None:
    from runnerkit.config import ConfigError

    with pytest.raises(ConfigError, match=f"`{field}`"):
        load_runner_config(None, tiny_config_dict(tiny_ckpt, compile=compile_cfg))


def test_the_default_written_out_is_not_refused(tiny_ckpt: Path) -> None:
    cfg = load_runner_config(None, tiny_config_dict(tiny_ckpt, compile={"coordinate_descent_tuning": False}))
    assert cfg.compile.coordinate_descent_tuning is False and not cfg.compile.enabled


@pytest.mark.parametrize("mode, options", [
    ("default", {"coordinate_descent_tuning": True}),
    ("reduce-overhead", {"triton.cudagraphs": True, "coordinate_descent_tuning": True}),
])
def test_coordinate_descent_tuning_reaches_inductor_with_the_modes_options(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                                           options: dict[str, Any]) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(regional_compile, "_COMPILED", {})

    class Block(torch.nn.Module):
        pass

    for tuned in (True, False):
        regional_compile.compiled_forward(Block, CompileConfig(enabled=True, mode=mode, coordinate_descent_tuning=tuned))
    assert calls == [{"options": options, "dynamic": None, "backend": "inductor"},
                     {"mode": mode, "dynamic": None, "backend": "inductor"}]


@pytest.mark.parametrize("flags, options", [
    ({"deterministic": True}, {"deterministic": True}),
    ({"deterministic": True, "coordinate_descent_tuning": True}, {"coordinate_descent_tuning": True,
                                                                  "deterministic": True}),
])
def test_deterministic_mode_reaches_inductor(monkeypatch: pytest.MonkeyPatch, flags: dict[str, bool],
                                             options: dict[str, Any]) -> None:
    """`compile.deterministic` is inductor's `deterministic` option beside the mode's options, and a compiled function
    of its own (a run without it shares none of its graphs)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(regional_compile, "_COMPILED", {})

    class Block(torch.nn.Module):
        pass

    regional_compile.compiled_forward(Block, CompileConfig(enabled=True, **flags))
    regional_compile.compiled_forward(Block, CompileConfig(enabled=True))
    assert calls == [{"options": options, "dynamic": None, "backend": "inductor"},
                     {"mode": "default", "dynamic": None, "backend": "inductor"}]


def test_deterministic_mode_needs_an_inductor_that_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import config as inductor_config

    cfg = CompileConfig(enabled=True, deterministic=True)
    regional_compile.check_supported(cfg, OffloadConfig(mode="none"), device=torch.device("cuda"))  # nothing raised
    monkeypatch.delattr(inductor_config, "deterministic")
    with pytest.raises(NotImplementedError, match=r"`compile.deterministic` needs torch >= 2.10 .*this is torch"):
        regional_compile.check_supported(cfg, OffloadConfig(mode="none"), device=torch.device("cuda"))


class _Part(torch.nn.Module):
    COMPILED_REGIONS = ("double",)

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class _Bad(torch.nn.Module):
    COMPILED_REGIONS = ("missing",)


def test_declared_regions_share_one_compiled_function_per_class_and_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """`COMPILED_REGIONS` (a network whose blocks cannot be compiled whole, e.g. the LTX-2.5 diffusion decoder): every
    instance's method goes through one compiled function of its class and method; `install` routes them with
    compile on and leaves them alone with it off; a name that is no method is refused with the class named."""
    compiled: list[str] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn.__qualname__) or fn)
    monkeypatch.setattr(regional_compile, "_COMPILED", {})
    net = torch.nn.Sequential(_Part(), torch.nn.Sequential(_Part()))
    regional_compile.install(net, None, CompileConfig(enabled=False))
    assert compiled == [] and "double" not in vars(net[0])
    regional_compile.install(net, None, CompileConfig(enabled=True))
    assert compiled == ["_Part.double"]
    assert net[0].double.__func__ is net[1][0].double.__func__ is regional_compile._COMPILED[
        (_Part, "double", "default", False, "inductor", False, False)]
    assert torch.equal(net[1][0].double(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(TypeError, match=r"_Bad\.COMPILED_REGIONS names 'missing', not a method"):
        regional_compile.compile_regions(_Bad(), CompileConfig(enabled=True))


class _TwoRegions(torch.nn.Module):
    COMPILED_REGIONS = ("f", "g")

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def g(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@pytest.mark.usefixtures("fresh_compiler")
def test_recompile_reasons_are_taken_function_by_function() -> None:
    """Two compiled functions, each recompiled earlier; then only the first recompiles: the new reasons are its own
    (one per cached graph torch tried), labelled with its class and method, never the other's older ones (a flat
    list sliced at its old length would hand those over)."""
    m = _TwoRegions()
    regional_compile.compile_regions(m, CompileConfig(enabled=True, backend="eager"))
    for shape in ((3,), (4,), (2, 2)):
        m.f(torch.ones(shape))
        m.g(torch.ones(shape))
    count0, before = regional_compile.recompile_state()
    assert set(before) == {"_TwoRegions.f", "_TwoRegions.g"} and before["_TwoRegions.g"]
    m.f(torch.ones(2, 2, 2))
    count1, after = regional_compile.recompile_state()
    reasons = regional_compile.new_reasons(before, after)
    assert count1 - count0 == 1 and reasons and all(r.startswith("_TwoRegions.f: ") for r in reasons), reasons
    assert len(reasons) == len(after["_TwoRegions.f"]) - len(before["_TwoRegions.f"])  # one per cached graph tried


ONE_TOKEN = (16, 16, 1)
"""Latent 1x2x2, one transformer token: a size torch never serves from a dynamic dimension."""
TOKENS = {(32, 48, 9): 18, (64, 64, 13): 64, (16, 16, 5): 2, ONE_TOKEN: 1}


def test_after_warmup_only_a_one_token_shape_compiles_and_each_start_says_so(
        tiny_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After warmup, requests at the warmed shapes and at shapes differing only in dynamic dimensions
    (token counts of 2 and more) compile nothing, and a non-warmup one's start says in an INFO line
    that the compiled blocks cover it. torch specialises sizes 0 and 1, so a shape with one
    transformer token is not covered: its start warns that it compiles, and it does; a second request
    at that shape compiles nothing and its start says so in an INFO line. What compiled is read from
    torch's own counters, not only from runnerkit's audit."""
    from loguru import logger
    from torch._dynamo.utils import counters

    handler = logger.add(caplog.handler, level="INFO", format="{message}")
    try:
        runner = make(tiny_ckpt, warmup=True, **COMPILE)
        seen = {}
        for i, shape in enumerate([*WARMED, *DYNAMIC_ONLY, (16, 16, 5), ONE_TOKEN, ONE_TOKEN]):
            caplog.clear()
            graphs = counters["stats"]["unique_graphs"]
            audit, _ = request(runner, shape, tmp_path, i)
            starts = [(r.levelname, r.getMessage()) for r in caplog.records if "is not a warmup shape" in r.getMessage()]
            seen[shape if i < 6 else "again"] = (counters["stats"]["unique_graphs"] - graphs, audit, starts)
    finally:
        logger.remove(handler)
    assert runner.profiler.warmup is not None and runner.profiler.warmup["compilations"] >= 1
    assert runner.profiler.warmup["compile_seconds"] > 0
    for shape in [*WARMED, *DYNAMIC_ONLY, (16, 16, 5)]:
        graphs, audit, records = seen[shape]
        assert graphs == 0, (shape, graphs)
        assert (audit["compilations"], audit["recompilations"], audit["compile_seconds"]) == (0, 0, 0.0), (shape, audit)
        if shape in WARMED:
            assert records == [], records
        else:
            assert [lv for lv, _ in records] == ["INFO"] and "the compiled blocks cover it" in records[0][1], records
            assert f"transformer tokens {TOKENS[shape]}," in records[0][1], records
    graphs, audit, records = seen[ONE_TOKEN]
    assert graphs >= 1 and audit["compilations"] >= 1  # torch: "0/1 specialization", a graph of its own
    assert [lv for lv, _ in records] == ["WARNING"], records
    assert "transformer tokens 1:" in records[0][1] and "this request compiles" in records[0][1], records
    graphs, audit, records = seen["again"]  # the same one-token shape: the graphs request 5 compiled serve it
    assert graphs == 0 and audit["compilations"] == 0 and audit["recompilations"] == 0, audit
    warmed = [list(s) for s in runner.warmed_shapes]
    assert records == [("INFO", f"request 6: shape [16, 16, 1] is not a warmup shape ({warmed}) and gives the "
                                "compiled blocks transformer tokens 1, which request 5 compiled graphs for; the "
                                "request's audit reports any compilation")], records
    blocks = runner.transformer.blocks
    assert len({b.forward.__func__ for b in blocks}) == 1  # one compiled forward shared by every block
    assert len(regional_compile._COMPILED) == 1


def test_a_shape_warmup_did_not_run_warns_on_the_eager_path(tiny_ckpt: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from loguru import logger

    handler = logger.add(caplog.handler, level="INFO", format="{message}")
    try:
        request(make(tiny_ckpt, warmup=True), DYNAMIC_ONLY[0], tmp_path)
    finally:
        logger.remove(handler)
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert any(lv == "WARNING" and "was not warmed" in m and "expect a slower first step" in m
               for lv, m in records), records
