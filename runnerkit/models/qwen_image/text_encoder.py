"""Qwen2.5-VL text encoder of Qwen-Image: architecture, loading, and prompt encoding.

The network is transformers' `Qwen2_5_VLForConditionalGeneration` (a well-kept implementation);
runnerkit owns reading it from a diffusers `text_encoder/` folder and the prompt encoding, which
follows diffusers 0.42 `QwenImagePipeline` (text-to-image), `QwenImageEditPipeline` (one image)
and `QwenImageEditPlusPipeline` (one or more images): the prompt is put in a chat template, the
last hidden state (after the final norm) is taken for the valid tokens, and the first `drop_idx`
tokens (the system prompt and chat prefix) are dropped.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import PIL.Image
import torch
import transformers
from loguru import logger
from pydantic import Field, ValidationInfo, model_validator
from torch import nn

from runnerkit.arch import Arch
from runnerkit.config import OffloadConfig
from runnerkit.models.qwen_image.tokenizer_files import TINY_SPECIAL_IDS, TINY_VOCAB_SIZE
from runnerkit.models.qwen_image.vl_images import (
    VL_AREA,
    EditVariant,
    calculate_dimensions,
    resize_for_vl,
    vl_image_size,
)
from runnerkit.offload.encoders import KeyRules, hf_skeleton, prefixed_key_map, stream_from_files
from runnerkit.offload.layout import StreamSpec
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.synthetic import save_pretrained_here
from runnerkit.weights import (
    CheckpointError,
    loading_info_problems,
    own_cpu_memory,
    read_json_object,
    safetensors_files,
    safetensors_infos,
    synthetic_tensor,
)

T2I_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                "<|im_end|>\n<|im_start|>assistant\n")
"""QwenImagePipeline's chat template; `{}` is the prompt."""
T2I_DROP_IDX = 34
"""Tokens of the T2I template before the prompt (real Qwen2 tokenizer), dropped from the output."""
_EDIT_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                "objects, background), then explain how the user's text instruction should alter or modify the "
                "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                "the original input where appropriate.<|im_end|>\n<|im_start|>user\n")
EDIT_TEMPLATE = _EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
"""QwenImageEditPipeline's template: the one image sits before the prompt."""
EDIT_PLUS_TEMPLATE = _EDIT_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
"""QwenImageEditPlusPipeline's template; `{}` is the picture prefixes followed by the prompt."""
EDIT_PLUS_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
"""Edit-Plus prefix of each reference image, numbered from 1."""
EDIT_DROP_IDX = 64
"""Tokens dropped by both edit pipelines (system prompt and chat prefix, real Qwen2 tokenizer)."""
TOKENIZER_MAX_LENGTH = 1024
"""Most prompt tokens kept after the template prefix (diffusers `tokenizer_max_length`)."""


