"""cgroup limits on this process: its own group's and every group's above it, the tightest (runnerkit.cgroup).

Each test writes a cgroup tree and a /proc/self/cgroup of its own in tmp_path: nothing of the machine it runs on
is read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from runnerkit import cgroup, memory

GIB = 1 << 30


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`write(membership, {group: {file: text}}, mounts)`: a /proc/self/cgroup, a tree under a fresh CGROUP_ROOT
    (its path has a space: mountinfo escapes it) and a /proc/self/mountinfo mounting `mounts` {hierarchy (""
    for v2, else the controller): the group mounted there}."""
    root = tmp_path / "sys fs" / "cgroup"
    root.mkdir(parents=True)  # an empty tree until `write`
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", root)
    monkeypatch.setattr(cgroup, "MEMBERSHIP", tmp_path / "self-cgroup")
    monkeypatch.setattr(cgroup, "MOUNTINFO", tmp_path / "mountinfo")

    def write(membership: str | bytes, groups: dict[str, dict[str, str]], mounts: dict[str, str] = {}) -> None:
        shutil.rmtree(root)  # each call writes a tree of its own
        root.mkdir()
        (tmp_path / "self-cgroup").write_bytes(membership if isinstance(membership, bytes) else membership.encode())
        (tmp_path / "mountinfo").write_text("".join(
            f"{30 + i} 23 0:{40 + i} {group} {str(root / hierarchy).replace(' ', chr(92) + '040')} rw,relatime - "
            f"{'cgroup' if hierarchy else 'cgroup2'} cgroup rw{',' + hierarchy if hierarchy else ''}\n"
            for i, (hierarchy, group) in enumerate(mounts.items())))
        for group, files in groups.items():
            (root / group).mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (root / group / name).write_text(text + "\n")
    return write


def _v2_memory(limit: int | str, current: int, inactive: int = 0) -> dict[str, str]:
    return {"memory.max": str(limit), "memory.current": str(current),
            "memory.stat": f"anon 1\ninactive_file {inactive}"}


@pytest.mark.parametrize("membership, groups, want", [
    ("0::/a/b\n", {"a": {"cpu.max": "200000 100000"}, "a/b": {"cpu.max": "max 100000"}}, 2),  # the parent binds
    ("0::/a/b\n", {"": {"cpu.max": "300000 100000"}, "a/b": {"cpu.max": "150000 100000"}}, 2),  # the smallest
    ("0::/a\n", {"a": {"cpu.max": "100000 100000"}, "b": {"cpu.max": "50000 100000"}}, 1),  # a sibling's is not ours
    ("0::/a\n", {"b": {"cpu.max": "50000 100000"}}, None),  # no quota on our chain
    ("0::/a/../b\n", {"": {"cpu.max": "300000 100000"}, "a": {}, "b": {"cpu.max": "50000 100000"}}, 3),  # root only
    ("4:cpu,cpuacct:/job_1/step_0\n0::/\n", {"cpu/job_1": {"cpu.cfs_quota_us": "250000", "cpu.cfs_period_us": "100000"},
                                             "cpu": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}}, 3),
    ("4:cpu,cpuacct:/x\n0::/\n", {"cpu/x": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}}, None),
    ("0::/a\n", {"a": {"cpu.max": "abc def"}}, None), ("0::/a\n", {"a": {"cpu.max": "100000 0"}}, None),
    ("", {"": {"cpu.max": "400000 100000"}}, 4)])  # no membership line: the root's
def test_cpu_quota_is_the_tightest_on_the_process_chain(tree, membership: str, groups: dict[str, dict[str, str]],
                                                        want: int | None) -> None:
    """v2 `cpu.max` and v1 CFS quota, from the process's group to the root (rounded up: 2.5 CPUs are 3)."""
    tree(membership, groups)
    assert cgroup.cpu_quota() == want


