"""Where a runner's checkpoint comes from: `model_path`, or a synthetic one written on first use.

`SyntheticCheckpointSource` is mixed into a family runner that can write synthetic checkpoints
(`DefaultRunner.write_synthetic_checkpoint`). The runner provides `arch_override` (its
architecture, a pydantic model: the cache folder is keyed by it) and `open_checkpoint(path)`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from loguru import logger

from runnerkit.synthetic import synthetic_seed_of
from runnerkit.weights import CheckpointError


def synthetic_cache_dir() -> Path:
    """Where synthetic checkpoints go when `model_path` is not set (env RUNNERKIT_CACHE overrides)."""
    root = os.environ.get("RUNNERKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "runnerkit")
    return Path(root) / "synthetic"


class SyntheticCheckpointSource:
    """Locate (and, for `synthetic_checkpoint`, write once) the runner's checkpoint."""

    config: Any
    dtype: Any
    arch_override: Any

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
        return not path.exists() or not any(path.iterdir())

    def locate_checkpoint(self) -> Any:
        """Open the checkpoint (`open_checkpoint`), writing a synthetic one first if configured and absent
        (`write_synthetic_checkpoint`).

        Raises:
            CheckpointError: no checkpoint there, or a synthetic one written with another seed.
        """
        cfg = self.config
        path = self.checkpoint_path()
        if self._synthetic_pending(path):
            type(self).write_synthetic_checkpoint(cfg, path, cfg.synthetic_checkpoint.seed, self.dtype,  # type: ignore[attr-defined]
                                                  "runnerkit")
        ckpt = self.open_checkpoint(path)
        seed = synthetic_seed_of(path)
        if seed is not None:
            expected = cfg.synthetic_checkpoint.seed if cfg.synthetic_checkpoint else seed
            if expected != seed:
                raise CheckpointError(f"`model_path` {str(path)!r} holds synthetic weights of seed {seed}, but "
                                      f"`synthetic_checkpoint.seed` is {expected}: use another model_path or delete it")
            logger.warning("model_path {} holds SYNTHETIC RANDOM weights (seed {}): the output will be noise", path, seed)
        return ckpt
