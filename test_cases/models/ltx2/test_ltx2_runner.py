"""The LTX-2 runner's lifecycle on the tiny CPU configs (ARCHITECTURE §3-4): warmup runs every stage of
the two-stage chain per shape in order; same seed => bit-identical video and audio with and without
warmup in every offload mode, also for a request served after another one; both checkpoint layouts
give the same result; fp8 single files stream from disk through one handle; input errors exit 2
before anything loads; i2av keeps its first latent frame clean.

One synthetic diffusers-layout checkpoint (seed 0, float32) is written per module and shared; the
reference outputs come from a cold runner without offload. End-to-end parity with diffusers' chain
(the cross attention, the generator hand-over, the upsampler's statistics): test_runner_parity.py
(t2av through the family contract's parity hook, i2av there).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from loguru import logger
from PIL import Image
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.infer import main
from runnerkit.models.ltx2 import runner as ltx2_runner
from runnerkit.models.ltx2.arch import LTX2Arch
from runnerkit.models.ltx2.checkpoint_synthetic import SINGLE_FILE, UPSAMPLER_FILE, write_synthetic_ltx2
from runnerkit.models.ltx2.runner import LTX2Runner
from runnerkit.offload import disk
from runnerkit.weights import safetensors_infos
from test_cases.family_contract import Family, FamilyContract, RequestSpy, check_failed_and_cancelled
from test_cases.offload._handles import HandleSampler, open_fds

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
SEED = 0  # `synthetic_checkpoint.seed` of the tiny configs
#: diffusers 0.42.1 `pipelines/ltx2/utils.py` DISTILLED_SIGMA_VALUES and STAGE_2_DISTILLED_SIGMA_VALUES,
#: written out here so that a changed table in the runner fails (the parity test reads the runner's).
STAGE1_SIGMAS = [1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875]
STAGE2_SIGMAS = [0.909375, 0.725, 0.421875]
# The tiny flavour's two warmup shapes (LTX2Runner.WARMUP_SHAPES["debug"]); LARGE is the configs' default.
SMALL = RequestConfig(prompt="a red fox runs through fresh snow, wind howls", seed=11, target_height=64,
                      target_width=64, target_video_length=9)
LARGE = RequestConfig(prompt="waves break on a rocky shore", seed=12)
Outputs = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager warmup freezes the gc once per process: never the test process's."""
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)


@pytest.fixture(autouse=True)
def _restore_logger() -> Iterator[None]:
    """`runnerkit.infer.main` binds loguru to the `sys.stderr` of its call (a capsys buffer); rebind."""
    yield
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="DEBUG")


