"""LTX-2.5 prompt enhancement: a tiny random `Gemma4ForConditionalGeneration` and a tiny Gemma-4 processor
(character-level tokenizer, chat template and image processor, built here) against diffusers 0.42.1
`LTX2Pipeline.enhance_prompt` with its `GEMMA4_PROMPT_ENHANCEMENT_CONFIG`: the same new token ids and the same
cleaned text, for text-only and image-conditioned prompts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models

from runnerkit.config import load_runner_config
from runnerkit.models.ltx2.prompt_enhancer import (
    GEMMA4_DECODING,
    PromptEnhancer,
    clean_response,
    enhancer_folders,
    fit_long_side,
    load_configured_enhancer,
    pad_to_multiple,
    prompt_to_encode,
    read_system_prompts,
)
from runnerkit.runners.pipeline import InputInfo
from runnerkit.runners.request_state import RequestState
from runnerkit.synthetic import save_pretrained_here
from runnerkit.weights import CheckpointError
from test_cases._reference import require_reference

transformers = require_reference("transformers")
diffusers = require_reference("diffusers")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = [chr(c) for c in range(0x20, 0x7F)]
MEDIA = ["<boi>", "<eoi>", "<image>", "<|video|>", "<boa>", "<eoa>", "<audio>", "<sot>", "<eot>"]
VOCAB = {t: i for i, t in enumerate([*SPECIALS, *CHARS, *MEDIA])}
# A chat template of the tiny tokenizer: the real one differs, but both sides render the same messages with it.
TEMPLATE = ("{% for m in messages %}<sot>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<eot>\n{% endfor %}"
            "{% if add_generation_prompt %}<sot>model\n{% endif %}")
SYSTEM = {"t2v": "Write a detailed video caption.", "i2v": "Describe the video that starts at this image."}
NEW_TOKENS = 6


def _tokenizer(folder: Path) -> Any:
    tok = Tokenizer(models.BPE(vocab=VOCAB, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([*SPECIALS, *MEDIA])
    tok.decoder = decoders.Fuse()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.to_str())
    media = {"image_token": "<image>", "boi_token": "<boi>", "eoi_token": "<eoi>", "audio_token": "<audio>",
             "boa_token": "<boa>", "eoa_token": "<eoa>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
              "bos_token": "<bos>", "unk_token": "<unk>", "extra_special_tokens": media, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.AutoTokenizer.from_pretrained(folder)


class _Processor(transformers.Gemma4Processor):
    """`Gemma4Processor` whose video processor is not type-checked: the real one needs torchvision, which the
    test environment lacks; text and image prompts never use it."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _processor(folder: Path) -> Any:
    """Patch 4, pooling 2, the smallest soft-token budget (70): an image becomes <= 70 `<image>` tokens."""
    from transformers.video_processing_utils import BaseVideoProcessor

    images = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    return _Processor(feature_extractor=transformers.Gemma4AudioFeatureExtractor(), image_processor=images,
                      tokenizer=_tokenizer(folder), video_processor=BaseVideoProcessor(), chat_template=TEMPLATE,
                      image_seq_length=70)


def _model() -> Any:
    """`Gemma4ForConditionalGeneration` 16 wide: 2 text layers (sliding, full), a 1-layer vision tower."""
    text = transformers.Gemma4TextConfig(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, global_head_dim=8, sliding_window=8, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=len(VOCAB),
        hidden_size_per_layer_input=4, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                             pooling_kernel_size=2, patch_size=4, position_embedding_size=64)
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
        boi_token_id=VOCAB["<boi>"], eoi_token_id=VOCAB["<eoi>"], image_token_id=VOCAB["<image>"],
        video_token_id=VOCAB["<|video|>"], boa_token_id=None, audio_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return transformers.Gemma4ForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def enhancer(tmp_path_factory: pytest.TempPathFactory) -> PromptEnhancer:
    folder = tmp_path_factory.mktemp("enhancer")
    return PromptEnhancer(_model(), _processor(folder / "processor"), SYSTEM)


