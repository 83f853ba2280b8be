"""Qwen-Image's sampling schedule: flow-matching Euler with resolution-dependent (dynamic) shifting.

Source: diffusers 0.42.1 `QwenImagePipeline.__call__` step 5 (pipelines/qwenimage/
pipeline_qwenimage.py; the Edit / Edit-Plus pipelines do the same) driving
`FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=...)`
(schedulers/scheduling_flow_match_euler_discrete.py). For S steps and a target image of
`image_seq_len` packed tokens ((H / 16) * (W / 16) for an H x W image):

1. `mu = image_seq_len * m + b`, the line through (`base_image_seq_len`, `base_shift`) and
   (`max_image_seq_len`, `max_shift`), not clamped (the pipeline's `calculate_shift`).
2. `sigmas = linspace(1, 1 / S, S)` (float64), cast to float32.
3. Exponential time shift: `e^mu / (e^mu + (1 / sigma - 1))`, float32.
4. With `shift_terminal`: stretch so the last sigma is `shift_terminal`:
   `1 - (1 - sigma) / ((1 - sigma[-1]) / (1 - shift_terminal))`.
5. timesteps = float32 `sigma * num_train_timesteps`; a final sigma 0 is appended.

Config values of `Qwen/Qwen-Image` `scheduler/scheduler_config.json` (the `QwenSchedulerConfig`
defaults): base_image_seq_len 256, max_image_seq_len 8192, base_shift 0.5, max_shift 0.9,
shift 1.0 (unused with dynamic shifting), shift_terminal 0.02, time_shift_type "exponential",
use_dynamic_shifting true, num_train_timesteps 1000. diffusers 0.42.1 does not ship this file;
the values are those published with the model and repeated by several independent
re-implementations (e.g. ostris/ai-toolkit and the Qwen-Image-2.1 test fixtures of other
projects); diffusers' own defaults differ (max_shift 1.15, max_image_seq_len 4096, no terminal).
"""

from __future__ import annotations

from collections.abc import Sequence

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from runnerkit.schedulers.euler import FlowEulerScheduler
from runnerkit.weights import read_json_object

__all__ = ["QwenImageScheduler", "QwenSchedulerConfig", "calculate_mu", "check_steps", "qwen_schedule", "read_scheduler_config",
           "write_scheduler_config"]

DIFFUSERS_CLASS = "FlowMatchEulerDiscreteScheduler"


class QwenSchedulerConfig(BaseModel):
    """The dynamic-shift flow-matching Euler schedule of Qwen-Image (defaults: `Qwen/Qwen-Image`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_train_timesteps: int = Field(1000, gt=0)
    """Timesteps of the training schedule; the scheduler's timestep is `sigma * num_train_timesteps`."""
    shift: float = Field(1.0, gt=0)
    """Static SD3 shift; unused with dynamic shifting (kept so the diffusers file round-trips)."""
    use_dynamic_shifting: Literal[True] = True
    """Shift by the image's token count through `mu` (the only mode implemented)."""
    base_shift: float = 0.5
    """`mu` at `base_image_seq_len` tokens."""
    max_shift: float = 0.9
    """`mu` at `max_image_seq_len` tokens (larger images extrapolate the line, unclamped)."""
    base_image_seq_len: int = Field(256, gt=0)
    """Token count (packed 2x2 latent patches) where `mu` = `base_shift`."""
    max_image_seq_len: int = Field(8192, gt=0)
    """Token count where `mu` = `max_shift`; must differ from `base_image_seq_len`."""
    shift_terminal: float | None = Field(0.02, ge=0, lt=1)
    """Last non-zero sigma after the stretch; None or 0 disables the stretch (as in diffusers)."""
    time_shift_type: Literal["exponential"] = "exponential"
    """`e^mu / (e^mu + (1 / sigma - 1))` (diffusers' "linear" type is not implemented)."""

    @model_validator(mode="after")
    def _distinct_lengths(self) -> QwenSchedulerConfig:
        if self.base_image_seq_len == self.max_image_seq_len:
            raise ValueError(f"`max_image_seq_len` must differ from `base_image_seq_len` "
                             f"(both {self.base_image_seq_len}): `mu` is the line through the two")
        return self


# diffusers `FlowMatchEulerDiscreteScheduler` keys this schedule does not implement, with the one
# value accepted (the value diffusers writes for Qwen-Image).
_FIXED_KEYS: dict[str, Any] = {
    "invert_sigmas": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "stochastic_sampling": False,
}


