"""BlockStreamer re-entry (issue 21, item 3): a unit entered again while it is current (CFG branches run
block by block) computes from its slot: no refetch, no extra wait, the wrap prefetch still crosses steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runnerkit.offload import (
    BlockStreamer,
    CudaCopyEngine,
    DiskSource,
    SafetensorsDiskReader,
    SyncCopyEngine,
    plan_units,
)
from runnerkit.weights import build_on_meta
from test_cases.offload._engines import DeferredEngine, RecordingEngine
from test_cases.offload._fake_cuda import FakeCuda, check_slot_protocol
from test_cases.offload._toy import ToyModel, build_streamed, make_reference, state_dict_of, write_checkpoint


def forward_branches(model: ToyModel, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The toy's CFG-style one pass: embed every branch, then block i for every branch before block i+1."""
    hs = [model.embed(x) for x in xs]
    for block in model.blocks:
        for b in range(len(hs)):
            hs[b] = block(hs[b])
    return [model.head(h) for h in hs]


def branch_inputs(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step a (cond, uncond) pair of different inputs [2, 5, 8]."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("storage,num_blocks,gpu_slots,depth,engine_kind,hint", [
    ("host", 4, 2, 1, "sync", 2), ("host", 3, 2, 1, "deferred", 2), ("host", 3, 2, 1, "deferred", 1),
    ("pread", 4, 3, 2, "deferred", 2), ("pread", 5, 3, 2, "deferred", 2), ("pread", 5, 4, 3, "sync", 1)],
    ids=["host-4u-2s", "host-3u-2s-deferred", "host-3u-2s-deferred-no-hint", "pread-4u-3s-d2-deferred",
         "pread-5u-3s-d2-deferred", "pread-5u-4s-d3-no-hint"])
def test_branches_block_by_block_are_bit_identical(tmp_path: Path, storage: str, num_blocks: int, gpu_slots: int,
                                                   depth: int, engine_kind: str, hint: int) -> None:
    """Each branch's output equals the resident model's, over two steps and after the request boundary,
    whatever the slot/unit ratio (3u-2s and 5u-*: the wrap prefetch shares the last unit's slot), with
    the `entries` hint or without it (the hint only moves the wrap prefetch)."""
    reference = make_reference(seed=0, num_blocks=num_blocks)
    sd = state_dict_of(reference)
    files = write_checkpoint(sd, tmp_path) if storage != "host" else None
    engine = DeferredEngine(gpu_slots) if engine_kind == "deferred" else None
    model, streamer = build_streamed(sd, "block", storage, gpu_slots, depth, files=files, engine=engine,
                                     num_blocks=num_blocks)
    steps = branch_inputs()
    with torch.no_grad():
        for request in range(2):
            for pair in steps:
                with streamer.entries(hint):
                    outs = forward_branches(model, pair)
                for out, x in zip(outs, pair):
                    assert torch.equal(out, reference(x)), (request, hint)
            streamer.reset()
    every = 2 * 2 * num_blocks  # requests x steps x blocks: each block's second entry
    if hint == 2 or num_blocks % gpu_slots == 0:
        assert streamer.stats()["reentries"] == every
    else:  # no hint, a wrap prefetch into a computing unit's slot: that unit is fetched again once per step
        assert every - 2 * 2 * 2 <= streamer.stats()["reentries"] < every
    streamer.close()


def _recorded(num_blocks: int, gpu_slots: int, depth: int, hint: int,
              one_pass: bool) -> tuple[list[tuple], BlockStreamer]:
    log: list[tuple] = []
    reference = make_reference(seed=0, num_blocks=num_blocks)
    model, streamer = build_streamed(state_dict_of(reference), "block", "host", gpu_slots, depth,
                                     engine=RecordingEngine(gpu_slots, log), num_blocks=num_blocks)
    for j, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, j=j: log.append(("fwd", j)))
    with torch.no_grad():
        for pair in branch_inputs():
            if one_pass:
                with streamer.entries(hint):
                    forward_branches(model, pair)
            else:
                for x in pair:
                    model(x)
    return log, streamer


