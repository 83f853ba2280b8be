"""Qwen-Image text encoder: prompt-encoding parity with diffusers' QwenImage / Edit / Edit-Plus
pipelines, VL image sizes, config reading, strict loading, tiny tokenizer and processor."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from loguru import logger
from safetensors.torch import load_file, save_file

from runnerkit.models.qwen_image.text_encoder import (
    EDIT_TEMPLATE,
    T2I_TEMPLATE,
    TINY_QWEN_VL,
    QwenPromptEncoder,
    QwenVLArch,
    calculate_dimensions,
    load_processor,
    load_text_encoder,
    load_tokenizer,
    resize_for_vl,
    vl_image_size,
    write_tiny_text_encoder,
)
from runnerkit.models.qwen_image.tokenizer_files import (
    QWEN_SPECIAL_TOKENS,
    TINY_SPECIAL_IDS,
    write_tiny_processor,
    write_tiny_tokenizer,
)
from runnerkit.weights import CheckpointError
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.image_processor import VaeImageProcessor  # noqa: E402
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as ref_edit  # noqa: E402
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as ref_edit_plus  # noqa: E402

CPU = torch.device("cpu")
TOLERANCE = 1e-4

# Qwen/Qwen-Image `text_encoder/config.json` as transformers 4.53 wrote it (flat text fields).
QWEN_IMAGE_CONFIG_4X: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
    "image_token_id": 151655, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 128000, "max_window_layers": 28, "model_type": "qwen2_5_vl",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.53.1", "use_cache": True, "use_sliding_window": False, "video_token_id": 151656,
    "vision_config": {
        "depth": 32, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "hidden_size": 1280,
        "in_channels": 3, "in_chans": 3, "initializer_range": 0.02, "intermediate_size": 3420,
        "model_type": "qwen2_5_vl", "num_heads": 16, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2, "tokens_per_second": 2,
        "window_size": 112, "torch_dtype": "bfloat16"},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652, "vision_token_id": 151654,
    "vocab_size": 152064,
}


def _image(width: int, height: int, seed: int) -> PIL.Image.Image:
    """A smooth random RGB image (smooth so that resampling filters matter less than content)."""
    g = np.random.default_rng(seed)
    small = g.integers(0, 256, (max(height // 16, 2), max(width // 16, 2), 3), dtype=np.uint8)
    return PIL.Image.fromarray(small).resize((width, height), PIL.Image.Resampling.BILINEAR)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen_vl")
    write_tiny_text_encoder(root / "text_encoder", TINY_QWEN_VL, seed=0, dtype=torch.float32)
    write_tiny_tokenizer(root / "tokenizer")
    write_tiny_processor(root / "processor")
    return root


@pytest.fixture(scope="module")
def encoder(folders: Path) -> QwenPromptEncoder:
    model = load_text_encoder(folders / "text_encoder", torch.float32, CPU)
    return QwenPromptEncoder(load_tokenizer(folders / "tokenizer"), load_processor(folders / "processor"), model)


def _reference(cls: type, encoder: QwenPromptEncoder) -> Any:
    """A diffusers pipeline holding our tiny text encoder, tokenizer and processor (no VAE, no DiT:
    only its prompt encoding is called)."""
    kwargs = {"processor": encoder.processor} if cls is not diffusers.QwenImagePipeline else {}
    return cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None, transformer=None,
               text_encoder=encoder.model, tokenizer=encoder.tokenizer, **kwargs)


def _compare(ours: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None) -> float:
    """Max abs error; lengths must agree exactly and the reference must carry no padding."""
    assert ref.shape[0] == 1 and mask is None, "one prompt: diffusers returns no mask when nothing is padded"
    assert ours.shape == ref.shape[1:], f"ours {tuple(ours.shape)} vs diffusers {tuple(ref.shape[1:])}"
    err = (ours - ref[0]).abs().max().item()
    print(f"max abs error vs diffusers: {err:.3g} over {tuple(ours.shape)}")
    return err


# ---- tokenizer and processor -----------------------------------------------------------------

def test_tiny_tokenizer_encodes_the_t2i_template_with_single_special_ids(folders: Path) -> None:
    tokenizer = load_tokenizer(folders / "tokenizer")
    text = T2I_TEMPLATE.format("the cat")
    ids = tokenizer(text).input_ids
    im_start, im_end = TINY_SPECIAL_IDS["<|im_start|>"], TINY_SPECIAL_IDS["<|im_end|>"]
    assert ids[0] == im_start
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert all(i < TINY_SPECIAL_IDS["<|endoftext|>"] for i in ids if i not in (im_start, im_end))
    # " the" merges to one token ("Ġt"+"he"); newline is byte 10.
    assert ids[-6:] == [im_end, 10, im_start, *tokenizer("assistant").input_ids, 10][-6:]
    assert tokenizer.decode(ids) == text
    edit = tokenizer(EDIT_TEMPLATE.format("x")).input_ids
    vision = [TINY_SPECIAL_IDS[t] for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    start = edit.index(vision[0])
    assert edit[start:start + 3] == vision


def test_tiny_tokenizer_json_agrees_with_transformers(folders: Path) -> None:
    """transformers rebuilds a Qwen2Tokenizer's pipeline from its class; the written tokenizer.json
    must encode the same on its own (the `tokenizers` library, other readers)."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(folders / "tokenizer" / "tokenizer.json"))
    tokenizer = load_tokenizer(folders / "tokenizer")
    prompt = "一只猫, a cat 🐱 in  the rain's 2024 cafe\u0301 light"  # decomposed é: NFC matters
    for text in (T2I_TEMPLATE.format(prompt), EDIT_TEMPLATE.format(" x ")):
        assert raw.encode(text).ids == tokenizer(text).input_ids
        plain = text
        for token in QWEN_SPECIAL_TOKENS:
            plain = plain.replace(token, "")
        assert raw.decode(raw.encode(text).ids, skip_special_tokens=True) == unicodedata.normalize("NFC", plain)


