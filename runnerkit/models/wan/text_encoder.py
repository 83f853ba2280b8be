"""UMT5 text encoder of Wan2.1 (umt5-xxl, encoder only) and its prompt-encoding wrapper.

Source: Wan-Video/Wan2.1 `wan/modules/t5.py` (`T5Encoder` built by `umt5_xxl(encoder_only=True)`,
`shared_pos=False`), checked against transformers' `UMT5EncoderModel`. Each block has its own
bidirectional relative position bias; attention has no 1/sqrt(d) scaling; the FFN is
gated-GELU (tanh); T5 RMS norms are computed in float32; no dropout (inference only).

Parameter names are those of Wan's `models_t5_umt5-xxl-enc-bf16.pth`; `hf_to_native` /
`native_to_hf` convert from/to the transformers layout (diffusers' `text_encoder/`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from runnerkit.models.wan.arch import UMT5Arch
from runnerkit.models.wan.tokenizer import WanTokenizer
from runnerkit.offload.layout import StreamSpec
from runnerkit.weights import CheckpointError, assign_state_dict, build_on_meta, short_list


def keep_fp32(name: str) -> bool:
    """True for the weights that stay float32 whatever the model dtype: the RMS norm scales."""
    return name == "norm.weight" or name.endswith((".norm1.weight", ".norm2.weight"))


def relative_position_buckets(length: int, num_buckets: int, max_distance: int,
                              device: torch.device | None = None) -> torch.LongTensor:
    """Bidirectional T5 buckets of `key - query` for a self-attention over `length` tokens.

    Half of the buckets hold keys after the query. In each half, distances below a quarter of
    `num_buckets` get one bucket each, larger ones log-spaced buckets up to `max_distance`,
    beyond which all share the last bucket (Raffel et al. 2020, T5; Mesh TensorFlow).

    Returns:
        LongTensor [L, L] of bucket ids in [0, num_buckets).
    """
    positions = torch.arange(length, device=device)
    relative = positions[None, :] - positions[:, None]  # [Lq, Lk]
    half = num_buckets // 2
    buckets = (relative > 0).long() * half
    distance = relative.abs()
    max_exact = half // 2
    # The clamp only keeps log() finite; distances below max_exact take the exact branch.
    log_ratio = torch.log(distance.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (half - max_exact)).long()).clamp(max=half - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


def _clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    """Wan's `fp16_clamp`: pull float16 activations back from inf (no-op for other dtypes)."""
    if x.dtype != torch.float16:
        return x
    big = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), x.new_tensor(big - 1000), x.new_tensor(big))
    return torch.clamp(x, -limit, limit)


class T5RMSNorm(nn.Module):
    """T5 layer norm: scale only, no mean subtraction, no bias; statistics in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., D] in x's dtype (the scale multiply is done in float32 too)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class T5Attention(nn.Module):
    """Multi-head self-attention without query scaling; the additive bias carries positions and padding."""

    def __init__(self, dim: int, dim_attn: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim_attn // num_heads
        self.q = nn.Linear(dim, dim_attn, bias=False)
        self.k = nn.Linear(dim, dim_attn, bias=False)
        self.v = nn.Linear(dim, dim_attn, bias=False)
        self.o = nn.Linear(dim_attn, dim, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [B, L, D], bias [B, H, L, L] (added to the logits) -> [B, L, D]."""
        B, L, _ = x.shape
        H, Dh = self.num_heads, self.head_dim
        q = self.q(x).view(B, L, H, Dh).transpose(1, 2)  # [B, H, L, Dh]
        k = self.k(x).view(B, L, H, Dh).transpose(1, 2)
        v = self.v(x).view(B, L, H, Dh).transpose(1, 2)
        # T5 folds 1/sqrt(d) into the initialisation of q, so the logits are not scaled.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)  # [B, H, L, Dh]
        return self.o(out.transpose(1, 2).reshape(B, L, H * Dh))


