"""LTX-2's Gemma-3 text encoder streamed through the block streamer (issue 21, `offload.stream_modules`):
the stacked hidden states the runner hands the connectors equal the resident encoder's bit for bit, from
host memory and from the folder's safetensors, block and phase; a release-style folder
(`Gemma3ForConditionalGeneration`, `language_model.model.*` keys, a vision tower) streams its text
layers and never reads the vision tensors; the estimate counts the streamed encoder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.models.ltx2 import text_encoder as te
from runnerkit.models.ltx2.arch import LTX2Arch, tiny_ltx2_arch
from runnerkit.models.ltx2.checkpoint_synthetic import (
    GEMMA_VOCAB,
    tiny_gemma_sizes,
    write_synthetic_ltx2,
    write_tiny_gemma,
)
from runnerkit.models.ltx2.estimate import GEMMA_DEFAULTS, gemma_footprint, gemma_parameters
from runnerkit.models.ltx2.runner import LTX2Runner
from runnerkit.planning import fit
from runnerkit.weights import safetensors_infos
from test_cases._encoder_streaming import (
    assert_streamed_parity,
    deterministic_cuda,
    streamed_encoder,
    two_requests,
)
from test_cases.models.ltx2._gemma_streaming import (
    check_streamed_case,
    count_disk_reads,
    hidden_states,
    resident_hidden_states,
    streaming_runner,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
CPU = torch.device("cpu")
CASES: dict[str, dict[str, Any]] = {
    "block_cpu": {"mode": "block"},
    "block_disk_3slots_prefetch2": {"mode": "block", "storage": "disk", "gpu_slots": 3, "prefetch_depth": 2},
    "phase_cpu": {"mode": "phase"},
    "phase_disk": {"mode": "phase", "storage": "disk"},
}


def tiny_arch() -> LTX2Arch:
    return LTX2Runner.parse_arch(json.loads((CONFIGS / "ltx2_t2av_tiny.json").read_text())["model"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config's synthetic checkpoint (diffusers layout: `text_encoder/` is a `Gemma3TextModel`)."""
    return write_synthetic_ltx2(tiny_arch(), tmp_path_factory.mktemp("ltx2_stream") / "ckpt", 0, torch.float32)


def make_runner(ckpt: Path, **offload: Any) -> LTX2Runner:
    return streaming_runner(LTX2Runner, CONFIGS / "ltx2_t2av_tiny.json", ckpt, **offload)


