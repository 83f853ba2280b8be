"""LTX-2 transformer key names: single-file release <-> diffusers, against diffusers' own converter."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.ltx2.transformer import LTX2Transformer
from runnerkit.models.ltx2.transformer_arch import LTX2_19B, LTX23_22B, LTX2TransformerArch
from runnerkit.models.ltx2.transformer_keys import ORIGINAL_PREFIX, diffusers_name, original_name
from test_cases._reference import require_reference

require_reference("diffusers")
from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

DIFFUSERS_ONLY_WORDS = ("time_embed", "norm_q", "norm_k", "proj_in", "av_cross_attn", "_cross_attn_scale_shift_table",
                        "prompt_adaln.")
"""Substrings of diffusers' names that the release never uses."""


def _keys(release: LTX2TransformerArch) -> list[str]:
    with torch.device("meta"):
        return list(LTX2Transformer(release.model_copy(update={"num_layers": 2})).state_dict())


@pytest.mark.parametrize("release", [LTX2_19B, LTX23_22B], ids=["2.0", "2.3"])
def test_round_trip_and_diffusers_converter(release: LTX2TransformerArch) -> None:
    keys = _keys(release)
    originals = {original_name(k): k for k in keys}
    assert len(originals) == len(keys)
    assert all(o.startswith(ORIGINAL_PREFIX) for o in originals)
    assert not [o for o in originals if any(w in o for w in DIFFUSERS_ONLY_WORDS)]
    assert all(diffusers_name(o) == k for o, k in originals.items())
    # diffusers 0.42.1's single-file converter gives the same names, except that it lacks LTX-2.3's
    # prompt_adaln renames (it leaves `prompt_adaln_single.*`; its newer conversion script renames them)
    converted = convert_ltx2_transformer_to_diffusers({o: torch.empty(0) for o in originals})
    missed = {k for k in keys if k.startswith(("prompt_adaln.", "audio_prompt_adaln."))}
    assert set(converted) == (set(keys) - missed) | {original_name(k)[len(ORIGINAL_PREFIX):] for k in missed}
    assert bool(missed) == release.prompt_modulation


def test_other_components_are_not_transformer_keys() -> None:
    for key in ("vae.decoder.conv_in.conv.weight", "audio_vae.decoder.conv_in.weight", "vocoder.conv_pre.weight",
                f"{ORIGINAL_PREFIX}video_embeddings_connector.learnable_registers",
                f"{ORIGINAL_PREFIX}audio_embeddings_connector.transformer_1d_blocks.0.attn1.q_norm.weight",
                f"{ORIGINAL_PREFIX}text_embedding_projection.video_aggregate_embed.weight"):
        assert diffusers_name(key) is None
    assert diffusers_name(f"{ORIGINAL_PREFIX}adaln_single.emb.timestep_embedder.linear_1.weight") == \
        "time_embed.emb.timestep_embedder.linear_1.weight"
    assert diffusers_name(f"{ORIGINAL_PREFIX}audio_adaln_single.linear.bias") == "audio_time_embed.linear.bias"
