"""LTX-2 checkpoints: both layouts written by the synthetic writer load to the same networks.

Independent checks: the loaded weights equal `synthetic_state_dict` (what the writer draws, by our
names) and the single file holds the release's key names from diffusers' conversion tables (so a
rename bug shared by writer and loader still fails); open handles are counted through /proc/self/fd.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runnerkit import synthetic
from runnerkit.models.ltx2.release_config import arch_from_single_file_config
from runnerkit.models.ltx2.arch import COMPONENTS, LTX2Arch, tiny_ltx2_arch
from runnerkit.models.ltx2.checkpoint import LTX2Checkpoint, read_metadata_config
from runnerkit.models.ltx2.checkpoint_synthetic import (
    SINGLE_FILE,
    UPSAMPLER_FILE,
    synthetic_state_dict,
    tiny_gemma_sizes,
    write_synthetic_ltx2,
)
from runnerkit.models.ltx2.estimate import gemma_fields
from runnerkit.models.ltx2.transformer_arch import tiny_arch
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.weights import CheckpointError, safetensors_infos, synthetic_tensor
from test_cases.offload._handles import HandleSampler

SEED = 7


def _single(folder: Path, arch: LTX2Arch | None = None) -> LTX2Checkpoint:
    return LTX2Checkpoint.open(folder / SINGLE_FILE, folder / UPSAMPLER_FILE, folder / "text_encoder", arch=arch)


@pytest.fixture(scope="module", params=["2.0", "2.3"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LTX2Arch, Path, Path]:
    arch = tiny_ltx2_arch(request.param)
    root = tmp_path_factory.mktemp(f"ltx{request.param}")
    return (arch, write_synthetic_ltx2(arch, root / "single", SEED, torch.float32, "single_file"),
            write_synthetic_ltx2(arch, root / "diffusers", SEED, torch.float32, "diffusers"))


def _inputs(arch: LTX2Arch, component: str) -> tuple[tuple, dict]:
    """One input per network, tiny and seeded."""
    gen = torch.Generator().manual_seed(3)
    t, c = arch.transformer, arch.connectors
    if component == "transformer":
        text = t.caption_channels if t.use_prompt_embeddings else t.cross_attention_dim
        audio_text = t.caption_channels if t.use_prompt_embeddings else t.audio_cross_attention_dim
        step = torch.tensor([600.0])
        return (), dict(hidden_states=torch.randn(1, 8, t.in_channels, generator=gen),
                        audio_hidden_states=torch.randn(1, 3, t.audio_in_channels, generator=gen),
                        encoder_hidden_states=torch.randn(1, 4, text, generator=gen),
                        audio_encoder_hidden_states=torch.randn(1, 4, audio_text, generator=gen),
                        timestep=step, sigma=step, num_frames=2, height=2, width=2, audio_num_frames=3)
    if component == "connectors":
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # left padding; a multiple of the 4 registers
        return (torch.randn(1, 8, c.caption_channels * c.text_proj_in_factor, generator=gen), mask), {}
    if component == "vae":
        return (torch.randn(1, arch.vae.latent_channels, 2, 2, 2, generator=gen),), {}
    if component == "audio_vae":
        return (torch.randn(1, arch.audio_vae.latent_channels, 3, arch.audio_vae.latent_mel_bins, generator=gen),), {}
    if component == "vocoder":
        return (torch.randn(1, 2, 5, arch.audio_vae.mel_bins, generator=gen),), {}
    return (torch.randn(1, arch.latent_upsampler.in_channels, 2, 2, 2, generator=gen),), {}


def _run(module: torch.nn.Module, component: str, args: tuple, kw: dict) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = module.decode_raw(*args) if component == "vae" else module(*args, **kw)
    return out if isinstance(out, tuple) else (out,)


def test_layouts_load_bit_identical_networks(written: tuple[LTX2Arch, Path, Path]) -> None:
    arch, single_dir, diffusers_dir = written
    single, folder = _single(single_dir), LTX2Checkpoint.open(diffusers_dir)
    assert single.arch == arch and folder.arch == arch
    for component in COMPONENTS:
        a, b = single.load(component), folder.load(component)
        drawn = synthetic_state_dict(arch, component, SEED, torch.float32)
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb) == list(drawn), component
        for name, tensor in drawn.items():
            assert sa[name].dtype == sb[name].dtype == tensor.dtype, (component, name)
            assert torch.equal(sa[name], tensor) and torch.equal(sb[name], tensor), (component, name)
        args, kw = _inputs(arch, component)
        outs_a, outs_b = _run(a, component, args, kw), _run(b, component, args, kw)
        for x, y in zip(outs_a, outs_b, strict=True):
            assert torch.equal(x, y), component
        print(f"LTX-{arch.version} {component}: {len(sa)} tensors, outputs {[tuple(o.shape) for o in outs_a]} equal")


def test_single_file_config_round_trips(written: tuple[LTX2Arch, Path, Path]) -> None:
    arch, single_dir, _ = written
    config = read_metadata_config(single_dir / SINGLE_FILE, "checkpoint")
    assert set(config) == {"transformer", "connectors", "vae", "audio_vae", "vocoder"}
    upsampler = read_metadata_config(single_dir / UPSAMPLER_FILE, "latent_upsampler")
    assert arch_from_single_file_config(config, upsampler, "test") == arch


def test_release_style_config_is_refused_naming_the_key(written: tuple[LTX2Arch, Path, Path], tmp_path: Path) -> None:
    """runnerkit's own sections format (a `connectors` section) with a key in ltx-core's field names is not
    guessed at: the error names the key (release-format files are mapped: test_release_config.py)."""
    _, single_dir, _ = written
    copy = Path(shutil.copytree(single_dir, tmp_path / "single"))
    path = copy / SINGLE_FILE
    with safe_open(str(path), framework="pt") as f:
        config = json.loads(f.metadata()["config"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config["transformer"]["frequencies_precision"] = "float64"
    save_file(tensors, str(path), metadata={"config": json.dumps(config)})
    with pytest.raises(CheckpointError, match=f"frequencies_precision(.|\n)*{path}|{path}(.|\n)*frequencies_precision"):
        _single(copy)
    assert _single(copy, tiny_ltx2_arch("2.0")).arch == tiny_ltx2_arch("2.0")  # an explicit arch is used as given


def test_the_estimate_reads_the_written_gemma_sizes(written: tuple[LTX2Arch, Path, Path]) -> None:
    """What the memory estimate assumes of a synthetic Gemma before it is written is what the writer writes."""
    arch, single_dir, diffusers_dir = written
    for folder in (single_dir / "text_encoder", diffusers_dir / "text_encoder"):
        assert gemma_fields(folder) == tiny_gemma_sizes(arch)


def test_audio_vae_encoder_tensors_are_not_read(written: tuple[LTX2Arch, Path, Path], tmp_path: Path) -> None:
    """Both layouts may carry the audio VAE's encoder (diffusers saves the whole AutoencoderKLLTX2Audio); our
    network is its decoder: those tensors are skipped, not reported."""
    _, single_dir, diffusers_dir = written
    single = Path(shutil.copytree(single_dir, tmp_path / "single"))
    _add(single / SINGLE_FILE, {"audio_vae.encoder.conv_in.conv.weight": torch.ones(2, 2)})
    folder = Path(shutil.copytree(diffusers_dir, tmp_path / "diffusers"))
    shard = folder / "audio_vae" / "diffusion_pytorch_model.safetensors"
    _add(shard, {"encoder.conv_in.conv.weight": torch.ones(2, 2)})
    a, b = _single(single).load("audio_vae").state_dict(), LTX2Checkpoint.open(folder).load("audio_vae").state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    _add(folder / "vocoder" / "diffusion_pytorch_model.safetensors", {"encoder.conv_in.conv.weight": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\): \['encoder.conv_in.conv.weight'\]"):
        LTX2Checkpoint.open(folder).load("vocoder")


def _add(path: Path, extra: dict[str, torch.Tensor]) -> None:
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file({**tensors, **extra}, str(path), metadata=metadata)


def test_single_file_uses_release_names(written: tuple[LTX2Arch, Path, Path]) -> None:
    """Key names from diffusers' single_file_utils / convert_ltx2_to_diffusers.py tables, written out by hand."""
    arch, single_dir, _ = written
    keys = set(safetensors_infos([single_dir / SINGLE_FILE], "test"))
    dm = "model.diffusion_model."
    expected = [f"{dm}patchify_proj.weight", f"{dm}audio_patchify_proj.weight", f"{dm}adaln_single.linear.weight",
                f"{dm}audio_adaln_single.linear.weight", f"{dm}av_ca_a2v_gate_adaln_single.linear.weight",
                f"{dm}transformer_blocks.1.attn1.q_norm.weight",
                f"{dm}transformer_blocks.0.scale_shift_table_a2v_ca_video",
                f"{dm}video_embeddings_connector.transformer_1d_blocks.1.attn1.k_norm.weight",
                f"{dm}audio_embeddings_connector.transformer_1d_blocks.0.attn1.q_norm.weight",
                f"{dm}audio_embeddings_connector.learnable_registers",
                "vae.per_channel_statistics.mean-of-means", "vae.encoder.down_blocks.8.res_blocks.0.conv1.conv.weight",
                "vae.decoder.up_blocks.0.res_blocks.0.conv1.conv.weight",
                "audio_vae.per_channel_statistics.std-of-means", "audio_vae.decoder.conv_in.conv.weight"]
    if arch.version == "2.0":
        expected += ["text_embedding_projection.aggregate_embed.weight", "vocoder.conv_pre.weight",
                     "vocoder.ups.1.weight", "vocoder.resblocks.0.convs1.0.weight", "vocoder.conv_post.weight"]
    else:
        expected += ["text_embedding_projection.video_aggregate_embed.bias", f"{dm}prompt_adaln_single.linear.weight",
                     "text_embedding_projection.audio_aggregate_embed.weight", "vocoder.vocoder.conv_pre.weight",
                     "vocoder.bwe_generator.ups.0.weight", f"{dm}transformer_blocks.0.attn1.to_gate_logits.weight"]
    assert [k for k in expected if k not in keys] == []


