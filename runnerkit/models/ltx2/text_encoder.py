"""LTX-2 prompt encoder: Gemma-3 (transformers) -> stacked hidden states -> the text connectors.

The language model is transformers' `Gemma3TextModel` (runnerkit does not write the LLM); runnerkit
owns reading it from a folder, the tokenization and the packing, which follow diffusers 0.42.1
`pipelines/ltx2/pipeline_ltx2.py`, `LTX2Pipeline._get_gemma_prompt_embeds` / `encode_prompt`, and
stage 3 of `LTX2Pipeline.__call__` (the connectors call):

1. Each prompt is stripped, tokenized with the special tokens (Gemma: `<bos>` first), truncated
   to `max_sequence_length` (1024) tokens keeping the first ones, and LEFT-padded (`padding_side`
   left, `padding="max_length"`; an absent pad token falls back to the eos token).
2. Gemma-3 runs on ids and mask with `output_hidden_states=True`; its layers + 1 hidden states
   (embedding output x sqrt(D), layer outputs, the last one after the final norm: transformers
   5.23's convention) are stacked per token: [B, L, D * (layers + 1)], feature d * (layers + 1) + l
   (`connectors.stack_text_hidden_states`), cast to the requested dtype (default: the model's).
3. The connectors take them with the tokenizer's mask and padding side "left" (`text_contexts`).

Padding (diffusers 0.42.1): every prompt is padded to exactly `max_sequence_length` tokens, the
negative prompt ("" when none is given) included: Gemma always runs on [B, 1024] ids, so its cost
is the same for every prompt, and the connectors return [B, 1024, D] contexts (registers fill the
padding, the mask is all ones), so the transformer's text length is 1024 too. A warm server never
meets a new text length; only the batch B varies (1 prompt, or 2 under CFG when batched). Prompts
longer than 1024 tokens are cut (a warning is logged here; diffusers cuts silently). Position ids
are 0..L-1 whatever the padding, as transformers assigns them when none are passed.

Loading: the release's text encoder is `google/gemma-3-12b-it` (`Gemma3ForConditionalGeneration`:
a SigLIP vision tower, a projector and the Gemma-3 text model; keys `language_model.model.*`,
`vision_tower.*`, `multi_modal_projector.*`, or transformers' in-memory `model.language_model.*`, ...).
Only the text model is built (from the config's `text_config`), through transformers'
`from_pretrained` with a `key_mapping` that strips the text prefix (`TEXT_PREFIXES`); the vision
and projector tensors are declared ignorable (`UNUSED_PREFIXES`), and transformers
5.23 never materializes checkpoint keys that map to no parameter (`core_model_loading`), so their
bytes are neither read nor copied to the device. A plain `Gemma3TextModel` folder (the synthetic
tiny one) loads the same way. transformers loads onto the CPU (its `device_map` needs `accelerate`,
which runnerkit does not depend on), then the model moves to `device`. For text-only input
`Gemma3ForConditionalGeneration` runs exactly this text model (same embedding scale, masks, RoPE),
which the parity tests check against the full model.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any
from pathlib import Path

import torch
import transformers
from loguru import logger
from torch import Tensor

from runnerkit.config import OffloadConfig
from runnerkit.models.ltx2.connectors import LTX2TextConnectors, stack_text_hidden_states
from runnerkit.models.ltx2.connectors_arch import LTX2ConnectorsArch
from runnerkit.offload.encoders import KeyRules, hf_skeleton, prefixed_key_map, stream_from_files
from runnerkit.offload.layout import StreamSpec
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.weights import (
    CheckpointError,
    loading_info_problems,
    own_cpu_memory,
    read_json_object,
    safetensors_files,
    safetensors_infos,
)

GEMMA_PADDING_SIDE = "left"
"""diffusers: "Gemma expects left padding for chat-style prompts"; the connectors' 2.0 features read it."""
MAX_SEQUENCE_LENGTH = 1024
"""Tokens per prompt after truncation and padding (diffusers `max_sequence_length` default)."""
GEMMA_MODEL_TYPES = ("gemma3", "gemma3_text")
"""`model_type` of a `Gemma3ForConditionalGeneration` folder (the release) and a `Gemma3TextModel` folder."""
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
"""Prefixes of the text model's keys in a `Gemma3ForConditionalGeneration` checkpoint: the Hub's (which
transformers 5.23 `save_pretrained` also writes) and transformers' in-memory names."""
UNUSED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "language_model.lm_head.", "model.vision_tower.",
                   "model.multi_modal_projector.", "lm_head.")
