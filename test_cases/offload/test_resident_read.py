"""Storage "disk": a streamed module's resident part is read in bounded batches (`offload.resident_read`).

The batch split (`plan_batches`, `batch_bound`); `stream_module` on the toy network (`_toy.py`, the fp8
release of `test_disk_fp8.py` and a bfloat16 one) with a small batch budget: the exact order of reads and
device copies, no tensor of a batch alive on the host when the next is read, fp8 scales read with their
weights, the same weights and outputs as one whole-part read and as the resident network; the memory planner's
load term (`ModuleFootprint.stream_load_bytes`) an upper bound of every batch read, and the plans it allows under
a small host limit.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.offload import resident_read, setup
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.resident_read import batch_bound, plan_batches, read_resident_batches
from runnerkit.offload.setup import stream_module
from runnerkit.planning.fit import MemoryEstimate, host_bytes_of, module_footprint
from runnerkit.weights import CheckpointError, build_on_meta
from test_cases._cli import restore_logger  # noqa: F401 (autouse fixture)
from test_cases.conftest import REPO
from test_cases.offload._toy import ToyModel, make_reference, state_dict_of, write_checkpoint
from test_cases.offload.test_disk_fp8 import FP8, RESIDENT, SPEC, expected_weights, fp8_checkpoint, resident_toy
from test_cases.tools.test_plan import no_checkpoints, run_plan  # noqa: F401 (a fixture)

X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
SMALL = 700
"""A batch budget below most of the toy's resident tensors' bytes (16 x 16 float32 weights: 1,024 bytes)."""


@pytest.mark.parametrize(("sizes", "budget", "batches"), [
    ([100, 50, 200, 10, 10], 150, [[0, 1], [2], [3, 4]]),  # the 200-byte item raises the bound to 200
    ([100, 50, 200, 10, 10], 1000, [[0, 1, 2, 3, 4]]),
    ([3, 3, 3], 1, [[0], [1], [2]]),  # one item per batch
    ([4, 4, 1, 8, 2, 2], 8, [[0, 1], [2], [3], [4, 5]]),  # greedy: 4 + 4 + 1 > 8
    ([], 8, []),
])
def test_batches_are_consecutive_and_within_the_bound(sizes: list[int], budget: int, batches: list[list[int]]) -> None:
    assert plan_batches(sizes, budget) == batches
    assert all(sum(sizes[i] for i in b) <= batch_bound(sizes, budget) for b in batches)


@pytest.mark.parametrize(("sizes", "budget", "bound"), [
    ([100, 50, 200], 150, 200),  # the largest item
    ([100, 50, 200], 250, 250),  # the budget
    ([100, 50, 200], 1000, 350),  # never more than all items
    ([], 8, 0),
])
def test_batch_bound(sizes: list[int], budget: int, bound: int) -> None:
    assert batch_bound(sizes, budget) == bound


def test_plan_batches_refuses_a_budget_below_one_byte() -> None:
    with pytest.raises(ValueError, match=r"`budget` must be at least 1 byte, got 0"):
        plan_batches([1], 0)


def test_names_the_checkpoint_lacks_are_refused_before_any_read(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    files = write_checkpoint(state_dict_of(make_reference(seed=0)), tmp_path)
    reader = SafetensorsDiskReader(files)
    monkeypatch.setattr(SafetensorsDiskReader, "load_tensors", lambda *a: pytest.fail("read"))
    with pytest.raises(CheckpointError, match=r"disk reader: 2 tensors are not in the checkpoint: nope, embed.weight_scale$"):
        read_resident_batches(reader, ["embed.weight", "nope"], {}, {"embed.weight": "embed.weight_scale"})


class Recorder:
    """Spies on the reader's batch reads and on `setup.to_compute` (one call per resident tensor put on the
    device). `events`: "read" per batch read and "move" per tensor moved, in order; `reads`: the names each
    read asked for; `alive_at_read`: bytes of earlier reads' tensors still alive when each read starts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.reads: list[list[str]] = []
        self.read_bytes: list[int] = []
        self.alive_at_read: list[int] = []
        self._held: list[tuple[weakref.ref[torch.Tensor], int]] = []
        real_load, real_move = SafetensorsDiskReader.load_tensors, setup.to_compute

        def load(reader: SafetensorsDiskReader, names: Iterable[str]) -> dict[str, torch.Tensor]:
            names = list(names)
            self.alive_at_read.append(sum(n for ref, n in self._held if ref() is not None))
            out = real_load(reader, names)
            self.events.append("read")
            self.reads.append(names)
            self.read_bytes.append(sum(t.nbytes for t in out.values()))
            self._held += [(weakref.ref(t), t.nbytes) for t in out.values()]
            return out

        def move(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.events.append("move")
            return real_move(*args, **kwargs)

        monkeypatch.setattr(SafetensorsDiskReader, "load_tensors", load)
        monkeypatch.setattr(setup, "to_compute", move)


def _stream(files: list[Path], mode: Literal["block", "phase"], dtype: torch.dtype, scales: dict[str, str],
            kept: int = 0, reader: Literal["mmap", "pread"] = "mmap") -> tuple[ToyModel, Any]:
    cfg = OffloadConfig(mode=mode, storage="disk", reader=reader, pin_memory=False, resident_blocks=kept)
    model = build_on_meta(ToyModel)
    return model, stream_module(model, SPEC, cfg, torch.device("cpu"), dtype, "toy", files=files, scale_map=scales)


@pytest.mark.parametrize(("mode", "kept"), [("block", 1), ("phase", 4)])
def test_each_batch_is_on_the_device_and_dropped_before_the_next_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: Literal["block", "phase"], kept: int) -> None:
    files, stored, scales = fp8_checkpoint(tmp_path)
    monkeypatch.setattr(resident_read, "RESIDENT_BATCH_BYTES", SMALL)
    spy = Recorder(monkeypatch)
    model, streamer = _stream(files, mode, torch.bfloat16, scales, kept)
    try:
        streamed = {p for u in streamer.units for p in u.params}
        resident = [n for n in model.state_dict() if n not in streamed]
        assert len(spy.reads) > 3, "the small budget splits the resident part"
        # exactly: batch read, each of its tensors to the device, then the next batch
        assert spy.events == [e for names in spy.reads
                              for e in ["read"] + ["move"] * sum(n in resident for n in names)]
        assert spy.alive_at_read == [0] * len(spy.reads)  # nothing of an earlier batch is on the host
        weights = [n for names in spy.reads for n in names if not n.endswith("weight_scale")]
        assert sorted(weights) == sorted(resident)  # each resident tensor read once, nothing streamed
        for names in spy.reads:  # a scale in the batch of its weight
            assert {n for n in names if n.endswith("weight_scale")} == {scales[n] for n in names if n in scales}
        bound = batch_bound([stored[n].nbytes + (4 if n in scales else 0) for n in resident], SMALL)
        assert max(spy.read_bytes) <= bound < sum(spy.read_bytes)
        # the planner's load term bounds every batch (fp8 weights at 1 byte, each with a 4-byte scale)
        cfg = OffloadConfig(mode=mode, storage="disk", resident_blocks=kept)
        fp8 = {n for n, t in stored.items() if t.dtype == FP8}
        footprint = module_footprint(build_on_meta(ToyModel), torch.bfloat16, SPEC.keep_fp32, SPEC, cfg,
                                     fp8_stored=fp8)
        # the toy's file keeps its biases in float32 (4 bytes read, 2 loaded: the planner's one blind spot, as
        # for the whole part), so the bound is checked against what the planner's sizes would read
        planned = batch_bound([stored[n].numel() * (1 if stored[n].dtype == FP8 else 2) + (4 if n in fp8 else 0)
                               for n in resident], SMALL)
        assert footprint.stream_load_bytes == planned
        run = RunnerConfig(model_cls="toy", task="t2v", model_path=str(tmp_path), offload=cfg)
        host = host_bytes_of(MemoryEstimate(modules={"toy": footprint}, stages=()), run, torch.device("cuda"))
        assert (host.transient_module, host.transient_bytes) == ("toy", planned)
    finally:
        streamer.close()