def test_ltx25_transformer_single_file_round_trips(tmp_path: Path) -> None:
    """The synthetic writer gives an LTX-2.5 transformer its key set (no video FFN biases, the audio FFN's kept,
    the keyframe embedding under the single-file prefix, as ltx-core names it); the file's own config reads back
    the switches and the transformer loads strictly with the drawn values."""
    arch = tiny_ltx2_arch("2.3").model_copy(update={"transformer": tiny_arch("2.5")})
    ckpt = _single(write_synthetic_ltx2(arch, tmp_path / "single", SEED, torch.float32, "single_file"))
    assert ckpt.arch == arch
    keys = set(safetensors_infos([ckpt.path], "test"))
    dm = "model.diffusion_model."
    assert {f"{dm}keyframes_abs_pos_embedding", f"{dm}transformer_blocks.1.ff.net.0.proj.weight",
            f"{dm}transformer_blocks.1.audio_ff.net.2.bias"} <= keys
    assert not {k for k in keys if k.startswith(f"{dm}transformer_blocks.") and ".ff.net." in k and k.endswith("bias")}
    loaded = ckpt.load("transformer").state_dict()
    drawn = synthetic_state_dict(arch, "transformer", SEED, torch.float32)
    assert list(loaded) == list(drawn) and all(torch.equal(loaded[k], v) for k, v in drawn.items())
    assert loaded["keyframes_abs_pos_embedding"].shape == (1, 16)


