"""The official `openai` client (unmodified) against `runnerkit serve` on 127.0.0.1: videos.

One server (the tiny Wan t2v config, 2 steps, no warmup) serves the module. It starts with torch's
import held back (a `sitecustomize` on its PYTHONPATH blocks the first `import torch` until the
test releases it): its port must open and answer `starting` meanwhile, since the port opens before
the heavy imports. The images calls run against the Qwen-Image edit server in
test_cases/models/qwen_image/test_serve.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cases.conftest import tiny_config_dict, write_config
from test_cases.serve.test_server import Server, frames, http

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client marks its videos calls

STEPS = 2
GATE = '''import importlib.util, os, sys, time


class _HoldTorch:
    """Holds the first `import torch` back until the file named by RUNNERKIT_TEST_TORCH_GATE exists. It
    waits in the loader's exec_module (the torch module's own lock), not in find_spec (which runs under
    the interpreter's global import lock and would block every other thread's imports)."""

    done = False  # set, not removed from sys.meta_path: a thread walking that list while it shrinks skips a finder

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self.done:
            return None
        self.done = True
        spec = importlib.util.find_spec("torch")
        real = spec.loader

        class Held:
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                while not os.path.exists(os.environ["RUNNERKIT_TEST_TORCH_GATE"]):
                    time.sleep(0.02)
                real.exec_module(module)

        spec.loader = Held()
        return spec


sys.meta_path.insert(0, _HoldTorch())
'''


@pytest.fixture(scope="module")
def server(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server, checked to open its port and answer `starting` while torch cannot be imported."""
    root = tmp_path_factory.mktemp("serve_openai")
    (root / "gate").mkdir()
    (root / "gate" / "sitecustomize.py").write_text(GATE)
    release = root / "torch_may_load"
    config = write_config(root / "tiny.json", tiny_config_dict(tiny_ckpt, infer_steps=STEPS))
    from test_cases.serve.test_server import env

    pythonpath = f"{root / 'gate'}:{env(root / 'cache')['PYTHONPATH']}"
    srv = Server(config, root / "out", root / "cache", extra_env={"PYTHONPATH": pythonpath,
                                                                   "RUNNERKIT_TEST_TORCH_GATE": str(release)})
    try:
        assert srv.wait_port(timeout=60), srv.log()  # torch is held back: the port opened without it
        r = srv.get("/health/ready")
        assert (r.status, r.json()["phase"]) == (503, "starting"), r.body
        assert srv.get("/health/live").status == 200
        assert srv.get("/v1/info").json() == {"phase": "starting", "max_queue": 16}
        assert srv.get("/metrics").status == 503
        refused = http("POST", srv.url + "/v1/videos", {"prompt": "too early"})
        assert refused.status == 503 and refused.headers.get("retry-after") == "5", refused.body
        assert "phase: loading" not in srv.log()
        release.touch()
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_videos_create_poll_retrieve_download(client: openai.OpenAI, server: Server) -> None:
    queued = client.videos.create(prompt="a red fox in the snow", size="48x32", seconds="1")  # a multipart form
    assert isinstance(queued, openai.types.Video)
    assert (queued.object, queued.status, queued.size, queued.seconds, queued.model) == \
        ("video", "queued", "48x32", "1.125", "wan2.1")
    assert isinstance(queued.created_at, int) and queued.completed_at is None and queued.prompt == "a red fox in the snow"
    assert abs(queued.created_at - time.time()) < 60
    done = client.videos.poll(queued.id, poll_interval_ms=20)
    assert (done.status, done.progress, done.error) == ("completed", 100, None), done
    assert isinstance(done.completed_at, int) and done.completed_at >= done.created_at
    again = client.videos.retrieve(queued.id)
    assert again.model_dump()["steps_done"] == STEPS and again.status == "completed"
    content = client.videos.download_content(queued.id)
    mp4 = server.out_dir / queued.id / "result.mp4"
    assert content.content == mp4.read_bytes() and content.content[4:8] == b"ftyp"
    assert frames(mp4) == 9  # seconds "1" at the tiny config's 8 fps: 8 frames, the nearest 4k + 1 is 9 (9 / 8 s)
    # 8 fps, frames 4k+1: "0.7" s is 5.6 frames: 5 (0.625 s, the shortest clip) is the nearest
    short = client.videos.create_and_poll(prompt="ocean waves", seconds="0.7", poll_interval_ms=20)
    assert (short.status, short.seconds, short.size) == ("completed", "0.625", "80x48"), short
    assert server.job(short.id)["resolved"]["frames"] == 5 and server.job(short.id)["request"] == {
        "prompt": "ocean waves", "seconds": "0.7"}
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        client.videos.download_content(queued.id, variant="thumbnail")
    assert exc.value.param == "variant"