def _reference(enhancer: PromptEnhancer, prompt: str, image: Image.Image | None, seed: int) -> tuple[Any, str]:
    """diffusers' `enhance_prompt` on the same model and processor: (its new token ids [N], its text)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    captured: list[torch.Tensor] = []
    model = enhancer.model
    generate = model.generate

    def spy(**kwargs: Any) -> torch.Tensor:
        out = generate(**kwargs)
        captured.append(out[0, kwargs["input_ids"].shape[1]:])
        return out

    pipe = SimpleNamespace(prompt_enhancer=model, processor=enhancer.processor, text_encoder=None,
                           _execution_device=torch.device("cpu"))
    model.generate = spy
    try:
        system = SYSTEM["t2v" if image is None else "i2v"]
        texts = LTX2Pipeline.enhance_prompt(pipe, prompt=prompt, system_prompt=system, max_new_tokens=NEW_TOKENS,
                                            seed=seed, device="cpu", image=image)
    finally:
        del model.generate
    return captured[0], texts[0]


def _image() -> Image.Image:
    pixels = np.random.RandomState(0).randint(0, 256, (20, 30, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("prompt", ["A red fox jumps over a log.", "  \u201cquoted\u201d dusk \u2014 rain  "])
def test_text_enhancement_matches_diffusers(enhancer: PromptEnhancer, prompt: str) -> None:
    """Greedy decoding of the same left-padded chat: the new token ids and the cleaned text are identical."""
    ids = enhancer.generate_ids(prompt, seed=11, max_new_tokens=NEW_TOKENS)
    text = enhancer.enhance(prompt, seed=11, max_new_tokens=NEW_TOKENS)
    ref_ids, ref_text = _reference(enhancer, prompt, None, 11)
    assert ids.tolist() == ref_ids.tolist()
    assert len(ids) == NEW_TOKENS  # the tiny model never emits its end token this early
    assert text == ref_text


def test_image_enhancement_matches_diffusers(enhancer: PromptEnhancer) -> None:
    """Image-conditioned: the frame resized to a long side of 896 and through the vision tower (its soft tokens
    in the prompt), the other user message; the same ids and text as diffusers, and not those of the text path."""
    prompt = "The cat turns its head."
    ids = enhancer.generate_ids(prompt, _image(), seed=11, max_new_tokens=NEW_TOKENS)
    ref_ids, ref_text = _reference(enhancer, prompt, _image(), 11)
    assert ids.tolist() == ref_ids.tolist()
    assert enhancer.enhance(prompt, _image(), seed=11, max_new_tokens=NEW_TOKENS) == ref_text
    inputs = enhancer.inputs(prompt, _image())
    assert int((inputs["input_ids"] == VOCAB["<image>"]).sum()) > 0
    assert inputs["input_ids"].shape[1] % 8 == 0


def test_inputs_are_left_padded_to_a_multiple_of_8(enhancer: PromptEnhancer) -> None:
    """The chat renders to 8k+3 tokens here: 5 pad ids in front, masked out; the chat's own tokens unchanged."""
    inputs = enhancer.inputs("abcdef")
    ids, mask = inputs["input_ids"][0].tolist(), inputs["attention_mask"][0].tolist()
    chat = "<sot>system\n" + SYSTEM["t2v"] + "<eot>\n<sot>user\nuser prompt: abcdef<eot>\n<sot>model\n"
    expected = enhancer.processor.tokenizer(chat, add_special_tokens=False)["input_ids"]
    pad = -len(expected) % 8
    assert pad == 5, len(expected)
    assert ids == [0] * pad + expected
    assert mask == [0] * pad + [1] * len(expected)


def test_pad_to_multiple_keeps_aligned_inputs_and_pads_token_types() -> None:
    ids = torch.arange(1, 9)[None]
    same = pad_to_multiple({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, pad_id=5)
    assert same["input_ids"].tolist() == ids.tolist()
    short = {"input_ids": ids[:, :6], "attention_mask": torch.ones(1, 6, dtype=torch.long),
             "token_type_ids": torch.full((1, 6), 2), "pixel_values": torch.ones(1, 3)}
    out = pad_to_multiple(short, pad_id=5)
    assert out["input_ids"].tolist() == [[5, 5, 1, 2, 3, 4, 5, 6]]
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1]]
    assert out["token_type_ids"].tolist() == [[0, 0, 2, 2, 2, 2, 2, 2]]
    assert out["pixel_values"] is short["pixel_values"]


