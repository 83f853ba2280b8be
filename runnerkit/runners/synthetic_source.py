"""Where a runner's checkpoint comes from: `model_path`, or a synthetic one written on first use.

`SyntheticCheckpointSource` is mixed into a family runner that can write synthetic checkpoints: it
declares the family's hook `write_synthetic_checkpoint` and its `CHECKPOINT_LAYOUTS` (what
runnerkit.tools.synth_checkpoint writes). The runner provides `arch_override` (its architecture, a
pydantic model: the cache folder is keyed by it) and `open_checkpoint(path)`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from loguru import logger

from runnerkit.synthetic import synthetic_seed_of
from runnerkit.weights import CheckpointError

if TYPE_CHECKING:
    import torch

    from runnerkit.config import RunnerConfig


def synthetic_cache_dir() -> Path:
    """Where synthetic checkpoints go when `model_path` is not set (env RUNNERKIT_CACHE overrides)."""
    root = os.environ.get("RUNNERKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "runnerkit")
    return Path(root) / "synthetic"


def check_synthetic_cache() -> None:
    """Refuse a cache root that cannot hold the synthetic-checkpoint folders (cheap: nothing is written).

    The nearest existing folder on the way to `synthetic_cache_dir()` must be a folder this process
    may write (a file there failed only at write time, naming a `.partial-...` temporary folder).

    Raises:
        CheckpointError: naming `RUNNERKIT_CACHE` and its value (or the default folder), and what it must be.
    """
    env = os.environ.get("RUNNERKIT_CACHE")
    existing = synthetic_cache_dir()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    problem = f"{str(existing)!r} is a file" if not existing.is_dir() else f"{str(existing)!r} is not writable"
    where = (f"`RUNNERKIT_CACHE` {env!r}" if env else
             f"the synthetic-checkpoint cache {str(synthetic_cache_dir().parent)!r} (set `RUNNERKIT_CACHE` to move it)")
    raise CheckpointError(f"{where} must be a writable folder (synthetic checkpoints are written under it): {problem}")


class SyntheticCheckpointSource:
    """Locate (and, for `synthetic_checkpoint`, write once) the runner's checkpoint."""

    config: Any
    dtype: Any
    arch_override: Any
    plan_only: bool  # BaseRunner: built by `for_plan`
    #: The layout a synthetic checkpoint is written in when the runner writes one itself.
    SYNTHETIC_LAYOUT: str = "runnerkit"
    #: Checkpoint layouts `write_synthetic_checkpoint` can write (empty: the family writes none).
    CHECKPOINT_LAYOUTS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def write_synthetic_checkpoint(cls, config: RunnerConfig, out: Path, seed: int, dtype: torch.dtype,
                                   layout: str, **options: Any) -> None:
        """Family hook: write deterministic random weights of `config`'s architecture to `out`, in `layout`
        (one of `CHECKPOINT_LAYOUTS`; runnerkit.tools.synth_checkpoint, `synthetic_checkpoint`)."""
        raise NotImplementedError(f"{cls.__name__} cannot write synthetic checkpoints")

    @classmethod
    def lora_layers(cls, config: RunnerConfig, layout: str) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
        """Family hook for the synthetic adapter writer (runnerkit/lora/synthetic.py): the linear layers a
        typical adapter of `config`'s architecture covers, name -> (out, in), and their names in `layout`."""
        raise NotImplementedError(f"{cls.__name__} cannot describe its LoRA layers for a synthetic adapter")

    def open_checkpoint(self, path: Path, raw: bool = False) -> Any:
        """The family's checkpoint at `path` (`raw`: without the config's `model` over it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement open_checkpoint(path, raw) to read its "
                                  "checkpoint layouts (SyntheticCheckpointSource only locates and writes them)")

    def checkpoint_path(self) -> Path:
        """`model_path`, or the cache folder of this architecture's synthetic checkpoint."""
        cfg = self.config
        if cfg.model_path:
            return Path(cfg.model_path)
        assert cfg.synthetic_checkpoint is not None, "config validation requires model_path or synthetic_checkpoint"
        digest = hashlib.sha1(json.dumps(self.arch_override.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        return synthetic_cache_dir() / f"{cfg.model_cls}-{digest[:12]}-seed{cfg.synthetic_checkpoint.seed}-{cfg.dtype}"

    def _synthetic_pending(self, path: Path) -> bool:
        """True if a synthetic checkpoint is configured and not written yet at `path`."""
        if self.config.synthetic_checkpoint is None:
            return False
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"`model_path` {str(path)!r} is a file; a synthetic checkpoint needs a folder")
        pending = not path.exists() or not any(path.iterdir())
        if pending and not self.config.model_path:
            check_synthetic_cache()
        return pending

    def checkpoint_absent(self) -> bool:
        """True for a runner built to plan only (`BaseRunner.for_plan`) whose `model_path` does not exist (and
        is not a synthetic checkpoint's, to write): its architecture before loading is then the one the config
        gives or implies (`arch_from_config`). A run's load refuses the missing checkpoint as always."""
        cfg = self.config
        return (self.plan_only and cfg.synthetic_checkpoint is None and cfg.model_path is not None
                and not Path(cfg.model_path).exists())

    def arch_from_config(self, path: Path) -> bool:
        """Whether the architecture before loading is the configured one (`arch_override`) rather than the
        checkpoint's at `path`: a synthetic checkpoint still to write (`_synthetic_pending`), or a planning
        runner's absent checkpoint (`checkpoint_absent`)."""
        return self.checkpoint_absent() or self._synthetic_pending(path)

    def checkpoint_repair_hint(self) -> str | None:
        """For a synthetic checkpoint that is rewritten when absent (it holds `SYNTHETIC_MARKER` and
        `synthetic_checkpoint` is configured): delete its folder so that the next run writes it again."""
        if self.config.synthetic_checkpoint is None:
            return None
        path = self.checkpoint_path()
        try:
            if synthetic_seed_of(path) is None:
                return None
        except CheckpointError:  # an unreadable marker: its own message already says to delete the folder
            return None
        return f"{path} is a synthetic checkpoint: delete that folder and run again to write it anew"

    def locate_checkpoint(self) -> Any:
        """Open the checkpoint (`open_checkpoint`), writing a synthetic one first if configured and absent
        (`write_synthetic_checkpoint`).

        Raises:
            CheckpointError: no checkpoint there, or a synthetic one written with another seed.
        """
        cfg = self.config
        path = self.checkpoint_path()
        if self._synthetic_pending(path):
            type(self).write_synthetic_checkpoint(cfg, path, cfg.synthetic_checkpoint.seed, self.dtype,
                                                  self.SYNTHETIC_LAYOUT)
        ckpt = self.open_checkpoint(path)
        seed = synthetic_seed_of(path)
        if seed is not None:
            expected = cfg.synthetic_checkpoint.seed if cfg.synthetic_checkpoint else seed
            if expected != seed:
                raise CheckpointError(f"`model_path` {str(path)!r} holds synthetic weights of seed {seed}, but "
                                      f"`synthetic_checkpoint.seed` is {expected}: use another model_path or delete it")
            logger.warning("model_path {} holds SYNTHETIC RANDOM weights (seed {}): the output will be noise", path, seed)
        return ckpt