"""Keys of a `Gemma3ForConditionalGeneration` checkpoint that the text model does not take (never read)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class _GemmaTextTower(transformers.Gemma3TextModel):
    """`Gemma3TextModel` that loads from a `Gemma3ForConditionalGeneration` folder without reporting
    (or reading) the vision tower's and projector's tensors."""

    _keys_to_ignore_on_load_unexpected = ["^" + re.escape(prefix) for prefix in UNUSED_PREFIXES]


# ---- loading ---------------------------------------------------------------------------------

def gemma_text_config(folder: str | Path) -> transformers.Gemma3TextConfig:
    """The Gemma-3 text model's config of a transformers folder (`text_config` of a
    `Gemma3ForConditionalGeneration` config, or the config of a `Gemma3TextModel`).

    Raises:
        CheckpointError: naming the folder: no config.json, unreadable, or not a Gemma-3 model.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"text_encoder: Gemma-3 folder {folder} has no config.json "
                              "(a transformers `save_pretrained` folder, e.g. google/gemma-3-12b-it)")
    model_type = read_json_object(folder / "config.json", "text_encoder").get("model_type")
    if model_type not in GEMMA_MODEL_TYPES:
        raise CheckpointError(f"text_encoder: {folder / 'config.json'} has `model_type`={model_type!r}; "
                              f"allowed: {list(GEMMA_MODEL_TYPES)} (Gemma-3)")
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"text_encoder: transformers cannot read {folder / 'config.json'}: {exc}") from None
    return config.get_text_config()


def check_fits_connectors(text_config: transformers.PretrainedConfig, connectors: LTX2ConnectorsArch,
                          folder: str | Path, name: str = "Gemma-3") -> None:
    """Refuse a Gemma (`name`: "Gemma-3", "Gemma-4") whose stacked hidden states do not fit the connectors'
    input projection.

    Raises:
        CheckpointError: naming `folder` and both numbers: `hidden_size` != `caption_channels`, or
            `num_hidden_layers` + 1 != `text_proj_in_factor`.
    """
    if text_config.hidden_size != connectors.caption_channels:
        raise CheckpointError(f"text_encoder: {folder}: {name} `hidden_size`={text_config.hidden_size} does not fit "
                              f"the connectors' `caption_channels`={connectors.caption_channels}")
    if text_config.num_hidden_layers + 1 != connectors.text_proj_in_factor:
        raise CheckpointError(f"text_encoder: {folder}: {name} has `num_hidden_layers`={text_config.num_hidden_layers}"
                              f" (+ 1 embedding output = {text_config.num_hidden_layers + 1} hidden states) but the "
                              f"connectors stack `text_proj_in_factor`={connectors.text_proj_in_factor}")


