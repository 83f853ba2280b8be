"""LTX-2.5 decoding with the convolutional VAE (`video_decoder` "conv"; conv_vae25.py, runner25.py, estimate25.py).

- The release-size conv VAE file the synthetic writer writes holds exactly the tensors ltx-core expects of
  `vae/ltx-2.5-video-vae-conv-bf16.safetensors`: ltx-core (github.com/Lightricks/LTX-2 @ 400fd31,
  `packages/ltx-core/src/ltx_core/model/video_vae/model_configurator.py`) builds a `CausalVideoAutoencoder` file's
  encoder and decoder with `VideoEncoderConfigurator` / `VideoDecoderConfigurator` (`_build_conv_video_decoder`)
  and maps the file's bare `encoder.*`, `decoder.*`, `per_channel_statistics.*` with `VAE_ENCODER_COMFY_KEYS_FILTER` /
  `VAE_DECODER_COMFY_KEYS_FILTER`. Those configurators on LTX-2.3's `vae` config (release_configs.py) build the
  networks whose names `data/ltx2.3_release_keys.json.gz` lists as `vae.*` (dumped from the same commit; re-dumped
  for this file with the class name set: the same 170 tensors), so the expected key set is that listing without
  `vae.`; its bf16 bytes are the release file's size less its header.
- The tiny release layout: with "conv" the video VAE (encoder, conv decoder, statistics) comes from the conv file,
  equal to the diffusers folder's `vae/`; with "diffusion" from the diffusion VAE file (never the other).
- Bad conv files are refused at load, naming the file and the problem.
- The tiny runner with "conv" (t2av, frames predicted): no diffusion decoder loaded, the conv decode warmed at
  both shapes, the same output with and without warmup, from the diffusers folder and from the release layout.
- The memory estimate and `runnerkit plan` without the diffusion decoder.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runnerkit.config import OffloadConfig, RequestConfig, load_runner_config
from runnerkit.models.ltx2.arch25 import LTX25_22B_PIPELINE_ARCH
from runnerkit.models.ltx2.checkpoint import network_factory
from runnerkit.models.ltx2.checkpoint25 import LTX25Checkpoint
from runnerkit.models.ltx2.checkpoint_release25 import open_ltx25
from runnerkit.models.ltx2.conv_vae25 import conv_vae_file
from runnerkit.models.ltx2.estimate import ltx2_estimate
from runnerkit.models.ltx2.estimate25 import TILING_HINT, ltx25_estimate
from runnerkit.models.ltx2.ltx25_arch import GEMMA4_12B_TEXT
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.runners.base import error_phase
from runnerkit.weights import CheckpointError, build_on_meta
from test_cases.conftest import REPO
from test_cases.models.ltx2.test_release_layout_ltx25 import FILES, _no_gc_freeze, layouts  # noqa: F401 (fixtures)
from test_cases.models.ltx2.test_release_layout_ltx25 import _config as release_config
from test_cases.tools.test_plan import no_checkpoints, run_plan  # noqa: F401 (fixture)

DATA = Path(__file__).parent / "data"
CONFIGS = REPO / "configs" / "ltx2"
PROMPT = "a red fox runs through fresh snow, wind howls"
RELEASE_CONV_BYTES = 1_452_269_922
"""The size of the release's `vae/ltx-2.5-video-vae-conv-bf16.safetensors` (header included)."""


def _open_release(root: Path, video_decoder: str) -> Any:
    return open_ltx25(root / FILES["transformer"], root / FILES["latent_upsampler"], root / FILES["text_encoder"],
                      video_decoder=video_decoder)


def ltx23_vae_keys() -> dict[str, list[int]]:
    """ltx-core's key set of the release's conv VAE file: LTX-2.3's monolith `vae.*` listing without `vae.`
    (module docstring)."""
    with gzip.open(DATA / "ltx2.3_release_keys.json.gz", "rt") as f:
        return {k.removeprefix("vae."): s for k, s in json.load(f)["networks"]["vae"].items()}


def test_release_size_conv_file_holds_ltx_cores_keys() -> None:
    expected = ltx23_vae_keys()
    vae = build_on_meta(network_factory("vae", LTX25_22B_PIPELINE_ARCH)).state_dict()
    ours = {k: list(v.shape) for k, v in conv_vae_file(vae, LTX25_22B_PIPELINE_ARCH).items()}
    assert ours == expected and len(ours) == 170
    data_bytes = 2 * sum(math.prod(s) for s in ours.values())  # bf16
    assert data_bytes == 1_452_212_450 and 0 < RELEASE_CONV_BYTES - data_bytes < 64 * 1024  # the rest: the header


