"""Damaged checkpoint files are refused at load with exit 2 and one line naming the file (and the
tensor), the same way in every offload mode and every layout (issue 8, item 3).

Each case hard-links a tiny synthetic checkpoint (runnerkit, original Wan or diffusers layout,
single-file or sharded) into `tmp_path`, replaces one file with a byte-precise damaged copy, and
runs the launch script in-process once per offload mode (`MODES`: none, model, block and phase
streaming from host memory and from disk with both readers, lazy_load, unload_modules). Every
mode must exit 2 with the same one error record from the load phase, naming the file and the
tensor, and write nothing: damage kind x layout x mode.

The loader-level tests at the end check the pieces directly: the all-resident reader and the disk
streaming reader refuse a damaged header with one message (and only headers the safetensors
library refuses too), and the state-dict and streaming paths refuse a wrong shape or dtype, naming
the file and the tensor, while legal casts between floating dtypes load.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit import synthetic
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from runnerkit.config import OffloadConfig
from runnerkit.infer import main
from runnerkit.models.wan import checkpoint as ckpt_mod
from runnerkit.models.wan.arch import WanArch, WanTransformerArch
from runnerkit.models.wan.checkpoint import LAYOUTS, write_synthetic
from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
from runnerkit.offload.disk import SafetensorsDiskReader
from runnerkit.offload.setup import stream_module
from runnerkit.weights import CheckpointError, assign_state_dict, build_on_meta, read_safetensors, synthetic_tensor
from test_cases.conftest import TINY_CONFIG, tiny_config_dict, write_config
from test_cases._cli import no_gc_freeze, restore_logger  # noqa: F401 (autouse fixtures)

# Offload settings, together covering every value of mode, storage, reader, lazy_load and unload_modules.
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "model": {"offload": {"mode": "model"}},
    "phase-cpu": {"offload": {"mode": "phase", "storage": "cpu"}},
    "block-disk-pread": {"offload": {"mode": "block", "storage": "disk", "reader": "pread"}},
    "lazy_load-phase-disk-mmap": {"offload": {"mode": "phase", "storage": "disk", "reader": "mmap", "lazy_load": True}},
    "unload_modules": {"unload_modules": True},
}
# Where each layout keeps the files that get damaged.
FILES: dict[str, dict[str, str]] = {
    "runnerkit": {"transformer": "transformer/model.safetensors", "text_encoder": "text_encoder/model.safetensors",
                  "vae": "vae/model.safetensors", "tokenizer": "tokenizer/tokenizer.json"},
    "original": {"transformer": "diffusion_pytorch_model.safetensors", "text_encoder": ckpt_mod.ORIGINAL_T5,
                 "vae": ckpt_mod.ORIGINAL_VAE, "tokenizer": "google/umt5-xxl/tokenizer.json"},
    "diffusers": {"transformer": "transformer/diffusion_pytorch_model.safetensors",
                  "text_encoder": "text_encoder/model.safetensors", "vae": "vae/diffusion_pytorch_model.safetensors",
                  "tokenizer": "tokenizer/tokenizer.json"},
}
# Shard index of each layout's sharded transformer.
INDEX = {"runnerkit": "transformer/model.safetensors.index.json",
         "original": "diffusion_pytorch_model.safetensors.index.json",
         "diffusers": "transformer/diffusion_pytorch_model.safetensors.index.json"}

# A damage reads the intact file and returns the damaged bytes and what the error must name.
Damage = Callable[[Path], tuple[bytes, tuple[str, ...]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny architecture in every layout; "<layout>-sharded" splits the transformer into shards + index."""
    arch = WanArch.model_validate(json.loads(TINY_CONFIG.read_text())["model"])
    root = tmp_path_factory.mktemp("intact")
    out = {layout: write_synthetic(arch, root / layout, seed=0, dtype=torch.float32, layout=layout)
           for layout in LAYOUTS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synthetic, "SHARD_BYTES", 150_000)  # the tiny transformer is ~600 kB: 4+ shards
        for layout in LAYOUTS:
            out[f"{layout}-sharded"] = write_synthetic(arch, root / f"{layout}-sharded", seed=0, dtype=torch.float32,
                                                       layout=layout)
    return out


def _damaged(intact: Path, dest: Path, rel: str, damage: Damage) -> tuple[Path, tuple[str, ...]]:
    """`intact` hard-linked into `dest`, with `rel` replaced by its damaged copy (the intact files are
    shared, never written); returns the damaged file and what its error must name."""
    shutil.copytree(intact, dest, copy_function=os.link)
    data, needles = damage(intact / rel)
    (dest / rel).unlink()  # a new file: the hard-linked original stays intact
    (dest / rel).write_bytes(data)
    return dest / rel, needles


