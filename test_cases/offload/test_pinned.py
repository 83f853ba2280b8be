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


class FakeDriver:
    """Page-locked host ranges as a CUDA driver would know them, for a CPU-only torch: cudaHostRegister
    and torch's pinned allocator (`torch.empty(..., pin_memory=True)`) lock a range (`fail` makes
    either refuse); `torch.Tensor.is_pinned` answers from the locked ranges, as the driver's
    pointer query would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: tuple[str, ...] = ()) -> None:
        self.locked: list[tuple[int, int]] = []
        self.fail = fail
        real_empty = torch.empty

        def empty(*size: int, pin_memory: bool = False, **kw: object) -> torch.Tensor:
            tensor = real_empty(*size, **kw)
            if pin_memory:
                if "pin" in fail:
                    raise RuntimeError("CUDA error: out of memory (fake)")
                self.locked.append((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()))
            return tensor

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, device=None: any(
            lo <= t.data_ptr() < hi for lo, hi in self.locked))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self)
        monkeypatch.setattr(pinned_mod, "_clear_cuda_last_error", lambda: None)
        monkeypatch.delenv("RUNNERKIT_DISABLE_PINNED", raising=False)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if "register" in self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.locked.append((ptr, ptr + size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.locked = [r for r in self.locked if r[0] != ptr]
        return 0


@pytest.mark.parametrize("fail, kind, pinned", [
    ((), "registered", True),
    (("register",), "pinned", True),  # torch's pinned allocator: page-locked too, copies may be async
    (("register", "pin"), "pageable", False),
], ids=["registered", "torch_pinned", "pageable"])
def test_is_pinned_matches_the_memory_the_driver_locked(monkeypatch: pytest.MonkeyPatch, fail: tuple[str, ...],
                                                        kind: str, pinned: bool) -> None:
    """`HostSlab.is_pinned` (which decides whether H2D copies are issued asynchronously) agrees with
    what the (fake) driver says about the buffer, on every step of the fallback chain."""
    FakeDriver(monkeypatch, fail)
    slab = HostSlab(5000)
    assert slab.kind == kind
    assert slab.buffer.is_pinned() is pinned  # the driver's view
    assert slab.is_pinned is pinned  # the slab's own report agrees
    view = slab.view(256, torch.float32, (4,))
    assert view.is_pinned() is pinned  # views handed to copies too
    slab.release()  # a registered range is unlocked; torch's pinned block stays locked while views live
    assert slab.is_pinned is view.is_pinned()


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


class ChunkDriver(FakeDriver):
    """`FakeDriver` that records every register/unregister call and can refuse the `fail_at`-th
    register call (1-based) with an error code, or raise there (`raise_at`), as a driver would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None, raise_at: int | None = None,
                 fail: tuple[str, ...] = ()) -> None:
        super().__init__(monkeypatch, fail)
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at, self.raise_at = fail_at, raise_at

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        n = sum(1 for c in self.calls if c[0] == "register")
        if n == self.raise_at:
            raise RuntimeError("driver gone (fake)")
        if n == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        return super().cudaHostRegister(ptr, size, flags)

    def cudaHostUnregister(self, ptr: int) -> int:
        size = next((hi - lo for lo, hi in self.locked if lo == ptr), -1)
        self.calls.append(("unregister", ptr, size))
        return super().cudaHostUnregister(ptr)


CHUNK = 3 * 4096


