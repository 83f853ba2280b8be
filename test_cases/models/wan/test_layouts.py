"""Wan2.1 checkpoint layouts (runnerkit / original / diffusers): the synthetic writer, layout
detection, sharding, and strict loading against the config's `model` override.

Synthetic weights depend only on (tensor name, seed), so every layout written by
`runnerkit.tools.synth_checkpoint` holds the same network and must give bit-identical outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit import synthetic
from safetensors import safe_open
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.wan import checkpoint as ckpt_mod
from runnerkit.models.wan.checkpoint import LAYOUTS, WanCheckpoint, detect_layout
from runnerkit.registry import get_runner_cls
from runnerkit.runners.base import error_phase
from runnerkit.tools import synth_checkpoint
from runnerkit.weights import CheckpointError
from test_cases.conftest import TINY_CONFIG, tiny_config_dict

# A small non-square request (fast on the CPU): [3, 5, 32, 48].
REQUEST = {"prompt": "a lighthouse in a storm", "seed": 11, "target_height": 32, "target_width": 48,
           "target_video_length": 5}
# Where each layout keeps its transformer safetensors, and their file stem.
TRANSFORMER_FILES = {"runnerkit": ("transformer", "model"), "original": (".", "diffusion_pytorch_model"),
                     "diffusers": ("transformer", "diffusion_pytorch_model")}


def _synth(out: Path, layout: str) -> Path:
    rc = synth_checkpoint.main(["--config", str(TINY_CONFIG), "--out", str(out), "--layout", layout, "--dtype", "fp32"])
    assert rc == 0
    return out


def _config_overrides(layout: str) -> dict[str, Any]:
    # The original Wan layout records only the transformer's architecture (its T5 and VAE are fixed
    # in the reference), so the tiny text encoder / VAE come from the config's `model`; the other
    # two layouts describe every component and are read with no override at all.
    return {} if layout == "original" else {"model": None}


def _generate(ckpt: Path, out: Path, **overrides: Any) -> tuple[torch.Tensor, Any]:
    """Build a runner on `ckpt` through the registry, serve REQUEST, return (video, runner)."""
    config = load_runner_config(None, tiny_config_dict(ckpt, **overrides))
    runner = get_runner_cls("wan2.1")(config)
    runner.init_modules()
    runner.run_pipeline(RequestConfig(**REQUEST, save_tensor_path=str(out)), 0)
    video = load_file(str(out))["video"]
    assert video.dtype == torch.float32 and tuple(video.shape) == (3, 5, 32, 48)
    assert video.min() >= -1 and video.max() <= 1 and video.std() > 1e-3
    return video, runner


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {layout: _synth(root / layout, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def reference(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """REQUEST on the session checkpoint (written by `write_synthetic` directly, runnerkit layout)."""
    video, _ = _generate(tiny_ckpt, tmp_path_factory.mktemp("ref") / "ref.safetensors")
    return video


# ---- the three layouts ---------------------------------------------------------------------------
def test_synthetic_writer_produces_each_layout(layouts: dict[str, Path]) -> None:
    assert (layouts["runnerkit"] / "runnerkit.json").is_file()
    assert (layouts["original"] / "config.json").is_file()
    assert (layouts["original"] / ckpt_mod.ORIGINAL_T5).is_file()
    assert (layouts["original"] / ckpt_mod.ORIGINAL_VAE).is_file()
    assert (layouts["diffusers"] / "model_index.json").is_file()
    for sub in ("transformer", "text_encoder", "vae", "tokenizer"):
        assert (layouts["diffusers"] / sub).is_dir()
    for layout, path in layouts.items():
        assert detect_layout(path) == layout
        assert not path.with_name(path.name + ".partial").exists()  # written atomically


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_give_bit_identical_outputs(layouts: dict[str, Path], reference: torch.Tensor, tmp_path: Path,
                                            layout: str) -> None:
    video, runner = _generate(layouts[layout], tmp_path / f"{layout}.safetensors", **_config_overrides(layout))
    assert runner.checkpoint.layout == layout
    assert runner.flavour() == "debug"
    tiny_model = json.loads(TINY_CONFIG.read_text())["model"]
    resolved = runner.config.model
    for component, values in tiny_model.items():  # the architecture read back is the tiny one
        for key, value in values.items():
            assert resolved[component][key] == value, f"{layout}: model.{component}.{key}"
    assert torch.equal(video, reference), f"{layout} layout output differs from the runnerkit-layout reference"


def test_original_layout_without_model_override_fails_strictly(layouts: dict[str, Path]) -> None:
    # Without `model`, the original layout's text encoder gets the reference UMT5-XXL architecture,
    # which the tiny .pth cannot satisfy: strict loading must say so, not load half a network.
    config = load_runner_config(None, tiny_config_dict(layouts["original"], model=None))
    runner = get_runner_cls("wan2.1")(config)
    with pytest.raises(CheckpointError, match="text_encoder") as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "load"


# ---- layout detection ------------------------------------------------------------------------------
def _assert_lists_layouts(message: str) -> None:
    for needle in ("runnerkit.json", "runnerkit layout", "model_index.json", "diffusers layout",
                   "config.json + diffusion_pytorch_model*.safetensors", "original Wan layout"):
        assert needle in message, f"{needle!r} not in {message!r}"


def test_empty_folder_is_not_a_checkpoint(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError) as exc:
        detect_layout(empty)
    assert str(empty) in str(exc.value)
    _assert_lists_layouts(str(exc.value))


def test_folder_of_random_files_is_not_a_checkpoint(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    (junk / "sub").mkdir(parents=True)
    (junk / "notes.txt").write_text("hello")
    (junk / "weights.bin").write_bytes(torch.randn(16).numpy().tobytes())
    (junk / "config.json").write_text(json.dumps({"dim": 64}))  # a config.json without transformer weights
    (junk / "sub" / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError) as exc:
        WanCheckpoint.open(junk)
    _assert_lists_layouts(str(exc.value))


def test_runner_on_unrecognised_folder_fails_at_load(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "readme.md").write_text("not weights")
    config = load_runner_config(None, tiny_config_dict(tmp_path / "ckpt"))
    runner = get_runner_cls("wan2.1")(config)
    with pytest.raises(CheckpointError) as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "load"
    _assert_lists_layouts(str(exc.value))


def test_missing_folder_names_synthetic_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist") as exc:
        detect_layout(tmp_path / "absent")
    assert "synthetic_checkpoint" in str(exc.value)


# ---- sharding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_synthetic_writer_shards_and_shards_load(monkeypatch: pytest.MonkeyPatch, reference: torch.Tensor,
                                                  tmp_path: Path, layout: str) -> None:
    shard_bytes = 150_000  # the tiny transformer is ~600 kB in float32
    monkeypatch.setattr(synthetic, "SHARD_BYTES", shard_bytes)
    path = _synth(tmp_path / layout, layout)
    sub, stem = TRANSFORMER_FILES[layout]
    folder = path / sub
    shards = sorted(folder.glob(f"{stem}-*-of-*.safetensors"))
    assert len(shards) >= 3, [p.name for p in folder.iterdir()]
    assert not (folder / f"{stem}.safetensors").exists()
    n = len(shards)
    assert [p.name for p in shards] == [f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    index = json.loads((folder / f"{stem}.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    assert set(weight_map.values()) == {p.name for p in shards}
    total = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            keys = list(f.keys())
            sizes = [f.get_slice(k).get_shape() for k in keys]
            nbytes = sum(torch.Size(s).numel() * 4 for s in sizes)  # fp32 checkpoint
        assert {k for k, v in weight_map.items() if v == shard.name} == set(keys)
        assert nbytes <= shard_bytes or len(keys) == 1, f"{shard.name}: {nbytes} bytes in {len(keys)} tensors"
        total += nbytes
    assert index["metadata"]["total_size"] == total

    video, runner = _generate(path, tmp_path / "out.safetensors", **_config_overrides(layout))
    assert len(runner.checkpoint.transformer_files()) == n
    assert torch.equal(video, reference)


# ---- config `model` vs the checkpoint; a checkpoint whose config does not match its weights --------------
def _claiming(tiny_ckpt: Path, tmp_path: Path, **transformer: Any) -> Path:
    """A copy of the tiny checkpoint whose runnerkit.json claims other transformer sizes than its weights."""
    ckpt = tmp_path / "claiming"
    shutil.copytree(tiny_ckpt, ckpt)
    meta = json.loads((ckpt / "runnerkit.json").read_text())
    meta["arch"]["transformer"].update(transformer)
    (ckpt / "runnerkit.json").write_text(json.dumps(meta))
    return ckpt


def test_a_model_that_disagrees_with_the_checkpoint_is_a_load_error(tiny_ckpt: Path) -> None:
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, model={"transformer": {"num_layers": 3}}))
    runner = get_runner_cls("wan2.1")(config)
    with pytest.raises(CheckpointError) as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "load"
    assert str(exc.value).startswith(f"the config's `model` disagrees with the architecture in {tiny_ckpt}/runnerkit."
                                     "json:\n  `model.transformer.num_layers` 3 (the checkpoint's: 2)\n")
    assert runner.transformer is None  # nothing half-loaded is kept


def test_a_config_file_claiming_more_layers_names_missing_keys(tiny_ckpt: Path, tmp_path: Path) -> None:
    # num_layers 3 against 2 layers of weights: block 2 has no weights.
    ckpt = _claiming(tiny_ckpt, tmp_path, num_layers=3)
    runner = get_runner_cls("wan2.1")(load_runner_config(None, tiny_config_dict(ckpt, model=None)))
    with pytest.raises(CheckpointError) as exc:
        runner.init_modules()
    msg = str(exc.value)
    assert error_phase(exc.value) == "load"
    assert "transformer" in msg
    assert "missing keys (27)" in msg  # every tensor of block 2 (27 per block)
    assert "blocks.2.cross_attn.k.bias" in msg and "blocks.2.ffn.0.weight" in msg
    listed = msg.split("missing keys (27): ")[1].split(";")[0].split(", ")
    assert all(k.startswith("blocks.2.") for k in listed if not k.startswith("...")), listed
    assert "unexpected keys (0)" in msg
    assert runner.transformer is None  # nothing half-loaded is kept


def test_a_config_file_claiming_another_width_names_shape_mismatch(tiny_ckpt: Path, tmp_path: Path) -> None:
    ckpt = _claiming(tiny_ckpt, tmp_path, ffn_dim=96)
    runner = get_runner_cls("wan2.1")(load_runner_config(None, tiny_config_dict(ckpt, model=None)))
    with pytest.raises(CheckpointError, match="shape mismatch") as exc:
        runner.init_modules()
    assert "blocks.0.ffn.0.weight" in str(exc.value)
    assert "(128, 64)" in str(exc.value) and "(96, 64)" in str(exc.value)


def test_model_override_unknown_component(tiny_ckpt: Path) -> None:
    config = load_runner_config(None, tiny_config_dict(tiny_ckpt, model={"unet": {"dim": 8}}))
    with pytest.raises(ValueError) as exc:  # refused when the runner is built, before anything loads
        get_runner_cls("wan2.1")(config)
    for needle in ("model.unet", "text_encoder", "transformer", "vae"):
        assert needle in str(exc.value)
