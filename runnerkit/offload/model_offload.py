"""Model-level offload: whole modules visit the GPU for their stage (ARCHITECTURE §4, mode "model").

Each module's parameters and buffers are packed once into one exact-size host slab (pinned
where possible) and re-bound as views into it, one tensor at a time, each original freed before
the next is copied. The slab is page-locked only once filled (`HostSlab(defer_pinning=True)`), so
packing never holds the module twice in host memory: its peak is the slab plus one tensor.
`on_device(name)` copies the slab to the device in one H2D copy, re-binds the tensors as views of
the device copy, and in `finally` re-binds them to the host views and drops the device copy:
weights are read-only, so nothing is copied back. Buffers a module replaces during forward are
not carried back (inference only).

Design source: diffusers `enable_model_cpu_offload` (one module on the GPU per stage) and
LightX2V's CPU offload of encoders and VAE; restated here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from loguru import logger
from torch import nn

from runnerkit.offload.pinned import HostSlab, copy_h2d, plan_offsets, typed_view

_Entry = tuple[nn.Module, str, bool, int, torch.dtype, tuple[int, ...]]  # module, leaf, is_param, offset, dtype, shape


class ModelOffloader:
    """Keeps modules in host memory and moves one to the device for the length of a `with` block.

    Args:
        modules: stage name -> module (e.g. {"text_encoder": t5, "vae": vae}); their tensors
            must be materialized on the CPU (not meta).
        device: the compute device. On the CPU, nothing is packed or copied and `on_device`
            only tracks residency.
        pin_memory: page-locked slabs where possible (see `HostSlab`); a slab whose registration
            fails after packing stays pageable (a WARNING; its copies are synchronous).

    Raises:
        ValueError: a module has tensors on the meta device or on a non-CPU device.
    """

    def __init__(self, modules: dict[str, nn.Module], device: torch.device | str, pin_memory: bool = True) -> None:
        start = time.perf_counter()
        self.device = torch.device(device)
        self.modules = dict(modules)
        self._depth: dict[str, int] = {name: 0 for name in self.modules}
        self._slabs: dict[str, HostSlab] = {}
        self._entries: dict[str, list[_Entry]] = {}
        self._closed = False
        if self.device.type == "cpu":
            return
        for name, module in self.modules.items():
            tensors = [(m, leaf, True, t) for m in module.modules()
                       for leaf, t in m._parameters.items() if t is not None]
            tensors += [(m, leaf, False, t) for m in module.modules()
                        for leaf, t in m._buffers.items() if t is not None]
            bad = [f"{leaf} ({t.device})" for _, leaf, _, t in tensors if t.device.type != "cpu"]
            if bad:
                raise ValueError(f"`modules[{name!r}]`: tensors must be on the CPU before model offload, got {bad[:4]}")
            unique = list({id(t): t for *_, t in tensors}.values())  # a tied tensor is stored once
            uses: dict[int, list[tuple[nn.Module, str, bool]]] = {}
            for m, leaf, is_param, t in tensors:
                uses.setdefault(id(t), []).append((m, leaf, is_param))
            del tensors
            offsets, total = plan_offsets([t.numel() * t.element_size() for t in unique])
            # page-locked only once filled: registering populates every page, so a slab registered first would
            # sit fully resident beside the whole pageable module
            slab = HostSlab(total, pin_memory=pin_memory, label=name, defer_pinning=True)
            entries: list[_Entry] = []
            # One tensor at a time: copied into the (untouched) slab, then every use of it rebound, so the module's
            # original (pageable) tensor is freed before the next is copied. Resident at any moment: the slab pages
            # written so far and the originals not yet copied, i.e. the slab plus the one tensor being copied; the
            # registration after the loop only locks pages that are already resident.
            unique.reverse()
            for offset in offsets:
                t = unique.pop()
                typed_view(slab.buffer, offset, t.dtype, t.shape).copy_(t)
                for m, leaf, is_param in uses.pop(id(t)):
                    self._rebind(m, leaf, is_param, typed_view(slab.buffer, offset, t.dtype, t.shape))
                    entries.append((m, leaf, is_param, offset, t.dtype, tuple(t.shape)))
                del t
            slab.pin()  # registers the filled slab (chunked, all or nothing); stays pageable on failure
            self._slabs[name] = slab
            self._entries[name] = entries
        total_gib = sum(s.nbytes for s in self._slabs.values()) / 2**30
        kinds = sorted({s.kind for s in self._slabs.values()})
        logger.info(f"model offload: {len(self._slabs)} modules, {total_gib:.3f} GiB in host slabs "
                    f"({'/'.join(kinds) or 'none'}), packed in {time.perf_counter() - start:.2f}s")

    @staticmethod
    def _rebind(module: nn.Module, leaf: str, is_param: bool, tensor: torch.Tensor) -> None:
        """Point a parameter (same Parameter object: compile guards keep holding) or buffer at `tensor`."""
        if not is_param:
            module._buffers[leaf] = tensor
            return
        param = module._parameters[leaf]
        try:
            param.data = tensor  # CPU <-> CUDA: compatible tensor types
        except RuntimeError:  # e.g. the meta device: swap the whole tensor, identity kept
            torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))

    def resident(self) -> set[str]:
        """Names of the modules currently on the device (inside an `on_device` block)."""
        return {name for name, depth in self._depth.items() if depth > 0}

    @contextmanager
    def on_device(self, name: str) -> Iterator[nn.Module]:
        """Move module `name` to the device for the `with` block; always move it back (finally).

        Nested blocks for the same name share one device copy.

        Raises:
            KeyError: unknown `name` (the message lists the known names).
            RuntimeError: the offloader was closed.
        """
        if name not in self.modules:
            raise KeyError(f"`name`={name!r} is not an offloaded module; known: {sorted(self.modules)}")
        if self._closed:
            raise RuntimeError(f"model offload was closed; cannot move {name!r} to {self.device}")
        first = self._depth[name] == 0
        self._depth[name] += 1
        try:
            if first and name in self._slabs:
                self._to_device(name)
            yield self.modules[name]
        finally:
            self._depth[name] -= 1
            if self._depth[name] == 0 and name in self._slabs:
                self._to_host(name)

    def _to_device(self, name: str) -> None:
        slab = self._slabs[name]
        device_buffer = torch.empty(slab.nbytes, dtype=torch.uint8, device=self.device)
        # one H2D copy on the current (compute) stream; async only from pinned memory
        copy_h2d(device_buffer, slab.buffer, slab.is_pinned)  # split at registered-chunk boundaries
        for m, leaf, is_param, offset, dtype, shape in self._entries[name]:
            self._rebind(m, leaf, is_param, typed_view(device_buffer, offset, dtype, shape))

    def _to_host(self, name: str) -> None:
        slab = self._slabs[name]
        for m, leaf, is_param, offset, dtype, shape in self._entries[name]:
            self._rebind(m, leaf, is_param, typed_view(slab.buffer, offset, dtype, shape))

    def close(self) -> None:
        """Release the slabs' registrations; module tensors stay valid (pageable) host views.

        Raises:
            RuntimeError: a module is still on the device.
        """
        if self.resident():
            raise RuntimeError(f"model offload closed while modules are on the device: {sorted(self.resident())}")
        for slab in self._slabs.values():
            slab.release()
        self._closed = True
