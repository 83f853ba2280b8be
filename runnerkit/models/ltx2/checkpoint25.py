"""LTX-2.5 checkpoints: the diffusers folder with the duration head, the diffusion decoder and Gemma-4.

An LTX-2.5 diffusers folder is LTX-2.3's (`checkpoint.py`: `transformer/`, `connectors/`, `vae/`,
`audio_vae/`, `vocoder/`, `latent_upsampler/`, `tokenizer/`) with `duration_head/` and
`diffusion_decoder/` added (config.json + safetensors, diffusers' tensor names, loaded strictly) and
`text_encoder/` a Gemma-4 (`gemma4_unified`) transformers folder (`text_encoder_gemma4.py`).
Lightricks' per-component release files (`diffusion_models/`, `text_encoders/`, ...) are read by
checkpoint_release25.py (`open_ltx25` opens either layout).

`write_synthetic_ltx25` writes that folder with deterministic random weights (the LTX-2 part through
`checkpoint_synthetic.write_synthetic_ltx2`, the same values for the same names and seed); the
diffusion decoder's latent statistics are the video VAE's, as in the release.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from runnerkit import synthetic
from runnerkit.files import give_default_mode
from runnerkit.models.ltx2.arch25 import EXTRA_COMPONENTS, LTX25Arch
from runnerkit.models.ltx2.checkpoint import DIFFUSERS_STEM, LTX2Checkpoint, _arch
from runnerkit.models.ltx2.checkpoint_synthetic import GEMMA_VOCAB, write_synthetic_ltx2
from runnerkit.models.ltx2.diffusion_decoder import LTX2DiffusionDecoder
from runnerkit.models.ltx2.duration import LTX2DurationHead
from runnerkit.weights import CheckpointError, build_on_meta, safetensors_files, safetensors_infos, synthetic_tensor

_CLASSES = {"duration_head": "LTX2DurationHead", "diffusion_decoder": "LTX2VideoDiffusionDecoderModel"}


def extra_factory(component: str, arch: LTX25Arch) -> nn.Module:
    """The meta-built network of an `EXTRA_COMPONENTS` component."""
    if component == "duration_head":
        return build_on_meta(lambda: LTX2DurationHead(arch.duration_head))
    return build_on_meta(lambda: LTX2DiffusionDecoder(arch.diffusion_decoder))


class LTX25Checkpoint(LTX2Checkpoint):
    """A located LTX-2.5 diffusers folder (`LTX2Checkpoint` plus `EXTRA_COMPONENTS`; `arch` an `LTX25Arch`)."""

    @classmethod
    def open(cls, path: str | Path, upsampler_path: str | Path | None = None,  # type: ignore[override]
             text_encoder_path: str | Path | None = None, arch: LTX25Arch | None = None) -> LTX25Checkpoint:
        """Open the diffusers folder `path`; `arch` replaces the architecture read from its config.json files
        (Lightricks' per-component release: checkpoint_release25.py `open_ltx25`, which opens either).

        Raises:
            CheckpointError: a single file or separate module paths (naming `open_ltx25`), a missing folder or
                file (naming it), a config the architecture refuses, or a Gemma-3 text encoder.
        """
        path = Path(path)
        if path.suffix == ".safetensors" or upsampler_path is not None or text_encoder_path is not None:
            raise CheckpointError(f"LTX-2.5: {path} with `upsampler_path` / `text_encoder_path` is the per-component "
                                  "release, opened by checkpoint_release25.py `open_ltx25`; this opens a diffusers "
                                  "folder (with duration_head/ and diffusion_decoder/)")
        for sub in EXTRA_COMPONENTS:
            if not (path / sub).is_dir():
                raise CheckpointError(f"LTX-2.5 checkpoint {path}: folder {path / sub} does not exist (an LTX-2.3 "
                                      "folder? use model_cls 'ltx2')")
        if arch is None:
            read = lambda: LTX25Arch.from_diffusers_folder(path)
            arch = _arch(read, f"config.json files of {path}")  # type: ignore[assignment]
        ckpt = cls._open_diffusers(path, arch)
        for component in EXTRA_COMPONENTS:
            files = safetensors_files(path / component, component=component)
            if not files:
                raise CheckpointError(f"{component}: no .safetensors files in {path / component}")
            ckpt._index[component] = dict(safetensors_infos(files, component))
        return ckpt  # type: ignore[return-value]

    def _plan(self, component: str,
              module: nn.Module | None = None) -> tuple[nn.Module, dict[str, str], dict[str, str]]:
        """`LTX2Checkpoint._plan`, the extra components' networks built here."""
        if module is None and component in EXTRA_COMPONENTS:
            assert isinstance(self.arch, LTX25Arch), "an LTX-2.5 checkpoint has an LTX25Arch"
            module = extra_factory(component, self.arch)
        return super()._plan(component, module)


def tiny_gemma4_sizes(arch: LTX25Arch) -> dict[str, object]:
    """`Gemma4UnifiedTextConfig` sizes of the synthetic text model: the connectors' width and depth
    (`caption_channels`, `text_proj_in_factor` - 1 layers), sliding layers then a full one, 2 heads."""
    c = arch.connectors
    layers = c.text_proj_in_factor - 1
    return {"vocab_size": GEMMA_VOCAB, "hidden_size": c.caption_channels,
            "intermediate_size": min(2 * c.caption_channels, 256),
            "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "global_head_dim": 16, "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 16,
            "max_position_embeddings": 256,
            "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"]}


