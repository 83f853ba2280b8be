"""Lifecycle of the Wan image runners: Wan2.1 i2v (`WanI2VRunner`), Wan2.1 flf2v (`WanFLF2VRunner`)
and Wan2.2 MoE i2v (`WanMoEI2VRunner`), on their tiny CPU configs (float32, 4 steps).

Covered: the launch script end to end with --warmup; same seed => bit-identical output with and
without warmup in every offload mode; what warmup runs (per-shape image encoders, both frames of
flf2v, both MoE experts), recorded by hooks on the modules; Wan's area/aspect shape rule and the
last-frame fit, with hand-computed golden values; input errors refused before any weight loads;
request isolation after warmup; the three checkpoint layouts and a damaged CLIP file.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.images import ImageInputError, write_image
from runnerkit.infer import main
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import ORIGINAL_CLIP, write_synthetic
from runnerkit.models.wan.i2v import WanFLF2VRunner, WanI2VRunner, fit_last_frame, wan_resize_shape
from runnerkit.models.wan.moe import WanMoEI2VRunner
from runnerkit.models.wan.moe_checkpoint import write_synthetic_moe
from runnerkit.registry import get_runner_cls
from runnerkit.runners import loading
from test_cases.conftest import tiny_config_dict, write_config
from test_cases.family_contract import Family, RequestSpy, check_failed_and_cancelled

REPO = Path(__file__).resolve().parents[3]
CONFIGS = {"i2v": "wan_i2v_tiny.json", "flf2v": "wan_flf2v_tiny.json", "moe_i2v": "wan22_moe_i2v_tiny.json"}
TASKS = list(CONFIGS)
RUNNER_CLASSES = {"i2v": WanI2VRunner, "flf2v": WanFLF2VRunner, "moe_i2v": WanMoEI2VRunner}
HIGH, LOW = "transformer", "transformer_2"
CLIP_TOKENS = (32 // 2) ** 2 + 1  # tiny CLIP: image_size 32, patch 2 -> 16 x 16 patches + the class token


def tiny(task: str) -> dict[str, Any]:
    return json.loads((REPO / "configs" / "wan" / CONFIGS[task]).read_text())


def config_dict(task: str, ckpt: Path, **overrides: Any) -> dict[str, Any]:
    """The task's tiny config pointing at `ckpt`, on the CPU, no synthetic writing (dicts merged one level)."""
    data = {**tiny(task), "model_path": str(ckpt), "device": "cpu"}
    data.pop("synthetic_checkpoint")
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return data


def make_runner(task: str, ckpt: Path, **overrides: Any) -> Any:
    cfg = load_runner_config(None, config_dict(task, ckpt, **overrides))
    runner = get_runner_cls(cfg.model_cls, cfg.task)(cfg)
    assert type(runner) is RUNNER_CLASSES[task]
    return runner


