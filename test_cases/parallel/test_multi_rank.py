"""Multi-process runs on the CPU (gloo): CFG parallel and Ulysses sequence parallel (issue 24).

Each test starts 2 or 4 real processes of `runnerkit` (the launch script) on the tiny Wan t2v config
(2 layers, 2 heads, float32, 2 steps, 32x32x5: 8 video tokens) through
`test_cases/parallel/_rank_worker.py`, which adds a collective spy and injected failures. One test
goes through `torchrun` itself; the others fork the ranks from a forkserver that imported torch and
runnerkit once (seconds per rank saved) and give them torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so no launcher kills a rank for them: each rank has to end
on its own, which is what "no rank hangs" asks. Collectives time out after
`parallel.timeout_s` = 20 s and every subprocess after 90 s.

- CFG parallel is bit-identical to one process: each rank runs one branch with the same shapes and
  ops as the one-process forward of that branch; the all-gather moves bytes unchanged.
- Ulysses: every linear layer sees L/K rows and each attention call N/K heads; the CPU kernels may
  block those differently, so the video may differ in the last bits: tolerance 1e-4 (float32 video
  in [-1, 1]). On the machines tried it is bit-identical.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.registry import get_runner_cls
from test_cases.conftest import REPO, TINY_CONFIG, config_dict

STEPS, SHAPE = 2, (32, 32, 5)
WARMUP_SHAPES = [[32, 32, 5], [32, 64, 5]]  # 8 and 16 tokens: both divide by 2 (the debug flavour's 48x80x9 has 45)
ULYSSES_ATOL = 1e-4
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ckpt(tiny_ckpt: Path) -> Path:
    """The session's tiny Wan t2v checkpoint (test_cases/conftest.py)."""
    return tiny_ckpt


def _config(ckpt: Path, tmp: Path, parallel: dict[str, Any] | None, template: Path = TINY_CONFIG,
            **overrides: Any) -> Path:
    data = config_dict(template, ckpt, **{"infer_steps": STEPS, **overrides})
    if parallel is not None:
        data["parallel"] = {"timeout_s": 20.0, **parallel}
    path = tmp / f"config_{len(list(tmp.glob('config_*')))}.json"
    path.write_text(json.dumps(data))
    return path


def _argv(config: Path, out: Path | None, warmup: bool, shape: tuple[int, int, int] = SHAPE) -> list[str]:
    h, w, f = shape
    argv = ["--config_json", str(config), "--prompt", "a red fox in the snow", "--seed", "7", "--target_height",
            str(h), "--target_width", str(w), "--target_video_length", str(f)]
    return argv + (["--save_tensor_path", str(out)] if out else []) + (["--warmup"] if warmup else [])


def _spec(tmp: Path, argv: list[str], fail: dict[str, Any] | None = None,
          warmup_shapes: list[list[int]] = WARMUP_SHAPES) -> Path:
    spy = tmp / "spy"
    spy.mkdir(exist_ok=True)
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"argv": argv, "spy_dir": str(spy), "fail": fail, "warmup_shapes": warmup_shapes}))
    return spec


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RUNNERKIT_LOG_LEVEL", None)
    return env


@pytest.fixture(scope="module")
def forkserver() -> Any:
    """A multiprocessing context whose server imported torch and runnerkit once (`_rank_worker.PRELOAD`)."""
    import multiprocessing

    from test_cases.parallel import _rank_worker

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_rank_worker.PRELOAD)
    return ctx


def start_ranks(ctx: Any, n: int, spec: Path) -> tuple[list[Any], list[Path]]:
    """Start `n` ranks (forked from `ctx`'s server) with torchrun's environment; return the processes
    and their log files, by rank."""
    from test_cases.parallel._rank_worker import rank_main

    port = _free_port()
    logs = [spec.parent / f"rank{r}.log" for r in range(n)]
    procs = [ctx.Process(target=rank_main, args=(str(spec), r, n, port, str(logs[r]))) for r in range(n)]
    for p in procs:
        p.start()
    return procs, logs


def join_ranks(procs: list[Any], logs: list[Path], timeout_s: float = TIMEOUT_S) -> list[tuple[int, str]]:
    """Wait for each rank (bounded: a rank still running after `timeout_s` is a hang, and every rank is
    killed); return (exit status, log) by rank."""
    for rank, p in enumerate(procs):
        p.join(timeout_s)
        if p.exitcode is None:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {rank} did not end within {timeout_s} s (a hang):\n"
                                 + "\n".join(log.read_text()[-2000:] for log in logs))
    return [(p.exitcode, log.read_text()) for p, log in zip(procs, logs)]


