"""The release single files' exact key sets and their `config` metadata, loaded through `LTX2Checkpoint`.

Listings (`data/ltx{2.0,2.3}_release_keys.json.gz`: network -> {key in the file: shape}) were dumped from
Lightricks' own loader, github.com/Lightricks/LTX-2 at commit 400fd31054597515f47125691032c04b1c3ee24e,
`packages/ltx-core/src/ltx_core/`: the `state_dict()` of the networks that its configurators build from
the release configs of `release_configs.py` (`LTXModelConfigurator`, `Embeddings1DConnectorConfigurator`,
`AudioEmbeddings1DConnectorConfigurator`, the feature extractor of `encoders/encoder_configurator.py`
with Gemma-3 12B's widths, `VideoEncoderConfigurator` / `VideoDecoderConfigurator`,
`AudioEncoderConfigurator` / `AudioDecoderConfigurator`, `VocoderConfigurator`,
`LatentUpsamplerConfigurator`), with the file prefixes their `SDOps` strip put back
(`model.diffusion_model.`, `text_embedding_projection.`, `vae.`, `audio_vae.`, `vocoder.`; the upsampler
file has none). Counts: 2.0 transformer 3510, connectors 59, vae 184, audio_vae 102, vocoder 194,
upsampler 73; 2.3 transformer 4186, connectors 262, vae 170, audio_vae 102, vocoder 1227 (the 16 kHz
generator 667, the extender 557, `mel_stft` 3: the counts a public MLX converter reports for the
release's audio file), upsampler 72. Independent checks: diffusers 0.42.1 `single_file_utils` converts
the transformer, VAE and audio VAE from these names, and diffusers' `convert_ltx2_to_diffusers.py`
(`LTX_2_3_VOCODER_RENAME_DICT`: `act_post`, `downsample.lowpass`) and ComfyUI's
`comfy/ldm/lightricks/vocoders/vocoder.py` name the 2.3 vocoder's tensors as listed.

The file written here has exactly those keys and shapes (bf16, a sparse data section: nothing is read
but the headers) and a `__metadata__` as ltx-core writes and reads it
(`loader/sft_loader.py` `SafetensorsModelStateDictLoader.metadata`: `config` a JSON string, other
entries such as `model_version` plain strings).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from runnerkit.models.ltx2.audio_arch import LTX2VocoderArch, LTX2VocoderBWEArch
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint
from runnerkit.models.ltx2.checkpoint_keys import ignored
from runnerkit.weights import CheckpointError
from test_cases.models.ltx2.release_configs import (
    GEMMA3_12B_CONFIG,
    LTX2_19B_CONFIG,
    LTX2_UPSAMPLER_CONFIG,
    LTX23_22B_CONFIG,
    LTX23_UPSAMPLER_CONFIG,
)

DATA = Path(__file__).parent / "data"
RELEASES = {"2.0": (LTX2_19B_CONFIG, LTX2_UPSAMPLER_CONFIG), "2.3": (LTX23_22B_CONFIG, LTX23_UPSAMPLER_CONFIG)}
NETWORKS = ("transformer", "connectors", "vae", "audio_vae", "vocoder", "latent_upsampler")


def release_keys(version: str) -> dict[str, dict[str, list[int]]]:
    """network -> {key in the release file: shape}."""
    with gzip.open(DATA / f"ltx{version}_release_keys.json.gz", "rt") as f:
        return json.load(f)["networks"]


def write_header_only(path: Path, shapes: dict[str, list[int]], metadata: dict[str, str]) -> None:
    """A safetensors file with `shapes` in bf16 whose data section is a hole (sparse: no disk used)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, shape in shapes.items():
        size = 2
        for n in shape:
            size *= n
        header[key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
    os.truncate(path, 8 + len(raw) + offset)


def write_release(folder: Path, version: str, extra: dict[str, list[int]] | None = None) -> LTX2Checkpoint:
    config, upsampler_config = RELEASES[version]
    keys = release_keys(version)
    single = {k: s for network in NETWORKS[:-1] for k, s in keys[network].items()} | (extra or {})
    write_header_only(folder / "model.safetensors", single, {
        "config": json.dumps(config), "model_version": f"{version}.0", "license": "LTX-2 Community License"})
    write_header_only(folder / "upsampler.safetensors", keys["latent_upsampler"],
                      {"config": json.dumps(upsampler_config)})
    gemma = folder / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps(GEMMA3_12B_CONFIG))
    (gemma / "tokenizer.json").write_text("{}")
    return LTX2Checkpoint.open(folder / "model.safetensors", folder / "upsampler.safetensors", gemma)


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_release_key_set_loads(version: str, tmp_path: Path) -> None:
    """Every network's file keys are claimed (names and shapes checked); only the audio VAE encoder, which no
    network of ours reads, is left over."""
    ckpt = write_release(tmp_path, version)
    keys = release_keys(version)
    for network in NETWORKS:
        _, key_map, scales = ckpt.stream_sources(network)  # raises on any missing/unexpected key or shape
        assert scales == {}
        left = set(keys[network]) - set(key_map.values())
        assert left == {k for k in keys[network] if network != "latent_upsampler" and ignored(network, k)}, network
    # ltx-core's latent statistics hold only the two that are used; the unused pair is accepted if present
    assert {k for n in NETWORKS[:-1] for k in keys[n] if ignored(n, k)} == {
        k for k in keys["audio_vae"] if k.startswith("audio_vae.encoder.")}


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_release_metadata_sets_the_architecture(version: str, tmp_path: Path) -> None:
    """The header's `config` (ltx-core's JSON, with the plain-string entries beside it) gives the release's
    sizes: values from the release configs and diffusers' `convert_ltx2_to_diffusers.py` for that version."""
    arch = write_release(tmp_path, version).arch
    t, c = arch.transformer, arch.connectors
    assert (arch.version, t.num_layers, t.num_attention_heads, t.attention_head_dim) == (version, 48, 32, 128)
    assert (t.audio_num_attention_heads, t.audio_attention_head_dim, t.cross_attn_mod) == (32, 64, version == "2.3")
    assert (c.caption_channels, c.text_proj_in_factor) == (3840, 49)
    assert (arch.vae.temporal_compression, arch.vae.spatial_compression) == (8, 32)
    if version == "2.0":
        assert isinstance(arch.vocoder, LTX2VocoderArch)
        assert (arch.vocoder.hidden_channels, arch.vocoder.upsample_factors) == (1024, (6, 5, 2, 2, 2))
        assert c.video_connector_num_layers == c.audio_connector_num_layers == 2
    else:
        assert isinstance(arch.vocoder, LTX2VocoderBWEArch)
        assert (arch.vocoder.vocoder.hidden_channels, arch.vocoder.bwe.hidden_channels) == (1536, 512)
        assert (arch.vocoder.input_sampling_rate, arch.vocoder.output_sampling_rate) == (16000, 48000)
        assert (arch.vocoder.hop_length, arch.vocoder.num_mel_channels) == (80, 64)
        assert c.video_connector_num_layers == c.audio_connector_num_layers == 8


