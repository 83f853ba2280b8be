"""Cost of the disk reader's file-identity check (one `os.stat` before and one after each file's batch of reads).

CPU only, page cache warm (the worst case for the check: no disk time to hide it). A safetensors
file of Wan2.1 1.3B transformer blocks in bf16 (dim 1536, ffn 8960: 26 tensors, 92.9 MB per
block) and one of the tiny debug architecture's blocks (dim 64, ffn 128: 16 KB tensors) are
read unit by unit (`read_many` of every tensor of a block into one preallocated buffer, as
`DiskSource` does: two checks per unit and file) with the check and with it replaced by a no-op,
arms interleaved, order alternating per round.

    python -m bench.disk_identity_check [--rounds 15] [--out bench/results/disk_identity_check_cpu.json]

Reports, per reader (mmap, pread without dropping the page cache) and architecture: seconds per
unit with and without the check (median [min-max] over rounds), the per-round ratio, and the
check's own cost (median of 20000 calls) times the checks per unit over the unit's read time.
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
from safetensors.torch import save_file

from runnerkit.offload.disk import SafetensorsDiskReader

ARCHS = {  # name -> (dim, ffn_dim, blocks)
    "1.3B": (1536, 8960, 4),
    "debug": (64, 128, 64),
}


def block_shapes(dim: int, ffn: int) -> dict[str, tuple[int, ...]]:
    """The streamed tensors of one Wan2.1 attention block (the float32 modulation stays resident)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for attn in ("self_attn", "cross_attn"):
        for proj in ("q", "k", "v", "o"):
            shapes[f"{attn}.{proj}.weight"] = (dim, dim)
            shapes[f"{attn}.{proj}.bias"] = (dim,)
        shapes[f"{attn}.norm_q.weight"] = (dim,)
        shapes[f"{attn}.norm_k.weight"] = (dim,)
    shapes.update({"ffn.0.weight": (ffn, dim), "ffn.0.bias": (ffn,), "ffn.2.weight": (dim, ffn),
                   "ffn.2.bias": (dim,), "norm3.weight": (dim,), "norm3.bias": (dim,)})
    return shapes


def write(path: Path, dim: int, ffn: int, blocks: int) -> list[list[str]]:
    gen = torch.Generator().manual_seed(0)
    tensors, units = {}, []
    for b in range(blocks):
        names = []
        for leaf, shape in block_shapes(dim, ffn).items():
            name = f"blocks.{b}.{leaf}"
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
            names.append(name)
        units.append(names)
    save_file(tensors, str(path))
    return units


def fetch_all(reader: SafetensorsDiskReader, units: list[list[str]], buf: torch.Tensor) -> float:
    """Seconds to read every unit once (each tensor into its place in `buf`)."""
    start = time.perf_counter()
    for names in units:
        reads, offset = [], 0
        for name in names:
            n = reader.index[name].nbytes
            reads.append((name, buf[offset:offset + n]))
            offset += n
        reader.read_many(reads)
    return time.perf_counter() - start


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(kind: str, arch: str, folder: Path, rounds: int) -> dict[str, Any]:
    dim, ffn, blocks = ARCHS[arch]
    path = folder / f"{arch}.safetensors"
    units = write(path, dim, ffn, blocks)
    reader = SafetensorsDiskReader([path], reader=kind, drop_pages=False)
    unit_bytes = sum(reader.index[n].nbytes for n in units[0])
    buf = torch.empty(unit_bytes, dtype=torch.uint8)
    fetch_all(reader, units, buf)  # page cache and mapping warm
    real_check = reader._check
    per_unit: dict[str, list[float]] = {"check": [], "no_check": []}
    for r in range(rounds):
        for arm in (("check", "no_check") if r % 2 == 0 else ("no_check", "check")):
            reader._check = real_check if arm == "check" else (lambda *args: None)  # type: ignore[method-assign]
            per_unit[arm].append(fetch_all(reader, units, buf) / len(units))
    reader._check = real_check  # type: ignore[method-assign]
    handle = reader._long_lived[path]
    entry = reader.index[units[0][0]]
    calls = 20000
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            real_check(handle, entry, "before")
        samples.append((time.perf_counter() - start) / calls)
    check_s = statistics.median(samples)
    checks_per_unit = 2  # one file: before and after the unit's batch
    ratios = [a / b for a, b in zip(per_unit["check"], per_unit["no_check"])]
    reader.close()
    path.unlink()
    return {"reader": kind, "arch": arch, "tensors_per_unit": len(units[0]), "unit_bytes": unit_bytes,
            "units": len(units), "rounds": rounds,
            "seconds_per_unit": {arm: spread(xs) for arm, xs in per_unit.items()},
            "ratio_check_over_no_check": spread(ratios),
            "check_seconds": check_s, "checks_per_unit": checks_per_unit,
            "check_share_of_unit": check_s * checks_per_unit / statistics.median(per_unit["no_check"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        for arch in ARCHS:
            for kind in ("mmap", "pread"):
                res = run(kind, arch, Path(tmp), args.rounds)
                results.append(res)
                s, r = res["seconds_per_unit"], res["ratio_check_over_no_check"]
                ms = {arm: f"{x['median'] * 1e3:8.3f} ms [{x['min'] * 1e3:.3f}-{x['max'] * 1e3:.3f}]"
                      for arm, x in s.items()}
                print(f"{kind:5} {arch:5} unit {res['unit_bytes'] / 1e6:8.3f} MB: check {ms['check']}, "
                      f"no check {ms['no_check']}, ratio {r['median']:.4f} [{r['min']:.4f}-{r['max']:.4f}]; "
                      f"one check {res['check_seconds'] * 1e6:.2f} us x {res['checks_per_unit']} = "
                      f"{res['check_share_of_unit'] * 100:.3f} % of the unit", flush=True)
    if args.out:
        meta = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                "python": platform.python_version()}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