def tiny_arch() -> LTX2Arch:
    """The architecture of the tiny configs (their `model` key)."""
    return LTX2Runner.parse_arch(json.loads((CONFIGS / "ltx2_t2av_tiny.json").read_text())["model"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny configs' synthetic checkpoint (diffusers layout), as the runner would write it."""
    return write_synthetic_ltx2(tiny_arch(), tmp_path_factory.mktemp("ltx2") / "diffusers", SEED, torch.float32)


def config_dict(task: str, **overrides: Any) -> dict[str, Any]:
    """The tiny config of `task` on the CPU with `overrides` (a None value removes the key)."""
    data = {**json.loads((CONFIGS / f"ltx2_{task}_tiny.json").read_text()), "device": "cpu", **overrides}
    return {k: v for k, v in data.items() if v is not None}


def make_runner(task: str, **overrides: Any) -> LTX2Runner:
    """The tiny config of `task` on the CPU with `overrides` (a None value removes the key)."""
    return LTX2Runner(load_runner_config(None, config_dict(task, **overrides)))


def single_file_paths(folder: Path) -> dict[str, Any]:
    """Overrides that run the single-file checkpoint in `folder`, its architecture read from the file."""
    return dict(model_path=str(folder / SINGLE_FILE), upsampler_path=str(folder / UPSAMPLER_FILE),
                text_encoder_path=str(folder / "text_encoder"), synthetic_checkpoint=None, model=None)


def assert_request_boundary(runner: LTX2Runner) -> None:
    """The start-up baseline: no request state, every offloaded module off the device, streamers at a
    request boundary, schedulers as fresh ones."""
    assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys()
    assert runner.pipeline is not None
    for stage in runner.pipeline.denoise:
        fresh = runner.build_scheduler(stage)
        assert scheduler_state(runner.schedulers[stage.name]) == scheduler_state(fresh), stage.name
    assert runner.placement is not None and runner.placement.on_device_now() == set()
    if runner.transformer is not None:
        assert runner.transformer._rope_cache == {}
    if runner.streamer is not None:
        state = runner.streamer.state()
        assert state["next_prefetch"] == 0 and state["issued"] == [] and state["in_flight"] == 0


def scheduler_state(sched: Any) -> dict[str, Any]:
    return {k: (tuple(v.shape), v.flatten().tolist()) if isinstance(v, torch.Tensor) else v
            for k, v in vars(sched).items()}


def serve(runner: LTX2Runner, request: RequestConfig, path: Path, index: int = 0) -> Outputs:
    """One request through `run_pipeline`; its saved video [3, F, H, W] and audio [channels, samples]."""
    runner.run_pipeline(request.model_copy(update={"save_tensor_path": str(path)}), index)
    assert_request_boundary(runner)
    outputs = load_file(str(path))
    assert sorted(outputs) == ["audio", "video"]
    return outputs


def assert_same(got: Outputs, want: Outputs, what: str) -> None:
    for key in ("video", "audio"):
        assert torch.equal(got[key], want[key]), f"{what}: {key} differs (max {(got[key] - want[key]).abs().max()})"


def wrap(runner: LTX2Runner, method: str, before: Callable[..., None] | None = None,
         after: Callable[[Any], None] | None = None) -> None:
    """Replace `runner.<method>` by a call of the real one with `before(*args)` and `after(result)` around
    it (instance attributes: describe_pipeline and the request path call `self.<method>`)."""
    real = getattr(runner, method)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args)
        result = real(*args, **kwargs)
        if after is not None:
            after(result)
        return result

    setattr(runner, method, wrapped)


@dataclass
class Reference:
    """A cold runner without offload: SMALL served first (fresh), then LARGE; the timesteps of SMALL's steps."""

    small: Outputs
    large: Outputs
    timesteps: dict[str, list[float]]


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    runner = make_runner("t2av", model_path=str(checkpoint))
    runner.init_modules()
    timesteps: dict[str, list[float]] = {}
    wrap(runner, "run_step", before=lambda req, stage, model, latents, timestep, i: timesteps.setdefault(
        stage.name, []).append(float(timestep)))
    out = tmp_path_factory.mktemp("reference")
    small = serve(runner, SMALL, out / "small.safetensors")
    small_timesteps = {k: list(v) for k, v in timesteps.items()}  # before LARGE adds its own
    return Reference(small, serve(runner, LARGE, out / "large.safetensors", 1), small_timesteps)


# ---- warmup ---------------------------------------------------------------------------------
#: The module each stage needs on the device (runner.describe_pipeline).
STAGE_MODULES = {"text_encoder": "text_encoder", "text_connectors": "connectors", "vae_encoder": "vae",
                 "stage1": "transformer", "latent_upsampler": "latent_upsampler", "stage2": "transformer",
                 "vae_decoder": "vae", "audio_decoder": "audio_decoder"}


def record_stages(runner: LTX2Runner) -> tuple[list[tuple[Any, ...]], list[tuple[str, set[str]]]]:
    """Record every stage method of `runner` (call before init_modules). Returns the calls in order, each
    (stage, shape) or, for a denoising step, (stage, step, sigma, shape), the shape None for the text
    stages (shared by the shapes); and per call (stage, the modules on the device during it)."""
    calls: list[tuple[Any, ...]] = []
    placed: list[tuple[str, set[str]]] = []

    def note(req: Any, stage: str, *step: Any) -> None:
        calls.append((stage, *step, req.info.shape if stage not in ("text_encoder", "text_connectors") else None))
        assert runner.placement is not None
        placed.append((stage, runner.placement.on_device_now()))

    for method, stage in (("run_text_encoder", "text_encoder"), ("run_connectors", "text_connectors"),
                          ("run_vae_encoder", "vae_encoder"), ("run_vae_decoder", "vae_decoder"),
                          ("run_audio_decoder", "audio_decoder")):
        wrap(runner, method, before=lambda req, *_, s=stage: note(req, s))  # the module is on the device already
    wrap(runner, "run_transition", before=lambda req, *_: note(req, "latent_upsampler"))
    wrap(runner, "run_step", before=lambda req, stage, model, latents, timestep, i: note(
        req, stage.name, i, round(float(timestep) / 1000, 6)))
    return calls, placed


@pytest.mark.parametrize(("task", "offload"), [("t2av", "model"), ("i2av", "none")])
def test_warmup_runs_every_stage_per_shape_in_order(checkpoint: Path, mocker: Any, task: str, offload: str) -> None:
    """Text encoder and connectors once (shared); per warmup shape: [i2av: the VAE encoder], stage 1 steps
    0 and 7, the upsampler transition, stage 2 steps 0 and 2 (each stage's first and last sigma), the
    video and audio decoders; nothing saved; each shape starts from a cleared state. Model offload: each
    stage ran with its own module on the device, and none is left there."""
    runner = make_runner(task, model_path=str(checkpoint), warmup=True, offload={"mode": offload})
    calls, placed = record_stages(runner)
    stage2_left: list[bool] = []  # at each shape's first step: does stage 2 still hold the last shape's latents?
    wrap(runner, "run_step", before=lambda req, stage, model, latents, timestep, i: stage2_left.append(
        runner.schedulers["stage2"].latents is not None) if (stage.name, i) == ("stage1", 0) else None)
    run_pipeline = mocker.spy(LTX2Runner, "run_pipeline")
    save = mocker.spy(LTX2Runner, "save_outputs")
    runner.init_modules()

    assert runner.flavour() == "debug"
    shapes = LTX2Runner.WARMUP_SHAPES["debug"]

    def per_shape(shape: tuple[int, int, int]) -> list[tuple[Any, ...]]:
        return [*([("vae_encoder", shape)] if task == "i2av" else []),
                ("stage1", 0, 1.0, shape), ("stage1", 7, 0.421875, shape), ("latent_upsampler", shape),
                ("stage2", 0, 0.909375, shape), ("stage2", 2, 0.421875, shape),
                ("vae_decoder", shape), ("audio_decoder", shape)]

    assert calls == [("text_encoder", None), ("text_connectors", None), *per_shape(shapes[0]), *per_shape(shapes[1])]
    assert stage2_left == [False, False]  # state is cleared after each shape, not only after warmup
    assert run_pipeline.call_count == 0 and save.call_count == 0
    assert runner.profiler.warmup["shapes"] == [list(s) for s in shapes]
    assert runner.warmups.step_report() == runner.profiler.warmup["steps_per_shape"] == {"stage1": [0, 7],
                                                                                     "stage2": [0, 2]}
    assert_request_boundary(runner)
    if offload == "model":
        assert runner.placement is not None and runner.placement.offloader is not None
        assert set(runner.placement.offloader.modules) == set(STAGE_MODULES.values()) - {"vae_encoder"}
        assert placed == [(stage, {STAGE_MODULES[stage]}) for stage, _ in placed]
        assert runner.placement.offloader.resident() == set()


def test_request_steps_through_the_distilled_sigma_tables(reference: Reference) -> None:
    """All 8 stage-1 and 3 stage-2 steps, on the distilled model's trained sigmas: timesteps 1000 x sigma in
    float32, as diffusers' FlowMatchEulerDiscreteScheduler gives them for `sigmas=`."""
    timesteps = lambda sigmas: (torch.tensor(sigmas, dtype=torch.float32) * 1000).tolist()  # noqa: E731
    assert reference.timesteps == {"stage1": timesteps(STAGE1_SIGMAS), "stage2": timesteps(STAGE2_SIGMAS)}


# ---- same seed, same result -----------------------------------------------------------------
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "model": {"offload": {"mode": "model"}},
    "block_disk_mmap": {"offload": {"mode": "block", "storage": "disk", "reader": "mmap"}},
    "phase_disk_pread": {"offload": {"mode": "phase", "storage": "disk", "reader": "pread"}},
    "block_disk_lazy_load": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
    # built once per request: held through the upsampler between the stages
    "lazy_load_kept_across_stages": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True,
                                                 "keep_across_stages": True}},
    # one block of each streamed module (Gemma-3's layers, the connectors' two stacks, the transformer) resident
    "block_disk_resident_blocks": {"offload": {"mode": "block", "storage": "disk", "resident_blocks": 1,
                                               "stream_modules": ["text_encoder", "connectors", "transformer"]}},
}


