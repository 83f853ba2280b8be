"""Offload modes of the Wan2.1 runner on the CPU: same output as `offload.mode: none`, with and
without warmup; request-boundary state after warmup and after every request (ARCHITECTURE §3-4),
through the family contract (test_cases/family_contract.py), and what only Wan's modes have."""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit import memory
from runnerkit.config import ConfigError, RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from test_cases.conftest import tiny_config_dict
from test_cases.family_contract import Family, FamilyContract

MODES: dict[str, dict[str, Any]] = {
    "model": {"offload": {"mode": "model"}},
    "block_cpu": {"offload": {"mode": "block"}},
    "phase_cpu_3slots": {"offload": {"mode": "phase", "gpu_slots": 3, "prefetch_depth": 2}},
    "block_cpu_unpinned": {"offload": {"mode": "block", "pin_memory": False}},
    "block_disk_mmap": {"offload": {"mode": "block", "storage": "disk", "reader": "mmap"}},
    "phase_disk_pread": {"offload": {"mode": "phase", "storage": "disk", "reader": "pread"}},
    "block_disk_lazy": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True}},
    # the text encoder streams its layers too (issue 21): phase from host memory, block from disk per stage
    "phase_cpu_text_encoder": {"offload": {"mode": "phase", "stream_modules": ["transformer", "text_encoder"]}},
    "block_disk_lazy_text_encoder": {"offload": {"mode": "block", "storage": "disk", "lazy_load": True,
                                                 "stream_modules": ["transformer", "text_encoder"]}},
    # two of the 6 phase units stay resident (offload.resident_blocks), the others stream, built per request
    "phase_disk_lazy_resident_blocks": {"offload": {"mode": "phase", "storage": "disk", "lazy_load": True,
                                                    "resident_blocks": 2}},
    "unload_modules": {"unload_modules": True},
    "vae_tiling_one_tile": {"offload": {"vae_tiling": True}},  # 48x80 fits one 256-px tile: exact
}
REQUESTS = [RequestConfig(prompt="a red fox in the snow", seed=11),
            RequestConfig(prompt="a boat", seed=12, target_height=32, target_width=32, target_video_length=5)]


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: None)


def make_runner(ckpt: Path, **overrides: Any) -> WanT2VRunner:
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(ckpt, **overrides)))
    runner.init_modules()
    return runner


def serve(runner: WanT2VRunner, tmp_path: Path, tag: str) -> list[torch.Tensor]:
    out = []
    for i, req in enumerate(REQUESTS):
        path = tmp_path / f"{tag}_{i}.safetensors"
        runner.run_pipeline(req.model_copy(update={"save_tensor_path": str(path)}), i)
        out.append(load_file(str(path))["video"])
        assert_request_boundary(runner)
    return out


def assert_request_boundary(runner: WanT2VRunner) -> None:
    assert not {"input_info", "inputs", "stage_modules"} & vars(runner).keys() and runner.scheduler.generator is None
    assert runner.placement.on_device_now() == set(), "model-offloaded/per-stage modules must be off the device"
    for name, streamer in runner.streamers.items():
        state = streamer.state()
        assert state["next_prefetch"] == 0 and state["issued"] == [] and state["in_flight"] == 0, name


