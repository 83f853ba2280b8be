"""Tiny Qwen2-compatible tokenizer and Qwen2.5-VL processor folders, written locally for tests and
synthetic checkpoints (no download).

The tokenizer is a byte-level BPE with the pre-tokenizer, normalizer and decoder of transformers'
`Qwen2Tokenizer`: ids 0-255 are the 256 bytes (GPT-2's byte-to-unicode alphabet, in byte order),
then a few merges, then the Qwen special tokens in the order the real vocabulary has them
(`<|endoftext|>` first, `<|video_pad|>` last). The real Qwen2.5 tokenizer has the same specials
at 151643-151656; `TINY_SPECIAL_IDS` gives the tiny ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
"""Qwen2.5 special tokens, in vocabulary order (real ids 151643 ... 151656)."""

# Splits text into words, numbers, punctuation runs and whitespace the way Qwen2's tokenizer does.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# A handful of merges ("Ġ" is the byte-level space), enough to exercise BPE merging.
_TINY_MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("e", "d"), ("Ġ", "o"),
)

TINY_VOCAB_SIZE = 256 + len(_TINY_MERGES) + len(QWEN_SPECIAL_TOKENS)
"""Ids of the tiny tokenizer: 256 bytes + 10 merges + 14 specials = 280."""
TINY_SPECIAL_IDS: dict[str, int] = {t: 256 + len(_TINY_MERGES) + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}
"""Special token -> id in the tiny tokenizer (`<|endoftext|>` 266 ... `<|video_pad|>` 279)."""

# Qwen2-VL image processor values (Qwen/Qwen-Image-Edit `processor/preprocessor_config.json`).
QWEN2VL_IMAGE_PROCESSOR: dict[str, object] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OpenAI CLIP statistics
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,  # 56 * 56
    "max_pixels": 12845056,  # 28 * 28 * 16384
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "resample": 3,  # PIL bicubic
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)  # control bytes and space move past Latin-1
            shifted += 1
    return table


def write_tiny_tokenizer(folder: Path) -> Path:
    """Write a Qwen2-compatible byte-level BPE tokenizer (`tokenizer.json` + `tokenizer_config.json`).

    transformers loads the folder as a `Qwen2Tokenizer` (`AutoTokenizer.from_pretrained`). Vocabulary:
    `TINY_VOCAB_SIZE` ids, specials at `TINY_SPECIAL_IDS`; any text encodes (bytes are the base
    alphabet), special tokens are single ids. Deterministic: same bytes on every call.

    Returns:
        `folder`.
    """
    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    for left, right in _TINY_MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(_TINY_MERGES), unk_token=None, fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    assert tokenizer.get_vocab_size() == TINY_VOCAB_SIZE, "special tokens must follow the merges"

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    # The values of Qwen2.5-VL's tokenizer_config.json that change encoding or padding.
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "bos_token": None, "model_max_length": 131072, "errors": "replace",
              "split_special_tokens": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def write_tiny_processor(folder: Path) -> Path:
    """Write a Qwen2.5-VL processor folder: the tiny tokenizer + `preprocessor_config.json` with the
    Qwen2-VL image processor values (`QWEN2VL_IMAGE_PROCESSOR`: patch 14, merge 2, temporal patch 2,
    min/max pixels, CLIP mean/std), as diffusers' `processor/` folder holds them.

    Returns:
        `folder`.
    """
    folder = Path(folder)
    write_tiny_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(QWEN2VL_IMAGE_PROCESSOR, indent=2, sort_keys=True)
                                                     + "\n")
    return folder


__all__ = ["QWEN2VL_IMAGE_PROCESSOR", "QWEN_SPECIAL_TOKENS", "TINY_SPECIAL_IDS", "TINY_VOCAB_SIZE",
           "write_tiny_processor", "write_tiny_tokenizer"]
