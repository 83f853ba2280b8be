"""The writer thread (`--max_writes_in_flight`, runnerkit/writer.py, runners/writes.py): request k's files
are written while request k+1 computes, bounded, in order; a request is done only once its files are;
a failed write fails its request alone; the writer owns CPU copies; an interrupt completes the files in
flight and a second one abandons them, leaving nothing.

The launch script runs in-process on the two-stage toy family (test_cases/runners/two_stage.py: no
checkpoint, a request in a fraction of a second). Orders are asserted on recorded events, never on
timings: the fake slow writer holds request k's write until request k+N's compute has started, so the
overlap shows as an order (with inline writes it would wait for a compute that never comes, give up
after WAIT_S and the order assertions fail).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file

from runnerkit import media
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.registry import get_runner_cls
from runnerkit.runners import writes
from runnerkit.runners.base import BaseRunner
from runnerkit.writer import ResultWriter, WriteAbandoned, WriteOutcome
from test_cases._cli import no_gc_freeze, restore_logger  # noqa: F401 (autouse fixtures)
from test_cases._cli import run_cli
from test_cases.runners.two_stage import TwoStageImageRunner, config_dict

N = 4  # requests of a batch
WAIT_S = 20.0  # how long the fake writer waits for a later request's compute before it gives up (a failure)


@pytest.fixture(scope="module")
def toy_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("toy")
    path = folder / "toy.json"
    path.write_text(json.dumps(config_dict(folder)))
    return path


def _requests(folder: Path, n: int = N) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"prompt": f"a fox {k}", "seed": k, "save_result_path": str(folder / f"o{k}.png"),
              "save_tensor_path": str(folder / f"o{k}.safetensors")} for k in range(n)]
    path = folder / "reqs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _index(path: Any) -> int:
    return int(Path(path).stem.removeprefix("o"))


class Recorder:
    """Events of a launch, in the order they happened, from every thread: `compute k` (its text encoder
    starts), `prepare k` (its outputs are taken for writing: a writer slot is held from here), `write k
    start` / `write k end` (the media writer), `done k` (`report_request_done`: its log line and
    observer). `hold`: the write of request k waits until request k + hold computes (0: never waits)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: int, n: int = N) -> None:
        self.events: list[str] = []
        self.threads: dict[str, str] = {}
        self.computing = [threading.Event() for _ in range(n + hold)]
        real_encode, real_prepare, real_write = (TwoStageImageRunner.run_text_encoder, writes.prepare_write,
                                                 writes.write_outputs)
        real_done = BaseRunner.report_request_done

        def encode(runner: Any, req: Any) -> Any:
            k = runner.profiler.current.index
            self.events.append(f"compute {k}")
            self.computing[k].set()
            return real_encode(runner, req)

        def prepare(runner: Any, req: Any, outputs: Any) -> Any:
            self.events.append(f"prepare {_index(req.info.save_tensor_path)}")
            return real_prepare(runner, req, outputs)

        def write(tensors: Any, specs: Any, **kwargs: Any) -> list[str]:
            k = _index(kwargs["tensor_path"])
            self.events.append(f"write {k} start")
            self.threads[f"write {k}"] = threading.current_thread().name
            if hold and k + hold < n and not self.computing[k + hold].wait(WAIT_S):
                self.events.append(f"write {k} gave up waiting")
            paths = real_write(tensors, specs, **kwargs)
            self.events.append(f"write {k} end")
            return paths

        def done(runner: Any, prof: Any, error: BaseException | None) -> None:
            self.events.append(f"done {prof.index}")
            real_done(runner, prof, error)

        monkeypatch.setattr(TwoStageImageRunner, "run_text_encoder", encode)
        monkeypatch.setattr(writes, "prepare_write", prepare)
        monkeypatch.setattr(writes, "write_outputs", write)
        monkeypatch.setattr(BaseRunner, "report_request_done", done)

    def before(self, a: str, b: str) -> bool:
        return self.events.index(a) < self.events.index(b)

    def only(self, prefix: str) -> list[str]:
        return [e for e in self.events if e.startswith(prefix)]