def _bf16_checkpoint(folder: Path) -> tuple[list[Path], dict[str, torch.Tensor]]:
    stored = {k: v.to(torch.bfloat16) for k, v in state_dict_of(make_reference(seed=0)).items()}
    return write_checkpoint(stored, folder), stored


@pytest.mark.parametrize("budget", [1, SMALL, None], ids=["largest-tensor", "small", "whole-part"])
@pytest.mark.parametrize("release", ["fp8", "bf16"])
def test_batched_reads_load_the_same_weights_as_one_read_and_the_resident_network(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int | None, release: str) -> None:
    """Budget 1 byte: batches of the largest tensor's size (mostly one tensor each); None: larger than the toy
    (one batch, the whole-part read it replaces)."""
    if budget is not None:
        monkeypatch.setattr(resident_read, "RESIDENT_BATCH_BYTES", budget)
    spy = Recorder(monkeypatch)
    if release == "fp8":
        files, stored, scales = fp8_checkpoint(tmp_path)
    else:
        (files, stored), scales = _bf16_checkpoint(tmp_path), {}
    want = expected_weights(stored, scales, torch.bfloat16)
    model, streamer = _stream(files, "block", torch.bfloat16, scales, kept=2, reader="pread")
    try:
        assert (len(spy.reads) == 1) is (budget is None)
        streamed = {p for u in streamer.units for p in u.params}
        for name, value in model.state_dict().items():
            if name not in streamed:
                assert value.dtype == torch.bfloat16 and torch.equal(value, want[name]), name
        if release == "fp8":
            assert stored[RESIDENT].dtype == FP8 and not torch.equal(model.embed.weight, stored[RESIDENT].bfloat16())
        with torch.no_grad():
            out = resident_toy(want)(X.bfloat16())
            for _ in range(2):
                assert torch.equal(model.eval()(X.bfloat16()), out)
    finally:
        streamer.close()