def load_gemma_text_encoder(folder: str | Path, dtype: torch.dtype, device: torch.device | str,
                            connectors: LTX2ConnectorsArch | None = None) -> transformers.Gemma3TextModel:
    """Load the Gemma-3 text model of a transformers folder strictly, without the vision tower.

    The folder holds config.json and `*.safetensors` (one file, or shards with an index): the
    release's `google/gemma-3-12b-it` (`Gemma3ForConditionalGeneration`) or a `Gemma3TextModel`.
    See the module docstring for what is and is not read. Attention is transformers' "sdpa".

    Args:
        dtype: weight dtype (the release runs Gemma in bfloat16).
        device: where the model goes (loaded on the CPU first).
        connectors: when given, the model must fit them (`check_fits_connectors`), checked before
            any weight is read.

    Returns:
        The `Gemma3TextModel` in eval mode without gradients (gemma-3-12b-it: 48 layers of width
        3840, about 11.8e9 parameters, 22 GiB in bfloat16).

    Raises:
        CheckpointError: naming the folder: no config.json, not Gemma-3, no `*.safetensors`, a damaged
            shard, a model that does not fit `connectors` (both numbers), or missing / unexpected /
            mismatched text-model keys (listed).
    """
    return load_text_tower(_GemmaTextTower, Path(folder), gemma_text_config(Path(folder)), dtype, device, connectors,
                           "Gemma-3", TEXT_PREFIXES, UNUSED_PREFIXES, "vision/projector")


def load_text_tower(tower: type[transformers.PreTrainedModel], folder: Path, text_config: transformers.PretrainedConfig,
                    dtype: torch.dtype, device: torch.device | str, connectors: LTX2ConnectorsArch | None, name: str,
                    text_prefixes: tuple[str, ...], unused_prefixes: tuple[str, ...], unused: str) -> Any:
    """A Gemma text model (`tower`, named `name`) of a transformers folder, strictly: the connectors fit
    checked first, the text weights under `text_prefixes` read, those under `unused_prefixes` (`unused`,
    e.g. "vision/projector") left unread; on `device` in eval mode, without gradients.

    Raises:
        CheckpointError: naming the folder (see `load_gemma_text_encoder`).
    """
    start = time.perf_counter()
    if connectors is not None:
        check_fits_connectors(text_config, connectors, folder, name)
    files = safetensors_files(folder, component="text_encoder")
    if not files:
        raise CheckpointError(f"text_encoder: {name} folder {folder} holds no *.safetensors weights")
    skipped = {k: e for k, e in safetensors_infos(files, "text_encoder").items() if k.startswith(unused_prefixes)}
    try:
        transformers.utils.logging.disable_progress_bar()  # runnerkit logs one line per module instead
        model, info = tower.from_pretrained(
            folder, config=text_config, dtype=dtype, attn_implementation="sdpa", local_files_only=True,
            use_safetensors=True, output_loading_info=True, ignore_mismatched_sizes=True,  # refused below, named
            key_mapping={"^" + re.escape(prefix): "" for prefix in text_prefixes})
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"text_encoder: transformers cannot load {folder}: {exc}") from None
    problems = loading_info_problems(info)
    if problems:
        raise CheckpointError(f"text_encoder: {folder} does not match its {name} text config; " + "; ".join(problems))
    model = own_cpu_memory(model.to(device)).eval().requires_grad_(False)
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    skipped_gib = sum(e.nbytes for e in skipped.values()) / 2**30
    logger.info(f"text_encoder: loaded {name} text model ({text_config.num_hidden_layers} layers, {gib:.3f} GiB, "
                f"{dtype}, {device}); left {len(skipped)} {unused} tensors ({skipped_gib:.3f} GiB) unread; "
                f"{time.perf_counter() - start:.2f} s")
    return model


STREAM_SPEC = StreamSpec(blocks_attr="layers", phases=("self_attn", "mlp"), keep_fp32=lambda name: False,
                         per_step=False)
"""Layer streaming of the Gemma-3 text model (`offload.stream_modules` lists "text_encoder"): its decoder
layers, or their attention (with its q/k norms) and MLP (mode "phase"; the four layer norms then stay
resident). The token embedding and the final norm stay resident; nothing is kept in float32 (as
`from_pretrained(dtype=...)` loads it)."""
KEY_RULES: KeyRules = (("", ("", *TEXT_PREFIXES)),)
"""Text-model name -> the file's: as it is (a `Gemma3TextModel` folder) or under a `TEXT_PREFIXES` prefix."""


