"""Errors the whole ASGI app answers in OpenAI's shape, naming the parameter as the client sent it: an
uploaded image that declares more pixels than Pillow will open (a decompression bomb), and query parameters
FastAPI itself refuses (`limit=abc`) as those the route refuses (`limit=0`). The tiny i2v runner is only built (no checkpoint is read)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from runnerkit.serve.app import create_app
from test_cases.serve.test_bodies import _error_shape, _multipart, _video_state, pieces, post
from test_cases.serve.test_units import _wan_i2v_state


def _blank_png(side: int) -> bytes:
    """A valid 1-bit PNG of `side` x `side` black pixels: a 20000-pixel side is 400 M pixels in ~50 KB."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (side + 7) // 8)  # filter byte 0, then the row's bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # width, height, bit depth 1, grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def bomb() -> bytes:
    png = _blank_png(20000)
    assert len(png) < 100_000 and 20000**2 > 2 * Image.MAX_IMAGE_PIXELS  # small on disk, over Pillow's error limit
    return png


BOMB_SAYS = ("`{field}` (uploaded) is too large to decode safely: Image size (400000000 pixels) exceeds limit of "
             f"{2 * Image.MAX_IMAGE_PIXELS} pixels, could be decompression bomb DOS attack.")


@pytest.mark.parametrize(("field", "as_form"), [("input_reference", True), ("image", True), ("image", False)],
                         ids=["input_reference-part", "image-part", "image-base64"])
def test_a_decompression_bomb_is_422_naming_the_field_as_sent(tmp_path: Path, bomb: bytes, field: str,
                                                             as_form: bool) -> None:
    app = create_app(_wan_i2v_state(tmp_path))
    if as_form:
        raw = _multipart([("prompt", None, b"x"), (field, "huge.png", bomb)]) + b"--b0undary--\r\n"
        wire = post(app, "/v1/videos", pieces(raw), content_type="multipart/form-data; boundary=b0undary")
    else:
        raw = json.dumps({"prompt": "x", field: base64.b64encode(bomb).decode()}).encode()
        wire = post(app, "/v1/videos", pieces(raw))
    status, reply = wire.reply()
    err = _error_shape(422, reply)
    assert (status, err["param"], err["message"]) == (422, field, BOMB_SAYS.format(field=field)), reply
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == []  # the job's folder was removed


def get(app: Any, path: str, query: str) -> tuple[int, dict[str, Any]]:
    """GET `path?query` through the whole app (its exception handlers included)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "path": path,
             "raw_path": path.encode(), "query_string": query.encode(), "root_path": "", "headers": [],
             "server": ("t", 80), "client": ("c", 1), "scheme": "http"}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.mark.parametrize(("query", "param", "says"), [
    ("limit=abc", "limit", "`limit` 'abc' (a query parameter): input should be a valid integer, unable to parse "
                           "string as an integer"),
    ("limit=1.5", "limit", "`limit` '1.5' (a query parameter): input should be a valid integer, unable to parse "
                           "string as an integer"),
    ("limit=0", "limit", "`limit` must be in [1, 1000] (got 0)"),
    ("order=up", "order", "`order` must be 'asc' or 'desc' (got 'up')"),
])
def test_a_bad_query_parameter_is_422_in_the_openai_shape_naming_it(tmp_path: Path, query: str, param: str,
                                                                    says: str) -> None:
    status, reply = get(create_app(_video_state(tmp_path)), "/v1/videos", query)
    err = _error_shape(422, reply)
    assert set(reply) == {"error"} and (status, err["param"], err["message"]) == (422, param, says), reply

