"""The memory and CPU limits that Linux cgroups set on this process (None on systems without them).

A limit set on a group binds every group below it: a systemd unit's `MemoryMax=`, a Slurm job's
memory and CPUs, or a pod's limits are set on a group, and the process runs in that group or in one
below it. So each reader here walks from the process's own group (its line of /proc/self/cgroup)
up to the root of the mounted hierarchy and takes the tightest limit on the way.

In a container the mounted hierarchy's root is usually the container's own group: with a cgroup
namespace /proc/self/cgroup names paths below it; without one it names the host's path, and the
group mounted at the root (the 4th field of the mount's /proc/self/mountinfo line) is cut from its
front. A path that is not below the mounted group reads the root alone. cgroup v1 also reports the
tightest limit of all the groups above it, mounted or not (`hierarchical_memory_limit` of
`memory.stat`), which counts against the group's own usage.

cgroup v2: the unified hierarchy at `CGROUP_ROOT` (`memory.max`, `memory.current`, `memory.stat`
`inactive_file`; `cpu.max`). v1: one hierarchy per controller at `CGROUP_ROOT/<controller>`
(`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat` `total_inactive_file`,
`hierarchical_memory_limit`; `cpu.cfs_quota_us`, `cpu.cfs_period_us`). Not read: a v2 hierarchy
mounted elsewhere (hybrid mode's `unified` with controllers moved to it by `cgroup_no_v1`) and
combined v1 controllers mounted without a link named after each.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")
MOUNTINFO = Path("/proc/self/mountinfo")
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number (2^63 rounded to pages)
_GIB = 1 << 30


def _lines(path: Path) -> list[str] | None:
    """The lines of a /proc file (undecodable bytes kept as surrogates, as paths are), or None."""
    try:
        return path.read_text(errors="surrogateescape").splitlines()
    except OSError:
        return None


def _membership(version: int, controller: str) -> str | None:
    """The group path /proc/self/cgroup names for the v2 hierarchy ("0::<path>") or the v1 hierarchy
    of `controller` ("<id>:<controllers>:<path>"), or None."""
    for line in _lines(MEMBERSHIP) or []:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (hierarchy == "0" and not controllers) if version == 2 else controller in controllers.split(","):
            return path
    return None


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)  # mountinfo writes " " as \040


def _mounted_group(mount_point: Path) -> str | None:
    """The group mounted at `mount_point` (the root field of its cgroup line in /proc/self/mountinfo,
    the last mount there winning), or None."""
    target, found = os.path.realpath(mount_point), None
    for line in _lines(MOUNTINFO) or []:
        fields, _, tail = line.partition(" - ")
        fields = fields.split(" ")
        if len(fields) > 4 and tail.split(" ")[0] in ("cgroup", "cgroup2") and _unescape(fields[4]) == target:
            found = _unescape(fields[3])
    return found


def group_chain(version: int, controller: str) -> list[Path]:
    """The directories of this process's group and of each group above it up to the hierarchy's mount
    (v2: `CGROUP_ROOT`; v1: `CGROUP_ROOT/<controller>`), the process's own first; the mount alone when
    the membership cannot be read or names a group outside the mounted one."""
    root = CGROUP_ROOT if version == 2 else CGROUP_ROOT / controller
    path = _membership(version, controller)
    mounted = (_mounted_group(root) or "/").rstrip("/")
    if path is None or ".." in Path(path).parts or not (path == mounted or path.startswith(mounted + "/")):
        return [root]
    group = root / path[len(mounted):].lstrip("/")
    return [group, *(p for p in group.parents if p.is_relative_to(root))]


def _read_int(path: Path, negative: bool = False) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):  # ValueError: undecodable bytes
        return None
    return int(text) if re.fullmatch(r"-?[0-9]+" if negative else "[0-9]+", text) else None


def _stat_values(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, ValueError):
        return {}
    pairs = (line.split(" ", 1) for line in lines)
    return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2 and re.fullmatch("[0-9]+", pair[1].strip())}


def _where(group: Path, root: Path) -> str:
    return "" if group == root else f" of group /{group.relative_to(root)}"


def memory_available() -> tuple[int, str] | None:
    """Bytes left under the cgroup memory limit on this process's chain of groups that leaves the least
    (limit - usage + inactive file cache, the reclaimable part, as `docker stats` counts it; counted in
    the group that sets the limit, its other members included) and its source, e.g. "cgroup v2
    memory.max 16.00 GiB of group /system.slice/app.service"; None without a limit."""
    best: tuple[int, str] | None = None
    for version, limit_name, usage_name, key in ((2, "memory.max", "memory.current", "inactive_file"),
                                                 (1, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                  "total_inactive_file")):
        chain = group_chain(version, "memory")
        for group in chain:
            usage, stat = _read_int(group / usage_name), _stat_values(group / "memory.stat")
            limits = [(_read_int(group / limit_name), limit_name),
                      (stat.get("hierarchical_memory_limit") if version == 1 else None, "hierarchical_memory_limit")]
            limit, name = min(((v, n) for v, n in limits if v is not None), default=(None, ""))
            if limit is None or usage is None or limit >= _UNLIMITED:
                continue
            left = max(0, limit - usage + stat.get(key, 0))
            if best is None or left < best[0]:
                best = left, f"cgroup v{version} {name} {limit / _GIB:.2f} GiB{_where(group, chain[-1])}"
    return best


def _quota(group: Path, version: int) -> int | None:
    """The CPUs one group's quota allows (rounded up), or None (no quota, unreadable)."""
    if version == 2:
        try:
            quota, period = (group / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):  # ValueError: fewer than two fields, undecodable bytes
            return None
        quota_us, period_us = (int(quota), int(period)) if re.fullmatch("[0-9]+ [0-9]+", f"{quota} {period}") \
            else (None, None)
    else:
        quota_us = _read_int(group / "cpu.cfs_quota_us", negative=True)
        period_us = _read_int(group / "cpu.cfs_period_us")
    if quota_us is None or period_us is None or quota_us < 0 or period_us <= 0:  # v2 "max", v1 -1: no quota
        return None
    return max(1, math.ceil(quota_us / period_us))


def cpu_quota() -> int | None:
    """The CPUs the tightest cgroup CPU quota (v2 `cpu.max`, v1 CFS quota) on this process's chain of
    groups allows, rounded up; None where no group sets one."""
    quotas = [_quota(group, version) for version in (2, 1) for group in group_chain(version, "cpu")]
    return min((q for q in quotas if q is not None), default=None)
