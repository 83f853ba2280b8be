"""LoRA through the launch script: `--lora PATH[:STRENGTH]` and the jsonl `lora` field; bad adapters
exit 2 with one line naming the file (unknown format, keys matching no layer, rank mismatch, an
adapter for another model, a shape that does not fit, `lora` without the config's section)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runnerkit.config import LoRARequest, load_runner_config, parse_lora_flag
from runnerkit.lora.synthetic import synthetic_adapter
from runnerkit.models.wan.runner import WanT2VRunner
from test_cases.conftest import tiny_config_dict, write_config
from test_cases._cli import no_gc_freeze, restore_logger  # noqa: F401 (autouse fixtures)
from test_cases._cli import run_cli as _cli

SMALL = ["--target_height", "32", "--target_width", "32", "--target_video_length", "5"]


@pytest.fixture(scope="module")
def layers(tiny_ckpt: Path) -> dict[str, tuple[int, int]]:
    return WanT2VRunner.lora_layers(load_runner_config(None, tiny_config_dict(tiny_ckpt)), "lightx2v")[0]


def _config(tiny_ckpt: Path, tmp_path: Path, **overrides: Any) -> Path:
    return write_config(tmp_path / "config.json", tiny_config_dict(tiny_ckpt, infer_steps=2, **overrides))


def test_parse_lora_flag() -> None:
    assert parse_lora_flag("a.safetensors") == LoRARequest(path="a.safetensors", strength=1.0)
    assert parse_lora_flag("dir/a.safetensors:0.5") == LoRARequest(path="dir/a.safetensors", strength=0.5)
    assert parse_lora_flag("c:/x/a.safetensors:-1") == LoRARequest(path="c:/x/a.safetensors", strength=-1.0)
    with pytest.raises(ValueError, match=r"the strength 'abc' after the last ':' is not a number"):
        parse_lora_flag("a.safetensors:abc")
    with pytest.raises(ValueError, match=r"the strength '' after the last ':' is not a number"):
        parse_lora_flag("a.safetensors:")
    with pytest.raises(ValueError, match=r"`--lora` ':0.5': no path before the ':'"):
        parse_lora_flag(":0.5")


def test_parse_lora_flag_keeps_a_colon_of_an_existing_file(tmp_path: Path) -> None:
    weird = tmp_path / "weird:name.safetensors"
    weird.write_bytes(b"")
    assert parse_lora_flag(str(weird)) == LoRARequest(path=str(weird))


def test_a_bad_strength_exits_2_naming_it(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flag, says in (("x.safetensors:abc", "the strength 'abc'"), ("x.safetensors:1000", "strength")):
        rc, err = _cli(capsys, "--config_json", _config(tiny_ckpt, tmp_path, lora={}), "--prompt", "x", *SMALL,
                       "--lora", flag)
        assert rc == 2 and says in err and "Traceback" not in err, err


BAD: dict[str, tuple[Any, str]] = {
    # name -> (tensors, or a file suffix; what the one line must say besides the file)
    "unknown_suffix": (".pt", "unknown format"),
    "unknown_keys": ({"blocks.0.self_attn.q.weight": torch.zeros(64, 64)}, "unknown format: 1 keys are not LoRA keys"),
    "rank_mismatch": ({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(4, 64),
                       "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(64, 3)}, "rank mismatch"),
    "unpaired": ({"blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 64)}, "without its pair"),
    "unmatched_key": ("unmatched", "1 of its layers match no linear layer of the wan2.1 transformer: blocks.9.self_attn.q"),
    "other_family": ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
                      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 4)},
                     "an adapter for another model"),
    "shape": ({"diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.zeros(4, 32),
               "diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.zeros(128, 4)}, "do not fit blocks.0.ffn.0 [out 128, in 64]"),
    # a damaged adapter: NaN would turn the whole output into NaN
    "nan": ({"diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.full((4, 64), float("nan")),
             "diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.zeros(128, 4)}, "NaN or infinite values"),
    # another size of the model: the names match, the shapes do not, and nothing else matches
    "other_size": ({"diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.zeros(4, 32),
                    "diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.zeros(128, 4),
                    "diffusion_model.blocks.7.ffn.0.lora_down.weight": torch.zeros(4, 32),
                    "diffusion_model.blocks.7.ffn.0.lora_up.weight": torch.zeros(128, 4)},
                   "1 match by name but not by shape (another size of this model?): blocks.0.ffn.0: down (4, 32)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_exits_2_naming_the_file(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             layers: dict[str, tuple[int, int]], case: str) -> None:
    content, says = BAD[case]
    path = tmp_path / f"{case}.{'pt' if content == '.pt' else 'safetensors'}"
    if content == ".pt":
        torch.save({"x": torch.zeros(1)}, path)
    else:
        if content == "unmatched":  # a good adapter plus one layer the 2-block model lacks
            content = synthetic_adapter(layers, "lightx2v", 2)
            content.update({"diffusion_model.blocks.9.self_attn.q.lora_down.weight": torch.zeros(2, 64),
                            "diffusion_model.blocks.9.self_attn.q.lora_up.weight": torch.zeros(64, 2)})
        save_file(content, str(path))
    out = tmp_path / "out.safetensors"
    rc, err = _cli(capsys, "--config_json", _config(tiny_ckpt, tmp_path, lora={}), "--prompt", "x", *SMALL,
                   "--lora", f"{path}:0.5", "--save_tensor_path", out)
    assert rc == 2, err
    line = next(x for x in err.splitlines() if "invalid input" in x)
    assert str(path) in line and says in line, err
    assert not out.exists()


def test_lora_without_config_section_exits_2(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             layers: dict[str, tuple[int, int]]) -> None:
    path = tmp_path / "a.safetensors"
    save_file(synthetic_adapter(layers, "lightx2v", 2), str(path))
    rc, err = _cli(capsys, "--config_json", _config(tiny_ckpt, tmp_path), "--prompt", "x", *SMALL, "--lora", path)
    assert rc == 2 and "config has no `lora` section" in err, err


def test_an_adapter_neither_named_nor_on_disk_exits_2_listing_the_names(
        tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], layers: dict[str, tuple[int, int]]) -> None:
    path = tmp_path / "a.safetensors"
    save_file(synthetic_adapter(layers, "lightx2v", 2), str(path))
    config = _config(tiny_ckpt, tmp_path, lora={"adapters": {"style": str(path), "fast": str(path)}})
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "x", *SMALL, "--lora", "stlye")
    line = next(x for x in err.splitlines() if "stlye" in x)
    assert rc == 2 and "`lora[0].path`='stlye' is neither a name of the config's `lora.adapters` (names: " \
        "['fast', 'style']) nor an existing .safetensors file" in line, err
    rc, err = _cli(capsys, "--config_json", config, "--prompt", "x", *SMALL, "--lora", "style", "--lora", tmp_path)
    line = next(x for x in err.splitlines() if "invalid input" in x)
    assert rc == 2 and f"`lora[1].path`={str(tmp_path)!r} is a folder: give an adapter's .safetensors file" in line, err


def test_requests_file_with_and_without_lora(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             layers: dict[str, tuple[int, int]]) -> None:
    """One process: [A at 0.7 (a name of `lora.adapters`), none, A by path at 0.7]: the requests
    without an adapter and the two with it agree, the sidecar records the adapter."""
    path = tmp_path / "a.safetensors"
    save_file(synthetic_adapter(layers, "lightx2v", 4, seed=3, alpha=4.0), str(path))
    lines = [{"prompt": "a fox", "seed": 1, "lora": [{"path": "style", "strength": 0.7}]},
             {"prompt": "a fox", "seed": 1},
             {"prompt": "a fox", "seed": 1, "lora": [{"path": str(path), "strength": 0.7}]}]
    for i, line in enumerate(lines):
        line.update(target_height=32, target_width=32, target_video_length=5,
                    save_result_path=str(tmp_path / f"r{i}.mp4") if i == 0 else None,
                    save_tensor_path=str(tmp_path / f"r{i}.safetensors"))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({k: v for k, v in x.items() if v is not None}) for x in lines))
    config = _config(tiny_ckpt, tmp_path, lora={"adapters": {"style": str(path)}})
    rc, err = _cli(capsys, "--config_json", config, "--requests", requests)
    if rc != 0 and "media" in err:
        pytest.skip("media extra missing")
    assert rc == 0, err
    videos = [load_file(str(tmp_path / f"r{i}.safetensors"))["video"] for i in range(3)]
    assert torch.equal(videos[0], videos[2]) and not torch.equal(videos[0], videos[1])
    sidecar = json.loads((tmp_path / "r0.json").read_text())
    assert sidecar["lora"] == [{"path": str(path.resolve()), "strength": 0.7}], sidecar


@pytest.mark.parametrize("flag, says", [("a.safetensors:1e999", "lora[0].strength: Input should be a finite number"),
                                        ("a.safetensors:-101", "lora[0].strength: Input should be greater than or equal"),
                                        ("", "lora[0].path: String should have at least 1 character")])
def test_a_lora_flag_value_out_of_range_names_its_item(tiny_ckpt: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str], flag: str, says: str) -> None:
    rc, err = _cli(capsys, "--config_json", _config(tiny_ckpt, tmp_path, lora={}), "--prompt", "x", *SMALL,
                   "--lora", flag)
    assert rc == 2 and says in err, err
