"""The pipeline seam: a two-stage image family served by the unchanged base machinery.

Built through the registry, initialised with warmup, several requests, profile written; exact
call orders for requests and warmup; same seed => bit-identical with and without warmup;
request state back at the start-up baseline after every request.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.registry import get_runner_cls
from runnerkit.runners.default import DefaultRunner
from runnerkit.schedulers import SCHEDULERS
from test_cases.family_contract import Family, FamilyContract
from test_cases.runners.two_stage import NAME, TwoStageImageRunner, config_dict


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", True)  # never freeze the test process


def build(tmp_path: Path, **overrides: Any) -> TwoStageImageRunner:
    config = load_runner_config(None, config_dict(tmp_path, **overrides))
    runner = get_runner_cls(config.model_cls)(config)
    assert isinstance(runner, TwoStageImageRunner)
    return runner


def image(runner: TwoStageImageRunner, tmp_path: Path, name: str, index: int = 0, **request: Any) -> torch.Tensor:
    out = tmp_path / f"{name}.safetensors"
    runner.run_pipeline(RequestConfig(prompt=request.pop("prompt", "a red fox"), save_tensor_path=str(out), **request),
                        index)
    return load_file(str(out))["image"]


def assert_baseline(runner: TwoStageImageRunner) -> None:
    for stage in runner.pipeline.denoise:
        fresh = SCHEDULERS[stage.scheduler](shift=stage.shift, spacing=stage.spacing)
        state = {k: v for k, v in vars(runner.schedulers[stage.name]).items() if not callable(v)}  # minus spies
        assert state == vars(fresh), stage.name
    assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys()
    assert runner.placement.on_device_now() == set()


def test_family_overrides_no_lifecycle_verb_or_request_path() -> None:
    lifecycle = {"init_modules", "warmup", "run_pipeline", "serve_request", "run_denoise", "run_denoise_stage",
                 "run_encoders", "decode", "save_outputs", "end_run", "load_modules", "run_warmup"}
    assert lifecycle.isdisjoint(TwoStageImageRunner.__dict__)
    from runnerkit.models.wan.runner import WanT2VRunner

    assert lifecycle.isdisjoint(WanT2VRunner.__dict__)


def test_request_runs_the_described_pipeline_in_order(tmp_path: Path) -> None:
    runner = build(tmp_path)
    runner.init_modules()
    calls: list[str] = []
    for name, sched in runner.schedulers.items():
        for verb in ("prepare", "step_pre", "step_post"):
            real = getattr(sched, verb)
            setattr(sched, verb, lambda *a, _r=real, _n=f"{name}.{verb}", **k: (calls.append(_n), _r(*a, **k))[1])
    for name, module in runner.modules.items():
        module.register_forward_pre_hook(lambda m, args, _n=name: calls.append(_n))
    real_save = runner.save_outputs
    runner.save_outputs = lambda *a: (calls.append("save"), real_save(*a))[1]  # type: ignore[method-assign]

    image(runner, tmp_path, "a", seed=3)

    step = lambda s, m: [f"{s}.step_pre", m, m, f"{s}.step_post"]  # noqa: E731  cond + uncond
    expected = ["text_encoder", "text_encoder", "stage1.prepare", *step("stage1", "transformer") * 4,
                "upsampler", "stage2.prepare", *step("stage2", "transformer_2") * 3, "decoder", "save"]
    assert calls == expected  # stage 2: 6 scheduled steps at strength 0.5 -> the last 3 run
    prof = runner.profiler.requests[-1]
    assert list(prof.stages) == ["text_encoder", "stage1", "upsampler", "stage2", "image_decoder", "save"]
    assert len(prof.steps) == 4 + 3 and prof.shape == [32, 64, 1] and prof.ok
    assert_baseline(runner)


def test_warmup_covers_both_stages_transition_and_decoder_per_shape(tmp_path: Path, mocker: Any) -> None:
    runner = build(tmp_path, warmup=True)
    calls: list[str] = []
    real_load = runner.load_modules

    def load_and_instrument() -> None:
        real_load()
        for name, module in runner.modules.items():
            module.register_forward_pre_hook(lambda m, args, _n=name: calls.append(f"{_n}{tuple(args[0].shape)[2:]}"
                                                                                   if _n != "text_encoder" else _n))

    runner.load_modules = load_and_instrument  # type: ignore[method-assign]
    pipeline_calls = mocker.spy(TwoStageImageRunner, "run_pipeline")
    runner.init_modules()

    def shape(h: int, w: int) -> list[str]:
        lo, hi = (h // 16, w // 16), (h // 8, w // 8)
        return [f"transformer{lo}", f"transformer{lo}", f"upsampler{lo}", f"transformer_2{hi}", f"transformer_2{hi}",
                f"decoder{hi}"]

    # text encoded once (cond + uncond), then per shape: step 0 of each stage on both CFG branches
    assert calls == ["text_encoder", "text_encoder", *shape(32, 32), *shape(32, 64)]
    assert pipeline_calls.call_count == 0
    assert runner.profiler.warmup["steps_per_shape"] == {"stage1": [0], "stage2": [0]}
    assert runner.profiler.warmup["shapes"] == [[32, 32, 1], [32, 64, 1]]
    assert_baseline(runner)


@pytest.mark.parametrize("mode", ["none", "model"])
def test_same_seed_bit_identical_with_and_without_warmup(tmp_path: Path, mode: str) -> None:
    cold, warm = build(tmp_path, offload={"mode": mode}), build(tmp_path, warmup=True, offload={"mode": mode})
    cold.init_modules()
    warm.init_modules()
    shapes = [(32, 64), (32, 32), (32, 64)]
    served = []
    for i, (h, w) in enumerate(shapes):
        a = image(cold, tmp_path, f"cold{i}", i, seed=11, target_height=h, target_width=w)
        b = image(warm, tmp_path, f"warm{i}", i, seed=11, target_height=h, target_width=w)
        assert torch.equal(a, b), (mode, i)
        served.append(b)
        assert warm.profiler.requests[-1].audit["warmed_shape"] is True
        assert_baseline(warm)
    assert torch.equal(served[0], served[2])  # the middle request left nothing behind
    assert served[0].shape == (3, 32, 64) and served[0].abs().max() <= 1


def reference_latents(runner: TwoStageImageRunner, prompt: str, seed: int, strength: float,
                      h: int = 32, w: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(stage-1 latents, stage-2 latents) of a request, computed without the runner's request path:
    the runner's modules and fresh schedulers, driven by hand, with ONE generator seeded once and
    drawn from in order (stage 1's noise, then stage 2's), as ARCHITECTURE §2 requires."""
    m, cfg = runner.modules, runner.config
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        cond, uncond = m["text_encoder"](prompt), m["text_encoder"]("")  # the family's negative prompt: ""

        def denoise(name: str, steps: int, shape: tuple[int, ...], model: torch.nn.Module, init: Any = None,
                    strength: float = 1.0, **scheduler: Any) -> torch.Tensor:
            sched = SCHEDULERS[name](**scheduler)
            sched.generator = generator
            sched.prepare(shape, steps, seed, "cpu", torch.float32, init_latents=init, strength=strength)
            for i in range(sched.infer_steps):
                latents, t = sched.step_pre(i)
                c, u = model(latents, t, cond), model(latents, t, uncond)
                sched.step_post(u + cfg.sample_guide_scale * (c - u))
            return sched.latents

        stage1 = denoise("euler", 4, (1, 4, h // 16, w // 16), m["transformer"], shift=3.0, spacing="diffusers")
        stage2 = denoise("unipc", TwoStageImageRunner.STAGE2_STEPS, (1, 4, h // 8, w // 8), m["transformer_2"],
                         init=m["upsampler"](stage1), strength=strength, shift=1.0, spacing="diffusers")
    return stage1, stage2


def served_latents(runner: TwoStageImageRunner, tmp_path: Path, name: str, **request: Any) -> tuple[torch.Tensor, ...]:
    """(stage-1 latents, stage-2 latents, image) of one request served by the runner, read at the inputs
    of the upsampler and the decoder."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [runner.modules[k].register_forward_pre_hook(lambda mod, args, _k=k: seen.__setitem__(_k, args[0].clone()))
             for k in ("upsampler", "decoder")]
    try:
        out = image(runner, tmp_path, name, **request)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["upsampler"], seen["decoder"], out


def test_stage_two_continues_the_request_generator(tmp_path: Path) -> None:
    """Stage 2's noise is the next draw of the generator stage 1 drew from (not a fresh seeding)."""
    runner = build(tmp_path)
    runner.init_modules()
    stage1, stage2, _ = served_latents(runner, tmp_path, "a", prompt="a red fox", seed=5)
    want1, want2 = reference_latents(runner, "a red fox", 5, TwoStageImageRunner.STAGE2_STRENGTH)
    torch.testing.assert_close(stage1, want1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stage2, want2, rtol=1e-5, atol=1e-6)


def test_strength_changes_only_the_second_stage(tmp_path: Path) -> None:
    runner = build(tmp_path)
    runner.init_modules()
    half = served_latents(runner, tmp_path, "half", seed=2)
    TwoStageImageRunner.STAGE2_STRENGTH = 1.0  # restored below; the pipeline is described at load
    try:
        other = build(tmp_path)
        other.init_modules()
    finally:
        TwoStageImageRunner.STAGE2_STRENGTH = 0.5
    full = served_latents(other, tmp_path, "full", seed=2)
    assert torch.equal(half[0], full[0])  # stage 1: the same values, whatever stage 2's strength
    for served, strength in ((half, 0.5), (full, 1.0)):
        want1, want2 = reference_latents(runner, "a red fox", 2, strength)
        torch.testing.assert_close(served[0], want1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(served[1], want2, rtol=1e-5, atol=1e-6)
    assert not torch.equal(half[1], full[1]) and not torch.equal(half[2], full[2])


def test_transition_time_is_its_own_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upsampler's seconds go to the `upsampler` stage, not to the denoise stage after it: a fake
    clock (profiling's only time source) advances only while the upsampler runs."""
    from types import SimpleNamespace

    from runnerkit import profiling

    now = [0.0]
    monkeypatch.setattr(profiling, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    runner = build(tmp_path)
    runner.init_modules()
    runner.modules["upsampler"].register_forward_hook(lambda *a: now.__setitem__(0, now[0] + 100.0))
    prof = runner.run_pipeline(RequestConfig(prompt="a cat", seed=1, save_tensor_path=str(tmp_path / "c.safetensors")))
    assert prof.stages == {"text_encoder": 0.0, "stage1": 0.0, "upsampler": 100.0, "stage2": 0.0,
                           "image_decoder": 0.0, "save": 0.0}
    assert prof.steps == [0.0] * 7


class ToyBlock(torch.nn.Module):
    """A denoiser block of the test's own (dynamo does not trace torch's own `Conv2d.forward` as a frame)."""

    def __init__(self, conv: torch.nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv(h)


class CompiledTwoStage(TwoStageImageRunner):
    """The toy family with its denoisers' blocks regionally compiled."""

    def describe_pipeline(self) -> Any:
        pipeline = super().describe_pipeline()

        def with_blocks(build: Any) -> Any:
            def wrapped(device: torch.device) -> torch.nn.Module:
                module = build(device)
                module.blocks = torch.nn.ModuleList(ToyBlock(conv) for conv in module.blocks)
                return module
            return wrapped

        modules = tuple(dataclasses.replace(m, build=with_blocks(m.build), blocks="blocks")
                        if m.name.startswith("transformer") else m for m in pipeline.modules)
        return dataclasses.replace(pipeline, modules=modules)


@pytest.mark.usefixtures("fresh_compiler")
def test_recompile_reasons_are_the_requests_own(tmp_path: Path) -> None:
    """A request reports only the recompilations it caused, though torch keeps the process's guard
    failures: the first request recompiles (stage 2's latents are larger than stage 1's, through the
    same compiled block) and says why; the next, at the same shape, compiles nothing and lists nothing."""
    from runnerkit import compile as regional_compile

    config = load_runner_config(None, config_dict(tmp_path, compile={"enabled": True, "backend": "eager"}))
    runner = CompiledTwoStage(config)
    runner.init_modules()
    try:
        audits = [runner.run_pipeline(RequestConfig(prompt="a cat", seed=1,
                                                    save_tensor_path=str(tmp_path / f"{i}.safetensors")), i).audit
                  for i in range(2)]
    finally:
        torch._dynamo.reset()
        regional_compile._COMPILED.clear()
    first, second = audits
    assert first["compilations"] >= 1 and first["recompilations"] >= 1, first
    assert first["recompile_reasons"] and all(r.startswith("ToyBlock: ") for r in first["recompile_reasons"]), first
    assert (second["compilations"], second["recompilations"], second["recompile_reasons"]) == (0, 0, []), second


def test_several_requests_profile_and_png(tmp_path: Path) -> None:
    runner = build(tmp_path, warmup=True)
    runner.init_modules()
    png = tmp_path / "out" / "cat.png"
    runner.run_pipeline(RequestConfig(prompt="a cat", seed=1, save_result_path=str(png),
                                      save_tensor_path=str(tmp_path / "cat.safetensors")), 0)
    image(runner, tmp_path, "dog", 1, prompt="a dog", target_height=32, target_width=32)
    runner.profiler.write(tmp_path / "profile.json")
    report = json.loads((tmp_path / "profile.json").read_text())
    assert [r["index"] for r in report["requests"]] == [0, 1]
    assert [r["shape"] for r in report["requests"]] == [[32, 64, 1], [32, 32, 1]]
    assert report["warmup"]["shapes"] == [[32, 32, 1], [32, 64, 1]]
    saved = load_file(str(tmp_path / "cat.safetensors"))["image"]
    expected = ((saved.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.array_equal(np.asarray(Image.open(png)), expected)
    sidecar = json.loads(png.with_suffix(".json").read_text())
    assert sidecar["seed"] == 1 and sidecar["config"]["model_cls"] == NAME


def test_a_failed_request_leaves_existing_outputs_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs are replaced all-or-nothing: files of an earlier run at the same paths keep their exact
    bytes when a request targeting them fails while writing (here the PNG writer fills half its file,
    then the disk is full), and nothing else is left in the folder."""
    import errno

    from runnerkit import media

    runner = build(tmp_path)
    runner.init_modules()
    out = tmp_path / "out"
    png, tensors = out / "cat.png", out / "cat.safetensors"
    runner.run_pipeline(RequestConfig(prompt="a cat", seed=1, save_result_path=str(png),
                                      save_tensor_path=str(tensors)), 0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["cat.json", "cat.png", "cat.safetensors"]

    def disk_full(tensor: torch.Tensor, path: str | Path) -> None:
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(media, "save_image", disk_full)
    with pytest.raises(media.MediaWriteError, match="No space left on device"):
        runner.run_pipeline(RequestConfig(prompt="a dog", seed=2, save_result_path=str(png),
                                          save_tensor_path=str(tensors)), 1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_result_suffix_must_fit_the_primary_output(tmp_path: Path) -> None:
    config = load_runner_config(None, config_dict(tmp_path))
    with pytest.raises(ValueError, match=r"task 't2i' makes an image; use \.png"):
        TwoStageImageRunner.validate_request(RequestConfig(prompt="x", save_result_path="a.mp4"), config)
    with pytest.raises(ValueError, match="must be 1 for an image"):
        TwoStageImageRunner.validate_request(RequestConfig(prompt="x", target_video_length=5), config)


def test_family_defaults_fill_unset_settings_only(tmp_path: Path) -> None:
    runner = build(tmp_path, infer_steps=2)
    assert runner.config.infer_steps == 2 and runner.config.scheduler == "euler"
    assert (runner.config.target_height, runner.config.target_width) == (32, 64)
    assert isinstance(runner, DefaultRunner)


# ---- the family contract (test_cases/family_contract.py) ------------------------------------------
@pytest.fixture(scope="module")
def two_stage_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("two_stage_ckpt")


class TestFamilyContract(FamilyContract):
    """The example family keeps every lifecycle guarantee a real one does: the warmup gates, `model`
    offload and warmup bit-identical to a cold `none` runner, the start-up state after every request
    (failed and cancelled ones too), its CPU estimate against the measured peak."""

    family = Family(
        name="two_stage t2i", runner_cls=TwoStageImageRunner, checkpoint="two_stage_ckpt", config=config_dict,
        requests=(RequestConfig(prompt="a red fox in the snow", seed=11),  # the default shape, 32x64
                  RequestConfig(prompt="a boat", seed=12, target_height=32, target_width=32)),
        outputs=("image",), shapes=({"image": (3, 32, 64)}, {"image": (3, 32, 32)}),
        modes={"none": {}, "model": {"offload": {"mode": "model"}}, "unload_modules": {"unload_modules": True}},
        estimate_request=RequestConfig(prompt="a red fox in the snow", seed=11))
