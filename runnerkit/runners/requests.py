"""Request validation of `DefaultRunner`: a request's fields and shape, checked before anything runs, and its
defaults filled in. The rules are functions of what they need; `DefaultRunner` declares the hooks that call them
(the block `# ---- request checks` at the end of its class body), which families override:

    validate_request (classmethod, before loading) -> check_request -> shape_of -> validate_shape (check_shape)
    resolve_request (each request) -> resolve: the request's defaults filled in -> InputInfo
    lora_specs: the request's adapters, names of `config.lora.adapters` resolved

Whether a request fits the device's memory is the runner's memory checks' (planning/checks.py `MemoryChecks`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runnerkit.admission import AdmittedRequest
from runnerkit.config import RequestConfig, RunnerConfig, as_request
from runnerkit.images import check_image
from runnerkit.lora import LoRAError, read_adapter
from runnerkit.runners.pipeline import InputInfo, OutputKind, Shape

__all__ = ["check_enhance_prompt", "check_request", "check_shape", "lora_specs", "resolve", "shape_with_defaults"]


def check_shape(height: int, width: int, frames: int, spatial: int, temporal: int) -> None:
    """Raise ValueError naming the field if (`height`, `width`, `frames`) breaks the patch/VAE factors: height and
    width multiples of `spatial`, frames `temporal`*n+1."""
    s, t = spatial, temporal
    if height % s:
        raise ValueError(f"`target_height` must be a multiple of {s} (got {height})")
    if width % s:
        raise ValueError(f"`target_width` must be a multiple of {s} (got {width})")
    if (frames - 1) % t:
        examples = ", ".join(str(t * k + 1) for k in (1, 2, 80 // t))  # 5, 9, 81 for 4; 9, 17, 81 for 8
        raise ValueError(f"`target_video_length` must be {t}n+1, e.g. {examples} (got {frames})")


def shape_with_defaults(request: RequestConfig, config: RunnerConfig) -> Shape:
    """(height, width, frames) a request runs at (`config` with the family defaults): the request's fields, else
    the config's. A family whose shape follows its inputs (e.g. image-to-video keeping the image's aspect ratio)
    overrides `DefaultRunner.shape_of`; its image inputs have already been checked by `validate_request` then."""
    return (request.target_height or config.target_height, request.target_width or config.target_width,
            request.target_video_length or config.target_video_length)


def check_request(request: RequestConfig, config: RunnerConfig, image_inputs: Mapping[str, tuple[str, ...]],
                  extra_images: Mapping[str, int], result_kinds: Mapping[str, OutputKind],
                  shape_of: Callable[[RequestConfig, RunnerConfig], Shape],
                  validate_shape: Callable[[int, int, int], None], enhancer: bool = False) -> None:
    """Check a request against a runner before anything loads.

    Args:
        config: the runner config, the family's defaults filled in (`resolve_config`).
        image_inputs, extra_images, result_kinds: the runner class's `IMAGE_INPUTS`, `EXTRA_IMAGES` and
            `RESULT_KINDS` (per task).
        shape_of, validate_shape: the runner class's hooks (a family may override them).
        enhancer: the runner class has a prompt enhancer (`PROMPT_ENHANCER`; `check_enhance_prompt`).

    Raises:
        ValueError: naming the field: `lora` adapters that are not readable adapter files
            (`runnerkit.lora.LoRAError`, naming the file) or without the config's `lora`; image
            inputs the task does not take, lacks, or that are
            not readable images (`runnerkit.images.ImageInputError`), shape factors, a result
            file suffix that does not fit the task's primary output, `enhance_prompt` where nothing can
            enhance (`check_enhance_prompt`).
    """
    check_enhance_prompt(request, config, enhancer)
    if request.negative_prompt is not None and not config.enable_cfg:
        raise ValueError("`negative_prompt` only acts with classifier-free guidance, but the runner's "
                         "`enable_cfg` is false: remove it from the request")
    task_inputs = image_inputs.get(config.task, ())
    for field in ("image_path", "last_frame_path"):
        value = getattr(request, field)
        if value is not None and field not in task_inputs:
            raise ValueError(f"`{field}` is not used by task {config.task!r} (got {value!r}); image inputs of "
                             f"this task: {', '.join(f'`{f}`' for f in task_inputs) or 'none'}")
        if field in task_inputs:
            if value is None:
                flag = "--" + field
                raise ValueError(f"`{field}` ({flag}) is required by task {config.task!r}: give an image file")
            check_image(value, field)
    extra, most = request.extra_image_paths or [], extra_images.get(config.task, 0)
    if len(extra) > most:
        raise ValueError(f"`extra_image_paths` holds {len(extra)} image(s); task {config.task!r} takes at most "
                         f"{most} after `image_path`" + ("" if most else " (it takes no further references)"))
    for k, value in enumerate(extra):
        check_image(value, f"extra_image_paths[{k}]")
    for path, _ in lora_specs(request, config):  # format, pairs and ranks; layer names once loaded
        try:
            read_adapter(path, header_only=True)
        except LoRAError as exc:
            raise LoRAError(f"`lora`: {exc}") from None
    h, w, f = shape_of(request, config)
    validate_shape(h, w, f)
    if request.save_result_path:
        suffix = Path(request.save_result_path).suffix.lower()
        kind = result_kinds.get(config.task, "video")
        allowed = {"video": (".mp4", ".png") if f == 1 else (".mp4",), "image": (".png",), "audio": (".wav",)}[kind]
        if suffix not in allowed:
            what = f"a {f}-frame video" if kind == "video" else f"an {kind}" if kind == "image" else "audio"
            hint = " (.png: with target_video_length 1)" if kind == "video" and f != 1 else ""
            raise ValueError(f"`save_result_path` {request.save_result_path!r}: task {config.task!r} makes {what}; "
                             f"use {' or '.join(allowed)}{hint}")


def check_enhance_prompt(request: RequestConfig, config: RunnerConfig, enhancer: bool) -> None:
    """Refuse `enhance_prompt` on a runner that cannot enhance: its class has no prompt enhancer (`enhancer`
    False), or the config does not load it (no `prompt_enhancer` section).

    Raises:
        ValueError: naming the field, its value and why.
    """
    if not request.enhance_prompt:
        return
    if not enhancer:
        raise ValueError(f"`enhance_prompt`=true: model_cls {config.model_cls!r} (task {config.task!r}) has no "
                         "prompt enhancer; remove the field (or set it false)")
    if config.prompt_enhancer is None:
        raise ValueError(f"`enhance_prompt`=true: the runner's config does not load the prompt enhancer of "
                         f"{config.model_cls!r}; add a `prompt_enhancer` section to the config (docs/configs.md) "
                         "or remove the field")


def resolve(request: RequestConfig | dict[str, Any], config: RunnerConfig,
            validate_request: Callable[[RequestConfig, RunnerConfig], None],
            shape_of: Callable[[RequestConfig, RunnerConfig], Shape], default_negative_prompt: str) -> InputInfo:
    """Fill request defaults from the runner `config` and validate the request (`validate_request`), unless
    the entry point admitted it already (`runnerkit.admission.admit`: an `AdmittedRequest`).

    Args:
        validate_request, shape_of: the runner's hooks; default_negative_prompt: the family's, used when
            neither the request nor the config gives one.

    Raises:
        ValueError: an invalid request (a dict is validated as a `RequestConfig` first).
        TypeError: `request` is neither a `RequestConfig` nor a dict.
    """
    cfg = config
    request = as_request(request)
    if not isinstance(request, AdmittedRequest):  # the Python API: nothing checked it yet
        validate_request(request, cfg)
    height, width, frames = shape_of(request, cfg)
    return InputInfo(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt if request.negative_prompt is not None
        else (cfg.negative_prompt if cfg.negative_prompt is not None else default_negative_prompt),
        seed=request.seed if request.seed is not None else cfg.seed,
        height=height,
        width=width,
        frames=frames,
        frames_omitted=request.target_video_length is None and cfg.target_video_length is None,
        save_result_path=request.save_result_path,
        save_tensor_path=request.save_tensor_path,
        image_path=request.image_path,
        last_frame_path=request.last_frame_path,
        extra_image_paths=tuple(request.extra_image_paths or ()),
        lora=lora_specs(request, cfg),
        enhance_prompt=request.enhance_prompt,
    )


def lora_specs(request: RequestConfig, config: RunnerConfig) -> tuple[tuple[str, float], ...]:
    """The request's adapters as ((path, strength), ...), names of `config.lora.adapters` resolved.

    Raises:
        ValueError: `lora` in a request while the config has no `lora` section; an adapter that is
            neither a name of `lora.adapters` nor an existing path (naming `lora[i].path` and the names),
            or a folder.
    """
    if not request.lora:
        return ()
    if config.lora is None:
        raise ValueError("`lora`: this runner's config has no `lora` section, so requests cannot carry adapters; "
                         'add `"lora": {}` (or {"mode": "fused"}) to the config')
    known = config.lora.adapters
    for i, a in enumerate(request.lora):
        if a.path not in known and not Path(a.path).exists():
            names = sorted(known) or "none: the config's `lora.adapters` is empty"
            raise ValueError(f"`lora[{i}].path`={a.path!r} is neither a name of the config's `lora.adapters` "
                             f"(names: {names}) nor an existing .safetensors file")
        if a.path not in known and Path(a.path).is_dir():
            raise ValueError(f"`lora[{i}].path`={a.path!r} is a folder: give an adapter's .safetensors file or a "
                             "name of the config's `lora.adapters`")
    return tuple((known.get(a.path, a.path), a.strength) for a in request.lora)
