"""`runnerkit serve` over the Qwen-Image edit config: references sent as base64 (`image`,
`extra_images`), the job's PNG bit-identical to the launch script's, field errors by body name."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from PIL import Image

from test_cases.conftest import REPO, write_config
from test_cases.models.qwen_image.conftest import EDIT_CONFIG, qwen_config_dict, reference_images
from test_cases.serve.test_server import Server, env, http


def wait_image_job(server: Server, job_id: str, timeout: float = 120) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        job = http("GET", f"{server.url}/v1/images/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"image job {job_id} did not end in {timeout} s:\n{server.log()[-3000:]}")


def test_edit_server_takes_extra_images_and_matches_the_launch_script(qwen_edit_ckpt: Path, tmp_path: Path) -> None:
    a, b = reference_images(tmp_path)
    config = write_config(tmp_path / "c.json", qwen_config_dict(EDIT_CONFIG, qwen_edit_ckpt))
    cache = tmp_path / "cache"
    expected = tmp_path / "cli.png"
    cli = subprocess.run([sys.executable, "-m", "runnerkit.infer", "--config_json", str(config), "--prompt",
                          "make it blue", "--seed", "5", "--image_path", str(a), "--extra_image_paths", str(b),
                          "--save_result_path", str(expected)], cwd=REPO, env=env(cache), capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    server = Server(config, tmp_path / "out", cache, "--warmup")
    try:
        assert server.wait_port(), server.log()
        server.wait_ready()
        encoded = [base64.b64encode(p.read_bytes()).decode() for p in (a, b)]
        url = server.url + "/v1/images/generations"
        bad = http("POST", url, {"prompt": "x", "image": encoded[0], "extra_images": ["###"]})
        assert bad.status == 422 and bad.json()["error"]["field"] == "extra_images[0]", bad.body
        not_image = http("POST", url, {"prompt": "x", "image": encoded[0],
                                       "extra_images": [base64.b64encode(b"not an image").decode()]})
        assert not_image.status == 422 and not_image.json()["error"]["field"] == "extra_images[0]", not_image.body
        assert "`extra_images[0]` (uploaded) is not an image" in not_image.json()["error"]["message"], not_image.body
        too_many = http("POST", url, {"prompt": "x", "image": encoded[0], "extra_images": [encoded[1]] * 3})
        assert too_many.status == 422 and too_many.json()["error"]["field"] == "extra_images", too_many.body
        paths = http("POST", url, {"prompt": "x", "extra_image_paths": [str(b)]})
        assert paths.status == 422 and "`extra_images`" in paths.json()["error"]["message"], paths.body
        reply = http("POST", url, {"prompt": "make it blue", "seed": 5, "image": encoded[0],
                                   "extra_images": [encoded[1]]})
        assert reply.status == 200, reply.body
        job = wait_image_job(server, reply.json()["id"])
        assert job["status"] == "completed", job
        content = http("GET", f"{server.url}/v1/images/{job['id']}/content")
        assert content.status == 200 and content.headers["content-type"] == "image/png"
        got = tmp_path / "served.png"
        got.write_bytes(content.body)
        with Image.open(got) as g, Image.open(expected) as e:
            assert g.size == e.size == (96, 64) and g.tobytes() == e.tobytes()
    finally:
        server.stop()
