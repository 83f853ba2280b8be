"""The one table of override flags: every command-line flag that overrides a runner-config key or sets a
request field, and where it applies. The launch script's flags (infer.py), the server's flags
(serve/server.py) and the fields a server job's body accepts (serve/fields.py) are built from it.

    where: "launch"  a flag of `runnerkit` (the launch script)
           "serve"   a flag of `runnerkit serve`
           "body"    a field of a server job's body (under `body_name` where the body calls it otherwise:
                     an image travels as the image itself, not a path)

Light on purpose (the standard library only): the launch script builds its parser before torch loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OVERRIDES", "Override", "add_flags", "body_name", "config_overrides", "override", "request_flags"]

LAUNCH, SERVE, BODY = "launch", "serve", "body"


@dataclass(frozen=True)
class Override:
    """One flag: `--<name>` sets the request field `name` (`key` None) or the config key `key` (dotted: a key of
    a section, e.g. `offload.mode`)."""

    name: str
    help: str  # the launch script's help (or the only one)
    where: frozenset[str]
    type: type = str  # int for numbers; bool: a switch (`store_true`), given as True or left None
    key: str | None = None
    serve_help: str | None = None  # the server's help, where it says it otherwise
    body_name: str | None = None  # the body's name of a request field, where it differs
    options: Mapping[str, Any] = field(default_factory=dict)  # argparse's nargs, choices, action, metavar

    @property
    def flag(self) -> str:
        return f"--{self.name}"


_OFFLOAD_CHOICES = ("none", "model", "block", "phase", "auto")

OVERRIDES: tuple[Override, ...] = (
    # ---- runner-config keys ------------------------------------------------------------------------------
    Override("model_cls", "registered model family (or in --config_json)", frozenset({LAUNCH, SERVE}),
             key="model_cls", serve_help="override the config's model_cls"),
    Override("task", "task of the model family, e.g. t2v, i2v, flf2v (an unknown one lists the family's)",
             frozenset({LAUNCH, SERVE}), key="task", serve_help="override the config's task"),
    Override("model_path", "checkpoint folder (runnerkit, the original release, or diffusers layout), or a "
             "single-file release (.safetensors) where the family loads one", frozenset({LAUNCH, SERVE}),
             key="model_path", serve_help="override the config's checkpoint folder"),
    Override("text_encoder_path", "text encoder folder (transformers layout) of a single-file release, or "
             "a packed text-encoder .safetensors where the family reads one",
             frozenset({LAUNCH}), key="text_encoder_path"),
    Override("upsampler_path", "latent upsampler file of a single-file two-stage release", frozenset({LAUNCH}),
             key="upsampler_path"),
    # ---- request fields ----------------------------------------------------------------------------------
    Override("prompt", "text prompt of the single request", frozenset({LAUNCH, BODY})),
    Override("negative_prompt", "CFG negative prompt (default: the config's, else the family's reference one)",
             frozenset({LAUNCH, BODY})),
    Override("image_path", "conditioning image (image-conditioned tasks only)", frozenset({LAUNCH, BODY}),
             body_name="image"),
    Override("last_frame_path", "last-frame image (first-last-frame tasks only)", frozenset({LAUNCH, BODY}),
             body_name="last_frame"),
    Override("extra_image_paths", "further reference images after --image_path, in order (image editing with "
             "several references)", frozenset({LAUNCH, BODY}), body_name="extra_images",
             options={"nargs": "+", "metavar": "PATH"}),
    Override("seed", "seed of the request's noise (default: the config's seed)", frozenset({LAUNCH, BODY}), int),
    Override("target_height", "pixels, a multiple of the family's factor (e.g. 16); with an input image a family "
             "either takes height x width as the target area and keeps the image's aspect ratio, or makes exactly "
             "height x width with the image resized to it (the family's page in docs/ says which)",
             frozenset({LAUNCH, BODY}), int),
    Override("target_width", "pixels, a multiple of the family's factor (e.g. 16)", frozenset({LAUNCH, BODY}), int),
    Override("target_video_length", "frames, as the family allows (e.g. 4n+1; 1 for images)",
             frozenset({LAUNCH, BODY}), int),
    Override("save_result_path", ".mp4 for video tasks (.png for a 1-frame request; audio+video tasks carry their "
             "audio inside the .mp4), .png for image tasks; a sidecar .json is written beside it", frozenset({LAUNCH})),
    Override("save_tensor_path", ".safetensors with every output, e.g. 'video' float32 [C, F, H, W] in [-1, 1]",
             frozenset({LAUNCH})),
    Override("lora", "LoRA adapter of the request (.safetensors: diffusers/PEFT, kohya or LightX2V layout, or a "
             "name of the config's lora.adapters), strength default 1; repeat for several; needs the config's "
             "`lora` section (docs/lora.md)", frozenset({LAUNCH, BODY}),
             options={"action": "append", "metavar": "PATH[:STRENGTH]"}),
    Override("enhance_prompt", "rewrite the prompt with the runner's prompt enhancer (an LLM) before encoding; the "
             "sidecar keeps both prompts; needs a runner with an enhancer and the config's `prompt_enhancer` section",
             frozenset({LAUNCH, BODY}), bool, options={"default": None}),  # None: not given (a requests file's lines)
    # ---- runner-config keys ------------------------------------------------------------------------------
    Override("infer_steps", "denoising steps (default: the config's, else the family's)", frozenset({LAUNCH}), int,
             key="infer_steps"),
    Override("device", "'auto', 'cpu', 'cuda' or 'cuda:N' (default: the config's, else auto)",
             frozenset({LAUNCH, SERVE}), key="device",
             serve_help="override the config's device (auto, cpu, cuda, cuda:N)"),
    Override("offload", "offload mode, replacing the config's offload.mode (its other offload keys stay); auto (the "
             "default when the config sets none): the fastest plan that fits every request's shape on the device and "
             "in host memory, chosen before loading (docs/memory_plan.md)", frozenset({LAUNCH, SERVE}),
             key="offload.mode", options={"choices": _OFFLOAD_CHOICES},
             serve_help="override the config's offload.mode (auto, the default when the config sets none: planned "
                        "for the config's shape and, with --warmup, the warmup shapes, before loading; "
                        "docs/memory_plan.md)"),
    Override("warmup", "run the one-time warmup before the first request", frozenset({LAUNCH, SERVE}), bool,
             key="warmup", serve_help="warm up before reporting ready"),
)

_BY_NAME = {row.name: row for row in OVERRIDES}


def override(name: str) -> Override:
    """The table's row for `--<name>`.

    Raises:
        KeyError: naming the flag and the table's flags.
    """
    if name not in _BY_NAME:
        raise KeyError(f"`--{name}` is not an override flag; the table has {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def add_flags(parser: argparse.ArgumentParser, surface: str, names: Iterable[str],
              choices: Mapping[str, Sequence[str]] | None = None) -> None:
    """Add the flags `names` (rows of the table that apply to `surface`, `launch` or `serve`) to `parser`, in
    that order. `choices`: flag name -> choices known only at run time (`--model_cls`: the registered families).

    Raises:
        ValueError: a row that does not apply to `surface` (naming both).
    """
    for name in names:
        row = override(name)
        if surface not in row.where:
            raise ValueError(f"`{row.flag}` is not a flag of {surface!r} (it applies to {sorted(row.where)})")
        help_text = row.serve_help if surface == SERVE and row.serve_help is not None else row.help
        options = dict(row.options)
        if choices is not None and name in choices:
            options["choices"] = choices[name]
        if row.type is bool:
            parser.add_argument(row.flag, action="store_true", help=help_text, **options)
        elif row.type is str:
            parser.add_argument(row.flag, help=help_text, **options)
        else:
            parser.add_argument(row.flag, type=row.type, help=help_text, **options)


def config_overrides(args: argparse.Namespace, surface: str) -> dict[str, Any]:
    """The config keys the parsed `args` of `surface` override: key -> value (None: not given), in table order.
    A switch counts only when given (True), so the config's own value stays otherwise."""
    out: dict[str, Any] = {}
    for row in OVERRIDES:
        if row.key is not None and surface in row.where:
            value = getattr(args, row.name)
            out[row.key] = (True if value else None) if row.type is bool else value
    return out


def request_flags(surface: str = LAUNCH) -> tuple[str, ...]:
    """The request fields `surface` takes (as the request names them), in table order."""
    return tuple(row.name for row in OVERRIDES if row.key is None and surface in row.where)


def body_name(name: str) -> str:
    """The server body's name of request field `name`."""
    return _BY_NAME[name].body_name or name
