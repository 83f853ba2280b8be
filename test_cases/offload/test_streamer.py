"""BlockStreamer on the CPU: bit-exact parity, hook/copy order (recording engine; the real CUDA engine on fake
streams), boundary state, close, rejections, stream specs of other families."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runnerkit.offload import (
    BlockStreamer,
    CudaCopyEngine,
    DiskSource,
    HostSource,
    SafetensorsDiskReader,
    StreamSpec,
    dequantize_fp8_e4m3,
    plan_units,
    quantize_fp8_e4m3,
    resident_names,
)
from runnerkit.weights import CheckpointError, build_on_meta
from test_cases.offload._engines import DeferredEngine, RecordingEngine
from test_cases.offload._fake_cuda import FakeCuda, check_slot_protocol
from test_cases.offload._toy import (
    ToyModel,
    build_streamed,
    is_resident,
    make_reference,
    state_dict_of,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def reference() -> ToyModel:
    return make_reference(seed=0)


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)


@pytest.fixture()
def files(tmp_path: Path, reference: ToyModel) -> list[Path]:
    return write_checkpoint(state_dict_of(reference), tmp_path)


SLOT_DEPTH = [(2, 1), (3, 1), (3, 2)]


@pytest.mark.parametrize("storage", ["host", "mmap", "pread"])
@pytest.mark.parametrize("mode", ["block", "phase"])
@pytest.mark.parametrize("gpu_slots,prefetch_depth", SLOT_DEPTH)
@pytest.mark.parametrize("engine_kind", ["sync", "deferred"])
def test_parity_bit_identical_two_steps(reference: ToyModel, inputs: tuple[torch.Tensor, torch.Tensor],
                                        files: list[Path], storage: str, mode: str, gpu_slots: int,
                                        prefetch_depth: int, engine_kind: str) -> None:
    engine = DeferredEngine(gpu_slots) if engine_kind == "deferred" else None
    model, streamer = build_streamed(state_dict_of(reference), mode, storage, gpu_slots, prefetch_depth,
                                     files=files, engine=engine)
    with torch.no_grad():
        for x in inputs:  # two consecutive forwards: the prefetch wraps from the last unit to unit 0
            assert torch.equal(model(x), reference(x))
        streamer.reset()
        assert torch.equal(model(inputs[0]), reference(inputs[0]))  # after the request boundary
    streamer.close()


def _unit_names(mode: str) -> list[str]:
    return [u.module for u in plan_units(build_on_meta(ToyModel), mode, ToyModel.STREAM_SPEC)]


def _run_recorded(reference: ToyModel, inputs: tuple[torch.Tensor, torch.Tensor], mode: str, gpu_slots: int,
                  depth: int) -> tuple[list[tuple], BlockStreamer]:
    log: list[tuple] = []
    model, streamer = build_streamed(state_dict_of(reference), mode, "host", gpu_slots, depth,
                                     engine=RecordingEngine(gpu_slots, log))
    for name in _unit_names(mode):
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: log.append(("fwd", name)))
    with torch.no_grad():
        for x in inputs:
            model(x)
    return log, streamer


def test_exact_event_order_block_mode(reference: ToyModel, inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    log, streamer = _run_recorded(reference, inputs, "block", gpu_slots=2, depth=1)

    def unit(j: int, prefetch: int | None, first: bool = False) -> list[tuple]:
        s = j % 2
        ev = [("h2d", s, f"blocks.{j}")] if first else []
        ev.append(("wait", s))
        if prefetch is not None:
            ev.append(("h2d", prefetch % 2, f"blocks.{prefetch}"))
        return ev + [("fwd", f"blocks.{j}"), ("done", s)]

    step1 = unit(0, 1, first=True) + unit(1, 2) + unit(2, 3) + unit(3, 0)  # unit 3 prefetches unit 0: wrap
    step2 = unit(0, 1) + unit(1, 2) + unit(2, 3) + unit(3, 0)
    assert log == step1 + step2
    assert streamer.state() == {"next_prefetch": 1, "issued": [0], "in_flight": 0, "pending": [],
                                "slots": [0, 3]}


@pytest.mark.parametrize("mode", ["block", "phase"])
@pytest.mark.parametrize("gpu_slots,depth", [(2, 1), (3, 1), (3, 2), (4, 3)])
def test_event_order_invariants(reference: ToyModel, inputs: tuple[torch.Tensor, torch.Tensor], mode: str,
                                gpu_slots: int, depth: int) -> None:
    log, _ = _run_recorded(reference, inputs, mode, gpu_slots, depth)
    names = _unit_names(mode)
    n = len(names)
    index_of = {name: j for j, name in enumerate(names)}
    fwd_at = [i for i, e in enumerate(log) if e[0] == "fwd"]
    assert [index_of[log[i][1]] for i in fwd_at] == list(range(n)) * 2
    last_h2d: dict[int, int] = {}  # slot -> log index of its last copy
    for i, e in enumerate(log):
        if e[0] == "h2d":
            slot, unit = e[1], index_of[e[2]]
            assert slot == unit % gpu_slots
            if slot in last_h2d:  # slot reuse: its previous unit ran and marked compute done in between
                p = last_h2d[slot]
                prev = log[p][2]
                f = next(k for k in range(p, i) if log[k] == ("fwd", prev))
                assert ("done", slot) in log[f:i], f"copy {e} issued before {prev} marked compute done"
            last_h2d[slot] = i
        elif e[0] == "fwd":
            slot = index_of[e[1]] % gpu_slots
            copy = max(k for k in range(i) if log[k][0] == "h2d" and log[k][1] == slot)
            assert log[copy][2] == e[1], f"{e[1]} would compute with {log[copy][2]}'s bytes"
            assert ("wait", slot) in log[copy:i], f"compute of {e[1]} did not wait for its copy"
    # wrap: unit k < depth of step 2 is issued during step 1 (in the pre-hook of unit n - depth + k),
    # except when its slot is still held by a not-yet-computed unit (n % slots != 0): then right after it computed
    for k in range(depth):
        issued = [i for i, e in enumerate(log) if e[0] == "h2d" and e[2] == names[k]]
        if sum(1 for u in range(n) if u % gpu_slots == k % gpu_slots) == 1:
            assert len(issued) == 1  # sole user of its slot: its bytes stay valid, never copied again
            continue
        assert len(issued) == 3  # first use, wrap during step 1, wrap during step 2
        assert issued[1] < fwd_at[n], "prefetch did not wrap to the next step"
        if n % gpu_slots == 0:
            assert fwd_at[n - depth + k - 1] < issued[1] < fwd_at[n - depth + k]


@pytest.mark.parametrize("depth", [1, 2])
def test_reset_reaches_the_fresh_boundary(reference: ToyModel, inputs: tuple[torch.Tensor, torch.Tensor],
                                          depth: int) -> None:
    engine = DeferredEngine(3)
    model, streamer = build_streamed(state_dict_of(reference), "phase", "host", 3, depth, engine=engine)
    fresh = streamer.state()
    assert fresh == {"next_prefetch": 0, "issued": [], "in_flight": 0, "pending": [], "slots": [None] * 3}
    with torch.no_grad():
        model(inputs[0])
    after_step = streamer.state()
    assert after_step["next_prefetch"] == depth
    assert after_step["issued"] == list(range(depth))  # the wrap prefetch of the next step
    assert after_step["in_flight"] == depth  # nothing waited for them yet
    streamer.reset()
    assert streamer.state() == fresh
    stats = streamer.stats()
    assert stats["h2d_copies"] == 12 + depth and stats["h2d_bytes"] > 0


def test_close_drops_every_reference(reference: ToyModel, inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    model, streamer = build_streamed(state_dict_of(reference), "block", "host", 2, 1)
    with torch.no_grad():
        model(inputs[0])
    refs = [weakref.ref(streamer), *(weakref.ref(s) for s in streamer._slots),
            *(weakref.ref(s.buffer) for s in streamer.source.slabs)]
    streamer.close()
    streamer.close()  # idempotent
    del streamer
    gc.collect()
    assert all(r() is None for r in refs)
    streamed = [n for n, p in model.named_parameters() if n.startswith("blocks.") and not is_resident(n)]
    assert streamed and all(model.get_parameter(n).is_meta for n in streamed)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in model.blocks)
    assert not model.embed.weight.is_meta  # resident tensors untouched


def test_streamer_collected_without_close_detaches(reference: ToyModel) -> None:
    model, streamer = build_streamed(state_dict_of(reference), "phase", "host", 2, 1)
    ref = weakref.ref(streamer)
    del streamer
    gc.collect()
    assert ref() is None  # the hooks hold only a weak reference
    assert model.blocks[0].ffn.fc1.weight.is_meta
    assert not model.blocks[0].ffn._forward_pre_hooks


def test_fp8_matches_dequantized_weights_exactly_and_fp32_loosely(reference: ToyModel,
                                                                  inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    sd = state_dict_of(reference)
    model, streamer = build_streamed(sd, "phase", "host", 2, 1, weight_dtype="fp8_e4m3")
    roundtrip = make_reference(seed=0)
    streamed = {p for u in streamer.units for p in u.params}
    roundtrip.load_state_dict({k: dequantize_fp8_e4m3(*quantize_fp8_e4m3(v), torch.float32) if k in streamed else v
                               for k, v in sd.items()})
    with torch.no_grad():
        for x in inputs:
            out = model(x)
            assert torch.equal(out, roundtrip(x))  # exact: same weights, same kernels
            ref = reference(x)
            rel = (out - ref).norm() / ref.norm()
            # per weight <= 2^-4 relative rounding; through 12 streamed phases the toy's output drifts ~6%
            assert rel < 0.10, f"fp8 relative L2 error {rel:.4f} vs fp32 exceeds the stated 10%"
    assert streamer.layouts[0].tensors[0].stored_dtype == torch.float8_e4m3fn
    streamer.close()


def test_quantize_fp8_scale_and_range() -> None:
    w = torch.tensor([[-3.0, 1.5], [0.0, 0.75]])
    q, scale = quantize_fp8_e4m3(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    assert scale.item() == pytest.approx(3.0 / 448)
    assert q.float().abs().max().item() == 448.0
    assert torch.allclose(dequantize_fp8_e4m3(q, scale, torch.float32), w, rtol=2**-4)
    zq, zscale = quantize_fp8_e4m3(torch.zeros(3))
    assert zscale.item() == 1.0 and torch.equal(zq.float(), torch.zeros(3))


def test_rejected_combinations(reference: ToyModel, files: list[Path]) -> None:
    sd = state_dict_of(reference)
    with pytest.raises(ValueError, match="`gpu_slots` must be >= 2"):
        build_streamed(sd, "block", "host", gpu_slots=1, prefetch_depth=1)
    with pytest.raises(ValueError, match=r"`prefetch_depth` must be in \[1, gpu_slots - 1\] = \[1, 1\], got 2"):
        build_streamed(sd, "block", "host", gpu_slots=2, prefetch_depth=2)
    with pytest.raises(ValueError, match="`prefetch_depth`"):
        build_streamed(sd, "block", "host", gpu_slots=2, prefetch_depth=0)
    model = build_on_meta(ToyModel)
    units = plan_units(model, "block", ToyModel.STREAM_SPEC)
    reader = SafetensorsDiskReader(files, reader="pread")
    # a checkpoint dtype other than the compute dtype is cast, not refused: test_disk_casts.py
    with pytest.raises(NotImplementedError, match="fp8_e4m3"):
        DiskSource(units, reader, torch.float32, weight_dtype="fp8_e4m3")
    with pytest.raises(CheckpointError, match="missing"):
        HostSource(units, {k: v for k, v in sd.items() if "blocks.2.ffn" not in k}, torch.float32, pin_memory=False)
    bad = dict(sd)
    bad["blocks.0.ffn.fc1.weight"] = torch.zeros(3, 3)
    source = HostSource(units, bad, torch.float32, pin_memory=False)
    with pytest.raises(CheckpointError, match=r"blocks.0.ffn.fc1.weight.*\[3, 3\] vs model \[32, 16\]"):
        BlockStreamer(model, units, source, "cpu")
    with pytest.raises(ValueError, match="`mode` must be 'block' or 'phase'"):
        plan_units(model, "layer", ToyModel.STREAM_SPEC)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no submodule 'attn2'"):
        plan_units(model, "phase", replace(ToyModel.STREAM_SPEC, phases=("self_attn", "attn2")))
    with pytest.raises(ValueError, match="`blocks_attr`='layers'"):
        plan_units(model, "block", replace(ToyModel.STREAM_SPEC, blocks_attr="layers"))
    with pytest.raises(ValueError, match="mode 'phase' needs phases"):
        plan_units(model, "phase", replace(ToyModel.STREAM_SPEC, phases=()))


def test_plan_units_block_and_phase() -> None:
    model = build_on_meta(ToyModel)
    block = plan_units(model, "block", ToyModel.STREAM_SPEC)
    phase = plan_units(model, "phase", ToyModel.STREAM_SPEC)
    assert [u.module for u in block] == [f"blocks.{i}" for i in range(4)]
    assert [u.module for u in phase[:3]] == ["blocks.0.self_attn", "blocks.0.cross_attn", "blocks.0.ffn"]
    assert len(phase) == 12
    assert not any(is_resident(p) for u in block for p in u.params)
    assert sorted(p for u in phase[:3] for p in u.params) == sorted(block[0].params)


class _Layer(nn.Module):
    """A block of another family's shape: phases `attn` then `mlp`, a resident float32 `scale`."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x) * self.scale
        return x + self.mlp(x)


