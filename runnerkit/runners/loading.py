"""Loading and placement of `DefaultRunner` (ARCHITECTURE §2, §4): what `load_modules` does, and a
module on the device for one stage.

    load_modules: prepare_load -> check_parallel -> the attention backend and text buckets
        -> describe_pipeline -> fp8 compute check -> the LoRA manager -> place_modules -> schedulers
        -> the config's named adapters read and matched

Everything it makes is kept on the runner, which the request path reads: `attention`, `buckets`,
`pipeline`, `fp8_bias_in_gemm`, `lora`, `installers`, `builder`, `placement`, `modules` (and the
`streamers` the builder fills), `schedulers`. The family's part is its hooks (`prepare_load`,
`describe_pipeline`, `attention_head_dim`, `lora_aliases`, `build_scheduler`, `attention_heads`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from loguru import logger
from torch import nn

from runnerkit import compile as regional_compile
from runnerkit.runners.adapters import manager_for
from runnerkit.runners.building import ModuleBuilder, check_family_settings, check_stream_modules
from runnerkit.runners.installers import check_fp8_compute, check_parallel, installers_for, preload_adapters
from runnerkit.runners.pipeline import Pipeline
from runnerkit.runners.placement import Placement
from runnerkit.runners.request_state import RequestState
from runnerkit.text_buckets import choose

if TYPE_CHECKING:
    from runnerkit.runners.default import DefaultRunner

__all__ = ["check_settings", "load_modules", "module_on_device", "place_modules"]


def check_settings(runner: DefaultRunner) -> None:
    """What the runner refuses when it is built, before any plan or load: settings the family does not
    read (runners/building.py `check_family_settings`), an `offload.stream_modules` entry not among
    `STREAM_MODULES` (`check_stream_modules`), and compile settings that cannot run here.

    Raises:
        ValueError, NotImplementedError: naming the setting, its value and what is allowed.
    """
    config = runner.config
    check_family_settings(config, runner.MODULE_PATHS, runner.TEXT_BUCKETS is not None, runner.PROMPT_ENHANCER,
                          runner.VIDEO_DECODERS)
    check_stream_modules(config, runner.STREAM_MODULES, type(runner).__name__)
    regional_compile.check_supported(config.compile, config.offload, config.unload_modules, runner.device)


def load_modules(runner: DefaultRunner) -> None:
    """prepare_load -> the attention backend -> describe_pipeline -> place every module as the offload
    config says -> schedulers (see the module docstring).

    Raises:
        NotImplementedError: the configured attention backend, `compute_dtype: fp8` or `parallel` cannot
            run here (with the reason).
        runnerkit.lora.LoRAError: an adapter of `lora.adapters` cannot be applied (naming its file).
    """
    config, name = runner.config, type(runner).__name__
    runner.prepare_load()
    check_parallel(config, runner.parallel, runner.PARALLEL_MODES, runner.attention_heads, name)
    head_dim = runner.attention_head_dim()
    runner.attention, runner.buckets = backend, buckets = choose(config.attention, config.text_buckets,
                                                                 runner.TEXT_BUCKETS, runner.device, runner.dtype,
                                                                 head_dim)
    logger.info("attention: {} ({}; head size {}, {})", backend.name, backend.reason, head_dim, runner.dtype)
    runner.profiler.attention = {"backend": backend.name, "reason": backend.reason, "head_dim": head_dim,
                                 "text_buckets": list(buckets.lengths), "text_buckets_reason": buckets.reason}
    runner.pipeline = pipeline = runner.describe_pipeline()
    if config.compute_dtype == "fp8":  # refused where it cannot run, before anything loads
        runner.fp8_bias_in_gemm = check_fp8_compute(pipeline, runner.device, runner.dtype, config.dtype, name)
    can = sorted(m.name for m in pipeline.modules if m.stream is not None)
    assert can == sorted(runner.STREAM_MODULES), (f"{name}.STREAM_MODULES {list(runner.STREAM_MODULES)} differs "
                                                  f"from the modules its pipeline can stream, {can}: declare them")
    runner.lora = manager_for(runner)
    runner.placement = place_modules(runner, pipeline)
    runner.schedulers = {s.name: runner.build_scheduler(s) for s in pipeline.denoise}
    if runner.lora is not None:  # every adapter of `lora.adapters` read and matched now (a bad file fails the load)
        assert config.lora is not None
        preload_adapters(runner.lora, config.lora.adapters, pipeline)


def place_modules(runner: DefaultRunner, pipeline: Pipeline) -> Placement:
    """Build every module where the offload config puts it (runners/building.py `ModuleBuilder.place`),
    with the run's installers (runners/installers.py), made here from what load chose (attention, LoRA,
    fp8); sets `runner.installers`, `runner.builder` and `runner.modules`."""
    assert runner.attention is not None, "load_modules chooses the attention backend first"
    name = type(runner).__name__
    runner.installers = installers_for(runner.config, runner.dtype, runner.attention, runner.lora,
                                       runner.fp8_bias_in_gemm, runner.parallel, name)
    runner.builder = ModuleBuilder(runner.config, runner.device, name, runner.CFG_ONE_PASS, runner.installers,
                                   runner.streamers)
    placement, runner.modules = runner.builder.place(pipeline)
    return placement


@contextmanager
def module_on_device(placement: Placement | None, name: str | None,
                     req: RequestState | None = None) -> Iterator[nn.Module | None]:
    """Module `name` on the compute device for one stage (runners/placement.py); while the block runs it
    is also `req.modules[name]`. `name` None (or nothing placed yet): yields None."""
    if name is None or placement is None:
        yield None
        return
    with placement.on_device(name) as module:
        if req is None:
            yield module
            return
        req.modules[name] = module
        try:
            yield module
        finally:
            del req.modules[name]
