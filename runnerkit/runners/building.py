"""Building a pipeline's modules where the offload config puts them (ARCHITECTURE §4).

`DefaultRunner` holds one `ModuleBuilder` (`runner.builder`, made in `load_modules` once the attention
backend, the LoRA manager and the other installers are known) and asks it to `place` the pipeline:

    none     every module built on the device
    model    every module built in host memory (visiting the device for its stage)
    block /  the modules of `offload.stream_modules` (default: the streamable transformers) stream their
    phase    blocks (built per stage under `lazy_load`); the others are model-offloaded
    unload_modules: every module built by its stage and dropped after

Every build path ends in `finish`: the run's installers in order (runners/installers.py). Streamers of
streamed modules go into the runner's `streamers` dict, by module name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from loguru import logger
from torch import nn

from runnerkit.config import RunnerConfig
from runnerkit.offload.setup import pin_memory_enabled
from runnerkit.runners.installers import Installer
from runnerkit.planning.offload_checks import check_resident_modules
from runnerkit.runners.pipeline import ModuleSpec, Pipeline
from runnerkit.runners.placement import Loader, Placement

__all__ = ["ModuleBuilder", "check_family_settings", "check_stream_modules", "stream_choice"]


class ModuleBuilder:
    """Builds, streams and places a pipeline's modules; applies the installers to each (module docstring).

    Args:
        config: the run config (offload, memory thresholds, compute dtype, CFG).
        device: the compute device.
        runner: the runner class's name, for messages.
        cfg_one_pass: the family runs its CFG branches through each streamed block in one pass.
        installers: applied in order to every module built (`installers.installers_for`).
        streamers: the runner's streamers by module name, filled as modules stream.
    """

    def __init__(self, config: RunnerConfig, device: torch.device, runner: str, cfg_one_pass: bool,
                 installers: Sequence[Installer], streamers: dict[str, Any]) -> None:
        self.config = config
        self.device = device
        self.runner = runner
        self.cfg_one_pass = cfg_one_pass
        self.installers = tuple(installers)
        self.streamers = streamers

    def place(self, pipeline: Pipeline) -> tuple[Placement, dict[str, nn.Module]]:
        """Build every module where the offload config puts it (ARCHITECTURE §4): its placement, and the
        resident and model-offloaded modules by name (per-stage ones are built by their stage).

        none: all resident on the device; model: all in host memory, each visits the device for
        its stage; block/phase: the modules of `offload.stream_modules` (default: the streamable
        transformers) stream their blocks or layers (built per stage under lazy_load), the others
        are model-offloaded; in model/block/phase, `offload.resident_modules` are built on the
        device instead; unload_modules: every module built per stage.

        Raises:
            NotImplementedError: block/phase offload of a pipeline without a streamable module.
            ValueError: `offload.stream_modules` names a module that is not in the pipeline or cannot stream;
                `offload.resident_modules` names one that is not in the pipeline or streams.
        """
        cfg, off = self.config, self.config.offload
        thresholds = dict(empty_cache_min_free_gib=cfg.memory.empty_cache_min_free_gib,
                          empty_cache_min_reclaimable_gib=cfg.memory.empty_cache_min_reclaimable_gib)
        pin = pin_memory_enabled(off)
        cpu = torch.device("cpu")
        resident: dict[str, nn.Module] = {}
        offloaded: dict[str, nn.Module] = {}
        loaders: dict[str, Loader] = {}
        if cfg.unload_modules:
            loaders = {m.name: self.per_stage(m, streamed=False) for m in pipeline.modules}
        elif off.mode == "none":
            resident = {m.name: self.build(m, self.device) for m in pipeline.modules}
        elif off.mode == "model":
            kept = self.resident_choice(pipeline, ())
            resident = {m.name: self.build(m, self.device) for m in pipeline.modules if m.name in kept}
            offloaded = {m.name: self.build(m, cpu) for m in pipeline.modules if m.name not in kept}
        else:
            if cfg.compute_dtype == "fp8":  # the config refuses block/phase; the memory planner may choose it
                raise NotImplementedError(f"`compute_dtype`='fp8' with `offload.mode`={off.mode!r}: streamed blocks "
                                          "cannot hold fp8 compute weights; use 'none' or 'model'")
            streamable = stream_choice(pipeline, off.stream_modules, self.runner)
            if not streamable:
                raise NotImplementedError(f"`offload.mode`={off.mode!r}: {self.runner} has no module that "
                                          "streams its blocks; use 'none' or 'model'")
            kept = self.resident_choice(pipeline, [x.name for x in streamable])
            resident = {m.name: self.build(m, self.device) for m in pipeline.modules if m.name in kept}
            offloaded = {m.name: self.build(m, cpu) for m in pipeline.modules
                         if m.name not in {x.name for x in streamable} and m.name not in kept}
            self.log_cfg_passes(streamable)
            for m in streamable:
                if off.lazy_load:
                    self.stream(m)  # once now, so a checkpoint that cannot stream fails at load
                    self.drop_streamer(m.name)
                    loaders[m.name] = self.per_stage(m, streamed=True)
                else:
                    resident[m.name] = self.stream(m)
        return (Placement(self.device, resident=resident, offloaded=offloaded, loaders=loaders, pin_memory=pin,
                          **thresholds), {**resident, **offloaded})

    def resident_choice(self, pipeline: Pipeline, streamed: Sequence[str]) -> set[str]:
        """The modules of `offload.resident_modules`, checked against the pipeline and the streamed ones.

        Raises:
            ValueError: a name that is not a module of the pipeline, or one that streams (`streamed`).
        """
        return check_resident_modules(self.config.offload, [m.name for m in pipeline.modules], streamed, self.runner)

    def log_cfg_passes(self, streamed: Sequence[ModuleSpec]) -> None:
        """One INFO line: how the CFG branches go through the streamed transformer(s)."""
        names = [m.name for m in streamed if m.role == "transformer"]
        if not (self.cfg_one_pass and self.config.enable_cfg and names):
            return
        if self.config.offload.mode == "block":
            logger.info("CFG: both branches run through each streamed block of {} while it is on the device "
                        "(one block pass per step)", names)
        else:
            logger.info("CFG with `offload.mode`='phase': one forward per branch, so each phase of {} is "
                        "streamed twice per step (mode 'block' streams each block once for both branches)", names)

    def build(self, spec: ModuleSpec, device: torch.device) -> nn.Module:
        module = spec.build(device)
        self.finish(spec, module)
        return module

    def stream(self, spec: ModuleSpec) -> nn.Module:
        assert spec.stream is not None, f"module {spec.name} does not stream"
        module, streamer = spec.stream()
        self.finish(spec, module)
        self.streamers[spec.name] = streamer
        return module

    def one_pass_streamer(self, model: nn.Module) -> Any:
        """The block streamer of `model` when the CFG branches share one pass through its blocks:
        `offload.mode` "block" and `model` streamed. The family's `run_step` then
        calls the transformer's `forward_branches` inside `streamer.entries(branches)`, so each block
        is moved once per step instead of once per branch. None otherwise: resident or
        model-offloaded (nothing is moved per block, and one forward per branch keeps the smaller
        activation peak), or mode "phase" (branch-major inside a block would enter its phases
        0, 1, 2, 0, 1, 2: one forward per branch, each phase moved twice per step)."""
        if self.config.offload.mode != "block":
            return None
        return next((s for s in self.streamers.values() if s.streams(model)), None)

    def finish(self, spec: ModuleSpec, module: nn.Module) -> None:
        """What every built module gets, on every build path: the run's installers, in order
        (runners/installers.py: fp8 compute, LoRA slots, attention, sequence parallel, compile)."""
        for installer in self.installers:
            installer.install(spec, module)

    def drop_streamer(self, name: str) -> None:
        streamer = self.streamers.pop(name, None)
        if streamer is not None:
            streamer.close()

    def per_stage(self, spec: ModuleSpec, streamed: bool) -> Loader:
        def load() -> tuple[nn.Module, Callable[[], None]]:
            module = self.stream(spec) if streamed else self.build(spec, self.device)
            return module, lambda: self.drop_streamer(spec.name)

        return load


def stream_choice(pipeline: Pipeline, names: Sequence[str] | None, runner: str) -> list[ModuleSpec]:
    """The modules that stream in mode block/phase: those of `names` (config `offload.stream_modules`),
    or, for None, every streamable module of role "transformer".

    Raises:
        ValueError: a name that is not a module of the pipeline, or a module that cannot stream
            (the message lists the ones that can).
    """
    can = [m for m in pipeline.modules if m.stream is not None]
    if names is None:
        return [m for m in can if m.role == "transformer"]
    bad = [n for n in names if n not in {m.name for m in can}]
    if bad:
        raise ValueError(f"`offload.stream_modules`={list(names)}: {runner} cannot stream {bad}; modules that "
                         f"can stream: {[m.name for m in can]}")
    return [m for m in can if m.name in names]


def check_stream_modules(config: RunnerConfig, allowed: Sequence[str], runner: str) -> None:
    """Refuse an `offload.stream_modules` entry that is not one of the runner's `STREAM_MODULES` `allowed`
    (before planning and loading: under mode auto it would otherwise exclude every streaming candidate).

    Raises:
        ValueError: naming the field, the value, the names that cannot stream and the allowed ones.
    """
    names = config.offload.stream_modules
    if names is None:
        return
    bad = [n for n in names if n not in allowed]
    if bad:
        can = list(allowed) or "none (no module of this runner streams)"
        raise ValueError(f"`offload.stream_modules`={list(names)}: {bad} cannot stream in model_cls "
                         f"{config.model_cls!r} (task {config.task!r}, {runner}); modules that can: {can}")


def check_family_settings(config: RunnerConfig, module_paths: Sequence[str], pads_text: bool,
                          enhancer: bool = False, video_decoders: Sequence[str] = ()) -> None:
    """Refuse settings the family does not read, when the runner is built: `text_encoder_path` /
    `upsampler_path` not among its `MODULE_PATHS`, `text_buckets` other than 'auto' when it pads no
    text (`pads_text`: it declares `TEXT_BUCKETS`), `prompt_enhancer` without one (`enhancer`: it declares
    `PROMPT_ENHANCER`), and a `video_decoder` not among its `VIDEO_DECODERS`.

    Raises:
        ValueError: naming the field, its value and why it is refused.
    """
    for key in ("text_encoder_path", "upsampler_path"):
        value = getattr(config, key)
        if value is not None and key not in module_paths:
            raise ValueError(f"`{key}` ({value!r}) is not read by {config.model_cls!r}: its checkpoint folder "
                             "holds that module; remove it")
    if not pads_text and config.text_buckets != "auto":
        raise ValueError(f"`text_buckets` ({config.text_buckets!r}) is not read by {config.model_cls!r} "
                         f"task {config.task!r}: "
                         "its prompts are not padded to text buckets (docs/prompt_lengths.md); remove it")
    if not enhancer and config.prompt_enhancer is not None:
        raise ValueError(f"`prompt_enhancer` is not read by {config.model_cls!r} task {config.task!r}: it has no "
                         "prompt enhancer; remove the section")
    if config.video_decoder is not None and config.video_decoder not in video_decoders:
        can = f"it takes {list(video_decoders)}" if video_decoders else "it has one video decoder; remove the key"
        raise ValueError(f"`video_decoder` ({config.video_decoder!r}) is not read by {config.model_cls!r}: {can}")
