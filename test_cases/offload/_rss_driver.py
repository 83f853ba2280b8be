"""Host memory of disk streaming, measured in a fresh process (`test_host_memory.py` runs this).

    python -m test_cases.offload._rss_driver CHECKPOINT READER GPU_SLOTS STEPS

Builds `WideToy` (blocks of two float32 linears, DIM -> HIDDEN -> DIM: `UNIT_BYTES` streamed per
block, a small float32 norm resident per block) on the meta device, then takes the process's RSS as the
baseline, resets the peak (`memory.reset_host_peak`), streams every block from CHECKPOINT
through `offload.setup.stream_module` (storage disk, pin_memory false, on the CPU: the device
slots are host memory too) for STEPS forward passes, and prints one JSON line: the baseline
and peak RSS (bytes), the sizes the bound is made of, and the process's reads (`memory.disk_io`).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch
from torch import nn

DIM, HIDDEN = 1024, 512
UNIT_BYTES = 2 * DIM * HIDDEN * 4
"""Streamed bytes of one block (two float32 weights, [HIDDEN, DIM] and [DIM, HIDDEN]): 4 MiB."""


def is_resident(name: str) -> bool:
    return ".norm." in name


class WideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.fc2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class WideToy(nn.Module):
    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WideBlock() for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def write_checkpoint(path: Path, num_blocks: int) -> list[tuple[str, int, int]]:
    """A float32 safetensors file of `WideToy(num_blocks)` whose bytes are one repeated value
    (0x3C3C3C3C, about 0.0115), written in slices without building tensors in memory.

    Returns:
        (name, absolute file offset, nbytes) of every tensor.
    """
    shapes = {}
    for i in range(num_blocks):
        shapes[f"blocks.{i}.fc1.weight"] = (HIDDEN, DIM)
        shapes[f"blocks.{i}.fc2.weight"] = (DIM, HIDDEN)
        shapes[f"blocks.{i}.norm.weight"] = (DIM,)
        shapes[f"blocks.{i}.norm.bias"] = (DIM,)
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = 4 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    chunk = b"\x3c" * (1 << 20)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())  # clean pages: the page cache may drop them (POSIX_FADV_DONTNEED skips dirty ones)
    return [(n, start + h["data_offsets"][0], h["data_offsets"][1] - h["data_offsets"][0]) for n, h in header.items()]


def stream(files: list[Path], reader: str, gpu_slots: int, steps: int, num_blocks: int,
           page_cache: str = "drop", read_threads: int | None = None) -> tuple[object, dict]:
    """Stream `WideToy` from `files` for `steps` forward passes; returns (streamer, measurements).
    `page_cache`: `offload.page_cache` of reader pread (the host-memory bounds are the dropping reader's);
    `read_threads`: `offload.read_threads` (None: not set)."""
    from runnerkit import memory
    from runnerkit.config import OffloadConfig
    from runnerkit.offload.layout import StreamSpec
    from runnerkit.offload.setup import stream_module
    from runnerkit.weights import build_on_meta

    spec = StreamSpec(blocks_attr="blocks", phases=(), keep_fp32=is_resident)
    model = build_on_meta(lambda: WideToy(num_blocks))
    x = torch.full((1, 4, DIM), 0.5)
    cfg = OffloadConfig(mode="block", storage="disk", reader=reader, pin_memory=False, gpu_slots=gpu_slots,
                        prefetch_depth=1, page_cache=page_cache if reader == "pread" else "auto",
                        **({} if read_threads is None else {"read_threads": read_threads}))
    before = memory.host_memory()
    io_before = memory.disk_io()
    peak_reset = memory.reset_host_peak()  # False: VmHWM counts from the process start (the test skips)
    streamer = stream_module(model, spec, cfg, torch.device("cpu"), torch.float32, "transformer", files=files)
    with torch.no_grad():
        for _ in range(steps):
            out = model(x)
    streamer.reset()
    after = memory.host_memory()
    io = memory.disk_io()
    assert torch.isfinite(out).all()
    streamed = sum(layout.raw_nbytes for layout in streamer.layouts)
    streamed_names = {p for unit in streamer.units for p in unit.params}
    resident = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n not in streamed_names)
    found = {"peak_reset": peak_reset,
             "baseline_rss": round(before.rss_gib * memory.GIB), "peak_rss": round(after.peak_rss_gib * memory.GIB),
             "largest_unit": max(layout.raw_nbytes for layout in streamer.layouts), "units": len(streamer.layouts),
             "streamed_per_step": streamed, "resident_bytes": resident, "gpu_slots": gpu_slots, "steps": steps,
             "disk_bytes_read": streamer.stats()["disk_bytes_read"],
             "rchar": io.rchar - io_before.rchar if io and io_before else None,
             "reader_dropped_bytes": streamer.source.reader.dropped_bytes}
    return streamer, found


def main(argv: list[str]) -> int:
    checkpoint, reader, gpu_slots, steps, num_blocks = argv
    streamer, found = stream([Path(checkpoint)], reader, int(gpu_slots), int(steps), int(num_blocks))
    streamer.close()
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
