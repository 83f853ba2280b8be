"""Where each pipeline module lives between its stages (ARCHITECTURE §4, model level).

A runner asks `placement.on_device(name)` around a stage and gets the module on the compute
device for the length of the `with` block:

- resident: the module is always on the device (offload mode none; the streamed transformer).
- offloaded: the module lives in (pinned) host memory and visits the device for its stage
  (`ModelOffloader`), and is back in host memory in `finally`.
- per stage: the module is built by its loader for the stage and dropped after (unload_modules,
  and lazy_load for the transformer), with its teardown (e.g. closing a streamer) and a
  pressure-aware cache cleanup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from loguru import logger
from torch import nn

from runnerkit import memory
from runnerkit.offload.model_offload import ModelOffloader
from runnerkit.runners.pipeline import DenoiseStage

#: builds a module for one stage; returns it and its teardown.
Loader = Callable[[], tuple[nn.Module, Callable[[], None]]]


class Placement:
    """Resident, model-offloaded and per-stage modules, by stage name."""

    def __init__(self, device: torch.device, resident: dict[str, nn.Module] | None = None,
                 offloaded: dict[str, nn.Module] | None = None, loaders: dict[str, Loader] | None = None,
                 pin_memory: bool = True, empty_cache_min_free_gib: float = 2.0,
                 empty_cache_min_reclaimable_gib: float = 16.0) -> None:
        self.device = device
        self.resident_modules = dict(resident or {})
        self.loaders = dict(loaders or {})
        self.offloader = ModelOffloader(offloaded, device, pin_memory) if offloaded else None
        names = [*self.resident_modules, *self.loaders, *(self.offloader.modules if self.offloader else {})]
        dup = {n for n in names if names.count(n) > 1}
        assert not dup, f"modules placed twice: {sorted(dup)}"
        self._thresholds = (empty_cache_min_free_gib, empty_cache_min_reclaimable_gib)
        self.live_per_stage: dict[str, nn.Module] = {}

    def names(self) -> set[str]:
        return {*self.resident_modules, *self.loaders, *(self.offloader.modules if self.offloader else {})}

    @contextmanager
    def on_device(self, name: str) -> Iterator[nn.Module]:
        """The module `name` on the compute device for the `with` block. Nested blocks for the same name
        share one copy (a visiting module is copied once, a per-stage one built once).

        Raises:
            KeyError: unknown `name` (lists the known ones).
        """
        if name in self.resident_modules:
            yield self.resident_modules[name]
        elif self.offloader is not None and name in self.offloader.modules:
            with self.offloader.on_device(name) as module:
                yield module
        elif name in self.live_per_stage:  # nested (held across stages): the module already built
            yield self.live_per_stage[name]
        elif name in self.loaders:
            module, teardown = self.loaders[name]()
            self.live_per_stage[name] = module
            try:
                yield module
            finally:
                del self.live_per_stage[name]
                memory.synchronize(self.device)
                teardown()
                del module
                memory.maybe_empty_cache(self.device, f"drop per-stage {name}", *self._thresholds, collect_garbage=True)
                logger.debug("per-stage module {} dropped", name)
        else:
            raise KeyError(f"no module {name!r} in this pipeline; known: {sorted(self.names())}")

    def on_device_now(self) -> set[str]:
        """Offloaded or per-stage modules currently on the device (empty between stages)."""
        now = set(self.live_per_stage)
        if self.offloader is not None:
            now |= self.offloader.resident()
        return now


def spans_across_stages(stages: Sequence[DenoiseStage]) -> dict[str, tuple[int, int]]:
    """Transformer name -> (first, last) index of a run of two or more consecutive denoising stages that
    use it (`DenoiseStage.transformers`): the module `held_across_stages` keeps on the device from the start
    of the first to the end of the last (through the transitions between them). A name in two separate runs
    keeps the first."""
    spans: dict[str, tuple[int, int]] = {}
    for i, stage in enumerate(stages):
        for name in stage.transformers:
            if name not in spans:
                spans[name] = (i, i)
            elif spans[name][1] == i - 1:  # the run goes on
                spans[name] = (spans[name][0], i)
    return {n: s for n, s in spans.items() if s[1] > s[0]}


@contextmanager
def held_across_stages(stages: Sequence[DenoiseStage], keep: bool,
                       placement: Placement | None) -> Iterator[Callable[[int], None]]:
    """`offload.keep_across_stages`: yields `at(index)`, to be called before denoising stage `index` (and its
    transition) starts; it releases the holds whose run of stages has ended and puts on the device the
    transformers whose run starts there (`spans_across_stages`), so a visiting transformer is copied once for
    the run and a per-stage (lazy_load) one built once; the stages' own `on_device` nest inside the hold.
    Everything held is released when the block ends (also on an error). `keep` False or no placement: `at`
    does nothing."""
    spans = spans_across_stages(stages) if keep and placement is not None else {}
    holds: dict[str, ExitStack] = {}

    def at(index: int) -> None:
        for name in [n for n in holds if spans[n][1] < index]:
            holds.pop(name).close()
        for name, (first, _) in spans.items():
            if first == index and name not in holds:
                assert placement is not None
                hold = ExitStack()
                hold.enter_context(placement.on_device(name))
                holds[name] = hold
                logger.debug("{} held on the device through stages {}..{}", name, *spans[name])

    try:
        yield at
    finally:
        for hold in holds.values():
            hold.close()
