"""The memory refusal's core (planning/fit.py, memory.memory_limit), family-independent: placement
rules per offload mode (checked against a placed runner), the limit sources, and where the check
runs (before loading, before a request's first stage, warmup shapes), on the two-stage test family.

The Wan formulas and their measurements are in test_cases/models/wan/test_estimate.py; the launch
script's exit status in test_cases/test_infer.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger

from runnerkit import cgroup, memory
from runnerkit.config import ConfigError, RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.planning import fit
from runnerkit.runners.base import error_phase
from runnerkit.planning.fit import MemoryEstimate, MemoryFitError, ModuleFootprint, StageFootprint
from test_cases.conftest import tiny_config_dict
from test_cases.runners.two_stage import TwoStageImageRunner, config_dict

GIB = 1024**3
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", True)


@pytest.fixture
def logs() -> Any:
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(m.rstrip("\n")), level="DEBUG", format="{level} {message}")
    yield lines
    logger.remove(handler)


def toy(tmp_path: Path, **overrides: Any) -> TwoStageImageRunner:
    return TwoStageImageRunner(load_runner_config(None, config_dict(tmp_path, **overrides)))


# ---- the peak: weights per offload mode + stage activations ----------------------------------
ESTIMATE = MemoryEstimate(
    modules={"enc": ModuleFootprint(4 * GIB),
             "dit": ModuleFootprint(10 * GIB, stream_resident_bytes=1 * GIB, stream_slot_bytes=2 * GIB,
                                    stream_host_bytes=9 * GIB),
             "dec": ModuleFootprint(1 * GIB)},
    stages=(StageFootprint("encode", "enc", 1 * GIB), StageFootprint("denoise", "dit", 3 * GIB),
            StageFootprint("decode", "dec", 6 * GIB), StageFootprint("save", None, 1 * GIB)))


def cfg(**overrides: Any) -> Any:
    return load_runner_config(None, {"model_cls": "x", "model_path": "/x", **overrides})


@pytest.mark.parametrize("overrides, device, stage, weights, activations", [
    ({}, CUDA, "decode", 15, 6),  # all resident: 4 + 10 + 1
    ({"offload": {"mode": "model"}}, CUDA, "denoise", 10, 3),  # only the stage's module
    ({"offload": {"mode": "block"}}, CUDA, "decode", 1 + 2 + 1, 6),  # streamed resident + slots, then the decoder
    ({"offload": {"mode": "block"}}, CPU, "decode", 4 + 12 + 1, 6),  # host memory holds every copy
    ({"offload": {"mode": "block", "storage": "disk", "lazy_load": True}}, CUDA, "decode", 1, 6),
    ({"unload_modules": True}, CUDA, "denoise", 10, 3),
    ({"unload_modules": True}, CPU, "denoise", 10, 3),
    ({"offload": {"mode": "model"}}, CPU, "decode", 15, 6),  # offloaded modules are in the same memory
])
def test_peak_follows_the_placement_of_each_offload_mode(overrides: dict[str, Any], device: torch.device, stage: str,
                                                         weights: int, activations: int) -> None:
    peak = fit.peak_of(ESTIMATE, cfg(**overrides), device)
    assert (peak.stage, peak.weight_bytes, peak.activation_bytes) == (stage, weights * GIB, activations * GIB)
    assert peak.formula_bytes == (weights + activations) * GIB
    overhead = {"cuda": 256, "cpu": 512}[device.type] * 1024**2
    assert peak.bytes == -(-peak.formula_bytes * 11 // 10) + overhead  # ceil(x * 1.1) + overhead


def test_a_stage_on_an_unknown_module_is_an_error() -> None:
    bad = MemoryEstimate(modules={}, stages=(StageFootprint("s", "ghost", 1),))
    with pytest.raises(ValueError, match=r"stages use modules \['ghost'\] without a footprint"):
        fit.peak_of(bad, cfg(), CUDA)


@pytest.mark.parametrize("overrides", [{}, {"offload": {"mode": "model"}}, {"offload": {"mode": "block"}},
                                       {"offload": {"mode": "phase"}},
                                       {"offload": {"mode": "phase", "resident_blocks": 2}},
                                       {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
                                       {"unload_modules": True}])
def test_placement_rules_match_the_placed_runner(tiny_ckpt: Path, overrides: dict[str, Any]) -> None:
    """What fit.py assumes is on a (CUDA) device between stages and during each stage is what
    `DefaultRunner.place_modules` really placed: resident modules, plus the stage's own."""
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, **overrides)))
    runner.init_modules()
    placement = runner.placement
    estimate = runner.estimate_memory((48, 80, 9))
    between = set(fit.device_weights(estimate, None, runner.config, CUDA))
    assert between == set(placement.resident_modules)
    for stage in estimate.stages:
        during = set(fit.device_weights(estimate, stage.module, runner.config, CUDA))
        assert during == set(placement.resident_modules) | ({stage.module} - {None}), stage.name
    streamer = runner.streamers.get("transformer")
    if streamer is not None and not runner.config.offload.lazy_load:  # slot bytes as the streamer allocated them
        footprint = estimate.modules["transformer"]
        assert footprint.stream_slot_bytes == streamer.num_slots * streamer.slot_nbytes