def launch_ranks(ctx: Any, n: int, spec: Path) -> list[tuple[int, str]]:
    """Start `n` ranks (`start_ranks`), wait for each (bounded); return (exit status, log) by rank."""
    return join_ranks(*start_ranks(ctx, n, spec))


def reference(ckpt: Path, tmp: Path, template: Path = TINY_CONFIG, shape: tuple[int, int, int] = SHAPE,
              key: str = "video", steps: int = STEPS, **request: Any) -> torch.Tensor:
    """The one-process output of the same request (one thread, as each rank runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = config_dict(template, ckpt, infer_steps=steps)
        runner = get_runner_cls(data["model_cls"], data["task"])(load_runner_config(None, data))
        runner.init_modules()
        h, w, f = shape
        runner.run_pipeline(RequestConfig(prompt="a red fox in the snow", seed=7, target_height=h, target_width=w,
                                          target_video_length=f, save_tensor_path=str(tmp / "ref.safetensors"),
                                          **request), 0)
    finally:
        torch.set_num_threads(threads)
    return load_file(str(tmp / "ref.safetensors"))[key]


def spy_log(tmp: Path, n: int) -> list[list[list[Any]]]:
    return [json.loads((tmp / "spy" / f"rank{r}.json").read_text()) for r in range(n)]


def test_cfg_parallel_under_torchrun_is_bit_identical(ckpt: Path, tmp_path: Path) -> None:
    """2 processes through torchrun, cfg 2: rank 0 saves a video equal bit for bit to one process's; only
    rank 0 writes; warmup and the request run the same collectives in the same order on both ranks."""
    out = tmp_path / "video.safetensors"
    spec = _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"cfg": 2}), out, warmup=True))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "test_cases.parallel._rank_worker", str(spec)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    assert torch.equal(load_file(str(out))["video"], reference(ckpt, tmp_path))
    logs = spy_log(tmp_path, 2)
    assert logs[0] == logs[1]
    gather = ["all_gather", "cfg", [1, 16, 2, 4, 4]]  # [B, C, F', H', W'] of the 32x32x5 prediction
    warm = [c[1:] for c in logs[0] if c[0] == "warmup"]
    # step 0 of each warmup shape: one gather of the prediction (32x64: W' = 8)
    assert warm == [gather, ["all_gather", "cfg", [1, 16, 2, 4, 8]]]
    requests = [c[1:] for c in logs[0] if c[0] == "requests"]
    # after the last request, one agreement that rank 0's files were all written (a failed one exits 1 everywhere)
    assert requests == [["agree:init", "world", [1]]] + [gather] * STEPS + [["agree:request 0", "world", [1]],
                                                                            ["agree:writes", "world", [1]]]


def test_a_wrong_world_size_is_reported_once_by_rank_0(ckpt: Path, tmp_path: Path) -> None:
    """ulysses 4 launched with 2 processes through torchrun: rank 0 alone logs the refusal (one line)
    and every rank exits 2 (the ranks meet in torchrun's store first, so none is still starting when
    the launcher sends SIGTERM); torchrun itself exits 1 with its own ChildFailedError summary, which
    no rank can prevent."""
    config = _config(ckpt, tmp_path, {"ulysses": 4})
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "runnerkit.infer", *_argv(config, None, warmup=False)], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    output = run.stdout + run.stderr
    assert ERROR_LINE.findall(output) == ["invalid input: `parallel` = cfg 1 x ulysses 4 needs 4 processes, but "
                                          "WORLD_SIZE is 2: use `torchrun --nproc_per_node 4` or change "
                                          "`parallel`"], output
    assert run.returncode == 1, output
    ranks = re.findall(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)", output)
    assert sorted(ranks) == [("0", "2"), ("1", "2")], output


def test_cfg_and_ulysses_on_four_ranks(ckpt: Path, tmp_path: Path, forkserver: Any) -> None:
    """4 ranks, cfg 2 x ulysses 2, with warmup: the video matches one process (tolerance: module doc) and
    every rank issued the same collectives in the same order, warmup included."""
    out = tmp_path / "video.safetensors"
    spec = _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"cfg": 2, "ulysses": 2}), out, warmup=True))
    ranks = launch_ranks(forkserver, 4, spec)
    assert [r[0] for r in ranks] == [0] * 4, ranks[0][1][-3000:]
    video, ref = load_file(str(out))["video"], reference(ckpt, tmp_path)
    assert (video - ref).abs().max().item() <= ULYSSES_ATOL
    logs = spy_log(tmp_path, 4)
    assert logs[0] == logs[1] == logs[2] == logs[3]
    warm = [c[1:] for c in logs[0] if c[0] == "warmup"]
    layers, heads, d = 2, 2, 32
    for tokens, grid in ((8, [1, 16, 2, 4, 4]), (16, [1, 16, 2, 4, 8])):
        # per block: q, k, v in one all-to-all and the output in one; then the head's tokens, then the CFG gather
        qkv = ["all_to_all", "ulysses", [2, 3, heads // 2, tokens // 2, d]]
        back = ["all_to_all", "ulysses", [2, 1, heads // 2, tokens // 2, d]]
        step = [qkv, back] * layers + [["all_gather", "ulysses", [1, tokens // 2, 64]], ["all_gather", "cfg", grid]]
        assert warm[:len(step)] == step
        warm = warm[len(step):]
    assert warm == []


def test_ulysses_warmup_skips_a_shape_whose_tokens_do_not_divide(ckpt: Path, tmp_path: Path, forkserver: Any) -> None:
    """ulysses 2 with warmup shapes 48x80x9 (45 tokens) and 32x64x5 (16): every rank warms the second
    only (the first would fail its split, as a request of it does), then serves the request."""
    out = tmp_path / "video.safetensors"
    spec = _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"ulysses": 2}), out, warmup=True),
                 warmup_shapes=[[48, 80, 9], [32, 64, 5]])
    ranks = launch_ranks(forkserver, 2, spec)
    assert [r[0] for r in ranks] == [0, 0], ranks[0][1][-3000:]
    for _, log in ranks:
        assert "warmup: skipped shape [48, 80, 9]: `parallel.ulysses`=2 needs the transformer's tokens divisible by 2, " \
               "got 45" in log, log[-3000:]
    assert "over shapes [[32, 64, 5]]" in ranks[0][1], ranks[0][1][-3000:]
    # the request's shape was not warmed: the line names the shapes warmup ran, not the skipped one
    assert "shape [32, 32, 5] was not warmed (warmup shapes: [[32, 64, 5]])" in ranks[0][1], ranks[0][1][-3000:]
    assert out.exists()


def test_ulysses_on_two_ranks_with_block_offload(ckpt: Path, tmp_path: Path, forkserver: Any) -> None:
    """2 ranks, ulysses 2, `offload.mode` block on each rank (both CFG branches through each streamed
    block, `forward_branches`, on the rank's token shard): one process's video (tolerance: module doc)."""
    out = tmp_path / "video.safetensors"
    config = _config(ckpt, tmp_path, {"ulysses": 2}, offload={"mode": "block"})
    ranks = launch_ranks(forkserver, 2, _spec(tmp_path, _argv(config, out, False)))
    assert [r[0] for r in ranks] == [0, 0], ranks[0][1][-3000:]
    assert (load_file(str(out))["video"] - reference(ckpt, tmp_path)).abs().max().item() <= ULYSSES_ATOL


MOE_CONFIG = REPO / "configs" / "wan" / "wan22_moe_t2v_tiny.json"


def test_wan_moe_ulysses_on_two_ranks(tmp_path: Path, forkserver: Any) -> None:
    """Wan2.2 MoE t2v, ulysses 2, 4 steps (the high-noise expert, then the low-noise one, each with its
    own guidance scale): one process's video (tolerance: module doc)."""
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.moe_checkpoint import write_synthetic_moe

    ckpt = write_synthetic_moe(WanArch.model_validate(json.loads(MOE_CONFIG.read_text())["model"]),
                               tmp_path / "moe", seed=0, dtype=torch.float32)
    out = tmp_path / "video.safetensors"
    ranks = launch_ranks(forkserver, 2, _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"ulysses": 2}, MOE_CONFIG,
                                                                      infer_steps=4), out, False)))
    assert [r[0] for r in ranks] == [0, 0], ranks[0][1][-3000:]
    ref = reference(ckpt, tmp_path, MOE_CONFIG, steps=4)
    assert (load_file(str(out))["video"] - ref).abs().max().item() <= ULYSSES_ATOL


