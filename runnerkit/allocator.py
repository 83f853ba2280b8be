"""The CUDA caching allocator's settings a run plans its memory with (config `memory.expandable_segments`).

PyTorch's caching allocator keeps the device memory it has reserved in segments; by default each large
allocation gets a segment of its own size, and a block freed inside a segment can only be reused by a later
allocation that fits it. A stage whose activations come in many sizes (a VAE decode: each level's feature maps,
padded copies and convolution workspaces) leaves reserved-but-unused gaps, so its peak *reserved* memory is
well above its peak *allocated* memory. The memory plan estimates allocated bytes and may fill the device to
its limit; under a limit that binds, the gaps then make a stage fail or make cuDNN fall back to slower
convolution algorithms whose workspace fits.

With `expandable_segments` the allocator maps physical memory into one growing virtual range per stream, so
freed memory is reused whatever the sizes. Measured on an H100 (bench/results/allocator_h100.md): a video VAE
decode that allocates 9.6 GiB above its weights reserves 13.0 GiB with the default segments and runs out of
memory under a cap 2 GiB above its allocated peak; with expandable segments it runs under a cap at that peak
within 2 % of its uncapped time, and a 24 GiB plan's decode took 3.16 s instead of 5.24 s.

Settings given in the environment (`PYTORCH_CUDA_ALLOC_CONF`, or `PYTORCH_ALLOC_CONF` of newer PyTorch) are the
user's and are kept as they are: the config key then has no effect, and the log says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from loguru import logger

ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Environment variables that configure PyTorch's CUDA caching allocator (newer PyTorch reads both)."""
EXPANDABLE = "expandable_segments:True"


def _setter() -> Callable[[str], None]:
    """PyTorch's setter of allocator settings at run time (the accelerator-generic one where it exists, the CUDA
    one of older releases)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        return setter
    return torch._C._cuda_cudaCachingAllocator_set_allocator_settings


_logged: set[str] = set()  # the lines logged in this process: a run that plans twice says each once


def configure_cuda_allocator(device: torch.device, expandable_segments: bool) -> str | None:
    """Apply `memory.expandable_segments` to this process's CUDA caching allocator; the log line, or None.

    Process-wide (the allocator is one per process) and applied before any weight is loaded, so every segment
    the run reserves is expandable. Nothing is changed when `device` is not CUDA, when `expandable_segments` is
    False (PyTorch's default allocator), or when an allocator variable of `ENV_VARS` is set (the user's
    settings, kept whole). Each distinct line is logged once per process (the launch script plans before its
    fit check and again in `init_modules`).

    Args:
        device: the run's compute device.
        expandable_segments: config `memory.expandable_segments`.
    """
    if device.type != "cuda":
        return None
    given = {name: os.environ[name] for name in ENV_VARS if os.environ.get(name)}
    if given:
        line = ("CUDA allocator: the environment's settings kept (" + ", ".join(f"{k}={v!r}" for k, v in given.items())
                + "); `memory.expandable_segments` not applied")
    elif not expandable_segments:
        line = "CUDA allocator: PyTorch's default segments (`memory.expandable_segments` false)"
    else:
        _setter()(EXPANDABLE)
        line = "CUDA allocator: expandable segments (`memory.expandable_segments`), so freed memory is reused whatever its size"
    if line not in _logged:
        _logged.add(line)
        logger.info(line)
    return line
