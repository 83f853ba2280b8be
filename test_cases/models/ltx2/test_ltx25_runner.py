"""The LTX-2.5 runner on its tiny CPU config (configs/ltx2/ltx25_t2av_tiny.json): the frame count
omitted and predicted by the duration head, the bounds used before the prediction, warmup over the
bounds' smallest and largest counts, the launch script end to end, the synthetic checkpoint, i2av's VAE
encoder per warmup shape.

The tiny flavour's duration bounds are 0.3 s to 1.6 s: 9 to 33 frames at 24 fps; the synthetic head
predicts ~1.24 s for these prompts, 25 frames. Parity with diffusers' LTX-2.5 chain:
test_runner25_parity.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, RunnerConfig, load_runner_config
from runnerkit.infer import main
from runnerkit.models.ltx2.arch25 import LTX25Arch, tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint25 import LTX25Checkpoint
from runnerkit.models.ltx2.duration import LTX2DurationHead, frames_for_duration
from runnerkit.models.ltx2.runner import LTX2Runner
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.weights import CheckpointError

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
CONFIG = CONFIGS / "ltx25_t2av_tiny.json"
PROMPT = "a red fox runs through fresh snow, wind howls"
PREDICTED = 25  # what the synthetic head predicts for PROMPT (1.24 s at 24 fps -> 30 -> snapped to 25)
Outputs = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A cache of this module's own (the synthetic checkpoint); never the test process's gc freeze."""
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path_factory.getbasetemp() / "ltx25-cache"))


@pytest.fixture(autouse=True)
def _restore_logger() -> Iterator[None]:
    """`runnerkit.infer.main` binds loguru to the `sys.stderr` of its call (pytest's capture); rebind."""
    yield
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="DEBUG")


def make_runner(**overrides: Any) -> LTX25Runner:
    return LTX25Runner(load_runner_config(CONFIG, {"device": "cpu", **overrides}))


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A cold runner's outputs: PROMPT with the frames omitted, then given as 17, then given as 25."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RUNNERKIT_CACHE", str(tmp_path_factory.getbasetemp() / "ltx25-cache"))
    out = tmp_path_factory.mktemp("cold")
    try:
        runner = make_runner()
        runner.init_modules()
        calls: list[int] = []
        hook = runner.modules["duration_head"].register_forward_hook(lambda *_: calls.append(1))
        results = {}
        for name, frames in (("omitted", None), ("given17", 17), ("given25", PREDICTED)):
            before = len(calls)
            runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=3, target_video_length=frames,
                                              save_tensor_path=str(out / f"{name}.safetensors"),
                                              save_result_path=str(out / f"{name}.mp4")))
            results[name] = (load_file(out / f"{name}.safetensors"),
                             json.loads((out / f"{name}.json").read_text()), len(calls) - before)
        hook.remove()
        profiles = {name: runner.profiler.requests[i] for i, name in enumerate(results)}
        return {"runner": runner, "profiles": profiles, **results}
    finally:
        mp.undo()


def test_frames_omitted_run_at_the_predicted_count(cold: dict[str, Any]) -> None:
    """The head's count replaces the bound for the whole request: the outputs equal a request that gives
    that count, bit for bit (latent shapes, audio length, noise), and the sidecar records the prediction."""
    omitted, sidecar, head_calls = cold["omitted"]
    given, given_sidecar, _ = cold["given25"]
    assert head_calls == 1
    assert omitted["video"].shape == (3, PREDICTED, 64, 128)
    assert torch.equal(omitted["video"], given["video"]) and torch.equal(omitted["audio"], given["audio"])
    duration = sidecar["duration"]
    assert duration["predicted"] is True and duration["frames"] == sidecar["frames"] == PREDICTED
    assert duration["seconds"] == PREDICTED / 24 and duration["bounds_seconds"] == [0.3, 1.6]
    assert frames_for_duration(duration["head_seconds"], 24.0, 8, 0.3, 1.6) == PREDICTED
    assert 1.2 < duration["head_seconds"] < 1.3
    assert sidecar["streams"]["video"]["frames"] == PREDICTED and sidecar["streams"]["audio"]["codec"] == "aac"
    assert given_sidecar["duration"] == {"predicted": False, "frames": PREDICTED, "seconds": PREDICTED / 24}


