"""`runnerkit plan` of the real-size LTX-2.5 config without any file (configs/ltx2/ltx25_t2av_22b_distilled.json):
the release's architecture from the transformer file's name, Gemma-4 12B's sizes, the omitted frame count at the
largest the duration head can predict (473 at 24 fps), each said in `estimate_sources`; at 80 GiB the plan equals
the planner called directly on estimate25.py's estimate of those; at 24 and 16 GiB nothing fits (the diffusion
decoder's activations at 512 x 768 x 473 alone exceed either) and the refusal says where the peak is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.memory import MemoryLimit
from runnerkit.models.ltx2.arch25 import LTX25_22B_PIPELINE_ARCH
from runnerkit.models.ltx2.estimate25 import ltx25_estimate
from runnerkit.models.ltx2.ltx25_arch import GEMMA4_12B_TEXT
from runnerkit.models.ltx2.runner import DISTILLED_SIGMAS, STAGE2_SIGMAS
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.planning import fit, planner
from runnerkit.planning import report as plan_report
from test_cases.conftest import REPO
from test_cases.tools.test_plan import no_checkpoints, run_plan  # noqa: F401 (fixture)

CONFIG = REPO / "configs/ltx2/ltx25_t2av_22b_distilled.json"
GIB = 1024**3
SHAPES = [[512, 768, 473], [256, 384, 25]]  # the default shape at the head's largest count, the 22B-2.5 warmup's
SOURCES = [
    ("architecture: the LTX-2.5 22B release, named by `model_path`'s name "
     "'ltx-2.5-22b-distilled-transformer-bf16.safetensors' (`model_path` "
     "models/LTX-2.5/diffusion_models/ltx-2.5-22b-distilled-transformer-bf16.safetensors does not exist)"),
    ("Gemma-4 sizes: Gemma-4 12B (ltx25_arch.GEMMA4_12B_TEXT, the release's text encoder): "
     "models/LTX-2.5/text_encoders/gemma4-12b-with-proj-ltx-2.5-bf16.safetensors does not exist"),
    "fp8 storage: none assumed (the bf16 release; the checkpoint's headers would tell)",
    ("frames: omitted by the config (the duration head predicts them per request): planned at 473, the largest "
     "count a prediction can take (1 s to 20 s at 24 fps)")]


def _direct_plan(device_gib: int, host_gib: int, vae_tiling: bool = False) -> planner.MemoryPlan:
    """The planner on estimate25.py's estimate of the release: `LTX25_22B_PIPELINE_ARCH`, Gemma-4 12B, bf16, no
    fp8 storage, one pass per step, 8 + 3 steps, the shapes above, no compute model (no device name)."""
    config = LTX25Runner.resolve_config(load_runner_config(CONFIG, {
        "memory.limit_gib": device_gib, "memory.host_limit_gib": host_gib, "offload.vae_tiling": vae_tiling}))
    gemma = transformers.Gemma4UnifiedTextConfig(**GEMMA4_12B_TEXT).to_dict()

    def estimate(off: OffloadConfig, shape: tuple[int, int, int]) -> fit.MemoryEstimate:
        return ltx25_estimate(LTX25_22B_PIPELINE_ARCH, gemma, shape, 24, "t2av", torch.bfloat16,
                              torch.device("cuda"), off)

    return planner.plan_offload(config, [tuple(s) for s in SHAPES], torch.device("cuda"), estimate,
                                MemoryLimit(device_gib * GIB, "config memory.limit_gib"),
                                MemoryLimit(host_gib * GIB, "config memory.host_limit_gib"), lambda off: 1,
                                lambda off: None, (64, 8),
                                steps_per_request=len(DISTILLED_SIGMAS) + len(STAGE2_SIGMAS),
                                compute_note=("no compute estimate: the device is unnamed "
                                              "(planning/compute.py DEVICE_PEAKS)"),
                                fixed_shapes=LTX25Runner.WARMUP_SHAPES["22B-2.5"], own_shapes=[tuple(SHAPES[0])])


def test_the_80_gib_plan_equals_the_planner_on_the_release_sizes(no_checkpoints: Path,  # noqa: F811
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert not (no_checkpoints / "models").exists()
    rc, out, err = run_plan(capsys, "--config_json", CONFIG, "--device_gib", 80, "--host_gib", 128)
    assert rc == 0, err
    assert out["shapes"] == SHAPES and out["estimate_sources"] == SOURCES
    direct = _direct_plan(80, 128)
    report = plan_report.report(direct, OffloadConfig())
    for key in set(report) - {"modules", "device_limit_source", "host_limit_source", "estimated_request_seconds"}:
        assert out[key] == report[key], key
    assert out["offload"]["mode"] == "model" and out["peak_stage"] == "diffusion_decoder"
    assert out["peak_shape"] == [512, 768, 473]
    rows = plan_report.module_rows(direct.chosen, torch.device("cuda"))
    assert [(m["name"], m["device_bytes"], m["host_bytes"]) for m in out["modules"]] == [
        (r.name, r.device_bytes, r.host_bytes) for r in rows]


@pytest.mark.parametrize("device_gib", [24, 16])
def test_at_24_and_16_gib_nothing_fits_and_the_refusal_names_the_decoder(
        device_gib: int, no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    rc, out, err = run_plan(capsys, "--config_json", CONFIG, "--device_gib", device_gib, "--host_gib", 128)
    assert (rc, out["fits"], out["offload"], out["modules"]) == (1, False, None, []), err
    assert out["shapes"] == SHAPES and out["estimate_sources"] == SOURCES
    with pytest.raises(fit.MemoryFitError) as direct:
        _direct_plan(device_gib, 128)
    assert out["refusal"] == str(direct.value)
    assert "peak in stage diffusion_decoder at shape [512, 768, 473]" in out["refusal"]


def test_a_given_frame_count_is_planned_as_given(no_checkpoints: Path,  # noqa: F811
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_plan(capsys, "--config_json", CONFIG, "--device_gib", 80, "--host_gib", 128,
                            "--target_video_length", 121)
    assert rc == 0, err
    assert out["shapes"] == [[512, 768, 121], SHAPES[1], SHAPES[0]] and out["estimate_sources"] == SOURCES[:3]


@pytest.mark.parametrize("device_gib, storage, resident_units, peak_stage",
                         [(24, "cpu", 2, "diffusion_decoder"), (16, "disk", 12, "stage2")])
def test_with_decoder_tiling_24_and_16_gib_plan_block_streaming(
        device_gib: int, storage: str, resident_units: int, peak_stage: str, no_checkpoints: Path,  # noqa: F811
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`offload.vae_tiling` (the diffusion decoder on 768 px x 80-frame tiles: 11.4 GiB instead of 50.5 GiB at
    512x768x473) is the refusal's advice above, and with it the planner finds block streaming of Gemma-4, the
    connectors and the transformer: from pinned host memory at 24 GiB, lazily from disk at 16 GiB; it equals the
    planner on the release sizes."""
    rc, out, _ = run_plan(capsys, "--config_json", CONFIG, "--device_gib", device_gib, "--host_gib", 128)
    assert "offload.vae_tiling=true (the diffusion decoder's last two stages run on" in out["refusal"]
    config = json.loads(CONFIG.read_text()) | {"offload": {"vae_tiling": True}}
    (tmp_path / "tiled.json").write_text(json.dumps(config))
    rc, out, err = run_plan(capsys, "--config_json", tmp_path / "tiled.json", "--device_gib", device_gib,
                            "--host_gib", 128)
    assert (rc, out["fits"]) == (0, True), err
    offload = out["offload"]
    assert (offload["mode"], offload["storage"], offload["lazy_load"], offload["vae_tiling"]) == \
        ("block", storage, storage == "disk", True)
    assert tuple(offload["stream_modules"]) == ("text_encoder", "connectors", "transformer")
    direct = _direct_plan(device_gib, 128, vae_tiling=True)
    report = plan_report.report(direct, OffloadConfig(vae_tiling=True))
    for key in set(report) - {"modules", "device_limit_source", "host_limit_source", "estimated_request_seconds"}:
        assert out[key] == report[key], key
    assert f"{resident_units} units resident" in direct.chosen.name
    assert out["peak_stage"] == peak_stage


def test_the_gemma4_config_is_built_once_per_sizes_and_each_call_gets_its_own_dict() -> None:
    """The planner's hundreds of estimates share one built Gemma-4 text config per sizes: other sizes give
    another config (the cache keys on every size), and a caller changing its dict changes no later call's."""
    from runnerkit.models.ltx2.plan_sources25 import _gemma4_text_dict, gemma4_text_dict

    _gemma4_text_dict.cache_clear()
    first = gemma4_text_dict(GEMMA4_12B_TEXT)
    assert first == transformers.Gemma4UnifiedTextConfig(**GEMMA4_12B_TEXT).to_dict()
    first["hidden_size"] = 1
    assert gemma4_text_dict(GEMMA4_12B_TEXT)["hidden_size"] == GEMMA4_12B_TEXT["hidden_size"]
    other = gemma4_text_dict({**GEMMA4_12B_TEXT, "num_hidden_layers": 7})
    assert other["num_hidden_layers"] == 7
    assert _gemma4_text_dict.cache_info().misses == 2