def test_conv_file_gives_the_whole_vae_and_the_diffusion_file_stays_apart(layouts: dict[str, Path]) -> None:
    root = layouts["release"]
    diffusers = LTX25Checkpoint.open(layouts["diffusers"]).load("vae", torch.float32).state_dict()
    conv = _open_release(root, "conv")
    assert conv.files("vae") == [root / FILES["conv_vae"]] and not conv._index["diffusion_decoder"]
    ours = conv.load("vae", torch.float32).state_dict()
    assert set(ours) == set(diffusers) and any(k.startswith("decoder.") for k in ours)
    assert all(torch.equal(ours[k], diffusers[k]) for k in ours)
    diffusion = _open_release(root, "diffusion")
    assert diffusion.files("vae") == [root / FILES["video_vae"]]
    assert not any(k.startswith("decoder.") for k in diffusion.load("vae", torch.float32).state_dict())


def _rewrite(file: Path, drop: str | None = None, metadata: dict[str, str] | None = None) -> None:
    """Rewrite safetensors `file` without tensor `drop`, with `metadata` (default: its own)."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        meta = f.metadata() if metadata is None else metadata
    tensors = {k: v for k, v in load_file(file).items() if k != drop}
    save_file(tensors, str(file), metadata=meta)


def test_bad_conv_files_are_refused_naming_them(layouts: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "release"
    shutil.copytree(layouts["release"], root)
    conv = root / FILES["conv_vae"]
    conv.rename(conv.with_name("any-name.safetensors"))  # found by content, whatever its name
    conv = conv.with_name("any-name.safetensors")
    assert _open_release(root, "conv").files("vae") == [conv]
    _rewrite(conv, metadata={"config": json.dumps({"vae": {"_class_name": "CausalDiffusionVAE"}})})
    with pytest.raises(CheckpointError, match=rf"{conv}.*names vae._class_name 'CausalDiffusionVAE', not "
                                              "'CausalVideoAutoencoder'"):
        _open_release(root, "conv")
    _rewrite(conv, drop="decoder.conv_out.conv.weight", metadata={})
    with pytest.raises(CheckpointError, match=rf"{conv}: vae: .*missing keys \(1\): \['decoder.conv_out.conv.weight'"):
        _open_release(root, "conv").load("vae", torch.float32)
    shutil.copy(conv, root / "vae" / "copy.safetensors")
    with pytest.raises(CheckpointError, match=r"2 files in .*vae hold the convolutional VAE"):
        _open_release(root, "conv")
    conv.unlink()
    (root / "vae" / "copy.safetensors").unlink()
    config = _config(tmp_path, {"diffusers": root, "release": root}, "release", warmup=False)
    runner = LTX25Runner(load_runner_config(config, {}))
    with pytest.raises(CheckpointError, match=r"0 files in .*vae hold the convolutional VAE") as info:
        runner.init_modules()
    assert error_phase(info.value) == "load"


def _config(tmp: Path, layouts: dict[str, Path], layout: str, warmup: bool) -> Path:
    return release_config(tmp, "t2av", layouts, layout, video_decoder="conv", warmup=warmup)


def test_conv_runner_t2av_same_output_with_and_without_warmup_from_either_layout(
        layouts: dict[str, Path], tmp_path: Path, mocker: Any) -> None:
    from runnerkit.models.ltx2.vae import LTX2VideoVAE

    outputs, decoded = {}, []
    conv = mocker.spy(LTX2VideoVAE, "decode")  # the conv decoder itself: [B, C, F, H, W] latents in
    for layout, warmup in (("diffusers", False), ("diffusers", True), ("release", True)):
        runner = LTX25Runner(load_runner_config(_config(tmp_path, layouts, layout, warmup), {}))
        diffusion = mocker.spy(runner, "run_diffusion_decoder")
        conv.reset_mock()
        runner.init_modules()
        assert "diffusion_decoder" not in runner.modules and "vae" in runner.modules
        out = tmp_path / f"{layout}-{warmup}"
        runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=3, save_tensor_path=str(out / "o.safetensors")))
        decoded.append([tuple(c.args[1].shape) for c in conv.call_args_list])
        assert diffusion.call_count == 0
        outputs[(layout, warmup)] = load_file(out / "o.safetensors")
    warm = [(1, 8, 2, 2, 2), (1, 8, 5, 2, 4)]  # the warmup shapes 64x64x9 and 64x128x33 in latents
    assert decoded == [[(1, 8, 4, 2, 4)], [*warm, (1, 8, 4, 2, 4)], [*warm, (1, 8, 4, 2, 4)]]  # the request: 25 frames
    first = outputs[("diffusers", False)]
    assert first["video"].shape == (3, 25, 64, 128)  # frames predicted (bounds 9..33)
    for key, other in outputs.items():
        assert set(other) == set(first) and all(torch.equal(other[k], first[k]) for k in first), key


def test_estimate_without_the_diffusion_decoder() -> None:
    """"conv": LTX-2's `vae` weights and its `vae_decoder` stage exactly, no diffusion decoder, no tiling hint."""
    import transformers

    arch, shape, off = LTX25_22B_PIPELINE_ARCH, (512, 768, 121), OffloadConfig()
    gemma4 = transformers.Gemma4UnifiedTextConfig(**GEMMA4_12B_TEXT).to_dict()
    conv = ltx25_estimate(arch, gemma4, shape, 24, "t2av", torch.bfloat16, torch.device("cuda"), off,
                          conv_decoder=True)
    diffusion = ltx25_estimate(arch, gemma4, shape, 24, "t2av", torch.bfloat16, torch.device("cuda"), off)
    gemma = {k: gemma4[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                    "num_attention_heads", "num_key_value_heads", "head_dim")}
    base = ltx2_estimate(arch.base(), gemma, shape, 24, "t2av", torch.bfloat16, torch.device("cuda"), off)
    assert "diffusion_decoder" not in conv.modules and conv.modules["vae"] == base.modules["vae"]
    assert set(diffusion.modules) - set(conv.modules) == {"diffusion_decoder"}
    assert set(conv.modules) - set(diffusion.modules) == {"vae"}
    stages = {s.name: s for s in conv.stages}
    assert "diffusion_decoder" not in stages and stages["vae_decoder"] == {s.name: s for s in base.stages}["vae_decoder"]
    assert [s.name for s in conv.stages] == [s.name if s.name != "diffusion_decoder" else "vae_decoder"
                                             for s in diffusion.stages]
    assert TILING_HINT in diffusion.hints and TILING_HINT not in conv.hints