def test_tiny_special_ids_agree_with_tokenizer_and_arch(folders: Path) -> None:
    tokenizer = load_tokenizer(folders / "tokenizer")
    assert len(tokenizer) == TINY_QWEN_VL.vocab_size
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS} == TINY_SPECIAL_IDS
    assert (TINY_QWEN_VL.image_token_id, TINY_QWEN_VL.video_token_id, TINY_QWEN_VL.vision_start_token_id,
            TINY_QWEN_VL.vision_end_token_id) == tuple(TINY_SPECIAL_IDS[t] for t in (
                "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))


def test_processor_expands_an_image_to_one_token_per_28px_square(encoder: QwenPromptEncoder) -> None:
    image = resize_for_vl(_image(640, 640, seed=1), "edit_plus")
    assert image.size == (384, 384)
    out = encoder.processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image], return_tensors="pt")
    # smart_resize snaps 384 to the nearest multiple of 28 (392): 14 x 14 merged patches.
    assert out["image_grid_thw"].tolist() == [[1, 28, 28]]
    assert (out["input_ids"] == TINY_SPECIAL_IDS["<|image_pad|>"]).sum().item() == 196
    assert tuple(out["pixel_values"].shape) == (28 * 28, 3 * 2 * 14 * 14)


# ---- prompt encoding parity with diffusers -------------------------------------------------

@pytest.mark.parametrize("prompt", ["the cat sat on the mat", "一只猫, a cat 🐱\nin the rain", ""])
def test_t2i_matches_diffusers_qwenimage_pipeline(encoder: QwenPromptEncoder, prompt: str) -> None:
    ref, mask = _reference(diffusers.QwenImagePipeline, encoder).encode_prompt(prompt, device=CPU)
    ours = encoder.encode_t2i(prompt)
    err = _compare(ours, ref, mask)
    assert err <= TOLERANCE, err
    assert ours.dtype == torch.float32 and ours.device == CPU


def test_t2i_truncation_matches_diffusers_and_warns(encoder: QwenPromptEncoder) -> None:
    prompt = " ".join(f"word{i}" for i in range(180))  # ~1400 tokens: beyond 34 + 1024
    pipe = _reference(diffusers.QwenImagePipeline, encoder)
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    try:
        ours = encoder.encode_t2i(prompt)
        ours_short = encoder.encode_t2i(prompt, max_tokens=40)
    finally:
        logger.remove(sink)
    assert ours.shape[0] == 1024 and ours_short.shape[0] == 40
    assert len(messages) == 2 and "truncated to 1024 tokens" in messages[0]
    err = _compare(ours, *pipe.encode_prompt(prompt, device=CPU))
    err_short = _compare(ours_short, *pipe.encode_prompt(prompt, device=CPU, max_sequence_length=40))
    assert max(err, err_short) <= TOLERANCE, (err, err_short)


