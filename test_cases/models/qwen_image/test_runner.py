"""The Qwen-Image runners on the CPU: the launch script end to end, input errors, warmup coverage
(one and two references), and every offload mode bit-identical to `offload.mode: none` with and
without warmup (ARCHITECTURE §3-4; t2i through the family contract, test_cases/family_contract.py)."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.runners.request_state import RequestState
from runnerkit.infer import main
from runnerkit.models.qwen_image.edit import QwenImageEditRunner
from runnerkit.models.qwen_image.runner import QwenImageRunner
from runnerkit.models.qwen_image.transformer import QwenImageTransformer2D
from test_cases.conftest import write_config
from test_cases.family_contract import Family, FamilyContract
from test_cases.models.qwen_image.conftest import EDIT_CONFIG, T2I_CONFIG, qwen_config_dict, reference_images

MODES: dict[str, dict[str, Any]] = {
    "model": {"offload": {"mode": "model"}},
    "block_cpu": {"offload": {"mode": "block"}},
    "phase_cpu_3slots": {"offload": {"mode": "phase", "gpu_slots": 3, "prefetch_depth": 2}},
    "block_disk_mmap": {"offload": {"mode": "block", "storage": "disk", "reader": "mmap"}},
    "phase_disk_pread": {"offload": {"mode": "phase", "storage": "disk", "reader": "pread"}},
    "block_disk_lazy": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
    "block_cpu_all_resident_blocks": {"offload": {"mode": "block", "resident_blocks": 64}},  # nothing streams
    "unload_modules": {"unload_modules": True},
}
T2I_REQUESTS = [RequestConfig(prompt="a red fox in the snow", seed=11),
                RequestConfig(prompt="a boat", seed=12, target_height=32, target_width=32)]


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


def _cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def make(cls: type[QwenImageRunner], config: Path, ckpt: Path, **overrides: Any) -> QwenImageRunner:
    runner = cls(load_runner_config(None, qwen_config_dict(config, ckpt, **overrides)))
    runner.init_modules()
    return runner


def serve(runner: QwenImageRunner, requests: list[RequestConfig], folder: Path, tag: str) -> list[torch.Tensor]:
    out = []
    for i, req in enumerate(requests):
        path = folder / f"{tag}_{i}.safetensors"
        runner.run_pipeline(req.model_copy(update={"save_tensor_path": str(path)}), i)
        out.append(load_file(str(path))["image"])
        assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys() and runner.scheduler.generator is None
        assert runner.scheduler.sigmas is None
    return out


@pytest.fixture(scope="module")
def t2i_reference(qwen_t2i_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    return serve(make(QwenImageRunner, T2I_CONFIG, qwen_t2i_ckpt), T2I_REQUESTS, tmp_path_factory.mktemp("ref"), "none")


def qwen_boundary(runner: QwenImageRunner) -> None:
    """Qwen-Image's request-specific caches: the RoPE tables per grid and the VAE's feature cache."""
    transformer, vae = runner.modules.get("transformer"), runner.modules.get("vae")
    assert transformer is None or transformer._rope_cache == {}
    assert vae is None or vae.feature_cache is None


def qwen_parity(request: pytest.FixtureRequest, folder: Path) -> None:
    from test_cases.models.qwen_image.test_pipeline_parity import check_t2i_parity  # needs diffusers

    check_t2i_parity(request.getfixturevalue("qwen_diffusers_ckpts"), folder)


class TestFamilyContract(FamilyContract):
    """t2i: every mode of MODES bit-identical to `none` with and without warmup, the request boundary
    after each request, the warmup gates, parity with diffusers' QwenImagePipeline
    (test_cases/family_contract.py)."""

    family = Family(
        name="qwen_image t2i", runner_cls=QwenImageRunner, checkpoint="qwen_t2i_ckpt",
        config=lambda ckpt, **overrides: qwen_config_dict(T2I_CONFIG, ckpt, **overrides),
        requests=tuple(T2I_REQUESTS), outputs=("image",), modes=MODES, boundary=qwen_boundary,
        shapes=({"image": (3, 48, 80)}, {"image": (3, 32, 32)}), parity=qwen_parity, reference_package="diffusers")


@pytest.fixture(scope="module")
def family_reference(t2i_reference: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The contract's reference outputs: the cold `offload.mode: none` runs (family_contract.py)."""
    return [{"image": image} for image in t2i_reference]


def test_t2i_warmup_without_it_same_seed_same_image_and_cfg_acts(qwen_t2i_ckpt: Path, tmp_path: Path,
                                                                  t2i_reference: list[torch.Tensor]) -> None:
    """The guidance scale changes the image (CFG is not a no-op), and a fresh runner repeats it."""
    again = serve(make(QwenImageRunner, T2I_CONFIG, qwen_t2i_ckpt), T2I_REQUESTS[:1], tmp_path, "again")
    assert torch.equal(again[0], t2i_reference[0])
    other = serve(make(QwenImageRunner, T2I_CONFIG, qwen_t2i_ckpt, sample_guide_scale=1.5), T2I_REQUESTS[:1],
                  tmp_path, "cfg")
    assert (other[0] - t2i_reference[0]).abs().max() > 1e-3


