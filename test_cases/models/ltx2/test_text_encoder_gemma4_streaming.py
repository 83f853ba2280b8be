"""LTX-2.5's Gemma-4 text encoder streamed through the block streamer (`offload.stream_modules` lists
"text_encoder"), as LTX-2.3's Gemma-3 is (test_text_encoder_streaming.py): the stacked hidden states the
runner hands the connectors equal the resident encoder's bit for bit, from host memory and from the folder's
safetensors, block and phase; a Gemma-4 with shared KV layers (no k/v projections, a double-wide MLP) and
sliding / full layers of different head widths streams its text layers and never reads the multimodal
embedders or the head; the estimate counts the streamed encoder (resident part + slots), and the memory plan
streams it where that is what makes LTX-2.5 fit a 16 / 24 GiB device. The LTX-2.5 runner end to end with
the text encoder streamed: test_ltx25_contract.py (its `*_streams_gemma4` modes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.memory import MemoryLimit
from runnerkit.models.ltx2.arch25 import LTX25_22B_PIPELINE_ARCH, tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint25 import tiny_gemma4_sizes, write_synthetic_ltx25
from runnerkit.models.ltx2.estimate25 import gemma4_footprint, ltx25_estimate
from runnerkit.models.ltx2.ltx25_arch import GEMMA4_12B_TEXT
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.models.ltx2.text_encoder import load_gemma_tokenizer
from runnerkit.models.ltx2.text_encoder_gemma4 import Gemma4PromptEncoder, load_gemma4_text_encoder
from runnerkit.models.ltx2.text_encoder_gemma4_stream import stream_gemma4_text_encoder
from runnerkit.planning import fit
from runnerkit.planning.planner import plan_offload
from runnerkit.synthetic import save_pretrained_here
from runnerkit.weights import safetensors_infos
from test_cases.models.ltx2._gemma_streaming import (
    check_streamed_case,
    count_disk_reads,
    resident_hidden_states,
    streaming_runner,
)

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ltx2" / "ltx25_t2av_tiny.json"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GIB = 2**30
CASES: dict[str, dict[str, Any]] = {
    "block_cpu": {"mode": "block"},
    "block_disk_3slots_prefetch2": {"mode": "block", "storage": "disk", "gpu_slots": 3, "prefetch_depth": 2},
    "phase_cpu": {"mode": "phase"},
    "phase_disk_pread": {"mode": "phase", "storage": "disk", "reader": "pread"},
}
ALL = ["text_encoder", "connectors", "transformer"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config's synthetic checkpoint: `text_encoder/` a 2-layer Gemma-4 (a sliding layer with 8-wide
    heads, then a full one with 16-wide heads and keys as values)."""
    return write_synthetic_ltx25(tiny_ltx25_arch(), tmp_path_factory.mktemp("ltx25_stream") / "ckpt", 0,
                                 torch.float32)


def make_runner(ckpt: Path, **offload: Any) -> LTX25Runner:
    return streaming_runner(LTX25Runner, CONFIG, ckpt, **offload)


