"""Wan2.2 MoE checkpoint layouts: two transformer experts beside one text encoder and one VAE.

The A14B releases hold a high-noise and a low-noise expert of the same architecture (Wan2.1's
14B transformer), the Wan2.1 VAE and umt5-xxl. Three layouts, each a Wan2.1 layout
(checkpoint.py) with the single transformer replaced by two expert folders:

- original (Wan-Video/Wan2.2, `wan/configs/wan_t2v_A14B.py`): `high_noise_model/` and
  `low_noise_model/`, each `config.json` (WanModel) + `diffusion_pytorch_model*.safetensors`;
  `models_t5_umt5-xxl-enc-bf16.pth`, `Wan2.1_VAE.pth`, `google/umt5-xxl/`.
- diffusers (Wan-AI/Wan2.2-T2V-A14B-Diffusers): `transformer/` (high-noise) and `transformer_2/`
  (low-noise), `boundary_ratio` in `model_index.json`; `text_encoder/`, `vae/`, `tokenizer/`.
- runnerkit: `runnerkit.json` (family "wan2.2_moe") + `transformer/` (high-noise) +
  `transformer_2/` (low-noise) + `text_encoder/`, `vae/`, `tokenizer/`.

runnerkit names the experts by their module names everywhere: `transformer` = high-noise,
`transformer_2` = low-noise (diffusers' names).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError

from runnerkit import synthetic
from runnerkit.config import format_validation_error
from runnerkit.files import write_error_reason
from runnerkit.models.wan import transformer_keys as tk
from runnerkit.models.wan.arch import WanArch
from runnerkit.models.wan.checkpoint import (
    SYNTHETIC_MARKER,
    Layout,
    WanCheckpoint,
    _arch_from,
    marked_layout,
    merge_override,
    write_synthetic,
)
from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
from runnerkit.weights import CheckpointError, build_on_meta, check_tensors, read_json_object, safetensors_files

#: Expert module names, high-noise first.
EXPERTS: tuple[str, str] = ("transformer", "transformer_2")
#: Folder of each expert per layout.
EXPERT_FOLDERS: dict[str, dict[str, str]] = {
    "runnerkit": {"transformer": "transformer", "transformer_2": "transformer_2"},
    "original": {"transformer": "high_noise_model", "transformer_2": "low_noise_model"},
    "diffusers": {"transformer": "transformer", "transformer_2": "transformer_2"},
}
EXPERT_ROLES = {"transformer": "high-noise", "transformer_2": "low-noise"}
#: Seed offset of the low-noise expert's synthetic weights (the experts must differ, as real ones do).
LOW_NOISE_SEED_OFFSET = 1


@dataclass(frozen=True)
class WanExpertCheckpoint(WanCheckpoint):
    """One expert's view of a MoE checkpoint: a Wan2.1 checkpoint whose transformer is in `folder`
    (text encoder, VAE and tokenizer are the shared ones)."""

    folder: Path = Path()

    def transformer_files(self) -> list[Path]:
        stem = "model" if self.layout == "runnerkit" else "diffusion_pytorch_model"
        files = safetensors_files(self.folder, stem, "transformer")
        if not files:
            raise CheckpointError(f"transformer: no {stem}*.safetensors in {self.folder} "
                                  "(is the MoE checkpoint complete?)")
        return files


def detect_moe_layout(path: Path) -> Layout:
    """Which MoE layout `path` holds.

    Raises:
        CheckpointError: the folder is missing or holds no MoE layout (lists what each needs).
    """
    own = marked_layout(path)
    if own is not None:
        return own
    if any((path / f).is_dir() for f in EXPERT_FOLDERS["original"].values()):
        return "original"
    raise CheckpointError(
        f"`model_path` {str(path)!r} holds no Wan2.2 MoE checkpoint: expected runnerkit.json (runnerkit layout), "
        "model_index.json with transformer/ + transformer_2/ (diffusers layout) or high_noise_model/ + "
        "low_noise_model/ (original Wan2.2 layout)")


@dataclass(frozen=True)
class WanMoECheckpoint:
    """A located MoE checkpoint: layout, folder, the shared architecture, one view per expert.

    Attributes:
        boundary: the checkpoint's own expert switch (diffusers `boundary_ratio`), or None.
    """

    path: Path
    layout: Layout
    arch: WanArch
    experts: dict[str, WanExpertCheckpoint] = field(default_factory=dict)
    boundary: float | None = None

    @classmethod
    def open(cls, path: str | Path, override: dict[str, Any] | None = None) -> WanMoECheckpoint:
        """Detect the layout, check both experts are there, read the architecture (no weight read).

        Raises:
            CheckpointError: no MoE layout; an expert folder missing (named); the experts' configs
                disagree; a config file missing or invalid (named).
        """
        path = Path(path)
        layout = detect_moe_layout(path)
        folders = {e: path / f for e, f in EXPERT_FOLDERS[layout].items()}
        if layout == "runnerkit":  # the family first: a wan2.1 checkpoint is named as such
            meta = read_json_object(path / "runnerkit.json", "checkpoint")
            if meta.get("family") != "wan2.2_moe" or not isinstance(meta.get("arch"), dict):
                raise CheckpointError(f"{path}/runnerkit.json must be an object with \"family\": \"wan2.2_moe\" and an "
                                      f"\"arch\" object (got family {meta.get('family')!r})")
        missing = [f"{folders[e].name}/ ({EXPERT_ROLES[e]} expert)" for e in EXPERTS if not folders[e].is_dir()]
        if missing:
            raise CheckpointError(
                f"`model_path` {str(path)!r} ({layout} layout) lacks the expert folder {' and '.join(missing)}: a "
                f"Wan2.2 MoE checkpoint needs both {folders['transformer'].name}/ (high-noise) and "
                f"{folders['transformer_2'].name}/ (low-noise)")
        boundary: float | None = None
        if layout == "runnerkit":
            try:
                arch = WanArch.model_validate(meta["arch"])
            except ValidationError as exc:
                raise CheckpointError(format_validation_error(exc, f"architecture in {path}/runnerkit.json")) from None
            second = arch.transformer
        elif layout == "original":
            # Wan2.2 i2v configs read like Wan2.1's ("i2v", in_dim 36), but Wan2.2 has no CLIP image tokens
            first, second = (_arch_from(folders[e] / "config.json", e,
                                        lambda d: tk.arch_from_original_config(d, image_context=False)) for e in EXPERTS)
            arch = WanArch(transformer=first)
        else:
            index = read_json_object(path / "model_index.json", "checkpoint")
            ratio = index.get("boundary_ratio")
            if ratio is not None:
                if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < 1:
                    raise CheckpointError(f"{path}/model_index.json: `boundary_ratio` must be a number in (0, 1) "
                                          f"(got {ratio!r})")
                boundary = float(ratio)
            arch = WanCheckpoint.open(path).arch  # transformer/, text_encoder/, vae/ configs
            second = _arch_from(folders["transformer_2"] / "config.json", "transformer_2",
                                tk.arch_from_diffusers_config)
        if second != arch.transformer:
            raise CheckpointError(f"{path}: the experts' architectures differ ({folders['transformer'].name}: "
                                  f"{arch.transformer}; {folders['transformer_2'].name}: {second})")
        where = str(path / "runnerkit.json") if layout == "runnerkit" else f"the {layout} layout's configs in {path}"
        arch = merge_override(arch, override, path, layout, where)
        if arch.transformer.image_context:
            raise CheckpointError(f"{path}: the experts attend to CLIP image tokens (`image_context` true), which no "
                                  "Wan2.2 MoE release does (Wan2.2 i2v conditions through the VAE latents only)")
        experts = {e: WanExpertCheckpoint(path=path, layout=layout, arch=arch, folder=folders[e]) for e in EXPERTS}
        return cls(path=path, layout=layout, arch=arch, experts=experts, boundary=boundary)

    def check_files(self) -> None:
        """Every weight file against the architecture, from headers only: text encoder, high-noise
        expert and VAE (`WanCheckpoint.check_files`), then the low-noise expert.

        Raises:
            CheckpointError: naming the component, the file and the tensor.
        """
        self.experts["transformer"].check_files()
        expected = build_on_meta(lambda: WanTransformer3D(self.arch.transformer)).state_dict(keep_vars=True)
        check_tensors(expected, self.experts["transformer_2"].transformer_infos(), "transformer_2")


def write_synthetic_moe(arch: WanArch, out: Path, seed: int, dtype: torch.dtype, layout: Layout = "runnerkit",
                        boundary: float | None = None, generator_device: str = "cpu", replace: bool = False) -> Path:
    """Write a MoE checkpoint of random weights in `layout` (atomically: tmp folder, then rename).

    The Wan2.1 writer (`write_synthetic`) writes the shared parts and the high-noise expert with
    `seed`; the low-noise expert gets `seed + LOW_NOISE_SEED_OFFSET`, so the experts differ.
    `boundary` goes to the diffusers `model_index.json` (`boundary_ratio`; default 0.875).

    Raises:
        CheckpointError: `out` is not empty (and `replace` is false) and holds no synthetic checkpoint of this seed.
    """
    out = Path(out).absolute()
    tmp = out.with_name(f".{out.name}.partial-moe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write_synthetic(arch, tmp, seed, dtype, layout, generator_device=generator_device, announce=False)
        high, low = (tmp / EXPERT_FOLDERS[layout][e] for e in EXPERTS)
        if layout == "original":  # Wan2.1 keeps its transformer at the top; Wan2.2 in expert folders
            high.mkdir()
            for f in list(tmp.iterdir()):
                if f.name == "config.json" or f.name.startswith("diffusion_pytorch_model"):
                    f.rename(high / f.name)
            low.mkdir()
            (low / "config.json").write_text(json.dumps(tk.arch_to_original_config(arch.transformer), indent=1))
            stem, rename = "diffusion_pytorch_model", (lambda sd: sd)
        elif layout == "diffusers":
            index = json.loads((tmp / "model_index.json").read_text())
            index.update(transformer_2=["diffusers", "WanTransformer3DModel"],
                         boundary_ratio=boundary if boundary is not None else 0.875)
            (tmp / "model_index.json").write_text(json.dumps(index, indent=1))
            low.mkdir()
            (low / "config.json").write_text(json.dumps(tk.arch_to_diffusers_config(arch.transformer), indent=1))
            stem, rename = "diffusion_pytorch_model", tk.native_to_diffusers
        else:
            meta = json.loads((tmp / "runnerkit.json").read_text())
            (tmp / "runnerkit.json").write_text(json.dumps({**meta, "family": "wan2.2_moe"}, indent=1))
            stem, rename = "model", (lambda sd: sd)
        skeleton = build_on_meta(lambda: WanTransformer3D(arch.transformer))
        shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        synthetic.write_sharded(shapes, rename, low, stem, seed + LOW_NOISE_SEED_OFFSET, dtype, keep_fp32, generator_device)
        marker = json.loads((tmp / SYNTHETIC_MARKER).read_text())
        marker["experts"] = {"transformer": seed, "transformer_2": seed + LOW_NOISE_SEED_OFFSET}
        (tmp / SYNTHETIC_MARKER).write_text(json.dumps(marker))
    except BaseException as exc:  # failed or interrupted: no partial folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, SafetensorError, CheckpointError)):  # name the final folder, not tmp
            reason = str(exc).split(": ", 1)[1] if isinstance(exc, CheckpointError) else write_error_reason(exc)
            raise CheckpointError(f"cannot write a synthetic checkpoint to {out}: {reason}") from None
        raise
    return synthetic.finish(tmp, out, seed, f"{layout} (MoE)", replace)


__all__ = ["EXPERTS", "EXPERT_FOLDERS", "WanExpertCheckpoint", "WanMoECheckpoint", "detect_moe_layout",
           "write_synthetic_moe"]
