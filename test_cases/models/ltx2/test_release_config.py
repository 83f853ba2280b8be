"""Lightricks' single-file `config` metadata (ltx-core's names) -> our architecture (release_config.py).

The configs are written out by hand from public dumps and ltx-core's configurators (release_configs.py
names the sources), so a mapping bug cannot hide in a shared helper; the expected archs are the
release constants the rest of runnerkit believes in (LTX2_19B_ARCH, LTX23_22B_ARCH).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.models.ltx2 import connectors_arch as ca
from runnerkit.models.ltx2.release_config import arch_from_single_file_config
from runnerkit.models.ltx2.arch import COMPONENTS, LTX2_19B_ARCH, LTX23_22B_ARCH, LTX2Arch, tiny_ltx2_arch
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint
from runnerkit.models.ltx2.ltx25_arch import LTX25_22B_ARCH
from runnerkit.models.ltx2.transformer_arch import tiny_arch
from runnerkit.models.ltx2.checkpoint_synthetic import GEMMA_VOCAB, SINGLE_FILE, UPSAMPLER_FILE, _write_single_file
from runnerkit.weights import CheckpointError
from test_cases.models.ltx2.release_configs import (
    GEMMA3_12B_CONFIG,
    LTX2_19B_CONFIG,
    LTX2_UPSAMPLER_CONFIG,
    LTX23_22B_CONFIG,
    LTX23_UPSAMPLER_CONFIG,
    LTX25_22B_CONFIG,
    tiny_release_config,
)

RELEASES = {"19B": (LTX2_19B_CONFIG, LTX2_UPSAMPLER_CONFIG, LTX2_19B_ARCH),
            "22B": (LTX23_22B_CONFIG, LTX23_UPSAMPLER_CONFIG, LTX23_22B_ARCH),
            "2.5-22B": (LTX25_22B_CONFIG, LTX23_UPSAMPLER_CONFIG, LTX25_22B_ARCH)}


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("gemma", [None, GEMMA3_12B_CONFIG], ids=["no-gemma", "gemma-12b"])
def test_release_config_maps_to_the_release_arch(release: str, gemma: dict | None) -> None:
    config, upsampler, expected = RELEASES[release]
    arch = arch_from_single_file_config(copy.deepcopy(config), dict(upsampler), "test", gemma)
    for component in COMPONENTS:  # field for field, so a failure shows the differing fields
        assert getattr(arch, component).model_dump() == getattr(expected, component).model_dump(), component
    assert arch == expected and arch.version == ("2.0" if release == "19B" else "2.3")


def _tiny_arch(version: str) -> LTX2Arch:
    """tiny_ltx2_arch, with 2.3's video connector as wide as the transformer (ltx-core sizes it so); 2.5: 2.3's
    with the transformer's 2.5 switches."""
    if version == "2.5":
        return _tiny_arch("2.3").model_copy(update={"transformer": tiny_arch("2.5")})
    arch = tiny_ltx2_arch(version)
    if version == "2.0":
        return arch
    connectors = ca.LTX2ConnectorsArch(**{**arch.connectors.model_dump(), "video_connector_num_attention_heads": 2,
                                          "video_hidden_dim": arch.transformer.inner_dim})
    return arch.model_copy(update={"connectors": connectors})


def _set_config(path: Path, config: dict[str, Any]) -> None:
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={"config": json.dumps(config)})


