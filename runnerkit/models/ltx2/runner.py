"""LTX-2 / LTX-2.3 distilled two-stage audio+video runner (`model_cls` "ltx2", tasks t2av and i2av).

The request path (diffusers 0.42.1's documented distilled chain: `LTX2Pipeline` with
`DISTILLED_SIGMA_VALUES` and `output_type="latent"` -> `LTX2LatentUpsamplePipeline` -> `LTX2Pipeline`
again with `STAGE_2_DISTILLED_SIGMA_VALUES`, `noise_scale` = their first sigma, the stage-1 audio
latents; `LTX2ImageToVideoPipeline` for i2av), as pipeline description (runners/pipeline.py):

    text_encoder (Gemma-3, transformers) -> text_connectors -> [i2av: vae_encoder of the first frame
    at the stage-1 size] -> stage1 (8 Euler steps on the distilled sigmas, half height and width)
    -> latent_upsampler (x2, the transition) -> stage2 (3 Euler steps from the upsampled video and the
    stage-1 audio, both re-noised at 0.909375 with the request's generator) -> vae_decoder (video)
    -> audio_decoder (audio VAE decoder + vocoder) -> mp4 with its audio stream

Video and audio latents are one flat scheduler tensor per stage (latents.py `JointLayout`); both
modalities share the sigmas, as diffusers' copied audio scheduler does. No CFG: the distilled
model is trained without it (`enable_cfg` must be false). Where diffusers and Lightricks'
`ltx-pipelines` differ, this follows diffusers (the parity reference) and says so:
- sigmas are used as given (diffusers with `use_dynamic_shifting` off, as the reference's distilled
  pipeline does; both agree);
- i2av stage 2 keeps the upsampled first latent frame clean (diffusers' `conditioning_mask`); the
  reference re-encodes the image at full size instead;
- the velocity goes through diffusers' x0 round trip in diffusers (`convert_velocity_to_x0` and
  back, no guidance in between): an identity up to float32 rounding, skipped here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from loguru import logger
from torch import Tensor, nn

from runnerkit.config import RunnerConfig
from runnerkit.images import read_pil_image
from runnerkit.lora import linear_targets
from runnerkit.models.ltx2 import planning
from runnerkit.models.ltx2.arch import LTX2Arch, tiny_pipeline_arch
from runnerkit.models.ltx2.audio_vae import LTX2AudioVAEDecoder, audio_latent_length
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint, open_checked
from runnerkit.models.ltx2.checkpoint_synthetic import write_synthetic_ltx2
from runnerkit.models.ltx2.connectors import LTX2TextConnectors
from runnerkit.models.ltx2.flops import ltx2_denoise_flops
from runnerkit.models.ltx2.image_crf import missing_pyav, recompress_h264
from runnerkit.models.ltx2.latents import JointLayout
from runnerkit.models.ltx2.plan_sources import check_paths, configured_arch
from runnerkit.models.ltx2.transformer import (
    LTX2Transformer,
    pack_audio_latents,
    pack_video_latents,
    unpack_audio_latents,
    unpack_video_latents,
)
from runnerkit.models.ltx2.upsampler import upsample_normalized_latents
from runnerkit.models.ltx2.vae import LTX2VideoVAE
from runnerkit.offload.layout import StreamSpec
from runnerkit.offload.setup import stream_module
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.planning.compute import StageFlops
from runnerkit.registry import register_runner
from runnerkit.runners.default import DefaultRunner
from runnerkit.runners.pipeline import (
    DecoderStage,
    DenoiseStage,
    EncoderStage,
    InputInfo,
    ModuleSpec,
    OutputSpec,
    Pipeline,
    Shape,
)
from runnerkit.runners.request_state import RequestState
from runnerkit.schedulers.base import Scheduler
from runnerkit.weights import CheckpointError, build_on_meta

__all__ = ["DISTILLED_SIGMAS", "STAGE2_SIGMAS", "LTX2Inputs", "LTX2Runner", "flavour_of"]

#: The distilled model's trained schedules (Lightricks ltx-pipelines `utils/constants.py`, as
#: diffusers 0.42.1 `pipelines/ltx2/utils.py` copies them): stage 1 from pure noise, stage 2 from
#: the upsampled latents re-noised at its first sigma.
DISTILLED_SIGMAS: tuple[float, ...] = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875)
STAGE2_SIGMAS: tuple[float, ...] = (0.909375, 0.725, 0.421875)

# Architectures recognised as flavours: (version, num_layers, video width) -> name.
FLAVOURS: dict[tuple[str, int, int], str] = {
    ("2.0", 2, 16): "debug-2.0",  # configs/ltx2/*_tiny.json with version 2.0 (arch.tiny_pipeline_arch)
    ("2.3", 2, 32): "debug",  # configs/ltx2/*_tiny.json
    ("2.0", 48, 4096): "19B",
    ("2.3", 48, 4096): "22B",
}


def flavour_of(arch: LTX2Arch) -> str | None:
    """The flavour name of an architecture, or None if it is not a known one."""
    t = arch.transformer
    return FLAVOURS.get((arch.version, t.num_layers, t.inner_dim))


@dataclass
class LTX2Inputs:
    """A request's encoded inputs (the runner's `inputs`)."""

    text_hidden: Tensor | None = None
    """Between the text stages: [1, T, D * (layers + 1)] stacked Gemma-3 hidden states."""
    text_mask: Tensor | None = None
    """[1, T] tokenizer mask (1 prompt, 0 padding)."""
    video_context: Tensor | None = None
    """[1, T, Dv] video text context from the connectors (model dtype)."""
    audio_context: Tensor | None = None
    """[1, T, Da] audio text context."""
    context_mask: Tensor | None = None
    """[1, T] mask of the contexts (the connectors' registers make it all ones)."""
    image_latents: Tensor | None = None
    """i2av: [1, C, 1, H1, W1] normalised latents of the first frame at the stage-1 size (float32)."""


class AudioDecoder(nn.Module):
    """The audio VAE decoder and the vocoder, one module for the `audio_decoder` stage."""

    def __init__(self, vae: LTX2AudioVAEDecoder, vocoder: nn.Module) -> None:
        super().__init__()
        self.vae = vae
        self.vocoder = vocoder

    @torch.no_grad()
    def forward(self, tokens: Tensor) -> Tensor:
        """[1, La, Ca*Ma] normalised audio tokens (float32) -> waveform [1, channels, samples]."""
        mel = self.vae.decode_tokens(tokens)
        weight = next(self.vocoder.parameters())
        return self.vocoder(mel.to(weight.dtype))


@register_runner("ltx2")
class LTX2Runner(DefaultRunner):
    """LTX-2 (19B) and LTX-2.3 (22B) distilled, text (and first frame) to video with audio."""

    TASKS = ("t2av", "i2av")
    SPATIAL_FACTOR = 64  # VAE 32x, stage 1 at half size
    TEMPORAL_FACTOR = 8
    #: The distilled release's defaults (diffusers' LTX2Pipeline: 512x768, 121 frames at 24 fps);
    #: the step count is the distilled table's and cannot change.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "infer_steps": len(DISTILLED_SIGMAS), "target_height": 512, "target_width": 768, "target_video_length": 121,
        "fps": 24, "sample_shift": 1.0, "sample_guide_scale": 1.0, "scheduler": "euler",
        "scheduler_spacing": "diffusers"}
    RESULT_KINDS = {"t2av": "video", "i2av": "video"}
    IMAGE_INPUTS: ClassVar[dict[str, tuple[str, ...]]] = {"t2av": (), "i2av": ("image_path",)}
    MODULE_PATHS = ("text_encoder_path", "upsampler_path")
    STREAM_MODULES: ClassVar[tuple[str, ...]] = ("text_encoder", "connectors", "transformer")
    STAGE_STEPS: ClassVar[tuple[int, int]] = (len(DISTILLED_SIGMAS), len(STAGE2_SIGMAS))  # flops.py: the time model
    #: H.264 CRF of the conditioning image (ltx-pipelines' default for the Gemma-3 generations 2.0 and 2.3).
    IMAGE_CRF: ClassVar[int] = 33
    DECODER_TILING: ClassVar[bool] = False  # whether `offload.vae_tiling` tiles the video decoder (LTX-2.5's)
    SYNTHETIC_LAYOUT = "diffusers"

    # ---- warmup opt-in (declared here; not inherited by subclasses) --------------------------
    WARMUP_TASKS: ClassVar[tuple[str, ...]] = ("t2av", "i2av")
    WARMUP_OFFLOAD_MODES: ClassVar[tuple[str, ...]] = ("none", "model", "block", "phase", "lazy_load")
    #: flavour -> (small, production) output shapes (height, width, frames); stage 1 runs at half size.
    WARMUP_SHAPES: ClassVar[dict[str, tuple[Shape, Shape]]] = {
        "debug": ((64, 64, 9), (128, 192, 17)),
        "debug-2.0": ((64, 64, 9), (128, 192, 17)),
        "19B": ((256, 384, 25), (512, 768, 121)),
        "22B": ((256, 384, 25), (512, 768, 121)),
    }

    def __init__(self, config: RunnerConfig) -> None:
        self._headers: dict[tuple[Any, ...], LTX2Checkpoint] = {}  # before loading: the plan's estimates read once
        super().__init__(config)
        config = self.config
        if config.enable_cfg:
            raise ValueError(f"`enable_cfg` must be false for {config.model_cls}: the distilled checkpoints are "
                             "trained without classifier-free guidance (set \"enable_cfg\": false)")
        if config.sample_sigmas is not None:
            raise ValueError(f"`sample_sigmas` is not used by {config.model_cls}: the distilled model runs its trained "
                             "sigma tables (DISTILLED_SIGMAS, STAGE2_SIGMAS of runnerkit/models/ltx2/runner.py): "
                             "remove it")
        if config.infer_steps != len(DISTILLED_SIGMAS):
            raise ValueError(f"`infer_steps` must be {len(DISTILLED_SIGMAS)} for {config.model_cls} (got "
                             f"{config.infer_steps}): the distilled model runs its trained table of "
                             f"{len(DISTILLED_SIGMAS)} stage-1 sigmas, then {len(STAGE2_SIGMAS)} stage-2 sigmas")
        if (config.scheduler, config.scheduler_spacing, config.sample_shift) != ("euler", "diffusers", 1.0):
            raise ValueError(f"{config.model_cls} samples with Euler on the distilled sigma tables as given: "
                             "`scheduler` 'euler', `scheduler_spacing` 'diffusers' and `sample_shift` 1.0 (got "
                             f"{config.scheduler!r}, {config.scheduler_spacing!r}, {config.sample_shift})")
        if config.offload.vae_tiling and not self.DECODER_TILING:
            raise NotImplementedError("`offload.vae_tiling` is not available for ltx2 (the video VAE decodes whole)")
        self.check_module_paths(config, files=not self.plan_only)
        if config.task == "i2av" and not self.plan_only and missing_pyav() is not None:  # a plan encodes nothing
            raise ValueError(missing_pyav())
        # The configured architecture; without `model`, the tiny one only for a synthetic checkpoint (a real
        # checkpoint's architecture is its own, read at load: None here, so nothing can take the tiny one for it)
        self.arch_override: LTX2Arch | None = None
        self.arch_source = ""  # planning without the checkpoint: where arch_override comes from (plan_sources.py)
        if self.checkpoints.absent():
            parsed = self.parse_arch(config.model) if config.model is not None else None
            self.arch_override, self.arch_source = configured_arch(config, parsed)
        elif config.model is not None or config.synthetic_checkpoint is not None:
            self.arch_override = self.parse_arch(config.model, partial=config.model_path is not None)
        self.checkpoint: LTX2Checkpoint | None = None
        self.tokenizer: Any = None
        self.vae_stats: tuple[Tensor, Tensor, float] | None = None

    @staticmethod
    def parse_arch(model: dict[str, Any] | None, partial: bool = False) -> LTX2Arch:
        """The config's `model` key as a validated LTX-2 architecture; without one, the tiny LTX-2.3
        pipeline architecture (`arch.tiny_pipeline_arch`), so a synthetic config may omit it (a config
        of a real checkpoint omits it too: the runner then reads the checkpoint's, see `__init__`).

        Raises:
            ValueError: naming each bad field as `model.<component>.<field>`.
        """
        if model is None:
            return tiny_pipeline_arch("2.3")
        return LTX2Arch.from_config_model(model, partial, "ltx2")

    @classmethod
    def lora_layers(cls, config: RunnerConfig, layout: str) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """The blocks' linear layers of `config.model`'s transformer (video, audio and cross-modal
        attention, feed-forwards); our names are diffusers' in every layout."""
        model = build_on_meta(lambda: LTX2Transformer(cls.parse_arch(config.model).transformer))
        return {n: (m.out_features, m.in_features) for n, m in linear_targets(model).items()
                if n.startswith("transformer_blocks.")}, {}

    # ---- modules that tests and tools look at ---------------------------------------------
    @property
    def transformer(self) -> LTX2Transformer | None:
        """The loaded transformer (None when built per stage: lazy_load, unload_modules)."""
        return self.modules.get("transformer")  # type: ignore[return-value]

    @property
    def streamer(self) -> BlockStreamer | None:
        """The transformer's block/phase streamer (None unless streaming)."""
        return self.streamers.get("transformer")

    # ---- synthetic checkpoints (runnerkit.tools.synth_checkpoint) ----------------------------
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = ("diffusers", "single_file")

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Write deterministic random weights of `config.model`'s architecture to the folder `out`
        (checkpoint_synthetic.py): `diffusers` (a checkpoint folder) or `single_file` (the release's
        `ltx2.safetensors`, `latent_upsampler.safetensors` and `text_encoder/` in `out`). Options:
        `replace`, `generator_device`, `fp8_blocks` ("plain" / "scaled": single_file only, the transformer
        blocks' linear weights as float8_e4m3fn, without or with `weight_scale`, as the fp8 releases).

        Without `model`: the tiny architecture for the runner's own synthetic checkpoint (written to
        `model_path` or the cache); a config that names another checkpoint (`model_path`: a real one,
        e.g. configs/ltx2/ltx23_*_22b_distilled.json given to the tool) gets that checkpoint's
        architecture, read from its headers.

        Raises:
            ValueError: `model` omitted and `model_path`'s checkpoint cannot be read: the
                architecture to write is unknown (naming `model`).
        """
        arch = cls.parse_arch(config.model)
        elsewhere = config.model_path is not None and Path(config.model_path).absolute() != Path(out).absolute()
        if config.model is None and elsewhere:
            try:
                arch = LTX2Checkpoint.open(config.model_path, config.upsampler_path, config.text_encoder_path).arch
            except CheckpointError as exc:
                raise ValueError(f"`model` is omitted, so the architecture is the checkpoint's at `model_path`, which "
                                 f"cannot be read ({exc}); to write a synthetic checkpoint, give `model` (e.g. "
                                 "`LTX23_22B_ARCH.model_dump(mode='json')` of runnerkit/models/ltx2/arch.py) or start "
                                 "from configs/ltx2/ltx2_t2av_tiny.json") from None
        write_synthetic_ltx2(arch, out, seed, dtype, layout,  # type: ignore[arg-type]
                             replace=options.get("replace", False),
                             generator_device=options.get("generator_device") or "cpu",
                             fp8_blocks=options.get("fp8_blocks") or "none")

    # ---- loading -----------------------------------------------------------------------
    def open_checkpoint(self, path: Path, raw: bool = False) -> LTX2Checkpoint:
        """The checkpoint at `path` (a folder, or a single file with the configured upsampler and Gemma-3
        folder) with its own architecture; the config's `model` must agree with it (`open_checked`) unless `raw`."""
        cfg = self.config
        key = (path, raw, cfg.upsampler_path, cfg.text_encoder_path)
        if self.checkpoint is None and self._headers.get(key) is not None:  # before loading: read once for the plan
            return self._headers[key]
        ckpt = open_checked(lambda a: LTX2Checkpoint.open(path, cfg.upsampler_path, cfg.text_encoder_path, arch=a),
                            path, None if raw else cfg.model, lambda: self.parse_arch(cfg.model))
        if self.checkpoint is None:
            self._headers = {key: ckpt}
        return ckpt

    def prepare_load(self) -> None:
        """Checkpoint (written first if synthetic) and its architecture into the config, the tokenizer,
        the video VAE's latent statistics (the transition needs them, the VAE may be elsewhere).

        Raises:
            CheckpointError: the checkpoint is missing or damaged, naming the file.
            NotImplementedError: a timestep-conditioned video VAE (no release has one).
        """
        self._headers = {}  # the load reads the checkpoint afresh
        self.checkpoint = ckpt = self.checkpoints.locate()
        if ckpt.arch.vae.timestep_conditioning:
            raise NotImplementedError("a timestep-conditioned LTX-2 video VAE is not supported (no release has one)")
        logger.info("checkpoint {} ({} layout, LTX-{}), flavour {}", ckpt.path, ckpt.layout, ckpt.arch.release,
                    flavour_of(ckpt.arch))
        self.update_config(model=ckpt.arch.model_dump(mode="json"), model_path=str(ckpt.path))
        self.tokenizer = self.load_tokenizer(ckpt)
        stats = ckpt.read_tensors("vae", ["latents_mean", "latents_std"])
        self.vae_stats = (stats["latents_mean"].float(), stats["latents_std"].float(), ckpt.arch.vae.scaling_factor)

    check_module_paths = staticmethod(check_paths)  # `text_encoder_path`, `upsampler_path` (plan_sources.py)

    def load_tokenizer(self, ckpt: LTX2Checkpoint) -> Any:
        """The Gemma tokenizer of `ckpt` (`text_encoder.load_gemma_tokenizer` of its tokenizer folder)."""
        from runnerkit.models.ltx2 import text_encoder as te

        return te.load_gemma_tokenizer(ckpt.tokenizer_path)

    def attention_head_dim(self) -> int:
        """The video stream's head size (128 in both releases; the audio stream's is 64)."""
        assert self.checkpoint is not None, "prepare_load first"
        return self.checkpoint.arch.transformer.attention_head_dim

    def _load(self, component: str, device: torch.device) -> nn.Module:
        assert self.checkpoint is not None, "prepare_load first"
        return self.checkpoint.load(component, self.dtype, device).eval().requires_grad_(False)

    def build_text_encoder(self, device: torch.device) -> nn.Module:
        from runnerkit.models.ltx2 import text_encoder as te

        assert self.checkpoint is not None, "prepare_load first"
        ckpt = self.checkpoint
        return te.load_gemma_text_encoder(ckpt.text_encoder_path, self.dtype, device, connectors=ckpt.arch.connectors)

    def stream_text_encoder(self) -> tuple[nn.Module, BlockStreamer]:
        """Gemma-3 with its layers (or their attention and MLP, mode "phase") streamed from host memory
        or its folder's safetensors (`offload.stream_modules` lists "text_encoder")."""
        from runnerkit.models.ltx2 import text_encoder as te

        assert self.checkpoint is not None, "prepare_load first"
        ckpt = self.checkpoint
        return te.stream_gemma_text_encoder(ckpt.text_encoder_path, self.config.offload, self.device, self.dtype,
                                            connectors=ckpt.arch.connectors)

    def build_audio_decoder(self, device: torch.device) -> nn.Module:
        return AudioDecoder(self._load("audio_vae", device), self._load("vocoder", device)).eval()  # type: ignore[arg-type]

    def stream_transformer(self) -> tuple[LTX2Transformer, BlockStreamer]:
        """The transformer with its blocks (or phases) streamed from host memory or the checkpoint file(s)."""
        ckpt = self.checkpoint
        assert ckpt is not None, "prepare_load first"
        model = build_on_meta(lambda: LTX2Transformer(ckpt.arch.transformer))
        return model, self._stream_network("transformer", model, LTX2Transformer.STREAM_SPEC)

    def stream_connectors(self) -> tuple[LTX2TextConnectors, BlockStreamer]:
        """The text connectors with their 1D blocks (video connector's, then audio's; or their attention
        and MLP, mode "phase") streamed from host memory or the checkpoint file(s) (`offload.stream_modules`
        lists "connectors"); projections and registers resident."""
        ckpt = self.checkpoint
        assert ckpt is not None, "prepare_load first"
        model = build_on_meta(lambda: LTX2TextConnectors(ckpt.arch.connectors))
        return model, self._stream_network("connectors", model, LTX2TextConnectors.STREAM_SPEC)

    def _stream_network(self, component: str, model: nn.Module, spec: StreamSpec) -> BlockStreamer:
        """`stream_module` of meta-built `model` (`component` of the checkpoint): storage cpu from its state
        dict, handed over (fp8 weights read as stored, each upcast as a resident load does and freed once
        copied), storage disk from its file(s). `model` is left in eval mode without gradients."""
        ckpt = self.checkpoint
        assert ckpt is not None, "prepare_load first"
        off = self.config.offload
        if off.storage == "cpu":
            tensors, scales = ckpt.state_dict(component)
            streamer = stream_module(model, spec, off, self.device, self.dtype, component, state_dict=tensors,
                                     scales=scales, consume=True)
        else:
            files, key_map, scale_map = ckpt.stream_sources(component, model)
            streamer = stream_module(model, spec, off, self.device, self.dtype, component, files=files,
                                     key_map=key_map, shared_files=ckpt.layout == "single_file", scale_map=scale_map)
        model.eval().requires_grad_(False)
        return streamer

    def describe_pipeline(self) -> Pipeline:
        """Gemma-3 -> connectors (-> VAE encoder of the first frame, i2av) -> stage1 -> upsampler ->
        stage2 -> video VAE decoder and audio decoder -> video with audio."""
        ckpt = self.checkpoint
        assert ckpt is not None, "prepare_load first"
        encoders = [EncoderStage("text_encoder", module="text_encoder", run=self.run_text_encoder),
                    EncoderStage("text_connectors", module="connectors", run=self.run_connectors)]
        if self.config.task == "i2av":
            encoders.append(EncoderStage("vae_encoder", module="vae", run=self.run_vae_encoder, per_shape=True))
        blocks = LTX2Transformer.STREAM_SPEC.blocks_attr
        euler = dict(scheduler="euler", shift=1.0, spacing="diffusers")
        return Pipeline(
            modules=(ModuleSpec("text_encoder", "text_encoder", build=self.build_text_encoder,
                                stream=self.stream_text_encoder),
                     ModuleSpec("connectors", "text_encoder", build=lambda d: self._load("connectors", d),
                                stream=self.stream_connectors),
                     ModuleSpec("transformer", "transformer", build=lambda d: self._load("transformer", d),
                                stream=self.stream_transformer, blocks=blocks),
                     ModuleSpec("latent_upsampler", "upsampler", build=lambda d: self._load("latent_upsampler", d)),
                     ModuleSpec("vae", "decoder", build=lambda d: self._load("vae", d)),
                     ModuleSpec("audio_decoder", "decoder", build=self.build_audio_decoder)),
            encoders=tuple(encoders),
            denoise=(DenoiseStage("stage1", transformers=("transformer",), steps=len(DISTILLED_SIGMAS),
                                  sigmas=DISTILLED_SIGMAS, latent_shape=lambda i: self.layout(i, 1).shape,
                                  noise_shapes=lambda i: self.layout(i, 1).noise_shapes(), **euler),
                     DenoiseStage("stage2", transformers=("transformer",), steps=len(STAGE2_SIGMAS),
                                  sigmas=STAGE2_SIGMAS, transition="latent_upsampler",
                                  latent_shape=lambda i: self.layout(i, 2).shape,
                                  noise_shapes=lambda i: self.layout(i, 2).noise_shapes(), **euler)),
            decoders=(DecoderStage("vae_decoder", module="vae", output="video", run=self.run_vae_decoder),
                      DecoderStage("audio_decoder", module="audio_decoder", output="audio", run=self.run_audio_decoder)),
            outputs=(OutputSpec("video", "video"), OutputSpec("audio", "audio", sample_rate=self.sample_rate())),
        )

    def sample_rate(self) -> int:
        """Waveform samples per second of the vocoder (24000 for LTX-2.0, 48000 for LTX-2.3)."""
        assert self.checkpoint is not None, "prepare_load first"
        return self.checkpoint.arch.vocoder.output_sampling_rate

    def flavour(self) -> str | None:
        """From the loaded checkpoint; before loading from its config (or the configured architecture
        of a synthetic checkpoint still to write)."""
        if self.checkpoint is not None:
            return flavour_of(self.checkpoint.arch)
        path = self.checkpoints.path()
        if self.checkpoints.arch_from_config(path):
            return flavour_of(self.arch_override) if self.arch_override is not None else None
        return flavour_of(self.open_checkpoint(path).arch)

    # ---- memory plan hooks (planning.py: before loading from headers, config or release sizes; flops.py) ----
    architecture = planning.architecture  # the checkpoint's LTX2Arch (EstimateUnavailable before loading)
    gemma_sizes = planning.gemma_sizes  # Gemma-3's sizes, from the text encoder folder's config.json
    fp8_transformer_weights = planning.fp8_transformer_weights  # transformer weights stored as float8_e4m3fn
    estimate_sources = planning.estimate_sources
    estimate_memory = planning.estimate_memory

    def denoise_flops(self, shape: Shape) -> tuple[StageFlops, ...]:
        """Both stages' step FLOPs at `shape` (flops.py `ltx2_denoise_flops`); raises as `architecture`."""
        return ltx2_denoise_flops(self.architecture(), self.config, shape, self.STAGE_STEPS)

    # ---- request stages ------------------------------------------------------------------
    def layouts(self, req: RequestState) -> tuple[JointLayout, JointLayout]:
        """Per denoise stage (`DenoiseStage.index`), request `req`'s joint latents; computed once per request."""
        if "ltx2.layouts" not in req.derived:
            req.derived["ltx2.layouts"] = (self.layout(req.info, 1), self.layout(req.info, 2))
        return req.derived["ltx2.layouts"]

    def layout(self, info: InputInfo, stage: int) -> JointLayout:
        """The joint latents of `stage` (1: half size; 2: full size) for request `info` (latents.py)."""
        assert self.checkpoint is not None, "prepare_load first"
        arch = self.checkpoint.arch
        scale = arch.vae.spatial_compression * (2 if stage == 1 else 1)  # stage 1 at half the output size
        frames = (info.frames - 1) // arch.vae.temporal_compression + 1
        audio = (arch.audio_vae.latent_channels, audio_latent_length(info.frames, self.config.fps, arch.audio_vae),
                 arch.audio_vae.latent_mel_bins)
        video = (arch.vae.latent_channels, frames, info.height // scale, info.width // scale)
        packed = stage == 2
        return JointLayout(video, audio, packed_video=packed and self.config.task == "t2av", packed_audio=packed)

    @torch.inference_mode()
    def run_text_encoder(self, req: RequestState) -> LTX2Inputs:
        """Prompt -> stacked Gemma-3 hidden states [1, T, D * (layers + 1)] and the tokenizer mask (every
        prompt padded to 1024 tokens, as diffusers: a new prompt never brings a new text length)."""
        from runnerkit.models.ltx2 import text_encoder as te

        encoder = te.GemmaPromptEncoder(self.tokenizer, req.modules["text_encoder"])
        hidden, mask = encoder.encode(req.info.prompt)
        return LTX2Inputs(text_hidden=hidden, text_mask=mask)

    @torch.inference_mode()
    def run_connectors(self, req: RequestState) -> LTX2Inputs:
        """Stacked hidden states -> the video and audio text contexts (model dtype)."""
        inputs = req.inputs
        assert inputs.text_hidden is not None and inputs.text_mask is not None, "run the text encoder first"
        from runnerkit.models.ltx2 import text_encoder as te

        connectors = req.modules["connectors"]
        weight = next(connectors.parameters())
        video, audio, mask = te.text_contexts(connectors, inputs.text_hidden.to(weight.device, weight.dtype),
                                              inputs.text_mask.to(weight.device))
        return LTX2Inputs(video_context=video.to(self.device, self.dtype), audio_context=audio.to(self.device, self.dtype),
                          context_mask=mask.to(self.device), image_latents=inputs.image_latents)

    def first_frame(self, info: InputInfo) -> Tensor:
        """i2av: the request's image (warmup: a grey ramp of the same size) re-compressed as one H.264
        frame at `IMAGE_CRF` (image_crf.recompress_h264, PyAV; Lightricks ltx-pipelines `media_io.preprocess`,
        diffusers 0.42.1 `ltx2.utils.apply_image_conditioning_crf`: LTX-2 is trained to condition on
        frames compressed like video), then resized
        bilinearly to the stage-1 size as diffusers' `VideoProcessor(resample="bilinear")` does (aspect
        ratio not kept: the output size is the request's): [1, 3, 1, h/2, w/2] in [-1, 1]."""
        from PIL import Image

        size = (info.width // 2, info.height // 2)
        if info.warmup or info.image_path is None:
            ramp = np.linspace(0, 255, size[0] * size[1] * 3).reshape(size[1], size[0], 3)
            picture = Image.fromarray(ramp.astype(np.uint8))
        else:
            picture = read_pil_image(info.image_path, "image_path")
        picture = Image.fromarray(recompress_h264(np.asarray(picture), self.IMAGE_CRF))
        pixels = np.asarray(picture.resize(size, Image.BILINEAR))
        image = torch.from_numpy(pixels.astype(np.float32) / 255.0).permute(2, 0, 1)  # [3, h, w] in [0, 1]
        return (image * 2.0 - 1.0)[None, :, None]

    @torch.inference_mode()
    def run_vae_encoder(self, req: RequestState) -> LTX2Inputs:
        """i2av: the first frame's normalised latents [1, C, 1, H1, W1] (float32), as diffusers' i2v
        `prepare_latents` encodes it (the image in the model dtype, the posterior mode)."""
        vae = req.modules["vae"]
        assert isinstance(vae, LTX2VideoVAE)
        latents = vae.encode(self.first_frame(req.info).to(self.dtype)).to(self.device)
        return LTX2Inputs(**{**req.inputs.__dict__, "image_latents": latents})

    def condition_latents(self, req: RequestState, stage: DenoiseStage, latents: Tensor,
                          init_latents: Tensor | None) -> Tensor:
        """i2av: the first latent frame is clean: the image's latents in stage 1, the upsampled stage-1
        frame in stage 2 (diffusers' `conditioning_mask`, noise scale 0 there)."""
        if self.config.task != "i2av":
            return latents
        layout, image = self.layouts(req)[stage.index], req.inputs.image_latents
        assert init_latents is not None or image is not None, "run the VAE encoder first"
        latents = latents.clone()  # the scheduler's start stays as drawn; it continues from the returned one
        video, _ = layout.split(latents)  # views into `latents` (5-D video part)
        clean = image if init_latents is None else layout.split(init_latents.to(video.device, torch.float32))[0][:, :, :1]
        video[:, :, :1] = clean.to(video.device, video.dtype)
        return latents

    @torch.inference_mode()
    def run_step(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: Tensor, timestep: Tensor,
                 step_index: int) -> Tensor:
        """One call of the audio+video transformer; returns the joint velocity [1, N] float32 (i2av: 0 on
        the clean first frame, which Euler then keeps bit for bit)."""
        inputs, layout = req.inputs, self.layouts(req)[stage.index]
        assert isinstance(inputs, LTX2Inputs), "run the encoders first"
        video, audio = layout.split(latents)
        C, F_, H, W = layout.video
        video_timestep, audio_timestep = timestep, None
        if self.config.task == "i2av":
            clean = torch.zeros(1, F_ * H * W, device=timestep.device, dtype=timestep.dtype)
            clean[:, : H * W] = 1.0
            video_timestep, audio_timestep = timestep[:, None] * (1 - clean), timestep
        v_video, v_audio = model(
            hidden_states=pack_video_latents(video), audio_hidden_states=pack_audio_latents(audio),
            encoder_hidden_states=inputs.video_context, audio_encoder_hidden_states=inputs.audio_context,
            timestep=video_timestep, audio_timestep=audio_timestep, sigma=timestep, num_frames=F_, height=H, width=W,
            audio_num_frames=layout.audio[1], fps=float(self.config.fps), encoder_attention_mask=inputs.context_mask,
            audio_encoder_attention_mask=inputs.context_mask)
        v_video = unpack_video_latents(v_video.float(), F_, H, W)
        if self.config.task == "i2av":
            v_video[:, :, :1] = 0.0
        return layout.join(v_video, unpack_audio_latents(v_audio.float(), layout.audio[2]))

    def run_transition(self, req: RequestState, stage: DenoiseStage, model: nn.Module, latents: Tensor) -> Tensor:
        """Stage-1 joint latents -> stage 2's start: the video latents upsampled x2 by the latent
        upsampler (de-normalised, upsampled, normalised again), the audio latents as they are."""
        assert self.vae_stats is not None
        video, audio = self.layouts(req)[stage.index - 1].split(latents)
        mean, std, scaling = self.vae_stats
        with torch.inference_mode():
            up = upsample_normalized_latents(model, video, mean, std, scaling)  # type: ignore[arg-type]
        return self.layouts(req)[stage.index].join(up.float().to(latents.device), audio)

    @torch.inference_mode()
    def run_vae_decoder(self, req: RequestState, latents: Tensor) -> Tensor:
        """Final joint latents -> video [1, 3, F, H, W] in [-1, 1] (float32)."""
        video, _ = self.layouts(req)[-1].split(latents)  # the last stage's
        vae = req.modules["vae"]
        assert isinstance(vae, LTX2VideoVAE)
        return vae.decode(video.to(self.dtype)).float().clamp(-1.0, 1.0)

    @torch.inference_mode()
    def run_audio_decoder(self, req: RequestState, latents: Tensor) -> Tensor:
        """Final joint latents -> waveform [1, channels, samples] in [-1, 1] (float32)."""
        _, audio = self.layouts(req)[-1].split(latents)  # the last stage's
        return req.modules["audio_decoder"](pack_audio_latents(audio.float())).float().clamp(-1.0, 1.0)

    def plan_steps_per_request(self) -> int:
        """Stage 1's distilled steps + stage 2's (the transformer runs in both)."""
        return len(DISTILLED_SIGMAS) + len(STAGE2_SIGMAS)

    def warmup_steps(self, req: RequestState, stage: DenoiseStage, sched: Scheduler) -> list[int]:
        """Each stage's first and last step (the last lands on sigma 0)."""
        return sorted({0, sched.infer_steps - 1})

    def clear_request_state(self) -> None:
        """RoPE tables are request state: the resident transformer's, and those of a transformer built per request
        (`lazy_load`) while a hold keeps it on the device across request states (warmup's frame-count sweep)."""
        live = self.placement.live_per_stage.values() if self.placement is not None else ()
        for module in (self.transformer, *live):
            if isinstance(module, LTX2Transformer):
                module.clear_cache()

