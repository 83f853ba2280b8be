"""Open handles per checkpoint file, counted by the OS (`/proc/self/fd`, `/proc/self/maps`), not by the reader.

A *handle* is an open file descriptor: `/proc/self/fd/N` links to the file it has open. A
mapping made from a descriptor outlives the descriptor (it shows in `/proc/self/maps` only), so
mappings are counted as well, in mapped bytes: one mapping of a whole file covers at most the
file size rounded up to pages; two mappings of it cover more.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sample:
    """Open descriptors and mapped bytes per watched file (by file name) at one moment."""

    where: str
    thread: str
    fds: dict[str, int]
    mapped: dict[str, int]


def open_fds(paths: dict[str, str]) -> dict[str, int]:
    """Descriptors of this process open on each file of `paths` (real path -> name), by name."""
    count = dict.fromkeys(paths.values(), 0)
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:  # closed since the listing (or the listing's own descriptor)
            continue
        if target in paths:
            count[paths[target]] += 1
    return count


def mapped_bytes(paths: dict[str, str]) -> dict[str, int]:
    """Bytes of this process's address space mapped from each file of `paths`, by name."""
    total = dict.fromkeys(paths.values(), 0)
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    suffixes = tuple(paths)
    for line in lines:
        if line.endswith(suffixes):  # cheap filter: a torch process maps thousands of regions
            fields = line.split(maxsplit=5)  # address perms offset dev inode path
            if len(fields) == 6 and fields[5] in paths:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                total[paths[fields[5]]] += end - start
    return total


class HandleSampler:
    """Samples open descriptors and mappings of `files` on demand and from a polling thread.

    Args:
        files: the checkpoint's files (compared by real path, as `/proc` shows them).
        root: name each file by its path relative to `root` (e.g. "transformer/model.safetensors"),
            for checkpoints whose folders hold files of one name; default: the file name.
    """

    def __init__(self, files: Sequence[Path], root: Path | None = None) -> None:
        def name(f: Path) -> str:
            return str(Path(f).relative_to(root)) if root is not None else Path(f).name

        self.paths = {os.path.realpath(f): name(f) for f in files}
        self.page_limit = {name(f): -(-os.path.getsize(f) // mmap.PAGESIZE) * mmap.PAGESIZE for f in files}
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def sample(self, where: str) -> Sample:
        s = Sample(where, threading.current_thread().name, open_fds(self.paths), mapped_bytes(self.paths))
        with self._lock:
            self.samples.append(s)
        return s

    def start_polling(self, interval_s: float = 0.001) -> None:
        """Sample every `interval_s` seconds on a thread until `stop_polling` (the pause yields the GIL)."""
        def poll() -> None:
            while not self._stop.wait(interval_s):
                self.sample("poll")

        self._poller = threading.Thread(target=poll, name="fd-poller", daemon=True)
        self._poller.start()

    def stop_polling(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join()

    def violations(self, only: set[str] | None = None) -> list[str]:
        """Samples with two descriptors on a file, or more than one whole-file mapping of it (files
        named in `only`, or all)."""
        bad = []
        for s in self.samples:
            for name, n in s.fds.items():
                if only is not None and name not in only:
                    continue
                if n > 1:
                    bad.append(f"{n} descriptors open on {name} at {s.where} ({s.thread})")
                if s.mapped[name] > self.page_limit[name]:
                    bad.append(f"{s.mapped[name]} bytes of {name} ({self.page_limit[name]} page-rounded) mapped "
                               f"at {s.where} ({s.thread}): two mappings")
        return bad

    def ever_open(self) -> set[str]:
        """Files that had a descriptor open, or were mapped, in some sample."""
        return {name for s in self.samples for name, n in s.fds.items() if n or s.mapped[name]}
