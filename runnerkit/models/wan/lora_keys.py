"""LoRA layer names of the Wan2.1 transformer: the diffusers names of each linear layer (our modules
use the original release's names), for matching adapters trained on diffusers' `WanTransformer3DModel`
(runnerkit/lora). The original names (`blocks.0.self_attn.q`, LightX2V's and kohya/musubi's layouts)
match the model directly; the table is transformer_keys.py's, so the two stay one map.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from runnerkit.lora import linear_targets
from runnerkit.models.wan.transformer_keys import _BLOCK_MODULES, _TOP_MODULES

_BLOCK = dict(_BLOCK_MODULES)
_TOP = dict(_TOP_MODULES)
_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")


def lora_aliases(names: Sequence[str]) -> dict[str, str]:
    """Diffusers name -> native name of every linear layer in `names` (native names) that has one.

    E.g. `blocks.3.attn1.to_out.0` -> `blocks.3.self_attn.o`, `proj_out` -> `head.head`,
    `condition_embedder.time_proj` -> `time_projection.1`.
    """
    out: dict[str, str] = {}
    for name in names:
        m = _BLOCK_NAME.match(name)
        if m is not None and m.group(2) in _BLOCK:
            out[f"blocks.{m.group(1)}.{_BLOCK[m.group(2)]}"] = name
        elif name in _TOP:
            out[_TOP[name]] = name
    return out


def block_layers(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The blocks' linear layers of a (meta) transformer: name -> (out, in) (what LightX2V's distill
    adapters cover: self/cross attention q, k, v, o (+ k_img, v_img) and the FFN)."""
    return {n: (m.out_features, m.in_features) for n, m in linear_targets(model).items() if _BLOCK_NAME.match(n)}