def _assert_refused_in_every_mode(ckpt: Path, damaged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  *needles: str) -> None:
    """Every mode: exit 2, nothing written, one error record from the load phase naming `damaged`
    on its first line and every needle; the same record in every mode."""
    records: dict[str, str] = {}
    for mode, overrides in MODES.items():
        cfg = write_config(tmp_path / f"{mode}.json", tiny_config_dict(
            ckpt, infer_steps=1, target_height=32, target_width=32, target_video_length=5, **overrides))
        out = tmp_path / f"{mode}.safetensors"
        capsys.readouterr()
        rc = main(["--config_json", str(cfg), "--prompt", "x", "--save_tensor_path", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, f"{mode}: exit {rc}\n{err}"
        assert not out.exists(), f"{mode}: a request ran"
        assert err.count("| ERROR") == 1, f"{mode}: not one error record\n{err}"
        records[mode] = record = err.split("| ERROR", 1)[1].lstrip(" |").strip()
        first = record.splitlines()[0]
        assert first.startswith("load failed: CheckpointError: ") and str(damaged) in first, f"{mode}: {record}"
        for needle in needles:
            assert needle in record, f"{mode}: {needle!r} not in {record!r}"
    assert len(set(records.values())) == 1, "modes refuse differently:\n" + "\n".join(
        f"{mode}: {record}" for mode, record in records.items())


# ---- safetensors headers ---------------------------------------------------------------------------
def _split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, tensor data) of safetensors bytes."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict[str, Any] | list[Any], data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def _tensors(header: dict[str, Any]) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _matrix(header: dict[str, Any]) -> str:
    """The first tensor (by name) with two or more dimensions."""
    return next(k for k in _tensors(header) if len(header[k]["shape"]) >= 2)


def _last(header: dict[str, Any]) -> str:
    """The tensor whose bytes end the file."""
    return max(_tensors(header), key=lambda k: header[k]["data_offsets"][1])


def _edit(change: Callable[[dict[str, Any]], tuple[str, ...]]) -> Damage:
    """A damage that edits the parsed header (`change` returns the needles) and keeps the data bytes."""
    def damage(path: Path) -> tuple[bytes, tuple[str, ...]]:
        header, data = _split(path.read_bytes())
        needles = change(header)
        return _join(header, data), needles
    return damage


def _drop(key: str) -> Damage:
    def change(h: dict[str, Any]) -> tuple[str, ...]:
        name = _matrix(h)
        del h[name][key]
        return name, f"lacks [{key!r}]"
    return _edit(change)


def _set(key: str, value: Callable[[Any], Any], needle: str) -> Damage:
    """The first matrix's header field `key` becomes `value(its value)`."""
    def change(h: dict[str, Any]) -> tuple[str, ...]:
        name = _matrix(h)
        h[name][key] = value(h[name][key])
        return name, needle
    return _edit(change)


def _overlap(h: dict[str, Any]) -> tuple[str, ...]:
    """A tensor's offsets become those of another of the same dtype and shape."""
    by_kind: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for k in _tensors(h):
        by_kind.setdefault((h[k]["dtype"], tuple(h[k]["shape"])), []).append(k)
    first, second = next(names for names in by_kind.values() if len(names) >= 2)[:2]
    h[second]["data_offsets"] = list(h[first]["data_offsets"])
    return first, second, "overlap"


def _truncated(path: Path) -> tuple[bytes, tuple[str, ...]]:
    raw = path.read_bytes()
    return raw[:-100], (_last(_split(raw)[0]), "run past the end", "truncated")


HEADER_DAMAGES: dict[str, Damage] = {
    "length_past_eof": lambda p: (struct.pack("<Q", p.stat().st_size) + p.read_bytes()[8:],
                                  ("header length", "runs past the end")),
    "not_utf8": lambda p: (p.read_bytes()[:8] + b"\xff" + p.read_bytes()[9:], ("header is not UTF-8",)),
    "not_json": lambda p: (p.read_bytes()[:8] + p.read_bytes()[8:].replace(b'"', b"'", 1),
                           ("header is not valid JSON",)),
    "not_object": lambda p: (_join(_tensors(_split(p.read_bytes())[0]), _split(p.read_bytes())[1]),
                             ("header is an array, not a JSON object",)),
    "no_dtype": _drop("dtype"),
    "no_shape": _drop("shape"),
    "no_data_offsets": _drop("data_offsets"),
    "unknown_dtype": _set("dtype", lambda _: "F7", "dtype 'F7'"),
    "negative_dim": _set("shape", lambda s: [-s[0], *s[1:]], "not a list of non-negative integers"),
    "reversed_offsets": _set("data_offsets", lambda o: o[::-1], "begin <= end"),
    "size_mismatch": _set("shape", lambda s: [s[0], s[1] - 1, *s[2:]], "does not hold"),
    "overlap": _edit(_overlap),
    "truncated": _truncated,
    "trailing_bytes": lambda p: (p.read_bytes() + bytes(16), ("16 bytes after the last tensor",)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(HEADER_DAMAGES))
def test_damaged_transformer_header(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    kind: str, layout: str) -> None:
    damaged, needles = _damaged(checkpoints[layout], tmp_path / "ckpt", FILES[layout]["transformer"],
                                HEADER_DAMAGES[kind])
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, "transformer", *needles)


@pytest.mark.parametrize("component", ["text_encoder", "vae"])
@pytest.mark.parametrize("layout", ["runnerkit", "diffusers"])
@pytest.mark.parametrize("kind", ["not_json", "no_shape", "overlap", "truncated"])
def test_damaged_text_encoder_or_vae_header(checkpoints: dict[str, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str], kind: str, layout: str,
                                            component: str) -> None:
    damaged, needles = _damaged(checkpoints[layout], tmp_path / "ckpt", FILES[layout][component], HEADER_DAMAGES[kind])
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, component, *needles)


