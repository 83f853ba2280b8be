"""Wan2.2 MoE text-to-video (`wan2.2_moe`): parity with diffusers' WanPipeline with
`transformer_2` + `boundary_ratio`, the expert of every step, warmup over both experts, offload
modes, checkpoint layouts and a missing expert (ARCHITECTURE §3-5).

Tiny architecture (configs/wan/wan22_moe_t2v_tiny.json), float32, CPU. The two experts have
different random weights (seed and seed + 1), so swapping them changes every result.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.infer import main
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.moe import WanMoERunner
from runnerkit.models.wan.moe_checkpoint import WanMoECheckpoint, write_synthetic_moe
from runnerkit.registry import get_runner_cls
from runnerkit.runners import loading
from runnerkit.runners.request_state import RequestState
from test_cases._reference import require_reference

REPO = Path(__file__).resolve().parents[3]
MOE_CONFIG = REPO / "configs" / "wan" / "wan22_moe_t2v_tiny.json"
TINY = json.loads(MOE_CONFIG.read_text())
ARCH = WanArch.model_validate(TINY["model"])
HIGH, LOW = "transformer", "transformer_2"


def moe_config_dict(ckpt: Path, **overrides: Any) -> dict[str, Any]:
    """The tiny MoE config pointing at `ckpt`, on the CPU, with overrides (dicts merged one level)."""
    data = {**TINY, "model_path": str(ckpt), "device": "cpu"}
    data.pop("synthetic_checkpoint")
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return data


def make_runner(ckpt: Path, **overrides: Any) -> WanMoERunner:
    runner = get_runner_cls("wan2.2_moe")(load_runner_config(None, moe_config_dict(ckpt, **overrides)))
    assert isinstance(runner, WanMoERunner)
    return runner


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny MoE checkpoint in every layout (same weights), float32."""
    root = tmp_path_factory.mktemp("moe")
    return {layout: write_synthetic_moe(ARCH, root / layout, seed=0, dtype=torch.float32, layout=layout)
            for layout in ("runnerkit", "original", "diffusers")}


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


def record_expert_calls(runner: WanMoERunner, calls: list[tuple[str, int, int]]) -> None:
    """Append (expert, timestep, context length) to `calls` at every forward of either expert.
    The hooks sit on the modules themselves, so this does not ask the runner which expert it chose."""
    for name in (HIGH, LOW):
        runner.modules[name].register_forward_pre_hook(
            lambda module, args, name=name: calls.append((name, int(args[1].flatten()[0]), args[2].shape[1])))


# ---- parity with diffusers --------------------------------------------------------------------
HEIGHT, WIDTH, FRAMES, STEPS, SEED = 32, 48, 5, 6, 7
GUIDANCE = (4.0, 3.0)  # [high-noise, low-noise]: distinct, so a swapped or shared scale fails
PROMPT, NEGATIVE_PROMPT = "a red fox running through fresh snow", "blurry, low quality"


