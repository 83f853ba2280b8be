"""LTX-2.5's prompt enhancer: a Gemma-4 chat model (transformers `Gemma4ForConditionalGeneration` and its
processor) rewrites a short user prompt into the long audio-visual caption the video model was trained on.

Opt-in per request (`enhance_prompt`, docs/ltx2.md "Prompt enhancement"). The recipe follows Lightricks'
ltx-core / ltx-pipelines (`enhance_t2v`, `enhance_i2v`, `generate_enhanced_prompt`, `clean_response`), as
diffusers 0.42.1 `LTX2Pipeline.enhance_prompt` reproduces it with its `GEMMA4_PROMPT_ENHANCEMENT_CONFIG`:

    messages   system: the task's system prompt; user: "user prompt: {prompt}" (text), or an image
               followed by "User Raw Input Prompt: {prompt}." (image-conditioned)
    image      RGB, resized (bicubic) so that its long side is 896 pixels, before the processor
    tokens     the chat template with the generation prompt, left-padded to a multiple of 8
               (`pad_to_multiple`: pad id, mask 0)
    decoding   greedy, `no_repeat_ngram_size` 5, at most 600 new tokens; the global RNG seeded with
               `seed` inside `torch.random.fork_rng` (the caller's RNG state is left as it was)
    text       the new tokens decoded without special tokens, then `clean_response`

System prompts are long texts owned by Lightricks; runnerkit ships none. `load_prompt_enhancer` reads them
from UTF-8 files (used as written): the config's `prompt_enhancer.system_prompt_t2v` / `system_prompt_i2v`,
else `system_prompt_t2v.txt` / `system_prompt_i2v.txt` in the enhancer's folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from loguru import logger
from PIL import Image
from torch import nn

from runnerkit.config import RunnerConfig
from runnerkit.runners.request_state import RequestState
from runnerkit.weights import CheckpointError

__all__ = [
    "ENHANCER_FOLDER",
    "GEMMA4_DECODING",
    "PROCESSOR_FOLDER",
    "SYSTEM_PROMPT_FILES",
    "Decoding",
    "EnhancerParts",
    "PromptEnhancer",
    "clean_response",
    "configured_enhancer_parts",
    "configured_enhancer_root",
    "enhancer_folders",
    "enhancer_messages",
    "fit_long_side",
    "load_configured_enhancer",
    "load_enhancer_model",
    "load_enhancer_parts",
    "load_prompt_enhancer",
    "pad_to_multiple",
    "prompt_to_encode",
    "read_system_prompts",
]

Kind = Literal["t2v", "i2v"]

#: Folders of the enhancer's model and processor in a diffusers LTX-2.5 checkpoint.
ENHANCER_FOLDER = "prompt_enhancer"
PROCESSOR_FOLDER = "processor"
#: System prompt files looked up in the enhancer's folder when the config names none.
SYSTEM_PROMPT_FILES: dict[Kind, str] = {"t2v": "system_prompt_t2v.txt", "i2v": "system_prompt_i2v.txt"}
#: Long side (pixels) a reference image is resized to before the processor (ltx-pipelines' enhance prep).
IMAGE_LONG_SIDE = 896
#: Sequence lengths are left-padded to a multiple of this (the reference's attention alignment).
PAD_MULTIPLE = 8
#: New tokens of warmup's one enhancement: enough to run the prefill and the cached decode step.
WARMUP_NEW_TOKENS = 4
WARMUP_PROMPT = "A short warmup prompt."

# Typographic characters the model likes to emit, mapped to plain ASCII (ltx-pipelines `clean_response`).
_PLAIN = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "-",
                        "\u2013": "-", "\u00a0": " ", "\u2032": "'", "\u2212": "-"})


@dataclass(frozen=True)
class Decoding:
    """The `generate` recipe of an enhancer model: `max_new_tokens` and the keyword arguments passed as given."""

    max_new_tokens: int
    kwargs: Mapping[str, Any]


#: LTX-2.5's dedicated Gemma-4 enhancer (ltx-core `GEMMA4_ENHANCE_GENERATION_KWARGS`): greedy.
GEMMA4_DECODING = Decoding(max_new_tokens=600, kwargs={"do_sample": False, "no_repeat_ngram_size": 5})


def clean_response(text: str) -> str:
    """The enhancer's reply as a prompt: curly quotes, dashes, primes, the minus sign and no-break spaces made
    plain ASCII, then everything before the first letter dropped (the model opens with quotes, bullets or
    spaces). A reply without any letter is returned translated but otherwise whole."""
    text = text.translate(_PLAIN)
    for i, char in enumerate(text):
        if char.isalpha():
            return text[i:]
    return text


def enhancer_messages(prompt: str, system_prompt: str, with_image: bool) -> list[dict[str, Any]]:
    """The chat of one enhancement (ltx-core `enhance_t2v` / `enhance_i2v`): the system prompt, then the user
    turn: "user prompt: {prompt}" as text, or (`with_image`) an image slot and "User Raw Input Prompt: {prompt}."."""
    if not with_image:
        user: Any = f"user prompt: {prompt}"
    else:
        user = [{"type": "image"}, {"type": "text", "text": f"User Raw Input Prompt: {prompt}."}]
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]


def fit_long_side(image: Image.Image, long_side: int = IMAGE_LONG_SIDE) -> Image.Image:
    """`image` as RGB, resized (bicubic, both sides truncated to whole pixels) so its long side is `long_side`;
    the converted image itself when the size already matches.

    Raises:
        TypeError: `image` is not a PIL image.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"`image` must be a PIL.Image.Image, got {type(image).__name__}")
    rgb = image.convert("RGB")
    width, height = rgb.size
    scale = long_side / float(max(width, height))
    size = (int(width * scale), int(height * scale))
    return rgb if size == (width, height) else rgb.resize(size, resample=Image.Resampling.BICUBIC)


