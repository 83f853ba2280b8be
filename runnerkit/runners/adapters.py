"""LoRA adapters of `DefaultRunner` (config `lora`; runnerkit/lora, docs/lora.md): the manager made at
load, the check of a launch's adapters before serving, and the rank of the unfused slots for a
family's memory estimate.

The family's part stays a hook on the runner (runners/default.py): `lora_aliases` (other names of
its linear layers) and `lora_layers` (the layers a typical adapter covers, for the synthetic
adapter writer). A request's adapters are request state: set in `serve_request`, removed in
`reset_request_state` (`LoRAManager.set_request`, `LoRAManager.clear`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from runnerkit.config import RequestConfig
from runnerkit.lora import LoRAManager
from runnerkit.runners.pipeline import InputInfo

if TYPE_CHECKING:
    from runnerkit.runners.default import DefaultRunner

__all__ = ["check_adapters", "manager_for", "set_request", "slot_rank"]


def manager_for(runner: DefaultRunner) -> LoRAManager | None:
    """The run's adapter manager (config `lora`: its mode and slot rank, matched to the transformer's
    layers through the family's `lora_aliases`), made in `load_modules` before any module is built;
    None without `lora`."""
    cfg = runner.config
    if cfg.lora is None:
        return None
    return LoRAManager(cfg.lora.mode, cfg.lora.max_rank, runner.device, runner.dtype, runner.lora_aliases,
                       f"{cfg.model_cls} transformer")


def set_request(runner: DefaultRunner, info: InputInfo) -> None:
    """Apply the request's adapters (`info.lora`, resolved by `lora_specs`) for this request only; a no-op
    without. Request state: `reset_request_state` removes them (`LoRAManager.clear`)."""
    if info.lora:
        assert runner.lora is not None, "lora_specs refuses adapters without the config's `lora`"
        runner.lora.set_request(info.lora)


def slot_rank(runner: DefaultRunner) -> int:
    """The rank R of the unfused LoRA slots every transformer carries on the device (config `lora` in mode
    unfused: `lora.max_rank`); 0 without them. For a family's memory estimate."""
    lora = runner.config.lora
    return lora.max_rank if lora is not None and lora.mode == "unfused" else 0


def check_adapters(runner: DefaultRunner, requests: Sequence[RequestConfig]) -> None:
    """After `init_modules`, before serving: every request's adapters read and matched to the
    transformer's layers (nothing applied).

    Raises:
        ValueError: a request's `lora` the config cannot serve (`lora_specs`: no `lora` section, an unknown
            name or path).
        runnerkit.lora.LoRAError: naming the file (unknown format, keys matching no layer, an adapter for
            another model, shapes or ranks that do not fit).
    """
    for request in requests:
        specs = runner.lora_specs(request, runner.config)
        if specs:
            assert runner.lora is not None, "lora_specs refuses adapters without the config's `lora`"
            runner.lora.check(specs)
