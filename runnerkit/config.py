"""Typed, validated configuration: the one place where runnerkit's run defaults live.

Settings whose defaults belong to a model family (resolution, frames, fps, steps, shift,
guidance, scheduler and its sigma spacing: `FAMILY_DEFAULTED`) are None here and filled in from the family runner's
`DEFAULTS` when the runner is built (`BaseRunner.resolve_config`).

A run is described by `RunnerConfig` (JSON file + CLI overrides, validated once before any
loading) and one `RequestConfig` per request (CLI flags or one line of a `--requests` .jsonl).
Unknown keys, wrong types and out-of-range values are errors that name the field.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

MAX_SIDE = 8192  # pixels: bounds a request far above any released model resolution (720p video, 1328 px images)
MAX_FRAMES = 1025  # frames

#: Run settings whose defaults belong to the model family (`BaseRunner.DEFAULTS`); None here means
#: "the family's default", filled in by `BaseRunner.resolve_config` before anything else reads them.
FAMILY_DEFAULTED = ("infer_steps", "target_height", "target_width", "target_video_length", "fps",
                    "sample_shift", "sample_guide_scale", "scheduler", "scheduler_spacing")


MAX_TEXT_BUCKET = 1024
"""The largest `text_buckets` entry: prompts are cut at 1024 tokens (the text encoders' maximum sequence
length of the families with padded text), so a larger bucket is never reached."""
BUCKETS_RULE = (f"`text_buckets` must be 'auto', 'on', 'off' or a non-empty, strictly increasing list of integer "
                f"token counts in [1, {MAX_TEXT_BUCKET}]")


class ConfigError(ValueError):
    """A configuration or request is invalid; the message names the field, value and what is allowed."""


class ConfigLockedError(RuntimeError):
    """The runner's config was changed after `load_modules` (it is locked from then on)."""


class FrozenDict(dict):
    """A dict that refuses every change (the locked config's `model`); serialises as a plain dict."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigLockedError("the runner config is locked after load_modules (deeply frozen): "
                                "its `model` architecture cannot be changed")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]


class FrozenList(list):
    """A list that refuses every change (lists inside the locked config's `model`)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigLockedError("the runner config is locked after load_modules (deeply frozen): "
                                "its `model` architecture cannot be changed")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse  # type: ignore[assignment]