@pytest.fixture(scope="module")
def reference(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    return serve(make_runner(tiny_ckpt), tmp_path_factory.mktemp("ref"), "none")


def wan_boundary(runner: WanT2VRunner) -> None:
    """Wan's request-specific caches: the RoPE tables per grid and the VAE's feature cache."""
    assert runner.transformer is None or runner.transformer._rope_cache == {}
    assert runner.vae is None or runner.vae.feature_cache is None


def wan_parity(request: pytest.FixtureRequest, folder: Path) -> None:
    from test_cases.models.wan._pipeline_parity import check_parity  # needs diffusers: imported here

    check_parity(folder)


class TestFamilyContract(FamilyContract):
    """Every mode of MODES bit-identical to `none` with and without warmup, the request boundary
    after each request, the warmup gates, the CPU estimate, end-to-end parity with diffusers'
    WanPipeline (test_cases/family_contract.py)."""

    family = Family(
        name="wan2.1 t2v", runner_cls=WanT2VRunner, checkpoint="tiny_ckpt", config=tiny_config_dict,
        requests=tuple(REQUESTS), outputs=("video",), modes=MODES, boundary=wan_boundary,
        shapes=({"video": (3, 9, 48, 80)}, {"video": (3, 5, 32, 32)}),
        # formula / measured: 1.02 here (154.4 / 151.0 MiB); 1.13 at 256x256x5 (221.7 / 195.5 MiB); 0.996 at
        # 48x80x9 (36.41 / 36.55 MiB, inside fit.MARGIN)
        estimate_request=RequestConfig(prompt="a red fox in the snow", seed=11, target_height=128, target_width=128,
                                       target_video_length=5),
        estimate_loosest=1.5,
        parity=wan_parity, reference_package="diffusers")


@pytest.fixture(scope="module")
def family_reference(reference: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The contract's reference outputs: the cold `offload.mode: none` runs (family_contract.py)."""
    return [{"video": video} for video in reference]


def test_fp8_weights_within_tolerance(tiny_ckpt: Path, tmp_path: Path, reference: list[torch.Tensor]) -> None:
    """fp8 e4m3 streamed weights (per-tensor absmax scale): the decoded video stays close to fp32's.
    Stated tolerance: mean abs error < 0.05 and max abs error < 0.5 on values in [-1, 1]."""
    runner = make_runner(tiny_ckpt, warmup=True, offload={"mode": "block", "weight_dtype": "fp8_e4m3"})
    videos = serve(runner, tmp_path, "fp8")
    for got, want in zip(videos, reference):
        err = (got - want).abs()
        assert not torch.equal(got, want)  # really quantized
        assert err.mean() < 0.05 and err.max() < 0.5, (err.mean(), err.max())


def test_lazy_load_frees_transformer_after_each_request(tiny_ckpt: Path, tmp_path: Path) -> None:
    runner = make_runner(tiny_ckpt, warmup=True, offload={"mode": "block", "storage": "disk", "lazy_load": True})
    assert runner.transformer is None and runner.streamer is None
    seen: list[weakref.ref] = []
    loader = runner.placement.loaders["transformer"]

    def tracking_loader() -> Any:
        module, teardown = loader()
        seen.append(weakref.ref(module))
        seen.append(weakref.ref(runner.streamer))
        return module, teardown

    runner.placement.loaders["transformer"] = tracking_loader
    for i, req in enumerate(REQUESTS):
        runner.run_pipeline(req, i)
        gc.collect()
        assert all(ref() is None for ref in seen), f"transformer or streamer still alive after request {i}"
        assert runner.streamer is None
    assert len(seen) == 4


def test_disk_streaming_never_opens_two_handles_on_a_file(tiny_ckpt: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted by the OS (`/proc/self/fd`, `/proc/self/maps`) at every tensor read and by a polling thread;
    default reader (mmap); both readers on a split block: `offload/test_disk.py::test_os_sees_one_handle_per_shard`."""
    from runnerkit.offload import disk
    from test_cases.offload._handles import HandleSampler

    # a private copy: runners of earlier tests that are not collected yet may still hold the shared one open
    ckpt = Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))
    files = sorted((ckpt / "transformer").glob("*.safetensors"))
    assert files
    sampler = HandleSampler(files)
    assert sampler.sample("start").fds == {f.name: 0 for f in files}
    real_read = disk.SafetensorsDiskReader._read

    def sampled_read(self: Any, handle: Any, entry: Any, dst: torch.Tensor) -> None:
        sampler.sample(f"before reading {entry.name}")
        real_read(self, handle, entry, dst)
        sampler.sample(f"after reading {entry.name}")

    monkeypatch.setattr(disk.SafetensorsDiskReader, "_read", sampled_read)
    sampler.start_polling(interval_s=0.01)  # the runner's process maps many regions: sample less often
    try:
        runner = make_runner(ckpt, warmup=True, offload={"mode": "phase", "storage": "disk"})
        runner.run_pipeline(REQUESTS[0], 0)
    finally:
        sampler.stop_polling()
    assert sampler.violations() == []
    assert sampler.ever_open() == {f.name for f in files}


@pytest.mark.parametrize(("offload", "reason"), [
    ({"mode": "none", "storage": "disk"}, "needs `offload.mode` 'block' or 'phase'"),
    ({"mode": "model", "lazy_load": True}, "lazy_load"),
    ({"mode": "block", "storage": "disk", "weight_dtype": "fp8_e4m3"}, "fp8_e4m3"),
    ({"mode": "block", "gpu_slots": 2, "prefetch_depth": 2}, "prefetch_depth"),
    ({"mode": "model", "weight_dtype": "fp8_e4m3"}, "streamed weights only"),
])
def test_rejected_combinations(tiny_ckpt: Path, offload: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        load_runner_config(None, tiny_config_dict(tiny_ckpt, offload=offload))


def test_unload_modules_with_offload_is_rejected(tiny_ckpt: Path) -> None:
    with pytest.raises(ConfigError, match="unload_modules"):
        load_runner_config(None, tiny_config_dict(tiny_ckpt, unload_modules=True, offload={"mode": "block"}))


@pytest.mark.parametrize(("dtype", "lazy"), [("float32", False), ("bfloat16", True)])
def test_disk_storage_casts_a_tensor_of_another_dtype_like_resident_loading(tiny_ckpt: Path, tmp_path: Path,
                                                                            dtype: str, lazy: bool) -> None:
    """Issue 19: a float16 tensor in the float32 checkpoint ran resident but was refused with disk
    storage (naming the tensor, not the file), though casts work in every mode. Streamed from disk
    it is now cast at every fetch like resident loading casts it once: bit-identical outputs, also
    with the whole checkpoint cast to bfloat16 and under lazy_load."""
    from safetensors.torch import save_file

    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_ckpt, mixed)
    (shard,) = sorted((mixed / "transformer").glob("*.safetensors"))
    sd = load_file(str(shard))
    sd["blocks.1.ffn.0.weight"] = sd["blocks.1.ffn.0.weight"].half()  # a streamed block weight
    save_file(sd, str(shard))
    small = REQUESTS[1]  # 32x32x5: the cast is what is tested, not the shape

    def video(runner: WanT2VRunner, tag: str) -> torch.Tensor:
        path = tmp_path / f"{tag}.safetensors"
        runner.run_pipeline(small.model_copy(update={"save_tensor_path": str(path)}), 0)
        return load_file(str(path))["video"]

    want = video(make_runner(mixed, dtype=dtype), "resident")
    got = video(make_runner(mixed, dtype=dtype, offload={"mode": "block", "storage": "disk", "lazy_load": lazy}), "disk")
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["model", "block_cpu", "phase_cpu_3slots", "block_cpu_unpinned", "block_disk_mmap",
                                  "phase_disk_pread", "block_disk_lazy", "phase_cpu_text_encoder",
                                  "block_disk_lazy_text_encoder", "phase_disk_lazy_resident_blocks"])
def test_cuda_mode_is_bit_identical_to_none_under_deterministic_algorithms(
        tiny_ckpt: Path, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        want = serve(make_runner(tiny_ckpt, device="cuda"), tmp_path, "none")
        runner = make_runner(tiny_ckpt, device="cuda", warmup=True, **MODES[mode])
        got = serve(runner, tmp_path, mode)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(got, want):
        assert torch.equal(a, b), mode
    if runner.streamer is not None:
        assert runner.streamer.stats()["h2d_copies"] > 0


def test_vae_tiling_decodes_in_tiles_through_the_runner(tiny_ckpt: Path, tmp_path: Path,
                                                         reference: list[torch.Tensor],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from runnerkit.models.wan import vae_tiling

    calls: list[tuple[int, ...]] = []
    real_decode = vae_tiling.WanVAE.decode

    def spy(self: Any, latents: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(latents.shape[-2:]))
        return real_decode(self, latents)

    monkeypatch.setattr(vae_tiling, "TILE_LATENT", 4)
    monkeypatch.setattr(vae_tiling, "OVERLAP_LATENT", 2)
    monkeypatch.setattr(vae_tiling.WanVAE, "decode", spy)
    runner = make_runner(tiny_ckpt, offload={"vae_tiling": True})
    video = serve(runner, tmp_path, "tiled")[0]
    assert calls[:8] == [(4, 4)] * 8  # 48x80 -> latent 6x10: 2 x 4 tiles of 4x4 latent pixels
    assert video.shape == reference[0].shape and not torch.equal(video, reference[0])
    assert (video.abs() <= 1).all()


def test_runner_streams_the_units_the_transformer_declares(tiny_ckpt: Path) -> None:
    from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32

    runner = make_runner(tiny_ckpt, offload={"mode": "phase"})
    assert runner.streamer is not None
    num_layers = len(runner.transformer.blocks)
    assert WanTransformer3D.STREAM_SPEC.phases == ("self_attn", "cross_attn", "ffn")
    assert [u.module for u in runner.streamer.units] == [f"blocks.{i}.{p}" for i in range(num_layers)
                                                         for p in ("self_attn", "cross_attn", "ffn")]
    streamed = {p for u in runner.streamer.units for p in u.params}
    block_params = {n for n, _ in runner.transformer.named_parameters() if n.startswith("blocks.")}
    # every block weight streams except the float32 ones the reference keeps (modulation, norm3)
    assert block_params - streamed == {n for n in block_params if keep_fp32(n)}
    assert {n.split(".", 2)[2] for n in block_params - streamed} == {"modulation", "norm3.weight", "norm3.bias"}