def pad_to_multiple(inputs: Mapping[str, torch.Tensor], pad_id: int,
                    multiple: int = PAD_MULTIPLE) -> dict[str, torch.Tensor]:
    """Left-pad the processor's `input_ids` `[1, T]` (with `pad_id`), `attention_mask` `[1, T]` and, when
    present, `token_type_ids` `[1, T]` (with 0) to the next multiple of `multiple` tokens; every other entry
    (pixel values, `mm_token_type_ids`, ...) is kept as it is, as the reference does. Returns a new dict."""
    out = dict(inputs)
    length = out["input_ids"].shape[1]
    pad = -length % multiple
    if pad == 0:
        return out

    def left(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([torch.full((t.shape[0], pad), value, dtype=t.dtype, device=t.device), t], dim=1)

    out["input_ids"] = left(out["input_ids"], pad_id)
    out["attention_mask"] = left(out["attention_mask"], 0)
    if out.get("token_type_ids") is not None:
        out["token_type_ids"] = left(out["token_type_ids"], 0)
    return out


class PromptEnhancer:
    """A loaded enhancer: the chat model, its processor and the system prompts, on one device.

    Args:
        model: a transformers generation model (`Gemma4ForConditionalGeneration`), in eval mode on `device`.
        processor: its processor (`tokenizer` with a chat template; images for image-conditioned prompts).
        system_prompts: "t2v" and/or "i2v" -> the system prompt text.
        decoding: the `generate` recipe (LTX-2.5: `GEMMA4_DECODING`).
        device: where it generates (None: where `model` is). A model kept elsewhere (e.g. the CPU) visits
            `device` for each enhancement and goes back after it, as model offload does.
    """

    def __init__(self, model: nn.Module, processor: Any, system_prompts: Mapping[str, str],
                 decoding: Decoding = GEMMA4_DECODING, device: torch.device | None = None) -> None:
        self.model, self.processor, self.decoding = model, processor, decoding
        self.system_prompts = dict(system_prompts)
        self.home = next(model.parameters()).device
        self.device = torch.device(device) if device is not None else self.home

    def inputs(self, prompt: str, image: Image.Image | None = None) -> dict[str, torch.Tensor]:
        """The model inputs of one enhancement (`input_ids` `[1, T]`, T a multiple of 8, `attention_mask`, and
        the processor's image entries), on the model's device.

        Raises:
            ValueError: no system prompt for the kind (`t2v` without an image, `i2v` with one).
        """
        kind = "t2v" if image is None else "i2v"
        if kind not in self.system_prompts:
            raise ValueError(f"`image`: this enhancer has no {kind} system prompt (it has "
                             f"{sorted(self.system_prompts) or 'none'}); give `prompt_enhancer.system_prompt_{kind}`")
        messages = enhancer_messages(prompt, self.system_prompts[kind], image is not None)
        tokenizer = self.processor.tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images = None if image is None else fit_long_side(image)
        encoded = self.processor(text=text, images=images, return_tensors="pt")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return {k: v.to(self.device) for k, v in pad_to_multiple(dict(encoded), pad_id).items()}

    @torch.inference_mode()
    def generate_ids(self, prompt: str, image: Image.Image | None = None, seed: int = 10,
                     max_new_tokens: int | None = None) -> torch.Tensor:
        """The enhancer's new token ids `[N]` (N <= `max_new_tokens`, default the recipe's), int64 on the CPU.

        Args:
            prompt: the user's prompt; image: a reference frame (image-conditioned enhancement) or None.
            seed: seeds the global RNG inside a fork of it (greedy decoding draws nothing; kept for recipes
                that sample); the caller's RNG state is unchanged afterwards.

        Raises:
            ValueError: as `inputs`.
        """
        inputs = self.inputs(prompt, image)
        budget = self.decoding.max_new_tokens if max_new_tokens is None else max_new_tokens
        devices = [self.device] if self.device.type == "cuda" else []
        visiting = self.device != self.home
        try:
            if visiting:
                self.model.to(self.device)
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                sequences = self.model.generate(**inputs, max_new_tokens=budget, **self.decoding.kwargs)
        finally:
            if visiting:
                self.model.to(self.home)
        return sequences[0, inputs["input_ids"].shape[1]:].cpu()  # [N]: the prompt's tokens dropped

    def enhance(self, prompt: str, image: Image.Image | None = None, seed: int = 10,
                max_new_tokens: int | None = None) -> str:
        """The enhanced prompt: `generate_ids` decoded without special tokens, then `clean_response`.

        Raises:
            ValueError: as `inputs`.
        """
        ids = self.generate_ids(prompt, image, seed, max_new_tokens)
        return clean_response(self.processor.tokenizer.decode(ids, skip_special_tokens=True))

    def warm(self) -> list[str]:
        """Warmup's short enhancements, one per kind it has a system prompt for (`WARMUP_NEW_TOKENS` new tokens
        of a placeholder prompt; "i2v" with a mid-gray 896 x 512 frame through the vision path): the prefill and
        the cached decode step each run once, so a request's enhancement meets no first-call cost. Returns
        their texts, in kind order ("t2v", "i2v")."""
        gray = Image.new("RGB", (IMAGE_LONG_SIDE, 512), (128, 128, 128))
        return [self.enhance(WARMUP_PROMPT, gray if kind == "i2v" else None, seed=0, max_new_tokens=WARMUP_NEW_TOKENS)
                for kind in ("t2v", "i2v") if kind in self.system_prompts]


def read_system_prompts(kinds: tuple[str, ...], files: Mapping[str, str | None], folder: Path) -> dict[str, str]:
    """The system prompt of each of `kinds` ("t2v", "i2v"), read as UTF-8 text and used as written.

    Args:
        files: kind -> the configured file (None: `SYSTEM_PROMPT_FILES[kind]` in `folder`).
        folder: the enhancer's folder.

    Raises:
        ValueError: a kind's file does not exist or is empty, naming the config field and the default file.
    """
    prompts: dict[str, str] = {}
    for kind in kinds:
        configured = files.get(kind)
        path = Path(configured) if configured else folder / SYSTEM_PROMPT_FILES[kind]
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        if not text.strip():
            what = "is empty" if path.is_file() else "does not exist"
            raise ValueError(
                f"`prompt_enhancer.system_prompt_{kind}`: the {kind} system prompt file {str(path)!r} {what}. "
                "runnerkit ships no system prompts: give a text file (e.g. diffusers' LTX-2.5 prompt, "
                f"see docs/ltx2.md \"Prompt enhancement\") in the config, or put it at {SYSTEM_PROMPT_FILES[kind]!r} in the "
                "enhancer's folder")
        prompts[kind] = text
    return prompts


def enhancer_folders(root: str | Path) -> tuple[Path, Path]:
    """(model folder, processor folder) of an enhancer: `prompt_enhancer/` and `processor/` of a diffusers
    checkpoint folder `root`, else `root` itself for both (a transformers folder holding model and processor).

    Raises:
        CheckpointError: `root` is not a folder, or holds no `config.json` in either layout.
    """
    root = Path(root)
    model, processor = root / ENHANCER_FOLDER, root / PROCESSOR_FOLDER
    if not (model / "config.json").is_file():
        model = processor = root
    if not (model / "config.json").is_file():
        raise CheckpointError(f"prompt enhancer {str(root)!r}: neither {ENHANCER_FOLDER}/config.json (diffusers "
                              "layout, with processor/) nor config.json (a transformers folder) is there")
    return model, processor


@dataclass(frozen=True)
class EnhancerParts:
    """An enhancer without its weights: what the runner loads at start-up, the weights being a pipeline module
    placed by the offload config (resident, visiting the device for its stage, or built for it).

    Attributes:
        model_dir: the folder of the model's config.json and safetensors (`enhancer_folders`).
        processor: its processor; system_prompts: kind -> text; decoding: the `generate` recipe.
    """

    model_dir: Path
    processor: Any
    system_prompts: Mapping[str, str]
    decoding: Decoding

    def around(self, model: nn.Module) -> PromptEnhancer:
        """A `PromptEnhancer` generating with `model` where it is (the stage's placed module)."""
        return PromptEnhancer(model, self.processor, self.system_prompts, self.decoding)


def load_enhancer_parts(root: str | Path, kinds: tuple[str, ...], system_prompt_files: Mapping[str, str | None],
                        decoding: Decoding = GEMMA4_DECODING) -> EnhancerParts:
    """The system prompts, the config check and the processor of the enhancer at `root` (`enhancer_folders`),
    without its weights (`load_enhancer_model`).

    Raises:
        CheckpointError: no enhancer at `root`, its config is not a Gemma-4 conditional-generation model, or the
            processor loads as a bare tokenizer (torchvision missing).
        ValueError: a missing system prompt (`read_system_prompts`), checked first.
    """
    import transformers

    model_dir, processor_dir = enhancer_folders(root)
    prompts = read_system_prompts(kinds, system_prompt_files, model_dir)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if config.model_type != "gemma4":
        raise CheckpointError(f"prompt enhancer {str(model_dir)!r}: model_type {config.model_type!r}, expected "
                              "'gemma4' (Gemma4ForConditionalGeneration)")
    processor = transformers.AutoProcessor.from_pretrained(processor_dir)
    if not hasattr(processor, "tokenizer"):  # transformers fell back to the bare tokenizer
        raise CheckpointError(f"prompt enhancer processor {str(processor_dir)!r} loaded as "
                              f"{type(processor).__name__}, not Gemma-4's processor: transformers builds "
                              "Gemma4Processor only with torchvision installed (`pip install torchvision`)")
    return EnhancerParts(model_dir, processor, prompts, decoding)


def load_enhancer_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The enhancer's `Gemma4ForConditionalGeneration` of `model_dir` in `dtype`, in eval mode on `device`."""
    import transformers

    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)
    logger.info("prompt enhancer: {} ({} parameters, {}) on {}", model_dir,
                sum(p.numel() for p in model.parameters()), dtype, device)
    return model.to(device).eval()


