"""The process group of a parallel run: start from torchrun's environment, the CFG and Ulysses
subgroups, the collectives every parallel path goes through (with a spy hook for tests), and the
failure record that lets rank 0 report another rank's error.

Layout: WORLD_SIZE = cfg x ulysses; rank r has CFG rank r // ulysses and Ulysses rank r % ulysses,
so each Ulysses group is `ulysses` consecutive ranks (on one host: the fastest links carry the
all-to-alls) and each CFG group is `cfg` ranks `ulysses` apart.

Backend: NCCL on CUDA (device cuda:LOCAL_RANK), gloo on the CPU. Every collective, and the start,
is bounded by `parallel.timeout_s` (`init_process_group(timeout=...)`): gloo raises after it, NCCL's
watchdog aborts the communicator after it (set TORCH_NCCL_ASYNC_ERROR_HANDLING=1, torch's default
since 2.2, so the abort ends the process).

Source: torch.distributed (`init_process_group`, `new_group`, `all_to_all_single`, `all_gather`);
the rank layout of xDiT / LightX2V (CFG outermost, sequence parallel innermost).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import Tensor

from runnerkit.cli_common import TORCHRUN_ENV
from runnerkit.config import ParallelConfig

__all__ = ["SETUP_REFUSED_KEY", "TORCHRUN_ENV", "CollectiveCall", "ParallelGroup", "ParallelSetupError", "agent_store",
           "collective_hooks", "init_from_env"]


class ParallelSetupError(ValueError):
    """The launch does not match `parallel` (world size, missing torchrun environment, device)."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as the spy hooks see it: the op, its group and the shape of this rank's input."""

    op: str
    group: str
    shape: tuple[int, ...]


collective_hooks: list[Callable[[CollectiveCall], None]] = []
"""Called with every collective this process issues, before it is issued (tests append a spy)."""

SETUP_REFUSED_KEY = "runnerkit/setup_refused/{attempt}"
FAILURE_KEY = "runnerkit/failed/{rank}"
FAILURE_COUNT_KEY = "runnerkit/failures"
PROCESS_KEY = "runnerkit/process/{rank}"
ENDED_KEY = "runnerkit/ended/{rank}"