#: the tiny Wan transformer streams U = 2 block units or 6 phase units: resident_blocks 0, 1, U - 1, U, U + 5
RESIDENT_BLOCKS = [("phase", "cpu", n) for n in (0, 1, 5, 6, 11)] + [("block", "disk", n) for n in (0, 1, 2, 7)]


@pytest.mark.parametrize(("mode", "storage", "kept"), RESIDENT_BLOCKS)
def test_streamed_footprint_is_what_the_streamer_allocated(tiny_ckpt: Path, mode: str, storage: str,
                                                           kept: int) -> None:
    """`offload.resident_blocks`: the estimate's resident part, slots, host slabs and bytes moved per pass
    equal, byte for byte, the transformer's tensors outside the slots, the slot buffers, the host slabs
    (storage cpu: one per streamed unit; disk: one staging slab per slot) and the streamed units' raw
    regions of the placed runner; min(gpu_slots, streamed units) slots."""
    config = tiny_config_dict(tiny_ckpt, offload={"mode": mode, "storage": storage, "resident_blocks": kept})
    runner = WanT2VRunner(load_runner_config(None, config))
    runner.init_modules()
    streamer, model = runner.streamers["transformer"], runner.modules["transformer"]
    units = {"block": 2, "phase": 6}[mode]
    streamed = max(units - kept, 0)
    assert streamer.num_units == streamed and streamer.num_slots == min(2, streamed)
    in_slots = {s.untyped_storage().data_ptr() for s in streamer._slots}
    tensors = [*model.parameters(), *model.buffers()]
    resident = sum(t.numel() * t.element_size() for t in tensors if t.untyped_storage().data_ptr() not in in_slots)
    slabs = streamer.source.slabs if storage == "cpu" else streamer.source.staging
    footprint = runner.estimate_memory((48, 80, 9)).modules["transformer"]
    assert footprint.stream_resident_bytes == resident
    assert footprint.stream_slot_bytes == sum(s.numel() * s.element_size() for s in streamer._slots)
    assert footprint.stream_host_bytes == sum(s.nbytes for s in slabs)
    assert footprint.stream_moved_bytes == sum(layout.raw_nbytes for layout in streamer.layouts)
    runner.end_run()


def test_module_footprint_counts_load_dtypes_on_meta() -> None:
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.LayerNorm(20))
    module.register_buffer("table", torch.empty(7, dtype=torch.complex64, device="meta"))
    footprint = fit.module_footprint(module, torch.bfloat16, keep_fp32=lambda n: n.startswith("1."))
    assert footprint.weight_bytes == (200 + 20) * 2 + 40 * 4 + 7 * 8
    assert not footprint.streams


