"""The sections of a run config (`RunnerConfig`'s `offload`, `compile`, `memory`, `lora`, `parallel`,
`synthetic_checkpoint`) and a request's LoRA adapters; `runnerkit.config` re-exports every name here.

Each section is a strict, frozen pydantic model: unknown keys, wrong types and out-of-range values are
errors naming the field (`runnerkit.config.format_validation_error` words them).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["PREAD_KEYS", "CompileConfig", "LoRAConfig", "LoRARequest", "MemoryConfig", "OffloadConfig",
           "ParallelConfig", "PromptEnhancerConfig", "StrictModel", "SyntheticCheckpointConfig", "lora_flag_fields",
           "parse_lora_flag"]


PREAD_KEYS = ("page_cache", "read_threads")
"""Offload keys that act on storage disk with reader pread only (in a plan: on the pread rungs)."""
_PREAD_ALLOWED = {"page_cache": "'auto', 'keep', 'drop'", "read_threads": "'auto' or an int from 1 to 64"}


class StrictModel(BaseModel):
    # strict: "4" is not an int and 1 is not a bool (nothing is silently converted); floats accept ints.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class OffloadConfig(StrictModel):
    """Where weights live between uses (ARCHITECTURE §4)."""

    mode: Literal["none", "model", "block", "phase", "auto"] = Field(
        "auto", description="auto (the default): the memory planner (runnerkit/planning/planner.py, docs/memory_plan.md) "
        "chooses the fastest of the modes below that fits the device and host memory, before anything loads; the "
        "other keys set here constrain its choice (left unset, a family without a memory estimate, a run with "
        "`memory.check_fit` false or `unload_modules` stays resident). none: all resident, refused if it does not "
        "fit; model: whole modules visit the GPU for their stage; block/phase: transformer blocks (or their "
        "self-attn / cross-attn / FFN phases) stream through GPU slots.")
    storage: Literal["cpu", "disk"] = Field(
        "cpu", description="cpu: streamed weights live in (pinned) host memory; disk: they stream from the "
        "checkpoint's safetensors files every step.")
    lazy_load: bool = Field(False, description="Build the transformer per request and tear it down after (block/phase + disk only).")
    pin_memory: bool = Field(True, description="Use page-locked host memory (env RUNNERKIT_DISABLE_PINNED=1 forces false).")
    gpu_slots: int = Field(2, ge=2, le=64, description="Device slots that streamed blocks/phases rotate through.")
    prefetch_depth: int = Field(1, ge=1, le=63, description="Units copied ahead of the one computing (< gpu_slots).")
    reader: Literal["mmap", "pread"] = Field("mmap", description="How disk storage reads safetensors files.")
    page_cache: Literal["auto", "keep", "drop"] = Field(
        "auto", description="Storage disk with reader pread: keep the streamed files' pages in the OS page cache, so "
        "that steps after the first read them from memory, or drop the pages each read brought in, so that "
        "streaming a checkpoint larger than RAM evicts nothing else (every step then reads the disk). auto: keep "
        "when the streamed files the process keeps cached take at most half of the host's available memory (the "
        "smaller of MemAvailable and what a cgroup memory limit leaves); otherwise drop. Each file is decided once "
        "per process.")
    read_threads: int | Literal["auto"] = Field(
        "auto", description="Storage disk with reader pread: threads that read a streamed unit's bytes at once, each "
        "a contiguous part (one thread copies out of the page cache at a single core's memory bandwidth, a few GB/s "
        "on a server CPU). auto: where the files' pages stay cached (`page_cache`) 4, or fewer where the process may "
        "use fewer CPUs (affinity mask, cgroup CPU quotas); where each read goes to the disk (pages dropped) 1, as "
        "more threads read a virtio disk slower (docs/offload.md). Reads smaller than 4 MiB a thread use fewer.")

    @field_validator("read_threads", mode="before")
    @classmethod
    def _read_threads_value(cls, v: Any) -> Any:
        if v != "auto" and not (type(v) is int and 1 <= v <= 64):  # one message for both members of the union
            raise ValueError(f"must be {_PREAD_ALLOWED['read_threads']}")  # the formatted error adds the value
        return v

    weight_dtype: Literal["same", "fp8_e4m3", "auto"] = Field(
        "same", description="Storage dtype of streamed weights: same (the compute dtype), or fp8_e4m3 (quantized at "
        "load into host memory, storage cpu only; upcast at compute: lossy). auto (with mode auto only): the "
        "planner may choose fp8_e4m3 when the weights do not fit otherwise. A checkpoint's own float8_e4m3fn "
        "weights (fp8 releases) need no setting: with storage disk they stream as stored and are upcast on the "
        "device.")
    vae_tiling: bool = Field(False, description="Decode the VAE in spatial tiles to bound memory.")
    stream_modules: tuple[str, ...] | None = Field(
        None, description="Modules that stream their blocks/layers in mode block/phase. null: the family's "
        "transformers; a list names them all, e.g. [\"transformer\", \"text_encoder\"] to stream a text "
        "encoder's layers too (modules not listed visit the device whole for their stage).",
        strict=False)  # a JSON list, held as a tuple: the config stays hashable (estimates cache on it)
    resident_modules: tuple[str, ...] | None = Field(
        None, description="Modules kept on the device whole in mode model/block/phase (built there at load, never "
        "moved), e.g. [\"transformer\"] so that only the text encoder visits the device for its stage. null: none. "
        "A module cannot be both resident and in `offload.stream_modules`.",
        strict=False)
    keep_across_stages: bool = Field(
        False, description="Mode model/block/phase: a transformer that consecutive denoising stages use (around "
        "a latent upsampler between them) stays on the device through the transition instead of leaving and coming "
        "back (a visiting module is copied once, a lazy_load one built once per request). The planner sets it "
        "where it fits.")
    resident_blocks: int = Field(
        0, ge=0, le=4096, description="Mode block/phase: this many streamed units (blocks or phases) of each "
        "streamed transformer stay on the device, spread evenly over its units; the others rotate through the "
        "`gpu_slots`. 0: every unit streams. More than a module has: all of its units stay. Streamed text "
        "encoders and connectors (once per request) stream every unit.")

    def _pread_keys(self) -> list[str]:
        """The `PREAD_KEYS` set here to something other than 'auto'."""
        return [f for f in PREAD_KEYS if getattr(self, f) != "auto"]

    @model_validator(mode="after")
    def _combinations(self) -> OffloadConfig:
        if self.mode == "auto":  # the other keys constrain the plan; each candidate is validated as concrete
            set_ = self.model_fields_set
            pread_only = self._pread_keys()
            if pread_only and (("storage" in set_ and self.storage != "disk")
                               or ("reader" in set_ and self.reader != "pread")):
                key = pread_only[0]
                raise ValueError(f"`offload.{key}`={getattr(self, key)!r} applies to `offload.storage`='disk' with "
                                 f"`offload.reader`='pread' only (allowed there: {_PREAD_ALLOWED[key]}); the config "
                                 f"sets " + ", ".join(f"{k}={getattr(self, k)!r}" for k in ("storage", "reader")
                                                      if k in set_))
            return self
        if self.weight_dtype == "auto":
            raise ValueError(f"`offload.weight_dtype`='auto' lets the memory planner choose the storage dtype; it "
                             f"needs `offload.mode`='auto' (got {self.mode!r}): use 'same' or 'fp8_e4m3'")
        streaming = self.mode in ("block", "phase")
        inert = [f for f in ("gpu_slots", "prefetch_depth", "reader", "page_cache", "read_threads", "stream_modules",
                             "resident_blocks")
                 if f in self.model_fields_set and not streaming]
        inert += [f for f in ("pin_memory", "resident_modules", "keep_across_stages")
                  if f in self.model_fields_set and self.mode == "none"]
        if inert:
            keys = ", ".join(f"`offload.{f}`" for f in inert)  # each in backticks: its origin is shown too
            raise ValueError(f"`offload.{inert[0]}` has no effect with `offload.mode`={self.mode!r} "
                             f"(set for: {keys}); remove them or choose a mode that uses them")
        if self.stream_modules is not None:
            if not self.stream_modules:
                raise ValueError("`offload.stream_modules` is empty; list at least one module, or null for the "
                                 "family's transformers")
            dup = sorted({m for m in self.stream_modules if self.stream_modules.count(m) > 1})
            if dup:
                raise ValueError(f"`offload.stream_modules` lists {dup} more than once")
        if self.resident_modules is not None:
            if not self.resident_modules:
                raise ValueError("`offload.resident_modules` is empty; list at least one module, or null for none")
            dup = sorted({m for m in self.resident_modules if self.resident_modules.count(m) > 1})
            if dup:
                raise ValueError(f"`offload.resident_modules` lists {dup} more than once")
            both = sorted(set(self.resident_modules) & set(self.stream_modules or ()))
            if both and streaming:
                raise ValueError(f"`offload.resident_modules` and `offload.stream_modules` both list {both}: a module "
                                 "either stays on the device whole or streams its blocks")
        if self.reader != "mmap" and self.storage != "disk":
            raise ValueError(f"`offload.reader`={self.reader!r} applies to `offload.storage`='disk' only")
        pread_only = self._pread_keys()
        if pread_only and not (self.storage == "disk" and self.reader == "pread"):
            allowed = _PREAD_ALLOWED[pread_only[0]]
            raise ValueError(f"`offload.{pread_only[0]}`={getattr(self, pread_only[0])!r} applies to "
                             "`offload.storage`='disk' with `offload.reader`='pread' only (got "
                             f"storage={self.storage!r}, reader={self.reader!r}); allowed there: {allowed}")
        if self.prefetch_depth >= self.gpu_slots:
            raise ValueError(f"`offload.prefetch_depth` ({self.prefetch_depth}) must be < `offload.gpu_slots` "
                             f"({self.gpu_slots}): a slot is needed for the unit computing now")
        if self.storage == "disk" and not streaming:
            raise ValueError(f"`offload.storage`='disk' needs `offload.mode` 'block' or 'phase' (got {self.mode!r}): "
                             "only streamed transformer blocks are read from disk")
        if self.lazy_load and not (streaming and self.storage == "disk"):
            raise ValueError("`offload.lazy_load`=true needs `offload.mode` 'block'/'phase' and `offload.storage`='disk' "
                             f"(got mode={self.mode!r}, storage={self.storage!r})")
        if self.weight_dtype != "same" and not streaming:
            raise ValueError(f"`offload.weight_dtype`={self.weight_dtype!r} applies to streamed weights only; "
                             f"`offload.mode` must be 'block' or 'phase' (got {self.mode!r})")
        if self.weight_dtype != "same" and self.storage == "disk":
            raise ValueError("`offload.weight_dtype`='fp8_e4m3' (quantize to fp8 at load) needs `offload.storage`="
                             "'cpu': disk storage streams the checkpoint's bytes as they are. For an fp8 checkpoint "
                             "(float8_e4m3fn weights, with or without scales) keep `offload.weight_dtype`='same': "
                             "its fp8 weights stream from disk as stored")
        return self


class CompileConfig(StrictModel):
    """torch.compile of the transformer (one compile path, shared by warmup and requests)."""

    enabled: bool = Field(False, description="Compile the transformer's repeated block (regional compile, "
                          "runnerkit/compile.py), once, shared by every block; warmup's shapes compile it.")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    coordinate_descent_tuning: bool = Field(
        False, description="Inductor's coordinate-descent tuning of every generated Triton kernel's launch "
        "configuration (block sizes, warps, stages), benchmarked on the device at compile time: the fused "
        "normalization/modulation kernels of a block run closer to memory bandwidth, the first compile takes "
        "longer (warmup pays it; the compile cache keeps the result). Already part of the 'max-autotune' modes; "
        "inductor backend only. Measured in bench/results/summary.md.")
    deterministic: bool = Field(
        False, description="Inductor's deterministic mode (torch >= 2.10, CUDA): no on-device benchmarking that "
        "changes numerics (the reduction kernels' block sizes and warps, matmul padding, template autotuning), so "
        "that two processes (a fresh compile, a saved compile cache) are expected to give bit-identical outputs. "
        "Without it inductor picks some reduction configurations by timing, and the outputs of a seed can differ in "
        "the last bits between processes. Expected to cost some speed (docs/compile.md). Inductor backend only.")
    dynamic: bool = Field(False, description="false: torch's automatic dynamic shapes (a dimension that changes "
                          "between calls becomes dynamic at its first recompile); true: dynamic from the first compile.")
    backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="torch.compile backend; 'eager' and 'aot_eager' trace without generating kernels "
        "(tests count compilations with them).")
    cache_dir: str | None = Field(
        None, min_length=1, description="Folder of the compile cache (runnerkit/compile.py, `CompileCache`): the "
        "compiled artifacts of a warmed runner are saved here after warmup and loaded at the next start-up before "
        "warmup, so a restart on the same software, device and config compiles nothing. One entry per key (torch/"
        "CUDA/triton/Python versions, device, runner class, runnerkit's sources, architecture, dtype, compile "
        "settings, attention "
        "backend, offload mode); a mismatch recompiles and logs why. Inductor backend only; torch >= 2.7. A relative "
        "path is relative to the working directory.")

    @model_validator(mode="after")
    def _settings_act(self) -> CompileConfig:
        changed = [k for k in ("mode", "coordinate_descent_tuning", "deterministic", "dynamic", "backend", "cache_dir")
                   if k in self.model_fields_set
                   and (k not in ("coordinate_descent_tuning", "deterministic") or getattr(self, k))]  # false: default
        if not self.enabled and changed:
            raise ValueError(f"`compile.{changed[0]}` does nothing while `compile.enabled` is false: set "
                             "`enabled: true` or remove it")
        if self.backend != "inductor" and self.mode != "default":
            raise ValueError(f"`compile.mode`={self.mode!r} only acts with `compile.backend`='inductor' (got "
                             f"{self.backend!r}): remove it")
        for key in ("coordinate_descent_tuning", "deterministic"):
            if getattr(self, key) and self.backend != "inductor":
                raise ValueError(f"`compile.{key}` only acts with `compile.backend`='inductor' (got "
                                 f"{self.backend!r}): remove it")
        if self.coordinate_descent_tuning and self.mode.startswith("max-autotune"):
            raise ValueError(f"`compile.coordinate_descent_tuning` is already on in `compile.mode`={self.mode!r}: "
                             "remove it")
        if self.cache_dir is not None and not self.cache_dir.strip():
            raise ValueError(f"`compile.cache_dir`={self.cache_dir!r} is blank: give a folder path (relative paths "
                             "are relative to the working directory) or remove it")
        if self.backend != "inductor" and self.cache_dir is not None:
            raise ValueError(f"`compile.cache_dir` only acts with `compile.backend`='inductor' (got {self.backend!r}; "
                             "the 'eager' and 'aot_eager' backends generate no kernels to cache): remove it or use "
                             "backend 'inductor'")
        return self


class MemoryConfig(StrictModel):
    """Thresholds of the pressure-aware `maybe_empty_cache` and the fit check of requests (runnerkit.memory,
    runnerkit.planning.fit)."""

    empty_cache_min_free_gib: float = Field(2.0, ge=0, description="Empty the cache when free device memory is below this.")
    empty_cache_min_reclaimable_gib: float = Field(
        16.0, ge=0, description="Empty the cache when reserved-but-unallocated memory is above this.")
    check_fit: bool = Field(
        True, description="Refuse a request (and a warmup shape) whose estimated peak memory exceeds the limit, "
        "before any work on it starts.")
    limit_gib: float | None = Field(
        None, gt=0, le=1024**2, description="The device memory limit in GiB that requests are checked against "
        "(weights included); None: read from the device (CUDA: free + held by this process; CPU: available "
        "host memory).")
    host_limit_gib: float | None = Field(
        None, gt=0, le=1024**2, description="The host memory (RAM) limit in GiB of this process: the memory "
        "planner (`offload.mode` auto) plans within it, and the fit check refuses a request whose host bytes "
        "(`planning.fit.host_bytes_of`: offloaded weights, streamer slabs, a process constant) exceed it. None: "
        "the planner reads the host's available memory (incl. a cgroup limit) and the fit check does not check "
        "host memory.")
    pinned_limit_gib: float | None = Field(
        None, gt=0, le=1024**2, description="The page-locked (pinned) host memory limit in GiB, apart from the host "
        "limit: pinned pages cannot be swapped or reclaimed, so a machine shared with other work may allow fewer of "
        "them than it has RAM. The planner keeps a plan's pinned bytes (model-offloaded weights and streamer slabs "
        "with `offload.pin_memory`) within it, and the fit check refuses a request above it. None: pinned memory "
        "counts only towards the host limit.")
    expandable_segments: bool = Field(
        True, description="CUDA: PyTorch's caching allocator grows its segments in place (`expandable_segments`), "
        "so memory freed between differently sized activations is reused instead of left in gaps; set before "
        "loading, for the whole process. The memory plan counts allocated bytes and may fill the device to its "
        "limit, which the default segments' gaps can exceed (runnerkit/allocator.py). False: PyTorch's default. "
        "Not applied when PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set (the environment's settings are kept).")

    @model_validator(mode="after")
    def _limit_needs_check(self) -> MemoryConfig:
        for key in ("limit_gib", "host_limit_gib", "pinned_limit_gib"):
            if getattr(self, key) is not None and not self.check_fit:
                raise ValueError(f"`memory.{key}` has no effect with `memory.check_fit`=false; remove one of them")
        return self


class LoRAConfig(StrictModel):
    """LoRA adapters per request (runnerkit/lora, docs/lora.md). Present: requests may carry `lora`."""

    mode: Literal["unfused", "fused"] = Field(
        "unfused", description="unfused: y = x W^T + s (x A^T) B^T in every linear, the LoRA matrices resident on the "
        "device (any offload mode; a small cost per step, none per switch); fused: W + s B A written into the weights "
        "per request and restored from a kept copy (offload none/model or unload_modules; no cost per step, a weight "
        "copy per switch).")
    max_rank: int = Field(64, ge=1, le=1024, description="unfused: rank of each linear's LoRA slots; a request's "
                          "adapters' summed rank on a layer must fit (a fixed size: switching compiles nothing).")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="Known adapters: name -> .safetensors path; `GET /v1/models` lists them "
        "and a request may name one instead of a path.")

    @field_validator("adapters")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z0-9_.-]+", k)]
        if bad:
            raise ValueError(f"`lora.adapters` names must be letters, digits, '_', '.', '-' (got {bad})")
        return {k: os.path.expanduser(p) for k, p in v.items()}


class LoRARequest(StrictModel):
    """One adapter of a request: a .safetensors path (or a name of the config's `lora.adapters`) and its strength."""

    path: str = Field(min_length=1, description="Adapter file, or the name of one in the config's `lora.adapters`.")
    strength: float = Field(1.0, ge=-100, le=100, description="Multiplies the adapter's update (1: as trained).")

    @field_validator("path", mode="before")
    @classmethod
    def _home(cls, v: Any) -> Any:
        return os.path.expanduser(v) if isinstance(v, str) else v


def lora_flag_fields(text: str) -> dict[str, Any]:
    """`PATH[:STRENGTH]` (CLI `--lora`) -> {"path", "strength"} (strength omitted when not given), not yet
    validated (a request validates them as `lora[i]`). A tail after the last ':' that is not a number
    belongs to the path only when the whole text names an existing file.

    Raises:
        ValueError: nothing before the last ':', or a strength that is not a number.
    """
    path, sep, tail = text.rpartition(":")
    if sep and not path and not os.path.exists(os.path.expanduser(text)):
        raise ValueError(f"`--lora` {text!r}: no path before the ':' (syntax PATH[:STRENGTH], e.g. "
                         "style.safetensors:0.8, or a name of the config's `lora.adapters`)")
    if sep and path:
        try:
            return {"path": path, "strength": float(tail)}
        except ValueError:
            if os.path.exists(os.path.expanduser(text)):
                return {"path": text}
            raise ValueError(f"`--lora` {text!r}: the strength {tail!r} after the last ':' is not a number "
                             "(syntax PATH[:STRENGTH], e.g. style.safetensors:0.8)") from None
    return {"path": text}


def parse_lora_flag(text: str) -> LoRARequest:
    """`PATH[:STRENGTH]` (CLI `--lora`) -> a validated `LoRARequest` (`lora_flag_fields`).

    Raises:
        ValueError: see `lora_flag_fields`; pydantic's ValidationError (a ValueError) for an empty path or a
            strength outside [-100, 100] or not finite.
    """
    return LoRARequest(**lora_flag_fields(text))


class ParallelConfig(StrictModel):
    """Multi-GPU split of every request under `torchrun` (runnerkit/parallel, docs/multi_gpu.md).

    The launcher's WORLD_SIZE must equal `cfg` x `ulysses`; rank r is (cfg rank r // ulysses,
    Ulysses rank r % ulysses), so a Ulysses group is `ulysses` consecutive ranks.
    """

    cfg: Literal[1, 2] = Field(1, description="CFG parallel: 2 runs the conditional and the unconditional branch "
                               "on two ranks (one all-gather of the prediction per step); needs `enable_cfg`.")
    ulysses: int = Field(1, ge=1, le=64, description="Ulysses sequence parallel degree: the transformer's tokens "
                         "are split over this many ranks, with two all-to-alls per self-attention; the attention "
                         "heads and every request's token count must divide by it.")
    timeout_s: float = Field(600.0, gt=0, le=86400, description="Bound in seconds on every collective (and on "
                             "the process-group start): a rank that waits longer for its peers fails, so a "
                             "failed or stuck rank ends the group instead of hanging it. It must exceed the "
                             "longest stretch one rank works alone (rank 0's VAE decode and save).")

    @property
    def world_size(self) -> int:
        """Processes the launcher must start: `cfg` x `ulysses`."""
        return self.cfg * self.ulysses


class PromptEnhancerConfig(StrictModel):
    """The runner's prompt enhancer (an LLM that rewrites a request's prompt when it asks, `enhance_prompt`).
    Its presence loads the enhancer; warmup then runs one short enhancement (the family's docs/ page)."""

    path: str | None = Field(None, description="The enhancer's folder: a diffusers checkpoint holding "
                             "`prompt_enhancer/` and `processor/`, or one transformers folder with both (None: "
                             "`model_path`).")
    system_prompt_t2v: str | None = Field(None, description="UTF-8 file with the system prompt of text-only "
                                          "requests (None: `system_prompt_t2v.txt` in the enhancer's folder).")
    system_prompt_i2v: str | None = Field(None, description="UTF-8 file with the system prompt of requests with a "
                                          "reference image (None: `system_prompt_i2v.txt` in the enhancer's folder).")
    max_new_tokens: int = Field(600, ge=1, le=4096, description="Most tokens the enhancer writes (600: the "
                                "reference's).")


class SyntheticCheckpointConfig(StrictModel):
    """Write deterministic random weights (once) when no checkpoint exists. The output is noise."""

    seed: int = Field(0, ge=0, description="Seed of the random weights.")
