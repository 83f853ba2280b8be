"""`runnerkit serve` end to end: the real server in a subprocess, spoken to over HTTP with urllib.

One server (tiny Wan config, 30 steps, --warmup --save_tensors) is shared by the module; servers
with special flags (a failing warmup, --max_queue 1 --keep_jobs 1, SIGTERM with --on_shutdown
finish / cancel) are started by their tests. Outputs are compared bit for bit with the launch
script (`python -m runnerkit.infer --requests`) run in a process of its own with the same config,
prompts and seeds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from test_cases.conftest import REPO, tiny_config_dict, write_config

STEPS = 30
FINAL = ("completed", "failed", "cancelled")
# Requests compared with the launch script (the second with another shape).
REQUESTS: list[dict[str, Any]] = [
    {"prompt": "a red fox in the snow", "seed": 1},
    {"prompt": "ocean waves at dusk", "seed": 2, "target_height": 32, "target_width": 32, "target_video_length": 5},
    {"prompt": "a city at night", "seed": 3},
]
# A request whose denoising steps are slow on the CPU (~0.1-0.3 s each; its decode would take seconds).
SLOW = {"prompt": "a slow one", "seed": 7, "target_height": 256, "target_width": 256, "target_video_length": 17}


# ---- helpers ----------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, body: Any = None, raw: bytes | None = None, timeout: float = 30,
         content_type: str = "application/json") -> Reply:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": content_type} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


def form(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body (text fields, then file parts) and its Content-Type."""
    boundary = "runnerkit-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{k}.png"\r\n'
              f"Content-Type: image/png\r\n\r\n".encode() + v + b"\r\n" for k, v in files.items()]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUNNERKIT_CACHE": str(cache)}


