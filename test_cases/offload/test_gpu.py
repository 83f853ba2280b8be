"""Offload engine on CUDA: registered slabs, copy-stream parity, no host sync in hooks, waits that matter
(a missing one changes the output), model offload."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from runnerkit.offload import (
    BlockStreamer,
    CudaCopyEngine,
    HostSlab,
    HostSource,
    ModelOffloader,
    StreamSpec,
    SyncCopyEngine,
    plan_units,
    resident_names,
)
from runnerkit.offload.pinned import _clear_cuda_last_error, _cuda_ok
from runnerkit.weights import build_on_meta
from test_cases.offload._toy import build_streamed, make_reference, state_dict_of, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_slab_from_torchs_pinned_allocator_is_reported_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second step of the chain (cudaHostRegister refused): torch's real pinned allocator; the slab
    says pinned exactly when CUDA says its buffer is page-locked (async copies depend on it)."""
    monkeypatch.setattr(HostSlab, "_try_register", staticmethod(lambda nbytes: None))
    slab = HostSlab(1_000_003)
    assert slab.kind == "pinned" and slab.buffer.numel() == 1_000_003
    assert slab.buffer.is_pinned() and slab.is_pinned


def test_host_slab_is_registered_and_pinned() -> None:
    slab = HostSlab(10_000_017)
    assert slab.kind == "registered", f"fallback chain stopped at {slab.kind}"
    assert slab.is_pinned and slab.buffer.is_pinned() and slab.buffer.numel() == 10_000_017
    dev = torch.empty(slab.nbytes, dtype=torch.uint8, device="cuda")
    slab.buffer.fill_(7)
    dev.copy_(slab.buffer, non_blocking=True)
    torch.cuda.synchronize()
    assert int(dev[-1]) == 7
    slab.release()
    assert not slab.is_pinned


def test_failed_register_does_not_poison_the_next_kernel() -> None:
    slab = HostSlab(1 << 20)
    code = torch.cuda.cudart().cudaHostRegister(slab.buffer.data_ptr(), slab.nbytes, 0)  # registered twice
    assert not _cuda_ok(code)
    _clear_cuda_last_error()
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8.0
    slab.release()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", ["host", "mmap", "pread"])
@pytest.mark.parametrize("mode,gpu_slots,depth", [("block", 2, 1), ("phase", 3, 2), ("phase", 2, 1)])
def test_cuda_streaming_bit_identical(tmp_path: Path, dtype: torch.dtype, storage: str, mode: str, gpu_slots: int,
                                      depth: int) -> None:
    ref = make_reference(seed=0).to("cuda", dtype)
    sd = {k: v.to(dtype) for k, v in state_dict_of(make_reference(seed=0)).items()}
    files = write_checkpoint(sd, tmp_path)
    model, streamer = build_streamed(sd, mode, storage, gpu_slots, depth, files=files, device="cuda",
                                     dtype=dtype, pin_memory=True)
    assert isinstance(streamer.engine, CudaCopyEngine) and streamer.source.pinned
    xs = [torch.randn(2, 64, 8, device="cuda", dtype=dtype) for _ in range(3)]
    with torch.no_grad():
        if storage == "host":
            torch.cuda.set_sync_debug_mode("error")  # any host synchronize inside the hooks raises
        try:
            outs = [model(x) for x in xs]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for x, out in zip(xs, outs):
            assert torch.equal(out, ref(x))
        streamer.reset()
        assert streamer.state() == {"next_prefetch": 0, "issued": [], "in_flight": 0, "pending": [],
                                    "slots": [None] * gpu_slots}
        assert torch.equal(model(xs[0]), ref(xs[0]))
    assert streamer.stats()["h2d_gb_per_s"] > 0
    streamer.close()


def test_fp8_streaming_on_cuda_matches_dequantized() -> None:
    from runnerkit.offload import dequantize_fp8_e4m3, quantize_fp8_e4m3
    dtype = torch.bfloat16
    sd = {k: v.to(dtype) for k, v in state_dict_of(make_reference(seed=0)).items()}
    model, streamer = build_streamed(sd, "phase", "host", 2, 1, weight_dtype="fp8_e4m3", device="cuda",
                                     dtype=dtype, pin_memory=True)
    streamed = {p for u in streamer.units for p in u.params}
    ref = make_reference(seed=0).to("cuda", dtype)
    ref.load_state_dict({k: dequantize_fp8_e4m3(*quantize_fp8_e4m3(v), dtype) if k in streamed else v
                         for k, v in sd.items()})
    x = torch.randn(2, 64, 8, device="cuda", dtype=dtype)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        assert torch.equal(model(x), ref(x))
    streamer.close()


