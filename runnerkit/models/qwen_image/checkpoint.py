"""Qwen-Image checkpoint layouts: detect, read the architecture, load state dicts, write synthetic ones.

Two layouts (ARCHITECTURE §5):

- diffusers (Qwen/Qwen-Image, Qwen/Qwen-Image-Edit, Qwen/Qwen-Image-Edit-2509/2511, the public
  releases): `model_index.json` (its `_class_name` says text-to-image, Edit or Edit-Plus),
  `transformer/` (QwenImageTransformer2DModel: config.json + diffusion_pytorch_model*.safetensors),
  `text_encoder/` (transformers Qwen2_5_VLForConditionalGeneration), `tokenizer/`, `processor/`
  (the edit releases), `vae/` (AutoencoderKLQwenImage), `scheduler/scheduler_config.json`.
- runnerkit: `runnerkit.json` (format, family, the whole architecture and scheduler settings) +
  `transformer/` (safetensors in the transformer's own names, which are diffusers') + `vae/`
  (safetensors in the Wan VAE's native names) + `text_encoder/`, `tokenizer/`, `processor/` as
  transformers writes them (the text encoder is transformers' model; transformers owns its format).

`QwenCheckpoint.check_files` checks the transformer and VAE weight files against the architecture
from safetensors headers (no weight is read) before anything loads, in every offload mode; the
text encoder folder is checked by transformers when it loads (strictly: `load_text_encoder`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError

from runnerkit import synthetic
from runnerkit.arch import component_files, refuse_disagreements
from runnerkit.config import format_validation_error
from runnerkit.files import write_error_reason
from runnerkit.models.qwen_image import scheduler as sched_mod
from runnerkit.models.qwen_image import text_encoder as te
from runnerkit.models.qwen_image import vae as vae_mod
from runnerkit.models.qwen_image.tokenizer_files import write_tiny_processor, write_tiny_tokenizer
from runnerkit.models.qwen_image.arch import QwenEditArch, QwenImageArch, QwenImageTransformerArch
from runnerkit.models.qwen_image.transformer import QwenImageTransformer2D
from runnerkit.models.qwen_image.transformer import keep_fp32 as transformer_fp32
from runnerkit.nets.causal_vae3d import CausalVAE3D
from runnerkit.weights import (
    CheckpointError,
    TensorInfo,
    build_on_meta,
    check_tensors,
    marked_layout,
    read_json_object,
    read_safetensors,
    safetensors_files,
    safetensors_infos,
)

Layout = Literal["runnerkit", "diffusers"]
LAYOUTS: tuple[Layout, ...] = ("runnerkit", "diffusers")
FAMILY = "qwen_image"

#: diffusers pipeline class of each kind of checkpoint (`model_index.json` `_class_name`).
PIPELINE_CLASSES: dict[str, Literal["t2i", "edit", "edit_plus"]] = {
    "QwenImagePipeline": "t2i", "QwenImageEditPipeline": "edit", "QwenImageEditPlusPipeline": "edit_plus"}

# diffusers QwenImageTransformer2DModel config key -> arch field.
_TRANSFORMER_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                     "num_attention_heads", "joint_attention_dim", "axes_dims_rope", "zero_cond_t")
# Keys accepted only with these values (other variants of the model that this runner does not implement).
_TRANSFORMER_FIXED = {"guidance_embeds": False, "use_additional_t_cond": False, "use_layer3d_rope": False}


def transformer_arch_from_diffusers(config: dict[str, Any]) -> QwenImageTransformerArch:
    """`QwenImageTransformerArch` from a diffusers `transformer/config.json`.

    Raises:
        ValueError: an unknown key, or a variant this transformer does not implement (naming the key).
    """
    unknown = sorted(k for k in config if k not in _TRANSFORMER_KEYS and k not in _TRANSFORMER_FIXED
                     and not k.startswith("_"))
    if unknown:
        raise ValueError(f"unknown QwenImageTransformer2DModel config keys {unknown}; allowed: "
                         f"{sorted([*_TRANSFORMER_KEYS, *_TRANSFORMER_FIXED])}")
    if config.get("_class_name", "QwenImageTransformer2DModel") != "QwenImageTransformer2DModel":
        raise ValueError(f"`_class_name` must be 'QwenImageTransformer2DModel'; got {config['_class_name']!r}")
    for key, allowed in _TRANSFORMER_FIXED.items():
        if config.get(key, allowed) != allowed:
            raise ValueError(f"`{key}` = {config[key]!r} is not supported by runnerkit's Qwen-Image transformer "
                             f"(allowed: {allowed!r})")
    values = {k: config[k] for k in _TRANSFORMER_KEYS if k in config}
    if values.get("out_channels") is None:
        values.pop("out_channels", None)
    return QwenImageTransformerArch(**values)


def transformer_arch_to_diffusers(arch: QwenImageTransformerArch) -> dict[str, Any]:
    """The diffusers `transformer/config.json` of `arch`."""
    return {"_class_name": "QwenImageTransformer2DModel", **arch.model_dump(mode="json"), **_TRANSFORMER_FIXED}


def detect_layout(path: Path) -> Layout:
    """Which layout `path` holds.

    Raises:
        CheckpointError: the folder is missing or matches no layout.
    """
    layout = marked_layout(path)
    if layout is not None:
        return layout
    raise CheckpointError(f"`model_path` {str(path)!r} holds no recognised Qwen-Image checkpoint: expected "
                          "runnerkit.json (runnerkit layout) or model_index.json (diffusers layout)")


def _validated(data: dict[str, Any], path: Path) -> QwenImageArch:
    try:
        return QwenImageArch.model_validate(data)
    except ValidationError as exc:
        raise CheckpointError(format_validation_error(exc, f"architecture of {path}")) from None


def _component(path: Path, sub: str, what: str, convert: Any) -> Any:
    config = read_json_object(path / sub / "config.json", what)
    try:
        return convert(config)
    except (ValueError, ValidationError) as exc:
        raise CheckpointError(f"{path / sub / 'config.json'}: {exc}") from None


def read_arch(path: Path, layout: Layout) -> tuple[QwenImageArch, sched_mod.QwenSchedulerConfig]:
    """The architecture and scheduler settings the checkpoint itself declares (no override).

    Raises:
        CheckpointError: a config file is missing, unreadable or describes something unsupported.
    """
    if layout == "runnerkit":
        meta = read_json_object(path / "runnerkit.json", "runnerkit.json")
        if meta.get("family") != FAMILY:
            raise CheckpointError(f"{path / 'runnerkit.json'} is a checkpoint of family {meta.get('family')!r}, "
                                  f"not {FAMILY!r}")
        try:
            sched = sched_mod.QwenSchedulerConfig.model_validate(meta.get("scheduler", {}))
        except ValidationError as exc:
            raise CheckpointError(format_validation_error(exc, f"`scheduler` of {path / 'runnerkit.json'}")) from None
        return _validated(meta.get("arch", {}), path), sched
    index = read_json_object(path / "model_index.json", "model_index.json")
    kind = PIPELINE_CLASSES.get(index.get("_class_name", ""))
    if kind is None:
        raise CheckpointError(f"{path / 'model_index.json'}: `_class_name` {index.get('_class_name')!r} is not a "
                              f"Qwen-Image pipeline runnerkit serves; allowed: {sorted(PIPELINE_CLASSES)}")
    transformer = _component(path, "transformer", "transformer config", transformer_arch_from_diffusers)
    vae = _component(path, "vae", "VAE config", vae_mod.arch_from_diffusers_config)
    text_encoder = _component(path, "text_encoder", "text encoder config", te.QwenVLArch.from_hf_config)
    try:
        sched = sched_mod.read_scheduler_config(path / "scheduler" / "scheduler_config.json")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    edit = None if kind == "t2i" else QwenEditArch(variant=kind)
    arch = QwenImageArch.model_construct(transformer=transformer, vae=vae, text_encoder=text_encoder, edit=edit)
    return _validated(arch.model_dump(mode="json"), path), sched


def merge_override(arch: QwenImageArch, override: dict[str, Any] | None, path: Path,
                   layout: str = "runnerkit") -> QwenImageArch:
    """`arch` (read from the checkpoint's files) completed by the config's `model` where the checkpoint says
    nothing (a component it lacks), validated as a whole. Where both say a value, they must agree: the
    checkpoint's own config wins and a differing `model` value is an error.

    Raises:
        CheckpointError: a `model` field differs from the checkpoint's config (naming the field, both values and
            the file); the merged architecture breaks a rule (naming the field).
    """
    if not override:
        return arch
    where = str(path / "runnerkit.json") if layout == "runnerkit" else component_files(path)
    compared = override
    if layout != "runnerkit" and isinstance(override.get("edit"), dict):
        # a diffusers folder states the edit variant (model_index.json's pipeline class) but not the image areas
        # (constants of diffusers' pipeline code, not of the folder): `model` may set those
        compared = {**override, "edit": {k: v for k, v in override["edit"].items() if k == "variant"}}
    try:
        refuse_disagreements(compared, arch, where)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    data = arch.model_dump(mode="json")
    for component, fields in override.items():
        if isinstance(fields, dict) and isinstance(data.get(component), dict):
            data[component] = {**data[component], **fields}
        else:
            data[component] = fields
    return _validated(data, path)


@dataclass
class QwenCheckpoint:
    """An opened Qwen-Image checkpoint: where each network's files are, and its architecture."""

    path: Path
    layout: Layout
    arch: QwenImageArch
    scheduler: sched_mod.QwenSchedulerConfig

    @classmethod
    def open(cls, path: str | Path, override: dict[str, Any] | None = None) -> QwenCheckpoint:
        """Detect the layout and read the architecture (the config's `model` over it); no weight is read.

        Raises:
            CheckpointError: no checkpoint there, or unreadable / unsupported config files.
        """
        path = Path(path)
        layout = detect_layout(path)
        arch, sched = read_arch(path, layout)
        return cls(path, layout, merge_override(arch, override, path, layout), sched)

    @property
    def kind(self) -> Literal["t2i", "edit", "edit_plus"]:
        """What the checkpoint was trained for: text-to-image, Edit or Edit-Plus."""
        return "t2i" if self.arch.edit is None else self.arch.edit.variant

    def transformer_files(self) -> list[Path]:
        stem = "model" if self.layout == "runnerkit" else "diffusion_pytorch_model"
        return safetensors_files(self.path / "transformer", stem, "transformer")

    def transformer_state_dict(self) -> dict[str, torch.Tensor]:
        """All transformer tensors, in the model's names (the file names in both layouts)."""
        return read_safetensors(self.transformer_files(), "transformer")

    def vae_files(self) -> list[Path]:
        stem = "model" if self.layout == "runnerkit" else "diffusion_pytorch_model"
        return safetensors_files(self.path / "vae", stem, "vae")

    def vae_state_dict(self) -> dict[str, torch.Tensor]:
        """All VAE tensors in the Wan VAE's native names."""
        sd = read_safetensors(self.vae_files(), "vae")
        return sd if self.layout == "runnerkit" else vae_mod.diffusers_to_native(sd)

    def folder(self, sub: str) -> Path:
        """`text_encoder`, `tokenizer` or `processor` folder.

        Raises:
            CheckpointError: the folder is missing.
        """
        folder = self.path / sub
        if not folder.is_dir():
            raise CheckpointError(f"{self.layout} checkpoint {self.path}: the `{sub}/` folder is missing")
        return folder

    def check_files(self) -> None:
        """Every transformer and VAE tensor present with the architecture's shape (from headers),
        and the text encoder, tokenizer (and, for edit checkpoints, processor) folders present.

        Raises:
            CheckpointError: naming the file and the tensor (missing, unexpected, wrong shape, damaged).
        """
        expected = expected_shapes(self.arch)
        check_tensors(expected["transformer"], safetensors_infos(self.transformer_files(), "transformer"),
                      "transformer")
        vae_infos: dict[str, TensorInfo] = dict(safetensors_infos(self.vae_files(), "vae"))
        if self.layout == "diffusers":
            probes = {k: torch.empty(0) for k in vae_infos}
            renamed = {id(v): k for k, v in vae_mod.diffusers_to_native(probes).items()}
            vae_infos = {renamed[id(probes[k])]: info for k, info in vae_infos.items() if id(probes[k]) in renamed}
        check_tensors(expected["vae"], vae_infos, "vae")
        for sub in ("text_encoder", "tokenizer", *(("processor",) if self.arch.edit is not None else ())):
            self.folder(sub)
        read_json_object(self.path / "text_encoder" / "config.json", "text encoder config")


