"""The planner's time model (planning/compute.py): device peaks by name, the compute model and why there is
none, and each family's FLOPs of one denoising step against the counts of bench/speed.py and the H100 steps the
efficiency factors are calibrated on."""

from __future__ import annotations

import pytest
import torch

from runnerkit.config import load_runner_config
from runnerkit.models.ltx2.arch import LTX23_22B_ARCH
from runnerkit.models.ltx2.flops import ltx2_step_flops
from runnerkit.models.qwen_image.arch import QwenImageArch
from runnerkit.models.qwen_image.estimate import qwen_step_flops
from runnerkit.models.wan.arch import WanTransformerArch
from runnerkit.models.wan.flops import wan_step_flops
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.planning.compute import EFFICIENCY, StageFlops, compute_model, denoise_seconds, device_peak
from test_cases.conftest import REPO

WAN14 = WanTransformerArch(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)


@pytest.mark.parametrize("name, label, tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0), ("NVIDIA H100 NVL", "H100 NVL", 835.0),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0), ("NVIDIA H200", "H200 SXM", 989.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0), ("NVIDIA L40S", "L40S", 362.0), ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2), ("NVIDIA GeForce RTX 5090", "RTX 5090", 209.5),
])
def test_device_peaks_by_the_name_cuda_reports(name: str, label: str, tflops: float) -> None:
    peak = device_peak(name)
    assert peak is not None and (peak.label, peak.tflops) == (label, tflops)
    assert "datasheet" in peak.source or "whitepaper" in peak.source


def test_no_compute_estimate_says_why() -> None:
    stages = [StageFlops("transformer", 50, 1e15)]
    assert device_peak("Tesla T4") is None and device_peak(None) is None
    assert compute_model(stages, "Tesla T4", False) == (None, "no compute estimate: device 'Tesla T4' is not in "
                                                              "the table of peaks (planning/compute.py DEVICE_PEAKS)")
    assert compute_model(stages, None, False)[1] == ("no compute estimate: the device is unnamed "
                                                     "(planning/compute.py DEVICE_PEAKS)")
    assert compute_model(None, "NVIDIA H100 80GB HBM3", False)[1] == ("no compute estimate: the family gives no FLOP "
                                                                      "count (denoise_flops)")
    model, note = compute_model(stages, "NVIDIA H100 80GB HBM3", True)
    assert note == "" and model is not None
    assert model.stages == (("transformer", 50, 1e15 / (989e12 * EFFICIENCY[True])),)


def test_denoise_seconds_overlap_or_add_the_copy() -> None:
    model, _ = compute_model([StageFlops("stage1", 8, 989e12 * 0.37), StageFlops("stage2", 3, 3 * 989e12 * 0.37)],
                             "NVIDIA H100 80GB HBM3", False)
    assert model is not None  # 1 s and 3 s a step
    assert denoise_seconds(model, 2.0, overlapped=True) == pytest.approx(8 * 2.0 + 3 * 3.0)
    assert denoise_seconds(model, 2.0, overlapped=False) == pytest.approx(8 * 3.0 + 3 * 5.0)


def test_wan_flops_are_bench_speeds_count() -> None:
    """bench/speed.py `wan_flops` at 480x832x81 with CFG: L = 21 x 30 x 52 tokens, text 512."""
    L, T, n = 21 * 30 * 52, 512, 2 * 40
    D, F = 5120, 13824
    expected = (8 * L * D * D + 4 * L * D * D + 4 * T * D * D + 4 * L * D * F + 4 * L * L * D + 4 * L * T * D) * n
    assert wan_step_flops(WAN14, (480, 832, 81), 2) == expected
    # the calibration: 3.357 PFLOP in the 5.675 s compiled H100 step is 60 % of 989 TFLOP/s
    assert expected / 5.675 / 989e12 == pytest.approx(EFFICIENCY[True], abs=0.005)
    clip = 257  # Wan2.1 i2v: the CLIP tokens join the cross-attention
    assert wan_step_flops(WAN14, (480, 832, 81), 2, clip) - expected == (4 * clip * D * D + 4 * L * clip * D) * n


def test_the_runner_counts_its_steps_and_cfg() -> None:
    config = load_runner_config(REPO / "configs/wan/wan_t2v_14b.json", {"model_path": "absent", "device": "cpu"})
    stages = WanT2VRunner.for_plan(config).denoise_flops((480, 832, 81))
    assert stages == (StageFlops("transformer", 50, wan_step_flops(WAN14, (480, 832, 81), 2)),)
    no_cfg = load_runner_config(REPO / "configs/wan/wan_t2v_14b_distill4.json", {"model_path": "absent",
                                                                                 "device": "cpu"})
    assert not no_cfg.enable_cfg and no_cfg.infer_steps == 4
    assert WanT2VRunner.for_plan(no_cfg).denoise_flops((480, 832, 81)) == (
        StageFlops("transformer", 4, wan_step_flops(WAN14, (480, 832, 81), 1)),)


def test_qwen_and_ltx2_flops_match_the_eager_calibration() -> None:
    """Qwen-Image 20B 1328x1328 with CFG (bench/speed.py `qwen_flops`: 6889 image + 64 text tokens): 0.714 s on
    the H100; LTX-2.3 22B 512x768x121 stage 2: 0.53 s. Both within 3 % of the eager factor's 37 %."""
    arch = QwenImageArch().transformer
    L, D = 83 * 83 + 64, 3072
    qwen = qwen_step_flops(arch, 83 * 83, 64, 2)
    assert qwen == (8 * L * D * D + 16 * L * D * D + 4 * L * L * D) * 60 * 2
    assert qwen / 0.714 / 989e12 == pytest.approx(EFFICIENCY[False], rel=0.03)
    stage2 = ltx2_step_flops(LTX23_22B_ARCH, (512, 768, 121), 24, 2, 1)
    assert stage2 / 0.53 / 989e12 == pytest.approx(EFFICIENCY[False], rel=0.03)
    stage1 = ltx2_step_flops(LTX23_22B_ARCH, (512, 768, 121), 24, 1, 1)
    assert 3.5 < stage2 / stage1 < 4.5  # 4x the video tokens, attention growing faster
    assert ltx2_step_flops(LTX23_22B_ARCH, (512, 768, 121), 24, 2, 2) == 2 * stage2


def test_planning_on_the_cpu_has_no_compute_estimate() -> None:
    config = load_runner_config(REPO / "configs/wan/wan_t2v_14b.json", {"model_path": "absent", "device": "cpu"})
    runner = WanT2VRunner.for_plan(config, torch.device("cpu"))
    runner.memory_checks.planned_device_name = "NVIDIA H100 80GB HBM3"
    assert runner.memory_checks.compute_model([(480, 832, 81)]) == (None, "no compute estimate: the device is cpu")
    runner.memory_checks.memory_device = lambda: torch.device("cuda")  # type: ignore[method-assign]
    model, note = runner.memory_checks.compute_model([(240, 416, 21), (480, 832, 81)])
    assert note == "" and model is not None and model.peak.label == "H100 SXM"
    assert model.stages[0][2] == pytest.approx(wan_step_flops(WAN14, (480, 832, 81), 2) / (989e12 * 0.37))
