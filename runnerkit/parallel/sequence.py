"""Ulysses sequence parallel: each rank of a Ulysses group of size K holds 1/K of the tokens
through the transformer's blocks; around each self-attention two all-to-alls trade that for all
the tokens of 1/K of the heads, and back.

    x [B, L/K, dim] -> q, k, v [B, N, L/K, d] --all-to-all--> [B, N/K, L, d] -> attention
      -> [B, N/K, L, d] --all-to-all--> [B, N, L/K, d] -> output projection [B, L/K, dim]

Every other op of a DiT block (AdaLN modulation, norms, FFN, cross-attention whose keys are the
text) acts per token, so it runs on the local tokens unchanged. RoPE tables are sliced to the
local tokens (`shard`). Joint attention (text tokens replicated on every rank, image tokens
sharded; `joint_attention`): the text part keeps this rank's heads, the image part goes through
the all-to-alls, and the text output is all-gathered over the heads (a third collective).

A family opts in with three declarations (nothing here names a family):
- its transformer class derives from `ShardsSequence` and shards its token stream after the
  embedding (`self.sequence_parallel.shard`) and gathers the head's output (`gather`);
- each of its `AttentionUser` classes inside that transformer sets `SEQUENCE_PARALLEL`:
  "self" (queries and keys are the sharded tokens), "joint" (calls `self.joint_attention(q, k, v,
  prefix)` with `prefix` replicated tokens first), or "none" (queries sharded, keys replicated:
  text cross-attention);
- its runner declares "ulysses" in `PARALLEL_MODES` and says the token count of a shape.

Source: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509); the joint-token handling as in
xDiT's `xFuserLongContextAttention` (text heads local, image tokens exchanged).
"""

from __future__ import annotations

import functools
from typing import Any
import torch
from torch import Tensor, nn

from runnerkit.attention import AttentionFn, AttentionUser
from runnerkit.parallel.group import ParallelGroup, chunk_bounds

__all__ = ["SequenceParallel", "ShardsSequence", "install"]

SP_MODES = ("self", "joint", "none")


class ShardsSequence:
    """Mixin of a transformer that splits its tokens over a Ulysses group when
    `sequence_parallel` is set (by `install`); None: one process, nothing changes."""

    sequence_parallel: SequenceParallel | None = None


