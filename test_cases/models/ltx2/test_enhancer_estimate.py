"""LTX-2.5's prompt enhancer in the memory estimate and the plan (estimate_enhancer.py): the section adds exactly
the enhancer's weights (module `prompt_enhancer`) and its stage's activations (formula values of the tiny Gemma-4 of
test_prompt_enhancer.py), the runner places the module where the plan's rules put it, the measured CPU peak of an
enhancement and of a whole request stays under the estimate, and `runnerkit plan` of the 22B config lists the
module with the release's sizes when no enhancer folder exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.ltx2 import estimate_enhancer as ee
from runnerkit.models.ltx2.estimate import TEXT_TOKENS
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.planning import fit
from runnerkit.planning.fit import ModuleFootprint
from runnerkit.synthetic import save_pretrained_here
from test_cases._memory import peak_tensor_bytes
from test_cases.models.ltx2.test_ltx25_runner import CONFIG, FakeEnhancer, _isolated  # noqa: F401 (fixture)
from test_cases.models.ltx2.test_prompt_enhancer import VOCAB, _model, _processor, transformers
from test_cases.tools.test_plan import no_checkpoints, run_plan  # noqa: F401 (fixture)

SYSTEM_T2V = "Rewrite the prompt as a long caption. " * 5  # 190 UTF-8 bytes
NEW_TOKENS = 6
SHAPE = (64, 128, 9)
CUDA = torch.device("cuda")


def _weights(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters (tied ones once) and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A diffusers-layout enhancer: the tiny Gemma-4 in `prompt_enhancer/` with its t2v system prompt."""
    root = tmp_path_factory.mktemp("enhancer")
    save_pretrained_here(_model(), root / "prompt_enhancer")
    (root / "prompt_enhancer" / "system_prompt_t2v.txt").write_text(SYSTEM_T2V)
    return root


def _runner(**overrides: Any) -> LTX25Runner:
    return LTX25Runner(load_runner_config(CONFIG, {"device": "cpu", **overrides}))


def test_the_section_adds_the_enhancers_weights_and_stage(folder: Path) -> None:
    """With the section: one module more (the tiny Gemma-4's float32 weights) and one stage more, right before
    the text encoder, of kv + prefill + logits at T = 1024 + 190 + 64 + 6 tokens; everything else equal. On a
    CUDA device the enhancer's weights are on the device during its stage only (mode model), in every stage
    (mode none, or listed in `offload.resident_modules`)."""
    without = _runner().estimate_memory(SHAPE)
    runner = _runner(prompt_enhancer={"path": str(folder), "max_new_tokens": NEW_TOKENS})
    with_ = runner.estimate_memory(SHAPE)
    weights = _weights(_model())
    assert with_.modules == {"prompt_enhancer": ModuleFootprint(weights), **without.modules}
    T = TEXT_TOKENS + len(SYSTEM_T2V.encode()) + 64 + NEW_TOKENS
    assert T == 1284
    kv = T * 2 * (8 + 8) * 4  # 2 layers, k and v 1 head x 8 wide, float32
    prefill = T * (4 * 16 + 3 * 32 + 2 * 4) * 4 + 2 * T * T * 4  # hidden 16, MLP 32, per-layer 2 x 4; 2 heads
    logits = len(VOCAB) * (4 + 8)
    stage = next(s for s in with_.stages if s.name == "prompt_enhancer")
    assert (stage.module, stage.activation_bytes) == ("prompt_enhancer", kv + prefill + logits)
    at = [s.name for s in without.stages].index("text_encoder")
    assert with_.stages == (*without.stages[:at], stage, *without.stages[at:])
    for keys, resident in (({"mode": "model"}, False), ({"mode": "none"}, True),
                           ({"mode": "model", "resident_modules": ["prompt_enhancer"]}, True)):
        config = load_runner_config(CONFIG, {"offload": keys})
        for s in with_.stages:
            held = fit.device_weights(with_, s.module, config, CUDA, s.holds)
            base = fit.device_weights(without, None if s is stage else s.module, config, CUDA, s.holds)
            assert held == base | ({"prompt_enhancer": weights} if resident or s is stage else {}), (keys, s.name)
        placement = fit.placement_of("prompt_enhancer", with_.modules["prompt_enhancer"], config)
        assert placement == ("resident" if resident else "visits the device for its stage")


def test_tokens_bound_the_prompt_the_system_prompt_and_the_image(folder: Path) -> None:
    """t2av: the configured folder's t2v file; i2av: its i2v file is absent there, so the release's i2v system
    prompt, and the image's 280 soft tokens with their begin/end tokens."""
    section = {"path": str(folder), "max_new_tokens": NEW_TOKENS}
    t2av = load_runner_config(CONFIG, {"prompt_enhancer": section})
    assert ee.enhancer_tokens(t2av, "t2av") == 1024 + 190 + 64 + 6
    i2av = load_runner_config(CONFIG, {"prompt_enhancer": section, "task": "i2av"})
    assert ee.enhancer_tokens(i2av, "i2av") == 1024 + 4708 + 64 + 282 + 6


@pytest.mark.parametrize("keys, where", [({"offload": {"mode": "none"}}, "resident"),
                                         ({"offload": {"mode": "model"}}, "offloaded"),
                                         ({"offload": {"mode": "model", "resident_modules": ["prompt_enhancer"]}},
                                          "resident"),
                                         ({"unload_modules": True}, "per stage")])