class QwenVLArch(Arch):
    """Qwen2.5-VL (text decoder + vision tower); defaults are Qwen2.5-VL-7B-Instruct, as in
    `Qwen/Qwen-Image` `text_encoder/config.json`."""

    # text decoder
    vocab_size: int = Field(152064, gt=0, description="Token embedding rows (>= the tokenizer's ids).")
    hidden_size: int = Field(3584, gt=0, description="Decoder width; the width of the prompt embeddings.")
    intermediate_size: int = Field(18944, gt=0, description="SwiGLU MLP inner size.")
    num_hidden_layers: int = Field(28, gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(28, gt=0, description="Query heads.")
    num_key_value_heads: int = Field(4, gt=0, description="Key/value heads (grouped-query attention).")
    rope_theta: float = Field(1_000_000.0, gt=0, description="RoPE base frequency.")
    mrope_section: tuple[int, int, int] = Field(
        (16, 24, 24), strict=False, description="Multimodal RoPE: rotary pairs given to the (temporal, height, "
        "width) position ids; sums to head_dim / 2.")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
    max_position_embeddings: int = Field(128000, gt=0, description="Longest position the model was built for.")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the token embedding (7B: no).")
    # vision tower
    vision_depth: int = Field(32, gt=0, description="Vision transformer blocks.")
    vision_hidden_size: int = Field(1280, gt=0, description="Vision transformer width.")
    vision_intermediate_size: int = Field(3420, gt=0, description="Vision SwiGLU MLP inner size.")
    vision_num_heads: int = Field(16, gt=0, description="Vision attention heads.")
    vision_out_hidden_size: int = Field(3584, gt=0, description="Patch merger output width (= `hidden_size`).")
    patch_size: int = Field(14, gt=0, description="Spatial patch of the vision tower (pixels).")
    spatial_merge_size: int = Field(2, gt=0, description="Patches merged per side into one LLM token (2x2).")
    temporal_patch_size: int = Field(2, gt=0, description="Frames per patch (an image is repeated to 2).")
    window_size: int = Field(112, gt=0, description="Window attention side (pixels).")
    fullatt_block_indexes: tuple[int, ...] = Field(
        (7, 15, 23, 31), strict=False, description="Vision blocks with full (not windowed) attention.")
    tokens_per_second: int = Field(2, gt=0, description="Temporal RoPE positions per second of video.")
    # special token ids
    image_token_id: int = Field(151655, ge=0, description="`<|image_pad|>`: one per merged image patch.")
    video_token_id: int = Field(151656, ge=0, description="`<|video_pad|>`.")
    vision_start_token_id: int = Field(151652, ge=0, description="`<|vision_start|>`.")
    vision_end_token_id: int = Field(151653, ge=0, description="`<|vision_end|>`.")
    bos_token_id: int = Field(151643, ge=0, description="`<|endoftext|>`.")
    eos_token_id: int = Field(151645, ge=0, description="`<|im_end|>`.")

    @property
    def head_dim(self) -> int:
        """Decoder attention head size (128 for 7B)."""
        return self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> QwenVLArch:
        if self._check(info, "hidden_size", "num_attention_heads", "num_key_value_heads"):
            if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
                raise ValueError(f"`hidden_size`={self.hidden_size} must be a multiple of `num_attention_heads`="
                                 f"{self.num_attention_heads}, itself a multiple of `num_key_value_heads`="
                                 f"{self.num_key_value_heads}")
        if self._check(info, "mrope_section", "hidden_size", "num_attention_heads") and \
                2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"`mrope_section` {list(self.mrope_section)} must sum to head_dim / 2 = "
                             f"{self.head_dim // 2}")
        if self._check(info, "vision_hidden_size", "vision_num_heads") and \
                self.vision_hidden_size % self.vision_num_heads:
            raise ValueError(f"`vision_hidden_size`={self.vision_hidden_size} must be a multiple of "
                             f"`vision_num_heads`={self.vision_num_heads}")
        if self._check(info, "vision_out_hidden_size", "hidden_size") and \
                self.vision_out_hidden_size != self.hidden_size:
            raise ValueError(f"`vision_out_hidden_size`={self.vision_out_hidden_size} must equal `hidden_size`="
                             f"{self.hidden_size}: image tokens replace text embeddings")
        if self._check(info, "fullatt_block_indexes", "vision_depth") and \
                any(not 0 <= i < self.vision_depth for i in self.fullatt_block_indexes):
            raise ValueError(f"`fullatt_block_indexes` {list(self.fullatt_block_indexes)} must lie in "
                             f"[0, {self.vision_depth})")
        if self._check(info, "window_size", "patch_size", "spatial_merge_size") and \
                self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(f"`window_size`={self.window_size} must be a multiple of `patch_size` x "
                             f"`spatial_merge_size` = {self.patch_size * self.spatial_merge_size}")
        return self

    def to_hf_config(self) -> transformers.Qwen2_5_VLConfig:
        """The transformers `Qwen2_5_VLConfig` of this architecture (text_config nested, 5.x style)."""
        text = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings, "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "mrope_section": list(self.mrope_section)},
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        vision = {
            "depth": self.vision_depth, "hidden_size": self.vision_hidden_size, "hidden_act": "silu",
            "intermediate_size": self.vision_intermediate_size, "num_heads": self.vision_num_heads,
            "in_channels": 3, "patch_size": self.patch_size, "spatial_merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size, "tokens_per_second": self.tokens_per_second,
            "window_size": self.window_size, "out_hidden_size": self.vision_out_hidden_size,
            "fullatt_block_indexes": list(self.fullatt_block_indexes),
        }
        return transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=self.image_token_id,
            video_token_id=self.video_token_id, vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id, tie_word_embeddings=self.tie_word_embeddings)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> QwenVLArch:
        """Read a `text_encoder/config.json` as transformers 4.x writes it (text fields at the top
        level, `rope_scaling`, `vision_config`) or 5.x (`text_config` nested, `rope_parameters`).

        Keys that do not change the encoder's output (dropout, `use_cache`, `torch_dtype`,
        `architectures`, `initializer_range`, ...) are ignored.

        Raises:
            ValueError: a required key is missing, or a key holds a value this encoder does not
                implement (named with the allowed values).
        """
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping):
            raise ValueError("`vision_config`: missing or not an object in the Qwen2.5-VL config")
        nested = config.get("text_config")
        text = {**config, **nested} if isinstance(nested, Mapping) else dict(config)
        _require_value(config, "model_type", ("qwen2_5_vl",))
        _require_value(text, "hidden_act", ("silu",))
        _require_value(vision, "hidden_act", ("silu",))
        _require_value(vision, "in_channels", (3,))
        _require_value(text, "use_sliding_window", (False,))
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"`rope_scaling.rope_type`: {rope_type!r} is not supported; allowed: ['default', 'mrope']")
        if "mrope_section" not in rope:
            raise ValueError("`rope_scaling.mrope_section`: missing from the Qwen2.5-VL config")

        def need(source: Mapping[str, Any], key: str, where: str = "") -> Any:
            if key not in source:
                raise ValueError(f"`{where}{key}`: missing from the Qwen2.5-VL config")
            return source[key]

        values: dict[str, Any] = {
            k: need(text, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "rms_norm_eps", "max_position_embeddings")}
        values["num_key_value_heads"] = text.get("num_key_value_heads") or values["num_attention_heads"]
        values["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", 1_000_000.0)))
        values["mrope_section"] = rope["mrope_section"]
        values["tie_word_embeddings"] = config.get("tie_word_embeddings", False)
        for ours, theirs in (("vision_depth", "depth"), ("vision_hidden_size", "hidden_size"),
                             ("vision_intermediate_size", "intermediate_size"), ("vision_num_heads", "num_heads"),
                             ("vision_out_hidden_size", "out_hidden_size"), ("patch_size", "patch_size"),
                             ("spatial_merge_size", "spatial_merge_size"),
                             ("temporal_patch_size", "temporal_patch_size"), ("window_size", "window_size"),
                             ("fullatt_block_indexes", "fullatt_block_indexes")):
            values[ours] = need(vision, theirs, "vision_config.")
        values["tokens_per_second"] = vision.get("tokens_per_second", 2)
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                    "bos_token_id", "eos_token_id"):
            if key in text:
                values[key] = text[key]
        return cls.model_validate(values)


