"""The sampling shift a Wan2.1 checkpoint folder declares for itself.

The diffusers releases (Wan-AI/Wan2.1-T2V-*-Diffusers) ship `scheduler/scheduler_config.json`
for their `UniPCMultistepScheduler`, whose `flow_shift` is the shift the release samples with
(diffusers documents 3.0 as Wan's default there; Wan2.1's `generate.py` uses 5.0 for t2v). The
original releases and runnerkit's own layout declare none.

Precedence of `sample_shift` (WanT2VRunner.prepare_load): the run config's own value, else this
file's `flow_shift`, else the family default (`WanT2VRunner.DEFAULTS`).

Sources of the Wan family's sampling schedule (the core's schedulers name no family):
`scheduler_spacing: "train_range"` (the family default) reproduces Wan-Video/Wan2.1
`wan/utils/fm_solvers_unipc.py` `FlowUniPCMultistepScheduler.__init__` and `.set_timesteps`
as `wan/text2video.py` calls them (a scheduler built with `shift=1`, then
`set_timesteps(steps, shift=sample_shift)`; its `dpm++` path passes its own sigmas, and runnerkit
has no DPM++); `"diffusers"` is what diffusers' `WanPipeline` samples with. Golden values:
test_cases/schedulers/test_spacing.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from runnerkit.weights import CheckpointError, read_json_object

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"
"""Where a diffusers pipeline folder keeps its scheduler's config."""


def read_flow_shift(folder: Path) -> float | None:
    """`flow_shift` of `folder`'s `scheduler/scheduler_config.json` (a diffusers pipeline folder).

    Args:
        folder: the checkpoint folder (diffusers layout).

    Returns:
        The shift (> 0), or None when the file is absent or has no `flow_shift` key.

    Raises:
        CheckpointError: the file is not a JSON object, or `flow_shift` is not a finite number > 0
            (the message names the file and the value).
    """
    path = folder / SCHEDULER_CONFIG
    if not path.is_file():
        return None
    data = read_json_object(path, "scheduler")
    if "flow_shift" not in data:
        return None
    value = data["flow_shift"]
    # bool is an int in Python; a `true` here is a broken file, not a shift of 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"`flow_shift` in {str(path)!r} must be a number > 0 (got {value!r})")
    return float(value)


SYNTHETIC_FLOW_SHIFT = 3.0
"""`flow_shift` written into synthetic diffusers-layout checkpoints (diffusers documents 3.0 as Wan's
default there); it differs from the family default 5.0, so tests can tell which one a run used."""


def write_scheduler_config(folder: Path, flow_shift: float = SYNTHETIC_FLOW_SHIFT) -> Path:
    """Write `folder/scheduler/scheduler_config.json` as a diffusers Wan2.1 release holds it.

    diffusers' `UniPCMultistepScheduler.from_pretrained(folder, subfolder="scheduler")` reads it
    back as the flow-matching UniPC of `WanPipeline`.

    Returns:
        The path written.
    """
    path = folder / SCHEDULER_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "prediction_type": "flow_prediction",
        "use_flow_sigmas": True, "flow_shift": flow_shift, "solver_order": 2, "solver_type": "bh2", "predict_x0": True,
        "lower_order_final": True, "disable_corrector": [], "final_sigmas_type": "zero"}, indent=1))
    return path
