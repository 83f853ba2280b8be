"""The whole LTX-2 family architecture: one pydantic model holding the component archs.

Each component keeps its own arch class (transformer_arch.py, connectors_arch.py, vae_arch.py,
audio_arch.py, upsampler.py); `LTX2Arch` only groups them, with the release constants of
LTX-2 (19B, `Lightricks/LTX-2`) and LTX-2.3 (22B, `Lightricks/LTX-2.3`) and a tiny test size.

Readers:
- `from_diffusers_folder`: a diffusers-layout folder (`transformer/config.json`, `connectors/`,
  `vae/`, `audio_vae/`, `vocoder/`, `latent_upsampler/`), each read by its component's
  `from_diffusers_config`.
- `release_config.arch_from_single_file_config`: the JSON object of the `config` metadata entry of a single-file
  checkpoint and of its upsampler file, in either of two formats: Lightricks' release files carry
  ltx-core's field names (sections `transformer`, `vae`, `audio_vae`, `vocoder`, `scheduler`; the
  upsampler file a flat ltx-core config), mapped by `release_config.py`; runnerkit's synthetic files
  carry one section per component in diffusers' field names, as `to_sections` writes them
  (`{"transformer": {...}, "connectors": {...}, "vae": {...}, "audio_vae": {...}, "vocoder": {...}}`,
  the upsampler file diffusers' `latent_upsampler/config.json`). A `connectors` section marks ours.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from runnerkit.config import format_validation_error
from runnerkit.models.ltx2 import audio_arch as aa
from runnerkit.models.ltx2 import connectors_arch as ca
from runnerkit.models.ltx2 import transformer_arch as ta
from runnerkit.models.ltx2 import upsampler as up
from runnerkit.models.ltx2 import vae_arch as va

Version = Literal["2.0", "2.3"]
COMPONENTS = ("transformer", "connectors", "vae", "audio_vae", "vocoder", "latent_upsampler")
"""Components of a checkpoint, in diffusers' folder names (the text encoder is Gemma-3, read elsewhere)."""


class LTX2Arch(BaseModel):
    """Every network of an LTX-2 checkpoint (the Gemma-3 text encoder excepted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transformer: ta.LTX2TransformerArch
    """Audio+video diffusion transformer (`transformer/`; single file: `model.diffusion_model.`)."""
    connectors: ca.LTX2ConnectorsArch
    """Text connectors (`connectors/`; single file: `model.diffusion_model.*_embeddings_connector.`,
    `text_embedding_projection.`)."""
    vae: va.LTX2VideoVAEArch
    """Video VAE (`vae/`; single file: `vae.`)."""
    audio_vae: aa.LTX2AudioVAEArch
    """Audio VAE, decoder half (`audio_vae/`; single file: `audio_vae.`)."""
    vocoder: aa.LTX2VocoderArch | aa.LTX2VocoderBWEArch
    """Vocoder: HiFi-GAN style (2.0) or with bandwidth extension (2.3) (`vocoder/`; single file: `vocoder.`)."""
    latent_upsampler: up.LTX2LatentUpsamplerArch
    """x2 spatial latent upsampler (`latent_upsampler/`; a file of its own next to the single file)."""

    @property
    def version(self) -> Version:
        """"2.3" when the transformer has the LTX-2.3 gated attention, else "2.0"."""
        return "2.3" if self.transformer.gated_attn else "2.0"

    @property
    def release(self) -> str:
        """The release the transformer's switches name, for messages: "2.5" (no video FFN biases) or `version`."""
        return "2.5" if not self.transformer.ff_bias else self.version

    @classmethod
    def from_config_model(cls, model: dict[str, Any], partial: bool, model_cls: str) -> Self:
        """A config's `model` key validated as this architecture (`partial`: missing components allowed).

        Raises:
            ValueError: naming each bad field as `model.<component>.<field>`, and the components it takes.
        """
        try:
            return cls.model_validate_json(json.dumps(model), context={"partial": partial})
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, f"`model` ({model_cls} architecture)")
                             .replace("\n  ", "\n  model.") + "\n  (`model` takes the components "
                             + str(sorted(cls.model_fields)) + " in diffusers' config names, "
                             "runnerkit/models/ltx2/*arch*.py)") from None

    @classmethod
    def from_sections(cls, sections: dict[str, Any], where: str) -> LTX2Arch:
        """From component -> diffusers config dict (a diffusers folder's config.json files, or the
        sections of a single-file `config` metadata entry).

        Raises:
            ValueError: a missing section, naming `where`; the component readers' errors
                (unknown keys, bad values) pass through.
        """
        missing = [c for c in COMPONENTS if c not in sections]
        if missing:
            raise ValueError(f"{where}: no config for {missing} (has {sorted(sections)})")
        vocoder = sections["vocoder"]
        bwe = vocoder.get("_class_name") == "LTX2VocoderWithBWE" or any(k.startswith("bwe_") for k in vocoder)
        return cls(
            transformer=ta.LTX2TransformerArch.from_diffusers_config(sections["transformer"]),
            connectors=ca.LTX2ConnectorsArch.from_diffusers_config(sections["connectors"]),
            vae=va.LTX2VideoVAEArch.from_diffusers_config(sections["vae"]),
            audio_vae=aa.LTX2AudioVAEArch.from_diffusers_config(sections["audio_vae"]),
            vocoder=(aa.LTX2VocoderBWEArch if bwe else aa.LTX2VocoderArch).from_diffusers_config(vocoder),
            latent_upsampler=up.LTX2LatentUpsamplerArch.from_diffusers_config(sections["latent_upsampler"]),
        )

    def to_sections(self) -> dict[str, dict[str, Any]]:
        """component -> diffusers config dict that `from_sections` reads back to this arch."""
        def plain(arch: BaseModel) -> dict[str, Any]:
            return arch.model_dump(mode="json")

        vocoder = self.vocoder
        if isinstance(vocoder, aa.LTX2VocoderBWEArch):
            top = {k: v for k, v in plain(vocoder).items() if k not in ("vocoder", "bwe")}
            first = {k: v for k, v in plain(vocoder.vocoder).items() if k != "output_sampling_rate"}
            second = {f"bwe_{k}": v for k, v in plain(vocoder.bwe).items() if k != "output_sampling_rate"}
            vocoder_config = {"_class_name": "LTX2VocoderWithBWE", **top, **first, **second}
        else:
            vocoder_config = {"_class_name": "LTX2Vocoder", **plain(vocoder)}
        return {"transformer": plain(self.transformer), "connectors": plain(self.connectors),
                "vae": _vae_json(self.vae),
                "audio_vae": plain(self.audio_vae), "vocoder": vocoder_config,
                "latent_upsampler": self.latent_upsampler.to_diffusers_config()}

    @classmethod
    def from_diffusers_folder(cls, path: Path) -> LTX2Arch:
        """From a diffusers-layout folder's `<component>/config.json` files (errors name the file)."""
        from runnerkit.weights import read_json_object
        return cls.from_sections({c: read_json_object(Path(path) / c / "config.json", c) for c in COMPONENTS},
                                 str(path))


