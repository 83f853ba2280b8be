"""Regional compilation: the transformer's repeated block, compiled once and shared (issue 11, item 1).

`compile_blocks(model, blocks_attr, cfg)` replaces the `forward` of every block in
`model.<blocks_attr>` with one `torch.compile`d function per (block class, mode, dynamic,
backend), called with the block as its first argument. So:

- the graph is traced once and reused by every block of the model, every MoE expert of the same
  architecture, and the transformer rebuilt per request under lazy load (parameters are graph
  inputs: `torch._dynamo.config.inline_inbuilt_nn_modules`, on by default since torch 2.5);
- the block's own `__call__` stays eager: the forward hooks of block/phase/disk streaming run
  outside the compiled region, exactly as without compile, and only the block's math is compiled;
- one code path: warmup and requests call the same blocks, so warmup's two shapes are where the
  compilation happens.

Dynamic shapes (`compile.dynamic`): false = torch's automatic dynamic: the first shape compiles
static; a later call where a dimension differs recompiles once with that dimension dynamic, and
later calls that differ only in dynamic dimensions compile nothing. With the two warmup shapes
of a family (which differ in every spatial/temporal size) every token-count dimension is dynamic
after warmup. true = dynamic from the first compile.

Not supported (refused at start with the reason, `check_supported`): `mode` "reduce-overhead"
(CUDA graphs) with block/phase streaming, whose weights change addresses every step.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from loguru import logger
from torch import nn

from runnerkit.config import CompileConfig, OffloadConfig

_COMPILED: dict[tuple[type, str, bool, str], Callable[..., Any]] = {}


def check_supported(cfg: CompileConfig, offload: OffloadConfig) -> None:
    """Refuse combinations regional compile cannot serve.

    Raises:
        NotImplementedError: with the reason.
    """
    if not cfg.enabled:
        return
    if offload.mode == "phase":
        raise NotImplementedError(
            "`compile.enabled` with `offload.mode`='phase': the phase hooks run inside a block's forward, which "
            "regional compile traces as one graph; use offload mode 'block' (its hooks stay outside) or 'none'")
    if cfg.mode == "reduce-overhead" and offload.mode in ("block", "phase"):
        raise NotImplementedError(
            f"`compile.mode`='reduce-overhead' (CUDA graphs) cannot run with `offload.mode`={offload.mode!r}: "
            "streamed weights change addresses every step, which a captured graph cannot follow; use mode "
            "'default' or 'max-autotune-no-cudagraphs'")


def compiled_forward(block_cls: type, cfg: CompileConfig) -> Callable[..., Any]:
    """The one compiled `forward` of `block_cls` for `cfg` (created on first use, then shared)."""
    key = (block_cls, cfg.mode, cfg.dynamic, cfg.backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(block_cls.forward, mode=None if cfg.backend != "inductor" else cfg.mode,
                                       dynamic=True if cfg.dynamic else None, backend=cfg.backend)
    return _COMPILED[key]


def compile_blocks(model: nn.Module, blocks_attr: str, cfg: CompileConfig) -> int:
    """Route every block of `model.<blocks_attr>` through the shared compiled forward; returns the count.

    Raises:
        TypeError: `model.<blocks_attr>` is not an `nn.ModuleList` (a family declaration bug).
    """
    blocks = getattr(model, blocks_attr)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}.{blocks_attr} must be an nn.ModuleList to compile its blocks")
    for block in blocks:
        fn = compiled_forward(type(block), cfg)
        block.forward = types.MethodType(fn, block)
    return len(blocks)


def recompile_state() -> tuple[int, list[str]]:
    """(recompilations, the reasons torch gave for them) of every compiled block forward so far:
    graphs beyond the first in each forward's dynamo cache, and the guard failures torch recorded
    for it (one per cached graph it could not reuse)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.utils import guard_failures
    except ImportError:  # pragma: no cover - very old torch
        return 0, []
    recompiles, reasons = 0, []
    for block_cls in {key[0] for key in _COMPILED}:
        code = block_cls.forward.__code__
        recompiles += max(len(_debug_get_cache_entry_list(code)) - 1, 0)
        reasons += [f"{block_cls.__name__}: {r}" for r in guard_failures.get(code, [])]
    return recompiles, reasons


@functools.cache
def _announce(cfg: CompileConfig) -> None:
    logger.info("compile: regional (one compiled forward per block class), mode {}, dynamic {}, backend {}", cfg.mode,
                "from the first compile" if cfg.dynamic else "automatic", cfg.backend)


def install(model: nn.Module, blocks_attr: str | None, cfg: CompileConfig) -> None:
    """`compile_blocks` when `cfg.enabled` and the module names its blocks; logs once per config."""
    if cfg.enabled and blocks_attr is not None:
        _announce(cfg)
        t0 = time.perf_counter()
        n = compile_blocks(model, blocks_attr, cfg)
        logger.debug("compile: {} blocks of {} routed in {:.3f} s", n, type(model).__name__, time.perf_counter() - t0)