def load_prompt_enhancer(root: str | Path, kinds: tuple[str, ...], system_prompt_files: Mapping[str, str | None],
                         dtype: torch.dtype, device: torch.device, decoding: Decoding = GEMMA4_DECODING,
                         home: torch.device | None = None) -> PromptEnhancer:
    """Load the enhancer of `root` (`enhancer_folders`) through transformers, in `dtype`, generating on `device`.

    Args:
        kinds: the system prompts the runner's task needs ("t2v" for text-only tasks, "i2v" with an image).
        system_prompt_files: kind -> configured file or None (`read_system_prompts`).
        home: where the weights stay between enhancements (None: `device`, resident).

    Raises:
        CheckpointError: no enhancer at `root`, or its config is not a Gemma-4 conditional-generation model.
        ValueError: a missing system prompt (`read_system_prompts`), checked before the weights load.
    """
    parts = load_enhancer_parts(root, kinds, system_prompt_files, decoding)
    model = load_enhancer_model(parts.model_dir, dtype, home or device)
    return PromptEnhancer(model, parts.processor, parts.system_prompts, decoding, device)


def configured_enhancer_root(config: RunnerConfig) -> Path | None:
    """The enhancer folder the config's `prompt_enhancer` section names: `path`, else `model_path` (None: no
    section).

    Raises:
        ValueError: a section without a folder (a synthetic checkpoint, or neither key).
    """
    section = config.prompt_enhancer
    if section is None:
        return None
    if section.path is None and config.synthetic_checkpoint is not None:
        raise ValueError("`prompt_enhancer.path`: a synthetic checkpoint (`synthetic_checkpoint`) has no prompt "
                         "enhancer; give the folder of one (e.g. a diffusers LTX-2.5 folder's `prompt_enhancer/` "
                         "parent)")
    root = section.path or config.model_path
    if root is None:
        raise ValueError("`prompt_enhancer.path`: no enhancer folder (and no `model_path` to look in)")
    return Path(root)


