"""Request checks of `DefaultRunner`: a request's fields and shape, and whether its estimated peak
memory fits the device (runners/fit.py), all before anything runs.

    validate_request (classmethod, before loading) -> shape_of -> validate_shape
    check_requests_fit (before loading) / check_fit (warmup gate, each request) -> MemoryFitError
    resolve_request (each request): the request's defaults filled in -> InputInfo

`RequestChecksMixin` is mixed into `DefaultRunner` (runners/default.py) and reads what that class
supplies: `config`, `device`, `resolve_config` (BaseRunner); `placement`, the family hook
`estimate_memory`, the class settings `SPATIAL_FACTOR`, `TEMPORAL_FACTOR`, `IMAGE_INPUTS`,
`EXTRA_IMAGES`, `RESULT_KINDS`, `DEFAULT_NEGATIVE_PROMPT`, and the `_fit_unchecked_logged` /
`_fit_deferred_logged` flags set in `DefaultRunner.__init__`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loguru import logger

from runnerkit import memory
from runnerkit.config import RequestConfig, RunnerConfig, as_request
from runnerkit.images import check_image
from runnerkit.runners import fit
from runnerkit.runners.fit import MemoryFitError, PeakEstimate
from runnerkit.runners.pipeline import InputInfo, Shape

__all__ = ["RequestChecksMixin"]


class RequestChecksMixin:
    """Request validation and the memory fit check of `DefaultRunner` (see the module docstring)."""

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
            raise ValueError(f"`target_video_length` must be {t}n+1, e.g. {t + 1}, {2 * t + 1}, {20 * t + 1} "
                             f"(got {frames})")

    @classmethod
    def shape_of(cls, request: RequestConfig, config: RunnerConfig) -> Shape:
        """(height, width, frames) a request runs at (`config` with the family defaults).

        Default: the request's fields, else the config's. A family whose shape follows its inputs
        (e.g. image-to-video keeping the image's aspect ratio) overrides this; its image inputs
        have already been checked by `validate_request` when it is called.
        """
        return (request.target_height or config.target_height, request.target_width or config.target_width,
                request.target_video_length or config.target_video_length)

    @classmethod
    def validate_request(cls, request: RequestConfig, config: RunnerConfig) -> None:
        """Check a request against the runner before anything loads (`config` as given by the user).

        Raises:
            ValueError: naming the field: image inputs the task does not take, lacks, or that are
                not readable images (`runnerkit.images.ImageInputError`), shape factors, a result
                file suffix that does not fit the task's primary output.
        """
        config = cls.resolve_config(config)
        if request.negative_prompt is not None and not config.enable_cfg:
            raise ValueError("`negative_prompt` only acts with classifier-free guidance, but the runner's "
                             "`enable_cfg` is false: remove it from the request")
        task_inputs = cls.IMAGE_INPUTS.get(config.task, ())
        for field in ("image_path", "last_frame_path"):
            value = getattr(request, field)
            if value is not None and field not in task_inputs:
                raise ValueError(f"`{field}` is not used by task {config.task!r} (got {value!r}); "
                                 f"image inputs of this task: {list(task_inputs) or 'none'}")
            if field in task_inputs:
                if value is None:
                    flag = "--" + field
                    raise ValueError(f"`{field}` ({flag}) is required by task {config.task!r}: give an image file")
                check_image(value, field)
        extra, most = request.extra_image_paths or [], cls.EXTRA_IMAGES.get(config.task, 0)
        if len(extra) > most:
            raise ValueError(f"`extra_image_paths` holds {len(extra)} image(s); task {config.task!r} takes at most "
                             f"{most} after `image_path`" + ("" if most else " (it takes no further references)"))
        for k, value in enumerate(extra):
            check_image(value, f"extra_image_paths[{k}]")
        h, w, f = cls.shape_of(request, config)
        cls.validate_shape(h, w, f)
        if request.save_result_path:
            suffix = Path(request.save_result_path).suffix.lower()
            kind = cls.RESULT_KINDS.get(config.task, "video")
            allowed = {"video": (".mp4", ".png") if f == 1 else (".mp4",), "image": (".png",), "audio": (".wav",)}[kind]
            if suffix not in allowed:
                what = f"a {f}-frame video" if kind == "video" else f"an {kind}" if kind == "image" else "audio"
                hint = " (.png: with target_video_length 1)" if kind == "video" and f != 1 else ""
                raise ValueError(f"`save_result_path` {request.save_result_path!r}: task {config.task!r} makes {what}; "
                                 f"use {' or '.join(allowed)}{hint}")

    def request_shape(self, request: RequestConfig) -> Shape:
        """(height, width, frames) of `request`, the config's defaults filled in (`shape_of`)."""
        return self.shape_of(request, self.config)

    # ---- memory fit (runners/fit.py) --------------------------------------------------------
    def check_fit(self, shape: Shape, what: str) -> PeakEstimate | None:
        """Refuse `shape` if its estimated peak memory exceeds the device's limit; return the estimate.

        The limit is `memory.limit_gib`, else what the device offers (`memory.memory_limit`: CUDA
        free + held by this process; CPU available host memory + the weights already loaded).
        Returns None without a check: `memory.check_fit` false, no family estimate, an estimate not
        available before loading (`fit.EstimateUnavailable`: checked again before each request), or
        a device whose memory cannot be read (each logged once).

        Raises:
            MemoryFitError: naming `what`, the shape, the estimate, the limit and what to change.
        """
        cfg = self.config
        if not cfg.memory.check_fit:
            return None
        try:
            estimate = self.estimate_memory(shape)
        except fit.EstimateUnavailable as exc:
            if not self._fit_deferred_logged:
                logger.info("memory check: waits for the load, then checks each request before it runs: {}", exc)
                self._fit_deferred_logged = True
            return None
        if estimate is None:
            self._log_unchecked(f"{type(self).__name__} gives no memory estimate (estimate_memory)")
            return None
        loaded = fit.weights_between_stages(estimate, cfg, self.device) if self.placement is not None else 0
        limit = memory.memory_limit(self.device, cfg.memory.limit_gib, loaded_bytes=loaded)
        if limit is None:
            self._log_unchecked(f"the memory of device {self.device} cannot be read; set memory.limit_gib")
            return None
        peak = fit.peak_of(estimate, cfg, self.device)
        if peak.bytes > limit.bytes:
            raise MemoryFitError(fit.refusal_message(what, shape, peak, limit.bytes, limit.source, self.device, cfg,
                                                     estimate.hints))
        logger.debug("{}: shape {} fits: estimated {} of {:.2f} GiB ({})", what, list(shape), peak.describe(),
                     limit.bytes / fit.GIB, limit.source)
        return peak

    def _log_unchecked(self, reason: str) -> None:
        if not self._fit_unchecked_logged:
            logger.info("memory check: requests are not checked against the device's memory: {}", reason)
            self._fit_unchecked_logged = True

    def check_requests_fit(self, requests: Sequence[RequestConfig]) -> None:
        """Check every request's shape before anything loads (the launch script calls this first).

        Raises:
            MemoryFitError: for the first request that cannot fit (its index and source in the message).
        """
        peaks: dict[Shape, PeakEstimate | None] = {}
        for index, request in enumerate(requests):
            shape = self.request_shape(request)
            if shape not in peaks:
                peaks[shape] = self.check_fit(shape, f"request {index} ({request.source})")
        checked = {s: p for s, p in peaks.items() if p is not None}
        if checked:
            shape, peak = max(checked.items(), key=lambda item: item[1].bytes)
            logger.info("memory check: {} request(s) fit; largest estimate {} for shape {}", len(requests),
                        peak.describe(), list(shape))

    def resolve_request(self, request: RequestConfig | dict[str, Any]) -> InputInfo:
        """Fill request defaults from the runner config and validate the request.

        Raises:
            ValueError: an invalid request (a dict is validated as a `RequestConfig` first).
            TypeError: `request` is neither a `RequestConfig` nor a dict.
        """
        cfg = self.config
        request = as_request(request)
        self.validate_request(request, cfg)
        height, width, frames = self.shape_of(request, cfg)
        return InputInfo(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt if request.negative_prompt is not None
            else (cfg.negative_prompt if cfg.negative_prompt is not None else self.DEFAULT_NEGATIVE_PROMPT),
            seed=request.seed if request.seed is not None else cfg.seed,
            height=height,
            width=width,
            frames=frames,
            save_result_path=request.save_result_path,
            save_tensor_path=request.save_tensor_path,
            image_path=request.image_path,
            last_frame_path=request.last_frame_path,
            extra_image_paths=tuple(request.extra_image_paths or ()),
        )