def _require_value(source: Mapping[str, Any], key: str, allowed: tuple[Any, ...]) -> None:
    if key in source and source[key] not in allowed:
        raise ValueError(f"`{key}`: {source[key]!r} is not supported by the Qwen2.5-VL text encoder; "
                         f"allowed: {list(allowed)}")


TINY_QWEN_VL = QwenVLArch(
    vocab_size=TINY_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, mrope_section=(2, 3, 3), max_position_embeddings=4096, vision_depth=2,
    vision_hidden_size=32, vision_intermediate_size=64, vision_num_heads=2, vision_out_hidden_size=32,
    fullatt_block_indexes=(1,), image_token_id=TINY_SPECIAL_IDS["<|image_pad|>"],
    video_token_id=TINY_SPECIAL_IDS["<|video_pad|>"], vision_start_token_id=TINY_SPECIAL_IDS["<|vision_start|>"],
    vision_end_token_id=TINY_SPECIAL_IDS["<|vision_end|>"], bos_token_id=TINY_SPECIAL_IDS["<|endoftext|>"],
    eos_token_id=TINY_SPECIAL_IDS["<|im_end|>"])
"""A Qwen2.5-VL small enough for CPU tests, matching `write_tiny_tokenizer`'s ids (head_dim 16)."""


# ---- loading ---------------------------------------------------------------------------------

