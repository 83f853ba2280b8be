"""Attention backends: which kernel the transformers' self- and joint attention run on.

Config `attention` picks one per run:

- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` with PyTorch's own dispatch.
- `sdpa_cudnn`, `sdpa_flash`, `sdpa_efficient`, `sdpa_math`: SDPA restricted to one of its
  kernels (`torch.nn.attention.sdpa_kernel`): cuDNN attention, FlashAttention-2, memory-efficient
  attention, the reference math path.
- `flash_attn_4`: FlashAttention-4 (`flash_attn.cute.flash_attn_func`, the CuTe-DSL kernels for
  Hopper/Blackwell), when installed (PyPI `flash-attn-4`, the `fa4` extra).
- `auto`: the first available of `AUTO_ORDER` for the device, dtype and head size (FlashAttention-4
  only on the compute capabilities it targets, `FA4_ARCHS`).

An explicitly asked backend that is not installed or does not run the model's head size and
dtype on the device is refused at load with the reason (`resolve`), never replaced silently.
Availability is probed by running the kernel once on a small input of the model's head size and
dtype on the device; outputs are compared with the math path (`probe` tolerance below).

Family modules take the backend through the attribute `attention_fn` of their attention modules
(`AttentionUser`); the runner installs it on every module it builds (`install`). Layout of every
backend's call: q, k, v `[B, N, L, d]` -> `[B, N, Lq, d]`, as SDPA's.

Key masks: a family whose text is padded to a few lengths (docs/prompt_lengths.md) passes
`mask`, bool `[B, 1, 1, Lk]` (True: attend), to exclude the padded keys. SDPA's backends take it as
`attn_mask` (cuDNN then runs its biased variant: ~10 % slower a step in docs/prompt_lengths.md's H200 run);
FlashAttention-4 takes it as a key count: the attended keys are moved to the front of K and V (a
stable gather; attention does not depend on the keys' order) and `flash_attn_varlen_func` reads the
first `seqused_k` of them, so the padded keys cost neither time nor a mask. FlashAttention-2
(`sdpa_flash`) takes none. A runner that passes masks resolves its backend with `masked=True`: the
probe then runs with a mask, so `auto` skips the backends that cannot take one and an explicit one
is refused at load with the reason. Each backend declares what a mask costs it (`MASK_COST`, carried
as `AttentionBackend.mask_cost`): `text_buckets: auto` pads prompts only where it is free
(runnerkit/text_buckets.py).

Sources: PyTorch `torch.nn.attention` (SDPBackend, sdpa_kernel); FlashAttention-4: Dao-AILab
flash-attention `flash_attn/cute/interface.py` (`flash_attn_func(q, k, v)` with [B, L, N, d] inputs,
returning `(out, lse)`; `flash_attn_varlen_func(q, k, v, seqused_k=...)` with batched [B, L, N, d]
inputs reads the first `seqused_k[b]` keys of batch element b).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from loguru import logger
from torch import Tensor, nn

AttentionName = Literal["auto", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn_4"]
ATTENTION_NAMES: tuple[str, ...] = get_args(AttentionName)

MaskCost = Literal["free", "costly", "none"]
"""What a key mask costs a backend at steady state: "free" (the padded keys are skipped, not computed and
masked), "costly" (a masked kernel variant that runs every step slower than the unmasked one, over the
padded keys too), "none" (the backend takes no mask)."""

MASK_COST: dict[str, tuple[MaskCost, str]] = {
    "sdpa": ("costly", "PyTorch's SDPA with a mask leaves FlashAttention-2 for a masked kernel (cuDNN's biased "
                       "variant, the memory-efficient kernel, or the math path on the CPU), over the padded keys too"),
    "sdpa_cudnn": ("costly", "cuDNN attention takes the mask as a bias: its biased kernel over the padded keys, "
                             "6-10 % slower a 20B image transformer step at 1328x1328 on the H100/H200 (docs/prompt_lengths.md)"),
    "sdpa_flash": ("none", "SDPA's FlashAttention-2 kernel takes no mask"),
    "sdpa_efficient": ("costly", "the memory-efficient kernel adds the mask as a bias over the padded keys"),
    "sdpa_math": ("costly", "the math path computes the padded keys and then masks them"),
    "flash_attn_4": ("free", "FlashAttention-4 takes the mask as a key count (kept keys moved first, "
                             "`flash_attn_varlen_func` reads only those): the pads cost no attention time"),
}
"""Per backend: what a key mask costs it and why (`MaskCost`); `text_buckets: auto` pads only for "free"."""

FA4_ARCHS: dict[int, str] = {9: "Hopper", 10: "Blackwell", 11: "Blackwell"}
"""CUDA compute capability majors whose kernels FlashAttention-4 is written for (sm_90 Hopper; sm_100/sm_103
datacenter Blackwell, sm_110): `auto` tries FA4 only there. flash-attn-4 4.0.0b40 also accepts sm_80 and
sm_120 (consumer Blackwell) through its Ampere-style kernel, not measured here: an explicit `flash_attn_4`
is checked by running it (`probe`) and not by this table."""

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    # H200 at 480x832x81 video shapes, head size 128: cuDNN ~555 TFLOP/s, FA2 ~350, FA4 ~670.
    "cuda": ("flash_attn_4", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa"),
    "cpu": ("sdpa",),
}
"""`auto` takes the first backend of its device type's list that passes the probe (other device
types: `sdpa`)."""

PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Largest abs difference from the math path on the probe input (values ~N(0, 1), L = 64) for a
backend to count as working (float32: kernels that compute in TF32 or lower fail it)."""

