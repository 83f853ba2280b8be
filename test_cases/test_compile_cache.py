"""The compile cache (`compile.cache_dir`, runnerkit/compile.py `CompileCache`) on the CPU with the
inductor backend: a restart in a fresh process with the saved cache compiles nothing (inductor's
FX-graph cache counters, read by torch, not by the cache), and gives the same output bit for bit;
a mismatching entry is named with its reason and recompiled; a damaged entry warns and compiles;
an unwritable folder logs an error without failing the run; the first start's inductor video
agrees with eager within tolerance. Four runs compile: the first start and the restart
(subprocesses), one from-scratch run and the mismatching entry's run (here); the damage kinds and
unusable folders are checked on the cache alone, then once each in that one from-scratch run.

Every process gets its own empty `TORCHINDUCTOR_CACHE_DIR`, so torch's local disk cache can never
serve a later run: only the entry in `compile.cache_dir` can (the in-process tests get theirs, and
emptied in-process caches, from conftest's `_isolated_compiler`). Inductor generates scalar C++
here (`TORCHINDUCTOR_VEC_ISA_OK=0`, in-process `cpp.vec_isa_ok=False` for the whole test): the C++
build of the vectorised kernels takes twice as long on a small CPU and is not what these tests are
about.

What is compared bit for bit: a restart that loads the first start's entry runs the first start's
kernels (the same generated C++, rebuilt by the same compiler on the same CPU), so its video is
the first start's. A run that compiles from scratch (a damaged entry, an unusable folder) is a
second compilation: torch promises the same math, not the same kernels (the vector ISA it picks,
its fusions and reduction orders follow its config and the CPU), so its video is compared with the
first start's within `RECOMPILED_AGREE`.
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
from test_cases.conftest import REPO, built_once_per_run, tiny_config_dict, write_config
from test_cases.test_infer import _documented_keys

COMPILE = {"enabled": True, "backend": "inductor"}
SEED, PROMPT = 3, "a fox"
FirstStart = tuple[Path, dict[str, Any], torch.Tensor, str]
"""(cache folder, profile report, video, log) of the first start-up."""
RECOMPILED_AGREE = 1e-4
"""Max abs difference of a from-scratch compile's video from the first start's (video values ~1): two
compilations may round float32 reductions differently (AVX2 and AVX-512 kernels, scalar C++ when
the vector ISA is off: seen 5e-7 apart); a wrong graph or a skipped step is off by far more."""


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
    """A first start-up into an empty cache folder: (cache folder, profile, video, log). Run once per
    pytest run (`built_once_per_run`): both xdist workers read the same start; tests copy the cache."""

    def first(root: Path) -> None:
        proc, _, _ = _cli_run(tiny_ckpt, root / "run", root / "cache")
        (root / "run" / "stderr.txt").write_text(proc.stderr)

    root = built_once_per_run(tmp_path_factory, "compile_cache_first_start", first)
    run = root / "run"
    report = json.loads((run / "profile.json").read_text())
    return root / "cache", report, load_file(str(run / "out.safetensors"))["video"], (run / "stderr.txt").read_text()


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


@pytest.fixture
def in_process(fresh_compiler: None) -> Iterator[None]:
    """Compiles in this process: no compiled forward or dynamo cache of an earlier test, scalar C++
    for the whole test (as `TORCHINDUCTOR_VEC_ISA_OK=0` in the subprocesses), and the test's own
    inductor cache (conftest's `_isolated_compiler`)."""
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        yield


def _runner(ckpt: Path, **compile_cfg: Any) -> WanT2VRunner:
    """A warmed runner in this process (use with the `in_process` fixture)."""
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(ckpt, warmup=True,
                                                                    compile={**COMPILE, **compile_cfg})))
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


def test_a_mismatching_entry_is_named_and_recompiled(tiny_ckpt: Path, tmp_path: Path, logs: list[str],
                                                     in_process: None, first_start: FirstStart) -> None:
    cache = _copy(first_start[0], tmp_path / "cache")
    runner = _runner(tiny_ckpt, cache_dir=str(cache), dynamic=True)
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


def _damage(cache: Path, damage: str) -> Path:
    """Damage the one entry in `cache` as `damage` says; returns the file a warning must name."""
    (entry,) = cache.glob("*.bin")
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:1000])
    elif damage == "torch_rejects":  # the metadata's checksum fits: torch's own deserializer refuses it
        entry.write_bytes(b"not a cache")
        meta = json.loads(entry.with_suffix(".json").read_text())
        entry.with_suffix(".json").write_text(json.dumps({**meta, "sha256": hashlib.sha256(b"not a cache").hexdigest()}))
    else:
        entry.with_suffix(".json").unlink()
    return entry.with_suffix(".json") if damage == "no_metadata" else entry


def _unusable(tmp_path: Path, where: str) -> tuple[Path, str]:
    """A cache folder that cannot be one, and why, as the log says it."""
    (tmp_path / "a_file").write_text("")
    # a folder under a regular file cannot be made, also as root; a regular file is no folder
    if where == "under_a_file":
        return tmp_path / "a_file" / "cache", f"cannot be created ({tmp_path / 'a_file'} is not a directory)"
    return tmp_path / "a_file", "is not a directory"