class Server:
    """A `runnerkit serve` subprocess; its stderr goes to `log_path`."""

    def __init__(self, config: Path, out_dir: Path, cache: Path, *flags: str, module: str = "runnerkit.infer",
                 extra_env: dict[str, str] | None = None) -> None:
        self.out_dir = out_dir
        self.log_path = out_dir.parent / f"{out_dir.name}.log"
        if not any(f.startswith("--drain_grace") for f in flags):  # no test but the drain's waits for it
            flags = (*flags, "--drain_grace", "0")
        argv = [sys.executable, "-m", module, *(["serve"] if module == "runnerkit.infer" else []),
                "--config_json", str(config), "--port", "0", "--output_dir", str(out_dir), *flags]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**env(cache), **(extra_env or {})}, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.url = ""

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_port(self, timeout: float = 90) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.log())
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                return ""
            time.sleep(0.01)
        raise AssertionError(f"no port announced in {timeout} s:\n{self.log()}")

    def get(self, path: str) -> Reply:
        return http("GET", self.url + path)

    def post(self, body: Any = None, raw: bytes | None = None) -> Reply:
        return http("POST", self.url + "/v1/videos", body, raw)

    def submit(self, body: dict[str, Any]) -> str:
        r = self.post(body)
        assert r.status == 200, (r.status, r.body)
        assert r.json()["status"] == "queued"
        return r.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.get(f"/v1/videos/{job_id}")
        assert r.status == 200, (r.status, r.body)
        return r.json()

    def wait_job(self, job_id: str, until: Any = lambda j: j["status"] in FINAL, timeout: float = 120,
                 poll: float = 0.01) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            j = self.job(job_id)
            if until(j):
                return j
            if j["status"] in FINAL:
                raise AssertionError(f"job {job_id} ended before the condition: {j}")
            time.sleep(poll)
        raise AssertionError(f"job {job_id} timed out: {self.job(job_id)}\n{self.log()[-3000:]}")

    def wait_ready(self, timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.get("/health/ready").status == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"not ready in {timeout} s:\n{self.log()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def video(path: Path) -> torch.Tensor:
    tensors = load_file(str(path))
    assert sorted(tensors) == ["video"], f"{path} keys {sorted(tensors)}"
    return tensors["video"]


def frames(path: Path) -> int:
    import imageio_ffmpeg

    return imageio_ffmpeg.count_frames_and_secs(str(path))[0]


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve_cache")


@pytest.fixture(scope="module")
def config(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config (CPU, 48x80x9) with 30 steps, pointing at the session checkpoint."""
    return write_config(tmp_path_factory.mktemp("serve_cfg") / "tiny30.json",
                        tiny_config_dict(tiny_ckpt, infer_steps=STEPS))


@pytest.fixture(scope="module")
def references(config: Path, cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """REQUESTS run by the launch script in a process of its own, one after the other from a
    requests file, as the server runs its jobs (started at once, collected lazily)."""
    out = tmp_path_factory.mktemp("serve_refs")
    reqs = out / "requests.jsonl"
    reqs.write_text("".join(json.dumps({**req, "save_tensor_path": str(out / f"{n}.safetensors")}) + "\n"
                            for n, req in enumerate(REQUESTS)))
    proc = subprocess.Popen([sys.executable, "-m", "runnerkit.infer", "--config_json", str(config), "--requests",
                             str(reqs)], cwd=REPO, env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    done: dict[int, torch.Tensor] = {}

    def get(n: int) -> torch.Tensor:
        if not done:
            log, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, log
            done.update({k: video(out / f"{k}.safetensors") for k in range(len(REQUESTS))})
        return done[n]

    yield get
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def shared(config: Path, cache: Path, tmp_path_factory: pytest.TempPathFactory,
           references: Any) -> Iterator[tuple[Server, list[tuple[str, Reply]]]]:
    """The shared server (--warmup --save_tensors) and the trace of what it answered while starting:
    (endpoint, reply) polled as fast as possible from the moment its port opened until ready."""
    server = Server(config, tmp_path_factory.mktemp("serve_shared") / "out", cache, "--warmup", "--save_tensors")
    try:
        assert server.wait_port(), server.log()
        trace: list[tuple[str, Reply]] = []
        ready_in_a_row, end = 0, time.monotonic() + 90
        while ready_in_a_row < 3 and time.monotonic() < end:
            for path in ("/health/ready", "/health", "/health/live"):
                trace.append((path, server.get(path)))
            if trace[-3][1].status == 503:  # not ready a moment ago: a POST must be refused
                trace.append(("POST /v1/videos", server.post(REQUESTS[0])))
                ready_in_a_row = 0
            else:
                ready_in_a_row += 1
        yield server, trace
    finally:
        server.stop()


# ---- 1. readiness -----------------------------------------------------------------------------
def test_readiness_is_the_warmup(shared: tuple[Server, list[tuple[str, Reply]]]) -> None:
    server, trace = shared
    ready = [r for path, r in trace if path == "/health/ready"]
    assert ready and ready[-1].status == 200 and ready[-1].json() == {"status": "ready", "phase": "ready"}
    phases = [r.json()["phase"] for r in ready]
    # 503 with the start-up phase until ready, 200 from then on; phases only move forward.
    order = ["starting", "loading", "warming_up", "ready"]
    assert all(p in order for p in phases), phases
    ranks = [order.index(p) for p in phases]
    assert ranks == sorted(ranks), phases
    assert {"loading", "warming_up"} & set(phases), f"never saw loading/warming_up: {phases}"
    for r in ready:
        if r.json()["phase"] == "ready":
            assert r.status == 200, r.body
        else:
            assert r.status == 503 and r.json()["status"] == "not ready", r.body
            assert r.headers.get("retry-after") == "5"
    # /health answers as /health/ready; /health/live is 200 throughout.
    health = [r for path, r in trace if path == "/health"]
    assert [r.status for r in health if r.json()["phase"] != "ready"] == \
        [503] * sum(r.json()["phase"] != "ready" for r in health)
    assert any(r.status == 503 and r.json()["phase"] in ("loading", "warming_up") for r in health)
    live = [r for path, r in trace if path == "/health/live"]
    assert [r.status for r in live] == [200] * len(live)
    # Submissions before ready: 503 with Retry-After, and no job was created by them.
    posts = [r for path, r in trace if path == "POST /v1/videos"]
    assert any(r.status == 503 for r in posts), "no POST was made before ready"
    for r in posts:
        if r.status == 503:
            assert r.headers.get("retry-after") == "5" and r.json()["phase"] in ("starting", "loading", "warming_up")
    accepted = sum(r.status == 200 for r in posts)  # only if ready flipped between the check and the POST
    assert accepted <= 1
    assert len(server.get("/v1/videos").json()["data"]) >= accepted


# ---- 2. a failing warmup ----------------------------------------------------------------------
def test_failing_warmup_exits_and_never_ready(tiny_ckpt: Path, cache: Path, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "unload.json", tiny_config_dict(tiny_ckpt, unload_modules=True))
    server = Server(cfg, tmp_path / "out", cache, "--warmup", module="runnerkit.serve.server")
    try:
        assert server.wait_port(), server.log()
        statuses, end = [], time.monotonic() + 45
        while server.proc.poll() is None and time.monotonic() < end:
            try:
                statuses.append(http("GET", server.url + "/health/ready", timeout=5).status)
            except (urllib.error.URLError, ConnectionError):
                break  # the port closed
            time.sleep(0.01)
        try:
            rc: int | None = server.proc.wait(20)
        except subprocess.TimeoutExpired:
            rc = None
    finally:
        server.stop()
    log = server.log()
    assert rc is not None, f"still running a minute after its port opened:\n{log}"
    assert rc == 2, log  # NotImplementedError: an unsupported mode is bad input
    assert "warmup failed: NotImplementedError" in log and "unload_modules" in log, log
    assert 200 not in statuses, statuses
    assert "ready: accepting jobs" not in log


# ---- 3. FIFO order and parity with the launch script ------------------------------------------
def test_jobs_run_in_order_and_match_launch_script(shared: tuple[Server, Any], references: Any) -> None:
    server, _ = shared
    server.wait_ready()
    ids = [server.submit(req) for req in REQUESTS]
    jobs = [server.wait_job(i) for i in ids]
    assert [j["status"] for j in jobs] == ["completed"] * 3, jobs
    starts = [j["timestamps"]["started_at"] for j in jobs]
    ends = [j["timestamps"]["completed_at"] for j in jobs]
    # one computes at a time, in submission order, and they complete in that order; with the writer thread
    # (--max_writes_in_flight 1, the default) a job starts while the previous one's files are written
    assert starts[0] < starts[1] < starts[2] and ends[0] <= ends[1] <= ends[2], (starts, ends)
    assert all(s < e for s, e in zip(starts, ends)), (starts, ends)
    assert [j["timestamps"]["created_at"] for j in jobs] == sorted(j["timestamps"]["created_at"] for j in jobs)
    assert all(isinstance(j[k], int) for j in jobs for k in ("created_at", "started_at", "completed_at"))  # OpenAI's
    assert [j["seconds"] for j in jobs] == ["1.125", "0.625", "1.125"]  # frames / fps, the tiny config's 8 fps
    for n, j in enumerate(jobs):
        assert (j["steps_done"], j["steps_total"], j["progress"]) == (STEPS, STEPS, 100)
        assert j["request"] == REQUESTS[n]
        folder = server.out_dir / j["id"]
        assert files(folder) == ["result.json", "result.mp4", "result.safetensors"]
        got, ref = video(folder / "result.safetensors"), references(n)
        h, w, f = (REQUESTS[n].get("target_height", 48), REQUESTS[n].get("target_width", 80),
                   REQUESTS[n].get("target_video_length", 9))
        assert tuple(got.shape) == (3, f, h, w)
        assert torch.equal(got, ref), f"job {n}: max abs diff {(got - ref).abs().max().item()}"
        assert frames(folder / "result.mp4") == f


# ---- 4. cancellation --------------------------------------------------------------------------
def test_cancel_running_and_queued(shared: tuple[Server, Any], references: Any) -> None:
    server, _ = shared
    server.wait_ready()
    slow = server.submit(SLOW)
    after = server.submit(REQUESTS[1])
    queued = server.submit(REQUESTS[2])
    # the queued job: cancelled at once, never runs
    r = http("DELETE", f"{server.url}/v1/videos/{queued}")
    assert r.status == 200 and r.json()["status"] == "cancelled" and r.json()["started_at"] is None, r.body
    # the running one: cancelled at the next step boundary
    seen = server.wait_job(slow, until=lambda j: j["stage"] == "transformer" and j["step"] >= 2, poll=0.005)
    r = http("DELETE", f"{server.url}/v1/videos/{slow}")
    assert r.status == 200, r.body
    at_delete = r.json()
    assert at_delete["status"] == "in_progress" and at_delete["cancel_requested"] is True, at_delete
    assert at_delete["step"] >= seen["step"] >= 2
    end = server.wait_job(slow)
    assert end["status"] == "cancelled", end
    assert end["stage"] == "transformer" and end["steps"] == STEPS
    assert 2 <= end["step"] <= at_delete["step"] + 1 < STEPS, (seen["step"], at_delete["step"], end["step"])
    assert end["cancel_requested"] is False and end["error"] is None
    assert files(server.out_dir / slow) == []
    log = server.log()
    assert f"job {slow} cancelled at stage transformer (step {end['step']}/{STEPS})" in log
    # the next job starts from the start-up baseline: bit-identical to its isolated launch-script run
    nxt = server.wait_job(after)
    assert nxt["status"] == "completed" and nxt["timestamps"]["started_at"] >= end["timestamps"]["completed_at"], nxt
    got = video(server.out_dir / after / "result.safetensors")
    assert torch.equal(got, references(1)), f"max abs diff {(got - references(1)).abs().max().item()}"
    q = server.job(queued)
    assert (q["status"], q["started_at"], q["step"], q["steps_total"]) == ("cancelled", None, 0, 0), q
    assert not (server.out_dir / queued).exists()
    r = server.get(f"/v1/videos/{queued}/content")
    assert (r.status, r.json()["error"]["message"]) == (409, f"job {queued} has status 'cancelled': it has no "
                                                              "content"), r.body


# ---- 6. validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("raw,body,field,words", [
    (b'{"prompt": "a", ', None, None, "malformed JSON"),
    (None, {"prompt": "a", "colour": "red"}, "colour", "colour"),
    (None, {"prompt": "a", "target_height": 50}, "target_height", "multiple of 16"),
    (None, {"seed": 1}, "prompt", "prompt"),
    (None, {"prompt": "a", "save_result_path": "/tmp/x.mp4"}, "save_result_path", "set by the server"),
    (None, ["prompt", "a"], None, "JSON object"),
], ids=["malformed", "unknown_field", "bad_shape", "no_prompt", "save_result_path", "not_object"])
def test_invalid_requests_are_422(shared: tuple[Server, Any], raw: bytes | None, body: Any, field: str | None,
                                  words: str) -> None:
    server, _ = shared
    server.wait_ready()
    before = [j["id"] for j in server.get("/v1/videos").json()["data"]]  # ids: another test's job may still run
    folders = files(server.out_dir)
    r = server.post(body, raw)
    assert r.status == 422, r.body
    err = r.json()["error"]
    assert err["param"] == err["field"] == field and err["code"] == 422, err
    assert err["type"] == "invalid_request_error", err
    assert words in err["message"], err
    assert [j["id"] for j in server.get("/v1/videos").json()["data"]] == before  # no job added
    assert files(server.out_dir) == folders  # no job folder left behind


def test_an_oversized_image_is_413_as_json_and_as_a_form_part(shared: tuple[Server, Any]) -> None:
    """One byte over the 32 MiB image limit: 413 naming the field, as base64 in JSON (its decoded size) or as a file
    part (refused while it arrives, at the chunk that passes the limit) (`V4`)."""
    from runnerkit.serve.app import MAX_IMAGE_BYTES

    server, _ = shared
    server.wait_ready()
    folders = files(server.out_dir)
    big = b"\x89PNG" + bytes(MAX_IMAGE_BYTES - 3)
    as_json = server.post({"prompt": "a", "image": __import__("base64").b64encode(big).decode()})
    raw, content_type = form({"prompt": "a", "seed": "3"}, {"input_reference": big})
    as_form = http("POST", server.url + "/v1/videos", raw=raw, content_type=content_type)
    for r, name, holds in ((as_json, "image", f"{MAX_IMAGE_BYTES + 1}"), (as_form, "input_reference",
                                                                        f"more than {MAX_IMAGE_BYTES}")):
        assert r.status == 413, (r.status, r.body[:300])
        err = r.json()["error"]
        assert err["param"] == name and f"`{name}` holds {holds} bytes" in err["message"], err
    assert files(server.out_dir) == folders


def test_a_form_body_is_a_job_as_json_is(shared: tuple[Server, Any]) -> None:
    """multipart/form-data (what the openai client sends): text parts converted like JSON values."""
    server, _ = shared
    server.wait_ready()
    raw, content_type = form({"prompt": "a red fox in the snow", "seed": "1"}, {})
    r = http("POST", server.url + "/v1/videos", raw=raw, content_type=content_type)
    assert r.status == 200, r.body
    job = server.wait_job(r.json()["id"])
    assert job["status"] == "completed" and job["request"] == {"prompt": "a red fox in the snow", "seed": 1}
    raw, content_type = form({"prompt": "a", "seed": "one"}, {})
    r = http("POST", server.url + "/v1/videos", raw=raw, content_type=content_type)
    assert r.status == 422 and r.json()["error"]["param"] == "seed", r.body


# ---- 8. metrics -------------------------------------------------------------------------------
def test_metrics_count_jobs_and_steps(shared: tuple[Server, Any]) -> None:
    server, _ = shared
    server.wait_ready()
    assert server.wait_job(server.submit(REQUESTS[1]))["status"] == "completed"
    jobs = server.get("/v1/videos").json()["data"]
    assert all(j["status"] in FINAL for j in jobs), jobs
    r = server.get("/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    values = {}
    for line in r.body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    completed = [j for j in jobs if j["status"] == "completed"]
    cancelled = [j for j in jobs if j["status"] == "cancelled"]
    ran = [j for j in jobs if j["started_at"] is not None]
    assert values["runnerkit_ready"] == 1
    assert values["runnerkit_queue_depth"] == 0
    assert values['runnerkit_jobs_total{status="completed"}'] == len(completed) >= 1
    assert values.get('runnerkit_jobs_total{status="cancelled"}', 0) == len(cancelled)
    # every step that ran: all of a completed job's, a cancelled running job's up to `step`
    steps = STEPS * len(completed) + sum(j["step"] for j in cancelled if j["started_at"] is not None)
    assert values["runnerkit_step_seconds_count"] == steps
    assert values["runnerkit_first_step_seconds_count"] == len(completed) + sum(j["step"] > 0 for j in cancelled)
    assert values["runnerkit_job_seconds_count"] == len(ran)
    assert values["runnerkit_warmup_seconds"] > 0 and values["runnerkit_load_seconds"] > 0


# ---- 10. the page -----------------------------------------------------------------------------
def test_page(shared: tuple[Server, Any]) -> None:
    server, _ = shared
    r = server.get("/")
    assert r.status == 200 and r.headers["content-type"].startswith("text/html"), r.headers
    page = r.body.decode()
    for part in ('<form id="form">', '<textarea id="prompt"', '<button id="submit" type="submit"', "/v1/videos"):
        assert part in page, part


def test_info(shared: tuple[Server, Any]) -> None:
    server, _ = shared
    info = server.get("/v1/info").json()
    assert (info["model_cls"], info["task"], info["kind"], info["max_queue"]) == ("wan2.1", "t2v", "video", 16)
    assert info["defaults"] == {"target_height": 48, "target_width": 80, "target_video_length": 9,
                                "infer_steps": STEPS, "seed": 42}
    assert info["attention"] == {"backend": "sdpa", "reason": "auto: first available", "head_dim": 32,
                                 "text_buckets": [], "text_buckets_reason": "the family's text has one fixed length"}


# ---- 5 and 7. a bounded queue, content, retention ---------------------------------------------
def test_queue_full_content_and_retention(config: Path, cache: Path, tmp_path: Path) -> None:
    server = Server(config, tmp_path / "out", cache, "--max_queue", "1", "--keep_jobs", "1")
    try:
        assert server.wait_port(), server.log()
        server.wait_ready()
        slow = server.submit(SLOW)
        server.wait_job(slow, until=lambda j: j["status"] == "in_progress")
        assert server.get(f"/v1/videos/{slow}/content").status == 409
        waiting = server.submit(REQUESTS[0])
        r = server.get(f"/v1/videos/{waiting}/content")
        assert r.status == 409 and "queued" in r.json()["error"]["message"], r.body
        # the queue holds one waiting job: the next submission is refused, nothing is created
        r = server.post(REQUESTS[1])
        assert r.status == 429 and r.headers.get("retry-after") == "5", (r.status, r.body)
        assert "--max_queue 1" in r.json()["error"]["message"]
        assert [j["id"] for j in server.get("/v1/videos?order=asc").json()["data"]] == [slow, waiting]
        assert sorted(files(server.out_dir)) == sorted([slow, waiting])
        assert server.job(slow)["status"] == "in_progress" and server.job(waiting)["status"] == "queued"
        assert http("DELETE", f"{server.url}/v1/videos/{slow}").status == 200
        first = server.wait_job(waiting)
        assert first["status"] == "completed" and first["content_available"] is True
        r = server.get(f"/v1/videos/{waiting}/content")
        mp4 = server.out_dir / waiting / "result.mp4"
        assert r.status == 200 and r.headers["content-type"] == "video/mp4"
        assert r.body == mp4.read_bytes() and frames(mp4) == 9
        # a second job completes: --keep_jobs 1 removes the first one's files
        second = server.wait_job(server.submit(REQUESTS[1]))
        assert second["status"] == "completed"
        r = server.get(f"/v1/videos/{waiting}/content")
        assert r.status == 410, (r.status, r.body)
        assert not (server.out_dir / waiting).exists()
        assert server.job(waiting)["content_available"] is False
        r = server.get(f"/v1/videos/{second['id']}/content")
        assert r.status == 200 and r.body == (server.out_dir / second["id"] / "result.mp4").read_bytes()
        assert files(server.out_dir) == [second["id"]]
    finally:
        assert server.stop() == 0, server.log()


# ---- 9. SIGTERM -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["finish", "cancel"])
def test_sigterm_with_a_running_job(mode: str, config: Path, cache: Path, tmp_path: Path) -> None:
    """With `finish`, a client polling every 5 ms sees the job's final status, and status is answered for
    --drain_grace seconds after it (once in four drains such a client missed it: the port closed first)."""
    grace = 2.0 if mode == "finish" else 0.0
    server = Server(config, tmp_path / "out", cache, "--on_shutdown", mode, "--drain_grace", str(grace))
    answers: list[tuple[float, str]] = []  # (time.time(), status) of each status reply after SIGTERM

    def poll(job_id: str) -> None:
        while server.proc.poll() is None:
            try:
                answers.append((time.time(), http("GET", f"{server.url}/v1/videos/{job_id}", timeout=5).json()["status"]))
            except (urllib.error.URLError, ConnectionError, OSError):
                return  # the port closed
            time.sleep(0.005)

    try:
        assert server.wait_port(), server.log()
        server.wait_ready()
        req = REQUESTS[0] if mode == "finish" else SLOW  # SLOW's decode alone takes seconds
        job = server.submit(req)
        queued = server.submit(REQUESTS[1])
        seen = server.wait_job(job, until=lambda j: j["stage"] == "transformer" and j["step"] >= 2, poll=0.005)
        poller = threading.Thread(target=poll, args=(job,), daemon=True)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        poller.start()
        rc = server.proc.wait(120)
        elapsed = time.monotonic() - t0
        poller.join(10)
    finally:
        server.stop()
    log = server.log()
    assert rc == 0, log
    verb = "finishing" if mode == "finish" else "cancelling"
    assert f"shutting down: {verb} the running job {job}" in log, log
    assert "stopped" in log
    assert not (server.out_dir / queued).exists() or files(server.out_dir / queued) == []
    lines = re.findall(rf"transformer step (\d+)/{STEPS}", log.split("ready: accepting jobs")[1])
    if mode == "finish":
        final = [t for t, st in answers if st in FINAL]
        assert final, f"the poller never saw a final status: {answers[-3:]}"
        assert answers[-1][1] == "completed"
        # status still answered well into the grace (half of it: slack for slow replies on a loaded machine)
        assert answers[-1][0] - final[0] >= grace / 2, (final[0], answers[-1][0])
        assert f"answering status for {grace:g} s more" in log
        assert files(server.out_dir / job) == ["result.json", "result.mp4"]
        assert frames(server.out_dir / job / "result.mp4") == 9
        assert lines == [str(k) for k in range(1, STEPS + 1)]  # only this job ran, every step of it
    else:
        assert files(server.out_dir / job) == []
        assert f"job {job} cancelled at stage transformer" in log
        last = int(lines[-1])
        assert seen["step"] <= last < STEPS and lines == [str(k) for k in range(1, last + 1)], lines
        assert "vae_decoder" not in log.split("ready: accepting jobs")[1]
        assert elapsed < 20, elapsed
