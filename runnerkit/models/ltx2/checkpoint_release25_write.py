"""Synthetic LTX-2.5 checkpoints in Lightricks' per-component release layout (release25_names.py).

`write_release_ltx25` writes deterministic random weights under the release's folders and file names; every
tensor has the value the diffusers-folder writer (`checkpoint25.write_synthetic_ltx25`) gives the same network
for the same seed and generator device (values depend only on our name and the seed, `weights.synthetic_tensor`;
the duration head's and decoder's drawn as `<component>.<name>`; the decoder's latent statistics are the video
VAE's), so both layouts hold the same pipeline. Each file is built in host memory, one tensor drawn at a time
(the 22B transformer file: its own size, ~38 GB in bf16, ~24 GB with fp8 blocks); `generator_device` "cuda" draws
a real-size one in seconds. The transformer file's `config` metadata is runnerkit's sections format (with the
duration head's and decoder's sections), read back by checkpoint_release25.py. The conv VAE file
(conv_vae25.py) holds the same video VAE's encoder and its convolutional decoder.

Text encoder: the release's packed file (`text_encoders/gemma4-12b-with-proj-ltx-2.5-bf16.safetensors`,
text_encoder_packed_write.py: config, runnerkit's debug tokenizer, the weights in ComfyUI's flat naming, and the
connectors' projections `text_embedding_projection.*`, which the transformer file then lacks) of a Gemma-4 "tiny"
(`checkpoint25.write_tiny_gemma4`, packed from its folder) or "release" (a random stand-in of Gemma-4 12B's sizes,
`ltx25_arch.GEMMA4_12B_TEXT`, ~22 GiB in bf16, written tensor by tensor straight into the file).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from runnerkit import synthetic
from runnerkit.config import RunnerConfig
from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.files import give_default_mode
from runnerkit.models.ltx2.arch25 import EXTRA_COMPONENTS, LTX25Arch
from runnerkit.models.ltx2.checkpoint import SCALE_SUFFIX, UNUSED_SCALE_SUFFIX
from runnerkit.models.ltx2.checkpoint25 import extra_factory, write_tiny_gemma4
from runnerkit.models.ltx2.checkpoint_synthetic import (
    GEMMA_VOCAB,
    Fp8Blocks,
    GemmaSize,
    fp8_block_weight,
    synthetic_state_dict,
)
from runnerkit.models.ltx2.conv_vae25 import conv_vae_file, conv_vae_metadata
from runnerkit.models.ltx2.ltx25_arch import GEMMA4_12B_TEXT
from runnerkit.models.ltx2.release25_names import (
    DTYPE_NAMES,
    audio_file,
    duration_file,
    projection_tensors,
    release_files,
    transformer_file,
    vae_file,
)
from runnerkit.models.ltx2.text_encoder_gemma4 import TEXT_PREFIXES
from runnerkit.models.ltx2.text_encoder_packed_write import pack_gemma4_folder, write_packed_gemma4
from runnerkit.offload.layout import quantize_fp8_e4m3
from runnerkit.weights import synthetic_tensor

__all__ = ["arch_to_write", "transformer_path", "write_release_ltx25"]


def _extra(arch: LTX25Arch, component: str, seed: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    shapes = {k: tuple(v.shape) for k, v in extra_factory(component, arch).state_dict().items()}
    return {k: synthetic_tensor(f"{component}.{k}", s, seed, dtype, device) for k, s in shapes.items()}


def _fp8(tensors: dict[str, torch.Tensor], names: dict[str, str], fp8_blocks: Fp8Blocks, device: str) -> None:
    """The transformer blocks' 2-D linear weights (by our name, `names`: ours -> file key) stored as fp8, in place."""
    for ours, key in names.items():
        tensor = tensors[key]
        if not fp8_block_weight(ours, tuple(tensor.shape)):
            continue
        if fp8_blocks == "scaled":
            quantized, scale = quantize_fp8_e4m3(tensor.to(device).float())
            tensors[key] = quantized.cpu()
            module = key[: -len("weight")]
            tensors[module + SCALE_SUFFIX] = scale.cpu().reshape(()).float()
            tensors[module + UNUSED_SCALE_SUFFIX] = torch.ones((), dtype=torch.float32)
        else:
            tensors[key] = tensor.to(torch.float8_e4m3fn)


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    give_default_mode(path)