def test_exact_event_order_one_pass() -> None:
    """4 blocks, 2 slots, depth 1: each block is copied once per step and computed for both branches
    (the re-entry neither copies nor waits); the last block's pre-hook prefetches block 0 of the next step."""
    log, streamer = _recorded(4, 2, 1, hint=2, one_pass=True)

    def unit(j: int, first: bool = False) -> list[tuple]:
        s = j % 2
        ev = [("h2d", s, f"blocks.{j}")] if first else []
        ev += [("wait", s), ("h2d", (j + 1) % 2, f"blocks.{(j + 1) % 4}")]
        return ev + [("fwd", j), ("done", s), ("fwd", j), ("done", s)]

    step1 = unit(0, first=True) + unit(1) + unit(2) + unit(3)
    step2 = unit(0) + unit(1) + unit(2) + unit(3)
    assert log == step1 + step2
    assert streamer.state() == {"next_prefetch": 1, "issued": [0], "in_flight": 0, "pending": [], "slots": [0, 3]}
    assert streamer.stats()["h2d_copies"] == 1 + 2 * 4 and streamer.stats()["reentries"] == 2 * 4


@pytest.mark.parametrize("num_blocks,gpu_slots,depth", [(4, 2, 1), (6, 3, 2), (8, 4, 3)])
def test_one_pass_copies_half_of_two_passes(num_blocks: int, gpu_slots: int, depth: int) -> None:
    """Every slot is shared by several units, so two forwards copy every unit twice per step and the
    one pass once: depth + steps * units against depth + 2 * steps * units copies (depth: the last
    step's wrap prefetch)."""
    one, _ = _recorded(num_blocks, gpu_slots, depth, hint=2, one_pass=True)
    two, _ = _recorded(num_blocks, gpu_slots, depth, hint=1, one_pass=False)
    copies = [sum(1 for e in log if e[0] == "h2d") for log in (one, two)]
    assert copies == [depth + 2 * num_blocks, depth + 2 * 2 * num_blocks]
    fwd = [e[1] for e in one if e[0] == "fwd"]
    assert fwd == [j for j in range(num_blocks) for _ in range(2)] * 2  # block i for both branches, then i+1


@pytest.mark.parametrize("hint", [2, 1], ids=["entries2", "no-hint"])
def test_wrap_prefetch_into_the_last_units_slot(hint: int) -> None:
    """3 blocks over 2 slots: block 0 of the next step goes to the slot block 2 computes in. With the hint
    it is issued after block 2's second entry (before the next step); without it after the first entry,
    so the second entry finds its slot overwritten and fetches block 2 again (correct, one extra copy)."""
    log, _ = _recorded(3, 2, 1, hint=hint, one_pass=True)
    fwd_at = [i for i, e in enumerate(log) if e[0] == "fwd"]
    step2 = fwd_at[6]  # first compute of step 2 (3 blocks x 2 branches per step)
    wrap = [i for i, e in enumerate(log[:step2]) if e[0] == "h2d" and e[2] == "blocks.0"][1]
    if hint == 2:
        assert fwd_at[5] < wrap < step2, "block 0 of step 2 must be copied after block 2's last entry"
        assert sum(1 for e in log[:step2] if e[0] == "h2d") == 4  # blocks 0, 1, 2 and the wrap
    else:
        assert fwd_at[4] < wrap < fwd_at[5]
        refetch = [i for i, e in enumerate(log) if e == ("h2d", 0, "blocks.2")]
        assert len(refetch) == 2 * 2 and wrap < refetch[1] < fwd_at[5]


def test_reentry_state_and_reset() -> None:
    """After a one-pass step the wrap prefetch is the only unit issued; reset reaches the fresh state."""
    reference = make_reference(seed=0, num_blocks=4)
    model, streamer = build_streamed(state_dict_of(reference), "block", "host", 2, 1, engine=DeferredEngine(2))
    pair = branch_inputs(1)[0]
    with torch.no_grad():
        with streamer.entries(2):
            forward_branches(model, pair)
        assert streamer.state() == {"next_prefetch": 1, "issued": [0], "in_flight": 1, "pending": [], "slots": [0, 3]}
        streamer.reset()
        assert streamer.state() == {"next_prefetch": 0, "issued": [], "in_flight": 0, "pending": [],
                                    "slots": [None, None]}
        assert torch.equal(model(pair[0]), reference(pair[0]))  # a plain forward after the boundary