def _release_like(arch: LTX2Arch, version: str, folder: Path, edit: dict[str, Any] | None = None) -> Path:
    """The synthetic single file and upsampler file of `arch`, their metadata replaced by the tiny release config
    (`edit` updates its transformer section), and a Gemma-3 folder holding only the config.json ltx-core reads
    and its tokenizer (the tiny Gemma model itself costs seconds to build and is not read by `open`)."""
    folder.mkdir()
    _write_single_file(arch, folder, 3, torch.float32, "none")
    config, upsampler = tiny_release_config(version)
    config["transformer"].update(edit or {})
    _set_config(folder / SINGLE_FILE, config)
    _set_config(folder / UPSAMPLER_FILE, upsampler)
    (folder / "text_encoder").mkdir()
    c = arch.connectors
    gemma = {"model_type": "gemma3_text", "hidden_size": c.caption_channels,
             "num_hidden_layers": c.text_proj_in_factor - 1}
    (folder / "text_encoder" / "config.json").write_text(json.dumps(gemma))
    write_debug_tokenizer(folder / "text_encoder", GEMMA_VOCAB)  # `open` requires the Gemma folder's tokenizer
    return folder


@pytest.mark.parametrize("version", ["2.0", "2.3", "2.5"])
def test_tiny_single_file_with_release_metadata_opens_without_arch(version: str, tmp_path: Path) -> None:
    """A file laid out like a release (ltx-core metadata, Gemma folder next to it) opens without `arch`:
    the connectors' input comes from the Gemma config, and every network loads strictly from the file."""
    arch = _tiny_arch(version)
    out = _release_like(arch, version, tmp_path / "ckpt")
    ckpt = LTX2Checkpoint.open(out / SINGLE_FILE, out / UPSAMPLER_FILE, out / "text_encoder")
    assert ckpt.arch == arch
    for component in COMPONENTS:
        ckpt.load(component)  # strict: a width the mapping got wrong fails here with the key


def _edit(path: str, value: Any) -> dict[str, Any]:
    """The 22B config with `path` ("section.key" or "section.sub.key") set to `value` (None: deleted)."""
    config = copy.deepcopy(LTX23_22B_CONFIG)
    *parents, key = path.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    if value is None:
        del node[key]
    else:
        node[key] = value
    return config


