"""A family's pipeline, described as data: modules, stages, denoise loops and outputs.

A family does not write its own request path. It returns a `Pipeline` from `describe_pipeline()`
and the base machinery (runners/default.py) serves it: requests, warmup, profiling, module
placement and offload. Example (a text-to-video family):

    Pipeline(
        modules=(ModuleSpec("text_encoder", "text_encoder", build=...),
                 ModuleSpec("transformer", "transformer", build=..., stream=...),
                 ModuleSpec("vae", "decoder", build=...)),
        encoders=(EncoderStage("text_encoder", module="text_encoder", run=self.run_text_encoder),),
        denoise=(DenoiseStage("transformer", transformers=("transformer",), steps=50,
                              scheduler="unipc", shift=5.0, spacing="diffusers"),),
        decoders=(DecoderStage("vae_decoder", module="vae", output="video", run=self.run_vae_decoder),),
        outputs=(OutputSpec("video", "video"),),
    )

A two-stage family adds a second `DenoiseStage` whose `transition` names an upsampler module
(run on stage 1's latents before stage 2 starts at `strength`); a MoE family lists two
transformers in one stage and picks the expert per step in `DefaultRunner.select_transformer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

Role = Literal["text_encoder", "image_encoder", "vae_encoder", "transformer", "upsampler", "decoder"]
OutputKind = Literal["video", "image", "audio"]
Shape = tuple[int, int, int]  # (height, width, frames)


@dataclass(frozen=True)
class InputInfo:
    """One request with every default resolved (what the request path works from).

    `warmup` is True for the dummy requests of warmup: encoders then replace user content
    (prompt text, images) with placeholders of the right shape.

    `frames_omitted` is True when neither the request nor the config gives a frame count (a family
    that predicts it from the encoded inputs leaves its default unset): `frames` is then the largest
    count the family's prediction allows (its `shape_of`), which admission and the memory checks use,
    until the family's encoder stage replaces `RequestState.info` with the predicted count.
    """

    prompt: str
    negative_prompt: str
    seed: int
    height: int
    width: int
    frames: int
    save_result_path: str | None = None
    save_tensor_path: str | None = None
    image_path: str | None = None
    last_frame_path: str | None = None
    extra_image_paths: tuple[str, ...] = ()
    lora: tuple[tuple[str, float], ...] = ()
    """The request's LoRA adapters: (file path, strength), in order (names resolved); empty: none."""
    enhance_prompt: bool = False
    """Rewrite `prompt` with the runner's prompt enhancer before encoding (the family's text stage does it and
    records the result in `RequestState.enhanced_prompt`)."""
    warmup: bool = False
    frames_omitted: bool = False

    @property
    def shape(self) -> Shape:
        return (self.height, self.width, self.frames)

    @property
    def reference_paths(self) -> tuple[str, ...]:
        """`image_path` then `extra_image_paths`: every reference image of the request, in order
        (placeholders, never opened, in warmup's dummy requests)."""
        return ((self.image_path,) if self.image_path else ()) + self.extra_image_paths


@dataclass(frozen=True)
class ModuleSpec:
    """One network of the pipeline and how to build it.

    Attributes:
        name: placement name, e.g. "text_encoder", "transformer", "transformer_2", "upsampler", "vae".
        role: the stage it belongs to (decides nothing by itself; documents and checks the pipeline).
        build: `device -> module` with its weights loaded (on `device`, or the CPU for model offload).
        stream: for a transformer that can stream its blocks (offload mode block/phase):
            `() -> (module, streamer)`; the family calls `runnerkit.offload.setup.stream_module`
            with its own block list and phases. None: the module is never streamed.
        blocks: attribute of the built module holding its repeated blocks (an `nn.ModuleList`),
            the unit of regional compilation (`compile.enabled`, runnerkit/compile.py). None:
            the module is not compiled.
        fp8_skip: fp8 compute (config `compute_dtype: fp8`, runnerkit/fp8_compute.py): the
            block-relative module names whose linear layers stay in the model dtype (modulation /
            AdaLN projections), () when every linear of the blocks is eligible. None: the family
            has not declared its blocks for fp8 compute, which is then refused.
    """

    name: str
    role: Role
    build: Callable[[torch.device], nn.Module]
    stream: Callable[[], tuple[nn.Module, Any]] | None = None
    blocks: str | None = None
    fp8_skip: tuple[str, ...] | None = None