class T5GatedFeedForward(nn.Module):
    """Gated-GELU FFN: fc2(fc1(x) * gelu_tanh(gate(x))); `gate` is a Sequential so its key is `gate.0`."""

    def __init__(self, dim: int, dim_ffn: int) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), nn.GELU(approximate="tanh"))
        self.fc1 = nn.Linear(dim, dim_ffn, bias=False)
        self.fc2 = nn.Linear(dim_ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, D] -> [B, L, D]."""
        return self.fc2(self.fc1(x) * self.gate(x))


class T5RelativeBias(nn.Module):
    """Learned per-head bias for each relative position bucket."""

    def __init__(self, num_buckets: int, num_heads: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_buckets, num_heads)

    def forward(self, buckets: torch.LongTensor) -> torch.Tensor:
        """buckets [L, L] -> bias [1, H, L, L]."""
        return self.embedding(buckets).permute(2, 0, 1).unsqueeze(0)


class UMT5Block(nn.Module):
    """Pre-norm self-attention + FFN block with its own relative position bias (umt5: not shared)."""

    def __init__(self, arch: UMT5Arch) -> None:
        super().__init__()
        # Registration order follows Wan's T5SelfAttention, so state_dict order matches the .pth.
        self.norm1 = T5RMSNorm(arch.dim, arch.eps)
        self.attn = T5Attention(arch.dim, arch.dim_attn, arch.num_heads)
        self.norm2 = T5RMSNorm(arch.dim, arch.eps)
        self.ffn = T5GatedFeedForward(arch.dim, arch.dim_ffn)
        self.pos_embedding = T5RelativeBias(arch.num_buckets, arch.num_heads)

    def forward(self, x: torch.Tensor, buckets: torch.LongTensor, padding: torch.Tensor) -> torch.Tensor:
        """x [B, L, D], buckets [L, L], padding bool [B, 1, 1, L] (True = pad key) -> [B, L, D]."""
        bias = self.pos_embedding(buckets).to(x.dtype)  # [1, H, L, L]
        bias = bias.masked_fill(padding, torch.finfo(x.dtype).min)  # [B, H, L, L]
        x = _clamp_fp16(x + self.attn(self.norm1(x), bias))
        return _clamp_fp16(x + self.ffn(self.norm2(x)))


class UMT5Encoder(nn.Module):
    """The umt5 encoder stack Wan2.1 uses for text conditioning (Wan `T5Encoder`, shared_pos=False)."""

    STREAM_SPEC: ClassVar[StreamSpec] = StreamSpec(blocks_attr="blocks", phases=("attn", "ffn"), keep_fp32=keep_fp32,
                                                   per_step=False)
    """Layer streaming (`offload.stream_modules` lists "text_encoder"): `blocks[i]`, or its attention and
    FFN (mode "phase": the block's relative position bias is computed before its attention and stays
    resident, as do the float32 norms)."""

    def __init__(self, arch: UMT5Arch) -> None:
        super().__init__()
        if arch.dim_attn % arch.num_heads:
            raise ValueError(f"`dim_attn` ({arch.dim_attn}) must be divisible by `num_heads` ({arch.num_heads})")
        if arch.num_buckets < 4:
            raise ValueError(f"`num_buckets` must be >= 4 (two directions, each with exact and log buckets), "
                             f"got {arch.num_buckets}")
        if arch.max_distance <= arch.num_buckets // 4:
            raise ValueError(f"`max_distance` must be > num_buckets // 4 = {arch.num_buckets // 4}, "
                             f"got {arch.max_distance}")
        self.arch = arch
        self.token_embedding = nn.Embedding(arch.vocab_size, arch.dim)
        self.blocks = nn.ModuleList([UMT5Block(arch) for _ in range(arch.num_layers)])
        self.norm = T5RMSNorm(arch.dim, arch.eps)

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Encode token ids into per-token features.

        Args:
            input_ids: LongTensor [B, L] of token ids (< vocab_size).
            attention_mask: [B, L], 1 for tokens and 0 for padding (any integer, bool or float dtype).
                Padded keys are masked out; padded query rows are computed but meaningless.

        Returns:
            Tensor [B, L, dim] in the dtype of the token embedding.

        Raises:
            ValueError: `input_ids` is not 2-D, or `attention_mask` has a different shape.

        Source: Wan2.1 `wan/modules/t5.py` `T5Encoder.forward`.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"`input_ids` must be [B, L], got shape {tuple(input_ids.shape)}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        B, L = input_ids.shape
        x = self.token_embedding(input_ids)  # [B, L, D]
        buckets = relative_position_buckets(L, self.arch.num_buckets, self.arch.max_distance, input_ids.device)
        padding = (attention_mask == 0).view(B, 1, 1, L)  # [B, 1, 1, L] over keys
        for block in self.blocks:
            x = block(x, buckets, padding)
        return self.norm(x)


def load_umt5_encoder(arch: UMT5Arch, state_dict: dict[str, torch.Tensor],
                      dtype: torch.dtype | None = None) -> UMT5Encoder:
    """Build the encoder on the meta device and assign `state_dict` (native names) strictly.

    Norm scales stay float32 (`keep_fp32`); the rest is cast to `dtype` (None: keep).
    The module is returned in eval mode without gradients, on the state dict's device.

    Raises:
        CheckpointError: listing missing or unexpected keys, or shape mismatches.
    """
    start = time.perf_counter()
    model = build_on_meta(lambda: UMT5Encoder(arch))
    assign_state_dict(model, state_dict, "text_encoder", dtype=dtype, keep_fp32=keep_fp32)
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    logger.info(f"text_encoder: loaded umt5 ({arch.num_layers} layers, {gib:.2f} GiB) "
                f"in {time.perf_counter() - start:.2f} s")
    return model.eval().requires_grad_(False)


# ---- transformers (diffusers `text_encoder/`) layout --------------------------------------

# (transformers name, native name); "{}" is the block index.
_KEY_PAIRS: tuple[tuple[str, str], ...] = (
    ("shared.weight", "token_embedding.weight"),
    *((f"encoder.block.{{}}.layer.0.SelfAttention.{p}.weight", f"blocks.{{}}.attn.{p}.weight") for p in "qkvo"),
    ("encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight",
     "blocks.{}.pos_embedding.embedding.weight"),
    ("encoder.block.{}.layer.0.layer_norm.weight", "blocks.{}.norm1.weight"),
    ("encoder.block.{}.layer.1.DenseReluDense.wi_0.weight", "blocks.{}.ffn.gate.0.weight"),
    ("encoder.block.{}.layer.1.DenseReluDense.wi_1.weight", "blocks.{}.ffn.fc1.weight"),
    ("encoder.block.{}.layer.1.DenseReluDense.wo.weight", "blocks.{}.ffn.fc2.weight"),
    ("encoder.block.{}.layer.1.layer_norm.weight", "blocks.{}.norm2.weight"),
    ("encoder.final_layer_norm.weight", "norm.weight"),
)
HF_EMBED_ALIAS = "encoder.embed_tokens.weight"  # tied to shared.weight in UMT5EncoderModel


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)"))


def _rename(state_dict: Mapping[str, torch.Tensor], pairs: list[tuple[str, str]],
            layout: str) -> dict[str, torch.Tensor]:
    rules = [(_pattern(src), dst) for src, dst in pairs]
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state_dict.items():
        for pattern, target in rules:
            match = pattern.fullmatch(key)
            if match:
                out[target.format(*match.groups())] = tensor
                break
        else:
            unknown.append(key)
    if unknown:
        raise CheckpointError(f"text_encoder: {len(unknown)} keys unknown to the {layout} umt5 encoder layout: "
                              f"{short_list(sorted(unknown))}")
    return out


def hf_to_native(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers `UMT5EncoderModel` names -> Wan's native names (tensors are not copied).

    The token embedding may come as `shared.weight`, `encoder.embed_tokens.weight` or both (tied;
    they must then be equal).

    Raises:
        CheckpointError: unknown keys (listed), or the two embedding copies differ.
    """
    state_dict = dict(state_dict)
    alias = state_dict.pop(HF_EMBED_ALIAS, None)
    if alias is not None:
        shared = state_dict.setdefault("shared.weight", alias)
        same_storage = shared.shape == alias.shape and shared.data_ptr() == alias.data_ptr()
        if not (same_storage or (shared.shape == alias.shape and torch.equal(shared, alias))):
            raise CheckpointError(f"text_encoder: `shared.weight` and `{HF_EMBED_ALIAS}` are both present and differ; "
                                  "a UMT5 encoder ties them")
    return _rename(state_dict, list(_KEY_PAIRS), "transformers")


