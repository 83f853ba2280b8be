"""Warmup's frame-count sweep of LTX-2.5 (count_sweep.py): after the two class shapes, every other frame count the
duration bounds allow, at the larger shape's size, runs step 0 of each stage through the transformer's first block
and the audio decoder, with the modules held on the device for the whole sweep; the swept shapes count as warmed;
a request at a swept count equals a cold runner's bit for bit and compiles nothing after a compiled warmup.

The tiny flavour's bounds give 9, 17, 25 and 33 frames at 24 fps; its warmup shapes are 64x64x9 and 64x128x33, so
the sweep runs 9, 17 and 25 at 64x128. The release's runs 56 counts at 512x768 (25 to 465).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, RunnerConfig, load_runner_config
from runnerkit.models.ltx2.count_sweep import sweep_counts
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.models.ltx2.transformer import LTX2Transformer
from test_cases._logs import logged
from test_cases.runners._visits import count_builds, count_visits

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ltx2" / "ltx25_t2av_tiny.json"
SWEPT = [(64, 128, 9), (64, 128, 17), (64, 128, 25)]
PROMPT = "a red fox runs through fresh snow, wind howls"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A cache of this module's own (the synthetic checkpoint); never the test process's gc freeze."""
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path_factory.getbasetemp() / "sweep-cache"))


def make_runner(**overrides: Any) -> LTX25Runner:
    return LTX25Runner(load_runner_config(CONFIG, {"device": "cpu", **overrides}))


def serve(runner: LTX25Runner, out: Path, frames: int, index: int) -> tuple[Any, dict[str, torch.Tensor]]:
    path = out / f"r{index}.safetensors"
    prof = runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=3, target_video_length=frames,
                                             save_tensor_path=str(path)), index)
    return prof, load_file(str(path))


def test_the_counts_are_the_bounds_grid_at_the_larger_size_less_the_warmed() -> None:
    tiny = LTX25Runner.frame_bounds(make_runner().config)
    assert sweep_counts(tiny, 8, LTX25Runner.WARMUP_SHAPES["debug-2.5"]) == ((64, 128), [9, 17, 25])
    assert sweep_counts(tiny, 8, ((64, 128, 9), (64, 128, 33))) == ((64, 128), [17, 25])
    assert sweep_counts(tiny, 8, ((64, 128, 9), (64, 64, 33))) == ((64, 128), [17, 25, 33])
    release = LTX25Runner.frame_bounds(LTX25Runner.resolve_config(RunnerConfig(
        model_cls="ltx2.5", task="t2av", model_path="/x", enable_cfg=False)))
    size, counts = sweep_counts(release, 8, LTX25Runner.WARMUP_SHAPES["22B-2.5"])
    assert size == (512, 768) and counts == list(range(25, 466, 8)) and len(counts) == 56  # 25 ran at 256x384


def test_first_blocks_runs_only_those_and_is_restored_after_an_error() -> None:
    """The cut itself (what `forward` then runs is counted in the warmup test below)."""
    transformer = LTX2Transformer(make_runner().parse_arch(None).transformer)
    for bad in (0, 3):
        with pytest.raises(ValueError, match=rf"`count` must be 1\.\.2 \(the model's blocks\), got {bad}"):
            with transformer.first_blocks(bad):
                pass
    with pytest.raises(RuntimeError, match="inside"):
        with transformer.first_blocks(1):
            assert transformer._block_limit == 1
            raise RuntimeError("inside")
    assert transformer._block_limit is None


HOLDS = {  # offload -> what counts the transformer's trips to the device
    "model": ({"mode": "model", "keep_across_stages": True}, count_visits),
    "block_disk_lazy_load": ({"mode": "block", "storage": "disk", "lazy_load": True, "keep_across_stages": True},
                             count_builds),
}