def write_ckpt(task: str, out: Path, layout: str = "runnerkit") -> Path:
    model = tiny(task)["model"]
    if task == "moe_i2v":
        return write_synthetic_moe(WanMoEI2VRunner.parse_arch(model), out, seed=0, dtype=torch.float32, layout=layout)
    write_synthetic(WanArch.model_validate(model), out, seed=0, dtype=torch.float32, layout=layout)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One synthetic checkpoint per task (runnerkit layout, float32, seed 0)."""
    root = tmp_path_factory.mktemp("i2v_ckpts")
    return {task: write_ckpt(task, root / task) for task in TASKS}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PNG inputs of distinct content: `wide` 60x100 (h x w), `wide2` 60x100, `square` 100x100, `small` 40x40,
    `small2` 40x40."""
    root = tmp_path_factory.mktemp("images")
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, (h, w) in {"wide": (60, 100), "wide2": (60, 100), "square": (100, 100), "small": (40, 40),
                         "small2": (40, 40)}.items():
        out[name] = root / f"{name}.png"
        write_image(out[name], torch.rand(3, h, w, generator=gen) * 2 - 1)
    return out


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Any:
    """One intra-op thread: the tiny networks gain nothing from more, and a shared 2-core machine
    slows several-fold when processes oversubscribe it. Bit-identity is compared within one setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


@pytest.fixture(autouse=True)
def _restore_logger() -> Any:
    """`main` binds loguru to the `sys.stderr` of its call (a capsys buffer); rebind afterwards."""
    yield
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="DEBUG")


def request(task: str, first: Path, last: Path | None = None, **kw: Any) -> RequestConfig:
    """A request of `task`: flf2v also gets `last` (default: the first image)."""
    if task == "flf2v":
        kw["last_frame_path"] = str(last or first)
    return RequestConfig(prompt=kw.pop("prompt", "a red fox in the snow"), image_path=str(first), **kw)


def serve(runner: Any, req: RequestConfig, path: Path) -> torch.Tensor:
    runner.run_pipeline(req.model_copy(update={"save_tensor_path": str(path)}), 0)
    assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys(), "no request state on the runner after a request"
    return load_file(str(path))["video"]


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


# ---- 1. the launch script end to end --------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_launch_script_with_warmup_writes_the_mp4_and_its_sidecar(task: str, ckpts: dict[str, Path],
                                                                  images: dict[str, Path], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.json", config_dict(task, ckpts[task]))
    out = tmp_path / "video.mp4"
    last = ["--last_frame_path", images["square"]] if task == "flf2v" else []  # another size: fitted
    rc, err = cli(capsys, "--config_json", cfg, "--prompt", "a fox", "--seed", 3, "--image_path", images["wide"],
                  *last, "--save_result_path", out, "--warmup")
    assert rc == 0, err
    assert "warmup:" in err, err
    assert out.stat().st_size > 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["image_path"] == str(images["wide"])
    if task == "flf2v":
        assert sidecar["last_frame_path"] == str(images["square"])
    else:
        assert "last_frame_path" not in sidecar
    # a 60x100 image over the tiny config's 48x80 area: 48x80 (see test_shape_rule_golden_values)
    assert (sidecar["height"], sidecar["width"], sidecar["frames"]) == (48, 80, 9)
    assert sidecar["config"]["task"] == ("flf2v" if task == "flf2v" else "i2v")


# ---- 2. same seed, with and without warmup, every offload mode -------------------------------------
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "model": {"offload": {"mode": "model"}},
    "block": {"offload": {"mode": "block"}},
    "phase": {"offload": {"mode": "phase"}},
    "block_disk_lazy": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
    "block_disk": {"offload": {"mode": "block", "storage": "disk"}},
}


def small_request(task: str, images: dict[str, Path]) -> RequestConfig:
    """40x40 image(s) over a 32x32 area, 5 frames: the 32x32x5 warmup shape (cheap)."""
    return request(task, images["small"], images["small2"], seed=11, target_height=32, target_width=32,
                   target_video_length=5)


@pytest.fixture(scope="module")
def cold_reference(ckpts: dict[str, Path], images: dict[str, Path],
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Per task: the small request on a fresh runner without warmup, offload none."""
    root = tmp_path_factory.mktemp("cold_ref")
    out = {}
    for task in TASKS:
        runner = make_runner(task, ckpts[task])
        runner.init_modules()
        out[task] = serve(runner, small_request(task, images), root / f"{task}.safetensors")
        assert out[task].shape == (3, 5, 32, 32) and out[task].std() > 1e-3
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("task", TASKS)
def test_same_seed_bit_identical_with_warmup_in_every_offload_mode(task: str, mode: str, ckpts: dict[str, Path],
                                                                   images: dict[str, Path], tmp_path: Path,
                                                                   cold_reference: dict[str, torch.Tensor]) -> None:
    """Warmup (both shapes, image stages included) in `mode`, then the request: the tensor equals the
    cold `none` run bit for bit."""
    runner = make_runner(task, ckpts[task], warmup=True, **MODES[mode])
    runner.init_modules()
    assert runner.profiler.warmup is not None  # warmup really ran
    got = serve(runner, small_request(task, images), tmp_path / "v.safetensors")
    assert torch.equal(got, cold_reference[task]), (task, mode)
    assert runner.placement.on_device_now() == set() and "stage_modules" not in vars(runner)


