"""Counting the visits of model-offloaded modules to the device (runnerkit/offload/model_offload.py) and the builds
of per-stage (`lazy_load`) ones (runnerkit/runners/placement.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from runnerkit.offload.model_offload import ModelOffloader
from runnerkit.runners.placement import Placement


def count_visits(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Visits of model-offloaded modules to the device, by name, from now on: outermost `on_device` entries (on a
    CUDA device each is one host-to-device copy; on the CPU the weights stay where they are)."""
    counts: Counter[str] = Counter()
    real = ModelOffloader.on_device

    def counting(self: ModelOffloader, name: str) -> Any:
        if self._depth[name] == 0:
            counts[name] += 1
        return real(self, name)

    monkeypatch.setattr(ModelOffloader, "on_device", counting)
    return counts


def count_builds(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Builds of per-stage (`lazy_load`) modules, by name, from now on: `Placement.on_device` entries that find the
    module not built yet (a nested entry shares the one built)."""
    counts: Counter[str] = Counter()
    real = Placement.on_device

    def counting(self: Placement, name: str) -> Any:
        if name in self.loaders and name not in self.live_per_stage:
            counts[name] += 1
        return real(self, name)

    monkeypatch.setattr(Placement, "on_device", counting)
    return counts
