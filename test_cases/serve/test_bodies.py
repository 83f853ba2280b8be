"""The API's bodies and errors, through the whole ASGI app in this process (no model runs): caps counted
while a body arrives (JSON and every multipart part), refused bodies drained before the answer, deep
JSON nesting, the catch-all 500, and the `n` / seed contract of images.generate."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runnerkit.serve import body as body_mod
from runnerkit.serve.app import ServerState, create_app
from runnerkit.serve.jobs import JobQueue
from test_cases.serve.test_units import _png, _qwen_edit_state

CHUNK = 64 * 1024  # uvicorn's read size: what one ASGI `http.request` message carries at most


class Wire:
    """One request as a protocol server hands it to the ASGI app: the body in `chunks` (ASGI messages), then
    `http.disconnect` once the app asks for more than was sent. Records what the app pulled and sent, in order."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.pulled = 0  # body bytes the app received
        self.events: list[tuple[str, Any]] = []
        self.raised: Exception | None = None
        self._next = next(chunks, None)

    async def receive(self) -> dict[str, Any]:
        if self._next is None:
            return {"type": "http.disconnect"}
        data, self._next = self._next, next(self.chunks, None)
        self.pulled += len(data)
        self.events.append(("pulled", self.pulled))
        return {"type": "http.request", "body": data, "more_body": self._next is not None}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.events.append(("answered", message["status"]))
        elif message["type"] == "http.response.body":
            self.events.append(("body", message.get("body", b"")))

    def reply(self, raised: type[Exception] | None = None) -> tuple[int, dict[str, Any]]:
        """The answer's status and JSON body; the app let out no exception but one of type `raised`."""
        assert (self.raised is None) if raised is None else isinstance(self.raised, raised), self.raised
        status = next(v for k, v in self.events if k == "answered")
        return status, json.loads(b"".join(v for k, v in self.events if k == "body"))


def post(app: Any, path: str, chunks: Iterator[bytes], content_type: str = "application/json",
         length: int | None = None) -> Wire:
    """POST through the whole app (its middleware and exception handlers included); `length`: a declared
    Content-Length (None: a chunked body). An exception the app lets out is kept in `wire.raised`."""
    headers = [(b"content-type", content_type.encode())]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "server": ("t", 80), "client": ("c", 1), "scheme": "http"}
    wire = Wire(chunks)
    try:
        asyncio.run(app(scope, wire.receive, wire.send))
    except Exception as exc:  # noqa: BLE001  (the 500 test reads it; the others assert there is none)
        wire.raised = exc
    return wire


def pieces(data: bytes, size: int = CHUNK) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def endless(prefix: bytes, fill: bytes = b" ") -> Iterator[bytes]:
    """A chunked body far over any cap of the tests: `prefix`, then 256 CHUNK-sized chunks of `fill` (16 MiB)."""
    yield prefix
    block = fill * (CHUNK // len(fill))
    for _ in range(256):
        yield block


def _video_state(tmp_path: Path) -> ServerState:
    """A ready video server whose runner is never reached (the bodies are refused before)."""
    runner = SimpleNamespace(RESULT_KINDS={"t2v": "video"}, config=SimpleNamespace(task="t2v", model_cls="x"))
    return ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None,  # type: ignore[arg-type]
                       phase="ready")


def _error_shape(status: int, body: dict[str, Any]) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "field", "code"} and err["code"] == status, body
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error"), body
    return err


# ---- deep nesting and the catch-all 500 -------------------------------------------------------
def test_json_nested_2000_levels_is_422_in_the_api_error_shape(tmp_path: Path) -> None:
    raw = b'{"prompt": "x", "negative_prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    status, reply = post(create_app(_video_state(tmp_path)), "/v1/videos", pieces(raw)).reply()
    err = _error_shape(422, reply)
    assert status == 422 and err["param"] is None, reply
    assert err["message"] == ("the JSON body nests arrays and objects too deeply to be decoded; a request field "
                              "nests at most 8 levels"), err