@pytest.mark.parametrize(("path", "value", "error", "match"), [
    ("transformer.attention_heads_count", 32, ValueError, r"`config\.transformer`.*\['attention_heads_count'\]"),
    ("vae.decoder_depth", 4, ValueError, r"`config\.vae`.*\['decoder_depth'\]"),
    ("vocoder.bwe.num_mel_bins", 64, ValueError, r"`config\.vocoder\.bwe`.*\['num_mel_bins'\]"),
    ("audio_vae.model.params.ddconfig.channels", 128, ValueError, r"ddconfig`.*\['channels'\]"),
    ("duration_head", {"num_queries": 1}, NotImplementedError, r"`config\.duration_head`"),
    ("text_encoder", {"hidden_size": 3840}, ValueError, r"`config` has keys .*\['text_encoder'\]"),
    ("transformer.frequencies_precision", "float16", ValueError, r"`config\.transformer\.frequencies_precision`="
                                                                r"'float16'"),
    ("transformer.num_layers", "48", ValueError, r"`config\.transformer\.num_layers`='48'"),
    ("transformer.ff_bias", "false", ValueError, r"`config\.transformer\.ff_bias`='false': expected true or false"),
    ("transformer.use_keyframes_abs_pos_embedding", 1, ValueError, r"use_keyframes_abs_pos_embedding`=1: expected"),
    ("transformer.audio_ff_bias", False, NotImplementedError,
     r"`config\.transformer\.audio_ff_bias`=False .*so does LTX-2\.5"),
    ("transformer.connector_ff_bias", False, NotImplementedError, r"`config\.transformer\.connector_ff_bias`=False"),
    ("transformer.use_prompt_adaln_single", False, NotImplementedError, r"use_prompt_adaln_single`=False"),
    ("transformer.caption_proj_input_norm", None, NotImplementedError, r"missing \['caption_proj_input_norm'\]"),
    ("transformer.qk_norm", "layer_norm", NotImplementedError, r"`config\.transformer\.qk_norm`='layer_norm'"),
    ("vae._class_name", "CausalDiffusionVAE", NotImplementedError, r"`config\.vae\._class_name`='CausalDiffusionVAE'"),
    ("vae.norm_layer", "group_norm", NotImplementedError, r"`config\.vae\.norm_layer`='group_norm'"),
    ("vocoder.vocoder.activation", "snake", NotImplementedError, r"`config\.vocoder\.vocoder\.activation`='snake'"),
    ("vocoder.bwe.win_size", 1024, NotImplementedError, r"`config\.vocoder\.bwe\.win_size`=1024"),
    ("vae", None, ValueError, r"no \['vae'\] section"),
])
def test_unknown_key_or_unsupported_value_is_named(path: str, value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        arch_from_single_file_config(_edit(path, value), dict(LTX23_UPSAMPLER_CONFIG), "test")


def test_vae_block_list_errors_name_the_entry() -> None:
    config = copy.deepcopy(LTX23_22B_CONFIG)
    config["vae"]["decoder_blocks"][3] = ["attn_res_x", {"num_layers": 1, "attention_head_dim": 64}]
    with pytest.raises(NotImplementedError, match=r"`config\.vae\.decoder_blocks\[3\]` is 'attn_res_x'"):
        arch_from_single_file_config(config, dict(LTX23_UPSAMPLER_CONFIG), "test")
    config = copy.deepcopy(LTX23_22B_CONFIG)
    config["vae"]["encoder_blocks"][1][1]["stride"] = 2
    with pytest.raises(ValueError, match=r"`config\.vae\.encoder_blocks\[1\]`.*\['stride'\]"):
        arch_from_single_file_config(config, dict(LTX23_UPSAMPLER_CONFIG), "test")


def test_upsampler_and_text_encoder_errors_are_named() -> None:
    with pytest.raises(NotImplementedError, match=r"`latent_upsampler\.temporal_upsample`=True"):
        arch_from_single_file_config(copy.deepcopy(LTX23_22B_CONFIG),
                                         {**LTX23_UPSAMPLER_CONFIG, "temporal_upsample": True}, "test")
    with pytest.raises(ValueError, match=r"`latent_upsampler`.*\['spatial_scale_factor'\]"):
        arch_from_single_file_config(copy.deepcopy(LTX23_22B_CONFIG),
                                         {**LTX23_UPSAMPLER_CONFIG, "spatial_scale_factor": 2}, "test")
    gemma = {"text_config": {"hidden_size": 2560, "num_hidden_layers": 34}}  # Gemma-3 4B: not the 19B's 3840
    with pytest.raises(ValueError, match=r"`config\.transformer\.caption_channels`=3840 .* hidden size 2560"):
        arch_from_single_file_config(copy.deepcopy(LTX2_19B_CONFIG), dict(LTX2_UPSAMPLER_CONFIG), "test", gemma)


def test_checkpoint_error_names_key_and_file(tmp_path: Path) -> None:
    out = _release_like(_tiny_arch("2.3"), "2.3", tmp_path / "ckpt", {"audio_ff_bias": False})
    with pytest.raises(CheckpointError, match=rf"(?s){out / SINGLE_FILE}.*`config\.transformer\.audio_ff_bias`=False"):
        LTX2Checkpoint.open(out / SINGLE_FILE, out / UPSAMPLER_FILE, out / "text_encoder")


def test_each_release_architecture_names_its_release() -> None:
    """The load log's "LTX-<release>": the switches tell 2.0, 2.3 and 2.5 apart (2.5 shares 2.3's `version`)."""
    from runnerkit.models.ltx2.arch import LTX2_19B_ARCH, LTX23_22B_ARCH
    from runnerkit.models.ltx2.ltx25_arch import LTX25_22B_ARCH

    assert [a.release for a in (LTX2_19B_ARCH, LTX23_22B_ARCH, LTX25_22B_ARCH)] == ["2.0", "2.3", "2.5"]
    assert [a.version for a in (LTX2_19B_ARCH, LTX23_22B_ARCH, LTX25_22B_ARCH)] == ["2.0", "2.3", "2.3"]
