"""Copy engines: factory choice, synchronous copies from pageable memory, byte counters; the CUDA
engine's event protocol on the CPU (fake streams and events, see `_fake_cuda.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runnerkit.offload import CudaCopyEngine, SyncCopyEngine, make_copy_engine
from test_cases.offload._fake_cuda import TIMING, FakeCuda, check_slot_protocol
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


def _fake_engine(monkeypatch: pytest.MonkeyPatch, num_slots: int, units: int) -> tuple[FakeCuda, CudaCopyEngine,
                                                                                          list[torch.Tensor],
                                                                                          list[torch.Tensor]]:
    """The real CudaCopyEngine over fake streams/events, CPU slot buffers and one source per unit."""
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    engine = CudaCopyEngine("cuda", num_slots)
    cuda.name_engine_events(engine)
    slots = [torch.empty(8, dtype=torch.uint8) for _ in range(num_slots)]
    sources = [torch.full((8,), u, dtype=torch.uint8) for u in range(units)]
    slot_ptr = {t.data_ptr(): s for s, t in enumerate(slots)}
    unit_ptr = {t.data_ptr(): u for u, t in enumerate(sources)}
    cuda.copy_label = lambda dst, src: f"slot{slot_ptr[dst.data_ptr()]} unit{unit_ptr[src.data_ptr()]}"
    return cuda, engine, slots, sources


def test_cuda_copy_engine_event_order_with_slot_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real engine on fake CUDA streams: 4 units over 2 slots, the streamer's call pattern
    (copy j, compute waits, prefetch j+1, compute, mark done). Each slot is reused once."""
    cuda, engine, slots, sources = _fake_engine(monkeypatch, num_slots=2, units=4)

    def compute(unit: int) -> None:
        cuda.launch("compute", f"slot{unit % 2} unit{unit}")

    engine.h2d(0, slots[0], sources[0])
    for j in range(4):
        engine.wait_copy(j % 2)
        if j + 1 < 4:
            engine.h2d((j + 1) % 2, slots[(j + 1) % 2], sources[j + 1])
        compute(j)
        engine.mark_compute_done(j % 2)
    engine.reset()

    assert cuda.protocol() == [
        ("copy", "copy", "slot0 unit0"), ("record", "copy", "copy_done[0]"),
        ("wait", "compute", "copy_done[0]"),
        ("copy", "copy", "slot1 unit1"), ("record", "copy", "copy_done[1]"),  # first use of slot 1: no wait
        ("compute", "compute", "slot0 unit0"), ("record", "compute", "compute_done[0]"),
        ("wait", "compute", "copy_done[1]"),
        ("wait", "copy", "compute_done[0]"),  # slot 0 reused: the copy waits for unit 0's compute
        ("copy", "copy", "slot0 unit2"), ("record", "copy", "copy_done[0]"),
        ("compute", "compute", "slot1 unit1"), ("record", "compute", "compute_done[1]"),
        ("wait", "compute", "copy_done[0]"),
        ("wait", "copy", "compute_done[1]"),  # slot 1 reused after unit 1's compute
        ("copy", "copy", "slot1 unit3"), ("record", "copy", "copy_done[1]"),
        ("compute", "compute", "slot0 unit2"), ("record", "compute", "compute_done[0]"),
        ("wait", "compute", "copy_done[1]"),
        ("compute", "compute", "slot1 unit3"), ("record", "compute", "compute_done[1]"),
        ("stream_sync", "copy"), ("host_sync", "compute_done[0]"), ("host_sync", "compute_done[1]"),  # reset
    ]
    # every copy is bracketed by its timing events on the copy stream
    first = cuda.calls[:4]
    assert first == [("record", "copy", TIMING), ("copy", "copy", "slot0 unit0"), ("record", "copy", TIMING),
                     ("record", "copy", "copy_done[0]")]
    assert check_slot_protocol(cuda.ops, lambda label: label.split()[0], lambda label: label.split()[1]) == 4
    assert [int(s[0]) for s in slots] == [2, 3]
    stats = engine.stats()
    assert stats["copies"] == 4 and stats["bytes"] == 32 and stats["seconds"] == pytest.approx(0.004)


def test_cuda_copy_engine_host_wait_and_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, engine, slots, sources = _fake_engine(monkeypatch, num_slots=3, units=2)
    engine.wait_copy(1)
    engine.wait_copy_host(1)  # nothing copied into slot 1 yet: no wait at all
    engine.h2d(1, slots[1], sources[0])
    engine.wait_copy_host(1)
    assert engine.in_flight() == 0  # the fake events report completion
    assert cuda.protocol() == [("copy", "copy", "slot1 unit0"), ("record", "copy", "copy_done[1]"),
                               ("host_sync", "copy_done[1]")]
