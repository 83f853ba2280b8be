"""Synthetic LTX-2 checkpoints: deterministic random weights in either layout of checkpoint.py.

Values depend only on (our tensor name, seed) (`weights.synthetic_tensor`), so both layouts hold the
same networks bit for bit. The single-file layout builds the whole file in memory, one tensor drawn
at a time (its own size; the diffusers layout writes shard by shard, `synthetic.write_sharded`). The Gemma-3 text
encoder is a tiny `Gemma3TextModel` (transformers, random weights from `seed`, `save_pretrained`),
sized so that its hidden states fit the connectors (`caption_channels` wide, `text_proj_in_factor` - 1
layers); the tokenizer is runnerkit's character-level debug tokenizer (in `tokenizer/` for the diffusers
layout, next to the model in `text_encoder/` for the single-file layout, as the release ships Gemma).

The single file's `config` metadata is runnerkit's sections format (`LTX2Arch.to_sections`), not the
ltx-core format of Lightricks' files (release_config.py): that format cannot describe every arch this
writer is given. ltx-core sizes LTX-2.3's per-modality text projections to the transformer's widths,
and `tiny_ltx2_arch("2.3")` does not chain them (video connector 32 wide, transformer 16), so writing it
there would not read back to the same arch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from runnerkit import synthetic
from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.files import give_default_mode
from runnerkit.models.ltx2 import checkpoint_keys as ck
from runnerkit.models.ltx2.arch import COMPONENTS, LTX2Arch
from runnerkit.models.ltx2.checkpoint import DIFFUSERS_STEM, SCALE_SUFFIX, UNUSED_SCALE_SUFFIX, network_factory
from runnerkit.models.ltx2.transformer import keep_fp32
from runnerkit.offload.layout import quantize_fp8_e4m3
from runnerkit.weights import build_on_meta, synthetic_tensor

SINGLE_FILE = "ltx2.safetensors"
UPSAMPLER_FILE = "latent_upsampler.safetensors"
GEMMA_VOCAB = 128
Fp8Blocks = Literal["none", "plain", "scaled"]
GemmaSize = Literal["tiny", "release"]
RELEASE_GEMMA_SIZES: dict[str, int] = {
    "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 1024}
"""Gemma-3-12B's text model sizes (google/gemma-3-12b-it's `text_config`; 11.8 B parameters, 21.9 GiB in
bf16): `gemma="release"` writes a random stand-in of this size, so memory plans and streaming see the
real text encoder (its 262 208-row embedding is indexed by the debug tokenizer's first ids only)."""
_CLASSES = {"transformer": "LTX2VideoTransformer3DModel", "connectors": "LTX2TextConnectors",
            "vae": "AutoencoderKLLTX2Video", "audio_vae": "AutoencoderKLLTX2Audio", "vocoder": "LTX2Vocoder",
            "latent_upsampler": "LTX2LatentUpsamplerModel"}


def shapes_of(arch: LTX2Arch, component: str) -> dict[str, tuple[int, ...]]:
    """Our name -> shape of every tensor of `component`'s network (meta-built, no memory)."""
    return {k: tuple(v.shape) for k, v in build_on_meta(network_factory(component, arch)).state_dict().items()}


def _fp32(component: str, name: str) -> bool:
    return component == "transformer" and keep_fp32(name)


def fp8_block_weight(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors an fp8 release stores in fp8: 2-D linear weights inside the transformer blocks."""
    return name.startswith("transformer_blocks.") and name.endswith(".weight") and len(shape) == 2


def synthetic_state_dict(arch: LTX2Arch, component: str, seed: int, dtype: torch.dtype,
                         generator_device: str = "cpu") -> dict[str, torch.Tensor]:
    """`component`'s synthetic tensors in our names (the transformer's float32 layers in float32)."""
    return {k: synthetic_tensor(k, s, seed, torch.float32 if _fp32(component, k) else dtype, generator_device)
            for k, s in shapes_of(arch, component).items()}


def write_release_gemma(folder: Path, seed: int, dtype: torch.dtype = torch.bfloat16,
                        generator_device: str = "cpu") -> Path:
    """A random Gemma-3 text model of the release's size (`RELEASE_GEMMA_SIZES`, ~22 GiB in bf16): config.json
    as `save_pretrained` writes it and `model-*.safetensors` shards with their index, drawn tensor by tensor
    (`synthetic.write_sharded`: host memory ~one shard; "cuda" draws in seconds). Norm gains are ~1 + noise."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(**RELEASE_GEMMA_SIZES)
    config.torch_dtype = dtype
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Gemma3TextModel(config).state_dict().items()}
    config.save_pretrained(folder)
    synthetic.write_sharded(shapes, lambda sd: sd, folder, "model", seed, dtype, lambda name: False,
                            generator_device=generator_device)
    return folder


