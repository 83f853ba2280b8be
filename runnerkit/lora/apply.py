"""Applying LoRA adapters to a transformer's linear layers, per request, and removing them exactly.

Two modes (config `lora.mode`):

- `unfused`: every linear layer of the transformer becomes a `LoRALinear` with three device tensors
  of fixed size, allocated once: `lora_down` [R, in], `lora_up` [out, R], `lora_bias` [out]
  (R = `lora.max_rank`), all zeros when no adapter is set. Its forward is
  `y = x W^T + b + ((x down^T) up^T + lora_bias)`; with zeros the added term is exactly 0, so a
  request without an adapter gives the base model's output bit for bit. A request's adapters are
  written into the first r rows/columns (several adapters concatenated along the rank, strength and
  alpha/r folded into `up`); `clear` zeroes them again. The tensors never change shape or identity,
  so compiled graphs (which hold the LoRA matmuls from warmup on) never recompile on a switch.
  Streamed weights (block/phase, host or disk, lazy) need nothing: the LoRA tensors are not
  streamed, they stay on the device beside the slots.
- `fused`: `W <- W + strength * scale * up @ down` (float32 sum on W's device, one rounding to W's
  dtype) when the request starts; `clear` copies the base weights back (exact restore, never a
  subtraction). The base copy of every adapted weight is taken once (at load for the layers of
  the config's named adapters, else the first time a layer is adapted) and kept on the host for
  the module's life (pinned when the weight is on CUDA, so the restore is one H2D copy per layer
  at copy-engine speed): the base weights never change, so later requests reuse it. No per-step
  cost; a request with adapters costs a GEMM per adapted layer and the restore copy (measured for
  a 14B transformer in bench/results/lora_distill_h200.md), and the host holds one copy of the
  adapted weights. Only for weights that stay put (offload none, model, or unload_modules): a
  streamed unit is re-filled from its source every step.

Design source: PEFT's LoRA layer (scaling alpha / r), LightX2V's per-request LoRA wrapper (kept
weights, restore on removal); restated.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from loguru import logger
from torch import Tensor, nn

from runnerkit.lora.formats import Adapter, LayerDelta, LoRAError, match_adapter, read_adapter
from runnerkit.offload.pinned import HostSlab, copy_h2d

__all__ = ["LoRALinear", "LoRAManager", "linear_targets"]

ADAPTER_CACHE_SIZE = 4
"""Parsed adapter files kept in host memory (by path, device, inode, size and mtime), for switches between requests."""


class LoRALinear(nn.Linear):
    """`nn.Linear` with an unfused low-rank update (see the module docstring); made by `attach_slots`.

    The LoRA tensors are plain attributes, not parameters or buffers: `state_dict`, the offload
    engines and `module.to` leave them alone, and they stay on the compute device.
    """

    lora_down: Tensor
    lora_up: Tensor
    lora_bias: Tensor

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in] -> [..., out] in the dtype of the base layer's output (`F.linear(x, weight)`, or
        the base class's forward where the layer was a linear subclass, e.g. an fp8 `Fp8Linear`)."""
        y = super().forward(x)
        h = F.linear(x.to(self.lora_down.dtype), self.lora_down)  # [..., R]
        return y + F.linear(h, self.lora_up, self.lora_bias).to(y.dtype)  # [..., out]


def linear_targets(module: nn.Module) -> dict[str, nn.Linear]:
    """Every linear layer of `module`, by its name in `module` (the names adapters are matched to)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


def attach_slots(module: nn.Module, rank: int, device: torch.device, dtype: torch.dtype) -> dict[str, LoRALinear]:
    """Turn every linear layer of `module` into a `LoRALinear` with zero slots of rank `rank` on `device`.

    The slot dtype is the layer's weight dtype where it is a float32/bfloat16/float16 weight
    (float32-kept layers stay float32), else `dtype` (e.g. fp8-stored streamed weights).
    """
    out: dict[str, LoRALinear] = {}
    for name, lin in linear_targets(module).items():
        wd = lin.weight.dtype
        sd = wd if wd in (torch.float32, torch.bfloat16, torch.float16) else dtype
        lin.__class__ = _lora_class(type(lin))
        lin.lora_down = torch.zeros(rank, lin.in_features, dtype=sd, device=device)  # type: ignore[attr-defined]
        lin.lora_up = torch.zeros(lin.out_features, rank, dtype=sd, device=device)  # type: ignore[attr-defined]
        lin.lora_bias = torch.zeros(lin.out_features, dtype=sd, device=device)  # type: ignore[attr-defined]
        out[name] = lin  # type: ignore[assignment]
    return out


@functools.cache
def _lora_class(base: type[nn.Linear]) -> type[LoRALinear]:
    """`LoRALinear` for a plain `nn.Linear`; for a linear subclass with its own forward (fp8 compute's
    `Fp8Linear`), a class whose forward adds the LoRA update to that base forward's output."""
    if base is nn.Linear or issubclass(base, LoRALinear):
        return LoRALinear if base is nn.Linear else base
    return type(f"LoRA{base.__name__}", (LoRALinear, base), {"__module__": __name__})


