"""A job's body as a request: the body's fields read into a `RequestConfig` (images saved into the job's
folder, `size`, `seconds`, `input_reference` and `model` turned into request fields), then admitted as the
launch script admits a request (runnerkit/admission.py, source `server`), each refusal named by the body
field the client sent (`param`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from runnerkit.admission import Refused, admit
from runnerkit.config import MAX_EXTRA_IMAGES, MAX_FRAMES, RequestConfig, field_path, format_validation_error
from runnerkit.serve.body import EXTRA_IMAGES_FIELD, InputError
from runnerkit.serve.body import shown as _shown
from runnerkit.serve.fields import (
    IMAGE_FIELDS,
    INPUT_REFERENCE,
    SERVER_FIELDS,
    _decode_image,
    accepted_fields,
    image_extension,
    takes_files,
    unknown_field,
)
from runnerkit.serve.jobs import clip_seconds

if TYPE_CHECKING:
    from runnerkit.serve.app import ServerState

__all__ = ["build_request"]

#: Request field -> the body field that carries its image.
_BODY_NAME = {**{v: k for k, v in IMAGE_FIELDS.items()}, "extra_image_paths": EXTRA_IMAGES_FIELD}


@dataclass
class _Body:
    """What reading a body found: the request, the fields the job reports (`shown`), and how the client sent
    what became request fields (`sent`: request field -> body field; `size`, `seconds`, `reference`: an
    `input_reference`, `image_parts`: several `image` parts)."""

    request: RequestConfig
    shown: dict[str, Any]
    sent: dict[str, str]
    fields: dict[str, Any]  # the request fields as read from the body (those given)
    size: Any = None
    seconds: Any = None
    reference: bool = False
    image_parts: bool = False
    lora_names: dict[str, str] = field(default_factory=dict)  # the server's adapter path -> its name


def build_request(state: ServerState, body: dict[str, Any], folder: Path,
                  options: tuple[str, ...] = ()) -> tuple[RequestConfig, dict[str, Any], dict[str, Any]]:
    """The body as a `RequestConfig` checked as the launch script checks a request; images saved
    into `folder` with their real extension. Returns it, the fields the job reports, and the values
    it runs with (model, seed, height, width, frames; `seconds` for videos). `options`: the endpoint's
    own fields, already taken off `body` (named when a field is unknown).

    Raises:
        InputError: naming the field (422; 413 for an oversized image).
    """
    runner = state.runner
    assert runner is not None, "build_request before the runner exists"
    # 1. read the body into a request
    read = _read_body(state, dict(body), folder, options)
    # 2. admit it (runnerkit/admission.py): fields, adapters, memory fit, sequence split
    try:
        request = admit(runner, runner.config, [read.request], source="server")[0]
    except Refused as exc:
        raise _refusal(state, read, exc, folder) from None
    # 3. the values it runs with
    shape = runner.request_shape(request)
    cfg = runner.config
    resolved = {"model": cfg.model_cls, "seed": request.seed if request.seed is not None else cfg.seed,
                "height": shape[0], "width": shape[1], "frames": shape[2]}
    if state.kind == "video":
        resolved["seconds"] = clip_seconds(shape[2], cfg.fps or 1)
    return request, read.shown, resolved


def _read_body(state: ServerState, body: dict[str, Any], folder: Path, options: tuple[str, ...]) -> _Body:
    """The body's fields as request fields, its images written into `folder`, the request validated (pydantic)."""
    runner = state.runner
    for name in SERVER_FIELDS:
        if name in body:
            hint = f"; send the image itself as `{_BODY_NAME[name]}` (base64 or a file part)" if name in _BODY_NAME else ""
            raise InputError(f"`{name}` is set by the server, not by a request{hint}", name)
    reference = INPUT_REFERENCE in body
    if reference:
        if state.kind != "video":
            raise InputError(f"`{INPUT_REFERENCE}` is the first frame of a video; send an image task's image as "
                             "`image`", INPUT_REFERENCE)
        if "image" in body:
            raise InputError(f"give `image` or `{INPUT_REFERENCE}` (the same first frame), not both", INPUT_REFERENCE)
        body["image"] = _decode_image(body.pop(INPUT_REFERENCE), INPUT_REFERENCE)  # its errors name it as sent
    model = body.pop("model", None)
    if model is not None and model != runner.config.model_cls:
        raise InputError(f"`model` {_shown(model)}: this server serves {runner.config.model_cls!r}", "model")
    size, seconds = _size_and_seconds(state, body)
    image_parts, extra_name, shown = _write_images(state, body, folder)
    if seconds is not None:
        shown["seconds"] = seconds
        del shown["target_video_length"]
    _refuse_unknown(state, body, options)
    read = _Body(RequestConfig.model_construct(), shown, {}, body, size, seconds, reference, image_parts)
    # A field the client sent under another name is named as sent (`param`).
    read.sent = {**({"target_width": "size", "target_height": "size"} if size not in (None, "auto") else {}),
                 **({"target_video_length": "seconds"} if seconds is not None else {}),
                 **({"image": INPUT_REFERENCE} if reference else {}), "extra_image_paths": extra_name}
    lora_cfg = runner.config.lora
    read.lora_names = {path: name for name, path in (lora_cfg.adapters if lora_cfg is not None else {}).items()}
    try:
        read.request = RequestConfig.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        name = field_path(errors[0]["loc"]) if errors and errors[0]["loc"] else None
        message = format_validation_error(exc, "request")
        if size not in (None, "auto"):  # the client sent WIDTHxHEIGHT, not the fields it became
            for field_name, side in (("target_width", "width"), ("target_height", "height")):
                message = message.replace(f"\n  {field_name}: ", f"\n  `size` {size!r} ({side}): ")
        raise InputError(_api_wording(message, folder), read.sent.get(name or "", name)) from None
    return read


