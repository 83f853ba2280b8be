"""LoRA adapters at inference, per request (docs/lora.md): reading the public formats
(`formats.py`) and applying them unfused or fused, removed exactly after each request (`apply.py`).
Nothing here names a model family: a family gives only the other names of its layers (aliases)."""

from runnerkit.lora.apply import LoRALinear, LoRAManager, attach_slots, linear_targets
from runnerkit.lora.formats import Adapter, LayerDelta, LoRAError, match_adapter, read_adapter

__all__ = ["Adapter", "LayerDelta", "LoRAError", "LoRALinear", "LoRAManager", "attach_slots", "linear_targets",
           "match_adapter", "read_adapter"]