def _outputs(folder: Path, n: int = N) -> list[tuple[torch.Tensor, bytes, dict[str, Any]]]:
    return [(load_file(folder / f"o{k}.safetensors")["image"], (folder / f"o{k}.png").read_bytes(),
             json.loads((folder / f"o{k}.json").read_text())) for k in range(n)]


def _assert_same_outputs(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for (ta, pa, sa), (tb, pb, sb) in zip(a, b):
        assert torch.equal(ta, tb) and pa == pb and sa == sb


@pytest.fixture(scope="module")
def inline_outputs(toy_config: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The batch written inside each request (`--max_writes_in_flight 0`): the reference outputs."""
    from runnerkit.infer import main

    folder = tmp_path_factory.mktemp("inline")
    try:
        assert main(["--config_json", str(toy_config), "--requests", str(_requests(folder)), "--max_writes_in_flight",
                     "0", "--log_level", "WARNING"]) == 0
    finally:
        logger.remove()  # `main` bound loguru to this moment's stderr
        logger.add(lambda message: sys.stderr.write(message), level="DEBUG")
    return _outputs(folder)


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_files_are_written_while_later_requests_compute_in_order_and_bounded(
        toy_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        inline_outputs: list[Any], max_in_flight: int) -> None:
    rec = Recorder(monkeypatch, hold=max_in_flight)
    out = tmp_path / "overlap"
    rc, err = run_cli(capsys, "--config_json", toy_config, "--requests", _requests(out), "--max_writes_in_flight",
                      max_in_flight, "--profile_json", tmp_path / "p.json")
    assert rc == 0, err
    assert not [e for e in rec.events if "gave up" in e], rec.events
    for k in range(N - max_in_flight):  # request k+N computes while request k's files are written
        assert rec.before(f"compute {k + max_in_flight}", f"write {k} end"), rec.events
        # the bound: request k+N takes a writer slot only once request k's write ended
        assert rec.before(f"write {k} end", f"prepare {k + max_in_flight}"), rec.events
    # one writer thread, in request order; each request done once its files are, in order
    assert rec.only("write") == [f"write {k} {edge}" for k in range(N) for edge in ("start", "end")]
    assert set(rec.threads.values()) == {"runnerkit-writer"}
    assert rec.only("done") == [f"done {k}" for k in range(N)]
    assert all(rec.before(f"write {k} end", f"done {k}") for k in range(N)), rec.events
    _assert_same_outputs(_outputs(out), inline_outputs)
    assert not [p for p in out.iterdir() if "partial" in p.name]
    report = json.loads((tmp_path / "p.json").read_text())["requests"]
    assert [(r["ok"], r["saved"], r["write"]["overlapped"]) for r in report] == [(True, True, True)] * N
    assert all(r["write"]["seconds"] > 0 for r in report)


def test_zero_writes_inside_each_request_in_todays_order(toy_config: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, hold=0)
    rc, err = run_cli(capsys, "--config_json", toy_config, "--requests", _requests(tmp_path / "o"),
                      "--max_writes_in_flight", 0, "--profile_json", tmp_path / "p.json")
    assert rc == 0, err
    assert rec.events == [e for k in range(N) for e in (f"compute {k}", f"prepare {k}", f"write {k} start",
                                                        f"write {k} end", f"done {k}")]
    assert set(rec.threads.values()) == {"MainThread"}
    assert "runnerkit-writer" not in {t.name for t in threading.enumerate()}
    report = json.loads((tmp_path / "p.json").read_text())["requests"]
    assert [r["write"]["overlapped"] for r in report] == [False] * N


def test_a_failed_write_fails_its_request_alone(toy_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch, inline_outputs: list[Any]) -> None:
    """Request 1's tensor file meets a full disk on the writer thread: request 1 fails (exit 1, named with
    its line and file), nothing of it is left, requests 0, 2 and 3 are written exactly as inline."""
    import errno

    real = media.save_tensors

    def full_disk_for_o1(tensors: dict[str, torch.Tensor], path: Any) -> None:
        if Path(path).name.startswith(".o1."):
            Path(path).write_bytes(b"\0" * 100)  # a partial file, as a real full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(tensors, path)

    monkeypatch.setattr(media, "save_tensors", full_disk_for_o1)
    rec = Recorder(monkeypatch, hold=1)
    out = tmp_path / "o"
    reqs = _requests(out)
    rc, err = run_cli(capsys, "--config_json", toy_config, "--requests", reqs, "--profile_json", tmp_path / "p.json")
    assert rc == 1, err
    assert (f"request 1 (line 2 of {str(reqs)!r}) failed: MediaWriteError: could not write `save_tensor_path` "
            f"{str(out / 'o1.safetensors')!r}: No space left on device; nothing was saved for this request") in err, err
    assert "1 of 4 requests failed: [1]" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("o1") or "partial" in p.name) == []
    for k in (0, 2, 3):
        tensor = load_file(out / f"o{k}.safetensors")["image"]
        assert torch.equal(tensor, inline_outputs[k][0]) and (out / f"o{k}.png").read_bytes() == inline_outputs[k][1]
    assert rec.before("compute 2", "done 2") and rec.only("done") == ["done 0", "done 1", "done 2", "done 3"]
    report = json.loads((tmp_path / "p.json").read_text())["requests"]
    assert [(r["ok"], r["saved"]) for r in report] == [(True, True), (False, False), (True, True), (True, True)]
    assert report[1]["error"].startswith("MediaWriteError: could not write `save_tensor_path`")


def test_the_writer_owns_copies_of_the_outputs(toy_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, inline_outputs: list[Any]) -> None:
    """A decoder that returns one buffer it overwrites at every request (float32 on the CPU: `.float().cpu()`
    would hand the writer that very buffer): request k's files are written after request k+1 decoded into
    it, and still hold request k's image."""
    buffer: dict[str, torch.Tensor] = {}
    decoded = [threading.Event() for _ in range(N + 1)]
    real_decode = TwoStageImageRunner.run_decoder

    def decode_into_one_buffer(runner: Any, req: Any, latents: torch.Tensor) -> torch.Tensor:
        image = real_decode(runner, req, latents)
        out = buffer.setdefault("image", torch.empty_like(image))
        out.copy_(image)
        decoded[runner.profiler.current.index].set()
        return out

    real_write = writes.write_outputs

    def write_after_the_next_decode(tensors: Any, specs: Any, **kwargs: Any) -> list[str]:
        k = _index(kwargs["tensor_path"])
        if k + 1 < N:
            assert decoded[k + 1].wait(WAIT_S), f"request {k + 1} never decoded while request {k}'s files waited"
        return real_write(tensors, specs, **kwargs)

    monkeypatch.setattr(TwoStageImageRunner, "run_decoder", decode_into_one_buffer)
    monkeypatch.setattr(writes, "write_outputs", write_after_the_next_decode)
    rc, err = run_cli(capsys, "--config_json", toy_config, "--requests", _requests(tmp_path / "o"))
    assert rc == 0, err
    _assert_same_outputs(_outputs(tmp_path / "o"), inline_outputs)


# ---- interrupts -------------------------------------------------------------------------------------
@pytest.fixture
def interrupt() -> Iterator[Callable[[], None]]:
    """`interrupt()` on the writer thread: a KeyboardInterrupt in the main thread, as Ctrl-C gives (SIGUSR1
    with a handler of this test's, so nothing else of the process is signalled). The signal is delivered
    to the calling thread, as the kernel may deliver a Ctrl-C to any thread: the main thread, blocked
    waiting for the writer, must still see it at once (runnerkit/writer.py `SIGNAL_CHECK_S`)."""

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGUSR1, raise_interrupt)
    try:
        yield lambda: signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, before)