def test_seed_leaves_the_callers_rng_alone(enhancer: PromptEnhancer) -> None:
    """The enhancer seeds inside a fork of the global RNG: the next draw of the caller is the one it expected."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    enhancer.generate_ids("x", seed=99, max_new_tokens=2)
    assert torch.equal(torch.rand(3), expected)


def _generate_calls(enhancer: PromptEnhancer, run: Any) -> list[tuple[int, bool]]:
    """`run()`'s calls of the model's `generate`: (max_new_tokens, with pixel values)."""
    calls: list[tuple[int, bool]] = []
    generate = enhancer.model.generate

    def spy(**kwargs: Any) -> torch.Tensor:
        calls.append((kwargs["max_new_tokens"], "pixel_values" in kwargs))
        return generate(**kwargs)

    enhancer.model.generate = spy
    try:
        run()
    finally:
        del enhancer.model.generate
    return calls


def test_warm_runs_one_short_enhancement_per_kind(enhancer: PromptEnhancer) -> None:
    assert _generate_calls(enhancer, enhancer.warm) == [(4, False), (4, True)]
    text_only = PromptEnhancer(enhancer.model, enhancer.processor, {"t2v": "x"})
    assert _generate_calls(text_only, text_only.warm) == [(4, False)]


def _state(warmup: bool = False, enhance: bool = False) -> RequestState:
    info = InputInfo(prompt="a fox", negative_prompt="", seed=5, height=32, width=32, frames=9, warmup=warmup,
                     enhance_prompt=enhance)
    return RequestState(info)


def test_prompt_to_encode(enhancer: PromptEnhancer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not asked: the prompt, nothing generated; asked: the enhanced text (the request's seed), kept for the
    sidecar; warmup: `warm` once, the dummy prompt unchanged."""
    seeds: list[int] = []
    original = PromptEnhancer.enhance

    def enhance(self: PromptEnhancer, prompt: str, image: Any = None, seed: int = 10,
                max_new_tokens: Any = None) -> str:
        seeds.append(seed)
        return original(self, prompt, image, seed, max_new_tokens if max_new_tokens is not None else NEW_TOKENS)

    monkeypatch.setattr(PromptEnhancer, "enhance", enhance)
    plain = _state()
    assert _generate_calls(enhancer, lambda: prompt_to_encode(plain, enhancer)) == []
    assert prompt_to_encode(plain, None) == "a fox" and plain.enhanced_prompt is None
    asked = _state(enhance=True)
    text = prompt_to_encode(asked, enhancer)
    assert text == asked.enhanced_prompt == original(enhancer, "a fox", None, 5, NEW_TOKENS) and seeds[0] == 5
    with_image = _state(enhance=True)
    assert prompt_to_encode(with_image, enhancer, _image()) == original(enhancer, "a fox", _image(), 5, NEW_TOKENS)
    warm = _state(warmup=True)
    assert _generate_calls(enhancer, lambda: prompt_to_encode(warm, enhancer)) == [(4, False), (4, True)]
    assert prompt_to_encode(warm, None) == "a fox" and warm.enhanced_prompt is None
    with pytest.raises(RuntimeError, match="without a loaded prompt enhancer"):
        prompt_to_encode(_state(enhance=True), None)


def test_a_model_kept_elsewhere_visits_the_device_per_enhancement(enhancer: PromptEnhancer) -> None:
    moves: list[str] = []
    visiting = PromptEnhancer(enhancer.model, enhancer.processor, SYSTEM, device=torch.device("cpu"))
    visiting.home = torch.device("meta")  # stands for the CPU of a GPU run; `to` is recorded, not done
    visiting.model.to = lambda device: moves.append(str(device)) or visiting.model
    try:
        ids = visiting.generate_ids("x", max_new_tokens=2)
    finally:
        del visiting.model.to
    assert moves == ["cpu", "meta"] and ids.tolist() == enhancer.generate_ids("x", max_new_tokens=2).tolist()


def test_decoding_recipe_is_the_gemma4_one() -> None:
    """ltx-core's Gemma-4 recipe as diffusers copies it."""
    from diffusers.pipelines.ltx2.utils import GEMMA4_PROMPT_ENHANCEMENT_CONFIG as ref

    assert GEMMA4_DECODING.max_new_tokens == ref.max_new_tokens == 600
    assert dict(GEMMA4_DECODING.kwargs) == ref.generation_kwargs == {"do_sample": False, "no_repeat_ngram_size": 5}


@pytest.mark.parametrize("raw, cleaned", [
    ("\u201cA cat\u201d \u2014 sits", "A cat\" - sits"),  # opening quote dropped, the rest made ASCII
    ("  - 1. \u2018Rain\u2019 falls", "Rain' falls"),
    ("\u00a0x\u2212y\u2032z\u2013w", "x-y'z-w"),
    ("123 !?", "123 !?"),  # no letter: kept whole
    ("", ""),
    ("\u00e9t\u00e9 at noon", "\u00e9t\u00e9 at noon"),  # a non-ASCII letter is a letter
])
def test_clean_response(raw: str, cleaned: str) -> None:
    from diffusers.pipelines.ltx2.prompt_enhancement import clean_response as reference

    assert clean_response(raw) == cleaned == reference(raw)


def test_fit_long_side() -> None:
    """Long side to 896, the other side truncated; RGB; diffusers' `_prepare_enhance_image` gives the same pixels."""
    from diffusers.pipelines.ltx2.prompt_enhancement import _prepare_enhance_image

    image = _image().convert("L")
    out = fit_long_side(image)
    assert out.size == (896, 597) and out.mode == "RGB"
    assert np.array_equal(np.asarray(out), np.asarray(_prepare_enhance_image(image)))
    with pytest.raises(TypeError, match="`image` must be a PIL.Image.Image, got ndarray"):
        fit_long_side(np.zeros((4, 4, 3)))