def write_tiny_gemma(folder: Path, arch: LTX2Arch, seed: int, vision: bool = False) -> Path:
    """A small Gemma-3 text model whose stacked hidden states fit `arch.connectors` (its width and
    number of layers; two heads, a narrow MLP), saved with `save_pretrained` (config.json +
    model.safetensors).

    Args:
        vision: write the release's class instead, `Gemma3ForConditionalGeneration` (google/gemma-3-12b-it),
            with a tiny SigLIP vision tower and projector next to the text model (`language_model.model.*`).
    """
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        Gemma3TextModel,
        SiglipVisionConfig,
    )

    config = Gemma3TextConfig(**tiny_gemma_sizes(arch), max_position_embeddings=256, sliding_window=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vision:  # 28 / 14 = 2 x 2 patches pooled to mm_tokens_per_image = 4 image tokens
            siglip = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=28, patch_size=14)
            model = Gemma3ForConditionalGeneration(Gemma3Config(
                text_config=config.to_dict(), vision_config=siglip.to_dict(), mm_tokens_per_image=4))
        else:
            model = Gemma3TextModel(config)
    synthetic.save_pretrained_here(model, folder)
    return folder


def _write_single_file(arch: LTX2Arch, tmp: Path, seed: int, dtype: torch.dtype, fp8_blocks: Fp8Blocks,
                       generator_device: str = "cpu") -> None:
    # One tensor drawn at a time and stored as written (fp8 blocks quantized at once): host memory
    # peaks at the file's size (save_file writes from the tensors' memory), not file + a bf16 copy.
    tensors: dict[str, torch.Tensor] = {}
    for component in COMPONENTS[:-1]:
        shapes = shapes_of(arch, component)
        names = ck.native_names(component, list(shapes), arch)
        for name, shape in shapes.items():
            key = names[name]
            tensor = synthetic_tensor(name, shape, seed, torch.float32 if _fp32(component, name) else dtype,
                                      generator_device)
            if component == "transformer" and fp8_blocks != "none" and fp8_block_weight(name, tensor.shape):
                if fp8_blocks == "scaled":
                    tensor, scale = quantize_fp8_e4m3(tensor.to(generator_device).float())
                    tensor, scale = tensor.cpu(), scale.cpu()
                    module = key[: -len("weight")]
                    tensors[module + SCALE_SUFFIX] = scale.reshape(()).float()
                    tensors[module + UNUSED_SCALE_SUFFIX] = torch.ones((), dtype=torch.float32)
                else:
                    tensor = tensor.to(torch.float8_e4m3fn)
            tensors[key] = tensor
    sections = arch.to_sections()
    upsampler_config = sections.pop("latent_upsampler")
    save_file(tensors, str(tmp / SINGLE_FILE),
              metadata={"config": json.dumps(sections), "model_version": f"synthetic-ltx-{arch.version}"})
    del tensors
    upsampler = synthetic_state_dict(arch, "latent_upsampler", seed, dtype, generator_device)
    save_file({k: v.contiguous() for k, v in upsampler.items()}, str(tmp / UPSAMPLER_FILE),
              metadata={"config": json.dumps(upsampler_config)})
    for name in (SINGLE_FILE, UPSAMPLER_FILE):
        give_default_mode(tmp / name)


def _write_diffusers(arch: LTX2Arch, tmp: Path, seed: int, dtype: torch.dtype, generator_device: str = "cpu") -> None:
    sections = arch.to_sections()
    (tmp / "model_index.json").write_text(json.dumps({
        "_class_name": "LTX2Pipeline", **{c: ["diffusers", _CLASSES[c]] for c in COMPONENTS},
        "text_encoder": ["transformers", "Gemma3TextModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"]},
        indent=1))
    for component in COMPONENTS:
        folder = tmp / component
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"_class_name": _CLASSES[component], **sections[component]},
                                                       indent=1))
        synthetic.write_sharded(shapes_of(arch, component), lambda sd: sd, folder, DIFFUSERS_STEM, seed, dtype,
                                lambda name, c=component: _fp32(c, name), generator_device=generator_device)


