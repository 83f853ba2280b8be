"""Flow-matching UniPC multistep scheduler (predictor UniP + corrector UniC, B(h) = bh2)."""

from __future__ import annotations

from collections.abc import Sequence

import math

import numpy as np
import torch

from runnerkit.schedulers.base import Scheduler, shift_sigmas
from runnerkit.schedulers.spacing import Spacing


def _log_snr(sigma: float) -> float:
    """Half log-SNR `lambda = log(alpha / sigma)` of flow matching, where `alpha = 1 - sigma`.

    +inf at `sigma = 0` (clean data), which the update formulas handle through
    `expm1(-inf) = -1`.
    """
    if sigma == 0.0:
        return math.inf
    return math.log(1.0 - sigma) - math.log(sigma)


class FlowUniPCScheduler(Scheduler):
    """UniPC multistep solver for flow matching (predictor UniP + corrector UniC).

    Source: Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling
    of Diffusion Models", in its data-prediction form (the model's velocity `v` becomes
    `x0 = x - sigma * v`) with `B(h) = expm1(-h)` ("bh2"). Each `step_post` at step i:

    1. converts the velocity to `x0_i`;
    2. corrector UniC: if step i - 1 ran in the current history, it refines the latents at
       `sigmas[i]` with `x0_i` (order of step i - 1's predictor);
    3. predictor UniP: from the (corrected) latents to `sigmas[i + 1]` with the last
       `order` x0 predictions, where `order = min(solver_order, steps run in this history,
       infer_steps - i)` (the last step is first order, "lower_order_final").

    The update is the same in diffusers' `UniPCMultistepScheduler(prediction_type=
    "flow_prediction", use_flow_sigmas=True, flow_shift=shift, solver_order, predict_x0=True,
    solver_type="bh2", lower_order_final=True, disable_corrector=[], final_sigmas_type="zero")`
    (diffusers 0.42) and in the `FlowUniPCMultistepScheduler` that releases ship with their own
    inference code (a port of diffusers 0.31 with the same defaults; the family that uses it names
    the file): the
    corrector runs at every step after the first, rho = 1/2 for UniC-1 and UniP-2, the order
    drops to 1 on the last step. The two differ only in their sigmas, chosen by `spacing`
    (runnerkit/schedulers/spacing.py):

    - `"train_range"`: the port's `set_timesteps(infer_steps, shift=shift)` on a scheduler built
      with `shift=1`, as the releases' generate code does: `shift(linspace(1 - 1/N, 0, infer_steps +
      1)[:-1])`, a final 0, int64 timesteps `trunc(sigma * N)`. What the official release
      samples with.
    - `"diffusers"`: `shift(linspace(1, 1/N, infer_steps + 1)[:-1])`, the first one lowered by
      1e-6 when it equals 1 (so `log(1 - sigma)` stays finite), a final 0, int64 timesteps
      `trunc(sigma * N)`. What diffusers' pipelines sample with.

    Before the shift the two grids are at most 1/N apart, but the shift stretches that near the
    end of the schedule: with 50 steps and shift 5 the timesteps differ by up to 4 (last
    timestep 92 vs 96), and the final latents move far beyond float rounding (1.7e-3 with the
    smooth stand-in model of test_cases/schedulers/test_spacing.py).

    Coefficients are computed in float64 from the float32 sigmas; the latents update is float32.
    Solver history: `model_outputs` (the last `solver_order` x0 predictions, oldest first),
    `last_sample` (latents before the last predictor, for the corrector) and `last_order`.
    """

    keeps_history = True

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 5.0, solver_order: int = 2, *,
                 spacing: Spacing, sigmas: Sequence[float] | None = None) -> None:
        """Build the scheduler.

        Args:
            num_train_timesteps: timesteps of the training schedule (e.g. 1000).
            shift: SD3 time shift of the sigmas (a family default, e.g. 5.0).
            solver_order: 2 (the references' choice) or 1 (predictor and corrector of first order).
            spacing: `"train_range"` or `"diffusers"` (see the class docstring).
            sigmas: a fixed sigma table used as given (`Scheduler.__init__`).

        Raises:
            ValueError: `solver_order` not in (1, 2), a `sigmas` table that starts at 1 (the log-SNR is
                -inf there), or a base argument out of range.
        """
        if solver_order not in (1, 2):
            raise ValueError(f"`solver_order` must be 1 or 2, got {solver_order!r}")
        if sigmas is not None and len(sigmas) and float(sigmas[0]) >= 1:
            raise ValueError(f"UniPC needs every sigma below 1 (its log-SNR is -inf at 1), got `sigmas` starting at "
                             f"{sigmas[0]!r}")
        self.solver_order = solver_order
        super().__init__(num_train_timesteps=num_train_timesteps, shift=shift, spacing=spacing, sigmas=sigmas)

    def reset_history(self) -> None:
        """Drop the solver history (x0 predictions, corrector input), keeping latents and sigmas.

        The next `step_post` then skips the corrector and runs a first-order predictor, which for
        flow matching equals the Euler step `latents + (sigmas[i + 1] - sigmas[i]) * noise_pred`.
        """
        self.model_outputs: list[torch.Tensor] = []
        self.last_sample: torch.Tensor | None = None
        self.last_order: int = 0

    def _diffusers_schedule(self, infer_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_train_timesteps
        # float64 numpy as diffusers computes it; float32 only at the end.
        sigmas = shift_sigmas(np.linspace(1.0, 1.0 / n, infer_steps + 1)[:-1], self.shift)  # [S]
        if abs(sigmas[0] - 1.0) < 1e-6:
            sigmas[0] -= 1e-6  # alpha = 1 - sigma must stay > 0 for log-SNR
        timesteps = torch.from_numpy((sigmas * n).astype(np.int64))  # [S], truncated like diffusers
        sigmas = torch.from_numpy(np.append(sigmas, 0.0).astype(np.float32))  # [S + 1]
        return sigmas, timesteps

    def _update(self, velocity: torch.Tensor) -> torch.Tensor:
        i = self.step_index
        sigmas = self.sigmas.tolist()
        sample = self.latents
        # 1. data prediction of this step, from the uncorrected latents
        x0 = sample - sigmas[i] * velocity

        # 2. corrector: refine the latents the previous predictor produced
        if self.last_sample is not None:
            sample = self._uni_c(x0, sigmas)

        # 3. history, then predictor to sigmas[i + 1]
        self.model_outputs = [*self.model_outputs, x0][-self.solver_order :]
        order = min(self.solver_order, len(self.model_outputs), self.infer_steps - i)
        self.last_sample = sample
        self.last_order = order
        return self._uni_p(sample, order, sigmas)

    def _uni_p(self, sample: torch.Tensor, order: int, sigmas: list[float]) -> torch.Tensor:
        """UniP-`order` from `sigmas[i]` to `sigmas[i + 1]`; `model_outputs[-1]` is x0 at step i."""
        i = self.step_index
        sigma_s, sigma_t = sigmas[i], sigmas[i + 1]
        alpha_t = 1.0 - sigma_t
        lambda_s = _log_snr(sigma_s)
        h = _log_snr(sigma_t) - lambda_s
        b_h = math.expm1(-h)  # bh2; also h * phi_1(-h)
        m0 = self.model_outputs[-1]
        # first-order part (sigma_t / sigma_s is 0 on the final step: the result is x0)
        x_t = (sigma_t / sigma_s) * sample - (alpha_t * b_h) * m0
        if order == 2:
            r = (_log_snr(sigmas[i - 1]) - lambda_s) / h
            d1 = (self.model_outputs[-2] - m0) / r
            # UniP-2 uses rho = 1/2 for its single difference term (as the UniPC reference code)
            x_t = x_t - (alpha_t * b_h * 0.5) * d1
        return x_t

    def _uni_c(self, x0_t: torch.Tensor, sigmas: list[float]) -> torch.Tensor:
        """UniC-`last_order` correction of the latents at `sigmas[i]`, from `last_sample` at `sigmas[i - 1]`."""
        i = self.step_index
        sigma_s, sigma_t = sigmas[i - 1], sigmas[i]
        alpha_t = 1.0 - sigma_t
        lambda_s = _log_snr(sigma_s)
        h = _log_snr(sigma_t) - lambda_s
        hh = -h
        b_h = math.expm1(hh)
        m0 = self.model_outputs[-1]  # x0 at step i - 1
        d1_t = x0_t - m0
        x_t = (sigma_t / sigma_s) * self.last_sample - (alpha_t * b_h) * m0
        if self.last_order == 1:
            return x_t - (alpha_t * b_h * 0.5) * d1_t
        # Order 2: rho solves [[1, 1], [r, 1]] @ rho = [g1, g2], g_k = k! * hh * phi_{k+1}(hh) / B(h),
        # with the exponential-integrator functions phi_{k+1}(z) = (phi_k(z) - 1 / k!) / z.
        hphi_2 = math.expm1(hh) / hh - 1.0  # hh * phi_2(hh)
        hphi_3 = hphi_2 / hh - 0.5  # hh * phi_3(hh)
        g1, g2 = hphi_2 / b_h, 2.0 * hphi_3 / b_h
        r = (_log_snr(sigmas[i - 2]) - lambda_s) / h
        rho_hist = (g1 - g2) / (1.0 - r)
        rho_t = g1 - rho_hist
        d1 = (self.model_outputs[-2] - m0) / r
        return x_t - (alpha_t * b_h) * (rho_hist * d1 + rho_t * d1_t)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", solver_order={self.solver_order})"