def test_missing_system_prompt_is_refused(tmp_path: Path, enhancer: PromptEnhancer) -> None:
    (tmp_path / "system_prompt_t2v.txt").write_text("Caption it.\n")
    (tmp_path / "mine.txt").write_text("Mine.")
    assert read_system_prompts(("t2v",), {}, tmp_path) == {"t2v": "Caption it.\n"}
    assert read_system_prompts(("t2v", "i2v"), {"i2v": str(tmp_path / "mine.txt")}, tmp_path)["i2v"] == "Mine."
    with pytest.raises(ValueError, match=r"`prompt_enhancer.system_prompt_i2v`: the i2v system prompt file "
                                         r".*system_prompt_i2v.txt' does not exist. runnerkit ships no system"):
        read_system_prompts(("i2v",), {}, tmp_path)
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(ValueError, match="empty.txt' is empty"):
        read_system_prompts(("t2v",), {"t2v": str(tmp_path / "empty.txt")}, tmp_path)
    only_text = PromptEnhancer(enhancer.model, enhancer.processor, {"t2v": "x"})
    with pytest.raises(ValueError, match=r"no i2v system prompt \(it has \['t2v'\]\)"):
        only_text.inputs("a", _image())


def test_enhancer_folders(tmp_path: Path) -> None:
    """diffusers layout (prompt_enhancer/ + processor/) first, else one transformers folder; else refused."""
    (tmp_path / "prompt_enhancer").mkdir()
    (tmp_path / "prompt_enhancer" / "config.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")  # a folder of both layouts: the diffusers one wins
    assert enhancer_folders(tmp_path) == (tmp_path / "prompt_enhancer", tmp_path / "processor")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.json").write_text("{}")
    assert enhancer_folders(flat) == (flat, flat)
    with pytest.raises(CheckpointError, match="neither prompt_enhancer/config.json"):
        enhancer_folders(tmp_path / "nothing")


def test_load_configured_enhancer(tmp_path: Path, enhancer: PromptEnhancer, monkeypatch: pytest.MonkeyPatch) -> None:
    """No section: nothing loads. A diffusers layout under `model_path`: the saved model, the system prompt of the
    task's kind and the section's token budget. (transformers' `AutoProcessor` needs torchvision for Gemma-4's
    video processor, absent here: it returns the in-memory tiny processor, and is checked to be asked for
    `processor/`.)"""
    base = {"model_cls": "ltx2", "task": "t2av", "model_path": str(tmp_path), "device": "cpu"}
    assert load_configured_enhancer(load_runner_config(None, base), False, torch.float32, torch.device("cpu")) is None
    save_pretrained_here(enhancer.model, tmp_path / "prompt_enhancer")
    (tmp_path / "prompt_enhancer" / "system_prompt_i2v.txt").write_text("From the image.")
    asked: list[Path] = []
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained",
                        lambda folder, **kw: asked.append(Path(folder)) or enhancer.processor)
    config = load_runner_config(None, {**base, "prompt_enhancer": {"max_new_tokens": 3}})
    with pytest.raises(ValueError, match="`prompt_enhancer.system_prompt_t2v`: the t2v system prompt file"):
        load_configured_enhancer(config, False, torch.float32, torch.device("cpu"))
    assert asked == []  # refused before anything loads
    loaded = load_configured_enhancer(config, True, torch.float32, torch.device("cpu"))
    assert asked == [tmp_path / "processor"] and loaded.system_prompts == {"i2v": "From the image."}
    assert loaded.decoding == type(GEMMA4_DECODING)(3, GEMMA4_DECODING.kwargs)
    other = PromptEnhancer(enhancer.model, enhancer.processor, {"i2v": "From the image."})
    assert loaded.generate_ids("z", _image()).tolist() == other.generate_ids("z", _image(), max_new_tokens=3).tolist()
    # without torchvision transformers hands back the bare tokenizer: refused at load, naming torchvision
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda folder, **kw: enhancer.processor.tokenizer)
    with pytest.raises(CheckpointError, match=r"not Gemma-4's processor: .*torchvision"):
        load_configured_enhancer(config, True, torch.float32, torch.device("cpu"))
    synthetic = load_runner_config(None, {**base, "prompt_enhancer": {}, "synthetic_checkpoint": {"seed": 0}})
    with pytest.raises(ValueError, match=r"`prompt_enhancer.path`: a synthetic checkpoint .* has no prompt enhancer"):
        load_configured_enhancer(synthetic, True, torch.float32, torch.device("cpu"))
    (tmp_path / "prompt_enhancer" / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(CheckpointError, match="model_type 'gemma3', expected 'gemma4'"):
        load_configured_enhancer(config, True, torch.float32, torch.device("cpu"))
