"""Block streaming from host memory takes the state dict over (`HostSource(..., consume=True)`,
`stream_module(..., consume=True)`): each tensor leaves the caller's mapping right after it is copied, so its
memory is freed before the next unit's slab is allocated and the host never holds a unit twice but the one being
copied (docs/host_memory.md, "Block streaming from host memory"). The planner's transient for that load
(`ModuleFootprint.stream_load_bytes`) is the peak of the same sequence.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.offload import HostSource, StreamUnit, host_fill_peak, plan_units
from runnerkit.offload import encoders as encoders_mod
from runnerkit.offload import sources as sources_mod
from runnerkit.offload.encoders import stream_from_files
from runnerkit.offload.pinned import HostSlab
from runnerkit.offload.setup import stream_module
from runnerkit.planning.fit import PROCESS_HOST_BYTES, MemoryEstimate, host_bytes_of, module_footprint
from runnerkit.weights import build_on_meta
from test_cases._rss import CAN_MEASURE, peak_growth
from test_cases.offload._toy import ToyModel, make_reference, state_dict_of, write_checkpoint

SPEC = ToyModel.STREAM_SPEC
X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


class LoggedDict(dict):
    """A state dict that logs each read and removal of a tensor by name."""

    def __init__(self, items: dict[str, torch.Tensor], events: list[tuple[str, ...]]) -> None:
        super().__init__(items)
        self.events = events

    def __getitem__(self, name: str) -> torch.Tensor:
        self.events.append(("read", name))
        return super().__getitem__(name)

    def pop(self, name: str, *default: Any) -> Any:
        self.events.append(("drop", name))
        return super().pop(name, *default)


def record_slabs(monkeypatch: pytest.MonkeyPatch, events: list[tuple[Any, ...]],
                 originals: dict[str, torch.Tensor]) -> dict[str, weakref.ref]:
    """Log ("slab", label, names of the originals still alive) as each unit slab is allocated; the originals
    are only weakly referenced from here on (returned)."""
    refs = {n: weakref.ref(t) for n, t in originals.items()}

    class RecordingSlab(HostSlab):
        def __init__(self, nbytes: int, pin_memory: bool = True, label: str = "slab", **kw: Any) -> None:
            events.append(("slab", label, frozenset(n for n, r in refs.items() if r() is not None)))
            super().__init__(nbytes, pin_memory=pin_memory, label=label, **kw)

    monkeypatch.setattr(sources_mod, "HostSlab", RecordingSlab)
    return refs


def streamed_after(units: list[StreamUnit], j: int) -> frozenset[str]:
    return frozenset(p for u in units[j:] for p in u.params)


def test_each_tensor_is_dropped_right_after_its_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact order: unit j's slab, then for each of its tensors (layout order) read, copy, drop; the
    originals of earlier units are freed (weakrefs) before the slab of the next is allocated. Names outside
    the units stay; the slabs hold the bytes a source that only reads the dict holds."""
    units = plan_units(build_on_meta(ToyModel), "phase", SPEC)
    reference = state_dict_of(make_reference(seed=0))
    events: list[tuple[Any, ...]] = []
    sd = LoggedDict({n: t.clone() for n, t in reference.items()}, events)
    refs = record_slabs(monkeypatch, events, sd)
    source = HostSource(units, sd, torch.float32, pin_memory=False, consume=True)

    first = next(i for i, e in enumerate(events) if e[0] == "slab")
    want: list[tuple[Any, ...]] = []
    outside = frozenset(reference) - streamed_after(units, 0)
    for j, layout in enumerate(source.layouts):
        want.append(("slab", layout.module, outside | streamed_after(units, j)))
        for t in layout.tensors:
            want += [("read", t.name), ("drop", t.name)]
    assert events[first:] == want
    assert set(sd) == outside
    assert all(refs[n]() is None for n in streamed_after(units, 0))

    keep = dict(reference)
    monkeypatch.setattr(sources_mod, "HostSlab", HostSlab)
    reading = HostSource(units, keep, torch.float32, pin_memory=False)
    assert keep.keys() == reference.keys() and all(keep[n] is reference[n] for n in keep)  # default: only read
    for layout, slab, other in zip(source.layouts, source.slabs, reading.slabs, strict=True):
        for t in layout.tensors:
            got = slab.view(t.offset, t.stored_dtype, t.shape)
            assert torch.equal(got, other.view(t.offset, t.stored_dtype, t.shape)) and torch.equal(got, reference[t.name])


