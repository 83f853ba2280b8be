"""Regional compilation: the transformer's repeated block, compiled once and shared; and a module's declared
regions (`COMPILED_REGIONS`), for networks whose blocks cannot be compiled whole.

`compile_blocks(model, blocks_attr, cfg)` replaces the `forward` of every block in
`model.<blocks_attr>` with one `torch.compile`d function per (block class, mode, dynamic,
backend), called with the block as its first argument. So:

- the graph is traced once and reused by every block of the model, every MoE expert of the same
  architecture, and the transformer rebuilt per request under lazy load (parameters are graph
  inputs: `torch._dynamo.config.inline_inbuilt_nn_modules`, on by default since torch 2.5);
- the block's own `__call__` stays eager: the forward hooks of block/phase/disk streaming run
  outside the compiled region, exactly as without compile, and only the block's math is compiled;
- one code path: warmup and requests call the same blocks, so warmup's two shapes are where the
  compilation happens.

Dynamic shapes (`compile.dynamic`): false = torch's automatic dynamic: the first shape compiles
static; a later call where a dimension differs recompiles once with that dimension dynamic, and
later calls that differ only in dynamic dimensions compile nothing. With the two warmup shapes
of a family (which differ in every spatial/temporal size) every token-count dimension is dynamic
after warmup. true = dynamic from the first compile. Either way a dynamic dimension covers sizes
>= 2 only: torch specialises sizes 0 and 1 ("0/1 specialization"), so a request whose token count
is 1 (e.g. one latent patch per frame and a single latent frame) compiles graphs of its own (`uncovered_sizes`; the runner
warns at the request's start).

Declared regions (`compile_regions`): a module class may name methods in `COMPILED_REGIONS`, each a pure tensor
function of the module's parameters and tensor arguments (no Python object arguments whose attributes change with
the input's shape: dynamo would specialise on them). Every instance's method is routed through one compiled function
per (class, method, config), like a block's forward: for a network whose blocks take objects holding the input's
sizes, or run a compiled kernel of their own (docs/compile.md names the families that declare regions).

Not supported (refused at start with the reason, `check_supported`): `mode` "reduce-overhead"
(CUDA graphs) with block/phase streaming, whose weights change addresses every step; `cache_dir`
on torch < 2.7 (no portable cache API).

Compile cache (`compile.cache_dir`; `CompileCache`): after warmup the compiled
artifacts of the process (inductor FX graphs, AOTAutograd entries, autotune results: torch's
portable "mega-cache", `torch.compiler.save_cache_artifacts`) are written to `<key>.bin` with a
readable `<key>.json` beside it; at the next start-up, before warmup, `<key>.bin` is handed to
`torch.compiler.load_cache_artifacts`, which fills torch's local caches, so warmup's compiles are
cache hits. The key hashes everything that makes the artifacts valid (`cache_fields`). dynamo
still traces each frame (guards are rebuilt per process); what is skipped is inductor's lowering
and code generation. On the CPU torch rebuilds each graph's C++ kernel library from the cached
source (the `.so` is not part of the artifacts); on CUDA the triton kernels are bundled with
the graphs (`torch._inductor.config.bundle_triton_into_fx_graph_cache`). The cache is an
optimisation: a failure to read or write it is logged and the run compiles from scratch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
import types
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch import nn

from runnerkit.config import CompileConfig, OffloadConfig

_COMPILED: dict[tuple[type, str, str, bool, str, bool, bool], Callable[..., Any]] = {}
"""(class, method, mode, dynamic, backend, coordinate-descent tuning, deterministic) -> the compiled function."""


def check_supported(cfg: CompileConfig, offload: OffloadConfig, unload_modules: bool = False,
                    device: torch.device | None = None) -> None:
    """Refuse combinations regional compile cannot serve (`unload_modules`, `device`: the runner's).

    Raises:
        NotImplementedError: with the reason.
    """
    if not cfg.enabled:
        return
    if cfg.cache_dir is not None and torch.torch_version.TorchVersion(torch.__version__) < "2.7":
        raise NotImplementedError(
            f"`compile.cache_dir`={cfg.cache_dir!r} needs torch >= 2.7 (torch.compiler.save_cache_artifacts / "
            f"load_cache_artifacts, the portable compile cache); this is torch {torch.__version__}: upgrade torch "
            "or remove `compile.cache_dir`")
    if offload.mode == "phase":
        raise NotImplementedError(
            "`compile.enabled` with `offload.mode`='phase': the phase hooks run inside a block's forward, which "
            "regional compile traces as one graph; use offload mode 'block' (its hooks stay outside) or 'none'")
    if cfg.mode == "reduce-overhead" and offload.mode in ("block", "phase"):
        raise NotImplementedError(
            f"`compile.mode`='reduce-overhead' (CUDA graphs) cannot run with `offload.mode`={offload.mode!r}: "
            "streamed weights change addresses every step, which a captured graph cannot follow; use mode "
            "'default' or 'max-autotune-no-cudagraphs'")
    moved = ("`offload.mode`='model' (the transformer leaves the device between stages)" if offload.mode == "model" else
             "`offload.lazy_load` (the transformer is rebuilt for every request)" if offload.lazy_load else
             "`unload_modules` (the transformer is rebuilt for every request)" if unload_modules else None)
    if cfg.mode == "reduce-overhead" and moved is not None:
        raise NotImplementedError(
            f"`compile.mode`='reduce-overhead' (CUDA graphs) cannot run with {moved}: a captured graph keeps the "
            "weights' old device addresses; use mode 'default' or 'max-autotune-no-cudagraphs'")
    if cfg.coordinate_descent_tuning and cfg.backend == "inductor" and device is not None and device.type != "cuda":
        raise NotImplementedError(
            f"`compile.coordinate_descent_tuning` does nothing on device {device.type!r}: inductor tunes the "
            "launch configurations of the Triton kernels it generates for CUDA; remove it")
    if cfg.deterministic and device is not None and device.type != "cuda":
        raise NotImplementedError(
            f"`compile.deterministic` does nothing on device {device.type!r}: inductor benchmarks kernel "
            "configurations on CUDA devices only (CPU kernels are not chosen by timing); remove it")
    if cfg.deterministic and not hasattr(_inductor_config(), "deterministic"):
        raise NotImplementedError(
            f"`compile.deterministic` needs torch >= 2.10 (inductor's deterministic mode); this is torch "
            f"{torch.__version__}: upgrade torch or remove it")
    if cfg.mode == "reduce-overhead" and device is not None and device.type != "cuda":
        raise NotImplementedError(
            f"`compile.mode`='reduce-overhead' (CUDA graphs) does nothing on device {device.type!r}: use mode "
            "'default'")


def _inductor_config() -> Any:
    """torch._inductor.config (imported when asked: importing inductor takes a while)."""
    from torch._inductor import config

    return config


def compiled_forward(block_cls: type, cfg: CompileConfig) -> Callable[..., Any]:
    """The one compiled `forward` of `block_cls` for `cfg` (created on first use, then shared)."""
    return compiled_method(block_cls, "forward", cfg)


def compiled_method(cls: type, name: str, cfg: CompileConfig) -> Callable[..., Any]:
    """The one compiled `cls.<name>` for `cfg` (created on first use, then shared); called with the instance first."""
    key = (cls, name, cfg.mode, cfg.dynamic, cfg.backend, cfg.coordinate_descent_tuning, cfg.deterministic)
    if key not in _COMPILED:
        how: dict[str, Any] = {"mode": None if cfg.backend != "inductor" else cfg.mode}
        ours = {k: True for k in ("coordinate_descent_tuning", "deterministic") if getattr(cfg, k)}
        if ours:  # torch.compile takes a mode or options, not both: the mode's options + ours
            from torch._inductor import list_mode_options

            how = {"options": {**list_mode_options(cfg.mode), **ours}}
        _COMPILED[key] = torch.compile(getattr(cls, name), dynamic=True if cfg.dynamic else None, backend=cfg.backend,
                                       **how)
    return _COMPILED[key]


def compile_blocks(model: nn.Module, blocks_attr: str, cfg: CompileConfig) -> int:
    """Route every block of `model.<blocks_attr>` through the shared compiled forward; returns the count.

    Raises:
        TypeError: `model.<blocks_attr>` is not an `nn.ModuleList` (a family declaration bug).
    """
    blocks = getattr(model, blocks_attr)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}.{blocks_attr} must be an nn.ModuleList to compile its blocks")
    for block in blocks:
        fn = compiled_forward(type(block), cfg)
        block.forward = types.MethodType(fn, block)
    return len(blocks)


def compile_regions(model: nn.Module, cfg: CompileConfig) -> int:
    """Route the `COMPILED_REGIONS` methods of every submodule of `model` (itself included) through the shared
    compiled functions; returns how many methods were routed.

    Raises:
        TypeError: a name in `COMPILED_REGIONS` that is not a method of the class (a family declaration bug).
    """
    routed = 0
    for module in model.modules():
        for name in getattr(type(module), "COMPILED_REGIONS", ()):
            if not callable(getattr(type(module), name, None)):
                raise TypeError(f"{type(module).__name__}.COMPILED_REGIONS names {name!r}, not a method")
            setattr(module, name, types.MethodType(compiled_method(type(module), name, cfg), module))
            routed += 1
    return routed


def recompile_state() -> tuple[int, dict[str, list[str]]]:
    """(recompilations, the reasons torch gave for them, by compiled function) of every compiled block forward and
    declared region so far: graphs beyond the first in each function's dynamo cache, and the guard failures torch
    recorded for it (one per cached graph it could not reuse), labelled "Block" or "Class.method". Each function's
    list only grows: `new_reasons` takes what a stretch of work added."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.utils import guard_failures
    except ImportError:  # pragma: no cover - very old torch
        return 0, {}
    recompiles, reasons = 0, {}
    for cls, name in dict.fromkeys(key[:2] for key in _COMPILED):
        code = getattr(cls, name).__code__
        label = cls.__name__ if name == "forward" else f"{cls.__name__}.{name}"
        recompiles += max(len(_debug_get_cache_entry_list(code)) - 1, 0)
        reasons[label] = list(guard_failures.get(code, []))
    return recompiles, reasons


def new_reasons(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    """The recompile reasons in `after` that `before` (both `recompile_state()[1]`) did not hold, function by
    function, each as "label: reason"."""
    return [f"{label}: {r}" for label, rs in after.items() for r in rs[len(before.get(label, [])):]]


MIN_DYNAMIC_SIZE = 2
"""The smallest size a dynamic dimension of a compiled graph serves: torch specialises 0 and 1."""


def uncovered_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """The entries of `sizes` (name -> size of a dimension the compiled blocks see as dynamic after
    warmup, e.g. {'transformer tokens': 1}) that no graph compiled at warmup serves: torch never
    makes a dimension of size 0 or 1 dynamic (it guards `2 <= size` and specialises), so a request
    with such a size compiles graphs of its own."""
    return {name: size for name, size in sizes.items() if size < MIN_DYNAMIC_SIZE}


@functools.cache
def _announce(cfg: CompileConfig) -> None:
    logger.info("compile: regional (one compiled forward per block class, one function per declared region), "
                "mode {}{}, dynamic {}, backend {}", cfg.mode,
                (" + coordinate-descent tuning" if cfg.coordinate_descent_tuning else "")
                + (" + deterministic" if cfg.deterministic else ""),
                "from the first compile" if cfg.dynamic else "automatic", cfg.backend)


def install(model: nn.Module, blocks_attr: str | None, cfg: CompileConfig) -> None:
    """When `cfg.enabled`: `compile_blocks` where the module names its blocks, and `compile_regions`; logs once per
    config."""
    if not cfg.enabled:
        return
    t0 = time.perf_counter()
    blocks = compile_blocks(model, blocks_attr, cfg) if blocks_attr is not None else 0
    regions = compile_regions(model, cfg)
    if blocks or regions:
        _announce(cfg)
        logger.debug("compile: {} blocks and {} declared regions of {} routed in {:.3f} s", blocks, regions,
                     type(model).__name__, time.perf_counter() - t0)


# -- compile cache (compile.cache_dir) ------------------------------------------------------------

CACHE_FORMAT = 1
"""Layout of a cache entry (`<key>.bin` + `<key>.json`); part of the key."""


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def describe_device(device: torch.device) -> str:
    """What the generated kernels are specific to: the GPU's name and compute capability, or the
    CPU's architecture, the vector ISA torch dispatches to and the one inductor generates C++ for (which
    can differ: AMX or VNNI on AVX-512 machines; torch's own cache key for CPU names neither), e.g.
    'cpu x86_64 AVX512 inductor VecAVX512VNNI avx512 avx512_vnni'."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda {torch.cuda.get_device_name(device)} sm_{major}{minor}"
    if device.type == "cpu":
        return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()} inductor {_inductor_isa()}"
    return device.type


def _inductor_isa() -> str:
    """The vector ISA inductor's C++ code generation picks on this CPU (class and flags), or 'unknown'. Read
    at every call: it follows inductor's config (`cpp.vec_isa_ok`, `cpp.simdlen`) and `ATEN_CPU_CAPABILITY`;
    torch caches the probe of what the CPU supports (seconds, once per process)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        isa = pick_vec_isa()
    except Exception:  # noqa: BLE001  (a private module: an older or newer torch may lack it)
        return "unknown"
    return f"{type(isa).__name__} {isa}".strip()


@functools.lru_cache(maxsize=None)
def source_fingerprint(root: Path = Path(__file__).resolve().parent) -> str:
    """16 hex digits of the SHA-256 of every `.py` file under `root` (default: the runnerkit package),
    by relative path and content. Compiled graphs are traced from this code (the blocks, attention,
    fused operators), so an entry saved by other code (an upgrade, a local edit) is not loaded."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_fields(*, runner: type, model: dict[str, Any], dtype: str, cfg: CompileConfig, attention: str | None,
                 offload: OffloadConfig, device: torch.device, text_buckets: tuple[int, ...] = (),
                 lora: str = "off", compute_dtype: str = "same", ulysses: int = 1) -> dict[str, Any]:
    """Everything that makes compiled artifacts valid, in readable form: the metadata of a cache
    entry, whose key is the hash of these fields. `model` is the resolved architecture (JSON);
    `text_buckets` the text lengths prompts are padded to (() unpadded: the blocks then take no mask);
    `lora`: "off", or "unfused/r<max_rank>" when every linear carries LoRA matmuls (runnerkit/lora;
    fused LoRA compiles the same graph as none: "off"); `compute_dtype`: "same", or "fp8" when the blocks'
    linears run fp8 GEMMs (runnerkit/fp8_compute.py); `ulysses`: the sequence-parallel degree (config
    `parallel.ulysses`; above 1 the blocks' self-attention holds all-to-alls, and each rank runs
    1/ulysses of the tokens). CFG parallel is not keyed: each rank runs the one-process graph."""
    return {
        "format": CACHE_FORMAT,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": _dist_version("triton"),
        "python": platform.python_version(),
        "device": describe_device(device),
        "runner": f"{runner.__module__}.{runner.__qualname__}",
        "runnerkit sources": source_fingerprint(),
        "model": model,
        "dtype": dtype,
        "compile.mode": cfg.mode,
        "compile.coordinate_descent_tuning": cfg.coordinate_descent_tuning,
        "compile.deterministic": cfg.deterministic,
        "compile.dynamic": cfg.dynamic,
        "compile.backend": cfg.backend,
        "attention": attention or "none",
        "offload.mode": offload.mode,
        "offload.weight_dtype": offload.weight_dtype,
        "text_buckets": list(text_buckets),
        "lora": lora,
        "compute_dtype": compute_dtype,
        "parallel.ulysses": ulysses,
    }


def cache_key(fields: dict[str, Any]) -> str:
    """The entry name of `fields`: 20 hex digits of the SHA-256 of their canonical JSON."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def mismatch_reasons(cached: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Why an entry with fields `cached` does not serve `now`: one 'field cached != now' per field
    that differs ('model architecture differs (…)' for the architecture, up to 3 of its keys)."""
    reasons = []
    for name in [*now, *(k for k in cached if k not in now)]:
        a, b = cached.get(name, "(absent)"), now.get(name, "(absent)")
        if a == b:
            continue
        if name == "model" and isinstance(a, dict) and isinstance(b, dict):
            fa, fb = _flat(a), _flat(b)
            keys = [k for k in sorted(set(fa) | set(fb)) if fa.get(k, "(absent)") != fb.get(k, "(absent)")]
            reasons.append("model architecture differs (" + ", ".join(
                f"{k} {fa.get(k, '(absent)')} != {fb.get(k, '(absent)')}" for k in keys[:3]) +
                (f", {len(keys) - 3} more" if len(keys) > 3 else "") + ")")
        else:
            reasons.append(f"{name} {a} != {b}")
    return reasons


def _write_atomic(path: Path, data: bytes) -> None:
    """`data` to `path` through a temporary file beside it and a rename (never a truncated file).

    Raises:
        OSError: the write or the rename failed (the temporary file is removed).
    """
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


class CompileCache:
    """One entry of the compile cache in `cache_dir`: `<key>.bin` (torch's portable artifacts) and
    `<key>.json` (the fields of the key, the artifacts' SHA-256 and counts; written last, so an
    entry without it is incomplete). `load` before warmup, `save` after it; neither raises on a
    damaged or unwritable cache: both log what happened and `report()` says it (the profile's
    `compile_cache` section)."""

    def __init__(self, cache_dir: str | Path, fields: dict[str, Any]) -> None:
        self.dir = Path(cache_dir).expanduser()
        self.fields = fields
        self.key = cache_key(fields)
        self.loaded = False
        self.saved = False
        self.reason = "not loaded yet"
        self.artifacts: dict[str, int] = {}

    @property
    def bin_path(self) -> Path:
        return self.dir / f"{self.key}.bin"

    @property
    def meta_path(self) -> Path:
        return self.dir / f"{self.key}.json"

    def report(self) -> dict[str, Any]:
        """The profile's `compile_cache` section (docs/profile.md)."""
        return {"dir": str(self.dir), "key": self.key, "loaded": self.loaded, "reason": self.reason,
                "saved": self.saved, "artifacts": dict(self.artifacts)}

    def load(self, will_save: bool) -> bool:
        """Load this key's entry into torch's caches; True if loaded. Without one, log why each entry
        of the folder does not match (or that there is none); a damaged entry logs a WARNING.
        `will_save`: whether this run will write the entry after warmup (said in the log)."""
        after = "it will be written after warmup" if will_save else "nothing will be written (warmup is off)"
        unusable = self.unusable_folder()
        if unusable is not None:  # said now, before warmup pays for a compile that could not be saved
            self.reason = f"unusable folder: {unusable}"
            logger.warning("compile cache: `compile.cache_dir` {} {}: nothing can be loaded or saved there; compiling "
                           "from scratch", self.dir.resolve(), unusable)
            return False
        try:
            if self.bin_path.is_file():
                self.loaded = self._load_entry()
                return self.loaded
            others = sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []
        except OSError as exc:  # e.g. a folder this user may not read: the cache must not stop the run
            self.reason = f"unreadable folder: {type(exc).__name__}: {exc}"
            logger.warning("compile cache: could not read {}: {}: {}; compiling from scratch", self.dir,
                           type(exc).__name__, exc)
            return False
        if not others:
            self.reason = "no entry in the folder"
            logger.info("compile cache: {} holds no entry; compiling from scratch, {}", self.dir, after)
            return False
        mismatches = []
        for path in others:
            try:
                cached = json.loads(path.read_text())["fields"]
                why = "; ".join(mismatch_reasons(cached, self.fields)) or "same fields, other key (format change)"
            except (OSError, ValueError, KeyError, TypeError) as exc:
                why = f"unreadable metadata ({type(exc).__name__}: {exc})"
            mismatches.append(f"{path.stem}: {why}")
            logger.info("compile cache: entry {} does not match this run (cached != now): {}", path.name, why)
        self.reason = "no matching entry: " + " | ".join(mismatches)
        logger.info("compile cache: no entry for key {} in {}; compiling from scratch, {}", self.key, self.dir, after)
        return False

    def unusable_folder(self) -> str | None:
        """Why the cache folder can hold no entry (it is not a folder, or it or its nearest existing
        parent cannot be written), or None."""
        if self.dir.exists() and not self.dir.is_dir():
            return "is not a directory"
        existing = next((p for p in (self.dir.resolve(), *self.dir.resolve().parents) if p.exists()), None)
        if existing is None or not existing.is_dir():
            return f"cannot be created ({existing} is not a directory)"
        if not os.access(existing, os.W_OK | os.X_OK):
            return "is not writable" if existing == self.dir.resolve() else f"cannot be created ({existing} is not writable)"
        return None

    def _load_entry(self) -> bool:
        path, t0 = self.bin_path, time.perf_counter()
        try:
            data = path.read_bytes()
            path = self.meta_path  # a failure from here to the hash check is the metadata's
            meta = json.loads(self.meta_path.read_text())
            path = self.bin_path
            digest = hashlib.sha256(data).hexdigest()
            if meta.get("sha256") != digest:
                raise ValueError(f"its SHA-256 {digest[:12]}… differs from {self.meta_path.name}'s "
                                 f"{str(meta.get('sha256'))[:12]}… (truncated or overwritten)")
            info = torch.compiler.load_cache_artifacts(data)
            if info is None:
                raise ValueError("torch.compiler.load_cache_artifacts could not deserialize it")
        except Exception as exc:  # a cache must never stop the run: any failure -> compile from scratch
            self.reason = f"damaged entry: {type(exc).__name__}: {exc}"
            logger.warning("compile cache: could not load {}: {}: {}; compiling from scratch", path,
                           type(exc).__name__, exc)
            return False
        self.artifacts = {kind: len(keys) for kind, keys in info.artifacts.items()}
        self.reason = "loaded"
        logger.info("compile cache: loaded {} artifacts {} ({:.2f} MiB) from {} in {:.2f} s",
                    sum(self.artifacts.values()), self.artifacts, len(data) / 2**20, path, time.perf_counter() - t0)
        return True

    def save(self) -> bool:
        """Write every artifact torch compiled or loaded in this process so far as this key's entry;
        True if written. A failure logs an ERROR naming the path and the error, and returns False."""
        t0 = time.perf_counter()
        unusable = self.unusable_folder()  # before serializing what could not be written anyway
        if unusable is not None:
            logger.error("compile cache: `compile.cache_dir` {} {}; {} not written, the next start-up compiles from "
                         "scratch", self.dir.resolve(), unusable, self.bin_path.name)
            self.saved = False
            return False
        try:
            result = torch.compiler.save_cache_artifacts()
        except Exception as exc:  # torch's serializer: an optimisation must not fail the run
            logger.error("compile cache: torch.compiler.save_cache_artifacts failed: {}: {}; {} not written",
                         type(exc).__name__, exc, self.bin_path)
            self.saved = False
            return False
        if result is None:
            logger.info("compile cache: nothing compiled by inductor to save; {} not written", self.bin_path)
            self.saved = False
            return False
        data, info = result
        artifacts = {kind: len(keys) for kind, keys in info.artifacts.items()}
        meta = {"key": self.key, "fields": self.fields, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "artifacts": artifacts, "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        path = self.bin_path
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, data)
            path = self.meta_path
            _write_atomic(path, json.dumps(meta, indent=2).encode())
        except OSError as exc:
            logger.error("compile cache: could not write {}: {}; the next start-up compiles from scratch", path, exc)
            self.saved = False
            return False
        self.saved, self.artifacts = True, artifacts
        logger.info("compile cache: saved {} artifacts {} ({:.2f} MiB) to {} in {:.2f} s", sum(artifacts.values()),
                    artifacts, len(data) / 2**20, self.bin_path, time.perf_counter() - t0)
        return True
