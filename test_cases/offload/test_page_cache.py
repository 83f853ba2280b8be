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
from runnerkit.offload import setup
from runnerkit.offload.setup import page_cache_kept
from runnerkit.planning.ladder import Candidate, constrain
from test_cases._logs import logged
from test_cases.offload import _rss_driver

GIB = 2**30
SOURCE = "MemAvailable of /proc/meminfo"


def _sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk space (its size is all the decision reads)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The host's memory as `page_cache_kept` sees it (set `available`: bytes or None, and `source`), and no
    file decided before the test."""
    seen: dict[str, object] = {"available": 100 * GIB, "source": SOURCE}

    def available() -> tuple[int, str] | None:
        value = seen["available"]
        return None if value is None else (int(value), str(seen["source"]))  # type: ignore[call-overload]

    monkeypatch.setattr(memory, "host_available_bytes", available)
    monkeypatch.setattr(setup, "_PAGE_CACHE_DECIDED", {})
    return seen


def test_auto_keeps_files_up_to_half_the_available_memory(tmp_path: Path, host: dict[str, object]) -> None:
    files = [_sparse(tmp_path / "a.safetensors", 30 * GIB), _sparse(tmp_path / "b.safetensors", 20 * GIB)]
    assert page_cache_kept(files, "auto") == (
        True, f"50.00 GiB of files kept with these against 100.00 GiB available ({SOURCE})")
    host["available"] = GIB  # decided once: a module built again reads its files as before
    assert page_cache_kept(files[::-1], "auto") == (True, "as decided for these files earlier in this process")
    setup._PAGE_CACHE_DECIDED.clear()
    host["available"] = 100 * GIB - 1
    assert page_cache_kept(files, "auto") == (
        False, f"50.00 GiB of files kept with these against 100.00 GiB available ({SOURCE}): more than 50%")


def test_auto_counts_the_files_kept_before(tmp_path: Path, host: dict[str, object]) -> None:
    """Two modules' files: the second is kept only while both fit the share together; a file shared by both
    counts once."""
    shared = _sparse(tmp_path / "release.safetensors", 30 * GIB)
    assert page_cache_kept([shared], "auto")[0]
    assert page_cache_kept([shared, _sparse(tmp_path / "te.safetensors", 20 * GIB)], "auto") == (
        True, f"50.00 GiB of files kept with these against 100.00 GiB available ({SOURCE})")
    assert page_cache_kept([_sparse(tmp_path / "expert2.safetensors", 1)], "auto") == (
        False, f"50.00 GiB of files kept with these against 100.00 GiB available ({SOURCE}): more than 50%")


def test_auto_follows_a_cgroup_limit_and_drops_without_a_reading(tmp_path: Path, host: dict[str, object]) -> None:
    """`memory.host_available_bytes` gives what a cgroup limit leaves where that is smaller: the decision and
    its reason follow it."""
    host["available"], host["source"] = 10 * GIB, "cgroup v2 memory.max 64.00 GiB"
    assert page_cache_kept([_sparse(tmp_path / "a.safetensors", 6 * GIB)], "auto") == (
        False, "6.00 GiB of files kept with these against 10.00 GiB available (cgroup v2 memory.max 64.00 GiB): "
               "more than 50%")
    host["available"] = None
    assert page_cache_kept([_sparse(tmp_path / "b.safetensors", GIB)], "auto") == (
        False, "the host's available memory is unknown")


def test_an_explicit_choice_is_taken_whatever_the_host(tmp_path: Path, host: dict[str, object]) -> None:
    host["available"] = GIB
    assert page_cache_kept([_sparse(tmp_path / "a.safetensors", 90 * GIB)], "keep") == (True, "offload.page_cache=keep")
    host["available"] = 1000 * GIB
    assert page_cache_kept([_sparse(tmp_path / "b.safetensors", GIB)], "drop") == (False, "offload.page_cache=drop")
    assert setup._PAGE_CACHE_DECIDED == {}  # explicit choices are not auto's decisions


@pytest.mark.parametrize("reader, available, kept", [("pread", 100 * GIB, True), ("pread", GIB // 16, False),
                                                     ("mmap", 100 * GIB, None)], ids=["roomy", "tight", "mmap"])
def test_the_choice_reaches_the_reader_and_the_log(tmp_path: Path, host: dict[str, object], reader: str,
                                                   available: int, kept: bool | None) -> None:
    """auto through `stream_module`: a 64 MiB checkpoint against 100 GiB available is kept, against 64 MiB
    it is dropped after each read (the reader's `drop_pages`); reader mmap has no page-cache choice (its
    `drop_pages` unmaps pages from the process) and logs none."""
    checkpoint = tmp_path / "wide.safetensors"
    _rss_driver.write_checkpoint(checkpoint, 16)
    host["available"] = available
    with logged() as lines:
        streamer, _ = _rss_driver.stream([checkpoint], reader, gpu_slots=2, steps=1, num_blocks=16,
                                         page_cache="auto")
    try:
        assert streamer.source.reader.drop_pages is not bool(kept)  # type: ignore[attr-defined]
    finally:
        streamer.close()  # type: ignore[attr-defined]
    said = [line for line in lines if "page cache" in line]
    size = checkpoint.stat().st_size / GIB
    why = f"{size:.2f} GiB of files kept with these against {available / GIB:.2f} GiB available ({SOURCE})"
    assert said == ([] if kept is None else [
        f"transformer: page cache of the streamed files kept: {why}" if kept else
        f"transformer: page cache of the streamed files dropped after each read: {why}: more than 50%"])


@pytest.mark.parametrize("keys, message", [
    ({"mode": "block", "page_cache": "keep"}, r"`offload.page_cache`='keep' applies to `offload.storage`='disk' "
     r"with `offload.reader`='pread' only \(got storage='cpu', reader='mmap'\); allowed there: 'auto', 'keep', "
     r"'drop'"),
    ({"mode": "block", "storage": "disk", "page_cache": "drop"}, r"`offload.page_cache`='drop' applies to "
     r"`offload.storage`='disk' with `offload.reader`='pread' only \(got storage='disk', reader='mmap'\)"),
    ({"mode": "none", "page_cache": "keep"}, r"`offload.page_cache` has no effect with `offload.mode`='none'"),
    ({"mode": "auto", "storage": "cpu", "page_cache": "keep"}, r"`offload.page_cache`='keep' applies to "
     r"`offload.storage`='disk' with `offload.reader`='pread' only \(allowed there: 'auto', 'keep', 'drop'\); the "
     r"config sets storage='cpu' \[type"),
    ({"mode": "auto", "reader": "mmap", "page_cache": "drop"}, r"the config sets reader='mmap' \[type"),
], ids=["storage-cpu", "reader-mmap", "none", "auto-storage-cpu", "auto-reader-mmap"])
def test_page_cache_outside_pread_streaming_is_refused(keys: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**keys)
    with pytest.raises(ValueError, match="Input should be 'auto', 'keep' or 'drop'"):
        OffloadConfig(mode="block", storage="disk", reader="pread", page_cache="always")


def test_in_a_plan_page_cache_sets_how_the_pread_rungs_read() -> None:
    """With mode auto, `page_cache` excludes no rung: the pread rungs take it, the others have no page cache."""
    explicit = {"page_cache": "keep"}
    assert OffloadConfig(mode="auto", page_cache="keep").page_cache == "keep"
    host_rung, reason = constrain(Candidate({"mode": "block", "storage": "cpu", "weight_dtype": "same",
                                             "lazy_load": False, "stream_modules": None}), explicit)
    assert reason == "" and host_rung is not None and host_rung.page_cache == "auto" and host_rung.storage == "cpu"
    disk_rung, _ = constrain(Candidate({"mode": "block", "storage": "disk", "reader": "pread", "weight_dtype": "same",
                                        "lazy_load": True, "stream_modules": None}), explicit)
    assert disk_rung is not None and disk_rung.page_cache == "keep" and disk_rung.lazy_load
    resident, _ = constrain(Candidate({"mode": "none"}), explicit)
    assert resident is not None and resident.page_cache == "auto"
