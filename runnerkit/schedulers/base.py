"""The scheduler contract: a scheduler owns one request's denoising state.

A request drives a scheduler with a few verbs in one order (ARCHITECTURE §2):

```
scheduler.prepare(latent_shape, infer_steps, seed, device, dtype)   # noise, sigmas, timesteps
for i in range(infer_steps):
    latents, timestep = scheduler.step_pre(i)                       # model inputs of step i
    noise_pred = ...                                                # the runner's model call(s), CFG
    scheduler.step_post(noise_pred)                                 # update latents, advance
video_latents = scheduler.latents                                   # [B, C, F, H, W] float32
scheduler.clear()                                                   # back to the fresh state
```

The scheduler holds the latents, sigmas, timesteps, solver history and the request's CPU
`torch.Generator`; the model output reaches it only as the argument of `step_post`, and it never
holds the model. Warmup may jump straight to a later step with `set_step` (ARCHITECTURE §3).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from loguru import logger

from runnerkit.schedulers.spacing import SPACINGS, Spacing, shift_sigmas, train_range_schedule

__all__ = ["Scheduler", "shift_sigmas"]


class Scheduler(abc.ABC):
    """Base of runnerkit's flow-matching schedulers; owns one request's denoising state.

    Flow matching (Lipman et al. 2022; rectified flow, Liu et al. 2022) writes the noisy latents
    at noise level `sigma` as `x = (1 - sigma) * x0 + sigma * noise`, and the model predicts the
    velocity `v = noise - x0`. A scheduler integrates from `sigma ~ 1` down to `sigma = 0`.

    Request state (all dropped by `clear()`):
        latents: `[B, C, F, H, W]` float32 on the request's device, or None before `prepare`.
        sigmas: `[infer_steps + 1]` float32 on the CPU (the last one is 0), or None.
        timesteps: `[infer_steps]` on the request's device, as the model takes them, or None.
            Both come from the scheduler's `spacing` (runnerkit/schedulers/spacing.py).
        generator: the request's CPU `torch.Generator`, or None.
        step_index: the step `step_pre`/`step_post` act on next (0 .. infer_steps).
        infer_steps: number of denoising steps of the request (0 before `prepare`).
        model_dtype: dtype `step_pre` returns the latents in, or None.
        plus the solver history of subclasses that keep one (see `reset_history`).

    Subclasses implement `_diffusers_schedule` (sigmas and timesteps of the `"diffusers"`
    spacing: what diffusers' scheduler of the same solver gives), `_update` (one step of the
    solver) and `reset_history`, and declare `keeps_history`. The `"train_range"` spacing is shared by
    every solver (`spacing.train_range_schedule`).
    """

    keeps_history: ClassVar[bool]
    """True if the update at step i depends on earlier steps (multistep solvers). Warmup resets
    such a scheduler between non-consecutive steps."""

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 5.0, *, spacing: Spacing,
                 sigmas: Sequence[float] | None = None) -> None:
        """Build a scheduler with no request state.

        Args:
            num_train_timesteps: timesteps of the training schedule (e.g. 1000); the model's
                timestep is `sigma * num_train_timesteps`.
            shift: SD3 time shift of the sigmas (a family default, e.g. 5.0).
            spacing: where sigmas and timesteps come from (runnerkit/schedulers/spacing.py):
                `"train_range"` (over the training range, `spacing.train_range_schedule`) or `"diffusers"` (diffusers'
                scheduler of the same solver). No default: the two give different outputs, and
                the choice belongs to the model family (config `scheduler_spacing`).
            sigmas: a fixed table of sigmas, one per step, used as given (no shift, no spacing):
                the trained schedule of a step-distilled model (e.g. 8 values from 1.0 down). A
                request must then run exactly `len(sigmas)` steps; timesteps are
                `float32(sigma) * num_train_timesteps`, and a final sigma 0 is appended, as
                diffusers' `FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...)` gives them
                with `shift` 1 and no dynamic shifting.

        Raises:
            ValueError: `num_train_timesteps` < 1 (< 2 with the "train_range" spacing, whose training
                sigmas would all be 0), `shift` <= 0, an unknown `spacing`, or `sigmas` empty, outside
                (0, 1] or not strictly decreasing.
        """
        if not isinstance(num_train_timesteps, int) or num_train_timesteps < 1:
            raise ValueError(f"`num_train_timesteps` must be an integer >= 1, got {num_train_timesteps!r}")
        if not shift > 0:
            raise ValueError(f"`shift` must be > 0, got {shift!r}")
        if spacing not in SPACINGS:
            raise ValueError(f"`spacing` must be one of {list(SPACINGS)}, got {spacing!r}")
        if spacing == "train_range" and num_train_timesteps < 2:
            raise ValueError(f"`num_train_timesteps` must be >= 2 with spacing 'train_range', "
                             f"got {num_train_timesteps!r}")
        if sigmas is not None:
            table = [float(x) for x in sigmas]
            if not table or not all(0 < x <= 1 for x in table) or any(b >= a for a, b in zip(table, table[1:])):
                raise ValueError(f"`sigmas` must be a non-empty, strictly decreasing table of values in (0, 1], "
                                 f"got {list(sigmas)!r}")
        self.fixed_sigmas: tuple[float, ...] | None = tuple(float(x) for x in sigmas) if sigmas is not None else None
        self.num_train_timesteps = num_train_timesteps
        self.shift = float(shift)
        self.spacing: Spacing = spacing
        self._reset_request_state()

    # ---------------------------------------------------------------- subclass hooks

    @abc.abstractmethod
    def _diffusers_schedule(self, infer_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `"diffusers"` spacing: `(sigmas [infer_steps + 1] float32, timesteps [infer_steps])`
        on the CPU, as diffusers' scheduler of the same solver gives them."""

    @abc.abstractmethod
    def _update(self, velocity: torch.Tensor) -> torch.Tensor:
        """Return the latents at `sigmas[step_index + 1]` from the float32 `velocity` of this step."""

    @abc.abstractmethod
    def reset_history(self) -> None:
        """Drop the solver history only, keeping latents, sigmas, timesteps and the generator.

        The next `step_post` then runs the solver's first-order update, as at the start of a
        request. Warmup calls it (or `set_step`) before running a non-consecutive step.
        """

    # ---------------------------------------------------------------- lifecycle

    def _check_prepare(self, latent_shape: tuple[int, ...], infer_steps: int, dtype: torch.dtype,
                       init_latents: torch.Tensor | None, strength: float,
                       noise_shapes: Sequence[tuple[int, ...]] | None) -> tuple[int, list[tuple[int, ...]]]:
        """`prepare`'s arguments checked (its Raises); returns the steps `strength` skips and the noise parts
        (`noise_shapes`, or `latent_shape` alone)."""
        if not isinstance(infer_steps, int) or infer_steps < 1:
            raise ValueError(f"`infer_steps` must be an integer >= 1, got {infer_steps!r}")
        if len(latent_shape) == 0 or not all(isinstance(d, int) and d > 0 for d in latent_shape):
            raise ValueError(f"`latent_shape` must be a non-empty tuple of integers > 0, got {latent_shape!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating-point dtype, got {dtype}")
        if init_latents is not None and tuple(init_latents.shape) != tuple(latent_shape):
            raise ValueError(f"`init_latents` must have shape {tuple(latent_shape)}, got {tuple(init_latents.shape)}")
        skip = infer_steps - round(infer_steps * strength)
        if not 0 < strength <= 1 or skip >= infer_steps:
            raise ValueError(f"`strength` must be in (0, 1] and leave at least one of {infer_steps} steps, got {strength!r}")
        if init_latents is None and strength != 1.0:
            raise ValueError(f"`strength` {strength!r} needs `init_latents` (pure noise always runs the whole schedule)")
        if self.fixed_sigmas is not None and infer_steps != len(self.fixed_sigmas):
            raise ValueError(f"`infer_steps` must be {len(self.fixed_sigmas)}: the scheduler runs a fixed table of "
                             f"{len(self.fixed_sigmas)} sigmas {list(self.fixed_sigmas)}, got {infer_steps!r}")
        parts = [tuple(latent_shape)] if noise_shapes is None else [tuple(p) for p in noise_shapes]
        if noise_shapes is not None and (
                not parts or any(len(p) < 1 or p[0] != latent_shape[0] or min(p) <= 0 for p in parts)
                or sum(math.prod(p) for p in parts) != math.prod(latent_shape)):
            raise ValueError(f"`noise_shapes` {parts!r} must share the batch dim of `latent_shape` "
                             f"{tuple(latent_shape)} and hold as many elements in all")
        return skip, parts

    def prepare(
        self,
        latent_shape: tuple[int, ...],
        infer_steps: int,
        seed: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        init_latents: torch.Tensor | None = None,
        strength: float = 1.0,
        noise_shapes: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        """Start a request (or a later denoise stage): draw the noise, compute sigmas and timesteps.

        The noise is drawn in float32 on the CPU from `self.generator` and then moved to
        `device`, so one seed gives the same noise on every device. If `self.generator` is None
        it is created here as `torch.Generator("cpu").manual_seed(seed)`; if an encoder of the
        same request already created it (and drew from it), it is reused as it is and `seed` is
        not applied again, which keeps the request's order of random draws.

        Args:
            latent_shape: `(B, C, F, H, W)` of the latents (any rank >= 1; dim 0 is the batch).
            infer_steps: number of denoising steps (>= 1).
            seed: the request's seed, used only when `self.generator` is None.
            device: device of the latents and timesteps.
            dtype: the model's dtype; `step_pre` returns the latents in it. The latents
                themselves stay float32 for the update math.
            init_latents: `latent_shape` latents to start from (a later stage of a multi-stage
                pipeline, e.g. after a latent upsampler), or None to start from pure noise.
            strength: with `init_latents`, the fraction of the `infer_steps` schedule that runs
                (as diffusers' image-to-image: the first `infer_steps - round(infer_steps *
                strength)` steps are skipped); the start is the flow-matching forward process at
                the first remaining sigma, `(1 - sigma) * init_latents + sigma * noise`.
            noise_shapes: latents made of several parts (e.g. video and audio tokens): the noise
                is drawn as one `randn` per shape, in order, each flattened after the batch dim
                and the parts concatenated, then viewed as `latent_shape` (the numbers of elements
                must add up). This reproduces a reference that draws each part's noise in its own
                shape from one generator. None: one draw of `latent_shape`.

        Raises:
            ValueError: `infer_steps` < 1, a dim of `latent_shape` <= 0, `dtype` not floating,
                `init_latents` of another shape, `strength` outside (0, 1] or leaving no step,
                `noise_shapes` whose batch dims or sizes do not make `latent_shape`, or a fixed
                `sigmas` table of another length than `infer_steps`.
        """
        skip, parts = self._check_prepare(latent_shape, infer_steps, dtype, init_latents, strength, noise_shapes)

        generator = self.generator
        self._reset_request_state()
        if generator is None:
            generator = torch.Generator("cpu").manual_seed(seed)
        self.generator = generator

        draws = [torch.randn(p, generator=generator, dtype=torch.float32, device="cpu") for p in parts]
        batch = latent_shape[0]
        noise = (draws[0] if len(draws) == 1 else torch.cat([d.reshape(batch, -1) for d in draws], dim=1))
        noise = noise.reshape(tuple(latent_shape))
        sigmas, timesteps = self._schedule(infer_steps)
        sigmas, timesteps = sigmas[skip:], timesteps[skip:]  # [S' + 1], [S']
        if init_latents is None:
            self.latents = noise.to(device=device)
        else:
            sigma = float(sigmas[0])
            self.latents = (1.0 - sigma) * init_latents.to(device=device, dtype=torch.float32) + sigma * noise.to(device)
        self.sigmas = sigmas
        self.timesteps = timesteps.to(device=device)
        self.infer_steps = infer_steps - skip
        self.model_dtype = dtype
        logger.debug(
            f"{type(self).__name__}.prepare: latents {tuple(latent_shape)}, {infer_steps} steps, "
            f"shift {self.shift}, spacing {self.spacing}, device {device}, model dtype {dtype}"
        )

    def step_pre(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the model inputs of step `i`.

        Args:
            i: the step to run; must equal `self.step_index` (steps run in order; use `set_step`
                to jump).

        Returns:
            latents: `[B, C, F, H, W]` in the model dtype given to `prepare`. When that dtype is
                float32 this is the scheduler's own tensor: treat it as read-only.
            timestep: `[B]` on the latents' device, `timesteps[i]` repeated over the batch
                (int64 with the "train_range" spacing and diffusers' UniPC; float32 with diffusers' Euler:
                as each reference gives them).

        Raises:
            RuntimeError: `prepare` was not called.
            ValueError: `i` is not the current step index, or every step is already done.
        """
        self._check_prepared("step_pre")
        if self.step_index >= self.infer_steps:
            raise ValueError(f"`i` = {i!r}: all {self.infer_steps} steps are done; call prepare() for a new request")
        if i != self.step_index:
            raise ValueError(
                f"`i` must equal the current step index {self.step_index} (steps run in order; "
                f"use set_step() to jump), got {i!r}"
            )
        batch = self.latents.shape[0]
        return self.latents.to(self.model_dtype), self.timesteps[i].repeat(batch)

    def step_post(self, noise_pred: torch.Tensor) -> None:
        """Take the model output of the current step, update the latents and advance one step.

        Args:
            noise_pred: `[B, C, F, H, W]` flow velocity predicted at `sigmas[step_index]` (after
                CFG), any floating dtype, on the latents' device; it is upcast to float32 and
                not kept beyond what the solver history needs.

        Raises:
            RuntimeError: `prepare` was not called.
            ValueError: every step is already done, or `noise_pred` has another shape.
        """
        self._check_prepared("step_post")
        if self.step_index >= self.infer_steps:
            raise ValueError(f"all {self.infer_steps} steps are done; step_post got one more `noise_pred`")
        if noise_pred.shape != self.latents.shape:
            raise ValueError(
                f"`noise_pred` must have the latents' shape {tuple(self.latents.shape)}, got {tuple(noise_pred.shape)}"
            )
        self.latents = self._update(noise_pred.to(torch.float32))
        self.step_index += 1

    def set_latents(self, latents: torch.Tensor) -> None:
        """Continue from `latents` instead of the start `prepare` drew (the runner passes what a family's
        `condition_latents` returned, e.g. with an image's clean first frame; the same tensor changes nothing).

        Args:
            latents: the prepared latents' shape, float32, on their device.

        Raises:
            RuntimeError: `prepare` was not called.
            ValueError: another shape, dtype or device than the prepared latents'.
        """
        self._check_prepared("set_latents")
        old = self.latents
        if latents.shape != old.shape or latents.dtype != old.dtype or latents.device != old.device:
            raise ValueError(f"`latents` must match the prepared latents ({tuple(old.shape)}, {old.dtype}, "
                             f"{old.device}), got ({tuple(latents.shape)}, {latents.dtype}, {latents.device})")
        self.latents = latents

    def set_step(self, i: int) -> None:
        """Jump to step `i` (warmup runs a representative later step right after `prepare`).

        Jumping to another step than the current one drops the solver history
        (`reset_history`), so the next `step_post` is the solver's first-order update from
        `sigmas[i]` to `sigmas[i + 1]`; for flow matching that is the Euler step
        `latents + (sigmas[i + 1] - sigmas[i]) * noise_pred`. The latents are kept as they are
        (warmup does not need them to match `sigmas[i]`). `set_step(step_index)` changes nothing.

        Args:
            i: the step to run next, 0 <= i < infer_steps.

        Raises:
            RuntimeError: `prepare` was not called.
            ValueError: `i` is out of range.
        """
        self._check_prepared("set_step")
        if not isinstance(i, int) or not 0 <= i < self.infer_steps:
            raise ValueError(f"`i` must be an integer in [0, {self.infer_steps - 1}], got {i!r}")
        if i != self.step_index:
            self.reset_history()
            self.step_index = i

    def clear(self) -> None:
        """Drop all request state (latents, sigmas, timesteps, history, generator, step index).

        Afterwards the scheduler is exactly as freshly constructed (same attributes and values).
        """
        self._reset_request_state()

    # ---------------------------------------------------------------- helpers

    def _schedule(self, infer_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(sigmas [infer_steps + 1] float32, timesteps [infer_steps])` of `self.spacing`, on the CPU."""
        if self.fixed_sigmas is not None:
            sigmas = torch.tensor([*self.fixed_sigmas, 0.0], dtype=torch.float32)  # [S + 1]
            return sigmas, sigmas[:-1] * self.num_train_timesteps
        if self.spacing == "train_range":
            return train_range_schedule(infer_steps, self.shift, self.num_train_timesteps)
        return self._diffusers_schedule(infer_steps)

    def _reset_request_state(self) -> None:
        # The one place the request state is defined, so `__init__` and `clear` agree exactly.
        self.latents: torch.Tensor | None = None
        self.sigmas: torch.Tensor | None = None
        self.timesteps: torch.Tensor | None = None
        self.generator: torch.Generator | None = None
        self.step_index: int = 0
        self.infer_steps: int = 0
        self.model_dtype: torch.dtype | None = None
        self.reset_history()

    def _check_prepared(self, verb: str) -> None:
        if self.latents is None:
            raise RuntimeError(f"{type(self).__name__}.{verb}() called before prepare()")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_train_timesteps={self.num_train_timesteps}, shift={self.shift}, "
            f"spacing={self.spacing!r}, "
            f"step {self.step_index}/{self.infer_steps})"
        )