class SequenceParallel:
    """One rank's view of its Ulysses group: token shards and the all-to-all attention.

    Args:
        group: the parallel group (its `ulysses` size K and `ulysses_rank` r).
    """

    def __init__(self, group: ParallelGroup) -> None:
        self.group = group
        self.size = group.ulysses
        self.rank = group.ulysses_rank

    def bounds(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's tokens among `n` (n divisible by K: checked per request)."""
        assert n % self.size == 0, f"{n} tokens do not divide by ulysses {self.size} (the runner checks each shape)"
        return chunk_bounds(n, self.size, self.rank)

    def shard(self, x: Tensor, dim: int) -> Tensor:
        """This rank's 1/K of `x` along `dim`, as a fresh contiguous tensor (its own allocation, so
        the kernels see the same alignment as a one-process tensor)."""
        start, end = self.bounds(x.shape[dim])
        return x.narrow(dim, start, end - start).clone(memory_format=torch.contiguous_format)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's shard of `dim` concatenated in rank order (one all-gather): the inverse of `shard`."""
        return torch.cat(self.group.all_gather(x, "ulysses"), dim=dim)

    def scatter_heads(self, x: Tensor) -> Tensor:
        """[B, N, L/K, d] (all heads, local tokens) -> [B, N/K, L, d] (local heads, all tokens)."""
        B, N, Ll, d = x.shape
        K = self.size
        x = x.reshape(B, K, N // K, Ll, d).transpose(0, 1)  # [K, B, N/K, L/K, d]: chunk j goes to rank j
        y = self.group.all_to_all(x)  # [K, B, N/K, L/K, d]: chunk j holds rank j's tokens of my heads
        return y.permute(1, 2, 0, 3, 4).reshape(B, N // K, K * Ll, d)  # [B, N/K, L, d]

    def gather_heads(self, x: Tensor) -> Tensor:
        """[B, N/K, L, d] (local heads, all tokens) -> [B, N, L/K, d] (all heads, local tokens)."""
        B, Nl, L, d = x.shape
        K = self.size
        x = x.reshape(B, Nl, K, L // K, d).permute(2, 0, 1, 3, 4)  # [K, B, N/K, L/K, d]: token chunk j to rank j
        y = self.group.all_to_all(x)  # [K, B, N/K, L/K, d]: chunk j holds my tokens of rank j's heads
        return y.transpose(0, 1).reshape(B, K * Nl, L // K, d)  # [B, N, L/K, d]

    def local_heads(self, x: Tensor) -> Tensor:
        """[B, N, L, d] -> this rank's heads [B, N/K, L, d]."""
        n = x.shape[1] // self.size
        return x[:, self.rank * n:(self.rank + 1) * n]

    def attention(self, fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Self-attention over the whole sequence from local tokens: q, k, v [B, N, L/K, d] ->
        [B, N, L/K, d]. Two all-to-alls: q, k, v travel in one, the output in the other."""
        qkv = torch.stack([q, k, v])  # [3, B, N, L/K, d]
        T, B, N, Ll, d = qkv.shape
        full = self.scatter_heads(qkv.reshape(T * B, N, Ll, d)).reshape(T, B, N // self.size, Ll * self.size, d)
        out = fn(full[0], full[1], full[2])  # [B, N/K, L, d]
        return self.gather_heads(out)

    def joint_attention(self, fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, prefix: int,
                        mask: Tensor | None = None) -> Tensor:
        """Attention over [replicated prefix tokens, sharded tokens]: q, k, v [B, N, P + L/K, d], the
        first `prefix` = P tokens equal on every rank -> [B, N, P + L/K, d] (the prefix output with
        all heads on every rank). `mask`: None or bool [B, 1, 1, P + L] over the whole key sequence
        (the keys are whole after the all-to-all, in the same order: prefix, then every rank's tokens)."""
        qkv = torch.stack([q, k, v])  # [3, B, N, P + L/K, d]
        T, B, N, _, d = qkv.shape
        head = self.local_heads(qkv[:, :, :, :prefix].reshape(T * B, N, prefix, d))  # [3B, N/K, P, d]
        tail = qkv[:, :, :, prefix:]
        Ll = tail.shape[3]
        tail = self.scatter_heads(tail.reshape(T * B, N, Ll, d))  # [3B, N/K, L, d]
        full = torch.cat([head, tail], dim=2).reshape(T, B, N // self.size, prefix + Ll * self.size, d)
        out = fn(full[0], full[1], full[2]) if mask is None else fn(full[0], full[1], full[2], mask)  # [B, N/K, P + L, d]
        out_prefix = torch.cat(self.group.all_gather(out[:, :, :prefix], "ulysses"), dim=1)  # [B, N, P, d]
        out_tail = self.gather_heads(out[:, :, prefix:])  # [B, N, L/K, d]
        return torch.cat([out_prefix, out_tail], dim=2)


def install(model: nn.Module, sp: SequenceParallel) -> int:
    """Make `model` sequence-parallel over `sp`'s group: set `sequence_parallel` on every
    `ShardsSequence` inside it and wrap the attention of every `AttentionUser` below one
    (`SEQUENCE_PARALLEL` "self": `SequenceParallel.attention`; "joint": `joint_attention`; "none":
    unchanged). Returns how many transformers took it (0: `model` has none).

    Raises:
        NotImplementedError: an attention module inside a sharded transformer does not declare
            `SEQUENCE_PARALLEL` (it would silently attend to the local tokens only).
    """
    roots = [m for m in model.modules() if isinstance(m, ShardsSequence)]
    # One wrapper per backend function, shared by every module: regional compile guards on the callable,
    # so a wrapper per block would recompile the shared block graph once per block.
    wrapped: dict[tuple[str, int], Any] = {}

    def wrap(kind: str, fn: AttentionFn) -> Any:
        key = (kind, id(fn))
        if key not in wrapped:
            wrapped[key] = functools.partial(sp.attention if kind == "self" else sp.joint_attention, fn)
        return wrapped[key]

    for root in roots:
        root.sequence_parallel = sp  # type: ignore[misc]
        for m in root.modules():
            if not isinstance(m, AttentionUser):
                continue
            mode = m.SEQUENCE_PARALLEL
            if mode not in SP_MODES:
                raise NotImplementedError(f"{type(m).__name__} in {type(root).__name__} does not declare "
                                          f"SEQUENCE_PARALLEL (one of {list(SP_MODES)}): Ulysses cannot shard it")
            if mode == "self":
                m.attention_fn = wrap("self", m.attention_fn)
            elif mode == "joint":
                m.joint_attention = wrap("joint", m.attention_fn)  # type: ignore[method-assign]
    return len(roots)
