"""Lightricks' packed Gemma-4 text-encoder file (text_encoder_packed.py, text_encoder_packed_write.py).

- A tiny Gemma-4 folder (with a vision embedder's and a head's tensors the text model never takes) packed in both
  key namings ltx-core accepts: the same config, placeholder ids, tokenizer ids and weights as the folder, and the
  same stacked hidden states bit for bit; streamed from the packed file (host memory or its byte ranges), equal
  to the resident encoder.
- Each kind of bad file is refused when it is opened or loaded, naming the file and what is wrong.
- The release: the connector tensors of the packed file take precedence over the transformer file's (ltx-core's
  order), the packed file is found by content when `text_encoder_path` is omitted, and the memory estimate reads
  the Gemma-4 config from the packed file before anything loads.
The tiny runner from the release's packed file equals the diffusers folder of the same seed bit for bit:
test_release_layout_ltx25.py; the launch-script dry run: test_release_run_ltx25.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from runnerkit.config import OffloadConfig, load_runner_config
from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.models.ltx2 import release25_names as names
from runnerkit.models.ltx2.arch25 import tiny_ltx25_arch
from runnerkit.models.ltx2.checkpoint25 import tiny_gemma4_sizes, write_tiny_gemma4
from runnerkit.models.ltx2.checkpoint_release25 import open_ltx25
from runnerkit.models.ltx2.checkpoint_release25_write import write_release_ltx25
from runnerkit.models.ltx2.checkpoint_synthetic import GEMMA_VOCAB
from runnerkit.models.ltx2.runner25 import LTX25Runner
from runnerkit.models.ltx2.text_encoder_gemma4 import Gemma4PromptEncoder
from runnerkit.models.ltx2.text_encoder_packed import PackedGemma4
from runnerkit.models.ltx2.text_encoder_packed import configs_of as gemma4_configs
from runnerkit.models.ltx2.text_encoder_packed import load_text_model as load_gemma4_text_encoder
from runnerkit.models.ltx2.text_encoder_packed import load_tokenizer as load_gemma4_tokenizer
from runnerkit.models.ltx2.text_encoder_packed import stream_text_model as stream_gemma4_text_encoder
from runnerkit.models.ltx2.text_encoder_packed_write import pack_gemma4_folder
from runnerkit.offload import disk
from runnerkit.weights import CheckpointError

CPU = torch.device("cpu")
FILES = names.release_files(torch.float32)  # `_release` writes float32: its files are named `-fp32`
PROMPTS = ["a red fox runs~ through fresh snow", ""]
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ltx2" / "ltx25_t2av_tiny.json"
PROJECTION = {"text_embedding_projection.video_aggregate_embed.bias": torch.arange(4.0)}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Gemma-4 folder (norms and layer scalars away from their init; a vision embedder's tensor and an
    untied head beside the text model) and its packed file in each naming."""
    root = tmp_path_factory.mktemp("packed")
    folder = write_tiny_gemma4(root / "gemma4", tiny_ltx25_arch(), 0)
    write_debug_tokenizer(folder, GEMMA_VOCAB)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    tensors = {k: v + 0.3 * torch.randn(v.shape, generator=generator) if "norm" in k or "layer_scalar" in k else v
               for k, v in tensors.items()}
    tensors |= {"model.embed_vision.embedding_projection.weight": torch.ones(16, 4), "lm_head.weight": torch.ones(3, 5)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    out = {"folder": folder}
    for naming in ("comfy", "transformers"):
        out[naming] = pack_gemma4_folder(folder, root / f"{naming}.safetensors", PROJECTION, naming)
    return out


def _encode(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    _, placeholders = gemma4_configs(path)
    model = load_gemma4_text_encoder(path, torch.float32, CPU)
    return Gemma4PromptEncoder(load_gemma4_tokenizer(path), model, 64, placeholder_ids=placeholders).encode(PROMPTS)


@pytest.mark.parametrize("naming", ["comfy", "transformers"])
def test_the_packed_file_holds_the_folders_text_encoder(packed: dict[str, Path], naming: str) -> None:
    folder, file = packed["folder"], packed[naming]
    opened = PackedGemma4.open(file)
    with safe_open(str(file), framework="pt") as handle:
        keys = set(handle.keys())
    text_key = {"comfy": "model.layers.1.mlp.down_proj.weight",
                "transformers": "model.language_model.layers.1.mlp.down_proj.weight"}[naming]
    tower = {"comfy": "multi_modal_projector.embedding_projection.weight",
             "transformers": "model.embed_vision.embedding_projection.weight"}[naming]
    assert opened.naming == naming and {text_key, tower, "tokenizer_json"} <= keys
    assert set(opened.unused) == {tower, "lm_head.weight"} and set(opened.connectors) == set(PROJECTION)
    assert {"tokenizer_config.json", "chat_template.jinja"} <= set(opened.assets)
    (config_a, ids_a), (config_b, ids_b) = gemma4_configs(folder), gemma4_configs(file)
    assert config_a.to_dict() == config_b.to_dict() and ids_a == ids_b
    tok_a, tok_b = load_gemma4_tokenizer(folder), load_gemma4_tokenizer(file)
    assert type(tok_a) is type(tok_b) and tok_a.pad_token == tok_b.pad_token == "<pad>"
    assert tok_a(PROMPTS[0]).input_ids == tok_b(PROMPTS[0]).input_ids
    a = load_gemma4_text_encoder(folder, torch.float32, CPU)
    b = load_gemma4_text_encoder(file, torch.float32, CPU)
    for kind in ("named_parameters", "named_buffers"):
        got, want = dict(getattr(b, kind)()), dict(getattr(a, kind)())
        assert sorted(got) == sorted(want), kind
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want), kind
    (hidden_a, mask_a), (hidden_b, mask_b) = _encode(folder), _encode(file)
    assert torch.equal(hidden_a, hidden_b) and torch.equal(mask_a, mask_b)


@pytest.mark.parametrize(("mode", "storage", "reader"), [("block", "disk", "mmap"), ("phase", "disk", "pread"),
                                                         ("block", "cpu", "mmap")])
def test_streaming_from_the_packed_file_equals_the_resident_encoder(packed: dict[str, Path], mode: str, storage: str,
                                                                    reader: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit; the bytes read (either storage) are exactly the text model's tensors under the file's names,
    never the towers', the head's, the projections' or the embedded files'."""
    file = packed["comfy"]
    want = _encode(file)
    tokenizer, (_, placeholders) = load_gemma4_tokenizer(file), gemma4_configs(file)
    read: list[str] = []  # from here: the streamed model's reads only
    original = disk.SafetensorsDiskReader._read_batch
    monkeypatch.setattr(disk.SafetensorsDiskReader, "_read_batch", lambda self, handle, batch: (
        read.extend(e.name for e, _ in batch), original(self, handle, batch))[1])
    offload = OffloadConfig(mode=mode, storage=storage, reader=reader)
    model, streamer = stream_gemma4_text_encoder(file, offload, CPU, torch.float32)
    try:
        got = Gemma4PromptEncoder(tokenizer, model, 64, placeholder_ids=placeholders).encode(PROMPTS)
        stats = streamer.stats()
    finally:
        streamer.close()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(streamer.units) == 2 * (2 if mode == "phase" else 1) and stats["h2d_copies"] >= len(streamer.units)
    assert (stats.get("disk_bytes_read", 0) > 0) == (storage == "disk")
    assert set(read) == set(PackedGemma4.open(file).text)


# ---- bad files ---------------------------------------------------------------------------------------------
def _rewrite(source: Path, out: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None,
             metadata: dict[str, Any] | None = None) -> Path:
    """`source` rewritten: tensors `drop` removed, `add` added, metadata entries replaced (None: removed)."""
    with safe_open(str(source), framework="pt") as handle:
        meta = dict(handle.metadata() or {})
    tensors = {k: v for k, v in load_file(source).items() if k not in drop} | (add or {})
    for key, value in (metadata or {}).items():
        meta.pop(key) if value is None else meta.update({key: value})
    save_file(tensors, out, metadata=meta)
    return out


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "no_config": ({"metadata": {"gemma_config": None}}, r"has no `gemma_config` metadata entry"),
    "gemma3_config": ({"metadata": {"gemma_config": json.dumps({"model_type": "gemma3"})}},
                      r"`gemma_config` has `model_type`='gemma3'; allowed: \['gemma4_unified'\]"),
    "no_tokenizer": ({"drop": ("tokenizer_json",)}, r"has no `tokenizer_json` tensor"),
    "no_tokenizer_config": ({"drop": ("hf_asset__tokenizer_config.json",)},
                            r"lacks the sidecar\(s\) \['tokenizer_config.json'\]"),
    "no_text_model": ({"drop": "text"}, r"holds no Gemma-4 text-model weights"),
    "unknown_tensor": ({"add": {"diffusion_model.stray.weight": torch.ones(2)}},
                       r"1 tensors of no known role .*: diffusion_model.stray.weight"),
    "missing_weight": ({"drop": ("model.layers.1.mlp.down_proj.weight",)},
                       r"lacks 1 tensors of the streamed module \(model names\): layers.1.mlp.down_proj.weight"),
    "unexpected_weight": ({"add": {"model.layers.7.mlp.down_proj.weight": torch.ones(2)}},
                          r"1 unexpected text-model tensors .*: model.layers.7.mlp.down_proj.weight"),
    "wrong_shape": ({"add": {"model.norm.weight": torch.ones(3)}}, r"shape mismatch .*norm.weight: checkpoint \(3,\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_packed_file_is_refused_naming_the_file_and_what_is_wrong(packed: dict[str, Path], tmp_path: Path,
                                                                        case: str) -> None:
    change, message = BAD[case]
    source = packed["comfy"]
    if change.get("drop") == "text":
        change = {"drop": tuple(PackedGemma4.open(source).text)}
    bad = _rewrite(source, tmp_path / "bad.safetensors", **change)
    with pytest.raises(CheckpointError, match=message) as raised:
        load_gemma4_text_encoder(bad, torch.float32, CPU)  # opens the file, then reads the weights
    assert str(bad) in str(raised.value)


# ---- the release -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("release") / "ltx25"
    return write_release_ltx25(tiny_ltx25_arch(), root, 0, torch.float32)


def _copy(release: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ltx25"
    shutil.copytree(release, root)
    return root


def test_connector_tensors_of_the_packed_file_take_precedence(release: Path, tmp_path: Path) -> None:
    """ltx-core loads the transformer file, then the packed file, the later tensor replacing the earlier: a
    projection in both is the packed file's; one in neither is a load error naming the key."""
    root = _copy(release, tmp_path)
    transformer, packed = root / FILES["transformer"], root / FILES["text_encoder"]
    key = "text_embedding_projection.video_aggregate_embed.bias"
    theirs = load_file(packed)[key]
    _rewrite(transformer, tmp_path / "t.safetensors", add={key: torch.full_like(theirs, 7.0)})
    shutil.move(tmp_path / "t.safetensors", transformer)
    upsampler = root / FILES["latent_upsampler"]
    ckpt = open_ltx25(transformer, upsampler, packed)
    assert torch.equal(ckpt.state_dict("connectors")[0]["video_text_proj_in.bias"], theirs)
    _rewrite(packed, tmp_path / "p.safetensors", drop=(key,))
    shutil.move(tmp_path / "p.safetensors", packed)
    ckpt = open_ltx25(transformer, upsampler, packed)  # now only the transformer file has it
    assert torch.equal(ckpt.state_dict("connectors")[0]["video_text_proj_in.bias"], torch.full_like(theirs, 7.0))
    _rewrite(transformer, tmp_path / "t.safetensors", drop=(key,))
    shutil.move(tmp_path / "t.safetensors", transformer)
    with pytest.raises(CheckpointError, match=rf"connectors: .* missing keys \(1\): \['{key}'\]"):
        open_ltx25(transformer, upsampler, packed).state_dict("connectors")


def test_the_packed_file_is_found_by_content_without_text_encoder_path(release: Path, tmp_path: Path) -> None:
    root = _copy(release, tmp_path)
    transformer, upsampler = root / FILES["transformer"], root / FILES["latent_upsampler"]
    renamed = root / "text_encoders" / "any-name.safetensors"
    (root / FILES["text_encoder"]).rename(renamed)
    save_file({"text_embedding_projection.other.weight": torch.ones(1)}, root / "text_encoders" / "not-gemma.safetensors")
    assert open_ltx25(transformer, upsampler, None).text_encoder_path == renamed
    data = {**json.loads(CONFIG.read_text()), "device": "cpu", "model_path": str(transformer),
            "upsampler_path": str(upsampler)}
    del data["synthetic_checkpoint"]
    runner = LTX25Runner(load_runner_config(None, data))  # `text_encoder_path` may be left out
    assert runner.gemma4_folder(transformer) == renamed
    shutil.copy(renamed, root / "text_encoders" / "second.safetensors")
    with pytest.raises(CheckpointError, match=r"2 packed Gemma-4 files in .*text_encoders .*give `text_encoder_path`"):
        open_ltx25(transformer, upsampler, None)
    (root / "text_encoders" / "second.safetensors").unlink()
    _rewrite(renamed, renamed, metadata={"gemma_config": None})  # damaged: the refusal says why it is not one
    with pytest.raises(CheckpointError) as exc:
        open_ltx25(transformer, upsampler, None)
    assert ("0 packed Gemma-4 files in" in str(exc.value) and "; any-name.safetensors is not one: no `gemma_config` "
            "metadata entry; not-gemma.safetensors is not one: no `tokenizer_json` tensor and no `gemma_config` "
            "metadata entry; exactly one" in str(exc.value)), exc.value


def test_the_estimate_reads_gemma4_from_the_packed_file_before_loading(release: Path, tmp_path: Path) -> None:
    """Planning a release whose transformer file is absent: the Gemma-4 sizes are the packed file's (the tiny
    ones, which the tiny connectors take; Gemma-4 12B's would not fit them), and the plan's sources say so."""
    packed = release / FILES["text_encoder"]
    data = {**json.loads(CONFIG.read_text()), "device": "cpu", "model": tiny_ltx25_arch().model_dump(mode="json"),
            "model_path": str(tmp_path / "diffusion_models" / "ltx-2.5-22b-absent.safetensors"),
            "upsampler_path": str(release / FILES["latent_upsampler"]), "text_encoder_path": str(packed)}
    del data["synthetic_checkpoint"]
    runner = LTX25Runner.for_plan(load_runner_config(None, data))
    sizes = tiny_gemma4_sizes(tiny_ltx25_arch())
    config = runner.gemma4_text_config(tiny_ltx25_arch())
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim", "layer_types")
    assert [config[k] for k in fields] == [sizes[k] for k in fields]
    assert runner.estimate_memory((64, 64, 9)).modules["text_encoder"].weight_bytes > 0
    assert f"Gemma-4 sizes: metadata `gemma_config` of {packed}" in runner.estimate_sources()


def test_the_release_size_writer_streams_a_packed_file_the_reader_takes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`write_release_gemma4` (the 12B stand-in, here at the tiny sizes) writes the packed file tensor by tensor:
    ComfyUI's naming, the projections and the tokenizer embedded, each weight the value the folder writer draws
    for its transformers name (`synthetic_tensor`)."""
    from runnerkit.models.ltx2 import checkpoint_release25_write as write
    from runnerkit.weights import synthetic_tensor

    monkeypatch.setattr(write, "GEMMA4_12B_TEXT", tiny_gemma4_sizes(tiny_ltx25_arch()))
    write_debug_tokenizer(tmp_path / "tok", GEMMA_VOCAB)
    out = write.write_release_gemma4(tmp_path / "te.safetensors", 3, torch.bfloat16, PROJECTION, tmp_path / "tok")
    opened = PackedGemma4.open(out)
    assert opened.naming == "comfy" and set(opened.connectors) == set(PROJECTION) and not opened.unused
    assert torch.equal(load_file(out)["text_embedding_projection.video_aggregate_embed.bias"], torch.arange(4.0))
    model = load_gemma4_text_encoder(out, torch.bfloat16, CPU)
    for name, value in model.state_dict().items():
        if name in ("embed_tokens.weight", "layers.1.mlp.down_proj.weight", "norm.weight", "layers.0.layer_scalar"):
            want = synthetic_tensor(f"model.language_model.{name}", tuple(value.shape), 3, torch.bfloat16)
            assert torch.equal(value, want), name
    assert load_gemma4_tokenizer(out)("ab").input_ids == load_gemma4_tokenizer(tmp_path / "tok")("ab").input_ids


def test_the_text_config_is_read_once_per_version_of_its_file(packed: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate's Gemma-4 config (`text_config_dict`, asked once per candidate plan) reads a packed file or a
    folder's config.json once, and again once the file changes (its size or modification time); each call gets
    its own dict, and a file that cannot be read is not remembered."""
    import os

    from runnerkit.models.ltx2 import text_encoder_packed as tp

    tp._text_config_dict.cache_clear()
    reads: list[str] = []
    real = tp.configs_of
    monkeypatch.setattr(tp, "configs_of", lambda path: (reads.append(Path(path).name), real(path))[1])
    file = shutil.copy(packed["comfy"], tmp_path / "packed.safetensors")
    first = tp.text_config_dict(file)
    first["hidden_size"] = -1
    assert tp.text_config_dict(file) == real(file)[0].to_dict() and reads == ["packed.safetensors"]
    folder = shutil.copytree(packed["folder"], tmp_path / "folder")
    tp.text_config_dict(folder)
    tp.text_config_dict(folder)
    assert reads == ["packed.safetensors", "folder"]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config, indent=4))  # another size: another version
    os.utime(folder / "config.json", ns=(1, 1))
    tp.text_config_dict(folder)
    assert reads == ["packed.safetensors", "folder", "folder"]
    (folder / "config.json").unlink()
    for _ in range(2):
        with pytest.raises(CheckpointError, match="has no config.json"):
            tp.text_config_dict(folder)
    assert reads[3:] == ["folder", "folder"]