def native_to_hf(state_dict: Mapping[str, torch.Tensor], embed_tokens_alias: bool = True) -> dict[str, torch.Tensor]:
    """Wan's native names -> transformers `UMT5EncoderModel` names (tensors are not copied).

    Args:
        embed_tokens_alias: also emit `encoder.embed_tokens.weight` (the same tensor as
            `shared.weight`), as `UMT5EncoderModel.state_dict()` has it. Pass False to save with
            safetensors, which refuses tensors that share memory.

    Raises:
        CheckpointError: unknown keys (listed).
    """
    out = _rename(state_dict, [(dst, src) for src, dst in _KEY_PAIRS], "native")
    if embed_tokens_alias and "shared.weight" in out:
        out[HF_EMBED_ALIAS] = out["shared.weight"]
    return out


# Config keys that change the encoder's math, with the only values it implements.
_HF_FIXED: dict[str, tuple[Any, ...]] = {
    "model_type": ("umt5",),
    "feed_forward_proj": ("gated-gelu",),
    "dense_act_fn": ("gelu_new", "gelu_pytorch_tanh"),
    "is_gated_act": (True,),
    "is_decoder": (False,),
}
_HF_REQUIRED = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads")
# Keys with a UMT5Config default, and that default.
_HF_DEFAULTS: dict[str, Any] = {
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
}