@dataclass(frozen=True)
class EncoderStage:
    """An encoder run before denoising; profiled under `name`.

    Attributes:
        name: profiling stage, e.g. "text_encoder", "image_encoder", "vae_encoder".
        module: the module placed on the device while it runs (None: no module).
        run: `(req) -> inputs`: `req` is the request's `RequestState` (runners/request_state.py), with
            the inputs built so far in `req.inputs` (None for the first stage) and this stage's module in
            `req.modules`; returns the inputs extended (the family's typed inputs object).
        per_shape: True if the result depends on the request shape (image encoders, VAE encode
            of conditioning frames): warmup then runs it per shape; False (text): once.
        runs: `(req) -> bool`: whether the stage runs for this request (False: skipped, its module
            not placed, and the profile records null for it, not 0 seconds); None: it always runs.
    """

    name: str
    module: str | None
    run: Callable[[Any], Any]
    per_shape: bool = False
    runs: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class DenoiseStage:
    """One denoising loop with its own scheduler and steps.

    Attributes:
        name: profiling stage and log label, e.g. "transformer", "stage1", "stage2".
        transformers: module names the loop may call; more than one = MoE experts, chosen per
            step by `DefaultRunner.select_transformer`.
        steps: scheduled denoising steps (>= 1).
        scheduler: scheduler name (`runnerkit.schedulers.SCHEDULERS`).
        shift: SD3 sigma shift of the scheduler.
        spacing: where the scheduler's sigmas and timesteps come from, a name in
            `runnerkit.schedulers.SPACINGS` (runnerkit/schedulers/spacing.py).
        strength: fraction of the schedule that runs, from the previous stage's latents re-noised
            at the first remaining sigma (1.0: from pure noise; only 1.0 for the first stage).
        transition: module run on the previous stage's latents before this stage (e.g. a latent
            upsampler), through `DefaultRunner.run_transition`; profiled under its module name.
        latent_shape: `info -> latent shape` of this stage (e.g. [B, C, F', H', W']).
        sigmas: a fixed sigma table (a step-distilled model's trained schedule), used as given
            instead of `shift` and `spacing`; `steps` must equal its length. None: the spacing's.
        noise_shapes: `info -> shapes` when the latents are several parts drawn separately
            (e.g. video and audio tokens): one noise draw per shape, in order, flattened after the
            batch dim and concatenated into `latent_shape` (`Scheduler.prepare`). None: one draw.
        index: the stage's position in `Pipeline.denoise` (0 for the first), set by `Pipeline`;
            -1 for a stage not (yet) part of a pipeline. Hooks tell stages apart by it.
    """

    name: str
    transformers: tuple[str, ...]
    steps: int
    scheduler: str
    shift: float
    spacing: str
    latent_shape: Callable[[InputInfo], tuple[int, ...]]
    strength: float = 1.0
    transition: str | None = None
    sigmas: tuple[float, ...] | None = None
    noise_shapes: Callable[[InputInfo], tuple[tuple[int, ...], ...]] | None = None
    index: int = -1


@dataclass(frozen=True)
class DecoderStage:
    """A decoder run on the final latents; produces one output.

    Attributes:
        name: profiling stage, e.g. "vae_decoder", "audio_decoder".
        module: the module placed on the device while it runs.
        output: key of the `OutputSpec` it produces.
        run: `(req, latents) -> tensor [B, ...]` or an iterator of chunks along dim 2 (consumed fully
            while the module is on the device); `req` is the request's `RequestState`, with this
            stage's module in `req.modules`.
    """

    name: str
    module: str | None
    output: str
    run: Callable[[Any, torch.Tensor], torch.Tensor | Iterable[torch.Tensor]]


def collect_output(out: torch.Tensor | Iterable[torch.Tensor], on_chunk: Callable[[], None]) -> torch.Tensor:
    """What a `DecoderStage.run` returned, as one tensor: a tensor as it is; an iterator consumed fully,
    `on_chunk()` after each chunk (an observer may cancel a long decode there), closed however it ends
    (a generator left early, cancelled or failed, releases its caches now), its chunks concatenated
    along dim 2 (`[B, C, F, ...]`: frames)."""
    if isinstance(out, torch.Tensor):
        return out
    chunks = []
    try:
        for chunk in out:
            chunks.append(chunk)
            on_chunk()
    finally:
        close = getattr(out, "close", None)
        if close is not None:
            close()
    return torch.cat(chunks, dim=2)


@dataclass(frozen=True)
class OutputSpec:
    """A result of the pipeline.

    Attributes:
        key: tensor key in `save_tensor_path` ("video" [C, F, H, W], "image" [C, H, W], "audio"
            [channels, samples]), values in [-1, 1].
        kind: "video" (.mp4, or .png for one frame), "image" (.png), "audio" (.wav; beside a primary
            video, the AAC audio stream of its .mp4: runnerkit/media.py `save_outputs`).
        sample_rate: audio samples per second (audio only).
    """

    key: str
    kind: OutputKind
    sample_rate: int | None = None


