"""LTX-2.5 prompt encoder: Gemma-4 (unified, transformers) -> stacked hidden states -> the text connectors.

LTX-2.5 swaps Gemma-3 12B for an LTX fine-tune of Gemma-4 12B (`gemma4_unified`, transformers'
`Gemma4UnifiedForConditionalGeneration`; Lightricks calls it `gemma4-12b-ltx-v1`). Everything
around the language model is LTX-2.3's, in diffusers 0.42.1 (`LTX2Pipeline._get_gemma_prompt_embeds`,
`encode_prompt`, stage 3 of `__call__`; `text_encoder.py` describes each step):

1. the prompt is stripped, tokenized with the special tokens, truncated to 1024 tokens and
   LEFT-padded to exactly 1024 (pad token, or eos when there is none);
2. the model runs with `output_hidden_states=True`; its layers + 1 hidden states (the scaled
   embedding output, each decoder layer's output, the last one after the final norm) are stacked
   per token into [B, 1024, D * (layers + 1)] (`connectors.stack_text_hidden_states`);
3. the connectors take them with per_modality_projections (2.3's layout: per-token RMS norm,
   one projection per modality) and `caption_channels` = D, `text_proj_in_factor` = layers + 1,
   read from the Gemma-4 config (diffusers' converter and ltx-core `_create_feature_extractor`).

For text, `Gemma4UnifiedForConditionalGeneration` runs its text model `Gemma4UnifiedTextModel`
on embeddings of the ids with image / video / audio placeholder ids replaced by the pad id
(`Gemma4UnifiedModel.forward`); only that text model is built and read here, with the same
replacement (`Gemma4PromptEncoder.tokenize`). Its causal mask with the "vision" bidirectional
option equals the text model's own for a text-only prompt (tested against the full model).

Loading: a transformers folder (`save_pretrained` of `Gemma4UnifiedForConditionalGeneration`:
keys `model.language_model.*`; the vision / audio embedders `model.embed_vision.*`,
`model.embed_audio.*` and `lm_head.*` are never read), or a `Gemma4UnifiedTextModel` folder.
Lightricks' packed single file (`gemma4-12b-with-proj-ltx-2.5-bf16.safetensors`: config and
tokenizer embedded, the connectors' projection bundled) is read by text_encoder_packed.py, whose
`load_text_model`, `stream_text_model`, `configs_of` and `load_tokenizer` take either.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch
import transformers
from torch import Tensor

from runnerkit.models.ltx2.connectors_arch import LTX2ConnectorsArch
from runnerkit.models.ltx2.text_encoder import MAX_SEQUENCE_LENGTH, GemmaPromptEncoder, load_text_tower
from runnerkit.weights import (
    CheckpointError,
    read_json_object,
)

GEMMA4_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")
"""`model_type` of a `Gemma4UnifiedForConditionalGeneration` folder (the release's class) and of a text-model folder."""
TEXT_PREFIXES = ("model.language_model.",)
"""Prefix of the text model's keys in a `Gemma4UnifiedForConditionalGeneration` folder (transformers 5.23)."""
UNUSED_PREFIXES = ("model.embed_vision.", "model.embed_audio.", "lm_head.")
"""Keys of that folder the text model does not take (never read)."""
MULTIMODAL_TOKEN_FIELDS = ("image_token_id", "video_token_id", "audio_token_id")
"""Placeholder ids of `Gemma4UnifiedConfig` that the full model embeds as the pad id."""


class _Gemma4TextTower(transformers.Gemma4UnifiedTextModel):
    """`Gemma4UnifiedTextModel` that loads from a `Gemma4UnifiedForConditionalGeneration` folder without
    reporting (or reading) the multimodal embedders' tensors."""

    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = ["^" + re.escape(prefix) for prefix in UNUSED_PREFIXES]


def gemma4_configs(folder: str | Path) -> tuple[transformers.Gemma4UnifiedTextConfig, tuple[int, ...]]:
    """The Gemma-4 text config of a transformers folder and the multimodal placeholder ids of its
    top-level config (none for a text-model folder).

    Raises:
        CheckpointError: naming the folder: no config.json, unreadable, or not a Gemma-4 unified model.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"text_encoder: Gemma-4 folder {folder} has no config.json "
                              "(a transformers `save_pretrained` folder of `Gemma4UnifiedForConditionalGeneration`)")
    model_type = read_json_object(folder / "config.json", "text_encoder").get("model_type")
    if model_type not in GEMMA4_MODEL_TYPES:
        raise CheckpointError(f"text_encoder: {folder / 'config.json'} has `model_type`={model_type!r}; "
                              f"allowed: {list(GEMMA4_MODEL_TYPES)} (Gemma-4 unified, LTX-2.5)")
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"text_encoder: transformers cannot read {folder / 'config.json'}: {exc}") from None
    placeholders = tuple(getattr(config, field) for field in MULTIMODAL_TOKEN_FIELDS
                         if getattr(config, field, None) is not None)
    return config.get_text_config(), placeholders


def load_gemma4_text_encoder(folder: str | Path, dtype: torch.dtype, device: torch.device | str,
                             connectors: LTX2ConnectorsArch | None = None) -> transformers.Gemma4UnifiedTextModel:
    """Load the Gemma-4 text model of a transformers folder strictly, without the multimodal embedders.

    Args:
        dtype: weight dtype (the release runs it in bfloat16).
        device: where the model goes (loaded on the CPU first).
        connectors: when given, the model must fit them (`text_encoder.check_fits_connectors`), checked
            before any weight is read.

    Returns:
        The `Gemma4UnifiedTextModel` in eval mode without gradients; attention "sdpa".

    Raises:
        CheckpointError: naming the folder: no config.json, not Gemma-4 unified, no `*.safetensors`,
            a model that does not fit `connectors`, or missing / unexpected / mismatched keys (listed).
    """
    text_config, _ = gemma4_configs(Path(folder))
    return load_text_tower(_Gemma4TextTower, Path(folder), text_config, dtype, device, connectors, "Gemma-4",
                           TEXT_PREFIXES, UNUSED_PREFIXES, "multimodal")


class Gemma4PromptEncoder(GemmaPromptEncoder):
    """Tokenizer + Gemma-4 text model: prompts -> the stacked hidden states the connectors take.

    `GemmaPromptEncoder` (same tokenization, padding, stacking and outputs: [B, 1024, D * (layers + 1)]
    and the int64 mask), with the multimodal placeholder ids embedded as the pad id, as the full
    model does for a text prompt.
    """

    def __init__(self, tokenizer: transformers.PreTrainedTokenizerBase, model: transformers.Gemma4UnifiedTextModel,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, placeholder_ids: Sequence[int] = (),
                 prepend_bos: bool = False) -> None:
        """
        Args:
            placeholder_ids: image / video / audio placeholder ids (`gemma4_configs`' second value).
            prepend_bos: ltx-core's rule (`LTXGemmaTokenizer.tokenize_with_weights`) instead of diffusers':
                a prompt whose ids do not start with the bos token gets it prepended, then is cut to
                `max_sequence_length` (its last token dropped when full). ltx-core notes that Gemma-4's
                tokenizer adds no bos itself; diffusers relies on `add_special_tokens=True`.

        Raises:
            ValueError: `prepend_bos` with a tokenizer without a bos token; else as `GemmaPromptEncoder`.
            CheckpointError: as `GemmaPromptEncoder`.
        """
        super().__init__(tokenizer, model, max_sequence_length)
        if prepend_bos and tokenizer.bos_token_id is None:
            raise ValueError("`prepend_bos` needs a tokenizer with a bos token; this one has none")
        self.prepend_bos = prepend_bos
        self.placeholder_ids = torch.tensor(sorted(set(placeholder_ids)), dtype=torch.int64)
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def tokenize(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """`GemmaPromptEncoder.tokenize`, placeholder ids replaced by the model's pad id (mask kept).

        Returns:
            ids, mask: int64 [B, max_sequence_length] on the CPU.
        """
        ids, mask = self._tokenize_with_bos(prompts) if self.prepend_bos else super().tokenize(prompts)
        return torch.where(torch.isin(ids, self.placeholder_ids), self.pad_id, ids), mask

    def _tokenize_with_bos(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """ltx-core's tokenization: truncate, prepend bos where missing, cut, left-pad (pad id, mask 0)."""
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"`prompts` must be a non-empty list of strings, got {prompts!r}")
        L, bos = self.max_sequence_length, self.tokenizer.bos_token_id
        ids = torch.full((len(prompts), L), self.tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(prompts), L), dtype=torch.int64)
        for row, prompt in enumerate(prompts):
            tokens = self.tokenizer(prompt.strip(), truncation=True, max_length=L).input_ids
            if not tokens or tokens[0] != bos:
                tokens = [bos, *tokens][:L]
            ids[row, L - len(tokens):] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, L - len(tokens):] = 1
        return ids, mask


__all__ = ["GEMMA4_MODEL_TYPES", "Gemma4PromptEncoder", "gemma4_configs",
           "load_gemma4_text_encoder"]