# ---- 3. what warmup runs, recorded on the modules --------------------------------------------------
def instrument(runner: Any, calls: list[tuple[Any, ...]], ys: list[torch.Tensor]) -> None:
    """Record every module call: hooks on the text encoder, CLIP and transformer(s); wrappers on the
    VAE's encode and decode. Nothing asks the runner what it chose."""
    mods = runner.modules
    mods["text_encoder"].register_forward_pre_hook(lambda m, args: calls.append(("text_encoder", args[0].shape[0])))
    if "image_encoder" in mods:
        mods["image_encoder"].register_forward_pre_hook(
            lambda m, args: calls.append(("image_encoder", args[0].shape[0])))
    vae = mods["vae"]
    real_encode, real_decode = vae.encode, vae.decode_iter
    vae.encode = lambda video: (calls.append(("vae_encode", tuple(video.shape[2:]))), real_encode(video))[1]
    vae.decode_iter = lambda lat: (calls.append(("vae_decode", tuple(lat.shape[2:]))), real_decode(lat))[1]

    def transformer_hook(name: str) -> Any:
        def hook(m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            clip = kwargs.get("clip_context")
            calls.append((name, int(args[1].flatten()[0]), tuple(args[0].shape[2:]),
                          None if clip is None else clip.shape[1]))
            ys.append(kwargs["y"].clone())
        return hook

    for name in (HIGH, LOW):
        if name in mods:
            mods[name].register_forward_pre_hook(transformer_hook(name), with_kwargs=True)


def expected_mask(frames: int, last: bool) -> torch.Tensor:
    """[4, F_lat]: pixel frame 0 fills latent frame 0 (4 channels); flf2v: pixel frame F-1 is channel 3
    of the last latent frame; every other entry 0 (hand-written)."""
    mask = torch.zeros(4, (frames - 1) // 4 + 1)
    mask[:, 0] = 1
    if last:
        mask[3, -1] = 1
    return mask


@pytest.mark.parametrize("task", TASKS)
def test_warmup_runs_per_shape_image_encoders_both_frames_and_both_experts(
        task: str, ckpts: dict[str, Path], mocker: Any) -> None:
    runner = make_runner(task, ckpts[task], warmup=True)
    calls: list[tuple[Any, ...]] = []
    ys: list[torch.Tensor] = []
    real_place = loading.place_modules

    def place_and_record(placed: Any, pipeline: Any) -> Any:
        placement = real_place(placed, pipeline)
        instrument(runner, calls, ys)
        return placement

    mocker.patch.object(loading, "place_modules", side_effect=place_and_record)
    runner.init_modules()

    flf = task == "flf2v"
    expected: list[tuple[Any, ...]] = [("text_encoder", 2)]  # prompt + negative prompt, once for both shapes
    masks = []
    for h, w, f in [(32, 32, 5), (48, 80, 9)]:  # the debug flavour's warmup shapes
        grid = ((f - 1) // 4 + 1, h // 8, w // 8)
        if task != "moe_i2v":
            expected += [("image_encoder", 1)] * (2 if flf else 1)  # flf2v: first, then last frame
        expected.append(("vae_encode", (f, h, w)))
        if task == "moe_i2v":  # step 0 (high-noise), then the low-noise expert's first step; cond + uncond each
            steps = [(HIGH, "hi"), (HIGH, "hi"), (LOW, "lo"), (LOW, "lo")]
        else:
            steps = [(HIGH, "hi"), (HIGH, "hi")]
        clip = None if task == "moe_i2v" else CLIP_TOKENS * (2 if flf else 1)
        expected += [(name, phase, grid, clip) for name, phase in steps]
        masks += [expected_mask(f, flf)] * len(steps)
        expected.append(("vae_decode", grid))

    # the timestep of each transformer call -> which side of the boundary it is on
    boundary = 900 if task == "moe_i2v" else 0
    seen = [c if c[0] not in (HIGH, LOW) else (c[0], "hi" if c[1] >= boundary else "lo", *c[2:]) for c in calls]
    assert seen == expected
    if task == "moe_i2v":
        assert "image_encoder" not in runner.modules  # Wan2.2: no CLIP
    for y, mask, call in zip(ys, masks, [c for c in calls if c[0] in (HIGH, LOW)], strict=True):
        lat_f, lh, lw = call[2]
        assert y.shape == (1, 4 + 16, lat_f, lh, lw)
        assert torch.equal(y[0, :4], mask[:, :, None, None].expand(4, lat_f, lh, lw)), call
    assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys()


# ---- 4. shape rule ---------------------------------------------------------------------------------
def _lat(area: int, aspect: float) -> int:
    """Wan's rule per side, written out: round(sqrt(area * aspect) // 8 // 2 * 2)."""
    return round((area * aspect) ** 0.5 // 8 // 2 * 2)


@pytest.mark.parametrize(("image_hw", "area_hw", "video_hw"), [
    ((60, 100), (48, 80), (48, 80)),      # sqrt(3840 * 0.6) = 48 -> 6 * 8; sqrt(3840 / 0.6) = 80 -> 10 * 8
    ((100, 100), (48, 80), (48, 48)),     # sqrt(3840) = 61.97 -> // 8 = 7 -> // 2 * 2 = 6 -> 48
    ((100, 60), (48, 80), (80, 48)),      # portrait: the sides swap
    ((720, 1280), (480, 832), (464, 832)),  # 16:9 over 480P: sqrt(399360 * 0.5625) = 473.96 -> 58 * 8 = 464
    # Wan's 480P size does NOT map to itself: in float64 399360 * (480 / 832) = 230399.99999999997,
    # whose sqrt 479.99999999999994 // 8 = 59 -> 58 latent rows -> 464
    ((480, 832), (480, 832), (464, 832)),
    ((40, 40), (32, 32), (32, 32)),
])
def test_shape_rule_golden_values(image_hw: tuple[int, int], area_hw: tuple[int, int], video_hw: tuple[int, int],
                                  images: dict[str, Path], tmp_path: Path) -> None:
    area = area_hw[0] * area_hw[1]
    assert (_lat(area, image_hw[0] / image_hw[1]) * 8, _lat(area, image_hw[1] / image_hw[0]) * 8) == video_hw
    assert wan_resize_shape(*image_hw, area) == video_hw
    # through the runner's request path: the image file's own size decides
    path = tmp_path / "img.png"
    write_image(path, torch.zeros(3, *image_hw))
    cfg = load_runner_config(None, config_dict("i2v", tmp_path / "unused"))
    req = RequestConfig(prompt="x", image_path=str(path), target_height=area_hw[0], target_width=area_hw[1])
    assert WanI2VRunner.shape_of(req, cfg)[:2] == video_hw


#: flavour -> the target areas (h, w) of its releases, each with an image of that same aspect ratio
SUPPORTED_AREAS: dict[str, dict[str, tuple[tuple[int, int], ...]]] = {
    "i2v": {"debug": ((32, 32), (48, 80)), "14B": ((480, 832), (720, 1280))},
    "flf2v": {"debug": ((32, 32), (48, 80)), "14B": ((720, 1280), (1280, 720))},
    "moe_i2v": {"debug": ((32, 32), (48, 80)), "A14B": ((480, 832), (720, 1280))},
}


@pytest.mark.parametrize("task", TASKS)
def test_warmup_shapes_are_the_shapes_the_rule_gives(task: str) -> None:
    """Each class's warmup shapes are what an image of a supported size gives over that area (a shape
    no request reaches would warm nothing)."""
    table = RUNNER_CLASSES[task].__dict__["WARMUP_SHAPES"]
    assert set(table) == set(SUPPORTED_AREAS[task])
    for flavour, areas in SUPPORTED_AREAS[task].items():
        assert [(h, w) for h, w, _ in table[flavour]] == [wan_resize_shape(h, w, h * w) for h, w in areas], flavour


def test_shape_rule_refuses_an_image_too_narrow_for_the_area() -> None:
    with pytest.raises(ImageInputError, match=r"an image of height 1 x width 1000 pixels .* gives a video of height 0 "):
        wan_resize_shape(1, 1000, 48 * 80)  # lat_h = round(sqrt(3.84) // 8 ...) = 0


def test_fit_last_frame_covers_and_center_crops() -> None:
    x = torch.arange(3 * 4 * 8, dtype=torch.float32).reshape(3, 4, 8)
    assert fit_last_frame(x, 4, 8) is x  # same size: untouched
    # 4x8 -> 4x4: already covers (ratio 1), center columns 2..5
    assert torch.equal(fit_last_frame(x, 4, 4), x[:, :, 2:6])
    # 4x8 -> 2x8: rows 1..2
    assert torch.equal(fit_last_frame(x, 2, 8), x[:, 1:3, :])
    # 20x40 -> 10x10: scaled by 0.5 to 10x20 (cover), then columns 5..14; a left -1 / right +1 split
    # lands in the middle of the crop
    halves = torch.cat([torch.full((3, 20, 20), -1.0), torch.full((3, 20, 20), 1.0)], dim=2)
    fitted = fit_last_frame(halves, 10, 10)
    assert fitted.shape == (3, 10, 10)
    assert torch.allclose(fitted[:, :, :3], torch.tensor(-1.0)) and torch.allclose(fitted[:, :, 7:], torch.tensor(1.0))
    # 2x2 constant -> 4x4: scaled up by 2, bicubic keeps a constant
    up = fit_last_frame(torch.full((3, 2, 2), 0.25), 4, 4)
    assert up.shape == (3, 4, 4) and torch.allclose(up, torch.tensor(0.25), atol=1e-6)
    # 6x6 -> 4x8: width decides (ratio 8/6), scaled to 8x8, rows 2..5
    rows = torch.arange(6, dtype=torch.float32)[None, :, None].expand(3, 6, 6)
    assert fit_last_frame(rows, 4, 8).shape == (3, 4, 8)


# ---- 5. input errors: exit 2 naming the flag or file, before anything loads -------------------------
@pytest.fixture
def no_weight_loads(mocker: Any) -> list[Any]:
    """Every Wan weight-assignment entry point (the VAE's is the shared network's) patched to fail: the
    test asserts none was called."""
    names = ["runnerkit.models.wan.runner.assign_state_dict", "runnerkit.models.wan.i2v.assign_state_dict",
             "runnerkit.models.wan.text_encoder.assign_state_dict", "runnerkit.nets.causal_vae3d.load_on_meta"]
    return [mocker.patch(n, side_effect=AssertionError("weights loaded")) for n in names]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory, images: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    text = root / "notes.png"
    text.write_text("this is a text file, not an image\n")
    truncated = root / "truncated.png"
    data = images["wide"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    return {"missing": root / "no_such.png", "text": text, "truncated": truncated}


def _fresh_synthetic(task: str, folder: Path, **overrides: Any) -> dict[str, Any]:
    """The tiny config writing its synthetic checkpoint to `folder` on first load: the folder existing
    afterwards would mean loading started."""
    data = {**tiny(task), "model_path": str(folder), "device": "cpu"}
    data.update(overrides)
    return data


@pytest.mark.parametrize(("task", "case", "needles"), [
    ("i2v", "no_image", ["`image_path` (--image_path) is required by task 'i2v'"]),
    ("i2v", "missing", ["`image_path`", "no_such.png", "no such file"]),
    ("i2v", "text", ["`image_path`", "notes.png", "not an image"]),
    ("i2v", "truncated", ["`image_path`", "truncated.png", "cannot be decoded"]),
    ("moe_i2v", "truncated", ["`image_path`", "truncated.png", "cannot be decoded"]),
    ("flf2v", "no_last", ["`last_frame_path` (--last_frame_path) is required by task 'flf2v'"]),
    ("flf2v", "last_text", ["`last_frame_path`", "notes.png", "not an image"]),
    ("flf2v", "last_missing", ["`last_frame_path`", "no_such.png", "no such file"]),
    ("flf2v", "one_frame", ["`target_video_length` must be at least 5 for flf2v", "got 1"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_image_input_errors_exit_2_before_loading(task: str, case: str, needles: list[str], images: dict[str, Path],
                                                  bad_files: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str], no_weight_loads: list[Any]) -> None:
    folder = tmp_path / "synthetic_ckpt"
    cfg = write_config(tmp_path / "c.json", _fresh_synthetic(task, folder))
    first = {"no_image": None, "missing": bad_files["missing"], "text": bad_files["text"],
             "truncated": bad_files["truncated"]}.get(case, images["wide"])
    last = {"no_last": None, "last_text": bad_files["text"], "last_missing": bad_files["missing"]}.get(
        case, images["wide2"]) if task == "flf2v" else None
    flags = ["--prompt", "x", "--save_tensor_path", tmp_path / "o.safetensors"]
    flags += ["--image_path", first] if first is not None else []
    flags += ["--last_frame_path", last] if last is not None else []
    flags += ["--target_video_length", 1] if case == "one_frame" else []
    rc, err = cli(capsys, "--config_json", cfg, *flags)
    assert rc == 2, err
    assert "Traceback" not in err and "invalid input" in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"
    assert not folder.exists(), "the checkpoint was written: loading started before the input was refused"
    assert all(m.call_count == 0 for m in no_weight_loads)
    assert not (tmp_path / "o.safetensors").exists()


def test_image_path_on_t2v_exits_2_before_loading(tiny_ckpt: Path, images: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str], no_weight_loads: list[Any]) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config_dict(tiny_ckpt))
    rc, err = cli(capsys, "--config_json", cfg, "--prompt", "x", "--image_path", images["wide"])
    assert rc == 2, err
    assert "`image_path` is not used by task 't2v'" in err and "Traceback" not in err, err
    assert all(m.call_count == 0 for m in no_weight_loads)


def test_i2v_task_on_a_text_only_checkpoint_exits_2_before_loading(
        tiny_ckpt: Path, images: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        no_weight_loads: list[Any]) -> None:
    data = tiny_config_dict(tiny_ckpt)  # the t2v checkpoint; the architecture comes from it
    data.pop("model")
    cfg = write_config(tmp_path / "c.json", data)
    rc, err = cli(capsys, "--config_json", cfg, "--task", "i2v", "--prompt", "x", "--image_path", images["wide"])
    assert rc == 2, err
    assert "task 'i2v' needs i2v weights" in err and "`model_type`='t2v'" in err and "text-only" in err, err
    assert all(m.call_count == 0 for m in no_weight_loads)


@pytest.mark.parametrize(("task", "ckpt_task", "have"), [("i2v", None, "t2v"), ("i2v", "flf2v", "flf2v"),
                                                       ("flf2v", "i2v", "i2v")])
def test_shipped_image_config_on_a_checkpoint_of_another_task_exits_2_before_loading(
        task: str, ckpt_task: str | None, have: str, tiny_ckpt: Path, images: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], no_weight_loads: list[Any]) -> None:
    """The config's `model.transformer.model_type` does not hide what the checkpoint holds."""
    ckpt = tiny_ckpt if ckpt_task is None else write_ckpt(ckpt_task, tmp_path / "ckpt")
    cfg = write_config(tmp_path / "c.json", config_dict(task, ckpt))
    flags = ["--last_frame_path", images["wide2"]] if task == "flf2v" else []
    rc, err = cli(capsys, "--config_json", cfg, "--prompt", "x", "--image_path", images["wide"], *flags)
    assert rc == 2, err
    assert f"task {task!r} needs {task} weights" in err and f"`model_type`={have!r}" in err, err
    assert str(ckpt) in err and "Traceback" not in err, err
    assert all(m.call_count == 0 for m in no_weight_loads)


def test_one_frame_i2v_is_the_image_conditioned_frame(ckpts: dict[str, Path], images: dict[str, Path],
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 1-frame i2v request runs (the VAE encodes the lone first frame) and writes a PNG."""
    cfg = write_config(tmp_path / "c.json", config_dict("i2v", ckpts["i2v"]))
    rc, err = cli(capsys, "--config_json", cfg, "--prompt", "x", "--image_path", images["wide"],
                  "--target_video_length", 1, "--save_result_path", tmp_path / "one.png",
                  "--save_tensor_path", tmp_path / "one.safetensors")
    assert rc == 0, err
    assert load_file(tmp_path / "one.safetensors")["video"].shape[1] == 1
    assert (tmp_path / "one.png").stat().st_size > 0


@pytest.mark.parametrize("task", ["i2v", "flf2v"])
def test_clip_encodes_the_images_as_read_not_resized_to_the_video(task: str, ckpts: dict[str, Path],
                                                                  images: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Wan's CLIP sees the conditioning image(s) at their own size (60 x 100 here; the video is another
    size): its input equals the PNG's pixels, decoded by Pillow here and mapped to [-1, 1]."""
    import numpy as np
    from PIL import Image

    from runnerkit.models.wan.clip import CLIPVisionEncoder

    seen: list[torch.Tensor] = []
    real_encode = CLIPVisionEncoder.encode
    monkeypatch.setattr(CLIPVisionEncoder, "encode", lambda self, x: (seen.append(x.clone()), real_encode(self, x))[1])
    runner = make_runner(task, ckpts[task])
    runner.init_modules()
    first, last = images["wide"], images["wide2"]
    serve(runner, request(task, first, last, seed=1), tmp_path / "v.safetensors")
    assert tuple(runner.profiler.requests[-1].shape[:2]) != (60, 100), "the video must differ from the image size"

    def pixels(path: Path) -> torch.Tensor:
        with Image.open(path) as img:
            data = np.asarray(img.convert("RGB"), dtype=np.float32)  # [H, W, 3]
        return torch.from_numpy(data).permute(2, 0, 1).div(255).sub(0.5).div(0.5)[None]  # [1, 3, H, W]

    expected = [pixels(first)] + ([pixels(last)] if task == "flf2v" else [])
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected):
        assert got.shape == (1, 3, 60, 100) and torch.equal(got, want)


@pytest.mark.parametrize(("layout", "remove"), [("original", "low_noise_model"), ("diffusers", "transformer_2"),
                                                ("runnerkit", "transformer_2")])
def test_moe_i2v_checkpoint_missing_an_expert_exits_2_before_loading(
        layout: str, remove: str, images: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        no_weight_loads: list[Any]) -> None:
    ckpt = write_ckpt("moe_i2v", tmp_path / "ckpt", layout)
    shutil.rmtree(ckpt / remove)
    cfg = write_config(tmp_path / "c.json", config_dict("moe_i2v", ckpt))
    rc, err = cli(capsys, "--config_json", cfg, "--prompt", "x", "--image_path", images["wide"],
                  "--save_tensor_path", tmp_path / "o.safetensors")
    assert rc == 2, err
    assert f"{remove}/" in err and "expert" in err, err
    assert all(m.call_count == 0 for m in no_weight_loads)


# ---- 6. isolation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_consecutive_requests_after_warmup_equal_isolated_runs(task: str, ckpts: dict[str, Path],
                                                               images: dict[str, Path], tmp_path: Path) -> None:
    reqs = [request(task, images["square"], images["wide"], seed=3),  # flf2v: a last frame of another size
            request(task, images["wide"], images["wide2"], seed=3)]   # same seed: only the images differ
    warm = make_runner(task, ckpts[task], warmup=True)
    warm.init_modules()
    served = [serve(warm, r, tmp_path / f"served{i}.safetensors") for i, r in enumerate(reqs)]
    assert served[0].shape == (3, 9, 48, 48) and served[1].shape == (3, 9, 48, 80)  # the shape rule, end to end
    for i, r in enumerate(reqs):
        fresh = make_runner(task, ckpts[task])
        fresh.init_modules()
        assert torch.equal(served[i], serve(fresh, r, tmp_path / f"alone{i}.safetensors")), f"request {i}"


# ---- 7. checkpoint layouts and a damaged CLIP file ----------------------------------------------------
@pytest.fixture(scope="module")
def i2v_layouts(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("i2v_layouts")
    return {"runnerkit": ckpts["i2v"], **{layout: write_ckpt("i2v", root / layout, layout)
                                          for layout in ("original", "diffusers")}}


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_i2v_layouts_give_identical_outputs(layout: str, i2v_layouts: dict[str, Path], images: dict[str, Path],
                                            tmp_path: Path, cold_reference: dict[str, torch.Tensor]) -> None:
    runner = make_runner("i2v", i2v_layouts[layout])
    runner.init_modules()
    assert runner.checkpoint.layout == layout
    got = serve(runner, small_request("i2v", images), tmp_path / "v.safetensors")
    diff = (got - cold_reference["i2v"]).abs().max().item()
    assert diff <= 1e-6, f"{layout}: max abs difference {diff:.3g}"


@pytest.mark.parametrize(("layout", "damaged"), [("original", ORIGINAL_CLIP),
                                                 ("runnerkit", "image_encoder/model.safetensors")])
def test_truncated_clip_file_is_refused_at_load_naming_it(layout: str, damaged: str, i2v_layouts: dict[str, Path],
                                                          images: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = Path(shutil.copytree(i2v_layouts[layout], tmp_path / "ckpt"))
    target = ckpt / damaged
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    cfg = write_config(tmp_path / "c.json", config_dict("i2v", ckpt))
    out = tmp_path / "o.safetensors"
    rc, err = cli(capsys, "--config_json", cfg, "--prompt", "x", "--image_path", images["wide"],
                  "--save_tensor_path", out)
    assert rc == 2, err
    assert "load failed" in err and Path(damaged).name in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("task", ["i2v", "moe_i2v"])
def test_failed_and_cancelled_requests_leave_the_start_up_state(task: str, ckpts: dict[str, Path],
                                                                images: dict[str, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The family contract's failed/cancelled-request check (test_cases/family_contract.py) on the image
    runners, which the contract does not run whole: `vars(runner)` back at its start-up state and every
    `RequestState` freed after a failed, a cancelled and a following request (2 steps, 32x32x5)."""
    cls = RUNNER_CLASSES[task]
    family = Family(name=f"wan {task}", runner_cls=cls, checkpoint="ckpts",
                    config=lambda ckpt, **overrides: config_dict(task, ckpt, **overrides),
                    requests=(request(task, images["small"], seed=1, target_height=32, target_width=32,
                                      target_video_length=5),),
                    outputs=("video",), modes={})
    spy = RequestSpy(cls, monkeypatch)
    check_failed_and_cancelled(family, make_runner(task, ckpts[task], infer_steps=2), spy, tmp_path, None)