def expected_shapes(arch: QwenImageArch) -> dict[str, dict[str, torch.Tensor]]:
    """Meta tensors (names and shapes) of the transformer and the VAE of `arch`."""
    return {"transformer": build_on_meta(lambda: QwenImageTransformer2D(arch.transformer)).state_dict(),
            "vae": build_on_meta(lambda: CausalVAE3D(arch.vae)).state_dict()}


# ---- writing synthetic checkpoints ----------------------------------------------------------------
def write_synthetic(arch: QwenImageArch, out: Path, seed: int, dtype: torch.dtype, layout: Layout = "runnerkit",
                    generator_device: str = "cpu", transformer_only: bool = False, replace: bool = False,
                    announce: bool = True) -> Path:
    """Write deterministic random weights for `arch` to `out` in `layout` (atomically).

    Transformer and VAE values depend only on (tensor name, seed) (`weights.synthetic_tensor`);
    the text encoder is a transformers model seeded with `seed` (`text_encoder.write_tiny_text_encoder`)
    with the tiny tokenizer and processor. The VAE is written in float32 (it runs in float32).
    `transformer_only` (runnerkit layout): the transformer alone (benchmarks of the transformer).

    Raises:
        CheckpointError: `out` cannot be written (full disk, read-only) or holds another checkpoint.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS} (got {layout!r})")
    if transformer_only and layout != "runnerkit":
        raise ValueError(f"`transformer_only` needs the runnerkit layout (got {layout!r})")
    out = Path(out).absolute()
    tmp = synthetic.partial_folder(out)
    try:
        synthetic.write_marker(tmp, seed, layout, dtype)
        shapes = {c: {k: tuple(v.shape) for k, v in sd.items()} for c, sd in expected_shapes(arch).items()}
        sched = sched_mod.QwenSchedulerConfig()
        if layout == "runnerkit":
            (tmp / "runnerkit.json").write_text(json.dumps(
                {"format": "runnerkit", "version": 1, "family": FAMILY, "synthetic_seed": seed,
                 "arch": arch.model_dump(mode="json"), "scheduler": sched.model_dump(mode="json")}, indent=1))
            stem, vae_rename = "model", (lambda sd: sd)
        else:
            kind = "t2i" if arch.edit is None else arch.edit.variant
            pipeline = {v: k for k, v in PIPELINE_CLASSES.items()}[kind]
            (tmp / "model_index.json").write_text(json.dumps({
                "_class_name": pipeline, "transformer": ["diffusers", "QwenImageTransformer2DModel"],
                "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
                "tokenizer": ["transformers", "Qwen2Tokenizer"], "vae": ["diffusers", "AutoencoderKLQwenImage"],
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                **({"processor": ["transformers", "Qwen2VLProcessor"]} if kind != "t2i" else {})}, indent=1))
            for sub, cfg in (("transformer", transformer_arch_to_diffusers(arch.transformer)),
                             ("vae", vae_mod.arch_to_diffusers_config(arch.vae))):
                (tmp / sub).mkdir()
                (tmp / sub / "config.json").write_text(json.dumps(cfg, indent=1))
            (tmp / "scheduler").mkdir()
            sched_mod.write_scheduler_config(tmp / "scheduler" / "scheduler_config.json", sched)
            stem, vae_rename = "diffusion_pytorch_model", vae_mod.native_to_diffusers
        synthetic.write_sharded(shapes["transformer"], lambda sd: sd, tmp / "transformer", stem, seed, dtype,
                                transformer_fp32, generator_device)
        if transformer_only:
            return synthetic.finish(tmp, out, seed, layout, replace, announce)
        synthetic.write_sharded(shapes["vae"], vae_rename, tmp / "vae", stem, seed, torch.float32,
                                lambda name: True, generator_device)
        te.write_tiny_text_encoder(tmp / "text_encoder", arch.text_encoder, seed, dtype)
        write_tiny_tokenizer(tmp / "tokenizer")
        write_tiny_processor(tmp / "processor")
    except BaseException as exc:  # failed or interrupted (Ctrl-C, SIGTERM): no .partial-* folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write a synthetic checkpoint to {out}: {write_error_reason(exc)}; "
                                  "nothing was written") from None
        raise
    return synthetic.finish(tmp, out, seed, layout, replace, announce)
