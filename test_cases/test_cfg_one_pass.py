"""One block pass per step for both CFG branches under block streaming (issue 21, item 3).

The runners' one-pass path (`forward_branches` inside `streamer.entries(2)`) against their two-pass
path (one forward per branch, forced by `one_pass_streamer` -> None) on the same runner: the saved
result is bit-identical; the disk bytes (counted by the kernel, /proc/self/io `rchar`, and by the
streamer) and the H2D copies per step halve; block i runs for cond then uncond before block i+1.

Tiny configs with 4 transformer layers (2 slots: every slot is shared by two blocks, so every block
is copied every step; the copy counts also with 3 layers on 2 slots and 5 on 3), float32, CPU, 2 steps.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file
from torch import nn

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.registry import get_runner_cls
from runnerkit.runners.default import DefaultRunner
from test_cases.conftest import REPO, config_dict

LAYERS, STEPS = 4, 2
CONFIGS = {
    "wan_t2v": REPO / "configs" / "wan" / "wan_t2v_tiny.json",
    "wan_moe": REPO / "configs" / "wan" / "wan22_moe_t2v_tiny.json",
    "qwen_t2i": REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json",
}
REQUESTS = {
    "wan_t2v": RequestConfig(prompt="a red fox in the snow", seed=11, target_height=32, target_width=32,
                             target_video_length=5),
    "qwen_t2i": RequestConfig(prompt="a red fox in the snow at dawn", negative_prompt="blurry", seed=5),
}
REQUESTS["wan_moe"] = REQUESTS["wan_t2v"]


def _model(family: str, layers: int = LAYERS) -> dict[str, Any]:
    """The tiny config's `model` with `layers` transformer layers (2: the config's own, the `debug` flavour)."""
    model = json.loads(CONFIGS[family].read_text())["model"]
    model["transformer"] = {**model["transformer"], "num_layers": layers}
    return model


def _write(family: str, out: Path, layers: int) -> Path:
    if family == "wan_t2v":
        from runnerkit.models.wan.arch import WanArch
        from runnerkit.models.wan.checkpoint import write_synthetic
        write_synthetic(WanArch.model_validate(_model(family, layers)), out, seed=0, dtype=torch.float32)
        return out
    if family == "wan_moe":
        from runnerkit.models.wan.arch import WanArch
        from runnerkit.models.wan.moe_checkpoint import write_synthetic_moe
        return write_synthetic_moe(WanArch.model_validate(_model(family, layers)), out, seed=0, dtype=torch.float32)
    from runnerkit.models.qwen_image.arch import QwenImageArch
    from runnerkit.models.qwen_image.checkpoint import write_synthetic as write_qwen
    return write_qwen(QwenImageArch.model_validate(_model(family, layers)), out, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    written: dict[tuple[str, int], Path] = {}

    def get(family: str, layers: int = LAYERS) -> Path:
        if (family, layers) not in written:
            written[family, layers] = _write(family, tmp_path_factory.mktemp(family) / family, layers)
        return written[family, layers]

    return get


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


def make_runner(family: str, ckpt: Path, config: dict[str, Any] | None = None, layers: int = LAYERS,
                **offload: Any) -> DefaultRunner:
    data = config_dict(CONFIGS[family], ckpt, model=_model(family, layers), infer_steps=STEPS,
                       offload={"mode": "block", **offload}, **(config or {}))
    runner = get_runner_cls(data["model_cls"])(load_runner_config(None, data))
    runner.init_modules()
    return runner


def serve(runner: DefaultRunner, family: str, path: Path) -> torch.Tensor:
    runner.run_pipeline(REQUESTS[family].model_copy(update={"save_tensor_path": str(path)}), 0)
    return next(iter(load_file(str(path)).values()))


def two_passes(runner: DefaultRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the runner runs one forward per CFG branch (today's path before one-pass)."""
    monkeypatch.setattr(runner, "one_pass_streamer", lambda model: None)


def reentries(runner: DefaultRunner) -> int:
    return int(sum(s.stats()["reentries"] for s in runner.streamers.values()))


