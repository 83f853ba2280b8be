"""The LTX-2.5 release-layout GPU run of bench/DEVICE_RUN.md section 20, dry-run on the CPU at tiny sizes: the same
synthetic-writer flags (`--layout release --fp8_blocks scaled`) and the same launch-script flags (the release's
three paths, `--warmup`, `--requests bench/ltx25_requests.jsonl`), only the config the tiny one and the generator
device the CPU. Every request's frames are predicted (the config and the requests give none; within the tiny
bounds); the real-size
config gets the release's architecture and Gemma-4 12B's size from the writer.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import load_runner_config
from runnerkit.infer import main as infer_main
from runnerkit.models.ltx2.arch25 import LTX25_22B_PIPELINE_ARCH, tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint_release25_write import arch_to_write, transformer_path
from runnerkit.models.ltx2.release25_names import RELEASE_FILES, release_files
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.tools import synth_checkpoint
from test_cases.conftest import REPO

REQUESTS = REPO / "bench" / "ltx25_requests.jsonl"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)
    yield
    logger.remove()  # the launch script and the tool bind loguru to the stderr of their call: rebind
    logger.add(lambda message: sys.stderr.write(message), level="DEBUG")


def test_the_writer_gives_a_real_size_config_the_release() -> None:
    config = load_runner_config(REPO / "configs/ltx2/ltx25_t2av_22b_distilled.json", {})
    assert arch_to_write(config, tiny_ltx25_arch(), Path("/tmp/elsewhere")) == (LTX25_22B_PIPELINE_ARCH, "release")
    unnamed = load_runner_config(None, {**config.model_dump(exclude_unset=True), "model_path": "models/x.safetensors"})
    with pytest.raises(ValueError, match="`model` is omitted and `model_path` models/x.safetensors does not exist"):
        arch_to_write(unnamed, tiny_ltx25_arch(), Path("/tmp/elsewhere"))


def test_the_device_run_dry_at_tiny_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = json.loads((REPO / "configs/ltx2/ltx25_t2av_tiny.json").read_text())
    del data["synthetic_checkpoint"]
    (tmp_path / "tiny.json").write_text(json.dumps({**data, "device": "cpu"}))
    root = tmp_path / "ltx25"
    assert synth_checkpoint.main(["--config", "tiny.json", "--out", str(root), "--layout", "release",
                                  "--fp8_blocks", "scaled", "--dtype", "fp32", "--generator_device", "cpu"]) == 0
    transformer = root / transformer_path("scaled", torch.float32)
    assert transformer.name == "ltx-2.5-22b-distilled-transformer-fp8.safetensors"
    shutil.copy(REQUESTS, tmp_path / "requests.jsonl")
    rc = infer_main(["--config_json", "tiny.json", "--model_path", str(transformer),
                     "--upsampler_path", str(root / release_files(torch.float32)["latent_upsampler"]),
                     "--text_encoder_path", str(root / release_files(torch.float32)["text_encoder"]), "--warmup",
                     "--requests", "requests.jsonl"])
    assert rc == 0
    tiny = load_runner_config(tmp_path / "tiny.json", {"model_path": str(transformer)})
    low, high = LTX25Runner.frame_bounds(tiny)
    for name in ("short", "medium", "long"):  # tensors only (no PyAV needed on the GPU machine): frames predicted
        video = load_file(tmp_path / "outputs" / "ltx25" / f"{name}.safetensors")["video"]
        assert video.shape[0] == 3 and video.shape[2:] == (64, 128) and low <= video.shape[1] <= high  # [3, F, H, W]
    assert torch.float8_e4m3fn in {t.dtype for t in _headers(transformer)}


def _headers(path: Path) -> list[torch.Tensor]:
    from runnerkit.weights import safetensors_infos

    return [torch.empty(0, dtype=e.dtype) for e in safetensors_infos([path], "test").values()]


def test_the_real_size_write_has_the_release_files_and_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 20's write of the real-size config, with meta tensors (nothing drawn or written): every release file
    is written under its name, the transformer, duration head and diffusion VAE files with ltx-core's key sets
    (the transformer's plus the connectors' 1-D transformers), and the packed Gemma-4 12B stand-in with the
    connectors' projections."""
    from runnerkit import synthetic
    from runnerkit.models.ltx2 import checkpoint_release25_write as write
    from runnerkit.models.ltx2.checkpoint import network_factory
    from runnerkit.models.ltx2.conv_vae25 import CONV_VAE_FILE
    from runnerkit.weights import build_on_meta
    from test_cases.models.ltx2.test_conv_vae25 import ltx23_vae_keys
    from test_cases.models.ltx2.test_release_keys_ltx25 import ltx25_keys

    saved: dict[str, dict[str, list[int]]] = {}
    monkeypatch.setattr(write, "synthetic_state_dict", lambda arch, c, *a, **k: build_on_meta(
        network_factory(c, arch)).state_dict())
    monkeypatch.setattr(write, "synthetic_tensor", lambda name, shape, *a, **k: torch.empty(shape, device="meta"))
    monkeypatch.setattr(write, "_save", lambda tensors, path, metadata=None: saved.update(
        {path.relative_to(path.parents[1]).as_posix(): {k: list(v.shape) for k, v in tensors.items()}}))
    monkeypatch.setattr(write, "write_release_gemma4", lambda out, seed, dtype, projection, *a, **k: saved.update(
        {RELEASE_FILES["text_encoder"]: {k: list(v.shape) for k, v in projection.items()}}))
    monkeypatch.setattr(write, "write_debug_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(synthetic, "finish", lambda tmp, out, *a, **k: out)
    assert synth_checkpoint.main(["--config", str(REPO / "configs/ltx2/ltx25_t2av_22b_distilled.json"),
                                  "--out", str(tmp_path / "ltx25"), "--layout", "release"]) == 0
    assert set(saved) == set(RELEASE_FILES.values())
    keys = ltx25_keys()
    transformer = saved[RELEASE_FILES["transformer"]]
    assert {k: s for k, s in transformer.items() if k in keys["transformer"]} == keys["transformer"]
    projection = saved[RELEASE_FILES["text_encoder"]]  # the packed file's "with-proj" tensors, [4096 | 2048, 188160]
    assert projection["text_embedding_projection.video_aggregate_embed.weight"] == [4096, 3840 * 49]
    assert projection["text_embedding_projection.audio_aggregate_embed.weight"] == [2048, 3840 * 49]
    assert len(transformer) - len(keys["transformer"]) + len(projection) == len(build_on_meta(
        network_factory("connectors", LTX25_22B_PIPELINE_ARCH)).state_dict())
    assert saved[RELEASE_FILES["duration_head"]] == keys["duration_head"]
    assert saved[RELEASE_FILES["video_vae"]] == keys["diffusion_vae"]
    assert saved[CONV_VAE_FILE] == ltx23_vae_keys()  # ltx-core's conv VAE file (test_conv_vae25.py)
