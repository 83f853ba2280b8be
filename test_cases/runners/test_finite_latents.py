"""`check_finite_latents`: denoised latents holding NaN, +Inf or -Inf (any mix, Inf without NaN
included) are refused with the exact count; finite latents, the largest finite values included, pass."""

from __future__ import annotations

import re

import pytest
import torch

from runnerkit.runners.default import check_finite_latents

INF, NAN = float("inf"), float("nan")


def _latents(bad: dict[int, float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.zeros(1, 16, 2, 4, 4, dtype=dtype)  # [B, C, F, H, W]
    flat = x.view(-1)
    for i, v in bad.items():
        flat[i] = v
    return x


@pytest.mark.parametrize("bad", [{0: INF}, {5: -INF}, {1: INF, 511: -INF}, {3: NAN}, {2: NAN, 7: INF, 9: -INF}],
                         ids=["+inf", "-inf", "+inf and -inf", "nan", "nan and inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_latents_are_refused_with_their_count(bad: dict[int, float], dtype: torch.dtype) -> None:
    latents = _latents(bad, dtype)
    assert int(torch.isnan(latents).sum()) == sum(v != v for v in bad.values())  # Inf cases hold no NaN
    with pytest.raises(FloatingPointError, match=re.escape(
            f"the denoised latents [1, 16, 2, 4, 4] hold {len(bad)} non-finite values (NaN or Inf) of 512")):
        check_finite_latents(latents, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_latents_pass(dtype: torch.dtype) -> None:
    top = torch.finfo(dtype).max
    check_finite_latents(_latents({0: top, 1: -top, 2: torch.finfo(dtype).tiny}, dtype), dtype)
