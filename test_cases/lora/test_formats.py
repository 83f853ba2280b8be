"""Adapter files: LightX2V's zero `.diff` / bias-only norm keys are dropped, a non-zero full-tensor
delta is refused, alpha must be a scalar; matching by own name, alias and flattened name; the
summed rank of a request above `lora.max_rank` is refused naming the layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from runnerkit.lora import LoRAError, LoRAManager, match_adapter, read_adapter

PAIR = {"lora_down.weight": torch.ones(2, 4), "lora_up.weight": torch.ones(3, 2)}


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "a.safetensors"
    save_file({k: v.clone() for k, v in tensors.items()}, str(path))
    return path


def test_zero_norm_deltas_are_dropped_and_alpha_scales(tmp_path: Path) -> None:
    path = _write(tmp_path, {"diffusion_model.blocks.0.norm3.diff": torch.zeros(4),
                             "diffusion_model.blocks.0.norm3.diff_b": torch.zeros(4),
                             **{f"diffusion_model.blocks.0.q.{k}": v for k, v in PAIR.items()},
                             "diffusion_model.blocks.0.q.alpha": torch.tensor(1.0)})
    adapter = read_adapter(path)
    assert list(adapter.layers) == ["blocks.0.q"] and adapter.zero_diffs == ("blocks.0.norm3",)
    assert adapter.layers["blocks.0.q"].scale == 0.5  # alpha 1 / rank 2


@pytest.mark.parametrize("tensors, says", [
    ({"blocks.0.norm3.diff": torch.ones(4)}, "non-zero full-tensor delta"),
    ({**{f"blocks.0.q.{k}": v for k, v in PAIR.items()}, "blocks.0.q.alpha": torch.ones(2)}, "alpha must be a scalar"),
    ({"blocks.0.q.lora_up.weight": torch.ones(3, 2)}, "without its pair"),
])
def test_bad_files_name_the_file_and_the_key(tmp_path: Path, tensors: dict[str, torch.Tensor], says: str) -> None:
    path = _write(tmp_path, tensors)
    with pytest.raises(LoRAError, match=says) as exc:
        read_adapter(path)
    assert str(path) in str(exc.value)


def test_matching_by_name_alias_and_flattened_name(tmp_path: Path) -> None:
    targets = {"blocks.0.self_attn.q": (3, 4), "blocks.0.ffn.0": (3, 4), "head.head": (3, 4)}
    aliases = {"blocks.0.attn1.to_q": "blocks.0.self_attn.q"}
    tensors = {f"transformer.blocks.0.attn1.to_q.{k}": v for k, v in PAIR.items()}  # alias
    tensors.update({f"lora_unet_blocks_0_ffn_0.{k}": v for k, v in PAIR.items()})  # flattened own name
    tensors.update({f"diffusion_model.head.head.{k}": v for k, v in PAIR.items()})  # own name
    matched = match_adapter(read_adapter(_write(tmp_path, tensors)), targets, aliases, "m")
    assert sorted(matched) == sorted(targets)


def test_summed_rank_above_max_rank_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    path = _write(tmp_path, {f"0.{k}": v for k, v in PAIR.items()})
    manager = LoRAManager("unfused", 3, torch.device("cpu"), torch.float32, lambda names: {}, "m")
    manager.attach("transformer", model)
    manager.check([(str(path), 1.0)])  # rank 2 fits 3
    with pytest.raises(LoRAError, match="summed rank 4 on 0 exceeds `lora.max_rank` 3"):
        manager.set_request([(str(path), 1.0), (str(path), 0.5)])
    assert manager.active == () and not manager._written
