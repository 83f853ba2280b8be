"""Every shipped LTX-2 / LTX-2.5 config validates and builds a runner, and its default shape is a warmup
shape of its flavour; the LTX-2.3 22B configs name the release files and are the 22B flavour once the release's
architecture is read; a real config (no `model`) never falls back to the tiny architecture.

The release files are not here: the configs' relative paths are created empty in a scratch working
folder (the runner checks that they exist when it is built), and `LTX2Checkpoint.open` is replaced
by a stand-in that records the paths it is given and returns the LTX-2.3 architecture (what
release_config.py maps the release's metadata to: test_release_config.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.ltx2 import checkpoint, runner25
from runnerkit.models.ltx2.arch import LTX23_22B_ARCH, tiny_pipeline_arch
from runnerkit.models.ltx2.arch25 import LTX25_22B_PIPELINE_ARCH
from runnerkit.models.ltx2.runner import LTX2Runner
from runnerkit.models.ltx2.runner25 import LTX25Runner
from test_cases.conftest import REPO

CONFIGS = sorted((REPO / "configs" / "ltx2").glob("*.json"))
REAL = [p for p in CONFIGS if "model" not in json.loads(p.read_text())]


def release_files_in(folder: Path, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty stand-ins of a real config's side files (Gemma folder, upsampler file), the working folder there."""
    data = json.loads(config.read_text())
    if "text_encoder_path" in data:
        text_encoder = folder / data["text_encoder_path"]
        if text_encoder.suffix == ".safetensors":  # LTX-2.5's packed Gemma-4 file
            text_encoder.parent.mkdir(parents=True)
            text_encoder.touch()
        else:
            text_encoder.mkdir(parents=True)
        (folder / data["upsampler_path"]).parent.mkdir(parents=True, exist_ok=True)
        (folder / data["upsampler_path"]).touch()
    monkeypatch.chdir(folder)


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_ltx2_config_validates_and_builds_a_runner(config: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    release_files_in(tmp_path, config, monkeypatch)
    ltx25 = json.loads(config.read_text())["model_cls"] == "ltx2.5"
    runner = (LTX25Runner if ltx25 else LTX2Runner)(load_runner_config(config, {"device": "cpu"}))
    cfg = runner.config
    runner.validate_shape(cfg.target_height, cfg.target_width, cfg.target_video_length)
    assert (cfg.enable_cfg, cfg.infer_steps, cfg.fps) == (False, 8, 24)
    if config not in REAL:  # synthetic: the configured (tiny) architecture, nothing written to tell it
        flavour = "debug-2.5" if ltx25 else "debug"
        assert runner.flavour() == flavour
        # LTX-2.5 leaves the frames to the duration head: the default shape holds the bounds' largest count
        assert runner.request_shape(RequestConfig(prompt="p")) in runner.WARMUP_SHAPES[flavour]


REAL23 = [p for p in REAL if p.stem.startswith("ltx23_")]


def test_the_real_size_configs_are_the_releases() -> None:
    assert {p.stem for p in REAL} == {"ltx23_t2av_22b_distilled", "ltx23_i2av_22b_distilled",
                                      "ltx25_t2av_22b_distilled", "ltx25_i2av_22b_distilled"}


@pytest.mark.parametrize("config", REAL23, ids=[p.stem for p in REAL23])
def test_the_22b_configs_name_the_release_and_its_flavour(config: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[tuple[Any, ...]] = []

    def release(path: Any, upsampler: Any = None, text_encoder: Any = None, arch: Any = None) -> Any:
        opened.append((Path(path).name, Path(upsampler).name, Path(text_encoder).name, arch))
        return SimpleNamespace(arch=LTX23_22B_ARCH)

    monkeypatch.setattr(checkpoint.LTX2Checkpoint, "open", staticmethod(release))
    release_files_in(tmp_path, config, monkeypatch)
    runner = LTX2Runner(load_runner_config(config, {"device": "cpu"}))
    assert runner.arch_override is None  # no tiny architecture for a real checkpoint
    assert runner.flavour() == "22B"
    assert opened == [("ltx-2.3-22b-distilled.safetensors", "ltx-2.3-spatial-upscaler-x2-1.0.safetensors",
                       "gemma-3-12b-it", None)]  # the release's files, its architecture read from the file
    cfg = runner.config
    assert (cfg.target_height, cfg.target_width, cfg.target_video_length) in runner.WARMUP_SHAPES["22B"]
    assert (cfg.dtype, cfg.offload.mode, cfg.warmup) == ("bfloat16", "auto", True)  # no offload key: the default plan


REAL25 = [p for p in REAL if p.stem.startswith("ltx25_")]


@pytest.mark.parametrize("config", REAL25, ids=[p.stem for p in REAL25])
def test_the_ltx25_22b_configs_name_the_release_files(config: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The transformer file with its companion paths reaches `open_ltx25` (no architecture: the
    file's); the 22B-2.5 flavour; the frames left to the duration head, at most 473: a warmup shape."""
    opened: list[tuple[Any, ...]] = []

    def release(path: Any, upsampler: Any = None, text_encoder: Any = None, arch: Any = None,
                video_decoder: str = "") -> Any:
        opened.append((Path(path).as_posix(), Path(upsampler).name, Path(text_encoder).name,
                       arch, video_decoder))
        return SimpleNamespace(arch=LTX25_22B_PIPELINE_ARCH)

    monkeypatch.setattr(runner25, "open_ltx25", release)
    release_files_in(tmp_path, config, monkeypatch)
    model_path = json.loads(config.read_text())["model_path"]
    (tmp_path / model_path).parent.mkdir(parents=True)
    (tmp_path / model_path).touch()
    runner = LTX25Runner(load_runner_config(config, {"device": "cpu"}))
    assert runner.flavour() == "22B-2.5"
    assert opened == [("models/LTX-2.5/diffusion_models/ltx-2.5-22b-distilled-transformer-bf16.safetensors",
                       "ltx-2.5-latent-spatial-upscaler-x2-bf16-1.0.safetensors",
                       "gemma4-12b-with-proj-ltx-2.5-bf16.safetensors", None,
                       "diffusion")]  # the release's main pipelines decode with the diffusion decoder
    cfg = runner.config
    assert cfg.target_video_length is None and (cfg.dtype, cfg.offload.mode, cfg.warmup) == ("bfloat16", "auto", True)
    assert runner.request_shape(RequestConfig(prompt="p")) == (512, 768, 473) == runner.WARMUP_SHAPES["22B-2.5"][1]


def test_a_synthetic_config_without_model_is_the_tiny_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a synthetic config may omit `model` to mean the tiny architecture, also when it writes its
    checkpoint to its own `model_path` (the tool writing for a config that names another checkpoint takes
    that checkpoint's: test_synth_checkpoint_configs.py)."""
    from runnerkit.models.ltx2 import runner as runner_module

    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    data = json.loads((REPO / "configs/ltx2/ltx2_t2av_tiny.json").read_text())
    del data["model"]
    config = load_runner_config(None, {**data, "device": "cpu", "model_path": str(tmp_path / "ckpt")})
    assert LTX2Runner(config).arch_override == tiny_pipeline_arch("2.3")
    written: list[Any] = []
    monkeypatch.setattr(runner_module, "write_synthetic_ltx2", lambda arch, *args, **kwargs: written.append(arch))
    LTX2Runner.write_synthetic_checkpoint(config, tmp_path / "ckpt", 0, None, "diffusers")  # type: ignore[arg-type]
    assert written == [tiny_pipeline_arch("2.3")]


def test_the_launch_script_takes_the_single_file_paths(tmp_path: Path) -> None:
    """--model_path, --upsampler_path and --text_encoder_path override the config's (scripts/ltx2/run_ltx2.sh
    passes them from its environment)."""
    from runnerkit.infer import build_parser, parse_inputs

    args = build_parser().parse_args([
        "--config_json", str(REPO / "configs/ltx2/ltx23_i2av_22b_distilled.json"), "--device", "cpu",
        "--model_path", "/m/x.safetensors", "--upsampler_path", "/m/up.safetensors", "--text_encoder_path", "/m/gemma",
        "--prompt", "a fox", "--image_path", str(REPO / "assets/examples/first_frame.png")])
    config, requests = parse_inputs(args)
    assert (config.model_path, config.upsampler_path, config.text_encoder_path, config.task) == (
        "/m/x.safetensors", "/m/up.safetensors", "/m/gemma", "i2av")
    assert [r.prompt for r in requests] == ["a fox"]
