"""Regional compile (runnerkit/compile.py) on the CPU, counting compilations with torch's `eager`
backend (it traces and guards like inductor, without generating kernels): warmup compiles, a
request at a warmed shape or one differing only in dynamic dimensions compiles nothing, a request
without warmup reports what it compiled, compiled = eager output, streaming and lazy load share
the compiled code, unsupported combinations are refused."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit import compile as regional_compile
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.models.wan.transformer import WanTransformer3D
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


def test_after_warmup_warmed_and_dynamic_only_shapes_compile_nothing(tiny_ckpt: Path, tmp_path: Path) -> None:
    runner = make(tiny_ckpt, warmup=True, **COMPILE)
    assert runner.profiler.warmup is not None and runner.profiler.warmup["compilations"] >= 1
    assert runner.profiler.warmup["compile_seconds"] > 0
    for i, shape in enumerate(WARMED + DYNAMIC_ONLY):
        audit, _ = request(runner, shape, tmp_path, i)
        assert (audit["compilations"], audit["recompilations"], audit["compile_seconds"]) == (0, 0, 0.0), (shape, audit)
    blocks = runner.transformer.blocks
    assert len({b.forward.__func__ for b in blocks}) == 1  # one compiled forward shared by every block
    assert len(regional_compile._COMPILED) == 1


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


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_output_equals_eager(tiny_ckpt: Path, tmp_path: Path, backend: str) -> None:
    """The eager-backend traces run the same kernels: the video is bit-identical (inductor's
    tolerance is measured on the GPU: bench/)."""
    (tmp_path / "eager").mkdir()
    (tmp_path / "compiled").mkdir()
    _, eager = request(make(tiny_ckpt), WARMED[0], tmp_path / "eager")
    _, compiled = request(make(tiny_ckpt, compile={"enabled": True, "backend": backend}), WARMED[0],
                          tmp_path / "compiled")
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("offload", [{"mode": "block"}, {"mode": "block", "storage": "disk", "lazy_load": True}],
                         ids=["block", "lazy"])
def test_streaming_and_lazy_load_share_the_compiled_code(tiny_ckpt: Path, tmp_path: Path,
                                                         offload: dict[str, Any]) -> None:
    _, reference = request(make(tiny_ckpt), WARMED[0], tmp_path)
    runner = make(tiny_ckpt, warmup=True, offload=offload, **COMPILE)
    built: list[weakref.ref[WanTransformer3D]] = []
    real = runner._stream

    def tracked(spec: Any) -> Any:
        module = real(spec)
        built.append(weakref.ref(module))
        return module

    runner._stream = tracked  # type: ignore[method-assign]
    for i in range(2):
        audit, video = request(runner, WARMED[0], tmp_path, i)
        assert audit["compilations"] == 0 and audit["recompilations"] == 0, audit
        assert torch.equal(video, reference)
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
    ({"offload": {"mode": "block", "storage": "disk", "lazy_load": True}, "compile": {"enabled": True, "mode":
     "reduce-overhead"}}, "CUDA graphs"),
])
def test_unsupported_combinations_are_refused_with_the_reason(tiny_ckpt: Path, overrides: dict[str, Any],
                                                              reason: str) -> None:
    overrides = {"compile": {"enabled": True}, **overrides}
    with pytest.raises(NotImplementedError, match=reason):
        WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, **overrides)))



@pytest.mark.parametrize("compile_cfg, field", [({"backend": "eager"}, "compile.backend"),
                                                ({"enabled": True, "backend": "eager", "mode": "max-autotune"},
                                                 "compile.mode")])
def test_compile_settings_that_do_nothing_are_refused(tiny_ckpt: Path, compile_cfg: dict[str, Any], field: str) -> None:
    from runnerkit.config import ConfigError

    with pytest.raises(ConfigError, match=f"`{field}`"):
        load_runner_config(None, tiny_config_dict(tiny_ckpt, compile=compile_cfg))


INDUCTOR_AGREE = 1e-4
"""Max abs difference of inductor-compiled from eager output of the tiny float32 pipeline (video values ~1):
inductor fuses and reorders float32 reductions (LayerNorm, RMSNorm), so it is not bit-identical."""


def test_inductor_output_agrees_with_eager_within_tolerance(tiny_ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "eager").mkdir()
    (tmp_path / "compiled").mkdir()
    _, eager = request(make(tiny_ckpt), WARMED[0], tmp_path / "eager")
    runner = make(tiny_ckpt, compile={"enabled": True, "backend": "inductor"})
    audit, compiled = request(runner, WARMED[0], tmp_path / "compiled")
    assert audit["compilations"] >= 1  # inductor really ran
    err = (compiled - eager).abs().max().item()
    assert err <= INDUCTOR_AGREE, err
    assert eager.abs().max().item() > 0.1  # a non-trivial output


def test_a_dynamic_only_shape_is_not_warned_about_when_compile_covers_it(tiny_ckpt: Path, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Compiled: a shape differing from warmup's only in dynamic dimensions gets an INFO line, not the
    eager path's 'expect a slower first step' warning (its audit shows it compiled nothing)."""
    from loguru import logger

    handler = logger.add(caplog.handler, level="INFO", format="{message}")
    try:
        audit, _ = request(make(tiny_ckpt, warmup=True, **COMPILE), DYNAMIC_ONLY[0], tmp_path)
        compiled_records = [(r.levelname, r.getMessage()) for r in caplog.records]
        caplog.clear()
        request(make(tiny_ckpt, warmup=True), DYNAMIC_ONLY[0], tmp_path, 1)
        eager_records = [(r.levelname, r.getMessage()) for r in caplog.records]
    finally:
        logger.remove(handler)
    assert audit["compilations"] == 0
    assert any(lv == "INFO" and "is not a warmup shape" in m for lv, m in compiled_records), compiled_records
    assert not any("was not warmed" in m for _, m in compiled_records)
    assert any(lv == "WARNING" and "was not warmed" in m for lv, m in eager_records), eager_records
