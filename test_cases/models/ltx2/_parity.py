"""Helpers of the LTX-2 parity tests: seeded inputs and the max abs error against a reference."""

from __future__ import annotations

import torch


def randn(*shape: int, seed: int) -> torch.Tensor:
    """A standard-normal tensor of `shape` from its own CPU generator seeded with `seed`."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def report(name: str, got: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error of `got` against `expected` (shapes must match), printed with the reference's scale."""
    assert got.shape == expected.shape, (got.shape, expected.shape)
    err = (got.float() - expected.float()).abs().max().item()
    print(f"{name}: max abs error {err:.3e} (reference max |x| {expected.abs().max().item():.2f})")
    return err
