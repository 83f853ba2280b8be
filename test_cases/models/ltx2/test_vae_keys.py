"""LTX-2 video VAE single-file (native) names <-> diffusers names, checked against diffusers'
own single-file converter."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.ltx2.vae_arch import TINY_LTX2_VIDEO_VAE, TINY_LTX23_VIDEO_VAE, LTX2VideoVAEArch
from runnerkit.models.ltx2.vae_keys import UNUSED_NATIVE_STATS, diffusers_to_native, native_to_diffusers
from runnerkit.weights import CheckpointError
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers  # noqa: E402

# Rules of diffusers' scripts/convert_ltx2_to_diffusers.py that the 0.42.1 single-file converter lacks:
# the timestep-conditioned decoder's last AdaLN, and LTX-2.3's fourth up block (LTX_2_3_VIDEO_VAE_RENAME_DICT).
SCRIPT_EXTRA_RULES = {"last_time_embedder": "time_embedder", "last_scale_shift_table": "scale_shift_table",
                      "up_blocks.7": "up_blocks.3.upsamplers.0", "up_blocks.8": "up_blocks.3"}


def reference_convert(native: dict[str, torch.Tensor]) -> list[str]:
    """diffusers' single-file converter, then the conversion script's extra rules: sorted keys."""
    keys = []
    for key in convert_ltx2_vae_to_diffusers(native):
        for old, new in SCRIPT_EXTRA_RULES.items():
            key = key.replace(old, new)
        keys.append(key)
    return sorted(keys)


def diffusers_state_dict(arch: LTX2VideoVAEArch) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(diffusers.AutoencoderKLLTX2Video(**arch.to_diffusers_config()).state_dict())


def with_unused_stats(native: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**native, **{f"vae.{k}": torch.zeros(8) for k in UNUSED_NATIVE_STATS}, **other}


TIMESTEP_ARCH = LTX2VideoVAEArch(**{**TINY_LTX2_VIDEO_VAE.model_dump(), "timestep_conditioning": True})


@pytest.mark.parametrize("arch", [TINY_LTX2_VIDEO_VAE, TIMESTEP_ARCH], ids=["ltx2.0", "ltx2.0-timestep"])
def test_ltx20_names_match_diffusers_single_file_converter(arch: LTX2VideoVAEArch) -> None:
    ours = diffusers_state_dict(arch)
    native = diffusers_to_native(ours, arch)
    assert any(k.startswith("vae.decoder.up_blocks.6.res_blocks.") for k in native)
    assert ("vae.decoder.last_scale_shift_table" in native) == arch.timestep_conditioning
    assert reference_convert(with_unused_stats(native, {})) == sorted(ours)
    if not arch.timestep_conditioning:  # the single-file converter alone suffices for the 2.0 release
        assert sorted(convert_ltx2_vae_to_diffusers(with_unused_stats(native, {}))) == sorted(ours)
    assert native_to_diffusers(with_unused_stats(native, {"model.diffusion_model.x": torch.zeros(1)}), arch).keys() \
        == ours.keys()


def test_ltx23_names_match_diffusers_conversion_script() -> None:
    arch = TINY_LTX23_VIDEO_VAE
    ours = diffusers_state_dict(arch)
    native = diffusers_to_native(ours, arch)
    assert any(k.startswith("vae.decoder.up_blocks.8.res_blocks.") for k in native)
    assert reference_convert(with_unused_stats(native, {})) == sorted(ours)
    assert native_to_diffusers(native, arch).keys() == ours.keys()


def test_block_index_outside_arch() -> None:
    with pytest.raises(CheckpointError, match="up_blocks.9"):
        native_to_diffusers({"vae.decoder.up_blocks.9.res_blocks.0.conv1.conv.weight": torch.zeros(1)},
                            TINY_LTX23_VIDEO_VAE)
