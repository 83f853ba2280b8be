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

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from loguru import logger
from torch import nn

from runnerkit import memory
from runnerkit.offload.model_offload import ModelOffloader

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
        """The module `name` on the compute device for the `with` block.

        Raises:
            KeyError: unknown `name` (lists the known ones).
        """
        if name in self.resident_modules:
            yield self.resident_modules[name]
        elif self.offloader is not None and name in self.offloader.modules:
            with self.offloader.on_device(name) as module:
                yield module
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
