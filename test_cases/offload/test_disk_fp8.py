"""fp8 checkpoints stream from disk as stored (docs/fp8_streaming.md): float8_e4m3fn tensors cross to the
device as 1-byte values with their float32 per-tensor scale (the checkpoint's, or 1.0) and are upcast
there to exactly the weights a resident load gives, `(q.float() * scale).to(dtype)`; disk reads and H2D
copies carry fp8 bytes, not compute-dtype bytes.

The toy checkpoint: every streamed 2-D linear weight in fp8 with a `weight_scale` (absmax / 448, never a
power of two here), one streamed weight in fp8 without a scale, `embed.weight` (resident) in fp8 with a
scale, the rest float32 (cast on the CPU at each fetch, as before).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import save_file

from runnerkit.config import OffloadConfig
from runnerkit.offload import (
    BlockStreamer,
    DiskSource,
    HostSource,
    SafetensorsDiskReader,
    StreamSpec,
    align_up,
    plan_units,
    quantize_fp8_e4m3,
    resident_names,
)
from runnerkit.offload.setup import stream_module
from runnerkit.weights import CheckpointError, build_on_meta, safetensors_infos, to_compute
from test_cases.offload._toy import ToyModel, make_reference, state_dict_of, write_checkpoint

FP8 = torch.float8_e4m3fn
PLAIN = "blocks.2.ffn.fc2.weight"  # fp8 without a scale: the value is the weight
RESIDENT = "embed.weight"  # fp8 with a scale outside the blocks: upcast at load
#: the toy's spec with nothing kept float32, so that the whole toy runs in bfloat16
SPEC = StreamSpec(blocks_attr="blocks", phases=ToyModel.STREAM_SPEC.phases, keep_fp32=lambda name: False)


def scale_key(name: str) -> str:
    return name[: -len("weight")] + "weight_scale"


def fp8_checkpoint(folder: Path) -> tuple[list[Path], dict[str, torch.Tensor], dict[str, str]]:
    """(the two shard files, the stored tensors, model name -> scale key) of the toy as an fp8 release."""
    stored: dict[str, torch.Tensor] = {}
    scales: dict[str, str] = {}
    for name, value in state_dict_of(make_reference(seed=0)).items():
        if name == PLAIN:
            stored[name] = value.to(FP8)
        elif name.endswith(".weight") and value.dim() == 2 and (name.startswith("blocks.") or name == RESIDENT):
            q, scale = quantize_fp8_e4m3(value)
            stored[name], stored[scale_key(name)] = q, scale.reshape(())
            scales[name] = scale_key(name)
        else:
            stored[name] = value
    assert all(stored[s].item() not in (0.5, 0.25, 0.125, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256)
               for s in scales.values()), "a power-of-two scale would not show a double rounding"
    return write_checkpoint(stored, folder), stored, scales


def expected_weights(stored: dict[str, torch.Tensor], scales: dict[str, str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a resident load gives: fp8 -> float32, times the float32 scale, rounded once to `dtype`."""
    out = {}
    for name, value in stored.items():
        if name.endswith("weight_scale"):
            continue
        if name in scales:
            out[name] = (value.to(torch.float32) * stored[scales[name]].to(torch.float32)).to(dtype)
        else:
            out[name] = value.to(dtype)
    return out


def streamed_toy(files: list[Path], scales: dict[str, str], mode: Literal["block", "phase"], dtype: torch.dtype,
                 reader: Literal["mmap", "pread"] = "mmap", slots: int = 2,
                 resident_blocks: int = 0) -> tuple[ToyModel, BlockStreamer]:
    cfg = OffloadConfig(mode=mode, storage="disk", reader=reader, gpu_slots=slots, pin_memory=False,
                        resident_blocks=resident_blocks)
    model = build_on_meta(ToyModel)
    streamer = stream_module(model, SPEC, cfg, torch.device("cpu"), dtype, "toy", files=files, scale_map=scales)
    return model, streamer