def test_t2i_fp8_streaming_is_the_same_with_and_without_warmup(qwen_t2i_ckpt: Path, tmp_path: Path,
                                                               t2i_reference: list[torch.Tensor]) -> None:
    fp8 = {"offload": {"mode": "block", "weight_dtype": "fp8_e4m3"}}
    cold = serve(make(QwenImageRunner, T2I_CONFIG, qwen_t2i_ckpt, **fp8), T2I_REQUESTS, tmp_path, "cold")
    warm = serve(make(QwenImageRunner, T2I_CONFIG, qwen_t2i_ckpt, warmup=True, **fp8), T2I_REQUESTS, tmp_path, "warm")
    for a, b, ref in zip(cold, warm, t2i_reference):
        assert torch.equal(a, b)
        assert not torch.equal(a, ref) and (a - ref).abs().max() < 0.5  # fp8 weights: close, not equal


# ---- image editing -------------------------------------------------------------------------------
def test_edit_warmup_covers_one_and_two_references(qwen_edit_ckpt: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Warmup runs both sequence lengths an edit produces at each shape (1 and 2 references);
    requests with 1 and 2 references then run kernels of lengths warmup saw."""
    seen: list[tuple[str, int]] = []
    phase = {"now": "warmup"}
    real = QwenImageTransformer2D.forward

    def spy(self: QwenImageTransformer2D, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((phase["now"], hidden.shape[1]))
        return real(self, hidden, *args, **kwargs)

    monkeypatch.setattr(QwenImageTransformer2D, "forward", spy)
    runner = make(QwenImageEditRunner, EDIT_CONFIG, qwen_edit_ckpt, warmup=True)
    warm = {n for p, n in seen if p == "warmup"}
    (h1, w1, _), (h2, w2, _) = runner.warmup_shapes()
    # target tokens + per reference a grey image of the output's size at the VAE area (64x64 -> 4x4 patches etc.)
    assert len(warm) == 4, sorted(warm)
    phase["now"] = "request"
    grey = tmp_path / "grey.png"
    Image.new("RGB", (w2, h2), (128, 128, 128)).save(grey)
    for refs in ([grey], [grey, grey]):
        runner.run_pipeline(RequestConfig(prompt="x", image_path=str(refs[0]),
                                          extra_image_paths=[str(p) for p in refs[1:]] or None), 0)
    assert {n for p, n in seen if p == "request"} <= warm


def test_edit_token_count_before_the_encoders_is_the_transformers(qwen_edit_ckpt: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`sequence_tokens` (Ulysses' check at submission and before a parallel launch's first request)
    reads only the references' headers: it equals the tokens the transformer then gets, for references
    of three aspect ratios, and for warmup's grey references."""
    seen: list[int] = []
    real = QwenImageTransformer2D.forward

    def spy(self: QwenImageTransformer2D, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(hidden.shape[1])
        return real(self, hidden, *args, **kwargs)

    monkeypatch.setattr(QwenImageTransformer2D, "forward", spy)
    runner = make(QwenImageEditRunner, EDIT_CONFIG, qwen_edit_ckpt, infer_steps=2)
    stage = runner.pipeline.denoise[0]
    a, b = reference_images(tmp_path)
    wide = tmp_path / "wide.png"
    Image.new("RGB", (96, 32), (200, 30, 30)).save(wide)
    counts = []
    for refs in ([a], [a, b], [wide], [b, wide]):
        request = RequestConfig(prompt="x", image_path=str(refs[0]), extra_image_paths=[str(r) for r in refs[1:]] or None)
        expected = runner.sequence_tokens(stage, runner.resolve_request(request))
        seen.clear()
        runner.run_pipeline(request, 0)
        assert set(seen) == {expected}, (refs, seen, expected)
        counts.append(expected)
    assert counts[2] != counts[0] and len(set(counts)) == 4, counts  # the references change the count
    for shape in runner.warmup_shapes():
        for info in runner.warmup_infos(shape):
            expected = runner.sequence_tokens(stage, info)
            seen.clear()
            req = RequestState(info)  # as run_warmup makes it
            runner.run_encoders(req)
            runner.run_denoise(req, warmup=True)
            runner.reset_request_state()
            assert set(seen) == {expected}, (shape, seen, expected)


def test_edit_two_references_cli_png_and_warmup_bit_identical(qwen_edit_ckpt: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    a, b = reference_images(tmp_path)
    config = write_config(tmp_path / "c.json", qwen_config_dict(EDIT_CONFIG, qwen_edit_ckpt))
    outs = []
    for warm in ([], ["--warmup"]):
        png = tmp_path / f"out{len(warm)}.png"
        rc, err = _cli(capsys, "--config_json", config, "--prompt", "make it blue", "--image_path", a,
                       "--extra_image_paths", b, "--save_result_path", png, "--seed", 3, *warm)
        assert rc == 0, err
        with Image.open(png) as img:
            # area 64x64 with the last reference's aspect (64x36): calculate_dimensions -> 96 x 64 (w x h)
            assert img.size == (96, 64)
            outs.append(img.tobytes())
        sidecar = json.loads(png.with_suffix(".json").read_text())
        assert sidecar["extra_image_paths"] == [str(b)] and sidecar["image_path"] == str(a)
    assert outs[0] == outs[1]


def test_t2i_cli_writes_png_of_the_configured_size(qwen_t2i_ckpt: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "c.json", qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt))
    png = tmp_path / "o.png"
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "a fox", "--save_result_path", png, "--warmup")
    assert rc == 0, err
    with Image.open(png) as img:
        assert img.size == (80, 48) and img.mode == "RGB"


@pytest.mark.parametrize("case, flags, field", [
    ("multi-frame", ["--target_video_length", "5"], "target_video_length"),
    ("off-grid height", ["--target_height", "40"], "target_height"),
    ("off-grid width", ["--target_width", "72"], "target_width"),
    ("t2i with an image", ["--image_path", "IMAGE"], "image_path"),
    ("mp4 result", ["--save_result_path", "OUT.mp4"], "save_result_path"),
])
def test_t2i_input_errors_exit_2_naming_the_field(qwen_t2i_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  case: str, flags: list[str], field: str) -> None:
    a, _ = reference_images(tmp_path)
    config = write_config(tmp_path / "c.json", qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt))
    flags = [str(a) if f == "IMAGE" else str(tmp_path / "o.mp4") if f == "OUT.mp4" else f for f in flags]
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "x", *flags)
    assert rc == 2, err
    assert f"`{field}`" in err and "Traceback" not in err