def test_frames_given_skip_the_head(cold: dict[str, Any]) -> None:
    outputs, sidecar, head_calls = cold["given17"]
    assert head_calls == 0
    assert outputs["video"].shape == (3, 17, 64, 128) and sidecar["duration"]["predicted"] is False


def test_the_profile_records_the_shape_that_ran_and_the_head_only_when_it_ran(cold: dict[str, Any]) -> None:
    """`shape` is the predicted count's, not admission's largest; `duration_head` is null (not 0.0 s) when the
    request gave its frames, and its seconds when it ran."""
    profiles = cold["profiles"]
    assert [p.shape for p in profiles.values()] == [[64, 128, PREDICTED], [64, 128, 17], [64, 128, PREDICTED]]
    assert [p.stages["duration_head"] is None for p in profiles.values()] == [False, True, True]
    assert profiles["omitted"].stages["duration_head"] > 0
    assert all(v is not None and v > 0 for p in profiles.values() for k, v in p.stages.items() if k != "duration_head")


def test_admission_uses_the_largest_count(cold: dict[str, Any]) -> None:
    """Before the prediction a request's shape is the bounds' largest count (what admission and the memory
    checks see); a frame count given by the request or the config is kept; LTX-2.3 keeps its default."""
    runner: LTX25Runner = cold["runner"]
    assert runner.request_shape(RequestConfig(prompt="p")) == (64, 128, 33)
    info = runner.resolve_request(RequestConfig(prompt="p"))
    assert (info.frames, info.frames_omitted) == (33, True)
    info = runner.resolve_request(RequestConfig(prompt="p", target_video_length=17))
    assert (info.frames, info.frames_omitted) == (17, False)
    assert LTX25Runner.frame_bounds(runner.config) == (9, 33)
    release = RunnerConfig(model_cls="ltx2.5", task="t2av", model_path="/nonexistent", enable_cfg=False)
    assert LTX25Runner.frame_bounds(LTX25Runner.resolve_config(release)) == (25, 473)  # diffusers' 1 s .. 20 s
    with_frames = LTX25Runner.resolve_config(load_runner_config(CONFIG, {"target_video_length": 17}))
    assert LTX25Runner.shape_of(RequestConfig(prompt="p"), with_frames) == (64, 128, 17)
    tiny23 = LTX2Runner(load_runner_config(CONFIGS / "ltx2_t2av_tiny.json", {"device": "cpu"}))
    info = tiny23.resolve_request(RequestConfig(prompt="p"))
    assert (info.frames, info.frames_omitted) == (17, False)


def test_launch_script_with_warmup(cold: dict[str, Any], tmp_path: Path, mocker: Any) -> None:
    """`runnerkit --warmup` with the frames omitted: warmup runs the head and all three loops at the bounds'
    smallest and largest counts (9, 33), then the request equals the cold runner's bit for bit (mp4 with
    its audio stream, the predicted duration in the sidecar)."""
    head = mocker.spy(LTX2DurationHead, "forward")
    decoded = mocker.spy(LTX25Runner, "run_diffusion_decoder")
    stages = mocker.spy(LTX25Runner, "run_denoise_stage")
    mp4, tensors = tmp_path / "clip.mp4", tmp_path / "clip.safetensors"
    status = main(["--config_json", str(CONFIG), "--device", "cpu", "--prompt", PROMPT, "--seed", "3", "--warmup",
                   "--save_result_path", str(mp4), "--save_tensor_path", str(tensors)])
    assert status == 0
    warm_shapes = [c.args[1].info.shape for c in decoded.call_args_list]
    assert warm_shapes == [(64, 64, 9), (64, 128, 33), (64, 128, PREDICTED)]
    assert [(c.args[1].info.shape, c.args[2].name) for c in stages.call_args_list][:4] == [
        ((64, 64, 9), "stage1"), ((64, 64, 9), "stage2"), ((64, 128, 33), "stage1"), ((64, 128, 33), "stage2")]
    assert head.call_count == 2  # warmup's (its count unused) and the request's
    omitted, cold_sidecar, _ = cold["omitted"]
    ours = load_file(tensors)
    assert torch.equal(ours["video"], omitted["video"]) and torch.equal(ours["audio"], omitted["audio"])
    sidecar = json.loads(mp4.with_suffix(".json").read_text())
    assert sidecar["duration"] == cold_sidecar["duration"]
    assert sidecar["streams"]["video"]["frames"] == PREDICTED and "audio" in sidecar["streams"]


