"""`runnerkit plan` (runnerkit/tools/plan.py): the memory plan of a config without its checkpoint.

- Every shipped real-size config plans at 80 GiB / 128 GiB and at 16 / 32 GiB with no checkpoint on
  disk (the working folder is a fresh tmp folder, so the configs' relative `model_path`s do not exist):
  JSON with the documented keys, the limits given, a fitting plan within them, the exit status.
- One config's values against the planner called directly (planner.plan_offload on the family's own
  estimate of the release architecture): the no-load path changes nothing the plan says.
- A checkpoint on disk and the same architecture from the config alone give the same plan.
- The run is not weakened: a `for_plan` runner does not load; a run's runner still cannot estimate
  without its checkpoint.
- Bad input: exit 2 with a message naming the flag or file.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from runnerkit import cgroup, memory
from runnerkit.cli import main as cli_main
from runnerkit.config import OffloadConfig, RunnerConfig, load_runner_config
from runnerkit.memory import MemoryLimit
from runnerkit.models.ltx2 import estimate as est
from runnerkit.models.ltx2 import plan_sources
from runnerkit.models.ltx2.arch import LTX2_19B_ARCH, LTX23_22B_ARCH
from runnerkit.models.ltx2.estimate import ltx2_estimate
from runnerkit.models.ltx2.flops import ltx2_step_flops
from runnerkit.models.ltx2.runner import DISTILLED_SIGMAS, STAGE2_SIGMAS, LTX2Runner
from runnerkit.models.wan.runner import WanT2VRunner
from runnerkit.planning import compute as plan_compute
from runnerkit.planning import fit
from runnerkit.planning import planner
from runnerkit.planning import report as plan_report
from runnerkit.runners.base import LifecycleError
from runnerkit.tools.plan import describe, planner_seconds
from test_cases._cli import restore_logger  # noqa: F401 (autouse fixture)
from test_cases.conftest import REPO, TINY_CONFIG

GIB = 1024**3
CUDA = torch.device("cuda")
REAL_CONFIGS = sorted(p for p in (REPO / "configs").glob("*/*.json") if "tiny" not in p.name)
LTX2 = ["text_encoder", "connectors", "transformer", "latent_upsampler", "vae", "audio_decoder"]
WAN_T2V = ["text_encoder", "transformer", "vae"]
WAN_I2V = ["text_encoder", "image_encoder", "transformer", "vae"]  # Wan2.1 i2v / flf2v: the CLIP tower
WAN22_MOE = ["text_encoder", "transformer", "transformer_2", "vae"]  # Wan2.2 i2v takes no CLIP tokens
QWEN = ["text_encoder", "transformer", "vae"]
#: The modules each real config's estimate holds, in order (none: the family gives no estimate).
LTX25_T2AV = ["text_encoder", "connectors", "transformer", "latent_upsampler", "audio_decoder", "duration_head",
              "diffusion_decoder"]
LTX25_I2AV = [*LTX25_T2AV[:4], "vae", *LTX25_T2AV[4:]]  # the video VAE for the first frame's encoding only
MODULES = {"ltx23_i2av_22b_distilled": LTX2, "ltx23_t2av_22b_distilled": LTX2, "ltx25_i2av_22b_distilled": LTX25_I2AV,
           "ltx25_t2av_22b_distilled": LTX25_T2AV, "qwen_image_edit_plus_20b": QWEN,
           "qwen_image_t2i_20b": QWEN, "qwen_image_t2i_20b_lightning8": QWEN, "wan22_moe_i2v_a14b": WAN22_MOE,
           "wan22_moe_t2v_a14b": WAN22_MOE, "wan_flf2v_14b": WAN_I2V, "wan_i2v_14b": WAN_I2V, "wan_t2v_1.3b": WAN_T2V,
           "wan_t2v_14b": WAN_T2V, "wan_t2v_14b_distill4": WAN_T2V}
KEYS = {"offload", "device_gib", "host_gib", "estimated_request_seconds", "modules", "fits", "refusal", "shapes",
        "device_limit_gib", "host_limit_gib", "rejected", "estimate_sources", "candidate", "requested"}
MODULE_KEYS = {"name", "placement", "device_bytes", "host_bytes", "copy_bytes_per_step", "copy_bytes_per_request"}


def run_plan(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, dict[str, Any], str]:
    """`runnerkit plan ... --json` in-process: (exit status, the JSON object, stderr)."""
    capsys.readouterr()
    rc = cli_main(["plan", *map(str, argv), "--json"])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out) if captured.out else {}, captured.err


@pytest.fixture
def no_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty folder: the configs' `models/...` paths exist nowhere."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_real_config_is_listed() -> None:
    assert sorted(MODULES) == [p.stem for p in REAL_CONFIGS]


@pytest.mark.parametrize("limits", [(80, 128), (16, 32)], ids=["80-128", "16-32"])
@pytest.mark.parametrize("config", REAL_CONFIGS, ids=lambda p: p.stem)
def test_every_real_config_plans_without_its_checkpoint(config: Path, limits: tuple[int, int], no_checkpoints: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(config.read_text())
    assert not Path(data["model_path"]).exists()
    device_gib, host_gib = limits
    rc, out, err = run_plan(capsys, "--config_json", config, "--device_gib", device_gib, "--host_gib", host_gib)
    assert KEYS <= set(out), (rc, err)
    assert rc == (1 if out["fits"] is False else 0), err
    assert (out["device_limit_gib"], out["host_limit_gib"]) == (device_gib, host_gib)
    frames = data.get("target_video_length", 473)  # omitted (LTX-2.5): the largest count the head can predict
    assert out["shapes"][0] == [data["target_height"], data["target_width"], frames]
    if not MODULES[config.stem]:  # Qwen-Image: no estimate; the run keeps every module resident, unchecked
        assert out["fits"] is None and out["offload"]["mode"] == "none" and out["device_gib"] is None
        assert out["candidate"] == "resident (mode none)"
        assert "gives no memory estimate" in out["estimate_missing"] and out["modules"] == []
        return
    assert out["estimate_missing"] is None and out["estimate_sources"][0].startswith("architecture: ")
    assert "does not exist" in out["estimate_sources"][0]  # the plan says it took the config's architecture
    if out["fits"] is False:  # no plan fits (nothing planned), or the config's own mode exceeds a limit
        assert f"limit of {device_gib:.2f} GiB" in out["refusal"] or f"limit {device_gib:.2f} GiB" in out["refusal"]
        assert [m["name"] for m in out["modules"]] == ([] if out["offload"] is None else MODULES[config.stem])
        return
    assert [m["name"] for m in out["modules"]] == MODULES[config.stem]
    assert out["refusal"] is None and out["device_gib"] <= device_gib and out["host_gib"] <= host_gib
    mode = out["offload"]["mode"]
    for m in out["modules"]:
        assert MODULE_KEYS <= set(m)
        assert m["device_gib"] == round(m["device_bytes"] / GIB, 3) and m["host_gib"] == round(m["host_bytes"] / GIB, 3)
        if mode == "none" or m["placement"] == "resident":
            assert m["placement"] == "resident" and m["host_bytes"] == 0 and m["copy_bytes_per_step"] == 0
            assert m["copy_bytes_per_request"] == 0
        elif mode == "model":  # held in host memory, copied whole once per stage that uses it
            assert m["placement"] == "visits the device for its stage" and m["host_bytes"] == m["device_bytes"]
            assert m["copy_bytes_per_request"] in (m["device_bytes"], 2 * m["device_bytes"])
    if mode == "block":
        streamed = [m for m in out["modules"] if m["placement"].startswith("streamed from")]
        assert streamed and any(m["copy_bytes_per_step"] > 0 for m in streamed)
    assert out["estimated_request_seconds"] is None or out["estimated_request_seconds"] > 0


H100 = "NVIDIA H100 80GB HBM3"


def _ltx23_direct_plan(device_gib: int, host_gib: int) -> planner.MemoryPlan:
    """The planner called directly on the LTX-2.3 22B release: its estimate of the release architecture,
    Gemma-3 12B, bf16 weights (no fp8 storage), one pass per step (no CFG), the 22B warmup shapes, 8 + 3
    denoising steps per request (both stages), an H100's compute (eager) at the largest shape."""
    config = LTX2Runner.resolve_config(load_runner_config(REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json", {
        "memory.limit_gib": device_gib, "memory.host_limit_gib": host_gib}))
    gemma = plan_sources.GEMMA3_12B
    stages = [plan_compute.StageFlops(f"stage{k}", n, ltx2_step_flops(LTX23_22B_ARCH, (512, 768, 121), 24, k, 1))
              for k, n in ((1, len(DISTILLED_SIGMAS)), (2, len(STAGE2_SIGMAS)))]

    def estimate(off: OffloadConfig, shape: tuple[int, int, int]) -> fit.MemoryEstimate:
        return ltx2_estimate(LTX23_22B_ARCH, gemma, shape, 24, "t2av", torch.bfloat16, CUDA, off)

    return planner.plan_offload(config, [(512, 768, 121), (256, 384, 25)], CUDA, estimate,
                             MemoryLimit(device_gib * GIB, "config memory.limit_gib"),
                             MemoryLimit(host_gib * GIB, "config memory.host_limit_gib"), lambda off: 1,
                             lambda off: None, (64, 8), steps_per_request=len(DISTILLED_SIGMAS) + len(STAGE2_SIGMAS),
                             compute=plan_compute.compute_model(stages, H100, False)[0])


