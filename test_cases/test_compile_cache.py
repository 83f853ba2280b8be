"""The compile cache (`compile.cache_dir`, runnerkit/compile.py `CompileCache`) on the CPU with the
inductor backend: a restart in a fresh process with the saved cache compiles nothing (inductor's
FX-graph cache counters, read by torch, not by the cache), and gives the same output bit for bit;
a mismatching entry is named with its reason and recompiled; a damaged entry warns and compiles;
an unwritable folder logs an error without failing the run.

Every process gets its own empty `TORCHINDUCTOR_CACHE_DIR`, so torch's local disk cache can never
serve a later run: only the entry in `compile.cache_dir` can. Inductor generates scalar C++ here
(`TORCHINDUCTOR_VEC_ISA_OK=0`): the C++ build of the vectorised kernels takes twice as long on a
small CPU and is not what these tests are about.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file

from runnerkit.config import ConfigError, RequestConfig, load_runner_config
from runnerkit.models.wan.runner import WanT2VRunner
from test_cases.conftest import REPO, tiny_config_dict, write_config
from test_cases.test_infer import _documented_keys

COMPILE = {"enabled": True, "backend": "inductor"}
SEED, PROMPT = 3, "a fox"
FirstStart = tuple[Path, dict[str, Any], torch.Tensor, str]
"""(cache folder, profile report, video, log) of the first start-up."""


def _cli_run(ckpt: Path, folder: Path, cache_dir: Path, **compile_cfg: Any) -> tuple[subprocess.CompletedProcess[str],
                                                                                      dict[str, Any], torch.Tensor]:
    """The launch script in a fresh process: warmup, one request at the config's (warmed) shape."""
    folder.mkdir(parents=True)
    cfg = write_config(folder / "config.json", tiny_config_dict(
        ckpt, compile={**COMPILE, "cache_dir": str(cache_dir), **compile_cfg}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
           "TORCHINDUCTOR_VEC_ISA_OK": "0"}
    proc = subprocess.run([sys.executable, "-m", "runnerkit.infer", "--config_json", str(cfg), "--prompt", PROMPT,
                           "--seed", str(SEED), "--warmup", "--profile_json", str(folder / "profile.json"),
                           "--save_tensor_path", str(folder / "out.safetensors")],
                          capture_output=True, text=True, env=env, cwd=folder, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((folder / "profile.json").read_text())
    return proc, report, load_file(str(folder / "out.safetensors"))["video"]


@pytest.fixture(scope="module")
def first_start(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstStart:
    """A first start-up into an empty cache folder: (cache folder, profile, video, log)."""
    root = tmp_path_factory.mktemp("first")
    proc, report, video = _cli_run(tiny_ckpt, root / "run", root / "cache")
    return root / "cache", report, video, proc.stderr


def _copy(cache: Path, to: Path) -> Path:
    shutil.copytree(cache, to)
    return to


@pytest.fixture
def logs() -> Iterator[list[str]]:
    """Messages loguru logs while the test runs, as 'LEVEL message'."""
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(f"{m.record['level'].name} {m.record['message']}"), level="DEBUG")
    yield lines
    logger.remove(handler)


def _runner(ckpt: Path, monkeypatch: pytest.MonkeyPatch, inductor: Path, **compile_cfg: Any) -> WanT2VRunner:
    """A warmed runner in this process, torch's local inductor cache in `inductor`."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(ckpt, warmup=True,
                                                                    compile={**COMPILE, **compile_cfg})))
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):  # as TORCHINDUCTOR_VEC_ISA_OK=0
        runner.init_modules()
    return runner


def _request(runner: WanT2VRunner, out: Path) -> tuple[dict[str, Any], torch.Tensor]:
    prof = runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=SEED, save_tensor_path=str(out)), 0)
    return prof.audit, load_file(str(out))["video"]


def test_first_start_compiles_and_writes_the_cache(first_start: FirstStart) -> None:
    cache, report, _, log = first_start
    section, warm = report["compile_cache"], report["warmup"]
    assert warm["compile_cache_misses"] >= 2 and warm["compile_cache_hits"] == 0, warm  # static + dynamic graph
    assert section["loaded"] is False and section["saved"] is True, section
    assert section["reason"] == "no entry in the folder" and "holds no entry" in log and "written after warmup" in log
    assert section["artifacts"]["inductor"] >= 2, section
    assert sorted(p.name for p in cache.iterdir()) == [f"{section['key']}.bin", f"{section['key']}.json"]
    meta = json.loads((cache / f"{section['key']}.json").read_text())
    fields = meta["fields"]
    assert fields["torch"] == torch.__version__ and fields["runner"] == "runnerkit.models.wan.runner.WanT2VRunner"
    assert fields["compile.mode"] == "default" and fields["dtype"] == "float32" and fields["attention"] != "none"
    assert fields["model"]["transformer"]["dim"] == 64 and fields["device"].startswith("cpu ")
    assert meta["bytes"] == (cache / f"{section['key']}.bin").stat().st_size
    documented = {k for k in _documented_keys() if k.startswith("compile_cache.") or k.startswith("warmup.compile_")}
    assert {f"compile_cache.{k}" for k in section} | {f"warmup.{k}" for k in warm if k.startswith("compile_")} == \
        documented


def test_restart_with_the_saved_cache_compiles_nothing(tiny_ckpt: Path, tmp_path: Path,
                                                       first_start: FirstStart) -> None:
    cache, first, video1, _ = first_start
    proc, report, video2 = _cli_run(tiny_ckpt, tmp_path / "run", _copy(cache, tmp_path / "cache"))
    section, warm = report["compile_cache"], report["warmup"]
    assert section["key"] == first["compile_cache"]["key"] and section["loaded"] is True, section
    assert "compile cache: loaded" in proc.stderr
    # torch's own counters: every graph warmup needed came from the loaded cache, none was generated
    assert warm["compile_cache_misses"] == 0 and warm["compile_cache_hits"] >= 2, warm
    assert report["requests"][0]["audit"]["compilations"] == 0, report["requests"][0]["audit"]
    assert torch.equal(video1, video2)


def test_a_mismatching_entry_is_named_and_recompiled(tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     logs: list[str], fresh_compiler: None,
                                                     first_start: FirstStart) -> None:
    cache = _copy(first_start[0], tmp_path / "cache")
    runner = _runner(tiny_ckpt, monkeypatch, tmp_path / "inductor", cache_dir=str(cache), dynamic=True)
    section, warm = runner.profiler.compile_cache, runner.profiler.warmup
    assert section is not None and warm is not None
    assert section["loaded"] is False and "compile.dynamic False != True" in section["reason"], section
    assert any(line.startswith("INFO compile cache: entry") and "compile.dynamic False != True" in line
               for line in logs), logs
    assert warm["compile_cache_misses"] >= 1, warm
    assert section["saved"] is True and len(list(cache.glob("*.bin"))) == 2  # the old entry stays beside the new


def test_mismatch_reasons_name_each_field() -> None:
    from runnerkit.compile import mismatch_reasons

    now = {"torch": "2.13.0", "model": {"transformer": {"dim": 64, "num_layers": 2}}, "compile.mode": "default"}
    cached = {"torch": "2.11.0", "model": {"transformer": {"dim": 128, "num_layers": 2}},
              "compile.mode": "max-autotune", "format": 0}
    assert mismatch_reasons(cached, now) == ["torch 2.11.0 != 2.13.0",
                                             "model architecture differs (transformer.dim 128 != 64)",
                                             "compile.mode max-autotune != default", "format 0 != (absent)"]
    assert mismatch_reasons(now, now) == []


def test_the_key_changes_with_the_runnerkit_sources(tmp_path: Path) -> None:
    """Graphs are traced from runnerkit's code: an entry saved by other code (an upgrade) is not loaded."""
    from runnerkit import compile as rc
    from runnerkit.config import CompileConfig, OffloadConfig

    src = tmp_path / "pkg"
    (src / "sub").mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    (src / "sub" / "b.py").write_text("y = 2\n")
    (src / "notes.txt").write_text("not code")
    before = rc.source_fingerprint(src)
    (src / "notes.txt").write_text("changed, still not code")
    assert rc.source_fingerprint.__wrapped__(src) == before
    (src / "sub" / "b.py").write_text("y = 3\n")
    changed = rc.source_fingerprint.__wrapped__(src)
    assert changed != before and len(changed) == 16

    def fields() -> dict[str, Any]:
        return rc.cache_fields(runner=object, model={"transformer": {"dim": 8}}, dtype="float32", cfg=CompileConfig(),
                               attention="sdpa", offload=OffloadConfig(), device=torch.device("cpu"))

    now = fields()
    assert now["runnerkit sources"] == rc.source_fingerprint.__wrapped__()
    cached = {**now, "runnerkit sources": "0123456789abcdef"}
    assert rc.cache_key(cached) != rc.cache_key(now)
    assert rc.mismatch_reasons(cached, now) == [f"runnerkit sources 0123456789abcdef != {now['runnerkit sources']}"]


@pytest.fixture(scope="module")
def local_inductor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One local inductor cache for the in-process tests that do not count misses (they then compile once)."""
    return tmp_path_factory.mktemp("inductor")


@pytest.mark.parametrize("damage", ["truncated", "torch_rejects", "no_metadata"])
def test_a_damaged_entry_warns_and_compiles_from_scratch(tiny_ckpt: Path, tmp_path: Path, damage: str,
                                                         monkeypatch: pytest.MonkeyPatch, logs: list[str],
                                                         local_inductor: Path, fresh_compiler: None,
                                                         first_start: FirstStart) -> None:
    cache = _copy(first_start[0], tmp_path / "cache")
    (entry,) = cache.glob("*.bin")
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:1000])
    elif damage == "torch_rejects":  # the metadata's checksum fits: torch's own deserializer refuses it
        entry.write_bytes(b"not a cache")
        meta = json.loads(entry.with_suffix(".json").read_text())
        entry.with_suffix(".json").write_text(json.dumps({**meta, "sha256": hashlib.sha256(b"not a cache").hexdigest()}))
    else:
        entry.with_suffix(".json").unlink()
    runner = _runner(tiny_ckpt, monkeypatch, local_inductor, cache_dir=str(cache))
    section = runner.profiler.compile_cache
    assert section is not None and section["loaded"] is False and section["reason"].startswith("damaged entry"), section
    named = entry.with_suffix(".json") if damage == "no_metadata" else entry  # the file that is damaged
    assert any(line.startswith(f"WARNING compile cache: could not load {named}:") for line in logs), logs
    audit, video = _request(runner, tmp_path / "out.safetensors")
    assert audit["compilations"] == 0 and torch.equal(video, first_start[2])
    assert section["saved"] is True  # rewritten whole after warmup
    meta = json.loads(entry.with_suffix(".json").read_text())
    assert meta["bytes"] == entry.stat().st_size > 1000


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_an_unusable_folder_is_named_at_start_and_the_run_goes_on(tiny_ckpt: Path, tmp_path: Path, where: str,
                                                                  monkeypatch: pytest.MonkeyPatch, logs: list[str],
                                                                  local_inductor: Path, fresh_compiler: None,
                                                                  first_start: FirstStart) -> None:
    """Said at start-up, before warmup pays for a compile that cannot be saved; ERROR at the save; the run goes on."""
    (tmp_path / "a_file").write_text("")
    # a folder under a regular file cannot be made, also as root; a regular file is no folder
    cache = tmp_path / "a_file" / "cache" if where == "under_a_file" else tmp_path / "a_file"
    why = f"cannot be created ({tmp_path / 'a_file'} is not a directory)" if where == "under_a_file" else \
        "is not a directory"
    runner = _runner(tiny_ckpt, monkeypatch, local_inductor, cache_dir=str(cache))
    section = runner.profiler.compile_cache
    assert section is not None and section["loaded"] is False and section["saved"] is False, section
    assert section["reason"] == f"unusable folder: {why}", section
    start = next(i for i, line in enumerate(logs) if line.startswith("WARNING compile cache:"))
    assert f"{cache} {why}" in logs[start]
    assert not any("warmup:" in line for line in logs[:start])  # before warmup
    assert any(line.startswith("ERROR compile cache:") and "not written" in line for line in logs[start:]), logs
    audit, video = _request(runner, tmp_path / "out.safetensors")
    assert audit["compilations"] == 0 and torch.equal(video, first_start[2])


def test_an_unreadable_folder_warns_and_does_not_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       logs: list[str]) -> None:
    from runnerkit.compile import CompileCache

    def denied(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", denied)
    cache = CompileCache(tmp_path, {"torch": torch.__version__})
    assert cache.load(will_save=True) is False
    assert cache.report()["reason"].startswith("unreadable folder: PermissionError"), cache.report()
    assert any(line.startswith(f"WARNING compile cache: could not read {tmp_path}") for line in logs), logs


@pytest.mark.parametrize("compile_cfg, match", [
    ({"cache_dir": "/tmp/c"}, "`compile.cache_dir` does nothing while `compile.enabled` is false"),
    ({"enabled": True, "backend": "eager", "cache_dir": "/tmp/c"},
     "`compile.cache_dir` only acts with `compile.backend`='inductor' \\(got 'eager'"),
    ({"enabled": True, "cache_dir": ""}, "cache_dir"),
    ({"enabled": True, "cache_dir": "   "}, "`compile.cache_dir`='   ' is blank"),
])
def test_cache_settings_that_cannot_act_are_refused(tiny_ckpt: Path, compile_cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_runner_config(None, tiny_config_dict(tiny_ckpt, compile=compile_cfg))


def test_old_torch_is_refused_at_start(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    with pytest.raises(NotImplementedError, match=r"`compile.cache_dir`='/tmp/c' needs torch >= 2.7.*torch 2.6.0"):
        WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt, compile={**COMPILE, "cache_dir": "/tmp/c"})))
