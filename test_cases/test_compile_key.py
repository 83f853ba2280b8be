"""The compile cache's key (runnerkit/compile.py `cache_fields`, `cache_key`): every input that makes
compiled artifacts valid changes the key, one at a time, both where the fields are assembled and
through a runner's config (`BaseRunner._load_compile_cache`). Nothing is compiled here: only keys."""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit import compile as rc
from runnerkit import memory
from runnerkit.config import CompileConfig, OffloadConfig, load_runner_config
from runnerkit.runners import loading
from test_cases.runners.two_stage import TwoStageImageRunner, config_dict

#: What the key must cover, by field name (README "Compile cache"). A field added to
#: `cache_fields` without a case below fails `test_every_key_field_has_a_case`.
FIELDS = {"format", "torch", "cuda", "triton", "python", "device", "runner", "runnerkit sources", "model", "dtype",
          "compile.mode", "compile.coordinate_descent_tuning", "compile.deterministic", "compile.dynamic",
          "compile.backend", "attention", "offload.mode", "offload.weight_dtype", "text_buckets", "lora",
          "compute_dtype", "parallel.ulysses"}


class OtherRunner:
    """A second runner class (the key names the runner by module and qualified name)."""


BASE: dict[str, Any] = dict(runner=object, model={"transformer": {"dim": 8, "num_layers": 2}}, dtype="float32",
                            cfg=CompileConfig(enabled=True), attention="sdpa", offload=OffloadConfig(mode="block"),
                            device=torch.device("cpu"))

# field -> (keyword changes to cache_fields, or a monkeypatch of the environment the key reads)
ARGUMENT_CHANGES: dict[str, dict[str, Any]] = {
    "runner": {"runner": OtherRunner},
    "model": {"model": {"transformer": {"dim": 8, "num_layers": 3}}},
    "dtype": {"dtype": "bfloat16"},
    "compile.mode": {"cfg": CompileConfig(enabled=True, mode="max-autotune")},
    "compile.coordinate_descent_tuning": {"cfg": CompileConfig(enabled=True, coordinate_descent_tuning=True)},
    "compile.deterministic": {"cfg": CompileConfig(enabled=True, deterministic=True)},
    "compile.dynamic": {"cfg": CompileConfig(enabled=True, dynamic=True)},
    "compile.backend": {"cfg": CompileConfig(enabled=True, backend="aot_eager")},
    "attention": {"attention": "sdpa_math"},
    "offload.mode": {"offload": OffloadConfig(mode="none")},
    "offload.weight_dtype": {"offload": OffloadConfig(mode="block", weight_dtype="fp8_e4m3")},
    "device": {"device": torch.device("meta")},
    "text_buckets": {"text_buckets": (64, 128)},  # padded text: the blocks take a key mask
    "lora": {"lora": "unfused/r64"},
    "compute_dtype": {"compute_dtype": "fp8"},  # the blocks' linears run fp8 GEMMs
    "parallel.ulysses": {"ulysses": 2},  # all-to-alls inside the blocks' attention, half the tokens a rank
}

ENVIRONMENT_CHANGES: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "format": lambda mp: mp.setattr(rc, "CACHE_FORMAT", rc.CACHE_FORMAT + 1),
    "torch": lambda mp: mp.setattr(torch, "__version__", torch.__version__ + ".other"),
    "cuda": lambda mp: mp.setattr(torch.version, "cuda", "99.9"),
    "triton": lambda mp: mp.setattr(rc, "_dist_version", lambda name: "0.0.other"),
    "python": lambda mp: mp.setattr(platform, "python_version", lambda: "3.0.other"),
    "runnerkit sources": lambda mp: mp.setattr(rc, "source_fingerprint", lambda: "0123456789abcdef"),
    # the same CPU type with another vector ISA: kernels generated for one do not run on the other
    "device (cpu ISA)": lambda mp: mp.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER_ISA"),
    # the same dispatch ISA, but inductor generates C++ for another (AMX on one AVX-512 host, VNNI on another)
    "device (inductor ISA)": lambda mp: mp.setattr(rc, "_inductor_isa", lambda: "VecAMX avx512 amx_tile"),
}


def test_every_key_field_has_a_case() -> None:
    assert set(rc.cache_fields(**BASE)) == FIELDS
    covered = set(ARGUMENT_CHANGES) | {name.split(" (")[0] for name in ENVIRONMENT_CHANGES}
    assert covered == FIELDS


def test_the_same_inputs_give_the_same_key() -> None:
    assert rc.cache_key(rc.cache_fields(**BASE)) == rc.cache_key(rc.cache_fields(**{**BASE}))
    reordered = {**BASE, "model": {"transformer": {"num_layers": 2, "dim": 8}}}  # key order is not content
    assert rc.cache_key(rc.cache_fields(**reordered)) == rc.cache_key(rc.cache_fields(**BASE))