@pytest.mark.parametrize("mode", list(HOLDS))
def test_warmup_sweeps_the_other_counts_through_one_block_and_one_step(mode: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Model offload, and a transformer built per request (`lazy_load`) and streamed from disk (the 16 GiB plan):
    each step of the class shapes runs both blocks, each sweep step one, and each swept count starts from a reset
    request state (the held transformer's RoPE tables do not pile up: at release size they reached 19 GiB over a
    16 GiB cap on an H100); the sweep holds the transformer on the device once (and, model-offloaded, the audio
    decoder); the audio decoder runs at every swept count on zero latents; the sweep's step lines are DEBUG (the
    class shapes' stay INFO); then a request at a swept count is warmed, logs nothing about it, and equals a cold
    runner's."""
    cold = make_runner()
    cold.init_modules()
    _, expected = serve(cold, tmp_path, 17, 0)
    offload, counter = HOLDS[mode]
    runner = make_runner(warmup=True, offload=offload)
    steps: list[tuple[tuple[int, int, int], str, int, int]] = []
    audio: list[tuple[tuple[int, int, int], bool]] = []
    real_step, real_audio = LTX25Runner.run_step, LTX25Runner.run_audio_decoder
    blocks: list[int] = []
    rope_tables: list[int] = []
    hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # a transformer built per request is hooked when built

    def step(self: LTX25Runner, req: Any, stage: Any, model: Any, latents: Any, timestep: Any, i: int) -> Any:
        if model not in hooked:
            hooked.add(model)
            for block in model.transformer_blocks:
                block.register_forward_pre_hook(lambda *_: blocks.append(1))
        before = len(blocks)
        out = real_step(self, req, stage, model, latents, timestep, i)
        steps.append((req.info.shape, stage.name, i, len(blocks) - before))
        rope_tables.append(len(model._rope_cache))  # per-request state: one grid per stage, never the sweep's all
        return out

    def decode_audio(self: LTX25Runner, req: Any, latents: torch.Tensor) -> Any:
        audio.append((req.info.shape, bool((latents == 0).all())))
        return real_audio(self, req, latents)

    monkeypatch.setattr(LTX25Runner, "run_step", step)
    monkeypatch.setattr(LTX25Runner, "run_audio_decoder", decode_audio)
    counts = counter(monkeypatch)
    with logged("INFO") as lines:
        runner.init_modules()
    assert steps[:8] == [(s, n, i, 2) for s in ((64, 64, 9), (64, 128, 33))
                         for n, last in (("stage1", 7), ("stage2", 2)) for i in (0, last)]
    assert steps[8:] == [(s, n, 0, 1) for s in SWEPT for n in ("stage1", "stage2")]
    assert rope_tables[8:] == [1, 2] * len(SWEPT)  # the request state is reset after each swept count
    assert audio == [((64, 64, 9), False), ((64, 128, 33), False), *((s, True) for s in SWEPT)]
    assert counts["transformer"] == 3  # one per class shape, one for the sweep
    assert counts["audio_decoder"] == (3 if mode == "model" else 0)  # resident under block offload
    warmup = runner.profiler.warmup
    assert warmup is not None and warmup["steps_per_shape"] == {"stage1": [0, 7], "stage2": [0, 2]}
    assert warmup["frame_counts"]["size"] == [64, 128] and warmup["frame_counts"]["counts"] == [9, 17, 25]
    assert runner.warmed_shapes == ((64, 64, 9), (64, 128, 33), *SWEPT)
    step_lines = [m for m in lines if " step " in m and m.startswith("warmup [")]
    assert len(step_lines) == 8 and not [m for m in step_lines if "[64, 128, 9]" in m or "[64, 128, 17]" in m]
    with logged("WARNING") as warnings:
        prof, got = serve(runner, tmp_path, 17, 1)
    assert prof.audit["warmed_shape"] is True and not [w for w in warnings if "not warmed" in w], warnings
    assert torch.equal(got["video"], expected["video"]) and torch.equal(got["audio"], expected["audio"])


@pytest.mark.usefixtures("fresh_compiler")
def test_after_a_compiled_warmup_a_swept_count_compiles_nothing(tmp_path: Path) -> None:
    """Regional compile (torch's `eager` backend): the sweep's counts lie between the class shapes' sizes, so the
    first block's graphs serve them; the diffusion decoder's declared regions (its attention's query and key paths,
    its MLP tile), compiled at the class shapes' decodes with every size dynamic, serve a count warmup did not
    decode; a request at a swept count compiles nothing and equals the uncompiled output."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from runnerkit import compile as regional_compile
    from runnerkit.models.ltx2.diffusion_decoder_layers import NeighborhoodAttention, SwiGLU

    eager = make_runner()
    eager.init_modules()
    _, expected = serve(eager, tmp_path, 17, 0)
    compiled = make_runner(warmup=True, compile={"enabled": True, "backend": "eager"})
    compiled.init_modules()
    warmup = compiled.profiler.warmup
    assert warmup is not None and warmup["compilations"] >= 1 and warmup["frame_counts"]["counts"] == [9, 17, 25]
    decoder = compiled.placement.resident_modules["diffusion_decoder"]
    regions = [(m, name) for m in decoder.modules() for name in getattr(type(m), "COMPILED_REGIONS", ())]
    assert {(type(m), name) for m, name in regions} == {(NeighborhoodAttention, "query"),
                                                        (NeighborhoodAttention, "key"), (SwiGLU, "tile")}
    for module, name in regions:  # every instance through the one compiled function of its class and method
        assert getattr(module, name).__func__ is regional_compile.compiled_method(type(module), name,
                                                                                  compiled.config.compile)
    for cls, name in ((NeighborhoodAttention, "query"), (NeighborhoodAttention, "key"), (SwiGLU, "tile")):
        assert _debug_get_cache_entry_list(getattr(cls, name).__code__), (cls, name)  # warmup compiled it
    prof, got = serve(compiled, tmp_path, 17, 1)
    assert (prof.audit["compilations"], prof.audit["recompilations"]) == (0, 0), prof.audit
    assert torch.equal(got["video"], expected["video"]) and torch.equal(got["audio"], expected["audio"])


def test_a_predicted_count_at_another_size_is_judged_at_the_count_that_runs(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames omitted at 64x64 (not the sweep's size): the head predicts 25, which warmup ran only at 64x128; the
    warning and the audit name the shape that ran, [64, 64, 25], not admission's [64, 64, 33], and the warning
    sums up the sweep. At 64x128 the predicted count was swept: no warning. A prediction of 9 at 64x64 (made so
    here) is a class shape: warmed, though admission's [64, 64, 33] is not."""
    from runnerkit.models.ltx2 import runner25

    runner = make_runner(warmup=True)
    runner.init_modules()
    omitted = {"prompt": PROMPT, "seed": 3}
    with logged("WARNING") as warnings:
        small = runner.run_pipeline(RequestConfig(**omitted, target_height=64, target_width=64,
                                                  save_tensor_path=str(tmp_path / "small.safetensors")), 0)
        large = runner.run_pipeline(RequestConfig(**omitted, save_tensor_path=str(tmp_path / "large.safetensors")), 1)
        real = runner25.frames_for_duration  # the bounds (0.3 s, 1.6 s) keep their counts: admission stays at 33
        monkeypatch.setattr(runner25, "frames_for_duration",
                            lambda seconds, *rest: real(seconds, *rest) if seconds in (0.3, 1.6) else 9)
        nine = runner.run_pipeline(RequestConfig(**omitted, target_height=64, target_width=64,
                                                 save_tensor_path=str(tmp_path / "nine.safetensors")), 2)
    assert (small.shape, small.audit["warmed_shape"]) == ([64, 64, 25], False)
    assert (large.shape, large.audit["warmed_shape"]) == ([64, 128, 25], True)
    assert (nine.shape, nine.audit["warmed_shape"]) == ([64, 64, 9], True)
    assert [w for w in warnings if "not warmed" in w] == [
        "request 0: shape [64, 64, 25] was not warmed (warmup shapes: [[64, 64, 9], [64, 128, 33]] and 3 more "
        "(frame counts 9..25 at 64x128, swept)); expect a slower first step"]


def test_a_family_report_cannot_overwrite_the_warmup_section() -> None:
    warmups = make_runner().warmups
    warmups.report["frame_counts"] = {"counts": [9]}
    assert warmups.with_report({"seconds": 1.0}) == {"seconds": 1.0, "frame_counts": {"counts": [9]}}
    warmups.report["seconds"] = 2.0
    with pytest.raises(AssertionError, match=r"would overwrite the warmup section's \['seconds'\]"):
        warmups.with_report({"seconds": 1.0})