def _logged(needle: str) -> tuple[threading.Event, int]:
    seen = threading.Event()
    sink = logger.add(lambda m: seen.set() if needle in m.record["message"] else None, level="DEBUG")
    return seen, sink


@pytest.mark.parametrize("interrupts", [1, 2])
def test_an_interrupt_during_a_write_completes_it_and_a_second_abandons_it(
        tmp_path: Path, interrupt: Callable[[], None], interrupts: int) -> None:
    """The main thread waits for a write in flight (the launch script's last request) and is interrupted
    while the writer thread has written the tensor file (under its temporary name) and not yet the png:
    once, the write completes (every file final); twice, it stops at its next file boundary and nothing
    of it remains, temporary files included."""
    from runnerkit.runners.pipeline import OutputSpec

    completing, sink1 = _logged("interrupted: completing the files of request(s) [0]")
    abandoning, sink2 = _logged("abandoning the files of request(s) [0]")
    outcomes: list[WriteOutcome] = []
    real_save_tensors = media.save_tensors

    def tensors_then_interrupts(tensors: dict[str, torch.Tensor], path: Any) -> None:
        real_save_tensors(tensors, path)
        interrupt()
        assert completing.wait(WAIT_S), "the main thread never got the first interrupt"
        if interrupts == 2:
            interrupt()
            assert abandoning.wait(WAIT_S), "the main thread never got the second interrupt"

    image = torch.zeros(3, 16, 16)

    def write(checkpoint: Callable[[], None]) -> list[str]:
        return media.save_outputs({"image": image}, (OutputSpec("image", "image"),), str(tmp_path / "r.png"),
                                  str(tmp_path / "r.safetensors"), fps=1, sidecar={"seed": 0}, checkpoint=checkpoint)

    writer = ResultWriter(1)
    original = media.save_tensors
    media.save_tensors = tensors_then_interrupts
    try:
        writer.submit(0, lambda: write, outcomes.append)
        try:
            writer.drain()
            raise AssertionError("the interrupt never reached the main thread")
        except KeyboardInterrupt:
            writes.close_writer(writer, interrupted=True)
    finally:
        media.save_tensors = original
        logger.remove(sink1)
        logger.remove(sink2)
    [outcome] = outcomes
    if interrupts == 1:
        assert outcome.error is None and sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png",
                                                                                         "r.safetensors"]
        assert torch.equal(load_file(tmp_path / "r.safetensors")["image"], image)
    else:
        assert isinstance(outcome.error, WriteAbandoned) and list(tmp_path.iterdir()) == []
    assert writer.in_flight() == [] and "runnerkit-writer" not in {t.name for t in threading.enumerate()}


