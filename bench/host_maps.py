"""Where a running process's host memory is: its mappings from /proc/PID/smaps, grouped by what backs them
(the file's path, or [heap], [anon], ...), largest resident first, with the anonymous part of each.

Reads the process's `RssAnon + RssShmem` (what the memory plan's host estimate bounds; docs/profile.md
`host_anon_shmem_gib`) and shows which mappings hold it: a checkpoint mapped privately and then written to shows
up under its file's path with anonymous pages; allocations under [anon] (pinned host slabs registered with
`cudaHostRegister` are ordinary anonymous memory).

    python3 bench/host_maps.py PID [--top 15]

Linux only. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")
FIELDS = {"Rss": "rss_gib", "Anonymous": "anon_gib"}


def mappings(pid: int) -> dict[str, dict[str, float]]:
    """Backing -> {"rss_gib", "anon_gib", "count"} summed over the process's mappings. Shared memory (what RssShmem
    counts: /dev/shm files, memfd:..., /SYSV...) shows under its own backing, resident with no anonymous pages."""
    groups: dict[str, dict[str, float]] = defaultdict(lambda: {"rss_gib": 0.0, "anon_gib": 0.0, "count": 0})
    current = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        header = HEADER.match(line)
        if header:
            current = groups[header.group(1) or "[anon]"]
            current["count"] += 1
            continue
        key, _, value = line.partition(":")
        if current is not None and key in FIELDS:
            current[FIELDS[key]] += int(value.split()[0]) / 2**20
    return groups


def status(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile, RssShmem of /proc/PID/status, GiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = round(int(value.split()[0]) / 2**20, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    try:
        found = mappings(args.pid)
    except (FileNotFoundError, ProcessLookupError):
        raise SystemExit(f"no process {args.pid} (/proc/{args.pid}/smaps does not exist)") from None
    except PermissionError:
        raise SystemExit(f"/proc/{args.pid}/smaps cannot be read: run as the process's user or root") from None
    groups = sorted(found.items(), key=lambda kv: -kv[1]["rss_gib"])[: args.top]
    print(json.dumps({"status_gib": status(args.pid),
                      "top": [{"backing": k, **{n: round(v, 3) for n, v in g.items()}} for k, g in groups]}))


if __name__ == "__main__":
    main()
