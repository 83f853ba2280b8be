"""The memory planner (planning/planner.py, plan_report.py) on synthetic estimates: which candidate a
table of machines gets and why, the host-memory terms, the copy volume, the refusal and what it
advises. No model: the estimate is a function of (offload config, shape) written here.

The synthetic pipeline (GiB): text_encoder 4 (streamable only where `te_streams`), transformer 10,
vae 1. A streamable module keeps 10% resident and streams 90% in 10 units through 2 slots; fp8
storage halves the streamed bytes and adds a compute buffer of one bf16 unit per slot (as
`plan_unit_layout` does). Activations at the base shape 480x832x81: text 0.1, transformer 1,
vae 1 (both scale with height x width x frames). On CUDA a peak is ceil(1.1 x formula) + 0.25;
host memory is what the modules keep there + the largest module loaded through it + 2 (process):

    candidate                    device GiB (formula -> estimate)     host GiB
    resident                     16   -> 17.85  (transformer)         10 (transformer, loaded) + 2 -> 12
    model                        11   -> 12.35  (transformer stage)   4 + 10 + 1 + 2 -> 17
    block cpu [transformer]      6.9  -> 7.84   (text stage)          4 + 9 (slabs) + 1 + 1 (resident part) + 2 -> 17
    block cpu [+ text encoder]   5.92 -> 6.76   (vae stage)           (text encoder streamed too)
    block cpu fp8                7.8  -> 8.83   (slots hold fp8 + bf16) 4 + 4.5 + 1 + 1 + 2 -> 12.5
    block disk                   6.9  -> 7.84                         4 + 1.8 (2 staging slabs) + 1 + 1 + 2 -> 9.8
    block disk lazy_load         4.1  -> 4.76   (text stage)          9.8
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.memory import MemoryLimit
from runnerkit.planning import compute as plan_compute
from runnerkit.planning import fit
from runnerkit.planning import report as plan_report
from runnerkit.planning.checks import MemoryChecks
from runnerkit.planning.fit import GIB, MemoryEstimate, MemoryFitError, ModuleFootprint, StageFootprint
from runnerkit.planning.planner import plan_offload

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
BASE = (480, 832, 81)


def synthetic(te_streams: bool = False) -> Any:
    """An estimate function (offload config, shape) -> MemoryEstimate of the module docstring's pipeline."""

    def footprint(gib: float, default: bool, can: bool, off: OffloadConfig) -> ModuleFootprint:
        total = int(gib * GIB)
        if not can or off.mode not in ("block", "phase"):
            return ModuleFootprint(total, stream_default=default)
        unit = total * 9 // 10 // 10
        units = 10 - min(off.resident_blocks, 10)  # resident_blocks of the 10 units stay on the device
        streamed = total * 9 // 10 * units // 10
        stored_unit = unit // 2 if off.weight_dtype == "fp8_e4m3" else unit
        compute = unit if off.weight_dtype == "fp8_e4m3" else 0
        host = units * stored_unit if off.storage == "cpu" else min(2, units) * stored_unit
        return ModuleFootprint(total, stream_resident_bytes=total - streamed,
                               stream_slot_bytes=min(2, units) * (stored_unit + compute), stream_host_bytes=host,
                               stream_default=default)

    def estimate(off: OffloadConfig, shape: tuple[int, int, int]) -> MemoryEstimate:
        h, w, f = shape
        scale = h * w * f / math.prod(BASE)
        return MemoryEstimate(
            modules={"text_encoder": footprint(4, False, te_streams, off),
                     "transformer": footprint(10, True, True, off), "vae": footprint(1, True, False, off)},
            stages=(StageFootprint("text_encoder", "text_encoder", int(0.1 * GIB)),
                    StageFootprint("transformer", "transformer", int(scale * GIB)),
                    StageFootprint("vae_decoder", "vae", int((0.1 if off.vae_tiling else 1) * scale * GIB))),
            hints=() if off.vae_tiling else (fit.Hint("offload.vae_tiling=true (a family hint)", {"vae_tiling": True}),))

    return estimate


def config(**offload: Any) -> Any:
    return load_runner_config(None, {"model_cls": "x", "model_path": "/x", "offload": {"mode": "auto", **offload}})


def limit(gib: float | None, what: str = "test") -> MemoryLimit | None:
    return None if gib is None else MemoryLimit(int(gib * GIB), what)


def two_passes(off: OffloadConfig) -> int:
    """CFG, one forward per branch in every mode."""
    return 2


def plan(device_gib: float, host_gib: float | None, te_streams: bool = False, passes: Any = two_passes,
         device: torch.device = CUDA, shapes: tuple[tuple[int, int, int], ...] = (BASE,),
         factors: tuple[int, int] = (16, 4), steps: int = 10, keep_resident: bool = True, compute: Any = None,
         **offload: Any) -> Any:
    return plan_offload(config(**offload), shapes, device, synthetic(te_streams), limit(device_gib),
                        limit(host_gib), passes, factors=factors, steps_per_request=steps, keep_resident=keep_resident,
                        compute=compute)


def compute_of(step_seconds: float, steps: int = 10) -> Any:
    """A compute model of `steps` denoising steps of `step_seconds` each on an H100 (eager)."""
    flops = step_seconds * plan_compute.DEVICE_PEAKS[2][2] * 1e12 * plan_compute.EFFICIENCY[False]
    model, _ = plan_compute.compute_model([plan_compute.StageFlops("transformer", steps, flops)],
                                          "NVIDIA H100 80GB HBM3", False)
    assert model is not None and model.stages[0][2] == pytest.approx(step_seconds)
    return model


ladder_plan = partial(plan, keep_resident=False)  # each rung as the ladder writes it


