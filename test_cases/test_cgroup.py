"""cgroup limits on this process: its own group's and every group's above it, the tightest (runnerkit.cgroup).

Each test writes a cgroup tree and a /proc/self/cgroup of its own in tmp_path: nothing of the machine it runs on
is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runnerkit import cgroup, memory

GIB = 1 << 30


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`write(membership, {group: {file: text}})`: a /proc/self/cgroup and a tree under a fresh CGROUP_ROOT."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", root)
    monkeypatch.setattr(cgroup, "MEMBERSHIP", tmp_path / "self-cgroup")

    def write(membership: str, groups: dict[str, dict[str, str]]) -> None:
        (tmp_path / "self-cgroup").write_text(membership)
        for group, files in groups.items():
            (root / group).mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (root / group / name).write_text(text + "\n")
    return write


def _v2_memory(limit: int | str, current: int, inactive: int = 0) -> dict[str, str]:
    return {"memory.max": str(limit), "memory.current": str(current), "memory.stat": f"anon 1\ninactive_file {inactive}"}


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