@pytest.mark.parametrize("sizes", [[(640, 480)], [(300, 500), (512, 512)]], ids=["one_image", "two_images"])
def test_edit_plus_matches_diffusers_edit_plus_pipeline(encoder: QwenPromptEncoder,
                                                        sizes: list[tuple[int, int]]) -> None:
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    pipe = _reference(diffusers.QwenImageEditPlusPipeline, encoder)
    # diffusers' own condition-image preparation (QwenImageEditPlusPipeline.__call__, stage 3)
    conditions = []
    for image in images:
        w, h = ref_edit_plus.calculate_dimensions(ref_edit_plus.CONDITION_IMAGE_SIZE, image.width / image.height)
        conditions.append(pipe.image_processor.resize(image, h, w))
    ref, mask = pipe.encode_prompt("make the sky red", image=conditions, device=CPU)
    ours = encoder.encode_edit("make the sky red", [resize_for_vl(im, "edit_plus") for im in images], "edit_plus")
    err = _compare(ours, ref, mask)
    assert err <= TOLERANCE, err


def test_edit_matches_diffusers_edit_pipeline(encoder: QwenPromptEncoder) -> None:
    image = _image(480, 360, seed=3)
    pipe = _reference(diffusers.QwenImageEditPipeline, encoder)
    # diffusers' own VL-image preparation (QwenImageEditPipeline.__call__, stage 3)
    w, h, _ = ref_edit.calculate_dimensions(1024 * 1024, image.width / image.height)
    ref, mask = pipe.encode_prompt("add a hat", image=pipe.image_processor.resize(image, h, w), device=CPU)
    ours = encoder.encode_edit("add a hat", [resize_for_vl(image, "edit")], "edit")
    err = _compare(ours, ref, mask)
    assert err <= TOLERANCE, err