def test_tiny_gemma_feeds_the_connectors(written: tuple[LTX2Arch, Path, Path]) -> None:
    from transformers import Gemma3TextModel

    arch, single_dir, _ = written
    gemma = Gemma3TextModel.from_pretrained(single_dir / "text_encoder")
    ids, mask = torch.tensor([[0, 0, 0, 5, 9, 11, 3, 7]]), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        states = gemma(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(states) == arch.connectors.text_proj_in_factor
    assert states[0].shape[-1] == arch.connectors.caption_channels
    connectors = _single(single_dir).load("connectors")
    with torch.no_grad():
        video, audio, _ = connectors(torch.stack(states, dim=-1), mask)
    assert video.isfinite().all() and audio.isfinite().all()


def _rewrite(path: Path, rename: dict[str, str]) -> None:
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {rename.get(k, k): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata=metadata)


def test_renamed_key_names_key_and_file(written: tuple[LTX2Arch, Path, Path], tmp_path: Path) -> None:
    arch, single_dir, diffusers_dir = written
    copy = Path(shutil.copytree(single_dir, tmp_path / "single"))
    old = "vae.decoder.conv_out.conv.weight"
    _rewrite(copy / SINGLE_FILE, {old: "vae.decoder.conv_out.conv.wieght"})
    ckpt = _single(copy)
    ckpt.load("transformer")  # other components are not affected
    with pytest.raises(CheckpointError) as err:
        ckpt.load("vae")
    message = str(err.value)
    assert str(copy / SINGLE_FILE) in message and repr(old) in message
    assert "'vae.decoder.conv_out.conv.wieght'" in message
    folder = Path(shutil.copytree(diffusers_dir, tmp_path / "diffusers"))
    shard = folder / "connectors" / "diffusion_pytorch_model.safetensors"
    _rewrite(shard, {"audio_connector.learnable_registers": "audio_connector.registers"})
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): \['audio_connector.learnable_registers'\]; "
                       r"unexpected keys \(1\): \['audio_connector.registers'\]") as err:
        LTX2Checkpoint.open(folder).load("connectors")
    assert str(shard) in str(err.value)


