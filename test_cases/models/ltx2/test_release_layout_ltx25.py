"""LTX-2.5 from Lightricks' per-component release layout (checkpoint_release25.py, release25_names.py).

- The synthetic release writer's file names and key sets: at release size (meta tensors, nothing drawn), the
  transformer file, the duration head file and the diffusion VAE file hold exactly the keys ltx-core expects
  (data/ltx2.5_release_keys.json.gz; the transformer file's connectors beside them, as the writer stores them).
- The tiny pipeline written in that layout and as a diffusers folder from the same seed: every network loads to
  the same tensors, the architecture reads back from the transformer file's metadata, and the tiny runner (t2av
  with the frames predicted, i2av) gives bit-identical outputs from either (the Gemma-4 text encoder from the packed
  file); streamed from the release files (Gemma-4 from the packed file's byte ranges, lazily built), the same.
- The reader finds files by content (renamed files still load) and refuses what it cannot place, naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.ltx2 import release25_names as names
from runnerkit.models.ltx2.arch25 import LTX25_22B_PIPELINE_ARCH, tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint import network_factory
from runnerkit.models.ltx2.checkpoint25 import LTX25Checkpoint, extra_factory, write_synthetic_ltx25
from runnerkit.models.ltx2.checkpoint_release25 import LTX25ReleaseCheckpoint, open_ltx25
from runnerkit.models.ltx2.checkpoint_release25_write import write_release_ltx25
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.weights import CheckpointError, build_on_meta
from test_cases.models.ltx2.test_release_keys_ltx25 import ltx25_keys

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
PROMPT = "a red fox runs through fresh snow, wind howls"
FILES = names.release_files(torch.float32)  # the `layouts` fixture writes float32: its files are named `-fp32`
NETWORKS = ("transformer", "connectors", "vae", "audio_vae", "vocoder", "latent_upsampler", "duration_head",
            "diffusion_decoder")


@pytest.fixture(autouse=True)
def _no_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny pipeline (seed 0, float32) as a diffusers folder and in the release layout."""
    root = tmp_path_factory.mktemp("layouts")
    write_synthetic_ltx25(tiny_ltx25_arch(), root / "diffusers", 0, torch.float32)
    write_release_ltx25(tiny_ltx25_arch(), root / "release", 0, torch.float32)
    return {"diffusers": root / "diffusers", "release": root / "release"}


def _open_release(root: Path, arch: Any = None) -> LTX25Checkpoint:
    return open_ltx25(root / FILES["transformer"], root / FILES["latent_upsampler"], root / FILES["text_encoder"],
                      arch=arch)


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in tensors.items()}


def test_release_size_files_hold_exactly_ltx_cores_keys() -> None:
    arch, keys = LTX25_22B_PIPELINE_ARCH, ltx25_keys()
    ours = {c: build_on_meta(network_factory(c, arch)).state_dict() for c in ("transformer", "connectors", "vae")}
    transformer = names.transformer_file(ours["transformer"], ours["connectors"], arch)
    connectors = {k for k in transformer if k.startswith(("model.diffusion_model.video_embeddings_connector.",
                                                          "model.diffusion_model.audio_embeddings_connector."))}
    assert _shapes({k: v for k, v in transformer.items() if k not in connectors}) == keys["transformer"]
    projection = names.projection_tensors(ours["connectors"])  # in the packed text-encoder file
    assert set(projection) == {f"text_embedding_projection.{m}_aggregate_embed.{p}" for m in ("video", "audio")
                               for p in ("weight", "bias")}
    assert len(connectors) + len(projection) == len(ours["connectors"])
    assert _shapes(names.duration_file(extra_factory("duration_head", arch).state_dict())) == keys["duration_head"]
    decoder = extra_factory("diffusion_decoder", arch).state_dict()
    assert _shapes(names.vae_file(ours["vae"], decoder, arch)) == keys["diffusion_vae"]