def test_encode_edit_refuses_bad_arguments(encoder: QwenPromptEncoder) -> None:
    image = _image(64, 64, seed=0)
    with pytest.raises(ValueError, match="exactly one"):
        encoder.encode_edit("x", [image, image], "edit")
    with pytest.raises(ValueError, match="one or more"):
        encoder.encode_edit("x", [], "edit_plus")
    with pytest.raises(ValueError, match="`variant`"):
        encoder.encode_edit("x", [image], "inpaint")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_tokens`"):
        encoder.encode_t2i("x", max_tokens=1025)


# ---- image sizes -----------------------------------------------------------------------------

SIZES = [(1024, 1024), (1920, 1080), (1080, 1920), (640, 480), (333, 999), (4000, 3000), (512, 2048), (1000, 1001)]


@pytest.mark.parametrize("width, height", SIZES)
def test_dimensions_and_vl_sizes_match_diffusers(width: int, height: int) -> None:
    ratio = width / height
    for area in (1024 * 1024, 384 * 384, 512 * 512):
        assert calculate_dimensions(area, ratio) == ref_edit_plus.calculate_dimensions(area, ratio)
        assert calculate_dimensions(area, ratio) == ref_edit.calculate_dimensions(area, ratio)[:2]
    assert vl_image_size(width, height, "edit") == ref_edit.calculate_dimensions(1024 * 1024, ratio)[:2]
    assert vl_image_size(width, height, "edit_plus") == ref_edit_plus.calculate_dimensions(
        ref_edit_plus.CONDITION_IMAGE_SIZE, ratio)


@pytest.mark.parametrize("variant", ["edit", "edit_plus"])
def test_resize_for_vl_is_pixel_identical_to_diffusers(variant: str) -> None:
    image = _image(700, 300, seed=5)
    w, h = vl_image_size(700, 300, variant)  # type: ignore[arg-type]
    ref = VaeImageProcessor(vae_scale_factor=16).resize(image, h, w)
    ours = resize_for_vl(image, variant)  # type: ignore[arg-type]
    assert ours.size == ref.size == (w, h)
    assert np.array_equal(np.asarray(ours), np.asarray(ref))


# ---- architecture and config -----------------------------------------------------------------

def test_defaults_are_qwen_image_text_encoder_config_4x() -> None:
    assert QwenVLArch.from_hf_config(QWEN_IMAGE_CONFIG_4X) == QwenVLArch()
    assert QwenVLArch().head_dim == 128


def test_config_5x_round_trips(folders: Path) -> None:
    assert QwenVLArch.from_hf_config(TINY_QWEN_VL.to_hf_config().to_dict()) == TINY_QWEN_VL
    assert QwenVLArch.from_hf_config(QwenVLArch().to_hf_config().to_dict()) == QwenVLArch()
    saved = json.loads((folders / "text_encoder" / "config.json").read_text())
    assert QwenVLArch.from_hf_config(saved) == TINY_QWEN_VL


@pytest.mark.parametrize("edit, key", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2_vl"}, "model_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "mrope_section": [16, 24, 24]}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "default", "mrope_section": [16, 24, 20]}}, "mrope_section"),
    ({"vision_config": {**QWEN_IMAGE_CONFIG_4X["vision_config"], "hidden_act": "quick_gelu"}}, "hidden_act"),
    ({"vision_config": {k: v for k, v in QWEN_IMAGE_CONFIG_4X["vision_config"].items() if k != "depth"}},
     "vision_config.depth"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_unsupported_config_values_raise_naming_the_key(edit: dict[str, Any], key: str) -> None:
    config = {k: v for k, v in {**QWEN_IMAGE_CONFIG_4X, **edit}.items() if v is not None}
    with pytest.raises(ValueError, match=key):
        QwenVLArch.from_hf_config(config)


# ---- loading ---------------------------------------------------------------------------------

def test_load_text_encoder_casts_and_freezes(folders: Path) -> None:
    model = load_text_encoder(folders / "text_encoder", torch.bfloat16, CPU)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    encoder = QwenPromptEncoder(load_tokenizer(folders / "tokenizer"), None, model)
    assert encoder.encode_t2i("a cat").dtype == torch.bfloat16


def test_sharded_checkpoint_loads_to_the_same_encoder(folders: Path, encoder: QwenPromptEncoder,
                                                     tmp_path: Path) -> None:
    write_tiny_text_encoder(tmp_path, TINY_QWEN_VL, seed=0, dtype=torch.float32, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    sharded = QwenPromptEncoder(encoder.tokenizer, None, load_text_encoder(tmp_path, torch.float32, CPU))
    assert torch.equal(sharded.encode_t2i("a red fox"), encoder.encode_t2i("a red fox"))
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_text_encoder(tmp_path, torch.float32, CPU)


def test_writer_is_seeded_and_independent_of_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(1)
    write_tiny_text_encoder(tmp_path / "a", TINY_QWEN_VL, seed=7, dtype=torch.float32)
    torch.manual_seed(2)
    write_tiny_text_encoder(tmp_path / "b", TINY_QWEN_VL, seed=7, dtype=torch.float32)
    write_tiny_text_encoder(tmp_path / "c", TINY_QWEN_VL, seed=8, dtype=torch.float32)
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def _damaged(folders: Path, tmp_path: Path, change: Any) -> Path:
    folder = tmp_path / "text_encoder"
    shutil.copytree(folders / "text_encoder", folder)
    state = load_file(folder / "model.safetensors")
    change(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_load_refuses_a_missing_tensor_naming_it(folders: Path, tmp_path: Path) -> None:
    folder = _damaged(folders, tmp_path, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\):.*layers\.1\.mlp\.up_proj\.weight"):
        load_text_encoder(folder, torch.float32, CPU)


def test_load_refuses_unexpected_and_misshapen_tensors(folders: Path, tmp_path: Path) -> None:
    folder = _damaged(folders, tmp_path, lambda sd: sd.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(CheckpointError, match=r"mismatched keys \(1\):.*norm\.weight"):
        load_text_encoder(folder, torch.float32, CPU)
    shutil.rmtree(folder)
    folder = _damaged(folders, tmp_path, lambda sd: sd.update({"model.extra.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\):.*extra\.weight"):
        load_text_encoder(folder, torch.float32, CPU)


def test_load_refuses_missing_folder_config_and_weights(folders: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=str(tmp_path / "nowhere")):
        load_text_encoder(tmp_path / "nowhere", torch.float32, CPU)
    folder = tmp_path / "text_encoder"
    shutil.copytree(folders / "text_encoder", folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_text_encoder(folder, torch.float32, CPU)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=str(folder / "config.json")):
        load_text_encoder(folder, torch.float32, CPU)
    with pytest.raises(CheckpointError, match=str(tmp_path / "no_tokenizer")):
        load_tokenizer(tmp_path / "no_tokenizer")