def read_scheduler_config(path: Path) -> QwenSchedulerConfig:
    """`QwenSchedulerConfig` from a diffusers `scheduler/scheduler_config.json`.

    Absent keys take Qwen-Image's values (the `QwenSchedulerConfig` defaults, not diffusers'
    constructor defaults). `_`-prefixed metadata is ignored except `_class_name`.

    Raises:
        CheckpointError: the file is missing or not a JSON object.
        ValueError: naming the key: `_class_name` other than 'FlowMatchEulerDiscreteScheduler';
            an unknown key; `use_dynamic_shifting` false, `time_shift_type` 'linear', or a flag
            of `_FIXED_KEYS` (Karras / exponential / beta sigmas, inverted sigmas, stochastic
            sampling) switched on; a value out of range.
    """
    data = read_json_object(Path(path), "scheduler")
    if data.get("_class_name", DIFFUSERS_CLASS) != DIFFUSERS_CLASS:
        raise ValueError(f"`_class_name` in {str(path)!r} must be {DIFFUSERS_CLASS!r}; got {data['_class_name']!r}")
    fields = QwenSchedulerConfig.model_fields
    unknown = sorted(k for k in data if k not in fields and k not in _FIXED_KEYS and not k.startswith("_"))
    if unknown:
        raise ValueError(f"unknown {DIFFUSERS_CLASS} keys {unknown} in {str(path)!r}; allowed: "
                         f"{sorted([*fields, *_FIXED_KEYS])}")
    for key, allowed in _FIXED_KEYS.items():
        if key in data and data[key] != allowed:
            raise ValueError(f"`{key}` = {data[key]!r} in {str(path)!r} is not implemented; allowed: {allowed!r}")
    if data.get("use_dynamic_shifting", True) is not True:
        raise ValueError(f"`use_dynamic_shifting` = {data['use_dynamic_shifting']!r} in {str(path)!r} is not "
                         f"implemented; allowed: True")
    if data.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(f"`time_shift_type` = {data['time_shift_type']!r} in {str(path)!r} is not implemented; "
                         f"allowed: 'exponential'")
    return QwenSchedulerConfig(**{k: v for k, v in data.items() if k in fields})


def write_scheduler_config(path: Path, cfg: QwenSchedulerConfig) -> Path:
    """Write `cfg` as a diffusers `scheduler_config.json` (every key diffusers writes).

    `FlowMatchEulerDiscreteScheduler.from_pretrained(path.parent)` reads it back as the same
    schedule, and so does `read_scheduler_config`.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"_class_name": DIFFUSERS_CLASS, **cfg.model_dump(), **_FIXED_KEYS}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


# ---- the schedule ------------------------------------------------------------------------

def calculate_mu(image_seq_len: int, cfg: QwenSchedulerConfig) -> float:
    """The dynamic shift `mu` for `image_seq_len` tokens (the pipeline's `calculate_shift`).

    Linear in the token count through (`base_image_seq_len`, `base_shift`) and
    (`max_image_seq_len`, `max_shift`), not clamped; float64, same operation order as diffusers.
    """
    slope = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
    intercept = cfg.base_shift - slope * cfg.base_image_seq_len
    return image_seq_len * slope + intercept


def check_steps(infer_steps: int, cfg: QwenSchedulerConfig) -> None:
    """Raise ValueError if `infer_steps` < 2 with a `shift_terminal` stretch.

    The stretch divides by `1 - sigma[-1]`, which is 0 when the only sigma is 1: diffusers then
    gives a NaN sigma; runnerkit refuses the request instead.
    """
    if cfg.shift_terminal and infer_steps < 2:
        raise ValueError(f"`infer_steps` must be >= 2 for this checkpoint's schedule (got {infer_steps!r}): its sigmas "
                         f"are stretched to end at `shift_terminal`={cfg.shift_terminal}, which one step cannot do")


def qwen_schedule(infer_steps: int, mu: float, cfg: QwenSchedulerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmas and timesteps of `QwenImagePipeline` for `infer_steps` steps at shift `mu`.

    Numpy float32 after the initial float64 `linspace`, as diffusers computes them (see the
    module docstring for the steps).

    Returns:
        sigmas `[S + 1]` float32 (the last one 0) and timesteps `[S]` float32
        (`sigma * num_train_timesteps`), both on the CPU.

    Raises:
        ValueError: `infer_steps` < 2 with a `shift_terminal` stretch: the stretch divides by
            `1 - sigma[-1]`, which is 0 when the only sigma is 1 (diffusers returns NaN there).
    """
    check_steps(infer_steps, cfg)
    sigmas = np.linspace(1.0, 1.0 / infer_steps, infer_steps).astype(np.float32)  # [S]
    exp_mu = math.exp(mu)
    sigmas = exp_mu / (exp_mu + (1.0 / sigmas - 1.0))  # exponential time shift, float32
    if cfg.shift_terminal:
        keep = 1.0 - sigmas  # distance from 1, float32
        stretch = keep[-1] / (1.0 - cfg.shift_terminal)
        sigmas = 1.0 - keep / stretch  # the last sigma becomes shift_terminal
    sigmas = torch.from_numpy(sigmas).to(torch.float32)  # [S]
    timesteps = sigmas * cfg.num_train_timesteps  # [S] float32
    sigmas = torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])  # [S + 1]
    return sigmas, timesteps


