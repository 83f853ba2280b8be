"""What to change when a request needs more host memory than allowed: the refusal's advice.

Every setting advised is one the config would accept as a whole: streaming from disk needs `offload.mode`
'block' or 'phase' (`offload.storage`='disk' with mode model is refused), and `unload_modules`=true combines
with no offload mode but 'none' (an explicit 'auto' included). So each change is judged by the config's own
validation (`accepted`) and worded with every key it sets (`settings`), e.g. "`offload.mode`='block' (or
'phase') with `offload.storage`='disk'" for a config in mode model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from runnerkit.config import REVALIDATED, OffloadConfig, RunnerConfig
from runnerkit.planning.fit import GIB, HostEstimate, MemoryEstimate, host_bytes_of, overhead_bytes, streams

__all__ = ["accepted", "disk_streaming", "host_refusal_message", "pinned_options", "settings"]


def settings(changes: dict[str, Any], or_phase: bool = False) -> str:
    """`changes` (dotted config key -> value) in words, e.g. "`offload.mode`='block' with `offload.storage`='disk'
    and `offload.lazy_load`=true" (a bool as JSON: true/false). `or_phase`: "`offload.mode`='block' (or 'phase')"."""
    words = []
    for key, value in changes.items():
        text = f"`{key}`={json.dumps(value) if isinstance(value, bool) else repr(value)}"
        words.append(text + (" (or 'phase')" if or_phase and key == "offload.mode" and value == "block" else ""))
    return " with ".join(words[:2]) + "".join(f" and {w}" for w in words[2:])


def accepted(config: RunnerConfig, changes: dict[str, Any]) -> bool:
    """Whether `config` with `changes` (dotted config key -> value; the keys the config set itself kept) passes
    the config's validation, e.g. false for `offload.storage`='disk' in mode model, or for `offload.mode`='block'
    beside `unload_modules`=true or `lora.mode`='fused'."""
    data = config.model_dump(exclude_unset=True)
    for key, value in changes.items():
        section, dot, field = key.partition(".")
        if dot:
            data[section] = {**data.get(section, {}), field: value}
        else:
            data[key] = value
    try:
        type(config).model_validate(data, context={REVALIDATED: True})
    except ValueError:
        return False
    return True


def disk_streaming(config: RunnerConfig) -> dict[str, Any] | None:
    """The changes that stream `config`'s transformer blocks from disk (dotted key -> value), or None where the
    config already does or the config refuses streaming (e.g. `lora.mode`='fused', `compute_dtype`='fp8'):
    `offload.storage`='disk', plus `offload.mode`='block' outside block/phase, `offload.weight_dtype`='same'
    where fp8 storage is set (disk streams the checkpoint's bytes as they are), `unload_modules`=false where
    it is true."""
    off = config.offload
    if off.mode in ("block", "phase") and off.storage == "disk":
        return None
    changes: dict[str, Any] = {"unload_modules": False} if config.unload_modules else {}
    if off.mode not in ("block", "phase"):
        changes["offload.mode"] = "block"
    changes["offload.storage"] = "disk"
    if off.weight_dtype != "same":
        changes["offload.weight_dtype"] = "same"
    return changes if accepted(config, changes) else None


def _with(config: RunnerConfig, changes: dict[str, Any]) -> tuple[OffloadConfig, RunnerConfig]:
    """`config` with `changes` (dotted keys of `offload` and `unload_modules`): its offload config and the run
    config, for an estimate of the advised setting."""
    offload = OffloadConfig.model_validate({**config.offload.model_dump(exclude_unset=True),
                                            **{k.removeprefix("offload."): v for k, v in changes.items()
                                               if k.startswith("offload.")}})
    return offload, config.model_copy(update={"offload": offload,
                                              "unload_modules": changes.get("unload_modules", config.unload_modules)})


def pinned_options(config: RunnerConfig, limit_gib: float, device: torch.device,
                   estimate_with: Callable[[OffloadConfig], MemoryEstimate]) -> str:
    """What lowers the pinned host memory of `config` on a CUDA device below `limit_gib` (the refusal over
    `memory.pinned_limit_gib`): pageable host memory; streaming from disk where the config accepts it
    (`disk_streaming`) and its estimate's pinned bytes fit the limit, with that estimate; the planner.

    Args:
        estimate_with: the family's estimate of the refused shape under another offload config.
    """
    options = ["`offload.pin_memory`=false (pageable copies, slower)"]
    disk = disk_streaming(config)
    if disk is not None:
        offload, changed = _with(config, disk)
        pinned = host_bytes_of(estimate_with(offload), changed, device).pinned_bytes
        if pinned <= limit_gib * GIB:
            options.append(f"{settings(disk, or_phase=True)} (one staging slab per slot; estimated "
                           f"{pinned / GIB:.3f} GiB pinned)")
    return "; or ".join([*options, "`offload.mode`='auto'"])


