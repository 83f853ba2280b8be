"""`runnerkit serve` over the Qwen-Image edit config: references sent as base64 (`image`,
`extra_images`), the job's PNG bit-identical to the launch script's, field errors by body name; the
official `openai` client's images.edit (file parts) and images.generate (JSON) calls, answered at once."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from runnerkit.infer import main
from test_cases.conftest import write_config
from test_cases.models.qwen_image.conftest import EDIT_CONFIG, qwen_config_dict, reference_images
from test_cases.serve.test_server import Server, http


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
    # the launch script's `main` here, on one thread as the server (OMP_NUM_THREADS=1): the server is the
    # process under test, the reference needs no interpreter of its own
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["--config_json", str(config), "--prompt", "make it blue", "--seed", "5", "--image_path", str(a),
                   "--extra_image_paths", str(b), "--save_result_path", str(expected)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    server = Server(config, tmp_path / "out", cache, "--warmup")
    try:
        assert server.wait_port(), server.log()
        server.wait_ready()
        encoded = [base64.b64encode(p.read_bytes()).decode() for p in (a, b)]
        url = server.url + "/v1/images"  # the job endpoint (OpenAI's /v1/images/generations waits)
        bad = http("POST", url, {"prompt": "x", "image": encoded[0], "extra_images": ["###"]})
        assert bad.status == 422 and bad.json()["error"]["param"] == "extra_images[0]", bad.body
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
        # uploads are stored under their real extension (from the content), not .bin
        assert sorted(p.name for p in (server.out_dir / job["id"]).iterdir()) == [
            "extra_images0.png", "image.png", "result.json", "result.png"]
        r = http("GET", f"{server.url}/v1/videos/{job['id']}")
        assert r.status == 404 and f"see /v1/images/{job['id']}" in r.json()["error"]["message"], r.body
        check_openai_images(server, a, b, expected)
    finally:
        server.stop()


def check_openai_images(server: Server, a: Path, b: Path, expected: Path) -> None:
    """images.edit (a multipart form: `image[]` file parts, the first the image, the others references)
    and images.generate (JSON; an image through extra_body) answer `{created, data}` once the jobs end."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with a.open("rb") as fa, b.open("rb") as fb:
        edited = client.images.edit(image=[fa, fb], prompt="make it blue", n=2, quality="high",
                                    response_format="b64_json", extra_body={"seed": 5})
    assert isinstance(edited, openai.types.ImagesResponse) and isinstance(edited.created, int)
    assert edited.size == "96x64" and edited.output_format == "png" and len(edited.data) == 2
    first, second = (base64.b64decode(d.b64_json) for d in edited.data)
    assert first == expected.read_bytes() or _pixels(first) == _pixels(expected.read_bytes())  # seed 5, as the CLI
    assert _pixels(second) != _pixels(first)  # the second image is seed 6
    jobs = [j for j in http("GET", f"{server.url}/v1/images?limit=2").json()["data"]][::-1]
    assert [j["resolved"]["seed"] for j in jobs] == [5, 6] and all(j["request"]["extra_images"] for j in jobs)
    generated = client.images.generate(prompt="make it blue", size="96x64", response_format="url",
                                       extra_body={"seed": 5, "image": base64.b64encode(a.read_bytes()).decode(),
                                                   "extra_images": [base64.b64encode(b.read_bytes()).decode()]})
    (item,) = generated.data
    assert item.b64_json is None and item.url.startswith(server.url + "/v1/images/job_"), item
    png = http("GET", item.url)
    assert png.status == 200 and _pixels(png.body) == _pixels(expected.read_bytes())
    for call, param in ((dict(n=11), "n"), (dict(response_format="svg"), "response_format"),
                        (dict(quality="ultra"), "quality"), (dict(output_format="webp"), "output_format"),
                        (dict(style="vivid"), "style")):
        with pytest.raises(openai.APIStatusError) as exc:
            client.images.generate(prompt="x", **call)
        assert exc.value.status_code == 422 and exc.value.param == param, exc.value.body


def _pixels(png: bytes) -> bytes:
    import io

    with Image.open(io.BytesIO(png)) as im:
        return im.tobytes()