BLOCK = "block streaming from pinned host memory (streams the transformers)"
BLOCK_ALL = "block streaming from pinned host memory (streams text_encoder, transformer)"
FP8 = "block streaming from pinned host memory (weight_dtype fp8_e4m3; streams the transformers)"
DISK = "block streaming from disk (reader pread; streams the transformers)"
LAZY = "block streaming from disk (reader pread; lazy_load; streams the transformers)"
LAZY_ALL = "block streaming from disk (reader pread; lazy_load; streams text_encoder, transformer)"
RESIDENT, MODEL = "resident (mode none)", "model offload (mode model)"
MODEL_KEEP_TRANSFORMER = "model offload (mode model; resident transformer)"
LAZY_ALL_UNITS = LAZY + " (10 units, resident vae)"


def gib_up(nbytes: int) -> str:
    """`nbytes` in GiB rounded up to 0.01, as a refusal names what is needed (exact: Fraction, no float)."""
    return f"{math.ceil(Fraction(nbytes * 100, GIB)) / 100:.2f}"


def named(short: str) -> str:
    """A candidate's full name from the table's shorthand: 'NAME (N units, resident a, b)' adds the resident
    units and modules inside the name's parentheses, as `candidate_name` writes them."""
    if not short.endswith(")") or " (" not in short[:-1] or short.count("(") < 2:
        return short
    base, _, extra = short[:-1].rpartition(" (")
    parts = [p.strip() for p in extra.split(",")]
    units = [f"{p}" + " resident" for p in parts if p.endswith("units")]
    kept = [p.removeprefix("resident ") for p in parts if not p.endswith("units")]
    words = units + ([f"resident {', '.join(kept)}"] if kept else [])
    return base[:-1] + "; " + "; ".join(words) + ")"


@pytest.mark.parametrize("device_gib, host_gib, te_streams, offload, chosen, rejected", [
    # a big GPU: everything resident, nothing rejected
    (80, 64, False, {}, RESIDENT, []),
    # 16 GiB device: the resident peak (17.85) does not fit; model offload with the transformer kept resident
    # (15.76: its stage and the text encoder's visit) copies 5 GiB a request instead of 16
    (16, 64, False, {}, MODEL_KEEP_TRANSFORMER, [(RESIDENT, "device: peak 17.85 GiB > limit 16.00 GiB")]),
    # 10 GiB device: block streaming from host memory, 2 of its 10 units resident beside the slots (9.82)
    (10, 64, False, {}, BLOCK + " (2 units)", [(RESIDENT, "device: peak 17.85"), (MODEL, "device: peak 12.35 GiB > limit 10.00")]),
    # 16 GiB device, 16.5 GiB host: model offload needs 17 GiB of host memory; host streaming fits with 7 of
    # the transformer's units and the vae resident (fewer host slabs: 16.5 GiB host, 15.87 GiB device)
    (16, 16.5, False, {}, BLOCK + " (7 units, resident vae)", [(RESIDENT, "device: peak 17.85"),
                                                              (MODEL, "host: 17.00 GiB > limit 16.50 GiB")]),
    # the same machine with weight_dtype auto: lossless host streaming fits, so fp8 is not taken
    (16, 16.5, False, {"weight_dtype": "auto"}, BLOCK + " (7 units, resident vae)", [(RESIDENT, "device"),
                                                                                   (MODEL, "host: 17.00")]),
    # 7.5 GiB device, text encoder cannot stream: only lazy disk streaming (4.76) fits, 3 units resident (7.40)
    (7.5, 64, False, {}, LAZY + " (3 units)", [(RESIDENT, "device"), (MODEL, "device"), (BLOCK, "device: peak 7.84"),
                                (DISK, "device: peak 7.84")]),
    # ... and when it can: streaming it too from host memory, the vae resident (6.76), copies less
    (7.5, 64, True, {}, BLOCK_ALL + " (resident vae)", [(RESIDENT, "device"), (MODEL, "device"), (BLOCK, "device: peak 7.84 GiB")]),
    # host memory alone: 11.5 GiB host rejects resident (12: the transformer is read through host memory)
    (80, 11.5, False, {}, DISK + " (7 units, resident text_encoder, vae)", [(RESIDENT, "host: 12.00 GiB > limit 11.50"), (MODEL, "host: 17.00"),
                                 (BLOCK, "host: 17.00")]),
    # host memory unknown: not checked
    (80, None, False, {}, RESIDENT, []),
    # explicit keys constrain: storage disk set -> only disk candidates; on 80 GiB every unit stays resident
    (80, 64, False, {"storage": "disk"}, DISK + " (10 units, resident text_encoder, vae)", [
        (RESIDENT, "excluded: `offload.storage`='disk' needs `offload.mode` 'block' or 'phase'"),
        (MODEL, "excluded: `offload.storage`='disk' needs"),
        (BLOCK, "excluded: `offload.storage`='disk' is set in the config (this candidate uses 'cpu')")]),
    # gpu_slots set: it acts in streaming modes only
    (80, 64, False, {"gpu_slots": 3}, BLOCK + " (10 units, resident text_encoder, vae)", [(RESIDENT, "excluded: `offload.gpu_slots` has no effect with "
                                                          "`offload.mode`='none'"),
                                              (MODEL, "excluded: `offload.gpu_slots` has no effect")]),
    # stream_modules set: no resident or model-offload rung, and each streaming rung once, with the list
    (80, 64, True, {"stream_modules": ["text_encoder", "transformer"]}, BLOCK_ALL + " (10 units, resident vae)", [
        (RESIDENT, "excluded: `offload.stream_modules` has no effect with `offload.mode`='none'"),
        (MODEL, "excluded: `offload.stream_modules` has no effect with `offload.mode`='model'")]),
])
def test_the_fastest_candidate_that_fits(device_gib: float, host_gib: float | None, te_streams: bool,
                                         offload: dict[str, Any], chosen: str, rejected: list[tuple[str, str]]) -> None:
    result = plan(device_gib, host_gib, te_streams, **offload)
    assert result.chosen.name == named(chosen)
    assert [e.name for e in result.rejected] == [name for name, _ in rejected]
    for e, (_, reason) in zip(result.rejected, rejected):
        assert reason in e.reason, f"{e.name}: {e.reason!r}"
    assert result.offload.mode != "auto"
    for key, value in offload.items():  # the explicit keys are in the concrete config
        if value != "auto":
            assert getattr(result.offload, key) == (tuple(value) if isinstance(value, list) else value)


