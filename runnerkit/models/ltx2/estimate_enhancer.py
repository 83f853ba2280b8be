"""Memory estimate of LTX-2.5's prompt enhancer (prompt_enhancer.py), added to `estimate25.ltx25_estimate`'s
when the config has a `prompt_enhancer` section.

- module `prompt_enhancer`: the weights of a meta-built `Gemma4ForConditionalGeneration` of the enhancer's
  config.json (the folder's, `enhancer_folders`; absent: `release_enhancer_config`, said in the plan's sources),
  in the run's dtype. The runner places it as a pipeline module (runner25.py `describe_pipeline`), so the
  planner's rules hold (fit.py): resident with `offload.mode` none or when `offload.resident_modules` lists it,
  visiting the device for its stage otherwise, built for its stage under `unload_modules`; it never streams.
- stage `prompt_enhancer` (before the text encoder; it runs only for requests with `enhance_prompt`, and the
  plan counts it as if every request did), at T = `enhancer_tokens` tokens (prompt, system prompt, chat
  template, the image's soft tokens for i2av, `max_new_tokens`), s bytes per element:

      kv       = T * sum over decoder layers of (k_proj + v_proj output features) * s   (generate's KV cache,
                 every layer at full length: sliding windows and shared-KV layers make it smaller)
      prefill  = T * (4 * hidden + 3 * intermediate + layers * per_layer_width) * s     (the prefill's hidden
                 states, MLP and per-layer inputs at their largest layer)
                 + heads * T^2 * s                                                    (one layer's scores)
      logits   = vocab * (s + 2 * 4)          (the last position's logits, their float32 copy and the
                 processed scores: `generate` keeps one position)

  The largest user prompt counted is the text encoder's token budget (`estimate.TEXT_TOKENS`); a system prompt
  file counts its UTF-8 bytes (a byte-level BPE token holds at least one byte), the release's when absent.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runnerkit.config import RunnerConfig
from runnerkit.models.ltx2.estimate import TEXT_TOKENS
from runnerkit.planning.fit import MemoryEstimate, ModuleFootprint, StageFootprint, module_footprint
from runnerkit.weights import build_on_meta

__all__ = ["ENHANCER", "IMAGE_TOKENS", "RELEASE_SYSTEM_PROMPT_BYTES", "TEMPLATE_TOKENS", "enhancer_activation_bytes",
           "enhancer_config", "enhancer_tokens", "release_enhancer_config", "with_enhancer"]

ENHANCER = "prompt_enhancer"
"""The module's and the stage's name."""
TEMPLATE_TOKENS = 64
"""The chat template's tokens around the system prompt and the user turn, and the left padding to a multiple of 8."""
IMAGE_TOKENS = 280
"""An image's soft tokens in the processor's prompt (Gemma-4's `image_seq_length` / `max_soft_tokens` default;
a processor configured for more is beyond the estimate); + 2 for the begin/end-of-image tokens."""
RELEASE_SYSTEM_PROMPT_BYTES = {"t2v": 3769, "i2v": 4708}
"""UTF-8 bytes of diffusers 0.42.1's LTX-2.5 system prompts (`LTX2_5_T2V_DEFAULT_SYSTEM_PROMPT`,
`LTX2_5_I2V_DEFAULT_SYSTEM_PROMPT`), counted when the configured file cannot be read before loading."""


def release_enhancer_config() -> dict[str, Any]:
    """The enhancer's config when its folder is absent: transformers' `Gemma4Config` defaults with the default text,
    vision and audio configs (transformers documents them as "similar to google/gemma-4-e2b-it", the model
    diffusers pairs with LTX-2.5; 5.55 billion parameters, tied embeddings counted once). A new dict per call."""
    return json.loads(_release_json())


@functools.lru_cache(maxsize=1)
def _release_json() -> str:
    import transformers

    return json.dumps(transformers.Gemma4Config(text_config=transformers.Gemma4TextConfig().to_dict(),
                                                vision_config=transformers.Gemma4VisionConfig().to_dict(),
                                                audio_config=transformers.Gemma4AudioConfig().to_dict()).to_dict(),
                      default=str)


def enhancer_config(config: RunnerConfig) -> tuple[dict[str, Any], str]:
    """(the enhancer's config.json fields, the plan's line on where they come from) for the config's
    `prompt_enhancer` section: its folder's config.json, else `release_enhancer_config`.

    Raises:
        ValueError: the section names no folder (prompt_enhancer.py `configured_enhancer_root`).
    """
    from runnerkit.models.ltx2.prompt_enhancer import ENHANCER_FOLDER, configured_enhancer_root

    root = configured_enhancer_root(config)
    assert root is not None, "only with a `prompt_enhancer` section"
    for folder in (root / ENHANCER_FOLDER, root):
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text()), f"prompt enhancer sizes: {folder / 'config.json'}"
    return release_enhancer_config(), (f"prompt enhancer sizes: transformers' Gemma4Config defaults (similar to "
                                       f"google/gemma-4-e2b-it, the release's enhancer): {root} holds no "
                                       f"{ENHANCER_FOLDER}/config.json")


