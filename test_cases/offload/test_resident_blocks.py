"""`offload.resident_blocks`: the units `split_resident` keeps load like resident weights, the others stream.

The split rule's exact indices; `stream_module` on the toy network (4 blocks: 4 block units, 12 phase units)
from host memory and from disk: the same output as the resident network and as `resident_blocks` 0, the
kept units' weights on the device outside the slots, the streamer over the other units only, one log line
saying how many stay, and the H2D copies of a steady forward pass: exactly the streamed units.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from loguru import logger

from runnerkit.config import OffloadConfig
from runnerkit.offload import BlockStreamer, StreamUnit, plan_units, split_resident
from runnerkit.offload.setup import stream_module
from runnerkit.weights import build_on_meta, to_compute
from test_cases.offload._engines import RecordingEngine
from test_cases.offload._toy import ToyModel, make_reference, state_dict_of, write_checkpoint


def _units(total: int) -> list[StreamUnit]:
    return [StreamUnit(f"blocks.{i}", (f"blocks.{i}.w",)) for i in range(total)]


@pytest.mark.parametrize(("total", "n", "kept"), [
    (10, 0, []),
    (10, 1, [5]),
    (10, 2, [2, 7]),
    (10, 3, [1, 5, 8]),
    (12, 4, [1, 4, 7, 10]),
    (4, 1, [2]),
    (4, 3, [0, 2, 3]),
    (4, 4, [0, 1, 2, 3]),
    (4, 9, [0, 1, 2, 3]),  # more than the module has: every unit stays
    (1, 1, [0]),
    (0, 3, []),
])
def test_split_keeps_the_middle_unit_of_each_of_n_equal_stretches(total: int, n: int, kept: list[int]) -> None:
    units = _units(total)
    got_kept, got_streamed = split_resident(units, n)
    assert got_kept == [units[i] for i in kept]
    assert got_streamed == [u for i, u in enumerate(units) if i not in kept]  # execution order kept


def test_split_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError, match=r"`resident_blocks` must be >= 0, got -1"):
        split_resident(_units(4), -1)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return state_dict_of(make_reference(seed=0))


def _resident(weights: dict[str, torch.Tensor]) -> ToyModel:
    """Every weight resident, 64-byte aligned as a resident load places it (`to_compute`)."""
    model = build_on_meta(ToyModel)
    model.load_state_dict({k: to_compute(v) for k, v in weights.items()}, assign=True)
    return model.eval()


def _streamed(weights: dict[str, torch.Tensor], folder: Path, mode: Literal["block", "phase"], storage: str,
              n: int) -> tuple[ToyModel, BlockStreamer]:
    cfg = OffloadConfig(mode=mode, storage=storage, resident_blocks=n, pin_memory=False)  # type: ignore[arg-type]
    model = build_on_meta(ToyModel)
    if storage == "cpu":
        return model, stream_module(model, ToyModel.STREAM_SPEC, cfg, torch.device("cpu"), torch.float32, "toy",
                                    state_dict=weights)
    folder.mkdir()
    files = write_checkpoint(weights, folder)
    return model, stream_module(model, ToyModel.STREAM_SPEC, cfg, torch.device("cpu"), torch.float32, "toy",
                                files=files)


X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("mode", "storage", "n"), [("block", "cpu", 1), ("phase", "disk", 5), ("block", "disk", 4),
                                                    ("phase", "cpu", 17)])
def test_kept_units_are_resident_and_the_output_is_the_resident_one(weights: dict[str, torch.Tensor], tmp_path: Path,
                                                                    mode: Literal["block", "phase"], storage: str,
                                                                    n: int) -> None:
    planned = plan_units(build_on_meta(ToyModel), mode, ToyModel.STREAM_SPEC)
    kept, streamed = split_resident(planned, n)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        model, streamer = _streamed(weights, tmp_path / "n", mode, storage, n)
    finally:
        logger.remove(sink)
    zero_model, zero = _streamed(weights, tmp_path / "zero", mode, storage, 0)
    try:
        assert streamer.units == streamed and streamer.num_slots == min(2, len(streamed))
        assert [line for line in lines if "units resident" in line] == [(
            f"toy: {mode} streaming of {len(streamed)} units from {storage}, {len(kept)} of {len(planned)} units "
            f"resident (offload.resident_blocks={n}; host memory pinned: False, slots={min(2, len(streamed))}, "
            f"prefetch=1, reader={'mmap' if storage == 'disk' else '-'})")]
        slots = {s.untyped_storage().data_ptr() for s in streamer._slots}
        for unit in kept:  # loaded once, outside the slots, with the checkpoint's values
            for name in unit.params:
                p = model.get_parameter(name)
                assert not p.is_meta and p.untyped_storage().data_ptr() not in slots, name
                assert torch.equal(p, weights[name]), name
        with torch.no_grad():
            want = _resident(weights)(X)
            for _ in range(2):  # the second pass fetches the streamed units again
                assert torch.equal(model.eval()(X), want)
                assert torch.equal(zero_model.eval()(X), want)
    finally:
        streamer.close()
        zero.close()


@pytest.mark.parametrize(("n", "copies"), [(0, 12), (4, 8), (12, 0)])
def test_a_steady_pass_copies_the_streamed_units_only(weights: dict[str, torch.Tensor], tmp_path: Path, n: int,
                                                      copies: int) -> None:
    """Phase mode, 12 units over 2 slots: every streamed unit shares its slot, so each steady pass copies
    each streamed unit once (the next pass's first unit as the wrap prefetch) and no kept unit ever."""
    model, streamer = _streamed(weights, tmp_path, "phase", "cpu", n)
    log: list[tuple[Any, ...]] = []
    streamer.engine = RecordingEngine(streamer.num_slots, log)
    try:
        with torch.no_grad():
            model.eval()(X)  # the first pass: the first unit is copied in its own pre-hook
            log.clear()
            model(X)
        copied = [label for kind, *rest in log if kind == "h2d" for label in rest[1:]]
        assert len(copied) == copies
        assert sorted(copied) == sorted(u.module for u in streamer.units)
    finally:
        streamer.close()
