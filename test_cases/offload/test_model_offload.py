"""ModelOffloader: residency tracking, tensors re-bound to one host slab, always moved back."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from runnerkit.offload import HostSlab, ModelOffloader
from runnerkit.offload import pinned as pinned_mod
from test_cases._rss import CAN_MEASURE, peak_growth


def _modules() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    enc.register_buffer("table", torch.arange(6, dtype=torch.float32))
    return {"text_encoder": enc, "vae": nn.Conv2d(2, 3, 3)}


def test_cpu_device_is_a_noop_that_tracks_residency() -> None:
    mods = _modules()
    before = {n: p.data_ptr() for n, p in mods["vae"].named_parameters()}
    off = ModelOffloader(mods, "cpu")
    assert off.resident() == set()
    with off.on_device("vae") as vae:
        assert vae is mods["vae"] and off.resident() == {"vae"}
        with off.on_device("vae"):
            assert off.resident() == {"vae"}
        assert off.resident() == {"vae"}
    assert off.resident() == set()
    assert {n: p.data_ptr() for n, p in mods["vae"].named_parameters()} == before
    with pytest.raises(KeyError, match="'unet' is not an offloaded module; known: \\['text_encoder', 'vae'\\]"):
        with off.on_device("unet"):
            pass


def test_tensors_visit_the_device_and_return_to_the_slab() -> None:
    # device "meta" stands in for CUDA on a CPU-only machine: the copy and re-binding run for real
    mods = _modules()
    enc = mods["text_encoder"]
    originals = {n: t.detach().clone() for n, t in enc.state_dict().items()}
    param_ids = {n: id(p) for n, p in enc.named_parameters()}
    off = ModelOffloader(mods, "meta", pin_memory=False)
    slab = off._slabs["text_encoder"]
    lo, hi = slab.buffer.data_ptr(), slab.buffer.data_ptr() + slab.nbytes
    assert all(lo <= t.data_ptr() < hi for t in enc.state_dict().values())  # packed into one slab
    with pytest.raises(RuntimeError, match="boom"):
        with off.on_device("text_encoder"):
            assert all(t.is_meta for t in enc.state_dict().values())
            assert not mods["vae"].weight.is_meta
            assert off.resident() == {"text_encoder"}
            raise RuntimeError("boom")
    assert off.resident() == set()  # moved back in finally
    assert {n: id(p) for n, p in enc.named_parameters()} == param_ids
    for n, t in enc.state_dict().items():
        assert t.device.type == "cpu" and lo <= t.data_ptr() < hi and torch.equal(t, originals[n])
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        with off.on_device("vae"):
            pass


def test_packing_rebinds_each_tensor_before_copying_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host peak of packing a module is its slab plus one tensor: each tensor is copied into the slab and every
    use of it re-bound there (its original storage freed) before the next is copied, so a visiting text encoder
    loaded as pageable tensors never sits twice in host memory. A tied tensor is stored and copied once."""
    from runnerkit.offload import model_offload

    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
    enc.register_buffer("table", torch.arange(6, dtype=torch.float32))
    enc.tied = enc[0].bias  # the same Parameter under a second name
    values = {n: t.detach().clone() for n, t in enc.state_dict().items()}
    events: list[str] = []
    real_view, real_rebind = model_offload.typed_view, ModelOffloader._rebind

    def view(*args: object) -> torch.Tensor:
        events.append("view")
        return real_view(*args)  # type: ignore[arg-type]

    def rebind(module: nn.Module, leaf: str, is_param: bool, tensor: torch.Tensor) -> None:
        events.append(f"rebind {leaf}")
        real_rebind(module, leaf, is_param, tensor)

    monkeypatch.setattr(model_offload, "typed_view", view)
    monkeypatch.setattr(ModelOffloader, "_rebind", staticmethod(rebind))
    ModelOffloader({"text_encoder": enc}, "meta", pin_memory=False)
    # per stored tensor: its copy's view, then one view + re-bind per use (`module.modules()` order: the root's
    # `tied` first, which is layer 0's bias too; then layer 0's weight, layer 1's weight and bias; the buffer)
    assert events == ["view", "view", "rebind tied", "view", "rebind bias", "view", "view", "rebind weight",
                      "view", "view", "rebind weight", "view", "view", "rebind bias", "view", "view", "rebind table"]
    assert all(torch.equal(t, values[k]) for k, t in enc.state_dict().items())
    assert enc.tied is enc[0].bias


