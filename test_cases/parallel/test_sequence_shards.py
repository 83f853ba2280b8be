"""Ulysses token shards in one process (no process group): what each rank keeps, and the refusal of an
attention module that does not say how it meets sequence parallel (issue 24)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runnerkit.attention import AttentionUser
from runnerkit.models.qwen_image.transformer import QwenEmbedded, QwenImageTransformer2D
from runnerkit.parallel.group import chunk_bounds
from runnerkit.parallel.sequence import SequenceParallel, ShardsSequence, install


class RankView(SequenceParallel):
    """`SequenceParallel` of rank `rank` of `size`, without a group (only `bounds` and `shard` are used)."""

    def __init__(self, size: int, rank: int) -> None:  # noqa: D107 - no group: nothing is communicated
        self.size, self.rank = size, rank


@pytest.mark.parametrize(("sizes", "size", "expected"), [
    ([16, 16], 2, [[16, 0], [0, 16]]),  # target tokens on rank 0, reference tokens on rank 1
    ([6, 10], 4, [[4, 0], [2, 2], [0, 4], [0, 4]]),  # a segment boundary inside rank 1's shard
    ([12], 3, [[4], [4], [4]]),  # t2i: one segment
])
def test_qwen_modulation_segments_follow_the_shard(sizes: list[int], size: int, expected: list[list[int]]) -> None:
    """Each rank's image tokens, RoPE rows (text rows whole, then its image rows) and segment sizes."""
    L_txt, L_img, dim = 3, sum(sizes), 2
    img = torch.arange(L_img * dim, dtype=torch.float32).reshape(1, L_img, dim)
    txt = torch.zeros(1, L_txt, dim)
    rope = tuple(torch.arange(L_txt + L_img, dtype=torch.float32).reshape(-1, 1, 1) + k for k in (0, 100))
    pre = QwenEmbedded(temb=torch.zeros(1, len(sizes), dim), rope=rope, img_sizes=sizes)  # type: ignore[arg-type]
    model = QwenImageTransformer2D.__new__(QwenImageTransformer2D)
    for rank in range(size):
        object.__setattr__(model, "sequence_parallel", RankView(size, rank))
        img_r, txt_r, pre_r = QwenImageTransformer2D.shard(model, img, txt, pre)
        start, end = chunk_bounds(L_img, size, rank)
        assert torch.equal(img_r, img[:, start:end]) and img_r.is_contiguous()
        assert txt_r is txt
        for k, table in enumerate(pre_r.rope):
            rows = list(range(L_txt)) + [L_txt + i for i in range(start, end)]
            assert table.flatten().tolist() == [r + 100 * k for r in rows]
        assert pre_r.img_sizes == expected[rank]


class Undeclared(AttentionUser):
    pass


class Sharded(ShardsSequence, nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attn = attention


def test_install_refuses_an_undeclared_attention_and_shares_one_wrapper() -> None:
    sp: Any = RankView(2, 0)
    with pytest.raises(NotImplementedError, match=r"Undeclared in Sharded does not declare SEQUENCE_PARALLEL"):
        install(Sharded(Undeclared()), sp)

    class SelfAttention(AttentionUser):
        SEQUENCE_PARALLEL = "self"

    class CrossAttention(AttentionUser):
        SEQUENCE_PARALLEL = "none"

    model = nn.Sequential(Sharded(SelfAttention()), Sharded(SelfAttention()), Sharded(CrossAttention()))
    plain = model[2].attn.attention_fn
    assert install(model, sp) == 3
    assert model[0].sequence_parallel is sp
    assert model[0].attn.attention_fn is model[1].attn.attention_fn  # one wrapper: compile guards see one callable
    assert model[0].attn.attention_fn.func == sp.attention
    assert model[2].attn.attention_fn is plain  # cross-attention: keys on every rank, nothing exchanged
