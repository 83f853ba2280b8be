"""`stream_module`: a block/phase-streamed transformer computes with aligned weights, resident and
streamed, whatever the alignment of the tensors it was given, and matches `offload.mode: none`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import save_file

from runnerkit.config import OffloadConfig
from runnerkit.models.wan.arch import WanTransformerArch
from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
from runnerkit.offload.setup import stream_module
from runnerkit.weights import assign_state_dict, build_on_meta, synthetic_tensor
from test_cases._alignment import copy_at_residue, misaligned_weights

# ffn_dim 90: a 360-byte bias, so tensors packed back to back would leave 64-byte boundaries.
ARCH = WanTransformerArch(dim=64, num_heads=2, num_layers=2, text_dim=32, ffn_dim=90, freq_dim=32,
                          text_len=16, in_dim=4, out_dim=4)


def _build() -> WanTransformer3D:
    return build_on_meta(lambda: WanTransformer3D(ARCH))


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """The tiny transformer's float32 weights, each 4 bytes past a 64-byte boundary (as a mapped
    safetensors tensor can be); the time embedding is computed for one timestep: a GEMV."""
    shapes = {k: tuple(v.shape) for k, v in _build().state_dict().items()}
    return {k: copy_at_residue(synthetic_tensor(k, s, seed=3, dtype=torch.float32), 4) for k, s in shapes.items()}


def _forward(model: WanTransformer3D) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(1, ARCH.in_dim, 2, 4, 6, generator=gen)  # [B, C, F, H, W]
    context = torch.randn(1, 5, ARCH.text_dim, generator=gen)  # [B, L, text_dim]
    with torch.no_grad():
        return model(latents, torch.tensor([731.0]), context)


@pytest.mark.parametrize("storage", ["cpu", "disk"])
@pytest.mark.parametrize("mode", ["block", "phase"])
def test_streamed_weights_are_aligned_and_match_mode_none(weights: dict[str, torch.Tensor], tmp_path: Path,
                                                         mode: Literal["block", "phase"],
                                                         storage: Literal["cpu", "disk"]) -> None:
    reference = assign_state_dict(_build(), weights, "transformer", keep_fp32=keep_fp32).eval()
    assert misaligned_weights(reference) == []
    want = _forward(reference)

    model = _build()
    cfg = OffloadConfig(mode=mode, storage=storage, pin_memory=False)
    if storage == "cpu":
        streamer = stream_module(model, WanTransformer3D.STREAM_SPEC, cfg, torch.device("cpu"), torch.float32, "transformer",
                                 state_dict=weights)
    else:
        path = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
        streamer = stream_module(model, WanTransformer3D.STREAM_SPEC, cfg, torch.device("cpu"), torch.float32, "transformer",
                                 files=[path])
    try:
        # resident weights, and streamed ones (views into the device slots), at 64-byte addresses
        assert misaligned_weights(model) == []
        assert torch.equal(_forward(model.eval()), want)
    finally:
        streamer.close()