@pytest.mark.parametrize("mode", ["block", "phase"])
def test_fp8_checkpoint_streamed_from_disk_on_cuda_equals_the_resident_load(tmp_path: Path, mode: str) -> None:
    """float8_e4m3fn + weight_scale tensors cross H2D as stored (pinned staging, copy stream) and are upcast
    on the device: the output equals a resident model holding (q.float() * scale).to(bf16), bit for bit."""
    from runnerkit.config import OffloadConfig
    from runnerkit.offload.setup import stream_module
    from test_cases.offload.test_disk_fp8 import SPEC, ToyModel, expected_weights, fp8_checkpoint

    dtype = torch.bfloat16
    files, stored, scales = fp8_checkpoint(tmp_path)
    cfg = OffloadConfig(mode=mode, storage="disk", gpu_slots=2)  # type: ignore[arg-type]
    model = build_on_meta(ToyModel)
    streamer = stream_module(model, SPEC, cfg, torch.device("cuda"), dtype, "toy", files=files, scale_map=scales)
    assert isinstance(streamer.engine, CudaCopyEngine) and streamer.source.pinned
    ref = build_on_meta(ToyModel)
    ref.load_state_dict({k: v.to("cuda") for k, v in expected_weights(stored, scales, dtype).items()}, assign=True)
    x = torch.randn(2, 64, 8, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = ref(x)
        for _ in range(3):
            assert torch.equal(model(x), want)
    streamer.close()


def test_pageable_host_memory_uses_synchronous_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    sd = state_dict_of(make_reference(seed=0))
    model, streamer = build_streamed(sd, "block", "host", 2, 1, device="cuda", pin_memory=False)
    assert isinstance(streamer.engine, SyncCopyEngine)
    calls: list[bool] = []
    orig = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False:
                        calls.append(non_blocking) or orig(self, src, non_blocking=non_blocking))
    with torch.no_grad():
        model(torch.randn(1, 4, 8, device="cuda"))
    assert calls and not any(calls)
    streamer.close()


class _BigBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn, self.cross_attn, self.ffn = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.cross_attn(self.self_attn(x)))


class _Big(nn.Module):
    STREAM_SPEC = StreamSpec(blocks_attr="blocks", phases=("self_attn", "cross_attn", "ffn"),
                             keep_fp32=lambda name: False)

    def __init__(self, d: int = 4096, n: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_BigBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("pin", [True, False])
def test_h2d_bandwidth_is_reported(pin: bool, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    ref = _Big().to(torch.bfloat16)
    sd = state_dict_of(ref)
    model = build_on_meta(_Big).to(torch.bfloat16)
    units = plan_units(model, "phase", _Big.STREAM_SPEC)
    assert resident_names(model, units) == []
    streamer = BlockStreamer(model, units, HostSource(units, sd, torch.bfloat16, pin_memory=pin), "cuda", 2, 1)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            model(x)
    streamer.reset()
    s = streamer.stats()
    with capsys.disabled():
        print(f"\n[pin={pin}] {type(streamer.engine).__name__}: {s['h2d_copies']:.0f} copies, "
              f"{s['h2d_bytes'] / 2**30:.2f} GiB, {s['h2d_gb_per_s']:.1f} GB/s")
    assert s["h2d_gb_per_s"] > (10 if pin else 0.5)
    streamer.close()


def test_model_offload_on_cuda() -> None:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64))
    resident = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64)).cuda()
    resident.load_state_dict(enc.state_dict())
    off = ModelOffloader({"text_encoder": enc}, "cuda")
    assert off._slabs["text_encoder"].is_pinned
    x = torch.randn(4, 32, device="cuda")
    with torch.no_grad(), off.on_device("text_encoder") as m:
        assert all(p.is_cuda for p in m.parameters()) and off.resident() == {"text_encoder"}
        assert torch.equal(m(x), resident(x))
    assert off.resident() == set() and all(p.device.type == "cpu" for p in enc.parameters())
    off.close()


def test_torch_compile_graph_breaks_at_unit_hooks() -> None:
    ref = make_reference(seed=0).to("cuda")
    model, streamer = build_streamed(state_dict_of(make_reference(seed=0)), "phase", "host", 2, 1, device="cuda",
                                     pin_memory=True)
    compiled = torch.compile(model)
    x = torch.randn(2, 64, 8, device="cuda")
    with torch.no_grad():
        for _ in range(2):  # the second call reuses the graphs and wraps the prefetch
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
    assert streamer.state()["issued"] == [0]
    streamer.close()


