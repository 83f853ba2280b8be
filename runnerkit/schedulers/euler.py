"""Flow-matching Euler scheduler (first order, no history)."""

from __future__ import annotations

import numpy as np
import torch

from runnerkit.schedulers.base import Scheduler, shift_sigmas


class FlowEulerScheduler(Scheduler):
    """Euler integration of the flow-matching ODE: `x(sigma') = x(sigma) + (sigma' - sigma) * v`.

    Source: flow matching (Lipman et al. 2022) / rectified flow (Liu et al. 2022) with the SD3
    time shift (Esser et al. 2024). The update is computed in float32 like diffusers' (same
    values bit for bit on the CPU). Both spacings apply, so `euler` and `unipc` can sample the
    same sigmas:

    - `spacing="train_range"`: `spacing.train_range_schedule` (the grid the reference UniPC
      scheduler computes), with int64 timesteps as that reference gives every solver.
    - `spacing="diffusers"`: diffusers' `FlowMatchEulerDiscreteScheduler(num_train_timesteps,
      shift=shift)` exactly (diffusers 0.42): the training table `shift(t / N)` for t = N .. 1
      gives `sigma_max` (1 for any shift) and `sigma_min = shift(1 / N)`; the request's
      timesteps are `linspace(sigma_max * N, sigma_min * N, infer_steps)`, and their sigmas
      `t / N` are shifted again. So the last non-zero sigma is the shift applied twice to 1 / N,
      as in diffusers. Timesteps are float32 `sigma * N` (not rounded), as diffusers gives them.

    Either way a final sigma 0 is appended, so the last step lands on the x0 prediction.
    """

    keeps_history = False

    def _diffusers_schedule(self, infer_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_train_timesteps
        # Ends of diffusers' training table, computed as it does: in float32 torch.
        table_ends = torch.tensor([float(n), 1.0], dtype=torch.float32) / n
        sigma_max, sigma_min = shift_sigmas(table_ends, self.shift).tolist()
        # The request's schedule, in float64 numpy as diffusers computes it, then float32.
        timesteps = np.linspace(sigma_max * n, sigma_min * n, infer_steps)
        sigmas = torch.from_numpy(shift_sigmas(timesteps / n, self.shift)).to(torch.float32)  # [S]
        timesteps = sigmas * n  # [S] float32
        sigmas = torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])  # [S + 1]
        return sigmas, timesteps

    def _update(self, velocity: torch.Tensor) -> torch.Tensor:
        i = self.step_index
        # float32 difference of two float32 sigmas; exact as a Python float.
        dt = float(self.sigmas[i + 1] - self.sigmas[i])
        return self.latents + dt * velocity

    def reset_history(self) -> None:
        """Nothing to drop: every Euler step depends only on the current latents and velocity."""
        return None
