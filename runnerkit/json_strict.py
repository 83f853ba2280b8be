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
    """A JSON object of the text names `key` twice; `where` is the path of that object ("" at the top level,
    e.g. "lora[0]" or "model.transformer"); `field` is the key's path ("lora[0].strength")."""

    def __init__(self, key: str, where: str, first: Any, second: Any) -> None:
        self.field = f"{where}.{key}" if where else key
        place = f" of `{where}`" if where else ""
        super().__init__(f"key {_short(key)} appears twice in one JSON object{place} (values {_short(first)} and "
                         f"{_short(second)}): keep one")


class _Repeated(dict):  # type: ignore[type-arg]
    """An object that named a key twice: `repeated` is (key, first value, second value)."""

    repeated: tuple[str, Any, Any]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:48]}... ({len(text)} characters)"  # e.g. a base64 image


def _repeated(value: Any) -> tuple[str, _Repeated] | None:
    """The path and the object that named a key twice (one per text at most), or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, _Repeated):
            return path, node
        if isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`, every object checked for a repeated key (the first one decoded is reported).

    Raises:
        DuplicateKeyError: an object names a key twice (its path and both values in the message).
        json.JSONDecodeError, UnicodeDecodeError, ValueError (an integer over Python's digit limit),
            RecursionError (nesting deeper than about 1000 levels): as `json.loads`.
    """
    found = False

    def pairs_to_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj and not found:
                found = True
                marked = _Repeated(obj)
                marked.repeated = (key, obj[key], value)
                obj = marked
            obj[key] = value
        return obj

    value = json.loads(text, object_pairs_hook=pairs_to_object)
    if found:
        path_and_object = _repeated(value)
        assert path_and_object is not None, "the object marked while decoding is in the value"
        path, marked = path_and_object
        key, first, second = marked.repeated
        raise DuplicateKeyError(key, path, first, second)
    return value
