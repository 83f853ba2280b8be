"""What a parallel run (config `parallel`, runnerkit/parallel) changes on `DefaultRunner`'s request path:
the CFG branches one rank computes, and Ulysses' rule that the transformer's tokens divide by
`parallel.ulysses` (checked at submission, before a launch's first request and before every stage).

The family's part stays a hook on the runner (runners/default.py): `PARALLEL_MODES`,
`attention_heads` and `sequence_tokens`; `check_parallel` (runners/installers.py) refuses at load a
mode the family does not support.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from runnerkit.config import RequestConfig
from runnerkit.runners.pipeline import DenoiseStage, InputInfo

if TYPE_CHECKING:
    from runnerkit.runners.default import DefaultRunner

__all__ = ["cfg_branches", "cfg_parallel", "check_requests_split", "check_sequence_split", "decodes_here"]


def cfg_parallel(runner: DefaultRunner) -> bool:
    """The CFG branches run on two ranks (config `parallel.cfg` = 2)."""
    return runner.parallel is not None and runner.parallel.cfg > 1


def decodes_here(runner: DefaultRunner) -> bool:
    """This process runs the decoders and saves: one process, or rank 0 of a parallel run."""
    return runner.parallel is None or runner.parallel.rank == 0


def cfg_branches(runner: DefaultRunner, branches: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """Each CFG branch's prediction, in `branches` order (e.g. [cond, uncond]).

    One process: every branch runs here. CFG parallel (`parallel.cfg` = 2): this rank runs branch
    `cfg_rank` only and one all-gather over the CFG group brings the other's (same shape and dtype on
    both ranks), so every rank combines the same tensors as one process would.
    """
    group = runner.parallel
    if not runner.cfg_parallel:
        return [branch() for branch in branches]
    assert len(branches) == group.cfg, f"{len(branches)} CFG branches for parallel.cfg {group.cfg}"
    return group.all_gather(branches[group.cfg_rank](), "cfg")


def check_sequence_split(runner: DefaultRunner, info: InputInfo, stages: Sequence[DenoiseStage] | None = None) -> None:
    """Under Ulysses sequence parallel, refuse request `info` if a denoise stage's transformer tokens
    (`runner.sequence_tokens`) do not divide by `parallel.ulysses`; a no-op otherwise. The server calls it
    at submission (422), every stage before its first step. `stages`: default every one.

    Raises:
        NotImplementedError: naming the stage, the shape, the token count and `parallel.ulysses`.
    """
    if runner.parallel is None or runner.parallel.ulysses <= 1:
        return
    from runnerkit.parallel.group import split_even

    assert runner.pipeline is not None, "load_modules sets the pipeline"
    for stage in stages if stages is not None else runner.pipeline.denoise:
        split_even(runner.sequence_tokens(stage, info), runner.parallel.ulysses, "the transformer's tokens",
                   f"stage {stage.name!r} at shape {list(info.shape)}; choose a shape whose tokens divide")


def check_requests_split(runner: DefaultRunner, requests: Sequence[RequestConfig]) -> None:
    """`check_sequence_split` for every request of a launch, after `init_modules` and before the first
    runs (under `parallel` a failed request ends every rank, so none starts).

    Raises:
        NotImplementedError: naming the first request whose tokens do not divide (index, source).
    """
    for index, request in enumerate(requests):
        try:
            runner.check_sequence_split(runner.resolve_request(request))
        except NotImplementedError as exc:
            raise NotImplementedError(f"request {index} ({request.source}): {exc}") from None