@pytest.mark.parametrize("storage", ["cpu", "disk"])
@pytest.mark.parametrize("family", ["wan_t2v", "wan_moe", "qwen_t2i"])
def test_one_pass_is_bit_identical_to_two_passes(ckpts: Callable[[str], Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, family: str, storage: str) -> None:
    runner = make_runner(family, ckpts(family), storage=storage)
    one = serve(runner, family, tmp_path / "one.safetensors")
    used = reentries(runner)
    assert used == STEPS * LAYERS  # every block's uncond entry served from its slot (MoE: over both experts)
    two_passes(runner, monkeypatch)
    two = serve(runner, family, tmp_path / "two.safetensors")
    assert reentries(runner) == used  # really two passes this time
    assert torch.equal(one, two)


def _rchar() -> int:
    """Bytes this process read through read()/pread() syscalls (the kernel's count, not the reader's)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar line")


def _measured_request(runner: DefaultRunner, family: str, path: Path) -> dict[str, Any]:
    """rchar, the streamer's disk bytes and every H2D copy label, split by denoising step."""
    streamer = runner.streamers["transformer"]
    log: list[str] = []
    h2d, run_step = streamer.engine.h2d, runner.run_step

    def spy_h2d(slot: int, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        log.append(label)
        h2d(slot, dst, src, label)

    def spy_step(*args: Any) -> torch.Tensor:
        log.append("step")
        return run_step(*args)

    streamer.engine.h2d = spy_h2d  # type: ignore[method-assign]
    runner.run_step = spy_step  # type: ignore[method-assign]
    disk0, rchar0 = streamer.stats()["disk_bytes_read"], _rchar()
    runner.run_pipeline(REQUESTS[family].model_copy(update={"save_tensor_path": str(path)}), 0)
    rchar = _rchar() - rchar0
    disk = streamer.stats()["disk_bytes_read"] - disk0
    del streamer.engine.h2d, runner.run_step
    steps = "/".join(log).split("step")[1:]
    return {"rchar": rchar, "disk": disk, "copies": [len([x for x in s.split("/") if x]) for s in steps]}


# (layers, gpu_slots) -> H2D copies per step of a request, one pass and two passes. Block j sits in slot
# j % gpu_slots; a block alone in its slot (3 on 2: block 1; 4 on 3: blocks 1 and 2) keeps its bytes
# from step to step and is copied in step 1 only. Step 1 copies every block and the wrap prefetch of
# block 0. 3 on 2 and 4 on 3 put the last block in block 0's slot (the wrap prefetch is deferred).
COPIES = {(4, 2): ([5, 4], [9, 8]),
          (3, 2): ([4, 2], [6, 4]),
          (4, 3): ([5, 2], [7, 4])}


@pytest.mark.parametrize(("layers", "slots"), list(COPIES), ids=[f"{n}on{s}" for n, s in COPIES])
@pytest.mark.parametrize("family", ["wan_t2v", "qwen_t2i"])
def test_disk_bytes_and_copies_halve(ckpts: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     family: str, layers: int, slots: int) -> None:
    """storage disk, reader pread (every byte goes through read syscalls): per request, the kernel's rchar
    and the streamer's disk counter drop by one full pass per step, and the H2D copies per step are those
    of `COPIES` (the wrap prefetch of the next step's block 0 counts in the step that issues it). Where the
    block count does not divide by `gpu_slots`, the wrap prefetch of block 0 waits for the last block's
    slot, which one-pass CFG enters twice: issued after the first entry, it would overwrite the block the
    uncond branch is about to run, and both would be copied again."""
    runner = make_runner(family, ckpts(family, layers), layers=layers, storage="disk", reader="pread",
                         gpu_slots=slots)
    assert runner.streamers["transformer"].num_slots == slots
    streamed = runner.streamers["transformer"].layouts
    # one pass: the blocks' tensor bytes (a unit's raw_nbytes adds alignment padding, never read)
    pass_bytes = sum(t.nbytes for layout in streamed for t in layout.tensors)
    # what a step reads from disk: the blocks that share their slot (the others stay in theirs)
    shared = [j for j in range(layers) if sum(k % slots == j % slots for k in range(layers)) > 1]
    step_bytes = sum(t.nbytes for j in shared for t in streamed[j].tensors)
    one = _measured_request(runner, family, tmp_path / "one.safetensors")
    two_passes(runner, monkeypatch)
    two = _measured_request(runner, family, tmp_path / "two.safetensors")
    want_one, want_two = COPIES[layers, slots]
    assert one["copies"] == want_one[:1] + want_one[1:] * (STEPS - 1)
    assert two["copies"] == want_two[:1] + want_two[1:] * (STEPS - 1)
    assert two["disk"] - one["disk"] == STEPS * step_bytes  # the streamer's count
    # every block in step 1, the shared ones in each later step, + the wrap prefetch and read-ahead
    assert pass_bytes + (STEPS - 1) * step_bytes <= one["disk"] <= pass_bytes + STEPS * step_bytes
    # the kernel's count: the streamer's bytes, give or take the few KiB a request reads besides the blocks
    # (pread: no mmap page faults hide reads from rchar), so the same bytes per step less
    for measured in (one, two):
        assert 0 <= measured["rchar"] - measured["disk"] < 64 * 1024, (one, two, pass_bytes)
    assert abs((two["rchar"] - one["rchar"]) - STEPS * step_bytes) < 64 * 1024, (one, two, step_bytes)


def _running_request(runner: DefaultRunner) -> dict[str, Any]:
    """{"req": the RequestState of the step that runs}, kept current by a wrapper of `runner.run_step`."""
    now: dict[str, Any] = {}
    run_step = runner.run_step

    def spy(req: Any, *args: Any) -> torch.Tensor:
        now["req"] = req
        return run_step(req, *args)

    runner.run_step = spy  # type: ignore[method-assign]
    return now


def _branch_of_wan(runner: DefaultRunner, model: nn.Module, order: list[tuple[int, str]]) -> None:
    """Block pre-hooks record (block, branch); the branch is known from the embedded context each got."""
    branch_of: dict[int, str] = {}
    now = _running_request(runner)
    embed = model.embed

    def spy_embed(latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, *args: Any) -> Any:
        pre = embed(latents, timestep, context, *args)
        branch_of[id(pre.context)] = "cond" if context is now["req"].inputs.context else "uncond"
        return pre

    model.embed = spy_embed  # type: ignore[method-assign]
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: order.append((i, branch_of[id(args[2])])))


def _branch_of_qwen(runner: DefaultRunner, model: nn.Module, order: list[tuple[int, str]]) -> None:
    """The prompt and the negative prompt have different lengths: the text stream's length names the branch."""
    now = _running_request(runner)

    def hook(i: int, args: tuple) -> None:
        inputs = now["req"].inputs
        lengths = {inputs.prompt_embeds.shape[1]: "cond", inputs.negative_embeds.shape[1]: "uncond"}
        assert len(lengths) == 2, "pick a prompt and a negative prompt of different lengths"
        order.append((i, lengths[args[1].shape[1]]))

    for i, block in enumerate(model.transformer_blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: hook(i, args))


@pytest.mark.parametrize("family", ["wan_t2v", "qwen_t2i"])
def test_block_i_runs_cond_then_uncond_before_block_i_plus_1(ckpts: Callable[[str], Path], tmp_path: Path,
                                                             family: str) -> None:
    runner = make_runner(family, ckpts(family))
    order: list[tuple[int, str]] = []
    (_branch_of_wan if family.startswith("wan") else _branch_of_qwen)(runner, runner.transformer, order)
    serve(runner, family, tmp_path / "out.safetensors")
    assert order == [(i, b) for i in range(LAYERS) for b in ("cond", "uncond")] * STEPS


def test_resident_and_phase_keep_two_passes_and_the_load_says_which(ckpts: Callable[[str], Path]) -> None:
    """One pass only where blocks stream: resident (mode none) and phase streaming answer None; one INFO
    line at load names the path (none for resident)."""
    said: dict[str, list[str]] = {}
    no_cfg = {"enable_cfg": False, "sample_guide_scale": None}
    for mode in ("none", "phase", "block", "block-no-cfg"):
        said[mode] = lines = []
        sink = logger.add(lambda m, lines=lines: lines.append(m.record["message"]), level="INFO",
                          filter=lambda r: r["message"].startswith("CFG"))
        try:
            runner = make_runner("wan_t2v", ckpts("wan_t2v"), config=no_cfg if mode.endswith("no-cfg") else None,
                                 mode=mode.removesuffix("-no-cfg"))
        finally:
            logger.remove(sink)
        want = runner.streamers["transformer"] if mode.startswith("block") else None
        assert runner.one_pass_streamer(runner.transformer) is want, mode
    assert said["none"] == [] and said["block-no-cfg"] == []
    assert len(said["phase"]) == 1 and "one forward per branch" in said["phase"][0]
    assert len(said["block"]) == 1 and "both branches run through each streamed block" in said["block"][0]


@pytest.mark.usefixtures("fresh_compiler")
def test_compiled_blocks_take_both_branches_without_recompiling(ckpts: Callable[[str], Path], tmp_path: Path) -> None:
    """Qwen-Image, regional compile (eager backend) + block streaming + CFG: after warmup a request whose
    prompt and negative prompt differ in length (each branch keeps its own) compiles nothing, in one pass."""
    runner = make_runner("qwen_t2i", ckpts("qwen_t2i", 2), layers=2,  # warmup knows the `debug` flavour's shapes
                         config={"warmup": True, "compile": {"enabled": True, "backend": "eager"}})
    before = reentries(runner)
    request = REQUESTS["qwen_t2i"].model_copy(update={"save_tensor_path": str(tmp_path / "out.safetensors")})
    audit = runner.run_pipeline(request, 0).audit
    assert audit["compilations"] == 0 and audit["recompilations"] == 0, audit
    assert reentries(runner) - before == STEPS * 2