# -- page-locking after packing (HostSlab(defer_pinning=True)) -------------------------------------------------

class RecordingDriver:
    """`cudaHostRegister`/`cudaHostUnregister` for a CPU-only torch, recorded into `events` with how many of
    `originals` (storages of the module's tensors before packing) were freed at that call. `fail_at`: the n-th
    register call (1-based) returns cudaErrorMemoryAllocation. `populate`: a register call makes every page of
    its range resident (contents unchanged), as the real driver does when it locks a range."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, events: list[tuple], originals: list[StorageWeakRef],
                 fail_at: int | None = None, populate: bool = False) -> None:
        self.events, self.originals, self.fail_at, self.populate = events, originals, fail_at, populate
        self.locked: dict[int, int] = {}
        self.registers = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self)
        monkeypatch.setattr(pinned_mod, "_clear_cuda_last_error", lambda: None)
        monkeypatch.setattr(HostSlab, "_try_pin", staticmethod(self._pin))
        monkeypatch.delenv("RUNNERKIT_DISABLE_PINNED", raising=False)

    def freed(self) -> int:
        return sum(ref.expired() for ref in self.originals)

    def _pin(self, nbytes: int) -> torch.Tensor:
        self.events.append(("pin_memory", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registers += 1
        self.events.append(("register", self.freed()))
        if self.registers == self.fail_at:
            return 2
        if self.populate:  # x + 0 writes every byte back: each page becomes resident, the bytes stay
            torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8).add_(0)
        self.locked[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.events.append(("unregister", self.locked.pop(ptr)))
        return 0


def _packed_module() -> tuple[nn.Module, list[StorageWeakRef], dict[str, torch.Tensor]]:
    """Five tensors (one of them used twice, a buffer) of 37.25 KiB, their storages before packing, their bytes."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    enc.register_buffer("table", torch.randn(100))
    enc.tied = enc[0].bias
    storages = {t.data_ptr(): t.untyped_storage() for t in enc.state_dict().values()}  # the tied one once
    originals = [StorageWeakRef(s) for s in storages.values()]
    values = {n: t.detach().view(torch.uint8).clone() for n, t in enc.state_dict().items()}
    return enc, originals, values


