"""The body's fields as a client names them: those the server sets itself, those that carry an image,
which of them a task takes as files, every field an endpoint accepts; uploaded images decoded and checked
before anything is written."""

from __future__ import annotations

import base64
import binascii
import difflib
import io
import re
import warnings
from typing import Any

from runnerkit.overrides import OVERRIDES, body_name
from runnerkit.serve.body import EXTRA_IMAGES_FIELD, MAX_IMAGE_BYTES, InputError

#: Request fields a job's body carries (runnerkit/overrides.py, where "body"), in the table's order.
BODY_REQUEST_FIELDS = tuple(row.name for row in OVERRIDES if row.key is None and "body" in row.where)
#: Request fields the server sets itself (never from the body): the output paths, then the image paths (the
#: body carries the images themselves).
SERVER_FIELDS = (tuple(row.name for row in OVERRIDES if row.key is None and "body" not in row.where)
                 + tuple(name for name in BODY_REQUEST_FIELDS if body_name(name) != name))
#: Body fields that carry an image (base64, or a form's file part) -> the request field it becomes.
IMAGE_FIELDS = {body_name(name): name for name in ("image_path", "last_frame_path")}
#: OpenAI's name of the video's first frame (`client.videos.create(input_reference=...)`): `image`.
INPUT_REFERENCE = "input_reference"
#: Pillow's format name -> the file extension an uploaded image is stored with.
IMAGE_EXTENSIONS = {"PNG": ".png", "JPEG": ".jpg", "MPO": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp",
                    "TIFF": ".tiff"}


def _decode_image(value: Any, name: str) -> bytes:
    """An image's bytes from base64 (JSON) or as sent (a form's file part).

    Raises:
        InputError: naming `name` (422; 413 above MAX_IMAGE_BYTES).
    """
    if isinstance(value, bytes):
        raw = value
    elif isinstance(value, str):
        data = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
        data = re.sub(r"\s+", "", data)  # MIME-wrapped base64 (line breaks every 76 characters)
        data += "=" * (-len(data) % 4)  # unpadded base64
        try:
            altchars = b"-_" if ("-" in data or "_" in data) else None  # URL-safe alphabet
            raw = base64.b64decode(data, altchars=altchars, validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"`{name}` is not valid base64 (standard or URL-safe alphabet, optionally a "
                             "data:image/...;base64, URL)", name) from None
    else:
        raise InputError(f"`{name}` must be a base64 string, a data:image/...;base64, URL or a form's file part", name)
    if not raw:
        raise InputError(f"`{name}` is empty", name)
    if len(raw) > MAX_IMAGE_BYTES:
        raise InputError(f"`{name}` holds {len(raw)} bytes; at most {MAX_IMAGE_BYTES} are accepted", name, 413)
    _refuse_bomb(raw, name)
    return raw


def _refuse_bomb(raw: bytes, name: str) -> None:
    """Refuse an image whose header declares more pixels than Pillow's decompression-bomb limit (a file of a
    few KB can declare 20000x20000): Pillow raises at `Image.open`, before any reader of the upload could
    name the field. Only the header is read; what Pillow cannot identify is left to the runner's check.

    Raises:
        InputError: naming `name` (422).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # below the error limit: the runner's check
            Image.open(io.BytesIO(raw)).close()
    except Image.DecompressionBombError as exc:
        raise InputError(f"`{name}` (uploaded) is too large to decode safely: {exc}", name) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):  # not an image: the runner's check names it
        pass


def image_extension(raw: bytes) -> str:
    """The file extension of an uploaded image, from its content (Pillow); `.bin` if Pillow cannot
    tell (the runner's check then says the upload is not an image)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as im:
            return IMAGE_EXTENSIONS.get(im.format or "", ".bin")
    except (UnidentifiedImageError, OSError, ValueError):
        return ".bin"


def image_inputs(runner: Any) -> list[str]:
    """The image fields, as a body names them, that `runner`'s task takes: `image` and `last_frame` as the
    task needs them, then `extra_images` when it takes references."""
    task = runner.config.task
    body_name = {v: k for k, v in IMAGE_FIELDS.items()}
    names = [body_name[f] for f in getattr(runner, "IMAGE_INPUTS", {}).get(task, ())]
    return names + ([EXTRA_IMAGES_FIELD] if getattr(runner, "EXTRA_IMAGES", {}).get(task, 0) else [])



def takes_files(runner: Any, kind: str) -> str:
    """Which fields of `runner`'s task take a file, as an error message says it."""
    names = [f"`{f}`" + (f" (or `{INPUT_REFERENCE}`)" if f == "image" and kind == "video" else "")
             for f in image_inputs(runner)]
    task = runner.config.task
    return f"task {task!r} takes files in: {', '.join(names)}" if names else f"task {task!r} takes no file"


def accepted_fields(runner: Any, kind: str, options: tuple[str, ...] = ()) -> list[str]:
    """Every body field an endpoint takes, as a client names it: the request fields a client may set, in
    the override table's order (runnerkit/overrides.py) (images by their body names and only those the task takes; `lora` only with a
    `lora` section), then `size`, `seconds` (videos), `model` and the endpoint's own `options`."""
    images = image_inputs(runner)
    names: list[str] = []
    for field in BODY_REQUEST_FIELDS:
        name = body_name(field)
        if name != field and name in images:
            names += [name, INPUT_REFERENCE] if name == "image" and kind == "video" else [name]
        elif field not in SERVER_FIELDS and (field != "lora" or runner.config.lora is not None):
            names.append(name)
    return names + ["size", *(["seconds"] if kind == "video" else []), "model", *options]


def unknown_field(name: str, value: Any, accepted: list[str]) -> str:
    """The message for a body field no endpoint field matches: the closest accepted name (difflib), if any,
    and every accepted name."""
    close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return (f"`{name}` (got {value!r}) is not a field of this endpoint{hint}; it takes: "
            + ", ".join(f"`{f}`" for f in accepted))