def test_chosen_configs_are_concrete_and_complete() -> None:
    assert plan(10, 64).offload == OffloadConfig(mode="block", resident_blocks=2)
    assert plan(16, 64).offload == OffloadConfig(mode="model", resident_modules=["transformer"])
    assert plan(16, 16.5, weight_dtype="auto").offload == OffloadConfig(mode="block", resident_blocks=7,
                                                                       resident_modules=["vae"])
    assert ladder_plan(16, 16.5, weight_dtype="auto").offload == OffloadConfig(mode="block", weight_dtype="fp8_e4m3")
    assert plan(7.5, 64).offload == OffloadConfig(mode="block", storage="disk", reader="pread", lazy_load=True,
                                                  resident_blocks=3)
    assert plan(7.5, 64, te_streams=True).offload == OffloadConfig(
        mode="block", stream_modules=["text_encoder", "transformer"], resident_modules=["vae"])
    # an explicit reader replaces the ladder's pread
    assert plan(80, 64, storage="disk", reader="mmap").offload == OffloadConfig(
        mode="block", storage="disk", resident_blocks=10, resident_modules=["text_encoder", "vae"])
    # the ladder alone
    assert ladder_plan(10, 64).offload == OffloadConfig(mode="block")
    assert ladder_plan(16, 64).offload == OffloadConfig(mode="model")


@pytest.mark.parametrize("step_seconds", [None, 0.3, 5.0], ids=["copies", "copy-bound", "compute-bound"])
def test_more_memory_never_gives_a_slower_plan(step_seconds: float | None) -> None:
    """Over a grid of device and host limits, the chosen plan's estimated seconds per request (copies only, or
    with a compute model: each step the larger of compute and copy) never grow when either limit grows (the
    planner takes the fastest of every candidate that fits, not the first rung)."""
    devices = [4.8, 6, 7.5, 8, 9, 10, 12, 14, 16, 17, 18, 24, 80]
    hosts = [10, 11.5, 12.5, 14, 16.5, 17, 20, 64]
    compute = compute_of(step_seconds) if step_seconds is not None else None
    seconds: dict[tuple[float, float], float] = {}
    for d in devices:
        for h in hosts:
            try:
                chosen = plan(d, h, compute=compute).chosen
            except MemoryFitError:
                seconds[d, h] = math.inf
                continue
            seconds[d, h] = chosen.copy_seconds if compute is None else chosen.request_seconds
            assert chosen.rank[0] == seconds[d, h]
    pairs = [((d, h), (d2, h2)) for d in devices for h in hosts for d2 in devices for h2 in hosts
             if d2 >= d and h2 >= h]
    slower = [(a, b, seconds[a], seconds[b]) for a, b in pairs if seconds[b] > seconds[a] + 1e-9]
    assert not slower, slower[:5]
    floor = 0.0 if compute is None else 10 * compute.stages[0][2]  # resident: the compute alone
    assert seconds[80, 64] == pytest.approx(floor) and seconds[4.8, 64] > seconds[10, 64] >= seconds[16, 64] >= floor
    assert seconds[4.8, 64] > floor


def test_the_fastest_variant_is_chosen_over_the_first_rung_that_fits() -> None:
    """16 GiB: plain model offload fits (copies 4 + 10 + 1 GiB a request) but keeping the transformer resident
    also fits (15.76 GiB) and copies 5; at 10 GiB the most streamed units that fit stay resident: 2 fit
    (9.82 GiB), 3 would not."""
    ladder = ladder_plan(16, 64).chosen
    kept = plan(16, 64).chosen
    assert ladder.name == MODEL and kept.name == MODEL_KEEP_TRANSFORMER
    assert ladder.copy_seconds == pytest.approx(15 * GIB / plan_report.H2D_PINNED_BYTES_PER_S)
    assert kept.copy_seconds == pytest.approx(5 * GIB / plan_report.H2D_PINNED_BYTES_PER_S)
    assert kept.peak is not None and round(kept.peak.bytes / GIB, 2) == 15.76
    two = plan(10, 64).offload
    assert two.resident_blocks == 2
    three = plan(10, 64, resident_blocks=3)
    assert three.offload.resident_blocks == 3 and three.offload.storage == "disk"  # explicit: kept, via disk
    est = synthetic()(OffloadConfig(mode="block", resident_blocks=3), BASE)
    cfg = config().model_copy(update={"offload": OffloadConfig(mode="block", resident_blocks=3)})
    assert fit.peak_of(est, cfg, CUDA).bytes > 10 * GIB  # 3 units from host memory do not fit 10 GiB


def test_explicit_resident_keys_are_kept_as_set() -> None:
    """Explicit `resident_modules` / `resident_blocks` constrain the plan: no other set is tried."""
    result = plan(24, 64, resident_modules=["vae"])
    # every unit resident beside the vae (block streaming with nothing left to stream) copies only the text
    # encoder: faster than model offload with the vae resident, which copies the transformer too
    assert result.offload == OffloadConfig(mode="block", resident_modules=["vae"], resident_blocks=10)
    assert [e.name for e in result.rejected] == [RESIDENT]
    assert result.rejected[0].reason.startswith("excluded: `offload.resident_modules` has no effect with "
                                                "`offload.mode`='none'")
    assert plan(80, 64, resident_blocks=4).offload.resident_blocks == 4


