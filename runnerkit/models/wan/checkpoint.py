"""Wan2.1 checkpoint layouts: detect, read the architecture, load state dicts, write synthetic ones.

Three layouts are understood (ARCHITECTURE §5), all mapped to runnerkit's native key names (the
original Wan2.1 names):

- runnerkit: `runnerkit.json` (format, family, arch) + `transformer/`, `text_encoder/`, `vae/`
  (+ `image_encoder/` for i2v / flf2v) safetensors (native names) + `tokenizer/tokenizer.json`.
- original (Wan-Video/Wan2.1 release): `config.json` (WanModel), `diffusion_pytorch_model*.safetensors`
  (sharded with an index), `models_t5_umt5-xxl-enc-bf16.pth`, `Wan2.1_VAE.pth` (read with
  `torch.load(weights_only=True)`), `google/umt5-xxl/tokenizer.json`; i2v / flf2v add
  `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (the whole CLIP; its vision tower is used).
- diffusers (Wan-AI/Wan2.1-{T2V,I2V,FLF2V}-*-Diffusers): `model_index.json`, `transformer/`,
  `text_encoder/` (transformers UMT5EncoderModel), `vae/` (AutoencoderKLWan), `tokenizer/`; i2v /
  flf2v add `image_encoder/` (transformers CLIPVisionModel(WithProjection)).

The image encoder's architecture comes from `runnerkit.json` or `image_encoder/config.json`; the
original layout has no CLIP config, so it is the released ViT-H/14 unless the config's
`model.image_encoder` says otherwise.

`WanCheckpoint.check_files` checks every weight file against the architecture from safetensors
headers and memory-mapped `.pth` files (no weight is read) before anything loads, in every offload
mode: a damaged file is refused at load, naming the file and the tensor, whatever the mode.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import save_file

from runnerkit import synthetic
from runnerkit.arch import component_files, refuse_disagreements
from runnerkit.config import format_validation_error
from runnerkit.debug_tokenizer import write_debug_tokenizer
from runnerkit.files import give_default_mode, write_error_reason
from runnerkit.models.wan import clip_keys as ck
from runnerkit.models.wan import text_encoder as te
from runnerkit.models.wan import transformer_keys as tk
from runnerkit.models.wan import vae as vae_mod
from runnerkit.models.wan.arch import CLIPVisionArch, UMT5Arch, WanArch, WanTransformerArch, WanVAEArch
from runnerkit.models.wan.clip import CLIPVisionEncoder
from runnerkit.models.wan.clip import keep_fp32 as clip_fp32
from runnerkit.models.wan.scheduler_config import write_scheduler_config
from runnerkit.models.wan.transformer import WanTransformer3D
from runnerkit.models.wan.transformer import keep_fp32 as transformer_fp32
from runnerkit.weights import (
    CheckpointError,
    TensorInfo,
    build_on_meta,
    check_tensors,
    marked_layout,
    read_json_object,
    read_pth,
    read_safetensors,
    safetensors_files,
    safetensors_infos,
    synthetic_tensor,
    tensor_infos,
)

T = TypeVar("T")

Layout = Literal["runnerkit", "original", "diffusers"]
LAYOUTS: tuple[Layout, ...] = ("runnerkit", "original", "diffusers")
ORIGINAL_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
ORIGINAL_VAE = "Wan2.1_VAE.pth"
ORIGINAL_TOKENIZER = "google/umt5-xxl"
ORIGINAL_CLIP = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"


def detect_layout(path: Path) -> Layout:
    """Which layout `path` holds.

    Raises:
        CheckpointError: the folder is missing or matches no layout (lists what each needs).
    """
    own = marked_layout(path)
    if own is not None:
        return own
    if (path / "config.json").is_file() and safetensors_files(path, "diffusion_pytorch_model", "transformer"):
        return "original"
    raise CheckpointError(
        f"`model_path` {str(path)!r} holds no recognised checkpoint: expected runnerkit.json (runnerkit layout), "
        "model_index.json (diffusers layout) or config.json + diffusion_pytorch_model*.safetensors (original Wan layout)")


def _arch_from(path: Path, component: str, convert: Callable[[dict[str, Any]], T]) -> T:
    """`convert` of the JSON object in `path` (a config file), its errors naming the file.

    Raises:
        CheckpointError: `path` is missing, not a JSON object, or holds values `convert` refuses.
    """
    data = read_json_object(path, component)
    try:
        return convert(data)
    except ValidationError as exc:
        raise CheckpointError(format_validation_error(exc, f"{component} architecture in {path}")) from None
    except (ValueError, TypeError) as exc:  # the converters name the key; wrong JSON types raise TypeError
        raise CheckpointError(f"{component}: {path}: {exc}") from None


def merge_override(arch: WanArch, override: dict[str, Any] | None, path: Path, layout: str = "runnerkit",
                   where: str | None = None) -> WanArch:
    """`arch` (read from the checkpoint's files) completed by the config's `model` where the checkpoint says
    nothing: a component it lacks (`image_encoder` of a t2v checkpoint), or, in the original layout, which
    records only the transformer's architecture, the text encoder, VAE and CLIP tower. Where both say a
    value, they must agree: the checkpoint's own config wins and a differing `model` value is an error.

    Raises:
        CheckpointError: `model` names a component Wan does not have; a `model` field differs from the
            checkpoint's config (naming the field, both values and the file).
        ValueError: the merged architecture is invalid (naming `model.<component>.<field>`).
    """
    if not override:
        return arch
    merged = arch.model_dump()
    for component in override:
        if component not in merged:
            raise CheckpointError(f"`model.{component}` is not a Wan component; allowed: {sorted(merged)}")
    stated = ("transformer",) if layout == "original" else tuple(merged)  # what the checkpoint's files say
    named = {"runnerkit": path / "runnerkit.json", "original": path / "config.json"}
    files = where or (str(named[layout]) if layout in named else component_files(path))
    try:
        refuse_disagreements({k: v for k, v in override.items() if k in stated}, arch, files)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    for component, values in override.items():
        merged[component] = {**(merged[component] or {}), **values}
    try:
        return WanArch.model_validate(merged)
    except ValidationError as exc:  # the config's `model` does not fit this checkpoint's architecture
        raise ValueError(format_validation_error(exc, f"config `model` over the architecture of {path}")
                         .replace("\n  ", "\n  model.")) from None


def _read_folder(folder: Path, component: str) -> dict[str, torch.Tensor]:
    files = safetensors_files(folder, component=component)
    if not files:
        raise CheckpointError(f"{component}: no .safetensors files in {folder} (is the checkpoint complete?)")
    return read_safetensors(files, component)


@dataclass(frozen=True)
class WanCheckpoint:
    """A located checkpoint: its layout, folder and the architecture read from it."""

    path: Path
    layout: Layout
    arch: WanArch

    @classmethod
    def open(cls, path: str | Path, override: dict[str, Any] | None = None) -> "WanCheckpoint":
        """Detect the layout and read the architecture; `override` (config `model`) wins per component.

        Raises:
            CheckpointError: no recognised layout; a config file (runnerkit.json, config.json) that
                is missing, not a JSON object or holds values the architecture refuses, naming it.
        """
        path = Path(path)
        layout = detect_layout(path)
        if layout == "runnerkit":
            meta = read_json_object(path / "runnerkit.json", "checkpoint")
            if not isinstance(meta, dict) or meta.get("family") != "wan2.1" or not isinstance(meta.get("arch"), dict):
                raise CheckpointError(f"{path}/runnerkit.json must be an object with \"family\": \"wan2.1\" and an "
                                      f"\"arch\" object (got {str(meta)[:120]})")
            try:
                arch = WanArch.model_validate(meta["arch"])
            except ValidationError as exc:
                raise CheckpointError(format_validation_error(exc, f"architecture in {path}/runnerkit.json")) from None
        elif layout == "original":
            transformer = _arch_from(path / "config.json", "transformer", tk.arch_from_original_config)
            arch = WanArch(transformer=transformer, image_encoder=CLIPVisionArch() if transformer.image_context else None)
        else:
            transformer = _arch_from(path / "transformer/config.json", "transformer", tk.arch_from_diffusers_config)
            arch = WanArch(
                transformer=transformer,
                text_encoder=_arch_from(path / "text_encoder/config.json", "text_encoder", te.arch_from_hf_config),
                vae=_arch_from(path / "vae/config.json", "vae", vae_mod.arch_from_diffusers_config),
                image_encoder=_arch_from(path / "image_encoder/config.json", "image_encoder", ck.arch_from_hf_config)
                if transformer.image_context else None,
            )
        return cls(path=path, layout=layout, arch=merge_override(arch, override, path, layout))

    # ---- transformer -------------------------------------------------------------------
    def transformer_files(self) -> list[Path]:
        folder = {"runnerkit": self.path / "transformer", "original": self.path,
                  "diffusers": self.path / "transformer"}[self.layout]
        stem = "model" if self.layout == "runnerkit" else "diffusion_pytorch_model"
        files = safetensors_files(folder, stem, "transformer")
        if not files:
            raise CheckpointError(f"transformer: no {stem}*.safetensors in {folder}")
        return files

    def transformer_key_map(self, native_names: list[str]) -> dict[str, str]:
        """native name -> name in the files (identity except for diffusers)."""
        if self.layout != "diffusers":
            return {n: n for n in native_names}
        probes = {n: torch.empty(0) for n in native_names}  # distinct objects: match names by identity
        renamed = {id(v): k for k, v in tk.native_to_diffusers(probes).items()}
        return {n: renamed[id(v)] for n, v in probes.items()}

    def transformer_state_dict(self) -> dict[str, torch.Tensor]:
        sd = read_safetensors(self.transformer_files(), "transformer")
        return tk.diffusers_to_native(sd) if self.layout == "diffusers" else sd

    # ---- text encoder ------------------------------------------------------------------
    def text_encoder_state_dict(self) -> dict[str, torch.Tensor]:
        if self.layout == "runnerkit":
            return _read_folder(self.path / "text_encoder", "text_encoder")
        if self.layout == "original":
            return read_pth(self.path / ORIGINAL_T5, "text_encoder")
        return te.hf_to_native(_read_folder(self.path / "text_encoder", "text_encoder"))

    def text_encoder_files(self) -> list[Path]:
        """The text encoder's safetensors files (runnerkit and diffusers layouts: `text_encoder/`).

        Raises:
            NotImplementedError: the original layout, whose UMT5 is one pickled `.pth` (disk streaming
                reads safetensors byte ranges): naming the file and what to do instead.
            CheckpointError: no safetensors in the folder.
        """
        if self.layout == "original":
            raise NotImplementedError(
                f"text_encoder: {self.path / ORIGINAL_T5} is a .pth file, and `offload.storage` 'disk' streams layers "
                "from safetensors files: use `offload.storage` 'cpu' (the layers stream from host memory), or a "
                "diffusers checkpoint (its text_encoder/ holds safetensors), or leave \"text_encoder\" out of "
                "`offload.stream_modules`")
        folder = self.path / "text_encoder"
        files = safetensors_files(folder, component="text_encoder")
        if not files:
            raise CheckpointError(f"text_encoder: no .safetensors files in {folder} (is the checkpoint complete?)")
        return files

    def text_encoder_key_map(self, native_names: list[str]) -> dict[str, str]:
        """native name -> name in `text_encoder_files()` (identity except for diffusers, whose token
        embedding is `shared.weight`, or only its tied alias `encoder.embed_tokens.weight`).

        Raises:
            NotImplementedError, CheckpointError: see `text_encoder_files`.
        """
        files = self.text_encoder_files()
        if self.layout != "diffusers":
            return {n: n for n in native_names}
        probes = {n: torch.empty(0) for n in native_names}  # distinct objects: match names by identity
        renamed = {id(v): k for k, v in te.native_to_hf(probes, embed_tokens_alias=False).items()}
        out = {n: renamed[id(v)] for n, v in probes.items()}
        keys = set(safetensors_infos(files, "text_encoder"))
        for n, key in out.items():
            if key == "shared.weight" and key not in keys and te.HF_EMBED_ALIAS in keys:
                out[n] = te.HF_EMBED_ALIAS
        return out

    def tokenizer_path(self) -> Path:
        return {"runnerkit": self.path / "tokenizer", "original": self.path / ORIGINAL_TOKENIZER,
                "diffusers": self.path / "tokenizer"}[self.layout]

    # ---- vae ---------------------------------------------------------------------------
    def vae_state_dict(self) -> dict[str, torch.Tensor]:
        if self.layout == "runnerkit":
            return _read_folder(self.path / "vae", "vae")
        if self.layout == "original":
            return read_pth(self.path / ORIGINAL_VAE, "vae")
        return vae_mod.diffusers_to_native(_read_folder(self.path / "vae", "vae"))

    # ---- image encoder (i2v / flf2v) ----------------------------------------------------------
    def image_encoder_state_dict(self) -> dict[str, torch.Tensor]:
        """The CLIP vision tower in native names (clip.py), from this layout's files.

        Raises:
            CheckpointError: the architecture has no image encoder, or a file is missing or damaged.
        """
        arch = self._clip_arch()
        if self.layout == "runnerkit":
            return _read_folder(self.path / "image_encoder", "image_encoder")
        if self.layout == "original":
            return ck.original_to_native(read_pth(self.path / ORIGINAL_CLIP, "image_encoder"), arch)
        return ck.hf_to_native(_read_folder(self.path / "image_encoder", "image_encoder"), arch)

    def image_encoder_infos(self) -> dict[str, TensorInfo]:
        """native name -> the CLIP tensor's dtype, shape and file (headers, or the mapped .pth)."""
        arch = self._clip_arch()
        if self.layout == "original":
            path = self.path / ORIGINAL_CLIP
            return _renamed(tensor_infos(read_pth(path, "image_encoder"), path), lambda sd: ck.original_to_native(sd, arch))
        infos = _folder_infos(self.path / "image_encoder", "image_encoder")
        return _renamed(infos, lambda sd: ck.hf_to_native(sd, arch)) if self.layout == "diffusers" else infos

    def _clip_arch(self) -> CLIPVisionArch:
        if self.arch.image_encoder is None:
            raise CheckpointError(f"{self.path}: the transformer (`model_type`={self.arch.transformer.model_type!r}) "
                                  "takes no CLIP image tokens; this checkpoint has no image encoder")
        return self.arch.image_encoder

    # ---- checks before loading ------------------------------------------------------------------
    def check_files(self) -> None:
        """Check every weight file against the architecture before anything loads.

        Safetensors headers are checked (`weights.read_safetensors_header`) and `.pth` files opened
        memory-mapped, so no weight is read; names, shapes and dtypes are compared with meta-built
        networks (`weights.check_tensors`), in pipeline order. Runners call it in every offload mode
        (`unload_modules` included, which loads nothing until a request), so a damaged checkpoint
        is refused at load the same way whatever the mode.

        Raises:
            CheckpointError: naming the component, the file and the tensor.
        """
        infos = {"text_encoder": self.text_encoder_infos, "image_encoder": self.image_encoder_infos,
                 "transformer": self.transformer_infos, "vae": self.vae_infos}
        for component, network in _networks(self.arch).items():
            found = infos[component]()  # a damaged file is refused here, before any network is built
            check_tensors(build_on_meta(network).state_dict(keep_vars=True), found, component)

    def transformer_infos(self) -> dict[str, TensorInfo]:
        """native name -> the transformer tensor's dtype, shape and file, from the headers."""
        infos = safetensors_infos(self.transformer_files(), "transformer")
        return _renamed(infos, tk.diffusers_to_native) if self.layout == "diffusers" else dict(infos)

    def text_encoder_infos(self) -> dict[str, TensorInfo]:
        """native name -> the text encoder tensor's dtype, shape and file (headers, or the mapped .pth)."""
        if self.layout == "original":
            path = self.path / ORIGINAL_T5
            return tensor_infos(read_pth(path, "text_encoder"), path)
        infos = _folder_infos(self.path / "text_encoder", "text_encoder")
        return _renamed(infos, te.hf_to_native) if self.layout == "diffusers" else infos

    def vae_infos(self) -> dict[str, TensorInfo]:
        """native name -> the VAE tensor's dtype, shape and file (headers, or the mapped .pth)."""
        if self.layout == "original":
            path = self.path / ORIGINAL_VAE
            return tensor_infos(read_pth(path, "vae"), path)
        infos = _folder_infos(self.path / "vae", "vae")
        return _renamed(infos, vae_mod.diffusers_to_native) if self.layout == "diffusers" else infos


def _networks(arch: WanArch) -> dict[str, Callable[[], torch.nn.Module]]:
    """component -> factory of its network, in pipeline order (build them with `build_on_meta`);
    the image encoder only where the transformer takes CLIP tokens."""
    networks: dict[str, Callable[[], torch.nn.Module]] = {"text_encoder": lambda: te.UMT5Encoder(arch.text_encoder)}
    clip = arch.image_encoder
    if clip is not None:
        networks["image_encoder"] = lambda: CLIPVisionEncoder(clip)
    networks["transformer"] = lambda: WanTransformer3D(arch.transformer)
    networks["vae"] = lambda: vae_mod.WanVAE(arch.vae)
    return networks


def _folder_infos(folder: Path, component: str) -> dict[str, TensorInfo]:
    files = safetensors_files(folder, component=component)
    if not files:
        raise CheckpointError(f"{component}: no .safetensors files in {folder} (is the checkpoint complete?)")
    return dict(safetensors_infos(files, component))


def _renamed(infos: Mapping[str, TensorInfo], rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
             ) -> dict[str, TensorInfo]:
    """`infos` under the names `rename` (a layout's state-dict converter) gives their tensors; each
    info keeps its name in the file. The converter sees meta tensors of the right dtype and shape."""
    probes = {k: torch.empty(i.shape, dtype=i.dtype, device="meta") for k, i in infos.items()}
    by_probe = {id(v): infos[k] for k, v in probes.items()}  # distinct objects: map names by identity
    files = {i.path for i in infos.values()}
    only_file = files.pop() if len(files) == 1 else None
    # A tensor the converter builds (CLIP's fused q/k/v) has no single source: named by the result.
    return {name: by_probe.get(id(t)) or TensorInfo(name, only_file, t.dtype, tuple(t.shape))
            for name, t in rename(probes).items()}


# ---- writing synthetic checkpoints ----------------------------------------------------------
def _native_shapes(arch: WanArch) -> dict[str, dict[str, tuple[int, ...]]]:
    """name -> shape of every tensor of the three networks, from meta-built skeletons (no memory)."""
    return {component: {k: tuple(v.shape) for k, v in build_on_meta(network).state_dict().items()}
            for component, network in _networks(arch).items()}


SYNTHETIC_MARKER = synthetic.SYNTHETIC_MARKER
synthetic_seed_of = synthetic.synthetic_seed_of


def write_synthetic(arch: WanArch, out: Path, seed: int, dtype: torch.dtype, layout: Layout = "runnerkit",
                    generator_device: str = "cpu", transformer_only: bool = False, replace: bool = False,
                    announce: bool = True) -> Path:
    """Write deterministic random weights for `arch` to `out` in `layout` (atomically: tmp folder, then rename).

    Values depend only on (tensor name, seed): every layout holds the same network. The transformer
    is written shard by shard, so peak host memory is about one shard (SHARD_BYTES), not the model.
    `generator_device` (see `synthetic_tensor`); `transformer_only` (runnerkit layout) skips the
    text encoder, VAE and tokenizer (benchmarks of the transformer alone). `announce`: log the
    written folder (a writer that builds on this one in a temporary folder logs its own). `replace`: delete an
    existing `out` first (the caller has checked it may); otherwise `out` must be missing or empty,
    and a concurrent writer that finished first wins (its identical checkpoint is kept).

    Raises:
        CheckpointError: `out` is not empty (and `replace` is false) and holds no synthetic
            checkpoint of this seed.
    """
    if transformer_only and layout != "runnerkit":
        raise ValueError(f"`transformer_only` needs the runnerkit layout (got {layout!r})")
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS} (got {layout!r})")
    out = Path(out).absolute()
    # a private temporary folder per writer: concurrent first runs never write into each other's
    tmp = synthetic.partial_folder(out)

    def fill() -> None:
        synthetic.write_marker(tmp, seed, layout, dtype)
        weights = _SyntheticWeights(_native_shapes(arch), seed, dtype, generator_device)
        if layout == "runnerkit":
            _write_runnerkit_layout(tmp, arch, weights, transformer_only)
        elif layout == "original":
            _write_original_layout(tmp, arch, weights)
        else:
            _write_diffusers_layout(tmp, arch, weights)

    try:
        fill()
    except BaseException as exc:  # failed or interrupted (Ctrl-C, SIGTERM): no .partial-* folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, SafetensorError)):  # full disk, file-size limit, read-only folder
            raise CheckpointError(f"cannot write a synthetic checkpoint to {out}: {write_error_reason(exc)}; "
                                  "nothing was written") from None
        raise
    return synthetic.finish(tmp, out, seed, layout, replace, announce)