@pytest.mark.parametrize("case, field", [
    ("no image", "image_path"), ("missing image", "image_path"), ("unreadable image", "image_path"),
    ("unreadable second reference", "extra_image_paths[0]"), ("too many references", "extra_image_paths"),
    ("too wide a last reference", "extra_image_paths[0]"), ("too small an area", "target_height"),
])
def test_edit_input_errors_exit_2_naming_the_field(qwen_edit_ckpt: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str], case: str, field: str) -> None:
    a, b = reference_images(tmp_path)
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    wide = tmp_path / "wide.png"
    Image.new("RGB", (4000, 16)).save(wide)  # over the area 64x64: an output 0 pixels high
    flags = {"no image": [], "missing image": ["--image_path", tmp_path / "nope.png"],
             "unreadable image": ["--image_path", junk],
             "unreadable second reference": ["--image_path", a, "--extra_image_paths", junk],
             "too many references": ["--image_path", a, "--extra_image_paths", b, b, b],
             "too wide a last reference": ["--image_path", a, "--extra_image_paths", wide],
             "too small an area": ["--image_path", a, "--target_height", 16, "--target_width", 16]}[case]
    config = write_config(tmp_path / "c.json", qwen_config_dict(EDIT_CONFIG, qwen_edit_ckpt))
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "x", *flags)
    assert rc == 2, err
    assert f"`{field}`" in err and "Traceback" not in err


def test_task_and_checkpoint_kind_must_match(qwen_t2i_ckpt: Path, qwen_edit_ckpt: Path) -> None:
    from runnerkit.weights import CheckpointError

    with pytest.raises(CheckpointError, match="use --task i2i"):
        QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_edit_ckpt)))
    with pytest.raises(CheckpointError, match="use --task t2i"):
        QwenImageEditRunner(load_runner_config(None, qwen_config_dict(EDIT_CONFIG, qwen_t2i_ckpt)))


EDIT_MODES = ("model", "block_cpu", "phase_disk_pread", "block_disk_lazy")


@pytest.fixture(scope="module")
def edit_reference(qwen_edit_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[RequestConfig],
                                                                                             list[torch.Tensor]]:
    folder = tmp_path_factory.mktemp("edit_ref")
    a, b = reference_images(folder)
    requests = [RequestConfig(prompt="make it blue", image_path=str(a), extra_image_paths=[str(b)], seed=3),
                RequestConfig(prompt="add a hat", image_path=str(b), seed=4)]
    return requests, serve(make(QwenImageEditRunner, EDIT_CONFIG, qwen_edit_ckpt), requests, folder, "none")