def test_module_footprint_is_remembered_for_meta_modules_only() -> None:
    """The plan asks for one module under many offload configs: a meta-built module's footprint is computed
    once per the offload keys it depends on; a materialized module's every time (it may have changed)."""
    from runnerkit.config import OffloadConfig
    from runnerkit.models.wan.transformer import WanTransformer3D
    from runnerkit.weights import build_on_meta
    from test_cases.conftest import TINY_CONFIG

    arch = WanT2VRunner.parse_arch(load_runner_config(TINY_CONFIG, {}).model).transformer.model_copy(
        update={"num_layers": 4})  # more blocks than slots: disk staging holds fewer than all of them
    meta = build_on_meta(lambda: WanTransformer3D(arch))
    spec = WanTransformer3D.STREAM_SPEC

    def of(**offload: Any) -> ModuleFootprint:
        return fit.module_footprint(meta, torch.bfloat16, stream=spec, offload=OffloadConfig(mode="block", **offload))

    first = of()
    assert of(resident_modules=["vae"], pin_memory=False) is first  # keys the footprint does not read
    assert of(resident_blocks=1).stream_resident_bytes > first.stream_resident_bytes  # one it reads
    assert of(storage="disk").stream_host_bytes < first.stream_host_bytes
    real = torch.nn.Linear(10, 20)
    assert fit.module_footprint(real, torch.float32).weight_bytes == 220 * 4
    real.register_buffer("table", torch.zeros(5))
    assert fit.module_footprint(real, torch.float32).weight_bytes == 225 * 4


@pytest.mark.parametrize("overrides, stage, weights", [
    ({}, "decode", 15 + 1),  # resident: the slots beside the weights
    ({"offload": {"mode": "model"}}, "denoise", 10 + 1),
    ({"offload": {"mode": "model"}}, "decode", 1 + 1),  # the slots stay on the device while dit is offloaded
    ({"offload": {"mode": "block"}}, "decode", 1 + 2 + 1 + 1),
    ({"offload": {"mode": "block", "storage": "disk", "lazy_load": True}}, "denoise", 1 + 2 + 1),
    ({"unload_modules": True}, "denoise", 10 + 1),  # built (with its slots) for its stage only
])
def test_lora_slots_stay_on_the_device_in_every_offload_mode(overrides: dict[str, Any], stage: str,
                                                            weights: int) -> None:
    dit = ESTIMATE.modules["dit"]
    with_slots = MemoryEstimate(modules={**ESTIMATE.modules, "dit": ModuleFootprint(
        dit.weight_bytes, dit.stream_resident_bytes, dit.stream_slot_bytes, dit.stream_host_bytes,
        device_extra_bytes=1 * GIB)}, stages=ESTIMATE.stages)
    config = cfg(**overrides)
    peak = fit.peak_of(with_slots, config, CUDA)
    during = sum(fit.device_weights(with_slots, "dit" if stage == "denoise" else "dec", config, CUDA).values())
    assert during == weights * GIB, (peak.stage, during / GIB)


@pytest.mark.parametrize("overrides", [{}, {"offload": {"mode": "block"}}])
def test_the_lora_slot_estimate_is_what_the_runner_allocates(tiny_ckpt: Path, overrides: dict[str, Any]) -> None:
    """`lora_slot_bytes` on the meta-built transformer against the slots `attach_slots` gave the loaded
    one (down, up and bias of every linear layer), byte for byte, at rank 8; none without `lora`."""
    from runnerkit.lora.apply import LoRALinear

    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, lora={"max_rank": 8}, **overrides)))
    runner.init_modules()
    real = sum(t.numel() * t.element_size() for m in runner.modules["transformer"].modules()
               if isinstance(m, LoRALinear) for t in (m.lora_down, m.lora_up, m.lora_bias))
    assert real > 0 and runner.estimate_memory((48, 80, 9)).modules["transformer"].device_extra_bytes == real
    plain = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, **overrides)))
    assert plain.estimate_memory((48, 80, 9)).modules["transformer"].device_extra_bytes == 0
    if not overrides:  # fused LoRA writes into the weights (refused with streamed ones): no slots
        fused = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, lora={"mode": "fused"})))
        assert fused.estimate_memory((48, 80, 9)).modules["transformer"].device_extra_bytes == 0


# ---- the limit ---------------------------------------------------------------------------------
def test_limit_from_config_wins() -> None:
    limit = memory.memory_limit(CPU, limit_gib=3.5)
    assert limit == memory.MemoryLimit(int(3.5 * GIB), "config memory.limit_gib")