def test_the_slab_is_registered_only_after_every_tensor_is_copied_and_its_original_freed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration populates every page of the slab, so it comes after packing: when the first chunk is
    registered, every tensor of the module has been copied and re-bound and its original storage freed; each
    original is freed before the next tensor is re-bound (the tied one is stored once)."""
    from runnerkit.offload import model_offload

    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", 4 * 4096)
    enc, originals, values = _packed_module()
    events: list[tuple] = []
    driver = RecordingDriver(monkeypatch, events, originals)
    real_rebind = ModelOffloader._rebind

    def rebind(module: nn.Module, leaf: str, is_param: bool, tensor: torch.Tensor) -> None:
        events.append(("rebind", leaf, driver.freed()))
        real_rebind(module, leaf, is_param, tensor)

    monkeypatch.setattr(ModelOffloader, "_rebind", staticmethod(rebind))
    off = model_offload.ModelOffloader({"text_encoder": enc}, "meta")
    slab = off._slabs["text_encoder"]
    # 24576 + 384 + 12288 + 128 + 400 bytes, each at a 256-byte offset: two chunks of 16 KiB and a last one
    assert slab.nbytes == 24576 + 512 + 12288 + 256 + 512 == 38144
    # `module.modules()` order: root's `tied` (= layer 0's bias) and its second use, then each weight/bias, the
    # buffer; freed before each re-bind: every tensor copied before (a parameter's original storage goes at its
    # first re-bind: the Parameter object stays, on the slab's storage)
    assert events == [("rebind", "tied", 0), ("rebind", "bias", 1), ("rebind", "weight", 1), ("rebind", "weight", 2),
                      ("rebind", "bias", 3), ("rebind", "table", 4),
                      ("register", 5), ("register", 5), ("register", 5)]
    assert slab.kind == "registered" and slab.is_pinned and not slab.pin_pending
    assert slab.chunks == sorted(driver.locked.items()) and [n for _, n in slab.chunks] == [16384, 16384, 5376]
    assert all(torch.equal(t.view(torch.uint8), values[n]) for n, t in enc.state_dict().items())
    off.close()
    assert driver.locked == {}


def test_a_failed_registration_after_packing_leaves_the_module_pageable_and_intact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The third chunk's registration fails: the two before it are unregistered (nothing stays locked), torch's
    pinned allocator is not tried (it would hold a second copy of the full slab), the slab stays pageable with a
    WARNING, its bytes are the module's bit for bit, and visits to the device copy synchronously."""
    from loguru import logger

    from runnerkit.offload import model_offload

    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", 4 * 4096)
    enc, originals, values = _packed_module()
    events: list[tuple] = []
    driver = RecordingDriver(monkeypatch, events, originals, fail_at=3)
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{level} {message}")
    try:
        off = model_offload.ModelOffloader({"text_encoder": enc}, "meta")
    finally:
        logger.remove(sink)
    slab = off._slabs["text_encoder"]
    assert events == [("register", 5), ("register", 5), ("register", 5), ("unregister", 16384),
                      ("unregister", 16384)]  # no ("pin_memory", ...)
    assert driver.locked == {} and slab.kind == "pageable" and not slab.is_pinned and slab.chunks == []
    assert len(lines) == 1 and lines[0].startswith("WARNING host slab text_encoder: cudaHostRegister of the filled "
                                                   "slab failed; it stays pageable")
    lo, hi = slab.buffer.data_ptr(), slab.buffer.data_ptr() + slab.nbytes
    for n, t in enc.state_dict().items():
        assert lo <= t.data_ptr() < hi and torch.equal(t.view(torch.uint8), values[n])
    copies: list[bool] = []
    monkeypatch.setattr(model_offload, "copy_h2d", lambda dst, src, non_blocking: copies.append(non_blocking))
    with off.on_device("text_encoder"):
        pass
    assert copies == [False]  # from pageable memory: synchronous
    assert all(torch.equal(t.view(torch.uint8), values[n]) for n, t in enc.state_dict().items())
    off.close()
    assert driver.locked == {} and events[5:] == []


@pytest.mark.skipif(not CAN_MEASURE, reason="VmHWM reset is Linux's /proc/self/clear_refs")
def test_packing_a_module_does_not_hold_it_twice_in_host_memory() -> None:
    """Peak RSS while a 384 MiB module of fresh tensors (six of 64 MiB: above glibc's largest mmap threshold,
    so each is returned to the OS when freed) is packed into a slab whose registration makes every page
    resident (as the driver does; a stand-in driver on this CPU-only torch): it grows by about one tensor, far
    below the 384 MiB that registering the slab before filling it costs (the whole slab resident beside the
    whole module). Measured in a fresh interpreter (test_cases/_rss.py)."""
    out = peak_growth("""
        import ctypes
        import torch
        from torch import nn
        from runnerkit.offload import pinned
        from runnerkit.offload.model_offload import ModelOffloader

        class Driver:  # page-locking makes every page of the range resident, the bytes unchanged
            def cudaHostRegister(self, ptr, size, flags):
                torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8).add_(0)
                return 0

            def cudaHostUnregister(self, ptr):
                return 0

        torch.cuda.is_available, torch.cuda.cudart = (lambda: True), (lambda: Driver())
        pinned._clear_cuda_last_error = lambda: None
        module = nn.Module()
        for i in range(6):
            module.register_parameter(f"w{i}", nn.Parameter(torch.full((2**24,), float(i + 1)), requires_grad=False))

        def work():
            slab = ModelOffloader({"text_encoder": module}, "meta")._slabs["text_encoder"]
            values = all(bool(torch.all(getattr(module, f"w{i}") == i + 1)) for i in range(6))
            return {"kind": slab.kind, "nbytes": slab.nbytes, "chunks": len(slab.chunks), "values": values}

        measure(work)
    """)
    mib = 2**20
    assert (out["kind"], out["nbytes"], out["chunks"], out["values"]) == ("registered", 384 * mib, 2, True)
    assert out["grown"] < out["nbytes"] // 2, f"peak RSS grew {out['grown'] / mib:.0f} MiB packing 384 MiB"