GIB = 1024**3


@pytest.mark.parametrize(("device_gib", "host_gib", "kept", "before"), [(80, 8, 60, 5), (24, 16, 28, 18)])
def test_a_small_host_limit_keeps_more_qwen_image_blocks_resident(
        no_checkpoints: Path, capsys: pytest.CaptureFixture[str], device_gib: int, host_gib: int, kept: int,  # noqa: F811
        before: int) -> None:
    """Qwen-Image (60 blocks) streamed from disk: the host counts one batch of the resident part, not all of it,
    so the plan keeps `kept` blocks resident where it kept `before`. On 80 GiB under 8 GiB of host memory every
    block stays: host = the text encoder's staging slabs + its largest batch (the embedding table, 152064 x
    3584 in bf16: one tensor) + the process's 2 GiB."""
    rc, out, err = run_plan(capsys, "--config_json", REPO / "configs/qwen_image/qwen_image_t2i_20b.json",
                            "--device_gib", device_gib, "--host_gib", host_gib)
    assert rc == 0 and out["offload"]["storage"] == "disk", err
    assert out["offload"]["resident_blocks"] == kept > before
    if host_gib == 8:
        slabs = {m["name"]: m["host_bytes"] for m in out["modules"]}
        assert slabs == {"text_encoder": slabs["text_encoder"], "transformer": 0, "vae": 0}
        assert out["host_gib"] == round((slabs["text_encoder"] + 152064 * 3584 * 2 + 2 * GIB) / GIB, 3)