@dataclass(frozen=True)
class Pipeline:
    """What a family runs, in order: encoders -> denoise stages -> decoders -> outputs.

    The first output is the primary one: `save_result_path` writes it. Every output goes to
    `save_tensor_path` under its key.
    """

    modules: tuple[ModuleSpec, ...]
    encoders: tuple[EncoderStage, ...]
    denoise: tuple[DenoiseStage, ...]
    decoders: tuple[DecoderStage, ...]
    outputs: tuple[OutputSpec, ...]
    extra_stages: tuple[str, ...] = field(default=())
    """Further profiling stages the family times itself (with `runner.profiler.stage`)."""

    def __post_init__(self) -> None:
        # each denoise stage knows its position (hooks tell stages apart by it, never by name)
        object.__setattr__(self, "denoise", tuple(replace(s, index=i) for i, s in enumerate(self.denoise)))
        names = [m.name for m in self.modules]
        problems = []
        if len(set(names)) != len(names):
            problems.append(f"module names repeat: {names}")
        used = [e.module for e in self.encoders] + [d.module for d in self.decoders]
        used += [t for s in self.denoise for t in s.transformers] + [s.transition for s in self.denoise]
        problems += [f"stage uses unknown module {u!r}" for u in used if u is not None and u not in names]
        if not self.denoise:
            problems.append("at least one denoise stage is needed")
        for i, s in enumerate(self.denoise):
            if not s.transformers:
                problems.append(f"denoise stage {s.name!r} names no transformer")
            if s.steps < 1:
                problems.append(f"denoise stage {s.name!r} has steps={s.steps} (>= 1 needed)")
            if not 0 < s.strength <= 1 or (i == 0 and s.strength != 1.0):
                problems.append(f"denoise stage {s.name!r} has strength={s.strength} (first stage 1.0, others in (0, 1])")
            if s.sigmas is not None and len(s.sigmas) != s.steps:
                problems.append(f"denoise stage {s.name!r} has steps={s.steps} but a table of {len(s.sigmas)} sigmas")
            if i == 0 and s.transition is not None:
                problems.append(f"the first denoise stage {s.name!r} cannot have a transition")
        keys = [o.key for o in self.outputs]
        if not self.outputs or len(set(keys)) != len(keys):
            problems.append(f"outputs must be one or more distinct keys (got {keys})")
        problems += [f"decoder {d.name!r} produces unknown output {d.output!r}" for d in self.decoders if d.output not in keys]
        missing = sorted(set(keys) - {d.output for d in self.decoders})
        if missing:
            problems.append(f"no decoder produces outputs {missing}")
        stages = self.profile_stages()
        if len(set(stages)) != len(stages):
            problems.append(f"profiling stage names repeat: {stages}")
        if problems:
            raise ValueError("invalid pipeline description: " + "; ".join(problems))

    @functools.cached_property
    def step_offsets(self) -> tuple[dict[str, int], int]:
        """Per profiling stage, the denoising steps of the stages before it (a transition counts as its
        stage, encoders 0); and a request's total steps (what progress reports count)."""
        denoise = self.denoise
        before = {s.name: sum(d.steps for d in denoise[:k]) for k, s in enumerate(denoise)}
        before.update({s.transition: before[s.name] for s in denoise if s.transition is not None})
        before.update({e.name: 0 for e in self.encoders})
        return before, sum(s.steps for s in denoise)

    def encoders_to_run(self, req: Any, per_shape: bool | None, profiler: Any) -> Iterator[EncoderStage]:
        """The encoder stages of `per_shape` (None: all), in order, but those whose `runs` says no for the
        request state `req`: each of those is recorded as not run (`profiler.skip_stage`: null in the profile)."""
        for enc in self.encoders:
            if per_shape is not None and enc.per_shape != per_shape:
                continue
            if enc.runs is not None and not enc.runs(req):
                profiler.skip_stage(enc.name)
                continue
            yield enc

    def profile_stages(self) -> tuple[str, ...]:
        """Profiling stages in request order (the keys of a request profile's `stages`)."""
        stages = [e.name for e in self.encoders]
        for s in self.denoise:
            if s.transition is not None:
                stages.append(s.transition)
            stages.append(s.name)
        stages += [d.name for d in self.decoders]
        return (*stages, *self.extra_stages, "save")

    def module(self, name: str) -> ModuleSpec:
        """The module spec `name`. Raises KeyError listing the known names."""
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module {name!r} in this pipeline; known: {[m.name for m in self.modules]}")
