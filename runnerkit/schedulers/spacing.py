"""Sigma spacings: where a request's sigmas and timesteps come from, apart from the solver.

Two spacings of the same flow-matching schedule, each reproduced bit for bit from a public
implementation; one model, seed and step count gives visibly different videos under each:

- `"train_range"`: unshifted sigmas spaced over the training range, from its largest sigma
  `1 - 1/N` down to 0, shifted once (the `FlowUniPCMultistepScheduler.set_timesteps` of the
  flow-matching reference releases, built with `shift=1` and given the real shift at
  `set_timesteps`). See `train_range_schedule`.
- `"diffusers"`: what diffusers' scheduler of the same solver does (`UniPCMultistepScheduler`
  with `use_flow_sigmas=True`, `FlowMatchEulerDiscreteScheduler`); each scheduler class
  implements it as `_diffusers_schedule`.

A spacing is named after what it does (or the library it reproduces); which one a model family
samples with by default is the family's choice (its `DEFAULTS`, config key
`scheduler_spacing`).
"""

from __future__ import annotations

from typing import Literal, TypeVar, get_args

import numpy as np
import torch

Spacing = Literal["train_range", "diffusers"]
SPACINGS: tuple[str, ...] = get_args(Spacing)
"""The spacing names a scheduler accepts (and the config key `scheduler_spacing` allows)."""

ArrayOrTensor = TypeVar("ArrayOrTensor")


def shift_sigmas(sigmas: ArrayOrTensor, shift: float) -> ArrayOrTensor:
    """Apply the SD3 time shift `sigma' = shift * sigma / (1 + (shift - 1) * sigma)`.

    Source: Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution Image
    Synthesis" (SD3), as flow-matching video releases and diffusers use it. `shift > 1` spends more
    steps at high noise. Works on numpy arrays and tensors alike and keeps their dtype, so a
    schedule can be reproduced in the same precision as the reference computes it.

    Args:
        sigmas: noise levels in [0, 1], any shape.
        shift: the shift factor (> 0); 1 leaves the sigmas unchanged.

    Returns:
        The shifted sigmas, same shape, type and dtype.
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def train_range_schedule(infer_steps: int, shift: float,
                         num_train_timesteps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmas and timesteps for `infer_steps` steps spaced over the training range, then shifted.

    Source: the `FlowUniPCMultistepScheduler.__init__` and `.set_timesteps` of the flow-matching
    UniPC port that a release ships with its own inference code (the family that selects this
    spacing names the release and file: runnerkit/models/<family>/, e.g. scheduler_config.py).
    With N = `num_train_timesteps`:

    1. The training sigmas are `1 - linspace(1, 1/N, N)[::-1]`, stored in float32 and not
       shifted (the reference builds its scheduler with `shift=1`): they run from
       `sigma_max = float32(1 - 1/N)` (0.999 for N = 1000) down to `sigma_min = 0`.
    2. The request's unshifted sigmas are `linspace(sigma_max, sigma_min, S + 1)[:-1]` in float64,
       then shifted once in float64 (`shift_sigmas`). The first sigma stays below 1 (0.9998 with
       shift 5), so no clamping is needed for `log(1 - sigma)`.
    3. Timesteps are `int64(sigma * N)`, truncated toward zero, from the float64 sigmas.
    4. Sigmas are cast to float32 and a final 0 is appended (`final_sigmas_type="zero"`).

    diffusers' UniPC instead spaces `linspace(1, 1/N, S + 1)[:-1]` before the shift (and lowers a
    first sigma of 1 by 1e-6); after the shift the two differ most near the end of the schedule
    (50 steps, shift 5: last timestep 92 here, 96 in diffusers).

    Args:
        infer_steps: S, the number of denoising steps (>= 1).
        shift: SD3 time shift (> 0).
        num_train_timesteps: N (>= 2).

    Returns:
        sigmas `[S + 1]` float32 (the last one 0) and timesteps `[S]` int64, both on the CPU.
    """
    n = num_train_timesteps
    sigma_max = float(np.float32(1.0 - 1.0 / n))  # the largest training sigma, as float32 holds it
    sigma_min = 0.0  # the smallest training sigma: 1 - 1
    sigmas = shift_sigmas(np.linspace(sigma_max, sigma_min, infer_steps + 1)[:-1], shift)  # [S] float64
    timesteps = torch.from_numpy((sigmas * n).astype(np.int64))  # [S], truncated
    sigmas = torch.from_numpy(np.append(sigmas, 0.0).astype(np.float32))  # [S + 1]
    return sigmas, timesteps
