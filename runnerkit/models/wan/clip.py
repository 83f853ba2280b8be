"""CLIP ViT-H/14 image encoder of Wan2.1 i2v / flf2v, in the original release's key names.

Design and numerics follow the vision tower of Wan-Video/Wan2.1 `wan/modules/clip.py`
(`VisionTransformer` inside `XLMRobertaCLIP`, open-clip xlm-roberta-large-vit-huge-14, shipped
as `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` under the `visual.` prefix): a
bias-free Conv2d patch embedding, a class token, learned position embeddings, a LayerNorm
before the blocks (`pre_norm`), then pre-norm blocks of fused-qkv self-attention and an
exact-GELU MLP. Wan conditions on the penultimate hidden states (`use_31_block=True`: the
output of all blocks but the last, no final norm), so only the first `num_layers - 1` blocks
are built; the last block, `post_norm` and `head` of the checkpoint are never used.

The residual stream and the LayerNorms run in float32; every matmul runs in the dtype of its
own weight. Key maps to and from the release and transformers' `CLIPVisionModel` layouts
live in `clip_keys.py`.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runnerkit.models.wan.arch import CLIPVisionArch
from runnerkit.models.wan.transformer import FP32LayerNorm

# OpenAI CLIP pixel statistics (Wan `_clip`: every non-SigLIP CLIP), per RGB channel.
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

# LayerNorms and the (small) class and position embeddings stay float32 whatever the weight dtype.
_FP32_PATTERN = re.compile(r"(^|\.)(pre_norm|norm1|norm2)\.(weight|bias)$|^(cls_embedding|pos_embedding)$")


def keep_fp32(name: str) -> bool:
    """Whether the native CLIP parameter `name` stays float32 (for `assign_state_dict(keep_fp32=...)`)."""
    return _FP32_PATTERN.search(name) is not None


def clip_preprocess(images: Tensor, image_size: int = 224) -> Tensor:
    """Wan's CLIP input transform (`CLIPModel.visual`), on tensors.

    Each image is squashed (no crop, aspect ratio not kept) to `image_size` x `image_size` by
    bicubic interpolation (`align_corners=False`, no antialiasing), mapped from [-1, 1] to
    [0, 1], then normalised with the CLIP mean and std.

    Args:
        images: [B, 3, H, W] in [-1, 1] (any float dtype, any H, W).
        image_size: output side (the arch's `image_size`).

    Returns:
        [B, 3, image_size, image_size] float32.

    Raises:
        ValueError: `images` is not [B, 3, H, W].
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"`images` must be [B, 3, H, W] in [-1, 1], got shape {tuple(images.shape)}")
    x = F.interpolate(images.float(), size=(image_size, image_size), mode="bicubic", align_corners=False)
    x = x * 0.5 + 0.5  # [-1, 1] -> [0, 1]
    mean = torch.tensor(CLIP_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


class CLIPSelfAttention(nn.Module):
    """Multi-head self-attention with one fused q/k/v projection (Wan `clip.SelfAttention`)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, L, dim] -> [B, L, dim] (weight dtype)."""
        B, L, D = x.shape
        qkv = self.to_qkv(x.to(self.to_qkv.weight.dtype))  # [B, L, 3*dim]
        q, k, v = qkv.view(B, L, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # each [B, N, L, d]
        out = F.scaled_dot_product_attention(q, k, v)  # [B, N, L, d]
        return self.proj(out.transpose(1, 2).reshape(B, L, D))  # [B, L, dim]


class CLIPBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)) with an exact-GELU MLP."""

    def __init__(self, arch: CLIPVisionArch) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(arch.dim, arch.eps)
        self.attn = CLIPSelfAttention(arch.dim, arch.num_heads)
        self.norm2 = FP32LayerNorm(arch.dim, arch.eps)
        self.mlp = nn.Sequential(nn.Linear(arch.dim, arch.ffn_dim), nn.GELU(), nn.Linear(arch.ffn_dim, arch.dim))

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, L, dim] float32 residual stream -> [B, L, dim] float32."""
        x = x + self.attn(self.norm1(x)).float()
        return x + self.mlp(self.norm2(x).to(self.mlp[0].weight.dtype)).float()


class CLIPVisionEncoder(nn.Module):
    """CLIP ViT vision tower returning the penultimate hidden states (Wan `use_31_block=True`).

    Holds `num_layers - 1` blocks (`transformer.0` ... `transformer.{num_layers - 2}`); for
    ViT-H/14 at 224 pixels the output is [B, 257, 1280] (class token + 16 x 16 patches).
    Buildable on the meta device (no buffers), for `build_on_meta` + `assign_state_dict`.
    """

    def __init__(self, arch: CLIPVisionArch) -> None:
        super().__init__()
        self.arch = arch
        dim = arch.dim
        self.num_patches = (arch.image_size // arch.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(3, dim, kernel_size=arch.patch_size, stride=arch.patch_size, bias=False)
        self.cls_embedding = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.zeros(1, self.num_patches + 1, dim))
        self.pre_norm = FP32LayerNorm(dim, arch.eps)
        self.transformer = nn.ModuleList([CLIPBlock(arch) for _ in range(arch.num_layers - 1)])

    def forward(self, pixels: Tensor) -> Tensor:
        """Penultimate hidden states of normalised images.

        Args:
            pixels: [B, 3, image_size, image_size], the output of `clip_preprocess`.

        Returns:
            [B, 1 + (image_size / patch_size)^2, dim] float32 (ViT-H/14: [B, 257, 1280]): the
            output of block `num_layers - 1` (1-based), without the final LayerNorm; equal to
            transformers' `CLIPVisionModel(..., output_hidden_states=True).hidden_states[-2]`.

        Raises:
            ValueError: `pixels` is not [B, 3, image_size, image_size].

        Source: Wan-Video/Wan2.1 `wan/modules/clip.py` (`VisionTransformer.forward`).
        """
        size = self.arch.image_size
        if pixels.ndim != 4 or pixels.shape[1:] != (3, size, size):
            raise ValueError(f"`pixels` must be [B, 3, {size}, {size}] (see `clip_preprocess`), "
                             f"got shape {tuple(pixels.shape)}")
        B = pixels.shape[0]
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # [B, dim, g, g]
        x = x.flatten(2).transpose(1, 2).float()  # [B, g*g, dim]
        x = torch.cat([self.cls_embedding.float().expand(B, -1, -1), x], dim=1)  # [B, 1 + g*g, dim]
        x = self.pre_norm(x + self.pos_embedding.float())
        for block in self.transformer:
            x = block(x)
        return x

    def encode(self, images: Tensor) -> Tensor:
        """`forward(clip_preprocess(images))`: images [B, 3, H, W] in [-1, 1] -> [B, 257, dim] float32."""
        return self(clip_preprocess(images, self.arch.image_size).to(self.patch_embedding.weight.device))