def test_resampler_filter_in_the_file_is_accepted(tmp_path: Path) -> None:
    """Some public loaders list `vocoder.resampler.*` among the 2.3 file's keys; ltx-core, diffusers and ComfyUI
    compute that filter (persistent=False). A file carrying it loads, the key unread; any other stray vocoder
    key is still refused."""
    ckpt = write_release(tmp_path, "2.3", {"vocoder.resampler.filter": [1, 1, 85]})
    _, key_map, _ = ckpt.stream_sources("vocoder")
    assert "vocoder.resampler.filter" not in key_map.values()
    assert len(key_map) == len(release_keys("2.3")["vocoder"])
    stray = tmp_path / "stray"
    stray.mkdir()
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\): \['vocoder.resampler.kernel'\]"):
        write_release(stray, "2.3", {"vocoder.resampler.kernel": [1, 1, 85]}).stream_sources("vocoder")


# diffusers' `scripts/convert_ltx2_to_diffusers.py` (github huggingface/diffusers @ 58eb52c0), the single-file ->
# diffusers renames of the vocoder: `LTX_2_0_VOCODER_RENAME_DICT`; `LTX_2_3_VOCODER_RENAME_DICT` plus
# `convert_ltx2_3_vocoder_upsamplers` (".ups." -> ".upsamplers." on weights and biases only).
_DIFFUSERS_VOCODER_RENAMES = {
    "2.0": (("ups", "upsamplers"), ("resblocks", "resnets"), ("conv_pre", "conv_in"), ("conv_post", "conv_out")),
    "2.3": (("resblocks", "resnets"), ("conv_pre", "conv_in"), ("conv_post", "conv_out"), ("act_post", "act_out"),
            ("downsample.lowpass", "downsample")),
}


def _diffusers_vocoder_name(version: str, key: str) -> str:
    name = key.removeprefix("vocoder.")
    for old, new in _DIFFUSERS_VOCODER_RENAMES[version]:
        name = name.replace(old, new)
    if version == "2.3" and ".ups." in name and name.endswith((".weight", ".bias")):
        name = name.replace(".ups.", ".upsamplers.")
    return name


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_vocoder_names_pair_as_diffusers_converts_them(version: str, tmp_path: Path) -> None:
    """Name by name (a swap of two same-shaped tensors keeps the key set): each release vocoder key is the one
    our loader reads for the module tensor that diffusers' conversion puts it in."""
    ckpt = write_release(tmp_path, version)
    _, key_map, _ = ckpt.stream_sources("vocoder")
    expected = {_diffusers_vocoder_name(version, k): k for k in release_keys(version)["vocoder"]}
    assert key_map == expected
