"""What the LTX-2 Gemma-3 and LTX-2.5 Gemma-4 text-encoder streaming tests share (test_text_encoder_streaming.py,
test_text_encoder_gemma4_streaming.py): a runner of a tiny config whose text encoder streams, the hidden states
of its own text stage, the resident encoder's, and the disk reads counted by tensor name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import load_runner_config
from runnerkit.offload import disk
from runnerkit.runners.pipeline import InputInfo
from test_cases._alignment import misaligned_weights
from test_cases._encoder_streaming import (
    assert_streamed_parity,
    layer_units,
    streamed_encoder,
    text_stage,
    two_requests,
)

INFO = InputInfo(prompt="a red fox runs through fresh snow", negative_prompt="", seed=0, height=64, width=64,
                 frames=9)


def streaming_runner(runner_cls: type, config: Path, ckpt: Path, **offload: Any) -> Any:
    """`runner_cls` on the JSON `config` and the checkpoint `ckpt`, on the CPU, the transformer and the text encoder
    in `offload.stream_modules` with `offload`'s other keys; its checkpoint opened (`prepare_load`)."""
    data = {**json.loads(config.read_text()), "device": "cpu", "model_path": str(ckpt),
            "offload": {"stream_modules": ["transformer", "text_encoder"], **offload}}
    runner = runner_cls(load_runner_config(None, data))
    runner.prepare_load()
    return runner


def hidden_states(runner: Any, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The runner's own text stage on `module`: stacked hidden states [1, 1024, D * (layers + 1)] and the mask."""
    return text_stage(runner, module, INFO, "text_hidden", "text_mask")


def resident_hidden_states(runner: Any) -> tuple[torch.Tensor, ...]:
    """`hidden_states` of the runner's resident text encoder on the CPU (its weights re-homed off the file mapping
    transformers leaves float32 weights on)."""
    module = runner.build_text_encoder(torch.device("cpu"))
    assert misaligned_weights(module) == []
    return hidden_states(runner, module)


def check_streamed_case(runner: Any, offload: dict[str, Any], resident: tuple[torch.Tensor, ...], case: str,
                        head_dims: list[int] | None = None) -> None:
    """The runner's streamed text encoder (`offload` its settings) over two requests: one unit per decoder layer
    (two with phase streaming), the layers' head sizes `head_dims` where given, hidden states equal to the resident
    encoder's `resident` and the copies `assert_streamed_parity` expects."""
    phases = ("self_attn", "mlp") if offload["mode"] == "phase" else ("",)
    with streamed_encoder(runner) as (model, streamer):
        assert [u.module for u in streamer.units] == layer_units("layers", len(model.layers), phases)
        if head_dims is not None:
            assert [layer.self_attn.head_dim for layer in model.layers] == head_dims
        runs, stats = two_requests(lambda m: hidden_states(runner, m), model, streamer)
    assert_streamed_parity(runs, resident, stats, len(streamer.units), offload.get("storage", "cpu"), case)


def count_disk_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tensors the safetensors disk reader reads from now on, in order (every batch)."""
    read: list[str] = []
    original = disk.SafetensorsDiskReader._read_batch
    monkeypatch.setattr(disk.SafetensorsDiskReader, "_read_batch", lambda self, handle, batch: (
        read.extend(e.name for e, _ in batch), original(self, handle, batch))[1])
    return read
