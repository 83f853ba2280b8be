"""`--offload auto` end to end through the launch script (`runnerkit.infer.main`, in-process): the
plan resolved before loading lands in the sidecar's config and the profile's `memory_plan`, the
output equals the same explicit config bit for bit, nothing fits -> exit 2 before loading, a family
without an estimate is refused, explicit offload keys constrain the plan.

The CPU's own plan is always resident (offload cannot lower its peak), so the streaming cases plan
for a CUDA device (`MemoryChecks.memory_device` replaced) with `memory.limit_gib` and
`memory.host_limit_gib` from the family's own estimates, and compute on the CPU.

The Wan test architecture has a larger transformer than configs/wan/wan_t2v_tiny.json (dim 128, 6
layers): with two layers, disk streaming's staging slabs are all the blocks and no host limit can
tell the candidates apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.planning import fit
from runnerkit.planning import report as plan_report
from runnerkit.planning.checks import MemoryChecks
from test_cases.conftest import REPO, TINY_CONFIG, config_dict, write_config
from test_cases._cli import no_gc_freeze, restore_logger  # noqa: F401 (autouse fixtures)
from test_cases._cli import run_cli as _cli
from test_cases.planning.test_fit import logs  # noqa: F401 (fixture)

CUDA = torch.device("cuda")
SHAPE = (32, 32, 5)  # small: two runs of this file decode it
LAZY_DISK = {"mode": "block", "storage": "disk", "reader": "pread", "lazy_load": True}
#: what the plan makes of the `_limits` machine: lazy disk streaming, the only rung that fits, with the text
#: encoder kept resident beside it (it fits, and then nothing visits the device per request) and one of the
#: transformer's 4 blocks (`offload.resident_blocks`: the most that still fit, so the fewest bytes copied per step)
PLANNED = {**LAZY_DISK, "resident_modules": ["text_encoder"], "resident_blocks": 1}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import write_synthetic

    path = tmp_path_factory.mktemp("plan_ckpt") / "wan"
    write_synthetic(WanArch.model_validate(_model()), path, seed=0, dtype=torch.float32)
    return path


def _model() -> dict[str, Any]:
    model = json.loads(TINY_CONFIG.read_text())["model"]
    model["transformer"] = {**model["transformer"], "num_layers": 4}
    return model


def _config(ckpt: Path, **overrides: Any) -> dict[str, Any]:
    return config_dict(TINY_CONFIG, ckpt, model=_model(), **overrides)


def _plan_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MemoryChecks, "memory_device", lambda self: CUDA)


def _limits(ckpt: Path) -> tuple[float, float]:
    """(device GiB, host GiB) at which, by the family's estimate at SHAPE, only lazy disk streaming fits:
    resident and host streaming exceed the device, model offload the host (preconditions asserted)."""
    cfg = load_runner_config(None, _config(ckpt))
    runner = WanT2VRunner(cfg)

    def judge(**offload: Any) -> tuple[int, int]:
        off = OffloadConfig(**offload)
        c = cfg.model_copy(update={"offload": off})
        est = runner.memory_checks.estimate_with(off, SHAPE)
        return fit.peak_of(est, c, CUDA).bytes, fit.host_bytes_of(est, c, CUDA).bytes

    resident, model, block, disk, lazy = (judge(mode="none"), judge(mode="model"), judge(mode="block"),
                                          judge(mode="block", storage="disk", reader="pread"), judge(**LAZY_DISK))
    device, host = lazy
    assert resident[0] > device and block[0] > device and disk[0] > device, (resident, block, disk, lazy)
    assert model[0] <= device and model[1] > host, (model, lazy)
    return device / fit.GIB, host / fit.GIB


def test_auto_resolves_before_loading_and_equals_the_explicit_config(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    device_gib, host_gib = _limits(ckpt)
    plain = write_config(tmp_path / "plain.json", _config(ckpt, memory={"limit_gib": device_gib,
                                                                         "host_limit_gib": host_gib}))
    explicit = write_config(tmp_path / "explicit.json", _config(ckpt, offload=PLANNED))
    request = ["--prompt", "a fox", "--seed", "3", "--target_height", "32", "--target_width", "32",
               "--target_video_length", "5"]
    out_auto, out_explicit = tmp_path / "auto.mp4", tmp_path / "explicit.safetensors"
    _plan_for_cuda(monkeypatch)
    rc, err = _cli(capsys, "--config_json", plain, "--offload", "auto", *request, "--save_result_path", out_auto,
                   "--save_tensor_path", tmp_path / "auto.safetensors", "--profile_json", tmp_path / "p.json")
    assert rc == 0, err
    monkeypatch.undo()
    rc, err2 = _cli(capsys, "--config_json", explicit, *request, "--save_tensor_path", out_explicit)
    assert rc == 0, err2

    concrete = OffloadConfig(**PLANNED).model_dump(mode="json")
    assert json.loads(out_auto.with_suffix(".json").read_text())["config"]["offload"] == concrete
    plan = json.loads((tmp_path / "p.json").read_text())["memory_plan"]
    assert plan["offload"] == concrete and plan["requested"] == {"mode": "auto"}
    assert plan["candidate"] == ("block streaming from disk (reader pread; lazy_load; streams the transformers; "
                                 "1 units resident; resident text_encoder)")
    assert [r["candidate"] for r in plan["rejected"]] == [
        "resident (mode none)", "model offload (mode model)",
        "block streaming from pinned host memory (streams the transformers)",
        "block streaming from pinned host memory (streams text_encoder, transformer)",
        "block streaming from disk (reader pread; streams the transformers)",
        "block streaming from disk (reader pread; streams text_encoder, transformer)"]
    assert plan["rejected"][1]["reason"].startswith("host: ")
    assert plan["shapes"] == [list(SHAPE)] and plan["device_limit_source"] == "config memory.limit_gib"
    assert "memory plan (offload.mode auto): block streaming from disk" in err
    # planned before the load: the plan's log block comes first
    assert err.index("memory plan (offload.mode auto)") < err.index("load: ")
    assert torch.equal(load_file(str(tmp_path / "auto.safetensors"))["video"], load_file(str(out_explicit))["video"])


def _documented_plan_keys() -> set[str]:
    import re

    text = (REPO / "docs" / "profile.md").read_text()
    return {k for k in re.findall(r"^\| `([^`]+)` \|", text, flags=re.M) if k.startswith("memory_plan.")}


def test_profile_keys_of_the_plan_are_documented(ckpt: Path) -> None:
    runner = WanT2VRunner(load_runner_config(None, _config(ckpt, offload={"mode": "auto"},
                                                           memory={"limit_gib": 64.0, "host_limit_gib": 64.0})))
    runner.memory_checks.plan_memory([SHAPE])
    plan = runner.profiler.report()["memory_plan"]
    keys = {f"memory_plan.{k}" for k in plan}
    keys |= {f"memory_plan.modules[].{k}" for m in plan["modules"] for k in m}
    keys |= {f"memory_plan.rejected[].{k}" for r in plan["rejected"] for k in r}
    documented = _documented_plan_keys()
    assert keys - documented == set()
    assert documented - keys <= {f"memory_plan.rejected[].{k}" for k in (  # none rejected here
        "candidate", "offload", "reason", "device_gib", "host_gib", "passes_per_step", "copy_per_step_gib",
        "copy_seconds_per_step_estimate")}


def test_nothing_fits_exits_2_before_loading(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.json", _config(ckpt, memory={"limit_gib": 0.2, "host_limit_gib": 64.0}))
    _plan_for_cuda(monkeypatch)
    rc, err = _cli(capsys, "--config_json", cfg, "--offload", "auto", "--prompt", "a fox")
    assert rc == 2, err
    assert "invalid input: `offload.mode`='auto': no offload plan fits 1 shape(s) [[48, 80, 9]]" in err, err
    assert "GiB missing" in err and "Closest: " in err and "To fit: " in err, err
    assert "Traceback" not in err and "load: " not in err, err


def test_on_the_cpu_auto_keeps_everything_resident_and_says_why(ckpt: Path) -> None:
    runner = WanT2VRunner(load_runner_config(None, _config(ckpt, offload={"mode": "auto"})))
    plan = runner.memory_checks.plan_memory([SHAPE])
    assert plan is not None and runner.config.offload == OffloadConfig(mode="none")
    assert "the device is the CPU" in plan.why


def test_explicit_keys_constrain_the_plan(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _plan_for_cuda(monkeypatch)
    runner = WanT2VRunner(load_runner_config(None, _config(
        ckpt, offload={"mode": "auto", "gpu_slots": 3, "prefetch_depth": 2}, memory={"limit_gib": 64.0,
                                                                                  "host_limit_gib": 64.0})))
    plan = runner.memory_checks.plan_memory([SHAPE])
    assert plan is not None
    assert [e.name for e in plan.rejected] == ["resident (mode none)", "model offload (mode model)"]
    assert all(e.reason.startswith("excluded: `offload.gpu_slots` has no effect") for e in plan.rejected)
    off = runner.config.offload
    assert off.model_copy(update={"resident_modules": None, "resident_blocks": 0}) == OffloadConfig(
        mode="block", gpu_slots=3, prefetch_depth=2)
    assert off.resident_modules == ("text_encoder", "vae")  # 64 GiB: whatever does not stream stays resident


def test_a_family_without_an_estimate_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from runnerkit.models.qwen_image.runner import QwenImageRunner

    monkeypatch.setattr(QwenImageRunner, "estimate_memory", lambda self, shape: None)  # a family without one
    rc, err = _cli(capsys, "--config_json", REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json",
                   "--device", "cpu", "--offload", "auto", "--prompt", "a fox")
    assert rc == 2, err
    assert "`offload.mode`='auto' needs a memory estimate, and QwenImageRunner" in err, err
    assert "gives none (estimate_memory)" in err and "Traceback" not in err, err


def test_offload_flag_replaces_only_the_mode(tmp_path: Path) -> None:
    from runnerkit.serve.server import build_parser

    path = write_config(tmp_path / "c.json", {"model_cls": "x", "model_path": "/x",
                                              "offload": {"mode": "block", "storage": "disk"}})
    cfg = load_runner_config(path, {"offload.mode": "auto"})
    assert cfg.offload.mode == "auto" and cfg.offload.storage == "disk"
    assert build_parser().parse_args(["--config_json", str(path), "--offload", "auto"]).offload == "auto"


def test_a_conflict_names_where_each_value_came_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--offload block` over a file with `weight_dtype: auto`: the flag gave the mode, the file the dtype."""
    path = write_config(tmp_path / "c.json", {"model_cls": "wan2.1", "model_path": str(tmp_path),
                                              "offload": {"mode": "auto", "weight_dtype": "auto"}})
    rc, err = _cli(capsys, "--config_json", path, "--offload", "block", "--prompt", "a fox")
    assert rc == 2, err
    assert f"invalid config {path} with command-line overrides:" in err, err
    assert (f"(`offload.weight_dtype`='auto' from the config file {str(path)!r}; `offload.mode`='block' from the "
            "command line (--offload))") in err, err
    # a mode set nowhere is the default, auto, which `weight_dtype` 'auto' needs
    alone = load_runner_config(write_config(tmp_path / "d.json", {"model_cls": "x", "model_path": "/x",
                                                                  "offload": {"weight_dtype": "auto"}}), {})
    assert (alone.offload.mode, alone.offload.weight_dtype, "mode" in alone.offload.model_fields_set) == (
        "auto", "auto", False)
    # a whole section given as an override replaces the file's: its keys come from the override
    with pytest.raises(ValueError, match=r"`offload.weight_dtype`='auto' from the command line \(--offload\); "
                                         r"`offload.mode`='model' from the command line \(--offload\)"):
        load_runner_config(path, {"offload": {"mode": "model", "weight_dtype": "auto"}})