@pytest.mark.parametrize("damage", ["truncated", "torch_rejects", "no_metadata"])
def test_a_damaged_entry_is_not_loaded_and_warns_naming_the_file(tmp_path: Path, damage: str, logs: list[str],
                                                                 first_start: FirstStart) -> None:
    """Each damage, on the cache alone (the run that follows is `test_a_run_the_cache_cannot_serve_...`)."""
    from runnerkit.compile import CompileCache

    cache = _copy(first_start[0], tmp_path / "cache")
    fields = json.loads(next(cache.glob("*.json")).read_text())["fields"]
    named = _damage(cache, damage)
    entry = CompileCache(cache, fields)
    assert entry.bin_path.exists()  # the damaged entry is this key's
    assert entry.load(will_save=True) is False
    assert entry.report()["reason"].startswith("damaged entry"), entry.report()
    assert any(line.startswith(f"WARNING compile cache: could not load {named}:") for line in logs), logs


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_an_unusable_folder_is_named_at_load_and_at_save(tmp_path: Path, where: str, logs: list[str]) -> None:
    from runnerkit.compile import CompileCache

    cache, why = _unusable(tmp_path, where)
    entry = CompileCache(cache, {"torch": torch.__version__})
    assert entry.load(will_save=True) is False
    assert entry.report()["reason"] == f"unusable folder: {why}", entry.report()
    assert [line for line in logs if line.startswith("WARNING")] == [
        f"WARNING compile cache: `compile.cache_dir` {cache} {why}: nothing can be loaded or saved there; compiling "
        "from scratch"]
    assert entry.save() is False and entry.report()["saved"] is False
    assert any(line.startswith(f"ERROR compile cache: `compile.cache_dir` {cache} {why}") and "not written" in line
               for line in logs), logs


def test_a_run_the_cache_cannot_serve_compiles_from_scratch_and_goes_on(tiny_ckpt: Path, tmp_path: Path,
                                                                         logs: list[str], in_process: None,
                                                                         first_start: FirstStart) -> None:
    """A damaged entry: warned about before warmup, which compiles from scratch and rewrites the entry
    whole; the request compiles nothing and agrees with the first start. Then an unusable folder:
    named at start-up, before warmup pays for a compile that cannot be saved; ERROR at the save;
    the run goes on (this runner reuses the first one's compiled code: what differs is the cache)."""
    cache = _copy(first_start[0], tmp_path / "cache")
    named = _damage(cache, "truncated")
    runner = _runner(tiny_ckpt, cache_dir=str(cache))
    section, warm = runner.profiler.compile_cache, runner.profiler.warmup
    assert section is not None and warm is not None
    assert section["loaded"] is False and section["reason"].startswith("damaged entry"), section
    start = next(i for i, line in enumerate(logs) if line.startswith(f"WARNING compile cache: could not load {named}:"))
    assert not any("warmup:" in line for line in logs[:start])  # before warmup
    assert warm["compile_cache_misses"] >= 2 and warm["compile_cache_hits"] == 0, warm  # from scratch
    assert section["saved"] is True  # rewritten whole after warmup
    meta = json.loads(named.with_suffix(".json").read_text())
    assert meta["bytes"] == named.stat().st_size > 1000
    audit, video = _request(runner, tmp_path / "out.safetensors")
    assert audit["compilations"] == 0
    assert (video - first_start[2]).abs().max().item() <= RECOMPILED_AGREE

    logs.clear()
    unusable, why = _unusable(tmp_path, "under_a_file")
    runner = _runner(tiny_ckpt, cache_dir=str(unusable))
    section = runner.profiler.compile_cache
    assert section is not None and section["loaded"] is False and section["saved"] is False, section
    assert section["reason"] == f"unusable folder: {why}", section
    start = next(i for i, line in enumerate(logs) if line.startswith("WARNING compile cache:"))
    assert f"{unusable} {why}" in logs[start]
    assert not any("warmup:" in line for line in logs[:start])  # before warmup
    assert any(line.startswith("ERROR compile cache:") and "not written" in line for line in logs[start:]), logs
    audit, video = _request(runner, tmp_path / "out2.safetensors")
    assert audit["compilations"] == 0
    assert (video - first_start[2]).abs().max().item() <= RECOMPILED_AGREE


INDUCTOR_AGREE = 1e-4
"""Max abs difference of inductor-compiled from eager output of the tiny float32 pipeline (video values ~1):
inductor fuses and reorders float32 reductions (LayerNorm, RMSNorm), so it is not bit-identical."""


def test_inductor_output_agrees_with_eager_within_tolerance(tiny_ckpt: Path, tmp_path: Path,
                                                            first_start: FirstStart) -> None:
    """The first start's video (inductor, C++ kernels) against the same request run eagerly here."""
    runner = WanT2VRunner(load_runner_config(None, tiny_config_dict(tiny_ckpt)))
    runner.init_modules()
    _, eager = _request(runner, tmp_path / "eager.safetensors")
    _, _, compiled, _ = first_start
    assert first_start[1]["requests"][0]["audit"]["compilations"] == 0  # warmup compiled it: inductor really ran
    assert first_start[1]["warmup"]["compile_cache_misses"] >= 2
    err = (compiled - eager).abs().max().item()
    assert err <= INDUCTOR_AGREE, err
    assert eager.abs().max().item() > 0.1  # a non-trivial output


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
