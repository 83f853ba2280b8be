"""LTX-2.5's release files' exact key sets, loaded through our loaders, with their `config` metadata.

The listing `data/ltx2.5_release_keys.json.gz` (network -> {key in the file: shape}) was dumped from Lightricks'
own loader, github.com/Lightricks/LTX-2 at commit 400fd31054597515f47125691032c04b1c3ee24e,
`packages/ltx-core/src/ltx_core/` (imported from source, meta device; `einops` stubbed, unused at build): the
`state_dict()` of the networks its configurators build, named as ltx-core's SDOps expect them in the files:

- transformer (`diffusion_models/ltx-2.5-22b-*-transformer-bf16.safetensors`): `LTXModelConfigurator` on
  `LTX25_22B_CONFIG` (release_configs.py: 2.3's section with `ff_bias` false, `use_keyframes_abs_pos_embedding`
  true), prefix `model.diffusion_model.` put back: 4091 keys = 2.3's 4186 less 96 video FFN biases plus
  `keyframes_abs_pos_embedding` [1, 4096]. Whether the text connectors (2.3's names) sit in this file or in the
  text encoder's is not in ltx-core's code (its split loader reads them from both: ltx-pipelines
  `ModelPaths.from_split`); they are left out here.
- duration head (`model_patches/ltx-2.5-duration-head-bf16.safetensors`): `DurationHeadConfigurator` (its
  defaults), prefix `duration_head.` (`DURATION_HEAD_KEY_OPS`): 15 keys.
- diffusion VAE (`vae/ltx-2.5-video-vae-bf16.safetensors`): `VideoEncoderConfigurator` (84 `encoder.*` keys,
  LTX-2.3's after the prefix, compared below) and `VideoDecoderConfigurator` for a "CausalDiffusionVAE" whose
  `decoder` block has the release's sizes (diffusers' `convert_ltx2_to_diffusers.py` "2.5" values, which public
  dumps of the file's metadata repeat: stage widths 2048 ... 256, depths 4, 6, 4, 2, 8): 309 `decoder.*` keys with
  the inverse of `_build_diffusion_vae_decoder_sd_ops` applied (split q/k/v fused back into `qkv`,
  `t_embedder.mlp.0/2`), and the 2 `per_channel_statistics.*` both halves read: 395 keys. Prefixes bare, as in
  the split (ComfyUI-style) release files that ltx-core's SDOps match beside the monolith's `vae.`; a public
  third-party loader of the shipped file reads these bare names and skips one more tensor, `decoder.type_emb`
  (a training-time embedding; shape not public, so not listed: `diffusion_decoder_keys.UNUSED`). No gates or
  `coarse_*` heads: the release's dev file has neither (diffusers' `convert_ltx2_diffusion_video_vae`).
  Independent check of the names: diffusers' `LTX_2_5_DIFFUSION_DECODER_RENAME_DICT`.

ltx-core has every 2.5 network the release ships as a separate file among these (the latent upsampler's 2.5 file
and the audio VAE keep 2.3's networks). Metadata as ltx-core writes and reads it (`loader/sft_loader.py`:
`config` and `gemma_source_checkpoint` JSON strings, `model_version` a plain string).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint
from runnerkit.models.ltx2.diffusion_decoder import (
    LTX25_DIFFUSION_DECODER,
    TINY_LTX25_DIFFUSION_DECODER,
    LTX2DiffusionDecoder,
)
from runnerkit.models.ltx2.diffusion_decoder_keys import state_dict_from_single_file as decoder_state_dict
from runnerkit.models.ltx2.duration import LTX25_DURATION_HEAD, LTX2DurationHead, state_dict_from_single_file
from runnerkit.models.ltx2.ltx25_arch import LTX25_22B_ARCH
from runnerkit.weights import build_on_meta, check_tensors, load_on_meta, safetensors_infos, tensor_infos
from test_cases.models.ltx2.release_configs import GEMMA3_12B_CONFIG, LTX23_UPSAMPLER_CONFIG, LTX25_22B_CONFIG
from test_cases.models.ltx2.test_release_keys import release_keys, write_header_only

DATA = Path(__file__).parent / "data"
METADATA = {"config": json.dumps(LTX25_22B_CONFIG), "model_version": "2.5.0",
            "gemma_source_checkpoint": json.dumps({"gemma_version": "gemma4-12b-ltx-v1"})}


def ltx25_keys() -> dict[str, dict[str, list[int]]]:
    with gzip.open(DATA / "ltx2.5_release_keys.json.gz", "rt") as f:
        return json.load(f)["networks"]


def _meta_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as meta tensors of its header's shapes and dtypes (nothing read but the header)."""
    return {k: torch.empty(e.shape, dtype=e.dtype, device="meta") for k, e in safetensors_infos([path], "test").items()}