class _Phase(nn.Module):
    """One Linear applied `repeats` times (tanh keeps activations bounded): compute grows with repeats
    and tokens, the streamed bytes with `d` only."""

    def __init__(self, d: int, repeats: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            x = torch.tanh(self.lin(x))  # [1, L, d]
        return x


class _ChainBlock(nn.Module):
    def __init__(self, d: int, repeats: int) -> None:
        super().__init__()
        self.self_attn, self.cross_attn, self.ffn = (_Phase(d, repeats) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.cross_attn(self.self_attn(x)))


class _Chain(nn.Module):
    STREAM_SPEC = StreamSpec(blocks_attr="blocks", phases=("self_attn", "cross_attn", "ffn"), keep_fp32=lambda n: False)

    def __init__(self, d: int, repeats: int, num_blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ChainBlock(d, repeats) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# (d, repeats, tokens). copy-bound: a 64 MiB float32 weight per phase unit (~1-3 ms of pinned H2D) against a
# 4-token matmul (microseconds). compute-bound: a 4 MiB weight (~0.1 ms) against 16 matmuls of 16384 tokens
# (~10 ms in float32). The host issues a unit in well under a millisecond, so in both cases the GPU's copy and
# compute streams run far apart, and a missing wait lets a unit compute with another unit's bytes.
_SIZING = {"copy_bound": (4096, 1, 4), "compute_bound": (1024, 16, 16384)}


def _gpu_seconds(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.mark.parametrize("bound,broken", [("copy_bound", "wait_copy"), ("compute_bound", "mark_compute_done")])
def test_stream_waits_are_needed_and_kept(monkeypatch: pytest.MonkeyPatch, bound: str, broken: str) -> None:
    """Streamed == resident bit for bit; then without one of CudaCopyEngine's waits the output differs.

    copy_bound + `wait_copy` a no-op: compute no longer waits for its unit's copy (it reads the bytes
    of the slot's previous unit). compute_bound + `mark_compute_done` a no-op: no compute-done event,
    so a copy into a slot no longer waits for the compute of the slot's previous unit (it overwrites
    weights still to be read). The measured copy/compute times check the sizing each case relies on.
    GPU memory: < 1.5 GiB (copy_bound: 768 MiB resident reference, 2 x 64 MiB slots).
    """
    d, repeats, tokens = _SIZING[bound]
    torch.manual_seed(0)
    reference = _Chain(d, repeats)
    sd = state_dict_of(reference)
    reference = reference.to("cuda")
    model = build_on_meta(lambda: _Chain(d, repeats))
    units = plan_units(model, "phase", _Chain.STREAM_SPEC)
    streamer = BlockStreamer(model, units, HostSource(units, sd, torch.float32, pin_memory=True), "cuda", 2, 1)
    assert isinstance(streamer.engine, CudaCopyEngine) and streamer.source.pinned
    x = torch.randn(1, tokens, d, device="cuda")
    with torch.no_grad():
        want = reference(x)
        compute_s = _gpu_seconds(lambda: reference(x)) / len(units)
        outs = [model(x) for _ in range(3)]  # cold start, then two steps with the wrap prefetch
        streamer.reset()
        stats = streamer.stats()
        copy_s = stats["h2d_seconds"] / stats["h2d_copies"]
        for out in outs:
            assert torch.equal(out, want)
        ratio = copy_s / compute_s if bound == "copy_bound" else compute_s / copy_s
        assert ratio > 4, f"{bound} sizing does not hold: per unit copy {copy_s * 1e3:.3f} ms, compute " \
                          f"{compute_s * 1e3:.3f} ms; a missing wait might go unnoticed"

        monkeypatch.setattr(CudaCopyEngine, broken, lambda self, slot: None)
        broken_outs = [model(x) for _ in range(2)]
        torch.cuda.synchronize()
        monkeypatch.undo()
        assert all(not torch.equal(out, want) for out in broken_outs), \
            f"with {broken} a no-op the output did not change: the test no longer detects a missing wait"
    streamer.reset()
    streamer.close()


@pytest.mark.parametrize("path", ["copy_engine", "model_offload"])
def test_copies_from_a_slab_registered_in_chunks_cross_the_chunk_boundaries(
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A single cudaMemcpyAsync across two registrations fails with "invalid argument" (the H200 run
    of 2026-12-03: a 0.42 GiB staging slab in two 256 MiB chunks); the copy engine and model offload
    copy a chunked slab's bytes exactly."""
    from runnerkit.offload import pinned as pinned_mod

    monkeypatch.setattr(pinned_mod, "REGISTER_CHUNK_BYTES", 1 << 20)
    if path == "copy_engine":
        slab = pinned_mod.HostSlab(3 * (1 << 20) + 4096)
        assert slab.kind == "registered" and len(slab.chunks) == 4
        slab.buffer.copy_(torch.randint(0, 255, (slab.nbytes,), dtype=torch.uint8))
        engine = CudaCopyEngine(torch.device("cuda"), 1)
        dst = torch.empty(slab.nbytes - 512, dtype=torch.uint8, device="cuda")
        engine.h2d(0, dst, slab.buffer[256:-256])
        engine.wait_copy(0)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), slab.buffer[256:-256])
        return
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 8 MiB of float32: 8 chunks
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    offloader = ModelOffloader({"m": model}, torch.device("cuda"))
    with offloader.on_device("m") as m:
        torch.cuda.synchronize()
        assert all(torch.equal(v.cpu(), ref[k]) for k, v in m.state_dict().items())
