"""JSON input read strictly: an object that names a key twice is refused.

Python's `json` keeps the last of two equal keys without a word (RFC 8259 leaves which one counts to
the reader), so a config or request that sets a field twice would run with one of its values
silently dropped. Config files, `--requests` lines and the server's JSON bodies are read here.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DuplicateKeyError", "loads"]


class DuplicateKeyError(ValueError):
    """A JSON object of the text names `key` twice (the message names it and both values)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:48]}... ({len(text)} characters)"  # e.g. a base64 image


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKeyError(f"key {key!r} appears twice in one JSON object (values {_short(obj[key])} and "
                                    f"{_short(value)}): keep one", key)
        obj[key] = value
    return obj


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`, every object checked for a repeated key.

    Raises:
        DuplicateKeyError: an object names a key twice.
        json.JSONDecodeError, UnicodeDecodeError: as `json.loads`.
    """
    return json.loads(text, object_pairs_hook=_object)