AttentionFn = Callable[..., Tensor]
"""`fn(q, k, v, mask=None)`: q, k, v [B, N, L, d]; mask None or bool [B, 1, 1, Lk] (True: attend)."""

CUDA_ONLY = {"sdpa_cudnn": "cuDNN attention", "sdpa_efficient": "SDPA's memory-efficient kernel",
             "flash_attn_4": "FlashAttention-4"}
"""Backends with no kernel outside CUDA (SDPA's flash and math kernels also run on the CPU)."""


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """PyTorch's scaled-dot-product attention with its own kernel choice: [B, N, L, d] -> [B, N, Lq, d];
    `mask` bool [B, 1, 1, Lk] (True: attend) or None."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _sdpa_kernel(kernel: str) -> AttentionFn:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[kernel]

    def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None and kernel == "sdpa_flash":  # the kernel would raise a less clear "no kernel" error
            raise NotImplementedError("SDPA's FlashAttention-2 kernel takes no attention mask")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


_FA4_FUNC: Callable[..., object] | None = None
"""`flash_attn.cute.flash_attn_func` once `flash_attn_4` was asked for (imported on first use)."""
_FA4_VARLEN: Callable[..., object] | None = None
"""`flash_attn.cute.flash_attn_varlen_func` (the masked path), imported with `_FA4_FUNC`."""


@torch.library.custom_op("runnerkit::flash_attn_4", mutates_args=())
def _flash_attn_4_op(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """[B, Lq, N, d], [B, Lk, N, d] x2 -> [B, Lq, N, d] (FA4's own layout; a fresh tensor)."""
    assert _FA4_FUNC is not None, "flash_attn_4 runs only after backend_fn('flash_attn_4') imported it"
    out = _FA4_FUNC(q, k, v)
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


@_flash_attn_4_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def keys_first(k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The attended keys moved to the front: k, v [B, Lk, N, d] and `mask` bool [B, Lk] (True: attend)
    -> (k', v' [B, Lk, N, d], used int32 [B]) with the `used[b]` attended keys of batch element b
    first, in their order, and the masked ones after them (a stable sort on the mask). Attention
    over k'[b, :used[b]] equals attention over the keys `mask` keeps: the order of keys does not
    change softmax(q kᵀ) v."""
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)  # [B, Lk]: kept keys first
    index = order[:, :, None, None]
    k = torch.gather(k, 1, index.expand(-1, -1, k.shape[2], k.shape[3]))
    v = torch.gather(v, 1, index.expand(-1, -1, v.shape[2], v.shape[3]))
    return k, v, mask.sum(dim=1, dtype=torch.int32)


@torch.library.custom_op("runnerkit::flash_attn_4_masked", mutates_args=())
def _flash_attn_4_masked_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """[B, Lq, N, d], [B, Lk, N, d] x2, bool [B, Lk] -> [B, Lq, N, d]: FA4 over the keys `mask` keeps."""
    assert _FA4_VARLEN is not None, "flash_attn_4 checks for the varlen entry point before this op"
    k, v, used = keys_first(k, v, mask)
    out = _FA4_VARLEN(q, k, v, seqused_k=used)
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


@_flash_attn_4_masked_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def flash_attn_4(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """FlashAttention-4: [B, N, L, d] -> [B, N, Lq, d], as SDPA's layout; `mask` None or bool
    [B, 1, 1, Lk] (True: attend) over the keys.

    It runs as the torch custom ops `runnerkit::flash_attn_4` and `runnerkit::flash_attn_4_masked`
    (with shape-only fakes), so that regional compile keeps the block one graph with the kernel as an
    opaque call: FA4's own entry points are autograd Functions around CuTe-DSL launches that dynamo
    does not trace. The [B, N, L, d] inputs are views of [B, L, N, d] projections, so the transposes to
    and from FA4's layout copy nothing. With a mask, the kept keys are gathered to the front of K and V
    (`keys_first`, one copy of each) and the varlen kernel reads `seqused_k` of them: the shapes stay
    those of the padded sequence, so a prompt of a new length within a text bucket runs the same kernel.
    """
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is None:
        return _flash_attn_4_op(qt, kt, vt).transpose(1, 2)
    if _FA4_VARLEN is None:
        raise NotImplementedError("this flash-attn-4 has no `flash_attn_varlen_func`, which key masks need")
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise ValueError(f"flash_attn_4 takes a key mask [B, 1, 1, Lk] (got {tuple(mask.shape)})")
    return _flash_attn_4_masked_op(qt, kt, vt, mask[:, 0, 0].expand(q.shape[0], -1).contiguous()).transpose(1, 2)


def _flash_attn_4() -> AttentionFn:
    global _FA4_FUNC, _FA4_VARLEN
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        raise NotImplementedError("flash-attn-4 is not installed (the `flash_attn.cute` package of "
                                  "Dao-AILab/flash-attention; pip install 'runnerkit[fa4]', README)")
    import flash_attn.cute as cute  # type: ignore[import-not-found]

    _FA4_FUNC, _FA4_VARLEN = cute.flash_attn_func, getattr(cute, "flash_attn_varlen_func", None)
    return flash_attn_4


def backend_fn(name: str) -> AttentionFn:
    """The callable of backend `name` (not `auto`), without checking that it runs.

    Raises:
        ValueError: an unknown name (listing the allowed ones).
        NotImplementedError: the backend's package is not installed.
    """
    if name == "sdpa":
        return sdpa
    if name.startswith("sdpa_"):
        return _sdpa_kernel(name)
    if name == "flash_attn_4":
        return _flash_attn_4()
    raise ValueError(f"`attention` must be one of {list(ATTENTION_NAMES)} (got {name!r})")


def fa4_device_reason(device: torch.device) -> str | None:
    """Why `auto` does not try FlashAttention-4 on the CUDA device `device` (its compute capability is not
    one of `FA4_ARCHS`), or None (also for other device types: `probe` answers for those)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_ARCHS:
        return (f"FlashAttention-4 targets Hopper (sm_90) and Blackwell (sm_100, sm_103, sm_110); this device is "
                f"sm_{major}{minor}")
    return None


def probe(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool = False) -> str | None:
    """Why backend `name` cannot run [1, 2, 64, head_dim] attention in `dtype` on `device` (with
    `masked`: with a key mask that drops the last 8 keys), or None if it can."""
    if name in CUDA_ONLY and device.type != "cuda":
        return f"{CUDA_ONLY[name]} runs on CUDA devices only"
    try:
        fn = backend_fn(name)
    except Exception as exc:  # noqa: BLE001 - not installed, or a broken install: a reason
        return _first_line(exc)
    return probe_fn(fn, device, dtype, head_dim, masked)


def _first_line(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return first[:300]


def probe_fn(fn: AttentionFn, device: torch.device, dtype: torch.dtype, head_dim: int,
             masked: bool = False) -> str | None:
    """Why the attention callable `fn` cannot run [1, 2, 64, head_dim] attention in `dtype` on `device`
    (with `masked`: with a key mask that drops the last 8 keys), or None if it can: any exception is a
    reason, and so is an output off the float32 math path by more than `PROBE_TOLERANCE`."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, 2, 64, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(3))
        mask = None
        if masked:
            mask = torch.ones(1, 1, 1, 64, dtype=torch.bool, device=device)
            mask[..., -8:] = False
        with torch.inference_mode():
            out = fn(q, k, v, mask) if masked else fn(q, k, v)
            ref = _sdpa_kernel("sdpa_math")(q.float(), k.float(), v.float(), mask)
    except Exception as exc:  # noqa: BLE001 - any failure of a third-party kernel on the probe is a reason
        # (FlashAttention-4 checks dtype and head size with `assert`: AssertionError)
        return _first_line(exc)
    if out.shape != ref.shape:
        return f"returned shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = (out.float() - ref).abs().max().item()
    tol = PROBE_TOLERANCE.get(dtype, 2e-2)
    if not err <= tol:
        return f"differs from the math path by {err:.3g} on the probe (more than {tol:g} in {dtype})"
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """The backend a run uses: its name, its callable, why `auto` chose it, and what a key mask costs it
    (`MaskCost`; `resolve` fills it from `MASK_COST`)."""

    name: str
    fn: AttentionFn
    reason: str
    mask_cost: MaskCost = "costly"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.fn(q, k, v) if mask is None else self.fn(q, k, v, mask)


def resolve(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
            masked: bool = False) -> AttentionBackend:
    """The backend for config `attention` = `name` on `device` for `dtype` and `head_dim`; with
    `masked`, one that takes a key mask (the family pads its text: docs/prompt_lengths.md).

    Raises:
        ValueError: an unknown name.
        NotImplementedError: an explicit backend that cannot run here, with the reason (at load:
            never a silent fallback to another kernel).
    """
    if name not in ATTENTION_NAMES:
        raise ValueError(f"`attention` must be one of {list(ATTENTION_NAMES)} (got {name!r})")
    if name != "auto":
        why = probe(name, device, dtype, head_dim, masked)
        if why is not None:
            masks = (" with a key mask (padded text: set `text_buckets` to 'auto' or 'off' to run unpadded)"
                     if masked else "")
            raise NotImplementedError(f"`attention`={name!r} cannot run on {device} for {dtype} with head size "
                                      f"{head_dim}{masks}: {why}")
        return AttentionBackend(name, backend_fn(name), "asked for by the config", MASK_COST[name][0])
    skipped = []
    for candidate in AUTO_ORDER.get(device.type, ("sdpa",)):
        why = (fa4_device_reason(device) if candidate == "flash_attn_4" else None) or probe(
            candidate, device, dtype, head_dim, masked)
        if why is None:
            reason = "auto: first available" + (f" (not available: {'; '.join(skipped)})" if skipped else "")
            return AttentionBackend(candidate, backend_fn(candidate), reason, MASK_COST[candidate][0])
        skipped.append(f"{candidate}: {why}")
    raise NotImplementedError(f"`attention`='auto' found no backend on {device} for {dtype} with head size "
                              f"{head_dim}{' with a key mask' if masked else ''}: {'; '.join(skipped)}")


class AttentionUser(nn.Module):
    """Base of a family's attention module: it calls `self.attention_fn(q, k, v[, mask])` ([B, N, L, d])
    instead of SDPA directly, so the runner's chosen backend reaches it (`install`)."""

    attention_fn: AttentionFn = staticmethod(sdpa)  # type: ignore[assignment]
    #: How Ulysses sequence parallel treats this module (runnerkit/parallel/sequence.py): "self" (queries
    #: and keys are the sharded tokens), "joint" (`joint_attention` with replicated prefix tokens), "none"
    #: (keys replicated on every rank: text cross-attention); None: undeclared (Ulysses refuses the model).
    SEQUENCE_PARALLEL: ClassVar[str | None] = None

    def joint_attention(self, q: Tensor, k: Tensor, v: Tensor, prefix: int, mask: Tensor | None = None) -> Tensor:
        """Attention over a joint sequence whose first `prefix` tokens are replicated on every rank
        under sequence parallel ([B, N, L, d] -> [B, N, L, d]); `mask` None or bool [B, 1, 1, L] over
        the whole joint key sequence. One process: `attention_fn(q, k, v[, mask])`."""
        return self.attention_fn(q, k, v) if mask is None else self.attention_fn(q, k, v, mask)


def install(model: nn.Module, backend: AttentionBackend) -> int:
    """Set `backend` on every `AttentionUser` in `model`; returns how many modules took it."""
    users = [m for m in model.modules() if isinstance(m, AttentionUser)]
    for m in users:
        m.attention_fn = backend.fn
    if users:
        logger.debug("attention {} installed on {} modules of {}", backend.name, len(users), type(model).__name__)
    return len(users)