@pytest.mark.parametrize("mode", EDIT_MODES)
def test_edit_mode_with_warmup_is_bit_identical_to_none(qwen_edit_ckpt: Path, tmp_path: Path, mode: str,
                                                        edit_reference: tuple[list[RequestConfig], list[torch.Tensor]]) -> None:
    requests, reference = edit_reference
    got = serve(make(QwenImageEditRunner, EDIT_CONFIG, qwen_edit_ckpt, warmup=True, **MODES[mode]), requests, tmp_path,
                mode)
    assert [tuple(x.shape) for x in got] == [(3, 64, 96), (3, 64, 96)]
    for a, b in zip(got, reference):
        assert torch.equal(a, b), f"{mode}: max abs diff {(a - b).abs().max().item()}"


def test_diffusers_layout_gives_the_runnerkit_layouts_image(qwen_diffusers_ckpts: dict[str, Path], tmp_path: Path,
                                                            t2i_reference: list[torch.Tensor]) -> None:
    """Both layouts of one synthetic checkpoint hold the same network: the same image, bit for bit."""
    got = serve(make(QwenImageRunner, T2I_CONFIG, qwen_diffusers_ckpts["t2i"]), T2I_REQUESTS, tmp_path, "diffusers")
    for a, b in zip(got, t2i_reference):
        assert torch.equal(a, b)


def test_synth_tool_writes_both_layouts(tmp_path: Path) -> None:
    from runnerkit.tools.synth_checkpoint import main as synth_main

    for layout in ("runnerkit", "diffusers"):
        out = tmp_path / layout
        assert synth_main(["--config", str(EDIT_CONFIG), "--out", str(out), "--dtype", "fp32", "--layout", layout]) == 0
        marker = "runnerkit.json" if layout == "runnerkit" else "model_index.json"
        assert (out / marker).is_file() and (out / "processor").is_dir() and (out / "text_encoder").is_dir()
    index = json.loads((tmp_path / "diffusers" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"


@pytest.mark.parametrize("damage, named", [
    ("truncated transformer", "transformer"),
    ("no text encoder", "text_encoder"),
    ("transformer tensor missing", "transformer_blocks.1.attn.to_q.weight"),
    ("no tokenizer.json", "tokenizer"),
])
def test_damaged_checkpoint_exits_2_naming_what(qwen_t2i_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                damage: str, named: str) -> None:
    import shutil

    from safetensors.torch import save_file

    ckpt = tmp_path / "ck"
    shutil.copytree(qwen_t2i_ckpt, ckpt)
    weights = ckpt / "transformer" / "model.safetensors"
    if damage == "truncated transformer":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "no text encoder":
        shutil.rmtree(ckpt / "text_encoder")
    elif damage == "no tokenizer.json":
        (ckpt / "tokenizer" / "tokenizer.json").unlink()
    else:
        sd = load_file(str(weights))
        del sd[named]
        save_file(sd, str(weights))
    config = write_config(tmp_path / "c.json", qwen_config_dict(T2I_CONFIG, ckpt))
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "x", "--save_result_path", tmp_path / "o.png")
    assert rc == 2, err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "o.png").exists()


def test_edit_variant_takes_one_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen-Image-Edit checkpoint (one reference, the VL encoder sees the VAE-sized image) serves
    one reference and refuses a second, naming the field."""
    data = json.loads(EDIT_CONFIG.read_text())
    data["model"]["edit"] = {"variant": "edit", "vl_image_area": 64 * 64, "vae_image_area": 64 * 64, "max_images": 1}
    data["model_path"] = str(tmp_path / "ck")
    config = write_config(tmp_path / "c.json", data)
    a, b = reference_images(tmp_path)
    png = tmp_path / "o.png"
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "x", "--image_path", a, "--save_result_path", png,
                   "--warmup")
    assert rc == 0, err
    with Image.open(png) as img:
        assert img.size == (64, 64)  # the area 64x64 with the 40x56 reference's aspect: 64 x 64 on the 32 grid
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "x", "--image_path", a, "--extra_image_paths", b,
                   "--save_result_path", tmp_path / "o2.png")
    assert rc == 2 and "`extra_image_paths`" in err and "at most 1" in err, err
    assert not (tmp_path / "o2.png").exists()


@pytest.mark.parametrize("setting, field", [({"sample_shift": 3.0}, "sample_shift"), ({"fps": 16}, "fps"),
                                            ({"infer_steps": 1}, "infer_steps")])
def test_settings_that_do_nothing_or_cannot_run_are_refused_before_loading(
        qwen_t2i_ckpt: Path, setting: dict[str, Any], field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loads = []
    monkeypatch.setattr(QwenImageRunner, "prepare_load", lambda self: loads.append(1))
    with pytest.raises(ValueError, match=f"`{field}`"):
        QwenImageRunner(load_runner_config(None, qwen_config_dict(T2I_CONFIG, qwen_t2i_ckpt, **setting)))
    assert loads == []
