"""Copy engines: factory choice, synchronous copies from pageable memory, byte counters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runnerkit.offload import SyncCopyEngine, make_copy_engine
from test_cases.offload._toy import build_streamed, make_reference, state_dict_of, write_checkpoint


@pytest.mark.parametrize("device,pinned", [("cpu", True), ("cpu", False), ("cuda", False)])
def test_factory_picks_sync_without_cuda_or_pinning(device: str, pinned: bool) -> None:
    assert isinstance(make_copy_engine(device, 2, source_pinned=pinned), SyncCopyEngine)


@pytest.mark.parametrize("storage", ["host", "mmap", "pread"])
def test_no_non_blocking_copy_with_pinning_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, storage: str) -> None:
    sd = state_dict_of(make_reference(seed=5))
    files = write_checkpoint(sd, tmp_path)
    model, streamer = build_streamed(sd, "phase", storage, 3, 2, files=files, pin_memory=True)  # no CUDA: pageable
    calls: list[bool] = []
    orig = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        calls.append(non_blocking)
        return orig(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    with torch.no_grad():
        model(torch.randn(1, 2, 8))
    assert isinstance(streamer.engine, SyncCopyEngine)
    assert len(calls) >= 12 and not any(calls)


def test_sync_engine_counts_bytes() -> None:
    engine = SyncCopyEngine(2)
    dst, src = torch.empty(1000, dtype=torch.uint8), torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    engine.h2d(1, dst, src)
    assert torch.equal(dst, src)
    stats = engine.stats()
    assert stats["copies"] == 1 and stats["bytes"] == 1000 and stats["seconds"] >= 0
    assert engine.in_flight() == 0
