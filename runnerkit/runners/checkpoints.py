"""Where a runner's checkpoint comes from: `model_path`, or a synthetic one written on first use.

`CheckpointSource` is an object every runner holds (`runner.checkpoints`, made in `BaseRunner.__init__`):
it locates the checkpoint, writes a synthetic one once when configured, and says how to repair one. The
family's side are hooks declared on `BaseRunner` with their defaults: `open_checkpoint(path, raw)` (read
the family's layouts), `write_synthetic_checkpoint` and `CHECKPOINT_LAYOUTS` (what it writes, also for
runnerkit.tools.synth_checkpoint), `SYNTHETIC_LAYOUT`, and `arch_override` (the configured architecture,
a pydantic model: the synthetic cache folder is keyed by it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from runnerkit.synthetic import synthetic_dtype_of, synthetic_seed_of
from runnerkit.weights import CheckpointError

if TYPE_CHECKING:
    from runnerkit.runners.base import BaseRunner


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


class CheckpointSource:
    """Locate (and, for `synthetic_checkpoint`, write once) `runner`'s checkpoint.

    Reads the runner's current `config`, `dtype`, `plan_only` and `arch_override` at each call (the
    config may change before the lock: `update_config`, `config_trial`), and calls its hooks
    `open_checkpoint` and `write_synthetic_checkpoint` (in `SYNTHETIC_LAYOUT`).
    """

    def __init__(self, runner: BaseRunner) -> None:
        self.runner = runner

    def path(self) -> Path:
        """`model_path`, or the cache folder of this architecture's synthetic checkpoint."""
        cfg = self.runner.config
        if cfg.model_path:
            return Path(cfg.model_path)
        assert cfg.synthetic_checkpoint is not None, "config validation requires model_path or synthetic_checkpoint"
        arch = self.runner.arch_override
        assert arch is not None, f"{type(self.runner).__name__} sets `arch_override` for a synthetic checkpoint"
        digest = hashlib.sha1(json.dumps(arch.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        return synthetic_cache_dir() / f"{cfg.model_cls}-{digest[:12]}-seed{cfg.synthetic_checkpoint.seed}-{cfg.dtype}"

    def pending(self, path: Path) -> bool:
        """True if a synthetic checkpoint is configured and not written yet at `path`.

        Raises:
            CheckpointError: `path` is a file, or the synthetic cache root cannot hold folders (`check_synthetic_cache`).
        """
        cfg = self.runner.config
        if cfg.synthetic_checkpoint is None:
            return False
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"`model_path` {str(path)!r} is a file; a synthetic checkpoint needs a folder "
                                  "(to run from existing files, remove `synthetic_checkpoint` from the config)")
        pending = not path.exists() or not any(path.iterdir())
        if pending and not cfg.model_path:
            check_synthetic_cache()
        return pending

    def absent(self) -> bool:
        """True for a runner built to plan only (`BaseRunner.for_plan`) whose `model_path` does not exist (and
        is not a synthetic checkpoint's, to write): its architecture before loading is then the one the config
        gives or implies (`arch_from_config`). A run's load refuses the missing checkpoint as always."""
        cfg = self.runner.config
        return (self.runner.plan_only and cfg.synthetic_checkpoint is None and cfg.model_path is not None
                and not Path(cfg.model_path).exists())

    def arch_from_config(self, path: Path) -> bool:
        """Whether the architecture before loading is the configured one (`arch_override`) rather than the
        checkpoint's at `path`: a synthetic checkpoint still to write (`pending`), or a planning runner's
        absent checkpoint (`absent`)."""
        return self.absent() or self.pending(path)

    def repair_hint(self) -> str | None:
        """How to repair a damaged checkpoint, added to a `CheckpointError` at load (`BaseRunner.init_modules`):
        for a synthetic checkpoint that is rewritten when absent (it holds `SYNTHETIC_MARKER` and
        `synthetic_checkpoint` is configured), delete its folder so that the next run writes it again; None
        otherwise (a user's checkpoint: only its owner can replace it)."""
        if self.runner.config.synthetic_checkpoint is None:
            return None
        path = self.path()
        try:
            if synthetic_seed_of(path) is None:
                return None
        except CheckpointError:  # an unreadable marker: its own message already says to delete the folder
            return None
        return f"{path} is a synthetic checkpoint: delete that folder and run again to write it anew"

    def locate(self) -> Any:
        """Open the checkpoint (`runner.open_checkpoint`), writing a synthetic one first if configured and absent
        (`write_synthetic_checkpoint` of the runner's class, in its `SYNTHETIC_LAYOUT`).

        Raises:
            CheckpointError: no checkpoint there, or a synthetic one written with another seed or, where
                `synthetic_checkpoint` is configured, another dtype.
        """
        runner = self.runner
        cfg = runner.config
        path = self.path()
        if self.pending(path):
            type(runner).write_synthetic_checkpoint(cfg, path, cfg.synthetic_checkpoint.seed, runner.dtype,
                                                    runner.SYNTHETIC_LAYOUT)
        ckpt = runner.open_checkpoint(path)
        seed = synthetic_seed_of(path)
        if seed is not None:
            expected = cfg.synthetic_checkpoint.seed if cfg.synthetic_checkpoint else seed
            if expected != seed:
                raise CheckpointError(f"`model_path` {str(path)!r} holds synthetic weights of seed {seed}, but "
                                      f"`synthetic_checkpoint.seed` is {expected}: use another model_path")
            written = synthetic_dtype_of(path)  # the values are drawn in it: another dtype is another checkpoint
            if cfg.synthetic_checkpoint is not None and written is not None and written != cfg.dtype:
                raise CheckpointError(f"`model_path` {str(path)!r} holds synthetic weights written in {written}, but "
                                      f"`dtype` is {cfg.dtype!r}: use another model_path")
            logger.warning("model_path {} holds SYNTHETIC RANDOM weights (seed {}): the output will be noise", path, seed)
        return ckpt
