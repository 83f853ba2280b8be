"""LTX-2.5's transformer switches against diffusers 0.42.1 `LTX2VideoTransformer3DModel` built with them:
the video FFN without biases (`ff_bias` false) and the keyframe embedding (`use_keyframes_abs_pos_embedding`,
applied where `video_keyframes_mask` marks tokens). float32, tiny sizes, every parameter perturbed (the
keyframe embedding too, so it is not the reference's zeros), tolerance `TOL` = 1e-4 as in test_transformer.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runnerkit.models.ltx2.transformer import LTX2Transformer
from runnerkit.models.ltx2.transformer_arch import LTX23_22B, LTX25_22B, LTX2TransformerArch, tiny_arch
from test_cases._reference import require_reference
from test_cases.models.ltx2.test_transformer import (
    GRID,
    PARAMS,
    TOL,
    _inputs,
    _max_err,
    _ours,
    _reference,
    _run_reference,
)

diffusers = require_reference("diffusers")

LTX25_PARAMS = PARAMS["2.3"] - 48 * (16384 + 4096) + 4096
"""LTX-2.3's count, less 48 blocks' video FFN biases ([16384] and [4096]), plus the [1, 4096] keyframe embedding."""


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, LTX2Transformer]:
    arch = tiny_arch("2.5")
    reference = _reference(arch, seed=5)
    assert reference.keyframes_abs_pos_embedding.abs().min() > 0  # perturbed: a no-op marker would hide a bug
    return reference, _ours(reference, arch)


def _keyframes_mask(batch: int, rows: int) -> torch.Tensor:
    """[B, Lv, 1]: the first latent frame's tokens (the causal VAE's single-pixel-frame latents) and, in row 1,
    the last frame's too (a generated keyframe slot); values other than 1 where marked (the rule is > 0)."""
    _, H, W = GRID
    mask = torch.zeros(batch, GRID[0] * H * W, 1)
    mask[:, : H * W] = 0.5
    if rows > 1:
        mask[1, -H * W:] = 2.0
    return mask


@pytest.mark.parametrize("task,batch,keyframes", [("t2av", 1, False), ("i2av", 2, False), ("t2av", 1, True),
                                                  ("i2av", 2, True)])
def test_ltx25_parity_with_diffusers(models: tuple[torch.nn.Module, LTX2Transformer], task: str, batch: int,
                                     keyframes: bool) -> None:
    reference, ours = models
    kw: dict[str, Any] = _inputs(ours.arch, task, batch)
    if keyframes:
        kw["video_keyframes_mask"] = _keyframes_mask(batch, batch)
    expected = _run_reference(reference, kw, True)
    with torch.no_grad():
        out = ours(**kw)
    err = _max_err(out, expected)
    print(f"LTX-2.5 {task} B={batch} keyframes={keyframes}: max abs error {err:.3g}")
    assert err <= TOL, f"max abs error {err:.3g} (output scale {expected[0].abs().max().item():.3g})"


def test_keyframes_mask_moves_only_through_the_embedding(models: tuple[torch.nn.Module, LTX2Transformer]) -> None:
    """The mask changes the output (the parity case above could not pass by ignoring it), a mask of zeros is
    no mask, and a model without the embedding (LTX-2.3 switches) ignores a mask, as diffusers does."""
    _, ours = models
    kw = _inputs(ours.arch, "i2av", 2)
    with torch.no_grad():
        plain = ours(**kw)
        marked = ours(**kw, video_keyframes_mask=_keyframes_mask(2, 2))
        zeros = ours(**kw, video_keyframes_mask=torch.zeros(2, 18, 1))
    assert _max_err(marked, plain) > 1e-3
    assert _max_err(zeros, plain) == 0
    arch = tiny_arch("2.3")
    old = _ours(_reference(arch), arch)
    with torch.no_grad():
        assert _max_err(old(**kw, video_keyframes_mask=_keyframes_mask(2, 2)), old(**kw)) == 0


def test_keyframes_mask_shape_is_checked(models: tuple[torch.nn.Module, LTX2Transformer]) -> None:
    _, ours = models
    with pytest.raises(ValueError, match=r"`video_keyframes_mask` must be \[B, Lv, 1\] = \(2, 18, 1\), got \(2, 18\)"):
        ours(**_inputs(ours.arch, "t2av", 2), video_keyframes_mask=torch.ones(2, 18))


def test_release_layout_matches_diffusers() -> None:
    """LTX-2.5 widths (2 blocks to stay fast; blocks are identical): the same keys and shapes as diffusers'
    model with the "2.5" conversion config; 96 bias tensors fewer than 2.3 over 48 blocks, one more tensor."""
    arch = LTX25_22B.model_copy(update={"num_layers": 2})
    with torch.device("meta"):
        reference = diffusers.LTX2VideoTransformer3DModel(**arch.model_dump())
        ours = LTX2Transformer(arch)
        old = LTX2Transformer(LTX23_22B.model_copy(update={"num_layers": 2}))
    shapes = {k: v.shape for k, v in ours.state_dict().items()}
    assert shapes == {k: v.shape for k, v in reference.state_dict().items()}
    assert shapes["keyframes_abs_pos_embedding"] == (1, 4096)
    assert sorted(set(old.state_dict()) - set(shapes)) == [
        f"transformer_blocks.{i}.ff.net.{j}" for i in range(2) for j in ("0.proj.bias", "2.bias")]
    per_block = sum(p.numel() for p in ours.transformer_blocks[0].parameters())
    assert sum(p.numel() for p in ours.parameters()) + 46 * per_block == LTX25_PARAMS == 18_987_859_200
    assert LTX2TransformerArch.from_diffusers_config(dict(reference.config)) == arch
