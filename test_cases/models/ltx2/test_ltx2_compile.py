"""Regional compile of the LTX-2 transformer on the CPU (torch's `eager` backend: it traces and
guards like inductor without generating kernels): warmup compiles both stages' shapes, after
which a request at a warmup shape compiles nothing and gives exactly the uncompiled output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.ltx2.runner import LTX2Runner

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ltx2" / "ltx2_t2av_tiny.json"

pytestmark = pytest.mark.usefixtures("fresh_compiler")


def outputs(runner: LTX2Runner, out: Path, index: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = out / f"r{index}.safetensors"
    prof = runner.run_pipeline(RequestConfig(prompt="a lighthouse at night", seed=4, save_tensor_path=str(path)), index)
    return prof.audit, load_file(str(path))


def test_after_warmup_a_request_compiles_nothing_and_equals_eager(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    eager = LTX2Runner(load_runner_config(CONFIG, {"device": "cpu"}))
    eager.init_modules()
    _, expected = outputs(eager, tmp_path, 0)
    compiled = LTX2Runner(load_runner_config(CONFIG, {"device": "cpu", "warmup": True,
                                                      "compile": {"enabled": True, "backend": "eager"}}))
    compiled.init_modules()
    assert compiled.profiler.warmup is not None and compiled.profiler.warmup["compilations"] >= 1
    audit, got = outputs(compiled, tmp_path, 1)
    assert (audit["compilations"], audit["recompilations"]) == (0, 0), audit
    assert torch.equal(got["video"], expected["video"]) and torch.equal(got["audio"], expected["audio"])