def test_missing_side_files_name_the_path(written: tuple[LTX2Arch, Path, Path], tmp_path: Path) -> None:
    _, single_dir, diffusers_dir = written
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(CheckpointError, match=str(missing)):
        LTX2Checkpoint.open(single_dir / SINGLE_FILE, missing, single_dir / "text_encoder")
    with pytest.raises(CheckpointError, match=str(tmp_path / "gemma")):
        LTX2Checkpoint.open(single_dir / SINGLE_FILE, single_dir / UPSAMPLER_FILE, tmp_path / "gemma")
    folder = Path(shutil.copytree(diffusers_dir, tmp_path / "diffusers"))
    shutil.rmtree(folder / "text_encoder")
    with pytest.raises(CheckpointError, match=str(folder / "text_encoder")):
        LTX2Checkpoint.open(folder)


def test_tokenizer_files_are_required(written: tuple[LTX2Arch, Path, Path], tmp_path: Path) -> None:
    """transformers' AutoTokenizer silently builds an empty tokenizer from a Gemma-3 folder with only a
    config.json (every prompt then encodes to nothing): a folder without tokenizer.json or tokenizer.model
    is refused, naming it. The synthetic single file puts the tokenizer in its Gemma-3 folder."""
    _, single_dir, diffusers_dir = written
    assert (single_dir / "text_encoder" / "tokenizer.json").is_file()
    gemma = Path(shutil.copytree(single_dir / "text_encoder", tmp_path / "gemma"))
    (gemma / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=f"{gemma} holds none of"):
        LTX2Checkpoint.open(single_dir / SINGLE_FILE, single_dir / UPSAMPLER_FILE, gemma)
    folder = Path(shutil.copytree(diffusers_dir, tmp_path / "diffusers"))
    (folder / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=f"tokenizer folder {folder / 'tokenizer'} holds none of"):
        LTX2Checkpoint.open(folder)


@pytest.mark.parametrize("fp8", ["plain", "scaled"])
def test_fp8_blocks_load_as_fp8_storage(fp8: str, tmp_path: Path) -> None:
    arch = tiny_ltx2_arch("2.3")
    ckpt = _single(write_synthetic_ltx2(arch, tmp_path / "fp8", SEED, torch.bfloat16, "single_file", fp8_blocks=fp8))
    stored, scales = ckpt.state_dict("transformer")
    name = "transformer_blocks.1.ff.net.0.proj.weight"
    assert stored[name].dtype == torch.float8_e4m3fn and stored["proj_in.weight"].dtype == torch.bfloat16
    fp8_count = sum(t.dtype == torch.float8_e4m3fn for t in stored.values())
    assert fp8_count > 0 and len(scales) == (fp8_count if fp8 == "scaled" else 0)
    model = ckpt.load("transformer", dtype=torch.bfloat16)
    scale = scales[name] if fp8 == "scaled" else torch.tensor(1.0)
    assert torch.equal(model.state_dict()[name], (stored[name].float() * scale).to(torch.bfloat16))
    drawn = synthetic_state_dict(arch, "transformer", SEED, torch.bfloat16)[name].float()
    error = (model.state_dict()[name].float() - drawn).abs().max() / drawn.abs().max()
    print(f"fp8 {fp8}: max error relative to absmax {error:.4f}")
    assert error < (0.07 if fp8 == "scaled" else 0.5)
    if fp8 == "scaled":
        with pytest.raises(ValueError, match="pass `dtype`"):
            ckpt.load("transformer")
    sources = ckpt.transformer_block_sources()
    assert name in sources.units[1].params and sources.key_map[name] in sources.blocks[1].keys
    # the streamed scales: every fp8 weight's `weight_scale` key in the file (none without scales)
    assert sources.scale_map == ({n: sources.key_map[n][: -len("weight")] + "weight_scale" for n in scales}
                                 if fp8 == "scaled" else {})
    assert len(sources.scale_map) == len(scales)