def test_transformer_file_loads_with_its_metadata(tmp_path: Path) -> None:
    """Every key of the transformer file is claimed by `LTX2Checkpoint` (names and shapes checked), and its
    `config` gives the 2.5 switches; the key set is 2.3's less the video FFN biases plus the keyframe embedding."""
    keys = ltx25_keys()["transformer"]
    write_header_only(tmp_path / "transformer.safetensors", keys, METADATA)
    write_header_only(tmp_path / "upsampler.safetensors", release_keys("2.3")["latent_upsampler"],
                      {"config": json.dumps(LTX23_UPSAMPLER_CONFIG)})
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(GEMMA3_12B_CONFIG))  # Gemma-4 12B: the same widths
    (tmp_path / "gemma" / "tokenizer.json").write_text("{}")
    ckpt = LTX2Checkpoint.open(tmp_path / "transformer.safetensors", tmp_path / "upsampler.safetensors",
                               tmp_path / "gemma")
    assert ckpt.arch.transformer == LTX25_22B_ARCH.transformer
    assert (ckpt.arch.transformer.ff_bias, ckpt.arch.transformer.use_keyframes_abs_pos_embedding) == (False, True)
    _, key_map, scales = ckpt.stream_sources("transformer")  # raises on any missing/unexpected key or shape
    assert scales == {} and set(key_map.values()) == set(keys) and len(keys) == 4091
    old = release_keys("2.3")["transformer"]
    biases = {k for k in old if ".ff.net." in k and k.endswith(".bias") and ".audio_ff." not in k}
    assert len(biases) == 96
    assert set(keys) == set(old) - biases | {"model.diffusion_model.keyframes_abs_pos_embedding"}
    assert keys["model.diffusion_model.keyframes_abs_pos_embedding"] == [1, 4096]



@pytest.mark.parametrize("left_out", [("vae", "audio_vae", "vocoder"), ("vocoder",)], ids=["split", "no-vocoder"])
def test_a_split_transformer_file_without_vae_and_audio_sections_takes_the_release_sizes(
        tmp_path: Path, left_out: tuple[str, ...]) -> None:
    """A split release's transformer file may declare only `transformer` and `scheduler` (ltx-trainer's
    `is_split_transformer`): the sections it leaves out take LTX-2.5's release sizes, so the architecture equals the
    full config's. A single file (LTX-2.x) still needs every section."""
    from runnerkit.models.ltx2.checkpoint_release25 import _release_arch
    from runnerkit.models.ltx2.release_config import arch_from_release_config, upsampler_from_release_config

    config = {k: v for k, v in LTX25_22B_CONFIG.items() if k not in left_out}
    write_header_only(tmp_path / "transformer.safetensors", {"x": [1]}, {**METADATA, "config": json.dumps(config)})
    write_header_only(tmp_path / "upsampler.safetensors", {"x": [1]}, {"config": json.dumps(LTX23_UPSAMPLER_CONFIG)})
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(GEMMA3_12B_CONFIG))  # Gemma-4 12B: the same widths
    arch = _release_arch(tmp_path / "transformer.safetensors", tmp_path / "upsampler.safetensors", tmp_path / "gemma")
    for name in ("transformer", "connectors", "vae", "audio_vae", "vocoder"):
        assert getattr(arch, name) == getattr(LTX25_22B_ARCH, name), name
    upsampler = upsampler_from_release_config(LTX23_UPSAMPLER_CONFIG)
    with pytest.raises(ValueError, match=rf"`config` has no \[{', '.join(repr(s) for s in left_out)}\] section"):
        arch_from_release_config(config, upsampler, GEMMA3_12B_CONFIG)

def test_duration_head_file_loads(tmp_path: Path) -> None:
    """The head's file (read for real: 1.9 M zeros) loads strictly into the LTX-2.5 head."""
    from safetensors.torch import load_file

    keys = ltx25_keys()["duration_head"]
    write_header_only(tmp_path / "duration_head.safetensors", keys, {"model_version": "2.5.0"})
    tensors = load_file(str(tmp_path / "duration_head.safetensors"))
    head = load_on_meta(lambda: LTX2DurationHead(LTX25_DURATION_HEAD), state_dict_from_single_file(tensors),
                        "duration_head")
    assert len(keys) == 15 and sum(p.numel() for p in head.parameters()) == sum(
        torch.Size(s).numel() for s in keys.values())


