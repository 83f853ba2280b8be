"""LTX-2.5 distilled two-stage audio+video runner (`model_cls` "ltx2.5", tasks t2av and i2av).

LTX-2's runner (runner.py) with what LTX-2.5 changes, after diffusers 0.42.1's LTX-2.5 chain
(`LTX2Pipeline` with its `duration_head` and `num_frames` omitted, `output_type="latent"` ->
`LTX2LatentUpsamplePipeline` -> `LTX2Pipeline` stage 2 -> `LTX2VideoDiffusionDecodePipeline`):

    [prompt_enhancer (with the config's `prompt_enhancer` section, for requests with `enhance_prompt`: a
    Gemma-4 chat model rewrites the prompt, prompt_enhancer.py)] ->
    text_encoder (Gemma-4, transformers) -> text_connectors -> duration_head (only when the request
    and the config give no frame count: the predicted count replaces the request's frames for the
    rest of the request) -> [i2av: vae_encoder of the first frame, re-compressed at CRF 18]
    -> stage1 -> latent_upsampler -> stage2 -> diffusion_decoder (its own denoising loop; its pixel
    noise is the request generator's next draw after the stages' noise) and audio_decoder (as
    LTX-2.3) -> mp4 with its audio stream

Frames omitted: the request's `frames` is the largest count the duration bounds allow
(`frame_bounds`) until the head predicts it, so admission and the memory checks plan for the
longest clip; the sidecar records the prediction (`sidecar_extra`). Bounds: diffusers' defaults
(1 s to 20 s, 25 to 473 frames at 24 fps), the test flavour `debug-2.5` 0.3 s to 1.6 s (9 to 33
frames at 24 fps) so CPU tests reach every bucket.

Warmup (the shape is known only after the text encoder): the flavour's two shapes hold the
bounds' smallest and largest frame counts, so every predicted count lies between two warmed ones
(compiled blocks: dynamic token dimensions after two sizes serve every count between). The duration
head runs in warmup (its prediction is not used there), and all three loops (stage 1, stage 2, the
diffusion decoder's) run at both shapes. Then every other count at the larger shape's size runs one
step per stage through the transformer's first block, and the audio decoder (count_sweep.py): the
per-shape plans of each count's token counts are built before a request needs them.

`video_decoder` "conv" (the config key): the video VAE's convolutional decoder decodes instead, as LTX-2.3's runner does
(diffusers: `LTX2Pipeline` stage 2 with an `output_type` other than "latent" decodes with its `vae`): the diffusion
decoder is neither loaded nor counted in the memory plan, warmup runs the conv decode, and the release's video VAE
is its conv VAE file (conv_vae25.py).

Gemma-4 streams its decoder layers as Gemma-3 does when `offload.stream_modules` lists "text_encoder"
(text_encoder_gemma4_stream.py), which the memory plan's rungs that stream every module do.
Checkpoints: a diffusers folder, or Lightricks' per-component release (`model_path` its transformer file;
`text_encoder_path` its packed Gemma-4 file, text_encoder_packed.py, or a Gemma-4 folder; checkpoint_release25.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from runnerkit.config import RequestConfig, RunnerConfig
from runnerkit.models.ltx2.arch25 import LTX25Arch, tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint, open_checked
from runnerkit.models.ltx2.checkpoint25 import LTX25Checkpoint, write_synthetic_ltx25
from runnerkit.models.ltx2.checkpoint_release25 import open_ltx25
from runnerkit.models.ltx2.count_sweep import SWEEP_KEY, warm_frame_counts
from runnerkit.models.ltx2.diffusion_decode import decode_video, warm_whole_decode
from runnerkit.models.ltx2.diffusion_decode_tiled import DecoderTiling
from runnerkit.models.ltx2.diffusion_decoder import LTX25_DIFFUSION_DECODER, LTX2DiffusionDecoderArch
from runnerkit.models.ltx2.duration import MAX_SECONDS, MIN_SECONDS, frames_for_duration
from runnerkit.models.ltx2.plan_sources import configured_arch
from runnerkit.models.ltx2.plan_sources25 import (
    RELEASES_25,
    check_paths_25,
    estimate_sources_25,
    gemma4_present,
    gemma4_text_dict,
    release_gemma4,
)
from runnerkit.models.ltx2.runner import LTX2Inputs, LTX2Runner, flavour_of
from runnerkit.models.ltx2.transformer import LTX2Transformer
from runnerkit.planning.compute import StageFlops
from runnerkit.planning.fit import EstimateUnavailable, MemoryEstimate
from runnerkit.registry import register_runner
from runnerkit.runners.pipeline import DecoderStage, DenoiseStage, EncoderStage, ModuleSpec, Pipeline, Shape
from runnerkit.runners.request_state import RequestState
from runnerkit.runners.requests import shape_with_defaults
from runnerkit.schedulers.base import Scheduler
from runnerkit.weights import CheckpointError

if TYPE_CHECKING:
    from runnerkit.models.ltx2.prompt_enhancer import EnhancerParts
    from runnerkit.offload.streamer import BlockStreamer

__all__ = ["FLAVOURS_25", "LTX25Runner"]

#: LTX-2 flavour of the same sizes -> the LTX-2.5 flavour.
FLAVOURS_25: dict[str, str] = {"debug": "debug-2.5", "22B": "22B-2.5"}
WARMUP_FPS = 24
"""The frame rate at which `LTX25Runner.WARMUP_SHAPES` hold the duration bounds' smallest and largest counts."""
DURATION_KEY = "ltx25.duration"
"""`RequestState.derived` key of the request's predicted duration (`run_duration_head`)."""


