"""What the families' text-encoder streaming tests share (test_cases/models/*/test_text_encoder_streaming.py):
the runner's own text stage on a module of the test's choice, the streamed encoder opened and closed,
two requests through it, and the parity check against the resident encoder's outputs.

The parity each family asserts: both requests (a request boundary, `streamer.reset()`, between them)
equal the resident encoder's outputs bit for bit, dtype included; every streamed unit was copied in
each request; with storage disk the streamer read from the files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from runnerkit.runners.request_state import RequestState

Outputs = tuple[torch.Tensor, ...]


def text_stage(runner: Any, module: nn.Module, info: Any, *fields: str) -> Outputs:
    """The runner's own text stage (`run_text_encoder`) with `module` as its text encoder: the named fields
    of the inputs it returns (each asserted present)."""
    inputs = runner.run_text_encoder(RequestState(info, modules={"text_encoder": module}))
    out = tuple(getattr(inputs, f) for f in fields)
    assert all(t is not None for t in out), f"run_text_encoder left one of {fields} unset"
    return out


@contextmanager
def streamed_encoder(runner: Any) -> Iterator[tuple[nn.Module, Any]]:
    """(model, streamer) of `runner.stream_text_encoder()`; the streamer is closed after the block."""
    model, streamer = runner.stream_text_encoder()
    try:
        yield model, streamer
    finally:
        streamer.close()


def layer_units(prefix: str, layers: int, phases: Sequence[str]) -> list[str]:
    """Streamer unit names in order: `prefix.i` per layer, or `prefix.i.phase` per phase (phases ("",): block)."""
    return [f"{prefix}.{i}{'.' + p if p else ''}" for i in range(layers) for p in phases]


def two_requests(stage: Callable[[nn.Module], Outputs], model: nn.Module, streamer: Any) -> tuple[list[Outputs], dict]:
    """`stage(model)` twice, a request boundary (`streamer.reset()`, as `end_run` does) between them; the
    outputs of both and the streamer's stats after them."""
    first = stage(model)
    streamer.reset()
    second = stage(model)
    return [first, second], streamer.stats()


def assert_streamed_parity(runs: Sequence[Outputs], want: Outputs, stats: dict, units: int, storage: str,
                           what: str) -> None:
    """Every run equals `want` bit for bit (dtype included); each of the `units` streamed units was copied
    in every run; storage "disk" read bytes from the files."""
    for got in runs:
        assert len(got) == len(want), what
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), what
    assert stats["h2d_copies"] >= len(runs) * units, (what, stats["h2d_copies"])
    if storage == "disk":
        assert stats["disk_bytes_read"] > 0, what


@contextmanager
def deterministic_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's deterministic algorithms (cuBLAS with a fixed workspace) inside the block, restored after it."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