def test_diffusion_vae_file_loads(tmp_path: Path) -> None:
    """The decoder half maps onto `LTX2DiffusionDecoder` at release size (the strict loader's check: every tensor
    claimed, shapes checked; meta tensors from the header: the file holds 1.5 GB) and the training type
    embedding is left unread; the encoder half has LTX-2.3's names and shapes, which the
    convolutional VAE loader reads (test_release_keys.py)."""
    keys = ltx25_keys()["diffusion_vae"]
    path = tmp_path / "video_vae.safetensors"
    write_header_only(path, {**keys, "decoder.type_emb": [2, 256]},
                      {**METADATA, "config": json.dumps({"vae": {"_class_name": "CausalDiffusionVAE"}})})
    mapped = decoder_state_dict(_meta_tensors(path))
    decoder = build_on_meta(lambda: LTX2DiffusionDecoder(LTX25_DIFFUSION_DECODER)).state_dict(keep_vars=True)
    check_tensors(decoder, tensor_infos(mapped), "diffusion_decoder")  # the loader's check: every name and shape
    assert len(keys) == 395 and sum(k.startswith("decoder.") for k in keys) == 309
    fused = sum(k.endswith((".qkv.weight", ".qkv.bias")) for k in keys)  # each one becomes q, k and v
    assert len(decoder) == len(mapped) == 309 + 2 * fused + 2 == 407  # + latents_mean, latents_std
    encoder = {k: s for k, s in keys.items() if k.startswith("encoder.")}
    assert len(encoder) == 84
    assert encoder == {k[len("vae."):]: s for k, s in release_keys("2.3")["vae"].items() if k.startswith("vae.encoder.")}


def _file_names(ours: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Our decoder state dict under the release's names, written out here by hand from ltx-core's SDOps (the
    inverse of each: q/k/v concatenated into `qkv`, `to_out.0` -> `proj`, `norm_q` -> `q_norm`, ...)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in ours.items():
        if name in ("latents_mean", "latents_std"):
            stat = {"latents_mean": "mean-of-means", "latents_std": "std-of-means"}[name]
            out[f"{prefix}per_channel_statistics.{stat}"] = value
            continue
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        if ".attn.to_q." in name:
            leaf = name.rsplit(".", 1)[1]
            stem = name.split(".attn.to_q.")[0]
            name = f"{stem}.attn.qkv.{leaf}"
            value = torch.cat([ours[f"{stem}.attn.to_{p}.{leaf}"] for p in "qkv"])
        for ours_part, file_part in ((".attn.to_out.0.", ".attn.proj."), (".attn.norm_q.", ".attn.q_norm."),
                                     (".attn.norm_k.", ".attn.k_norm."),
                                     ("t_embedder.timestep_embedder.linear_1.", "t_embedder.mlp.0."),
                                     ("t_embedder.timestep_embedder.linear_2.", "t_embedder.mlp.2.")):
            name = name.replace(ours_part, file_part)
        out[prefix + name] = value
    return out


def _tiny_decoder_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LTX2DiffusionDecoder(TINY_LTX25_DIFFUSION_DECODER).state_dict().items()}
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def test_decoder_names_map_tensor_for_tensor() -> None:
    """Values, not only names: each tensor under its release name (split file and monolith prefixes) comes back
    as the same tensor under ours; q, k and v are the fused tensor's thirds in that order; preview heads and
    the training type embedding are dropped."""
    ours = _tiny_decoder_state()
    for prefix in ("", "vae."):
        tensors = {**_file_names(ours, prefix), f"{prefix}decoder.type_emb": torch.zeros(2, 4),
                   f"{prefix}decoder.coarse_head.weight": torch.zeros(3, 3), f"{prefix}encoder.conv_in.conv.weight":
                   torch.zeros(1)}
        mapped = decoder_state_dict(tensors)
        assert sorted(mapped) == sorted(ours), prefix
        assert all(torch.equal(mapped[k], v) for k, v in ours.items()), prefix


def test_decoder_gates_fold_into_their_linears() -> None:
    """A gated checkpoint: W <- g W and b <- g b for the attention output, the MLP down projection and the
    context projection (the gates' rows), and the gates themselves are not in our state dict."""
    ours = _tiny_decoder_state()
    tensors = _file_names(ours, "")
    block = "decoder.diff_blocks.0"
    width = ours[f"{block}.attn.to_out.0.weight"].shape[0]
    gates = {f"{block}.gate_{g}": torch.linspace(0.5, 2.0, width) for g in ("msa", "mlp", "ctx")}
    mapped = decoder_state_dict({**tensors, **gates})
    assert sorted(mapped) == sorted(ours)
    for ours_name, gate in ((".attn.to_out.0.weight", "msa"), (".attn.to_out.0.bias", "msa"),
                            (".mlp.w_down.weight", "mlp"), (".context_proj.weight", "ctx"),
                            (".context_proj.bias", "ctx")):
        g = gates[f"{block}.gate_{gate}"]
        value = ours[block + ours_name]
        expected = g[:, None] * value if value.ndim == 2 else g * value
        assert torch.equal(mapped[block + ours_name], expected), ours_name
    untouched = f"{block}.mlp.w_up.weight"
    assert torch.equal(mapped[untouched], ours[untouched])


def test_decoder_fused_qkv_must_split_in_three() -> None:
    with pytest.raises(ValueError, match=r"`decoder\.conv_in\.qkv\.weight` has 4 rows, not a multiple of 3"):
        decoder_state_dict({"decoder.conv_in.qkv.weight": torch.zeros(4, 2)})