# ---- tensors that do not fit the architecture --------------------------------------------------------
def _rewrite(pick: Callable[[dict[str, torch.Tensor]], str], change: Callable[[torch.Tensor], torch.Tensor],
             *needles: str) -> Damage:
    """A valid safetensors file whose tensor `pick(tensors)` becomes `change(tensor)`."""
    def damage(path: Path) -> tuple[bytes, tuple[str, ...]]:
        tensors = load_file(str(path))
        name = pick(tensors)
        tensors[name] = change(tensors[name]).contiguous()
        return save(tensors), (name, *needles)
    return damage


def _block_matrix(sd: dict[str, torch.Tensor]) -> str:
    return next(k for k in sorted(sd) if k.startswith("blocks.") and sd[k].ndim == 2)


def _resident_matrix(sd: dict[str, torch.Tensor]) -> str:
    return next(k for k in sorted(sd) if not k.startswith("blocks.") and sd[k].ndim >= 2)


TENSOR_DAMAGES: dict[str, Damage] = {
    "streamed_shape": _rewrite(_block_matrix, lambda t: t[:, :-1], "shape mismatch",
                               "checkpoint (64, 63) vs model (64, 64)"),
    "resident_shape": _rewrite(_resident_matrix, lambda t: t[:-1], "shape mismatch"),
    "integer_dtype": _rewrite(_block_matrix, lambda t: t.to(torch.int32), "dtype mismatch", "torch.int32 vs model"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(TENSOR_DAMAGES))
def test_transformer_tensor_of_wrong_shape_or_dtype(checkpoints: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str], kind: str, layout: str) -> None:
    damaged, needles = _damaged(checkpoints[layout], tmp_path / "ckpt", FILES[layout]["transformer"],
                                TENSOR_DAMAGES[kind])
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, "transformer", *needles)


# ---- .pth files (original layout: T5 and VAE) ----------------------------------------------------------
def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _pth_edit(change: Callable[[dict[str, Any]], tuple[str, ...]]) -> Damage:
    def damage(path: Path) -> tuple[bytes, tuple[str, ...]]:
        sd = torch.load(path, weights_only=True)
        needles = change(sd)
        return _torch_bytes(sd), needles
    return damage


def _pth_first_matrix(sd: dict[str, Any]) -> str:
    return next(k for k in sorted(sd) if sd[k].ndim >= 2 and sd[k].shape[-1] > 1)


def _pth_shape(sd: dict[str, Any]) -> tuple[str, ...]:
    name = _pth_first_matrix(sd)
    sd[name] = sd[name][..., :-1].clone()
    return name, "shape mismatch"


def _pth_dtype(sd: dict[str, Any]) -> tuple[str, ...]:
    name = _pth_first_matrix(sd)
    sd[name] = sd[name].to(torch.int32)
    return name, "dtype mismatch", "torch.int32"


def _pth_not_tensor(sd: dict[str, Any]) -> tuple[str, ...]:
    name = sorted(sd)[0]
    sd[name] = 3
    return name, "not tensors"


