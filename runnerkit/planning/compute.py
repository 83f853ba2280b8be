"""The planner's time model: a denoising step's compute on the device against its host-to-device copies
(docs/memory_plan.md, "Estimated request time").

    compute seconds per step = step FLOPs / (device dense bf16 peak x efficiency)
    request seconds = sum over denoising stages of steps x max(compute, copy per step)     (copies prefetched)
                                                   or steps x (compute + copy per step)    (pageable: in line)
                    + the per-request copies (visits, lazy reads, streamed text encoders), not overlapped

The step FLOPs are the family's (`DefaultRunner.denoise_flops`: the transformer's matmul and attention
FLOPs, 2 per multiply-add, every CFG pass, per stage), from the architecture alone. The copies are the plan's
(planning/report.py `module_rows`). Encoders and decoders run once per request; their compute is left out
(the same for every candidate, so the ranking does not change; the absolute time is low by that much).

`DEVICE_PEAKS` holds the dense (no sparsity) bf16 tensor-core peak of the devices the planner knows, by the
name CUDA reports (`torch.cuda.get_device_name`); `EFFICIENCY` the fraction of it a step reaches, calibrated
on H100 SXM runs of this package (sources beside each number). An unknown device, the CPU, or a plan for a
device given only by its memory size (`runnerkit plan --device_gib` without CUDA or `--device_name`) gets no
compute estimate: the plan then ranks by copy seconds alone, and says so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEVICE_PEAKS", "EFFICIENCY", "ComputeModel", "DevicePeak", "StageFlops", "compute_model",
           "denoise_seconds", "device_peak"]


@dataclass(frozen=True)
class StageFlops:
    """One denoising stage's steps and the FLOPs of one of its steps (every CFG pass counted).

    Attributes:
        name: the stage, e.g. "transformer" (one-stage families) or "stage1" / "stage2" (two-stage ones).
        steps: denoising steps of the stage per request.
        flops: FLOPs of one step (2 per multiply-add).
    """

    name: str
    steps: int
    flops: float


@dataclass(frozen=True)
class DevicePeak:
    """A device's dense bf16 tensor-core peak: `label` (the table's name), TFLOP/s, where the number comes from."""

    label: str
    tflops: float
    source: str


#: (pattern matched case-insensitively in the CUDA device name, label, dense bf16 TFLOP/s with FP32
#: accumulation, source). First match wins: specific names (NVL, PCIe, L40S) before general ones.
DEVICE_PEAKS: tuple[tuple[str, str, float, str], ...] = (
    (r"H100 NVL", "H100 NVL", 835.0, "NVIDIA H100 datasheet: BF16 Tensor Core 1,671 TFLOPS with sparsity"),
    (r"H100.*PCIe", "H100 PCIe", 756.0, "NVIDIA H100 datasheet: BF16 Tensor Core 1,513 TFLOPS with sparsity"),
    (r"H100", "H100 SXM", 989.0, "NVIDIA H100 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity"),
    (r"H200 NVL", "H200 NVL", 835.0, "NVIDIA H200 datasheet: BF16 Tensor Core 1,671 TFLOPS with sparsity"),
    (r"H200", "H200 SXM", 989.0, "NVIDIA H200 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity"),
    (r"GH200", "GH200", 989.0, "NVIDIA GH200 datasheet: BF16 1,979 TFLOPS with sparsity"),
    (r"B200", "B200", 2250.0, "NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs; BF16 2.25 PFLOPS dense"),
    (r"A100", "A100", 312.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    (r"L40S", "L40S", 362.0, "NVIDIA L40S datasheet: BF16 Tensor Core 733 TFLOPS with sparsity"),
    (r"L40", "L40", 181.0, "NVIDIA L40 datasheet: BF16 Tensor Core 362 TFLOPS with sparsity"),
    (r"\bL4\b", "L4", 121.0, "NVIDIA L4 datasheet: BF16 Tensor Core 242 TFLOPS with sparsity"),
    (r"A10G?\b", "A10", 125.0, "NVIDIA A10 datasheet: BF16 Tensor Core 125 TFLOPS (250 with sparsity)"),
    (r"RTX 5090", "RTX 5090", 209.5, "NVIDIA RTX Blackwell GPU architecture whitepaper: FP16/BF16 tensor with "
                                     "FP32 accumulate, 209.5 TFLOPS dense"),
    (r"RTX 4090", "RTX 4090", 165.2, "NVIDIA Ada GPU architecture whitepaper: FP16/BF16 tensor with FP32 "
                                     "accumulate, 165.2 TFLOPS dense"),
    (r"RTX 6000 Ada", "RTX 6000 Ada", 364.2, "NVIDIA Ada GPU architecture whitepaper: FP16 tensor with FP32 "
                                             "accumulate, 364.2 TFLOPS dense"),
    (r"RTX 3090", "RTX 3090", 71.0, "NVIDIA Ampere GA102 whitepaper: FP16 tensor with FP32 accumulate, 71 TFLOPS"),
)

EFFICIENCY: dict[bool, float] = {True: 0.60, False: 0.37}
"""Fraction of the dense peak a denoising step reaches, compiled (`compile.enabled`) or eager. Calibrated on
an H100 SXM (989 TFLOP/s) with the families' FLOP counts (models/<family> `denoise_flops`) against measured
steps: docs/memory_plan.md lists the runs (a compiled 14B video step 0.60, eager image and video steps 0.37-0.38;
a short low-resolution stage reaches 0.28, so it is estimated low by up to a quarter)."""


def device_peak(name: str | None) -> DevicePeak | None:
    """The dense bf16 peak of the device CUDA names `name` (`DEVICE_PEAKS`), or None: unknown, or no name."""
    if not name:
        return None
    for pattern, label, tflops, source in DEVICE_PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return DevicePeak(label, tflops, source)
    return None


@dataclass(frozen=True)
class ComputeModel:
    """The compute side of the time model: per denoising stage, its steps and seconds per step.

    Attributes:
        stages: (stage name, steps, compute seconds of one step) in order.
        device: the device name the peak was looked up by; peak: its table entry; efficiency: `EFFICIENCY`'s.
    """

    stages: tuple[tuple[str, int, float], ...]
    device: str
    peak: DevicePeak
    efficiency: float

    def report(self) -> dict[str, object]:
        """The profile's `memory_plan.compute_estimate` (docs/profile.md)."""
        return {"device": self.device, "peak_tflops": self.peak.tflops, "peak_source": f"{self.peak.label}: "
                f"{self.peak.source}", "efficiency": self.efficiency,
                "stages": [{"name": n, "steps": k, "seconds_per_step": round(s, 4)} for n, k, s in self.stages]}