def test_a_large_slab_is_registered_in_bounded_chunks_and_all_unregistered_on_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", CHUNK)
    driver = ChunkDriver(monkeypatch)
    nbytes = 10 * 4096 + 100
    slab = HostSlab(nbytes)
    base = slab.buffer.data_ptr()
    sizes = [CHUNK, CHUNK, CHUNK, nbytes - 3 * CHUNK]
    starts = [base + sum(sizes[:i]) for i in range(4)]
    assert driver.calls == [("register", p, n) for p, n in zip(starts, sizes)]  # one call per chunk, in order
    assert slab.kind == "registered" and slab.is_pinned and slab.chunks == list(zip(starts, sizes))
    assert slab.buffer.numel() == nbytes  # still one contiguous buffer of the exact size
    assert all(slab.view(off, torch.uint8, (1,)).is_pinned() for off in (0, CHUNK, 3 * CHUNK, nbytes - 1))
    slab.release()
    assert driver.calls[4:] == [("unregister", p, n) for p, n in reversed(list(zip(starts, sizes)))]
    assert driver.locked == [] and slab.chunks == []


def test_a_slab_dropped_without_release_unregisters_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", CHUNK)
    driver = ChunkDriver(monkeypatch)
    slab = HostSlab(2 * CHUNK + 1)
    assert len(driver.locked) == 3
    del slab
    gc.collect()
    assert driver.locked == [] and [c[0] for c in driver.calls] == ["register"] * 3 + ["unregister"] * 3


@pytest.mark.parametrize("how", ["error_code", "raises"])
@pytest.mark.parametrize("pin_ok", [True, False], ids=["then_pinned", "then_pageable"])
def test_a_chunk_failing_in_the_middle_unregisters_the_chunks_before_it_and_falls_back(
        monkeypatch: pytest.MonkeyPatch, how: str, pin_ok: bool) -> None:
    """No slab is part page-locked: the driver holds no registered range afterwards, and the slab is
    pinned (torch's allocator: one locked block) or pageable as a whole, which decides the copy engine."""
    from runnerkit.offload import make_copy_engine
    from runnerkit.offload.streams import SyncCopyEngine

    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", CHUNK)
    driver = ChunkDriver(monkeypatch, fail=() if pin_ok else ("pin",),
                         **({"fail_at": 3} if how == "error_code" else {"raise_at": 3}))
    nbytes = 5 * CHUNK
    slab = HostSlab(nbytes)
    registers = [c for c in driver.calls if c[0] == "register"]
    assert len(registers) == 3  # the third chunk failed: the last two were never tried
    assert driver.calls[3:] == [("unregister", registers[1][1], CHUNK), ("unregister", registers[0][1], CHUNK)]
    assert slab.chunks == [] and slab.buffer.numel() == nbytes
    if pin_ok:
        assert slab.kind == "pinned" and slab.is_pinned
        assert driver.locked == [(slab.buffer.data_ptr(), slab.buffer.data_ptr() + nbytes)]  # the pinned block only
    else:
        assert slab.kind == "pageable" and not slab.is_pinned and driver.locked == []
        assert not slab.buffer.is_pinned() and not slab.view(nbytes - 1, torch.uint8, (1,)).is_pinned()
        assert isinstance(make_copy_engine("cuda", 2, source_pinned=slab.is_pinned), SyncCopyEngine)
    slab.release()
    assert [c[0] for c in driver.calls].count("unregister") == 2  # release unregisters nothing more


def test_register_chunks_refuses_a_chunk_size_below_one() -> None:
    with pytest.raises(ValueError, match="`chunk_bytes` must be >= 1, got 0"):
        pinned_mod.register_chunks(0, 10, 0)