@register_runner("ltx2.5")
class LTX25Runner(LTX2Runner):
    """LTX-2.5 (22B) distilled, text to video with audio; the clip length predicted when not given."""

    TASKS = ("t2av", "i2av")
    #: LTX-2's defaults, the frame count left unset: predicted per request by the duration head.
    DEFAULTS: ClassVar[dict[str, Any]] = {**LTX2Runner.DEFAULTS, "target_video_length": None}
    #: read with `model_path` the release's transformer file (checkpoint_release25.py); a diffusers folder holds every
    #: module
    MODULE_PATHS = ("text_encoder_path", "upsampler_path")
    STREAM_MODULES: ClassVar[tuple[str, ...]] = ("text_encoder", "connectors", "transformer")
    #: H.264 CRF of a conditioning image (diffusers `resolve_default_image_crf` for Gemma-4 generations).
    IMAGE_CRF: ClassVar[int] = 18
    #: `offload.vae_tiling`: the diffusion decoder's stage 4 and stage 5 run on overlapping tiles
    #: (diffusion_decode_tiled.py, diffusers' default tile sizes `DecoderTiling()`)
    DECODER_TILING: ClassVar[bool] = True
    #: `video_decoder`: "diffusion" (the default, the release's main pipelines) or "conv" (the video VAE's decoder)
    VIDEO_DECODERS: ClassVar[tuple[str, ...]] = ("diffusion", "conv")
    #: "release": Lightricks' per-component files (checkpoint_release25_write.py), for real-size runs
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = ("diffusers", "release")
    #: Gemma-4 prompt enhancer (prompt_enhancer.py): loaded by the config's `prompt_enhancer` section, run for
    #: requests with `enhance_prompt`.
    PROMPT_ENHANCER: ClassVar[bool] = True
    #: flavour -> duration bounds (seconds) of a predicted clip; others: diffusers' (1 s, 20 s).
    DURATION_BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {"debug-2.5": (0.3, 1.6)}

    # ---- warmup opt-in (declared here; not inherited by subclasses) --------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("t2av", "i2av")
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> two output shapes (height, width, frames): the smallest and the largest frame count the
    #: duration bounds allow at 24 fps (debug-2.5: 9 and 33; 22B-2.5: 25 and 473).
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug-2.5": ((64, 64, 9), (64, 128, 33)),
        "22B-2.5": ((256, 384, 25), (512, 768, 473)),
    }

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        if self.config.warmup and self.config.fps != WARMUP_FPS:
            raise NotImplementedError(f"ltx2.5 warmup at `fps` {self.config.fps}: its shapes hold the duration bounds' "
                                      f"smallest and largest frame counts at {WARMUP_FPS} fps only (WARMUP_SHAPES); "
                                      f"run with fps {WARMUP_FPS} or without warmup")
        if self.conv_decoder and self.config.offload.vae_tiling:
            raise NotImplementedError("`offload.vae_tiling` with `video_decoder` 'conv': the convolutional VAE decodes "
                                      "whole (tiling is the diffusion decoder's); remove one of them")
        if self.checkpoints.absent() and self.config.model is None:  # planning without the files (plan_sources25.py)
            self.arch_override, self.arch_source = configured_arch(self.config, None, RELEASES_25)
        self.gemma4_placeholders: tuple[int, ...] = ()
        self.enhancer: EnhancerParts | None = None

    @property
    def conv_decoder(self) -> bool:
        """Whether the video VAE's convolutional decoder decodes (`video_decoder` "conv"), not the diffusion decoder."""
        return self.config.video_decoder == "conv"

    # ---- architecture, checkpoint, flavour ------------------------------------------------------
    @staticmethod
    def parse_arch(model: dict[str, Any] | None, partial: bool = False) -> LTX25Arch:
        """The config's `model` key as a validated LTX-2.5 architecture (`arch25.LTX25Arch`); without one,
        the tiny pipeline (`arch25.tiny_ltx25_arch`).

        Raises:
            ValueError: naming each bad field as `model.<component>.<field>`.
        """
        if model is None:
            return tiny_ltx25_arch()
        return LTX25Arch.from_config_model(model, partial, "ltx2.5")

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Deterministic random weights of `config.model`'s architecture (the tiny one without it) as a
        diffusers folder at `out` (checkpoint25.py `write_synthetic_ltx25`).

        Layout "release": Lightricks' per-component files under `out` (`arch_to_write`: a real-size config's
        release architecture from `model_path`'s name, Gemma-4 12B's size; options `fp8_blocks`,
        `generator_device`, `replace`).

        Raises:
            ValueError: a layout other than "diffusers" and "release"; `model` omitted in a config that names another
                checkpoint (`model_path`), whose architecture is not the tiny one (the release layout: one whose
                name names no release).
        """
        if layout == "release":
            from runnerkit.models.ltx2.checkpoint_release25_write import arch_to_write, write_release_ltx25

            arch, gemma = arch_to_write(config, cls.parse_arch(config.model), out)
            write_release_ltx25(arch, out, seed, dtype, options.get("fp8_blocks") or "none",
                                options.get("replace", False), options.get("generator_device") or "cpu", gemma)
            return
        if layout != "diffusers":
            raise ValueError(f"ltx2.5 writes synthetic checkpoints in the 'diffusers' or 'release' layout (got "
                             f"{layout!r})")
        elsewhere = config.model_path is not None and Path(config.model_path).absolute() != out.absolute()
        if config.model is None and elsewhere:
            raise ValueError(f"`model` is omitted, so the architecture is the checkpoint's at `model_path` "
                             f"({config.model_path}), not the tiny one: give `model`, or start from "
                             "configs/ltx2/ltx25_t2av_tiny.json")
        write_synthetic_ltx25(cls.parse_arch(config.model), out, seed, dtype, replace=options.get("replace", False))

    def open_checkpoint(self, path: Path, raw: bool = False) -> LTX25Checkpoint:
        """The diffusers folder at `path`, or the release whose transformer file `path` is (with `upsampler_path`
        and `text_encoder_path`; checkpoint25.py, checkpoint_release25.py) with its own architecture; the config's
        `model` must agree with it (checkpoint.py `open_checked`) unless `raw`."""
        key = (path, raw)
        if self.checkpoint is None and self._headers.get(key) is not None:
            return self._headers[key]  # type: ignore[return-value]
        single = path.suffix == ".safetensors"  # the release's transformer file: its companions from the config
        cfg = self.config
        ckpt = open_checked(lambda arch: open_ltx25(path, cfg.upsampler_path if single else None,
                                                    cfg.text_encoder_path if single else None, arch=arch,
                                                    video_decoder="conv" if self.conv_decoder else "diffusion"),
                            path, None if raw else cfg.model, lambda: self.parse_arch(cfg.model))
        if self.checkpoint is None:
            self._headers = {key: ckpt}
        return ckpt

    def flavour(self) -> str | None:
        """`LTX2Runner.flavour` of the same sizes, as an LTX-2.5 flavour (`FLAVOURS_25`)."""
        return FLAVOURS_25.get(super().flavour() or "")

    def prepare_load(self) -> None:
        """`LTX2Runner.prepare_load`, then the Gemma-4 placeholder ids (embedded as padding) and, when the config
        has a `prompt_enhancer` section, the enhancer's processor and system prompts (its weights are the pipeline
        module `prompt_enhancer`, placed as the offload config says: `describe_pipeline`)."""
        from runnerkit.models.ltx2.prompt_enhancer import configured_enhancer_parts
        from runnerkit.models.ltx2.text_encoder_packed import configs_of

        super().prepare_load()
        assert self.checkpoint is not None
        self.gemma4_placeholders = configs_of(self.checkpoint.text_encoder_path)[1]
        self.enhancer = configured_enhancer_parts(self.config, image_task=self.config.task == "i2av")

    # ---- frames omitted: the bounds ------------------------------------------------------------
    @classmethod
    def duration_bounds(cls, config: RunnerConfig) -> tuple[float, float]:
        """(min, max) seconds of a predicted clip for `config`'s architecture (`DURATION_BOUNDS`); a config
        without `model` and without a synthetic checkpoint is a release's: diffusers' bounds."""
        if config.model is None and config.synthetic_checkpoint is None:
            return (MIN_SECONDS, MAX_SECONDS)
        name = FLAVOURS_25.get(flavour_of(cls.parse_arch(config.model)) or "")
        return cls.DURATION_BOUNDS.get(name or "", (MIN_SECONDS, MAX_SECONDS))

    @classmethod
    def frame_bounds(cls, config: RunnerConfig) -> tuple[int, int]:
        """(smallest, largest) frame count a prediction can give at `config.fps` (duration.py rules)."""
        low, high = cls.duration_bounds(config)
        fps = float(config.fps or cls.DEFAULTS["fps"])
        return (frames_for_duration(low, fps, cls.TEMPORAL_FACTOR, low, high),
                frames_for_duration(high, fps, cls.TEMPORAL_FACTOR, low, high))

    @classmethod
    def shape_of(cls, request: RequestConfig, config: RunnerConfig) -> Shape:  # type: ignore[override]
        """(height, width, frames); frames omitted by the request and the config: the largest the bounds allow."""
        height, width, frames = shape_with_defaults(request, config)
        return (height, width, frames if frames is not None else cls.frame_bounds(config)[1])

    @classmethod
    def validate_request(cls, request: RequestConfig, config: RunnerConfig) -> None:
        """`LTX2Runner.validate_request`, and a frame count the request or the config gives no smaller than
        the shortest clip the duration head predicts (`frame_bounds`: 25 at 24 fps for the release): the
        diffusion decoder's attention windows need several latent frames (a 1-frame request would fail in
        the decoder, after both stages).

        Raises:
            ValueError: naming `target_video_length`, its value and the smallest allowed.
        """
        super().validate_request(request, config)
        height, width, frames = shape_with_defaults(request, cls.resolve_config(config))
        if config.video_decoder != "conv":
            cls._check_decoder_windows(height, width, config)
        smallest = cls.shortest_clip(config)
        if frames is not None and frames < smallest:
            raise ValueError(f"`target_video_length` {frames}: ltx2.5 takes at least {smallest} frames at "
                             f"{config.fps or cls.DEFAULTS['fps']} fps (the shortest clip its duration head "
                             "predicts; the diffusion decoder needs several latent frames); omit it to have it "
                             "predicted")

    @classmethod
    def _check_decoder_windows(cls, height: int, width: int, config: RunnerConfig) -> None:
        """The diffusion decoder's stage-1 attention window must fit the latent grid (later stages only grow it):
        refused with the request rather than in the decoder after both denoising stages. The decoder's
        architecture: the config's `model` if it has one, else the release's.

        Raises:
            ValueError: naming `target_height` / `target_width`, the size and the smallest allowed.
        """
        section = (config.model or {}).get("diffusion_decoder")
        arch = LTX2DiffusionDecoderArch(**section) if section else LTX25_DIFFUSION_DECODER
        _, kh, kw = arch.decoder_stage_kernels[0]
        r = arch.spatial_compression_ratio
        if height // r < kh or width // r < kw:
            raise ValueError(f"`target_height` x `target_width` {height}x{width}: the ltx2.5 diffusion decoder's "
                             f"attention windows need latents of at least {kh} x {kw} cells, {kh * r} x {kw * r} "
                             "pixels; ask for a larger video, or decode with `video_decoder` 'conv'")

    @classmethod
    def shortest_clip(cls, config: RunnerConfig) -> int:
        """The shortest clip the duration head predicts (`frame_bounds`), also the fewest frames a request may give
        (`validate_request`); never one frame."""
        return cls.frame_bounds(cls.resolve_config(config))[0]

    @classmethod
    def validate_shape(cls, height: int, width: int, frames: int | None) -> None:  # type: ignore[override]
        """`LTX2Runner.validate_shape`; `frames` None (the config's omitted default) is predicted, always valid."""
        super().validate_shape(height, width, 1 if frames is None else frames)

    def estimate_memory(self, shape: Shape) -> MemoryEstimate:  # type: ignore[override]
        """The estimate of a request of `shape` (estimate25.py `ltx25_estimate`; with a `prompt_enhancer` section
        also the enhancer's module and stage, estimate_enhancer.py); omitted frames (None) at the bounds' largest
        count.

        Raises:
            EstimateUnavailable: the architecture or the Gemma-4 config cannot be read before loading.
        """
        from runnerkit.models.ltx2 import planning
        from runnerkit.models.ltx2.estimate25 import ltx25_estimate
        from runnerkit.models.ltx2.estimate_enhancer import with_enhancer

        h, w, f = shape
        arch = planning.architecture(self)
        assert isinstance(arch, LTX25Arch), "an LTX-2.5 runner reads LTX-2.5 architectures"
        cfg = self.config
        estimate = ltx25_estimate(arch, self.gemma4_text_config(arch), (h, w, f if f is not None else
                                                                        self.frame_bounds(cfg)[1]),
                                  cfg.fps, cfg.task, self.dtype, self.device, cfg.offload,
                                  planning.fp8_transformer_weights(self), self.lora_slot_rank(), self.conv_decoder)
        return with_enhancer(estimate, cfg, cfg.task, self.dtype)  # the prompt enhancer's module and stage

    def gemma4_text_config(self, arch: LTX25Arch) -> dict[str, Any]:
        """The Gemma-4 text config's fields: the checkpoint's text encoder (`gemma4_folder`: a packed file's
        `gemma_config` or a folder's config.json; the synthetic one's while it is still to be written).

        Raises:
            EstimateUnavailable: its config cannot be read.
        """
        from runnerkit.models.ltx2.checkpoint25 import tiny_gemma4_sizes
        from runnerkit.models.ltx2.text_encoder_packed import text_config_dict

        if self.checkpoint is not None:
            folder = self.checkpoint.text_encoder_path
        else:
            path = self.checkpoints.path()
            if self.checkpoints.pending(path):
                return gemma4_text_dict(tiny_gemma4_sizes(arch))
            folder = self.gemma4_folder(path)
            if self.checkpoints.absent() and not gemma4_present(folder):
                return release_gemma4(arch)  # planning without the files (plan_sources25.py)
        try:
            return text_config_dict(folder)
        except CheckpointError as exc:
            raise EstimateUnavailable(f"the Gemma-4 config cannot be read before loading ({exc})") from None

    def gemma4_folder(self, path: Path) -> Path:
        """The Gemma-4 text encoder of the checkpoint at `path`: `text_encoder_path` (the release: its packed file or
        a folder), else the packed file in the release's `text_encoders/` (by content; its usual name there when
        none is found), else the diffusers folder's `text_encoder/`."""
        from runnerkit.models.ltx2.checkpoint_release25 import find_packed_text_encoder
        from runnerkit.models.ltx2.release25_names import RELEASE_FILES

        cfg = self.config
        if cfg.text_encoder_path is not None:
            return Path(cfg.text_encoder_path)
        if path.suffix != ".safetensors":
            return path / "text_encoder"
        root = path.parent.parent  # <root>/diffusion_models/<transformer file>
        try:
            return find_packed_text_encoder(root)
        except CheckpointError:
            return root / RELEASE_FILES["text_encoder"]

    estimate_sources = estimate_sources_25  # an absent checkpoint's Gemma-4 and omitted frames (plan_sources25.py)

    def denoise_flops(self, shape: Shape) -> tuple[StageFlops, ...]:
        """`LTX2Runner.denoise_flops`, omitted frames at the bounds' largest count."""
        h, w, f = shape
        return super().denoise_flops((h, w, f if f is not None else self.frame_bounds(self.config)[1]))

    # ---- the pipeline ---------------------------------------------------------------------------
    def describe_pipeline(self) -> Pipeline:
        """LTX-2's, with Gemma-4 (resident, model-offloaded or streamed), the duration head after the connectors and
        the diffusion decoder in place of the video VAE's decoder (the VAE is loaded for i2av's encoder only); with
        `video_decoder` "conv" the video VAE's decoder stays (LTX-2's `vae_decoder`) and the diffusion decoder is
        left out. With a `prompt_enhancer` section: the module `prompt_enhancer` (placed by the offload config like
        the text encoder: resident, visiting the device for its stage, or built for it) and its stage before the
        text encoder, run for requests with `enhance_prompt` and in warmup."""
        base = self._describe_pipeline()
        if self.config.prompt_enhancer is None:
            return base
        from runnerkit.models.ltx2.estimate_enhancer import ENHANCER
        from runnerkit.models.ltx2.prompt_enhancer import load_enhancer_model

        parts = self.enhancer
        assert parts is not None, "prepare_load reads the enhancer's parts first"
        module = ModuleSpec(ENHANCER, "text_encoder", build=lambda d: load_enhancer_model(parts.model_dir, self.dtype, d))
        stage = EncoderStage(ENHANCER, module=ENHANCER, run=self.run_prompt_enhancer,
                             runs=lambda req: req.info.enhance_prompt or req.info.warmup)
        return replace(base, modules=(module, *base.modules), encoders=(stage, *base.encoders))

    def _describe_pipeline(self) -> Pipeline:
        """`describe_pipeline` without the prompt enhancer."""
        base = super().describe_pipeline()
        head = EncoderStage("duration_head", module="duration_head", run=self.run_duration_head,
                            runs=lambda req: req.info.frames_omitted or req.info.warmup)  # frames given: it does not
        if self.conv_decoder:
            modules = [ModuleSpec("text_encoder", "text_encoder", build=self.build_text_encoder,
                                  stream=self.stream_text_encoder)]
            modules += [m for m in base.modules if m.name != "text_encoder"]
            modules += [ModuleSpec("duration_head", "text_encoder", build=lambda d: self._load("duration_head", d))]
            return replace(base, modules=tuple(modules), encoders=(*base.encoders[:2], head, *base.encoders[2:]))
        unused = ("text_encoder",) if self.config.task == "i2av" else ("text_encoder", "vae")
        modules = [ModuleSpec("text_encoder", "text_encoder", build=self.build_text_encoder,
                              stream=self.stream_text_encoder)]
        modules += [m for m in base.modules if m.name not in unused]
        modules += [ModuleSpec("duration_head", "text_encoder", build=lambda d: self._load("duration_head", d)),
                    ModuleSpec("diffusion_decoder", "decoder", build=lambda d: self._load("diffusion_decoder", d))]
        decoders = [DecoderStage("diffusion_decoder", module="diffusion_decoder", output="video",
                                 run=self.run_diffusion_decoder)]
        decoders += [d for d in base.decoders if d.name != "vae_decoder"]
        encoders = (*base.encoders[:2], head, *base.encoders[2:])  # text, connectors, head, [i2av: VAE encoder]
        return replace(base, modules=tuple(modules), encoders=encoders, decoders=tuple(decoders))

    check_module_paths = staticmethod(check_paths_25)  # the packed text encoder file, or none (plan_sources25.py)

    def load_tokenizer(self, ckpt: LTX2Checkpoint) -> Any:  # type: ignore[override]
        """The tokenizer of `ckpt`'s tokenizer folder, or the one its packed Gemma-4 file embeds
        (text_encoder_packed.py `load_tokenizer`)."""
        from runnerkit.models.ltx2.text_encoder_packed import load_tokenizer

        return load_tokenizer(ckpt.tokenizer_path)

    def build_text_encoder(self, device: torch.device) -> nn.Module:
        from runnerkit.models.ltx2.text_encoder_packed import load_text_model

        assert self.checkpoint is not None, "prepare_load first"
        return load_text_model(self.checkpoint.text_encoder_path, self.dtype, device,
                               connectors=self.checkpoint.arch.connectors)

    def stream_text_encoder(self) -> tuple[nn.Module, BlockStreamer]:
        """Gemma-4 with its layers (or their attention and MLP, mode "phase") streamed from host memory or its
        folder's safetensors (`offload.stream_modules` lists "text_encoder"; text_encoder_gemma4_stream.py)."""
        from runnerkit.models.ltx2.text_encoder_packed import stream_text_model

        assert self.checkpoint is not None, "prepare_load first"
        return stream_text_model(self.checkpoint.text_encoder_path, self.config.offload, self.device,
                                 self.dtype, connectors=self.checkpoint.arch.connectors)

    @torch.inference_mode()
    def run_prompt_enhancer(self, req: RequestState) -> Any:
        """A request with `enhance_prompt`: the enhancer (the placed `prompt_enhancer` module) rewrites its prompt
        into `req.enhanced_prompt` (`prompt_to_encode`; i2av: conditioned on the request's image as read, before
        its CRF re-compression, as diffusers does); warmup: its short enhancements. Returns `req.inputs` unchanged."""
        from runnerkit.images import read_pil_image
        from runnerkit.models.ltx2.prompt_enhancer import prompt_to_encode

        assert self.enhancer is not None, "prepare_load reads the enhancer's parts first"
        info = req.info
        image = read_pil_image(info.image_path, "image_path") if info.image_path and not info.warmup else None
        prompt_to_encode(req, self.enhancer.around(req.modules["prompt_enhancer"]), image)
        return req.inputs

    @torch.inference_mode()
    def run_text_encoder(self, req: RequestState) -> LTX2Inputs:
        """Prompt -> stacked Gemma-4 hidden states [1, 1024, D * (layers + 1)] and the tokenizer mask
        (diffusers' tokenization: no bos prepended beyond the tokenizer's). A request with `enhance_prompt`
        encodes the enhancer's rewrite of its prompt (`req.enhanced_prompt`, `run_prompt_enhancer`)."""
        from runnerkit.models.ltx2.text_encoder_gemma4 import Gemma4PromptEncoder

        prompt = req.enhanced_prompt if req.enhanced_prompt is not None else req.info.prompt
        encoder = Gemma4PromptEncoder(self.tokenizer, req.modules["text_encoder"],
                                      placeholder_ids=self.gemma4_placeholders)
        hidden, mask = encoder.encode(prompt)
        return LTX2Inputs(text_hidden=hidden, text_mask=mask)

    @torch.inference_mode()
    def run_duration_head(self, req: RequestState) -> LTX2Inputs:
        """Frames omitted: the head's seconds from the connectors' outputs -> a frame count (duration.py
        `frames_for_duration`, the flavour's bounds, `config.fps`) that replaces `req.info.frames` (the
        stages' latent shapes follow); recorded under `DURATION_KEY`. Frames given: nothing runs. Warmup:
        the head runs, its count unused (the warmup shape stays).

        Raises:
            ValueError: the head's prediction is not finite (as `frames_for_duration`).
        """
        info, inputs = req.info, req.inputs
        if not (info.frames_omitted or info.warmup):
            return inputs
        assert isinstance(inputs, LTX2Inputs) and inputs.video_context is not None, "run the connectors first"
        seconds = float(req.modules["duration_head"](inputs.video_context, inputs.audio_context).item())
        low, high = self.duration_bounds(self.config)
        frames = frames_for_duration(seconds, float(self.config.fps), self.TEMPORAL_FACTOR, low, high)
        if not info.warmup:
            req.info = replace(info, frames=frames)
            req.derived[DURATION_KEY] = {"head_seconds": seconds, "frames": frames}
        return inputs

    @torch.inference_mode()
    def run_diffusion_decoder(self, req: RequestState, latents: Tensor) -> Tensor:
        """Final joint latents -> video [1, 3, F, H, W] in [-1, 1] (float32): de-normalised with the video
        VAE's statistics, decoded by the diffusion decoder's loop (diffusion_decode.py `decode_video`), its
        pixel noise drawn from the request's generator (after every stage's noise); with `offload.vae_tiling`
        on overlapping tiles (diffusion_decode_tiled.py) when the latents are larger than one, and in warmup
        also the largest whole decode at the shape's size (`warm_whole_decode`)."""
        assert self.vae_stats is not None and req.generator is not None, "run the denoise stages first"
        video, _ = self.layouts(req)[-1].split(latents)  # the last stage's, normalised
        mean, std, scaling = self.vae_stats
        tiling = DecoderTiling() if self.config.offload.vae_tiling else None
        decoded = decode_video(req.modules["diffusion_decoder"], video.float(), req.generator, latents_mean=mean,
                               latents_std=std, scaling_factor=scaling, tiling=tiling)
        if tiling is not None and req.info.warmup:  # the largest whole decode too (its stage-4 grid tops any tile's)
            warm_whole_decode(req.modules["diffusion_decoder"], video, tiling)
        return decoded

    # ---- warmup: the two shapes, then every frame count at the larger one's size ----------------
    def run_warmup(self, shapes: Sequence[Shape]) -> None:
        """The default warmup on `shapes`, then the frame-count sweep (count_sweep.py `warm_frame_counts`)."""
        shared = self.warmups.run(shapes)
        warm_frame_counts(self, shared, shapes)

    def warmup_steps(self, req: RequestState, stage: DenoiseStage, sched: Scheduler) -> list[int]:
        """Each stage's first and last step; a sweep request's first step only."""
        return [0] if req.derived.get(SWEEP_KEY) else super().warmup_steps(req, stage, sched)

    @torch.inference_mode()
    def run_step(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: Tensor, timestep: Tensor,
                 step_index: int) -> Tensor:
        """`LTX2Runner.run_step`; a sweep request's through the transformer's first block only."""
        if not req.derived.get(SWEEP_KEY):
            return super().run_step(req, stage, model, latents, timestep, step_index)
        assert isinstance(model, LTX2Transformer), f"the sweep cuts an LTX2Transformer, got {type(model).__name__}"
        with model.first_blocks(1):
            return super().run_step(req, stage, model, latents, timestep, step_index)

    def sidecar_extra(self, req: RequestState) -> dict[str, Any]:
        """`duration`: `predicted` (whether the duration head chose the frame count), `frames`, `seconds`
        (frames / fps, the video's length); predicted also `head_seconds` (the head's raw output) and
        `bounds_seconds` [min, max]."""
        fps = float(self.config.fps)
        record: dict[str, Any] = {"predicted": DURATION_KEY in req.derived, "frames": req.info.frames,
                                  "seconds": req.info.frames / fps}
        if record["predicted"]:
            record |= {"head_seconds": req.derived[DURATION_KEY]["head_seconds"],
                       "bounds_seconds": list(self.duration_bounds(self.config))}
        return {"duration": record}
