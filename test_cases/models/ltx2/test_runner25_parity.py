"""The LTX-2.5 runner end to end against diffusers 0.42.1's LTX-2.5 chain, the frame count omitted.

Same tiny random weights (the runner's synthetic diffusers folder, loaded by diffusers' `from_pretrained`:
Gemma-4 as `Gemma4UnifiedForConditionalGeneration`, the duration head, the diffusion decoder), same
seed, one CPU generator throughout, as the runner draws: `LTX2Pipeline` with its `duration_head` and no
`num_frames` (the flavour's duration bounds as `min_seconds` / `max_seconds`, distilled sigmas, no
guidance, `output_type="latent"`) -> `LTX2LatentUpsamplePipeline` -> `LTX2Pipeline` stage 2 at the
predicted count -> `LTX2VideoDiffusionDecodePipeline` (its noise the generator's next draw) and the
audio VAE decode. float32; stage latents, decoded video and mel spectrogram within 1e-4; the
predicted frame count equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.ltx2.runner import DISTILLED_SIGMAS, STAGE2_SIGMAS
from runnerkit.models.ltx2.runner25 import LTX25Runner
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import report

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ltx2" / "ltx25_t2av_tiny.json"
PROMPT = "a red fox runs through fresh snow, wind howls"
TOL = 1e-4
GUIDANCE_OFF = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0,
                "modality_scale": 1.0, "audio_modality_scale": 1.0, "guidance_rescale": 0.0,
                "audio_guidance_rescale": 0.0}
"""Every guidance off (0.42.1's defaults are the LTX-2.5 dev model's: CFG, STG, modality guidance)."""


def reference_pipelines(folder: Path) -> tuple[Any, Any, Any]:
    """diffusers' LTX-2.5 pipelines on the runner's synthetic folder: (LTX2Pipeline with the duration
    head, the latent upsample pipeline, the diffusion decode pipeline)."""
    from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoDiffusionDecoderModel
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline, LTX2Pipeline
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.duration_head import LTX2DurationHead
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.pipeline_ltx2_diffusion_decode import LTX2VideoDiffusionDecodePipeline
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    vae = diffusers.AutoencoderKLLTX2Video.from_pretrained(folder / "vae")
    pipe = LTX2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
        vae=vae,
        audio_vae=diffusers.AutoencoderKLLTX2Audio.from_pretrained(folder / "audio_vae", low_cpu_mem_usage=False),
        text_encoder=transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(folder / "text_encoder"),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder / "tokenizer"),
        connectors=LTX2TextConnectors.from_pretrained(folder / "connectors"),
        transformer=diffusers.LTX2VideoTransformer3DModel.from_pretrained(folder / "transformer"),
        vocoder=LTX2VocoderWithBWE.from_pretrained(folder / "vocoder"),
        duration_head=LTX2DurationHead.from_pretrained(folder / "duration_head"))
    upsample = LTX2LatentUpsamplePipeline(vae=vae, latent_upsampler=LTX2LatentUpsamplerModel.from_pretrained(
        folder / "latent_upsampler"))
    decode = LTX2VideoDiffusionDecodePipeline(
        diffusion_decoder=LTX2VideoDiffusionDecoderModel.from_pretrained(folder / "diffusion_decoder"),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())
    for p in (pipe, upsample, decode):
        p.set_progress_bar_config(disable=True)
    return pipe, upsample, decode


def reference_chain(folder: Path, seed: int, height: int, width: int, fps: int,
                    bounds: tuple[float, float]) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(predicted frames, stage-2 video latents [1, C, F, H, W] and audio latents [1, Ca, La, Ma] de-normalised,
    decoded pixels [1, 3, F, H, W] in [0, 1], the LTX2Pipeline) of diffusers' chain."""
    pipe, upsample, decode = reference_pipelines(folder)
    g = torch.Generator().manual_seed(seed)
    common = dict(prompt=PROMPT, frame_rate=float(fps), generator=g, return_dict=False, output_type="latent",
                  **GUIDANCE_OFF)
    video, audio = pipe(height=height // 2, width=width // 2, num_inference_steps=len(DISTILLED_SIGMAS),
                        sigmas=list(DISTILLED_SIGMAS), min_seconds=bounds[0], max_seconds=bounds[1], **common)
    frames = (video.shape[2] - 1) * pipe.vae_temporal_compression_ratio + 1
    video = upsample(latents=video, height=height, width=width, num_frames=frames, output_type="latent",
                     return_dict=False)[0]
    video, audio = pipe(latents=video, audio_latents=audio, height=height, width=width, num_frames=frames,
                        noise_scale=STAGE2_SIGMAS[0], num_inference_steps=len(STAGE2_SIGMAS),
                        sigmas=list(STAGE2_SIGMAS), **common)
    pixels = decode(video, generator=g, output_type="pt", denormalize=False).frames  # [1, F, 3, H, W]
    return frames, video, audio, pixels.permute(0, 2, 1, 3, 4), pipe


