"""Multi-GPU runs under torchrun: CFG parallel and Ulysses sequence parallel (docs/multi_gpu.md).

- group.py: the process group from torchrun's environment, its CFG and Ulysses subgroups, the
  collectives (with `collective_hooks`, a spy for tests) and the failure record.
- sequence.py: Ulysses all-to-all attention, token shards, and `install` on a family's transformer.
- driver.py: one rank's lifecycle under `runnerkit` (rank 0 reports; a failure ends the group).
- serving.py: `runnerkit serve` under torchrun (rank 0 serves HTTP and publishes each job; the
  other ranks follow).
"""

from runnerkit.parallel.group import (CollectiveCall, ParallelGroup, ParallelSetupError, collective_hooks,
                                      init_from_env)

__all__ = ["CollectiveCall", "ParallelGroup", "ParallelSetupError", "collective_hooks", "init_from_env"]