def test_warmup_shapes_hold_the_bounds_at_24_fps() -> None:
    """The warmup shapes' frame counts are the bounds' smallest and largest at 24 fps; at another fps they
    would not be, so warmup is refused there, naming fps."""
    config = make_runner().config
    assert {f for _, _, f in LTX25Runner.WARMUP_SHAPES["debug-2.5"]} == set(LTX25Runner.frame_bounds(config))
    release = LTX25Runner.resolve_config(RunnerConfig(model_cls="ltx2.5", task="t2av", model_path="/x",
                                                      enable_cfg=False))
    assert {f for _, _, f in LTX25Runner.WARMUP_SHAPES["22B-2.5"]} == set(LTX25Runner.frame_bounds(release))
    with pytest.raises(NotImplementedError, match="ltx2.5 warmup at `fps` 12: .* at 24 fps only"):
        make_runner(warmup=True, fps=12)
    make_runner(fps=12)  # without warmup: any fps


def test_i2av_warmup_encodes_the_first_frame_per_shape(tmp_path: Path, mocker: Any) -> None:
    """i2av under warmup: the head once (text stages are shared), the VAE encoder and the diffusion decoder at
    both shapes; the VAE is loaded for i2av only (t2av decodes with the diffusion decoder alone)."""
    pytest.importorskip("av")
    head = mocker.spy(LTX2DurationHead, "forward")
    encoded = mocker.spy(LTX25Runner, "run_vae_encoder")
    decoded = mocker.spy(LTX25Runner, "run_diffusion_decoder")
    runner = make_runner(task="i2av", warmup=True)
    runner.init_modules()
    assert head.call_count == 1
    # both shapes, then once for the frame-count sweep at the larger size (count_sweep.py)
    assert [c.args[1].info.shape for c in encoded.call_args_list] == [(64, 64, 9), (64, 128, 33), (64, 128, 9)]
    assert [c.args[1].info.shape for c in decoded.call_args_list] == [(64, 64, 9), (64, 128, 33)]
    assert runner.pipeline is not None and "vae" in {m.name for m in runner.pipeline.modules}
    assert [e.name for e in runner.pipeline.encoders] == ["text_encoder", "text_connectors", "duration_head",
                                                           "vae_encoder"]


def test_synthetic_checkpoint(cold: dict[str, Any], tmp_path: Path) -> None:
    """The folder reads back to the config's architecture, Gemma-4 as its text encoder, the diffusion
    decoder's latent statistics the video VAE's; an LTX-2.3 folder is refused naming what it lacks."""
    runner: LTX25Runner = cold["runner"]
    folder = Path(runner.config.model_path)
    ckpt = LTX25Checkpoint.open(folder)
    assert isinstance(ckpt.arch, LTX25Arch) and ckpt.arch == tiny_ltx25_arch()
    assert json.loads((folder / "text_encoder" / "config.json").read_text())["model_type"] == "gemma4_unified"
    stats = ckpt.read_tensors("vae", ["latents_mean", "latents_std"])
    decoder = ckpt.state_dict("diffusion_decoder")[0]
    assert torch.equal(decoder["latents_mean"], stats["latents_mean"].float())
    assert torch.equal(decoder["latents_std"], stats["latents_std"].float())
    assert runner.flavour() == "debug-2.5"
    assert runner.pipeline is not None and "vae" not in {m.name for m in runner.pipeline.modules}  # t2av
    with pytest.raises(CheckpointError, match="duration_head does not exist"):
        LTX25Checkpoint.open(tmp_path)


def test_server_admits_a_job_without_frames(tmp_path: Path) -> None:
    """The server's request path (`build_request`, on an unloaded runner) takes a body without a frame count
    (admitted at the bounds' largest) and still takes `seconds` (then the head does not run)."""
    from runnerkit.serve.app import ServerState, build_request
    from runnerkit.serve.jobs import JobQueue

    state = ServerState(runner=make_runner(), queue=JobQueue(tmp_path, 4, None, None), metrics=None)
    request, _, resolved = build_request(state, {"prompt": "x"}, tmp_path)
    assert request.target_video_length is None and resolved["frames"] == 33
    request, _, resolved = build_request(state, {"prompt": "x", "seconds": "0.7"}, tmp_path)
    assert request.target_video_length == resolved["frames"] == 17  # frames / fps = 0.7 s: 16.8 -> 17 (8k + 1)