def compute_model(stages: Sequence[StageFlops] | None, device_name: str | None,
                  compiled: bool) -> tuple[ComputeModel | None, str]:
    """The compute model of a run, or (None, why there is none).

    Args:
        stages: the family's step FLOPs per denoising stage (None: the family gives none).
        device_name: the CUDA device's name (None: the CPU, or a device known only by its memory size).
        compiled: `compile.enabled` (the efficiency factor).
    """
    if not stages:
        return None, "no compute estimate: the family gives no FLOP count (denoise_flops)"
    peak = device_peak(device_name)
    if peak is None:
        what = f"device {device_name!r} is not in the table of peaks" if device_name else "the device is unnamed"
        return None, f"no compute estimate: {what} (planning/compute.py DEVICE_PEAKS)"
    efficiency = EFFICIENCY[compiled]
    rate = peak.tflops * 1e12 * efficiency
    model = ComputeModel(tuple((s.name, s.steps, s.flops / rate) for s in stages), device_name or "", peak,
                         efficiency)
    return model, ""


def denoise_seconds(model: ComputeModel, step_copy_seconds: float, overlapped: bool) -> float:
    """Seconds of the denoising steps of one request: per step the larger of compute and copy where the copy
    is prefetched on the copy stream (`overlapped`: pinned host memory, or disk through pinned staging), else
    their sum (pageable memory: the copy runs in line on the compute stream)."""
    total = 0.0
    for _, steps, compute in model.stages:
        total += steps * (max(compute, step_copy_seconds) if overlapped else compute + step_copy_seconds)
    return total
