"""LTX-2's text connectors streamed through the block streamer (`offload.stream_modules` lists "connectors"):
the video and audio contexts equal the resident connectors' bit for bit, from host memory and from the
checkpoint file(s) (diffusers folder and single file), block and phase; the estimate counts only the
connectors' resident part and slots; the planner's 'auto' streams them when that is what makes a request fit
(LTX-2.3 22B fp8 on an 8 GiB device)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit import attention
from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.memory import MemoryLimit
from runnerkit.models.ltx2 import estimate as est
from runnerkit.models.ltx2.arch import LTX23_22B_ARCH
from runnerkit.models.ltx2.checkpoint_synthetic import SINGLE_FILE, UPSAMPLER_FILE, write_synthetic_ltx2
from runnerkit.models.ltx2.runner import LTX2Inputs, LTX2Runner
from runnerkit.planning import fit
from runnerkit.runners import loading
from runnerkit.runners.pipeline import InputInfo
from runnerkit.planning.planner import plan_offload
from runnerkit.runners.request_state import RequestState
from test_cases._alignment import misaligned_weights

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
INFO = InputInfo(prompt="a red fox", negative_prompt="", seed=0, height=64, width=64, frames=9)
CASES: dict[str, dict[str, Any]] = {
    "block_cpu": {"mode": "block"},
    "block_disk_3slots_prefetch2": {"mode": "block", "storage": "disk", "gpu_slots": 3, "prefetch_depth": 2},
    "phase_disk": {"mode": "phase", "storage": "disk"},
    "block_disk_single_file": {"mode": "block", "storage": "disk"},
}
T, VALID = 32, 19  # prompt tokens (a multiple of the tiny connectors' 4 registers), of which the last 19 are valid


def config_data() -> dict[str, Any]:
    return json.loads((CONFIGS / "ltx2_t2av_tiny.json").read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny config's synthetic checkpoint in both layouts (float32)."""
    arch = LTX2Runner.parse_arch(config_data()["model"])
    root = tmp_path_factory.mktemp("ltx2_connectors")
    return {layout: write_synthetic_ltx2(arch, root / layout, 0, torch.float32, layout)  # type: ignore[arg-type]
            for layout in ("diffusers", "single_file")}


def make_runner(ckpt: Path, layout: str, **offload: Any) -> LTX2Runner:
    paths: dict[str, Any] = {"model_path": str(ckpt)}
    if layout == "single_file":
        paths = {"model_path": str(ckpt / SINGLE_FILE), "upsampler_path": str(ckpt / UPSAMPLER_FILE),
                 "text_encoder_path": str(ckpt / "text_encoder"), "synthetic_checkpoint": None, "model": None}
    data = {**config_data(), "device": "cpu", **paths,
            "offload": {"stream_modules": ["transformer", "connectors"], **offload}}
    runner = LTX2Runner(load_runner_config(None, {k: v for k, v in data.items() if v is not None}))
    runner.prepare_load()
    return runner


def text_inputs() -> LTX2Inputs:
    """Stacked hidden states [1, T, 16 * 3] (the tiny Gemma's width x its layers + 1), left-padded mask."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, T, 48, generator=g)
    mask = (torch.arange(T) >= T - VALID).to(torch.int64)[None]  # [1, T]
    return LTX2Inputs(text_hidden=hidden, text_mask=mask)


def contexts(runner: LTX2Runner, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runner's own connectors stage on `module`: video [1, T, 32], audio [1, T, 8], mask [1, T]."""
    out = runner.run_connectors(RequestState(INFO, inputs=text_inputs(), modules={"connectors": module}))
    assert out.video_context is not None and out.audio_context is not None and out.context_mask is not None
    return out.video_context, out.audio_context, out.context_mask


@pytest.fixture(scope="module")
def resident(checkpoints: dict[str, Path]) -> tuple[torch.Tensor, ...]:
    runner = make_runner(checkpoints["diffusers"], "diffusers", mode="block")
    module = runner._load("connectors", CPU)
    assert misaligned_weights(module) == []  # bit identity must not hinge on where the weights sit
    return contexts(runner, module)


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_connectors_equal_the_resident_ones(checkpoints: dict[str, Path], resident: tuple[torch.Tensor, ...],
                                                     case: str) -> None:
    layout = "single_file" if case.endswith("single_file") else "diffusers"
    runner = make_runner(checkpoints[layout], layout, **CASES[case])
    model, streamer = runner.stream_connectors()
    try:
        phases = ("attn1", "ff") if CASES[case]["mode"] == "phase" else ("",)
        assert [u.module for u in streamer.units] == [  # video's 1D blocks, then audio's: the order forward runs
            f"{m}_connector.transformer_blocks.{i}{'.' + p if p else ''}"
            for m in ("video", "audio") for i in range(2) for p in phases]
        first = contexts(runner, model)
        streamer.reset()
        second = contexts(runner, model)
        stats = streamer.stats()
    finally:
        streamer.close()
    assert resident[0].abs().sum() > 0 and resident[1].abs().sum() > 0
    for got in (first, second):
        for g, want in zip(got, resident):
            assert g.dtype == want.dtype and torch.equal(g, want), case
    assert stats["h2d_copies"] >= 2 * len(streamer.units)
    if CASES[case].get("storage") == "disk":
        assert stats["disk_bytes_read"] > 0