@pytest.mark.parametrize("layout", ["single_file", "diffusers"])
def test_block_sources_list_each_blocks_keys(layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tiny_ltx2_arch("2.0")
    arch = base.model_copy(update={"transformer": tiny_arch("2.0", num_layers=11)})
    monkeypatch.setattr(synthetic, "SHARD_BYTES", 40_000)  # diffusers: several transformer shards
    out = write_synthetic_ltx2(arch, tmp_path / layout, SEED, torch.float32, layout)  # type: ignore[arg-type]
    ckpt = _single(out, arch) if layout == "single_file" else LTX2Checkpoint.open(out)
    sources = ckpt.transformer_block_sources()
    prefix = "model.diffusion_model.transformer_blocks." if layout == "single_file" else "transformer_blocks."
    files = sorted((out / "transformer").glob("*.safetensors")) if layout == "diffusers" else [out / SINGLE_FILE]
    assert sources.files == files and (layout == "single_file" or len(files) > 1)
    in_file = {k: e.path for k, e in safetensors_infos(files, "test").items()}
    assert len(sources.blocks) == 11
    for block in sources.blocks:
        header = sorted(k for k in in_file if k.startswith(f"{prefix}{block.index}."))
        assert sorted(block.keys) == header and len(set(block.keys)) == len(block.keys)
        assert block.files == tuple(sorted({in_file[k] for k in header}))
        unit_keys = {sources.key_map[p] for p in sources.units[block.index].params}
        assert unit_keys <= set(block.keys) and sources.units[block.index].module == f"transformer_blocks.{block.index}"
    assert set(sources.key_map.values()) <= set(in_file)


def test_one_handle_on_the_single_file(written: tuple[LTX2Arch, Path, Path]) -> None:
    arch, single_dir, _ = written
    path = single_dir / SINGLE_FILE
    sampler = HandleSampler([path])
    sampler.start_polling()
    try:
        ckpt = _single(single_dir)
        sampler.sample("opened")
        for component in ("connectors", "vae", "audio_vae", "vocoder"):
            ckpt.load(component)
            sampler.sample(f"loaded {component}")
        sources = ckpt.transformer_block_sources()
        reader = SafetensorsDiskReader(sources.files)
        resident = [k for n, k in sources.key_map.items() if not n.startswith("transformer_blocks.")]
        reader.load_tensors(resident)
        sampler.sample("transformer resident weights")
        for key in sources.blocks[0].keys:
            reader.read_into(key, torch.empty(reader.index[key].nbytes, dtype=torch.uint8))
            sampler.sample(f"block 0 {key}")
        reader.close()
    finally:
        sampler.stop_polling()
    assert sampler.violations() == []
    assert SINGLE_FILE in sampler.ever_open()
    assert json.loads((single_dir / synthetic.SYNTHETIC_MARKER).read_text())["seed"] == SEED


def test_release_size_gemma_stand_in_loads_with_transformers(tmp_path, monkeypatch):
    """`write_release_gemma` (the 12B-sized stand-in of GPU benchmarks) at reduced sizes: transformers loads its
    shards and config exactly as written, tensor by tensor (the sharded writer's names are the model's)."""
    from transformers import Gemma3TextModel

    from runnerkit.models.ltx2 import checkpoint_synthetic as cs

    monkeypatch.setattr(cs, "RELEASE_GEMMA_SIZES", {
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 40, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "query_pre_attn_scalar": 8,
        "sliding_window": 16})
    monkeypatch.setattr(synthetic, "SHARD_BYTES", 4096)  # several shards and the index
    folder = cs.write_release_gemma(tmp_path / "gemma", SEED, torch.float32)
    assert (folder / "model.safetensors.index.json").is_file()
    model = Gemma3TextModel.from_pretrained(folder, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, synthetic_tensor(name, tuple(tensor.shape), SEED, torch.float32)), name
    assert model.config.intermediate_size == 40 and model.config.num_hidden_layers == 3
