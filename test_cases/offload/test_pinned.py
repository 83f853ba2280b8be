"""HostSlab: exact size, fallback chain (register -> pin -> pageable), env switch, non-overlapping views."""

from __future__ import annotations

import pytest
import torch

from runnerkit.offload import HostSlab, align_up, plan_offsets, typed_view
from runnerkit.offload import pinned as pinned_mod


class FakeCudart:
    def __init__(self, register_code: int) -> None:
        self.register_code = register_code
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.register_code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[bool]]:
    """Pretend CUDA exists; pinned allocations become plain ones (CPU-only torch cannot pin)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RUNNERKIT_DISABLE_PINNED", raising=False)
    pins: list[int] = []
    monkeypatch.setattr(HostSlab, "_try_pin",
                        staticmethod(lambda n: pins.append(n) or torch.empty(n, dtype=torch.uint8)))
    clears: list[bool] = []
    monkeypatch.setattr(pinned_mod, "_clear_cuda_last_error", lambda: clears.append(True))
    return pins, clears


def test_exact_size_pageable_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    slab = HostSlab(1000, pin_memory=True)
    assert slab.buffer.numel() == 1000 and slab.buffer.dtype == torch.uint8
    assert slab.kind == "pageable" and not slab.is_pinned
    assert HostSlab(0).buffer.numel() == 0
    with pytest.raises(ValueError, match="`nbytes` must be >= 0, got -1"):
        HostSlab(-1)


def test_registered_first_exact_size_and_release(fake_cuda: tuple[list[int], list[bool]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pins, clears = fake_cuda
    cudart = FakeCudart(register_code=0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slab = HostSlab(3 * 4096 + 17)
    assert slab.kind == "registered" and slab.is_pinned and pins == [] and clears == []
    assert cudart.calls == [("register", slab.buffer.data_ptr(), 3 * 4096 + 17, 0)]  # exact, no rounding
    assert slab.buffer.data_ptr() % 4096 == 0  # page-aligned mapping
    ptr = slab.buffer.data_ptr()
    slab.release()
    slab.release()
    assert cudart.calls[1:] == [("unregister", ptr)]
    assert slab.kind == "pageable" and slab.buffer is None
    with pytest.raises(ValueError, match="released"):
        slab.view(0, torch.float32, (1,))


def test_failed_register_falls_back_to_pin_and_clears_error(fake_cuda: tuple[list[int], list[bool]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pins, clears = fake_cuda
    cudart = FakeCudart(register_code=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    slab = HostSlab(5000)
    assert slab.kind == "pinned" and pins == [5000] and clears == [True]
    assert slab.buffer.numel() == 5000


def test_failed_pin_falls_back_to_pageable(fake_cuda: tuple[list[int], list[bool]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(register_code=1))

    def fail(n: int) -> None:
        return None

    monkeypatch.setattr(HostSlab, "_try_pin", staticmethod(fail))
    assert HostSlab(64).kind == "pageable"


@pytest.mark.parametrize("how", ["env", "argument"])
def test_pinning_disabled(fake_cuda: tuple[list[int], list[bool]], monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    pins, _ = fake_cuda
    cudart = FakeCudart(register_code=0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    if how == "env":
        monkeypatch.setenv("RUNNERKIT_DISABLE_PINNED", "1")
    slab = HostSlab(4096, pin_memory=how != "argument")
    assert slab.kind == "pageable" and not slab.is_pinned
    assert cudart.calls == [] and pins == []


def test_plan_offsets_exact_and_views_disjoint() -> None:
    sizes = [10, 300, 0, 256, 5]
    offsets, total = plan_offsets(sizes)
    assert offsets == [0, 256, 768, 768, 1024]
    assert total == sum(align_up(s) for s in sizes) == 1280
    slab = HostSlab(total)
    views = [slab.view(off, torch.uint8, (n,)) for off, n in zip(offsets, sizes)]
    for i, v in enumerate(views):
        v.fill_(i + 1)
    for i, v in enumerate(views):
        assert torch.all(v == i + 1)
    spans = sorted((off, off + n) for off, n in zip(offsets, sizes) if n)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    f = slab.view(256, torch.float32, (5, 3))
    assert f.shape == (5, 3) and f.data_ptr() == slab.buffer.data_ptr() + 256
    with pytest.raises(ValueError, match="not a multiple"):
        typed_view(slab.buffer, 2, torch.float32, (1,))
    with pytest.raises(ValueError, match="does not fit"):
        typed_view(slab.buffer, 1024, torch.float32, (100,))
    with pytest.raises(ValueError, match=r"`sizes\[1\]` must be >= 0"):
        plan_offsets([1, -2])
