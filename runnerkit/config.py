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
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from runnerkit import json_strict
from runnerkit.config_sections import (
    PREAD_KEYS,
    CompileConfig,
    LoRAConfig,
    LoRARequest,
    MemoryConfig,
    OffloadConfig,
    ParallelConfig,
    PromptEnhancerConfig,
    SyntheticCheckpointConfig,
    lora_flag_fields,
    parse_lora_flag,
)
from runnerkit.config_sections import StrictModel as _Strict

__all__ = ["FAMILY_DEFAULTED", "MAX_EXTRA_IMAGES", "MAX_FRAMES", "MAX_PROMPT_CHARS", "MAX_SIDE", "MAX_TEXT_BUCKET",
           "PREAD_KEYS", "REQUEST_DEFAULT_FIELDS", "REVALIDATED", "CompileConfig", "ConfigError", "ConfigLockedError",
           "FrozenDict", "FrozenList", "LoRAConfig", "LoRARequest", "MemoryConfig", "OffloadConfig", "ParallelConfig",
           "RequestConfig", "RunnerConfig", "SyntheticCheckpointConfig", "as_request", "deep_freeze", "field_path",
           "fill_family_defaults", "format_validation_error", "invalid_lines", "load_runner_config",
           "lora_flag_fields", "parse_lora_flag", "read_requests", "validate_model_arch"]

MAX_SIDE = 8192  # pixels: bounds a request far above any released model resolution (720p video, 1328 px images)
MAX_FRAMES = 1025  # frames

#: Run settings whose defaults belong to the model family (`BaseRunner.DEFAULTS`); None here means
#: "the family's default", filled in by `BaseRunner.resolve_config` before anything else reads them.
FAMILY_DEFAULTED = ("infer_steps", "target_height", "target_width", "target_video_length", "fps",
                    "sample_shift", "sample_guide_scale", "scheduler", "scheduler_spacing")
#: `model_validate(..., context={REVALIDATED: True})`: a config validated before, its family's defaults filled in
#: (`fill_family_defaults`); the checks of what a user may set together are not repeated on it.
REVALIDATED = "revalidated"


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
    prompt_enhancer: PromptEnhancerConfig | None = Field(
        None, description="Load the runner's prompt enhancer, for requests with `enhance_prompt` (None: not loaded; "
        "a runner without one refuses the section).")
    video_decoder: Literal["diffusion", "conv"] | None = Field(
        None, description="What decodes the video latents in a family with two decoders: 'diffusion' (a diffusion "
        "decoder) or 'conv' (the convolutional VAE); None: the family's default; a family with one refuses the key.")

    @field_validator("sample_sigmas", mode="before")
    @classmethod
    def _table_from_json(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v  # JSON has no tuples

    @field_validator("sample_sigmas")
    @classmethod
    def _table(cls, v: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if v is not None and (not all(0 < x <= 1 for x in v) or any(b >= a for a, b in zip(v, v[1:]))):
            raise ValueError(f"`sample_sigmas` must be strictly decreasing values in (0, 1] (got {list(v)})")
        return v

    @model_validator(mode="after")
    def _fixed_table(self, info: ValidationInfo) -> RunnerConfig:
        if self.sample_sigmas is None:
            return self
        given = [f"`{k}`" for k in ("sample_shift", "scheduler_spacing") if getattr(self, k) is not None]
        if given and not (info.context or {}).get(REVALIDATED):  # a family's defaults fill them in a resolved config
            raise ValueError(f"`sample_sigmas` is used as given, so {' and '.join(given)} would do nothing: "
                             f"remove {'them' if len(given) > 1 else 'it'} (or remove `sample_sigmas`)")
        if self.scheduler == "unipc" and self.sample_sigmas[0] >= 1:
            raise ValueError(f"`sample_sigmas` starts at {self.sample_sigmas[0]}, but `scheduler` 'unipc' needs every "
                             "sigma below 1 (its log-SNR is -inf at 1): start the table below 1, or set `scheduler` "
                             "'euler'")
        return self

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
    def _combinations(self) -> RunnerConfig:
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
    enhance_prompt: bool = Field(False, description="Rewrite `prompt` with the runner's prompt enhancer before "
                                 "encoding (needs the config's `prompt_enhancer`); the sidecar keeps both prompts.")

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
            data = json_strict.loads(p.read_text(encoding="utf-8"))
        except json_strict.DuplicateKeyError as exc:
            raise ConfigError(f"config file {str(p)!r}: {exc}") from None
        except (ValueError, RecursionError) as exc:  # not JSON or UTF-8, a huge integer, nesting past ~1000 levels
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
        source = (f"config {path!s}" + (" with command-line overrides" if applied else "") if path
                  else "config from the command-line flags")
        origins = _origins(data, set_by) if applied else None
        raise ConfigError(format_validation_error(exc, source, origins)) from None


def read_requests(path: str | Path) -> tuple[list[RequestConfig], list[tuple[int, str]], int]:
    """Every line of a `--requests` .jsonl file: (the valid requests, (line number, problem) of each invalid
    line, the count of non-empty lines).

    Raises:
        ConfigError: the file is missing, a folder, or not UTF-8 text.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"requests file {str(p)!r} " + ("is a folder, not a file" if p.is_dir() else "does not exist"))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"requests file {str(p)!r} is not UTF-8 text: {exc}") from None
    requests: list[RequestConfig] = []
    problems: list[tuple[int, str]] = []
    lines = 0
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        lines += 1
        try:
            json_strict.loads(line)
        except json_strict.DuplicateKeyError as exc:
            problems.append((n, f"request on line {n} of {str(p)!r}: {exc}"))
            continue
        except (ValueError, RecursionError):  # not JSON, or too deep: pydantic's message below names the problem
            pass
        try:
            request = RequestConfig.model_validate_json(line)
        except ValidationError as exc:
            problems.append((n, format_validation_error(exc, f"request on line {n} of {str(p)!r}")))
            continue
        request._source = f"line {n} of {str(p)!r}"
        requests.append(request)
    return requests, problems, lines


def fill_family_defaults(config: RunnerConfig, defaults: Mapping[str, Any]) -> RunnerConfig:
    """`config` with `defaults` (a family's, for the settings it leaves unset) filled in and validated again.
    Raises ValueError for a combination only the defaults make (e.g. `sample_sigmas` that its scheduler refuses)."""
    if not defaults:
        return config
    try:
        return RunnerConfig.model_validate({**config.model_dump(exclude_unset=True), **defaults},
                                           context={REVALIDATED: True})
    except ValidationError as exc:
        origins = {k: f"{v!r}, {config.model_cls}'s default" for k, v in defaults.items()}
        raise ValueError(format_validation_error(exc, "config with the family's defaults", origins)) from None


def invalid_lines(problems: list[tuple[int, str]], lines: int) -> str:
    """One message for the invalid lines of a requests file, in line order."""
    texts = [text for _, text in sorted(problems, key=lambda item: item[0])]
    return texts[0] if len(texts) == 1 else f"{len(texts)} of {lines} request lines are invalid:\n" + "\n".join(texts)
