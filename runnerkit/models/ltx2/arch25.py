"""The LTX-2.5 pipeline architecture: LTX-2's networks plus the duration head and the diffusion decoder.

`LTX25Arch` extends `arch.LTX2Arch` (transformer, connectors, video VAE, audio VAE, vocoder, latent
upsampler; their sizes are LTX-2.3's in the release, `ltx25_arch.py`) with the two networks LTX-2.5
adds: `duration_head` (`duration.py`) and `diffusion_decoder` (`diffusion_decoder.py`). A diffusers
folder holds each in a folder of that name (`<name>/config.json` + safetensors). The text encoder
(Gemma-4) is read from its own folder, as Gemma-3 is for LTX-2.3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runnerkit.arch import config_file_error
from runnerkit.models.ltx2 import arch
from runnerkit.models.ltx2.diffusion_decoder import (
    LTX25_DIFFUSION_DECODER,
    TINY_LTX25_DIFFUSION_DECODER,
    LTX2DiffusionDecoderArch,
)
from runnerkit.models.ltx2.duration import LTX25_DURATION_HEAD, TINY_DURATION_HEAD, LTX2DurationHeadArch
from runnerkit.models.ltx2.ltx25_arch import LTX25_22B_ARCH, LTX25_TRANSFORMER_CHANGES

EXTRA_COMPONENTS = ("duration_head", "diffusion_decoder")
"""What an LTX-2.5 diffusers folder adds to `arch.COMPONENTS` (diffusers' folder names)."""


class LTX25Arch(arch.LTX2Arch):
    """Every network of an LTX-2.5 checkpoint but the Gemma-4 text encoder."""

    duration_head: LTX2DurationHeadArch
    """Clip length from the connectors' outputs (`duration_head/`)."""
    diffusion_decoder: LTX2DiffusionDecoderArch
    """Video latents -> pixels by its own denoising loop (`diffusion_decoder/`)."""

    def base(self) -> arch.LTX2Arch:
        """The LTX-2 part (the components `arch.COMPONENTS`)."""
        return arch.LTX2Arch(**{name: getattr(self, name) for name in arch.COMPONENTS})

    @classmethod
    def from_sections(cls, sections: dict[str, Any], where: str, folder: bool = False) -> LTX25Arch:
        """From component -> diffusers config dict, `arch.COMPONENTS` and `EXTRA_COMPONENTS`. `where`: the
        diffusers folder (`folder`: each section is its `<component>/config.json`) or the file whose `config`
        metadata holds the sections.

        Raises:
            ValueError: a missing section, naming `where`; a bad duration head or diffusion decoder config,
                naming its file (or section), each bad key, its value and what is allowed; the other component
                readers' errors pass through.
        """
        missing = [c for c in EXTRA_COMPONENTS if c not in sections]
        if missing:
            raise ValueError(f"{where}: no config for {missing} (an LTX-2.5 checkpoint has them; has "
                             f"{sorted(sections)})")
        base = arch.LTX2Arch.from_sections(sections, where)
        origin = {c: (f"{c} config in {Path(where) / c / 'config.json'}" if folder
                      else f"section `{c}` of the `config` in {where}") for c in EXTRA_COMPONENTS}
        duration = {k: v for k, v in sections["duration_head"].items() if not k.startswith("_")}
        try:
            duration_head = LTX2DurationHeadArch.model_validate_json(json.dumps(duration))
        except ValidationError as exc:
            raise ValueError(config_file_error(exc, LTX2DurationHeadArch, origin["duration_head"])) from None
        decoder = LTX2DiffusionDecoderArch.from_diffusers_config(sections["diffusion_decoder"],
                                                                 origin["diffusion_decoder"])
        return cls(**{name: getattr(base, name) for name in arch.COMPONENTS}, duration_head=duration_head,
                   diffusion_decoder=decoder)

    def to_sections(self) -> dict[str, dict[str, Any]]:
        """component -> diffusers config dict that `from_sections` reads back to this arch."""
        return {**self.base().to_sections(), "duration_head": self.duration_head.model_dump(mode="json"),
                "diffusion_decoder": self.diffusion_decoder.model_dump(mode="json")}

    @classmethod
    def from_diffusers_folder(cls, path: Path) -> LTX25Arch:
        """From a diffusers-layout folder's `<component>/config.json` files (errors name the file)."""
        from runnerkit.weights import read_json_object

        names = (*arch.COMPONENTS, *EXTRA_COMPONENTS)
        return cls.from_sections({c: read_json_object(Path(path) / c / "config.json", c) for c in names}, str(path),
                                 folder=True)


LTX25_22B_PIPELINE_ARCH = LTX25Arch(**{name: getattr(LTX25_22B_ARCH, name) for name in arch.COMPONENTS},
                                    duration_head=LTX25_DURATION_HEAD, diffusion_decoder=LTX25_DIFFUSION_DECODER)
"""LTX-2.5 (22B): 2.3's sizes, the release's duration head and diffusion decoder."""


def tiny_ltx25_arch() -> LTX25Arch:
    """A tiny LTX-2.5 pipeline (configs/ltx2/ltx25_t2av_tiny.json, runner tests): `arch.tiny_pipeline_arch("2.3")`
    with LTX-2.5's transformer switches (`LTX25_TRANSFORMER_CHANGES`: video FFN without biases, the keyframe
    embedding), the tiny duration head (it takes the tiny connectors' video 32 and audio 8 wide outputs) and a
    tiny diffusion decoder at the video VAE's ratios (8 latent channels, 32x spatial: patch 8 after a 4x
    pixel shuffle; 8x temporal), its windows small enough for a 64 x 64 output (2 x 2 latent cells)."""
    base = arch.tiny_pipeline_arch("2.3")
    decoder = LTX2DiffusionDecoderArch(**{
        **TINY_LTX25_DIFFUSION_DECODER.model_dump(), "patch_size": 8, "spatial_compression_ratio": 32,
        "decoder_stage_kernels": ((3, 1, 1), (3, 3, 3), (3, 3, 3), (3, 3, 3)), "decoder_stage5_kernel": (3, 3, 3)})
    base = base.model_copy(update={"transformer": base.transformer.model_copy(update=LTX25_TRANSFORMER_CHANGES)})
    return LTX25Arch(**{name: getattr(base, name) for name in arch.COMPONENTS}, duration_head=TINY_DURATION_HEAD,
                     diffusion_decoder=decoder)


__all__ = ["EXTRA_COMPONENTS", "LTX25_22B_PIPELINE_ARCH", "LTX25Arch", "tiny_ltx25_arch"]