NOT_A_CHECKPOINT = "the file is truncated or not a torch checkpoint"
PTH_DAMAGES: dict[str, Damage] = {
    "truncated": lambda p: (p.read_bytes()[: p.stat().st_size // 2], (NOT_A_CHECKPOINT,)),
    "garbage": lambda p: (random.Random(0).randbytes(4096), (NOT_A_CHECKPOINT,)),
    "empty": lambda p: (b"", (NOT_A_CHECKPOINT, "(0 bytes)")),
    "not_a_dict": lambda p: (_torch_bytes([torch.zeros(2)]), ("does not hold a state dict (got list)",)),
    "not_a_tensor": _pth_edit(_pth_not_tensor),
    "wrong_shape": _pth_edit(_pth_shape),
    "integer_dtype": _pth_edit(_pth_dtype),
}


@pytest.mark.parametrize("component", ["text_encoder", "vae"])
@pytest.mark.parametrize("kind", list(PTH_DAMAGES))
def test_damaged_pth(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str,
                     component: str) -> None:
    damaged, needles = _damaged(checkpoints["original"], tmp_path / "ckpt", FILES["original"][component],
                                PTH_DAMAGES[kind])
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, component, *needles)


# ---- JSON: shard index, tokenizer, config files ------------------------------------------------------
def _index_edit(change: Callable[[dict[str, str]], tuple[str, ...]]) -> Damage:
    def damage(path: Path) -> tuple[bytes, tuple[str, ...]]:
        index = json.loads(path.read_text())
        needles = change(index["weight_map"])
        return json.dumps(index).encode(), needles
    return damage


def _missing_shard(weight_map: dict[str, str]) -> tuple[str, ...]:
    weight_map[sorted(weight_map)[0]] = "absent-shard.safetensors"
    return "absent-shard.safetensors", "does not exist"


def _moved_tensor(weight_map: dict[str, str]) -> tuple[str, ...]:
    """The index places a tensor in another shard, which lacks it."""
    name = sorted(weight_map)[0]
    other = next(s for s in sorted(set(weight_map.values())) if s != weight_map[name])
    weight_map[name] = other
    return name, other, "lacks"


def _outside(weight_map: dict[str, str]) -> tuple[str, ...]:
    weight_map[sorted(weight_map)[0]] = "../elsewhere.safetensors"
    return "'../elsewhere.safetensors'", "not a .safetensors file name"


INDEX_DAMAGES: dict[str, Damage] = {
    "not_json": lambda p: (p.read_bytes()[:-20], ("is not valid JSON",)),
    "no_weight_map": lambda p: (b'{"metadata": {}}', ("no `weight_map`",)),
    "missing_shard": _index_edit(_missing_shard),
    "tensor_not_in_its_shard": _index_edit(_moved_tensor),
    "shard_outside_folder": _index_edit(_outside),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(INDEX_DAMAGES))
def test_damaged_shard_index(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             kind: str, layout: str) -> None:
    damaged, needles = _damaged(checkpoints[f"{layout}-sharded"], tmp_path / "ckpt", INDEX[layout], INDEX_DAMAGES[kind])
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, "transformer: shard index", *needles)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_damaged_shard_header(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              layout: str) -> None:
    intact = checkpoints[f"{layout}-sharded"]
    shard = sorted((intact / INDEX[layout]).parent.glob("*-00002-of-*.safetensors"))[0]
    damaged, needles = _damaged(intact, tmp_path / "ckpt", str(shard.relative_to(intact)), HEADER_DAMAGES["overlap"])
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, "transformer", *needles)


NOT_UTF8 = b'{"\xff\xfe": 1}'


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["not_utf8", "truncated"])
def test_damaged_tokenizer_json(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                kind: str, layout: str) -> None:
    damage: Damage = {"not_utf8": lambda p: (NOT_UTF8, ()), "truncated": lambda p: (p.read_bytes()[:1000], ())}[kind]
    damaged, _ = _damaged(checkpoints[layout], tmp_path / "ckpt", FILES[layout]["tokenizer"], damage)
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, "is not a valid tokenizer.json")


CONFIGS = {  # config file -> (layout, its layer-count key)
    "config.json": ("original", "num_layers"),
    "transformer/config.json": ("diffusers", "num_layers"),
    "text_encoder/config.json": ("diffusers", "num_layers"),
    "vae/config.json": ("diffusers", "num_res_blocks"),
}


def _bad_value(key: str) -> Damage:
    def damage(path: Path) -> tuple[bytes, tuple[str, ...]]:
        config = json.loads(path.read_text())
        config[key] = "two"
        return json.dumps(config).encode(), (f"{key}: Input should be a valid integer (got 'two')",)
    return damage


