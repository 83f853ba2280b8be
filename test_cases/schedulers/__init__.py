"""Tests of runnerkit.schedulers, plus the small helpers both scheduler test files share."""

from __future__ import annotations

import torch

LATENT_SHAPE = (2, 4, 3, 6, 8)  # [B, C, F, H, W]


def fake_velocity(latents: torch.Tensor, step: int) -> torch.Tensor:
    """A deterministic stand-in for the transformer: a smooth, step-dependent velocity field."""
    return 0.7 * latents + 0.3 * torch.sin(latents * (step + 1))


def assert_same_state(actual: object, expected: object) -> None:
    """Assert two schedulers have the same attributes with equal values (tensors compared exactly)."""
    a, e = vars(actual), vars(expected)
    assert a.keys() == e.keys(), f"attributes differ: {sorted(a.keys() ^ e.keys())}"
    for name, value in e.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(a[name], torch.Tensor) and torch.equal(a[name], value), name
        else:
            assert a[name] == value, f"{name}: {a[name]!r} != {value!r}"
