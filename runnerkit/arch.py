"""The base of every architecture description (`models/<family>/arch.py` and the shared networks').

An architecture description holds the numbers that define one network (widths, depths, patch
sizes); it is read from a checkpoint or given under the `model` key of a runnerkit JSON config.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo


class Arch(BaseModel):
    """A strict, frozen pydantic model: unknown keys, coercions ("64" for an int, true for a layer
    count) and inf/nan are refused; JSON lists still fill tuple fields declared `strict=False`.

    Validators that relate several fields check them through `_check`, so a partial override
    (validation context {"partial": True}) is checked only once merged with the checkpoint's
    architecture.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def _check(self, info: ValidationInfo, *fields: str) -> bool:
        """Whether to check a rule between `fields`: always for a whole architecture; for a partial
        override (validation context {"partial": True}) only if it gives every one of them (the
        others come from the checkpoint and are checked after merging)."""
        partial = bool(info.context and info.context.get("partial"))
        return not partial or set(fields) <= self.model_fields_set


def config_file_error(exc: ValidationError, model: type[BaseModel], where: str) -> str:
    """`exc` (validating a checkpoint's config file as `model`) as one line per problem naming the key, the
    value and what is allowed, under a first line naming `where` (the file):

        invalid diffusion_decoder config in /ckpt/diffusion_decoder/config.json:
          `latent_channels`: Input should be a valid integer (got '8'); allowed: int > 0
          `bogus`: unknown key (got 3); allowed keys: out_channels, latent_channels, ...
    """
    lines = []
    for e in exc.errors():
        loc = e["loc"]
        key = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        value = e.get("input")
        shown = repr(value) if len(repr(value)) <= 120 else repr(value)[:100] + "..."
        if e["type"] == "extra_forbidden":
            lines.append(f"  `{key}`: unknown key (got {shown}); allowed keys: {', '.join(model.model_fields)}")
        elif not loc:  # a rule between several keys (its message names them)
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            info = model.model_fields.get(str(loc[0]))
            allowed = f"; allowed: {_allowed(info)}" if info is not None else ""
            lines.append(f"  `{key}`: {e['msg']} (got {shown}){allowed}")
    return f"invalid {where}:\n" + "\n".join(lines)


def _allowed(info: Any) -> str:
    """A field's type and bounds as a user reads them: `int > 0`, `'x0' | 'v'`, `tuple[int, int, int]` (a list)."""
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        text = " | ".join(repr(a) for a in typing.get_args(annotation))
    elif isinstance(annotation, type) and typing.get_origin(annotation) is None:
        text = annotation.__name__
    else:
        text = str(annotation).replace("typing.", "") + " (a JSON list)"
    bounds = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "multiple_of": "a multiple of"}
    for meta in info.metadata:
        for attr, word in bounds.items():
            if getattr(meta, attr, None) is not None:
                text += f", {word} {getattr(meta, attr)}" if attr == "multiple_of" else f" {word} {getattr(meta, attr)}"
    return text


def disagreements(configured: Mapping[str, Any], read: Mapping[str, Any], prefix: str = "model") -> list[str]:
    """Each field a config's `model` (`configured`, possibly partial) gives with another value than the
    architecture read from a checkpoint's own files (`read`, `model_dump(mode="json")` of it), as
    "`model.transformer.num_layers` 3 (the checkpoint's: 2)". Nested objects are compared field by field; a
    field or component the checkpoint's architecture does not hold (absent, or None: e.g. the CLIP tower of a
    text-to-video checkpoint) is not compared: the config gives it. Values are compared as JSON (tuples as
    lists; 2 equals 2.0)."""
    out = []
    for key, value in configured.items():
        name = f"{prefix}.{key}"
        theirs = read.get(key)
        if theirs is None:
            continue
        if isinstance(value, Mapping) and isinstance(theirs, Mapping):
            out += disagreements(value, theirs, name)
        elif json.loads(json.dumps(value)) != theirs:
            out.append(f"`{name}` {json.dumps(value)} (the checkpoint's: {json.dumps(theirs)})")
    return out


def component_files(folder: str | Path) -> Callable[[str], str]:
    """Where a diffusers folder states each component's architecture, for `refuse_disagreements`:
    `<folder>/<component>/config.json`, else (a component without its own folder, e.g. one the pipeline class
    implies) `<folder>/model_index.json`."""
    root = Path(folder)

    def file_of(component: str) -> str:
        own = root / component / "config.json"
        return str(own if own.is_file() else root / "model_index.json")

    return file_of


def refuse_disagreements(configured: Mapping[str, Any] | None, read: BaseModel,
                         where: str | Callable[[str], str]) -> None:
    """Refuse a config's `model` that says another architecture than the checkpoint's own config files.

    Args:
        configured: the config's `model` (None: nothing to compare).
        read: the architecture read from the checkpoint's files.
        where: those files, as the error names them: one for the whole architecture, or the file of each
            component (`component_files`), named on each field's line.

    Raises:
        ValueError: naming each field that differs, both values and the file (nothing is silently corrected:
            drop those fields from `model`, or point `model_path` at a checkpoint of that architecture).
    """
    dumped = read.model_dump(mode="json")
    if callable(where):
        found = [line[:-1] + f", in {where(component)})" for component, value in (configured or {}).items()
                 for line in disagreements({component: value}, dumped)]
        head = "the checkpoint's config files"
    else:
        found, head = disagreements(configured or {}, dumped), where
    if found:
        raise ValueError(f"the config's `model` disagrees with the architecture in {head}:\n  "
                         + "\n  ".join(found) + "\n  (the checkpoint's own config wins: drop those fields from "
                         "`model`, or use a checkpoint of that architecture)")