def _process_identity(pid: int | str = "self") -> tuple[int, str] | None:
    """(pid, start time in clock ticks since boot) of a live process; None if it is gone or a zombie.
    The start time tells a process from a later one that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces: state is field 3
    if fields[0] in ("Z", "X"):
        return None
    return int(stat.split(" ", 1)[0]), fields[19]  # field 22: starttime


@dataclass
class ParallelGroup:
    """This rank's place in the parallel run and its process groups.

    Attributes:
        config: the run's `parallel` config.
        rank, world_size: global rank and size (torchrun's RANK, WORLD_SIZE).
        cfg_rank: which CFG branch this rank computes (0: conditional, 1: unconditional) when cfg = 2.
        ulysses_rank: this rank's slice of the tokens (and of the heads inside attention).
        device: the rank's compute device (cuda:LOCAL_RANK or cpu).
    """

    config: ParallelConfig
    rank: int
    world_size: int
    cfg_rank: int
    ulysses_rank: int
    device: torch.device
    cfg_group: Any = field(repr=False, default=None)
    ulysses_group: Any = field(repr=False, default=None)
    output_lock: threading.Lock = field(repr=False, default_factory=threading.Lock)
    """Held while rank 0 writes a request's files, and by a thread that removes them before ending
    the process: the removal never races a file being renamed into place."""
    _peers: dict[int, tuple[str, int, str]] = field(repr=False, default_factory=dict)

    @property
    def cfg(self) -> int:
        return self.config.cfg

    @property
    def ulysses(self) -> int:
        return self.config.ulysses

    # -- collectives (each goes through the spy hooks) ------------------------------------
    def _note(self, op: str, group: str, t: Tensor) -> None:
        if not collective_hooks or torch.compiler.is_compiling():  # a compiled graph does not call Python hooks
            return
        for hook in collective_hooks:
            hook(CollectiveCall(op, group, tuple(t.shape)))

    def all_to_all(self, x: Tensor) -> Tensor:
        """Ulysses all-to-all: split dim 0 of `x` in `ulysses` equal chunks, chunk j goes to Ulysses
        rank j; returns the chunks received, chunk j from Ulysses rank j, stacked on dim 0 (same shape)."""
        self._note("all_to_all", "ulysses", x)
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.ulysses_group)
        return out

    def all_gather(self, x: Tensor, group: str) -> list[Tensor]:
        """Every rank's `x` of `group` ("cfg" or "ulysses"), in group-rank order (same shape everywhere)."""
        self._note("all_gather", group, x)
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.cfg if group == "cfg" else self.ulysses)]
        dist.all_gather(out, x, group=self.cfg_group if group == "cfg" else self.ulysses_group)
        return out

    def agree(self, ok: bool, phase: str) -> bool:
        """Every rank says whether `phase` succeeded on it; True only if it did on all (one all-reduce
        over the whole group). A phase boundary where the ranks wait for each other."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=self._collective_device())
        self._note(f"agree:{phase}", "world", flag)
        dist.all_reduce(flag)
        return int(flag.item()) == 0

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- failures ---------------------------------------------------------------------------
    def _store(self) -> Any:
        return dist.distributed_c10d._get_default_store()

    def record_failure(self, line: str, rank: int | None = None) -> None:
        """Leave the failure line of this rank (or of `rank`, a peer that died without recording its
        own) in the rendezvous store (it outlives this process under torchrun)."""
        try:
            self._store().set(FAILURE_KEY.format(rank=self.rank if rank is None else rank), line)
            self._store().add(FAILURE_COUNT_KEY, 1)  # after the line: a reader that sees the count finds it
        except Exception as exc:  # noqa: BLE001 - the store may be gone with rank 0; the exit status still tells
            logger.debug("rank {}: could not record the failure in the store: {}", self.rank, exc)

    def failures(self, wait_s: float = 0.0) -> dict[int, str]:
        """Failure lines recorded so far (this rank's included), by rank; waits up to `wait_s` for the first."""
        deadline = time.monotonic() + wait_s
        found: dict[int, str] = {}
        while True:
            try:  # one store request per poll while nothing failed (every rank's watcher polls)
                count = self._store().add(FAILURE_COUNT_KEY, 0)
            except Exception:  # noqa: BLE001 - a store whose host exited: nothing more to read
                return found
            for r in range(self.world_size if count else 0):
                key = FAILURE_KEY.format(rank=r)
                try:
                    if r not in found and self._store().check([key]):
                        found[r] = self._store().get(key).decode()
                except Exception:  # noqa: BLE001 - a store whose host exited: nothing more to read
                    return found
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def register_process(self) -> None:
        """Leave this rank's host, pid and process start time in the store (`dead_ranks` reads them)."""
        me = _process_identity()
        if me is not None:
            self._store().set(PROCESS_KEY.format(rank=self.rank), f"{socket.gethostname()} {me[0]} {me[1]}")

    def mark_ended(self) -> None:
        """Say in the store that this rank ends in order (done, failed and recorded, or interrupted),
        so a peer that finds its process gone does not report it as a death."""
        try:
            self._store().set(ENDED_KEY.format(rank=self.rank), "1")
        except Exception:  # noqa: BLE001 - a store whose host exited: no peer left to tell
            pass

    def _gone(self, r: int) -> bool:
        """Whether rank `r`'s process, on this host, is gone (or a zombie); False for a rank on another
        host (it cannot be seen from here) or one that has not registered yet."""
        if r not in self._peers:
            key = PROCESS_KEY.format(rank=r)
            if not self._store().check([key]):
                return False
            host, pid, start = self._store().get(key).decode().split()
            self._peers[r] = (host, int(pid), start)
        host, pid, start = self._peers[r]
        return host == socket.gethostname() and _process_identity(pid) != (pid, start)

    def dead_ranks(self) -> list[int]:
        """Other ranks on this host whose process is gone (or a zombie) without having recorded a
        failure or ended in order: killed (SIGKILL, the OOM killer) or crashed. Ranks on other hosts
        cannot be seen from here and are never listed."""
        dead = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                if self._gone(r) and not self._store().check([FAILURE_KEY.format(rank=r)]) and \
                        not self._store().check([ENDED_KEY.format(rank=r)]):
                    dead.append(r)
            except Exception:  # noqa: BLE001 - a store whose host exited: nothing more to read
                return dead
        return dead

    def reporter(self) -> int:
        """The rank that logs the group's failure line: 0, unless rank 0's process is gone without
        having ended in order (killed or crashed, on this host); then the lowest rank still alive."""
        if self.rank == 0:
            return 0
        try:  # gone before ended: rank 0 marks itself ended before it exits, so an orderly exit reads as ended
            if not self._gone(0) or self._store().check([ENDED_KEY.format(rank=0)]):
                return 0
            return next(r for r in range(1, self.world_size) if r == self.rank or not self._gone(r))
        except Exception:  # noqa: BLE001 - a store whose host exited (rank 0's own): nothing to read, rank 0 reports
            return 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_from_env(config: ParallelConfig, device_spec: str) -> ParallelGroup:
    """Start the process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) and build the CFG and Ulysses subgroups.

    Args:
        config: the run's `parallel` config.
        device_spec: the config's `device` ('auto', 'cpu', 'cuda', 'cuda:N'); on CUDA each rank
            takes cuda:LOCAL_RANK (an explicit index is refused: the launcher assigns devices).

    Raises:
        ParallelSetupError: not launched by torchrun, WORLD_SIZE != cfg x ulysses, an explicit
            cuda:N, or fewer CUDA devices than LOCAL_RANK needs.
    """
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ParallelSetupError(f"`parallel` is set but the environment lacks {missing}: launch with "
                                 f"`torchrun --nproc_per_node {config.world_size} -m runnerkit.infer ...`")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if world != config.world_size:
        raise ParallelSetupError(f"`parallel` = cfg {config.cfg} x ulysses {config.ulysses} needs "
                                 f"{config.world_size} processes, but WORLD_SIZE is {world}: use "
                                 f"`torchrun --nproc_per_node {config.world_size}` or change `parallel`")
    if device_spec.startswith("cuda:"):
        raise ParallelSetupError(f"`device`={device_spec!r} under `parallel`: each rank takes cuda:LOCAL_RANK; "
                                 "use 'cuda' or 'auto' (CUDA_VISIBLE_DEVICES picks the GPUs)")
    use_cuda = device_spec == "cuda" or (device_spec == "auto" and torch.cuda.is_available())
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise ParallelSetupError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices are "
                                     "visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=config.timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    cfg_rank, u_rank = divmod(rank, config.ulysses)
    group = ParallelGroup(config, rank, world, cfg_rank, u_rank, device)
    group.register_process()  # before the collective new_group calls: once they return, every rank has
    # new_group is collective over the whole world: every rank creates every subgroup, in the same order.
    for c in range(config.cfg):
        ranks = list(range(c * config.ulysses, (c + 1) * config.ulysses))
        g = dist.new_group(ranks, timeout=timeout)
        if c == cfg_rank:
            group.ulysses_group = g
    for u in range(config.ulysses):
        ranks = [c * config.ulysses + u for c in range(config.cfg)]
        g = dist.new_group(ranks, timeout=timeout)
        if u == u_rank:
            group.cfg_group = g
    logger.info("parallel: rank {}/{} ({} on {}), cfg rank {}, ulysses rank {}, collective timeout {:g} s",
                rank, world, backend, device, cfg_rank, u_rank, config.timeout_s)
    return group


def agent_store(timeout_s: float) -> Any | None:
    """torchrun's own store, hosted by its agent (TORCHELASTIC_USE_AGENT_STORE=True): reachable
    without a process group and alive after any rank exits. None under another launcher."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - without it each rank simply exits on its own
        logger.debug("torchrun's agent store is not reachable: {}", exc)
        return None


def split_even(n: int, parts: int, what: str, why: str) -> int:
    """n // parts, refusing a remainder.

    Raises:
        NotImplementedError: `n` does not divide by `parts` (names `what` and `why`).
    """
    if n % parts:
        raise NotImplementedError(f"`parallel.ulysses`={parts} needs {what} divisible by {parts}, got {n} ({why})")
    return n // parts


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk `index` of `n` items cut in `parts` equal chunks."""
    size = n // parts
    return index * size, (index + 1) * size
