"""What a parallel run refuses, and why, in one process (no process group needed; issue 24).

The refusals come before any collective: the config (cfg 2 without CFG), the launch (no torchrun
environment, a world size that is not cfg x ulysses, an explicit cuda:N), the family (a runner
that has not opted in, heads that do not divide), and a request whose tokens do not divide (at the
start of the denoise stage, before its first step). A stand-in group (`FakeGroup`) gives the
runner its rank layout; nothing here reaches a collective.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from runnerkit.config import ParallelConfig, RequestConfig, load_runner_config
from runnerkit.parallel import ParallelSetupError, init_from_env
from runnerkit.registry import get_runner_cls
from runnerkit.runners.installers import check_parallel
from test_cases.conftest import REPO, TINY_CONFIG, config_dict


@dataclass
class FakeGroup:
    """The rank layout a runner reads from a `ParallelGroup`; its collectives must never be reached."""

    config: ParallelConfig
    rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def cfg(self) -> int:
        return self.config.cfg

    @property
    def ulysses(self) -> int:
        return self.config.ulysses

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.config.ulysses

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.config.ulysses

    def all_gather(self, *args: Any) -> Any:
        raise AssertionError("a refusal must come before any collective")

    all_to_all = all_gather


def _runner(tiny_ckpt: Path, parallel: dict[str, Any] | None, attach: bool = True, **overrides: Any) -> Any:
    data = config_dict(TINY_CONFIG, tiny_ckpt, infer_steps=1, **overrides)
    if parallel is not None:
        data["parallel"] = parallel
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    if attach and config.parallel is not None:
        runner.attach_parallel(FakeGroup(config.parallel))
    return runner


def test_config_bounds_and_cfg_needs_cfg() -> None:
    assert ParallelConfig(cfg=2, ulysses=4).world_size == 8
    with pytest.raises(ValidationError, match="cfg"):
        ParallelConfig.model_validate({"cfg": 3})
    with pytest.raises(ValidationError, match="ulysses"):
        ParallelConfig.model_validate({"ulysses": 0})
    data = {**json.loads(TINY_CONFIG.read_text()), "enable_cfg": False, "parallel": {"cfg": 2}}
    data.pop("sample_guide_scale")
    with pytest.raises(ValueError, match=r"`parallel.cfg`=2 .* `enable_cfg` is false"):
        load_runner_config(None, data)


def test_launch_environment_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ParallelSetupError, match=r"torchrun --nproc_per_node 4"):
        init_from_env(ParallelConfig(cfg=2, ulysses=2), "cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ParallelSetupError, match=r"needs 4 processes, but WORLD_SIZE is 2"):
        init_from_env(ParallelConfig(cfg=2, ulysses=2), "cpu")
    with pytest.raises(ParallelSetupError, match=r"cuda:LOCAL_RANK"):
        init_from_env(ParallelConfig(cfg=2), "cuda:1")


def test_parallel_config_without_a_group_is_refused_at_load(tiny_ckpt: Path) -> None:
    runner = _runner(tiny_ckpt, {"cfg": 2}, attach=False)
    with pytest.raises(ParallelSetupError, match="no process group") as info:
        runner.init_modules()
    assert getattr(info.value, "runnerkit_phase", None) == "load"


def test_heads_that_do_not_divide_are_refused_at_load(tiny_ckpt: Path) -> None:
    runner = _runner(tiny_ckpt, {"ulysses": 4})  # the tiny transformer has 2 heads
    with pytest.raises(NotImplementedError, match=r"`parallel.ulysses`=4 needs the attention heads divisible by 4, "
                                                  r"got 2"):
        runner.init_modules()


def test_a_family_without_parallel_support_is_refused(tmp_path: Path) -> None:
    """LTX-2 has not opted in (PARALLEL_MODES empty): refused at load, naming what it supports."""
    from runnerkit.models.ltx2.runner import LTX2Runner

    assert LTX2Runner.PARALLEL_MODES == frozenset()
    data = {**json.loads((REPO / "configs" / "ltx2" / "ltx2_t2av_tiny.json").read_text()), "device": "cpu",
            "parallel": {"ulysses": 2}}
    config = load_runner_config(None, data)
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.attach_parallel(FakeGroup(config.parallel))
    with pytest.raises(NotImplementedError, match=r"does not support \['ulysses'\] parallel \(supported: \[\]\)"):
        check_parallel(runner.config, runner.parallel, runner.PARALLEL_MODES, runner.attention_heads, "LTX2Runner")


def test_tokens_that_do_not_divide_are_refused_before_the_first_step(tiny_ckpt: Path) -> None:
    """48x80x9 gives 3 x 3 x 5 = 45 video tokens: ulysses 2 refuses the request at its denoise stage,
    before any step (FakeGroup's collectives would raise otherwise)."""
    runner = _runner(tiny_ckpt, {"ulysses": 2})
    runner.init_modules()
    request = RequestConfig(prompt="a fox", target_height=48, target_width=80, target_video_length=9)
    with pytest.raises(NotImplementedError, match=r"the transformer's tokens divisible by 2, got 45"):
        runner.run_pipeline(request, 0)


def test_warmup_runs_the_shapes_whose_tokens_divide(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ulysses 2 warmup drops a shape whose tokens do not divide (48x80x9: 45), naming it in a
    warning, runs the others and records exactly those as `warmed_shapes` (what the 'not warmed' line
    and the profile's `warmed_shape` read); with none left it refuses, naming every shape's count."""
    from loguru import logger

    runner = _runner(tiny_ckpt, {"ulysses": 2}, warmup=True)
    ran: list[tuple[tuple[int, int, int], ...]] = []
    monkeypatch.setattr(runner.warmups, "shapes", lambda: ((48, 80, 9), (32, 32, 5), (32, 64, 5)))
    monkeypatch.setattr(runner, "run_warmup", lambda shapes: ran.append(tuple(shapes)))  # no collective to reach
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        runner.init_modules()
    finally:
        logger.remove(sink)
    assert [w for w in warnings if w.startswith("warmup")] == [
        "warmup: skipped shape [48, 80, 9]: `parallel.ulysses`=2 needs the transformer's tokens divisible by 2, got 45 "
        "(stage 'transformer' at shape [48, 80, 9]; choose a shape whose tokens divide) (a request of that shape is "
        "refused as well)"]
    assert ran == [((32, 32, 5), (32, 64, 5))]
    assert runner.warmed_shapes == ((32, 32, 5), (32, 64, 5))
    assert runner.profiler.warmup["shapes"] == [[32, 32, 5], [32, 64, 5]]
    with pytest.raises(NotImplementedError, match=r"^`parallel.ulysses`=2: no warmup shape of WanT2VRunner has tokens "
                                                  r"that divide \(\[48, 80, 9\]: .*got 45 .*; \[16, 48, 1\]: .*got 3 "):
        runner.warmups.runnable_shapes([(48, 80, 9), (16, 48, 1)])
    assert _runner(tiny_ckpt, None).warmups.runnable_shapes([(48, 80, 9)]) == ((48, 80, 9),)


def test_a_launch_checks_every_request_split_before_the_first_runs(tiny_ckpt: Path) -> None:
    """`check_requests_split` (the parallel launch, after init): the first request whose tokens do not
    divide is named by index and source; dividing ones pass."""
    runner = _runner(tiny_ckpt, {"ulysses": 2})
    runner.init_modules()
    fine = RequestConfig(prompt="a fox", target_height=32, target_width=32, target_video_length=5)
    bad = RequestConfig(prompt="a fox", target_height=48, target_width=80, target_video_length=9)
    bad._source = "line 2 of r.jsonl"  # as load_requests names a line
    runner.check_requests_split([fine, fine])
    with pytest.raises(NotImplementedError, match=r"^request 1 \(line 2 of r.jsonl\): `parallel.ulysses`=2 needs "
                                                  r"the transformer's tokens divisible by 2, got 45 "):
        runner.check_requests_split([fine, bad, bad])


def test_the_server_refuses_tokens_that_do_not_divide_at_submission(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The same check at submission: `POST` with a size whose tokens do not divide by `parallel.ulysses`
    is a 422 naming `size` and the token count, before the job is queued; a dividing size is accepted."""
    from runnerkit.serve.app import InputError, ServerState, build_request
    from runnerkit.serve.jobs import JobQueue

    runner = _runner(tiny_ckpt, {"ulysses": 2})
    runner.init_modules()
    state = ServerState(runner=runner, queue=JobQueue(tmp_path, 4, None, None), metrics=None, phase="ready")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"the transformer's tokens divisible by 2, got 45") as err:
        build_request(state, {"prompt": "a fox", "size": "80x48", "seconds": "1"}, tmp_path / "a")
    assert (err.value.field, err.value.status) == ("size", 422)
    request, _, _ = build_request(state, {"prompt": "a fox", "size": "64x32", "seconds": "1"}, tmp_path / "b")
    assert (request.target_height, request.target_width) == (32, 64)


def test_the_server_counts_edit_references_before_any_encoder_ran(tmp_path: Path) -> None:
    """Qwen-Image Edit under ulysses 2: the submission check counts the tokens of the target and of the
    reference from their sizes, before any encoder ran for the job (it used to fail with "run the
    encoders first", a 500 for every edit job). Edit grids have even sides (32-pixel multiples), so
    the tiny model's ulysses 2 always divides: the job is accepted."""
    import base64

    from PIL import Image

    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic
    from runnerkit.serve.app import ServerState, build_request
    from runnerkit.serve.jobs import JobQueue

    template = REPO / "configs" / "qwen_image" / "qwen_image_edit_tiny.json"
    ckpt = write_synthetic(QwenImageArch.model_validate(json.loads(template.read_text())["model"]), tmp_path / "edit",
                           seed=0, dtype=torch.float32)
    config = load_runner_config(None, {**config_dict(template, ckpt), "parallel": {"ulysses": 2}})
    runner = get_runner_cls(config.model_cls, config.task)(config)
    runner.attach_parallel(FakeGroup(config.parallel))
    runner.init_modules()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(tmp_path / "ref.png")
    image = base64.b64encode((tmp_path / "ref.png").read_bytes()).decode()
    state = ServerState(runner=runner, queue=JobQueue(tmp_path / "jobs", 4, None, None), metrics=None, phase="ready")  # type: ignore[arg-type]
    folder = tmp_path / "job"
    folder.mkdir()
    request, _, _ = build_request(state, {"prompt": "make it blue", "size": "64x64", "image": image}, folder)
    assert (request.target_height, request.target_width) == (64, 64)
    # the 64x64 output is 4 x 4 tokens; the 64x64 reference at the VAE area of 4096 pixels too
    assert runner.sequence_tokens(runner.pipeline.denoise[0], runner.resolve_request(request)) == 16 + 16


def test_the_parallel_server_says_when_its_default_size_cannot_run(tiny_ckpt: Path) -> None:
    """Under ulysses 2 the tiny config's default 48x80x9 (45 tokens) would refuse every job that gives no
    `size`: the server warns at ready (`default_size_refusal`); a 32x32x5 default gives no warning."""
    from runnerkit.serve.server import default_size_refusal

    runner = _runner(tiny_ckpt, {"ulysses": 2})
    runner.init_modules()
    assert default_size_refusal(runner) == ("`parallel.ulysses`=2 needs the transformer's tokens divisible by 2, got 45 "
                                            "(stage 'transformer' at shape [48, 80, 9]; choose a shape whose tokens divide)")
    fine = _runner(tiny_ckpt, {"ulysses": 2}, target_height=32, target_width=32, target_video_length=5)
    fine.init_modules()
    assert default_size_refusal(fine) is None


def test_attach_parallel_after_init_is_refused(tiny_ckpt: Path) -> None:
    from runnerkit.runners.base import LifecycleError

    runner = _runner(tiny_ckpt, None)
    runner.init_modules()
    with pytest.raises(LifecycleError, match="before init_modules"):
        runner.attach_parallel(FakeGroup(ParallelConfig(cfg=2)))