# ---- synthetic checkpoints: one writer per layout, called by `write_synthetic` in its temporary folder ----

def _same_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return sd


def _text_encoder_fp32(name: str) -> bool:
    return te.keep_fp32(name)


def _all_fp32(name: str) -> bool:
    return True  # the VAE is kept (and run) in float32, as the reference does


@dataclass(frozen=True)
class _SyntheticWeights:
    """The random network every layout of `write_synthetic` holds: tensor name -> shape per
    component (`_native_shapes`), values from (name, `seed`) alone (`synthetic_tensor`) in `dtype`,
    except the names a component's `keep_fp32` keeps in float32."""

    shapes: dict[str, dict[str, tuple[int, ...]]]
    seed: int
    dtype: torch.dtype
    generator_device: str

    def write_sharded(self, component: str, rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                      folder: Path, stem: str, fp32: Callable[[str], bool], dtype: torch.dtype | None = None) -> None:
        """`component`'s tensors as safetensors shards `<folder>/<stem>*.safetensors`, with the names
        `rename` gives (`synthetic.write_sharded`); `dtype` overrides the checkpoint's dtype."""
        synthetic.write_sharded(self.shapes[component], rename, folder, stem, self.seed, dtype or self.dtype, fp32,
                                self.generator_device)

    def state_dict(self, component: str, fp32: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """`component`'s tensors in memory, native names (for the `.pth` files of the original layout)."""
        return {k: synthetic_tensor(k, s, self.seed, torch.float32 if fp32(k) else self.dtype, self.generator_device)
                for k, s in self.shapes[component].items()}


def _write_runnerkit_layout(tmp: Path, arch: WanArch, weights: _SyntheticWeights, transformer_only: bool) -> None:
    """runnerkit layout: `runnerkit.json` (the arch) and one safetensors folder per network, native
    names; `transformer_only` stops after the transformer. CLIP only for image tasks that have one."""
    (tmp / "runnerkit.json").write_text(json.dumps(
        {"format": "runnerkit", "version": 1, "family": "wan2.1", "synthetic_seed": weights.seed,
         "arch": arch.model_dump(mode="json")}, indent=1))
    weights.write_sharded("transformer", _same_names, tmp / "transformer", "model", transformer_fp32)
    if transformer_only:
        return
    weights.write_sharded("text_encoder", _same_names, tmp / "text_encoder", "model", _text_encoder_fp32)
    weights.write_sharded("vae", _same_names, tmp / "vae", "model", _all_fp32, dtype=torch.float32)
    write_debug_tokenizer(tmp / "tokenizer", arch.text_encoder.vocab_size)
    if arch.image_encoder is not None:
        weights.write_sharded("image_encoder", _same_names, tmp / "image_encoder", "model", clip_fp32)


def _write_original_layout(tmp: Path, arch: WanArch, weights: _SyntheticWeights) -> None:
    """Wan-Video release layout: `config.json` and sharded transformer safetensors at the top, the
    T5, VAE (and CLIP) as `.pth` files under their release names, the tokenizer in its subfolder."""
    (tmp / "config.json").write_text(json.dumps(tk.arch_to_original_config(arch.transformer), indent=1))
    weights.write_sharded("transformer", _same_names, tmp, "diffusion_pytorch_model", transformer_fp32)
    torch.save(weights.state_dict("text_encoder", _text_encoder_fp32), tmp / ORIGINAL_T5)
    torch.save(weights.state_dict("vae", _all_fp32), tmp / ORIGINAL_VAE)
    write_debug_tokenizer(tmp / ORIGINAL_TOKENIZER, arch.text_encoder.vocab_size)
    if arch.image_encoder is not None:  # the release file holds the whole CLIP; the vision tower is what Wan uses
        torch.save(ck.native_to_original(weights.state_dict("image_encoder", clip_fp32)), tmp / ORIGINAL_CLIP)


def _write_diffusers_layout(tmp: Path, arch: WanArch, weights: _SyntheticWeights) -> None:
    """diffusers layout: `model_index.json` (the image pipeline for i2v / flf2v), a config and
    diffusers / transformers key names per component folder, the scheduler config, and CLIP as a
    transformers `CLIPVisionModel` where the arch has one."""
    clip = arch.image_encoder
    image_task = arch.transformer.model_type != "t2v"
    (tmp / "model_index.json").write_text(json.dumps({
        "_class_name": "WanImageToVideoPipeline" if image_task else "WanPipeline",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        **({"image_encoder": ["transformers", "CLIPVisionModel"] if clip else [None, None],
            "image_processor": ["transformers", "CLIPImageProcessor"] if clip else [None, None]}
           if image_task else {})}, indent=1))
    for sub, cfg in (("transformer", tk.arch_to_diffusers_config(arch.transformer)),
                     ("text_encoder", te.arch_to_hf_config(arch.text_encoder)),
                     ("vae", vae_mod.arch_to_diffusers_config(arch.vae))):
        (tmp / sub).mkdir()
        (tmp / sub / "config.json").write_text(json.dumps(cfg, indent=1))
    weights.write_sharded("transformer", tk.native_to_diffusers, tmp / "transformer", "diffusion_pytorch_model",
                          transformer_fp32)
    weights.write_sharded("text_encoder", lambda sd: te.native_to_hf(sd, embed_tokens_alias=False),
                          tmp / "text_encoder", "model", _text_encoder_fp32)
    weights.write_sharded("vae", vae_mod.native_to_diffusers, tmp / "vae", "diffusion_pytorch_model", _all_fp32,
                          dtype=torch.float32)
    write_debug_tokenizer(tmp / "tokenizer", arch.text_encoder.vocab_size)
    write_scheduler_config(tmp)
    if clip is not None:
        (tmp / "image_encoder").mkdir()
        (tmp / "image_encoder" / "config.json").write_text(json.dumps(
            {"architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model",
             **ck.arch_to_hf_config(clip)}, indent=1))
        clip_sd = ck.native_to_hf(weights.state_dict("image_encoder", clip_fp32))
        save_file({k: v.contiguous() for k, v in clip_sd.items()}, str(tmp / "image_encoder" / "model.safetensors"))
        give_default_mode(tmp / "image_encoder" / "model.safetensors")


__all__ = ["LAYOUTS", "WanCheckpoint", "detect_layout", "write_synthetic", "UMT5Arch", "WanTransformerArch", "WanVAEArch"]