def ltx2_boundary(runner: LTX2Runner) -> None:
    """LTX-2's request-specific cache: the RoPE tables per grid."""
    assert runner.transformer is None or runner.transformer._rope_cache == {}


def ltx2_after_mode(mode: str, runner: LTX2Runner) -> None:
    if mode in ("block_disk_lazy_load", "lazy_load_kept_across_stages"):
        assert runner.transformer is None and runner.streamer is None  # built per stage, dropped after it
    elif mode in ("block_disk_mmap", "phase_disk_pread"):
        assert runner.streamer is not None and runner.streamer.stats()["disk_bytes_read"] > 0  # read from the file


def ltx2_parity(request: pytest.FixtureRequest, folder: Path) -> None:
    from test_cases.models.ltx2.test_runner_parity import check_t2av_parity  # needs diffusers

    check_t2av_parity(folder, request.getfixturevalue("monkeypatch"))


class TestFamilyContract(FamilyContract):
    """After warmup, LARGE and then SMALL equal the cold reference bit for bit (video and audio) in every
    mode: SMALL, served after another request, equals SMALL in a fresh runner; the request boundary after
    each request; the warmup gates; the CPU estimate; t2av parity with diffusers' two-stage chain
    (test_cases/family_contract.py)."""

    family = Family(
        name="ltx2 t2av", runner_cls=LTX2Runner, checkpoint="checkpoint",
        config=lambda ckpt, **overrides: config_dict("t2av", model_path=str(ckpt), **overrides),
        requests=(LARGE, SMALL), outputs=("video", "audio"), modes=MODES, warmup_arms=(True,),
        boundary=ltx2_boundary, after_mode=ltx2_after_mode,
        # the configs' default shape; formula / measured: 0.998 here (16.94 / 16.97 MiB, the VAE decoder:
        # inside fit.MARGIN), 1.25 at SMALL (8.81 / 7.04 MiB, the text encoder)
        estimate_request=LARGE.model_copy(update={"target_height": 128, "target_width": 192, "target_video_length": 17}),
        estimate_loosest=1.5, parity=ltx2_parity, reference_package="diffusers")


