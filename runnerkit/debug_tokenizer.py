"""A tiny deterministic character-level tokenizer for synthetic debug checkpoints.

Tiny test configurations (and `synthetic_checkpoint`) need a tokenizer that every family's
text path can load without downloading one: `write_debug_tokenizer` writes a `tokenizer.json`
(HF `tokenizers` library) with T5-style special tokens, which transformers loads too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, processors

EOS_TOKEN = "</s>"
"""End-of-sequence token the post-processor appends (umt5's)."""

DEBUG_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", EOS_TOKEN, "<unk>")
"""Special tokens of the debug tokenizer, at ids 0, 1, 2 (umt5's order)."""


def write_debug_tokenizer(path: Path, vocab_size: int) -> Path:
    """Write a deterministic character-level `tokenizer.json` into the folder `path`.

    Ids: `<pad>` 0, `</s>` 1, `<unk>` 2, then the printable ASCII characters from space (3) to
    `~` (97), cut to fit below `vocab_size`; any other character maps to `<unk>`. A
    post-processor appends `</s>`. The folder also gets a `tokenizer_config.json`, so
    transformers loads it too (`AutoTokenizer.from_pretrained(folder)`, or
    `PreTrainedTokenizerFast(tokenizer_file=..., pad_token="<pad>")`).

    Returns:
        The path of the written tokenizer.json.

    Raises:
        ValueError: `vocab_size` < 4 (three specials and at least one character).
    """
    if vocab_size < len(DEBUG_SPECIAL_TOKENS) + 1:
        raise ValueError(f"`vocab_size` must be >= {len(DEBUG_SPECIAL_TOKENS) + 1}, got {vocab_size}")
    chars = [chr(c) for c in range(0x20, 0x7F)][: vocab_size - len(DEBUG_SPECIAL_TOKENS)]
    vocab = {token: i for i, token in enumerate([*DEBUG_SPECIAL_TOKENS, *chars])}
    # BPE without merges is a character-level model that maps unknown characters to <unk>.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(list(DEBUG_SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}", pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
        special_tokens=[(EOS_TOKEN, vocab[EOS_TOKEN])])
    tokenizer.decoder = decoders.Fuse()

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "tokenizer.json"
    file.write_text(tokenizer.to_str(pretty=True))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": EOS_TOKEN,
              "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return file
