"""The umt5-xxl tokenizer as Wan2.1 drives it, on the `tokenizers` library (HF fast tokenizers).

Wan2.1 (`wan/modules/tokenizers.py`, `HuggingfaceTokenizer(clean='whitespace')`) cleans each
prompt, tokenizes it with special tokens (T5 appends `</s>`), truncates to `text_len` and pads
to `text_len`. This module does the same from the `tokenizer.json` the umt5-xxl folder ships,
without importing transformers. Synthetic debug checkpoints ship the tiny character-level
tokenizer of runnerkit/debug_tokenizer.py (`write_debug_tokenizer`, re-exported here).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer, processors

from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.weights import CheckpointError

PAD_ID = 0
"""Padding id of umt5 (`<pad>`); Wan pads every prompt to `text_len` with it."""
EOS_TOKEN = "</s>"

# Unicode White_Space, the set `\s` matches in the `regex` package Wan uses. Python's `re`
# `\s` would also match U+001C..U+001F, which Wan keeps.
_WHITESPACE = re.compile(
    "[\u0009-\u000d\u0020\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+"
)


def clean_prompt(text: str) -> str:
    """Wan's `clean='whitespace'`: unescape HTML twice, strip, collapse whitespace runs to one space.

    Wan first runs `ftfy.fix_text` (mojibake and odd-unicode repair). runnerkit does not depend
    on ftfy, so text that ftfy would repair (mojibake such as mis-decoded UTF-8, stray control
    or compatibility characters) may tokenize differently from Wan; ordinary text is unaffected.
    """
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip()


class WanTokenizer:
    """Tokenizes prompts into fixed-length id and mask tensors, as Wan2.1's T5 tokenizer does.

    Build it with `WanTokenizer.from_file(path)`. A `tokenizer.json` without a post-processor
    gets one that appends `</s>`, which is what transformers' T5 tokenizer always adds.
    """

    def __init__(self, tokenizer: Tokenizer, source: Path) -> None:
        self._tokenizer = tokenizer
        self.source = source
        if tokenizer.post_processor is None:
            eos_id = tokenizer.token_to_id(EOS_TOKEN)
            if eos_id is None:
                raise ValueError(f"tokenizer {source} has no post-processor and no {EOS_TOKEN!r} token to append")
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"$A {EOS_TOKEN}", pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
                special_tokens=[(EOS_TOKEN, eos_id)])

    @classmethod
    def from_file(cls, path: Path) -> WanTokenizer:
        """Load `path`: a `tokenizer.json`, or a folder holding one (e.g. `google/umt5-xxl/`).

        Raises:
            CheckpointError: naming the path when no tokenizer.json is there.
            CheckpointError: naming the file when it is not a tokenizer.json the `tokenizers`
                library can read (not UTF-8, not JSON, truncated, not a tokenizer).
        """
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"tokenizer: no tokenizer.json at {path} (the checkpoint's tokenizer file, or a "
                                  "folder holding tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception with serde's message
            raise CheckpointError(f"tokenizer: {file} is not a valid tokenizer.json ({exc})") from None
        return cls(tokenizer, file)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (specials and added tokens included)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, prompts: list[str], text_len: int) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Clean, tokenize (with `</s>`), truncate and pad `prompts` to `text_len` tokens.

        Truncation keeps the special tokens: a prompt longer than `text_len` keeps its first
        `text_len - 1` tokens and ends with `</s>`, as transformers' fast tokenizers do with
        `truncation=True, max_length=text_len` (Wan's call).

        Args:
            prompts: B prompt strings.
            text_len: tokens per prompt after truncation/padding (Wan2.1: 512).

        Returns:
            ids: LongTensor [B, text_len], padded with 0.
            mask: LongTensor [B, text_len], 1 for tokens and 0 for padding.

        Raises:
            ValueError: `prompts` is empty or holds a non-string, or `text_len` < 1.
        """
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"`prompts` must be a non-empty list of strings, got {prompts!r}")
        if text_len < 1:
            raise ValueError(f"`text_len` must be >= 1, got {text_len}")
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=text_len)
        encodings = self._tokenizer.encode_batch([clean_prompt(p) for p in prompts], add_special_tokens=True)
        ids = torch.full((len(prompts), text_len), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), text_len), dtype=torch.long)
        for i, encoding in enumerate(encodings):
            n = len(encoding.ids)
            ids[i, :n] = torch.tensor(encoding.ids, dtype=torch.long)
            mask[i, :n] = 1
        return ids, mask


__all__ = ["PAD_ID", "WanTokenizer", "clean_prompt", "write_debug_tokenizer"]
