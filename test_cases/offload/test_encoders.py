"""The generic parts of text-encoder streaming (runnerkit/offload/encoders.py, issue 21): block lists at
dotted paths, key maps by prefix, and the refusal of a tensor that is neither loaded, streamed nor
computed (a RoPE table a skeleton forgot). Each family's encoder is tested end to end beside it
(test_cases/models/*/test_text_encoder_streaming.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runnerkit.config import OffloadConfig
from runnerkit.offload.encoders import prefixed_key_map
from runnerkit.offload.layout import StreamSpec, plan_units
from runnerkit.offload.setup import stream_module
from runnerkit.weights import CheckpointError, build_on_meta

SPEC = StreamSpec(blocks_attr="inner.layers", phases=(), keep_fp32=lambda name: False)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)  # computed, as a RoPE table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return x


class Encoder(nn.Module):
    """An embedding, then layers one level down (as transformers' `model.language_model.layers`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.inner = Inner()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(self.embed(ids))


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=g) for k, v in Encoder().state_dict().items()}


def test_a_dotted_block_path_plans_the_nested_layers() -> None:
    units = plan_units(build_on_meta(Encoder), "block", SPEC)
    assert [u.module for u in units] == ["inner.layers.0", "inner.layers.1", "inner.layers.2"]
    assert units[1].params == ("inner.layers.1.weight", "inner.layers.1.bias")
    with pytest.raises(ValueError, match=r"`blocks_attr`='inner.blocks': model Encoder has no nn.ModuleList there"):
        plan_units(build_on_meta(Encoder), "block", StreamSpec("inner.blocks", (), lambda name: False))


def test_a_buffer_computed_at_build_moves_to_the_device_and_the_output_is_exact() -> None:
    weights = _weights()
    reference = Encoder()
    reference.load_state_dict(weights)
    ids = torch.tensor([[1, 4, 7]])
    model = build_on_meta(Encoder)
    model.inner.scale = torch.full((4,), 2.0)  # what a skeleton builder computes (hf_skeleton: initialize_weights)
    streamer = stream_module(model, SPEC, OffloadConfig(mode="block"), torch.device("cpu"), torch.float32, "enc",
                             state_dict=weights)
    try:
        with torch.no_grad():
            assert torch.equal(model(ids), reference(ids))
    finally:
        streamer.close()


def test_a_buffer_left_on_meta_is_refused_by_name() -> None:
    """A skeleton that does not compute its non-persistent buffers (e.g. RoPE `inv_freq`) fails at load."""
    with pytest.raises(CheckpointError, match=r"enc: 1 tensors are neither loaded nor streamed .*inner\.scale"):
        stream_module(build_on_meta(Encoder), SPEC, OffloadConfig(mode="block"), torch.device("cpu"), torch.float32,
                      "enc", state_dict=_weights())


def test_prefixed_key_map_tries_the_rules_in_order_and_lists_what_is_missing() -> None:
    rules = (("language_model.", ("model.", "model.language_model.")), ("visual.", ("visual.", "model.visual.")))
    names = ["language_model.layers.0.w", "language_model.norm.w", "visual.blocks.0.w"]
    legacy = {"model.layers.0.w", "model.norm.w", "visual.blocks.0.w", "lm_head.w"}
    assert prefixed_key_map(names, legacy, rules, "enc", "f") == {
        "language_model.layers.0.w": "model.layers.0.w", "language_model.norm.w": "model.norm.w",
        "visual.blocks.0.w": "visual.blocks.0.w"}
    in_memory = {"model.language_model.layers.0.w", "model.language_model.norm.w", "model.visual.blocks.0.w"}
    assert prefixed_key_map(names, in_memory, rules, "enc", "f")["visual.blocks.0.w"] == "model.visual.blocks.0.w"
    with pytest.raises(CheckpointError, match=r"enc: /ckpt/te lacks 2 tensors .*language_model\.norm\.w, "
                                              r"audio\.x"):
        prefixed_key_map([*names, "audio.x"], legacy - {"model.norm.w"}, rules, "enc", "/ckpt/te")
