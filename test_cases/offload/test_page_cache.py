"""`offload.page_cache`: whether disk streaming with reader pread keeps the streamed files' pages in the
OS page cache (runnerkit/offload/setup.py `page_cache_kept`).

What each choice does to the page cache is measured in test_host_memory.py
(`test_pread_streaming_keeps_the_page_cache_bounded`, through the config key); here: which choice `auto`
makes from the host's memory, that the choice reaches the reader and the log, and the config's bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runnerkit import memory
from runnerkit.config import OffloadConfig
from runnerkit.offload.setup import page_cache_kept
from runnerkit.planning.ladder import Candidate, constrain
from test_cases._logs import logged
from test_cases.offload import _rss_driver

GIB = 2**30


def _sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk space (its size is all the decision reads)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The host's memory as `page_cache_kept` sees it: set `available` (bytes or None) and `cgroup`."""
    seen: dict[str, object] = {"available": 100 * GIB, "cgroup": None}

    def available() -> tuple[int, str] | None:
        value = seen["available"]
        return None if value is None else (int(value), "MemAvailable of /proc/meminfo")  # type: ignore[call-overload]

    monkeypatch.setattr(memory, "host_available_bytes", available)
    monkeypatch.setattr(memory, "cgroup_memory_limit", lambda: seen["cgroup"])
    return seen


def test_auto_keeps_files_up_to_half_the_available_memory(tmp_path: Path, host: dict[str, object]) -> None:
    files = [_sparse(tmp_path / "a.safetensors", 30 * GIB), _sparse(tmp_path / "b.safetensors", 20 * GIB)]
    assert page_cache_kept(files, "auto") == (
        True, "the files' 50.00 GiB against 100.00 GiB available (MemAvailable of /proc/meminfo)")
    host["available"] = 100 * GIB - 1
    assert page_cache_kept(files, "auto") == (
        False, "the files' 50.00 GiB against 100.00 GiB available (MemAvailable of /proc/meminfo): more than 50%")


def test_auto_drops_under_a_cgroup_limit_or_without_a_reading(tmp_path: Path, host: dict[str, object]) -> None:
    files = [_sparse(tmp_path / "a.safetensors", GIB)]
    host["cgroup"] = "cgroup v2 memory.max 64.00 GiB"
    assert page_cache_kept(files, "auto") == (
        False, "a cgroup memory limit applies (cgroup v2 memory.max 64.00 GiB): cached pages count against it")
    host["cgroup"], host["available"] = None, None
    assert page_cache_kept(files, "auto") == (False, "the host's available memory is unknown")


def test_an_explicit_choice_is_taken_whatever_the_host(tmp_path: Path, host: dict[str, object]) -> None:
    files = [_sparse(tmp_path / "a.safetensors", 90 * GIB)]
    host["cgroup"] = "cgroup v2 memory.max 64.00 GiB"
    assert page_cache_kept(files, "keep") == (True, "offload.page_cache=keep")
    host["cgroup"] = None
    assert page_cache_kept([_sparse(tmp_path / "b.safetensors", GIB)], "drop") == (False, "offload.page_cache=drop")


@pytest.mark.parametrize("available, kept", [(100 * GIB, True), (GIB // 16, False)], ids=["roomy", "tight"])
def test_the_choice_reaches_the_reader_and_the_log(tmp_path: Path, host: dict[str, object], available: int,
                                                   kept: bool) -> None:
    """auto through `stream_module`: a 64 MiB checkpoint against 100 GiB available is kept, against 64 MiB
    it is dropped after each read (the reader's `drop_pages`)."""
    checkpoint = tmp_path / "wide.safetensors"
    _rss_driver.write_checkpoint(checkpoint, 16)
    host["available"] = available
    with logged() as lines:
        streamer, _ = _rss_driver.stream([checkpoint], "pread", gpu_slots=2, steps=1, num_blocks=16,
                                         page_cache="auto")
    try:
        assert streamer.source.reader.drop_pages is not kept  # type: ignore[attr-defined]
    finally:
        streamer.close()  # type: ignore[attr-defined]
    said = [line for line in lines if "page cache of the streamed files" in line]
    assert said == [f"transformer: page cache of the streamed files {'kept' if kept else 'dropped after each read'}: "
                    f"{page_cache_kept([checkpoint], 'auto')[1]}"]


@pytest.mark.parametrize("keys", [{"mode": "block", "page_cache": "keep"},
                                  {"mode": "block", "storage": "disk", "page_cache": "drop"},
                                  {"mode": "none", "page_cache": "keep"}], ids=["storage-cpu", "reader-mmap", "none"])
def test_page_cache_outside_pread_streaming_is_refused(keys: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"`offload.page_cache`='(keep|drop)' applies to `offload.storage`='disk' "
                                         r"with `offload.reader`='pread' only \(got storage='(cpu|disk)', "
                                         r"reader='mmap'\); allowed there: 'auto', 'keep', 'drop'"):
        OffloadConfig(**keys)
    with pytest.raises(ValueError, match="Input should be 'auto', 'keep' or 'drop'"):
        OffloadConfig(mode="block", storage="disk", reader="pread", page_cache="always")


def test_an_explicit_page_cache_leaves_the_plan_disk_streaming_only() -> None:
    """With mode auto, `page_cache` set constrains the ladder: the host-memory rungs are left out with the
    validator's reason, the pread rungs take it."""
    explicit = {"page_cache": "keep"}
    host_rung, reason = constrain(Candidate({"mode": "block", "storage": "cpu", "weight_dtype": "same",
                                             "lazy_load": False, "stream_modules": None}), explicit)
    assert host_rung is None and "`offload.page_cache`='keep' applies to `offload.storage`='disk'" in reason
    disk_rung, _ = constrain(Candidate({"mode": "block", "storage": "disk", "reader": "pread", "weight_dtype": "same",
                                        "lazy_load": True, "stream_modules": None}), explicit)
    assert disk_rung is not None and disk_rung.page_cache == "keep" and disk_rung.lazy_load