@pytest.fixture(scope="module")
def resident(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    return resident_hidden_states(make_runner(checkpoint, mode="block"))


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_hidden_states_equal_the_resident_encoders(checkpoint: Path, resident: tuple[torch.Tensor, ...],
                                                            case: str) -> None:
    check_streamed_case(make_runner(checkpoint, **CASES[case]), CASES[case], resident, case,
                        head_dims=[8, 16])  # sliding, then full


# ---- shared KV layers, unread tensors ----------------------------------------------------------------------
def _shared_kv_gemma4(folder: Path) -> Path:
    """A `Gemma4UnifiedForConditionalGeneration` folder of 4 layers (sliding, full, sliding, full; the last two
    reuse the keys and values of the first two and have a double-wide MLP), norms and layer scalars away from
    their init; plus tensors the text model does not take (a vision embedder's, an untied head)."""
    text = transformers.Gemma4UnifiedTextConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=16, max_position_embeddings=256, num_kv_shared_layers=2, use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention"] * 2)
    config = transformers.Gemma4UnifiedConfig(text_config=text.to_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = transformers.Gemma4UnifiedForConditionalGeneration(config)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if "norm" in name or "layer_scalar" in name:
                    tensor.add_(torch.randn_like(tensor) * 0.3)
    save_pretrained_here(model, folder)
    write_debug_tokenizer(folder, 98)
    tensors = load_file(folder / "model.safetensors")
    tensors |= {"model.embed_vision.embedding_projection.weight": torch.ones(16, 4),
                "lm_head.weight": torch.ones(128, 16)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(("mode", "storage"), [("block", "disk"), ("phase", "disk"), ("phase", "cpu")])
def test_shared_kv_layers_stream_and_only_the_text_model_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  mode: str, storage: str) -> None:
    """KV-sharing layers hold only q / o projections, the q norm and their (double-wide) MLP: units of other
    sizes than the layers they reuse; the hidden states still equal the resident model's bit for bit, and the
    disk reads (counted by tensor name, both storages) are the text model's tensors only."""
    folder = _shared_kv_gemma4(tmp_path / "gemma-4")
    encoder = Gemma4PromptEncoder(load_gemma_tokenizer(folder), load_gemma4_text_encoder(folder, torch.float32, CPU),
                                  32)
    want = encoder.encode(["a fox~ in snow", ""])
    read = count_disk_reads(monkeypatch)
    model, streamer = stream_gemma4_text_encoder(folder, OffloadConfig(mode=mode, storage=storage), CPU, torch.float32)
    try:
        attn = [layer.self_attn for layer in model.layers]
        assert [(a.is_kv_shared_layer, a.k_proj is not None if hasattr(a, "k_proj") else False) for a in attn] == [
            (False, True), (False, True), (True, False), (True, False)]
        assert [layer.mlp.intermediate_size for layer in model.layers] == [32, 32, 64, 64]
        encoder.model = model
        got = encoder.encode(["a fox~ in snow", ""])
        assert len(streamer.units) == 4 * (2 if mode == "phase" else 1)
        assert streamer.stats()["h2d_copies"] >= len(streamer.units)  # + the wrap's prefetch
    finally:
        streamer.close()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    names = set(safetensors_infos([folder / "model.safetensors"], "gemma"))
    text = {n for n in names if n.startswith("model.language_model.")}
    assert len(text) + 2 == len(names) and set(read) == text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_skeletons_buffers_are_those_from_pretrained_computes(checkpoint: Path, dtype: torch.dtype) -> None:
    """Both RoPE tables (default RoPE of the sliding layers, proportional of the full ones), the embedding
    scale, the layer scalars: same names, dtypes and values as transformers' own load."""
    folder = checkpoint / "text_encoder"
    loaded = dict(load_gemma4_text_encoder(folder, dtype, CPU).named_buffers())
    model, streamer = stream_gemma4_text_encoder(folder, OffloadConfig(mode="block"), CPU, dtype)
    streamer.close()
    built = dict(model.named_buffers())
    assert sorted(built) == sorted(loaded)
    assert {"rotary_emb.sliding_attention_inv_freq", "rotary_emb.full_attention_inv_freq"} <= set(built)
    for name, buf in built.items():
        assert buf.dtype == loaded[name].dtype and torch.equal(buf, loaded[name]), name


# ---- the memory estimate and the plan ----------------------------------------------------------------------
def test_the_estimate_counts_the_streamed_gemma4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed in `stream_modules`: the text encoder's footprint is its resident part + slots, and no hint names
    Gemma-4; not listed: the whole model, and a hint says how to stream it (with Gemma-4's size)."""
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    fresh = {}
    for listed in (False, True):
        data = {**json.loads(CONFIG.read_text()), "device": "cpu",
                "offload": {"mode": "block", **({"stream_modules": ["transformer", "text_encoder"]} if listed else {})}}
        runner = LTX25Runner(load_runner_config(None, data))
        estimate = runner.estimate_memory((64, 64, 9))
        gemma = estimate.modules["text_encoder"]
        held = fit.device_weights(estimate, "text_encoder", runner.config, CUDA)["text_encoder"]
        fresh[listed] = (gemma, held, estimate.hints)
    (whole, held_whole, hints_whole), (streamed, held_streamed, hints_streamed) = fresh[False], fresh[True]
    assert whole.weight_bytes == streamed.weight_bytes == held_whole
    assert streamed.stream_resident_bytes is not None and not streamed.stream_default
    assert held_streamed == streamed.stream_resident_bytes + streamed.stream_slot_bytes
    sizes: dict[str, Any] = tiny_gemma4_sizes(tiny_ltx25_arch())
    V, D = sizes["vocab_size"], sizes["hidden_size"]
    buffers = 4 * (sizes["num_hidden_layers"] + 1)  # the layer scalars and the embedding scale (float32 scalars)
    rope = 4 * 2 * (sizes["head_dim"] // 2 + sizes["global_head_dim"] // 2)  # both tables and their originals
    assert streamed.stream_resident_bytes == 4 * (V * D + D) + buffers + rope  # embedding, final norm, buffers
    streaming = [h for h in hints_whole if "stream_modules" in h.offload]  # the others: the decoder's tiling
    assert [h.offload["stream_modules"] for h in streaming] == [
        ("transformer", "text_encoder"), ("transformer", "connectors"), ("transformer", "text_encoder", "connectors")]
    assert "the Gemma-4 text encoder, 0.0 GiB" in streaming[0].text
    assert not any("Gemma" in h.text for h in hints_streamed)


def _gemma4_12b() -> dict[str, Any]:
    return transformers.Gemma4UnifiedTextConfig(**GEMMA4_12B_TEXT).to_dict()


@pytest.mark.parametrize("mode", ["block", "phase"])
def test_the_12b_gemma4_streams_all_but_its_embedding(mode: str) -> None:
    """Gemma-4 12B in bf16: 22.2 GiB whole; streamed, the device holds the embedding and the final norm (1.88 GiB;
    in phase also the 4 norms of each layer) and two slots of the largest unit: a full-attention layer (its
    512-wide q / o, one key head as the value, no v_proj) in block mode, an MLP in phase mode."""
    D, I, V = 3840, 15360, 262144
    offload = OffloadConfig(mode=mode, stream_modules=["text_encoder"])
    footprint = gemma4_footprint(_gemma4_12b(), torch.bfloat16, offload)
    assert 22.1 * GIB < footprint.weight_bytes < 22.2 * GIB
    small_buffers = footprint.stream_resident_bytes - 2 * (V * D + D + (48 * 4 * D if mode == "phase" else 0))
    assert 0 < small_buffers < 8 * 1024  # RoPE tables, layer scalars, embedding scale
    mlp = 3 * D * I
    full_layer = D * 16 * 512 * 2 + D * 512 + 2 * 512 + mlp + 4 * D  # q and o, k (= v), q / k norms, MLP, norms
    unit = 2 * (full_layer if mode == "block" else mlp)
    assert 2 * unit <= footprint.stream_slot_bytes < 2.01 * unit


@pytest.mark.parametrize(("gib", "shape"), [(16, (256, 384, 25)), (24, (512, 768, 121))])
def test_auto_streams_gemma4_where_that_makes_ltx25_fit(gib: int, shape: tuple[int, int, int]) -> None:
    """LTX-2.5 22B in bf16 on a 16 GiB device (256x384x25) and on a 24 GiB one (512x768x121): 'auto' takes a
    rung that streams the text encoder; the same rung with Gemma-4 whole on the device for its stage needs
    more than the device (its 22.2 GiB of weights), so without Gemma-4 streaming the plan could not take it."""
    text = _gemma4_12b()

    def estimate(off: OffloadConfig, s: tuple[int, int, int]) -> fit.MemoryEstimate:
        return ltx25_estimate(LTX25_22B_PIPELINE_ARCH, text, s, 24, "t2av", torch.bfloat16, CUDA, off)

    base = {"model_cls": "ltx2.5", "model_path": "/x"}
    limit = MemoryLimit(gib * GIB, f"test: a {gib} GiB device")
    plan = plan_offload(load_runner_config(None, {**base, "offload": {"mode": "auto"}}), [shape], CUDA, estimate,
                        limit, None, lambda off: 1)
    chosen = plan.chosen.offload
    assert chosen.stream_modules is not None and "text_encoder" in chosen.stream_modules
    assert plan.chosen.peak is not None and plan.chosen.peak.bytes <= limit.bytes
    whole = chosen.model_copy(update={"stream_modules": tuple(m for m in chosen.stream_modules if m != "text_encoder")})
    config = load_runner_config(None, {**base, "offload": whole.model_dump()})
    need = fit.peak_of(estimate(config.offload, shape), config, CUDA)
    assert need.stage == "text_encoder" and need.bytes > limit.bytes
