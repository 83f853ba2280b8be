"""The LTX-2 runner end to end against diffusers 0.42.1's documented distilled two-stage chain.

Same tiny random weights (the runner's synthetic diffusers folder, loaded by diffusers'
`from_pretrained`), same seed, no injected noise: `LTX2Pipeline` (distilled sigmas, no CFG,
`output_type="latent"`) -> `LTX2LatentUpsamplePipeline` -> `LTX2Pipeline` on the stage-2 sigmas with
`noise_scale` = their first sigma and the stage-1 audio latents, one CPU generator throughout, as
the runner draws its noise (video then audio, per stage). float32; video and audio compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.ltx2.arch import tiny_pipeline_arch
from runnerkit.models.ltx2.runner import DISTILLED_SIGMAS, STAGE2_SIGMAS, LTX2Runner
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import report
from test_cases.models.ltx2.test_image_crf import picture

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "ltx2"
PROMPT = "a red fox runs through fresh snow, wind howls"


def runner_for(task: str, tmp: Path, version: str = "2.3", **overrides: Any) -> LTX2Runner:
    path = CONFIGS / f"ltx2_{task}_tiny.json"
    if version == "2.0":  # the shipped tiny configs are LTX-2.3's: the same with the tiny 2.0 pipeline
        raw = json.loads(path.read_text()) | {"model": tiny_pipeline_arch("2.0").model_dump(mode="json")}
        path = tmp / f"ltx2_{task}_tiny_2.0.json"
        path.write_text(json.dumps(raw))
    config = load_runner_config(path, {"device": "cpu", **overrides})
    runner = LTX2Runner(config)
    runner.init_modules()
    return runner


def diffusers_pipelines(folder: Path) -> tuple[Any, Any]:
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline, LTX2Pipeline
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    vocoder_cls = LTX2VocoderWithBWE if "WithBWE" in (folder / "vocoder" / "config.json").read_text() else LTX2Vocoder
    vae = diffusers.AutoencoderKLLTX2Video.from_pretrained(folder / "vae")
    pipe = LTX2Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
        vae=vae, audio_vae=diffusers.AutoencoderKLLTX2Audio.from_pretrained(
            # the synthetic folder has no audio encoder (never used here): with `accelerate` installed (peft
            # brings it) diffusers would leave those weights on the meta device, and the pipeline's
            # execution device, taken from its modules' parameters, would be meta
            folder / "audio_vae", low_cpu_mem_usage=False),
        text_encoder=transformers.Gemma3TextModel.from_pretrained(folder / "text_encoder"),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder / "tokenizer"),
        connectors=LTX2TextConnectors.from_pretrained(folder / "connectors"),
        transformer=diffusers.LTX2VideoTransformer3DModel.from_pretrained(folder / "transformer"),
        vocoder=vocoder_cls.from_pretrained(folder / "vocoder"))
    upsample = LTX2LatentUpsamplePipeline(vae=vae, latent_upsampler=LTX2LatentUpsamplerModel.from_pretrained(
        folder / "latent_upsampler"))
    return pipe, upsample


def reference_two_stage(pipe: Any, upsample: Any, seed: int, height: int, width: int, frames: int,
                        fps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' chain; returns stage 2's final latents as `output_type="latent"` gives them: video
    [1, C, F, H, W] and audio [1, Ca, La, Ma], both de-normalised."""
    g = torch.Generator().manual_seed(seed)
    # every guidance off (0.42.1's defaults are the LTX-2.5 dev model's: CFG, STG, modality guidance)
    guidance = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    common = dict(prompt=PROMPT, num_frames=frames, frame_rate=float(fps), generator=g, return_dict=False,
                  output_type="latent", **guidance)
    video, audio = pipe(height=height // 2, width=width // 2, num_inference_steps=len(DISTILLED_SIGMAS),
                        sigmas=list(DISTILLED_SIGMAS), **common)
    video = upsample(latents=video, height=height, width=width, num_frames=frames, output_type="latent",
                     return_dict=False)[0]
    return pipe(latents=video, audio_latents=audio, height=height, width=width, noise_scale=STAGE2_SIGMAS[0],
                num_inference_steps=len(STAGE2_SIGMAS), sigmas=list(STAGE2_SIGMAS), **common)