def load_text_encoder(folder: Path, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Load the `Qwen2_5_VLForConditionalGeneration` of a transformers-format folder strictly.

    The folder holds `config.json` and `model.safetensors` or shards with
    `model.safetensors.index.json` (diffusers' `text_encoder/`). Weights are cast to `dtype`
    (Qwen-Image: bfloat16) and moved to `device`; the module is in eval mode without gradients.

    Raises:
        CheckpointError: the folder or its config is missing or unreadable (the path named), the
            config is not a supported Qwen2.5-VL, transformers cannot read the weights, or keys are
            missing, unexpected or of another shape (listed).
    """
    start = time.perf_counter()
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"text_encoder: {folder} is not a folder")
    config = read_json_object(folder / "config.json", "text_encoder")
    try:
        arch = QwenVLArch.from_hf_config(config)
    except ValueError as exc:
        raise CheckpointError(f"text_encoder: {folder / 'config.json'}: {exc}") from None
    try:
        transformers.utils.logging.disable_progress_bar()  # runnerkit logs one line per module instead
        model, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            folder, dtype=dtype, local_files_only=True, use_safetensors=True, output_loading_info=True,
            ignore_mismatched_sizes=True)  # reported in `info` below, then refused with the keys named
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"text_encoder: transformers cannot load {folder}: {exc}") from None
    problems = loading_info_problems(info)
    if problems:
        raise CheckpointError(f"text_encoder: {folder} does not match the Qwen2.5-VL architecture; "
                              + "; ".join(problems))
    model = own_cpu_memory(model.to(device)).eval().requires_grad_(False)
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    logger.info(f"text_encoder: loaded Qwen2.5-VL ({arch.num_hidden_layers} layers, {gib:.2f} GiB, {dtype}) "
                f"in {time.perf_counter() - start:.2f} s")
    return model


STREAM_SPEC = StreamSpec(blocks_attr="language_model.layers", phases=("self_attn", "mlp"), keep_fp32=lambda name: False,
                         per_step=False)
"""Layer streaming of `Qwen2_5_VLModel` (`offload.stream_modules` lists "text_encoder"): the decoder
layers, or their attention and MLP (mode "phase"; the layer norms then stay resident). The vision
tower, the token embedding and the final norm stay resident; nothing is kept in float32 (as
`from_pretrained(dtype=...)` loads it)."""
KEY_RULES: KeyRules = (("language_model.", ("model.", "model.language_model.")),
                       ("visual.", ("visual.", "model.visual.")))
"""`Qwen2_5_VLModel` name prefix -> the file's: transformers 4.x files (diffusers' `text_encoder/`) name the
decoder `model.*` and the vision tower `visual.*`; 5.x in-memory names add `model.` to both."""


def stream_text_encoder(folder: Path, offload: OffloadConfig, device: torch.device, dtype: torch.dtype
                        ) -> tuple[nn.Module, BlockStreamer]:
    """The `Qwen2_5_VLModel` of a transformers folder (no language-model head: `QwenPromptEncoder` reads
    hidden states) with its decoder layers streamed (`STREAM_SPEC`) from host memory (`offload.storage`
    "cpu") or from the folder's safetensors ("disk"). Its outputs equal `load_text_encoder`'s bit for bit.

    Raises:
        CheckpointError: the folder, its config or its weights are missing or do not fit the model
            (naming the folder and the tensors); see `offload.setup.stream_module`.
    """
    folder = Path(folder)
    config = read_json_object(folder / "config.json", "text_encoder")
    try:
        QwenVLArch.from_hf_config(config)  # refuse what the encoder does not implement, as `load_text_encoder`
        hf_config = transformers.Qwen2_5_VLConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"text_encoder: {folder / 'config.json'}: {exc}") from None
    files = safetensors_files(folder, component="text_encoder")
    if not files:
        raise CheckpointError(f"text_encoder: {folder} holds no *.safetensors weights")
    model = hf_skeleton(lambda: transformers.Qwen2_5_VLModel(hf_config), dtype)
    names = list(model.state_dict(keep_vars=True))
    key_map = prefixed_key_map(names, safetensors_infos(files, "text_encoder"), KEY_RULES, "text_encoder", folder)
    streamer = stream_from_files(model, STREAM_SPEC, offload, device, dtype, "text_encoder", files, key_map)
    return model, streamer


def load_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerBase:
    """The Qwen2 tokenizer of a diffusers `tokenizer/` folder (local files only).

    Raises:
        CheckpointError: naming the folder when it is missing or transformers cannot read it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"tokenizer: {folder} is not a folder")
    if not (folder / "tokenizer.json").is_file() and not ((folder / "vocab.json").is_file()
                                                        and (folder / "merges.txt").is_file()):
        raise CheckpointError(f"tokenizer: {folder} holds neither tokenizer.json nor vocab.json + merges.txt")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"tokenizer: transformers cannot load {folder}: {exc}") from None
    # transformers builds an empty tokenizer from a damaged folder rather than failing: check the
    # template's special tokens are single known ids.
    ids = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_start|>", "<|im_end|>")]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise CheckpointError(f"tokenizer: {folder} does not know Qwen2's special tokens <|im_start|> / <|im_end|> "
                              "(a damaged or foreign tokenizer)")
    return tokenizer


