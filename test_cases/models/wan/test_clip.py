"""Wan2.1 CLIP ViT-H/14 vision encoder: parity with transformers, key maps, preprocessing, dtypes, errors."""

from __future__ import annotations

import re

import pytest
import torch

from runnerkit.models.wan.arch import CLIPVisionArch
from runnerkit.models.wan.clip import CLIP_MEAN, CLIP_STD, CLIPVisionEncoder, clip_preprocess, keep_fp32
from runnerkit.models.wan.clip_keys import (
    arch_from_hf_config,
    arch_to_hf_config,
    hf_to_native,
    native_to_hf,
    native_to_original,
    original_to_native,
)
from runnerkit.weights import CheckpointError, assign_state_dict, build_on_meta
from test_cases._reference import require_reference

transformers = require_reference("transformers")

# 4 x 4 patches of 7 pixels + the class token = 17 tokens; 3 blocks in the checkpoint, 2 run.
ARCH = CLIPVisionArch(image_size=28, patch_size=7, dim=64, ffn_dim=96, num_heads=4, num_layers=3)
TOL = 1e-4


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return module.eval()


def _reference(cls: str = "CLIPVisionModel", seed: int = 0) -> torch.nn.Module:
    config = transformers.CLIPVisionConfig(**arch_to_hf_config(ARCH))
    return _randomize(getattr(transformers, cls)(config), seed)