def _size_and_seconds(state: ServerState, body: dict[str, Any]) -> tuple[Any, Any]:
    """OpenAI's `size` ("WIDTHxHEIGHT", or "auto": the config's) and `seconds`, replaced in `body` by the
    request fields they stand for; returns them as sent."""
    size = body.pop("size", None)
    if size is not None and size != "auto":  # "auto" (OpenAI): the config's size
        m = re.fullmatch(r"(\d+)x(\d+)", str(size))
        if m is None:
            raise InputError(f"`size` must be WIDTHxHEIGHT, e.g. \"832x480\" (got {_shown(size)})", "size")
        if "target_width" in body or "target_height" in body:
            raise InputError("give `size` or `target_width`/`target_height`, not both", "size")
        body["target_width"], body["target_height"] = int(m.group(1)), int(m.group(2))
    seconds = body.pop("seconds", None)
    if seconds is not None:
        if "target_video_length" in body:
            raise InputError("give `seconds` or `target_video_length`, not both", "seconds")
        body["target_video_length"] = _frames_of(seconds, state, state.runner.config.fps or 1)
    return size, seconds


def _write_images(state: ServerState, body: dict[str, Any], folder: Path) -> tuple[bool, str, dict[str, Any]]:
    """Decode the body's images and write them into `folder`, their paths put in `body` as request fields.
    Returns whether the references came as several `image` parts, the name they came under, and the fields
    as the job reports them (sizes for images)."""
    # Several `image`s (images.edit's `image[]` parts): the image, then the references, named as sent:
    # `image[k + 1]` is `extra_images[k]`.
    image_parts = isinstance(body.get("image"), list) and len(body["image"]) > 1
    extra_name, offset = ("image", 1) if image_parts else (EXTRA_IMAGES_FIELD, 0)
    if image_parts:
        if EXTRA_IMAGES_FIELD in body:
            raise InputError(f"give several `image`s or `image` and `{EXTRA_IMAGES_FIELD}`, not both", "image")
        body["image"], *body[EXTRA_IMAGES_FIELD] = body["image"]
    elif isinstance(body.get("image"), list) and body["image"]:
        body["image"] = body["image"][0]
    images = {name: _decode_image(body.pop(name), name) for name in IMAGE_FIELDS if name in body}
    extra = body.pop(EXTRA_IMAGES_FIELD, None)
    if extra is not None and (not isinstance(extra, list) or not extra):
        raise InputError(f"`{EXTRA_IMAGES_FIELD}` must be a non-empty list of images", EXTRA_IMAGES_FIELD)
    if extra is not None and len(extra) > MAX_EXTRA_IMAGES:
        raise InputError(f"`{extra_name}` holds {len(extra) + offset} images; a request takes at most "
                         f"{MAX_EXTRA_IMAGES + offset}" + (f" (the image and {MAX_EXTRA_IMAGES} references)"
                                                           if offset else ""), extra_name)
    extra_raw = [_decode_image(v, f"{extra_name}[{k + offset}]") for k, v in enumerate(extra or [])]
    shown = dict(body)
    for name, raw in images.items():
        path = folder / f"{name}{image_extension(raw)}"
        path.write_bytes(raw)
        body[IMAGE_FIELDS[name]] = str(path)
        shown[name] = f"{len(raw)} bytes"
    if extra_raw:
        paths = [folder / f"{EXTRA_IMAGES_FIELD}{k}{image_extension(raw)}" for k, raw in enumerate(extra_raw)]
        for path, raw in zip(paths, extra_raw):
            path.write_bytes(raw)
        body["extra_image_paths"] = [str(p) for p in paths]
        shown[EXTRA_IMAGES_FIELD] = [f"{len(raw)} bytes" for raw in extra_raw]
    return image_parts, extra_name, shown