class QwenImageScheduler(FlowEulerScheduler):
    """Flow-matching Euler with Qwen-Image's resolution-dependent sigmas.

    The Euler update and the noise are the base class's (`FlowEulerScheduler`, `Scheduler.prepare`):
    the noise is float32 `randn(latent_shape)` from the request's CPU generator, the same draws as
    the pipeline's `randn_tensor((B, 1, C, H, W))` on a CPU generator in float32 (the same
    elements in the same order; the pipeline packs that tensor through a view). The sigmas and
    timesteps are `qwen_schedule` at `mu = calculate_mu((H / 2) * (W / 2))`.

    Request state: the base class's plus `mu` (float, or None before `prepare`); `clear()` drops
    it too, leaving the scheduler equal to a freshly built one.

    diffusers' `step` casts the updated latents back to the model output's dtype (bfloat16 with a
    bfloat16 transformer); runnerkit keeps them float32 between steps (`step_pre` casts a copy
    for the model). The two are identical in float32.

    The model's timestep: `step_pre` returns `timesteps[i]` (= sigma * 1000, float32) over the
    batch; the pipeline casts it to the latents' dtype and calls the transformer with
    `timestep / 1000`.
    """

    def __init__(self, config: QwenSchedulerConfig | None = None, sigmas: Sequence[float] | None = None) -> None:
        """Build a scheduler with no request state; `config` defaults to Qwen-Image's; `sigmas`: a
        fixed table used as given (`Scheduler`; `mu` is then not used)."""
        self.config = config if config is not None else QwenSchedulerConfig()
        self.mu: float | None = None
        super().__init__(self.config.num_train_timesteps, self.config.shift, spacing="diffusers", sigmas=sigmas)

    def image_seq_len(self, latent_shape: tuple[int, ...]) -> int:
        """Packed token count of latents `(B, C, 1, H, W)`: (H / 2) * (W / 2).

        Raises:
            ValueError: `latent_shape` is not `(B, C, 1, H, W)` with positive even H and W.
        """
        positive = all(isinstance(d, int) and d > 0 for d in latent_shape)
        if len(latent_shape) != 5 or latent_shape[2] != 1 or not positive:
            raise ValueError(f"`latent_shape` must be (B, C, 1, H, W) of positive integers; got {latent_shape!r}")
        B, C, _, H, W = latent_shape
        if H % 2 or W % 2:
            raise ValueError(f"`latent_shape` H and W must be even (2x2 patches); got H={H}, W={W}")
        return (H // 2) * (W // 2)

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
        """Start a request: `mu` from the latent shape, then `Scheduler.prepare` (noise, sigmas, timesteps).

        Args:
            latent_shape: `(B, C, 1, H, W)`, the unpacked VAE latents of the target image
                (H = height_px / 8, W = width_px / 8, both even).
            infer_steps, seed, device, dtype, init_latents, strength, noise_shapes: as `Scheduler.prepare`.

        Raises:
            ValueError: `latent_shape` is not `(B, C, 1, H, W)` with even H, W; `infer_steps` < 2
                with `shift_terminal` (see `qwen_schedule`); and as `Scheduler.prepare`.
        """
        mu = calculate_mu(self.image_seq_len(tuple(latent_shape)), self.config)
        if isinstance(infer_steps, int):
            check_steps(infer_steps, self.config)  # before any state changes (the base checks the type)
        # `Scheduler.prepare` resets the base request state but not `mu`, which the schedule reads.
        previous_mu, self.mu = self.mu, mu
        try:
            super().prepare(latent_shape, infer_steps, seed, device, dtype, init_latents, strength, noise_shapes)
        except Exception:
            self.mu = previous_mu  # a refused request leaves the scheduler as it was
            raise

    def clear(self) -> None:
        """Drop all request state, `mu` included (equal to a freshly built scheduler afterwards)."""
        super().clear()
        self.mu = None

    def _diffusers_schedule(self, infer_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.mu is not None, "QwenImageScheduler: `mu` is set by prepare() before the schedule is computed"
        return qwen_schedule(infer_steps, self.mu, self.config)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(mu={self.mu}, shift_terminal={self.config.shift_terminal}, "
                f"step {self.step_index}/{self.infer_steps})")
