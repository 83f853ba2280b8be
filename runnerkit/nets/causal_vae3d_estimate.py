"""Activation bytes of the causal 3D VAE's decoder, walked layer by layer on a meta-built network.

    cache, peak = vae_chunk_bytes(arch, h, w, device_type)   # decoding one later latent frame of h x w

The decoder keeps a feature cache of two frames per causal convolution across the latent frames it
decodes one at a time; `vae_chunk_bytes` returns that cache and the largest transient of one frame
(float32 activations: the decoder runs in float32), counting each layer's input, output, `F.pad`
copy and convolution workspace (`runnerkit.planning.workspaces.conv_workspace`). Families whose
VAE is this network (runnerkit/nets/causal_vae3d.py) build their decode estimate on it.
"""

from __future__ import annotations

import functools
import math

from torch import nn

from runnerkit.nets.causal_vae3d import CausalVAE3D
from runnerkit.nets.causal_vae3d_arch import CausalVAE3DArch
from runnerkit.nets.causal_vae3d_blocks import AttentionBlock, CausalConv3d, Decoder3d, Resample, ResidualBlock
from runnerkit.planning.workspaces import F32, conv_workspace, sdpa_workspace
from runnerkit.weights import build_on_meta

__all__ = ["vae_chunk_bytes", "video_bytes"]


@functools.lru_cache(maxsize=8)
def _meta_decoder(arch: CausalVAE3DArch) -> Decoder3d:
    return build_on_meta(lambda: CausalVAE3D(arch)).decoder


