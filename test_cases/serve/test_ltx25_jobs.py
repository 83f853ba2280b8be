"""A server job of LTX-2.5 with the frame count omitted, in-process (the job worker on the tiny runner, no HTTP):
admitted at the bounds' largest count, it reports the count the duration head predicted once it ran, and its
`seconds` is that clip's length as the mp4 and the sidecar give it (frames / fps)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runnerkit import memory
from runnerkit.config import load_runner_config
from runnerkit.media import sidecar_path
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.serve.app import ServerState, build_request
from runnerkit.serve.jobs import Job, JobQueue, Worker
from test_cases.conftest import REPO

CONFIG = REPO / "configs" / "ltx2" / "ltx25_t2av_tiny.json"
PREDICTED = 25  # the tiny head's count for this prompt and seed (test_ltx25_runner.py)


@pytest.fixture
def _one_thread() -> Iterator[None]:
    """Tiny matmuls: a second thread only adds sync cost (as test_cases/models/ltx2/conftest.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("_one_thread")
def test_an_omitted_frame_count_is_reported_as_the_predicted_one_once_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("av")
    monkeypatch.setattr(memory, "freeze_gc_once", lambda: False)
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    runner = LTX25Runner(load_runner_config(CONFIG, {"device": "cpu"}))
    runner.init_modules()
    queue = JobQueue(tmp_path / "jobs", 4, None, None)
    state = ServerState(runner=runner, queue=queue, metrics=None, phase="ready")
    job_id, folder = queue.new_folder()
    request, shown, resolved = build_request(state, {"prompt": "a red fox runs through fresh snow, wind howls",
                                                     "seed": 3}, folder)
    assert (resolved["frames"], resolved["seconds"]) == (33, "1.375")  # admitted at the largest count: 33 / 24 s
    job = Job(id=job_id, kind="video", request=request, folder=folder, fields=shown, resolved=resolved)
    queue.submit(job)
    worker = Worker(runner, queue, on_done=lambda j: None, save_tensors=False)
    worker.run_job(queue.next())  # type: ignore[arg-type]
    sidecar = json.loads(sidecar_path(job.result_path).read_text())
    assert job.status == "completed", job.error
    assert sidecar["duration"]["predicted"] and sidecar["frames"] == PREDICTED
    assert job.as_dict()["resolved"] == {**resolved, "frames": PREDICTED, "seconds": "1.04167"}
    assert job.as_dict()["seconds"] == f"{sidecar['duration']['seconds']:g}" == f"{PREDICTED / 24:g}"
    assert job.profile is not None and job.profile["shape"] == [64, 128, PREDICTED]