def stream_gemma_text_encoder(folder: str | Path, offload: OffloadConfig, device: torch.device, dtype: torch.dtype,
                              connectors: LTX2ConnectorsArch | None = None
                              ) -> tuple[transformers.Gemma3TextModel, BlockStreamer]:
    """The Gemma-3 text model of a transformers folder with its layers streamed (`STREAM_SPEC`) from host
    memory (`offload.storage` "cpu") or from the folder's safetensors ("disk"); the vision tower and
    projector of a `Gemma3ForConditionalGeneration` folder are never read. Its outputs equal
    `load_gemma_text_encoder`'s bit for bit.

    Raises:
        CheckpointError: as `load_gemma_text_encoder` (naming the folder), or tensors the files lack.
    """
    folder = Path(folder)
    return stream_text_tower(_GemmaTextTower, folder, gemma_text_config(folder), offload, device, dtype, connectors,
                             "Gemma-3", STREAM_SPEC, KEY_RULES)


def stream_text_tower(tower: type[transformers.PreTrainedModel], folder: Path,
                      text_config: transformers.PretrainedConfig, offload: OffloadConfig, device: torch.device,
                      dtype: torch.dtype, connectors: LTX2ConnectorsArch | None, name: str, spec: StreamSpec,
                      key_rules: KeyRules) -> tuple[Any, BlockStreamer]:
    """A Gemma text model (`tower`, named `name`) of a transformers folder built on the meta device
    (`hf_skeleton`), its units (`spec`) streamed and the rest resident on `device`: the connectors fit
    checked first, only the tensors `key_rules` map the model's names to read (`load_text_tower`'s
    counterpart; attention "sdpa", as there).

    Raises:
        CheckpointError: naming the folder: a model that does not fit `connectors`, no `*.safetensors`,
            tensors the files lack (listed), wrong shapes or dtypes.
    """
    if connectors is not None:
        check_fits_connectors(text_config, connectors, folder, name)
    text_config._attn_implementation = "sdpa"  # as `load_text_tower` asks transformers
    files = safetensors_files(folder, component="text_encoder")
    if not files:
        raise CheckpointError(f"text_encoder: {name} folder {folder} holds no *.safetensors weights")
    model = hf_skeleton(lambda: tower(text_config), dtype)
    names = list(model.state_dict(keep_vars=True))
    key_map = prefixed_key_map(names, safetensors_infos(files, "text_encoder"), key_rules, "text_encoder", folder)
    streamer = stream_from_files(model, spec, offload, device, dtype, "text_encoder", files, key_map)
    return model, streamer