def test_a_read_only_mapping_is_refused_with_consume() -> None:
    from types import MappingProxyType

    units = plan_units(build_on_meta(ToyModel), "block", SPEC)
    sd = state_dict_of(make_reference(seed=0))
    with pytest.raises(TypeError, match=r"host source: consume=True removes the tensors it copies .* got mappingproxy and NoneType"):
        HostSource(units, MappingProxyType(sd), torch.float32, pin_memory=False, consume=True)
    cfg = OffloadConfig(mode="block", pin_memory=False)
    with pytest.raises(TypeError, match=r"^toy: consume=True removes .* got dict and mappingproxy$"):
        stream_module(build_on_meta(ToyModel), SPEC, cfg, torch.device("cpu"), torch.float32, "toy", state_dict=sd,
                      scales=MappingProxyType({}), consume=True)
    assert len(sd) == len(state_dict_of(make_reference(seed=0)))  # refused before any tensor left it


def test_stream_module_hands_the_state_dict_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stream_module(..., consume=True)`: the resident tensors leave the caller's dict as they are loaded, so
    at the first slab only the streamed originals are alive, and at unit j's slab only those of units j..;
    the caller's variable ends empty with every original freed; the output is the non-consuming build's."""
    units = plan_units(build_on_meta(ToyModel), "phase", SPEC)
    reference = state_dict_of(make_reference(seed=0))
    cfg = OffloadConfig(mode="phase", pin_memory=False)
    sd = {n: t.clone() for n, t in reference.items()}
    events: list[tuple[Any, ...]] = []
    refs = record_slabs(monkeypatch, events, sd)
    model = build_on_meta(ToyModel)
    streamer = stream_module(model, SPEC, cfg, torch.device("cpu"), torch.float32, "toy", state_dict=sd, consume=True)
    assert [e[2] for e in events] == [streamed_after(units, j) for j in range(len(units))]
    assert sd == {} and all(r() is None for r in refs.values())

    monkeypatch.setattr(sources_mod, "HostSlab", HostSlab)
    kept = dict(reference)
    plain = build_on_meta(ToyModel)
    plain_streamer = stream_module(plain, SPEC, cfg, torch.device("cpu"), torch.float32, "toy", state_dict=kept)
    assert kept.keys() == reference.keys()
    with torch.no_grad():
        assert torch.equal(model.eval()(X), plain.eval()(X))
    streamer.close()
    plain_streamer.close()


def test_stream_from_files_frees_what_it_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder streamed from its files with storage cpu: the tensors `read_mapped` read are freed unit by
    unit while the slabs fill (none is left alive once the call returns: the caller keeps no reference)."""
    reference = state_dict_of(make_reference(seed=0))
    files = write_checkpoint(reference, tmp_path)
    units = plan_units(build_on_meta(ToyModel), "block", SPEC)
    events: list[tuple[Any, ...]] = []
    refs: dict[str, weakref.ref] = {}
    real = encoders_mod.read_mapped

    def spy(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        out = real(*args, **kwargs)
        refs.update(record_slabs(monkeypatch, events, out))
        return out

    monkeypatch.setattr(encoders_mod, "read_mapped", spy)
    model = build_on_meta(ToyModel)
    cfg = OffloadConfig(mode="block", storage="cpu", pin_memory=False)
    streamer = stream_from_files(model, SPEC, cfg, torch.device("cpu"), torch.float32, "toy", files,
                                 {n: n for n in reference})
    assert [e[2] for e in events] == [streamed_after(units, j) for j in range(len(units))]
    assert refs.keys() == reference.keys() and all(r() is None for r in refs.values())
    with torch.no_grad():
        assert torch.equal(model.eval()(X), make_reference(seed=0)(X))
    streamer.close()


@pytest.mark.parametrize(("mode", "weight_dtype", "kept"), [("phase", "same", 0), ("block", "fp8_e4m3", 1)])
def test_the_planned_load_transient_is_the_peak_of_the_fill(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                            weight_dtype: str, kept: int) -> None:
    """`stream_load_bytes` of a storage-cpu footprint = the largest (bytes left in the handed-over state dict +
    slabs allocated so far), at the start and at each slab allocation, less all the slabs: counted here from
    the real fill of a float32 toy (the compute dtype, as the planner counts a state dict). The host estimate
    takes it as the load transient on top of the slabs."""
    cfg = OffloadConfig(mode=mode, storage="cpu", pin_memory=False, weight_dtype=weight_dtype,  # type: ignore[arg-type]
                        resident_blocks=kept)
    sd = state_dict_of(make_reference(seed=0))
    totals = [sum(t.nbytes for t in sd.values())]
    slabs: list[int] = []

    class CountingSlab(HostSlab):
        def __init__(self, nbytes: int, *args: Any, **kw: Any) -> None:
            slabs.append(nbytes)
            totals.append(sum(t.nbytes for t in sd.values()) + sum(slabs))
            super().__init__(nbytes, *args, **kw)

    monkeypatch.setattr(sources_mod, "HostSlab", CountingSlab)
    streamer = stream_module(build_on_meta(ToyModel), SPEC, cfg, torch.device("cpu"), torch.float32, "toy",
                             state_dict=sd, consume=True)
    footprint = module_footprint(build_on_meta(ToyModel), torch.float32, SPEC.keep_fp32, SPEC, cfg)
    assert footprint.stream_host_bytes == sum(slabs) > 0
    assert footprint.stream_load_bytes == max(totals) - sum(slabs) != footprint.resident_read_bytes
    run = RunnerConfig(model_cls="toy", task="t2v", model_path="unused", offload=cfg)
    host = host_bytes_of(MemoryEstimate(modules={"toy": footprint}, stages=()), run, torch.device("cuda"))
    assert (host.transient_module, host.transient_bytes) == ("toy", footprint.stream_load_bytes)
    assert host.bytes == sum(slabs) + footprint.stream_load_bytes + PROCESS_HOST_BYTES
    streamer.close()


def test_host_fill_peak_by_hand() -> None:
    """Resident 10, units read as 4, 8, 2 bytes into slabs of 4, 8, 2: the start (24 held, no slab) is the peak,
    10 above the slabs; with 1 resident byte, unit 1's slab (slabs 12 + tensors of units 1, 2: 10, less 14)
    gives 8; slabs half the size (fp8 storage): unit 1's slab (6 + 10, less 7) gives 9, above the start's 7."""
    assert host_fill_peak(10, [4, 8, 2], [4, 8, 2]) == 10
    assert host_fill_peak(1, [4, 8, 2], [4, 8, 2]) == 8
    assert host_fill_peak(0, [4, 8, 2], [2, 4, 1]) == 9
    assert host_fill_peak(5, [], []) == 5


@pytest.mark.skipif(not CAN_MEASURE, reason="VmHWM reset is Linux's /proc/self/clear_refs")
def test_filling_the_slabs_does_not_hold_the_module_twice() -> None:
    """Peak RSS while six fresh 64 MiB tensors (above glibc's largest mmap threshold, so each goes back to the OS
    when freed) fill six pageable unit slabs (written page by page): it grows by about one unit, far below the
    384 MiB that keeping the state dict beside the slabs costs. Measured in a fresh interpreter
    (test_cases/_rss.py)."""
    out = peak_growth("""
        import torch
        from runnerkit.offload import HostSource, StreamUnit

        units = [StreamUnit(f"b{i}", (f"b{i}.w",)) for i in range(6)]
        sd = {f"b{i}.w": torch.full((2**24,), float(i + 1)) for i in range(6)}

        def work():
            source = HostSource(units, sd, torch.float32, pin_memory=False, consume=True)
            values = all(bool(torch.all(s.buffer.view(torch.float32)[: 2**24] == i + 1))
                         for i, s in enumerate(source.slabs))
            return {"total": sum(s.nbytes for s in source.slabs), "left": len(sd), "values": values}

        measure(work)
    """)
    mib = 2**20
    assert out["total"] >= 384 * mib and (out["left"], out["values"]) == (0, True)
    assert out["grown"] < out["total"] // 2, f"peak RSS grew {out['grown'] / mib:.0f} MiB filling {out['total'] / mib:.0f} MiB"