@pytest.fixture(scope="module")
def family_reference(reference: Reference) -> list[Outputs]:
    """The contract's reference outputs: the cold `offload.mode: none` runs (family_contract.py)."""
    return [reference.large, reference.small]  # the reference served SMALL first, in a fresh runner


# ---- checkpoint layouts ---------------------------------------------------------------------
def test_single_file_layout_equals_the_diffusers_folder(reference: Reference, tmp_path: Path) -> None:
    """The release layout (one .safetensors, the upsampler file, the Gemma-3 folder with its tokenizer) of
    the same seed: architecture read from the file's metadata, outputs bit-identical."""
    folder = write_synthetic_ltx2(tiny_arch(), tmp_path / "single", SEED, torch.float32, "single_file")
    runner = make_runner("t2av", **single_file_paths(folder))
    runner.init_modules()
    assert runner.checkpoint is not None and runner.checkpoint.layout == "single_file"
    assert runner.checkpoint.arch == tiny_arch()
    assert_same(serve(runner, SMALL, tmp_path / "small.safetensors"), reference.small, "single file")


def test_fp8_single_file_streams_from_disk_through_one_handle(reference: Reference, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed file as the fp8 releases ship (block linear weights float8_e4m3fn, the rest bfloat16),
    streamed block by block from disk: equal to the same file loaded resident, and the OS never sees
    two descriptors (or two mappings) of the file, sampled at every tensor read and by a polling thread."""
    folder = write_synthetic_ltx2(tiny_arch(), tmp_path / "fp8", SEED, torch.bfloat16, "single_file",
                                  fp8_blocks="plain")
    path = folder / SINGLE_FILE
    dtypes = {k: e.dtype for k, e in safetensors_infos([path], "test").items()}
    blocks = "model.diffusion_model.transformer_blocks.0."
    assert dtypes[blocks + "ff.net.0.proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.diffusion_model.patchify_proj.weight"] == torch.bfloat16
    resident = make_runner("t2av", **single_file_paths(folder))
    resident.init_modules()
    want = serve(resident, SMALL, tmp_path / "resident.safetensors")

    sampler = HandleSampler([path])
    descriptors: list[int] = []  # open on the file at each read of a tensor outside the blocks
    real_read = disk.SafetensorsDiskReader._read

    def sampled_read(self: Any, handle: Any, entry: Any, dst: torch.Tensor) -> None:
        # the reader's handle is open here; mappings (a scan of /proc/self/maps) at streamed reads only
        if ".transformer_blocks." in entry.name:
            sampler.sample(f"streaming {entry.name}")
        else:
            descriptors.append(open_fds(sampler.paths)[SINGLE_FILE])
        real_read(self, handle, entry, dst)

    monkeypatch.setattr(disk.SafetensorsDiskReader, "_read", sampled_read)
    sampler.start_polling(interval_s=0.02)
    try:
        runner = make_runner("t2av", offload={"mode": "block", "storage": "disk"}, **single_file_paths(folder))
        runner.init_modules()
        got = serve(runner, SMALL, tmp_path / "streamed.safetensors")
    finally:
        sampler.stop_polling()
    assert sampler.violations() == [] and max(descriptors) <= 1
    streamed = [s for s in sampler.samples if s.where.startswith("streaming ")]
    assert len(streamed) >= 11 * 2, "every step reads each block's weights from the file"
    # one handle: a descriptor or a mapping of the file (the mmap reader closes its descriptor once mapped), never
    # both, nor none (the block weights are read from the file itself)
    assert {s.fds[SINGLE_FILE] + (s.mapped[SINGLE_FILE] > 0) for s in streamed} == {1}
    assert runner.streamer is not None and runner.streamer.stats()["disk_bytes_read"] > 0
    assert_same(got, want, "fp8 blocks streamed from disk vs resident")
    assert not torch.equal(got["video"], reference.small["video"])  # the blocks really are fp8


# ---- input errors ---------------------------------------------------------------------------
def bad_input_argv(case: str, tmp_path: Path) -> list[str]:
    """The launch script's arguments of an input error `case` (nothing there needs a checkpoint)."""
    t2av = ["--config_json", str(CONFIGS / "ltx2_t2av_tiny.json"), "--device", "cpu", "--prompt", "a fox"]
    gemma, upsampler = tmp_path / "gemma", tmp_path / UPSAMPLER_FILE
    gemma.mkdir()
    upsampler.write_bytes(b"")
    paths = {"model_path": str(tmp_path / SINGLE_FILE), "text_encoder_path": str(gemma),
             "upsampler_path": str(upsampler)}

    def config(**changes: Any) -> list[str]:
        data = {**json.loads((CONFIGS / "ltx2_t2av_tiny.json").read_text()), "device": "cpu", **changes}
        file = tmp_path / f"{case}.json"
        file.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
        return ["--config_json", str(file), "--prompt", "a fox"]

    cases: dict[str, Callable[[], list[str]]] = {
        "frames": lambda: [*t2av, "--target_video_length", "13"],
        "height": lambda: [*t2av, "--target_height", "96"],
        "width": lambda: [*t2av, "--target_width", "160"],
        "text_encoder_path": lambda: config(**{**paths, "text_encoder_path": str(tmp_path / "no")},
                                            synthetic_checkpoint=None),
        "upsampler_path": lambda: config(**{**paths, "upsampler_path": str(tmp_path / "no.st")},
                                         synthetic_checkpoint=None),
        "image_path": lambda: ["--config_json", str(CONFIGS / "ltx2_i2av_tiny.json"), "--device", "cpu",
                               "--prompt", "a fox"],
        "enable_cfg": lambda: config(enable_cfg=True),
        "infer_steps": lambda: [*t2av, "--infer_steps", "4"],
        "sample_sigmas": lambda: config(sample_sigmas=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]),
    }
    return cases[case]()