def test_estimate_counts_the_new_modules_and_stages(cold: dict[str, Any]) -> None:
    """The estimate's weights of Gemma-4, the duration head and the diffusion decoder are the loaded modules'
    bytes; its stages are the pipeline's profiled stages in order (the diffusion decoder in place of the VAE
    decoder, no VAE module for t2av); the decoder's stage holds `diffusion_decode_bytes` at stage 2's grid
    (frames omitted: at the bounds' largest count, 33 frames -> 5 latent frames) and the CPU's dense window mask."""
    from runnerkit.models.ltx2.estimate25 import dense_mask_bytes
    from runnerkit.models.ltx2.estimate_diffusion_decoder import diffusion_decode_bytes

    runner: LTX25Runner = cold["runner"]
    estimate = runner.estimate_memory(runner.request_shape(RequestConfig(prompt="p")))
    assert runner.estimate_memory((64, 128, None)) == estimate  # the config's omitted default (`runnerkit plan`)
    for name in ("text_encoder", "duration_head", "diffusion_decoder"):
        module = runner.modules[name]
        loaded = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        assert estimate.modules[name].weight_bytes == loaded, name
    assert "vae" not in estimate.modules and set(estimate.modules) == set(runner.modules)
    assert tuple(s.name for s in estimate.stages) == runner.profile_stages()
    decode = next(s for s in estimate.stages if s.name == "diffusion_decoder")
    decoder = runner.checkpoint.arch.diffusion_decoder
    mask = dense_mask_bytes(decoder, (5, 2, 4), torch.device("cpu"), None)  # the CPU's dense window mask
    assert mask > 0 and "the dense window mask" in decode.detail
    assert decode.activation_bytes > diffusion_decode_bytes(decoder, (5, 2, 4), 4)[0] + mask
    assert decode.activation_bytes < diffusion_decode_bytes(decoder, (6, 2, 4), 4)[0] + mask