@functools.lru_cache(maxsize=4)
def _meta_enhancer(config_json: str) -> nn.Module:
    import transformers

    config = transformers.Gemma4Config.from_dict(json.loads(config_json))
    return build_on_meta(lambda: transformers.Gemma4ForConditionalGeneration(config))


def _system_prompt_bytes(config: RunnerConfig, kind: str) -> int:
    """UTF-8 bytes of the kind's system prompt file (`read_system_prompts`' lookup), the release's if unreadable."""
    from runnerkit.models.ltx2.prompt_enhancer import ENHANCER_FOLDER, SYSTEM_PROMPT_FILES, configured_enhancer_root

    section, root = config.prompt_enhancer, configured_enhancer_root(config)
    assert section is not None and root is not None, "only with a `prompt_enhancer` section"
    configured = section.system_prompt_t2v if kind == "t2v" else section.system_prompt_i2v
    folder = root / ENHANCER_FOLDER if (root / ENHANCER_FOLDER / "config.json").is_file() else root
    path = Path(configured) if configured else folder / SYSTEM_PROMPT_FILES[kind]  # type: ignore[index]
    return path.stat().st_size if path.is_file() else RELEASE_SYSTEM_PROMPT_BYTES[kind]


def enhancer_tokens(config: RunnerConfig, task: str) -> int:
    """T: the most tokens one enhancement holds: `TEXT_TOKENS` (the user prompt) + the system prompt's UTF-8 bytes
    + `TEMPLATE_TOKENS` (+ `IMAGE_TOKENS` + 2 for i2av) + `prompt_enhancer.max_new_tokens`."""
    assert config.prompt_enhancer is not None, "only with a `prompt_enhancer` section"
    kind = "i2v" if task == "i2av" else "t2v"
    image = IMAGE_TOKENS + 2 if kind == "i2v" else 0
    return TEXT_TOKENS + _system_prompt_bytes(config, kind) + TEMPLATE_TOKENS + image + \
        config.prompt_enhancer.max_new_tokens


def enhancer_activation_bytes(model: nn.Module, tokens: int, s: int) -> int:
    """kv + prefill + logits of one enhancement of `tokens` tokens at `s` bytes per element (module docstring),
    from the meta-built `Gemma4ForConditionalGeneration` `model`."""
    text = model.config.get_text_config()
    kv = 0
    for layer in model.model.language_model.layers:
        k, v = layer.self_attn.k_proj, getattr(layer.self_attn, "v_proj", None)  # k_eq_v layers have none
        kv += k.out_features + (v.out_features if v is not None else k.out_features)
    per_layer = text.num_hidden_layers * (text.hidden_size_per_layer_input or 0)
    prefill = tokens * (4 * text.hidden_size + 3 * text.intermediate_size + per_layer) * s
    prefill += text.num_attention_heads * tokens * tokens * s
    logits = text.vocab_size * (s + 2 * 4)
    return tokens * kv * s + prefill + logits


def with_enhancer(estimate: MemoryEstimate, config: RunnerConfig, task: str, dtype: torch.dtype) -> MemoryEstimate:
    """`estimate` with the enhancer's module (`ModuleFootprint` of its weights in `dtype`) and its stage
    (`enhancer_activation_bytes` at `enhancer_tokens`) before the text encoder's; `estimate` itself without
    a `prompt_enhancer` section."""
    if config.prompt_enhancer is None:
        return estimate
    fields, _ = enhancer_config(config)
    model = _meta_enhancer(json.dumps(fields, sort_keys=True, default=str))
    footprint: ModuleFootprint = module_footprint(model, dtype)
    s = torch.empty((), dtype=dtype, device="meta").element_size()
    tokens = enhancer_tokens(config, task)
    stage = StageFootprint(ENHANCER, ENHANCER, enhancer_activation_bytes(model, tokens, s),
                           f"prompt enhancer generate: KV cache and prefill of {tokens} tokens")
    at = next((i for i, st in enumerate(estimate.stages) if st.name == "text_encoder"), 0)
    return replace(estimate, modules={ENHANCER: footprint, **estimate.modules},
                   stages=(*estimate.stages[:at], stage, *estimate.stages[at:]))