@pytest.mark.parametrize("enable_cfg, one_pass, passes", [(True, True, 1), (True, False, 2), (False, True, 1)])
def test_copy_volume_counts_the_cfg_passes(ckpt: Path, monkeypatch: pytest.MonkeyPatch, enable_cfg: bool,
                                           one_pass: bool, passes: int) -> None:
    """Block streaming with CFG: one pass per step where the family runs both branches through each block
    (Wan's CFG_ONE_PASS), two where it would not; without CFG one."""
    _plan_for_cuda(monkeypatch)
    monkeypatch.setattr(WanT2VRunner, "CFG_ONE_PASS", one_pass)
    overrides: dict[str, Any] = {"enable_cfg": enable_cfg} if enable_cfg else {"enable_cfg": False,
                                                                               "sample_guide_scale": None}
    runner = WanT2VRunner(load_runner_config(None, _config(
        ckpt, offload={"mode": "auto", "gpu_slots": 2, "resident_blocks": 0},  # every block streams
        memory={"limit_gib": 64.0, "host_limit_gib": 64.0},
        **overrides)))
    plan = runner.memory_checks.plan_memory([SHAPE])
    assert plan is not None and plan.offload.mode == "block"
    assert runner.profiler.memory_plan["passes_per_step"] == passes
    est = runner.memory_checks.estimate_with(runner.config.offload, SHAPE)
    slabs = est.modules["transformer"].stream_host_bytes  # storage cpu: every unit's slab, copied once per pass
    rows = {r.name: r for r in plan_report.module_rows(plan.chosen, CUDA)}
    assert slabs > 0 and rows["transformer"].copy_step_bytes == passes * slabs


