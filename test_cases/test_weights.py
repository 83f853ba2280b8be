"""Checkpoint readers + `assign_state_dict`: loaded weights give outputs that do not depend on
where their bytes sat in the file (alignment changes the rounding of the CPU kernels)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from runnerkit.weights import assign_state_dict, build_on_meta, read_pth, read_safetensors
from test_cases._alignment import misaligned_weights

IN, OUT = 64, 96


def _linear_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"weight": torch.randn(OUT, IN, generator=gen) / IN**0.5, "bias": 0.02 * torch.randn(OUT, generator=gen)}


def _write_safetensors(sd: dict[str, torch.Tensor], path: Path, residue: int) -> Path:
    """`sd` in one safetensors file whose "weight" bytes start at a file offset == `residue` (mod 64).

    A float32 "pad" tensor (sorted first) shifts the data; its length is searched until the
    header (safetensors spec: u64 header size, JSON header, data) puts "weight" where asked.
    The file is mapped at a page boundary, so the offset's residue is the address's.
    """
    for pad in range(1, 64):
        save_file({"a_pad": torch.zeros(pad), **sd}, str(path))
        raw = path.read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        begin = json.loads(raw[8:8 + header_len])["weight"]["data_offsets"][0]
        if (8 + header_len + begin) % 64 == residue:
            return path
    raise AssertionError(f"no pad puts the weight at residue {residue}")


def _write_pth(sd: dict[str, torch.Tensor], path: Path, residue: int) -> Path:
    """`sd` in a .pth whose "weight" is a view `residue` bytes into its storage (torch.save starts
    every storage 64-byte aligned in the zip, so the view starts at `residue` mod 64)."""
    w = sd["weight"]
    storage = torch.zeros(w.numel() + residue // 4)
    view = storage[residue // 4:].view(w.shape)
    view.copy_(w)
    torch.save({"weight": view, "bias": sd["bias"]}, path)
    return path


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    sd = read_safetensors([path], "linear")
    sd.pop("a_pad")
    return sd


READERS: dict[str, tuple[Callable[..., Path], Callable[[Path], dict[str, torch.Tensor]], str]] = {
    "safetensors": (_write_safetensors, _read_safetensors, "model.safetensors"),
    "pth": (_write_pth, lambda p: read_pth(p, "linear"), "model.pth"),
}


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["keep", "float32"])
@pytest.mark.parametrize("reader", list(READERS))
def test_weight_offset_in_file_does_not_change_outputs(tmp_path: Path, reader: str,
                                                       dtype: torch.dtype | None) -> None:
    write, read, name = READERS[reader]
    sd = _linear_weights()
    x = torch.randn(1, IN, generator=torch.Generator().manual_seed(6))  # one token: MKL's GEMV path
    outputs = []
    for residue in (0, 4):
        folder = tmp_path / f"residue{residue}"
        folder.mkdir()
        loaded = read(write(sd, folder / name, residue))
        # the reader really hands out a tensor at the file's alignment (else this test tests nothing)
        assert loaded["weight"].data_ptr() % 64 == residue
        assert torch.equal(loaded["weight"], sd["weight"])
        module = assign_state_dict(build_on_meta(lambda: nn.Linear(IN, OUT)), loaded, "linear", dtype=dtype)
        assert misaligned_weights(module) == []
        with torch.no_grad():
            outputs.append(module(x))  # [1, OUT]
    assert torch.equal(outputs[0], outputs[1]), (outputs[0] - outputs[1]).abs().max()