def test_entries_restored_and_checked() -> None:
    reference = make_reference(seed=0, num_blocks=4)
    _, streamer = build_streamed(state_dict_of(reference), "block", "host", 2, 1)
    with pytest.raises(ValueError, match=r"`n` \(entries per unit\) must be >= 1, got 0"):
        with streamer.entries(0):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with streamer.entries(2):
            assert streamer.entries_per_unit == 2
            raise RuntimeError("boom")
    assert streamer.entries_per_unit == 1


@pytest.mark.parametrize("num_blocks,gpu_slots,depth,hint", [(4, 2, 1, 2), (3, 2, 1, 2), (3, 2, 1, 1), (5, 3, 2, 2),
                                                             (5, 4, 3, 1)])
def test_real_cuda_engine_orders_reentries(monkeypatch: pytest.MonkeyPatch, num_blocks: int, gpu_slots: int,
                                           depth: int, hint: int) -> None:
    """The real CudaCopyEngine on fake streams, one-pass over two steps and a request boundary: every
    compute (both entries of a block) uses its block's bytes, waits for their copy, and finishes before
    the next copy into its slot starts (the wrap prefetch into the last block's slot included)."""
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    engine = CudaCopyEngine("cuda", gpu_slots)
    cuda.name_engine_events(engine)
    reference = make_reference(seed=0, num_blocks=num_blocks)
    model, streamer = build_streamed(state_dict_of(reference), "block", "host", gpu_slots, depth, engine=engine,
                                     num_blocks=num_blocks)
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
    steps = branch_inputs()
    with torch.no_grad():
        for pair in [*steps, None, steps[0]]:
            if pair is None:
                streamer.reset()
                continue
            with streamer.entries(hint):
                outs = forward_branches(model, pair)
            assert all(torch.equal(out, reference(x)) for out, x in zip(outs, pair))
    assert check_slot_protocol(cuda.ops, lambda label: label.split()[0],
                               lambda label: label.split()[1]) == 3 * 2 * num_blocks
    streamer.close()


def test_disk_source_out_of_order_fetch_keeps_each_units_bytes(tmp_path: Path) -> None:
    """A unit fetched out of order (a re-entered unit whose slot was overwritten is fetched again) goes to
    the staging slab a read-ahead of another unit is filling: the read-ahead is finished and forgotten, so
    neither fetch hands out the other unit's bytes (before the fix, unit 1 came back holding unit 3's)."""
    sd = state_dict_of(make_reference(seed=0, num_blocks=4))
    units = plan_units(build_on_meta(lambda: ToyModel(4)), "block", ToyModel.STREAM_SPEC)
    source = DiskSource(units, SafetensorsDiskReader(write_checkpoint(sd, tmp_path), reader="pread"), torch.float32,
                        pin_memory=False)
    source.bind(2)
    engine = SyncCopyEngine(2)

    def holds(buffer: torch.Tensor, unit: int) -> bool:
        return all(torch.equal(buffer[t.offset:t.offset + t.nbytes], sd[t.name].reshape(-1).view(torch.uint8))
                   for t in source.layouts[unit].tensors)

    source.fetch(0, 0, engine)  # reads unit 1 ahead into staging slab 1
    source._ahead[1][0].result()  # that read has landed (deterministic order)
    assert holds(source.fetch(3, 1, engine).clone(), 3)  # out of order, into staging slab 1
    assert holds(source.fetch(1, 1, engine).clone(), 1)
    source.reset()
    source.fetch(0, 0, engine)  # unit 1 read ahead into slab 1 again
    source._ahead[1][0].result()
    assert holds(source.fetch(2, 0, engine).clone(), 2)  # out of order: its read-ahead (unit 3) would go to slab 1
    assert holds(source.fetch(1, 1, engine).clone(), 1)  # ... and is not started while unit 1's is there
    source.close()