def write_release_gemma4(out: Path, seed: int, dtype: torch.dtype, projection: dict[str, torch.Tensor],
                         tokenizer_folder: Path, generator_device: str = "cpu") -> Path:
    """A random Gemma-4 12B-sized `Gemma4UnifiedForConditionalGeneration` (text model only, no towers) as the packed
    file `out`: its config, the text model's tensors (drawn as `model.language_model.*`, stored in ComfyUI's flat
    naming, one at a time), `projection` and the tokenizer of `tokenizer_folder`."""
    import transformers

    text = transformers.Gemma4UnifiedTextConfig(**GEMMA4_12B_TEXT)
    config = transformers.Gemma4UnifiedConfig(text_config=text.to_dict())
    config.dtype = dtype
    with torch.device("meta"):
        model = transformers.Gemma4UnifiedTextModel(text)
    weights = {TEXT_PREFIXES[0] + k: (tuple(v.shape), dtype, lambda k=TEXT_PREFIXES[0] + k, s=tuple(v.shape):
                                      synthetic_tensor(k, s, seed, dtype, generator_device).cpu())
               for k, v in model.state_dict().items()}
    return write_packed_gemma4(out, config.to_dict(), weights, tokenizer_folder, projection)


def transformer_path(fp8_blocks: Fp8Blocks = "none", dtype: torch.dtype = torch.bfloat16) -> str:
    """Where the writer puts the transformer file under its root: the release's name with the dtype written
    (`-bf16`, `-fp32`: `release_files`), `-fp8` for fp8 blocks."""
    path = release_files(dtype)["transformer"]
    return path if fp8_blocks == "none" else path.replace(f"-{DTYPE_NAMES[dtype]}.safetensors", "-fp8.safetensors")


def arch_to_write(config: RunnerConfig, parsed: LTX25Arch, out: Path) -> tuple[LTX25Arch, GemmaSize]:
    """The architecture a release-layout synthetic checkpoint of `config` gets, and its Gemma-4's size: the
    config's `model` (`parsed`, the tiny pipeline without it) when it has one or its `model_path` lies in `out` (or
    is unset); else the release `model_path`'s name names (plan_sources25.py `RELEASES_25`: a real-size config such
    as configs/ltx2/ltx25_t2av_22b_distilled.json). Gemma-4 12B's size ("release") where the connectors take it.

    Raises:
        ValueError: `model` omitted and `model_path` (outside `out`) names no known release, naming `model`.
    """
    from runnerkit.models.ltx2.plan_sources import configured_arch
    from runnerkit.models.ltx2.plan_sources25 import RELEASES_25

    arch = parsed
    inside = config.model_path is None or Path(config.model_path).absolute().is_relative_to(Path(out).absolute())
    if config.model is None and not inside:
        named, why = configured_arch(config, None, RELEASES_25)
        if named is None:
            raise ValueError(f"`model` is omitted and {why}")
        arch = named  # type: ignore[assignment]
    c = arch.connectors
    release = (c.caption_channels, c.text_proj_in_factor - 1) == (GEMMA4_12B_TEXT["hidden_size"],
                                                                   GEMMA4_12B_TEXT["num_hidden_layers"])
    return arch, "release" if release else "tiny"