def test_the_release_files_are_named_with_the_dtype_they_hold(layouts: dict[str, Path]) -> None:
    """A float32 write names every file `-fp32` (not the bf16 release's `-bf16`), and each holds float32 tensors."""
    root = layouts["release"]
    written = {p.relative_to(root).as_posix() for p in root.rglob("*.safetensors")}
    assert written == set(FILES.values()) and all("-fp32" in n and "-bf16" not in n for n in written), written
    for name in written:  # the packed text encoder's tokenizer and sidecar files are uint8 byte tensors
        with safe_open(str(root / name), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == ({"F32", "U8"} if name == FILES["text_encoder"] else {"F32"}), name
    assert names.release_files(torch.bfloat16) == names.RELEASE_FILES
    with pytest.raises(ValueError, match=r"`dtype` torch.float8_e4m3fn has no release file name; allowed: "):
        write_release_ltx25(tiny_ltx25_arch(), root.parent / "fp8", 0, torch.float8_e4m3fn)
    assert not (root.parent / "fp8").exists()


def test_both_layouts_hold_the_same_networks(layouts: dict[str, Path]) -> None:
    """Every network's tensors equal bit for bit; the release's architecture reads back from its metadata."""
    diffusers, release = LTX25Checkpoint.open(layouts["diffusers"]), _open_release(layouts["release"])
    assert isinstance(release, LTX25ReleaseCheckpoint) and release.arch == diffusers.arch == tiny_ltx25_arch()
    for component in NETWORKS:
        a = diffusers.load(component, torch.float32).state_dict()
        b = release.load(component, torch.float32).state_dict()
        if component == "vae":  # the release VAE file has no convolutional decoder: LTX-2.5 never runs it
            assert set(a) - set(b) == {k for k in a if k.startswith("decoder.")} != set()
        else:
            assert set(a) == set(b), component
        assert all(torch.equal(a[k], b[k]) for k in b), component


def _config(tmp: Path, task: str, layouts: dict[str, Path], layout: str, offload: dict[str, Any] | None = None,
            **extra: Any) -> Path:
    """The tiny `task` config reading `layout` ("diffusers" or "release") of `layouts`, with `offload` and `extra`
    config keys, written to a file of its own under `tmp`."""
    data = json.loads((CONFIGS / f"ltx25_{task}_tiny.json").read_text())
    del data["synthetic_checkpoint"]
    data["device"] = "cpu"
    data |= extra
    if offload is not None:
        data["offload"] = offload
    if layout == "diffusers":
        data["model_path"] = str(layouts["diffusers"])
    else:
        root = layouts["release"]
        data |= {"model_path": str(root / FILES["transformer"]),
                 "upsampler_path": str(root / FILES["latent_upsampler"]),
                 "text_encoder_path": str(root / FILES["text_encoder"])}
    path = tmp / ("_".join([task, layout, *(f"{k}-{v}" for k, v in extra.items())]) + ".json")
    path.write_text(json.dumps(data))
    return path


def _run(config: Path, request: RequestConfig, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    runner = LTX25Runner(load_runner_config(config, {}))
    runner.init_modules()
    runner.run_pipeline(request.model_copy(update={"save_tensor_path": str(out / "out.safetensors"),
                                                   "save_result_path": str(out / "out.mp4")}))
    return load_file(out / "out.safetensors"), json.loads((out / "out.json").read_text())


@pytest.mark.parametrize("task", ["t2av", "i2av"])
def test_the_runner_from_the_release_equals_the_diffusers_folder(task: str, layouts: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    request = RequestConfig(prompt=PROMPT, seed=3)  # frames omitted: the duration head predicts them
    if task == "i2av":
        pytest.importorskip("av")
        from PIL import Image

        Image.new("RGB", (128, 64), (200, 60, 30)).save(tmp_path / "frame.png")
        request = request.model_copy(update={"image_path": str(tmp_path / "frame.png")})
    outputs = {}
    for layout in ("diffusers", "release"):
        (tmp_path / layout).mkdir()
        outputs[layout] = _run(_config(tmp_path, task, layouts, layout), request, tmp_path / layout)
    (a, side_a), (b, side_b) = outputs["diffusers"], outputs["release"]
    assert side_a["duration"]["predicted"] and side_a["duration"] == side_b["duration"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_streaming_from_the_release_files_equals_the_resident_run(layouts: dict[str, Path], tmp_path: Path) -> None:
    """Gemma-4 streamed from the packed file's byte ranges, the connectors from the transformer file and the packed
    file (their projections), the transformer from its file, built per request (`lazy_load`): the same video and
    audio as every module resident."""
    request = RequestConfig(prompt=PROMPT, seed=3)
    streamed = {"mode": "block", "storage": "disk", "lazy_load": True,
                "stream_modules": ["text_encoder", "connectors", "transformer"]}
    outputs = []
    for name, offload in (("resident", {"mode": "none"}), ("streamed", streamed)):
        (tmp_path / name).mkdir()
        config = _config(tmp_path, "t2av", layouts, "release", offload)
        outputs.append(_run(config.rename(tmp_path / f"{name}.json"), request, tmp_path / name))
    (a, side_a), (b, side_b) = outputs
    assert side_a["duration"] == side_b["duration"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_files_are_found_by_content_and_what_cannot_be_placed_is_refused(layouts: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    root = tmp_path / "release"
    shutil.copytree(layouts["release"], root)
    for key in ("video_vae", "audio_vae", "duration_head"):  # any names: the reader looks inside
        file = root / FILES[key]
        file.rename(file.with_name(f"renamed-{key}.safetensors"))
    assert _open_release(root).arch == tiny_ltx25_arch()
    shutil.copy(root / "vae" / "renamed-video_vae.safetensors", root / "vae" / "copy.safetensors")
    with pytest.raises(CheckpointError, match=r"2 files in .*vae hold the diffusion VAE"):
        _open_release(root)
    (root / "vae" / "copy.safetensors").unlink()
    (root / "model_patches" / "renamed-duration_head.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"0 files in .*model_patches hold the duration head"):
        _open_release(root)
    moved = tmp_path / "elsewhere.safetensors"
    shutil.copy(root / FILES["transformer"], moved)
    with pytest.raises(CheckpointError, match="must be the transformer file in the release's `diffusion_models/`"):
        open_ltx25(moved, root / FILES["latent_upsampler"], root / FILES["text_encoder"])
    with pytest.raises(CheckpointError, match="`upsampler_path` is required"):
        open_ltx25(root / FILES["transformer"])