class FakeEnhancer:
    """Stands in for the Gemma-4 enhancer (its parity: test_prompt_enhancer.py): records its calls and the
    placed module it generates with, and rewrites every prompt to PROMPT."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, int]] = []
        self.models: list[Any] = []
        self.warmed = 0

    def around(self, model: Any) -> FakeEnhancer:
        self.models.append(model)
        return self

    def enhance(self, prompt: str, image: Any = None, seed: int = 10) -> str:
        self.calls.append((prompt, image, seed))
        return PROMPT

    def warm(self) -> None:
        self.warmed += 1


def test_enhanced_prompt_is_what_the_text_encoder_reads(cold: dict[str, Any], tmp_path: Path, mocker: Any) -> None:
    """With a `prompt_enhancer` section the runner reads the enhancer's parts and places its weights as the
    pipeline module `prompt_enhancer` (stage before the text encoder); warmup warms it once; a request with
    `enhance_prompt` is encoded from the rewrite (its outputs equal a plain request of the rewritten prompt,
    bit for bit), the sidecar keeps both prompts, and a request without the field never calls it."""
    from test_cases.models.ltx2.test_prompt_enhancer import _model

    _model().config.to_json_file(tmp_path / "config.json")  # the estimate reads its sizes
    fake, weights = FakeEnhancer(), torch.nn.Linear(1, 1)
    fake.model_dir = tmp_path  # type: ignore[attr-defined]
    parts = mocker.patch("runnerkit.models.ltx2.prompt_enhancer.configured_enhancer_parts", return_value=fake)
    load = mocker.patch("runnerkit.models.ltx2.prompt_enhancer.load_enhancer_model", return_value=weights)
    runner = make_runner(prompt_enhancer={"path": str(tmp_path)}, warmup=True)
    runner.init_modules()
    assert parts.call_args.kwargs["image_task"] is False and fake.warmed == 1 and fake.models == [weights]
    assert load.call_args.args == (tmp_path, torch.float32, torch.device("cpu"))  # mode none: on the device
    assert runner.profile_stages()[:2] == ("prompt_enhancer", "text_encoder")
    runner.run_pipeline(RequestConfig(prompt="fox", seed=3, enhance_prompt=True, save_result_path=str(tmp_path / "e.mp4"),
                                      save_tensor_path=str(tmp_path / "e.safetensors")))
    runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=3, save_result_path=str(tmp_path / "p.mp4"),
                                      save_tensor_path=str(tmp_path / "p.safetensors")))
    assert fake.calls == [("fox", None, 3)] and fake.warmed == 1 and fake.models == [weights, weights]
    enhanced, expected = load_file(tmp_path / "e.safetensors"), cold["omitted"][0]
    assert torch.equal(enhanced["video"], expected["video"]) and torch.equal(enhanced["audio"], expected["audio"])
    sidecar = json.loads((tmp_path / "e.json").read_text())
    assert (sidecar["prompt"], sidecar["enhanced_prompt"]) == ("fox", PROMPT)
    assert "enhanced_prompt" not in json.loads((tmp_path / "p.json").read_text())


def test_plan_refusal_at_the_largest_predicted_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`runnerkit plan` of the tiny config with `offload.mode` auto and its frames omitted, on a device too
    small for 33 frames: the plan judges the bounds' largest count (33), and its refusal offers the frame
    count that fits (9) instead of failing on the omitted count."""
    from runnerkit.tools.plan import main as plan_main

    raw = json.loads(CONFIG.read_text()) | {"offload": {"mode": "auto"}}
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(raw))
    rc = plan_main(["--config_json", str(path), "--device_gib", "0.26", "--host_gib", "64"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 1, text  # the plan tool's "nothing fits" (the run itself would exit 2)
    assert "no offload plan fits 1 shape(s) [[64, 128, 33]]" in text and "To fit: target_video_length 9 at 64x128" in text


def test_vae_tiling_tiles_the_diffusion_decoder(cold: dict[str, Any], tmp_path: Path, mocker: Any) -> None:
    """`offload.vae_tiling` (refused by LTX-2.3, whose VAE decodes whole) hands the default tiles to the
    diffusion decode; a tiny latent fits one tile, so the video is the untiled one bit for bit. The estimate
    then takes the tiled decode's bytes and drops the tiling advice the untiled estimate gives."""
    from runnerkit.models.ltx2 import runner25
    from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling
    from runnerkit.models.ltx2.estimate25 import TILING_HINT

    with pytest.raises(NotImplementedError, match="`offload.vae_tiling` is not available for ltx2"):
        LTX2Runner(load_runner_config(CONFIGS / "ltx2_t2av_tiny.json", {"device": "cpu", "offload.vae_tiling": True}))
    spy = mocker.spy(runner25, "decode_video")
    runner = make_runner(**{"offload.vae_tiling": True})
    runner.init_modules()
    runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=3, target_video_length=17,
                                      save_tensor_path=str(tmp_path / "tiled.safetensors")))
    assert spy.call_count == 1 and spy.call_args.kwargs["tiling"] == DecoderTiling()
    assert torch.equal(load_file(tmp_path / "tiled.safetensors")["video"], cold["given17"][0]["video"])
    untiled = cold["runner"].estimate_memory((64, 128, 17))
    tiled = runner.estimate_memory((64, 128, 17))
    assert TILING_HINT in untiled.hints and TILING_HINT not in tiled.hints
    assert tiled.stages == untiled.stages  # one tile: the same bytes


def test_warmup_with_vae_tiling_adds_the_largest_whole_decode(cold: dict[str, Any], tmp_path: Path,
                                                               mocker: Any) -> None:
    """Warmup with `offload.vae_tiling`: after each shape's decode, one decode of zero latents at the shape's
    latent size with `tile_frames // 8` = 10 latent frames (`warm_whole_decode`), from a generator of its own:
    the first request still equals the cold runner's bit for bit."""
    from runnerkit.models.ltx2 import diffusion_decode, runner25

    spy = mocker.spy(runner25, "warm_whole_decode")
    inner = mocker.spy(diffusion_decode, "decode_video")  # the extra decode's (runner25 holds its own name)
    runner = make_runner(**{"offload.vae_tiling": True, "warmup": True})
    runner.init_modules()
    assert [tuple(c.args[1].shape) for c in spy.call_args_list] == [(1, 8, 2, 2, 2), (1, 8, 5, 2, 4)]
    assert [tuple(c.args[1].shape) for c in inner.call_args_list] == [(1, 8, 10, 2, 2), (1, 8, 10, 2, 4)]
    runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=3, target_video_length=17,
                                      save_tensor_path=str(tmp_path / "warm.safetensors")))
    assert spy.call_count == 2  # a request does not run it
    assert torch.equal(load_file(tmp_path / "warm.safetensors")["video"], cold["given17"][0]["video"])


