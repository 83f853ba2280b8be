"""End to end against diffusers: the runnerkit Qwen-Image runners and diffusers' `QwenImagePipeline`
/ `QwenImageEditPlusPipeline` on the same tiny random weights (the diffusers-layout synthetic
checkpoint, loaded by diffusers' and transformers' own classes), the same initial latents, CFG > 1,
float32 on the CPU. The comparison is of the final images (diffusers' `output_type="pt"`, [0, 1]).
t2i runs as the family contract's parity hook (`check_t2i_parity`, test_runner.py::TestFamilyContract).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.models.qwen_image import text_encoder as te
from runnerkit.models.qwen_image.edit import QwenImageEditRunner
from runnerkit.models.qwen_image.latents import pack_latents
from runnerkit.models.qwen_image.runner import QwenImageRunner
from test_cases.models.qwen_image.conftest import EDIT_CONFIG, T2I_CONFIG, qwen_config_dict, reference_images

diffusers = pytest.importorskip("diffusers")
STEPS, SEED, SCALE = 3, 7, 4.0
PROMPT, NEGATIVE = "a lighthouse on a cliff at dawn", "blurry, low quality"
TOLERANCE = 1e-4


def diffusers_components(folder: Path) -> dict[str, Any]:
    """The checkpoint's components, each loaded by its reference class."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    return {
        "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler"),
        "vae": AutoencoderKLQwenImage.from_pretrained(folder / "vae", torch_dtype=torch.float32),
        "text_encoder": Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder",
                                                                           dtype=torch.float32).eval(),
        "tokenizer": te.load_tokenizer(folder / "tokenizer"),
        "transformer": QwenImageTransformer2DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32),
    }


def initial_latents(height: int, width: int) -> torch.Tensor:
    """The noise runnerkit draws for SEED ([1, 16, 1, H/8, W/8] from a CPU generator), packed [1, L, 64]."""
    noise = torch.randn((1, 16, 1, height // 8, width // 8), generator=torch.Generator().manual_seed(SEED))
    return pack_latents(noise)


def ours(cls: type[QwenImageRunner], config: Path, folder: Path, tmp_path: Path, **request: Any) -> torch.Tensor:
    runner = cls(load_runner_config(None, qwen_config_dict(config, folder, infer_steps=STEPS, sample_guide_scale=SCALE)))
    runner.init_modules()
    out = tmp_path / "ours.safetensors"
    runner.run_pipeline(RequestConfig(prompt=PROMPT, negative_prompt=NEGATIVE, seed=SEED, save_tensor_path=str(out),
                                      **request), 0)
    return load_file(str(out))["image"]  # [3, H, W] in [-1, 1]


def check_t2i_parity(qwen_diffusers_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """The family contract's parity hook (test_runner.py::TestFamilyContract): t2i against
    `QwenImagePipeline`."""
    from diffusers import QwenImagePipeline

    folder = qwen_diffusers_ckpts["t2i"]
    image = ours(QwenImageRunner, T2I_CONFIG, folder, tmp_path)
    _, height, width = image.shape
    pipe = QwenImagePipeline(**diffusers_components(folder))
    ref = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=SCALE, height=height, width=width,
               num_inference_steps=STEPS, latents=initial_latents(height, width), output_type="pt").images[0]
    err = (image * 0.5 + 0.5 - ref).abs().max().item()
    assert err <= TOLERANCE, err
    # the images are not flat: the comparison can fail
    assert ref.std() > 0.01


def test_edit_plus_two_references_matches_qwen_image_edit_plus_pipeline(
        qwen_diffusers_ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import QwenImageEditPlusPipeline

    folder = qwen_diffusers_ckpts["i2i"]
    a, b = reference_images(tmp_path)
    image = ours(QwenImageEditRunner, EDIT_CONFIG, folder, tmp_path, image_path=str(a), extra_image_paths=[str(b)])
    _, height, width = image.shape
    assert (height, width) == (64, 96)  # the area 64x64 with the last reference's 64x36 aspect ratio
    # The reference pipeline's reference-image areas are module constants; the tiny config's are smaller.
    module = importlib.import_module(QwenImageEditPlusPipeline.__module__)
    monkeypatch.setattr(module, "CONDITION_IMAGE_SIZE", 56 * 56)
    monkeypatch.setattr(module, "VAE_IMAGE_SIZE", 64 * 64)
    pipe = QwenImageEditPlusPipeline(**diffusers_components(folder), processor=te.load_processor(folder / "processor"))
    images = [Image.open(p).convert("RGB") for p in (a, b)]
    ref = pipe(image=images, prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=SCALE, height=height,
               width=width, num_inference_steps=STEPS, latents=initial_latents(height, width),
               output_type="pt").images[0]
    err = (image * 0.5 + 0.5 - ref).abs().max().item()
    assert err <= TOLERANCE, err
    assert ref.std() > 0.01