def resident_toy(weights: dict[str, torch.Tensor]) -> ToyModel:
    model = build_on_meta(ToyModel)
    model.load_state_dict({k: to_compute(v) for k, v in weights.items()}, assign=True)  # CPU-aligned, as loaded
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("mode", "reader"), [("block", "mmap"), ("phase", "pread")])
def test_disk_streamed_fp8_equals_the_resident_load(tmp_path: Path, mode: Literal["block", "phase"],
                                                    reader: Literal["mmap", "pread"], dtype: torch.dtype) -> None:
    files, stored, scales = fp8_checkpoint(tmp_path)
    want = expected_weights(stored, scales, dtype)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    model, streamer = streamed_toy(files, scales, mode, dtype, reader)  # two slots: staging and slots reused
    with torch.no_grad():
        out = resident_toy(want)(x)
        for _ in range(2):  # the second pass re-reads every unit (and its scales) from the file
            assert torch.equal(model(x), out)
    assert torch.equal(model.embed.weight, want[RESIDENT])  # the resident scaled weight, upcast at load
    streamer.close()

    # every weight in its slot (one slot per unit, so all stay there after a pass) is the resident value
    model, streamer = streamed_toy(files, scales, mode, dtype, reader, slots=len(plan_units(model, mode, SPEC)))
    with torch.no_grad():
        model(x)
    streamed = [t for layout in streamer.layouts for t in layout.tensors]
    assert {t.name for t in streamed if t.stored_dtype == FP8} == {n for n in scales if n != RESIDENT} | {PLAIN}
    for t in streamed:
        assert torch.equal(model.get_parameter(t.name), want[t.name]), t.name
    streamer.close()


@pytest.mark.parametrize(("mode", "kept"), [("block", 2), ("phase", 5)])
def test_kept_fp8_units_are_upcast_once_as_a_resident_load(tmp_path: Path, mode: Literal["block", "phase"],
                                                           kept: int) -> None:
    """`offload.resident_blocks`: the kept units' fp8 weights (block: blocks 1 and 3; phase: units 1, 3, 6, 8,
    10, among them blocks.2.ffn with the unscaled fp8 weight) are read once and upcast at load, the float32
    product rounded once to bfloat16: the weights and the output of the resident load, bit for bit."""
    files, stored, scales = fp8_checkpoint(tmp_path)
    want = expected_weights(stored, scales, torch.bfloat16)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    model, streamer = streamed_toy(files, scales, mode, torch.bfloat16, resident_blocks=kept)
    streamed = {p for u in streamer.units for p in u.params}
    resident_fp8 = {n for n in [*scales, PLAIN] if n.startswith("blocks.") and n not in streamed}
    assert len(resident_fp8) >= 4 and (PLAIN in resident_fp8) is (mode == "phase")
    for name in resident_fp8:
        assert torch.equal(model.get_parameter(name), want[name]), name
    with torch.no_grad():
        out = resident_toy(want)(x)
        for _ in range(2):
            assert torch.equal(model(x), out)
    streamer.close()


@pytest.mark.parametrize("mode", ["block", "phase"])
def test_disk_reads_and_h2d_copies_carry_fp8_bytes(tmp_path: Path, mode: Literal["block", "phase"]) -> None:
    """Per (steady) pass: bytes read = the streamed tensors' bytes in the file (1 per fp8 element) + 4 per scale;
    bytes copied H2D = each unit's tensors at their stored size (fp8: 1 byte, the rest bf16), 256-aligned,
    + its float32 scales: counted from the file's header, not from the layout."""
    files, stored, scales = fp8_checkpoint(tmp_path)
    infos = safetensors_infos(files, "toy")
    model, streamer = streamed_toy(files, scales, mode, torch.bfloat16)
    streamer.source.read_ahead = False  # reads in the fetch: no background read in flight when the counters are read
    units = plan_units(build_on_meta(ToyModel), mode, SPEC)
    disk_bytes = h2d_bytes = 0
    for unit in units:
        fp8 = [p for p in unit.params if infos[p].dtype == FP8]
        disk_bytes += sum(infos[p].nbytes for p in unit.params) + sum(infos[scales[p]].nbytes for p in fp8 if p in scales)
        h2d_bytes += sum(align_up(math.prod(infos[p].shape) * (1 if p in fp8 else 2)) for p in unit.params)
        h2d_bytes += align_up(4 * len(fp8)) if fp8 else 0
    assert sum(1 for p in infos if infos[p].dtype == FP8) > 10
    x = torch.randn(1, 3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)  # the first pass also reads unit 0 of the next (the wrap prefetch)
        before = streamer.stats()
        model(x)  # a steady pass: every unit read and copied once
        after = streamer.stats()
    assert after["disk_bytes_read"] - before["disk_bytes_read"] == disk_bytes
    assert after["h2d_bytes"] - before["h2d_bytes"] == h2d_bytes
    assert h2d_bytes == sum(layout.raw_nbytes for layout in streamer.layouts)
    streamer.close()


