"""Request bodies of the HTTP API: read with their size caps counted while the bytes arrive.

A body is a JSON object, a multipart form (what the official `openai` client sends) or an
url-encoded form. No cap is checked after the fact: the bytes are counted chunk by chunk as the
server receives them, and reading stops at the first chunk that passes a cap, so at most one
chunk (the protocol server's read size, 64 KiB with uvicorn) beyond a cap is ever held.

Caps: the whole body MAX_BODY_BYTES (a declared `Content-Length` above it is refused before any
byte is read; a chunked body is counted); a form's file part MAX_IMAGE_BYTES, its text part
MAX_TEXT_PART_BYTES, each counted as the part arrives, in memory (a part is never written to a
temporary file). Above a cap: 413 naming the part.

A refused body whose declared `Content-Length` is at most MAX_BODY_BYTES + DRAIN_BYTES is read
to its end (the bytes discarded) before the answer, so that a client which sends the whole body
before reading the response reads the error instead of a reset connection. A longer declared
body, or a chunked one (its length is unknown), is not drained: the answer goes at once.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

from fastapi import Request
try:
    from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header
except ImportError:  # python-multipart before 0.0.13 names its module `multipart`
    from multipart.multipart import MultipartParseError, MultipartParser, parse_options_header  # type: ignore[no-redef]

from runnerkit import json_strict
from runnerkit.config import MAX_EXTRA_IMAGES

MAX_IMAGE_BYTES = 32 * 1024**2
MAX_BODY_BYTES = 3 * MAX_IMAGE_BYTES  # two base64 images (4/3 of their bytes) and the fields
MAX_TEXT_PART_BYTES = 1024**2  # a form's text part: a prompt, a number, a JSON list of adapters
DRAIN_BYTES = MAX_BODY_BYTES  # a refused body declared up to twice the cap is read (and discarded) to its end
MAX_FIELD_DEPTH = 8  # levels of arrays and objects in one field; `lora` (a list of objects) has 2
MAX_FILES = 2 + MAX_EXTRA_IMAGES + 1  # image, last_frame, the references, and a refused `mask`
MAX_FIELDS = 100
#: Integer request fields, converted from a form's text parts.
INT_FIELDS = ("seed", "target_height", "target_width", "target_video_length", "n")
#: Boolean request fields, converted from a form's text parts "true" / "false".
BOOL_FIELDS = ("enhance_prompt",)
#: Body field carrying a list of further reference images -> `extra_image_paths`.
EXTRA_IMAGES_FIELD = "extra_images"
#: A form's LoRA parts as the official `openai` client writes `extra_body={"lora": [{"path", "strength"}]}` in a
#: multipart body (its query-string style: `lora[][path]`, `lora[][strength]`). The client groups repeated
#: keys before sending (every path part, then every strength part), so the parts' order cannot say which
#: strength belongs to which adapter: strengths are paired with paths by their order among themselves.
LORA_FORM_PART = re.compile(r"lora\[\]\[(path|strength)\]")
NUMBER = r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*"


class InputError(Exception):
    """A request the server refuses (HTTP `status`: 4xx its fault, 500 the server's), naming the field."""

    def __init__(self, message: str, field: str | None = None, status: int = 422) -> None:
        super().__init__(message)
        self.field, self.status = field, status


class ClientGone(Exception):
    """The client disconnected before its body arrived."""


def shown(value: Any) -> str:
    """A body value as an error message shows it: its repr, but never a file's contents (a form's file part)."""
    return f"an uploaded file of {len(value)} bytes" if isinstance(value, bytes) else repr(value)


class CountedBody:
    """The request body as it arrives (ASGI `http.request` messages), counted against MAX_BODY_BYTES."""

    def __init__(self, request: Request) -> None:
        self.receive = request.receive
        self.declared = _declared_length(request)
        self.read = 0  # bytes received so far
        self.ended = False  # the last message arrived

    async def chunk(self) -> bytes:
        """The next chunk (b"" once the body ended).

        Raises:
            InputError: 413 once the bytes read pass MAX_BODY_BYTES.
            ClientGone: the client disconnected.
        """
        if self.ended:
            return b""
        message = await self.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected while sending its body")
        self.ended = not message.get("more_body", False)
        data = message.get("body", b"")
        self.read += len(data)
        if self.read > MAX_BODY_BYTES:
            raise InputError(f"the body holds more than {MAX_BODY_BYTES} bytes; at most {MAX_BODY_BYTES} are "
                             "accepted", status=413)
        return data

    async def drain(self) -> None:
        """Receive and discard the rest of a declared body of at most MAX_BODY_BYTES + DRAIN_BYTES."""
        if self.declared is None or self.declared > MAX_BODY_BYTES + DRAIN_BYTES:
            return
        while not self.ended:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return
            self.ended = not message.get("more_body", False)


def _declared_length(request: Request) -> int | None:
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


async def read_body(request: Request) -> dict[str, Any]:
    """The request's fields: a JSON object, or a multipart / url-encoded form (files as bytes,
    integer fields converted, `name[]` parts as lists), read with every cap counted as it arrives.

    Raises:
        InputError: 413 over a cap (MAX_BODY_BYTES, a part's), 422 for a body that is none of these.
        ClientGone: the client disconnected.
    """
    body = CountedBody(request)
    try:
        if body.declared is not None and body.declared > MAX_BODY_BYTES:
            raise InputError(f"the body holds {body.declared} bytes; at most {MAX_BODY_BYTES} are accepted",
                             status=413)
        content_type = request.headers.get("content-type", "")
        kind = content_type.split(";")[0].strip().lower()
        if kind == "multipart/form-data":
            return await form_fields(await _multipart_parts(body, content_type))
        if kind == "application/x-www-form-urlencoded":
            return await form_fields(await _urlencoded_parts(body))
        return await _json_object(body)
    except InputError:
        await body.drain()
        raise


async def _read_all(body: CountedBody) -> bytes:
    raw = bytearray()
    while chunk := await body.chunk():
        raw += chunk
    return bytes(raw)


async def _json_object(body: CountedBody) -> dict[str, Any]:
    raw = await _read_all(body)
    try:
        value = json_strict.loads(raw)
    except json_strict.DuplicateKeyError as exc:
        raise InputError(f"the JSON body: {exc}", exc.field) from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer over Python's digit limit
        raise InputError(f"malformed JSON body: {exc} (send a JSON object or a multipart form)") from None
    except RecursionError:  # the decoder recurses once per level: ~1000 levels end it
        raise InputError(f"the JSON body nests arrays and objects too deeply to be decoded; a request field nests "
                         f"at most {MAX_FIELD_DEPTH} levels") from None
    if not isinstance(value, dict):
        raise InputError("the body must be a JSON object of request fields (or a multipart form)")
    for name, field in value.items():
        if _deeper_than(field, MAX_FIELD_DEPTH):  # repr and validation recurse too: refused before either
            raise InputError(f"`{name}` nests arrays and objects more than {MAX_FIELD_DEPTH} levels deep; a request "
                             f"field nests at most {MAX_FIELD_DEPTH}", name)
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and dicts in `value` nest more than `limit` levels (a scalar: 0), found without recursion."""
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if level + 1 > limit:
            return True
        stack.extend((child, level + 1) for child in children)
    return False


async def _urlencoded_parts(body: CountedBody) -> list[tuple[str, str | bytes]]:
    raw = await _read_all(body)
    try:
        return urllib.parse.parse_qsl(raw.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FIELDS)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"malformed form body: {exc}") from None


async def _multipart_parts(body: CountedBody, content_type: str) -> list[tuple[str, str | bytes]]:
    """A multipart body's parts in order: (name, text) for a text part, (name, bytes) for a file part
    (one with a `filename`), each counted against its cap while its bytes arrive.

    Raises:
        InputError: 413 naming a part over its cap; 422 for a malformed body or too many parts.
    """
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise InputError("malformed form body: the Content-Type names no multipart boundary")
    parts: list[tuple[str, str | bytes]] = []
    counts = {"files": 0, "fields": 0}
    part: dict[str, Any] = {}
    header = {"name": b"", "value": b""}

    def on_part_begin() -> None:
        part.clear()
        part.update(disposition=b"", data=bytearray())

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header["name"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header["value"] += data[start:end]

    def on_header_end() -> None:
        if header["name"].lower() == b"content-disposition":
            part["disposition"] = header["value"]
        header["name"], header["value"] = b"", b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(part["disposition"])
        if b"name" not in options:
            raise InputError("malformed form body: a part's Content-Disposition names no field (`name`)")
        part["name"] = options[b"name"].decode("utf-8", "replace")
        part["file"] = b"filename" in options
        kind, limit = ("files", MAX_FILES) if part["file"] else ("fields", MAX_FIELDS)
        counts[kind] += 1
        if counts[kind] > limit:
            raise InputError(f"the form holds more than {limit} {'file' if part['file'] else 'text'} parts; at most "
                             f"{limit} are accepted", part["name"])
        part["cap"] = MAX_IMAGE_BYTES if part["file"] else MAX_TEXT_PART_BYTES

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part["data"] += data[start:end]
        if len(part["data"]) > part["cap"]:
            name = part["name"][:-2] if part["name"].endswith("[]") else part["name"]
            what = "" if part["file"] else " (a text part; send an image as a file part)"
            raise InputError(f"`{name}` holds more than {part['cap']} bytes{what}; at most {part['cap']} are "
                             "accepted", name, 413)

    def on_part_end() -> None:
        data = bytes(part["data"])
        if part["file"]:
            parts.append((part["name"], data))
            return
        try:
            parts.append((part["name"], data.decode("utf-8")))
        except UnicodeDecodeError:
            raise InputError(f"`{part['name']}`: a text part must be UTF-8", part["name"]) from None

    parser = MultipartParser(boundary, {"on_part_begin": on_part_begin, "on_header_field": on_header_field,
                                        "on_header_value": on_header_value, "on_header_end": on_header_end,
                                        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
                                        "on_part_end": on_part_end})
    try:
        while chunk := await body.chunk():
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as exc:
        raise InputError(f"malformed form body: {exc}") from None
    return parts


def _form_lora(parts: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The adapters of a form's `lora[][path]` / `lora[][strength]` parts ((key, value) in form order):
    the k-th strength part belongs to the k-th path part. Every adapter has a strength, or none has one
    (each then 1.0), or there is one adapter; anything else is ambiguous.

    Raises:
        InputError: a part that is an uploaded file; strength parts that cannot be paired with the path
            parts (naming both counts and the unambiguous alternative: one `lora` part holding the JSON list).
    """
    for key, value in parts:
        if isinstance(value, bytes):
            raise InputError(f"`{key}` must be a text part, not an uploaded file of {len(value)} bytes", "lora")
    paths = [v for k, v in parts if k.endswith("[path]")]
    strengths = [v for k, v in parts if k.endswith("[strength]")]
    if strengths and len(strengths) != len(paths):
        raise InputError(f"`lora`: the form has {len(paths)} `lora[][path]` and {len(strengths)} `lora[][strength]` "
                         "parts, which cannot be paired (clients such as `openai` send every path part before every "
                         "strength part): give every adapter a strength, or send `lora` as one form part holding the "
                         'JSON list, e.g. lora=[{"path": "a", "strength": 0.5}, {"path": "b"}]', "lora")
    adapters: list[dict[str, Any]] = [{"path": p} for p in paths]
    for adapter, strength in zip(adapters, strengths):  # a form's text is a number when it reads as one
        adapter["strength"] = float(strength) if re.fullmatch(NUMBER, strength) else strength
    return adapters


async def form_fields(items: list[tuple[str, str | bytes]]) -> dict[str, Any]:
    """A form's parts (text as str, files as bytes) as body fields. Several `image` parts (OpenAI's
    `image[]` of images.edit) are a list, the first image and then the references (`extra_images`,
    split by build_request). LoRA adapters come as `lora[][path]` / `lora[][strength]` parts
    (`_form_lora`, what the `openai` client sends for `extra_body={"lora": [...]}`) or as one `lora`
    text part holding the JSON list."""
    fields: dict[str, Any] = {}
    lora_parts: list[tuple[str, Any]] = []  # lora[][path] / lora[][strength], paired after the loop
    for key, value in items:
        name = key[:-2] if key.endswith("[]") else key
        if LORA_FORM_PART.fullmatch(key):
            lora_parts.append((key, value))
            continue
        if name == "lora" and isinstance(value, str):
            if "lora" in fields:
                raise InputError("`lora` is given twice in the form", "lora")
            try:
                fields["lora"] = json_strict.loads(value)
            except json_strict.DuplicateKeyError as exc:
                raise InputError(f"`lora` as a form part: {exc}", "lora") from None
            except (ValueError, RecursionError):
                raise InputError(f"`lora` as a form part must be a JSON list of {{\"path\": name, \"strength\": x}} "
                                 f"(got {shown(value)})", "lora") from None
            continue
        if isinstance(value, str) and name in INT_FIELDS and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            value = int(value)
        if isinstance(value, str) and name in BOOL_FIELDS and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if name == EXTRA_IMAGES_FIELD:
            fields.setdefault(name, []).append(value)
        elif name in fields and name == "image":  # build_request splits them (errors name `image[k]`, as sent)
            fields[name] = [*fields[name], value] if isinstance(fields[name], list) else [fields[name], value]
        elif name in fields:
            raise InputError(f"`{name}` is given twice in the form", name)
        else:
            fields[name] = value
    if lora_parts:
        if "lora" in fields:
            raise InputError("`lora` is given twice in the form (as a `lora` part and as `lora[][...]` parts)", "lora")
        fields["lora"] = _form_lora(lora_parts)
    return fields


__all__ = ["ClientGone", "CountedBody", "InputError", "form_fields", "read_body", "shown"]