def deep_freeze(value: Any) -> Any:
    """dicts -> FrozenDict, lists -> FrozenList, recursively; other values unchanged."""
    if isinstance(value, dict):
        return FrozenDict({k: deep_freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        frozen = [deep_freeze(v) for v in value]
        return FrozenList(frozen) if isinstance(value, list) else tuple(frozen)
    return value


class _Strict(BaseModel):
    # strict: "4" is not an int and 1 is not a bool (nothing is silently converted); floats accept ints.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class OffloadConfig(_Strict):
    """Where weights live between uses (ARCHITECTURE §4)."""

    mode: Literal["none", "model", "block", "phase", "auto"] = Field(
        "auto", description="auto (the default): the memory planner (runnerkit/runners/plan.py, docs/memory_plan.md) "
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

    @model_validator(mode="after")
    def _combinations(self) -> "OffloadConfig":
        if self.mode == "auto":  # the other keys constrain the plan; each candidate is validated as concrete
            return self
        if self.weight_dtype == "auto":
            raise ValueError(f"`offload.weight_dtype`='auto' lets the memory planner choose the storage dtype; it "
                             f"needs `offload.mode`='auto' (got {self.mode!r}): use 'same' or 'fp8_e4m3'")
        streaming = self.mode in ("block", "phase")
        inert = [f for f in ("gpu_slots", "prefetch_depth", "reader", "stream_modules", "resident_blocks")
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


class CompileConfig(_Strict):
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
        changed = [k for k in ("mode", "coordinate_descent_tuning", "dynamic", "backend", "cache_dir")
                   if k in self.model_fields_set
                   and (k != "coordinate_descent_tuning" or self.coordinate_descent_tuning)]  # false: the default
        if not self.enabled and changed:
            raise ValueError(f"`compile.{changed[0]}` does nothing while `compile.enabled` is false: set "
                             "`enabled: true` or remove it")
        if self.backend != "inductor" and self.mode != "default":
            raise ValueError(f"`compile.mode`={self.mode!r} only acts with `compile.backend`='inductor' (got "
                             f"{self.backend!r}): remove it")
        if self.coordinate_descent_tuning and self.backend != "inductor":
            raise ValueError(f"`compile.coordinate_descent_tuning` only acts with `compile.backend`='inductor' (got "
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


class MemoryConfig(_Strict):
    """Thresholds of the pressure-aware `maybe_empty_cache` and the fit check of requests (runnerkit.memory,
    runnerkit.runners.fit)."""

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
        "(`runners.fit.host_bytes_of`: offloaded weights, streamer slabs, a process constant) exceed it. None: "
        "the planner reads the host's available memory (incl. a cgroup limit) and the fit check does not check "
        "host memory.")
    pinned_limit_gib: float | None = Field(
        None, gt=0, le=1024**2, description="The page-locked (pinned) host memory limit in GiB, apart from the host "
        "limit: pinned pages cannot be swapped or reclaimed, so a machine shared with other work may allow fewer of "
        "them than it has RAM. The planner keeps a plan's pinned bytes (model-offloaded weights and streamer slabs "
        "with `offload.pin_memory`) within it, and the fit check refuses a request above it. None: pinned memory "
        "counts only towards the host limit.")

    @model_validator(mode="after")
    def _limit_needs_check(self) -> "MemoryConfig":
        for key in ("limit_gib", "host_limit_gib", "pinned_limit_gib"):
            if getattr(self, key) is not None and not self.check_fit:
                raise ValueError(f"`memory.{key}` has no effect with `memory.check_fit`=false; remove one of them")
        return self


class LoRAConfig(_Strict):
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


class LoRARequest(_Strict):
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


class ParallelConfig(_Strict):
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


class SyntheticCheckpointConfig(_Strict):
    """Write deterministic random weights (once) when no checkpoint exists. The output is noise."""

    seed: int = Field(0, ge=0, description="Seed of the random weights.")


REQUEST_DEFAULT_FIELDS = ("seed", "target_height", "target_width", "target_video_length", "negative_prompt")
"""Runner-config fields that are only defaults of a request's own values (a request may set each)."""


class RunnerConfig(_Strict):
    """Everything that stays fixed for the life of a runner (locked after `load_modules`)."""

    model_cls: str = Field(description="Registered runner name (runnerkit.registry; `runnerkit --help` lists them).")
    task: str = Field("t2v", description="Task of the runner, e.g. 't2v'.")
    model_path: str | None = Field(None, description="Checkpoint folder (runnerkit, original or diffusers layout), or "
                                   "a single-file release (.safetensors) where the family loads one.")
    text_encoder_path: str | None = Field(
        None, description="Text encoder folder (transformers layout) of a single-file release; a checkpoint folder holds "
                          "its own (families that take it: their docs/ page).")
    upsampler_path: str | None = Field(
        None, description="Latent upsampler file (.safetensors) of a single-file two-stage release; a checkpoint folder "
                          "holds its own.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="Compute dtype of transformer and text encoder.")
    compute_dtype: Literal["same", "fp8"] = Field(
        "same", description="Matmul precision of the transformer blocks' linear layers: 'same' (`dtype`), or 'fp8': "
        "E4M3 weights with per-output-row scales (quantized once at load) and activations quantized per token at "
        "each call, through torch._scaled_mm (docs/fp8_compute.md). Needs CUDA compute capability >= 8.9 (or the "
        "CPU), offload mode none or model, and `lora.mode` unfused if LoRA is set.")
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'.")
    infer_steps: int | None = Field(None, ge=1, le=1000, description="Denoising steps (None: the family's default).")
    target_height: int | None = Field(None, gt=0, le=MAX_SIDE, description="Default output height in pixels (None: family default).")
    target_width: int | None = Field(None, gt=0, le=MAX_SIDE, description="Default output width in pixels (None: family default).")
    target_video_length: int | None = Field(
        None, gt=0, le=MAX_FRAMES, description="Default number of frames, e.g. 4n+1 for video families, 1 for images (None: family default).")
    fps: int | None = Field(None, gt=0, le=240, description="Frames per second of saved video (None: family default).")
    sample_shift: float | None = Field(None, gt=0, description="Flow-matching sigma shift (None: family default).")
    sample_sigmas: tuple[float, ...] | None = Field(
        None, min_length=1, max_length=1000, description="A fixed table of sigmas, one per step, used as given "
        "instead of `sample_shift` and `scheduler_spacing` (a step-distilled model's trained schedule, e.g. "
        "docs/lora.md); `infer_steps` must equal its length.")
    sample_guide_scale: float | tuple[float, float] | None = Field(
        None, description="CFG scale; a pair [high-noise, low-noise] for MoE models (None: family default).")
    boundary: float | None = Field(None, gt=0, lt=1, description="MoE expert switch point (fraction of timesteps).")
    enable_cfg: bool = Field(True, description="Classifier-free guidance (two branches per step).")
    negative_prompt: str | None = Field(None, description="Default negative prompt; None: the family's reference default.")
    scheduler: Literal["unipc", "euler"] | None = Field(None, description="Flow-matching sampler (None: family default).")
    scheduler_spacing: str | None = Field(
        None, description="Where the sampler's sigmas and timesteps come from: a name in runnerkit.schedulers.SPACINGS, "
                          "each the set_timesteps of the implementation it is named after "
                          "(runnerkit/schedulers/spacing.py; None: family default).")
    seed: int = Field(42, ge=0, le=2**63 - 1, description="Default seed of a request.")
    warmup: bool = Field(False, description="Run the one-time warmup in init_modules (CLI --warmup).")
    unload_modules: bool = Field(False, description="Load every module per request (warmup refuses this mode).")
    offload: OffloadConfig = OffloadConfig()
    compile: CompileConfig = CompileConfig()
    attention: Literal["auto", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn_4"] = Field(
        "auto", description="Attention kernel of the transformer (runnerkit/attention.py): 'auto' takes the first "
        "available of the device's preference list; an explicit one that cannot run is refused at load.")
    text_buckets: Literal["auto", "on", "off"] | tuple[int, ...] = Field(
        "auto", description="Text lengths (tokens) a family with variable-length prompts pads the text encoder's "
        "output to, the padding masked out (docs/prompt_lengths.md): each prompt runs at one of a few warmed shapes. "
        "'auto': the family's buckets where the attention backend takes the mask at no steady cost, else 'off' "
        "(decided at load); 'on': the family's buckets; 'off': each prompt at its own length; a list: strictly "
        "increasing lengths in [1, 1024]. Families whose text already has one fixed length take 'auto' only.")
    memory: MemoryConfig = MemoryConfig()
    parallel: ParallelConfig | None = Field(
        None, description="Split each request over the ranks of `torchrun` (CFG parallel, Ulysses sequence "
        "parallel); None: one process (docs/multi_gpu.md).")
    synthetic_checkpoint: SyntheticCheckpointConfig | None = Field(
        None, description="Write random weights to model_path (or a cache folder) if no checkpoint is there.")
    model: dict[str, Any] | None = Field(None, description="Architecture in runnerkit's names; normally read from the checkpoint.")
    lora: LoRAConfig | None = Field(None, description="LoRA adapters per request (None: requests may not carry `lora`).")

    @field_validator("sample_sigmas", mode="before")
    @classmethod
    def _table_from_json(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v  # JSON has no tuples

    @field_validator("sample_guide_scale", mode="before")
    @classmethod
    def _pair_from_json(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v  # JSON has no tuples; the pair arrives as a list

    @field_validator("scheduler_spacing")
    @classmethod
    def _spacing(cls, v: str | None) -> str | None:
        # The names live with the schedulers (imported here, not at module level: this module stays
        # free of torch, which the schedulers need).
        from runnerkit.schedulers.spacing import SPACINGS

        if v is not None and v not in SPACINGS:
            raise ValueError(f"`scheduler_spacing` must be one of {list(SPACINGS)} (got {v!r})")
        return v

    @field_validator("text_buckets", mode="before")
    @classmethod
    def _buckets_from_json(cls, v: Any) -> Any:
        """One clear line for a value of the wrong type (instead of the union's two); JSON has no tuples."""
        if isinstance(v, (list, tuple)) and all(type(n) is int for n in v):
            return tuple(v)
        if v in ("auto", "on", "off"):
            return v
        raise ValueError(f"{BUCKETS_RULE} (got {v!r})")

    @field_validator("text_buckets")
    @classmethod
    def _buckets(cls, v: str | tuple[int, ...]) -> str | tuple[int, ...]:
        if isinstance(v, tuple):
            if not v or any(not 1 <= n <= MAX_TEXT_BUCKET for n in v) or any(a >= b for a, b in zip(v, v[1:])):
                raise ValueError(f"{BUCKETS_RULE} (got {list(v)})")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"`device` must be 'auto', 'cpu', 'cuda' or 'cuda:N' (got {v!r})")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> "RunnerConfig":
        default_auto = self.offload.mode == "auto" and "mode" not in self.offload.model_fields_set
        if self.unload_modules and self.offload.mode != "none" and not default_auto:
            raise ValueError(f"`unload_modules`=true loads whole modules per request; it cannot be combined with "
                             f"`offload.mode`={self.offload.mode!r}")
        if self.lora is not None and self.lora.mode == "fused" and self.offload.mode in ("block", "phase"):
            raise ValueError(f"`lora.mode`='fused' cannot adapt streamed weights (`offload.mode`={self.offload.mode!r} "
                             "re-fills each block from its source every step): use `lora.mode`='unfused'")
        if self.compute_dtype == "fp8" and self.offload.mode in ("block", "phase"):
            raise ValueError(f"`compute_dtype`='fp8' with `offload.mode`={self.offload.mode!r} is not supported: the "
                             "streamed blocks are re-filled from their source every step, so their fp8 weights would "
                             "be re-quantized at every fetch; use `offload.mode` 'none' or 'model' (or keep "
                             "`compute_dtype`='same'; `offload.weight_dtype`='fp8_e4m3' stores streamed weights in "
                             "fp8 and computes in `dtype`)")
        if self.compute_dtype == "fp8" and self.lora is not None and self.lora.mode == "fused":
            raise ValueError("`compute_dtype`='fp8' with `lora.mode`='fused' is not supported: fused LoRA writes "
                             "W + s B A into the weights, which fp8 compute holds quantized; use `lora.mode`="
                             "'unfused' (its low-rank update runs in `dtype` beside the fp8 GEMM)")
        if self.sample_sigmas is not None and self.infer_steps is not None and len(self.sample_sigmas) != self.infer_steps:
            raise ValueError(f"`infer_steps`={self.infer_steps} but `sample_sigmas` holds {len(self.sample_sigmas)} "
                             "sigmas: a fixed table runs one step per sigma")
        if self.model_path is None and self.synthetic_checkpoint is None:
            raise ValueError("`model_path` is required unless `synthetic_checkpoint` is set")
        if self.parallel is not None and self.parallel.cfg == 2 and not self.enable_cfg:
            raise ValueError("`parallel.cfg`=2 runs the two CFG branches on two ranks, but `enable_cfg` is false "
                             "(one branch): set `parallel.cfg` to 1 or enable CFG")
        scales = self.sample_guide_scale if isinstance(self.sample_guide_scale, tuple) else (self.sample_guide_scale,)
        if any(s is not None and s < 0 for s in scales):
            raise ValueError(f"`sample_guide_scale` must be >= 0 (1: the conditional prediction alone); "
                             f"got {self.sample_guide_scale!r}")
        return self

    def refuse_inert_settings(self) -> None:
        """Refuse settings the user gave that nothing would read (call on the config as given, before
        family defaults fill it).

        Raises:
            ConfigError: `sample_guide_scale` or `negative_prompt` set while `enable_cfg` is false.
        """
        if not self.enable_cfg:  # settings that only CFG reads would be silently ignored
            inert = [k for k in ("sample_guide_scale", "negative_prompt") if getattr(self, k) is not None]
            if inert:
                raise ConfigError(f"{' and '.join(f'`{k}`' for k in inert)} only act{'s' if len(inert) == 1 else ''} "
                                  "with classifier-free guidance, but `enable_cfg` is false: remove "
                                  f"{'it' if len(inert) == 1 else 'them'} or enable CFG")


#: Longest prompt accepted, in characters (the text encoders read a few hundred tokens; a longer
#: text only costs tokenization time and memory).
MAX_PROMPT_CHARS = 20_000
#: Reference images a request may add after `image_path` (`extra_image_paths`); a family takes fewer.
MAX_EXTRA_IMAGES = 7


class RequestConfig(_Strict):
    """One request: what to generate and where to save it."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS,
                        description="Text prompt (not only whitespace; text encoders read a few hundred tokens).")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS,
                                        description="Overrides the runner's negative prompt.")
    image_path: str | None = Field(None, description="Conditioning image (image tasks).")
    last_frame_path: str | None = Field(None, description="Last-frame image (FLF2V).")
    extra_image_paths: list[str] | None = Field(
        None, min_length=1, max_length=MAX_EXTRA_IMAGES,
        description="Further reference images after `image_path`, in order (image editing with several references).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Seed; None: the runner config's seed.")
    target_height: int | None = Field(None, gt=0, le=MAX_SIDE)
    target_width: int | None = Field(None, gt=0, le=MAX_SIDE)
    target_video_length: int | None = Field(None, gt=0, le=MAX_FRAMES)
    lora: list[LoRARequest] | None = Field(
        None, max_length=8, description="LoRA adapters of this request only, in order (needs the config's `lora`); "
        "removed after the request.")

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("`prompt` must contain text, not only whitespace")
        return v
    save_result_path: str | None = Field(
        None, description=".mp4 for video tasks (.png for a one-frame request; an audio+video task's audio is an AAC "
        "stream inside the .mp4), .png for image tasks (checked by the runner's `validate_request`, before loading); a "
        "sidecar .json is written beside it.")
    save_tensor_path: str | None = Field(
        None, description=".safetensors with every output of the pipeline, e.g. 'video' float32 [C, F, H, W] in [-1, 1].")
    _source: str = PrivateAttr("command line")  # where the request came from, for messages (not a request field)

    @property
    def source(self) -> str:
        return self._source

    @field_validator("save_result_path", "save_tensor_path", "image_path", "last_frame_path", mode="before")
    @classmethod
    def _home(cls, v: Any) -> Any:
        return os.path.expanduser(v) if isinstance(v, str) else v  # "~/x" means the home folder, as in a shell

    @field_validator("extra_image_paths", mode="before")
    @classmethod
    def _home_each(cls, v: Any) -> Any:
        return [os.path.expanduser(x) if isinstance(x, str) else x for x in v] if isinstance(v, list) else v

    @field_validator("save_tensor_path")
    @classmethod
    def _tensor_suffix(cls, v: str | None) -> str | None:
        if v is not None and Path(v).suffix.lower() != ".safetensors":
            raise ValueError(f"`save_tensor_path` must end in .safetensors (got {v!r})")
        return v


def as_request(request: Any) -> RequestConfig:
    """`request` as a `RequestConfig` (Python API: a dict with the launch script's request fields is
    validated like a line of a `--requests` file).

    Raises:
        ConfigError: the dict is not a valid request (each bad field named).
        TypeError: neither a `RequestConfig` nor a dict.
    """
    if isinstance(request, RequestConfig):
        return request
    if isinstance(request, dict):
        try:
            return RequestConfig.model_validate(request)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, "request")) from None
    raise TypeError(f"a request must be a RequestConfig or a dict of its fields (got {type(request).__name__})")


def field_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """A pydantic error location as the field is written: ('lora', 0, 'strength') -> 'lora[0].strength'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def format_validation_error(err: ValidationError, source: str, origins: Mapping[str, str] | None = None) -> str:
    """One line per problem: `field: message (got value)`.

    Args:
        origins: dotted field name -> its value and where it came from (`load_runner_config`: the file,
            a command-line flag or the default); a problem whose field, or a field its message names in
            backticks, is listed gets a second line with their origins.
    """
    lines = []
    for e in err.errors():
        field = field_path(e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "tuple_type":  # a list field held as a tuple: JSON and the user know lists
            msg = msg.replace("valid tuple", "valid list")
        if e["type"] == "extra_forbidden":
            msg = _unknown_field_message(err.title, e["loc"])
        value = e.get("input")
        text = repr(value)
        count = len(value) if isinstance(value, str) else len(text)  # a string's own characters, not its quotes
        text = text if len(text) <= 120 else f"{text[:100]}... ({count} characters)"  # e.g. a base64 image
        shown = "" if e["type"] == "missing" or isinstance(value, dict) or "(got " in msg else f" (got {text})"
        lines.append(f"  {field}: {msg}{shown}")
        whole = field_path([p for p in e["loc"] if not isinstance(p, int)])  # the list field of an item
        named = [n for n in dict.fromkeys([field, whole, *re.findall(r"`([A-Za-z_][\w.]*)`", msg)]) if n in (origins or {})]
        if named:
            assert origins is not None
            lines.append("    (" + "; ".join(f"`{n}`={origins[n]}" for n in named) + ")")
    return f"invalid {source}:\n" + "\n".join(lines)


def _fields_at(title: str, loc: tuple[int | str, ...]) -> list[str] | None:
    """The field names of the config class that holds location `loc` of a `title` model (a class of this
    module), or None where the walk meets something that is not a pydantic model."""
    model: Any = globals().get(title)
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        if isinstance(part, int):
            continue  # an element of a list field: its annotation was unwrapped below
        info = model.model_fields.get(part)
        if info is None:
            return None
        candidates = [info.annotation, *typing.get_args(info.annotation)]
        candidates += [arg for c in candidates for arg in typing.get_args(c)]  # list[X] | None
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    return list(model.model_fields)


def _unknown_field_message(title: str, loc: tuple[int | str, ...]) -> str:
    """"unknown field" with the closest allowed name (difflib) or the allowed names of its section."""
    allowed = _fields_at(title, tuple(loc[:-1]))
    if not allowed:
        return "unknown field"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean `{close[0]}`?"
    return "unknown field; allowed here: " + ", ".join(allowed)


def _origins(data: dict[str, Any], set_by: dict[str, str]) -> dict[str, str]:
    """Every leaf field of `RunnerConfig` (`offload.mode`, `model_path`) -> "<value> from <where>" for the
    fields in `set_by` (their value as merged in `data`), "<default> (the default: not set)" for the others."""
    out = {}
    for name, info in RunnerConfig.model_fields.items():
        default = info.get_default(call_default_factory=True)
        nested = type(default) if isinstance(default, BaseModel) else None
        if nested is None and isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            nested = info.annotation
        if nested is None:
            out[name] = (f"{data[name]!r} from {set_by[name]}" if name in set_by
                         else f"{default!r} (the default: not set)")
            continue
        section = data.get(name) if isinstance(data.get(name), dict) else {}
        for field, sub in nested.model_fields.items():
            key = f"{name}.{field}"
            out[key] = (f"{section[field]!r} from {set_by[key]}" if key in set_by and field in section
                        else f"{sub.get_default(call_default_factory=True)!r} (the default: not set)")
    return out



def validate_model_arch(arch_cls: type[BaseModel], model: dict[str, Any] | None, partial: bool, family: str,
                        fields_file: str) -> Any:
    """A config's `model` key validated as the family's architecture class (defaults fill what it omits).

    `partial`: `model` overrides a checkpoint's architecture, so a rule between fields is only
    checked where `model` gives all of them (the merged architecture is checked at load).

    Raises:
        ValueError: naming each bad field as `model.<component>.<field>`, the components allowed
            and `fields_file`, where the fields are described.
    """
    try:
        return arch_cls.model_validate(model or {}, context={"partial": partial})
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc, f"`model` ({family} architecture)").replace("\n  ", "\n  model.")
                         + f"\n  (`model` takes the components {sorted(arch_cls.model_fields)}, with the fields of "
                         f"{fields_file})") from None

def load_runner_config(path: str | Path | None, overrides: dict[str, Any],
                       flags: Mapping[str, str] | None = None) -> RunnerConfig:
    """Read a JSON config, apply CLI overrides (non-None values), validate.

    An override key with a dot sets a key of a nested section, keeping the section's other keys
    (`{"offload.mode": "auto"}`: the launch script's and the server's `--offload`).

    Args:
        flags: override key -> the command-line flag that gave it, for messages (default `--<key>`).

    Raises:
        ConfigError: unreadable file, bad JSON, unknown keys, wrong types, out-of-range values. Where an
            override was applied, each problem also says where the values it names came from: the file,
            a command-line flag, or the default.
    """
    data: dict[str, Any] = {}
    set_by: dict[str, str] = {}  # dotted field name -> where its value came from
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} " + ("is a folder, not a file" if p.is_dir() else "does not exist"))
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid UTF-8 JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a JSON object (got {type(data).__name__})")
        where = f"the config file {str(p)!r}"
        for key, value in data.items():
            set_by[key] = where
            set_by.update({f"{key}.{field}": where for field in value} if isinstance(value, dict) else {})
    applied = False
    for key, value in overrides.items():
        if value is None:
            continue
        applied = True
        where = f"the command line ({(flags or {}).get(key, '--' + key)})"
        section, dot, field = key.partition(".")
        if not dot:
            data[key] = value
            set_by[key] = where
            set_by.update({f"{key}.{f}": where for f in value} if isinstance(value, dict) else {})
        elif isinstance(data.get(section, {}), dict):
            data[section] = {**data.get(section, {}), field: value}
            set_by[key] = where
        # else: the file's section is not an object; validation names it
    try:
        return RunnerConfig.model_validate(data)
    except ValidationError as exc:
        source = (f"config {str(path)}" + (" with command-line overrides" if applied else "") if path
                  else "config from the command-line flags")
        origins = _origins(data, set_by) if applied else None
        raise ConfigError(format_validation_error(exc, source, origins)) from None


def load_requests(path: str | Path) -> list[RequestConfig]:
    """Read and validate every line of a `--requests` .jsonl file before anything is loaded.

    Raises:
        ConfigError: naming the line number and field of every bad line (all at once).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"requests file {str(p)!r} " + ("is a folder, not a file" if p.is_dir() else "does not exist"))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"requests file {str(p)!r} is not UTF-8 text: {exc}") from None
    requests, problems, lines = [], [], 0
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        lines += 1
        try:
            request = RequestConfig.model_validate_json(line)
        except ValidationError as exc:
            problems.append(format_validation_error(exc, f"request on line {n} of {str(p)!r}"))
            continue
        request._source = f"line {n} of {str(p)!r}"
        requests.append(request)
    if problems:  # every bad line at once, not one per run
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} of {lines} request lines are invalid:\n" + "\n".join(problems))
    if not requests:
        raise ConfigError(f"requests file {str(p)!r} holds no request")
    return requests
