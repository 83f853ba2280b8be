"""LTX-2.5 (22B, `Lightricks/LTX-2.5`): its sizes, and what differs from LTX-2.3 beyond sizes.

Sources: diffusers' `scripts/convert_ltx2_to_diffusers.py` (version "2.5": `get_ltx2_*_config`,
`convert_ltx2_duration_head`), diffusers 0.42.1's class docstrings, Lightricks' LTX-2 README and
ltx-core (`encoder_configurator.py`, `duration_head/`), and `google/gemma-4-12B`'s public config.json.

Every size is LTX-2.3's (`LTX25_22B_ARCH` is `LTX23_22B_ARCH` with the transformer's two LTX-2.5 switches):

- transformer: the same widths and depth (video 32 x 128, audio 32 x 64, 48 blocks, 128 latent
  channels, gated attention, cross-attention AdaLN, `use_prompt_adaln_single` still true). Two
  config switches differ (`LTX25_TRANSFORMER_CHANGES`): the video FFN has no biases (`ff_bias`
  false: 96 fewer tensors, `ff.net.0.proj.bias` [16384] and `ff.net.2.bias` [4096] per block), and
  2.5.1+ files carry `keyframes_abs_pos_embedding` [1, 4096], added after `proj_in` to tokens a
  `video_keyframes_mask` marks (the plain text/image-to-video path passes none: no effect). Both are
  `LTX2TransformerArch` fields (`transformer_arch.LTX25_22B`), implemented by the transformer.
- connectors: the 2.3 layout (per-modality projections, 8 + 8 gated blocks, 128 registers); the input
  width is now read from the Gemma-4 config (`caption_channels` = `hidden_size`, `text_proj_in_factor` =
  `num_hidden_layers` + 1), which for Gemma-4 12B (`GEMMA4_12B_TEXT`) is Gemma-3 12B's 3840 and 48 + 1.
- video VAE: the encoder and latent space are 2.3's (diffusers: byte-identical encoder weights); the
  decoder is either 2.3's convolutional decoder (`ltx-2.5-video-vae-conv-bf16.safetensors`) or the
  new diffusion decoder (`ltx-2.5-video-vae-bf16.safetensors`, diffusers `LTX2VideoDiffusionDecoderModel`).
- audio VAE, vocoder (BigVGAN v2 + bandwidth extension to 48 kHz): 2.3's configs unchanged.
- latent upsampler: a 2.5 file (`ltx-2.5-latent-spatial-upscaler-x2-bf16-1.0.safetensors`); diffusers'
  converter has no 2.5 entry, so its sizes are assumed to be 2.3's (unverified).
- new: the duration head (`duration.py`, `LTX25_DURATION_HEAD`, `model_patches/ltx-2.5-duration-head-bf16.safetensors`),
  and image conditioning re-compressed at CRF 18 instead of 33 (diffusers `resolve_default_image_crf`).
- text encoder: an LTX fine-tune of Gemma-4 12B (`gemma4_unified`; `text_encoder_gemma4.py`).

The release ships one file per component (`diffusion_models/`, `text_encoders/`, `vae/`,
`latent_upscale_models/`, `model_patches/`) instead of 2.3's single file.
"""

from __future__ import annotations

from typing import Any

from runnerkit.models.ltx2 import arch
from runnerkit.models.ltx2.duration import LTX25_DURATION_HEAD, LTX2DurationHeadArch
from runnerkit.models.ltx2.transformer_arch import LTX25_22B

LTX25_22B_ARCH = arch.LTX2Arch(**{name: getattr(arch.LTX23_22B_ARCH, name) for name in arch.COMPONENTS
                                  if name != "transformer"}, transformer=LTX25_22B)
"""LTX-2.5 (22B): LTX-2.3's sizes in every component, the transformer with LTX-2.5's switches (module docstring)."""
LTX25_TRANSFORMER_CHANGES: dict[str, Any] = {"ff_bias": False, "use_keyframes_abs_pos_embedding": True}
"""diffusers `LTX2VideoTransformer3DModel` config keys whose LTX-2.5 value differs from LTX-2.3's."""
LTX25_DURATION: LTX2DurationHeadArch = LTX25_DURATION_HEAD
"""The duration head: video 4096 and audio 2048 wide inputs, pooler 256 x 4 heads, 1 query, MLP 256."""
GEMMA4_12B_TEXT: dict[str, Any] = {
    "hidden_size": 3840, "num_hidden_layers": 48, "intermediate_size": 15360, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256, "num_global_key_value_heads": 1, "global_head_dim": 512,
    "attention_k_eq_v": True, "sliding_window": 1024, "vocab_size": 262144}
"""`google/gemma-4-12B` text config (`Gemma4UnifiedTextConfig`): 5 sliding-window layers then one full
(proportional RoPE, a quarter of the 512-wide head rotated) in 8 groups; the LTX fine-tune keeps the sizes."""

__all__ = ["GEMMA4_12B_TEXT", "LTX25_22B_ARCH", "LTX25_DURATION", "LTX25_TRANSFORMER_CHANGES"]