def test_a_field_nested_deeper_than_the_limit_is_422_naming_it(tmp_path: Path) -> None:
    """Deep enough to decode, too deep to show or validate: refused naming the field; 8 levels are not refused
    for their depth (validation names the field's type instead)."""
    app = create_app(_video_state(tmp_path))
    too_deep = b'{"prompt": "x", "negative_prompt": ' + b"[" * 9 + b"]" * 9 + b"}"
    status, reply = post(app, "/v1/videos", pieces(too_deep)).reply()
    err = _error_shape(422, reply)
    assert (status, err["param"], err["message"]) == (
        422, "negative_prompt", "`negative_prompt` nests arrays and objects more than 8 levels deep; a request field "
                                "nests at most 8"), reply
    assert not body_mod._deeper_than([[[[[[[[1]]]]]]]], 8) and body_mod._deeper_than([[[[[[[[[1]]]]]]]]], 8)


def test_an_unhandled_failure_is_500_in_the_api_error_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A route that raises something no handler answers: 500, `type: server_error`, the API's shape (not
    Starlette's plain-text `Internal Server Error`)."""
    import runnerkit.serve.app as app_mod

    def broken(*args: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(app_mod, "build_request", broken)
    wire = post(create_app(_video_state(tmp_path)), "/v1/videos", pieces(b'{"prompt": "x"}'))
    status, reply = wire.reply(raised=RuntimeError)  # Starlette re-raises it after the answer, for the server's log
    err = _error_shape(500, reply)
    assert (status, err["type"], err["param"]) == (500, "server_error", None), reply
    assert err["message"] == ("POST /v1/videos: internal server error (RuntimeError: disk on fire); the server's "
                              "log has the traceback"), err
    assert list(tmp_path.iterdir()) == []  # the job's folder was removed


# ---- caps counted while the body arrives --------------------------------------------------------
def test_a_chunked_json_body_over_the_cap_stops_at_the_chunk_that_passes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Content-Length: the body is counted as it arrives and refused (413) at the chunk that passes the cap;
    nothing more is pulled."""
    cap = 10 * CHUNK
    monkeypatch.setattr(body_mod, "MAX_BODY_BYTES", cap)
    wire = post(create_app(_video_state(tmp_path)), "/v1/videos", endless(b'{"prompt": "', b"x"))
    status, reply = wire.reply()
    err = _error_shape(413, reply)
    assert (status, err["message"]) == (413, f"the body holds more than {cap} bytes; at most {cap} are accepted")
    assert cap < wire.pulled <= cap + CHUNK, wire.pulled


def _multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "b0undary") -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out


@pytest.mark.parametrize("part", ["file", "text"])
def test_a_chunked_form_part_over_its_cap_stops_the_parser_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 part: str) -> None:
    """A file part (cap MAX_IMAGE_BYTES) or a text part (cap MAX_TEXT_PART_BYTES) that never ends, in a chunked
    body far under the body cap: 413 naming the part once it passes its own cap, at most one chunk later, and no
    temporary file is written (the parts stay in memory)."""
    monkeypatch.setattr(body_mod, "MAX_IMAGE_BYTES", 4 * CHUNK)
    monkeypatch.setattr(body_mod, "MAX_TEXT_PART_BYTES", 2 * CHUNK)
    spool = tmp_path / "tempdir"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    head = _multipart([("prompt", None, b"x")]) + (
        b'--b0undary\r\nContent-Disposition: form-data; name="input_reference"; filename="a.png"\r\n\r\n'
        if part == "file" else b'--b0undary\r\nContent-Disposition: form-data; name="negative_prompt"\r\n\r\n')
    state = _video_state(tmp_path / "out")
    (tmp_path / "out").mkdir()
    state.queue = JobQueue(tmp_path / "out", 4, None, None)
    wire = post(create_app(state), "/v1/videos", endless(head), content_type="multipart/form-data; boundary=b0undary")
    status, reply = wire.reply()
    err = _error_shape(413, reply)
    cap = 4 * CHUNK if part == "file" else 2 * CHUNK
    name = "input_reference" if part == "file" else "negative_prompt"
    what = "" if part == "file" else " (a text part; send an image as a file part)"
    assert (status, err["param"], err["message"]) == (
        413, name, f"`{name}` holds more than {cap} bytes{what}; at most {cap} are accepted"), reply
    assert cap < wire.pulled - len(head) <= cap + CHUNK, wire.pulled
    assert list(spool.iterdir()) == []


def test_a_form_is_read_part_by_part_as_starlette_read_it(tmp_path: Path) -> None:
    """Text parts as str, file parts as bytes, `image[]` parts a list, integer fields converted, in one
    chunked body split inside a part's bytes."""
    png = _png()
    raw = _multipart([("prompt", None, "un été".encode()), ("seed", None, b"7"), ("image[]", "a.png", png),
                      ("image[]", "b.png", png)]) + b"--b0undary--\r\n"
    fields: dict[str, Any] = {}

    async def read() -> None:
        wire = Wire(pieces(raw, 1000))
        request = SimpleNamespace(receive=wire.receive, headers={"content-type": "multipart/form-data; boundary=b0undary"})
        fields.update(await body_mod.read_body(request))  # type: ignore[arg-type]

    asyncio.run(read())
    assert fields == {"prompt": "un été", "seed": 7, "image": [png, png]}


# ---- refused bodies are drained before the answer -----------------------------------------------
@pytest.mark.parametrize(("declared", "drained"), [("cap + 1", True), ("cap + drain", True),
                                                   ("cap + drain + 1", False)])
def test_a_refused_declared_body_is_read_to_its_end_before_the_413_up_to_the_drain_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, declared: str, drained: bool) -> None:
    """Content-Length over the cap: 413 without a byte kept; the declared body is received (and discarded) to its
    end before the answer when it is at most cap + DRAIN_BYTES, and not at all beyond."""
    cap, drain = 4 * CHUNK, 6 * CHUNK
    monkeypatch.setattr(body_mod, "MAX_BODY_BYTES", cap)
    monkeypatch.setattr(body_mod, "DRAIN_BYTES", drain)
    length = {"cap + 1": cap + 1, "cap + drain": cap + drain, "cap + drain + 1": cap + drain + 1}[declared]
    wire = post(create_app(_video_state(tmp_path)), "/v1/videos", pieces(b" " * length), length=length)
    status, reply = wire.reply()
    assert (status, reply["error"]["message"]) == (413, f"the body holds {length} bytes; at most {cap} are accepted")
    answered = wire.events.index(("answered", 413))
    assert wire.events[:answered] == ([("pulled", min(length, k * CHUNK)) for k in range(1, -(-length // CHUNK) + 1)]
                                      if drained else []), wire.events[:answered]


def test_a_client_sending_the_whole_refused_body_reads_the_413(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a real socket (uvicorn, HTTP/1.1): a client that sends its whole over-cap body before reading,
    starting after a pause longer than the connection's keep-alive timeout, reads the 413 (the server
    waits for the body before answering, so the connection is not closed under the sending client)."""
    import uvicorn

    cap = 4 * CHUNK
    monkeypatch.setattr(body_mod, "MAX_BODY_BYTES", cap)
    server = uvicorn.Server(uvicorn.Config(create_app(_video_state(tmp_path)), host="127.0.0.1", port=0,
                                           log_level="warning", timeout_keep_alive=1, http="h11"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        length = 3 * cap
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {length}\r\n\r\n".encode())
            time.sleep(1.5)  # longer than timeout_keep_alive: a connection answered already would be closed now
            sock.sendall(b" " * length)
            head = b""
            while b"\r\n\r\n" not in head:
                data = sock.recv(4096)
                assert data, head
                head += data
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 413 Request Entity Too Large", head
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ---- images.generate: n and seeds -----------------------------------------------------------------
def _queued_then_gone(state: ServerState, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """POST images.edits; the client disconnects once the jobs are queued (no worker runs them)."""
    state.metrics = SimpleNamespace(queue_depth=SimpleNamespace(set=lambda v: None))  # type: ignore[assignment]
    wire = post(create_app(state), "/v1/images/edits", pieces(json.dumps(body).encode()))
    status = next(v for k, v in wire.events if k == "answered")
    payload = b"".join(v for k, v in wire.events if k == "body")
    return status, json.loads(payload) if payload else None


@pytest.mark.parametrize("seed", [7, None])
def test_n_images_get_successive_seeds(tmp_path: Path, seed: int | None) -> None:
    state = _qwen_edit_state(tmp_path)
    body = {"prompt": "x", "n": 3, "image": base64.b64encode(_png()).decode(), **({"seed": seed} if seed is not None else {})}
    status, _ = _queued_then_gone(state, body)
    first = seed if seed is not None else state.runner.config.seed
    jobs = state.queue.list()
    assert status == 499 and [j.resolved["seed"] for j in jobs] == [first, first + 1, first + 2]
    assert [j.request.seed for j in jobs] == [seed, first + 1, first + 2]


def test_n_10_is_accepted_and_11_refused_naming_n(tmp_path: Path) -> None:
    state = _qwen_edit_state(tmp_path)
    state.queue = JobQueue(tmp_path, 16, None, None)
    image = base64.b64encode(_png()).decode()
    status, _ = _queued_then_gone(state, {"prompt": "x", "n": 10, "image": image})
    assert status == 499 and len(state.queue.list()) == 10
    status, reply = _queued_then_gone(state, {"prompt": "x", "n": 11, "image": image})
    err = _error_shape(422, reply or {})
    assert (status, err["param"]) == (422, "n") and "in [1, 10] (got 11)" in err["message"], reply
    assert len(state.queue.list()) == 10


# ---- a key given twice -----------------------------------------------------------------------
def test_a_json_body_naming_a_key_twice_is_422_naming_it(tmp_path: Path) -> None:
    """`json` would keep the last `seed` silently; the body is refused naming the key as the client sent it (its
    path inside a field's object) and both values (a long value shortened), also in a form's `lora` part."""
    app = create_app(_video_state(tmp_path))
    raw = b'{"prompt": "x", "seed": 1, "negative_prompt": "' + b"n" * 500 + b'", "seed": 2}'
    status, reply = post(app, "/v1/videos", pieces(raw)).reply()
    err = _error_shape(422, reply)
    assert (status, err["param"], err["message"]) == (
        422, "seed", "the JSON body: key 'seed' appears twice in one JSON object (values 1 and 2): keep one"), reply
    raw = b'{"prompt": "x", "lora": [{"path": "a"}, {"path": "a", "path": "' + b"b" * 100 + b'"}]}'
    status, reply = post(app, "/v1/videos", pieces(raw)).reply()
    err = _error_shape(422, reply)
    assert (status, err["param"], err["message"]) == (
        422, "lora[1].path", "the JSON body: key 'path' appears twice in one JSON object of `lora[1]` (values 'a' "
                             f"and '{'b' * 47}... (102 characters)): keep one"), reply
    form = b'prompt=x&lora=%5B%7B%22path%22%3A%22a%22%2C%22path%22%3A%22b%22%7D%5D'  # [{"path":"a","path":"b"}]
    status, reply = post(app, "/v1/videos", pieces(form), "application/x-www-form-urlencoded").reply()
    err = _error_shape(422, reply)
    assert (status, err["param"], err["message"]) == (
        422, "lora", "`lora` as a form part: key 'path' appears twice in one JSON object of `[0]` (values 'a' and "
                     "'b'): keep one"), reply


def test_an_integer_past_the_digit_limit_is_422_not_500(tmp_path: Path) -> None:
    """Python refuses to convert an integer of more than 4300 digits (a ValueError that is no JSONDecodeError)."""
    raw = b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"
    status, reply = post(create_app(_video_state(tmp_path)), "/v1/videos", pieces(raw)).reply()
    err = _error_shape(422, reply)
    assert status == 422 and err["message"].startswith("malformed JSON body: Exceeds the limit (4300 digits)"), reply
