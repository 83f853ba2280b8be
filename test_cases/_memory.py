"""Measuring the CPU memory a piece of code allocates, for the estimate-against-peak tests."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(fn: Callable[[], Any], min_events: int = 11) -> int:
    """Peak of live CPU tensor bytes allocated while `fn` runs (its result freed after), from the
    profiler's allocation events (`[memory]`, signed byte counts) replayed in time order; fewer than
    `min_events` events means the profiler stopped reporting them."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    assert len(events) >= min_events, "the profiler reported no allocations: its memory events changed?"
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
