"""The memory and CPU limits Linux cgroups set on this process (nothing found elsewhere).

A limit set on a group binds every group below it: a systemd unit's `MemoryMax=`, a Slurm job's
memory and CPUs, or a pod's limits are set on a group, and the process runs in that group or in one
below it. So each reader here walks from the process's own group (its line of /proc/self/cgroup)
up to the root of the hierarchy and takes the tightest limit on the way. In a container the
hierarchy's root is usually the container's own group (a cgroup namespace, or a bind mount of it),
where the path that /proc/self/cgroup names may not exist: such levels are skipped, the root is
always read.

cgroup v2: the unified hierarchy at `CGROUP_ROOT` (`memory.max`, `memory.current`, `memory.stat`
`inactive_file`; `cpu.max`). v1: one hierarchy per controller at `CGROUP_ROOT/<controller>`
(`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat` `total_inactive_file`;
`cpu.cfs_quota_us`, `cpu.cfs_period_us`).
"""

from __future__ import annotations

import math
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number (2^63 rounded to pages)
_GIB = 1 << 30


def _membership(version: int, controller: str) -> str | None:
    """The group path /proc/self/cgroup names for the v2 hierarchy ("0::<path>") or the v1 hierarchy
    of `controller` ("<id>:<controllers>:<path>"), or None."""
    try:
        lines = MEMBERSHIP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (hierarchy == "0" and not controllers) if version == 2 else controller in controllers.split(","):
            return path.strip()
    return None


def group_chain(version: int, controller: str) -> list[Path]:
    """The directories of this process's group and of each group above it up to the hierarchy's root
    (v2: `CGROUP_ROOT`; v1: `CGROUP_ROOT/<controller>`), the process's own first; the root alone when
    the membership cannot be read or names a path outside the root."""
    root = CGROUP_ROOT if version == 2 else CGROUP_ROOT / controller
    path = _membership(version, controller)
    if not path or ".." in Path(path).parts:
        return [root]
    group = root / path.lstrip("/")
    return [group, *(p for p in group.parents if p.is_relative_to(root))]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.lstrip("-").isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _where(group: Path, root: Path) -> str:
    return "" if group == root else f" of group /{group.relative_to(root)}"


def memory_available() -> tuple[int, str] | None:
    """Bytes left under the tightest cgroup memory limit on this process's chain of groups (limit -
    usage + inactive file cache, the reclaimable part, as `docker stats` counts it; both counted in the
    group that sets the limit, siblings included) and its source, e.g. "cgroup v2 memory.max 16.00 GiB
    of group /system.slice/app.service"; None without a limit."""
    best: tuple[int, str] | None = None
    for version, limit_name, usage_name, key in ((2, "memory.max", "memory.current", "inactive_file"),
                                                 (1, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                  "total_inactive_file")):
        chain = group_chain(version, "memory")
        for group in chain:
            limit, usage = _read_int(group / limit_name), _read_int(group / usage_name)
            if limit is None or usage is None or limit >= _UNLIMITED:
                continue
            left = max(0, limit - usage + _stat_value(group / "memory.stat", key))
            if best is None or left < best[0]:
                best = left, f"cgroup v{version} {limit_name} {limit / _GIB:.2f} GiB{_where(group, chain[-1])}"
    return best


def _quota(group: Path, version: int) -> int | None:
    """The CPUs one group's quota allows (rounded up), or None (no quota, unreadable)."""
    if version == 2:
        try:
            quota, period = (group / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            return None
        if quota == "max" or not quota.isdigit() or not period.isdigit():
            return None
        quota_us, period_us = int(quota), int(period)
    else:
        quota_us, period_us = _read_int(group / "cpu.cfs_quota_us"), _read_int(group / "cpu.cfs_period_us")
        if quota_us is None or period_us is None or quota_us < 0:  # -1: no quota
            return None
    return None if period_us <= 0 else max(1, math.ceil(quota_us / period_us))


def cpu_quota() -> int | None:
    """The CPUs the tightest cgroup CPU quota (v2 `cpu.max`, v1 CFS quota) on this process's chain of
    groups allows, rounded up; None where no group sets one."""
    quotas = [_quota(group, version) for version in (2, 1) for group in group_chain(version, "cpu")]
    return min((q for q in quotas if q is not None), default=None)