def run_ours(config: Path, request: RequestConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[LTX25Runner, Any, Any]:
    """The runner on `config` (CPU) serving `request`: (runner, stage 2's final video latents, audio latents),
    normalised, split by stage 2's layout."""
    runner = LTX25Runner(load_runner_config(config, {"device": "cpu"}))
    runner.init_modules()
    finals: list[torch.Tensor] = []
    run_denoise = runner.run_denoise
    monkeypatch.setattr(runner, "run_denoise",
                        lambda req, warmup=False: finals.append(run_denoise(req, warmup)) or finals[-1])
    layouts: list[Any] = []
    layouts_of = runner.layouts
    monkeypatch.setattr(runner, "layouts", lambda req: layouts.append(layouts_of(req)) or layouts[-1])
    runner.run_pipeline(request)
    video, audio = layouts[-1][1].split(finals[0])
    return runner, video, audio


FLEX_EAGER = "ignore:flex_attention called without torch.compile"


@pytest.mark.filterwarnings(FLEX_EAGER)
def test_t2av_frames_omitted_matches_diffusers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ours.safetensors"
    runner, video, audio = run_ours(CONFIG, RequestConfig(prompt=PROMPT, seed=7, save_tensor_path=str(out)),
                                    monkeypatch)
    ours = load_file(out)
    cfg = runner.config
    h, w = cfg.target_height, cfg.target_width
    with torch.inference_mode():
        frames, ref_video, ref_audio, ref_pixels, pipe = reference_chain(
            Path(cfg.model_path), 7, h, w, cfg.fps, runner.duration_bounds(cfg))
        assert frames == ours["video"].shape[1] == 25  # the bounds allow 9 to 33: the prediction, not the bound
        vae, audio_vae = pipe.vae, pipe.audio_vae
        raw_video = video * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor \
            + vae.latents_mean.view(1, -1, 1, 1, 1)
        assert report("stage-2 video latents", raw_video, ref_video) <= TOL
        tokens = audio.transpose(1, 2).flatten(2, 3) * audio_vae.latents_std + audio_vae.latents_mean
        assert report("stage-2 audio latents", tokens.unflatten(2, (audio.shape[1], -1)).transpose(1, 2),
                      ref_audio) <= TOL
        assert report("diffusion-decoded video", ours["video"][None] / 2 + 0.5, ref_pixels) <= TOL
        ref_mel = audio_vae.decode(ref_audio, return_dict=False)[0]
        our_mel = runner.modules["audio_decoder"].vae.decode_tokens(audio.transpose(1, 2).flatten(2, 3))
        assert report("spectrogram", our_mel, ref_mel) <= TOL


@pytest.mark.filterwarnings(FLEX_EAGER)
def test_i2av_frames_omitted_matches_diffusers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """i2av through `LTX2ImageToVideoPipeline` with the duration head (both stages: the clean first latent
    frame), the first frame re-compressed at diffusers' default CRF for a Gemma-4 text encoder
    (`resolve_default_image_crf`: 18, not passed here) and at the runner's `IMAGE_CRF`; final latents
    within 1e-4, the predicted count equal."""
    from diffusers.pipelines.ltx2 import LTX2ImageToVideoPipeline
    from PIL import Image

    from test_cases.models.ltx2.test_image_crf import picture

    require_reference("av")
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    image = tmp_path / "first.png"
    Image.fromarray(picture(80, 120)).save(image)
    out = tmp_path / "ours.safetensors"
    request = RequestConfig(prompt=PROMPT, seed=5, image_path=str(image), save_tensor_path=str(out))
    runner, video, audio = run_ours(CONFIG.with_name("ltx25_i2av_tiny.json"), request, monkeypatch)
    cfg = runner.config
    h, w = cfg.target_height, cfg.target_width
    t2v, upsample, _ = reference_pipelines(Path(cfg.model_path))
    pipe = LTX2ImageToVideoPipeline(**{k: getattr(t2v, k) for k in (
        "scheduler", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "transformer", "vocoder",
        "duration_head")})
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(5)
    low, high = runner.duration_bounds(cfg)
    common = dict(image=Image.open(image), prompt=PROMPT, frame_rate=float(cfg.fps), generator=g, return_dict=False,
                  output_type="latent", **GUIDANCE_OFF)
    with torch.inference_mode():
        ref_video, ref_audio = pipe(height=h // 2, width=w // 2, num_inference_steps=len(DISTILLED_SIGMAS),
                                    sigmas=list(DISTILLED_SIGMAS), min_seconds=low, max_seconds=high, **common)
        frames = (ref_video.shape[2] - 1) * 8 + 1
        ref_video = upsample(latents=ref_video, height=h, width=w, num_frames=frames, output_type="latent",
                             return_dict=False)[0]
        ref_video, ref_audio = pipe(latents=ref_video, audio_latents=ref_audio, height=h, width=w, num_frames=frames,
                                    noise_scale=STAGE2_SIGMAS[0], num_inference_steps=len(STAGE2_SIGMAS),
                                    sigmas=list(STAGE2_SIGMAS), **common)
    assert frames == load_file(out)["video"].shape[1] == 25
    vae, audio_vae = t2v.vae, t2v.audio_vae
    raw_video = video * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor \
        + vae.latents_mean.view(1, -1, 1, 1, 1)
    assert report("i2av stage-2 video latents", raw_video, ref_video) <= TOL
    tokens = audio.transpose(1, 2).flatten(2, 3) * audio_vae.latents_std + audio_vae.latents_mean
    assert report("i2av stage-2 audio latents", tokens.unflatten(2, (audio.shape[1], -1)).transpose(1, 2),
                  ref_audio) <= TOL