BAD_INPUTS = {
    "frames": "`target_video_length` must be 8n+1, e.g. 9, 17, 81 (got 13)",
    "height": "`target_height` must be a multiple of 64 (got 96)",
    "width": "`target_width` must be a multiple of 64 (got 160)",
    "text_encoder_path": "`text_encoder_path` '{tmp}/no' is not an existing folder",
    "upsampler_path": "`upsampler_path` '{tmp}/no.st' is not an existing file",
    "image_path": "`image_path` (--image_path) is required by task 'i2av'",
    "enable_cfg": "`enable_cfg` must be false for ltx2",
    "infer_steps": "`infer_steps` must be 8 for ltx2 (got 4)",
    "sample_sigmas": "`sample_sigmas` is not used by ltx2: the distilled model runs its trained sigma tables",
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_naming_it_before_loading(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   mocker: Any) -> None:
    """Through the launch script: exit status 2, one line naming the field (and the path) with what is
    allowed, no traceback, and the runner never started loading."""
    argv = bad_input_argv(case, tmp_path)
    load = mocker.spy(LTX2Runner, "load_modules")
    capsys.readouterr()
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "invalid input" in err and BAD_INPUTS[case].format(tmp=tmp_path) in err, err
    assert "Traceback" not in err and load.call_count == 0


# ---- i2av ----------------------------------------------------------------------------------
def test_i2av_keeps_the_first_latent_frame_clean(checkpoint: Path, tmp_path: Path, mocker: Any) -> None:
    """The image, H.264 re-compressed at CRF 33, is encoded once; stage 1 ends with its latents as the
    first latent frame, bit for bit, and stage 2 with the upsampled first frame it started from (the
    configs' default shape: 2 x 3 latents in stage 1, 4 x 6 in stage 2)."""
    pixels = np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    image = tmp_path / "first.png"
    Image.fromarray(pixels).save(image)
    runner = make_runner("i2av", model_path=str(checkpoint))
    seen: dict[str, torch.Tensor] = {}
    wrap(runner, "run_vae_encoder", after=lambda inputs: seen.__setitem__("image", inputs.image_latents.clone()))
    wrap(runner, "run_transition", before=lambda req, stage, model, latents: seen.__setitem__("stage1", latents.clone()),
         after=lambda latents: seen.__setitem__("stage2_start", latents.clone()))
    wrap(runner, "run_vae_decoder", before=lambda req, latents: seen.__setitem__("stage2", latents.clone()))
    runner.init_modules()  # after wrapping: describe_pipeline takes the encoder and decoder methods
    recompress = mocker.spy(ltx2_runner, "recompress_h264")
    request = RequestConfig(prompt="a fox in the snow", seed=5, image_path=str(image))
    serve(runner, request, tmp_path / "out.safetensors")

    assert recompress.call_count == 1 and recompress.call_args.args[1] == LTX2Runner.IMAGE_CRF == 33
    assert np.array_equal(recompress.call_args.args[0], pixels)
    cfg = runner.config
    shape = SimpleNamespace(height=cfg.target_height, width=cfg.target_width, frames=cfg.target_video_length)
    stage1 = runner.layout(shape, 1).split(seen["stage1"])[0]  # [1, C, F, H/64, W/64]
    # [1, C, F, H/32, W/32] (i2av keeps stage 2's video 5-D)
    start, end = (runner.layout(shape, 2).split(seen[k])[0] for k in ("stage2_start", "stage2"))
    assert torch.equal(stage1[:, :, :1], seen["image"])
    assert torch.equal(end[:, :, :1], start[:, :, :1])
    assert not torch.equal(end[:, :, 1:], start[:, :, 1:])  # the other frames were denoised


def test_i2av_failed_and_cancelled_requests_leave_the_start_up_state(checkpoint: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The family contract's failed/cancelled-request check (test_cases/family_contract.py, run whole on
    t2av) on i2av: `vars(runner)` back at its start-up state and every `RequestState` freed after a failed,
    a cancelled and a following request (SMALL with a first frame)."""
    image = tmp_path / "inputs" / "first.png"
    image.parent.mkdir()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image)
    family = Family(name="ltx2 i2av", runner_cls=LTX2Runner, checkpoint="checkpoint",
                    config=lambda ckpt, **overrides: config_dict("i2av", model_path=str(ckpt), **overrides),
                    requests=(SMALL.model_copy(update={"image_path": str(image)}),), outputs=("video", "audio"),
                    modes={}, boundary=ltx2_boundary)
    spy = RequestSpy(LTX2Runner, monkeypatch)
    check_failed_and_cancelled(family, make_runner("i2av", model_path=str(checkpoint)), spy, tmp_path, None)
