"""LTX-2.5's Gemma-4 text model with its decoder layers streamed, as LTX-2.3's Gemma-3 is (text_encoder.py).

`offload.stream_modules` lists "text_encoder" (mode block or phase): the decoder layers of transformers
5.23's `Gemma4UnifiedTextModel` go through the device slots, from pinned host memory (storage "cpu") or
from the folder's safetensors or LTX-2.5's packed file (storage "disk", text_encoder_packed.py); the token
embedding and the final norm stay resident.
What a Gemma-4 layer holds, and why none of it stops it streaming:

- sliding-window and full-attention layers differ in size: the full layers have the wider head
  (`global_head_dim`, 512 in the 12B) and, with `attention_k_eq_v`, no `v_proj` (the key projection's
  output is also the value); the units differ in size, and every slot holds the largest one;
- RoPE: one table per layer type (`rotary_emb.<type>_inv_freq`: the default RoPE of the sliding layers,
  the proportional one of the full layers, a quarter of their head rotated); non-persistent buffers
  computed by the model's own `initialize_weights()` when the skeleton is built (`hf_skeleton`), resident;
- each layer's `layer_scalar` ([1], a persistent buffer, read from the file): resident, outside the unit;
- the attention masks and the RoPE tables are built once per call by the model, outside the layers;
- shared KV (`num_kv_shared_layers` > 0: the last layers reuse the keys and values an earlier layer of
  their type stored, and have no k/v projections or norms; with `use_double_wide_mlp` their MLP is twice
  as wide): what crosses layers are activations (`shared_kv_states`), never weights, so a reusing
  layer's unit is its own q / o projections, q norm and MLP. Gemma-4 12B shares none (0, the default);
- no per-layer input embeddings: the unified text model has none (Gemma-3n's `embed_tokens_per_layer`).

Mode "phase" streams each layer's `self_attn` (projections, q / k norms) and `mlp` as two units; the
four layer norms and `layer_scalar` then stay resident. Device memory = the embedding and final norm
(+ the norms in "phase") + `gpu_slots` x the largest unit (estimate25.py `gemma4_footprint`). The
multimodal embedders and `lm_head` of a `Gemma4UnifiedForConditionalGeneration` folder are never read.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from runnerkit.config import OffloadConfig
from runnerkit.models.ltx2.connectors_arch import LTX2ConnectorsArch
from runnerkit.models.ltx2.text_encoder import stream_text_tower
from runnerkit.models.ltx2.text_encoder_gemma4 import TEXT_PREFIXES, _Gemma4TextTower, gemma4_configs
from runnerkit.offload.encoders import KeyRules
from runnerkit.offload.layout import StreamSpec
from runnerkit.offload.streamer import BlockStreamer

GEMMA4_STREAM_SPEC = StreamSpec(blocks_attr="layers", phases=("self_attn", "mlp"), keep_fp32=lambda name: False,
                                per_step=False)
"""Layer streaming of `Gemma4UnifiedTextModel`: its decoder layers (mode "block"), or their attention and
MLP (mode "phase"); nothing kept in float32 (as `from_pretrained(dtype=...)` loads it); runs once per
request (`offload.resident_blocks` keeps none of its units)."""
GEMMA4_KEY_RULES: KeyRules = (("", ("", *TEXT_PREFIXES)),)
"""Text-model name -> the file's: as it is (a `Gemma4UnifiedTextModel` folder) or under `model.language_model.`."""


def stream_gemma4_text_encoder(folder: str | Path, offload: OffloadConfig, device: torch.device, dtype: torch.dtype,
                               connectors: LTX2ConnectorsArch | None = None
                               ) -> tuple[transformers.Gemma4UnifiedTextModel, BlockStreamer]:
    """The Gemma-4 text model of a transformers folder with its layers streamed (`GEMMA4_STREAM_SPEC`) from
    host memory (`offload.storage` "cpu") or from the folder's safetensors ("disk"); its hidden states equal
    `text_encoder_gemma4.load_gemma4_text_encoder`'s bit for bit.

    Args:
        offload: mode "block" or "phase", storage, slots, prefetch depth, reader, pinning.
        device: where the resident part and the slots live.
        dtype: weight dtype (the release runs it in bfloat16).
        connectors: when given, the model must fit them, checked before any weight is read.

    Returns:
        (model, streamer): the model in eval mode without gradients, every streamed parameter a view into
        a slot; close the streamer before dropping the model.

    Raises:
        CheckpointError: naming the folder: no config.json, not Gemma-4 unified, a model that does not fit
            `connectors`, no `*.safetensors`, or text-model tensors the files lack (listed).
    """
    folder = Path(folder)
    text_config, _ = gemma4_configs(folder)
    return stream_text_tower(_Gemma4TextTower, folder, text_config, offload, device, dtype, connectors, "Gemma-4",
                             GEMMA4_STREAM_SPEC, GEMMA4_KEY_RULES)


__all__ = ["GEMMA4_KEY_RULES", "GEMMA4_STREAM_SPEC", "stream_gemma4_text_encoder"]