@functools.cache
def processor_class() -> type:
    """`QwenImageTextProcessor`: transformers' `Qwen2_5_VLProcessor` for images and text only (no
    video processor, so it needs neither torchvision nor a video config: Qwen-Image never encodes
    video). Built on first use: subclassing imports transformers' processing stack (~2 s), which
    a process that never runs this family should not pay at start-up."""

    class QwenImageTextProcessor(transformers.Qwen2_5_VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any) -> None:
            self.image_token = "<|image_pad|>"
            self.video_token = "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return QwenImageTextProcessor


def load_processor(folder: Path, backend: Literal["pil", "torchvision"] | None = None) -> Any:
    """The Qwen2.5-VL processor (image processor + tokenizer) of a diffusers `processor/` folder.

    Args:
        backend: the image processor implementation; None takes transformers' default
            (torchvision when installed, else PIL). They resize with slightly different kernels.

    Raises:
        CheckpointError: naming the folder when it is missing or transformers cannot read it.
    """
    folder = Path(folder)
    tokenizer = load_tokenizer(folder)
    kwargs = {"backend": backend} if backend else {}
    try:
        image_processor = transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"processor: transformers cannot load the image processor of {folder}: {exc}") from None
    return processor_class()(image_processor=image_processor, tokenizer=tokenizer)