def test_plan_without_the_diffusion_decoder(no_checkpoints: Path, tmp_path: Path,  # noqa: F811
                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads((CONFIGS / "ltx25_t2av_22b_distilled.json").read_text()) | {"video_decoder": "conv"}
    (tmp_path / "conv.json").write_text(json.dumps(config))
    rc, out, err = run_plan(capsys, "--config_json", tmp_path / "conv.json", "--device_gib", 80, "--host_gib", 128)
    assert rc == 0, err
    modules = [m["name"] for m in out["modules"]]
    assert "diffusion_decoder" not in modules and "vae" in modules
    assert out["peak_stage"] != "diffusion_decoder"
    runner = LTX25Runner.for_plan(load_runner_config(tmp_path / "conv.json", {}), torch.device("cuda"))
    estimate = runner.estimate_memory((512, 768, 473))
    assert "diffusion_decoder" not in estimate.modules and "vae_decoder" in {s.name for s in estimate.stages}


def test_video_decoder_is_refused_where_it_is_not_read(tmp_path: Path) -> None:
    from runnerkit.models.ltx2.runner import LTX2Runner

    ltx2 = load_runner_config(CONFIGS / "ltx2_t2av_tiny.json", {"video_decoder": "conv"})
    with pytest.raises(ValueError, match=r"`video_decoder` \('conv'\) is not read by 'ltx2': it has one video "
                                         "decoder; remove the key"):
        LTX2Runner(ltx2)
    conv = load_runner_config(CONFIGS / "ltx25_t2av_tiny.json", {"video_decoder": "conv", "offload.vae_tiling": True})
    with pytest.raises(NotImplementedError, match="`offload.vae_tiling` with `video_decoder` 'conv'"):
        LTX25Runner(conv)