def write_synthetic_ltx2(arch: LTX2Arch, out: Path, seed: int, dtype: torch.dtype = torch.bfloat16,
                         layout: Literal["single_file", "diffusers"] = "diffusers", fp8_blocks: Fp8Blocks = "none",
                         replace: bool = False, generator_device: str = "cpu", gemma: GemmaSize = "tiny",
                         announce: bool = True) -> Path:
    """Write deterministic random weights for `arch` to the folder `out` (atomically: tmp folder, rename).

    single_file: `out/ltx2.safetensors`, `out/latent_upsampler.safetensors`, `out/text_encoder/` (Gemma-3
    and its tokenizer, as the release's Gemma folder); open with
    `LTX2Checkpoint.open(out / SINGLE_FILE, out / UPSAMPLER_FILE, out / "text_encoder")`.
    diffusers: `out/` is the folder (`LTX2Checkpoint.open(out)`), the tokenizer in `out/tokenizer/`.

    Args:
        fp8_blocks: single_file only: store the transformer blocks' linear weights as float8_e4m3fn,
            "plain" (cast) or "scaled" (absmax/448 per tensor, `weight_scale` and an unused `input_scale`).
        generator_device: draw the values on this device ("cuda": real sizes in seconds; the values
            depend on the device's generator, `weights.synthetic_tensor`). The single file is built in
            host memory (its own size: a 22B fp8 file ~25 GB), the diffusers layout shard by shard.
        gemma: "tiny" (a narrow stand-in of the arch's width and depth, `tiny_gemma_sizes`) or "release"
            (Gemma-3-12B's sizes, `write_release_gemma`; the arch must have its 3840 x 48 connectors).
        announce: log the "SYNTHETIC checkpoint" warning naming `out` (False: a writer that builds on this one,
            e.g. LTX-2.5's in a temporary folder, announces its own final folder once).

    Raises:
        ValueError: fp8 blocks asked for the diffusers layout.
        CheckpointError: `out` is not empty and not this seed's synthetic checkpoint (`replace` false).
    """
    if fp8_blocks != "none" and layout != "single_file":
        raise ValueError(f"`fp8_blocks`={fp8_blocks!r} needs layout 'single_file' (as the fp8 releases ship)")
    wants = (RELEASE_GEMMA_SIZES["hidden_size"], RELEASE_GEMMA_SIZES["num_hidden_layers"] + 1)
    has = (arch.connectors.caption_channels, arch.connectors.text_proj_in_factor)
    if gemma == "release" and has != wants:
        raise ValueError(f"`gemma`='release' writes Gemma-3-12B (width, hidden states) {wants}; the arch's connectors "
                         f"take {has}: use gemma 'tiny' for this arch")
    out = Path(out).absolute()
    tmp = synthetic.partial_folder(out)
    try:
        synthetic.write_marker(tmp, seed, layout, dtype)
        if layout == "single_file":
            _write_single_file(arch, tmp, seed, dtype, fp8_blocks, generator_device)
        else:
            _write_diffusers(arch, tmp, seed, dtype, generator_device)
            write_debug_tokenizer(tmp / "tokenizer", GEMMA_VOCAB)
        if gemma == "release":
            write_release_gemma(tmp / "text_encoder", seed, dtype, generator_device)
        else:
            write_tiny_gemma(tmp / "text_encoder", arch, seed)
        if layout == "single_file":  # the release's Gemma folder (google/gemma-3-12b-it) holds its tokenizer
            write_debug_tokenizer(tmp / "text_encoder", GEMMA_VOCAB)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return synthetic.finish(tmp, out, seed, layout, replace, announce)


def tiny_gemma_sizes(arch: LTX2Arch) -> dict[str, int]:
    """The `Gemma3TextConfig` sizes `write_tiny_gemma` gives the synthetic text model of `arch` (the memory
    estimate reads them before the checkpoint is written; test_checkpoint.py compares them with the
    written config.json)."""
    c = arch.connectors
    # The connectors fix the width and depth (the release's 3840 x 48 for the real sizes); the MLP is
    # kept narrow (at most 256) so a real-size arch's stand-in is ~0.15B parameters, not 12B.
    return {"vocab_size": GEMMA_VOCAB, "hidden_size": c.caption_channels,
            "intermediate_size": min(2 * c.caption_channels, 256),
            "num_hidden_layers": c.text_proj_in_factor - 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8}