# ---- the writer itself --------------------------------------------------------------------------------
def test_the_writer_refuses_a_bad_bound_and_frees_the_slot_of_a_failed_prepare() -> None:
    with pytest.raises(ValueError, match=r"`max_writes_in_flight` for the writer thread must be an int >= 1 \(got 0"):
        ResultWriter(0)
    writer = ResultWriter(1)

    def broken() -> Any:
        raise MemoryError("no host memory for the copy")

    with pytest.raises(MemoryError):
        writer.submit(0, broken, lambda o: None)
    outcomes: list[WriteOutcome] = []
    later = threading.Thread(target=writer.submit, args=(1, lambda: (lambda checkpoint: ["x"]), outcomes.append),
                             daemon=True)  # (a daemon: one that waits for ever must not hold the test process)
    later.start()
    later.join(WAIT_S)
    assert not later.is_alive(), "the failed prepare kept its slot: the next submit waits for ever"
    writer.close()
    assert [(o.index, o.paths, o.error) for o in outcomes] == [(1, ["x"], None)]
    with pytest.raises(RuntimeError, match="the result writer is closed: request 2's files cannot be queued"):
        writer.submit(2, lambda: (lambda checkpoint: []), lambda o: None)


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_a_result_that_finds_every_slot_taken_waits_before_its_copies_are_taken(max_in_flight: int) -> None:
    """`max_in_flight` writes held in flight: the next submit waits, without calling its `prepare` (no
    copy of its outputs is taken), until the oldest write ends; then it takes that slot."""
    import time

    writer = ResultWriter(max_in_flight)
    late = max_in_flight
    release = [threading.Event() for _ in range(late + 1)]
    events: list[str] = []

    def task(k: int) -> Callable[[], Any]:
        def write(checkpoint: Callable[[], None]) -> list[str]:
            assert release[k].wait(WAIT_S)
            events.append(f"write {k} end")
            return []

        return lambda: (events.append(f"prepare {k}"), write)[1]

    for k in range(late):
        writer.submit(k, task(k), lambda o: None)
    waiter = threading.Thread(target=writer.submit, args=(late, task(late), lambda o: None), daemon=True)
    waiter.start()
    deadline = time.monotonic() + WAIT_S  # until it waits for a slot, or (wrongly) took one
    while not writer.waiting() and f"prepare {late}" not in events and time.monotonic() < deadline:
        threading.Event().wait(0.001)
    assert events == [f"prepare {k}" for k in range(late)] and writer.waiting() == 1
    release[0].set()
    waiter.join(WAIT_S)
    assert events == [*(f"prepare {k}" for k in range(late)), "write 0 end", f"prepare {late}"]
    for event in release:
        event.set()
    writer.close()
    assert events[-late:] == [f"write {k} end" for k in range(1, late + 1)]


