"""File-system helpers shared by every writer of runnerkit files."""

from __future__ import annotations

import os
import re
from pathlib import Path


def new_file_mode() -> int:
    """The permission bits a newly created regular file gets here: 0o666 without the umask."""
    umask = None
    try:
        with open("/proc/self/status") as f:  # Linux >= 4.7: read without changing it
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
                    break
    except (OSError, ValueError, IndexError):
        pass
    if umask is None:  # elsewhere: set and restore (not thread-safe, but only used here)
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def give_default_mode(path: str | Path) -> None:
    """Give `path` the mode of a normally created file (the safetensors writer creates 0o600 files,
    unlike every other output; this makes all of a run's files alike)."""
    os.chmod(path, new_file_mode())


def write_error_reason(exc: BaseException) -> str:
    """The operating system's words for a failed write (`OSError.strerror`, or the OS message inside
    a safetensors `SafetensorError`), without paths or the writer's internals."""
    strerror = getattr(exc, "strerror", None)
    if strerror:
        return strerror
    found = re.search(r'message: "([^"]+)"|I/O error: ([^(]+?) \(os error', str(exc))
    return next(g for g in found.groups() if g) if found else type(exc).__name__

