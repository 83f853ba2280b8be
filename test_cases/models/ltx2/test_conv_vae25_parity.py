"""The LTX-2.5 runner with `video_decoder` "conv" end to end against diffusers 0.42.1, the frame count omitted.

diffusers decodes LTX-2.5 with the convolutional VAE (`AutoencoderKLLTX2Video`, the pipeline's `vae`) when
`LTX2Pipeline`'s stage 2 is asked for pixels (`output_type` "pt" instead of "latent", so no
`LTX2VideoDiffusionDecodePipeline`): the chain of test_runner25_parity.py with that last call. Same tiny random
weights (the runner's synthetic diffusers folder), seed and CPU generator; float32; the decoded video within 1e-4,
the predicted frame count equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig
from runnerkit.models.ltx2.runner import DISTILLED_SIGMAS, STAGE2_SIGMAS
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import report
from test_cases.models.ltx2.test_runner25_parity import CONFIG, FLEX_EAGER, GUIDANCE_OFF, PROMPT, TOL, run_ours

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")


@pytest.mark.filterwarnings(FLEX_EAGER)
def test_t2av_conv_decode_matches_diffusers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_cases.models.ltx2.test_runner25_parity import reference_pipelines

    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "conv.json"
    config.write_text(json.dumps(json.loads(CONFIG.read_text()) | {"video_decoder": "conv"}))
    out = tmp_path / "ours.safetensors"
    runner, _, _ = run_ours(config, RequestConfig(prompt=PROMPT, seed=7, save_tensor_path=str(out)), monkeypatch)
    assert "diffusion_decoder" not in runner.modules
    ours = load_file(out)["video"]  # [3, F, H, W] in [-1, 1]
    cfg = runner.config
    h, w = cfg.target_height, cfg.target_width
    pipe, upsample, _ = reference_pipelines(Path(cfg.model_path))
    assert not pipe.vae.config.timestep_conditioning  # no decode noise: the generator is not drawn from
    g = torch.Generator().manual_seed(7)
    low, high = runner.duration_bounds(cfg)
    common = dict(prompt=PROMPT, frame_rate=float(cfg.fps), generator=g, return_dict=False, **GUIDANCE_OFF)
    with torch.inference_mode():
        video, audio = pipe(height=h // 2, width=w // 2, num_inference_steps=len(DISTILLED_SIGMAS),
                            sigmas=list(DISTILLED_SIGMAS), min_seconds=low, max_seconds=high, output_type="latent",
                            **common)
        frames = (video.shape[2] - 1) * pipe.vae_temporal_compression_ratio + 1
        video = upsample(latents=video, height=h, width=w, num_frames=frames, output_type="latent",
                         return_dict=False)[0]
        pixels, _ = pipe(latents=video, audio_latents=audio, height=h, width=w, num_frames=frames,
                         noise_scale=STAGE2_SIGMAS[0], num_inference_steps=len(STAGE2_SIGMAS),
                         sigmas=list(STAGE2_SIGMAS), output_type="pt", **common)  # [1, F, 3, H, W] in [0, 1]
    assert frames == ours.shape[1] == 25  # the bounds allow 9 to 33: the prediction
    assert report("conv-decoded video", ours[None] / 2 + 0.5, pixels.permute(0, 2, 1, 3, 4)) <= TOL