def test_init_modules_plans_for_the_config_shape_before_loading(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's and the Python API's path: no request is known, `init_modules` plans for the config's
    default shape, before the load, and the config is concrete (and locked) afterwards."""
    _plan_for_cuda(monkeypatch)
    device_gib, host_gib = _limits(ckpt)
    runner = WanT2VRunner(load_runner_config(None, _config(
        ckpt, target_height=SHAPE[0], target_width=SHAPE[1], target_video_length=SHAPE[2], offload={"mode": "auto"},
        memory={"limit_gib": device_gib, "host_limit_gib": host_gib})))
    order: list[str] = []
    monkeypatch.setattr(MemoryChecks, "plan_memory", _recording(MemoryChecks.plan_memory, "plan", order))
    monkeypatch.setattr(WanT2VRunner, "load_modules", _recording(WanT2VRunner.load_modules, "load", order))
    runner.init_modules()
    assert order == ["plan", "load"]
    assert runner.config.offload == OffloadConfig(**PLANNED)
    assert runner.profiler.memory_plan is not None and runner.profiler.memory_plan["shapes"] == [list(SHAPE)]


def test_warmup_shapes_are_planned_for_and_unsupported_modes_skipped(tiny_ckpt: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _plan_for_cuda(monkeypatch)
    monkeypatch.setattr(WanT2VRunner, "WARMUP_OFFLOAD_MODES", ("model",))  # as if warmup could not run resident
    runner = WanT2VRunner(load_runner_config(None, config_dict(  # the tiny flavour has warmup shapes
        TINY_CONFIG, tiny_ckpt, warmup=True, offload={"mode": "auto"}, memory={"limit_gib": 64.0,
                                                                              "host_limit_gib": 64.0})))
    plan = runner.memory_checks.plan_memory([SHAPE])
    assert plan is not None and runner.warmup_shapes()
    assert list(plan.shapes) == list(dict.fromkeys([SHAPE, *runner.warmup_shapes()]))
    assert plan.chosen.name == "model offload (mode model; resident transformer, vae)"  # the text encoder visits
    assert [e.reason for e in plan.rejected] == ["excluded: warmup of WanT2VRunner does not support offload mode "
                                                 "'none' (supported: ['model'])"]


def _recording(method: Any, name: str, order: list[str]) -> Any:
    def wrapper(self: Any, *args: Any) -> Any:
        order.append(name)
        return method(self, *args)

    return wrapper


def test_host_limit_also_checks_requests_of_an_explicit_mode(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`memory.host_limit_gib` with a concrete mode: the fit check refuses what exceeds it (before loading)."""
    _plan_for_cuda(monkeypatch)
    from runnerkit.config import RequestConfig
    from runnerkit.planning.fit import MemoryFitError

    host = fit.PROCESS_HOST_BYTES / fit.GIB  # the process alone; the weights do not fit beside it
    runner = WanT2VRunner(load_runner_config(None, _config(ckpt, offload={"mode": "block"},
                                                           memory={"limit_gib": 64.0, "host_limit_gib": host})))
    with pytest.raises(MemoryFitError, match=r"request 0 \(command line\): shape \[48, 80, 9\] needs an estimated "
                                             r"2\.\d\d GiB \(held: text_encoder .*of host memory, more than config "
                                             r"memory.host_limit_gib \(2.0 GiB\)"):
        runner.memory_checks.check_requests_fit([RequestConfig(prompt="a fox")])
    roomy = WanT2VRunner(load_runner_config(None, _config(ckpt, offload={"mode": "block"},
                                                          memory={"limit_gib": 64.0, "host_limit_gib": host + 1})))
    roomy.memory_checks.check_requests_fit([RequestConfig(prompt="a fox")])  # no error


def test_host_limit_adds_what_the_process_holds(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `memory.host_limit_gib` the host limit is what the kernel still offers plus this process's RSS
    (its own weights and libraries count in the estimate, so they must count in the limit too)."""
    _plan_for_cuda(monkeypatch)
    available, rss_gib = 3 * fit.GIB + 12345, 1.5
    monkeypatch.setattr(memory, "host_available_bytes", lambda: (available, "test meminfo"))
    monkeypatch.setattr(memory, "host_memory", lambda: memory.HostMemory(rss_gib, rss_gib, available / fit.GIB))
    runner = WanT2VRunner(load_runner_config(None, _config(ckpt, offload={"mode": "auto"},
                                                           memory={"limit_gib": 64.0})))
    plan = runner.memory_checks.plan_memory([SHAPE])
    assert plan is not None and plan.host_limit is not None
    assert plan.host_limit.bytes == available + 3 * fit.GIB // 2
    assert plan.host_limit.source == "3.00 GiB available (test meminfo) + 1.50 GiB held by this process"
    assert runner.profiler.memory_plan["host_limit_gib"] == round((available + 3 * fit.GIB // 2) / fit.GIB, 3)


def _host_refusal(runner: WanT2VRunner) -> str:
    """The message of the launch script's check refusing one request at SHAPE for its host memory."""
    from runnerkit.config import RequestConfig
    from runnerkit.planning.fit import MemoryFitError

    with pytest.raises(MemoryFitError) as err:
        runner.memory_checks.check_requests_fit([RequestConfig(prompt="a fox", target_height=SHAPE[0],
                                                               target_width=SHAPE[1], target_video_length=SHAPE[2])])
    return str(err.value)


def test_on_the_cpu_the_host_refusal_advises_only_what_lowers_host_memory(ckpt: Path) -> None:
    """CPU, offload none, `memory.host_limit_gib` just below the estimate: each module built for its own stage
    and lazy disk streaming lower the CPU's peak (the estimate says by how much); storage 'disk' alone, mode
    'model' and `offload.mode`='auto' (resident on the CPU) do not, and are named as such, not advised."""
    cfg = load_runner_config(None, _config(ckpt, memory={"limit_gib": 64.0, "host_limit_gib": 0.52}))
    runner = WanT2VRunner(cfg)
    cpu = torch.device("cpu")
    est = runner.estimate_memory(SHAPE)
    now = fit.peak_of(est, cfg, cpu).bytes
    unload = fit.peak_of(est, cfg.model_copy(update={"unload_modules": True}), cpu).bytes
    disk = OffloadConfig(mode="block", storage="disk", reader="pread", lazy_load=True)
    lazy = fit.peak_of(runner.memory_checks.estimate_with(disk, SHAPE), cfg.model_copy(update={"offload": disk}),
                       cpu).bytes
    assert max(unload, lazy) < now and now > 0.52 * fit.GIB
    assert _host_refusal(runner) == (
        f"request 0 (command line): shape {list(SHAPE)} needs an estimated {now / fit.GIB:.2f} GiB (the device is "
        "the host: its peak estimate) of host memory, more than config memory.host_limit_gib (0.52 GiB). Try "
        f"`unload_modules`=true (each module built for its own stage: {unload / fit.GIB:.3f} GiB); or "
        "`offload.mode`='block' with `offload.storage`='disk' and `offload.lazy_load`=true (blocks read from disk "
        f"per use: {lazy / fit.GIB:.3f} GiB); or a smaller target_height/target_width/target_video_length "
        "(activations); or a larger memory.host_limit_gib if the machine has it. On the CPU the device is the host: "
        "offloading to host memory (mode 'model', storage 'cpu', or `offload.mode`='auto', which keeps every module "
        "resident there) lowers nothing")


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, free: int) -> dict[str, int]:
    """torch.cuda's memory readings for a device with `free` bytes and nothing reserved; the returned
    state is what they report, so a test can move it."""
    state = {"free": free, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * fit.GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    _plan_for_cuda(monkeypatch)
    return state


def _resident_peak(cfg: Any) -> int:
    """The resident candidate's estimate over every shape the plan judges (default + warmup shapes)."""
    runner = WanT2VRunner(cfg)
    shapes = [(cfg.target_height, cfg.target_width, cfg.target_video_length), *runner.warmup_shapes()]
    c = cfg.model_copy(update={"offload": OffloadConfig(mode="none")})
    resident = OffloadConfig(mode="none")
    return max(fit.peak_of(runner.memory_checks.estimate_with(resident, s), c, CUDA).bytes for s in shapes)


def test_an_accepted_plan_passes_warmup_and_every_request_while_free_memory_shrinks(
        tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan reads the device once, before loading (free + reserved, less the CUDA headroom); the
    load then reserves the weights and the libraries take 2 GiB outside the allocator, so a re-read
    would offer 2 GiB less than the plan had. The plan it accepted (resident, exactly at the budget)
    passes the warmup gate and every request's check."""
    cfg = load_runner_config(None, config_dict(TINY_CONFIG, tiny_ckpt, warmup=True, offload={"mode": "auto"}))
    resident = _resident_peak(cfg)
    state = _fake_cuda(monkeypatch, resident + memory.HEADROOM_BYTES["cuda"])
    runner = WanT2VRunner(cfg)
    real_load = WanT2VRunner.load_modules

    def load_then_shrink(self: WanT2VRunner) -> None:
        real_load(self)
        weights = sum(t.numel() * t.element_size() for m in self.modules.values()
                      for t in (*m.parameters(), *m.buffers()))
        state["reserved"] += weights
        state["free"] -= weights + 2 * fit.GIB

    monkeypatch.setattr(WanT2VRunner, "load_modules", load_then_shrink)
    runner.init_modules()
    assert runner.config.offload.mode == "none"
    assert memory.memory_limit(CUDA).bytes == resident + memory.HEADROOM_BYTES["cuda"] - 2 * fit.GIB
    for i, shape in enumerate(runner.warmup_shapes()):
        h, w, f = shape
        runner.run_pipeline({"prompt": "a fox", "target_height": h, "target_width": w, "target_video_length": f,
                             "save_tensor_path": str(tmp_path / f"{i}.safetensors")}, i)
        assert (tmp_path / f"{i}.safetensors").is_file()


def test_the_plan_keeps_the_headroom_under_a_read_limit(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte less than resident + headroom: resident is rejected (model offload taken), and the
    rejection names the budget's source with the headroom; a configured `memory.limit_gib` is the
    budget exactly (no headroom)."""
    cfg = load_runner_config(None, config_dict(TINY_CONFIG, tiny_ckpt, warmup=True, offload={"mode": "auto"}))
    resident = _resident_peak(cfg)
    headroom = memory.HEADROOM_BYTES["cuda"]
    assert headroom == fit.GIB
    _fake_cuda(monkeypatch, resident + headroom - 1)
    runner = WanT2VRunner(cfg)
    result = runner.memory_checks.plan_memory(())
    assert runner.config.offload.mode == "model"
    assert result.device_limit.bytes == resident - 1
    assert result.device_limit.source.endswith(" - 1.00 GiB kept for the CUDA libraries")
    assert [e.name for e in result.rejected] == ["resident (mode none)"]
    configured = WanT2VRunner(load_runner_config(None, config_dict(
        TINY_CONFIG, tiny_ckpt, warmup=True, offload={"mode": "auto"}, memory={"limit_gib": resident / fit.GIB})))
    configured.memory_checks.plan_memory(())
    assert configured.config.offload.mode == "none"
    assert configured.memory_checks.device_budget() == memory.MemoryLimit(resident, "config memory.limit_gib")


def test_a_config_without_an_offload_mode_plans_automatically(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """No `offload.mode` on a CUDA device: the plan runs as with `--offload auto` (the same concrete config,
    the log says the mode was not set, the profile's `memory_plan.requested` has no mode); an explicit
    `none` at the same limit is resident-or-refuse: exit 2, no plan."""
    device_gib, host_gib = _limits(ckpt)
    limits = {"memory": {"limit_gib": device_gib, "host_limit_gib": host_gib}}
    request = ["--prompt", "a fox", "--seed", "3", "--target_height", "32", "--target_width", "32",
               "--target_video_length", "5", "--save_tensor_path", tmp_path / "v.safetensors"]
    _plan_for_cuda(monkeypatch)
    rc, err = _cli(capsys, "--config_json", write_config(tmp_path / "default.json", _config(ckpt, **limits)),
                   *request, "--profile_json", tmp_path / "p.json")
    assert rc == 0, err
    plan = json.loads((tmp_path / "p.json").read_text())["memory_plan"]
    assert plan["requested"] == {} and plan["offload"] == OffloadConfig(**PLANNED).model_dump(mode="json")
    assert "memory plan: `offload.mode` not set, so the plan is automatic" in err
    rc, err = _cli(capsys, "--config_json", write_config(tmp_path / "none.json", _config(
        ckpt, offload={"mode": "none"}, **limits)), *request)
    assert rc == 2 and "memory plan" not in err, err
    assert "invalid input: request 0 (command line): shape 32x32x5" in err, err


def test_without_an_estimate_the_default_stays_resident_and_says_why(tmp_path: Path, logs: list[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A family without a memory estimate (Qwen-Image's tiny config, its estimate removed, on a fake CUDA
    device): the default mode keeps every module resident with one INFO line; `--offload auto` is refused
    (test above)."""
    from runnerkit.models.qwen_image.runner import QwenImageRunner

    monkeypatch.setattr(QwenImageRunner, "estimate_memory", lambda self, shape: None)

    cfg = load_runner_config(REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json", {"device": "cpu"})
    runner = QwenImageRunner(cfg)
    runner.memory_checks.memory_device = lambda: CUDA  # type: ignore[method-assign]
    runner.memory_checks.device_budget = lambda: memory.MemoryLimit(80 * fit.GIB, "test")  # type: ignore[method-assign]
    assert runner.memory_checks.plan_memory(()) is None
    assert runner.config.offload == OffloadConfig(mode="none")
    assert [line for line in logs if "every module resident" in line] == [
        "INFO memory plan: `offload.mode` not set, every module resident: QwenImageRunner gives no memory "
        "estimate (estimate_memory) to plan from"]


def test_unload_modules_with_the_default_mode_is_accepted() -> None:
    cfg = load_runner_config(None, {"model_cls": "x", "model_path": "/x", "unload_modules": True})
    assert cfg.offload.mode == "auto" and "mode" not in cfg.offload.model_fields_set
    with pytest.raises(ValueError, match=r"cannot be combined with `offload.mode`='auto'"):
        load_runner_config(None, {"model_cls": "x", "model_path": "/x", "unload_modules": True,
                                  "offload": {"mode": "auto"}})


def test_on_the_cpu_the_host_refusal_advises_nothing_that_would_not_fit(ckpt: Path) -> None:
    """A host limit below the fixed overhead: neither `unload_modules` nor lazy disk streaming nor a smaller
    shape can fit (each estimate is still above the limit), so none is advised; the message says why."""
    cfg = load_runner_config(None, _config(ckpt, memory={"limit_gib": 64.0, "host_limit_gib": 0.01}))
    runner = WanT2VRunner(cfg)
    now = fit.peak_of(runner.estimate_memory(SHAPE), cfg, torch.device("cpu")).bytes
    assert _host_refusal(runner) == (
        f"request 0 (command line): shape {list(SHAPE)} needs an estimated {now / fit.GIB:.2f} GiB (the device is "
        "the host: its peak estimate) of host memory, more than config memory.host_limit_gib (0.01 GiB). No setting "
        "or shape fits: the fixed overhead alone is 0.50 GiB. Try a larger memory.host_limit_gib if the machine has "
        "it. On the CPU the device is the host: offloading to host memory (mode 'model', storage 'cpu', or "
        "`offload.mode`='auto', which keeps every module resident there) lowers nothing")


def test_offload_keys_without_a_mode_constrain_the_default_plan(ckpt: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys that resident cannot take (`gpu_slots`) and no mode: on the CPU the default plans with them as
    explicit auto does (the first allowed candidate: block streaming with 3 slots), instead of refusing
    them as if the user had set mode none; a family without an estimate says why no plan can take them."""
    from runnerkit.models.qwen_image.runner import QwenImageRunner

    runner = WanT2VRunner(load_runner_config(None, _config(ckpt, offload={"gpu_slots": 3})))
    runner.memory_checks.plan_memory([SHAPE])
    assert runner.config.offload == OffloadConfig(mode="block", gpu_slots=3)
    monkeypatch.setattr(QwenImageRunner, "estimate_memory", lambda self, shape: None)  # a family without one
    qwen = QwenImageRunner(load_runner_config(REPO / "configs" / "qwen_image" / "qwen_image_t2i_tiny.json",
                                              {"device": "cpu", "offload": {"gpu_slots": 3}}))
    with pytest.raises(ValueError) as err:
        qwen.memory_checks.plan_memory(())
    assert str(err.value) == ("`offload` sets ['gpu_slots'] but no `offload.mode`, and the default plan cannot be "
                              "made: QwenImageRunner gives no memory estimate (estimate_memory) to plan from; set "
                              "`offload.mode` to the mode they belong to ('model', 'block' or 'phase')")
