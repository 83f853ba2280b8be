"""LoRA parity with diffusers: our adapted transformer (unfused and fused) against diffusers'
`load_lora_weights` + `set_adapters` on the same tiny weights and tiny random adapters, in each
public layout (PEFT/diffusers names, kohya/musubi flattened names with alpha, LightX2V's original
names with alpha and bias deltas), two adapters at once with their own strengths; float32, <= 1e-4."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runnerkit.lora import LoRAManager, linear_targets
from runnerkit.lora.synthetic import synthetic_adapter
from runnerkit.models.wan import lora_keys
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
require_reference("peft")  # diffusers' LoRA loading needs it

from test_cases.models.qwen_image import test_transformer as qwen_t  # noqa: E402
from test_cases.models.wan import test_transformer as wan_t  # noqa: E402

TOL = 1e-4
STRENGTHS = (0.8, -0.6)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ours(model: torch.nn.Module, mode: str, files: list[Path], aliases=lambda names: {}) -> LoRAManager:  # noqa: ANN001
    manager = LoRAManager(mode, 16, torch.device("cpu"), torch.float32, aliases, "test transformer")
    manager.attach("transformer", model)
    manager.set_request([(str(f), s) for f, s in zip(files, STRENGTHS)])
    return manager


def _reference_with(pipe_cls: type, transformer: torch.nn.Module, files: list[Path]) -> torch.nn.Module:
    pipe = pipe_cls(**{k: None for k in ("tokenizer", "text_encoder", "vae", "scheduler")}, transformer=transformer)
    for i, f in enumerate(files):
        pipe.load_lora_weights(str(f), adapter_name=f"a{i}")
    pipe.set_adapters([f"a{i}" for i in range(len(files))], list(STRENGTHS[: len(files)]))
    return pipe.transformer


WAN_LAYOUTS = {  # layout -> (alpha, bias deltas)
    "peft": (None, False),
    "kohya": (8.0, False),
    "lightx2v": (2.0, True),
}


@pytest.mark.parametrize("mode", ["unfused", "fused"])
@pytest.mark.parametrize("layout", list(WAN_LAYOUTS))
@torch.no_grad()
def test_wan_matches_diffusers(tmp_path: Path, layout: str, mode: str) -> None:
    reference = wan_t._diffusers_model()
    model = wan_t._load(wan_t.diffusers_to_native(reference.state_dict()))
    layers = lora_keys.block_layers(model)
    names = {v: k for k, v in lora_keys.lora_aliases(list(layers)).items()} if layout == "peft" else {}
    alpha, bias = WAN_LAYOUTS[layout]
    files = []
    for seed, rank in ((1, 4), (2, 6)):
        files.append(tmp_path / f"{layout}_{seed}.safetensors")
        save_file(synthetic_adapter(layers, layout, rank, seed, alpha, names, bias=bias), str(files[-1]))  # type: ignore[arg-type]
    latents, timestep, context, padded = wan_t._inputs(2, 4, 6, [5, 3], [999.0, 500.0])
    base = model(latents, timestep, context)

    manager = _ours(model, mode, files, lora_keys.lora_aliases)
    out = model(latents, timestep, context)
    expected = _reference_with(diffusers.WanPipeline, reference, files)(latents, timestep, padded, return_dict=False)[0]

    assert (out - base).abs().max() > 100 * TOL, "the adapters must change the output"
    err = (out - expected).abs().max().item()
    assert err <= TOL, f"{layout}/{mode}: max abs error {err:.3g}"
    manager.clear()
    assert torch.equal(model(latents, timestep, context), base), "clear must give the base model back bit for bit"


QWEN_LAYOUTS = {"peft": None, "kohya": 8.0, "lightx2v": 4.0}  # Qwen-Image-Lightning: original names + alpha


@pytest.mark.parametrize("mode", ["unfused", "fused"])
@pytest.mark.parametrize("layout", list(QWEN_LAYOUTS))
@torch.no_grad()
def test_qwen_image_matches_diffusers(tmp_path: Path, layout: str, mode: str) -> None:
    reference = qwen_t._reference(False)
    model = qwen_t._ours(reference)
    layers = {n: (m.out_features, m.in_features) for n, m in linear_targets(model).items()
              if n.startswith("transformer_blocks.")}
    files = []
    for seed, rank in ((1, 4), (2, 6)):
        files.append(tmp_path / f"{layout}_{seed}.safetensors")
        save_file(synthetic_adapter(layers, layout, rank, seed, QWEN_LAYOUTS[layout]), str(files[-1]))  # type: ignore[arg-type]
    shapes = qwen_t.T2I_SHAPES
    x, txt, t = qwen_t._inputs(shapes, 1)
    base = model(x, txt, t, shapes)

    manager = _ours(model, mode, files)
    out = model(x, txt, t, shapes)
    expected = qwen_t._run_reference(_reference_with(diffusers.QwenImagePipeline, reference, files), x, txt, t, shapes)

    assert (out - base).abs().max() > 100 * TOL, "the adapters must change the output"
    err = (out - expected).abs().max().item()
    assert err <= TOL, f"{layout}/{mode}: max abs error {err:.3g}"
    manager.clear()
    assert torch.equal(model(x, txt, t, shapes), base), "clear must give the base model back bit for bit"