def test_the_runner_places_the_enhancer_as_the_plan_does(keys: dict[str, Any], where: str, folder: Path,
                                                         mocker: Any) -> None:
    """The module `prompt_enhancer` lives where `fit.placement_of` says: resident (mode none, or listed in
    `offload.resident_modules`), visiting the device for its stage (mode model: the model offloader's), or
    built for its stage (`unload_modules`: nothing loaded until a request asks)."""
    fake, weights = FakeEnhancer(), torch.nn.Linear(1, 1)
    fake.model_dir = folder / "prompt_enhancer"  # type: ignore[attr-defined]
    mocker.patch("runnerkit.models.ltx2.prompt_enhancer.configured_enhancer_parts", return_value=fake)
    load = mocker.patch("runnerkit.models.ltx2.prompt_enhancer.load_enhancer_model", return_value=weights)
    runner = _runner(prompt_enhancer={"path": str(folder)}, **keys)
    runner.init_modules()
    placement = runner.placement
    assert placement is not None
    found = ("resident" if "prompt_enhancer" in placement.resident_modules else
             "offloaded" if placement.offloader is not None and "prompt_enhancer" in placement.offloader.modules else
             "per stage" if "prompt_enhancer" in placement.loaders else None)
    assert found == where
    assert load.call_count == (0 if where == "per stage" else 1)
    runner.run_pipeline(RequestConfig(prompt="fox", enhance_prompt=True, target_video_length=9))
    assert fake.calls == [("fox", None, 42)] and fake.models == [weights]
    assert load.call_count == 1


@pytest.mark.parametrize("mode", ["none", "model"])
def test_the_measured_cpu_peak_is_bounded_by_the_estimate(mode: str, folder: Path,
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tiny runner with the tiny Gemma-4 enhancer (6 new tokens, a prompt of the counted 64 characters: the
    tokenizer is character-level): one enhancement's measured peak of CPU tensor bytes is under its stage's
    activations (and not looser than x1.5: the one layer's attention scores, materialised by the CPU's SDPA with a
    mask, are most of both), and a whole enhanced request's under the plan's reservation above the resident weights
    (the family contract's measure)."""
    monkeypatch.setattr(ee, "TEXT_TOKENS", 64)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda path, **kw: _processor(tmp_path / "p"))
    runner = _runner(prompt_enhancer={"path": str(folder), "max_new_tokens": NEW_TOKENS}, offload={"mode": mode})
    runner.init_modules()
    prompt = "a red fox runs through fresh snow at dawn, wind howls in trees.."
    assert len(prompt) == 64
    estimate = runner.estimate_memory(SHAPE)
    stage = next(s for s in estimate.stages if s.name == "prompt_enhancer")
    assert runner.enhancer is not None and runner.placement is not None
    with runner.placement.on_device("prompt_enhancer") as model:
        enhancer = runner.enhancer.around(model)
        measured = peak_tensor_bytes(lambda: enhancer.generate_ids(prompt, seed=0))
    said = f"enhancement: formula {stage.activation_bytes}, measured {measured}"
    assert measured <= stage.activation_bytes <= 1.5 * measured, said  # 1.32 when written
    peak = fit.peak_of(estimate, runner.config, torch.device("cpu"))
    resident = fit.weights_between_stages(estimate, runner.config, torch.device("cpu"))
    reserved = peak.bytes - peak.overhead_bytes - resident
    request = RequestConfig(prompt=prompt, enhance_prompt=True, target_video_length=9,
                            save_tensor_path=str(tmp_path / "r.safetensors"))
    whole = peak_tensor_bytes(lambda: runner.run_pipeline(request))
    assert whole <= reserved, f"request: measured {whole} > reserved {reserved} ({peak.stage})"


def test_plan_of_the_22b_config_lists_the_enhancer(no_checkpoints: Path, tmp_path: Path,  # noqa: F811
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`runnerkit plan` of configs/ltx2/ltx25_t2av_22b_distilled.json with a `prompt_enhancer` section and no
    files: the enhancer's sizes are the release's (said in the sources), its bf16 weights a module of the plan,
    resident in the 80 GiB plan (model offload of the text encoder and the transformer: the rest, the enhancer's
    10.3 GiB included, fits beside the 473-frame decode's peak)."""
    config = json.loads(CONFIG.with_name("ltx25_t2av_22b_distilled.json").read_text())
    config["prompt_enhancer"] = {"path": str(tmp_path / "absent")}
    (tmp_path / "enh.json").write_text(json.dumps(config))
    rc, out, err = run_plan(capsys, "--config_json", tmp_path / "enh.json", "--device_gib", 80, "--host_gib", 128)
    assert rc == 0, err
    assert out["estimate_sources"][-1] == (
        f"prompt enhancer sizes: transformers' Gemma4Config defaults (similar to google/gemma-4-e2b-it, the "
        f"release's enhancer): {tmp_path / 'absent'} holds no prompt_enhancer/config.json")
    release = transformers.Gemma4Config(text_config=transformers.Gemma4TextConfig(),
                                        vision_config=transformers.Gemma4VisionConfig(),
                                        audio_config=transformers.Gemma4AudioConfig())
    with torch.device("meta"):
        meta = transformers.Gemma4ForConditionalGeneration(release)
    params = sum(p.numel() for p in meta.parameters())
    assert params == 5_554_675_488
    gib = round((2 * params + sum(b.numel() * b.element_size() for b in meta.buffers())) / 1024**3, 3)
    row = next(m for m in out["modules"] if m["name"] == "prompt_enhancer")
    assert (row["placement"], row["device_gib"], row["host_gib"]) == ("resident", gib, 0.0)
    assert [m["name"] for m in out["modules"]][:2] == ["prompt_enhancer", "text_encoder"]