def load_gemma_tokenizer(folder: str | Path) -> transformers.PreTrainedTokenizerBase:
    """The Gemma-3 tokenizer of a folder (transformers `AutoTokenizer`, local files only): the Gemma
    folder itself for the single-file release, `tokenizer/` for the diffusers layout
    (`LTX2Checkpoint.tokenizer_path`). As diffusers does, a tokenizer without a pad token pads with
    its eos token.

    Raises:
        CheckpointError: naming the folder: neither tokenizer.json nor tokenizer.model, unreadable,
            or neither a pad nor an eos token.
    """
    folder = Path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"tokenizer: {folder} holds no Gemma tokenizer (neither {' nor '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"tokenizer: transformers cannot load {folder}: {exc}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise CheckpointError(f"tokenizer: {folder} has neither a pad nor an eos token to pad prompts with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---- prompt encoding -------------------------------------------------------------------------

class GemmaPromptEncoder:
    """Tokenizer + Gemma-3 text model: prompts -> the stacked hidden states the connectors take.

    diffusers 0.42.1 `LTX2Pipeline._get_gemma_prompt_embeds` (module docstring). diffusers encodes
    the prompt and the negative prompt in two calls; `encode(["", prompt])` gives the same rows up
    to kernel rounding (every row is padded to the same length, rows are independent).
    """

    def __init__(self, tokenizer: transformers.PreTrainedTokenizerBase, model: transformers.Gemma3TextModel,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> None:
        """
        Raises:
            ValueError: `max_sequence_length` < 1, or the tokenizer has no pad token.
            CheckpointError: the tokenizer has more ids than the model embeds.
        """
        if max_sequence_length < 1:
            raise ValueError(f"`max_sequence_length` must be >= 1, got {max_sequence_length}")
        if tokenizer.pad_token is None:
            raise ValueError("`tokenizer` has no pad token (load it with `load_gemma_tokenizer`)")
        if len(tokenizer) > model.config.vocab_size:
            raise CheckpointError(f"tokenizer: {len(tokenizer)} ids, but the Gemma-3 model embeds only "
                                  f"`vocab_size`={model.config.vocab_size}")
        self.tokenizer = tokenizer
        self.model = model
        self.max_sequence_length = max_sequence_length

    @property
    def device(self) -> torch.device:
        """Where the model's embedding (and so the ids) live."""
        return self.model.embed_tokens.weight.device

    def tokenize(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Strip, tokenize with the special tokens, truncate and left-pad to `max_sequence_length`.

        Returns:
            ids, mask: int64 [B, max_sequence_length] on the CPU; mask 1 for tokens, 0 for padding.

        Raises:
            ValueError: `prompts` is empty or holds a non-string.
        """
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"`prompts` must be a non-empty list of strings, got {prompts!r}")
        prompts = [p.strip() for p in prompts]
        for p in prompts:
            n = len(self.tokenizer(p, add_special_tokens=True).input_ids)
            if n > self.max_sequence_length:
                logger.warning(f"text_encoder: prompt cut to {self.max_sequence_length} tokens "
                               f"({n - self.max_sequence_length} tokens dropped)")
        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt", padding_side=GEMMA_PADDING_SIDE)
        return tokens.input_ids, tokens.attention_mask

    @torch.inference_mode()
    def encode(self, prompt: str | Sequence[str], dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Stacked Gemma-3 hidden states of `prompt` (diffusers `_get_gemma_prompt_embeds`).

        Args:
            prompt: one prompt (B = 1) or B prompts; the negative prompt is "" when the user gives none.
            dtype: dtype of the hidden states (None: the model's, as diffusers).

        Returns:
            hidden_states: [B, L, D * (layers + 1)] on the model's device, L = `max_sequence_length`,
                D = Gemma's `hidden_size` (3840 for 12B, 49 hidden states: 188160 features);
            attention_mask: int64 [B, L] on the model's device, 0 for the padding first, then 1 per token.

        Raises:
            ValueError: see `tokenize`.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        ids, mask = self.tokenize(prompts)  # [B, L] each
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = stack_text_hidden_states(out.hidden_states, dtype=dtype or self.model.dtype)  # [B, L, D*(layers+1)]
        return hidden, mask


def text_contexts(connectors: LTX2TextConnectors, hidden_states: Tensor,
                  attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Video and audio text contexts of encoded prompts (stage 3 of diffusers `LTX2Pipeline.__call__`:
    `self.connectors(prompt_embeds, prompt_attention_mask, padding_side="left")`).

    Args:
        hidden_states: [B, L, D * (layers + 1)] from `GemmaPromptEncoder.encode` (under CFG diffusers
            concatenates [negative, positive] on B first).
        attention_mask: [B, L] its mask.

    Returns:
        video_context [B, L, Dv], audio_context [B, L, Da] (2.0: Dv = Da = 3840; 2.3: 4096 and 2048),
        attention_mask int64 [B, L] (all ones: registers replaced the padding).

    Raises:
        ValueError: L is not a multiple of the connectors' learnable registers (128 in the releases).
    """
    return connectors(hidden_states, attention_mask, padding_side=GEMMA_PADDING_SIDE)


__all__ = ["GEMMA_PADDING_SIDE", "MAX_SEQUENCE_LENGTH", "STREAM_SPEC", "GemmaPromptEncoder", "check_fits_connectors",
           "gemma_text_config", "load_gemma_text_encoder", "load_gemma_tokenizer", "stream_gemma_text_encoder",
           "stream_text_tower", "text_contexts"]