def test_each_plan_kind_is_worded_per_module() -> None:
    rows = {r.name: r.placement for r in plan_report.module_rows(plan(7.5, 64, te_streams=True).chosen, CUDA)}
    assert rows == {"text_encoder": "streamed from pinned host memory", "transformer":
                    "streamed from pinned host memory", "vae": "resident"}
    rows = {r.name: r.placement for r in plan_report.module_rows(plan(7.5, 64).chosen, CUDA)}
    assert rows == {"text_encoder": "visits the device for its stage",
                    "transformer": "streamed from disk, 3 units resident, built per request",
                    "vae": "visits the device for its stage"}


def test_stream_modules_naming_a_module_that_cannot_stream_is_refused() -> None:
    with pytest.raises(MemoryFitError, match=r"Every candidate is excluded: .*`offload.stream_modules` names "
                                             r"\['text_encoder'\], which cannot stream \(modules that can: "
                                             r"\['transformer'\]\)"):
        plan(80, 64, stream_modules=["text_encoder", "transformer"])


def test_the_largest_shape_decides() -> None:
    small = (240, 416, 21)
    assert ladder_plan(10, 64, shapes=(small,)).chosen.name == BLOCK
    # ~5x the frames of BASE: the model-offload transformer stage, 10 + 4.95 GiB, grows beyond 16 GiB
    big = (480, 832, 401)
    result = ladder_plan(16, 64, shapes=(small, BASE, big))
    assert result.chosen.name == BLOCK
    assert result.chosen.peak_shape == big
    reason = result.rejected[1].reason
    assert "device: peak 16.70 GiB > limit 16.00 GiB (stage transformer, shape 480x832x401)" in reason
    assert ladder_plan(16, 64, shapes=(small, BASE)).chosen.name == MODEL


def test_on_the_cpu_resident_is_taken_and_said_why() -> None:
    result = plan(64, 64, device=CPU)
    assert result.chosen.name == RESIDENT and result.rejected == []
    assert "the device is the CPU" in result.why
    with pytest.raises(MemoryFitError) as err:  # the CPU's peak is not lowered by offload: refused, not streamed
        plan(10, None, device=CPU)
    assert str(err.value).startswith(f"`offload.mode`='auto' on the CPU: {RESIDENT} needs 18.11 GiB, 8.11 GiB over "
                                     "the limit (10.00 GiB: test); offload cannot lower it"), str(err.value)


def test_on_the_cpu_host_bytes_are_the_largest_shapes() -> None:
    """On the CPU the host bytes are the device peak, which grows with the shape: the largest shape decides
    the host check as it does the device's. Resident weights 4 + 10 + 1 = 15 GiB; BASE peaks in the transformer
    stage (15 + 1 GiB), the small shape in the text encoder's (15 + 0.1 GiB); CPU: x1.1 + 0.5 GiB fixed."""
    small = (240, 416, 21)
    big_host = math.ceil(16 * GIB * 1.1) + 512 * 1024**2
    small_host = math.ceil((15 * GIB + int(0.1 * GIB)) * 1.1) + 512 * 1024**2
    assert small_host < int(17.8 * GIB) < big_host  # the host limit below tells the two shapes apart
    result = plan(64, 20, device=CPU, shapes=(small, BASE))
    assert result.chosen.name == RESIDENT and result.chosen.host is not None
    assert result.chosen.host.bytes == big_host
    with pytest.raises(MemoryFitError) as err:  # host limit below the device limit: refused for the big shape
        plan(64, 17.8, device=CPU, shapes=(small, BASE))
    over = big_host - int(17.8 * GIB)
    assert (f"on the CPU: {RESIDENT} needs {gib_up(big_host)} GiB, {gib_up(over)} GiB "
            "over the host limit (17.80 GiB: test)") in str(err.value), str(err.value)


def test_explicit_fp8_reaches_the_fp8_rung() -> None:
    """`weight_dtype: fp8_e4m3` set with mode auto: the rungs that store weights as they are excluded, the fp8
    host-streaming rung taken (device 8.83 GiB, host 12.5 GiB: both fit)."""
    result = ladder_plan(80, 64, weight_dtype="fp8_e4m3")
    assert result.chosen.name == FP8
    assert result.offload == OffloadConfig(mode="block", weight_dtype="fp8_e4m3")
    assert [e.name for e in result.rejected] == [RESIDENT, MODEL, BLOCK]
    assert result.rejected[2].reason == ("excluded: `offload.weight_dtype`='fp8_e4m3' is set in the config (this "
                                         "candidate uses 'same')")


