"""DefaultRunner: the standard request path, the warmup gates and request-state cleanup.

Request path (ARCHITECTURE §2), each step a method a family may override:

    run_encoders (run_text_encoder [+ image encoders]) -> scheduler.prepare
    -> for each step: scheduler.step_pre -> run_step (model.infer per CFG branch) -> scheduler.step_post
    -> run_vae_decoder -> save_outputs -> end_run (always)

Warmup (ARCHITECTURE §3) is opt-in per class: a runner class declares `WARMUP_TASKS`,
`WARMUP_SHAPES` and `WARMUP_OFFLOAD_MODES` in its own class body; they are read from the class
`__dict__`, so a subclass does not inherit the opt-in and must declare its own.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from loguru import logger

from runnerkit import memory
from runnerkit.config import RequestConfig
from runnerkit.profiling import RequestProfile, StepTimer
from runnerkit.runners.base import BaseRunner, lifecycle_phase
from runnerkit.runners.placement import Placement
from runnerkit.schedulers import SCHEDULERS
from runnerkit.schedulers.base import Scheduler

Shape = tuple[int, int, int]  # (height, width, frames)


@dataclass(frozen=True)
class InputInfo:
    """One request with every default resolved (what `run_pipeline` works from)."""

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

    @property
    def shape(self) -> Shape:
        return (self.height, self.width, self.frames)


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, recompilations) so far in this process, from torch._dynamo's counters."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - very old torch
        return 0, 0
    return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["recompiles"].values()))


class DefaultRunner(BaseRunner):
    """Standard text/image-to-video request path with warmup gates. Families subclass it."""

    #: Spatial and temporal factors a request shape must respect (VAE stride x patch size).
    SPATIAL_FACTOR: ClassVar[int] = 16
    TEMPORAL_FACTOR: ClassVar[int] = 4
    #: Family default negative prompt (used when neither config nor request gives one).
    DEFAULT_NEGATIVE_PROMPT: ClassVar[str] = ""
    #: Seed of warmup's own noise; the generator is dropped after warmup, so requests never see it.
    WARMUP_SEED: ClassVar[int] = 0

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.scheduler: Scheduler | None = None
        self.placement: Placement | None = None
        self.stage_modules: dict[str, Any] = {}
        self._warmup_ran = False

    # ---- request validation ---------------------------------------------------------------
    @classmethod
    def validate_shape(cls, height: int, width: int, frames: int) -> None:
        """Raise ValueError naming the field if the shape breaks the patch/VAE factors."""
        s, t = cls.SPATIAL_FACTOR, cls.TEMPORAL_FACTOR
        if height % s:
            raise ValueError(f"`target_height` must be a multiple of {s} (got {height})")
        if width % s:
            raise ValueError(f"`target_width` must be a multiple of {s} (got {width})")
        if (frames - 1) % t:
            raise ValueError(f"`target_video_length` must be {t}n+1, e.g. 5, 9, 81 (got {frames})")

    #: Image inputs a task takes (request fields); text-only tasks take none.
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def validate_request(cls, request: RequestConfig, config: Any) -> None:
        """Check a request against the runner before anything loads.

        Raises:
            ValueError: naming the field: shape factors, image inputs the task does not take or
                lacks, a .png result for a multi-frame video.
        """
        h = request.target_height or config.target_height
        w = request.target_width or config.target_width
        f = request.target_video_length or config.target_video_length
        cls.validate_shape(h, w, f)
        wanted = cls.IMAGE_INPUTS.get(config.task, ())
        for field in ("image_path", "last_frame_path"):
            value = getattr(request, field)
            if value is not None and field not in wanted:
                raise ValueError(f"`{field}` is not used by task {config.task!r} (got {value!r}); "
                                 f"image inputs of this task: {list(wanted) or 'none'}")
            if field in wanted and (value is None or not Path(value).is_file()):
                raise ValueError(f"`{field}` must name an existing image file for task {config.task!r} (got {value!r})")
        if request.save_result_path and Path(request.save_result_path).suffix.lower() == ".png" and f > 1:
            raise ValueError(f"`save_result_path` {request.save_result_path!r}: a .png holds one image but this "
                             f"request makes a {f}-frame video; use .mp4")

    def resolve_request(self, request: RequestConfig) -> InputInfo:
        """Fill request defaults from the runner config and validate the shape."""
        cfg = self.config
        info = InputInfo(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt if request.negative_prompt is not None
            else (cfg.negative_prompt if cfg.negative_prompt is not None else self.DEFAULT_NEGATIVE_PROMPT),
            seed=request.seed if request.seed is not None else cfg.seed,
            height=request.target_height or cfg.target_height,
            width=request.target_width or cfg.target_width,
            frames=request.target_video_length or cfg.target_video_length,
            save_result_path=request.save_result_path,
            save_tensor_path=request.save_tensor_path,
            image_path=request.image_path,
            last_frame_path=request.last_frame_path,
        )
        self.validate_request(request, cfg)
        return info

    # ---- family hooks -------------------------------------------------------------------
    def build_scheduler(self) -> Scheduler:
        """The configured flow-matching scheduler (fresh state)."""
        return SCHEDULERS[self.config.scheduler](shift=self.config.sample_shift)

    @abstractmethod
    def flavour(self) -> str | None:
        """Model flavour recognised from the checkpoint's architecture (e.g. 'debug', '1.3B'), or None."""

    @abstractmethod
    def latent_shape(self, info: InputInfo) -> tuple[int, ...]:
        """Latent tensor shape for a request, e.g. [B, C, F', H', W']."""

    @abstractmethod
    def run_text_encoder(self, prompt: str, negative_prompt: str | None) -> Any:
        """Encode the prompt (and the CFG negative prompt); returns the family's typed inputs."""

    def run_image_encoder(self, info: InputInfo, inputs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} task {self.config.task!r} has no image encoder stage")

    def run_vae_encoder(self, info: InputInfo, inputs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} task {self.config.task!r} has no VAE encoder stage")

    def needs_image(self) -> bool:
        """True for image-conditioned tasks (run_image_encoder/run_vae_encoder run per request)."""
        return False

    @abstractmethod
    def run_step(self, latents: torch.Tensor, timestep: torch.Tensor, step_index: int) -> torch.Tensor:
        """One denoising step's model output (all CFG branches combined) for the scheduler."""

    @abstractmethod
    def run_vae_decoder(self, latents: torch.Tensor) -> torch.Tensor | Iterable[torch.Tensor]:
        """Decode latents to pixels [B, 3, F, H, W] in [-1, 1] (a tensor, or an iterator of chunks along F)."""

    @abstractmethod
    def save_outputs(self, video: torch.Tensor, info: InputInfo) -> None:
        """Write the requested files for a decoded video [3, F, H, W] in [-1, 1]."""

    def clear_request_state(self) -> None:
        """Family hook: drop request-specific caches (RoPE tables, branch state, transient inputs)."""

    @abstractmethod
    def run_warmup(self, shapes: Sequence[Shape]) -> None:
        """Family warmup: drive the real path on `shapes` via `warmup_shape` / the stage methods."""

    # ---- module placement -----------------------------------------------------------------
    @contextmanager
    def module_on_device(self, name: str) -> Iterator[Any]:
        """Module `name` on the compute device for one stage (see runners/placement.py); while the
        block runs it is also `self.stage_modules[name]`. Without a placement: a no-op yielding None."""
        if self.placement is None:
            yield None
            return
        with self.placement.on_device(name) as module:
            self.stage_modules[name] = module
            try:
                yield module
            finally:
                del self.stage_modules[name]

    def encode_text(self, prompt: str, negative_prompt: str | None) -> Any:
        """`run_text_encoder` with the text encoder on the device (requests and warmup)."""
        with self.module_on_device("text_encoder"):
            return self.run_text_encoder(prompt, negative_prompt)

    # ---- request path -------------------------------------------------------------------
    def run_encoders(self, info: InputInfo) -> Any:
        """Text encoder, then (image tasks) image and VAE encoders; stores and returns `self.inputs`."""
        with self.profiler.stage("text_encoder"):
            inputs = self.encode_text(info.prompt, info.negative_prompt if self.config.enable_cfg else None)
        self.inputs = inputs
        if self.needs_image():
            with self.profiler.stage("image_encoder"):
                inputs = self.run_image_encoder(info, inputs)
            with self.profiler.stage("vae_encoder"):
                inputs = self.run_vae_encoder(info, inputs)
            self.inputs = inputs
        return inputs

    def run_denoise(self, info: InputInfo, steps: Sequence[int] | None = None,
                    timer: StepTimer | None = None, label: str = "step") -> torch.Tensor:
        """prepare -> (step_pre -> run_step -> step_post) for `steps` (default: all) -> final latents.

        Warmup passes a subset of steps; a non-consecutive jump resets the solver history
        (only for schedulers that keep one).
        """
        assert self.scheduler is not None, "load_modules must set self.scheduler"
        sched = self.scheduler
        total = self.config.infer_steps
        sched.prepare(self.latent_shape(info), total, info.seed, self.device, self.dtype)
        order = list(range(total)) if steps is None else list(steps)
        with self.module_on_device("transformer"):
            self._denoise_loop(sched, order, total, timer, label)
        return sched.latents

    def _denoise_loop(self, sched: Scheduler, order: list[int], total: int, timer: StepTimer | None,
                      label: str) -> None:
        previous = -1
        for i in order:
            if i != previous + 1:
                if sched.keeps_history:
                    sched.reset_history()
                sched.set_step(i)
            ctx = timer.step() if timer is not None else nullcontext()
            with ctx:
                latents, timestep = sched.step_pre(i)
                noise_pred = self.run_step(latents, timestep, i)
                sched.step_post(noise_pred)
            logger.info("{} {}/{}", label, i + 1, total)
            previous = i

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Run the decoder and consume an iterator fully; returns [B, 3, F, H, W]."""
        with self.module_on_device("vae"):
            out = self.run_vae_decoder(latents)
            if isinstance(out, torch.Tensor):
                return out
            return torch.cat(list(out), dim=2)  # consume the iterator fully while the VAE is on the device

    def run_pipeline(self, request: RequestConfig, index: int = 0) -> RequestProfile:
        """Serve one request: encoders -> denoise -> decode -> save -> end_run (always).

        Raises whatever the stages raise, tagged with phase `request {index}`; CUDA OOM errors
        get a note that separates live allocated memory from the allocator's reserved cache.
        """
        prof = RequestProfile(index=index, shape=[0, 0, 0])
        self.profiler.requests.append(prof)
        self.profiler.current = prof
        timer = StepTimer(self.device)
        graphs0, recompiles0 = _dynamo_counts()
        reserved0 = memory.snapshot(self.device).reserved_gib
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            with lifecycle_phase(f"request {index}"), memory.oom_note(self.device, f"request {index}"):
                # 1. resolve and check the request
                info = self.resolve_request(request)
                self.input_info = info
                prof.shape = list(info.shape)
                if self._warmup_ran and info.shape not in self.warmup_shapes():
                    logger.warning("request {}: shape {} was not warmed (warmup shapes: {}); expect a slower "
                                   "first step", index, list(info.shape), [list(x) for x in self.warmup_shapes()])
                if not (info.save_result_path or info.save_tensor_path):
                    logger.warning("request {}: no save_result_path or save_tensor_path: the result is not saved",
                                   index)
                # 2. encoders
                self.run_encoders(info)
                # 3. denoise
                with self.profiler.stage("transformer"):
                    latents = self.run_denoise(info, timer=timer)
                # 4. decode
                with self.profiler.stage("vae_decoder"):
                    video = self.decode(latents)
                # 5. save
                with self.profiler.stage("save"):
                    self.save_outputs(video[0].float().cpu(), info)
        except BaseException as exc:
            prof.ok = False
            prof.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                prof.steps = timer.seconds()
            finally:
                self.end_run()
            prof.seconds = time.perf_counter() - t0
            snap = memory.snapshot(self.device)
            graphs1, recompiles1 = _dynamo_counts()
            prof.memory = {k: round(v, 4) for k, v in snap.as_dict().items() if k != "free_gib"}
            prof.audit = {
                "compilations": graphs1 - graphs0,
                "recompilations": recompiles1 - recompiles0,
                "reserved_growth_gib": round(snap.reserved_gib - reserved0, 4),
                "warmed_shape": self._warmup_ran and tuple(prof.shape) in set(self.warmup_shapes()),
            }
            self.profiler.current = None
        logger.info("request {}: {:.2f} s, stages {}", index, prof.seconds,
                    {k: round(v, 3) for k, v in prof.stages.items()})
        return prof

    def end_run(self) -> None:
        """Back to the start-up baseline: scheduler state, request info, inputs, family caches."""
        self._reset_request_state()
        memory.maybe_empty_cache(self.device, "end_run", self.config.memory.empty_cache_min_free_gib,
                                 self.config.memory.empty_cache_min_reclaimable_gib)

    def _reset_request_state(self) -> None:
        if self.scheduler is not None:
            self.scheduler.clear()
        self.input_info = None
        self.inputs = None
        self.clear_request_state()

    # ---- warmup ------------------------------------------------------------------------
    def _opt_in(self, name: str) -> Any:
        """A warmup declaration from the runner's own class body (never inherited)."""
        return type(self).__dict__.get(name)

    def warmup_shapes(self) -> tuple[Shape, ...]:
        """The class-constant warmup shapes of this checkpoint's flavour ((h, w, f), two of them)."""
        table = self._opt_in("WARMUP_SHAPES") or {}
        return tuple(table.get(self.flavour(), ()))

    def check_warmup_supported(self) -> None:
        """Refuse (NotImplementedError with the reason) anything the warmup path does not support."""
        cls = type(self).__name__
        if self.config.unload_modules:
            raise NotImplementedError(
                "warmup is refused with `unload_modules`=true: every module is reloaded per request, so "
                "nothing warmup loads or compiles would survive to the first request")
        tasks, table, modes = (self._opt_in(n) for n in ("WARMUP_TASKS", "WARMUP_SHAPES", "WARMUP_OFFLOAD_MODES"))
        if tasks is None or table is None or modes is None:
            raise NotImplementedError(
                f"runner class {cls} has not opted in to warmup: it must declare WARMUP_TASKS, WARMUP_SHAPES "
                "and WARMUP_OFFLOAD_MODES in its own class body (opt-in is not inherited from a parent runner)")
        if self.config.task not in tasks:
            raise NotImplementedError(f"warmup of {cls} does not cover task {self.config.task!r} (covered: {list(tasks)})")
        mode = self.config.offload.mode if not self.config.offload.lazy_load else "lazy_load"
        if mode not in modes:
            raise NotImplementedError(
                f"warmup of {cls} does not support offload mode {mode!r} (supported: {list(modes)})")
        with lifecycle_phase("load"):  # reading the checkpoint's architecture is a load problem if it fails
            flavour = self.flavour()
        if flavour not in table:
            raise NotImplementedError(
                f"warmup of {cls} has no shapes for this checkpoint's flavour {flavour!r} "
                f"(recognised flavours: {sorted(table)}); an unrecognised architecture is not warmed")
        shapes = table[flavour]
        assert len(shapes) == 2, f"{cls}.WARMUP_SHAPES[{flavour!r}] must hold exactly two shapes"

    def warmup(self) -> None:
        """Run `run_warmup` once on the class-constant shapes; a no-op without --warmup or if already run.

        Afterwards: `input_info` and `inputs` are None, the scheduler is fresh (generator None), family
        caches are cleared; the allocator cache and resident weights are kept. Eager runners then
        freeze the gc once.
        """
        if not self.config.warmup:
            return
        if self._warmup_ran:
            logger.debug("warmup already ran; second call ignored")
            return
        self.check_warmup_supported()
        shapes = self.warmup_shapes()
        before = memory.snapshot(self.device)
        t0 = time.perf_counter()
        try:
            with memory.oom_note(self.device, "warmup"):
                self.run_warmup(shapes)
        finally:
            self._reset_request_state()
            if self.scheduler is not None:
                self.scheduler.generator = None
        memory.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self._warmup_ran = True
        self.after_warmup()
        after = memory.snapshot(self.device)
        self.profiler.warmup = {
            "seconds": round(seconds, 4),
            "shapes": [list(s) for s in shapes],
            "steps_per_shape": self.warmup_steps(),
            "memory_before": before.as_dict(),
            "memory_after": after.as_dict(),
        }
        logger.info("warmup: {:.2f} s over shapes {}; {}", seconds, [list(s) for s in shapes], after.describe())

    def warmup_steps(self) -> list[int]:
        """Steps warmup runs per shape: step 0 (every Wan2.1 step shares one layout)."""
        return [0]

    def after_warmup(self) -> None:
        """Eager default: collect and freeze the gc once (never under lazy load or unload_modules)."""
        if not (self.config.offload.lazy_load or self.config.unload_modules):
            memory.freeze_gc_once()

    def warmup_shape(self, shape: Shape, inputs: Any) -> None:
        """Drive the real request path on one shape with the shared text `inputs`; clean up in finally.

        encoders (image tasks only: per shape) -> prepare -> warmup_steps (step_pre/run_step/step_post)
        -> decode (iterator consumed). Nothing is saved and no request profile is written.
        """
        h, w, f = shape
        info = InputInfo(prompt="", negative_prompt="", seed=self.WARMUP_SEED, height=h, width=w, frames=f)
        try:
            self.input_info = info
            self.inputs = inputs
            if self.needs_image():
                self.inputs = self.run_vae_encoder(info, self.run_image_encoder(info, inputs))
            latents = self.run_denoise(info, steps=self.warmup_steps(), label="warmup step")
            self.decode(latents)
        finally:
            self._reset_request_state()