def configured_enhancer_parts(config: RunnerConfig, image_task: bool) -> EnhancerParts | None:
    """`load_enhancer_parts` as the config's `prompt_enhancer` section says (None: no section): from
    `configured_enhancer_root`, with the system prompt of the task's kind ("i2v" for `image_task`, else "t2v") and
    at most `max_new_tokens` new tokens.

    Raises:
        CheckpointError, ValueError: as `configured_enhancer_root` and `load_enhancer_parts`.
    """
    root = configured_enhancer_root(config)
    if root is None:
        return None
    section = config.prompt_enhancer
    assert section is not None, "a root comes from the section"
    kind: Kind = "i2v" if image_task else "t2v"
    files = {"t2v": section.system_prompt_t2v, "i2v": section.system_prompt_i2v}
    return load_enhancer_parts(root, (kind,), files, Decoding(section.max_new_tokens, GEMMA4_DECODING.kwargs))


def load_configured_enhancer(config: RunnerConfig, image_task: bool, dtype: torch.dtype, device: torch.device,
                             home: torch.device | None = None) -> PromptEnhancer | None:
    """The enhancer as its config's `prompt_enhancer` section says (None: no section, nothing loads):
    `configured_enhancer_parts`, then its weights in `dtype` on `home` (None: `device`), generating on `device`.

    Raises:
        CheckpointError, ValueError: as `configured_enhancer_parts`.
    """
    parts = configured_enhancer_parts(config, image_task)
    if parts is None:
        return None
    model = load_enhancer_model(parts.model_dir, dtype, home or device)
    return PromptEnhancer(model, parts.processor, parts.system_prompts, parts.decoding, device)


