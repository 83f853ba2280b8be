"""Offload keys checked against the family's modules before anything loads or is written.

`offload.resident_modules` and `offload.keep_across_stages` name or assume modules and stages of the
family's pipeline, which pydantic cannot know. The pipeline description itself needs the checkpoint
(`describe_pipeline` runs at load), but the family's memory estimate lists the same modules and
stages from the architecture alone (the config's, a checkpoint's headers, or the release sizes), so
the keys are judged against it when the run plans its memory (`MemoryChecks.plan_memory`, the
first thing `init_modules` and `runnerkit plan` do), before a synthetic checkpoint is written. A
family whose estimate is not available before loading is still checked at load
(`DefaultRunner._resident_choice`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runnerkit.config import OffloadConfig, RunnerConfig
from runnerkit.planning.fit import MemoryEstimate, streams

__all__ = ["check_offload_modules", "check_resident_modules"]


def check_offload_modules(config: RunnerConfig, estimate_with: Callable[[OffloadConfig], MemoryEstimate | None],
                          runner: str) -> None:
    """Refuse `offload.resident_modules` entries the family cannot keep resident and a
    `offload.keep_across_stages` that has no effect.

    Args:
        config: the run config (`offload.mode` concrete, or auto: the keys then constrain the plan).
        estimate_with: the family's estimate of the config's default shape under an offload config (None: the
            family gives none before loading; nothing is checked here then).
        runner: the runner's name for messages, e.g. "T2VRunner".

    Raises:
        ValueError: naming the field and its value: a `resident_modules` entry that is not a module of the
            pipeline, or one that streams its blocks in the configured mode (block/phase), with the modules
            that can be kept resident; `keep_across_stages` true where no stage holds a module across a
            transition (a pipeline with one denoising stage).
    """
    off = config.offload
    if not off.resident_modules and not off.keep_across_stages:
        return
    # mode auto: each candidate decides what streams; the modules are those of any offload config
    estimate = estimate_with(off if off.mode != "auto" else OffloadConfig(mode="block"))
    if estimate is None:
        return
    where = f"{runner} (model_cls {config.model_cls!r}, task {config.task!r})"
    streamed = [n for n, m in estimate.modules.items() if off.mode != "auto" and streams(n, m, off)]
    check_resident_modules(off, list(estimate.modules), streamed, where)
    if off.keep_across_stages and not any(s.holds for s in estimate.stages):
        raise ValueError(f"`offload.keep_across_stages`=true has no effect: {where} has one denoising stage (no "
                         "module stays on the device across a transition between stages); remove it")


def check_resident_modules(off: OffloadConfig, modules: Sequence[str], streamed: Sequence[str], where: str) -> set[str]:
    """`off.resident_modules` checked against the pipeline's `modules` and the ones that stream in `off.mode`;
    returns the names (empty: none listed). The check before loading (from the estimate) and the one at load
    (from the pipeline description, for a family without an estimate) both call it.

    Raises:
        ValueError: a name that is not one of `modules`, or one of `streamed`, with the modules that can stay.
    """
    names = off.resident_modules or ()
    allowed = [n for n in modules if n not in streamed]
    bad = [n for n in names if n not in modules]
    if bad:
        raise ValueError(f"`offload.resident_modules`={list(names)}: {where} has no module {bad}; modules it can "
                         f"keep resident: {allowed}")
    both = [n for n in names if n in streamed]
    if both:
        raise ValueError(f"`offload.resident_modules`={list(names)}: {both} stream their blocks in `offload.mode`="
                         f"{off.mode!r} (streamed: {list(streamed)}); modules it can keep resident in this mode: "
                         f"{allowed} (or list the modules to stream in `offload.stream_modules` without them)")
    return set(names)
