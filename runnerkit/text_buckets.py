"""Text buckets (config `text_buckets`): whether a run pads its prompts to a few text lengths, decided
at load together with the attention backend (docs/prompt_lengths.md).

Padding a prompt's text to a bucket makes every prompt run at one of a few sequence lengths, all of
them warmed, so a prompt of a new length runs at steady speed. The price is a key mask in every joint
attention, and whether that price is paid on every step depends on the backend
(`runnerkit.attention.MASK_COST`, carried as `AttentionBackend.mask_cost`): FlashAttention-4 skips the
padded keys ("free"); cuDNN and SDPA's other kernels compute them under a mask ("costly": 6-8 % a step
measured on a 20B image transformer on the H100, docs/prompt_lengths.md), and SDPA's
FlashAttention-2 takes no mask ("none"). So:

- `auto` (the default): the backend is resolved as for unpadded text, then buckets are on only if
  that backend declares masks "free" and runs with one here (a masked probe); otherwise every prompt
  runs at its own length.
- `on`: the family's buckets whatever the backend (resolved with `masked=True`: one that cannot take
  a mask is skipped by `attention: auto`, refused when asked explicitly).
- a list: those buckets, as `on`.
- `off`: exact lengths.

A family whose text has one fixed length (`TEXT_BUCKETS` None) runs unpadded. The decision is logged
as one INFO line (families with buckets only) and reported in the profile (`attention.text_buckets`,
`attention.text_buckets_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loguru import logger

from runnerkit import attention
from runnerkit.attention import AttentionBackend

Setting = str | tuple[int, ...]
"""Config `text_buckets`: 'auto', 'on', 'off' or a strictly increasing tuple of token counts."""


@dataclass(frozen=True)
class TextBuckets:
    """The text lengths (tokens) a run pads its prompts to, increasing (() : each prompt at its own
    length), and why."""

    lengths: tuple[int, ...]
    reason: str


def configured(setting: Setting, family: tuple[int, ...] | None) -> tuple[int, ...]:
    """The buckets that `setting` fixes without the backend: () for `off` or a family without buckets,
    the family's for `on`, the list for a list.

    Raises:
        RuntimeError: `setting` is 'auto' for a family with buckets (decided at load: `choose`).
    """
    if setting == "off" or family is None:
        return ()
    if setting == "on":
        return family
    if setting == "auto":
        raise RuntimeError("`text_buckets: auto` is decided at load with the attention backend "
                           "(runnerkit/text_buckets.py); load the runner first")
    assert isinstance(setting, tuple), f"the config validates `text_buckets` ({setting!r})"
    return setting


def auto_buckets(backend: AttentionBackend, family: tuple[int, ...], device: torch.device, dtype: torch.dtype,
                 head_dim: int) -> TextBuckets:
    """`text_buckets: auto` for the resolved `backend`: the family's buckets if `backend.mask_cost` is
    "free" and `backend.fn` runs [1, 2, 64, head_dim] attention with a key mask in `dtype` on `device`
    (`attention.probe_fn`), else () (exact lengths); the reason names the backend and what a mask costs it."""
    note = attention.MASK_COST[backend.name][1] if backend.name in attention.MASK_COST else (
        f"it declares key masks {backend.mask_cost}")
    if backend.mask_cost == "none":
        return TextBuckets((), f"auto: {backend.name} takes no key mask ({note}); exact prompt lengths")
    if backend.mask_cost != "free":
        return TextBuckets((), f"auto: a key mask would cost {backend.name} on every step ({note}); exact prompt "
                               "lengths, `text_buckets: on` pads anyway")
    why = attention.probe_fn(backend.fn, device, dtype, head_dim, masked=True)
    if why is not None:
        return TextBuckets((), f"auto: {backend.name} takes key masks at no steady cost but not here ({why}); "
                               "exact prompt lengths")
    return TextBuckets(family, f"auto: {backend.name} applies the padding mask at no steady cost ({note})")


def choose(attention_name: str, setting: Setting, family: tuple[int, ...] | None, device: torch.device,
           dtype: torch.dtype, head_dim: int) -> tuple[AttentionBackend, TextBuckets]:
    """The attention backend (config `attention` = `attention_name`) and the text buckets (config
    `text_buckets` = `setting`, the family's `TEXT_BUCKETS` = `family`) of a run, for `head_dim` and
    `dtype` on `device`; logs the bucket decision (one INFO line) for a family with buckets.

    Raises:
        ValueError: an unknown attention name.
        NotImplementedError: the attention backend cannot run here, or, with padded text (`on` or a
            list), cannot take a key mask (`attention.resolve`, with the reason).
    """
    if family is None:
        return (attention.resolve(attention_name, device, dtype, head_dim),
                TextBuckets((), "the family's text has one fixed length"))
    if setting == "auto":
        backend = attention.resolve(attention_name, device, dtype, head_dim)  # as for exact lengths
        buckets = auto_buckets(backend, family, device, dtype, head_dim)
    else:
        lengths = configured(setting, family)
        backend = attention.resolve(attention_name, device, dtype, head_dim, masked=bool(lengths))
        cost = "" if not lengths or backend.mask_cost == "free" else (
            f"; {backend.name} pays for the key mask on every step")
        shown = setting if isinstance(setting, str) else list(setting)
        buckets = TextBuckets(lengths, f"config `text_buckets`: {shown}{cost}")
    state = f"on {list(buckets.lengths)}" if buckets.lengths else "off, each prompt at its own length"
    logger.info("text buckets: {} ({})", state, buckets.reason)
    return backend, buckets