def test_pageable_host_memory_copies_at_the_pageable_rate() -> None:
    """`pin_memory: false`: the streamed transformer's copy (90% of 10 GiB, 2 passes) is timed at the pageable
    H2D rate, not the pinned one."""
    result = ladder_plan(10, 64, pin_memory=False)
    assert result.chosen.name == "block streaming from host memory (streams the transformers)"
    rows = {r.name: r for r in plan_report.module_rows(result.chosen, CUDA)}
    step = 2 * (int(10 * GIB) * 9 // 10)
    assert rows["transformer"].copy_step_bytes == step
    assert plan_report.H2D_PAGEABLE_BYTES_PER_S != plan_report.H2D_PINNED_BYTES_PER_S
    assert {r.bytes_per_s for r in rows.values()} == {plan_report.H2D_PAGEABLE_BYTES_PER_S}
    report = plan_report.report(result, config(pin_memory=False).offload)
    assert report["copy_seconds_per_step_estimate"] == round(step / plan_report.H2D_PAGEABLE_BYTES_PER_S, 4)
    assert {m["assumed_gb_per_s"] for m in report["modules"]} == {plan_report.H2D_PAGEABLE_BYTES_PER_S / 1e9}


def test_a_streamed_text_encoder_is_copied_once_per_request_whatever_the_cfg_passes() -> None:
    """The text encoder runs once per prompt: its streamed 90% of 4 GiB is copied once per request, not once
    per CFG pass; the offloaded VAE adds its 1 GiB; the step's copy is the transformer's (2 passes)."""
    result = ladder_plan(7.5, 64, te_streams=True)  # two_passes
    assert result.chosen.name == BLOCK_ALL and result.passes_per_step == 2
    rows = {r.name: r for r in plan_report.module_rows(result.chosen, CUDA)}
    te = int(4 * GIB) * 9 // 10
    assert (rows["text_encoder"].copy_request_bytes, rows["text_encoder"].copy_step_bytes) == (te, 0)
    assert (rows["vae"].copy_request_bytes, rows["vae"].copy_step_bytes) == (GIB, 0)
    assert rows["transformer"].copy_step_bytes == 2 * (int(10 * GIB) * 9 // 10)
    report = plan_report.report(result, config().offload)
    assert report["copy_per_request_gib"] == round((te + GIB) / GIB, 3)
    assert report["copy_seconds_per_request_estimate"] == round((te + GIB) / plan_report.H2D_PINNED_BYTES_PER_S, 4)


def test_host_bytes_terms() -> None:
    est = synthetic()(OffloadConfig(mode="block"), BASE)
    cfg = config().model_copy(update={"offload": OffloadConfig(mode="block")})
    host = fit.host_bytes_of(est, cfg, CUDA)
    slabs = 10 * (int(10 * GIB) * 9 // 10 // 10)
    assert host.modules == {"text_encoder": 4 * GIB, "transformer": slabs, "vae": GIB}
    assert (host.transient_module, host.transient_bytes) == ("transformer", int(10 * GIB) - int(10 * GIB) * 9 // 10)
    assert host.bytes == 5 * GIB + slabs + host.transient_bytes + fit.PROCESS_HOST_BYTES
    resident = fit.host_bytes_of(est, cfg.model_copy(update={"offload": OffloadConfig(mode="none")}), CUDA)
    assert resident.modules == {} and resident.transient_bytes == 10 * GIB  # the largest module is read through host
    on_cpu = fit.host_bytes_of(est, cfg, CPU)
    assert on_cpu.bytes == fit.peak_of(est, cfg, CPU).bytes  # the device is the host


@pytest.mark.parametrize("passes", [2, 1])
def test_copy_volume_per_step_follows_cfg(passes: int) -> None:
    result = ladder_plan(10, 64, passes=lambda off: passes)
    report = plan_report.report(result, config().offload)
    streamed = 10 * (int(10 * GIB) * 9 // 10 // 10)
    rows = {m["name"]: m for m in report["modules"]}
    assert rows["transformer"]["placement"] == "streamed from pinned host memory"
    assert rows["transformer"]["copy_per_step_gib"] == round(passes * streamed / GIB, 3)
    assert report["copy_seconds_per_step_estimate"] == round(passes * streamed / plan_report.H2D_PINNED_BYTES_PER_S, 4)
    assert rows["text_encoder"]["placement"] == "visits the device for its stage"
    assert rows["text_encoder"]["copy_per_request_gib"] == 4.0 and rows["text_encoder"]["copy_per_step_gib"] == 0
    assert report["passes_per_step"] == passes
    assert report["offload"]["mode"] == "block" and report["requested"] == {"mode": "auto"}
    assert [r["candidate"] for r in report["rejected"]] == [RESIDENT, MODEL]


def test_passes_per_step_are_each_candidates_own() -> None:
    """With CFG and a family that runs both branches through each block in one pass (`CFG_ONE_PASS`), mode
    block counts 1 pass per step and every other mode 2: asked of the runner's own hook per candidate."""
    cfg = config()
    runner = SimpleNamespace(config=cfg, CFG_ONE_PASS=True)
    hook = MemoryChecks(runner).denoise_passes_per_step  # type: ignore[arg-type]
    result = ladder_plan(7.5, 64, te_streams=True, passes=hook)
    assert result.chosen.name == BLOCK_ALL and result.passes_per_step == 1
    report = plan_report.report(result, cfg.offload)
    streamed = 10 * (int(10 * GIB) * 9 // 10 // 10)
    assert report["passes_per_step"] == 1 and report["copy_per_step_gib"] == round(streamed / GIB, 3)
    rejected = {r["candidate"]: r for r in report["rejected"]}
    assert [(name, r["passes_per_step"]) for name, r in rejected.items()] == [(RESIDENT, 2), (MODEL, 2), (BLOCK, 1)]
    assert rejected[BLOCK]["copy_per_step_gib"] == round(streamed / GIB, 3)
    assert rejected[BLOCK]["copy_seconds_per_step_estimate"] == round(streamed / plan_report.H2D_PINNED_BYTES_PER_S, 4)
    assert rejected[MODEL]["copy_per_step_gib"] == 0.0  # nothing streams: 2 passes copy nothing
    # a family that runs one forward per CFG branch: 2 passes in mode block too
    runner.CFG_ONE_PASS = False
    assert ladder_plan(7.5, 64, te_streams=True, passes=hook).passes_per_step == 2


def test_disk_copies_at_the_disk_rate() -> None:
    rows = {r.name: r for r in plan_report.module_rows(ladder_plan(7.5, 64).chosen, CUDA)}
    assert rows["transformer"].placement == "streamed from disk, built per request"
    assert rows["transformer"].bytes_per_s == plan_report.DISK_BYTES_PER_S


def test_the_log_block_names_every_module_and_rejection() -> None:
    text = plan_report.describe(ladder_plan(16, 16.5))
    assert text.splitlines()[0].startswith(f"memory plan (offload.mode auto): {DISK}")
    for needle in ("text_encoder", "transformer", "vae", "streamed from disk", "copy per denoising step (estimate)",
                   f"rejected: {MODEL}: host: 17.00 GiB > limit 16.50 GiB"):
        assert needle in text, needle


# ---- nothing fits ---------------------------------------------------------------------------------
def test_refusal_names_the_missing_gib_on_the_device() -> None:
    with pytest.raises(MemoryFitError) as err:
        plan(4, 64)
    msg = str(err.value)
    # closest: lazy disk streaming, 4.76 GiB at the text-encoder stage (weights: no smaller shape helps)
    assert f"Closest: {LAZY} needs 4.76 GiB on the device (0.76 GiB missing" in msg, msg
    # the peak is the text encoder's stage: tiled VAE decoding would not fit, so it is not offered; what does
    # not shrink with the shape is named as the estimate splits it (weights, margin, fixed overhead)
    assert "vae_tiling" not in msg, msg
    assert msg.endswith(f"To fit: no smaller size of the aspect ratio 15:26 in place of [480, 832, 81] fits: at "
                        f"240x416x1 {LAZY} still needs 4.76 GiB (4.00 GiB weights, 0.25 GiB fixed overhead); a device "
                        "with more memory"), msg


def test_refusal_names_a_fixed_overhead_above_the_limit() -> None:
    with pytest.raises(MemoryFitError) as err:
        plan(0.2, 64)
    msg = str(err.value)
    assert "its fixed overhead alone (0.25 GiB) exceeds the limit; a device with more memory" in msg, msg


@pytest.mark.parametrize("device_gib, tiling_fits", [(6.0, True), (5.5, False)])
def test_refusal_offers_a_family_hint_only_where_it_fits(device_gib: float, tiling_fits: bool) -> None:
    """Host storage only, text encoder streamed: the closest candidate peaks in the VAE decode (6.76 GiB, named 6.77: rounded up);
    tiled decoding brings it to 5.77 GiB by the same estimate: advice at a 6 GiB device, none at 5.5."""
    with pytest.raises(MemoryFitError) as err:
        plan(device_gib, 64, te_streams=True, storage="cpu")
    msg = str(err.value)
    assert f"Closest: {BLOCK_ALL} needs 6.77 GiB on the device" in msg, msg
    offered = f"offload.vae_tiling=true (a family hint): {BLOCK_ALL} then fits (5.77 GiB on the device)"
    assert (offered in msg) == tiling_fits, msg
    assert ("vae_tiling" in msg) == tiling_fits, msg


def test_smaller_shapes_are_judged_with_every_planned_shape() -> None:
    """Two shapes: 61 frames at 480x832 would fit in place of 81 (test below), but the second shape, 73
    frames, still would not: no frame count is offered, and the refusal names the shape that stays too big."""
    with pytest.raises(MemoryFitError) as err:
        plan(4.2, 64, te_streams=True, shapes=(BASE, (480, 832, 73)))
    msg = str(err.value)
    assert "target_video_length" not in msg and "target_height x target_width" not in msg, msg
    assert "in place of [480, 832, 81] fits (the other shapes as planned)" in msg, msg
    assert "at shape [480, 832, 73]" in msg, msg


def test_refusal_names_the_largest_frames_and_size_that_fit() -> None:
    # text encoder streamed too: the lazy peak is the transformer stage, which shrinks with the shape
    with pytest.raises(MemoryFitError) as err:
        plan(4.2, 64, te_streams=True)
    msg = str(err.value)
    # 4.2 GiB: formula <= (4.2 - 0.25) / 1.1 = 3.59; transformer stage 1.0 resident + 1.8 slots + activations
    # -> activations <= 0.79 GiB -> frames f with f / 81 <= 0.79 -> 61 (4n+1)
    assert "target_video_length 61 at 480x832" in msg, msg
    # 480x832 is 15:26 = 2 x (240x416) on the 16-pixel grid: the one smaller size of that ratio
    assert f"target_height x target_width 240x416 at 81 frames (aspect ratio 15:26; {LAZY_ALL})" in msg, msg


def test_refusal_names_the_missing_host_memory() -> None:
    with pytest.raises(MemoryFitError) as err:
        ladder_plan(80, 9)  # (disk streaming with the text encoder kept resident fits 9 GiB: plan(80, 9) does)
    msg = str(err.value)
    assert f"Closest: {DISK} needs 9.80 GiB of host memory (0.80 GiB missing)" in msg, msg
    assert "raise `memory.host_limit_gib`" in msg, msg


def test_refusal_names_the_host_memory_of_the_rungs_least_memory_variant() -> None:
    """Keeping the text encoder and the VAE resident beside disk streaming drops their host copies (9.80 ->
    7.80 GiB): the refusal names that variant and its figure, and the figure it names is enough to fit."""
    with pytest.raises(MemoryFitError) as err:
        plan(80, 6)
    msg = str(err.value)
    closest = f"{DISK[:-1]}; resident text_encoder, vae)"
    assert f"Closest: {closest} needs 7.80 GiB of host memory (1.80 GiB missing)" in msg, msg
    fitted = plan(80, 7.8)
    assert fitted.chosen.host is not None and fitted.chosen.host.bytes <= 7.8 * GIB


def test_refusal_names_weight_dtype_auto_when_fp8_would_fit() -> None:
    with pytest.raises(MemoryFitError) as err:
        ladder_plan(16, 14, storage="cpu")  # disk excluded by the explicit storage; fp8 not allowed
    msg = str(err.value)
    assert ("To fit: `offload.weight_dtype`='auto' (lets the planner store streamed weights in lossy fp8_e4m3): "
            f"{FP8} fits") in msg, msg


def test_refusal_names_the_explicit_key_that_excludes_a_fitting_candidate() -> None:
    with pytest.raises(MemoryFitError) as err:
        plan(5, 64, lazy_load=False)
    msg = str(err.value)
    assert f"To fit: {LAZY} fits (4.76 GiB on the device), but it is excluded: `offload.lazy_load`=False is set" in msg


def test_plan_refuses_a_concrete_mode() -> None:
    cfg = load_runner_config(None, {"model_cls": "x", "model_path": "/x", "offload": {"mode": "none"}})
    with pytest.raises(ValueError, match="resolves `offload.mode`='auto' only"):
        plan_offload(cfg, (BASE,), CUDA, synthetic(), limit(80), limit(64), two_passes)


def test_weight_dtype_auto_needs_mode_auto() -> None:
    with pytest.raises(ValueError, match="`offload.weight_dtype`='auto' lets the memory planner choose"):
        OffloadConfig(mode="block", weight_dtype="auto")
    assert hash(OffloadConfig(mode="block", stream_modules=["transformer"]))  # hashable: families cache by it


def test_on_the_cpu_the_refusal_leads_with_the_reason_and_logs_the_candidates() -> None:
    """CPU, 17.5 GiB: resident needs ceil(1.1 x 16 GiB) + 0.5 = 18.10 GiB. Fewer frames f fit where
    15 + f/81 <= (17.5 - 0.5) / 1.1, f <= 36.8 -> 33 (4n+1); half the size (240x416, a quarter of the pixels)
    at 81 frames needs 1.1 x 15.25 + 0.5 = 17.28 GiB. The candidates the CPU does not evaluate go to DEBUG."""
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{message}")
    try:
        with pytest.raises(MemoryFitError) as err:
            plan(17.5, None, device=CPU)
    finally:
        logger.remove(sink)
    msg = str(err.value)
    assert msg == (f"`offload.mode`='auto' on the CPU: {RESIDENT} needs 18.11 GiB, 0.61 GiB over the limit (17.50 GiB: "
                   "test); offload cannot lower it (the device is the host). To fit: target_video_length 33 at "
                   "480x832; or target_height x target_width 240x416 at 81 frames (aspect ratio 15:26)"), msg
    assert len(msg) < 300
    skipped = "not evaluated: on the CPU the first allowed candidate is taken"
    assert [line.strip() for line in lines if line.startswith("memory plan candidate: ")] == [
        f"memory plan candidate: {RESIDENT}: device: peak 18.10 GiB > limit 17.50 GiB (stage transformer, shape "
        "480x832x81)", *(f"memory plan candidate: {name}: {skipped}" for name in (MODEL, BLOCK, DISK, LAZY))]


def test_smaller_sizes_keep_the_aspect_ratio_on_the_family_grid() -> None:
    """LTX-2's rules (64-pixel grid, 8n+1 frames): 128x192 is 2:3 and 2 x 3 cells, the smallest size of that
    ratio: none smaller is offered, the fallback is 128x192 at 1 frame. 256x384 (2:3, 4 x 6 cells) halves to
    128x192, which fits on the CPU at 17.3 GiB (1.1 x 15.1 + 0.5 = 17.11 GiB); 89 frames (8n+1) do too:
    15 + 256 x 384 x f / (480 x 832 x 81) <= 15.27 -> f <= 89.7."""
    from runnerkit.models.ltx2.runner import LTX2Runner

    factors = (LTX2Runner.SPATIAL_FACTOR, LTX2Runner.TEMPORAL_FACTOR)
    assert factors == (64, 8)
    with pytest.raises(MemoryFitError) as err:
        plan(4, 64, shapes=((128, 192, 121),), factors=factors)
    assert str(err.value).endswith(
        f"To fit: no smaller size keeps the aspect ratio 2:3 of [128, 192, 121] on the family's 64-pixel grid: at "
        f"128x192x1 {LAZY} still needs 4.76 GiB (4.00 GiB weights, 0.25 GiB fixed overhead); a device with more "
        "memory"), str(err.value)
    LTX2Runner.validate_shape(128, 192, 1)
    with pytest.raises(MemoryFitError) as err:
        plan(17.3, None, device=CPU, shapes=((256, 384, 121),), factors=factors)
    assert str(err.value).endswith("To fit: target_video_length 89 at 256x384; or target_height x target_width "
                                   "128x192 at 121 frames (aspect ratio 2:3)"), str(err.value)
    LTX2Runner.validate_shape(256, 384, 89)


def test_pinned_host_memory_is_budgeted_apart() -> None:
    """Model offload pins every offloaded module (4 + 10 + 1 GiB at 16 GiB with the transformer kept: 4 + 1);
    host streaming the slabs too; disk streaming only its staging slabs. A pinned limit below a plan's pinned
    bytes rejects it whatever the host limit; pin_memory false pins nothing."""
    est = synthetic()(OffloadConfig(mode="model"), BASE)
    cfg = config().model_copy(update={"offload": OffloadConfig(mode="model")})
    host = fit.host_bytes_of(est, cfg, CUDA)
    assert host.pinned_bytes == 15 * GIB and host.bytes == 15 * GIB + fit.PROCESS_HOST_BYTES
    pageable = cfg.model_copy(update={"offload": OffloadConfig(mode="model", pin_memory=False)})
    assert fit.host_bytes_of(est, pageable, CUDA).pinned_bytes == 0
    free = plan_offload(config(), (BASE,), CUDA, synthetic(), limit(16), limit(64), two_passes, steps_per_request=10)
    assert free.offload == OffloadConfig(mode="model", resident_modules=["transformer"])  # pins 5 GiB
    tight = plan_offload(config(), (BASE,), CUDA, synthetic(), limit(16), limit(64), two_passes, steps_per_request=10,
                         pinned_limit=limit(4.5, "config memory.pinned_limit_gib"))
    assert tight.chosen.host is not None and tight.chosen.host.pinned_bytes <= 4.5 * GIB
    assert "pinned host memory: 15.00 GiB > limit 4.50 GiB (config memory.pinned_limit_gib)" in next(
        e.reason for e in tight.rejected if e.name == MODEL)
    report = plan_report.report(tight, config().offload)
    assert report["host_pinned_gib"] == round(tight.chosen.host.pinned_bytes / GIB, 3)


# ---- the time model: compute against copies (planning/compute.py) ------------------------------
def test_a_copy_hidden_under_compute_ranks_before_a_smaller_copy_that_is_not() -> None:
    """16 GiB, 5 s of compute a step: model offload with the transformer resident copies the text encoder and the
    VAE once per request (5 GiB, 0.27 s, not overlapped); block streaming with 6 of 10 units, the text encoder and
    the VAE resident (the most that fit) copies 4 units x 2 passes every step (7.2 GiB, 0.39 s), hidden under the
    step's compute.
    Copies alone rank model offload first; the request time ranks block streaming first (50 s against 50.27 s).
    From pageable memory the copy runs in line (compute + copy): model offload again."""
    copies = plan(16, 64)
    assert copies.chosen.name == MODEL_KEEP_TRANSFORMER and copies.chosen.request_seconds is None
    timed = plan(16, 64, compute=compute_of(5.0))
    assert timed.offload == OffloadConfig(mode="block", resident_blocks=6, resident_modules=["text_encoder", "vae"])
    step_copy = 2 * 4 * (int(10 * GIB) * 9 // 10 // 10) / plan_report.H2D_PINNED_BYTES_PER_S
    assert 0 < step_copy < 5.0
    assert timed.chosen.request_seconds == pytest.approx(10 * 5.0)  # every copy hidden
    model = timed.chosen.copy_seconds
    assert model == pytest.approx(10 * step_copy) and model > copies.chosen.copy_seconds
    assert timed.why.startswith("the fastest that fits: an estimated 50.00 s per request (compute and copies)")
    pageable = plan(16, 64, compute=compute_of(5.0), pin_memory=False)
    assert pageable.offload == OffloadConfig(mode="model", resident_modules=["transformer"], pin_memory=False)
    assert pageable.chosen.request_seconds == pytest.approx(50 + 5 * GIB / plan_report.H2D_PAGEABLE_BYTES_PER_S)


def test_request_seconds_take_the_larger_of_compute_and_copy_per_step() -> None:
    """Copy-bound (0.3 s of compute against a 0.87 s streamed copy per step, 10 GiB device): the step costs the
    copy; the report carries the time, the compute model and each module's copy per step."""
    result = ladder_plan(10, 64, compute=compute_of(0.3))
    assert result.chosen.name == BLOCK
    rows = {r.name: r for r in plan_report.module_rows(result.chosen, CUDA)}
    step = rows["transformer"].copy_step_bytes / plan_report.H2D_PINNED_BYTES_PER_S
    request = (4 + 1) * GIB / plan_report.H2D_PINNED_BYTES_PER_S  # text encoder and VAE visit once
    assert step > 0.3 and result.chosen.request_seconds == pytest.approx(10 * step + request)
    report = plan_report.report(result, config().offload)
    assert report["estimated_request_seconds"] == round(10 * step + request, 3)
    assert report["compute_estimate"]["stages"] == [{"name": "transformer", "steps": 10, "seconds_per_step": 0.3}]
    assert report["compute_note"] is None
    assert {m["name"]: m["copy_seconds_per_step_estimate"] for m in report["modules"]} == {
        "text_encoder": 0.0, "transformer": round(step, 4), "vae": 0.0}
    text = plan_report.describe(result)
    assert "  request time (estimate): " + f"{10 * step + request:.2f} s, the least of the plans that fit" in text


@pytest.mark.parametrize("minimum_frames, offered", [(65, None), (41, 61)])
def test_smaller_shapes_the_estimate_refuses_do_not_fit(minimum_frames: int, offered: int | None) -> None:
    """A family whose estimate refuses shapes below its networks' minimum (ValueError, as LTX-2.5's diffusion
    decoder below its window): the refusal's search for a smaller shape counts them as not fitting instead of
    failing with the estimate's error. 61 frames would fit (test above): offered where the estimate takes it;
    refused below 65 frames (and below 480 px), nothing is offered and the last resort names no shape."""
    inner = synthetic(te_streams=True)

    def estimate(off: OffloadConfig, shape: tuple[int, int, int]) -> MemoryEstimate:
        if shape[2] < minimum_frames or shape[0] < 480:
            raise ValueError(f"latent grid of {shape} is smaller than the decoder's window")
        return inner(off, shape)

    with pytest.raises(MemoryFitError) as err:
        plan_offload(config(), (BASE,), CUDA, estimate, limit(4.2), limit(64), two_passes, factors=(16, 4),
                     steps_per_request=10)
    msg = str(err.value)
    if offered is None:
        assert msg.endswith("To fit: no smaller size of the aspect ratio 15:26 in place of [480, 832, 81] fits (the "
                            "smallest the estimate takes was tried); a device with more memory"), msg
    else:
        assert f"To fit: target_video_length {offered} at 480x832" in msg, msg
