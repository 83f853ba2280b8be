"""What every built module gets, as a list of installers applied in order (runners/building.py).

A module of the pipeline is built (resident, model-offloaded, streamed or per stage) and then each
installer of the run, in this order, installs its feature on it:

    1. fp8 compute      config `compute_dtype: fp8`: the transformer blocks' linear layers in E4M3
                        (runnerkit/fp8_compute.py), before anything wraps those layers
    2. LoRA slots       config `lora`: each transformer registered with the adapter manager (runnerkit/lora)
    3. attention        the backend chosen at load (runnerkit/attention.py), on every module
    4. sequence parallel config `parallel.ulysses` > 1: token sharding (runnerkit/parallel/sequence.py)
    5. compile          config `compile`: regional compilation of the blocks (runnerkit/compile.py), last,
                        so it compiles what the others installed

`installers_for` makes the run's list from the config and what load chose (the attention backend,
the LoRA manager, fp8's bias probe, the process group); an installer that does not apply to a run is
left out, and one that does not apply to a module (e.g. fp8 on a text encoder) leaves it as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar, Protocol

import torch
from loguru import logger
from torch import nn

from runnerkit import attention, fp8_compute
from runnerkit import compile as regional_compile
from runnerkit.config import CompileConfig, RunnerConfig
from runnerkit.lora import LoRAError, LoRAManager
from runnerkit.runners.pipeline import ModuleSpec, Pipeline

__all__ = ["Attention", "Fp8Compute", "Installer", "LoRASlots", "RegionalCompile", "SequenceParallel",
           "check_fp8_compute", "check_parallel", "installers_for", "preload_adapters"]


class Installer(Protocol):
    """Installs one feature on a freshly built module (`install` runs once per build)."""

    name: ClassVar[str]

    def install(self, spec: ModuleSpec, module: nn.Module) -> None: ...


@dataclass(frozen=True)
class Fp8Compute:
    """The transformer blocks' linear layers in fp8 (`ModuleSpec.fp8_skip` layers kept in the model dtype)."""

    name: ClassVar[str] = "fp8_compute"
    dtype: torch.dtype
    bias_in_gemm: bool

    def install(self, spec: ModuleSpec, module: nn.Module) -> None:
        if spec.role != "transformer" or spec.fp8_skip is None:
            return
        assert spec.blocks is not None, f"{spec.name}: fp8_skip without blocks (check_fp8_compute)"
        start = time.perf_counter()
        done, kept = fp8_compute.convert_blocks(module, spec.blocks, spec.fp8_skip, self.dtype, self.bias_in_gemm)
        logger.info("fp8 compute: {} linear layers of {} quantized in {:.2f} s; kept in {}: {}", len(done),
                    spec.name, time.perf_counter() - start, str(self.dtype).removeprefix("torch."),
                    sorted({k.split(".", 2)[-1] + f" ({v})" for k, v in kept.items()}) or "none")


@dataclass(frozen=True)
class LoRASlots:
    """Each transformer registered with the run's LoRA manager (unfused slots, or fused base copies)."""

    name: ClassVar[str] = "lora"
    manager: LoRAManager

    def install(self, spec: ModuleSpec, module: nn.Module) -> None:
        if spec.role == "transformer":
            self.manager.attach(spec.name, module)


@dataclass(frozen=True)
class Attention:
    """The attention backend chosen at load, on every attention layer of the module."""

    name: ClassVar[str] = "attention"
    backend: attention.AttentionBackend

    def install(self, spec: ModuleSpec, module: nn.Module) -> None:
        attention.install(module, self.backend)


@dataclass(frozen=True)
class SequenceParallel:
    """Ulysses token sharding over the process group (`parallel.ulysses` > 1)."""

    name: ClassVar[str] = "sequence_parallel"
    group: Any
    runner: str

    def install(self, spec: ModuleSpec, module: nn.Module) -> None:
        """Raises:
            NotImplementedError: a transformer with no `ShardsSequence` inside it."""
        from runnerkit.parallel import sequence

        if sequence.install(module, sequence.SequenceParallel(self.group)) == 0 and spec.role == "transformer":
            raise NotImplementedError(f"`parallel.ulysses`: transformer {spec.name!r} of {self.runner} "
                                      "does not shard its tokens (no ShardsSequence inside it)")


@dataclass(frozen=True)
class RegionalCompile:
    """Regional compilation of the module's blocks (`ModuleSpec.blocks`) and of its declared regions
    (`COMPILED_REGIONS`, runnerkit/compile.py); a no-op when compile is off."""

    name: ClassVar[str] = "compile"
    config: CompileConfig

    def install(self, spec: ModuleSpec, module: nn.Module) -> None:
        regional_compile.install(module, spec.blocks, self.config)