def write_tiny_text_encoder(folder: Path, arch: QwenVLArch, seed: int, dtype: torch.dtype,
                            max_shard_size: str | None = None) -> Path:
    """Save a Qwen2.5-VL of `arch` with deterministic random weights (transformers layout, safetensors).

    Every tensor comes from `runnerkit.weights.synthetic_tensor(name, shape, seed)`: the same
    values whatever the global RNG state. `load_text_encoder(folder, ...)` reads it back.
    `max_shard_size` (e.g. "50KB") writes shards and `model.safetensors.index.json`; None: one file.

    Returns:
        `folder`.
    """
    config = arch.to_hf_config()
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    state = {name: synthetic_tensor(name, tuple(t.shape), seed, dtype) for name, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.config.dtype = dtype
    transformers.utils.logging.disable_progress_bar()
    save_pretrained_here(model, Path(folder), safe_serialization=True,
                         **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return Path(folder)


# ---- prompt encoding -------------------------------------------------------------------------

def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest of `buckets` (increasing token counts) that holds `length` tokens; `length`
    itself when no bucket does (or `buckets` is empty): such a text runs unpadded."""
    return next((b for b in buckets if b >= length), length)


@dataclass
class PaddedText:
    """One prompt's conditioning padded to a text bucket (docs/prompt_lengths.md)."""

    embeds: torch.Tensor
    """[L_bucket, hidden_size] (model dtype): the valid tokens' states, then zeros."""
    mask: torch.Tensor
    """[L_bucket] bool on the embeddings' device: True for the first `length` rows."""
    length: int
    """Valid tokens (what an unpadded `encode_t2i` returns)."""


class QwenPromptEncoder:
    """Turns prompts (and reference images) into Qwen-Image text conditioning.

    Holds a Qwen2 tokenizer, a Qwen2.5-VL processor (for edits) and the loaded
    `Qwen2_5_VLForConditionalGeneration`. One prompt per call; no padding is involved.
    """

    def __init__(self, tokenizer: Any, processor: Any, model: nn.Module) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.model = model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def encode_t2i(self, prompt: str, max_tokens: int = TOKENIZER_MAX_LENGTH) -> torch.Tensor:
        """Text-to-image conditioning of one prompt (diffusers `QwenImagePipeline.encode_prompt`).

        The templated prompt is tokenized, cut to `T2I_DROP_IDX + max_tokens` tokens (a warning
        is logged when this drops tokens), encoded, and the first `T2I_DROP_IDX` positions dropped.
        Cutting the input instead of the output (diffusers cuts at 1024 + 34, then slices to
        `max_sequence_length`) gives the same states: the decoder is causal.

        Args:
            prompt: the user prompt.
            max_tokens: most tokens returned, in [1, 1024] (diffusers `max_sequence_length`).

        Returns:
            Tensor [L, hidden_size] in the model dtype on the model device, L <= max_tokens.

        Raises:
            ValueError: `prompt` is not a string, or `max_tokens` is out of range.
        """
        ids = self.t2i_ids(prompt, max_tokens)  # [1, L]
        return self._encode({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, T2I_DROP_IDX)

    def t2i_ids(self, prompt: str, max_tokens: int = TOKENIZER_MAX_LENGTH) -> torch.Tensor:
        """Token ids [1, L] of the templated prompt, cut to `T2I_DROP_IDX + max_tokens` (a warning
        is logged when this drops tokens). Raises ValueError as `encode_t2i`."""
        if not isinstance(prompt, str):
            raise ValueError(f"`prompt` must be a string, got {type(prompt).__name__}")
        if not 1 <= max_tokens <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"`max_tokens` must be in [1, {TOKENIZER_MAX_LENGTH}], got {max_tokens}")
        ids = self.tokenizer(T2I_TEMPLATE.format(prompt), return_tensors="pt").input_ids  # [1, L]
        limit = T2I_DROP_IDX + max_tokens
        if ids.shape[1] > limit:
            logger.warning(f"text_encoder: prompt truncated to {max_tokens} tokens "
                           f"({ids.shape[1] - limit} tokens dropped)")
            ids = ids[:, :limit]
        return ids

    @torch.inference_mode()
    def encode_t2i_padded(self, prompt: str, buckets: Sequence[int], max_tokens: int = TOKENIZER_MAX_LENGTH,
                          pad_to: int | None = None) -> PaddedText:
        """`encode_t2i` with the text padded to its bucket: the encoder runs on `T2I_DROP_IDX +
        L_bucket` tokens (the prompt's, then pad tokens) and returns L_bucket rows.

        Exact: the Qwen2.5-VL decoder is causal, so a pad token appended after the prompt is seen by
        no valid token (the causal mask itself excludes it; no padding mask is passed, so every
        length of a bucket runs the same causal kernel), and valid tokens keep their positions
        0..L-1. The pad rows of the output are zeroed. The valid rows equal `encode_t2i`'s up to the
        kernels' summation order over a longer sequence.

        Args:
            prompt, max_tokens: as `encode_t2i`.
            buckets: increasing token counts (`bucket_length`); a text longer than the largest runs
                unpadded (mask all True).
            pad_to: a length to pad to instead of the prompt's bucket (warmup: each bucket), >= the
                prompt's token count.

        Returns:
            PaddedText: embeds [L_bucket, hidden_size], mask [L_bucket] bool, the valid length.

        Raises:
            ValueError: as `encode_t2i`, or `pad_to` shorter than the prompt.
        """
        ids = self.t2i_ids(prompt, max_tokens)  # [1, T2I_DROP_IDX + L]
        length = ids.shape[1] - T2I_DROP_IDX
        target = bucket_length(length, buckets) if pad_to is None else pad_to
        if target < length:
            raise ValueError(f"`pad_to` ({pad_to}) is shorter than the prompt's {length} tokens")
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        padded = torch.cat([ids, ids.new_full((1, target - length), pad_id)], dim=1)  # [1, T2I_DROP_IDX + L_b]
        states = self._encode({"input_ids": padded, "attention_mask": torch.ones_like(padded)}, T2I_DROP_IDX)
        mask = torch.arange(target, device=states.device) < length  # [L_b]
        return PaddedText(embeds=states.masked_fill(~mask[:, None], 0), mask=mask, length=length)

    @torch.inference_mode()
    def encode_edit(self, prompt: str, images: list[PIL.Image.Image], variant: EditVariant) -> torch.Tensor:
        """Edit conditioning of one prompt with its reference images (diffusers
        `QwenImageEditPipeline` / `QwenImageEditPlusPipeline` `encode_prompt`).

        Edit: one image, placed before the prompt by the template. Edit-Plus: each image gets a
        `Picture {i}: ` prefix (i from 1) before the prompt. The processor expands each
        `<|image_pad|>` to (H/28) x (W/28) tokens of its `smart_resize`d image (multiples of 28),
        normalises and patchifies; the vision tower's features replace those tokens. Like the
        reference, edits are not truncated. The first `EDIT_DROP_IDX` positions are dropped.

        Args:
            prompt: the edit instruction.
            images: RGB images already resized for the VL encoder (`resize_for_vl`).
            variant: "edit" (exactly one image) or "edit_plus" (one or more).

        Returns:
            Tensor [L, hidden_size] in the model dtype on the model device.

        Raises:
            ValueError: `variant` unknown, no image, or more than one image for "edit".
        """
        if variant not in VL_AREA:
            raise ValueError(f"`variant` must be one of {list(VL_AREA)}, got {variant!r}")
        if not isinstance(prompt, str):
            raise ValueError(f"`prompt` must be a string, got {type(prompt).__name__}")
        if not images or (variant == "edit" and len(images) != 1):
            raise ValueError(f"`images`: {variant!r} takes {'exactly one' if variant == 'edit' else 'one or more'} "
                             f"images, got {len(images)}")
        if variant == "edit":
            text = EDIT_TEMPLATE.format(prompt)
        else:
            pictures = "".join(EDIT_PLUS_PICTURE.format(i + 1) for i in range(len(images)))
            text = EDIT_PLUS_TEMPLATE.format(pictures + prompt)
        inputs = self.processor(text=[text], images=list(images), padding=True, return_tensors="pt")
        return self._encode(dict(inputs), EDIT_DROP_IDX)

    def _encode(self, inputs: dict[str, torch.Tensor], drop_idx: int) -> torch.Tensor:
        """Last hidden state (after the final norm) of the valid tokens, the first `drop_idx` dropped.

        Runs the `Qwen2_5_VLModel` alone (of a `Qwen2_5_VLForConditionalGeneration`: its `.model`, which
        its forward calls before the head): the language-model head is not used."""
        device = self.device
        mask = inputs["attention_mask"].to(device)  # [1, L]
        model = self.model.model if isinstance(self.model, transformers.Qwen2_5_VLForConditionalGeneration) \
            else self.model
        out = model(
            input_ids=inputs["input_ids"].to(device), attention_mask=mask,
            pixel_values=inputs["pixel_values"].to(device) if "pixel_values" in inputs else None,
            image_grid_thw=inputs["image_grid_thw"].to(device) if "image_grid_thw" in inputs else None,
            output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # [L, D]
        return hidden[mask[0].bool()][drop_idx:].to(self.dtype)  # [L_valid - drop_idx, D]


__all__ = ["EDIT_DROP_IDX", "EDIT_PLUS_PICTURE", "EDIT_PLUS_TEMPLATE", "EDIT_TEMPLATE", "T2I_DROP_IDX",
           "T2I_TEMPLATE", "TINY_QWEN_VL", "TOKENIZER_MAX_LENGTH", "PaddedText", "bucket_length", "processor_class",
           "QwenPromptEncoder",
           "QwenVLArch", "calculate_dimensions", "load_processor", "load_text_encoder", "load_tokenizer",
           "resize_for_vl", "stream_text_encoder", "vl_image_size", "write_tiny_text_encoder", "STREAM_SPEC"]
