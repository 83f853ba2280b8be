"""Reading LoRA adapter files and matching their keys to a transformer's linear layers.

Formats recognised (one safetensors file; the format is read from each key's suffix):

- diffusers / PEFT: `<module>.lora_A.weight` [r, in], `<module>.lora_B.weight` [out, r],
  optional `<module>.alpha` and `<module>.lora_B.bias` [out]; PEFT's adapter-named variant
  `lora_A.default.weight` too.
- kohya / original: `<module>.lora_down.weight` [r, in], `<module>.lora_up.weight` [out, r] and
  `<module>.alpha` (a scalar); kohya flattens the module path with underscores
  (`lora_unet_blocks_0_self_attn_q`).
- LightX2V's distill adapters: the original layout under `diffusion_model.`, with `.diff_b` (a bias
  delta [out]) on linears and `.diff` (a full-tensor delta) on norms, which these releases ship as
  zeros.

The update of a linear is `delta_W = strength * (alpha / r) * up @ down` (scale 1 without alpha;
PEFT's `lora_alpha / r` is the same rule), and `delta_b = strength * diff_b`.

Key prefixes `diffusion_model.`, `model.diffusion_model.`, `transformer.`, `base_model.model.`,
`lora_unet_`, `lora_transformer_` are removed. Module names are then matched to the target
model's linear layers: exact name, then the family's aliases (another naming of the same layer, e.g.
diffusers' names for a model that uses the original release's), then the underscore-flattened form
of either. A key that matches no layer is an error listing the keys; so is an adapter none of
whose keys match (an adapter for another model).

Design source: the layouts handled by diffusers' `lora_conversion_utils` (the video and image families, kohya)
and LightX2V's LoRA loader (diff / diff_b); restated, not copied.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from runnerkit.weights import short_list

__all__ = ["LoRAError", "LayerDelta", "Adapter", "read_adapter", "match_adapter", "PREFIXES"]

PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "lora_unet_",
            "lora_transformer_")
"""Key prefixes removed before matching (longest first where one contains another)."""

# suffix -> role; checked longest first
_SUFFIXES: dict[str, str] = {
    ".lora_A.default.weight": "down", ".lora_B.default.weight": "up",
    ".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_B.bias": "bias",
    ".lora_down.weight": "down", ".lora_up.weight": "up",
    ".alpha": "alpha", ".diff_b": "bias", ".diff": "diff",
}
_ORDERED = sorted(_SUFFIXES, key=len, reverse=True)


class LoRAError(ValueError):
    """An adapter file cannot be applied: unreadable or unknown format, keys matching no layer,
    inconsistent ranks or shapes. The message names the file."""


@dataclass(frozen=True)
class LayerDelta:
    """One linear layer's update, before strength: `delta_W = scale * up @ down`, `delta_b = bias`.

    Attributes:
        down: [r, in] float32.
        up: [out, r] float32.
        scale: alpha / r (1.0 without alpha).
        bias: [out] float32 bias delta (`diff_b` / `lora_B.bias`), or None.
    """

    down: Tensor | None
    up: Tensor | None
    scale: float
    bias: Tensor | None

    @property
    def rank(self) -> int:
        return 0 if self.down is None else self.down.shape[0]


@dataclass(frozen=True)
class Adapter:
    """A parsed adapter file: module name (as in the file, prefix removed) -> its delta.

    Attributes:
        path: the file.
        layers: module name -> `LayerDelta`.
        zero_diffs: full-tensor `.diff` keys that were all zeros (dropped; LightX2V ships norms so).
    """

    path: str
    layers: dict[str, LayerDelta]
    zero_diffs: tuple[str, ...] = ()


def _split(key: str) -> tuple[str, str] | None:
    for suffix in _ORDERED:
        if key.endswith(suffix):
            return key[: -len(suffix)], _SUFFIXES[suffix]
    return None


def _strip(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def read_adapter(path: str | os.PathLike[str], header_only: bool = False) -> Adapter:
    """Read and check one adapter file (format, pairs, ranks); no model needed.

    `header_only`: read only the safetensors header (names, shapes: the checks before loading);
    the tensors are then meta tensors and `.diff` / bias-only keys are not checked for zeros.

    Raises:
        LoRAError: naming the file: missing, not safetensors, unknown key format, a down matrix
            without its up matrix (or the reverse), ranks of down and up that differ, an alpha
            that is not a scalar, a non-zero full-tensor `.diff` (not supported).
    """
    path = str(path)
    parts = _group_by_module(path, _read_tensors(path, header_only))
    layers: dict[str, LayerDelta] = {}
    zero_diffs: list[str] = []
    problems: list[str] = []
    for module, roles in sorted(parts.items()):
        delta = _module_delta(module, roles, header_only, zero_diffs)
        if isinstance(delta, str):
            problems.append(delta)
        elif delta is not None:
            layers[module] = delta
    if problems:
        raise LoRAError(f"LoRA adapter {path!r}: {len(problems)} problem(s): " + "; ".join(problems[:6])
                        + (f"; ... (+{len(problems) - 6} more)" if len(problems) > 6 else ""))
    return Adapter(path, layers, tuple(dict.fromkeys(zero_diffs)))


def _read_tensors(path: str, header_only: bool) -> dict[str, Tensor]:
    """Step 1 of `read_adapter`: whether `path` is a readable, non-empty .safetensors file; its
    tensors by key (meta tensors of the header's shapes when `header_only`).

    Raises:
        LoRAError: the path is missing or a directory, its suffix is not .safetensors, the file is
            unreadable, or it holds no tensors.
    """
    if not os.path.isfile(path):
        what = "a directory, not a .safetensors file" if os.path.isdir(path) else "no such file"
        raise LoRAError(f"LoRA adapter {path!r}: {what}")
    if Path(path).suffix.lower() != ".safetensors":
        raise LoRAError(f"LoRA adapter {path!r}: unknown format (suffix {Path(path).suffix!r}); adapters are "
                        ".safetensors files (diffusers/PEFT lora_A/lora_B, kohya lora_down/lora_up, LightX2V)")
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: (torch.empty(f.get_slice(k).get_shape(), device="meta") if header_only else f.get_tensor(k))
                       for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise LoRAError(f"LoRA adapter {path!r}: unreadable safetensors file ({type(exc).__name__}: {exc})") from None
    if not tensors:
        raise LoRAError(f"LoRA adapter {path!r}: holds no tensors")
    return tensors


def _group_by_module(path: str, tensors: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """Step 2 of `read_adapter`: which module and role (down, up, alpha, bias, diff) each key is,
    from its suffix; module names with their prefix removed (`PREFIXES`).

    Raises:
        LoRAError: listing the keys with no LoRA suffix (an unknown format).
    """
    parts: dict[str, dict[str, Tensor]] = {}
    unknown = []
    for key, value in tensors.items():
        split = _split(key)
        if split is None:
            unknown.append(key)
            continue
        module, role = split
        parts.setdefault(_strip(module), {})[role] = value
    if unknown:
        raise LoRAError(f"LoRA adapter {path!r}: unknown format: {len(unknown)} keys are not LoRA keys "
                        f"(lora_A/lora_B, lora_down/lora_up, alpha, diff, diff_b): {short_list(sorted(unknown), 6)}")
    return parts


def _module_delta(module: str, roles: dict[str, Tensor], header_only: bool,
                  zero_diffs: list[str]) -> LayerDelta | str | None:
    """Step 3 of `read_adapter`, per module: whether its keys form an update that can be applied.

    A zero full-tensor `.diff` is dropped (the module is appended to `zero_diffs`), and so is a zero
    bias delta that comes alone (LightX2V's norms). Otherwise the down and up matrices must come as a
    pair of ranks that agree, the alpha be a scalar (scale = alpha / r, 1.0 without it), the bias
    delta be [out] matching up's rows, and no tensor hold NaN or infinite values (not checked with
    `header_only`, nor are zeros). `roles` loses its "diff" entry.

    Returns:
        The module's `LayerDelta` (float32 tensors); a problem in words, naming the module; or None
        when the module has nothing to apply.
    """
    if "diff" in roles:
        if not header_only and torch.count_nonzero(roles.pop("diff")) != 0:
            return (f"{module}.diff is a non-zero full-tensor delta (not supported: only low-rank "
                    "lora pairs and bias deltas are)")
        roles.pop("diff", None)
        zero_diffs.append(module)
        if not roles:
            return None
    down, up = roles.get("down"), roles.get("up")
    if down is None and up is None and "bias" in roles and (header_only or torch.count_nonzero(roles["bias"]) == 0):
        zero_diffs.append(module)  # a zero bias delta alone (LightX2V's norms): nothing to apply
        return None
    if (down is None) != (up is None):
        return f"{module} has {'lora_down/lora_A' if down is not None else 'lora_up/lora_B'} without its pair"
    if down is None and "alpha" in roles and "bias" not in roles:
        return f"{module} has an alpha but no lora pair"
    scale = 1.0
    if down is not None:
        assert up is not None
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
            return (f"{module}: rank mismatch: down {tuple(down.shape)} and up {tuple(up.shape)} "
                    "(need down [r, in] and up [out, r])")
        if "alpha" in roles:
            alpha = roles["alpha"]
            if alpha.numel() != 1:
                return f"{module}.alpha must be a scalar, got shape {tuple(alpha.shape)}"
            scale = 1.0 if header_only else float(alpha.float().item()) / down.shape[0]
    bias = roles.get("bias")
    if bias is not None and bias.ndim != 1:
        return f"{module}: bias delta must be [out], got shape {tuple(bias.shape)}"
    if bias is not None and up is not None and bias.shape[0] != up.shape[0]:
        return f"{module}: bias delta [{bias.shape[0]}] does not fit up {tuple(up.shape)}"
    if not header_only and any(t is not None and not bool(torch.isfinite(t).all())
                               for t in (down, up, bias, roles.get("alpha"))):
        return (f"{module}: holds NaN or infinite values (a damaged adapter: it would turn the "
                "whole output into NaN)")
    return LayerDelta(None if down is None else down.float(), None if up is None else up.float(),
                      scale, None if bias is None else bias.float())


def _flat(name: str) -> str:
    return name.replace(".", "_")


def match_adapter(adapter: Adapter, targets: Mapping[str, tuple[int, int]], aliases: Mapping[str, str],
                  model: str) -> dict[str, LayerDelta]:
    """The adapter's layers keyed by the target model's linear names, shapes checked.

    Args:
        adapter: from `read_adapter`.
        targets: the model's linear layers: name -> (out_features, in_features).
        aliases: other names of the same layers (e.g. diffusers names) -> target name (family map).
        model: what to call the model in messages (e.g. "<model_cls> transformer").

    Raises:
        LoRAError: naming the file: keys matching no layer (all listed, up to a dozen; none
            matching at all says it is an adapter for another model), or shapes that do not fit
            the layer (in/out features).
    """
    lookup: dict[str, str] = {**{a: t for a, t in aliases.items() if t in targets}, **{t: t for t in targets}}
    flat: dict[str, str | None] = {}
    for name, target in lookup.items():
        key = _flat(name)
        flat[key] = target if flat.get(key, target) == target else None  # ambiguous flattening: no match
    matched: dict[str, LayerDelta] = {}
    unmatched, bad = [], []
    for name, delta in adapter.layers.items():
        target = lookup.get(name) or flat.get(_flat(name))
        if target is None:
            unmatched.append(name)
            continue
        out_f, in_f = targets[target]
        if delta.down is not None and (delta.down.shape[1] != in_f or delta.up.shape[0] != out_f):  # type: ignore[union-attr]
            bad.append(f"{name}: down {tuple(delta.down.shape)} / up {tuple(delta.up.shape)} do not fit "  # type: ignore[union-attr]
                       f"{target} [out {out_f}, in {in_f}]")
            continue
        if delta.bias is not None and delta.bias.shape[0] != out_f:
            bad.append(f"{name}: bias delta [{delta.bias.shape[0]}] does not fit {target} [out {out_f}]")
            continue
        if target in matched:
            bad.append(f"{name}: a second entry for {target}")
            continue
        matched[target] = delta
    if unmatched and not matched:
        misfit = (f"; {len(bad)} match by name but not by shape (another size of this model?): "
                  + "; ".join(bad[:3])) if bad else ""
        raise LoRAError(f"LoRA adapter {adapter.path!r}: none of its {len(adapter.layers)} layers match a linear layer "
                        f"of the {model} (an adapter for another model?): {short_list(sorted(unmatched), 8)}{misfit}")
    if unmatched:
        raise LoRAError(f"LoRA adapter {adapter.path!r}: {len(unmatched)} of its layers match no linear layer of the "
                        f"{model}: {short_list(sorted(unmatched), 12)}")
    if bad:
        raise LoRAError(f"LoRA adapter {adapter.path!r}: {len(bad)} layer(s) do not fit the {model}: "
                        + "; ".join(bad[:6]) + (f"; ... (+{len(bad) - 6} more)" if len(bad) > 6 else ""))
    return matched