def test_the_python_api_writes_inline_unless_asked(tmp_path: Path) -> None:
    """A runner built in Python writes each request's files before `run_pipeline` returns (no writer),
    and with `overlap_writes(1)` after it returns, once `finish_writes` waited for them."""
    config = load_runner_config(None, config_dict(tmp_path))
    runner = get_runner_cls(config.model_cls)(config)
    runner.init_modules()
    assert runner.writer is None
    runner.run_pipeline(RequestConfig(prompt="a", save_tensor_path=str(tmp_path / "a.safetensors")), 0)
    assert (tmp_path / "a.safetensors").exists()
    with pytest.raises(ValueError, match=r"`max_writes_in_flight` must be an int >= 0 \(got -1"):
        runner.overlap_writes(-1)
    done: list[tuple[int, Any]] = []
    runner.on_request_done = lambda prof, error: done.append((prof.index, error))
    runner.overlap_writes(1)
    prof = runner.run_pipeline(RequestConfig(prompt="a", save_tensor_path=str(tmp_path / "b.safetensors")), 1)
    runner.finish_writes()
    assert done == [(1, None)] and prof.saved and prof.write["overlapped"]
    assert torch.equal(load_file(tmp_path / "b.safetensors")["image"], load_file(tmp_path / "a.safetensors")["image"])
    runner.writer.close()


