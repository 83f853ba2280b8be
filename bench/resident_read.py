"""Read throughput of a disk-streamed module's resident part by batch size (`offload.resident_read`).

CPU only. A synthetic safetensors file shaped like Qwen-Image's resident part in bf16 (the non-block
tensors: image/text input projections, time embedding, output norm and projection; and `--blocks` kept
transformer blocks of dim 3072: modulation linears of 113 MB, attention projections of 19 MB, MLPs of
75 MB, q/k norms and biases of 0.25-24 KB) is read through `read_resident_batches` with several batch
budgets, each batch dropped before the next is read (as `stream_module` does once it is on the device).
"1 tensor": one `load_tensors` call per tensor, in file order; "all": one batch, the old whole-part read.
(A budget below the largest tensor batches up to the largest tensor's size: `batch_bound`.)

    python -m bench.resident_read [--blocks 2] [--small 4000] [--rounds 5] [--out bench/results/resident_read_cpu.json]

A second file holds only small tensors (`--small` norm weights and biases of 6 KB): where one read per tensor
costs most (a handle, two identity checks and a read call each; no coalescing).

Per reader (pread, mmap) and budget: MB/s (median [min-max] over rounds), the batches, and the largest
batch. Arms are interleaved, order rotating per round. "warm": the file's pages are in the page cache
(read once beforehand); "cold": `posix_fadvise(DONTNEED)` drops them before every arm, so the bytes come
from the disk (a virtual disk here: its rate is the host's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from safetensors.torch import save_file

from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.resident_read import read_resident_batches

MIB = 1024**2
DIM, MLP, TXT = 3072, 12288, 3584
BUDGETS: dict[str, int | None] = {"1 tensor": 0, "16 MiB": 16 * MIB, "64 MiB": 64 * MIB, "256 MiB": 256 * MIB,
                                  "all": None}
"""Batch budgets; 0: one tensor per read (`load_tensors([name])`, file order), not a budget `plan_batches` takes
(its bound is at least the largest tensor); None: one read of everything."""


def shapes(blocks: int) -> dict[str, tuple[int, ...]]:
    """The resident tensors: Qwen-Image's non-block weights and `blocks` transformer blocks."""
    out: dict[str, tuple[int, ...]] = {
        "img_in.weight": (DIM, 64), "img_in.bias": (DIM,), "txt_norm.weight": (TXT,),
        "txt_in.weight": (DIM, TXT), "txt_in.bias": (DIM,),
        "time_text_embed.timestep_embedder.linear_1.weight": (DIM, 256),
        "time_text_embed.timestep_embedder.linear_1.bias": (DIM,),
        "time_text_embed.timestep_embedder.linear_2.weight": (DIM, DIM),
        "time_text_embed.timestep_embedder.linear_2.bias": (DIM,),
        "norm_out.linear.weight": (2 * DIM, DIM), "norm_out.linear.bias": (2 * DIM,),
        "proj_out.weight": (64, DIM), "proj_out.bias": (64,)}
    for b in range(blocks):
        p = f"transformer_blocks.{b}."
        for stream in ("img", "txt"):
            out[f"{p}{stream}_mod.1.weight"] = (6 * DIM, DIM)
            out[f"{p}{stream}_mod.1.bias"] = (6 * DIM,)
            out[f"{p}{stream}_mlp.net.0.proj.weight"] = (MLP, DIM)
            out[f"{p}{stream}_mlp.net.0.proj.bias"] = (MLP,)
            out[f"{p}{stream}_mlp.net.2.weight"] = (DIM, MLP)
            out[f"{p}{stream}_mlp.net.2.bias"] = (DIM,)
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            out[f"{p}attn.{proj}.weight"] = (DIM, DIM)
            out[f"{p}attn.{proj}.bias"] = (DIM,)
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            out[f"{p}attn.{norm}.weight"] = (128,)
    return out


def small_shapes(count: int) -> dict[str, tuple[int, ...]]:
    """`count` norm weights and biases of dim 3072 (6 KB each in bf16): a resident part of small tensors."""
    return {f"layers.{i // 4}.{('norm1', 'norm2', 'attn.bias', 'mlp.bias')[i % 4]}": (DIM,) for i in range(count)}


def write(path: Path, tensor_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in tensor_shapes.items()}
    save_file(tensors, str(path))
    return list(tensors)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_once(path: Path, names: list[str], reader: str, budget: int | None) -> tuple[float, int, int]:
    """(seconds, batches, largest batch bytes) of one read of the whole resident part."""
    disk = SafetensorsDiskReader([path], reader=reader)  # type: ignore[arg-type]
    total = sum(disk.index[n].nbytes for n in names)
    batches, largest = 0, 0
    start = time.perf_counter()
    one_by_one = (disk.load_tensors([n]) for n in sorted(names, key=lambda n: disk.index[n].offset))
    reads = (((t, {}) for t in one_by_one) if budget == 0
             else read_resident_batches(disk, names, {}, {}, budget or total))
    for tensors, _ in reads:
        batches += 1
        largest = max(largest, sum(t.nbytes for t in tensors.values()))
        del tensors  # as `stream_module`: on the device, the host copy dropped
    seconds = time.perf_counter() - start
    disk.close()
    return seconds, batches, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--small", type=int, default=4000, help="tensors of the small-tensor file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logger.remove()  # the reader logs one line per index
    results: list[dict[str, Any]] = []
    files = {"qwen": shapes(args.blocks), "small": small_shapes(args.small)}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for kind, tensor_shapes in files.items():
            path = Path(tmp) / f"{kind}.safetensors"
            names = write(path, tensor_shapes)
            size = path.stat().st_size
            print(f"{kind}: {len(names)} tensors, {size / 1e6:.0f} MB, {args.rounds} rounds, torch {torch.__version__}, "
                  f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", flush=True)
            for cache in ("cold", "warm"):
                arms = [(r, b) for r in ("pread", "mmap") for b in BUDGETS]
                times: dict[tuple[str, str], list[float]] = {a: [] for a in arms}
                shape: dict[tuple[str, str], tuple[int, int]] = {}
                for k in range(args.rounds):
                    for reader, label in arms[k % len(arms):] + arms[:k % len(arms)]:
                        if cache == "cold":
                            drop_cache(path)
                        else:
                            read_once(path, names, "mmap", None)  # pages into the cache (mmap keeps them cached)
                        seconds, batches, largest = read_once(path, names, reader, BUDGETS[label])
                        times[(reader, label)].append(size / seconds / 1e6)
                        shape[(reader, label)] = (batches, largest)
                for reader, label in arms:
                    rates = times[(reader, label)]
                    batches, largest = shape[(reader, label)]
                    row = {"file": kind, "file_mb": size / 1e6, "tensors": len(names), "cache": cache,
                           "reader": reader, "budget": label, "mb_per_s": statistics.median(rates), "min": min(rates),
                           "max": max(rates), "batches": batches, "largest_batch_mib": largest / MIB}
                    results.append(row)
                    print(f"{kind:5} {cache:4} {reader:5} {label:8} {row['mb_per_s']:8.0f} MB/s "
                          f"[{row['min']:.0f}-{row['max']:.0f}]  {batches:4} batches, largest {largest / MIB:7.1f} MiB",
                          flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "torch": torch.__version__, "results": results},
                                       indent=1))


if __name__ == "__main__":
    main()