def test_the_plan_equals_the_planner_called_directly(no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_plan(capsys, "--config_json", REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json",
                            "--device_gib", 24, "--host_gib", 64, "--device_name", H100)
    assert rc == 0, err
    direct = _ltx23_direct_plan(24, 64)
    assert out["estimated_request_seconds"] == round(direct.chosen.request_seconds, 3) > 0
    report = plan_report.report(direct, OffloadConfig())
    assert out["shapes"] == [[512, 768, 121], [256, 384, 25]]  # the default shape and the 22B warmup shapes
    for key in set(report) - {"modules", "device_limit_source", "host_limit_source"}:
        assert out[key] == report[key], key
    assert out["device_limit_source"] == "--device_gib, as config memory.limit_gib"
    assert out["host_limit_source"] == "--host_gib, as config memory.host_limit_gib"
    rows = plan_report.module_rows(direct.chosen, CUDA)
    assert direct.chosen.estimate is not None
    config = RunnerConfig.model_construct(offload=direct.offload, unload_modules=False)
    assert [(m["name"], m["device_bytes"], m["host_bytes"], m["copy_bytes_per_step"], m["placement"])
            for m in out["modules"]] == [
        (r.name, r.device_bytes, r.host_bytes, r.copy_step_bytes,
         fit.placement_of(r.name, direct.chosen.estimate.modules[r.name], config)) for r in rows]
    assert [r["candidate"] for r in out["rejected"]] == [e.name for e in direct.rejected]
    assert out["estimate_sources"] == [
        ("architecture: the LTX-2.3 22B release, named by `model_path`'s name 'ltx-2.3-22b-distilled.safetensors' "
        "(`model_path` models/LTX-2.3/ltx-2.3-22b-distilled.safetensors does not exist)"),
        ("Gemma-3 sizes: Gemma-3 12B (google/gemma-3-12b-it, the releases' text encoder): models/gemma-3-12b-it has "
        "no config.json"),
        "fp8 storage: none assumed (the bf16 release; the checkpoint's headers would tell)"]


def test_a_configs_own_mode_is_judged_over_the_runs_shapes(no_checkpoints: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`--offload model` is not planned: it is judged over the default and warmup shapes as the run checks it."""
    config = REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json"
    off = OffloadConfig(mode="model")
    run = RunnerConfig.model_construct(offload=off, unload_modules=False)
    peaks = [fit.peak_of(ltx2_estimate(LTX23_22B_ARCH, plan_sources.GEMMA3_12B, shape, 24, "t2av", torch.bfloat16,
                                       CUDA, off), run, CUDA) for shape in ((512, 768, 121), (256, 384, 25))]
    rc, out, err = run_plan(capsys, "--config_json", config, "--offload", "model", "--device_gib", 80, "--host_gib", 128)
    assert rc == 0, err
    assert out["shapes"] == [[512, 768, 121], [256, 384, 25]] and out["rejected"] == []
    assert out["why"] == "`offload.mode` 'model' is set by the --offload flag: not planned, judged as it is"
    assert out["device_gib"] == round(max(p.bytes for p in peaks) / GIB, 3) and out["peak_shape"] == [512, 768, 121]
    assert out["steps_per_request"] == len(DISTILLED_SIGMAS) + len(STAGE2_SIGMAS)  # the copy time counts both stages
    rc, out, err = run_plan(capsys, "--config_json", config, "--offload", "model", "--device_gib", 40, "--host_gib", 128)
    assert rc == 1 and out["fits"] is False and out["offload"]["mode"] == "model"
    assert out["refusal"].startswith("the default shape: shape 512x768x121 (height x width x frames) needs an estimated "
                                     f"{peaks[0].bytes / GIB:.2f} GiB")


def _tiny_wan(tmp_path: Path, model_path: Path, offload: dict[str, Any] | None) -> Path:
    data = json.loads(TINY_CONFIG.read_text())
    data["model"]["transformer"]["num_layers"] = 4
    data.update(model_path=str(model_path), synthetic_checkpoint=None, device="cuda")
    if offload:
        data["offload"] = offload
    path = tmp_path / f"{model_path.name}.json"
    path.write_text(json.dumps(data))
    return path


ADVICE_TAIL = ("`offload.mode`='auto' (the fastest plan within both limits, if one fits); or a larger "
               "memory.host_limit_gib if the machine has it")


def test_a_host_refusal_of_mode_model_advises_disk_streaming_the_config_accepts(
        no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config that sets mode model itself, over the host limit: the mode is named as the config's, and the advice
    streams from disk in a mode that allows it (storage disk alone is refused in mode model), with the host
    memory a plan of exactly that setting estimates; the advised setting loads."""
    config = REPO / "configs/wan/wan22_moe_i2v_a14b.json"
    rc, out, err = run_plan(capsys, "--config_json", config, "--device_gib", 10000, "--host_gib", 64)
    assert rc == 1 and out["offload"]["mode"] == "model", err
    assert out["why"] == "`offload.mode` 'model' is set in the config: not planned, judged as it is"
    data = json.loads(config.read_text())
    data["offload"] = {**data["offload"], "mode": "block", "storage": "disk"}  # the advice, applied
    streamed = no_checkpoints / "disk.json"
    streamed.write_text(json.dumps(data))
    rc_disk, out_disk, err_disk = run_plan(capsys, "--config_json", streamed, "--device_gib", 10000, "--host_gib", 64)
    assert rc_disk == 0 and out_disk["fits"] is True, err_disk
    assert out["refusal"].split(" Try ", 1)[1] == (
        f"`offload.mode`='block' (or 'phase') with `offload.storage`='disk' (streamed weights stay on disk; "
        f"estimated {out_disk['host_gib']:.3f} GiB); or {ADVICE_TAIL}")


def test_a_host_refusal_advises_no_disk_streaming_that_would_not_fit(
        no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen-Image at 8 GiB of host memory, mode model from the flag: streaming the transformer from disk still
    holds the 15 GiB text encoder in host memory, so only the planner (which also streams the text encoder) and
    a larger limit are advised, and the mode is named as the flag's."""
    config = REPO / "configs/qwen_image/qwen_image_t2i_20b.json"
    rc, out, err = run_plan(capsys, "--config_json", config, "--device_gib", 80, "--host_gib", 8, "--offload", "model")
    assert rc == 1, err
    assert out["why"] == "`offload.mode` 'model' is set by the --offload flag: not planned, judged as it is"
    assert out["refusal"].split(" Try ", 1)[1] == ADVICE_TAIL
    rc_auto, out_auto, err_auto = run_plan(capsys, "--config_json", config, "--device_gib", 80, "--host_gib", 8,
                                           "--offload", "auto")
    assert rc_auto == 0 and out_auto["offload"]["storage"] == "disk", err_auto  # the advice that fits


@pytest.mark.parametrize("pinned_gib", [8, 20])
def test_a_pinned_refusal_advises_disk_streaming_only_where_its_pinned_memory_fits(
        no_checkpoints: Path, capsys: pytest.CaptureFixture[str], pinned_gib: int) -> None:
    """Qwen-Image streaming from pinned memory (53.90 GiB pinned) over `memory.pinned_limit_gib`: streaming from
    disk keeps the model-offloaded text encoder and VAE pinned (17.18 GiB), so it is advised, with that estimate,
    only under a limit it fits (20 GiB), and the advised setting then plans; under 8 GiB it is not advised."""
    data = json.loads((REPO / "configs/qwen_image/qwen_image_t2i_20b.json").read_text())
    data.update(offload={"mode": "block"}, memory={"pinned_limit_gib": pinned_gib})
    config = no_checkpoints / "pinned.json"
    config.write_text(json.dumps(data))
    rc, out, err = run_plan(capsys, "--config_json", config, "--device_gib", 80, "--host_gib", 64)
    assert rc == 1, err
    data["offload"] = {"mode": "block", "storage": "disk"}  # the advice, applied
    streamed = no_checkpoints / "pinned_disk.json"
    streamed.write_text(json.dumps(data))
    rc_disk, out_disk, err_disk = run_plan(capsys, "--config_json", streamed, "--device_gib", 80, "--host_gib", 64)
    assert round(out_disk["host_pinned_gib"], 2) == 17.18, err_disk
    disk = (f"`offload.storage`='disk' (one staging slab per slot; estimated {out_disk['host_pinned_gib']:.3f} GiB "
            "pinned); or " if pinned_gib == 20 else "")
    assert out["refusal"].split(" Try ", 1)[1] == (f"`offload.pin_memory`=false (pageable copies, slower); or {disk}"
                                                   "`offload.mode`='auto'")
    assert rc_disk == (0 if pinned_gib == 20 else 1), err_disk


@pytest.mark.parametrize("offload", [None, {"mode": "block", "storage": "disk"}], ids=["auto", "block-disk"])
def test_a_checkpoint_and_the_configs_architecture_give_the_same_plan(
        tmp_path: Path, offload: dict[str, Any] | None, capsys: pytest.CaptureFixture[str]) -> None:
    from runnerkit.models.wan.arch import WanArch
    from runnerkit.models.wan.checkpoint import write_synthetic

    ckpt = tmp_path / "ckpt"
    present = _tiny_wan(tmp_path, ckpt, offload)
    write_synthetic(WanArch.model_validate(json.loads(present.read_text())["model"]), ckpt, seed=0,
                    dtype=torch.float32)
    absent = _tiny_wan(tmp_path, tmp_path / "absent", offload)
    limits = ("--device_gib", 0.284, "--host_gib", 2.1)  # resident needs 0.286 GiB: auto offloads
    rc_p, with_ckpt, err = run_plan(capsys, "--config_json", present, *limits)
    rc_a, without, err2 = run_plan(capsys, "--config_json", absent, *limits)
    assert (rc_p, rc_a) == (0, 0), err + err2
    assert with_ckpt["estimate_sources"] == [
        f"architecture: the checkpoint's own ({ckpt}), the config's `model` over it"]
    assert without["estimate_sources"][0].endswith(f"`model_path` {tmp_path / 'absent'} does not exist")
    assert with_ckpt["offload"]["mode"] == ("model" if offload is None else "block")
    for key in ("config_json", "estimate_sources"):
        del with_ckpt[key], without[key]
    assert with_ckpt == without


def test_planning_does_not_weaken_the_run(no_checkpoints: Path) -> None:
    """A `for_plan` runner never loads; a run's runner still waits for the checkpoint (the load refuses it)."""
    overrides = {"model_path": str(no_checkpoints / "absent"), "device": "cpu"}
    config = load_runner_config(REPO / "configs/wan/wan_t2v_14b.json", overrides)
    planned = WanT2VRunner.for_plan(config)
    transformer = planned.estimate_memory((480, 832, 81)).modules["transformer"]
    assert transformer.weight_bytes == 28_635_875_456  # Wan2.1 14B: 14.3 B parameters in bf16, float32 norms
    with pytest.raises(LifecycleError, match="for_plan"):
        planned.init_modules()
    run = WanT2VRunner(config)
    with pytest.raises(fit.EstimateUnavailable, match="cannot be read before loading"):
        run.estimate_memory((480, 832, 81))
    single = load_runner_config(REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json", {**overrides, "model_path": str(
        no_checkpoints / "ltx-2.3-22b-distilled.safetensors")})
    LTX2Runner.for_plan(single)
    with pytest.raises(ValueError, match="`text_encoder_path` 'models/gemma-3-12b-it' is not an existing folder"):
        LTX2Runner(single)


def test_ltx2_implies_the_release_from_the_checkpoints_name() -> None:
    config = load_runner_config(REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json", {})
    for name, arch in (("x/ltx-2.3-22b-distilled.safetensors", LTX23_22B_ARCH),
                       ("x/LTX-2-19B-dev-fp8.safetensors", LTX2_19B_ARCH)):
        assert plan_sources.configured_arch(config.model_copy(update={"model_path": name}), None)[0] == arch
    arch, why = plan_sources.configured_arch(config.model_copy(update={"model_path": "x/mine.safetensors"}), None)
    assert arch is None and "give the config's `model`" in why
    given = plan_sources.configured_arch(config, LTX2_19B_ARCH)  # the config's `model` wins over the name
    assert given == (LTX2_19B_ARCH, "the config's `model`")


def test_an_unknown_ltx2_checkpoint_name_is_no_plan(no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads((REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json").read_text())
    data["model_path"] = "models/mine.safetensors"
    (no_checkpoints / "c.json").write_text(json.dumps(data))
    rc, out, err = run_plan(capsys, "--config_json", "c.json", "--device_gib", 24)
    assert rc == 2 and out == {}
    assert "cannot estimate the memory without what the checkpoint holds" in err and "give the config's `model`" in err


def test_an_fp8_release_streams_fp8_weights_from_disk(no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """By its name, an fp8 release's block weights are read as stored: 1 byte each (+ a scale) instead of 2."""
    copies = {}
    for name in ("ltx-2.3-22b-distilled.safetensors", "ltx-2.3-22b-distilled-fp8.safetensors"):
        data = json.loads((REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json").read_text())
        data.update(model_path=f"models/{name}", offload={"mode": "block", "storage": "disk"})
        (no_checkpoints / "c.json").write_text(json.dumps(data))
        rc, out, err = run_plan(capsys, "--config_json", "c.json", "--device_gib", 80, "--host_gib", 128)
        assert rc == 0, err
        copies[name] = next(m for m in out["modules"] if m["name"] == "transformer")["copy_bytes_per_step"]
        stored = out["estimate_sources"][2]
    blocks = est._meta("transformer", LTX23_22B_ARCH).transformer_blocks  # the release's, built on meta (cached)
    linears = sum(isinstance(m, nn.Linear) for m in blocks.modules())
    assert stored == f"fp8 storage: {linears} transformer block weights assumed float8_e4m3fn (`fp8` in the file name)"
    bf16, fp8 = copies.values()
    assert 0.5 < fp8 / bf16 < 0.55  # the blocks' linear weights halve; their norms and biases stay


@pytest.mark.parametrize("argv, message", [
    (["--config_json", "missing.json", "--device_gib", "24"], "config file 'missing.json' does not exist"),
    (["--config_json", "c.json", "--device_gib", "24", "--bogus"], "unrecognized arguments: --bogus"),
    (["--config_json", "c.json", "--device_gib", "-1"], ("`--device_gib` must be a positive number of GiB, e.g. 24 "
                                                        "(got '-1')")),
    (["--config_json", "c.json", "--device_gib", "0"], "`--device_gib` must be a positive number of GiB"),
    (["--config_json", "c.json", "--host_gib", "lots", "--device_gib", "24"], ("`--host_gib` must be a positive "
                                                                              "number of GiB, e.g. 24 (got 'lots')")),
    (["--config_json", "c.json"], "this machine has no CUDA, so the GPU's memory cannot be read: pass --device_gib"),
], ids=["missing-config", "unknown-flag", "negative-gib", "zero-gib", "bad-host-gib", "no-cuda-no-limit"])
def test_bad_input_exits_2_naming_it(argv: list[str], message: str, no_checkpoints: Path,
                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(REPO / "configs/wan/wan_t2v_14b.json", no_checkpoints / "c.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        rc = cli_main(["plan", *argv])
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert message in " ".join(captured.err.split())


@pytest.mark.parametrize("version", ["v2", "v1", "none"])
def test_default_limits_are_this_machines(version: str, no_checkpoints: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """No flags: the CUDA device's free + held less 1 GiB for the libraries; the host's available memory,
    here the container's cgroup limit less its usage (smaller than MemAvailable) or, without a cgroup limit,
    MemAvailable, + this process's RSS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    root = no_checkpoints / "cgroup"
    files = ({"memory.max": 16 * GIB, "memory.current": 6 * GIB} if version == "v2" else
             {"memory/memory.limit_in_bytes": 16 * GIB, "memory/memory.usage_in_bytes": 6 * GIB} if version == "v1"
             else {})
    for name, value in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"{value}\n")
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", root)
    monkeypatch.setattr(cgroup, "MEMBERSHIP", root / "no_membership")
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 100 * GIB)
    monkeypatch.setattr(memory, "host_memory", lambda: SimpleNamespace(rss_gib=0.5))
    rc, out, err = run_plan(capsys, "--config_json", REPO / "configs/wan/wan_t2v_1.3b.json")
    assert rc == 0, err
    assert out["device_limit_gib"] == 31.0 and "kept for the CUDA libraries" in out["device_limit_source"]
    if version == "none":
        assert out["host_limit_gib"] == 100.5 and out["host_limit_source"] == (
            "100.00 GiB available (MemAvailable of /proc/meminfo) + 0.50 GiB held by this process")
    else:
        assert out["host_limit_gib"] == 10.5 and f"cgroup {version}" in out["host_limit_source"]


def test_a_plan_short_of_both_limits_advises_for_both(no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_plan(capsys, "--config_json", REPO / "configs/wan/wan_t2v_14b.json", "--device_gib", 2,
                          "--host_gib", 4)
    refusal = out["refusal"]
    assert rc == 1 and "GiB missing, peak in stage" in refusal and "of host memory (" in refusal, refusal
    advice = refusal.split("To fit: ", 1)[1]
    assert "raise `memory.host_limit_gib`" in advice and re.search(r"a device with \d+\.\d\d GiB more memory", advice), \
        advice


def test_the_text_output_lists_each_module_and_the_rejected(no_checkpoints: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = REPO / "configs/wan/wan_t2v_14b.json"
    rc, out, _ = run_plan(capsys, "--config_json", config, "--device_gib", 24, "--host_gib", 64)
    assert rc == 0
    out["config_json"] = str(config)
    text = describe(out)
    assert cli_main(["plan", "--config_json", str(config), "--device_gib", "24", "--host_gib", "64"]) == 0
    assert capsys.readouterr().out == text + "\n"
    assert "  weights: not read (the plan reads architectures and headers only" in text  # it never vouches for them
    for m in out["modules"]:
        row = next(line for line in text.splitlines() if line.split()[0] == m["name"])
        assert m["placement"] in row and row.split()[-4:] == [
            f"{m['device_bytes'] / GIB:.2f}", f"{m['host_bytes'] / GIB:.2f}", f"{m['copy_bytes_per_step'] / GIB:.2f}",
            f"{m['copy_bytes_per_request'] / GIB:.2f}"]
    assert [line.split(": ", 1)[1] for line in text.splitlines() if "rejected (faster)" in line] == [
        f"{r['candidate']}: {r['reason']}" for r in out["rejected"]]
    assert (f"  estimated host-to-device copies per request: {out['request_copy_seconds_estimate']:.2f} s over 50 "
            "denoising step(s) (no compute estimate: the device is unnamed (planning/compute.py DEVICE_PEAKS): "
            "the time model counts copies, not compute)") in text.splitlines()


def test_the_planners_request_time_is_shown_where_it_gives_one() -> None:
    chosen = SimpleNamespace(estimated_request_seconds=12.5)
    assert planner_seconds({}, SimpleNamespace(chosen=chosen)) == 12.5  # type: ignore[arg-type]
    assert planner_seconds({"estimated_request_seconds": 3}, None) == 3.0
    assert planner_seconds({}, SimpleNamespace(chosen=SimpleNamespace())) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("flags", "message"), [
    (["--target_video_length", "24"], "`target_video_length` must be 8n+1, e.g. 9, 17, 81 (got 24)"),
    (["--target_video_length", "9"], "`target_video_length` 9: ltx2.5 takes at least 25 frames"),
    (["--target_height", "512", "--target_width", "700"], "`target_width` must be a multiple of 64 (got 700)"),
], ids=["frame-grid", "shortest-clip", "width-multiple"])
def test_a_shape_no_run_takes_is_refused_as_the_launch_script_refuses_it(
        flags: list[str], message: str, no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_plan(capsys, "--config_json", REPO / "configs/ltx2/ltx25_t2av_22b_distilled.json",
                            "--device_gib", 80, *flags)
    assert (rc, out) == (2, {}) and message in err, err


def test_the_launch_scripts_module_runs_plan_as_the_command_does(no_checkpoints: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """README: `runnerkit` = `python -m runnerkit.infer`, so `python -m runnerkit.infer plan ...` is the same plan."""
    from runnerkit.infer import main as infer_main

    argv = ["plan", "--config_json", str(REPO / "configs/wan/wan_t2v_14b.json"), "--device_gib", "24",
            "--host_gib", "64", "--json"]
    assert cli_main(argv) == 0
    want = capsys.readouterr().out
    assert infer_main(argv) == 0
    assert capsys.readouterr().out == want and json.loads(want)["offload"]["mode"] != "none"


@pytest.mark.parametrize("argv", [["plan", "--help"], ["plan", "--config_json", "c.json", "--device_gib", "-1"]])
def test_help_and_bad_flags_answer_before_torch_loads(argv: list[str]) -> None:
    """`runnerkit plan --help` (and a flag argparse refuses) needs neither torch nor a family: a fresh process
    answers with the plan's own parser and exits without having imported torch."""
    code = ("import sys\nfrom runnerkit.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
    status = "0" if argv[-1] == "--help" else "2"
    assert done.stdout.splitlines()[-1] == f"exit {status} False", (done.stdout, done.stderr)
    assert ("--device_gib DEVICE_GIB" in done.stdout) if status == "0" else ("`--device_gib` must be" in done.stderr)


@pytest.mark.parametrize("config, device_gib, host_gib, flag", [
    ("qwen_image/qwen_image_t2i_20b", 80, 3, "--host_gib"),  # short of host memory
    ("wan/wan_t2v_14b", 8, 64, "--device_gib"),  # short of device memory
    ("ltx2/ltx23_t2av_22b_distilled", 6, 200, "--device_gib"),
])
def test_the_figure_a_refusal_names_is_enough(config: str, device_gib: int, host_gib: int, flag: str,
                                              no_checkpoints: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """"Closest: X needs N GiB": N is rounded up, so a limit of exactly N fits that candidate (rounded to the
    nearest, it fell a few bytes short and the next refusal said "0.00 GiB missing")."""
    path = REPO / "configs" / f"{config}.json"
    rc, out, err = run_plan(capsys, "--config_json", path, "--device_gib", device_gib, "--host_gib", host_gib,
                            "--device_name", "none")
    assert rc == 1, err
    where = "of host memory" if flag == "--host_gib" else "on the device"
    needed = re.search(rf"Closest: .* needs (\d+\.\d\d) GiB {where}", out["refusal"])
    assert needed is not None, out["refusal"]
    limits = {"--device_gib": device_gib, "--host_gib": host_gib, flag: needed.group(1)}
    rc, out, err = run_plan(capsys, "--config_json", path, *(x for kv in limits.items() for x in kv),
                            "--device_name", "none")
    assert (rc, out["fits"]) == (0, True), out.get("refusal", err)


def test_a_warmup_shape_at_the_peak_is_advised_with_warmup_off(no_checkpoints: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """LTX-2.3's config warms up at 512x768x121, the family's fixed shape: no target size removes it, so the
    refusal says the peak is a warmup shape and offers smaller shapes only with `warmup` false; following the
    first advice as given fits."""
    data = json.loads((REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json").read_text())
    rc, out, err = run_plan(capsys, "--config_json", REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json",
                            "--device_gib", 6, "--host_gib", 200, "--device_name", "none")
    refusal = out["refusal"]
    assert rc == 1 and "at shape [512, 768, 121], a warmup shape: no target size changes it)" in refusal, refusal
    advice = refusal.split("To fit: ", 1)[1].split("; or ")
    assert advice and all(a.startswith("`warmup` false and target_") for a in advice), advice
    frames = re.match(r"`warmup` false and target_video_length (\d+) at 512x768", advice[0])
    assert frames is not None, advice
    no_warmup = no_checkpoints / "no_warmup.json"
    no_warmup.write_text(json.dumps({**data, "warmup": False}))
    rc, out, err = run_plan(capsys, "--config_json", no_warmup, "--device_gib", 6, "--host_gib", 200,
                            "--device_name", "none", "--target_video_length", frames.group(1))
    assert (rc, out["fits"]) == (0, True), out.get("refusal", err)
    rc, out, err = run_plan(capsys, "--config_json", REPO / "configs/ltx2/ltx23_t2av_22b_distilled.json",
                            "--device_gib", 6, "--host_gib", 200, "--device_name", "none",
                            "--target_video_length", frames.group(1))
    assert rc == 1, "with warmup on, the smaller default shape alone does not fit"