def write_release_ltx25(arch: LTX25Arch, out: Path, seed: int, dtype: torch.dtype = torch.bfloat16,
                        fp8_blocks: Fp8Blocks = "none", replace: bool = False, generator_device: str = "cpu",
                        gemma: GemmaSize = "tiny") -> Path:
    """Write `arch`'s synthetic weights in the release layout under `out` (module docstring; atomically: assembled
    beside `out`, then renamed), each file named with the dtype it holds (`release_files(dtype)`: `-bf16`, `-fp16`,
    `-fp32`). Open with `open_ltx25(out / transformer_path(fp8_blocks, dtype),
    out / release_files(dtype)["latent_upsampler"], out / release_files(dtype)["text_encoder"])`.

    Args:
        fp8_blocks: store the transformer blocks' linear weights as float8_e4m3fn, "plain" (cast) or "scaled"
            (absmax / 448 per tensor, `weight_scale` and an unused `input_scale`), as fp8 releases do.
        gemma: "tiny" or "release" (module docstring; "release" needs the connectors' 3840 x 48 + 1 input).

    Raises:
        ValueError: `gemma` "release" for connectors of another width or depth; a `dtype` other than bfloat16,
            float16 and float32.
        CheckpointError: `out` is not empty and not this seed's synthetic checkpoint (`replace` false).
    """
    c = arch.connectors
    if gemma == "release" and (c.caption_channels, c.text_proj_in_factor - 1) != (
            GEMMA4_12B_TEXT["hidden_size"], GEMMA4_12B_TEXT["num_hidden_layers"]):
        raise ValueError(f"`gemma`='release' writes Gemma-4 12B (3840 wide, 48 layers); the connectors take "
                         f"{c.caption_channels} x {c.text_proj_in_factor - 1}: use gemma 'tiny' for this arch")
    files = release_files(dtype)  # before anything is written: an unnamed dtype is refused here
    out = Path(out).absolute()
    tmp = synthetic.partial_folder(out)
    try:
        synthetic.write_marker(tmp, seed, "release", dtype)
        base = arch.base()
        ours = {c: synthetic_state_dict(base, c, seed, dtype, generator_device) for c in ("transformer", "connectors")}
        tensors = transformer_file(ours["transformer"], ours["connectors"], arch)
        projection = projection_tensors(ours["connectors"])
        if fp8_blocks != "none":
            names = {n: k for n, k in zip(ours["transformer"], transformer_file(ours["transformer"], {}, arch))}
            _fp8(tensors, names, fp8_blocks, generator_device)
        sections = arch.to_sections()
        upsampler_config = sections.pop("latent_upsampler")
        _save(tensors, tmp / transformer_path(fp8_blocks, dtype),
              {"config": json.dumps(sections), "model_version": f"synthetic-ltx-{arch.version}-2.5"})
        del tensors, ours
        vae = synthetic_state_dict(base, "vae", seed, dtype, generator_device)
        decoder = _extra(arch, "diffusion_decoder", seed, dtype, generator_device)
        _save(vae_file(vae, decoder, arch), tmp / files["video_vae"])
        _save(conv_vae_file(vae, arch), tmp / files["conv_vae"], conv_vae_metadata(arch))  # same encoder, its decoder
        del vae, decoder
        _save(audio_file(synthetic_state_dict(base, "audio_vae", seed, dtype, generator_device),
                         synthetic_state_dict(base, "vocoder", seed, dtype, generator_device), arch),
              tmp / files["audio_vae"])
        _save(synthetic_state_dict(base, "latent_upsampler", seed, dtype, generator_device),
              tmp / files["latent_upsampler"], {"config": json.dumps(upsampler_config)})
        _save(duration_file(_extra(arch, "duration_head", seed, dtype, generator_device)),
              tmp / files["duration_head"], {"model_version": "synthetic-2.5"})
        folder = tmp / "gemma4-folder.partial"  # the tokenizer (and the tiny model) before packing
        if gemma == "release":
            write_debug_tokenizer(folder, GEMMA_VOCAB)
            write_release_gemma4(tmp / files["text_encoder"], seed, dtype, projection, folder,
                                 generator_device)
        else:
            write_tiny_gemma4(folder, arch, seed)
            write_debug_tokenizer(folder, GEMMA_VOCAB)
            pack_gemma4_folder(folder, tmp / files["text_encoder"], projection)
        shutil.rmtree(folder, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return synthetic.finish(tmp, out, seed, "release", replace)


assert set(EXTRA_COMPONENTS) == {"duration_head", "diffusion_decoder"}, "the release files hold both"