class _OtherFamily(nn.Module):
    STREAM_SPEC = StreamSpec(blocks_attr="layers", phases=("attn", "mlp"), keep_fp32=lambda n: n.endswith(".scale"))

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", ["block", "phase"])
def test_stream_spec_names_the_block_list_and_phases(mode: str) -> None:
    torch.manual_seed(0)
    reference = _OtherFamily().eval()
    sd = state_dict_of(reference)
    model = build_on_meta(_OtherFamily)
    units = plan_units(model, mode, _OtherFamily.STREAM_SPEC)
    if mode == "block":
        assert [u.module for u in units] == ["layers.0", "layers.1", "layers.2"]
    else:
        assert [u.module for u in units] == [f"layers.{i}.{p}" for i in range(3) for p in ("attn", "mlp")]
    assert resident_names(model, units) == ["layers.0.scale", "layers.1.scale", "layers.2.scale"]
    model.load_state_dict({n: sd[n] for n in resident_names(model, units)}, strict=False, assign=True)
    streamer = BlockStreamer(model, units, HostSource(units, sd, torch.float32, pin_memory=False), "cpu", 2, 1,
                             copy_engine=DeferredEngine(2))
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    streamer.close()


def _streamed_on_fake_cuda(reference: ToyModel, monkeypatch: pytest.MonkeyPatch, mode: str, gpu_slots: int,
                           depth: int) -> tuple[ToyModel, BlockStreamer, FakeCuda]:
    """The toy streamed from host slabs through the real CudaCopyEngine on fake streams (CPU buffers).
    Copies are labelled "slot<s> <unit>", computes (a pre-hook after the streamer's) the same way."""
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    engine = CudaCopyEngine("cuda", gpu_slots)
    cuda.name_engine_events(engine)
    model, streamer = build_streamed(state_dict_of(reference), mode, "host", gpu_slots, depth, engine=engine)
    slot_ptr = {t.data_ptr(): s for s, t in enumerate(streamer._slots)}
    unit_ptr = {slab.buffer.data_ptr(): u.module for slab, u in zip(streamer.source.slabs, streamer.units)}
    cuda.copy_label = lambda dst, src: f"slot{slot_ptr[dst.data_ptr()]} {unit_ptr[src.data_ptr()]}"
    def computes(label: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            cuda.launch("compute", label)  # after the streamer's pre-hook: the unit's kernels

        return hook

    for j, unit in enumerate(streamer.units):
        label = f"slot{j % streamer.num_slots} {unit.module}"
        model.get_submodule(unit.module).register_forward_pre_hook(computes(label))
    return model, streamer, cuda


def test_real_cuda_engine_event_order_over_two_steps(reference: ToyModel, inputs: tuple[torch.Tensor, torch.Tensor],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Block mode, 4 blocks over 2 slots, prefetch depth 1: the exact stream/event calls of two steps,
    the last block of step 1 prefetching block 0 of step 2 (wrap)."""
    model, streamer, cuda = _streamed_on_fake_cuda(reference, monkeypatch, "block", 2, 1)
    with torch.no_grad():
        for x in inputs:
            assert torch.equal(model(x), reference(x))
    expected: list[tuple[str, ...]] = []
    compute_marked = [False, False]

    def issue(j: int) -> None:
        s = j % 2
        if compute_marked[s]:
            expected.append(("wait", "copy", f"compute_done[{s}]"))  # slot reuse waits for the last compute
        expected.extend([("copy", "copy", f"slot{s} blocks.{j}"), ("record", "copy", f"copy_done[{s}]")])

    issue(0)  # the first block of the request is issued in its own pre-hook
    for step in range(2):
        for j in range(4):
            s = j % 2
            expected.append(("wait", "compute", f"copy_done[{s}]"))
            issue((j + 1) % 4)  # prefetch; from block 3 it wraps to block 0 of the next step
            expected.extend([("compute", "compute", f"slot{s} blocks.{j}"),
                             ("record", "compute", f"compute_done[{s}]")])
            compute_marked[s] = True
    assert cuda.protocol() == expected
    assert check_slot_protocol(cuda.ops, lambda label: label.split()[0], lambda label: label.split()[1]) == 8
    streamer.close()


@pytest.mark.parametrize("mode", ["block", "phase"])
@pytest.mark.parametrize("gpu_slots,depth", [(2, 1), (3, 1), (3, 2), (4, 3)])
def test_real_cuda_engine_orders_every_copy_and_compute(reference: ToyModel,
                                                        inputs: tuple[torch.Tensor, torch.Tensor],
                                                        monkeypatch: pytest.MonkeyPatch, mode: str, gpu_slots: int,
                                                        depth: int) -> None:
    """Over two steps and a request boundary, for every unit: its copy happens before its compute,
    and its compute before the next copy into its slot (as the GPU would be forced to run them)."""
    model, streamer, cuda = _streamed_on_fake_cuda(reference, monkeypatch, mode, gpu_slots, depth)
    with torch.no_grad():
        for x in inputs:
            assert torch.equal(model(x), reference(x))
        streamer.reset()
        model(inputs[0])
    units = len(streamer.units)
    assert check_slot_protocol(cuda.ops, lambda label: label.split()[0], lambda label: label.split()[1]) == 3 * units
    first_of_step2 = [i for i, op in enumerate(cuda.ops) if op.kind == "compute"][units]
    wrapped = [op.label.split()[1] for op in cuda.ops[:first_of_step2] if op.kind == "copy"][units:]
    if units > streamer.num_slots:
        assert wrapped[:1] == [streamer.units[0].module], "the prefetch did not wrap to the first unit of step 2"
    else:
        assert wrapped == []  # every unit owns a slot: copied once per request
    streamer.close()