def test_videos_list_pages_and_delete(client: openai.OpenAI, server: Server) -> None:
    ids = [client.videos.create(prompt=f"clip {k}", size="48x32").id for k in range(3)]
    for i in ids:
        assert client.videos.poll(i, poll_interval_ms=20).status == "completed"
    every = [v.id for v in client.videos.list()]  # newest first, as OpenAI
    assert every[:3] == ids[::-1]
    page = client.videos.list(limit=2, order="asc", after=every[-1])
    assert [v.id for v in page.data] == every[::-1][1:3] and page.has_more is (len(every) > 3)
    raw = http("GET", f"{server.url}/v1/videos?limit=2&order=asc").json()
    assert (raw["first_id"], raw["last_id"]) == (every[-1], every[-2]) and raw["has_more"] is True
    assert [v.id for v in client.videos.list(limit=1)] == every  # auto-pagination: one job a page, after last_id
    gone = client.videos.delete(ids[0])
    assert (gone.id, gone.object, gone.deleted) == (ids[0], "video.deleted", True)
    assert not (server.out_dir / ids[0]).exists()
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(ids[0])
    for bad, param in (({"order": "newest"}, "order"), ({"limit": 0}, "limit"), ({"after": "job_nope"}, "after")):
        with pytest.raises(openai.APIStatusError) as exc:
            client.videos.list(**bad)
        assert exc.value.param == param, exc.value.body


@pytest.mark.parametrize("call,param,status", [
    (dict(size="50x48"), "size", 422),  # not a multiple of 16
    (dict(seconds="soon"), "seconds", 422),
    (dict(model="sora-2"), "model", 422),
    (dict(input_reference=("first.png", b"\x89PNG not really", "image/png")), "input_reference", 422),  # t2v: no image
    (dict(extra_body={"colour": "red"}), "colour", 422),
], ids=["size", "seconds", "model", "input_reference", "unknown"])
def test_videos_errors_name_the_param(client: openai.OpenAI, server: Server, call: dict, param: str,
                                      status: int) -> None:
    before = http("GET", server.url + "/v1/videos").json()["data"]
    with pytest.raises(openai.APIStatusError) as exc:
        client.videos.create(prompt="x", **call)
    err = exc.value
    assert (err.status_code, err.param, err.type, str(err.code)) == (status, param, "invalid_request_error",
                                                                      str(status)), err.body
    assert http("GET", server.url + "/v1/videos").json()["data"] == before  # nothing was queued


def test_a_job_of_the_other_kind_is_404_with_a_hint(server: Server) -> None:
    job = http("POST", server.url + "/v1/videos", {"prompt": "x", "target_video_length": 1}).json()["id"]
    r = server.get(f"/v1/images/{job}")
    assert r.status == 404 and f"see /v1/videos/{job}" in r.json()["error"]["message"], r.body
    r = server.get("/v1/images/job_0123456789abcdef")
    assert r.status == 404 and "makes videos, see /v1/videos/job_0123456789abcdef" in r.json()["error"]["message"]
    r = http("POST", server.url + "/v1/images/generations", {"prompt": "x"})
    assert r.status == 404 and "POST /v1/videos" in r.json()["error"]["message"], r.body
    server.wait_job(job)
