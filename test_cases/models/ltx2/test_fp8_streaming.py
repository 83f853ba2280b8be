"""LTX-2 fp8 single files streamed from disk as stored (docs/fp8_streaming.md): the transformer's
float8_e4m3fn block weights, with their `weight_scale` (or without), cross to the device at 1 byte per
element and are upcast there to exactly the weights of a resident load (`LTX2Checkpoint.load(dtype)`),
so the streamed transformer, and a whole tiny t2av request, equal the resident ones bit for bit; the
memory estimate counts the streamed units at their stored size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import OffloadConfig, RequestConfig, load_runner_config
from runnerkit.models.ltx2.arch import LTX2Arch
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint
from runnerkit.models.ltx2.checkpoint_synthetic import SINGLE_FILE, UPSAMPLER_FILE, write_synthetic_ltx2
from runnerkit.models.ltx2.runner import LTX2Runner
from runnerkit.models.ltx2.transformer import LTX2Transformer, keep_fp32
from runnerkit.offload import align_up
from runnerkit.offload.setup import stream_module
from runnerkit.planning.fit import module_footprint
from runnerkit.weights import build_on_meta, safetensors_infos

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
SEED = 0
FP8 = torch.float8_e4m3fn


def _single(folder: Path) -> LTX2Checkpoint:
    return LTX2Checkpoint.open(folder / SINGLE_FILE, folder / UPSAMPLER_FILE, folder / "text_encoder")


@pytest.fixture(scope="module", params=["plain", "scaled"])
def fp8_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(fp8 kind, folder) of the tiny configs' LTX-2.3 architecture as a single file whose block linear weights
    are float8_e4m3fn."""
    folder = tmp_path_factory.mktemp(f"fp8_{request.param}") / "ckpt"
    arch = LTX2Runner.parse_arch(json.loads((CONFIGS / "ltx2_t2av_tiny.json").read_text())["model"])
    return request.param, write_synthetic_ltx2(arch, folder, SEED, torch.bfloat16, "single_file",
                                               fp8_blocks=request.param)


def transformer_inputs(arch: LTX2Arch, dtype: torch.dtype) -> dict[str, Any]:
    """One t2av call: a 2 x 2 x 3 video latent grid, 5 audio frames, 6 text tokens (the last 2 masked)."""
    gen = torch.Generator().manual_seed(3)
    t = arch.transformer
    frames, height, width = 2, 2, 3
    mask = torch.ones(1, 6)
    mask[:, -2:] = 0
    timestep = torch.tensor([600.0])
    return {"hidden_states": torch.randn(1, frames * height * width, t.in_channels, generator=gen).to(dtype),
            "audio_hidden_states": torch.randn(1, 5, t.audio_in_channels, generator=gen).to(dtype),
            "encoder_hidden_states": torch.randn(1, 6, t.cross_attention_dim, generator=gen).to(dtype),
            "audio_encoder_hidden_states": torch.randn(1, 6, t.audio_cross_attention_dim, generator=gen).to(dtype),
            "timestep": timestep, "sigma": timestep, "encoder_attention_mask": mask,
            "audio_encoder_attention_mask": mask, "num_frames": frames, "height": height, "width": width,
            "audio_num_frames": 5}