def host_refusal_message(what: str, shape: tuple[int, int, int], host: HostEstimate, limit_gib: float,
                         device: torch.device, config: RunnerConfig, estimate: MemoryEstimate,
                         estimate_with: Callable[[OffloadConfig], MemoryEstimate]) -> str:
    """The one-line reason a request needs more host memory than `memory.host_limit_gib`, with what to change.

    Only settings the config accepts are advised, each with every key it sets. On a CUDA device: streaming
    the transformers' blocks from disk (`disk_streaming`) where the estimate says it fits, with that estimate;
    `offload.mode`='auto' (the planner's fastest plan within both limits, if one fits); a larger limit.

    On the CPU the device is the host: weights offloaded to host memory (mode model, storage cpu, and the
    resident plan `offload.mode` 'auto' takes there) stay in the same memory, so only what the estimate says
    is lower is advised: each module built for its own stage (`unload_modules`), blocks streamed from disk
    and built per request, a smaller shape (activations), with their estimates.

    Args:
        estimate: the family's estimate of `shape` under `config.offload`.
        estimate_with: the family's estimate of `shape` under another offload config.
    """
    head = (f"{what}: shape {list(shape)} needs an estimated {host.describe()} of host memory, more than config "
            f"memory.host_limit_gib ({limit_gib} GiB). Try ")
    larger = "a larger memory.host_limit_gib if the machine has it"
    options: list[str] = []  # only what the config accepts and, where estimated, what fits the limit
    limit = limit_gib * GIB
    if device.type != "cpu":
        disk = disk_streaming(config)
        if disk is not None:
            offload, changed = _with(config, disk)
            nbytes = host_bytes_of(estimate_with(offload), changed, device).bytes
            if nbytes <= limit:
                options.append(f"{settings(disk, or_phase=True)} (streamed weights stay on disk; estimated {nbytes / GIB:.3f} GiB)")
        auto = {"unload_modules": False, "offload.mode": "auto"} if config.unload_modules else {"offload.mode": "auto"}
        if accepted(config, auto):
            options.append(f"{settings(auto)} (the fastest plan within both limits, if one fits)")
        return head + "; or ".join([*options, larger])
    if not config.unload_modules and config.offload.mode == "none":
        unload = config.model_copy(update={"unload_modules": True})
        nbytes = host_bytes_of(estimate, unload, device).bytes
        if nbytes <= limit and accepted(config, {"unload_modules": True}):
            options.append(f"`unload_modules`=true (each module built for its own stage: {nbytes / GIB:.3f} GiB)")
    disk = OffloadConfig(mode="block", storage="disk", reader="pread", lazy_load=True)
    changes = {"unload_modules": False} if config.unload_modules else {}
    changes.update({"offload.mode": "block", "offload.storage": "disk", "offload.lazy_load": True})
    streamed = estimate_with(disk)
    if any(streams(n, m, disk) for n, m in streamed.modules.items()) and accepted(config, changes):
        nbytes = host_bytes_of(streamed, config.model_copy(update={"offload": disk, "unload_modules": False}),
                               device).bytes
        if nbytes <= limit:
            options.append(f"{settings(changes)} (blocks read from disk per use: {nbytes / GIB:.3f} GiB)")
    fixed = overhead_bytes(device)
    if fixed < limit:
        options.append("a smaller target_height/target_width/target_video_length (activations)")
    else:  # the process's own fixed part is over the limit: no setting or shape of this run can fit
        head = head.removesuffix("Try ") + (f"No setting or shape fits: the fixed overhead alone is "
                                            f"{fixed / GIB:.2f} GiB. Try ")
    options.append(larger)
    return (head + "; or ".join(options) + ". On the CPU the device is the host: offloading to host memory (mode "
            "'model', storage 'cpu', or `offload.mode`='auto', which keeps every module resident there) lowers nothing")