def _refuse_unknown(state: ServerState, body: dict[str, Any], options: tuple[str, ...]) -> None:
    """Refuse bytes in a text field, a field no endpoint takes, and adapter paths (names of `lora.adapters` only)."""
    runner = state.runner
    for name, value in body.items():  # a file part in a text field, or a field not taken (`mask`): never echo its bytes
        if isinstance(value, bytes):
            what = (f"`{name}` ({_shown(value)}) is not a field of this endpoint" if name not in RequestConfig.model_fields
                    else f"`{name}` is a text field, not a file (got {_shown(value)})")
            raise InputError(f"{what}; {takes_files(runner, state.kind)}", name)
    unknown = [name for name in body if name not in RequestConfig.model_fields]
    if unknown:
        raise InputError(unknown_field(unknown[0], body[unknown[0]], accepted_fields(runner, state.kind, options)),
                         unknown[0])
    lora_cfg = runner.config.lora
    if lora_cfg is not None and isinstance(body.get("lora"), list):  # without a `lora` section: refused later
        for i, adapter in enumerate(body["lora"]):  # names of `lora.adapters` only: paths are the server's business
            path = adapter.get("path") if isinstance(adapter, dict) else None
            if isinstance(path, str) and path not in lora_cfg.adapters:
                names = f"one of {sorted(lora_cfg.adapters)}" if lora_cfg.adapters else "it names none"
                raise InputError(f"`lora[{i}].path` {_shown(path)} is not an adapter name of this server's "
                                 f"`lora.adapters` ({names}); the server takes names, not file paths",
                                 f"lora[{i}].path")


def _refusal(state: ServerState, read: _Body, refused: Refused, folder: Path) -> InputError:
    """Admission's refusal in the API's terms: the message in body fields, `param` the field as sent."""
    exc, sent = refused.cause, read.sent

    def by_name(message: str) -> str:  # paths are the server's business: its adapters by their names
        for path, name in read.lora_names.items():
            message = message.replace(path, name)
        return _api_wording(message, folder)

    if refused.rule == "fields":
        return _field_refusal(state, read, exc, folder, by_name)
    if refused.rule == "adapters":  # runnerkit.lora.LoRAError: this request's adapters together (e.g. summed rank)
        return InputError(by_name(str(exc)), "lora")
    if refused.rule == "fit":  # MemoryFitError: the shape as a whole, named by the first shape field sent
        given = [sent.get(f, f) for f in ("target_width", "target_height", "target_video_length") if f in read.fields]
        return InputError(str(exc), given[0] if given else None)
    assert refused.rule == "split", f"the server applies no rule {refused.rule!r}"
    return InputError(str(exc), "size")  # Ulysses: the request's tokens must divide among the ranks