@pytest.mark.parametrize("field", sorted(ARGUMENT_CHANGES))
def test_each_argument_changes_the_key(field: str) -> None:
    before = rc.cache_fields(**BASE)
    after = rc.cache_fields(**{**BASE, **ARGUMENT_CHANGES[field]})
    assert rc.cache_key(after) != rc.cache_key(before), field
    reasons = rc.mismatch_reasons(before, after)
    assert len(reasons) == 1 and reasons[0].startswith("model architecture" if field == "model" else field), reasons


@pytest.mark.parametrize("field", sorted(ENVIRONMENT_CHANGES))
def test_each_environment_input_changes_the_key(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = rc.cache_fields(**BASE)
    ENVIRONMENT_CHANGES[field](monkeypatch)
    after = rc.cache_fields(**BASE)
    assert rc.cache_key(after) != rc.cache_key(before), field
    reasons = rc.mismatch_reasons(before, after)
    assert len(reasons) == 1 and reasons[0].startswith(field.split(" (")[0]), reasons


# ---- through a runner: the config reaches the key ------------------------------------------------
class OtherToy(TwoStageImageRunner):
    """The toy family under another runner class."""


def _key(tmp_path: Path, cls: type[TwoStageImageRunner] = TwoStageImageRunner, **overrides: Any) -> str:
    """The compile-cache key a runner of `cls` computes at start-up for the toy config with `overrides`."""
    compile_cfg = {"enabled": True, "cache_dir": str(tmp_path / "cache"),
                   **overrides.pop("compile", {})}
    config = load_runner_config(None, config_dict(tmp_path, **{"model": {"width": 8}, **overrides,
                                                               "compile": compile_cfg}))
    runner = cls(config)
    runner.init_modules()  # no warmup: the entry is looked up (none there) and nothing is compiled or saved
    assert runner.compile_cache is not None and runner.profiler.compile_cache["key"] == runner.compile_cache.key
    return runner.compile_cache.key


@pytest.fixture(autouse=True)
def _no_real_gc_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_frozen", True)


@pytest.mark.parametrize("cls, overrides", [
    (OtherToy, {}),
    (TwoStageImageRunner, {"model": {"width": 16}}),
    (TwoStageImageRunner, {"dtype": "bfloat16"}),
    (TwoStageImageRunner, {"compile": {"mode": "max-autotune"}}),
    (TwoStageImageRunner, {"compile": {"dynamic": True}}),
    (TwoStageImageRunner, {"attention": "sdpa_math"}),
    (TwoStageImageRunner, {"offload": {"mode": "model"}}),
], ids=["runner", "model", "dtype", "compile.mode", "compile.dynamic", "attention",
        "offload.mode"])
def test_each_config_setting_reaches_the_runners_key(tmp_path: Path, cls: type[TwoStageImageRunner],
                                                     overrides: dict[str, Any]) -> None:
    """What a runner's config and class say reaches its key (the toy has no block to compile, so
    nothing is compiled; `cache_dir` needs the inductor backend, and offload.weight_dtype a streamed
    module, which the toy lacks: those two are covered at the fields above)."""
    base = _key(tmp_path)
    assert _key(tmp_path) == base  # the same config, another runner: the same entry
    assert _key(tmp_path, cls, **overrides) != base


class BucketedToy(TwoStageImageRunner):
    """The toy with padded text (the toy's text has one length; the key reads the runner's buckets)."""

    TEXT_BUCKETS = (8, 16)


class Fp8Toy(TwoStageImageRunner):
    """The toy where `compute_dtype` fp8 is accepted (the toy declares no fp8 layers; no block is compiled
    or quantized here, only the key is read): its load skips the fp8 check (runners/loading.py)."""

    def load_modules(self) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loading, "check_fp8_compute", lambda *args: True)  # bias in the GEMM, as the probe says
            super().load_modules()


@pytest.mark.parametrize("cls, base, changed", [
    (TwoStageImageRunner, {"lora": {"max_rank": 16}}, {"lora": {"max_rank": 32}}),
    (TwoStageImageRunner, {}, {"lora": {"max_rank": 16}}),
    (TwoStageImageRunner, {"lora": {"mode": "fused"}}, {"lora": {"max_rank": 16}}),
    (BucketedToy, {"text_buckets": "on"}, {"text_buckets": [8]}),
    (BucketedToy, {"text_buckets": "on"}, {"text_buckets": "off"}),
    (Fp8Toy, {}, {"compute_dtype": "fp8"}),
], ids=["lora.max_rank", "lora unfused vs none", "lora unfused vs fused", "text_buckets list",
        "text_buckets off", "compute_dtype"])
def test_lora_buckets_and_compute_dtype_reach_the_runners_key(tmp_path: Path, cls: type[TwoStageImageRunner],
                                                              base: dict[str, Any], changed: dict[str, Any]) -> None:
    key = _key(tmp_path, cls, **base)
    assert _key(tmp_path, cls, **base) == key  # the same config: the same entry
    assert _key(tmp_path, cls, **changed) != key


def test_fused_lora_keys_as_no_lora(tmp_path: Path) -> None:
    """Fused LoRA writes into the weights: the compiled graph is the one without LoRA, and so is the entry."""
    assert _key(tmp_path, lora={"mode": "fused"}) == _key(tmp_path)