def installers_for(config: RunnerConfig, dtype: torch.dtype, backend: attention.AttentionBackend,
                   lora: LoRAManager | None, fp8_bias_in_gemm: bool, parallel: Any,
                   runner: str) -> tuple[Installer, ...]:
    """The run's installers, in the order they apply (see the module docstring).

    Args:
        backend: the attention backend chosen at load.
        lora: the run's LoRA manager (None without config `lora`).
        fp8_bias_in_gemm: whether torch takes the bias in the fp8 GEMM (`check_fp8_compute`).
        parallel: this rank's process group (None: one process).
        runner: the runner class's name, for messages.
    """
    out: list[Installer] = []
    if config.compute_dtype == "fp8":
        out.append(Fp8Compute(dtype, fp8_bias_in_gemm))
    if lora is not None:
        out.append(LoRASlots(lora))
    out.append(Attention(backend))
    if parallel is not None and parallel.ulysses > 1:
        out.append(SequenceParallel(parallel, runner))
    out.append(RegionalCompile(config.compile))
    return tuple(out)


def check_fp8_compute(pipeline: Pipeline, device: torch.device, dtype: torch.dtype, dtype_name: str,
                      runner: str) -> bool:
    """`compute_dtype: fp8`: refuse it where it cannot run, before anything loads; else whether the bias
    goes into the fp8 GEMM (`fp8_compute.probe`, one tiny matmul on the device).

    Raises:
        NotImplementedError: no transformer of the pipeline declares its blocks for fp8 compute
            (`ModuleSpec.fp8_skip` None), or the device or torch cannot (with the probe's reason).
    """
    declared = [m.name for m in pipeline.modules if m.role == "transformer" and m.fp8_skip is not None
                and m.blocks is not None]
    if not declared:
        raise NotImplementedError(f"`compute_dtype`='fp8': {runner} does not declare which of its "
                                  "transformer's block layers may compute in fp8; use `compute_dtype`='same'")
    why, bias_in_gemm = fp8_compute.probe(device, dtype)
    if why is not None:
        raise NotImplementedError(f"`compute_dtype`='fp8' cannot run on {device} with `dtype`="
                                  f"{dtype_name!r}: {why}; use `compute_dtype`='same'")
    logger.info("fp8 compute: block linear layers of {} in E4M3 (rowwise scales) via torch._scaled_mm on {}, "
                "bias {}", declared, device, "in the GEMM" if bias_in_gemm else "added after")
    return bias_in_gemm


def preload_adapters(manager: LoRAManager, adapters: Mapping[str, str], pipeline: Pipeline) -> None:
    """Read and match every named adapter of the config's `lora.adapters` at load, one at a time:
    a missing or unusable file fails the load (naming it) instead of the first request that names
    it, and the parsed adapters are cached (`LoRAManager.read`, up to `ADAPTER_CACHE_SIZE`), so the
    first request with one does not read it from disk; in fused mode the base copies of the layers
    they cover are taken now (`LoRAManager.prepare`), not by the first request.

    Raises:
        runnerkit.lora.LoRAError: naming the adapter's file and what is wrong with it.
    """
    for name, path in adapters.items():
        try:
            manager.prepare(((path, 1.0),))  # matched now; fused: the base copies too
        except LoRAError as exc:
            raise LoRAError(f"`lora.adapters.{name}`: {exc}") from exc
    unbuilt = [m.name for m in pipeline.modules if m.role == "transformer" and m.name not in manager.targets]
    if adapters and unbuilt:  # unload_modules: no transformer exists between requests
        logger.warning("`lora.adapters` {} were read but not matched to {}: under `unload_modules` the transformer "
                       "is first built by a request, so an adapter that does not fit it fails that request (then "
                       "every later submission is checked)", sorted(adapters), unbuilt)


def check_parallel(config: RunnerConfig, group: Any, modes: Collection[str], attention_heads: Callable[[], int],
                   runner: str) -> None:
    """Refuse a `parallel` config the runner cannot serve (at load, after `prepare_load`).

    Args:
        group: the attached process group (None: not under torchrun).
        modes: the parallel modes the runner supports (`PARALLEL_MODES`).
        attention_heads: the transformer's attention heads (asked only under Ulysses).

    Raises:
        ParallelSetupError: `parallel` is set but no process group is attached (not under torchrun).
        NotImplementedError: a mode the family does not support, or heads that do not divide by `ulysses`.
    """
    par = config.parallel
    if par is None:
        return
    from runnerkit.parallel.group import ParallelSetupError, split_even

    if group is None:
        raise ParallelSetupError("`parallel` is set but this runner has no process group: launch with "
                                 f"`torchrun --nproc_per_node {par.world_size} -m runnerkit.infer ...`")
    check_parallel_modes(config, modes, runner)
    if par.ulysses > 1:
        split_even(attention_heads(), par.ulysses, "the attention heads", "each rank attends with its share "
                   "of the heads")


def check_parallel_modes(config: RunnerConfig, modes: Collection[str], runner: str) -> None:
    """Refuse a `parallel` mode the runner does not support (`PARALLEL_MODES`); the launch script calls it
    before any process group exists, `check_parallel` again at load.

    Raises:
        NotImplementedError: naming the runner, the task, the modes asked and those supported.
    """
    par = config.parallel
    if par is None:
        return
    asked = [m for m, on in (("cfg", par.cfg > 1), ("ulysses", par.ulysses > 1)) if on]
    unsupported = [m for m in asked if m not in modes]
    if unsupported:
        raise NotImplementedError(f"`parallel`: {runner} (task {config.task!r}) does not support "
                                  f"{unsupported} parallel (supported: {sorted(modes)})")
