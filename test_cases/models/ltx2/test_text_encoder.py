"""LTX-2 Gemma-3 prompt encoder: parity with diffusers 0.42.1 `LTX2Pipeline.encode_prompt` followed by
diffusers' connectors (stage 3 of `LTX2Pipeline.__call__`), the text-tower-only load, padding, errors.

The reference side is diffusers' own pipeline (a real `LTX2Pipeline` holding only a text encoder, a
tokenizer and connectors), its text encoder and tokenizer loaded by transformers' `from_pretrained` /
`AutoTokenizer` as diffusers loads them, with tokenizer instances of its own (diffusers sets the
padding side on its tokenizer; ours must not depend on that).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loguru import logger
from safetensors import safe_open
from safetensors.torch import save_file

from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.models.ltx2.arch import LTX2Arch, tiny_ltx2_arch
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint
from runnerkit.models.ltx2.checkpoint_synthetic import (
    GEMMA_VOCAB,
    SINGLE_FILE,
    UPSAMPLER_FILE,
    synthetic_state_dict,
    write_synthetic_ltx2,
    write_tiny_gemma,
)
from runnerkit.models.ltx2.connectors import LTX2TextConnectors
from runnerkit.models.ltx2.text_encoder import (
    GemmaPromptEncoder,
    load_gemma_text_encoder,
    load_gemma_tokenizer,
    text_contexts,
)
from runnerkit.weights import CheckpointError, load_on_meta
from test_cases._reference import require_reference
from test_cases.models.ltx2._parity import report

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors as RefConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

SEED = 5
TOL = 1e-4
L = 32
"""max_sequence_length: a multiple of the tiny connectors' 4 registers, twice Gemma's sliding window (16)."""
PROMPTS = ["  A red fox.  ", "x" * 40]
"""Character-level debug tokenizer (+ `</s>`): 11 tokens after the strip, and 41 cut to 32."""
CPU = torch.device("cpu")


# ---- builders --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def release_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's Gemma folder in small: `Gemma3ForConditionalGeneration` (vision tower included)
    with its tokenizer next to it. Both tiny archs take the same Gemma (16 wide, 2 layers)."""
    folder = write_tiny_gemma(tmp_path_factory.mktemp("gemma") / "gemma-3", tiny_ltx2_arch("2.0"), SEED, vision=True)
    write_debug_tokenizer(folder, GEMMA_VOCAB)
    return folder


def _connector_pair(arch: LTX2Arch) -> tuple[torch.nn.Module, LTX2TextConnectors]:
    """diffusers' connectors and ours holding the same synthetic weights (diffusers' key names)."""
    weights = synthetic_state_dict(arch, "connectors", SEED, torch.float32)
    reference = RefConnectors(**arch.connectors.model_dump())
    reference.load_state_dict(weights, strict=True)
    return reference.eval(), load_on_meta(lambda: LTX2TextConnectors(arch.connectors), weights, "connectors")


def _reference_pipeline(text_encoder: torch.nn.Module, tokenizer_folder: Path,
                        connectors: torch.nn.Module) -> LTX2Pipeline:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    return LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, text_encoder=text_encoder.eval(),
                        tokenizer=tokenizer, connectors=connectors, transformer=None, vocoder=None)


def _reference_stage3(pipe: LTX2Pipeline, prompt: list[str]) -> tuple[torch.Tensor, ...]:
    """`LTX2Pipeline.__call__` stage 3 with CFG and no negative prompt: (embeds, mask, video, audio, mask)."""
    with torch.no_grad():
        embeds, mask, negative_embeds, negative_mask = pipe.encode_prompt(
            prompt, None, do_classifier_free_guidance=True, max_sequence_length=L, device=CPU)
        embeds, mask = torch.cat([negative_embeds, embeds]), torch.cat([negative_mask, mask])
        return embeds, mask, *pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)


def _our_stage3(encoder: GemmaPromptEncoder, connectors: LTX2TextConnectors,
                prompt: list[str]) -> tuple[torch.Tensor, ...]:
    """What the runner does: encode the negative prompt ("" when none) and the prompt, then the connectors."""
    negative, negative_mask = encoder.encode([""] * len(prompt))
    hidden, mask = encoder.encode(prompt)
    hidden, mask = torch.cat([negative, hidden]), torch.cat([negative_mask, mask])
    return hidden, mask, *text_contexts(connectors, hidden, mask)


