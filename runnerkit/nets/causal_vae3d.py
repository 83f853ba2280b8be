"""The causal 3D video VAE: 4x temporal and 8x spatial compression to 16 latent channels.

Source: the 2.1 release's reference VAE (its `modules/vae.py`; the repository is named in
docs/architecture.md, "Shared code") and its diffusers port `AutoencoderKLWan`
(models/autoencoders/autoencoder_kl_wan.py). Key names are those of the released `.pth`
("native" names); `diffusers_to_native` / `native_to_diffusers` rename to and from diffusers'
`AutoencoderKLWan`. Families run it with their own weights and latent statistics
(`CausalVAE3DArch.latents_mean` / `latents_std`) and translate their diffusers configs with
`DIFFUSERS_CONFIG_FIELDS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from runnerkit.nets.causal_vae3d_arch import CausalVAE3DArch
from runnerkit.nets.causal_vae3d_blocks import CausalConv3d, Decoder3d, Encoder3d, FeatureCache
from runnerkit.weights import CheckpointError, load_on_meta

# Frames per encoder chunk after the first frame (the reference's fixed chunking); it equals
# the temporal compression, so each chunk becomes one latent frame.
ENCODE_CHUNK_FRAMES = 4


class CausalVAE3D(nn.Module):
    """The causal 3D VAE (the reference's `VAE_` class): `encoder`, `conv1` (posterior), `conv2`
    (post-quant), `decoder`.

    Build with `build_causal_vae3d` (meta device + strict load), or construct and load weights.

    Raises:
        ValueError: no `dim_mult` level, or a `latents_std` value is not positive (lengths are
            checked by `CausalVAE3DArch`).
        NotImplementedError: non-empty `attn_scales` (the reference cannot run them with its
            feature cache) or a temporal compression other than 4 (the reference's chunking).
    """

    def __init__(self, arch: CausalVAE3DArch) -> None:
        super().__init__()
        check_arch(arch)
        self.arch = arch
        self.z_dim = arch.z_dim
        self.temporal_factor = 2 ** sum(arch.temporal_downsample)
        self.spatial_factor = 2 ** (len(arch.dim_mult) - 1)
        self.encoder = Encoder3d(arch.dim, 2 * arch.z_dim, arch.dim_mult, arch.num_res_blocks,
                                 arch.temporal_downsample)
        self.conv1 = CausalConv3d(2 * arch.z_dim, 2 * arch.z_dim, 1)
        self.conv2 = CausalConv3d(arch.z_dim, arch.z_dim, 1)
        self.decoder = Decoder3d(arch.dim, arch.z_dim, arch.dim_mult, arch.num_res_blocks,
                                 arch.temporal_downsample[::-1])
        self._cache: FeatureCache | None = None

    # ---- feature cache -------------------------------------------------------------------

    @property
    def feature_cache(self) -> FeatureCache | None:
        """The cache of the encode/decode in progress; None between calls."""
        return self._cache

    def clear_cache(self) -> None:
        """Drop the feature cache (the frames carried between chunks) and free its tensors.

        A `decode_iter` still in progress then raises RuntimeError at its next chunk.
        """
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def _open_cache(self) -> FeatureCache:
        self.clear_cache()  # as the reference, every call starts from an empty cache
        self._cache = FeatureCache()
        return self._cache

    def _close_cache(self, cache: FeatureCache) -> None:
        cache.close()
        # Only forget our own cache: an abandoned `decode_iter` finalized late must not touch
        # the cache of a newer call.
        if self._cache is cache:
            self._cache = None

    # ---- encode --------------------------------------------------------------------------

    @torch.no_grad()
    def encode_raw(self, video: Tensor) -> Tensor:
        """Posterior mean of `video`, not normalized (diffusers' `encode(x).latent_dist.mean`).

        Args:
            video: [B, 3, F, H, W] in [-1, 1], F = 4n + 1, H and W multiples of 8; moved to the
                weights' device and dtype.

        Returns:
            [B, z_dim, (F - 1) // 4 + 1, H / 8, W / 8] in the weight dtype.

        Raises:
            ValueError: `video` has the wrong rank, channels, frame count, size or dtype.
        """
        self._check_video(video)
        weight = self.conv1.weight
        x = video.to(device=weight.device, dtype=weight.dtype)
        # The first frame alone, then chunks of 4: each chunk becomes one latent frame.
        # (a 1-frame video has no chunk of 4: `split` of an empty dimension would give one empty chunk)
        rest = x[:, :, 1:].split(ENCODE_CHUNK_FRAMES, dim=2) if x.shape[2] > 1 else ()
        chunks = [x[:, :, :1], *rest]  # [B, 3, 1 | 4, H, W]
        cache = self._open_cache()
        try:
            out = torch.cat([self.encoder(chunk, cache) for chunk in chunks], dim=2)  # [B, 2z, f, h, w]
            mu, _log_var = self.conv1(out).chunk(2, dim=1)  # [B, z, f, h, w] each
        finally:
            self._close_cache(cache)
        return mu

    def encode(self, video: Tensor) -> Tensor:
        """Normalized latents of `video`: (mu - mean) / std per channel (the reference's `encode`).

        The reference uses the posterior mean; nothing is sampled.

        Args:
            video: [B, 3, F, H, W] in [-1, 1], F = 4n + 1, H and W multiples of 8.

        Returns:
            [B, z_dim, (F - 1) // 4 + 1, H / 8, W / 8], float32.

        Raises:
            ValueError: `video` has the wrong rank, channels, frame count, size or dtype.
        """
        mu = self.encode_raw(video).float()
        mean, std = self._latent_stats(mu.device)
        return (mu - mean) / std

    # ---- decode --------------------------------------------------------------------------

    def decode_raw(self, latents: Tensor) -> Tensor:
        """Decode latents that are NOT normalized (diffusers' `decode(z).sample`).

        Args:
            latents: [B, z_dim, f, h, w]; moved to the weights' device and dtype.

        Returns:
            [B, 3, 4 (f - 1) + 1, 8h, 8w] in [-1, 1], in the weight dtype.

        Raises:
            ValueError: `latents` has the wrong rank, channels or dtype.
        """
        self._check_latents(latents)
        weight = self.conv2.weight
        z = latents.to(device=weight.device, dtype=weight.dtype)
        return torch.cat(list(self._decode_frames(z, out_dtype=weight.dtype)), dim=2)

    def decode_iter(self, latents: Tensor) -> Iterator[Tensor]:
        """Decode normalized latents one latent frame at a time (the reference's `decode`).

        Un-normalizes (z * std + mean, float32), then yields the video of each latent frame:
        [B, 3, 1, 8h, 8w] for the first, [B, 3, 4, 8h, 8w] for each later one, float32 in
        [-1, 1]. The feature cache is dropped when the iterator is exhausted, closed or fails.

        Args:
            latents: [B, z_dim, f, h, w], normalized as `encode` returns them.

        Raises:
            ValueError: `latents` has the wrong rank, channels or dtype (raised here, before
                the first chunk).
        """
        self._check_latents(latents)
        weight = self.conv2.weight
        mean, std = self._latent_stats(latents.device)
        z = latents.float() * std + mean  # [B, z, f, h, w]
        return self._decode_frames(z.to(device=weight.device, dtype=weight.dtype), out_dtype=torch.float32)

    def decode(self, latents: Tensor) -> Tensor:
        """Decode normalized latents to video: the concatenation of `decode_iter`.

        Args:
            latents: [B, z_dim, f, h, w], normalized as `encode` returns them.

        Returns:
            [B, 3, 4 (f - 1) + 1, 8h, 8w], float32 in [-1, 1].

        Raises:
            ValueError: `latents` has the wrong rank, channels or dtype.
        """
        return torch.cat(list(self.decode_iter(latents)), dim=2)

    @torch.no_grad()
    def _decode_frames(self, z: Tensor, out_dtype: torch.dtype) -> Iterator[Tensor]:
        """Un-normalized latents [B, z, f, h, w] -> one video chunk per latent frame, clamped."""
        cache = self._open_cache()
        try:
            x = self.conv2(z)  # [B, z, f, h, w]
            for i in range(x.shape[2]):
                frames = self.decoder(x[:, :, i:i + 1], cache)  # [B, 3, 1 | 4, 8h, 8w]
                yield frames.clamp_(-1.0, 1.0).to(out_dtype)
        finally:
            self._close_cache(cache)

    # ---- checks and helpers ----------------------------------------------------------------

    def _latent_stats(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """Per-channel latent mean and std, float32, each [1, z_dim, 1, 1, 1]."""
        mean = torch.tensor(self.arch.latents_mean, dtype=torch.float32, device=device)
        std = torch.tensor(self.arch.latents_std, dtype=torch.float32, device=device)
        return mean.view(1, -1, 1, 1, 1), std.view(1, -1, 1, 1, 1)

    def _check_video(self, video: Tensor) -> None:
        s, t = self.spatial_factor, self.temporal_factor
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"`video` must be [B, 3, F, H, W]; got shape {tuple(video.shape)}")
        B, C, F, H, W = video.shape
        if F % t != 1 or H % s or W % s or H == 0 or W == 0:
            raise ValueError(f"`video` must have F = {t}n + 1 frames and H, W positive multiples of {s}; "
                             f"got F={F}, H={H}, W={W}")
        if not video.is_floating_point():
            raise ValueError(f"`video` must be a floating tensor with values in [-1, 1]; got dtype {video.dtype}")

    def _check_latents(self, latents: Tensor) -> None:
        if latents.ndim != 5 or latents.shape[1] != self.z_dim or 0 in latents.shape:
            raise ValueError(f"`latents` must be [B, {self.z_dim}, f, h, w] with no empty dimension; "
                             f"got shape {tuple(latents.shape)}")
        if not latents.is_floating_point():
            raise ValueError(f"`latents` must be a floating tensor; got dtype {latents.dtype}")


def check_arch(arch: CausalVAE3DArch) -> None:
    """Raise if `arch` is not a VAE this implementation runs (see `CausalVAE3D` for the errors)."""
    # The lengths of `temporal_downsample`, `latents_mean` and `latents_std` are checked by
    # `CausalVAE3DArch` itself (causal_vae3d_arch.py), so a config is refused before anything loads.
    if not arch.dim_mult:
        raise ValueError("`dim_mult` must have at least one level; got ()")
    if min(arch.latents_std) <= 0:
        raise ValueError(f"`latents_std` must be positive; got {arch.latents_std}")
    if arch.attn_scales:
        raise NotImplementedError(f"`attn_scales` must be empty (the reference's encoder/decoder attention per scale "
                                  f"cannot run with the feature cache); got {arch.attn_scales}")
    if 2 ** sum(arch.temporal_downsample) != ENCODE_CHUNK_FRAMES:
        raise NotImplementedError(f"`temporal_downsample` must halve time exactly twice (4x, the reference's "
                                  f"{ENCODE_CHUNK_FRAMES}-frame chunks); got {arch.temporal_downsample}")


def build_causal_vae3d(arch: CausalVAE3DArch, state_dict: dict[str, Tensor],
                       dtype: torch.dtype | None = None) -> CausalVAE3D:
    """Build `CausalVAE3D` on the meta device and load `state_dict` (native key names) strictly.

    Args:
        arch: the architecture.
        state_dict: native names (convert diffusers weights with `diffusers_to_native`).
        dtype: weight dtype (float32 or bfloat16); None keeps the checkpoint's.

    Raises:
        CheckpointError: listing missing / unexpected keys or shape mismatches.
    """
    return load_on_meta(lambda: CausalVAE3D(arch), state_dict, component="vae", dtype=dtype)


# ---- diffusers <-> native key names -------------------------------------------------------

# Inside a residual block: native leaf name -> diffusers leaf name.
_RESNET_LEAVES = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
_RESNET_LEAVES_BACK = {v: k for k, v in _RESNET_LEAVES.items()}
# Leaves named the same in both layouts.
_RESAMPLE_LEAVES = frozenset({"resample.1.weight", "resample.1.bias", "time_conv.weight", "time_conv.bias"})
_ATTENTION_LEAVES = frozenset({"norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias"})
# Outside the repeated blocks: native -> diffusers, for the encoder ("{}" = encoder / decoder).
_FIXED_NAMES = {
    "conv1.weight": "quant_conv.weight",
    "conv1.bias": "quant_conv.bias",
    "conv2.weight": "post_quant_conv.weight",
    "conv2.bias": "post_quant_conv.bias",
    **{f"{part}.{native}": f"{part}.{diffusers}" for part in ("encoder", "decoder") for native, diffusers in (
        ("conv1.weight", "conv_in.weight"), ("conv1.bias", "conv_in.bias"), ("head.0.gamma", "norm_out.gamma"),
        ("head.2.weight", "conv_out.weight"), ("head.2.bias", "conv_out.bias"))},
}
_FIXED_NAMES_BACK = {v: k for k, v in _FIXED_NAMES.items()}


def native_to_diffusers(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a native state dict to diffusers' `AutoencoderKLWan` names (tensors shared).

    The decoder's flat `upsamples.N` list is regrouped into `up_blocks.L.resnets.J` /
    `up_blocks.L.upsamplers.0`; the blocks per level are read from where the first upsampler is.

    Raises:
        CheckpointError: listing the keys that are not native names of this VAE.
    """
    upsampler_indices = [int(m[1]) for k in state_dict
                         if (m := re.fullmatch(r"decoder\.upsamples\.(\d+)\.(.+)", k)) and m[2] in _RESAMPLE_LEAVES]
    # Entries per decoder level: its residual blocks plus one upsampler (none after the last level).
    per_level = min(upsampler_indices) + 1 if upsampler_indices else len(state_dict) + 1
    return _rename(state_dict, lambda name: _native_name_to_diffusers(name, per_level), "native causal 3D VAE")


def diffusers_to_native(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an `AutoencoderKLWan` (non-residual) state dict to native names.

    Raises:
        CheckpointError: listing the keys that are not AutoencoderKLWan (non-residual) names.
    """
    resnet_indices = {int(m[1]) for k in state_dict if (m := re.fullmatch(r"decoder\.up_blocks\.0\.resnets\.(\d+)\..+", k))}
    resnets_per_level = max(resnet_indices) + 1 if resnet_indices else 0
    return _rename(state_dict, lambda name: _diffusers_name_to_native(name, resnets_per_level),
                   "diffusers AutoencoderKLWan (non-residual)")


def _native_name_to_diffusers(name: str, per_level: int) -> str | None:
    if name in _FIXED_NAMES:
        return _FIXED_NAMES[name]
    if m := re.fullmatch(r"(encoder|decoder)\.middle\.(\d)\.(.+)", name):
        part, index, leaf = m[1], int(m[2]), m[3]
        if index in (0, 2) and leaf in _RESNET_LEAVES:
            return f"{part}.mid_block.resnets.{index // 2}.{_RESNET_LEAVES[leaf]}"
        if index == 1 and leaf in _ATTENTION_LEAVES:
            return f"{part}.mid_block.attentions.0.{leaf}"
    elif m := re.fullmatch(r"encoder\.downsamples\.(\d+)\.(.+)", name):
        index, leaf = m[1], m[2]
        if leaf in _RESNET_LEAVES:
            return f"encoder.down_blocks.{index}.{_RESNET_LEAVES[leaf]}"
        if leaf in _RESAMPLE_LEAVES:
            return f"encoder.down_blocks.{index}.{leaf}"
    elif m := re.fullmatch(r"decoder\.upsamples\.(\d+)\.(.+)", name):
        (level, position), leaf = divmod(int(m[1]), per_level), m[2]
        if position < per_level - 1 and leaf in _RESNET_LEAVES:
            return f"decoder.up_blocks.{level}.resnets.{position}.{_RESNET_LEAVES[leaf]}"
        if position == per_level - 1 and leaf in _RESAMPLE_LEAVES:
            return f"decoder.up_blocks.{level}.upsamplers.0.{leaf}"
    return None


def _diffusers_name_to_native(name: str, resnets_per_level: int) -> str | None:
    if name in _FIXED_NAMES_BACK:
        return _FIXED_NAMES_BACK[name]
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", name):
        part, index, leaf = m[1], int(m[2]), m[3]
        if index in (0, 1) and leaf in _RESNET_LEAVES_BACK:
            return f"{part}.middle.{2 * index}.{_RESNET_LEAVES_BACK[leaf]}"
    elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", name):
        if m[2] in _ATTENTION_LEAVES:
            return f"{m[1]}.middle.1.{m[2]}"
    elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.+)", name):
        index, leaf = m[1], m[2]
        if leaf in _RESNET_LEAVES_BACK:
            return f"encoder.downsamples.{index}.{_RESNET_LEAVES_BACK[leaf]}"
        if leaf in _RESAMPLE_LEAVES:
            return f"encoder.downsamples.{index}.{leaf}"
    elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", name):
        level, position, leaf = int(m[1]), int(m[2]), m[3]
        if leaf in _RESNET_LEAVES_BACK:
            return f"decoder.upsamples.{level * (resnets_per_level + 1) + position}.{_RESNET_LEAVES_BACK[leaf]}"
    elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", name):
        level, leaf = int(m[1]), m[2]
        if leaf in _RESAMPLE_LEAVES:
            return f"decoder.upsamples.{level * (resnets_per_level + 1) + resnets_per_level}.{leaf}"
    return None


def _rename(state_dict: dict[str, Tensor], rename: Callable[[str], str | None], layout: str) -> dict[str, Tensor]:
    renamed: dict[str, Tensor] = {}
    unknown: list[str] = []
    for name, tensor in state_dict.items():
        new_name = rename(name)
        if new_name is None:
            unknown.append(name)
        else:
            renamed[new_name] = tensor
    if unknown:
        shown = ", ".join(sorted(unknown)[:12]) + (f", ... (+{len(unknown) - 12} more)" if len(unknown) > 12 else "")
        raise CheckpointError(f"vae: {len(unknown)} keys are not {layout} names: {shown}")
    return renamed


# ---- diffusers config <-> arch -----------------------------------------------------------

# diffusers config key -> `CausalVAE3DArch` field (`AutoencoderKLWan`'s keys; other diffusers
# classes of this network use the same ones).
DIFFUSERS_CONFIG_FIELDS = {
    "base_dim": "dim",
    "z_dim": "z_dim",
    "dim_mult": "dim_mult",
    "num_res_blocks": "num_res_blocks",
    "attn_scales": "attn_scales",
    "temperal_downsample": "temporal_downsample",  # sic, diffusers' spelling
    "latents_mean": "latents_mean",
    "latents_std": "latents_std",
}