def _field_refusal(state: ServerState, read: _Body, exc: BaseException, folder: Path, by_name: Any) -> InputError:
    """The `fields` rule's refusal (`validate_request`), named by the body field as sent."""
    from runnerkit.lora import LoRAError  # torch: loaded with the runner by now

    if isinstance(exc, LoRAError):  # a configured adapter's file cannot be read: the server's fault
        return InputError(f"a LoRA adapter of this server cannot be used (server error, not the request's): "
                          f"{by_name(str(exc))}", "lora", status=500)
    found = re.search(r"`(\w+(?:\[\d+\])?)`", str(exc))
    name = found.group(1) if found else None
    name = _BODY_NAME.get(name or "", name)
    if name is not None and name.startswith("extra_image_paths["):
        name = EXTRA_IMAGES_FIELD + name[len("extra_image_paths"):]
    message = _api_wording(str(exc), folder)
    if name == "image" and state.kind == "video" and read.request.image_path is None:  # a missing first frame
        message += f" (`image`, or `{INPUT_REFERENCE}` as OpenAI's client names the first frame)"
    if read.reference:  # the first frame was sent as `input_reference`
        message = message.replace("`image`", f"`{INPUT_REFERENCE}`")
    if read.image_parts:  # the references were sent as `image[1]`, `image[2]`, ...
        message = re.sub(r"`extra_images` holds (\d+) image\(s\); task (\S+) takes at most (\d+) after `image`",
                         lambda m: f"`image` holds {int(m[1]) + 1} images; task {m[2]} takes at most "
                                   f"{int(m[3]) + 1} (the image and {m[3]} references)", message)
        message = re.sub(r"`extra_images\[(\d+)\]`", lambda m: f"`image[{int(m[1]) + 1}]`", message)
        name = re.sub(r"^extra_images(?:\[(\d+)\])?$",
                      lambda m: "image" if m[1] is None else f"image[{int(m[1]) + 1}]", name or "") or None
    if read.sent.get(name or "") == "size":  # the client sent WIDTHxHEIGHT, not the field the runner names
        message = message.replace(f"`{name}`", f"`size`'s {'width' if name == 'target_width' else 'height'}")
    return InputError(message, read.sent.get(name or "", name))


def _frames_of(seconds: Any, state: ServerState, fps: int) -> int:
    """OpenAI's `seconds` (a string such as "4", or a number) as frames: a clip of F frames lasts F / fps
    seconds (each frame is shown 1 / fps s: the mp4's duration, its audio track's length and the sidecar's
    `duration.seconds`), rounded to the nearest frame count the model takes (TEMPORAL_FACTOR * k + 1, k >= 1).

    Allowed: from the family's shortest clip (`shortest_clip`, (TEMPORAL_FACTOR + 1) / fps seconds unless the family
    needs more) to the longest (the request's frame limit, `target_video_length`'s bound, / fps); nothing outside
    is silently corrected (a one-frame video, where the family takes one, is `target_video_length: 1`).

    Raises:
        InputError: naming `seconds`, the value and the allowed range.
    """
    if state.kind != "video":
        raise InputError("`seconds` is for video tasks; this server makes images", "seconds")
    step = getattr(state.runner, "TEMPORAL_FACTOR", 1)
    fewest = state.runner.shortest_clip(state.runner.config)  # the family's (more than step + 1 for some)
    max_frames = step * ((MAX_FRAMES - 1) // step) + 1  # the longest clip the model takes
    shortest, longest = fewest / fps, max_frames / fps
    single = "; `target_video_length: 1` for a single frame" if fewest == step + 1 else ""
    allowed = (f"{shortest:g} to {longest:g} seconds ({fewest} to {max_frames} frames at {fps} fps, each shown "
               f"1/{fps} s{single})")
    try:
        value = float("nan") if isinstance(seconds, bool) else float(seconds)
    except (TypeError, ValueError):
        value = None
    if value is None or value != value:  # nan is no length either
        raise InputError(f"`seconds` {_shown(seconds)} is not a number: give seconds from {allowed}", "seconds")
    if not shortest <= value <= longest:
        raise InputError(f"`seconds` {_shown(seconds)} is out of range: from {allowed}", "seconds")
    return step * round((value * fps - 1) / step) + 1


def _api_wording(message: str, folder: Path) -> str:
    """A launch-script message in the API's terms: body fields, not flags or server paths."""
    for body_field, request_field in IMAGE_FIELDS.items():
        message = message.replace(f"`{request_field}` (--{request_field}) is required",
                                  f"`{body_field}` is required")
        message = message.replace(f"`{request_field}`", f"`{body_field}`")
    message = message.replace("`extra_image_paths", f"`{EXTRA_IMAGES_FIELD}")
    message = re.sub("'?" + re.escape(str(folder)) + r"/[\w.]+'?", "(uploaded)", message)  # an uploaded file
    message = message.replace("(got (uploaded))", "(an uploaded image)")
    return message.replace("give an image file", "send the image as base64 or a file part")