def _host_copy(t: Tensor, label: str) -> tuple[Tensor, HostSlab | None]:
    """A host copy of `t` (the base weight fused LoRA restores) and the slab holding it: a page-locked
    slab of exact size when `t` is on CUDA (runnerkit/offload/pinned.py; the restore is then an
    asynchronous H2D copy), a plain clone otherwise."""
    if not t.is_cuda:
        return t.detach().to("cpu", copy=True), None
    slab = HostSlab(t.numel() * t.element_size(), label=label)
    host = slab.view(0, t.dtype, t.shape)
    host.copy_(t)
    return host, slab


def _combine(items: Sequence[tuple[LayerDelta, float]]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Several adapters' deltas of one layer -> (down [r_total, in], up [out, r_total] with
    strength * scale folded in, bias [out]) in float32; parts absent in every adapter are None."""
    pairs = [(d.down, d.up * (s * d.scale)) for d, s in items if d.down is not None]
    biases = [d.bias * s for d, s in items if d.bias is not None]
    down = torch.cat([p[0] for p in pairs], dim=0) if pairs else None  # [r_total, in]
    up = torch.cat([p[1] for p in pairs], dim=1) if pairs else None  # [out, r_total]
    bias = torch.stack(biases).sum(0) if biases else None  # [out]
    return down, up, bias


class LoRAManager:
    """The runner's adapter state: which adapters the running request uses, written into the
    transformer(s) when the request starts (and into any transformer built during it), removed by
    `clear` (called from `end_run` and after warmup).

    Args:
        mode: "unfused" or "fused".
        max_rank: unfused slot rank R (the summed rank of a request's adapters must fit).
        device, dtype: the compute device and dtype (unfused slots).
        aliases: `(target names) -> {other name: target name}`: the family's other namings of the
            layers (e.g. diffusers names), for matching.
        label: the model in messages, e.g. "<model_cls> transformer".
    """

    def __init__(self, mode: str, max_rank: int, device: torch.device, dtype: torch.dtype,
                 aliases: Callable[[Sequence[str]], Mapping[str, str]], label: str) -> None:
        if mode not in ("unfused", "fused"):
            raise ValueError(f"`lora.mode` must be 'unfused' or 'fused' (got {mode!r})")
        self.mode, self.max_rank, self.device, self.dtype = mode, max_rank, device, dtype
        self._aliases_of = aliases
        self.label = label
        #: linear layer shapes of every adapted module (placement name -> layer -> (out, in)); kept
        #: after a per-request module is torn down, so adapters are checked without it.
        self.targets: dict[str, dict[str, tuple[int, int]]] = {}
        self._aliases: dict[str, Mapping[str, str]] = {}
        self._live: dict[str, weakref.ref[nn.Module]] = {}
        self._layers: dict[str, weakref.WeakValueDictionary[str, nn.Linear]] = {}
        self._cache: OrderedDict[tuple[str, int, int, int, int], Adapter] = OrderedDict()
        self._cache_lock = threading.Lock()  # a server checks a new request's adapters while one runs
        #: the running request's adapters: ((path, strength), ...); empty: none.
        self.active: tuple[tuple[str, float], ...] = ()
        self._deltas: dict[str, dict[str, list[tuple[LayerDelta, float]]]] = {}
        self._written: dict[str, set[str]] = {}  # unfused: module -> layers whose slots hold values
        #: fused: (module, layer) -> the base (W, b) on the host (`_keep_base`), kept while the module lives
        #: (dropped when `attach` registers a rebuilt module of that name)
        self._base: dict[tuple[str, str], tuple[tuple[Tensor, HostSlab | None], tuple[Tensor, HostSlab | None] | None]] = {}
        self._fused: set[tuple[str, str]] = set()  # fused: layers whose weights hold the running request's adapters

    # ---- modules ---------------------------------------------------------------------------
    def attach(self, name: str, module: nn.Module) -> None:
        """Register a freshly built transformer `name` (every build path: resident, offloaded,
        streamed, per request). Unfused: gives its linear layers zero slots. If a request is
        running (a module built per request), its adapters are written at once."""
        layers = attach_slots(module, self.max_rank, self.device, self.dtype) if self.mode == "unfused" \
            else linear_targets(module)
        self.targets[name] = {n: (m.out_features, m.in_features) for n, m in layers.items()}
        self._aliases[name] = self._aliases_of(list(layers))
        self._live[name] = weakref.ref(module)
        self._layers[name] = weakref.WeakValueDictionary(layers)
        self._written.pop(name, None)
        for key in [k for k in self._base if k[0] == name]:  # a rebuilt module: its base copies are the old one's
            del self._base[key]
            self._fused.discard(key)
        if self.active:
            if name not in self._deltas:  # first built during this request (unload_modules): match it now
                self._deltas.update(self.match(self.active, [name]))
            self._apply(name)

    # ---- adapters --------------------------------------------------------------------------
    def read(self, path: str) -> Adapter:
        """The parsed adapter at `path`, cached by path and the file's identity (device, inode, size,
        mtime in ns): a file rewritten in place or replaced by another (a rename keeps the path) between
        two requests is read again. A rewrite of the same size within one tick of the kernel's coarse
        clock keeps the identity (see runnerkit/offload/disk.py)."""
        try:
            st = os.stat(path)
        except OSError:
            return read_adapter(path)  # raises LoRAError naming the file
        key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        adapter = read_adapter(path)
        with self._cache_lock:
            self._cache[key] = adapter
            while len(self._cache) > ADAPTER_CACHE_SIZE:
                self._cache.popitem(last=False)
        return adapter

    def match(self, specs: Sequence[tuple[str, float]],
              modules: Sequence[str] | None = None) -> dict[str, dict[str, list[tuple[LayerDelta, float]]]]:
        """Read and match every adapter of a request against the adapted modules `modules` (default:
        every one whose layers are known: built once; under `unload_modules` a transformer is first
        built during the first request, and matched then, in `attach`).

        Returns:
            module name -> layer -> [(delta, strength), ...] in the request's order.

        Raises:
            LoRAError: naming the file (see `read_adapter`, `match_adapter`); unfused: the summed rank
                of the request's adapters on one layer exceeds `lora.max_rank`; fused: a bias delta
                on a layer without a bias.
        """
        names = list(self.targets) if modules is None else list(modules)
        out: dict[str, dict[str, list[tuple[LayerDelta, float]]]] = {n: {} for n in names}
        for path, strength in specs:
            adapter = self.read(path)
            for name in names:
                for layer, delta in match_adapter(adapter, self.targets[name], self._aliases[name], self.label).items():
                    out[name].setdefault(layer, []).append((delta, strength))
        for name, layers in out.items():
            for layer, items in layers.items():
                rank = sum(d.rank for d, _ in items)
                if self.mode == "unfused" and rank > self.max_rank:
                    raise LoRAError(f"LoRA adapters {[p for p, _ in specs]}: summed rank {rank} on {layer} exceeds "
                                    f"`lora.max_rank` {self.max_rank}; raise it in the config")
                lin = self._layers[name].get(layer)
                if self.mode == "fused" and lin is not None and lin.bias is None and any(
                        d.bias is not None for d, _ in items):
                    raise LoRAError(f"LoRA adapter {[p for p, _ in specs]}: a bias delta on {layer}, which has no bias: "
                                    "`lora.mode` fused cannot add one (unfused can)")
        return out

    def set_request(self, specs: Sequence[tuple[str, float]]) -> None:
        """Apply a request's adapters ((path, strength), ...) to every live adapted module.

        Raises:
            LoRAError: see `match`; nothing is applied then.
            RuntimeError: the previous request's adapters were not cleared (a lifecycle bug).
        """
        if self.active or self._written or self._fused:
            raise RuntimeError("LoRA state of the previous request was not cleared (end_run must call clear)")
        if not specs:
            return
        t0 = time.perf_counter()
        self._deltas = self.match(specs)
        self.active = tuple(specs)
        for name in list(self._live):
            self._apply(name)
        live = sorted(name for name, ref in self._live.items() if ref() is not None)
        logger.info("LoRA ({}): {} {} in {:.3f} s", self.mode, [f"{os.path.basename(p)}:{s:g}" for p, s in specs],
                    f"applied to {live}" if live else "set for the request (written into the transformer when the "
                    "request builds it)", time.perf_counter() - t0)

    @torch.no_grad()
    def prepare(self, specs: Sequence[tuple[str, float]]) -> None:
        """At load, for the config's named adapters: read and match them against the live modules (as
        `check`), and in fused mode take the base copies of every layer they cover now, so that the
        first request with them does not pay the one-time copy (measured for a 14B transformer: request
        1 took 2x request 3 without this). Modules not built yet (`unload_modules`) are matched when built.

        Raises:
            LoRAError: see `match`.
        """
        if not specs:
            return
        matched = self.match(specs)
        if self.mode != "fused":
            return
        for name, layers in matched.items():
            for layer in layers:
                lin = self._layers.get(name, {}).get(layer)
                if lin is not None:
                    self._keep_base(name, layer, lin)

    def _keep_base(self, name: str, layer: str, lin: nn.Linear) -> None:
        """Fused: the host copy of `layer`'s base weight and bias, taken once (`_host_copy`)."""
        if (name, layer) not in self._base:
            self._base[(name, layer)] = (_host_copy(lin.weight, f"lora base {layer}"), None if lin.bias is None
                                         else _host_copy(lin.bias, f"lora base {layer}.bias"))

    @torch.no_grad()
    def _apply(self, name: str) -> None:
        module = self._live[name]()
        if module is None:
            return
        layers = self._layers[name]
        for layer, items in self._deltas.get(name, {}).items():
            lin = layers[layer]
            down, up, bias = _combine(items)
            if self.mode == "unfused":
                assert isinstance(lin, LoRALinear), f"{layer} has no LoRA slots"
                if down is not None and up is not None:
                    r = down.shape[0]
                    lin.lora_down[:r].copy_(down)
                    lin.lora_up[:, :r].copy_(up)
                if bias is not None:
                    lin.lora_bias.copy_(bias)
                self._written.setdefault(name, set()).add(layer)
                continue
            w = lin.weight
            self._keep_base(name, layer, lin)
            self._fused.add((name, layer))
            if down is not None and up is not None:
                delta = up.to(w.device, torch.float32) @ down.to(w.device, torch.float32)
                w.copy_((w.float() + delta).to(w.dtype))
            if bias is not None:
                assert lin.bias is not None, "checked in match"
                lin.bias.copy_((lin.bias.float() + bias.to(lin.bias.device)).to(lin.bias.dtype))

    @torch.no_grad()
    def clear(self) -> None:
        """Remove the running request's adapters from every module: unfused slots zeroed, fused
        weights copied back from the kept copies. A no-op without adapters. Idempotent."""
        for name, written in self._written.items():
            layers = self._layers.get(name, {})
            for layer in written:
                lin = layers.get(layer)
                if lin is None:  # torn down with its module (per-request build)
                    continue
                lin.lora_down.zero_()  # type: ignore[operator]
                lin.lora_up.zero_()  # type: ignore[operator]
                lin.lora_bias.zero_()  # type: ignore[operator]
        cuda = False
        for name, layer in self._fused:
            lin = self._layers.get(name, {}).get(layer)
            if lin is None:
                continue
            (w, _), b = self._base[(name, layer)]
            copy_h2d(lin.weight, w, non_blocking=w.is_pinned())  # pinned: asynchronous, waited for below
            if b is not None:
                copy_h2d(lin.bias, b[0], non_blocking=b[0].is_pinned())
            cuda = cuda or lin.weight.is_cuda
        if cuda:
            torch.cuda.synchronize()
        self._written.clear()
        self._fused.clear()
        self._deltas = {}
        self.active = ()

    def check(self, specs: Sequence[tuple[str, float]]) -> None:
        """Raise `LoRAError` (naming the file) if a request's adapters cannot be applied; applies nothing."""
        if specs:
            self.match(specs)

    def describe(self) -> dict[str, object]:
        """What `GET /v1/models` and the profile say about LoRA: mode, max rank, adapted modules."""
        return {"mode": self.mode, "max_rank": self.max_rank if self.mode == "unfused" else None,
                "modules": sorted(self.targets)}


__all__ += ["attach_slots", "LoRAError"]