@pytest.fixture(scope="module")
def resident(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    return resident_hidden_states(make_runner(checkpoint, mode="block"))


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_hidden_states_equal_the_resident_encoders(checkpoint: Path, resident: tuple[torch.Tensor, ...],
                                                            case: str) -> None:
    check_streamed_case(make_runner(checkpoint, **CASES[case]), CASES[case], resident, case)


@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_a_release_folder_streams_its_text_layers_only(tmp_path: Path, storage: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`Gemma3ForConditionalGeneration` keys (`language_model.model.*`): mapped to the text model; the vision
    tower's and projector's bytes are never read (every read is counted by tensor name)."""
    folder = write_tiny_gemma(tmp_path / "gemma-3", tiny_ltx2_arch("2.3"), 5, vision=True)
    write_debug_tokenizer(folder, GEMMA_VOCAB)
    encoder = te.GemmaPromptEncoder(te.load_gemma_tokenizer(folder), te.load_gemma_text_encoder(folder, torch.float32,
                                                                                                 CPU), 32)
    want = encoder.encode(["a fox", ""])
    read = count_disk_reads(monkeypatch)
    model, streamer = te.stream_gemma_text_encoder(folder, OffloadConfig(mode="block", storage=storage), CPU,
                                                   torch.float32)
    try:
        encoder.model = model
        got = encoder.encode(["a fox", ""])
    finally:
        streamer.close()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    names = set(safetensors_infos([folder / "model.safetensors"], "gemma"))
    text = {n for n in names if n.startswith(te.TEXT_PREFIXES)}
    assert len(text) < len(names) and set(read) == text  # the text model's tensors, and nothing else


def test_the_estimate_counts_the_streamed_gemma(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed in `stream_modules`: the text encoder's footprint is its resident part + slots (no hint);
    not listed: the whole model, and the hint says how to stream it."""
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    fresh = {}
    for listed in (False, True):
        data = {**json.loads((CONFIGS / "ltx2_t2av_tiny.json").read_text()), "device": "cpu",
                "offload": {"mode": "block", **({"stream_modules": ["transformer", "text_encoder"]} if listed else {})}}
        runner = LTX2Runner(load_runner_config(None, data))
        estimate = runner.estimate_memory((64, 64, 9))
        gemma = estimate.modules["text_encoder"]
        held = fit.device_weights(estimate, "text_encoder", runner.config, torch.device("cuda"))["text_encoder"]
        fresh[listed] = (gemma, held, estimate.hints)
    (whole, held_whole, hints_whole), (streamed, held_streamed, hints_streamed) = fresh[False], fresh[True]
    assert whole.weight_bytes == streamed.weight_bytes == held_whole  # 4 x the tiny Gemma's 6,832 parameters
    assert streamed.stream_resident_bytes is not None and not streamed.stream_default
    assert held_streamed == streamed.stream_resident_bytes + streamed.stream_slot_bytes
    sizes = tiny_gemma_sizes(tiny_arch())
    assert streamed.stream_resident_bytes == 4 * (sizes["vocab_size"] + 1) * sizes["hidden_size"]  # embedding, norm
    assert any("stream_modules" in h.text for h in hints_whole) and not any("Gemma" in h.text for h in hints_streamed)
    # one hint per module that could stream (text encoder, connectors), then both together
    assert [h.offload for h in hints_whole] == [{"mode": "block", "stream_modules": ("transformer", "text_encoder")},
                                                {"mode": "block", "stream_modules": ("transformer", "connectors")},
                                                {"mode": "block", "stream_modules": ("transformer", "text_encoder",
                                                                                     "connectors")}]


@pytest.mark.parametrize("mode", ["block", "phase"])
def test_the_12b_gemma_streams_all_but_its_embedding(mode: str) -> None:
    """google/gemma-3-12b-it in bf16: 21.9 GiB whole; streamed, the device holds the embedding and final norm
    (1.88 GiB) and two slots of one layer (block) or of its MLP (phase; the norms then stay resident)."""
    g = {**GEMMA_DEFAULTS, "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
         "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256}
    footprint = gemma_footprint(g, torch.bfloat16, OffloadConfig(mode=mode, stream_modules=["text_encoder"]))
    D, layer = 3840, gemma_parameters({**g, "num_hidden_layers": 1, "vocab_size": 0}) - 3840  # one layer's parameters
    assert footprint.weight_bytes == 2 * 11_766_034_176
    norms = 48 * 4 * D if mode == "phase" else 0
    assert footprint.stream_resident_bytes == 2 * (262208 * D + D + norms)
    unit = 2 * layer if mode == "block" else 2 * 3 * D * 15360
    assert 2 * unit <= footprint.stream_slot_bytes < 2.01 * unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_skeletons_buffers_are_those_from_pretrained_computes(checkpoint: Path, dtype: torch.dtype) -> None:
    """RoPE tables and the embedding scale: same names, dtypes (bf16: the scale follows the default dtype
    transformers builds under) and values as transformers' own load; every parameter still on meta."""
    from runnerkit.offload.encoders import hf_skeleton

    folder = checkpoint / "text_encoder"
    loaded = dict(te.load_gemma_text_encoder(folder, dtype, CPU).named_buffers())
    skeleton = hf_skeleton(lambda: te._GemmaTextTower(te.gemma_text_config(folder)), dtype)
    built = dict(skeleton.named_buffers())
    assert sorted(built) == sorted(loaded) and any("inv_freq" in n for n in built)
    for name, buf in built.items():
        assert buf.dtype == loaded[name].dtype and torch.equal(buf, loaded[name]), name
    assert built["embed_tokens.embed_scale"].dtype == dtype
    assert all(p.is_meta for p in skeleton.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["block_cpu", "phase_disk"])
def test_cuda_streamed_hidden_states_equal_the_resident_encoders(checkpoint: Path, case: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (copy stream, pinned slabs), under deterministic algorithms."""
    with deterministic_cuda(monkeypatch):
        runner = make_runner(checkpoint, **CASES[case])
        runner.device = torch.device("cuda")
        want = hidden_states(runner, runner.build_text_encoder(runner.device))
        with streamed_encoder(runner) as (model, streamer):
            runs, stats = two_requests(lambda m: hidden_states(runner, m), model, streamer)
    assert runs[0][0].is_cuda
    assert_streamed_parity(runs, want, stats, len(streamer.units), CASES[case].get("storage", "cpu"), case)