def test_the_pipeline_streams_the_connectors_when_listed(checkpoints: dict[str, Path]) -> None:
    """`place_modules` (mode block) streams the connectors only when `offload.stream_modules` lists them;
    otherwise they are model-offloaded (whole on the device for their stage)."""
    for names, streamed in ((["transformer", "connectors"], True), (["transformer"], False)):
        runner = make_runner(checkpoints["diffusers"], "diffusers", mode="block", stream_modules=names)
        runner.attention = attention.resolve(runner.config.attention, runner.device, runner.dtype,
                                             runner.attention_head_dim())
        placement = loading.place_modules(runner, runner.describe_pipeline())
        try:
            assert ("connectors" in runner.streamers) is streamed and "transformer" in runner.streamers
            assert ("connectors" in placement.resident_modules) is streamed  # streamed: resident part + slots
        finally:
            for streamer in runner.streamers.values():
                streamer.close()


# ---- estimate and planner (LTX-2.3 22B, nothing allocated) -----------------------------------------------

GEMMA_12B = {"vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256}
SHAPE = (512, 768, 121)
CHOSEN = "block streaming from disk (reader pread; lazy_load; streams text_encoder, connectors, transformer)"
#: the same rung as the plan takes it: the vae and audio decoder kept, 2 transformer units resident beside the slots
CHOSEN_KEPT = CHOSEN[:-1] + "; 2 units resident; resident vae, audio_decoder)"
GIB = 1024**3


def connector_block_params() -> tuple[int, int, int]:
    """(all connector parameters, those of the 1D blocks, the largest block's), counted on the meta build."""
    connectors = est._meta("connectors", LTX23_22B_ARCH)
    total = sum(p.numel() for p in connectors.parameters())
    blocks = [b for m in (connectors.video_connector, connectors.audio_connector) for b in m.transformer_blocks]
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    assert len(blocks) == 16 and total == 3_172_227_584
    return total, sum(sizes), max(sizes)


def test_the_estimate_counts_the_streamed_connectors_resident_part_and_slots() -> None:
    total, blocks, largest = connector_block_params()
    whole = est.footprints(LTX23_22B_ARCH, tuple(GEMMA_12B.items()), torch.bfloat16,
                           OffloadConfig(mode="block", stream_modules=["transformer"]))["connectors"]
    off = OffloadConfig(mode="block", stream_modules=["transformer", "connectors"])
    streamed = est.footprints(LTX23_22B_ARCH, tuple(GEMMA_12B.items()), torch.bfloat16, off)["connectors"]
    assert whole.weight_bytes == streamed.weight_bytes == 2 * total
    assert not fit.streams("connectors", whole, OffloadConfig(mode="block", stream_modules=["transformer"]))
    assert fit.streams("connectors", streamed, off) and not streamed.stream_default  # only when listed
    assert streamed.stream_resident_bytes == 2 * (total - blocks)  # projections and registers: 2.15 GiB
    assert 2 * 2 * largest <= streamed.stream_slot_bytes < 2.01 * 2 * largest  # 2 slots of a video block: 0.75 GiB
    # the connectors' stage holds their resident part + slots, no longer the 5.9 GiB of the whole connectors
    config = load_runner_config(None, {"model_cls": "ltx2", "model_path": "/x", "offload": off.model_dump()})
    estimate = est.ltx2_estimate(LTX23_22B_ARCH, GEMMA_12B, SHAPE, 24, "t2av", torch.bfloat16, CUDA, off)
    held = fit.device_weights(estimate, "connectors", config, CUDA)["connectors"]
    assert held == streamed.stream_resident_bytes + streamed.stream_slot_bytes < 3 * GIB
    assert not any("connectors" in set(h.offload["stream_modules"]) - set(off.stream_modules) for h in estimate.hints)


def test_auto_streams_the_connectors_when_the_device_is_just_below_the_unstreamed_need() -> None:
    """The fp8 single-file release (block linears stored float8_e4m3fn) at 512x768x121: lazy disk streaming of
    Gemma-3 and the transformer with the connectors whole peaks in their stage; with 1 MiB less than that on
    the device, 'auto' takes the same rung with the connectors streamed too (the ladder's "every streamable
    module" rungs now list them; before, it refused: "... 0.34 GiB missing, peak in stage text_connectors")."""
    transformer = est._meta("transformer", LTX23_22B_ARCH)
    fp8 = frozenset(n for n, p in transformer.named_parameters() if n.startswith("transformer_blocks.") and p.dim() == 2)

    def estimate(off: OffloadConfig, shape: tuple[int, int, int]) -> fit.MemoryEstimate:
        return est.ltx2_estimate(LTX23_22B_ARCH, GEMMA_12B, shape, 24, "t2av", torch.bfloat16, CUDA, off, fp8)

    base = {"model_cls": "ltx2", "model_path": "/x"}
    without = {"mode": "block", "storage": "disk", "reader": "pread", "lazy_load": True,
               "stream_modules": ["text_encoder", "transformer"]}
    unstreamed = load_runner_config(None, {**base, "offload": without})
    need = fit.peak_of(estimate(unstreamed.offload, SHAPE), unstreamed, CUDA)
    assert need.stage == "text_connectors"
    limit = MemoryLimit(need.bytes - 2**20, "test: 1 MiB below the need without streamed connectors")
    auto = load_runner_config(None, {**base, "offload": {"mode": "auto"}})
    plan = plan_offload(auto, [SHAPE], CUDA, estimate, limit, None, lambda off: 1)
    chosen = plan.chosen.offload
    assert chosen.stream_modules is not None and "connectors" in chosen.stream_modules
    assert plan.chosen.peak is not None and plan.chosen.peak.bytes <= limit.bytes
    assert plan.rejected and all(e.device_missing > 0 for e in plan.rejected)  # every faster rung: the device
    assert plan.chosen.name == CHOSEN_KEPT