def test_the_upcast_is_the_float32_product_rounded_once_for_both_sources() -> None:
    """HostSource (weight_dtype fp8_e4m3, quantized at load) and DiskSource share the device upcast: in
    bfloat16, each streamed weight equals (q.float() * scale).to(bfloat16) bit for bit."""
    sd = state_dict_of(make_reference(seed=0))
    model = build_on_meta(ToyModel)
    units = plan_units(model, "phase", SPEC)
    model.load_state_dict({k: sd[k].to(torch.bfloat16) for k in resident_names(model, units)}, strict=False,
                          assign=True)
    source = HostSource(units, sd, torch.bfloat16, weight_dtype="fp8_e4m3", pin_memory=False)
    streamer = BlockStreamer(model, units, source, "cpu", gpu_slots=len(units))
    with torch.no_grad():
        model(torch.randn(1, 3, 8, dtype=torch.bfloat16))
    differs = 0
    for unit in units:
        for name in unit.params:
            q, scale = quantize_fp8_e4m3(sd[name])
            want = (q.to(torch.float32) * scale).to(torch.bfloat16)
            assert torch.equal(model.get_parameter(name), want), name
            differs += int(not torch.equal(want, (q.to(torch.bfloat16) * scale.to(torch.bfloat16))))
    assert differs > 0, "no weight where a bfloat16 product would differ: the test could not fail"
    streamer.close()


def test_bad_scales_are_refused_naming_the_tensor_and_file(tmp_path: Path) -> None:
    files, stored, scales = fp8_checkpoint(tmp_path)
    units = plan_units(build_on_meta(ToyModel), "block", SPEC)
    name = "blocks.0.self_attn.q.weight"

    def refused(scale_map: dict[str, str], folder: Path, tensors: dict[str, torch.Tensor] | None = None) -> str:
        paths = files
        if tensors is not None:
            folder.mkdir()
            paths = [folder / "one.safetensors"]
            save_file(tensors, str(paths[0]))
        with pytest.raises(CheckpointError) as exc:
            DiskSource(units, SafetensorsDiskReader(paths), torch.bfloat16, scale_map=scale_map)
        return str(exc.value)

    assert refused({**scales, name: "nowhere.weight_scale"}, tmp_path / "a") == (
        "disk source: 1 fp8 scales are not in the checkpoint: nowhere.weight_scale")
    bf16_scale = {**stored, scale_key(name): stored[scale_key(name)].to(torch.bfloat16)}
    assert refused(scales, tmp_path / "b", bf16_scale) == (
        "disk source: 1 fp8 scales are not one float32 element (only per-tensor scales are supported): "
        f"{scale_key(name)} (torch.bfloat16, shape []) in {tmp_path / 'b' / 'one.safetensors'}")
    per_channel = {**stored, scale_key(name): torch.ones(16)}
    assert "not one float32 element" in refused(scales, tmp_path / "c", per_channel)
    assert refused({**scales, "blocks.0.self_attn.q.bias": scale_key(name)}, tmp_path / "d") == (
        "disk source: 1 scaled tensors are not float8_e4m3fn, so a scale does not apply: "
        f"blocks.0.self_attn.q.bias (torch.float32) in {files[0]}")


