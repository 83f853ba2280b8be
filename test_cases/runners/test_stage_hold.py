"""`offload.keep_across_stages`: a transformer that consecutive denoising stages use stays on the device
through the transition between them (runners/placement.py `held_across_stages`), the estimate counts it there
(fit.py, `StageFootprint.holds`), the plan's copy time counts one visit, and outputs do not change.

The toy two-stage family (two_stage.py) is changed so that both stages use `transformer` (as LTX-2 does).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from runnerkit import memory
from runnerkit.config import OffloadConfig, RequestConfig, load_runner_config
from runnerkit.planning import fit
from runnerkit.planning import report as plan_report
from runnerkit.planning.fit import GIB, MemoryEstimate, ModuleFootprint, StageFootprint
from runnerkit.runners.pipeline import Pipeline
from runnerkit.runners.placement import Placement, spans_across_stages
from runnerkit.planning.planner import plan_offload
from test_cases.planning.test_planner import CUDA, config, limit
from test_cases.runners._visits import count_visits
from test_cases.runners.two_stage import TwoStageImageRunner, config_dict


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", True)  # never freeze the test process


class OneTransformer(TwoStageImageRunner):
    """Both stages through `transformer`, the upsampler between them."""

    def describe_pipeline(self) -> Pipeline:
        p = super().describe_pipeline()
        first, second = p.denoise
        return dataclasses.replace(p, modules=tuple(m for m in p.modules if m.name != "transformer_2"),
                                   denoise=(first, dataclasses.replace(second, transformers=("transformer",))))

    def estimate_memory(self, shape: tuple[int, int, int]) -> MemoryEstimate:
        """The toy estimate of this pipeline: stage 2 on `transformer`, held through the upsampler."""
        est = super().estimate_memory(shape)
        stages = tuple(dataclasses.replace(s, module="transformer") if s.name == "stage2" else
                       dataclasses.replace(s, holds=("transformer",)) if s.name == "upsampler" else s
                       for s in est.stages)
        return MemoryEstimate({n: m for n, m in est.modules.items() if n != "transformer_2"}, stages)


def build(tmp_path: Path, **offload: Any) -> OneTransformer:
    return OneTransformer(load_runner_config(None, config_dict(tmp_path, offload=offload)))


def serve(runner: OneTransformer, tmp_path: Path, name: str, index: int = 0) -> torch.Tensor:
    out = tmp_path / f"{name}.safetensors"
    runner.run_pipeline(RequestConfig(prompt="a red fox", seed=5, save_tensor_path=str(out)), index)
    return load_file(str(out))["image"]


def test_spans_are_runs_of_consecutive_stages() -> None:
    from types import SimpleNamespace as S

    assert spans_across_stages([S(transformers=("t",)), S(transformers=("t",))]) == {"t": (0, 1)}
    assert spans_across_stages([S(transformers=("t",))] * 3) == {"t": (0, 2)}
    assert spans_across_stages([S(transformers=("a", "b"))]) == {}  # one stage: nothing to hold
    assert spans_across_stages([S(transformers=("t",)), S(transformers=("u",)), S(transformers=("t",))]) == {}


def test_the_transformer_visits_once_per_request_and_outputs_do_not_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resident = build(tmp_path, mode="none")
    plain = build(tmp_path, mode="model")
    kept = build(tmp_path, mode="model", keep_across_stages=True)
    for r in (resident, plain, kept):
        r.init_modules()
    counts = count_visits(monkeypatch)
    reference = serve(resident, tmp_path, "resident")
    assert torch.equal(serve(plain, tmp_path, "plain"), reference)
    assert counts == {"text_encoder": 1, "transformer": 2, "upsampler": 1, "decoder": 1}  # stage 1, stage 2
    counts.clear()
    for i in range(2):  # and again: the hold ended with the request
        assert torch.equal(serve(kept, tmp_path, f"kept{i}", i), reference)
        assert counts == {"text_encoder": 1, "transformer": 1, "upsampler": 1, "decoder": 1}, i
        assert kept.placement.on_device_now() == set()
        counts.clear()


def test_the_hold_ends_when_a_stage_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = build(tmp_path, mode="model", keep_across_stages=True)
    runner.init_modules()
    seen: list[set[str]] = []

    def failing(req: Any, stage: Any, model: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        seen.append(runner.placement.on_device_now())
        raise RuntimeError("upsampler failed")

    monkeypatch.setattr(runner, "run_transition", failing)
    with pytest.raises(RuntimeError):
        serve(runner, tmp_path, "x")
    assert seen == [{"transformer", "upsampler"}]  # held through the transition
    assert runner.placement.on_device_now() == set()


def test_nested_per_stage_modules_are_built_once() -> None:
    builds: list[str] = []
    teardowns: list[str] = []

    def loader() -> tuple[nn.Module, Any]:
        builds.append("t")
        return nn.Linear(2, 2), lambda: teardowns.append("t")

    placement = Placement(torch.device("cpu"), loaders={"t": loader})
    with placement.on_device("t") as outer:
        with placement.on_device("t") as inner:
            assert inner is outer
        assert teardowns == [] and placement.on_device_now() == {"t"}
    assert builds == ["t"] and teardowns == ["t"] and placement.on_device_now() == set()


# ---- the estimate and the plan -----------------------------------------------------------------------
def two_stage_estimate(off: OffloadConfig, shape: tuple[int, int, int]) -> MemoryEstimate:
    """text encoder 4 GiB, transformer 10, upsampler 1; stage activations 1 GiB, the upsampler's 2."""
    return MemoryEstimate(
        modules={"text_encoder": ModuleFootprint(4 * GIB, stream_default=False),
                 "transformer": ModuleFootprint(10 * GIB), "upsampler": ModuleFootprint(GIB)},
        stages=(StageFootprint("text_encoder", "text_encoder", GIB // 10),
                StageFootprint("stage1", "transformer", GIB),
                StageFootprint("latent_upsampler", "upsampler", 2 * GIB, holds=("transformer",)),
                StageFootprint("stage2", "transformer", GIB)))


def test_the_estimate_counts_the_held_transformer_in_the_transition() -> None:
    est = two_stage_estimate(OffloadConfig(mode="model"), (1, 1, 1))
    plain = config().model_copy(update={"offload": OffloadConfig(mode="model")})
    kept = config().model_copy(update={"offload": OffloadConfig(mode="model", keep_across_stages=True)})
    assert fit.device_weights(est, "upsampler", plain, CUDA, ("transformer",)) == {"upsampler": GIB}
    assert fit.device_weights(est, "upsampler", kept, CUDA, ("transformer",)) == {"upsampler": GIB,
                                                                                  "transformer": 10 * GIB}
    assert fit.peak_of(est, plain, CUDA).stage == "stage1"  # 10 + 1
    peak = fit.peak_of(est, kept, CUDA)
    assert (peak.stage, peak.weight_bytes, peak.activation_bytes) == ("latent_upsampler", 11 * GIB, 2 * GIB)


@pytest.mark.parametrize("device_gib, keep", [(15.0, True), (13.0, False)])
def test_the_plan_holds_the_transformer_where_it_fits(device_gib: float, keep: bool) -> None:
    """Model offload copies the transformer twice a request (stage 1 and 2); held through the upsampler, once.
    Holding needs 10 + 1 + 2 GiB in the transition (x1.1 + 0.25 = 14.55 GiB): taken at 15 GiB, not at 13."""
    result = plan_offload(config(), [(1, 1, 1)], CUDA, two_stage_estimate, limit(device_gib), limit(64),
                          lambda off: 1, steps_per_request=4)
    assert result.offload.mode == "model" and result.offload.keep_across_stages is keep
    rows = {r.name: r for r in plan_report.module_rows(result.chosen, CUDA)}
    if rows["transformer"].placement != "resident":
        assert rows["transformer"].copy_request_bytes == (1 if keep else 2) * 10 * GIB