@pytest.mark.parametrize("frames, refused", [(1, True), (9, False), (17, False)])
def test_a_frame_count_below_the_shortest_prediction_is_refused(frames: int, refused: bool) -> None:
    """A given count below the bounds' smallest (9 at 24 fps for the tiny flavour) is refused before anything
    loads, naming the field and the smallest allowed (the decoder would fail on it after both stages)."""
    config = load_runner_config(CONFIG, {"device": "cpu"})
    request = RequestConfig(prompt="p", target_video_length=frames)
    if refused:
        with pytest.raises(ValueError, match=r"`target_video_length` 1: ltx2.5 takes at least 9 frames at 24 fps"):
            LTX25Runner.validate_request(request, config)
    else:
        LTX25Runner.validate_request(request, config)


@pytest.mark.parametrize("height, width, decoder, refused", [(192, 768, None, True), (512, 192, None, True),
                                                              (256, 256, None, False), (192, 768, "conv", False)])
def test_a_size_below_the_decoders_windows_is_refused(height: int, width: int, decoder: str | None,
                                                      refused: bool) -> None:
    """The release decoder's stage-1 window is 7 x 7 latent cells (224 x 224 pixels): a smaller request is refused
    before anything loads, naming both fields and the smallest size, unless the convolutional VAE decodes."""
    overrides = {"device": "cpu"} | ({"video_decoder": decoder} if decoder else {})
    config = load_runner_config(CONFIGS / "ltx25_t2av_22b_distilled.json", overrides)
    request = RequestConfig(prompt="p", target_height=height, target_width=width, target_video_length=25)
    if refused:
        with pytest.raises(ValueError, match=rf"`target_height` x `target_width` {height}x{width}: the ltx2.5 "
                                             r"diffusion decoder's attention windows need latents of at least 7 x 7 "
                                             r"cells, 224 x 224 pixels; .* `video_decoder` 'conv'"):
            LTX25Runner.validate_request(request, config)
    else:
        LTX25Runner.validate_request(request, config)


LTX25_SETTINGS_REFUSED = {
    "infer_steps": ({"infer_steps": 2}, ("`infer_steps` must be 8 for ltx2.5 (got 2): the distilled model runs its "
                                         "trained table of 8 stage-1 sigmas, then 3 stage-2 sigmas")),
    "enable_cfg": ({"enable_cfg": True}, ("`enable_cfg` must be false for ltx2.5: the distilled checkpoints are "
                                          "trained without classifier-free guidance (set \"enable_cfg\": false)")),
    "sample_shift": ({"sample_shift": 3.0}, ("ltx2.5 samples with Euler on the distilled sigma tables as given: "
                                             "`scheduler` 'euler', `scheduler_spacing` 'diffusers' and `sample_shift` "
                                             "1.0 (got 'euler', 'diffusers', 3.0)")),
}


@pytest.mark.parametrize("case", list(LTX25_SETTINGS_REFUSED))
def test_the_distilled_sampling_checks_name_ltx25(case: str) -> None:
    """The distilled-sampling checks LTX-2.5 inherits from LTX-2 name the config's `model_cls`, not 'ltx2'."""
    overrides, message = LTX25_SETTINGS_REFUSED[case]
    with pytest.raises(ValueError) as exc:
        make_runner(**overrides)
    assert str(exc.value) == message


def test_the_launch_script_names_ltx25_in_a_wrong_step_count(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    status = main(["--config_json", str(CONFIG), "--prompt", "x", "--infer_steps", "2",
                   "--save_tensor_path", str(tmp_path / "o.safetensors")])
    err = capsys.readouterr().err
    assert status == 2 and "`infer_steps` must be 8 for ltx2.5 (got 2)" in err, err