def check_t2av_parity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The family contract's parity hook (test_ltx2_runner.py::TestFamilyContract). Final latents, decoded video and the audio spectrogram within 1e-4 of diffusers' chain; the
    waveform is compared through the spectrogram: the random-weight vocoder turns a 1e-6 change of
    its input into ~3e-3 at its output (its parity on one input is exact: test_audio.py)."""
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    runner = runner_for("t2av", tmp_path)
    finals: list[torch.Tensor] = []
    run_denoise = runner.run_denoise
    monkeypatch.setattr(runner, "run_denoise", lambda info, warmup=False: finals.append(run_denoise(info, warmup)) or finals[-1])
    out = tmp_path / "ours.safetensors"
    runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=7, save_tensor_path=str(out)))
    ours = load_file(out)
    cfg = runner.config
    h, w, f = cfg.target_height, cfg.target_width, cfg.target_video_length
    info = type("Shape", (), {"height": h, "width": w, "frames": f})()
    video, audio = runner.layout(info, 2).split(finals[0])  # normalised
    pipe, upsample = diffusers_pipelines(Path(cfg.model_path))
    with torch.inference_mode():
        ref_video, ref_audio = reference_two_stage(pipe, upsample, 7, h, w, f, cfg.fps)
        vae, audio_vae = pipe.vae, pipe.audio_vae
        raw_video = video * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor \
            + vae.latents_mean.view(1, -1, 1, 1, 1)
        assert report("stage-2 video latents", raw_video, ref_video) <= 1e-4
        tokens = audio.transpose(1, 2).flatten(2, 3) * audio_vae.latents_std + audio_vae.latents_mean
        assert report("stage-2 audio latents", tokens.unflatten(2, (audio.shape[1], -1)).transpose(1, 2),
                      ref_audio) <= 1e-4
        ref_pixels = vae.decode(ref_video, None, return_dict=False)[0]  # the pipeline's decode (no timestep)
        assert report("video", ours["video"], ref_pixels[0].clamp(-1, 1)) <= 1e-4
        ref_mel = audio_vae.decode(ref_audio, return_dict=False)[0]
        our_mel = runner.modules["audio_decoder"].vae.decode_tokens(audio.transpose(1, 2).flatten(2, 3))
        assert report("spectrogram", our_mel, ref_mel) <= 1e-4
        assert torch.equal(ours["audio"], runner.modules["audio_decoder"].vocoder(our_mel)[0].clamp(-1, 1))


@pytest.mark.parametrize("version", ["2.3", "2.0"])
def test_i2av_two_stage_matches_diffusers(version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """i2av through `LTX2ImageToVideoPipeline` (both stages: the clean first latent frame, per-token
    timesteps 0 there), the first frame H.264 re-compressed on both sides at the runner's CRF (33; PyAV in
    both: test_image_crf.py compares that step alone), from a picture whose colours and noise the
    re-compression changes. The audio<->video
    AdaLN follows the checkpoint's version: LTX-2.3 diffusers' default `use_cross_timestep=True`, LTX-2.0
    its legacy `use_cross_timestep=False` (the per-token video timesteps of i2av tell them apart)."""
    from PIL import Image
    from diffusers.pipelines.ltx2 import LTX2ImageToVideoPipeline

    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    require_reference("av")
    image = tmp_path / "first.png"
    Image.fromarray(picture(80, 120)).save(image)
    runner = runner_for("i2av", tmp_path, version)
    finals: list[torch.Tensor] = []
    run_denoise = runner.run_denoise
    monkeypatch.setattr(runner, "run_denoise", lambda info, warmup=False: finals.append(run_denoise(info, warmup)) or finals[-1])
    runner.run_pipeline(RequestConfig(prompt=PROMPT, seed=5, image_path=str(image)))
    cfg = runner.config
    h, w, f = cfg.target_height, cfg.target_width, cfg.target_video_length
    info = type("Shape", (), {"height": h, "width": w, "frames": f})()
    video, audio = runner.layout(info, 2).split(finals[0])
    t2v, upsample = diffusers_pipelines(Path(cfg.model_path))
    pipe = LTX2ImageToVideoPipeline(**{k: getattr(t2v, k) for k in (
        "scheduler", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "transformer", "vocoder")})
    g = torch.Generator().manual_seed(5)
    guidance = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    common = dict(image=Image.open(image), prompt=PROMPT, num_frames=f, frame_rate=float(cfg.fps), generator=g,
                  return_dict=False, output_type="latent", image_crf=LTX2Runner.IMAGE_CRF,
                  use_cross_timestep=version == "2.3", **guidance)
    with torch.inference_mode():
        ref_video, ref_audio = pipe(height=h // 2, width=w // 2, num_inference_steps=len(DISTILLED_SIGMAS),
                                    sigmas=list(DISTILLED_SIGMAS), **common)
        ref_video = upsample(latents=ref_video, height=h, width=w, num_frames=f, output_type="latent",
                             return_dict=False)[0]
        ref_video, ref_audio = pipe(latents=ref_video, audio_latents=ref_audio, height=h, width=w,
                                    noise_scale=STAGE2_SIGMAS[0], num_inference_steps=len(STAGE2_SIGMAS),
                                    sigmas=list(STAGE2_SIGMAS), **common)
    vae, audio_vae = t2v.vae, t2v.audio_vae
    raw_video = video * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor \
        + vae.latents_mean.view(1, -1, 1, 1, 1)
    assert report("i2av stage-2 video latents", raw_video, ref_video) <= 1e-4
    tokens = audio.transpose(1, 2).flatten(2, 3) * audio_vae.latents_std + audio_vae.latents_mean
    assert report("i2av stage-2 audio latents", tokens.unflatten(2, (audio.shape[1], -1)).transpose(1, 2),
                  ref_audio) <= 1e-4