@pytest.mark.parametrize("mode", ["block", "phase"])
def test_streamed_fp8_transformer_equals_the_resident_load(fp8_file: tuple[str, Path], mode: str) -> None:
    kind, folder = fp8_file
    ckpt = _single(folder)
    dtype = torch.bfloat16  # a bfloat16 product of fp8 and scale would round differently from the float32 one
    kw = transformer_inputs(ckpt.arch, dtype)
    with torch.no_grad():
        want = ckpt.load("transformer", dtype).eval()(**kw)
    model = build_on_meta(lambda: LTX2Transformer(ckpt.arch.transformer))
    sources = ckpt.transformer_block_sources(model)
    infos = safetensors_infos([folder / SINGLE_FILE], "test")
    num_fp8 = sum(1 for k in infos if infos[k].dtype == FP8)
    assert num_fp8 == 2 * 34  # the 2 blocks' linear weights
    assert len(sources.scale_map) == (0 if kind == "plain" else num_fp8)
    cfg = OffloadConfig(mode=mode, storage="disk", pin_memory=False)  # type: ignore[arg-type]
    streamer = stream_module(model, LTX2Transformer.STREAM_SPEC, cfg, torch.device("cpu"), dtype, "transformer",
                             files=sources.files, key_map=sources.key_map, shared_files=True,
                             scale_map=sources.scale_map)
    model.eval()
    with torch.no_grad():
        for _ in range(2):  # phase: the second call reads every unit (and scale) from the file again
            got = model(**kw)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), \
                f"max {max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))}"
        if mode == "block":  # 2 blocks in 2 slots stay there after the first call: no steady reads to count
            streamer.close()
            return

        # bytes of a steady call (each unit read and copied once), from the file's header: read = the
        # streamed tensors' bytes in the file + 4 per scale; copied = stored sizes (fp8: 1 byte, the rest
        # bf16) at 256-byte offsets + the unit's float32 scales
        read = copied = 0
        for unit in streamer.units:
            keys = [sources.key_map[p] for p in unit.params]
            fp8 = [p for p, k in zip(unit.params, keys) if infos[k].dtype == FP8]
            read += sum(infos[k].nbytes for k in keys) + 4 * sum(p in sources.scale_map for p in fp8)
            copied += sum(align_up(math.prod(infos[k].shape) * (1 if infos[k].dtype == FP8 else 2)) for k in keys)
            copied += align_up(4 * len(fp8)) if fp8 else 0
        streamer.source.settle()  # the previous call's read-ahead of unit 0 counted before, this call's after
        before = streamer.stats()
        model(**kw)
        streamer.source.settle()
        after = streamer.stats()
    assert after["disk_bytes_read"] - before["disk_bytes_read"] == read
    assert after["h2d_bytes"] - before["h2d_bytes"] == copied
    streamer.close()


def _tiny_config(folder: Path) -> dict:
    """The tiny t2av config on the CPU in bfloat16, reading the fp8 single file, upsampler and text encoder of
    `folder` (no synthetic writing, the file's own architecture)."""
    base = {**json.loads((CONFIGS / "ltx2_t2av_tiny.json").read_text()), "device": "cpu", "dtype": "bfloat16",
            "model_path": str(folder / SINGLE_FILE), "upsampler_path": str(folder / UPSAMPLER_FILE),
            "text_encoder_path": str(folder / "text_encoder")}
    for key in ("synthetic_checkpoint", "model"):
        base.pop(key)
    return base


def test_t2av_request_streamed_from_an_fp8_file_equals_the_resident_run(fp8_file: tuple[str, Path],
                                                                        tmp_path: Path) -> None:
    """A whole tiny request (both stages, 11 transformer calls), bfloat16, block + disk vs all resident, and
    the estimate's slots and staging slabs = what the streamer allocated (fp8 bytes + compute region)."""
    kind, folder = fp8_file
    base = _tiny_config(folder)
    request = RequestConfig(prompt="a red fox runs through fresh snow", seed=11, target_height=64, target_width=64,
                            target_video_length=9)
    outputs = {}
    for name, offload in (("resident", {}), ("streamed", {"mode": "block", "storage": "disk", "pin_memory": False})):
        runner = LTX2Runner(load_runner_config(None, {**base, "offload": offload}))
        before_load = runner.estimate_memory((64, 64, 9)).modules["transformer"] if offload else None
        runner.init_modules()
        path = tmp_path / f"{name}.safetensors"
        runner.run_pipeline(request.model_copy(update={"save_tensor_path": str(path)}), 0)
        outputs[name] = load_file(str(path))
        if offload:
            streamer = runner.streamer
            assert streamer is not None and streamer.stats()["disk_bytes_read"] > 0
            footprint = runner.estimate_memory((64, 64, 9)).modules["transformer"]
            assert footprint == before_load  # from the headers before loading, the same
            assert footprint.stream_slot_bytes == streamer.num_slots * streamer.slot_nbytes
            assert footprint.stream_host_bytes == sum(slab.nbytes for slab in streamer.source.staging)
            as_bf16 = module_footprint(build_on_meta(lambda: LTX2Transformer(runner.architecture().transformer)),
                                       torch.bfloat16, keep_fp32, LTX2Transformer.STREAM_SPEC, runner.config.offload)
            assert footprint.stream_resident_bytes == as_bf16.stream_resident_bytes
            # a slot holds the fp8 bytes and the upcast (compute-dtype) copy: more than a bf16 slot; the host
            # staging slabs hold the fp8 bytes only: less
            assert footprint.stream_slot_bytes > as_bf16.stream_slot_bytes
            assert footprint.stream_host_bytes < as_bf16.stream_host_bytes
            streamer.close()
    for key in ("video", "audio"):
        assert torch.equal(outputs["streamed"][key], outputs["resident"][key]), key