def test_a_request_is_reported_only_once_its_compute_bookkeeping_ended_too(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are written before `end_run` returns (held there until they are): the report still waits
    for `run_pipeline`'s own end, so the observer sees the request's steps, memory and audit."""
    config = load_runner_config(None, config_dict(tmp_path))
    runner = get_runner_cls(config.model_cls)(config)
    runner.init_modules()
    runner.overlap_writes(1)
    written = threading.Event()
    real_write, real_end_run = writes.write_outputs, TwoStageImageRunner.end_run
    monkeypatch.setattr(writes, "write_outputs", lambda *a, **k: (real_write(*a, **k), written.set())[0])

    def end_run_after_the_write(self: Any) -> None:
        assert written.wait(WAIT_S), "the files were never written"
        real_end_run(self)

    monkeypatch.setattr(TwoStageImageRunner, "end_run", end_run_after_the_write)
    seen: list[tuple[bool, bool, bool, int]] = []
    runner.on_request_done = lambda prof, error: seen.append((error is None, bool(prof.audit), bool(prof.memory),
                                                              len(prof.steps)))
    runner.run_pipeline(RequestConfig(prompt="a", save_tensor_path=str(tmp_path / "a.safetensors")), 0)
    runner.writer.close()
    assert seen == [(True, True, True, 4 + 3)]


def test_under_parallel_the_writer_holds_the_groups_output_lock_for_the_whole_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's writer thread writes holding `group.output_lock`, as the inline save does, so a failing
    group's cleanup (parallel/driver.py `end_rank`, which takes it) never sees half a file set."""
    from types import SimpleNamespace

    config = load_runner_config(None, config_dict(tmp_path))
    runner = get_runner_cls(config.model_cls)(config)
    runner.init_modules()
    lock = threading.Lock()
    runner.parallel = SimpleNamespace(rank=0, cfg=1, ulysses=1, output_lock=lock)  # rank 0 of a group, as attached
    runner.overlap_writes(1)
    held: list[tuple[str, bool]] = []
    real_save_tensors = media.save_tensors

    def save_tensors(tensors: dict[str, torch.Tensor], path: Any) -> None:
        held.append((threading.current_thread().name, lock.locked()))
        real_save_tensors(tensors, path)

    monkeypatch.setattr(media, "save_tensors", save_tensors)
    monkeypatch.setattr(media, "write_sidecar", lambda path, record: held.append(
        (threading.current_thread().name, lock.locked())) or Path(path).write_text("{}"))
    runner.run_pipeline(RequestConfig(prompt="a", save_tensor_path=str(tmp_path / "a.safetensors"),
                                      save_result_path=str(tmp_path / "a.png")), 0)
    runner.finish_writes()
    runner.writer.close()
    assert held == [("runnerkit-writer", True)] * 2 and not lock.locked()


# ---- the server ---------------------------------------------------------------------------------------
def test_a_job_completes_once_its_files_are_written_while_the_next_job_computes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three jobs through the server's worker with the writer thread: job k's files are held until job
    k+1 computes, and job k is still `in_progress` without a result then; job 1's tensor file meets a
    full disk: it fails alone (its folder removed); the jobs end in order."""
    import errno

    from runnerkit.serve.jobs import Job, JobQueue, Worker

    rec = Recorder(monkeypatch, hold=1, n=3)  # before loading: the pipeline takes the encoder's bound method
    config = load_runner_config(None, config_dict(tmp_path))
    runner = get_runner_cls(config.model_cls)(config)
    runner.init_modules()
    runner.overlap_writes(1)
    queue = JobQueue(tmp_path / "jobs", 4, None, None)
    jobs = []
    for k in range(3):
        job_id, folder = queue.new_folder()
        jobs.append(Job(id=job_id, kind="image", request=RequestConfig(prompt=f"p{k}", seed=k), folder=folder,
                        fields={}))
    seen: dict[int, tuple[str, bool, str]] = {}
    real_save_tensors = media.save_tensors

    def held(tensors: dict[str, torch.Tensor], path: Any) -> None:  # runs inside the recorder's held write
        k = [j.folder for j in jobs].index(Path(path).parent)
        if k + 1 < 3:  # the recorder held this write until job k+1 computed
            seen[k] = (jobs[k].status, jobs[k].result_path.exists(), jobs[k + 1].status)
        if k == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save_tensors(tensors, path)

    monkeypatch.setattr(media, "save_tensors", held)
    ended: list[str] = []
    all_ended = threading.Event()

    def on_done(job: Job) -> None:
        ended.append(job.id)
        if len(ended) == 3:
            all_ended.set()

    folders = {str(j.tensor_path): k for k, j in enumerate(jobs)}  # the recorder's request index of a job's file
    monkeypatch.setattr("test_cases.test_writer._index", lambda path: folders[str(path)])
    worker = Worker(runner, queue, on_done, save_tensors=True)
    worker.start()
    queue.submit(*jobs)
    assert all_ended.wait(WAIT_S * 3), [j.status for j in jobs]
    queue.close(cancel_running=False)
    worker.join(WAIT_S)
    assert not [e for e in rec.events if "gave up" in e], rec.events
    assert seen == {0: ("in_progress", False, "in_progress"), 1: ("in_progress", False, "in_progress")}
    assert ended == [j.id for j in jobs]
    assert [j.status for j in jobs] == ["completed", "failed", "completed"]
    assert jobs[1].error.startswith(f"MediaWriteError: could not write `save_tensor_path` {str(jobs[1].tensor_path)!r}")
    assert not jobs[1].folder.exists() and jobs[0].result_path.exists() and jobs[2].result_path.exists()
    assert jobs[0].profile["write"]["overlapped"] and jobs[0].completed_at <= jobs[2].completed_at
    assert not worker.is_alive() and runner.writer.in_flight() == []


@pytest.mark.parametrize("interrupted", [True, False])
def test_an_interrupt_after_every_write_ended_names_no_empty_list(monkeypatch: pytest.MonkeyPatch,
                                                                  interrupted: bool) -> None:
    """An interrupt while the writer closes with nothing in flight (a request's files were just saved): the line
    says nothing is being written instead of abandoning "request(s) []", and the writer still closes."""
    writer = ResultWriter(1)
    real_close = writer.close
    calls: list[str] = []

    def close_interrupted_once() -> None:
        calls.append("close")
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_close()

    monkeypatch.setattr(writer, "close", close_interrupted_once)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    try:
        writes.close_writer(writer, interrupted=interrupted)
    finally:
        logger.remove(sink)
    again = " again" if interrupted else ""
    assert lines == [f"interrupted{again}: no request's files are being written"]
    assert calls == ["close", "close"] and writer.in_flight() == []