def prompt_to_encode(req: RequestState, enhancer: PromptEnhancer | None, image: Image.Image | None = None) -> str:
    """The prompt the text encoder reads for request `req`: the hook a family's text stage calls first.

    - `req.info.enhance_prompt` false: `req.info.prompt`, nothing runs.
    - true: `enhancer.enhance(prompt, image, seed=req.info.seed)` (the request's seed, as diffusers' pipeline
      seeds from the request's generator), also stored in `req.enhanced_prompt` for the sidecar.
    - warmup (`req.info.warmup`) with an enhancer: `enhancer.warm()` (the family calls its text stage once
      for all warmup shapes), then the dummy prompt as it is.

    Args:
        image: the request's reference frame for image-conditioned tasks, else None (not read in warmup).

    Raises:
        RuntimeError: `enhance_prompt` without an enhancer (admission refuses such a request first).
    """
    info = req.info
    if info.warmup:
        if enhancer is not None:
            enhancer.warm()
        return info.prompt
    if not info.enhance_prompt:
        return info.prompt
    if enhancer is None:
        raise RuntimeError("`enhance_prompt`=true reached a runner without a loaded prompt enhancer (admission "
                           "should have refused it: the runner class must declare PROMPT_ENHANCER and load the "
                           "config's `prompt_enhancer`)")
    req.enhanced_prompt = enhancer.enhance(info.prompt, image, seed=info.seed)
    logger.info("enhanced prompt ({} -> {} characters): {}", len(info.prompt), len(req.enhanced_prompt),
                req.enhanced_prompt)
    return req.enhanced_prompt