def test_runner_matches_diffusers_wan_pipeline_with_transformer_2(moe_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Same weights (one diffusers-layout checkpoint, read by each library's own loader), same
    initial noise (drawn here from the scheduler contract), boundary 0.875: 4 high-noise + 2
    low-noise steps of 6 on both sides."""
    diffusers = require_reference("diffusers")
    transformers = require_reference("transformers")
    from test_cases.models.wan._pipeline_parity import _diffusers_model

    ckpt, scheduler = moe_ckpts["diffusers"], "unipc"  # Wan2.2's sampler (Euler: wan2.1's parity test)
    runner = make_runner(ckpt, scheduler=scheduler, scheduler_spacing="diffusers", infer_steps=STEPS,
                         sample_guide_scale=list(GUIDANCE))  # diffusers parity: its sigma spacing
    runner.init_modules()
    out = tmp_path / "video.safetensors"
    runner.run_pipeline(RequestConfig(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, seed=SEED, target_height=HEIGHT,
                                      target_width=WIDTH, target_video_length=FRAMES, save_tensor_path=str(out)), 0)
    ours = load_file(str(out))["video"]

    shift = float(TINY["sample_shift"])
    # As Wan-AI/Wan2.2-T2V-A14B-Diffusers ships it (flow-matching UniPC, bh2, order 2), with the config's shift.
    sched = diffusers.UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
        solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero")
    text_encoder = transformers.UMT5EncoderModel.from_pretrained(ckpt / "text_encoder", dtype=torch.float32).eval()
    pipe = diffusers.WanPipeline(
        tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt / "tokenizer"), text_encoder=text_encoder,
        vae=_diffusers_model(diffusers.AutoencoderKLWan, ckpt / "vae"), scheduler=sched,
        transformer=_diffusers_model(diffusers.WanTransformer3DModel, ckpt / "transformer"),
        transformer_2=_diffusers_model(diffusers.WanTransformer3DModel, ckpt / "transformer_2"),
        boundary_ratio=json.loads((ckpt / "model_index.json").read_text())["boundary_ratio"])
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn((1, ARCH.vae.z_dim, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8),
                        generator=torch.Generator("cpu").manual_seed(SEED), dtype=torch.float32)
    with torch.inference_mode():
        frames = pipe(prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                      num_inference_steps=STEPS, guidance_scale=GUIDANCE[0], guidance_scale_2=GUIDANCE[1],
                      latents=noise, output_type="pt", max_sequence_length=ARCH.text_encoder.text_len).frames
    expected = frames[0].permute(1, 0, 2, 3).float() * 2 - 1  # [1, F, 3, H, W] in [0, 1] -> [3, F, H, W] in [-1, 1]

    assert pipe.config.boundary_ratio == 0.875 and runner.config.boundary == 0.875
    assert expected.std().item() > 0.2 and (expected.abs() >= 1).float().mean().item() < 0.2
    diff = (ours - expected).abs().max().item()
    assert diff <= 1e-4, f"{scheduler}: max abs difference {diff:.3g}"


# ---- which expert runs each step ----------------------------------------------------------------
@pytest.mark.parametrize(("boundary", "experts"), [
    (0.875, [HIGH] * 4 + [LOW] * 2),  # timesteps 999 983 959 922 | 856 705 (UniPC, Wan spacing, 6 steps, shift 12)
    (0.95, [HIGH] * 3 + [LOW] * 3),   # 959 >= 950 > 922
])
def test_each_step_runs_the_expert_of_its_timestep_with_both_cfg_branches(
        moe_ckpts: dict[str, Path], tmp_path: Path, boundary: float, experts: list[str]) -> None:
    runner = make_runner(moe_ckpts["runnerkit"], infer_steps=STEPS, boundary=boundary)
    runner.init_modules()
    calls: list[tuple[str, int, int]] = []
    record_expert_calls(runner, calls)
    runner.run_pipeline(RequestConfig(prompt="a fox", target_height=32, target_width=32, target_video_length=5), 0)
    assert [t for _, t, _ in calls[::2]] == [999, 983, 959, 922, 856, 705]  # the Wan reference's schedule
    assert [name for name, _, _ in calls] == [e for e in experts for _ in range(2)]  # cond + uncond per step
    assert all(calls[i][2] != calls[i + 1][2] for i in range(0, len(calls), 2)), "cond and uncond contexts differ"


def test_guidance_is_per_expert_and_one_number_serves_both(moe_ckpts: dict[str, Path]) -> None:
    runner = make_runner(moe_ckpts["runnerkit"])
    runner.init_modules()
    stage, req = runner.pipeline.denoise[0], RequestState(runner.warmup_info((32, 32, 5)))
    scales = {t: runner.guide_scale(req, stage, 0, torch.tensor([t])) for t in (999, 875, 874, 0)}
    assert scales == {999: 4.0, 875: 4.0, 874: 3.0, 0: 3.0}  # t >= 875 -> high-noise scale
    single = make_runner(moe_ckpts["runnerkit"], sample_guide_scale=5.0)
    single.init_modules()
    assert single.guide_scale(req, stage, 0, torch.tensor([999])) == single.guide_scale(
        req, stage, 0, torch.tensor([0])) == 5.0


# ---- warmup -----------------------------------------------------------------------------------
def test_warmup_runs_the_first_step_of_each_expert_on_both_shapes(moe_ckpts: dict[str, Path], mocker: Any) -> None:
    runner = make_runner(moe_ckpts["runnerkit"], warmup=True)  # 4 steps: timesteps 999 973 922 | 799 (Wan spacing)
    calls: list[tuple[str, int, int]] = []
    real_place = loading.place_modules

    def place_and_record(placed: Any, pipeline: Any) -> Any:
        placement = real_place(placed, pipeline)
        record_expert_calls(runner, calls)
        return placement

    mocker.patch.object(loading, "place_modules", side_effect=place_and_record)
    runner.init_modules()
    per_shape = [(HIGH, 999), (HIGH, 999), (LOW, 799), (LOW, 799)]  # step 0, then the low-noise expert's first step
    assert [(n, t) for n, t, _ in calls] == per_shape * 2
    assert runner.profiler.warmup["steps_per_shape"] == {"transformer": [0, 3]}
    assert all(calls[i][2] != calls[i + 1][2] for i in range(0, len(calls), 2)), "both CFG branches run"


def test_warmup_opt_in_is_the_moe_class_own() -> None:
    assert "WARMUP_SHAPES" in WanMoERunner.__dict__ and "WARMUP_TASKS" in WanMoERunner.__dict__
    table = WanMoERunner.__dict__["WARMUP_SHAPES"]
    assert set(table) == {"debug", "A14B"}
    for flavour, ((h0, w0, f0), (h1, w1, f1)) in table.items():
        assert h0 == w0 and h1 != w1, f"{flavour}: one square and one non-square shape"
        for shape in ((h0, w0, f0), (h1, w1, f1)):
            WanMoERunner.validate_shape(*shape)
    for config in ("wan22_moe_t2v_tiny.json", "wan22_moe_t2v_a14b.json"):
        data = json.loads((REPO / "configs" / "wan" / config).read_text())
        cfg = load_runner_config(REPO / "configs" / "wan" / config, {})  # a valid config
        arch = WanMoERunner.parse_arch(cfg.model, partial=cfg.model_path is not None).transformer
        flavour = {(64, 2, 2, 128): "debug", (5120, 40, 40, 13824): "A14B"}[
            (arch.dim, arch.num_layers, arch.num_heads, arch.ffn_dim)]
        shape = (data["target_height"], data["target_width"], data["target_video_length"])
        assert shape in table[flavour], (config, shape)


# ---- offload modes ----------------------------------------------------------------------------
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "model": {"offload": {"mode": "model"}},
    "block": {"offload": {"mode": "block"}},
    "phase_disk": {"offload": {"mode": "phase", "storage": "disk"}},
    "block_disk_lazy": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
}
REQUEST = RequestConfig(prompt="a red fox in the snow", seed=11, target_height=32, target_width=32,
                        target_video_length=5)


def serve(runner: WanMoERunner, path: Path) -> torch.Tensor:
    runner.run_pipeline(REQUEST.model_copy(update={"save_tensor_path": str(path)}), 0)
    assert runner.placement.on_device_now() == set() and "stage_modules" not in vars(runner)
    return load_file(str(path))["video"]


@pytest.fixture(scope="module")
def reference_video(moe_ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    runner = make_runner(moe_ckpts["runnerkit"])
    runner.init_modules()
    return serve(runner, tmp_path_factory.mktemp("moe_ref") / "ref.safetensors")


@pytest.mark.parametrize("mode", list(MODES))
def test_same_seed_bit_identical_with_warmup_in_every_mode(moe_ckpts: dict[str, Path], tmp_path: Path,
                                                           reference_video: torch.Tensor, mode: str) -> None:
    """Warmup (both experts, both shapes) then one request equals a cold `none` run bit for bit;
    model offload has only the active expert on the device at each of its calls; block/phase
    streaming gives each expert its own streamer."""
    runner = make_runner(moe_ckpts["runnerkit"], warmup=True, **MODES[mode])
    runner.init_modules()
    on_device: list[tuple[str, set[str]]] = []
    if mode == "model":
        for name in (HIGH, LOW):
            runner.modules[name].register_forward_pre_hook(
                lambda module, args, name=name: on_device.append((name, runner.placement.on_device_now())))
    assert torch.equal(serve(runner, tmp_path / "v.safetensors"), reference_video), mode
    if mode == "model":
        assert {n for n, _ in on_device} == {HIGH, LOW}
        assert all(now == {name} for name, now in on_device), on_device
    if mode in ("block", "phase_disk"):
        assert set(runner.streamers) == {HIGH, LOW} and runner.streamers[HIGH] is not runner.streamers[LOW]
        assert all(runner.streamers[n].stats()["h2d_copies"] > 0 for n in (HIGH, LOW)), "each expert streamed"


# ---- checkpoints and input errors -------------------------------------------------------------
def test_every_layout_holds_the_same_two_distinct_experts(moe_ckpts: dict[str, Path]) -> None:
    opened = {layout: WanMoECheckpoint.open(path, override=TINY["model"]) for layout, path in moe_ckpts.items()}
    assert {c.arch for c in opened.values()} == {ARCH}
    sds = {layout: {e: c.experts[e].transformer_state_dict() for e in (HIGH, LOW)} for layout, c in opened.items()}
    for layout in ("original", "diffusers"):
        for e in (HIGH, LOW):
            assert sds[layout][e].keys() == sds["runnerkit"][e].keys()
            assert all(torch.equal(sds[layout][e][k], v) for k, v in sds["runnerkit"][e].items()), (layout, e)
    assert not torch.equal(sds["runnerkit"][HIGH]["head.head.weight"], sds["runnerkit"][LOW]["head.head.weight"])
    assert opened["diffusers"].boundary == 0.875


@pytest.fixture
def _restore_logger() -> Any:
    yield
    logger.remove()
    logger.add(lambda message: __import__("sys").stderr.write(message), level="DEBUG")


@pytest.mark.parametrize(("layout", "remove", "named"), [
    ("original", "low_noise_model", "low_noise_model/"),
    ("original", "high_noise_model", "high_noise_model/"),
    ("diffusers", "transformer_2", "transformer_2/"),
    ("runnerkit", "transformer_2", "transformer_2/"),
])
def test_missing_expert_exits_2_naming_the_folder_before_loading(
        moe_ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], mocker: Any,
        _restore_logger: None, layout: str, remove: str, named: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(moe_ckpts[layout], ckpt)
    shutil.rmtree(ckpt / remove)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(moe_config_dict(ckpt)))
    load = mocker.patch("runnerkit.models.wan.runner.assign_state_dict")
    capsys.readouterr()
    rc = main(["--config_json", str(cfg), "--prompt", "x", "--save_tensor_path", str(tmp_path / "o.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert named in err and "expert" in err, err
    assert load.call_count == 0, "no weights may load before the missing expert is reported"


def test_wan21_checkpoint_is_not_a_moe_checkpoint(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"wan2.2_moe"):
        make_runner(tiny_ckpt).init_modules()


def test_launcher_runs_the_tiny_config_end_to_end_and_writes_an_mp4(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/wan/run_wan22_moe_t2v.sh on its default tiny config (synthetic checkpoint written
    on first use), with warmup and a --requests file: an mp4, its sidecar naming the boundary
    (bash runs the script; its `python -m runnerkit.infer` runs in this process: `run_launch_script`)."""
    import os
    import sys

    from test_cases._cli import run_launch_script

    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps({"prompt": "a fox", "seed": 1, "save_result_path": str(tmp_path / "fox.mp4")}) + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO), "RUNNERKIT_CACHE": str(tmp_path / "cache")}
    rc, err = run_launch_script(capsys, monkeypatch, REPO / "scripts/wan/run_wan22_moe_t2v.sh",
                                ["--requests", str(reqs), "--device", "cpu"], tmp_path, env)
    assert rc == 0, err
    assert "warmup:" in err and (tmp_path / "fox.mp4").stat().st_size > 0
    sidecar = json.loads((tmp_path / "fox.json").read_text())
    assert sidecar["boundary"] == 0.875 and sidecar["config"]["model_cls"] == "wan2.2_moe"
