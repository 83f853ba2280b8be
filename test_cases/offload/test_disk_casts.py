"""Disk streaming casts like resident loading (issue 19): a streamed tensor stored in another
floating dtype than the compute dtype is cast at every fetch, giving the same weights as the host
source (cast once) and as resident loading; a non-floating one is refused naming file and tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runnerkit.offload import DiskSource, SafetensorsDiskReader, plan_units
from runnerkit.weights import CheckpointError, build_on_meta
from test_cases.offload._toy import ToyModel, build_streamed, make_reference, state_dict_of, write_checkpoint

HALF = "blocks.1.ffn.fc1.weight"  # streamed in both modes, in the second shard (split block)


def mixed_state_dict() -> dict[str, torch.Tensor]:
    """The toy's float32 weights with one streamed tensor stored in float16."""
    sd = state_dict_of(make_reference(seed=0))
    sd[HALF] = sd[HALF].half()
    return sd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("mode", "reader"), [("block", "mmap"), ("phase", "pread")])
def test_disk_streaming_casts_like_the_host_source(tmp_path: Path, mode: str, reader: str, dtype: torch.dtype) -> None:
    sd = mixed_state_dict()
    files = write_checkpoint(sd, tmp_path)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    host_model, host = build_streamed(sd, mode, "host", dtype=dtype)
    disk_model, disk = build_streamed(sd, mode, reader, files=files, dtype=dtype)
    with torch.no_grad():
        want = host_model(x)
        for _ in range(2):  # two passes: the cast happens at every fetch, not once
            assert torch.equal(disk_model(x), want)
    # the streamed weight is the cast value itself (fetched into the slot during the forward)
    unit = next(i for i, u in enumerate(disk.units) if HALF in u.params)
    t = next(t for t in disk.source.layouts[unit].tensors if t.name == HALF)
    staged = disk.source.fetch(unit, 0, disk.engine)[t.offset:t.offset + t.nbytes].view(dtype).view(t.shape)
    assert torch.equal(staged, sd[HALF].to(dtype))
    host.close()
    disk.close()


def test_a_non_floating_streamed_tensor_is_refused_naming_file_and_tensor(tmp_path: Path) -> None:
    sd = state_dict_of(make_reference(seed=0))
    sd[HALF] = sd[HALF].to(torch.int32)
    files = write_checkpoint(sd, tmp_path)
    units = plan_units(build_on_meta(ToyModel), "block", ToyModel.STREAM_SPEC)
    with pytest.raises(CheckpointError) as exc:
        DiskSource(units, SafetensorsDiskReader(files, reader="pread"), torch.float32)
    assert str(exc.value) == ("disk source: 1 streamed tensors are not floating point, so no cast makes them weights: "
                              f"{HALF} (torch.int32) in {files[1]}")
