"""The base of every architecture description (`models/<family>/arch.py` and the shared networks').

An architecture description holds the numbers that define one network (widths, depths, patch
sizes); it is read from a checkpoint or given under the `model` key of a runnerkit JSON config.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo


class Arch(BaseModel):
    """A strict, frozen pydantic model: unknown keys, coercions ("64" for an int, true for a layer
    count) and inf/nan are refused; JSON lists still fill tuple fields declared `strict=False`.

    Validators that relate several fields check them through `_check`, so a partial override
    (validation context {"partial": True}) is checked only once merged with the checkpoint's
    architecture.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def _check(self, info: ValidationInfo, *fields: str) -> bool:
        """Whether to check a rule between `fields`: always for a whole architecture; for a partial
        override (validation context {"partial": True}) only if it gives every one of them (the
        others come from the checkpoint and are checked after merging)."""
        partial = bool(info.context and info.context.get("partial"))
        return not partial or set(fields) <= self.model_fields_set
