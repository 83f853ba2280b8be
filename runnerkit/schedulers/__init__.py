"""Flow-matching schedulers; each owns one request's denoising state (ARCHITECTURE §2)."""

from runnerkit.schedulers.base import Scheduler, shift_sigmas
from runnerkit.schedulers.euler import FlowEulerScheduler
from runnerkit.schedulers.spacing import SPACINGS, Spacing, train_range_schedule
from runnerkit.schedulers.unipc import FlowUniPCScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    "unipc": FlowUniPCScheduler,
    "euler": FlowEulerScheduler,
}
"""Scheduler classes by config name (the `scheduler` key of a runnerkit config)."""

__all__ = ["SCHEDULERS", "SPACINGS", "FlowEulerScheduler", "FlowUniPCScheduler", "Scheduler", "Spacing", "shift_sigmas",
           "train_range_schedule"]
