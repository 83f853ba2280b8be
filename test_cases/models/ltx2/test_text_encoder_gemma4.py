"""LTX-2.5 prompt encoding: a tiny random Gemma-4 (`Gemma4UnifiedForConditionalGeneration`, built here)
and the 2.3-layout connectors against diffusers 0.42.1 `LTX2Pipeline` running the whole model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.models.ltx2.arch import tiny_ltx2_arch
from runnerkit.models.ltx2.connectors_arch import LTX2ConnectorsArch
from runnerkit.models.ltx2.text_encoder import load_gemma_tokenizer
from runnerkit.models.ltx2.text_encoder_gemma4 import (
    Gemma4PromptEncoder,
    gemma4_configs,
    load_gemma4_text_encoder,
)
from runnerkit.synthetic import save_pretrained_here
from runnerkit.weights import CheckpointError
from test_cases._reference import require_reference
from test_cases.models.ltx2.test_text_encoder import (
    L,
    _compare,
    _connector_pair,
    _our_stage3,
    _reference_pipeline,
    _reference_stage3,
)

transformers = require_reference("transformers")

SEED = 7
CPU = torch.device("cpu")
TILDE = 3 + ord("~") - ord(" ")
"""Debug-tokenizer id of "~" (97), made the image placeholder: the full model embeds it as the pad id."""
PROMPTS = ["  A red fox~ jumps.  ", "x" * 40]


def _tiny_gemma4(folder: Path) -> Path:
    """`Gemma4UnifiedForConditionalGeneration` 16 wide, 2 layers (one sliding; one full with a wider
    proportional-RoPE head, one key head shared as the value, as Gemma-4 12B's full layers), fitting the tiny connectors (16 x 3 stacked features), no vision / audio
    embedders; saved with its debug tokenizer."""
    text = transformers.Gemma4UnifiedTextConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=16, max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"])
    config = transformers.Gemma4UnifiedConfig(text_config=text.to_dict(), image_token_id=TILDE, video_token_id=126,
                                              audio_token_id=127)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = transformers.Gemma4UnifiedForConditionalGeneration(config)
        with torch.no_grad():  # RMSNorm scales away from their init, so a wrong norm shows
            for name, param in model.named_parameters():
                if "norm" in name or "layer_scalar" in name:
                    param.add_(torch.randn_like(param) * 0.3)
    save_pretrained_here(model, folder)
    write_debug_tokenizer(folder, 98)
    return folder


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_gemma4(tmp_path_factory.mktemp("gemma4") / "gemma-4")


def _encoder(folder: Path, connectors: LTX2ConnectorsArch | None = None) -> Gemma4PromptEncoder:
    _, placeholders = gemma4_configs(folder)
    model = load_gemma4_text_encoder(folder, torch.float32, CPU, connectors)
    return Gemma4PromptEncoder(load_gemma_tokenizer(folder), model, L, placeholders)


def test_gemma4_and_connectors_match_diffusers(gemma4: Path) -> None:
    """diffusers runs the whole `Gemma4UnifiedForConditionalGeneration`; we load only its text model."""
    arch = tiny_ltx2_arch("2.3")
    reference_connectors, connectors = _connector_pair(arch)
    full = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(gemma4, dtype=torch.float32)
    expected = _reference_stage3(_reference_pipeline(full, gemma4, reference_connectors), PROMPTS)
    ours = _our_stage3(_encoder(gemma4, arch.connectors), connectors, PROMPTS)
    assert ours[0].shape == (4, L, 16 * 3) and ours[2].shape == (4, L, 32) and ours[3].shape == (4, L, 8)
    assert ours[1].sum(dim=1).tolist() == [1, 1, 18, 32]  # "", "", the fox (17 + </s>), the cut x's
    _compare(ours, expected, "LTX-2.5 Gemma-4")


def test_placeholder_ids_are_embedded_as_padding(gemma4: Path) -> None:
    encoder = _encoder(gemma4)
    ids, mask = encoder.tokenize(["a~b"])
    assert ids[0, -4:].tolist() == [68, 0, 69, 1] and mask[0, -4:].tolist() == [1, 1, 1, 1]


def test_only_the_text_model_is_read(gemma4: Path, tmp_path: Path) -> None:
    tensors = load_file(gemma4 / "model.safetensors")
    assert any(k.startswith("model.language_model.layers.1.") for k in tensors)
    folder = tmp_path / "g"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((gemma4 / name).read_bytes())
    tensors["model.embed_vision.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors")
    load_gemma4_text_encoder(folder, torch.float32, CPU)  # an unused prefix: accepted, unread
    del tensors["model.language_model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        load_gemma4_text_encoder(folder, torch.float32, CPU)


def test_refusals_name_the_folder(gemma4: Path, tmp_path: Path) -> None:
    arch = tiny_ltx2_arch("2.3")
    narrow = arch.connectors.model_copy(update={"text_proj_in_factor": 5})
    with pytest.raises(CheckpointError, match=r"`num_hidden_layers`=2 \(\+ 1 embedding output = 3 hidden states\) "
                                              r"but the connectors stack `text_proj_in_factor`=5"):
        load_gemma4_text_encoder(gemma4, torch.float32, CPU, narrow)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(CheckpointError, match=r"`model_type`='gemma3'; allowed: \['gemma4_unified', "):
        load_gemma4_text_encoder(tmp_path, torch.float32, CPU)


def test_ltx_core_bos_rule(gemma4: Path) -> None:
    """`prepend_bos`: ltx-core's tokenization. The debug tokenizer has no bos: "<unk>" (id 2) plays it."""
    tokenizer = load_gemma_tokenizer(gemma4)
    model = load_gemma4_text_encoder(gemma4, torch.float32, CPU)
    with pytest.raises(ValueError, match="`prepend_bos` needs a tokenizer with a bos token"):
        Gemma4PromptEncoder(tokenizer, model, L, prepend_bos=True)
    tokenizer.bos_token = "<unk>"
    encoder = Gemma4PromptEncoder(tokenizer, model, L, (TILDE,), prepend_bos=True)
    ids, mask = encoder.tokenize([" ab~ ", "x" * 40, "<unk>b"])
    x = 3 + ord("x") - ord(" ")
    assert ids[0].tolist() == [0] * 27 + [2, 68, 69, 0, 1] and mask[0].tolist() == [0] * 27 + [1] * 5
    assert ids[1].tolist() == [2] + [x] * 31 and mask[1].tolist() == [1] * 32  # bos in, </s> cut off
    assert ids[2, -3:].tolist() == [2, 69, 1] and mask[2].sum() == 3  # already first: not doubled
    hidden, _ = encoder.encode(["ab"])
    assert hidden.shape == (1, L, 16 * 3)