def _compare(ours: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], label: str) -> None:
    names = ["Gemma hidden states", "mask", "video context", "audio context", "context mask"]
    for name, got, want in zip(names, ours, expected):
        if "mask" in name:
            assert got.dtype == want.dtype and torch.equal(got, want), f"{label}: {name} differs"
        else:
            assert got.dtype == want.dtype == torch.float32
            assert report(f"{label} {name}", got, want) <= TOL


# ---- parity ----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_release_gemma_and_connectors_match_diffusers(version: str, release_gemma: Path) -> None:
    """Gemma3ForConditionalGeneration folder (the release's class): diffusers runs the whole model,
    we load only its text tower; then both connectors on the same weights."""
    arch = tiny_ltx2_arch(version)
    reference_connectors, connectors = _connector_pair(arch)
    full = transformers.Gemma3ForConditionalGeneration.from_pretrained(release_gemma, dtype=torch.float32)
    pipe = _reference_pipeline(full, release_gemma, reference_connectors)
    expected = _reference_stage3(pipe, PROMPTS)
    encoder = GemmaPromptEncoder(load_gemma_tokenizer(release_gemma),
                                 load_gemma_text_encoder(release_gemma, torch.float32, CPU, arch.connectors), L)
    ours = _our_stage3(encoder, connectors, PROMPTS)
    assert ours[0].shape == (4, L, 16 * 3) and ours[2].shape[:2] == (4, L)
    assert ours[1].sum(dim=1).tolist() == [1, 1, 11, 32]  # "", "", the fox, the cut x's
    _compare(ours, expected, f"LTX-{version} release Gemma")


def test_synthetic_layouts_match_diffusers_loading_them(tmp_path: Path) -> None:
    """Both synthetic layouts (the tokenizer in `tokenizer/`, or next to Gemma in the single-file layout)
    against diffusers' pipeline whose parts diffusers and transformers load from the diffusers folder."""
    arch = tiny_ltx2_arch("2.3")
    folders = {layout: write_synthetic_ltx2(arch, tmp_path / layout, SEED, torch.float32, layout)
               for layout in ("single_file", "diffusers")}
    reference = folders["diffusers"]
    pipe = _reference_pipeline(transformers.Gemma3TextModel.from_pretrained(reference / "text_encoder"),
                               reference / "tokenizer", RefConnectors.from_pretrained(reference / "connectors"))
    expected = _reference_stage3(pipe, PROMPTS[:1])
    checkpoints = {"diffusers": LTX2Checkpoint.open(reference), "single_file": LTX2Checkpoint.open(
        folders["single_file"] / SINGLE_FILE, folders["single_file"] / UPSAMPLER_FILE,
        folders["single_file"] / "text_encoder")}
    assert checkpoints["single_file"].tokenizer_path == folders["single_file"] / "text_encoder"
    assert checkpoints["diffusers"].tokenizer_path == reference / "tokenizer"
    for layout, ckpt in checkpoints.items():
        model = load_gemma_text_encoder(ckpt.text_encoder_path, torch.float32, CPU, ckpt.arch.connectors)
        encoder = GemmaPromptEncoder(load_gemma_tokenizer(ckpt.tokenizer_path), model, L)
        _compare(_our_stage3(encoder, ckpt.load("connectors"), PROMPTS[:1]), expected, f"synthetic {layout}")


def test_every_prompt_is_padded_to_max_sequence_length(release_gemma: Path) -> None:
    """The padding finding, on diffusers itself: any prompt gives [1, L, ...] with a left-padded mask;
    ours the same, and a prompt cut short is reported."""
    full = transformers.Gemma3ForConditionalGeneration.from_pretrained(release_gemma, dtype=torch.float32)
    pipe = _reference_pipeline(full, release_gemma, None)
    encoder = GemmaPromptEncoder(load_gemma_tokenizer(release_gemma),
                                 load_gemma_text_encoder(release_gemma, torch.float32, CPU), L)
    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        for prompt, tokens in [("", 1), ("a", 2), ("fox " * 4, 16), ("y" * 100, L)]:
            with torch.no_grad():
                embeds, mask = pipe._get_gemma_prompt_embeds(prompt, max_sequence_length=L, device=CPU)
            hidden, ours_mask = encoder.encode(prompt)
            left_padded = torch.tensor([[0] * (L - tokens) + [1] * tokens])
            assert embeds.shape == hidden.shape == (1, L, 48)
            assert torch.equal(mask, left_padded) and torch.equal(ours_mask, left_padded)
            assert report(f"padding {tokens} tokens", hidden, embeds) <= TOL
    finally:
        logger.remove(sink)
    assert [w.strip() for w in warnings] == [f"text_encoder: prompt cut to {L} tokens (69 tokens dropped)"]


