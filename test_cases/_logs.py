"""Capturing what runnerkit logs (loguru) inside a `with` block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from loguru import logger


@contextmanager
def logged(level: str = "INFO") -> Iterator[list[str]]:
    """The messages logged at `level` or above while the block runs, in order (the sink is removed on exit)."""
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level=level)
    try:
        yield messages
    finally:
        logger.remove(sink)