class _Walk:
    """Running peak of a decoder chunk: `cache` (feature cache) and the transients of each layer."""

    def __init__(self, device_type: str, e: int) -> None:
        self.device_type, self.e = device_type, e
        self.cache = 0
        self.peak = 0

    def at(self, live: int) -> None:
        self.peak = max(self.peak, live)

    def conv(self, conv: nn.Module, shape: tuple[int, ...], held: int, cached: bool) -> int:
        """A convolution with `held` bytes alive around it (its input among them); returns its output bytes.

        `shape`: [C, T, H, W] for a `CausalConv3d` (batch 1), [N, C, H, W] for an `nn.Conv2d`. A causal
        convolution copies its input with `F.pad`; with `cached`, it first stores two frames of its
        input in the feature cache (beside the previous ones until it returns) and concatenates the
        previous two frames in front.
        """
        e = self.e
        w = conv.weight
        cout, _cin, *k = w.shape
        weight_bytes = w.numel() * e
        if isinstance(conv, CausalConv3d):
            C, T, H, W = shape
            pw, ph, pt = conv.causal_padding[0], conv.causal_padding[2], conv.causal_padding[4]
            frame = C * H * W * e
            extra, t_in = 0, T + pt
            if cached and pt > 0:
                extra = 2 * frame + (T + 2) * frame  # new cache tail + [cache, x] concatenation
                self.cache += 2 * frame
                t_in = T + 2
            padded_shape: tuple[int, ...] = (1, C, t_in, H + 2 * ph, W + 2 * pw)
            copy = math.prod(padded_shape) * e  # F.pad's output
            positions = (t_in - k[0] + 1) * H * W
            dispatch_shape = padded_shape
        else:  # nn.Conv2d on [N, C, H, W] with its own padding: no padded copy
            N, C, H, W = shape
            extra, copy = 0, 0
            positions = N * H * W
            dispatch_shape = shape
        out = cout * positions * e
        in_bytes = copy or math.prod(shape) * e
        ws = conv_workspace(self.device_type, dispatch_shape, in_bytes, positions, math.prod(k), weight_bytes, out, e)
        self.at(held + extra + copy + out + ws)
        return out

    def norm_act(self, size: int, held: int) -> int:
        """RMSNorm (normalized, scaled and gamma-scaled copies: 3 at once) then SiLU; returns the activation."""
        self.at(held + 3 * size)
        self.at(held + 2 * size)
        return size

    def residual(self, block: ResidualBlock, shape: tuple[int, int, int, int], held: int) -> tuple[int, int, int, int]:
        e = self.e
        C, T, H, W = shape
        cout = block.residual[2].weight.shape[0]
        a_in, a_out = C * T * H * W * e, cout * T * H * W * e
        held_in = held + a_in
        if isinstance(block.shortcut, CausalConv3d):
            h = self.conv(block.shortcut, shape, held_in, cached=False)
        else:
            h = 0
        act = self.norm_act(a_in, held_in + h)
        self.conv(block.residual[2], shape, held_in + h + act, cached=True)
        act2 = self.norm_act(a_out, held_in + h + a_out)
        self.conv(block.residual[6], (cout, T, H, W), held_in + h + a_out + act2, cached=True)
        self.at(held_in + h + 3 * a_out)
        return cout, T, H, W

    def attention(self, block: AttentionBlock, shape: tuple[int, int, int, int], held: int) -> None:
        C, T, H, W = shape
        a = C * T * H * W * self.e
        base = held + 2 * a  # input (the identity) + its [B*T, C, H, W] copy
        self.norm_act(a, base)
        qkv = self.conv(block.to_qkv, (T, C, H, W), base + a, cached=False)
        self.at(base + 2 * qkv)  # contiguous copy of the reshaped qkv
        self.at(base + qkv + a + sdpa_workspace(self.device_type, 1, T * H * W, C, self.e))
        self.conv(block.proj, (T, C, H, W), held + a + qkv + a, cached=False)  # identity, qkv, reshaped output

    def resample(self, block: Resample, shape: tuple[int, int, int, int], held: int) -> tuple[int, int, int, int]:
        e = self.e
        C, T, H, W = shape
        a = C * T * H * W * e
        held_in = held + a
        if block.mode == "upsample3d":
            doubled = self.conv(block.time_conv, shape, held_in, cached=True)
            self.at(held_in + 2 * doubled)  # view/permute/reshape copy of the doubled frames
            T *= 2
        a2 = C * T * H * W * e
        up = 4 * a2  # nearest 2x of the [B*T, C, H, W] copy
        self.conv(block.resample[1], (T, C, 2 * H, 2 * W), held_in + a2 + up, cached=False)
        return block.resample[1].weight.shape[0], T, 2 * H, 2 * W


def vae_chunk_bytes(arch: CausalVAE3DArch, h: int, w: int, device_type: str) -> tuple[int, int]:
    """(feature cache, largest transient) of decoding one later latent frame of an h x w latent grid."""
    decoder = _meta_decoder(arch)
    walk = _Walk(device_type, F32)
    z = arch.z_dim
    C0 = decoder.conv1.weight.shape[0]
    a0 = C0 * h * w * F32
    walk.conv(decoder.conv1, (z, 1, h, w), z * h * w * F32, cached=True)
    res1, attention, res2 = decoder.middle
    walk.residual(res1, (C0, 1, h, w), 0)  # its input is the decoder's x
    walk.attention(attention, (C0, 1, h, w), a0)
    walk.residual(res2, (C0, 1, h, w), a0)
    shape: tuple[int, int, int, int] = (C0, 1, h, w)
    for block in decoder.upsamples:
        if isinstance(block, ResidualBlock):
            shape = walk.residual(block, shape, 0)
        else:
            assert isinstance(block, Resample), f"unexpected decoder block {type(block).__name__}"
            shape = walk.resample(block, shape, 0)
    C, T, H, W = shape
    a = C * T * H * W * F32
    act = walk.norm_act(a, a)
    walk.conv(decoder.head[2], shape, a + act, cached=True)
    return walk.cache, walk.peak


def video_bytes(frames: int, height: int, width: int) -> int:
    """A decoded float32 video [3, F, H, W]."""
    return 3 * frames * height * width * F32