def test_cpu_limit_reads_available_host_memory() -> None:
    """The real source on this machine: a positive number, /proc/meminfo's MemAvailable (or less under a
    cgroup limit)."""
    limit = memory.memory_limit(CPU)
    assert limit is not None and limit.bytes > 0
    if memory.MEMINFO.is_file():
        text = memory.MEMINFO.read_text()
        kb = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("MemAvailable:"))
        assert limit.bytes <= kb * 1024 + GIB
        assert "MemAvailable" in limit.source or "cgroup" in limit.source


def test_cpu_limit_sources_and_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8388608 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", tmp_path / "no_cgroup")
    monkeypatch.setattr(cgroup, "MEMBERSHIP", tmp_path / "no_membership")
    assert memory.host_available_bytes() == (8 * GIB, "MemAvailable of /proc/meminfo")
    # a cgroup v2 limit that leaves less: limit - usage + inactive file cache
    cg = tmp_path / "cgroup"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{6 * GIB}\n")
    (cg / "memory.current").write_text(f"{3 * GIB}\n")
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {1 * GIB}\n")
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", cg)
    available, source = memory.host_available_bytes()
    assert available == 4 * GIB and "cgroup v2 memory.max" in source
    (cg / "memory.max").write_text("max\n")  # no limit: back to MemAvailable
    assert memory.host_available_bytes()[0] == 8 * GIB
    # no /proc/meminfo, no psutil: free pages from os.sysconf
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "absent")
    monkeypatch.setitem(__import__("sys").modules, "psutil", None)
    available, source = memory.host_available_bytes()
    assert available > 0 and source == "free pages (os.sysconf)"


def test_limit_config_bounds() -> None:
    with pytest.raises(ConfigError, match="limit_gib"):
        cfg(memory={"limit_gib": 0})
    with pytest.raises(ConfigError, match="`memory.limit_gib` has no effect with `memory.check_fit`=false"):
        cfg(memory={"limit_gib": 8.0, "check_fit": False})


# ---- where the check runs ------------------------------------------------------------------------
TINY_LIMIT = 0.51  # GiB: above the fixed 0.5 GiB overhead on the CPU, below a 2048x2048 toy request


def test_before_loading_a_request_that_cannot_fit_is_refused(tmp_path: Path, mocker: Any) -> None:
    runner = toy(tmp_path, memory={"limit_gib": TINY_LIMIT})
    load = mocker.spy(TwoStageImageRunner, "load_modules")
    requests = [RequestConfig(prompt="small", target_height=16, target_width=16),
                RequestConfig(prompt="big", target_height=2048, target_width=2048)]
    requests[1]._source = "line 2 of 'r.jsonl'"
    with pytest.raises(MemoryFitError) as exc:
        runner.memory_checks.check_requests_fit(requests)
    msg = str(exc.value)
    assert msg.startswith("request 1 (line 2 of 'r.jsonl'): shape 2048x2048x1 (height x width x frames) "
                          "needs an estimated")
    peak = fit.peak_of(runner.estimate_memory((2048, 2048, 1)), runner.config, CPU)
    assert f"{peak.bytes / GIB:.2f} GiB (peak in stage save" in msg
    assert f"more than the limit of {TINY_LIMIT:.2f} GiB (config memory.limit_gib)" in msg
    assert "smaller target_height/target_width/target_video_length" in msg and "memory.check_fit=false" in msg
    assert load.call_count == 0


def test_a_refusal_that_the_lora_slots_cause_names_them_with_enough_digits(tiny_ckpt: Path) -> None:
    """The tiny Wan fits a limit just above its estimate without LoRA and not with rank-64 slots: the message
    names the slots' share and what to change, with the decimals that show the estimate above the limit."""
    shape, request = (48, 80, 9), RequestConfig(prompt="x", target_height=48, target_width=80, target_video_length=9)
    plain = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt)))
    base = fit.peak_of(plain.estimate_memory(shape), plain.config, CPU).bytes
    slots = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, lora={"max_rank": 64})))
    peak = fit.peak_of(slots.estimate_memory(shape), slots.config, CPU)
    limit = (base + peak.bytes) / 2 / GIB  # between the two estimates (they differ in the 3rd-4th decimal)
    for runner, refused in ((plain, False), (slots, True)):
        runner._config = runner.config.model_copy(update={"memory": runner.config.memory.model_copy(
            update={"limit_gib": limit})})
        if not refused:
            runner.memory_checks.check_requests_fit([request])
            continue
        with pytest.raises(MemoryFitError) as exc:
            runner.memory_checks.check_requests_fit([request])
    msg = str(exc.value)
    slot_gib = f"{peak.lora_slot_bytes / GIB:.2f}"
    assert peak.lora_slot_bytes == slots.estimate_memory(shape).modules["transformer"].device_extra_bytes > 0
    assert f"weights (of which {slot_gib} GiB LoRA slots)" in msg, msg
    advice = f"a smaller lora.max_rank (the unfused LoRA slots take {slot_gib} GiB at rank 64) or lora.mode 'fused'"
    assert advice in msg, msg
    shown = re.search(r"needs an estimated ([0-9.]+) GiB .* more than the limit of ([0-9.]+) GiB", msg)
    assert shown is not None and float(shown[1]) > float(shown[2]), msg