def write_tiny_gemma4(folder: Path, arch: LTX25Arch, seed: int) -> Path:
    """A small `Gemma4UnifiedForConditionalGeneration` (no vision / audio towers) whose stacked hidden
    states fit `arch.connectors`, random weights from `seed`, saved with `save_pretrained`."""
    import transformers

    text = transformers.Gemma4UnifiedTextConfig(**tiny_gemma4_sizes(arch))
    config = transformers.Gemma4UnifiedConfig(text_config=text.to_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Gemma4UnifiedForConditionalGeneration(config)
    synthetic.save_pretrained_here(model, folder)
    return folder


def _write_extra(arch: LTX25Arch, folder: Path, component: str, seed: int, dtype: torch.dtype,
                 vae_stats: dict[str, torch.Tensor]) -> None:
    (folder / component).mkdir()
    config = {"_class_name": _CLASSES[component], **arch.to_sections()[component]}
    (folder / component / "config.json").write_text(json.dumps(config, indent=1))
    shapes = {k: tuple(v.shape) for k, v in extra_factory(component, arch).state_dict().items()}
    tensors = {k: vae_stats[k].float() if k in vae_stats and component == "diffusion_decoder"
               else synthetic_tensor(f"{component}.{k}", s, seed, dtype) for k, s in shapes.items()}
    file = folder / component / f"{DIFFUSERS_STEM}.safetensors"
    save_file(tensors, str(file))
    give_default_mode(file)


def write_synthetic_ltx25(arch: LTX25Arch, out: Path, seed: int, dtype: torch.dtype = torch.bfloat16,
                          replace: bool = False) -> Path:
    """Write deterministic random weights for `arch` to the diffusers folder `out` (atomically: the
    folder is assembled beside `out`, then renamed); open with `LTX25Checkpoint.open(out)`.

    Raises:
        CheckpointError: `out` is not empty and not this seed's synthetic checkpoint (`replace` false).
    """
    out = Path(out).absolute()
    staging = synthetic.partial_folder(out)
    try:
        folder = write_synthetic_ltx2(arch.base(), staging / "ltx25", seed, dtype, "diffusers", announce=False)
        shutil.rmtree(folder / "text_encoder")
        write_tiny_gemma4(folder / "text_encoder", arch, seed)
        vae_stats = {k: v for file in safetensors_files(folder / "vae", component="vae")
                     for k, v in load_file(str(file)).items() if k in ("latents_mean", "latents_std")}
        for component in EXTRA_COMPONENTS:
            _write_extra(arch, folder, component, seed, dtype, vae_stats)
        index = json.loads((folder / "model_index.json").read_text())
        index.update({"_class_name": "LTX2Pipeline", **{c: ["diffusers", _CLASSES[c]] for c in EXTRA_COMPONENTS},
                      "text_encoder": ["transformers", "Gemma4UnifiedForConditionalGeneration"]})
        (folder / "model_index.json").write_text(json.dumps(index, indent=1))
        return synthetic.finish(folder, out, seed, "diffusers", replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["LTX25Checkpoint", "extra_factory", "tiny_gemma4_sizes", "write_synthetic_ltx25", "write_tiny_gemma4"]
