"""One request's state: the object every request hook of `DefaultRunner` receives.

`serve_request` (and warmup, per dummy request) creates one `RequestState`; the encoders, the denoise
stages, the transitions, the decoders and the save stage read and extend it, and hooks return what they
produce instead of writing it into the runner:

    req = RequestState(info)                       # the resolved request (pipeline.InputInfo)
    req.inputs = run_encoders(req)                 # the family's typed encoder outputs
    latents = run_denoise(req)                     # req.stage / req.generator follow the stages
    outputs = decode(req, latents)                 # {output key: tensor}
    save_outputs(req, outputs)

While a stage runs, `req.modules` holds the modules on the device for it (`module_on_device`). When the
request ends the object is dropped: nothing of the request remains on the runner (`end_run`; the family
contract, test_cases/family_contract.py, checks it for every family). `check_finite_latents` refuses a request's denoised latents
that hold NaN or Inf before they are decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runnerkit.runners.pipeline import DenoiseStage, InputInfo

__all__ = ["RequestState", "check_finite_latents"]


@dataclass(eq=False)
class RequestState:
    """What one request carries through the hooks (see the module docstring).

    Attributes:
        info: the request with every default resolved (warmup: a dummy request, `info.warmup` True).
        inputs: the family's encoder outputs so far (None before the first encoder stage).
        modules: module name -> module on the compute device, for the stage that runs now.
        generator: the request's CPU `torch.Generator` once its first random draw made it (None before):
            handed to each stage's scheduler before `prepare` and taken back after the stage.
        stage: the denoise stage running (its transition included), or None outside denoising.
        derived: values a family computes once per request from `info` (e.g. the latent layout of each stage),
            by name; the family owns the names.
        enhanced_prompt: the prompt the family's prompt enhancer wrote for `info.prompt` (`info.enhance_prompt`),
            which the text encoder read instead; None: not enhanced. The sidecar records it beside the prompt.
        step_log_level: loguru level of the per-step lines ("stage1 step 3/8"); "DEBUG" for the dummy requests
            of a family's warmup sweep, whose many one-step runs would flood the log.
    """

    info: InputInfo
    inputs: Any = None
    modules: dict[str, nn.Module] = field(default_factory=dict)
    generator: torch.Generator | None = None
    stage: DenoiseStage | None = None
    derived: dict[str, Any] = field(default_factory=dict)
    enhanced_prompt: str | None = None
    step_log_level: str = "INFO"

    @property
    def stage_index(self) -> int | None:
        """Index of the running denoise stage in the pipeline (0 for the first), or None outside denoising."""
        return None if self.stage is None else self.stage.index


def check_finite_latents(latents: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse denoised latents that hold NaN or Inf before they are decoded (one device sync per
    request or warmup shape). Decoded, they would give a video or image of noise, and the request
    would look successful. `dtype`: the transformer's compute dtype, named in the message.

    Raises:
        FloatingPointError: naming how many values are not finite, the dtype and the likely causes.
    """
    bad = int((~torch.isfinite(latents)).sum())
    if bad:
        raise FloatingPointError(
            f"the denoised latents {list(latents.shape)} hold {bad} non-finite values (NaN or Inf) of "
            f"{latents.numel()}: NaN or Inf in the checkpoint's weights (the transformer's, or an encoder's "
            f"that fed it) or in a LoRA, or an overflow in {str(dtype).removeprefix('torch.')}; nothing is "
            "decoded or saved")
