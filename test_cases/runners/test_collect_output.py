"""`collect_output` (runners/pipeline.py): what `DefaultRunner.decode` makes of a decoder's output: a
tensor as it is, an iterator consumed fully and concatenated along dim 2 (frames), a progress call
after each chunk, and a generator left early closed at once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from runnerkit.runners.pipeline import collect_output


def _chunks(events: list[str]) -> Iterator[torch.Tensor]:
    """Three chunks `[1, 2, 1, 2]` holding 0, 1, 2 (frames 0..2); records its end."""
    try:
        for i in range(3):
            events.append(f"chunk {i}")
            yield torch.full((1, 2, 1, 2), float(i))
    finally:
        events.append("closed")


def test_an_iterator_is_consumed_in_order_along_the_frames_with_a_report_after_each_chunk() -> None:
    events: list[str] = []
    out = collect_output(_chunks(events), lambda: events.append("report"))
    assert out.shape == (1, 2, 3, 2)
    assert out[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0]  # frame i holds chunk i
    assert events == ["chunk 0", "report", "chunk 1", "report", "chunk 2", "report", "closed"]


def test_a_generator_left_early_is_closed_before_the_error_leaves() -> None:
    events: list[str] = []

    def cancel_at_second() -> None:
        events.append("report")
        if events.count("report") == 2:
            raise KeyboardInterrupt("cancelled")

    chunks = _chunks(events)  # held here: only an explicit close ends it, not garbage collection
    with pytest.raises(KeyboardInterrupt, match="cancelled"):
        collect_output(chunks, cancel_at_second)
    assert events == ["chunk 0", "report", "chunk 1", "report", "closed"]


def test_a_tensor_is_returned_as_it_is_without_a_report() -> None:
    reports: list[int] = []
    video = torch.arange(12.0).reshape(1, 3, 2, 2, 1)
    assert collect_output(video, lambda: reports.append(1)) is video
    assert reports == []
