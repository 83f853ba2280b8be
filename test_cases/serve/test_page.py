"""The page of `runnerkit serve` (`GET /`) driven in headless Chromium against the real server.

Each test starts `python -m runnerkit.infer serve` on a tiny config (CPU, synthetic weights) and
uses the page as a person would: wait for the Generate button (enabled once the server reports
ready), type a prompt, submit, watch the status line, then check the `<video id="output">` it
shows and fetch that URL outside the browser. Cancel goes through the page's Cancel button; the
image task sets the first frame through the page's file input; the Qwen-Image Edit-Plus task adds
a further reference through the page's "Add reference image" button.

Chromium is Debian's `/usr/bin/chromium` driven by Playwright (no browser download). Without
it or without Playwright the tests skip, unless `RUNNERKIT_REQUIRE_BROWSER=1` (set by `.ci/run`
when Chromium is installed), which turns a missing browser into a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
FIRST_FRAME = REPO / "assets" / "examples" / "first_frame.png"
#: Denoising steps of the gated t2v config. A CPU runs all of them in well under a second (the
#: page polls every 0.5 s), so the t2v server holds every request at step GATE_STEP until the test
#: creates its release file (STEP_GATE below): the status line shows a step count and a Cancel
#: click lands mid-loop whatever the machine's speed.
SLOW_STEPS = 120
GATE_STEP = 2
#: A `sitecustomize` on the t2v server's PYTHONPATH: once `runnerkit.runners.default` is imported,
#: its `report_progress` (called after every denoising step) waits at step GATE_STEP of a request's
#: transformer stage until the file RUNNERKIT_TEST_STEP_GATE exists, then removes it (one release per
#: request; after 60 s it goes on by itself, so a broken test cannot hang the server). It waits after
#: the job's observer ran, so a cancel requested meanwhile stops the job at the next step.
STEP_GATE = '''import importlib.util, os, sys, time

GATE_STEP = %d


def _gate(cls):
    original = cls.report_progress

    def report_progress(self, info, stage, step=0, steps=0):
        original(self, info, stage, step, steps)
        if info.warmup or stage != "transformer" or step != GATE_STEP:
            return
        release, deadline = os.environ["RUNNERKIT_TEST_STEP_GATE"], time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.path.exists(release):
            os.unlink(release)

    cls.report_progress = report_progress


class _Patch:
    def find_spec(self, name, path=None, target=None):
        if name != "runnerkit.runners.default":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        real = spec.loader

        class Patched:
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                _gate(module.DefaultRunner)

        spec.loader = Patched()
        return spec


sys.meta_path.insert(0, _Patch())
''' % GATE_STEP
START_TIMEOUT_S = 90.0
JOB_TIMEOUT_MS = 30_000


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    release: Path | None = None  # the step gate's release file (the t2v server only)

    def release_step(self) -> None:
        """Let the request held at step GATE_STEP go on."""
        assert self.release is not None, "this server has no step gate"
        self.release.touch()


def _start_server(config: Path, out: Path, cache: Path, gated: bool = False) -> Server:
    """`runnerkit serve --port 0 --warmup` on `config` (held at step GATE_STEP of every request when
    `gated`); returns once it logged its address."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUNNERKIT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    release = None
    if gated:
        (out / "gate").mkdir(exist_ok=True)
        (out / "gate" / "sitecustomize.py").write_text(STEP_GATE)
        release = out / "step_may_go_on"
        env.update(PYTHONPATH=f"{out / 'gate'}:{REPO}", RUNNERKIT_TEST_STEP_GATE=str(release))
    with log.open("wb") as sink:  # a file, not a pipe: nobody drains a pipe while the test runs
        proc = subprocess.Popen([sys.executable, "-m", "runnerkit.infer", "serve", "--config_json", str(config),
                                 "--port", "0", "--warmup", "--on_shutdown", "cancel", "--drain_grace", "0",
                                 "--output_dir", str(out / "jobs")],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
        if m:
            return Server(proc, m.group(1), log, release)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    pytest.fail(f"the server did not report its address (exit {proc.returncode}):\n{log.read_text()[-3000:]}")


def _stop_server(server: Server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        pytest.fail(f"the server did not stop within 30 s of SIGTERM:\n{server.log.read_text()[-3000:]}")
    assert code == 0, f"the server exited {code}:\n{server.log.read_text()[-3000:]}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium through Playwright (skips or fails as the module docstring says)."""
    missing = []
    if not CHROMIUM.is_file():
        missing.append(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("playwright is not installed (pip install playwright)")
    if missing:
        why = "; ".join(missing)
        if os.environ.get("RUNNERKIT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"RUNNERKIT_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rk_cache")


@pytest.fixture(scope="module")
def t2v_server(tmp_path_factory: pytest.TempPathFactory, cache: Path, browser: Any) -> Iterator[Server]:
    """The tiny t2v config with SLOW_STEPS denoising steps, held at step GATE_STEP of every request."""
    out = tmp_path_factory.mktemp("serve_t2v")
    data = json.loads((REPO / "configs" / "wan" / "wan_t2v_tiny.json").read_text())
    data.update(infer_steps=SLOW_STEPS, device="cpu")
    config = out / "t2v_slow.json"
    config.write_text(json.dumps(data))
    server = _start_server(config, out, cache, gated=True)
    yield server
    _stop_server(server)


@pytest.fixture(scope="module")
def i2v_server(tmp_path_factory: pytest.TempPathFactory, cache: Path, browser: Any) -> Iterator[Server]:
    out = tmp_path_factory.mktemp("serve_i2v")
    data = json.loads((REPO / "configs" / "wan" / "wan_i2v_tiny.json").read_text())
    data.update(device="cpu")
    config = out / "i2v.json"
    config.write_text(json.dumps(data))
    server = _start_server(config, out, cache)
    yield server
    _stop_server(server)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page; JavaScript errors on it fail the test."""
    context = browser.new_context()
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(JOB_TIMEOUT_MS)
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _open_ready(page: Any, server: Server) -> None:
    """Open the page and wait for the Generate button (disabled until the server is ready)."""
    page.goto(server.url + "/")
    page.wait_for_selector("#submit:enabled", timeout=START_TIMEOUT_S * 1000)
    assert _get_json(server.url + "/health/ready")["status"] == "ready"


def _job_id(page: Any) -> str:
    m = re.match(r"(job_[0-9a-f]+):", page.text_content("#status") or "")
    assert m, f"the status line names no job: {page.text_content('#status')!r}"
    return m.group(1)


def _check_video_result(page: Any, server: Server) -> str:
    """Wait for `<video id="output">`, check its src serves an mp4; returns the job id."""
    page.wait_for_selector("video#output, #error:not(:empty)", state="attached")  # a refusal fails at once
    assert page.text_content("#error") == "", f"the page shows an error: {page.text_content('#error')!r}"
    job_id = _job_id(page)
    src = page.get_attribute("video#output", "src")
    assert src == f"/v1/videos/{job_id}/content", src
    with urllib.request.urlopen(server.url + src, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "video/mp4"
        body = r.read()
    assert len(body) > 1000 and body[4:8] == b"ftyp", f"not an mp4: {len(body)} bytes, head {body[:12]!r}"
    job = _get_json(f"{server.url}/v1/videos/{job_id}")
    assert job["status"] == "completed" and job["content_available"], job
    return job_id


def test_page_generates_a_video_with_progress(page: Any, t2v_server: Server) -> None:
    _open_ready(page, t2v_server)
    assert "wan2.1 · t2v · ready" in page.text_content("#model")
    assert page.query_selector("#images input[type=file]") is None  # t2v takes no image
    page.fill("#prompt", "a corgi surfing a wave at sunset")
    page.fill("#seed", "7")
    page.click("#submit")
    # the status line shows the running step count (the job is held there), then the result replaces it
    page.wait_for_function(
        f"/in_progress · transformer — step {GATE_STEP}\\/{SLOW_STEPS}/.test(document.getElementById('status').textContent)")
    assert page.is_disabled("#submit") and page.is_visible("#cancel")
    t2v_server.release_step()
    job_id = _check_video_result(page, t2v_server)
    assert page.text_content("#status").startswith(f"{job_id}: completed")
    assert page.is_enabled("#submit") and not page.is_visible("#cancel")
    assert _get_json(f"{t2v_server.url}/v1/videos/{job_id}")["request"] == {
        "prompt": "a corgi surfing a wave at sunset", "seed": 7}


def test_page_cancel_button_stops_the_running_job(page: Any, t2v_server: Server) -> None:
    _open_ready(page, t2v_server)
    page.fill("#prompt", "a slow job to cancel")
    page.click("#submit")
    page.wait_for_function(f"/step {GATE_STEP}\\//.test(document.getElementById('status').textContent)")
    page.click("#cancel")
    url = f"{t2v_server.url}/v1/videos/{_job_id(page)}"
    deadline = time.monotonic() + JOB_TIMEOUT_MS / 1000
    while not _get_json(url)["cancel_requested"]:  # the click's DELETE landed while the job is held
        assert time.monotonic() < deadline, _get_json(url)
        time.sleep(0.05)
    t2v_server.release_step()
    page.wait_for_function("/: cancelled/.test(document.getElementById('status').textContent)")
    job = _get_json(f"{t2v_server.url}/v1/videos/{_job_id(page)}")
    assert job["status"] == "cancelled", job
    assert job["steps_done"] == GATE_STEP + 1 < job["steps_total"], f"not cancelled at the step after the gate: {job}"
    assert page.query_selector("#output") is None
    assert page.is_enabled("#submit") and not page.is_visible("#cancel")


def test_page_image_task_sends_the_file(page: Any, i2v_server: Server) -> None:
    _open_ready(page, i2v_server)
    assert "wan2.1 · i2v · ready" in page.text_content("#model")
    file_input = page.wait_for_selector("#images input[type=file]#file-image", state="attached")
    assert file_input.get_attribute("accept") == "image/*"
    page.fill("#prompt", "the first frame comes alive")
    page.set_input_files("#file-image", str(FIRST_FRAME))
    page.click("#submit")
    job_id = _check_video_result(page, i2v_server)
    job = _get_json(f"{i2v_server.url}/v1/videos/{job_id}")
    assert job["request"]["image"] == f"{FIRST_FRAME.stat().st_size} bytes", job["request"]


@pytest.fixture(scope="module")
def edit_server(tmp_path_factory: pytest.TempPathFactory, cache: Path, browser: Any) -> Iterator[Server]:
    """The tiny Qwen-Image Edit-Plus config (several reference images)."""
    from test_cases.models.qwen_image.conftest import EDIT_CONFIG, _write, qwen_config_dict

    out = tmp_path_factory.mktemp("serve_edit")
    config = out / "edit.json"
    config.write_text(json.dumps(qwen_config_dict(EDIT_CONFIG, _write(EDIT_CONFIG, out / "ckpt"))))
    server = _start_server(config, out, cache)
    yield server
    _stop_server(server)


def test_page_edit_task_adds_reference_images(page: Any, edit_server: Server, tmp_path: Path) -> None:
    """Edit-Plus takes references after the image: the page's "Add reference image" button adds file
    inputs (up to /v1/info's `extra_images`), and their files travel as `extra_images`."""
    from test_cases.models.qwen_image.conftest import reference_images

    a, b = reference_images(tmp_path)
    _open_ready(page, edit_server)
    assert "qwen_image · i2i · ready" in page.text_content("#model")
    most = _get_json(edit_server.url + "/v1/info")["extra_images"]
    assert most >= 1
    page.set_input_files("#file-image", str(a))
    page.click("#add-reference")
    page.set_input_files("#file-extra-0", str(b))
    for _ in range(most - 1):
        page.click("#add-reference")
    assert page.is_disabled("#add-reference") and len(page.query_selector_all("input.extra-image")) == most
    page.fill("#prompt", "make it blue")
    page.click("#submit")
    page.wait_for_selector("img#output, #error:not(:empty)", state="attached")
    assert page.text_content("#error") == "", page.text_content("#error")
    job_id = _job_id(page)
    assert page.get_attribute("img#output", "src") == f"/v1/images/{job_id}/content"
    job = _get_json(f"{edit_server.url}/v1/images/{job_id}")
    assert job["status"] == "completed", job
    # the empty extra inputs are not sent; the filled one is, after the image
    assert job["request"] == {"prompt": "make it blue", "image": f"{a.stat().st_size} bytes",
                              "extra_images": [f"{b.stat().st_size} bytes"]}, job["request"]