def _load(sd: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> CLIPVisionEncoder:
    model = build_on_meta(lambda: CLIPVisionEncoder(ARCH))
    return assign_state_dict(model, sd, "image_encoder", dtype=dtype, keep_fp32=keep_fp32).eval()


@pytest.mark.parametrize("cls", ["CLIPVisionModel", "CLIPVisionModelWithProjection"])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_parity_with_transformers_penultimate_hidden_states(cls: str, batch: int) -> None:
    """Ours == `hidden_states[-2]` (what diffusers' Wan I2V pipeline feeds the transformer)."""
    reference = _reference(cls)
    model = _load(hf_to_native(reference.state_dict(), ARCH))
    pixels = torch.randn(batch, 3, 28, 28, generator=torch.Generator().manual_seed(1))

    hidden = reference(pixel_values=pixels, output_hidden_states=True).hidden_states
    out = model(pixels)

    assert len(hidden) == ARCH.num_layers + 1  # embeddings (after pre_layrnorm), then each layer
    assert out.shape == (batch, 17, 64) and out.dtype == torch.float32
    assert hidden[-2].abs().mean() > 0.1
    assert (out - hidden[-2]).abs().max() <= TOL
    assert (out - hidden[-1]).abs().max() > 100 * TOL  # the last layer is really skipped


@torch.no_grad()
def test_encode_is_preprocess_then_forward() -> None:
    model = _load(hf_to_native(_reference().state_dict(), ARCH))
    images = torch.rand(2, 3, 40, 60, generator=torch.Generator().manual_seed(2)) * 2 - 1
    assert torch.equal(model.encode(images), model(clip_preprocess(images, 28)))


def test_preprocess_golden_values() -> None:
    # The statistics are OpenAI CLIP's, as transformers records them.
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    assert CLIP_MEAN == tuple(OPENAI_CLIP_MEAN) and CLIP_STD == tuple(OPENAI_CLIP_STD)
    # A constant image v in [-1, 1] maps to ((v + 1) / 2 - mean) / std per channel.
    values = torch.tensor([-1.0, 0.2, 1.0])
    images = values.view(1, 3, 1, 1).expand(1, 3, 50, 70)
    out = clip_preprocess(images, 224)
    assert out.shape == (1, 3, 224, 224) and out.dtype == torch.float32
    expected = ((values + 1) / 2 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    assert torch.allclose(out, expected.view(1, 3, 1, 1).expand_as(out), atol=1e-6)
    # Squashed, not cropped: an image dark on its left third keeps a dark left third.
    wide = torch.ones(1, 3, 30, 90)
    wide[..., :30] = -1
    column = clip_preprocess(wide, 224)[0, 0, 100]
    assert (column[:70] < 0).all() and (column[80:] > 0).all()
    # Bicubic (Keys a = -0.75), not bilinear: the step rings past both levels next to the edge.
    low, high = ((torch.tensor([-1.0, 1.0]) + 1) / 2 - CLIP_MEAN[0]) / CLIP_STD[0]
    assert column.min() < low - 0.05 and column.max() > high + 0.05
    with pytest.raises(ValueError, match=re.escape("`images` must be [B, 3, H, W]")):
        clip_preprocess(torch.zeros(3, 30, 30))


def _original_names(arch: CLIPVisionArch) -> dict[str, tuple[int, ...]]:
    """The keys and shapes of Wan's `XLMRobertaCLIP` state dict, vision part written out by hand
    from `wan/modules/clip.py` (`VisionTransformer`, pool 'token', pre_norm), plus text-tower samples."""
    d, g = arch.dim, arch.image_size // arch.patch_size
    names: dict[str, tuple[int, ...]] = {
        "visual.patch_embedding.weight": (d, 3, arch.patch_size, arch.patch_size),
        "visual.cls_embedding": (1, 1, d), "visual.pos_embedding": (1, g * g + 1, d),
        "visual.pre_norm.weight": (d,), "visual.pre_norm.bias": (d,),
        "visual.post_norm.weight": (d,), "visual.post_norm.bias": (d,), "visual.head": (d, 1024),
        "log_scale": (), "textual.token_embedding.weight": (10, 8), "textual.head.0.weight": (9, 8),
    }
    for i in range(arch.num_layers):
        for name, shape in (("norm1.weight", (d,)), ("norm1.bias", (d,)), ("attn.to_qkv.weight", (3 * d, d)),
                            ("attn.to_qkv.bias", (3 * d,)), ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
                            ("norm2.weight", (d,)), ("norm2.bias", (d,)), ("mlp.0.weight", (arch.ffn_dim, d)),
                            ("mlp.0.bias", (arch.ffn_dim,)), ("mlp.2.weight", (d, arch.ffn_dim)), ("mlp.2.bias", (d,))):
            names[f"visual.transformer.{i}.{name}"] = shape
    return names


def test_original_map_covers_every_parameter() -> None:
    original = {k: torch.zeros(s) for k, s in _original_names(ARCH).items()}
    native = original_to_native(original, ARCH)
    ours = build_on_meta(lambda: CLIPVisionEncoder(ARCH)).state_dict()
    assert sorted(native) == sorted(ours)
    assert all(native[k].shape == ours[k].shape for k in ours)
    assert not any(k.startswith("transformer.2.") for k in native)  # the last block is dropped
    back = native_to_original(native)
    assert set(original) - set(back) == {k for k in original if k.startswith(("textual.", "visual.transformer.2."))} | {
        "log_scale", "visual.post_norm.weight", "visual.post_norm.bias", "visual.head"}
    assert all(back[k] is original[k] for k in back)


@torch.no_grad()
def test_original_and_hf_layouts_agree() -> None:
    """A transformers checkpoint written in the original layout (q/k/v fused) gives the same encoder."""
    reference = _reference()
    native = hf_to_native(reference.state_dict(), ARCH)
    # Fusion order: rows of `to_qkv` are q, then k, then v (Wan views the output as [B, L, 3, N, d]).
    hf = reference.state_dict()
    k_rows = native["transformer.1.attn.to_qkv.weight"][64:128]
    assert torch.equal(k_rows, hf["encoder.layers.1.self_attn.k_proj.weight"])
    original = native_to_original(native)
    assert original_to_native(original, ARCH).keys() == native.keys()
    # Round trips through the transformers names, with and without the `vision_model.` prefix.
    for prefix in ("vision_model.", ""):
        out = native_to_hf(native, prefix=prefix)
        assert hf_to_native(out, ARCH).keys() == native.keys()
        assert all(torch.equal(hf_to_native(out, ARCH)[k], v) for k, v in native.items())
    assert set(native_to_hf(native, prefix="")) == set(hf) - {
        k for k in hf if k.startswith(("encoder.layers.2.", "post_layernorm."))}


@torch.no_grad()
def test_bf16_weights_keep_norms_fp32() -> None:
    sd = hf_to_native(_reference().state_dict(), ARCH)
    model16 = _load(sd, dtype=torch.bfloat16)
    fp32 = {k for k, v in model16.state_dict().items() if v.dtype == torch.float32}
    assert fp32 == {"cls_embedding", "pos_embedding", "pre_norm.weight", "pre_norm.bias"} | {
        f"transformer.{i}.{n}.{p}" for i in range(2) for n in ("norm1", "norm2") for p in ("weight", "bias")}
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    expected = _load(sd)(pixels)
    out = model16(pixels)
    assert out.dtype == torch.float32
    rel = (out - expected).norm() / expected.norm()
    assert rel < 0.03, f"bf16 relative error {rel:.4f}"


# `image_encoder/config.json` of Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (CLIPVisionModelWithProjection).
WAN_I2V_IMAGE_ENCODER = {"architectures": ["CLIPVisionModelWithProjection"], "attention_dropout": 0.0, "dropout": 0.0,
                         "hidden_act": "gelu", "hidden_size": 1280, "image_size": 224, "initializer_factor": 1.0,
                         "initializer_range": 0.02, "intermediate_size": 5120, "layer_norm_eps": 1e-05,
                         "model_type": "clip_vision_model", "num_attention_heads": 16, "num_channels": 3,
                         "num_hidden_layers": 32, "patch_size": 14, "projection_dim": 1024, "torch_dtype": "float32"}


def test_release_config_and_meta_shapes() -> None:
    arch = arch_from_hf_config(WAN_I2V_IMAGE_ENCODER)
    assert arch == CLIPVisionArch()
    assert arch_from_hf_config(arch_to_hf_config(ARCH)) == ARCH
    model = build_on_meta(lambda: CLIPVisionEncoder(arch))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert all(v.is_meta for v in model.state_dict().values())
    assert len(model.transformer) == 31 and "transformer.31.norm1.weight" not in shapes
    assert shapes["patch_embedding.weight"] == (1280, 3, 14, 14)
    assert shapes["pos_embedding"] == (1, 257, 1280) and shapes["cls_embedding"] == (1, 1, 1280)
    assert shapes["transformer.30.attn.to_qkv.weight"] == (3840, 1280)
    assert shapes["transformer.30.mlp.0.weight"] == (5120, 1280)
    # 31 blocks of 19,677,440 + patch, position, class embeddings and pre_norm; with the dropped last block,
    # post_norm and the 1280 x 1024 head this is open_clip ViT-H-14's 632.08M visual parameters.
    per_block = 3840 * 1281 + 1280 * 1281 + 5120 * 1281 + 1280 * 5121 + 4 * 1280
    total = 31 * per_block + 1280 * 3 * 196 + 257 * 1280 + 3 * 1280
    assert sum(torch.Size(s).numel() for s in shapes.values()) == total
    assert total + per_block + 2 * 1280 + 1280 * 1024 == 632_076_800
    with pytest.raises(ValueError, match="`hidden_act`='quick_gelu'"):
        arch_from_hf_config({**WAN_I2V_IMAGE_ENCODER, "hidden_act": "quick_gelu"})
    with pytest.raises(ValueError, match="missing keys"):
        arch_from_hf_config({"hidden_size": 1280})


def test_errors_name_the_key() -> None:
    with pytest.raises(CheckpointError, match="model.visual.patch_embedding.weight"):
        original_to_native({"model.visual.patch_embedding.weight": torch.zeros(1)}, ARCH)
    with pytest.raises(CheckpointError, match=re.escape("layer 0 has self_attn ['k', 'q']_proj.weight")):
        hf_to_native({"encoder.layers.0.self_attn.q_proj.weight": torch.zeros(1),
                      "encoder.layers.0.self_attn.k_proj.weight": torch.zeros(1)}, ARCH)
    with pytest.raises(CheckpointError, match="encoder.layers.0.self_attn.qq_proj.weight"):
        hf_to_native({"encoder.layers.0.self_attn.qq_proj.weight": torch.zeros(1)}, ARCH)
    with pytest.raises(CheckpointError, match="transformer.0.attn.qkv.weight"):
        native_to_hf({"transformer.0.attn.qkv.weight": torch.zeros(1)})
    sd = hf_to_native(_reference().state_dict(), ARCH)
    del sd["transformer.1.norm2.bias"]
    with pytest.raises(CheckpointError, match=re.escape("transformer.1.norm2.bias")):
        _load(sd)
    with pytest.raises(ValueError, match=re.escape("`pixels` must be [B, 3, 28, 28]")):
        CLIPVisionEncoder(ARCH)(torch.zeros(1, 3, 32, 32))
