"""End-to-end parity of the Wan2.1 text-to-video runner with diffusers' `WanPipeline` (the family
contract's parity hook, `check_parity`, run by test_offload.py::TestFamilyContract).

The module tests (transformer, text encoder, VAE, schedulers) compare one piece at a time; this
one runs the whole request path of both libraries on the same weights and compares the decoded
videos, so a wrong stitch between the pieces (CFG combine, the sampler's schedule or update, the
initial noise, the text embeddings each branch gets, latent un-normalization) fails here.

runnerkit runs with `scheduler_spacing` "diffusers" here: diffusers' schedulers space their
sigmas unlike the Wan2.1 reference, whose spacing ("train_range") is the family's default
(test_cases/schedulers/test_spacing.py checks that one against the reference's own numbers).

Both sides read one synthetic checkpoint in the diffusers layout (the tiny `debug`
architecture, float32, CPU), written by runnerkit's own `write_synthetic`: runnerkit through its
checkpoint loader, diffusers/transformers through their own classes. The initial noise is drawn
here from the documented contract (float32 on a CPU `torch.Generator` seeded with the request
seed, one `randn` of the latent shape; `runnerkit/schedulers/base.py`) and handed to diffusers
as `latents=`; it is never read from runnerkit.

Text embeddings: runnerkit trims each prompt's embeddings to its token count and the
transformer zero-pads them to `text_len`; diffusers trims and zero-pads in
`_get_t5_prompt_embeds`. Both equal Wan2.1 (`T5EncoderModel.__call__` trims, `WanModel.forward`
zero-pads), so the transformer sees the same context on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import write_synthetic
from runnerkit.registry import get_runner_cls
from test_cases._reference import require_reference
from test_cases.conftest import TINY_CONFIG, tiny_config_dict

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")

# Non-square (catches a height/width swap), smallest frames > 1 latent frame (4n + 1 = 5 -> 2).
HEIGHT, WIDTH, FRAMES = 32, 48, 5
STEPS = 6  # >= 3: UniPC reaches its second-order predictor and corrector
GUIDANCE = 5.0
SEED = 7
PROMPT = "a red fox running through fresh snow"
NEGATIVE_PROMPT = "blurry, low quality"  # explicit on both sides (runnerkit's default is Wan's Chinese one)
TOLERANCE = 1e-4  # max abs difference of the videos in [-1, 1]

TINY = json.loads(TINY_CONFIG.read_text())
ARCH = WanArch.model_validate(TINY["model"])
SHIFT = float(TINY["sample_shift"])


def diffusers_checkpoint(folder: Path) -> Path:
    """The tiny architecture's random weights in the diffusers layout, float32."""
    return write_synthetic(ARCH, folder / "wan_tiny_diffusers", seed=0, dtype=torch.float32, layout="diffusers")


def _diffusers_model(cls: Any, folder: Path) -> torch.nn.Module:
    """Build `cls` from `folder`'s config.json and load its single safetensors file strictly.

    (`from_pretrained` needs `accelerate` for these classes; `from_config` + a strict
    `load_state_dict` loads the same weights without it.)
    """
    model = cls.from_config(cls.load_config(folder))
    model.load_state_dict(load_file(str(folder / "diffusion_pytorch_model.safetensors")), strict=True)
    return model.eval()


def reference_modules(diffusers_ckpt: Path) -> dict[str, Any]:
    """tokenizer, text_encoder (transformers UMT5EncoderModel), transformer and vae, from the checkpoint."""
    text_encoder, info = transformers.UMT5EncoderModel.from_pretrained(
        diffusers_ckpt / "text_encoder", dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return {
        "tokenizer": transformers.AutoTokenizer.from_pretrained(diffusers_ckpt / "tokenizer"),
        "text_encoder": text_encoder.eval(),
        "transformer": _diffusers_model(diffusers.WanTransformer3DModel, diffusers_ckpt / "transformer"),
        "vae": _diffusers_model(diffusers.AutoencoderKLWan, diffusers_ckpt / "vae"),
    }


def reference_scheduler(name: str) -> Any:
    """The diffusers scheduler runnerkit's `name` documents that it matches with spacing "diffusers"."""
    if name == "unipc":
        # As Wan-AI/Wan2.1-T2V-*-Diffusers ship it (flow-matching UniPC, bh2, order 2).
        return diffusers.UniPCMultistepScheduler(
            num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=SHIFT,
            solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero")
    assert name == "euler", name
    return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT)


def initial_noise(seed: int) -> torch.Tensor:
    """The request's noise, per the scheduler contract: one float32 CPU draw of [1, z, f, h, w]."""
    shape = (1, ARCH.vae.z_dim, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)


def runnerkit_video(ckpt: Path, scheduler: str, out: Path) -> torch.Tensor:
    """The runner's video [3, F, H, W] in [-1, 1], through its public API."""
    config = load_runner_config(None, tiny_config_dict(
        ckpt, scheduler=scheduler, scheduler_spacing="diffusers", infer_steps=STEPS, sample_guide_scale=GUIDANCE,
        enable_cfg=True))
    runner = get_runner_cls(config.model_cls)(config)
    runner.init_modules()
    runner.run_pipeline(RequestConfig(
        prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, seed=SEED, target_height=HEIGHT, target_width=WIDTH,
        target_video_length=FRAMES, save_tensor_path=str(out)), 0)
    return load_file(str(out))["video"]


def diffusers_video(modules: dict[str, Any], scheduler: str) -> torch.Tensor:
    """WanPipeline's video, mapped from its [1, F, 3, H, W] in [0, 1] to [3, F, H, W] in [-1, 1]."""
    pipe = diffusers.WanPipeline(scheduler=reference_scheduler(scheduler), **modules)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        frames = pipe(
            prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
            num_inference_steps=STEPS, guidance_scale=GUIDANCE, latents=initial_noise(SEED), output_type="pt",
            max_sequence_length=ARCH.text_encoder.text_len).frames  # [1, F, 3, H, W], (x / 2 + 0.5).clamp(0, 1)
    assert tuple(frames.shape) == (1, FRAMES, 3, HEIGHT, WIDTH), frames.shape
    return frames[0].permute(1, 0, 2, 3).float() * 2 - 1  # [3, F, H, W]


def check_parity(folder: Path) -> None:
    """The family contract's parity hook (test_offload.py::TestFamilyContract): for each scheduler
    (UniPC, Euler), the runner's video equals WanPipeline's on one checkpoint within TOLERANCE."""
    ckpt = diffusers_checkpoint(folder)
    modules = reference_modules(ckpt)
    for scheduler in ("unipc", "euler"):
        ours = runnerkit_video(ckpt, scheduler, folder / f"{scheduler}.safetensors")
        expected = diffusers_video(modules, scheduler)

        assert ours.dtype == torch.float32 and tuple(ours.shape) == (3, FRAMES, HEIGHT, WIDTH)
        # A meaningful comparison: a varied video, mostly inside the clamp range.
        assert expected.std().item() > 0.2
        assert (expected.abs() >= 1).float().mean().item() < 0.2
        diff = (ours - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{scheduler}: max abs difference {diff:.3g} > {TOLERANCE}"
