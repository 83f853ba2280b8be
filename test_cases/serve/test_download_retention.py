"""A result being downloaded is removed (by retention or DELETE) only after its download ends: the client
gets every byte, no new download starts, and the folder goes with the last one."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from runnerkit.serve.app import create_app
from runnerkit.serve.jobs import JobQueue
from test_cases.serve.test_units import _finished, _image_state

BODY = bytes(range(256)) * 4096  # 1 MiB: several chunks of the file response


def _endpoint(app: Any, job_id: str) -> Any:
    """The content endpoint's response for `job_id` (the endpoint called directly, as its route would)."""
    route = next(r for r in app.routes if getattr(r, "path", None) == "/v1/images/{job_id}/content")
    return asyncio.run(route.endpoint(job_id))


def _content(app: Any, job_id: str, on_start: Any = None) -> tuple[int, bytes]:
    """GET the job's content through its endpoint and the response's ASGI call; `on_start()` runs when the
    response's start message is sent (the file is opened after it)."""
    reply = _endpoint(app, job_id)
    status, body = reply.status_code, bytearray()

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and on_start is not None:
            on_start()
        body.extend(message.get("body", b""))

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b"",
             "server": ("t", 80), "scheme": "http", "root_path": "", "http_version": "1.1"}
    asyncio.run(reply(scope, receive, send))
    return status, bytes(body)


def _kept(tmp_path: Path) -> tuple[Any, JobQueue]:
    state = _image_state(tmp_path, max_queue=4)
    state.queue.keep_jobs = 1
    a = _finished(state.queue, "job_a", 0, 1.0)
    a.kind = "image"
    (a.folder / "result.png").write_bytes(BODY)
    return create_app(state), state.queue


@pytest.mark.parametrize("how", ["retention", "DELETE"])
def test_a_result_removed_while_downloaded_is_sent_whole_and_removed_after(tmp_path: Path, how: str) -> None:
    app, queue = _kept(tmp_path)
    a = queue.jobs["job_a"]
    seen: list[tuple[bool, int]] = []

    def remove() -> None:
        if how == "retention":
            _finished(queue, "job_b", 10, 2.0)
            queue.apply_retention()
        else:
            assert queue.delete("job_a")
        with ThreadPoolExecutor(1) as other:  # a second download meanwhile (its own event loop)
            seen.append((a.folder.exists(), other.submit(_content, app, "job_a").result()[0]))

    status, body = _content(app, "job_a", on_start=remove)
    assert status == 200 and body == BODY
    assert seen == [(True, 410 if how == "retention" else 404)]  # kept for the first, refused to a new one
    assert not a.folder.exists() and not queue._readers and not queue._doomed
    assert a.expired == (how == "retention")


def test_a_download_that_fails_still_lets_the_folder_go(tmp_path: Path) -> None:
    """The client goes away mid-download (the send raises): the removal deferred meanwhile still happens."""
    app, queue = _kept(tmp_path)
    a = queue.jobs["job_a"]
    reply = _endpoint(app, "job_a")

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            assert queue.delete("job_a") and a.folder.exists()
            raise OSError("the client went away")

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b"",
             "server": ("t", 80), "scheme": "http", "root_path": "", "http_version": "1.1"}
    with pytest.raises(OSError, match="went away"):
        asyncio.run(reply(scope, receive, send))
    assert not a.folder.exists() and not queue._readers


def test_a_result_not_downloaded_is_removed_at_once(tmp_path: Path) -> None:
    app, queue = _kept(tmp_path)
    a = queue.jobs["job_a"]
    assert _content(app, "job_a")[0] == 200 and a.folder.exists()  # the download ended: nothing held
    _finished(queue, "job_b", 10, 2.0)
    queue.apply_retention()
    assert a.expired and not a.folder.exists() and _content(app, "job_a")[0] == 410


def test_a_download_that_looked_the_job_up_before_a_delete_is_refused(tmp_path: Path) -> None:
    """A DELETE between the content endpoint's lookup and its start: the download does not start (the folder goes)."""
    _, queue = _kept(tmp_path)
    a = queue.jobs["job_a"]
    assert queue.delete("job_a") and not a.folder.exists()
    assert not queue.open_content(a) and not queue._readers


@pytest.mark.parametrize("error, status", [(FileNotFoundError, 410), (PermissionError, None)])
def test_a_response_that_cannot_be_built_holds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       error: type[OSError], status: int | None) -> None:
    """The result file vanished by other hands after the download was admitted (410), or cannot be read (the
    error propagates): the hold is released either way, so a later removal deletes the folder at once."""
    app, queue = _kept(tmp_path)
    a = queue.jobs["job_a"]
    real_stat = os.stat

    def failing(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path) == a.result_path:
            raise error(2, "refused", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", failing)
    if status is None:
        with pytest.raises(PermissionError):
            _endpoint(app, "job_a")
    else:
        assert _endpoint(app, "job_a").status_code == status
    monkeypatch.setattr(os, "stat", real_stat)
    assert not queue._readers
    assert queue.delete("job_a") and not a.folder.exists()


def test_head_on_the_content_gives_its_size_and_type_and_holds_nothing(tmp_path: Path) -> None:
    """HEAD (a player probing the file before its range requests): 200 with the length and the type, no body."""
    from starlette.testclient import TestClient

    app, queue = _kept(tmp_path)
    with TestClient(app) as client:
        reply = client.head("/v1/images/job_a/content")
        assert (reply.status_code, reply.headers["content-length"], reply.headers["content-type"], reply.content) \
            == (200, str(len(BODY)), "image/png", b"")
        assert client.head("/v1/images/job_x/content").status_code == 404
    assert not queue._readers