def test_one_batched_call_equals_two_calls(release_gemma: Path) -> None:
    """`encode(["", prompt])` (one Gemma call) gives diffusers' two calls, and a bfloat16 cast on request."""
    encoder = GemmaPromptEncoder(load_gemma_tokenizer(release_gemma),
                                 load_gemma_text_encoder(release_gemma, torch.float32, CPU), L)
    both, both_mask = encoder.encode(["", PROMPTS[0]])
    separate = [encoder.encode(p) for p in ("", PROMPTS[0])]
    assert torch.equal(both_mask, torch.cat([m for _, m in separate]))
    assert report("batched vs separate", both, torch.cat([h for h, _ in separate])) <= 1e-5
    half, _ = encoder.encode(PROMPTS[0], dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, separate[1][0].to(torch.bfloat16))


# ---- loading ---------------------------------------------------------------------------------

def _rewrite_keys(folder: Path, rename: Callable[[str], str | None]) -> None:
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {rename(k): f.get_tensor(k) for k in f.keys()}
    save_file({k: v for k, v in tensors.items() if k is not None}, str(path), metadata=metadata)


@pytest.mark.parametrize("key_layout", ["hub", "in_memory"])
def test_only_the_text_tower_is_loaded(key_layout: str, release_gemma: Path, tmp_path: Path) -> None:
    """The loaded model is the full model's language model, tensor for tensor, with no vision parameter,
    from the Hub's key names (`language_model.model.*`) and from transformers' in-memory ones."""
    full = transformers.Gemma3ForConditionalGeneration.from_pretrained(release_gemma, dtype=torch.float32)
    folder = Path(shutil.copytree(release_gemma, tmp_path / "gemma"))
    if key_layout == "in_memory":
        _rewrite_keys(folder, lambda k: "model." + k.replace("language_model.model.", "language_model.", 1))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        vision = [k for k in f.keys() if "vision_tower." in k or "multi_modal_projector." in k]
    messages: list[str] = []
    sink = logger.add(messages.append, level="INFO", format="{message}")
    try:
        model = load_gemma_text_encoder(folder, torch.bfloat16, CPU)
    finally:
        logger.remove(sink)
    expected = full.model.language_model.state_dict()
    got = model.state_dict()
    assert isinstance(model, transformers.Gemma3TextModel) and len(vision) > 10
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k].to(torch.bfloat16)) for k in got)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    hidden, _ = GemmaPromptEncoder(load_gemma_tokenizer(folder), model, L).encode("a")
    assert hidden.dtype == torch.bfloat16  # the model's dtype, as diffusers' default
    assert f"left {len(vision)} vision/projector tensors" in "".join(messages)


def test_missing_parts_name_the_folder(release_gemma: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(release_gemma, tmp_path / "gemma"))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=rf"tokenizer: {folder} holds no Gemma tokenizer"):
        load_gemma_tokenizer(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"Gemma-3 folder {folder} holds no \*.safetensors weights"):
        load_gemma_text_encoder(folder, torch.float32, CPU)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"Gemma-3 folder {folder} has no config.json"):
        load_gemma_text_encoder(folder, torch.float32, CPU)


def test_missing_text_weights_are_listed(release_gemma: Path, tmp_path: Path) -> None:
    """transformers would initialise a missing weight at random; the loader refuses instead."""
    folder = Path(shutil.copytree(release_gemma, tmp_path / "gemma"))
    _rewrite_keys(folder, lambda k: None if k == "language_model.model.layers.1.mlp.up_proj.weight" else k)
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): layers.1.mlp.up_proj.weight"):
        load_gemma_text_encoder(folder, torch.float32, CPU)


@pytest.mark.parametrize("field, value, message", [
    ("caption_channels", 32, r"`hidden_size`=16 does not fit the connectors' `caption_channels`=32"),
    ("text_proj_in_factor", 4, r"`num_hidden_layers`=2 .* connectors stack `text_proj_in_factor`=4"),
])
def test_gemma_that_does_not_fit_the_connectors(field: str, value: int, message: str, release_gemma: Path) -> None:
    connectors = tiny_ltx2_arch("2.0").connectors.model_copy(update={field: value})
    with pytest.raises(CheckpointError, match=message) as err:
        load_gemma_text_encoder(release_gemma, torch.float32, CPU, connectors)
    assert str(release_gemma) in str(err.value)