def test_memory_available_is_the_tightest_on_the_process_chain(tree) -> None:
    """A service's own group without a limit below a slice with one (systemd `MemoryMax=` on the slice): the slice's
    limit less the slice's usage (its other members included) counts; a tighter own limit wins; no limit: None."""
    tree("0::/app.slice/app.service\n", {"app.slice": _v2_memory(16 * GIB, 10 * GIB, 1 * GIB),
                                         "app.slice/app.service": _v2_memory("max", 4 * GIB),
                                         "other.slice": _v2_memory(1 * GIB, 0)})
    assert cgroup.memory_available() == (7 * GIB, "cgroup v2 memory.max 16.00 GiB of group /app.slice")
    tree("0::/app.slice/app.service\n", {"app.slice/app.service": _v2_memory(8 * GIB, 4 * GIB)})
    assert cgroup.memory_available() == (4 * GIB, "cgroup v2 memory.max 8.00 GiB of group /app.slice/app.service")
    tree("0::/app.slice/app.service\n", {"app.slice": _v2_memory(16 * GIB, 14 * GIB)})  # the parent leaves less
    assert cgroup.memory_available() == (2 * GIB, "cgroup v2 memory.max 16.00 GiB of group /app.slice")
    tree("0::/app.slice/app.service\n", {"app.slice": _v2_memory("max", 10 * GIB),
                                         "app.slice/app.service": _v2_memory("max", 4 * GIB)})
    assert cgroup.memory_available() is None