def test_a_copy_from_a_chunked_slab_is_split_at_the_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA rejects one copy spanning two `cudaHostRegister` ranges ("invalid argument", seen on the
    H200 with 0.42 GiB staging slabs in 256 MiB chunks): `copy_h2d` issues one copy per chunk spanned,
    each inside one chunk, and together they move every byte."""
    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", CHUNK)
    ChunkDriver(monkeypatch)
    nbytes = 2 * CHUNK + 1000
    slab = HostSlab(nbytes)
    slab.buffer.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    base = slab.buffer.data_ptr()
    copies: list[tuple[int, int]] = []
    real_copy = torch.Tensor.copy_

    def spy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append((src.data_ptr() - base, src.numel() * src.element_size()))
        return real_copy(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    src = slab.view(100, torch.bfloat16, ((nbytes - 200) // 2,))  # starts inside chunk 1, ends in chunk 3
    dst = torch.empty_like(src)
    assert pinned_mod.copy_h2d(dst, src, True) == 3
    assert copies == [(100, CHUNK - 100), (CHUNK, CHUNK), (2 * CHUNK, nbytes - 200 + 100 - 2 * CHUNK)]
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    copies.clear()
    inside = slab.view(CHUNK, torch.uint8, (CHUNK,))  # exactly chunk 2: one copy
    assert pinned_mod.copy_h2d(torch.empty_like(inside), inside, True) == 1 and copies == [(CHUNK, CHUNK)]
    slab.release()
    copies.clear()
    assert pinned_mod.chunk_cuts(base, nbytes) == []  # released chunks are forgotten


def test_a_deferred_slab_is_registered_only_by_pin_and_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`defer_pinning=True`: an untouched page-aligned mapping, pageable and not registered until `pin()`, which
    registers it in chunks with its contents and address unchanged; a second `pin()` does nothing, `release()`
    unregisters every chunk, and a slab released before `pin()` is never registered."""
    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", CHUNK)
    driver = ChunkDriver(monkeypatch)
    nbytes = 2 * CHUNK + 100
    slab = HostSlab(nbytes, defer_pinning=True)
    assert driver.calls == [] and slab.kind == "pageable" and not slab.is_pinned and slab.pin_pending
    base = slab.buffer.data_ptr()
    assert base % 4096 == 0 and slab.buffer.numel() == nbytes and not slab.buffer.is_pinned()
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    view = slab.view(0, torch.uint8, (nbytes,))
    view.copy_(data)
    assert slab.pin() == "registered"
    assert driver.calls == [("register", base, CHUNK), ("register", base + CHUNK, CHUNK),
                            ("register", base + 2 * CHUNK, 100)]
    assert slab.chunks == [(base, CHUNK), (base + CHUNK, CHUNK), (base + 2 * CHUNK, 100)] and not slab.pin_pending
    assert slab.is_pinned and view.is_pinned() and slab.buffer.data_ptr() == base and torch.equal(view, data)
    assert slab.pin() == "registered" and len(driver.calls) == 3
    slab.release()
    assert [c[0] for c in driver.calls[3:]] == ["unregister"] * 3 and driver.locked == []
    assert slab.pin() == "pageable" and len(driver.calls) == 6
    unfilled = HostSlab(CHUNK, defer_pinning=True)
    unfilled.release()  # released before it was pinned: nothing left to register
    assert unfilled.pin() == "pageable" and not unfilled.pin_pending and len(driver.calls) == 6


@pytest.mark.parametrize("why", ["env", "argument", "no_mapping"])
def test_a_deferred_slab_without_pinning_is_pageable_and_pin_does_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                          why: str) -> None:
    """Pinning switched off (env, `pin_memory=False`) or no anonymous mapping to register later: a pageable slab
    at once, no driver call now or at `pin()`, and torch's pinned allocator is not tried."""
    import mmap

    driver = ChunkDriver(monkeypatch)
    if why == "env":
        monkeypatch.setenv("RUNNERKIT_DISABLE_PINNED", "1")
    if why == "no_mapping":
        def refuse(*args: object) -> None:
            raise OSError(12, "Cannot allocate memory (fake)")

        monkeypatch.setattr(mmap, "mmap", refuse)
    slab = HostSlab(5000, pin_memory=why != "argument", defer_pinning=True)
    assert slab.kind == "pageable" and not slab.pin_pending and slab.buffer.numel() == 5000
    assert slab.pin() == "pageable" and not slab.is_pinned
    assert driver.calls == [] and driver.locked == []  # FakeDriver locks torch's pinned allocations too