def test_requests_that_fit_are_accepted_and_logged(tmp_path: Path, logs: list[str]) -> None:
    runner = toy(tmp_path, memory={"limit_gib": 1.0})
    runner.memory_checks.check_requests_fit([RequestConfig(prompt="a", target_height=32, target_width=64),
                               RequestConfig(prompt="b", target_height=64, target_width=64)])
    assert any(line.startswith("INFO memory check: 2 request(s) fit; largest estimate") and "[64, 64, 1]" in line
               for line in logs)


def test_the_limit_compares_strictly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request estimated at exactly the limit fits; one byte less of limit and it is refused."""
    runner = toy(tmp_path)
    peak = fit.peak_of(runner.estimate_memory((64, 64, 1)), runner.config, CPU)
    monkeypatch.setattr(memory, "memory_limit", lambda *a, **k: memory.MemoryLimit(peak.bytes, "test"))
    assert runner.memory_checks.check_fit((64, 64, 1), "request 0") == peak
    monkeypatch.setattr(memory, "memory_limit", lambda *a, **k: memory.MemoryLimit(peak.bytes - 1, "test"))
    runner = toy(tmp_path)  # a new runner reads the limit anew (device_budget: once per runner)
    with pytest.raises(MemoryFitError, match=r"request 0: shape 64x64x1 .* \(test\)"):
        runner.memory_checks.check_fit((64, 64, 1), "request 0")


def test_before_the_first_stage_a_request_that_cannot_fit_is_refused(tmp_path: Path, mocker: Any) -> None:
    """run_pipeline (the API path) checks too: refused before any stage, end_run still runs, the
    next request is served."""
    runner = toy(tmp_path, memory={"limit_gib": TINY_LIMIT})
    runner.init_modules()
    encoders = mocker.spy(TwoStageImageRunner, "run_encoders")
    end_run = mocker.spy(TwoStageImageRunner, "end_run")
    with pytest.raises(MemoryFitError, match=r"^request 3: shape 4096x4096x1") as exc:
        runner.run_pipeline(RequestConfig(prompt="huge", target_height=4096, target_width=4096), 3)
    assert error_phase(exc.value) == "request 3"
    assert encoders.call_count == 0 and end_run.call_count == 1
    runner.run_pipeline(RequestConfig(prompt="fits", save_tensor_path=str(tmp_path / "ok.safetensors")), 4)
    assert (tmp_path / "ok.safetensors").is_file()


def test_a_warmup_shape_that_cannot_fit_fails_before_loading(tmp_path: Path, mocker: Any) -> None:
    limit = fit.overhead_bytes(CPU) / GIB  # every estimate is above the fixed overhead
    runner = toy(tmp_path, warmup=True, memory={"limit_gib": limit})
    smallest = min(fit.peak_of(runner.estimate_memory(s), runner.config, CPU).bytes
                   for s in TwoStageImageRunner.WARMUP_SHAPES["toy"])
    assert smallest > limit * GIB, "the limit must refuse the toy's warmup shapes"
    load = mocker.spy(TwoStageImageRunner, "load_modules")
    with pytest.raises(MemoryFitError, match=r"^warmup shape \[32, 32, 1\]: shape 32x32x1") as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "warmup" and load.call_count == 0


def test_a_limit_below_the_fixed_overhead_advises_no_shape(tmp_path: Path) -> None:
    """Under the process's fixed overhead no shape or offload setting can fit: the refusal says so and
    advises a larger device; a limit above the overhead keeps the shape advice."""
    overhead = fit.overhead_bytes(CPU) / GIB
    runner = toy(tmp_path, memory={"limit_gib": overhead / 2})
    runner.init_modules()
    with pytest.raises(MemoryFitError) as exc:
        runner.run_pipeline(RequestConfig(prompt="x"), 0)
    msg = str(exc.value)
    assert f"No shape or setting fits: the fixed overhead alone is {overhead:.2f} GiB. Try a device with more " \
           "memory" in msg and "smaller target_height" not in msg, msg
    runner = toy(tmp_path, memory={"limit_gib": TINY_LIMIT})
    runner.init_modules()
    with pytest.raises(MemoryFitError) as exc:
        runner.run_pipeline(RequestConfig(prompt="huge", target_height=4096, target_width=4096), 1)
    assert "Try a smaller target_height/target_width/target_video_length" in str(exc.value)
    assert "No shape or setting fits" not in str(exc.value)


def test_the_warmup_gate_checks_the_second_shape_too(tmp_path: Path, mocker: Any) -> None:
    """A limit that the first (small) warmup shape fits under and only the second exceeds: the
    gate refuses, naming the second shape, before anything loads."""
    runner = toy(tmp_path, warmup=True)
    first, second = (fit.peak_of(runner.estimate_memory(s), runner.config, CPU).bytes
                     for s in TwoStageImageRunner.WARMUP_SHAPES["toy"])
    assert first < second, "the toy's second warmup shape must need more memory than its first"
    limit = (first + second) / 2 / GIB
    runner = toy(tmp_path, warmup=True, memory={"limit_gib": limit})
    load = mocker.spy(TwoStageImageRunner, "load_modules")
    with pytest.raises(MemoryFitError, match=r"^warmup shape \[32, 64, 1\]: shape 32x64x1") as exc:
        runner.init_modules()
    assert error_phase(exc.value) == "warmup" and load.call_count == 0


def test_check_fit_false_skips_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "memory_limit", lambda *a, **k: memory.MemoryLimit(1, "test"))
    runner = toy(tmp_path, memory={"check_fit": False})
    assert runner.memory_checks.check_fit((4096, 4096, 1), "request 0") is None
    runner.memory_checks.check_requests_fit([RequestConfig(prompt="x", target_height=4096, target_width=4096)])


class NoEstimateRunner(TwoStageImageRunner):
    """A family that gives no memory estimate (the base default)."""

    def estimate_memory(self, shape: Any) -> None:
        return None


def test_a_family_without_an_estimate_is_served_unchecked_with_one_info_line(tmp_path: Path,
                                                                               logs: list[str]) -> None:
    runner = NoEstimateRunner(load_runner_config(None, config_dict(tmp_path, memory={"limit_gib": TINY_LIMIT})))
    runner.memory_checks.check_requests_fit([RequestConfig(prompt="x", target_height=4096, target_width=4096)] * 2)
    runner.init_modules()
    runner.run_pipeline(RequestConfig(prompt="y", save_tensor_path=str(tmp_path / "y.safetensors")), 0)
    unchecked = [line for line in logs if "requests are not checked against the device's memory" in line]
    assert unchecked == ["INFO memory check: requests are not checked against the device's memory: "
                         "NoEstimateRunner gives no memory estimate (estimate_memory)"]


def test_the_limit_is_read_once_before_loading_and_kept(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan phase reads the device's limit before anything loads; the warmup gate and every
    request's check judge against that same number, however the device's own reading moves after
    (the loaded weights leave MemAvailable on the CPU; the libraries' allocations lower CUDA's free)."""
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, warmup=True)))
    calls: list[int] = []  # 8 GiB available at the first reading, 0.1 GiB (less than any estimate) later
    monkeypatch.setattr(memory, "host_available_bytes", lambda: (8 * GIB if not calls.append(0) and len(calls) == 1
                                                                 else GIB // 10, "fake"))
    read: list[str] = []
    real_limit = memory.memory_limit

    def spy(device: torch.device, limit_gib: float | None = None) -> memory.MemoryLimit | None:
        read.append(runner._lifecycle)
        return real_limit(device, limit_gib)

    monkeypatch.setattr(memory, "memory_limit", spy)
    limits: list[int] = []
    real_peak = fit.peak_of
    budget = runner.memory_checks.device_budget
    monkeypatch.setattr(fit, "peak_of", lambda *a: limits.append(budget().bytes) or real_peak(*a))
    runner.init_modules()
    runner.memory_checks.check_fit((48, 80, 9), "after")
    assert read == ["initialising"]  # once, in the plan phase, before the load
    assert len(limits) >= 3 and set(limits) == {8 * GIB}  # the warmup shapes and the request: each judged against it
    assert runner.memory_checks.device_budget() == memory.MemoryLimit(8 * GIB, "cpu: 8.00 GiB available (fake)")
    assert memory.memory_limit(CPU).bytes == GIB // 10  # what a re-read would have judged against


@pytest.mark.parametrize("kept", [0, 30])
def test_an_explicit_streaming_plan_bound_by_weights_is_advised_what_sheds_them(kept: int) -> None:
    """Block streaming whose peak is weights (e.g. 30 kept units beside a resident text encoder): the refusal
    advises fewer `offload.resident_blocks` (when some are kept) and the automatic plan, not only a smaller
    shape."""
    config = cfg(offload={"mode": "block", "resident_blocks": kept})
    peak = fit.PeakEstimate(bytes=33 * GIB, formula_bytes=33 * GIB, stage="text_encoder", weight_bytes=32 * GIB,
                            activation_bytes=GIB // 2)
    message = fit.refusal_message("request 0", (480, 832, 81), peak, 24 * GIB, "--device_gib", CUDA, config)
    assert ("fewer offload.resident_blocks (now 30" in message) is (kept == 30)
    assert "offload.mode 'auto'" in message and "a smaller target_height" in message
    activations = fit.PeakEstimate(bytes=33 * GIB, formula_bytes=33 * GIB, stage="denoise", weight_bytes=GIB,
                                   activation_bytes=32 * GIB)  # a shape too large: no offload advice
    assert "offload.mode 'auto'" not in fit.refusal_message("request 0", (480, 832, 81), activations, 24 * GIB,
                                                             "--device_gib", CUDA, config)


@pytest.mark.parametrize("stage", ["text_encoder", "diffusion_decoder"])
def test_a_refusal_shows_stage_bound_advice_only_at_that_stage(stage: str) -> None:
    """Advice that lowers only some stages (streaming the text encoder lowers its own) is shown only where the
    peak is in one of them; advice naming no stage is always shown."""
    stream = fit.Hint("STREAM-TE", {"mode": "block", "stream_modules": ("transformer", "text_encoder")},
                      ("text_encoder",))
    tiling = fit.Hint("TILING", {"vae_tiling": True})
    peak = fit.PeakEstimate(bytes=33 * GIB, formula_bytes=33 * GIB, stage=stage, weight_bytes=GIB,
                            activation_bytes=32 * GIB)
    message = fit.refusal_message("request 0", (480, 832, 81), peak, 24 * GIB, "--device_gib", CUDA, cfg(),
                                  (stream, tiling))
    assert ("STREAM-TE" in message) is (stage == "text_encoder")
    assert "TILING" in message


def test_a_host_estimate_reads_as_a_sentence_with_and_without_held_weights() -> None:
    from runnerkit.planning.fit import GIB, HostEstimate

    assert HostEstimate(bytes=2 * GIB, modules={}, process_bytes=2 * GIB).describe() == (
        "2.00 GiB (no weights held; + 2.00 GiB process)")
    assert HostEstimate(bytes=7 * GIB, modules={"text_encoder": 4 * GIB}, transient_bytes=GIB,
                        transient_module="transformer", process_bytes=2 * GIB, pinned_bytes=4 * GIB).describe() == (
        "7.00 GiB (held: text_encoder 4.00 GiB, 4.00 GiB of it pinned; + 1.00 GiB loading transformer through host "
        "memory; + 2.00 GiB process)")
    assert HostEstimate(bytes=6 * GIB, modules={"vae": 4 * GIB}, process_bytes=2 * GIB).describe() == (
        "6.00 GiB (held: vae 4.00 GiB, 0.00 GiB of it pinned; + 2.00 GiB process)")