def test_memory_v1_job_group_and_a_container_root(tree) -> None:
    """v1 (a Slurm job's group below the memory hierarchy's root; "no limit" is 2^63 rounded to pages); a container
    whose /proc/self/cgroup names a path that does not exist below its root: the root's limit."""
    tree("9:memory:/slurm/uid_1/job_7/step_0\n0::/\n", {
        "memory": {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": str(50 * GIB)},
        "memory/slurm/uid_1/job_7": {"memory.limit_in_bytes": str(32 * GIB), "memory.usage_in_bytes": str(20 * GIB),
                                     "memory.stat": f"cache 5\ntotal_inactive_file {2 * GIB}"}})
    assert cgroup.memory_available() == (14 * GIB, "cgroup v1 memory.limit_in_bytes 32.00 GiB of group "
                                                   "/slurm/uid_1/job_7")
    tree("9:memory:/docker/0123abcd\n0::/\n", {"memory": {"memory.limit_in_bytes": str(12 * GIB),
                                                          "memory.usage_in_bytes": str(2 * GIB)}})
    assert cgroup.memory_available() == (10 * GIB, "cgroup v1 memory.limit_in_bytes 12.00 GiB")


def test_host_available_takes_the_chain_limit(tree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host limit the planner reads: the smaller of MemAvailable and the chain's tightest limit, with its group."""
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 100 * GIB)
    tree("0::/a/b\n", {"a": _v2_memory(24 * GIB, 4 * GIB)})
    assert memory.host_available_bytes() == (20 * GIB, "cgroup v2 memory.max 24.00 GiB of group /a minus its usage")
    tree("0::/a/b\n", {"a": _v2_memory(240 * GIB, 4 * GIB)})
    assert memory.host_available_bytes() == (100 * GIB, "MemAvailable of /proc/meminfo")


def test_a_container_without_a_cgroup_namespace_cuts_its_mounted_group(tree) -> None:
    """/proc/self/cgroup names the host's path; the container's own group is mounted at the root (mountinfo): the
    process's subgroup below it is found (v1 and v2), a host group of the same name is not read (Docker in Docker),
    and a path outside the mounted group reads the root alone."""
    tree("9:memory:/docker/abc/job_1\n", {"memory": {"memory.limit_in_bytes": str(12 * GIB),
                                                      "memory.usage_in_bytes": str(2 * GIB)},
                                           "memory/job_1": {"memory.limit_in_bytes": str(4 * GIB),
                                                            "memory.usage_in_bytes": str(1 * GIB)}},
         {"memory": "/docker/abc"})
    assert cgroup.memory_available() == (3 * GIB, "cgroup v1 memory.limit_in_bytes 4.00 GiB of group /job_1")
    tree("0::/system.slice/docker-abc.scope/inner\n", {"": _v2_memory(12 * GIB, 2 * GIB),
                                                       "inner": _v2_memory(4 * GIB, 1 * GIB)},
         {"": "/system.slice/docker-abc.scope"})
    assert cgroup.memory_available() == (3 * GIB, "cgroup v2 memory.max 4.00 GiB of group /inner")
    tree("9:memory:/docker/outer\n", {"memory": {"memory.limit_in_bytes": str(12 * GIB),
                                                 "memory.usage_in_bytes": str(2 * GIB)},
                                      "memory/docker": {"memory.limit_in_bytes": str(GIB),
                                                        "memory.usage_in_bytes": str(GIB - 1)}},
         {"memory": "/docker/outer"})  # an inner dockerd's group under the mounted root: not this process's
    assert cgroup.memory_available() == (10 * GIB, "cgroup v1 memory.limit_in_bytes 12.00 GiB")
    tree("9:memory:/elsewhere/deeper/x\n", {}, {"memory": "/docker/outer"})
    assert cgroup.group_chain(1, "memory") == [cgroup.CGROUP_ROOT / "memory"]


def test_v1_counts_the_limit_of_groups_above_the_mount(tree) -> None:
    """A pod's limit above the container's mounted group, the container's own unlimited: `hierarchical_memory_limit`
    less the group's usage; without it, no limit."""
    stat = f"hierarchical_memory_limit {4 * GIB}\ntotal_inactive_file {GIB // 2}\n"
    tree("9:memory:/\n", {"memory": {"memory.limit_in_bytes": "9223372036854771712",
                                     "memory.usage_in_bytes": str(2 * GIB), "memory.stat": stat}})
    assert cgroup.memory_available() == (2 * GIB + GIB // 2, "cgroup v1 hierarchical_memory_limit 4.00 GiB")
    (cgroup.CGROUP_ROOT / "memory" / "memory.stat").write_text("hierarchical_memory_limit 9223372036854771712\n")
    assert cgroup.memory_available() is None


@pytest.mark.parametrize("limit, usage", [("--5", "1"), ("\u00b9", "1"), ("-5", "1"), ("4096", "-1"), ("1_000", "1"),
                                          ("", "1"), ("max", "1"), ("4096", "1 2")])
def test_a_value_that_is_not_a_byte_count_sets_no_limit(tree, limit: str, usage: str) -> None:
    """Only non-negative decimal integers count (no sign, underscore or other digit): anything else is no limit, and
    nothing raises."""
    tree("0::/\n", {"": {"memory.max": limit, "memory.current": usage}})
    assert cgroup.memory_available() is None


@pytest.mark.parametrize("cpu_max", ["--5 100000", "\u00b9 100000", "-100000 100000", "100000", "100000 \u00b9", ""])
def test_a_cpu_max_that_is_not_a_quota_sets_none(tree, cpu_max: str) -> None:
    tree("0::/\n", {"": {"cpu.max": cpu_max}})
    assert cgroup.cpu_quota() is None


def test_undecodable_bytes_in_the_membership_or_a_file_raise_nothing(tree) -> None:
    """A group name that is not UTF-8 is still a path (the bytes kept); a limit file that is not UTF-8 is no limit."""
    tree(b"0::/caf\xe9\n", {})
    group = cgroup.CGROUP_ROOT / os.fsdecode(b"caf\xe9")
    group.mkdir()
    (group / "cpu.max").write_text("200000 100000\n")
    assert cgroup.cpu_quota() == 2
    (group / "cpu.max").write_bytes(b"\xff\xfe 100000\n")
    (group / "memory.max").write_bytes(b"\xff\n")
    (group / "memory.current").write_text("1\n")
    assert cgroup.cpu_quota() is None and cgroup.memory_available() is None