def test_config_refusal_points_fp8_checkpoints_to_weight_dtype_same() -> None:
    with pytest.raises(ValueError, match="For an fp8 checkpoint .* keep `offload.weight_dtype`='same'"):
        OffloadConfig(mode="block", storage="disk", weight_dtype="fp8_e4m3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("mode", "kept"), [("block", 2), ("phase", 5)])
def test_kept_fp8_units_are_upcast_on_the_device_as_on_the_cpu(tmp_path: Path, mode: Literal["block", "phase"],
                                                               kept: int) -> None:
    """On CUDA the kept units' scaled fp8 weights are moved as stored and upcast on the device: each is the
    float32 product rounded once to bfloat16 computed on the CPU, bit for bit, and a pass through the streamed
    toy gives the output of the resident toy on the same device."""
    files, stored, scales = fp8_checkpoint(tmp_path)
    want = expected_weights(stored, scales, torch.bfloat16)
    cfg = OffloadConfig(mode=mode, storage="disk", reader="mmap", gpu_slots=2, pin_memory=True, resident_blocks=kept)
    model = build_on_meta(ToyModel)
    cuda = torch.device("cuda")
    streamer = stream_module(model, SPEC, cfg, cuda, torch.bfloat16, "toy", files=files, scale_map=scales)
    streamed = {p for u in streamer.units for p in u.params}
    resident_fp8 = {n for n in [*scales, PLAIN] if n not in streamed}
    assert RESIDENT in resident_fp8 and len(resident_fp8) >= 5
    for name in resident_fp8:
        got = model.get_parameter(name)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want[name]), name
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(cuda)
    reference = build_on_meta(ToyModel)
    reference.load_state_dict({k: v.to(cuda) for k, v in want.items()}, assign=True)
    with torch.no_grad():
        out = reference.eval()(x)
        for _ in range(2):
            assert torch.equal(model(x), out)
    streamer.close()


@pytest.mark.parametrize(("mode", "kept"), [("block", 2), ("phase", 5)])
def test_the_host_estimate_counts_kept_fp8_units_as_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           mode: Literal["block", "phase"], kept: int) -> None:
    """What loading the resident part reads into host memory (the reader's tensors, scales aside) is the
    footprint's `resident_read_bytes`: fp8-stored weights at 1 byte, not upcast; the estimate's transient
    host term takes it (with the scales) while it fits one batch. Storage cpu reads the state dict as stored too (fp8 weights upcast one at a time as they
    are loaded or copied into their slab): the same resident bytes."""
    from runnerkit.offload.disk import SafetensorsDiskReader
    from runnerkit.config import RunnerConfig
    from runnerkit.planning.fit import MemoryEstimate, host_bytes_of, module_footprint

    files, stored, scales = fp8_checkpoint(tmp_path)
    read: list[int] = []
    real = SafetensorsDiskReader.load_tensors

    def spy(self: SafetensorsDiskReader, names: Any) -> dict[str, torch.Tensor]:
        out = real(self, names)
        read.append(sum(t.nbytes for k, t in out.items() if not k.endswith("weight_scale")))
        return out

    monkeypatch.setattr(SafetensorsDiskReader, "load_tensors", spy)
    model, streamer = streamed_toy(files, scales, mode, torch.bfloat16, resident_blocks=kept)
    streamer.close()
    cfg = OffloadConfig(mode=mode, storage="disk", gpu_slots=2, resident_blocks=kept)
    fp8 = {n for n, t in stored.items() if t.dtype == FP8}
    footprint = module_footprint(build_on_meta(ToyModel), torch.bfloat16, SPEC.keep_fp32, SPEC, cfg, fp8_stored=fp8)
    streamed = {p for u in streamer.units for p in u.params}
    # the toy's file keeps its biases in float32 (4 bytes read, 2 loaded): the one difference allowed
    wide = sum(t.numel() * 2 for n, t in stored.items()
               if t.dtype == torch.float32 and n not in streamed and n not in scales.values())
    assert read[0] - wide == footprint.resident_read_bytes < footprint.stream_resident_bytes
    run = RunnerConfig(model_cls="toy", task="t2v", model_path=str(tmp_path), offload=cfg)
    host = host_bytes_of(MemoryEstimate(modules={"toy": footprint}, stages=()), run, torch.device("cuda"))
    # the toy's resident part is one batch (`resident_read.RESIDENT_BATCH_BYTES`): all of it, each fp8 weight
    # with a 4-byte scale (batches of a larger part: test_resident_read.py)
    kept_fp8 = len([n for n in fp8 if n not in streamed])
    assert footprint.stream_load_bytes == footprint.resident_read_bytes + 4 * kept_fp8
    assert (host.transient_module, host.transient_bytes) == ("toy", footprint.stream_load_bytes)
    upcast = module_footprint(build_on_meta(ToyModel), torch.bfloat16, SPEC.keep_fp32, SPEC,
                              cfg.model_copy(update={"storage": "cpu"}), fp8_stored=fp8)
    assert upcast.resident_read_bytes == footprint.resident_read_bytes < upcast.stream_resident_bytes