def arch_from_hf_config(config: Mapping[str, Any], text_len: int = 512) -> UMT5Arch:
    """A transformers `UMT5Config` dict (diffusers `text_encoder/config.json`) -> `UMT5Arch`.

    Keys that do not affect the encoder (dropout, token ids, `architectures`, ...) are ignored.

    Raises:
        ValueError: a required key is missing, or a key holds a value the encoder does not implement.
    """
    for key, allowed in _HF_FIXED.items():
        if key in config and config[key] not in allowed:
            raise ValueError(f"`{key}`: {config[key]!r} is not supported by the umt5 encoder; allowed: {list(allowed)}")
    missing = [key for key in _HF_REQUIRED if key not in config]
    if missing:
        raise ValueError(f"UMT5 config lacks required keys {missing}; it has {sorted(config)}")
    c = {**_HF_DEFAULTS, **config}
    return UMT5Arch(
        vocab_size=c["vocab_size"], dim=c["d_model"], dim_attn=c["d_kv"] * c["num_heads"], dim_ffn=c["d_ff"],
        num_heads=c["num_heads"], num_layers=c["num_layers"], num_buckets=c["relative_attention_num_buckets"],
        max_distance=c["relative_attention_max_distance"], eps=c["layer_norm_epsilon"], text_len=text_len,
    )


def arch_to_hf_config(arch: UMT5Arch) -> dict[str, Any]:
    """`UMT5Arch` -> the keys of a transformers `UMT5Config` for a `UMT5EncoderModel` (`text_len` is not one).

    Raises:
        ValueError: `dim_attn` is not a multiple of `num_heads` (transformers has no such layout).
    """
    if arch.dim_attn % arch.num_heads:
        raise ValueError(f"`dim_attn` ({arch.dim_attn}) must be divisible by `num_heads` ({arch.num_heads})")
    return {
        "architectures": ["UMT5EncoderModel"], "model_type": "umt5",
        "vocab_size": arch.vocab_size, "d_model": arch.dim, "d_kv": arch.dim_attn // arch.num_heads,
        "d_ff": arch.dim_ffn, "num_layers": arch.num_layers, "num_heads": arch.num_heads,
        "relative_attention_num_buckets": arch.num_buckets, "relative_attention_max_distance": arch.max_distance,
        "layer_norm_epsilon": arch.eps, "feed_forward_proj": "gated-gelu",
        "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
    }


# ---- prompt encoding -----------------------------------------------------------------------

class WanTextEncoder:
    """Tokenizer + umt5 encoder: prompts -> per-prompt text embeddings (Wan `T5EncoderModel`)."""

    def __init__(self, tokenizer: WanTokenizer, encoder: UMT5Encoder) -> None:
        if tokenizer.vocab_size > encoder.arch.vocab_size:
            raise ValueError(f"`tokenizer` ({tokenizer.source}) has {tokenizer.vocab_size} ids but the encoder "
                             f"embeds only {encoder.arch.vocab_size}")
        self.tokenizer = tokenizer
        self.encoder = encoder

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """Encode `prompts`, each trimmed to its own token count (eos included).

        Prompts are padded/truncated to `arch.text_len` tokens, encoded together, and each
        output is cut to the prompt's mask sum, as Wan's `T5EncoderModel.__call__` does.

        Returns:
            B tensors [L_i, dim] on the encoder's device, in its embedding dtype.

        Raises:
            ValueError: `prompts` is empty or holds a non-string.
        """
        weight = self.encoder.token_embedding.weight
        ids, mask = self.tokenizer(prompts, self.encoder.arch.text_len)  # [B, text_len] each
        lengths = mask.sum(dim=1).tolist()  # on the CPU: no device sync
        context = self.encoder(ids.to(weight.device), mask.to(weight.device))  # [B, text_len, dim]
        return [row[:n] for row, n in zip(context, lengths)]