ERROR_LINE = re.compile(r"\| ERROR\s+\| (.*)")


@pytest.mark.parametrize(("rank", "phase", "expected"), [
    (1, "load", "rank 1 failed during load: RuntimeError: injected load failure; ending all 2 ranks"),
    (1, "warmup", "rank 1 failed during warmup: RuntimeError: injected warmup failure; ending all 2 ranks"),
    (1, "request", "rank 1 failed during request 0: RuntimeError: injected request failure; ending all 2 ranks"),
    (0, "request", "rank 0 failed during request 0: RuntimeError: injected request failure; ending all 2 ranks"),
])
def test_a_failing_rank_ends_the_group(ckpt: Path, tmp_path: Path, forkserver: Any, rank: int, phase: str,
                                      expected: str) -> None:
    """cfg 2 with warmup; one rank raises at load, in warmup's second step (after collectives ran), or in
    the request's second step: every rank exits 1 on its own (no launcher kills them), rank 0 prints
    the one line naming the rank and the phase, no other rank prints an error, nothing is saved."""
    out = tmp_path / "video.safetensors"
    fail = {"rank": rank, "phase": phase, "step": 2}
    ranks = launch_ranks(forkserver, 2, _spec(tmp_path, _argv(_config(ckpt, tmp_path, {"cfg": 2}), out, True), fail))
    assert [r[0] for r in ranks] == [1, 1], [r[1][-2000:] for r in ranks]
    assert ERROR_LINE.findall(ranks[0][1]) == [expected], ranks[0][1][-3000:]
    assert ERROR_LINE.findall(ranks[1][1]) == [], ranks[1][1][-3000:]
    assert not out.exists()


