"""Wan's UMT5 text encoder streamed through the block streamer (issue 21, `offload.stream_modules`):
the prompt embeddings the runner uses equal the resident encoder's bit for bit, from host memory and
from the checkpoint's safetensors (runnerkit and diffusers layouts), in block and phase mode; the
original layout's `.pth` encoder cannot stream from disk and says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import load_runner_config
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import ORIGINAL_T5, write_synthetic
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.models.wan.text_encoder import keep_fp32
from runnerkit.runners.pipeline import InputInfo
from test_cases._encoder_streaming import assert_streamed_parity, layer_units, streamed_encoder, text_stage, two_requests
from test_cases.conftest import TINY_CONFIG, tiny_config_dict

CPU = torch.device("cpu")
INFO = InputInfo(prompt="a red fox in the snow", negative_prompt="blurry, static", seed=0, height=48, width=80,
                 frames=9)
CASES: dict[str, dict[str, Any]] = {
    "block_cpu": {"mode": "block"},
    "block_disk": {"mode": "block", "storage": "disk"},
    "phase_cpu_3slots_prefetch2": {"mode": "phase", "gpu_slots": 3, "prefetch_depth": 2},
    "phase_disk_pread": {"mode": "phase", "storage": "disk", "reader": "pread"},
}


def make_runner(ckpt: Path, **offload: Any) -> WanT2VRunner:
    """The tiny config over `ckpt`, its text encoder listed in `offload.stream_modules`; prepared, not loaded."""
    config = tiny_config_dict(ckpt, offload={"stream_modules": ["transformer", "text_encoder"], **offload})
    runner = WanT2VRunner(load_runner_config(None, config))
    runner.prepare_load()
    return runner


def embeddings(runner: WanT2VRunner, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The runner's own text stage on `module`: (context, context_null) [1, L, dim] each."""
    return text_stage(runner, module, INFO, "context", "context_null")


@pytest.fixture(scope="module")
def layouts(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny architecture in the three layouts (the same weights: synthetic values follow the native names)."""
    arch = WanArch.model_validate(json.loads(TINY_CONFIG.read_text())["model"])
    root = tmp_path_factory.mktemp("wan_layouts")
    return {"runnerkit": tiny_ckpt,
            "diffusers": write_synthetic(arch, root / "diffusers", seed=0, dtype=torch.float32, layout="diffusers"),
            "original": write_synthetic(arch, root / "original", seed=0, dtype=torch.float32, layout="original")}


@pytest.fixture(scope="module")
def resident(tiny_ckpt: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings of the resident encoder (what every offload mode without encoder streaming uses)."""
    runner = make_runner(tiny_ckpt, mode="block")
    return embeddings(runner, runner.build_text_encoder(CPU))


@pytest.mark.parametrize("layout", ["runnerkit", "diffusers"])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_embeddings_equal_the_resident_encoders(layouts: dict[str, Path], resident: tuple[torch.Tensor, ...],
                                                         case: str, layout: str) -> None:
    runner = make_runner(layouts[layout], **CASES[case])
    phases = ("attn", "ffn") if CASES[case]["mode"] == "phase" else ("",)
    with streamed_encoder(runner) as (model, streamer):
        assert [u.module for u in streamer.units] == layer_units("blocks", len(model.blocks), phases)
        streamed = {p for u in streamer.units for p in u.params}
        layer_weights = {n for n, _ in model.named_parameters() if n.startswith("blocks.")}
        resident_layer_weights = {n.split(".", 2)[2] for n in layer_weights - streamed}
        # no layer is resident whole: only the float32 norms (and, per phase, the position bias) stay
        assert resident_layer_weights == ({"norm1.weight", "norm2.weight", "pos_embedding.embedding.weight"}
                                          if phases != ("",) else {"norm1.weight", "norm2.weight"})
        assert all(keep_fp32(n) for n in layer_weights - streamed if "pos_embedding" not in n)
        runs, stats = two_requests(lambda m: embeddings(runner, m), model, streamer)
    assert_streamed_parity(runs, resident, stats, len(streamer.units), CASES[case].get("storage", "cpu"),
                           f"{case}, {layout}")


def test_the_original_pth_encoder_streams_from_host_memory_only(layouts: dict[str, Path],
                                                                 resident: tuple[torch.Tensor, ...]) -> None:
    runner = make_runner(layouts["original"], mode="block", storage="disk")
    with pytest.raises(NotImplementedError, match=rf"{ORIGINAL_T5} is a \.pth file.*use `offload\.storage` 'cpu'"):
        runner.stream_text_encoder()
    runner = make_runner(layouts["original"], mode="block")
    with streamed_encoder(runner) as (model, _):
        got = embeddings(runner, model)
    assert all(torch.equal(g, want) for g, want in zip(got, resident))


def test_the_estimate_counts_the_streamed_encoder() -> None:
    """Listed in `stream_modules`: during its stage the device holds the encoder's resident part (token
    embedding, final norm, float32 layer norms) and its slots; not listed: the whole encoder."""
    from runnerkit.config import OffloadConfig, RunnerConfig
    from runnerkit.models.wan.estimate import wan_t2v_estimate
    from runnerkit.planning import fit

    arch = WanArch.model_validate(json.loads(TINY_CONFIG.read_text())["model"])
    te_arch, cuda = arch.text_encoder, torch.device("cuda")
    held = {}
    for names in (None, ("transformer", "text_encoder")):
        offload = OffloadConfig(mode="block", stream_modules=names)
        estimate = wan_t2v_estimate(arch, (48, 80, 9), torch.bfloat16, cuda, True, offload)
        config = RunnerConfig.model_validate({**json.loads(TINY_CONFIG.read_text()), "offload": offload.model_dump()})
        held[names is not None] = (estimate.modules["text_encoder"],
                                   fit.device_weights(estimate, "text_encoder", config, cuda)["text_encoder"])
    (whole, held_whole), (streamed, held_streamed) = held[False], held[True]
    assert held_whole == whole.weight_bytes and not streamed.stream_default
    norms = 4 * te_arch.dim * (2 * te_arch.num_layers + 1)  # float32
    assert streamed.stream_resident_bytes == 2 * te_arch.vocab_size * te_arch.dim + norms
    assert held_streamed == streamed.stream_resident_bytes + streamed.stream_slot_bytes


def test_a_diffusers_encoder_holding_only_the_embedding_alias_streams_from_disk(
        layouts: dict[str, Path], resident: tuple[torch.Tensor, ...], tmp_path: Path) -> None:
    """transformers may save the tied token embedding as `encoder.embed_tokens.weight` alone."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(layouts["diffusers"], tmp_path / "alias")
    files = sorted((folder / "text_encoder").glob("*.safetensors"))
    for path in files:
        tensors = load_file(str(path))
        if "shared.weight" in tensors:
            tensors["encoder.embed_tokens.weight"] = tensors.pop("shared.weight")
            save_file(tensors, str(path))
    runner = make_runner(folder, mode="block", storage="disk")
    with streamed_encoder(runner) as (model, _):
        got = embeddings(runner, model)
    assert all(torch.equal(g, want) for g, want in zip(got, resident))
