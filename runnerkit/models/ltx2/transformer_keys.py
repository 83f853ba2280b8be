"""Key names of the LTX-2 transformer in the single-file release and in diffusers' layout.

The single-file release (`ltx-2-19b-*.safetensors`, `ltx-2.3-22b-*.safetensors`, Lightricks
ltx-core names) stores the transformer under the prefix `model.diffusion_model.`, next to its
text connectors (`model.diffusion_model.video_embeddings_connector.*`,
`...audio_embeddings_connector.*`; LTX-2.3 also `text_embedding_projection.*`), the video VAE
(`vae.*`), the audio VAE (`audio_vae.*`) and the vocoder (`vocoder.*`). Inside the prefix, names
differ from diffusers' (which this package uses) by whole-word renames:

    patchify_proj -> proj_in                      adaln_single. (at the start) -> time_embed.
    audio_patchify_proj -> audio_proj_in          audio_adaln_single. (start) -> audio_time_embed.
    av_ca_video_scale_shift_adaln_single -> av_cross_attn_video_scale_shift
    av_ca_audio_scale_shift_adaln_single -> av_cross_attn_audio_scale_shift
    av_ca_a2v_gate_adaln_single -> av_cross_attn_video_a2v_gate
    av_ca_v2a_gate_adaln_single -> av_cross_attn_audio_v2a_gate
    scale_shift_table_a2v_ca_video -> video_a2v_cross_attn_scale_shift_table
    scale_shift_table_a2v_ca_audio -> audio_a2v_cross_attn_scale_shift_table
    prompt_adaln_single -> prompt_adaln (LTX-2.3; also audio_)     q_norm -> norm_q, k_norm -> norm_k

LTX-2.5 adds no rename: its keyframe embedding is `keyframes_abs_pos_embedding` in both layouts
(`model.diffusion_model.keyframes_abs_pos_embedding` [1, 4096] in the file; ltx-core `LTXModel` and
diffusers use the same attribute name), and its bias-free video FFN just lacks `ff.net.0.proj.bias`
and `ff.net.2.bias`.

Source: diffusers `scripts/convert_ltx2_to_diffusers.py` (LTX_2_0 / LTX_2_3 rename dicts) and
0.42.1 `loaders/single_file_utils.py` (`convert_ltx2_transformer_to_diffusers`, which lacks the
LTX-2.3 prompt_adaln renames).
"""

from __future__ import annotations

ORIGINAL_PREFIX = "model.diffusion_model."
"""Prefix of the transformer (and its connectors) in the single-file release."""

NOT_TRANSFORMER = ("video_embeddings_connector.", "audio_embeddings_connector.", "text_embedding_projection.")
"""Names under `ORIGINAL_PREFIX` that belong to the text connectors, not to the transformer."""

_RENAMES: tuple[tuple[str, str], ...] = (
    # original substring, diffusers substring; longer originals first where one contains another
    ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
    ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
    ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
    ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
    ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
    ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"),
    ("prompt_adaln_single.", "prompt_adaln."),
    ("patchify_proj.", "proj_in."),
    (".q_norm.", ".norm_q."),
    (".k_norm.", ".norm_k."),
)
_START_RENAMES: tuple[tuple[str, str], ...] = (
    ("audio_adaln_single.", "audio_time_embed."),
    ("adaln_single.", "time_embed."),
)


def diffusers_name(original: str) -> str | None:
    """The diffusers (and runnerkit) key of a single-file key, or None when it is not a transformer key.

    Args:
        original: a key of the release file, e.g. "model.diffusion_model.transformer_blocks.0.attn1.q_norm.weight".

    Returns:
        e.g. "transformer_blocks.0.attn1.norm_q.weight"; None outside `ORIGINAL_PREFIX` or for a connector key.
    """
    if not original.startswith(ORIGINAL_PREFIX):
        return None
    name = original[len(ORIGINAL_PREFIX):]
    if name.startswith(NOT_TRANSFORMER):
        return None
    for old, new in _START_RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def original_name(diffusers: str) -> str:
    """The single-file key of a diffusers transformer key (inverse of `diffusers_name`)."""
    name = diffusers
    for old, new in _START_RENAMES:
        if name.startswith(new):
            name = old + name[len(new):]
            break
    for old, new in _RENAMES:
        name = name.replace(new, old)
    return ORIGINAL_PREFIX + name