def test_the_tool_writes_an_fp8_single_file(tmp_path: Path) -> None:
    """`synth_checkpoint --layout single_file --fp8_blocks scaled` (the headline run's stand-in): every block
    linear weight float8_e4m3fn with its float32 `weight_scale`; a family that writes no fp8 refuses the flag with exit 2."""
    from runnerkit.tools import synth_checkpoint

    out = tmp_path / "ckpt"
    argv = ["--config", str(CONFIGS / "ltx2_t2av_tiny.json"), "--out", str(out), "--layout", "single_file"]
    assert synth_checkpoint.main([*argv, "--fp8_blocks", "scaled"]) == 0
    ckpt = _single(out)
    names = list(build_on_meta(lambda: LTX2Transformer(ckpt.arch.transformer)).state_dict())
    fp8 = ckpt.fp8_weights("transformer", names)
    assert fp8 == {n for n in names if n.startswith("transformer_blocks.") and n.endswith(".weight")
                   and len(ckpt.read_tensors("transformer", [n])[n].shape) == 2}
    stored, scales = ckpt.state_dict("transformer")
    assert set(scales) == fp8 and all(s.dtype == torch.float32 for s in scales.values())
    assert all(stored[n].dtype == FP8 and scales[n] > 0 for n in fp8)

    wan = ["--config", str(CONFIGS.parent / "wan" / "wan_t2v_tiny.json"), "--out", str(tmp_path / "wan")]
    assert synth_checkpoint.main([*wan, "--fp8_blocks", "plain"]) == 2
    assert not (tmp_path / "wan").exists()


@pytest.mark.parametrize(("mode", "kept"), [("phase", 0), ("block", 1)])
def test_storage_cpu_hands_the_fp8_state_dict_over_and_equals_the_resident_load(
        fp8_file: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, mode: str, kept: int) -> None:
    """`offload.storage` cpu: the transformer's state dict is read as stored and handed over. At each unit slab's
    allocation it holds exactly the tensors of that unit and the later ones (the resident part already on the
    device), its fp8 weights still fp8 (upcast one at a time as they are copied); it ends empty, scales too; the
    streamed transformer equals the resident load bit for bit, and the estimate's load transient is the peak of
    (state dict left + slabs so far) - slabs."""
    from runnerkit.offload import sources
    from runnerkit.offload.pinned import HostSlab

    kind, folder = fp8_file
    base = _tiny_config(folder)
    offload = {"mode": mode, "storage": "cpu", "pin_memory": False, "resident_blocks": kept}
    runner = LTX2Runner(load_runner_config(None, {**base, "offload": offload}))
    runner.checkpoint = ckpt = _single(folder)
    handed: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []  # what `state_dict` returned
    totals: list[int] = []  # bytes held: the state dict at the start, then with each slab the dict left + slabs
    slab_sizes: list[int] = []
    seen: list[dict[str, torch.dtype]] = []  # at each slab allocation: the dtypes left in the state dict
    real = LTX2Checkpoint.state_dict

    def spy(self: LTX2Checkpoint, component: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        handed.append(real(self, component))
        totals.append(sum(t.nbytes for t in handed[0][0].values()))
        return handed[-1]

    class RecordingSlab(HostSlab):
        def __init__(self, nbytes: int, *args: Any, **kw: Any) -> None:
            seen.append({n: t.dtype for n, t in handed[0][0].items()})
            slab_sizes.append(nbytes)
            totals.append(sum(t.nbytes for t in handed[0][0].values()) + sum(slab_sizes))
            super().__init__(nbytes, *args, **kw)

    monkeypatch.setattr(LTX2Checkpoint, "state_dict", spy)
    monkeypatch.setattr(sources, "HostSlab", RecordingSlab)
    model, streamer = runner.stream_transformer()
    names = list(model.state_dict())
    fp8 = ckpt.fp8_weights("transformer", names)
    units = streamer.units
    assert len(seen) == len(units) >= 1
    for j, left in enumerate(seen):
        assert set(left) == {p for u in units[j:] for p in u.params}
        assert {n for n, d in left.items() if d == FP8} == fp8 & set(left) != set()
    assert handed[0] == ({}, {})
    dtype = torch.bfloat16
    kw = transformer_inputs(ckpt.arch, dtype)
    with torch.no_grad():
        want = ckpt.load("transformer", dtype).eval()(**kw)
        got = model(**kw)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    footprint = runner.estimate_memory((64, 64, 9)).modules["transformer"]
    assert footprint.stream_host_bytes == sum(slab_sizes)
    assert footprint.stream_load_bytes == max(totals) - sum(slab_sizes)
    streamer.close()