def _vae_json(vae: va.LTX2VideoVAEArch) -> dict[str, Any]:
    config = vae.to_diffusers_config()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


LTX2_19B_ARCH = LTX2Arch(transformer=ta.LTX2_19B, connectors=ca.LTX2_CONNECTORS, vae=va.LTX2_VIDEO_VAE,
                         audio_vae=aa.LTX2_AUDIO_VAE, vocoder=aa.LTX2_VOCODER,
                         latent_upsampler=up.LTX2_LATENT_UPSAMPLER)
"""LTX-2 (19B) release (`ltx-2-19b-*.safetensors` + `ltx-2-spatial-upscaler-x2-1.0.safetensors`)."""
LTX23_22B_ARCH = LTX2Arch(transformer=ta.LTX23_22B, connectors=ca.LTX23_CONNECTORS, vae=va.LTX23_VIDEO_VAE,
                          audio_vae=aa.LTX2_AUDIO_VAE, vocoder=aa.LTX23_VOCODER,
                          latent_upsampler=up.LTX23_LATENT_UPSAMPLER)
"""LTX-2.3 (22B) release."""


def tiny_ltx2_arch(version: Version) -> LTX2Arch:
    """A tiny arch with the switches of `version` (tests, synthetic checkpoints); each component is its
    own tiny test size, so widths do not chain from one component to the next."""
    latest = version == "2.3"
    return LTX2Arch(
        transformer=ta.tiny_arch(version),
        connectors=ca.TINY23_CONNECTORS if latest else ca.TINY_CONNECTORS,
        vae=va.TINY_LTX23_VIDEO_VAE if latest else va.TINY_LTX2_VIDEO_VAE,
        audio_vae=aa.TINY_AUDIO_VAE,
        vocoder=aa.TINY_VOCODER_BWE if latest else aa.TINY_VOCODER,
        latent_upsampler=up.LTX2LatentUpsamplerArch(in_channels=8, mid_channels=32, num_blocks_per_stage=1,
                                                    use_rational_resampler=not latest))


def tiny_pipeline_arch(version: Version) -> LTX2Arch:
    """A tiny arch whose components chain into a runnable two-stage pipeline (configs/ltx2/*_tiny.json,
    runner tests): the transformer takes the video VAE's 8 latent channels and the audio VAE's packed
    16 (4 channels x 4 latent mel bins), its text widths are the connectors' (2.0: the caption width
    16, projected inside; 2.3: video 32, audio 8), the upsampler the VAE's 8 channels. The vocoder
    makes as many samples per mel frame as the releases' (2.0: 240 at 24 kHz; 2.3: 160 at 16 kHz,
    then x3), so the audio lasts as long as the video."""
    base = tiny_ltx2_arch(version)
    widths = ({"attention_head_dim": 8, "cross_attention_dim": 32} if version == "2.3" else {})
    transformer = ta.tiny_arch(version, in_channels=8, out_channels=8, audio_in_channels=16, audio_out_channels=16,
                               **widths)
    if version == "2.3":
        assert isinstance(base.vocoder, aa.LTX2VocoderBWEArch)
        first = base.vocoder.vocoder.model_copy(update={
            "hidden_channels": 32, "upsample_factors": (5, 4, 4, 2), "upsample_kernel_sizes": (11, 8, 8, 4)})
        vocoder: aa.LTX2VocoderArch | aa.LTX2VocoderBWEArch = base.vocoder.model_copy(update={"vocoder": first})
    else:
        vocoder = base.vocoder.model_copy(update={
            "hidden_channels": 32, "upsample_factors": (6, 5, 4, 2), "upsample_kernel_sizes": (12, 10, 8, 4)})
    return base.model_copy(update={"transformer": transformer, "vocoder": vocoder})
