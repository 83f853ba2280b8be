"""The pread reader's throughput per `read_threads`: streamed units read from a safetensors file into one
staging buffer (pinned where CUDA is there), from the page cache (`--page_cache keep`: the file's pages
stay cached, as `offload.page_cache` keep/auto leaves them) or from the disk (`drop`: the file's pages are
dropped before each pass and every read's pages after it, so every pass reads the disk).

    python3 bench/pread_threads.py --dir /tmp/pread --gib 8 --threads 1 2 4 8 --out $OUT/pread_threads

Writes `<dir>/units_<gib>g_<units>.safetensors` once (uint8 tensors, `--units` units of six tensors each; the
name carries the sizes, so another size writes another file), syncs it to the disk, then per thread count
`--passes` passes over every unit, and prints a table: GB/s of each pass, median [min-max]. With `keep` the
file is in the page cache from its write (unless the host evicted it: then the first pass reads the disk).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table  # noqa: E402

PARTS = (("attn.qkv", 3), ("attn.out", 1), ("ff.up", 4), ("ff.down", 4), ("norm", 0), ("scale", 0))


def write(path: Path, units: int, unit_bytes: int) -> None:
    import torch
    from safetensors.torch import save_file

    weight = sum(w for _, w in PARTS)
    sd = {}
    for u in range(units):
        for name, w in PARTS:
            n = unit_bytes * w // weight if w else 4096
            sd[f"blocks.{u:03d}.{name}"] = torch.full((n,), u % 251, dtype=torch.uint8)
    save_file(sd, str(path))


def main() -> None:
    import torch

    from runnerkit.offload.disk import SafetensorsDiskReader

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=float, default=8.0, help="size of the file")
    p.add_argument("--units", type=int, default=37)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--page_cache", choices=["keep", "drop"], default="keep")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"units_{args.gib:g}g_{args.units}.safetensors"
    unit_bytes = int(args.gib * 2**30) // args.units
    if not path.is_file():
        t0 = time.perf_counter()
        write(path, args.units, unit_bytes)
        os.sync()  # written back: dropping the pages then really empties the cache
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s", flush=True)
    pinned = torch.cuda.is_available()
    rows, raw = [], {}
    for threads in args.threads:
        reader = SafetensorsDiskReader([path], reader="pread", drop_pages=args.page_cache == "drop",
                                       read_threads=threads)
        names = [[n for n in reader.index if n.startswith(f"blocks.{u:03d}.")] for u in range(args.units)]
        size = max(sum(reader.index[n].nbytes for n in unit) for unit in names)
        staging = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        rates = []
        for _ in range(args.passes):
            if args.page_cache == "drop":
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            t0, total = time.perf_counter(), 0
            for unit in names:
                at, reads = 0, []
                for n in unit:
                    nbytes = reader.index[n].nbytes
                    reads.append((n, staging[at:at + nbytes]))
                    at += nbytes
                reader.read_many(reads)
                total += at
            rates.append(total / (time.perf_counter() - t0) / 1e9)
        reader.close()
        raw[threads] = rates
        rows.append([threads, f"{statistics.median(rates):.2f} [{min(rates):.2f}-{max(rates):.2f}]",
                     " ".join(f"{r:.2f}" for r in rates)])
        print(f"read_threads {threads}: GB/s per pass {[round(r, 2) for r in rates]}", flush=True)
    header = ["read_threads", f"GB/s, median [min-max] of {args.passes} passes ({args.page_cache})", "every pass"]
    table = markdown_table(header, rows)
    print(table)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "pinned": pinned, "gb_per_s": raw},
                                                       indent=1))
        Path(f"{args.out}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
