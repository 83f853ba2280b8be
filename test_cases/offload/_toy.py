"""Toy network shaped like the Wan transformer for offload tests: embed -> blocks -> head.

Each block has three phase submodules called in order (`self_attn`, `cross_attn`, `ffn`),
a resident float32 `modulation` Parameter and a resident `norm3` LayerNorm, like WanAttentionBlock.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import torch
from safetensors.torch import save_file
from torch import nn

from runnerkit.offload import (
    BlockStreamer,
    CopyEngine,
    DiskSource,
    HostSource,
    SafetensorsDiskReader,
    StreamSpec,
    plan_units,
    resident_names,
)
from runnerkit.weights import build_on_meta

DIM, IN, NUM_BLOCKS = 16, 8, 4


def is_resident(name: str) -> bool:
    """The block tensors that stay on the device (Wan: modulation, norm3)."""
    return name.endswith(".modulation") or ".norm3." in name


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(x)))


class FFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attn()
        self.cross_attn = Attn()
        self.ffn = FFN()
        self.modulation = nn.Parameter(torch.randn(1, DIM) * 0.1)
        self.norm3 = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * (1 + self.modulation)
        x = x + self.self_attn(x)
        x = x + self.cross_attn(self.norm3(x))
        return x + self.ffn(x)


class ToyModel(nn.Module):
    STREAM_SPEC: ClassVar[StreamSpec] = StreamSpec(blocks_attr="blocks", phases=("self_attn", "cross_attn", "ffn"),
                                                   keep_fp32=is_resident)

    def __init__(self, num_blocks: int = NUM_BLOCKS) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.head = nn.Linear(DIM, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)  # [B, L, DIM]
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # [B, L, IN]


def make_reference(seed: int = 0, num_blocks: int = NUM_BLOCKS) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(num_blocks).eval()


def state_dict_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_checkpoint(sd: dict[str, torch.Tensor], folder: Path, split_block: int | None = 1) -> list[Path]:
    """Two shard files; block `split_block`'s tensors are split between them (phases in both)."""
    first, second = {}, {}
    for k, v in sd.items():
        in_second = k.startswith("head") or (split_block is not None and k.startswith(f"blocks.{split_block}.")
                                             and (".ffn." in k or ".cross_attn.o" in k))
        (second if in_second else first)[k] = v.contiguous()
    paths = [folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"]
    save_file(first, str(paths[0]))
    save_file(second, str(paths[1]))
    return paths


def build_streamed(sd: dict[str, torch.Tensor], mode: Literal["block", "phase"], storage: str = "host",
                   gpu_slots: int = 2, prefetch_depth: int = 1, files: list[Path] | None = None,
                   weight_dtype: Literal["same", "fp8_e4m3"] = "same", engine: CopyEngine | None = None,
                   reader: SafetensorsDiskReader | None = None, num_blocks: int = NUM_BLOCKS,
                   device: str = "cpu", dtype: torch.dtype = torch.float32,
                   pin_memory: bool = False) -> tuple[ToyModel, BlockStreamer]:
    """Meta skeleton + resident tensors loaded + streamer over `storage` ("host", "mmap", "pread")."""
    model = build_on_meta(lambda: ToyModel(num_blocks))
    units = plan_units(model, mode, ToyModel.STREAM_SPEC)
    resident = resident_names(model, units)
    if storage == "host":
        resident_sd = {k: sd[k] for k in resident}
        source = HostSource(units, sd, dtype, weight_dtype=weight_dtype, pin_memory=pin_memory)
    else:
        reader = reader or SafetensorsDiskReader(files, reader=storage)
        resident_sd = reader.load_tensors(resident)  # closed before any block fetch
        source = DiskSource(units, reader, dtype, pin_memory=pin_memory)
    resident_sd = {k: v.to(device=device, dtype=dtype) for k, v in resident_sd.items()}
    model.load_state_dict(resident_sd, strict=False, assign=True)
    streamer = BlockStreamer(model, units, source, device, gpu_slots=gpu_slots,
                             prefetch_depth=prefetch_depth, copy_engine=engine)
    return model, streamer