@pytest.mark.parametrize("rel", list(CONFIGS))
@pytest.mark.parametrize("kind", ["not_utf8", "not_an_object", "bad_value"])
def test_damaged_config_json(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             kind: str, rel: str) -> None:
    layout, key = CONFIGS[rel]
    damage: Damage = {"not_utf8": lambda p: (NOT_UTF8, ("is not UTF-8 text",)),
                      "not_an_object": lambda p: (b"[1, 2]", ("must hold a JSON object, not an array",)),
                      "bad_value": _bad_value(key)}[kind]
    damaged, needles = _damaged(checkpoints[layout], tmp_path / "ckpt", rel, damage)
    _assert_refused_in_every_mode(tmp_path / "ckpt", damaged, tmp_path, capsys, *needles)


# ---- loader level: the pieces the launch script relies on ---------------------------------------------
@pytest.fixture()
def small_file(tmp_path: Path) -> Path:
    """A small valid safetensors file: two same-shape float32 matrices and a vector."""
    path = tmp_path / "intact.safetensors"
    path.write_bytes(save({"a": torch.zeros(4, 4), "b": torch.ones(4, 4), "c": torch.arange(3.0)}))
    return path


@pytest.mark.parametrize("kind", list(HEADER_DAMAGES))
def test_resident_and_disk_readers_refuse_alike_what_safetensors_refuses(small_file: Path, kind: str) -> None:
    data, needles = HEADER_DAMAGES[kind](small_file)
    damaged = small_file.with_name("damaged.safetensors")
    damaged.write_bytes(data)
    with pytest.raises(SafetensorError):  # the reference library refuses it too: the check is not stricter than it
        with safe_open(str(damaged), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(CheckpointError) as resident:
        read_safetensors([damaged], "toy")
    with pytest.raises(CheckpointError) as disk:
        SafetensorsDiskReader([damaged], reader="pread")
    assert str(resident.value) == f"toy: {disk.value}"  # one check, one message
    for needle in (str(damaged), *needles):
        assert needle in str(disk.value)
    read_safetensors([small_file], "toy")  # the intact file loads in both
    SafetensorsDiskReader([small_file])


ARCH = WanTransformerArch(dim=64, num_heads=2, num_layers=2, text_dim=32, ffn_dim=96, freq_dim=32, text_len=16,
                          in_dim=4, out_dim=4)


def _transformer_weights() -> dict[str, torch.Tensor]:
    shapes = {k: tuple(v.shape) for k, v in build_on_meta(lambda: WanTransformer3D(ARCH)).state_dict().items()}
    return {k: synthetic_tensor(k, s, seed=1, dtype=torch.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_floating_casts_load(dtype: torch.dtype) -> None:
    weights = _transformer_weights()
    weights["blocks.0.ffn.0.weight"] = weights["blocks.0.ffn.0.weight"].to(dtype)
    model = assign_state_dict(build_on_meta(lambda: WanTransformer3D(ARCH)), weights, "transformer",
                              dtype=torch.float32, keep_fp32=keep_fp32)
    assert model.blocks[0].ffn[0].weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_state_dict_path_refuses_a_non_floating_weight(dtype: torch.dtype) -> None:
    weights = _transformer_weights()
    weights["blocks.0.ffn.0.weight"] = weights["blocks.0.ffn.0.weight"].to(dtype)
    with pytest.raises(CheckpointError) as exc:
        assign_state_dict(build_on_meta(lambda: WanTransformer3D(ARCH)), weights, "transformer", dtype=torch.float32)
    assert "transformer: dtype mismatch for 1 tensors" in str(exc.value)
    assert f"blocks.0.ffn.0.weight: checkpoint {dtype} vs model torch.float32" in str(exc.value)


@pytest.mark.parametrize("name", ["blocks.1.ffn.2.weight", "head.head.weight"], ids=["streamed", "resident"])
@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_streaming_path_refuses_a_wrong_shape_naming_file_and_tensor(tmp_path: Path, storage: str, name: str) -> None:
    weights = _transformer_weights()
    weights[name] = weights[name][:-1].contiguous()
    path = tmp_path / "model.safetensors"
    path.write_bytes(save(weights))
    cfg = OffloadConfig(mode="block", storage=storage, pin_memory=False)
    model = build_on_meta(lambda: WanTransformer3D(ARCH))
    source = {"state_dict": weights} if storage == "cpu" else {"files": [path]}
    with pytest.raises(CheckpointError) as exc:
        stream_module(model, WanTransformer3D.STREAM_SPEC, cfg, torch.device("cpu"), torch.float32, "transformer",
                      **source)
    want = tuple(weights[name].shape)
    where = f"{name} in {path}" if storage == "disk" else name
    assert f"transformer: shape mismatch for 1 tensors: {where}: checkpoint {want}" in str(exc.value)