QWEN_CONFIG = REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json"


def test_qwen_image_joint_tokens_on_two_ranks(tmp_path: Path, forkserver: Any) -> None:
    """Qwen-Image t2i, ulysses 2 (2 heads, 32x32: 4 image tokens, 2 per rank, and the prompt's text tokens
    on both): the joint attention (text heads local, image tokens through the all-to-alls, the text
    output all-gathered) gives one process's image (tolerance: module doc). The ranks pad the text to
    its bucket (`text_buckets: on`, as a FlashAttention-4 run does), so the key mask crosses the
    all-to-alls too; the one process runs unpadded (the CPU's default)."""
    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic

    ckpt = write_synthetic(QwenImageArch.model_validate(json.loads(QWEN_CONFIG.read_text())["model"]),
                           tmp_path / "qwen", seed=0, dtype=torch.float32)
    out, shape = tmp_path / "image.safetensors", (32, 32, 1)
    argv = _argv(_config(ckpt, tmp_path, {"ulysses": 2}, QWEN_CONFIG, text_buckets="on"), out, False, shape)
    ranks = launch_ranks(forkserver, 2, _spec(tmp_path, argv))
    assert [r[0] for r in ranks] == [0, 0], ranks[0][1][-3000:]
    logs = spy_log(tmp_path, 2)
    assert logs[0] == logs[1]
    assert sum(c[1] == "all_to_all" for c in logs[0]) == STEPS * 2 * 2 * 2  # steps x branches x layers x 2
    image = load_file(str(out))["image"]
    assert (image - reference(ckpt, tmp_path, QWEN_CONFIG, shape, "image")).abs().max().item() <= ULYSSES_ATOL


I2V_CONFIG = REPO / "configs" / "wan" / "wan_i2v_tiny.json"


def test_wan_i2v_ulysses_on_two_ranks(tmp_path: Path, forkserver: Any) -> None:
    """Wan2.1 i2v, ulysses 2: the CLIP and VAE encoders run on every rank, the image channels `y`
    are sharded with the latents' tokens, the CLIP keys of the cross-attention stay whole; one process's
    video (tolerance: module doc)."""
    from runnerkit.images import write_image
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import write_synthetic

    ckpt = tmp_path / "i2v"
    write_synthetic(WanArch.model_validate(json.loads(I2V_CONFIG.read_text())["model"]), ckpt, seed=0,
                    dtype=torch.float32)
    image = tmp_path / "first.png"
    write_image(image, torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1)
    out = tmp_path / "video.safetensors"
    argv = _argv(_config(ckpt, tmp_path, {"ulysses": 2}, I2V_CONFIG), out, False) + ["--image_path", str(image)]
    ranks = launch_ranks(forkserver, 2, _spec(tmp_path, argv))
    assert [r[0] for r in ranks] == [0, 0], ranks[0][1][-3000:]
    ref = reference(ckpt, tmp_path, I2V_CONFIG, image_path=str(image))
    assert (load_file(str(out))["video"] - ref).abs().max().item() <= ULYSSES_ATOL
