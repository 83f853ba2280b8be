"""Lightricks' single-file `config` metadata (ltx-core's field names) -> `LTX2Arch`.

The release files (`ltx-2-19b-*.safetensors`, `ltx-2.3-22b-*.safetensors`) carry in their safetensors
metadata a `config` entry: one JSON object with the sections `transformer`, `vae`, `audio_vae`,
`vocoder` and `scheduler`, in the field names that Lightricks' ltx-core reads (github Lightricks/LTX-2,
`packages/ltx-core/src/ltx_core/`: `model/transformer/model_configurator.py` LTXModelConfigurator,
`text_encoders/gemma/embeddings_connector.py` and `encoders/encoder_configurator.py`,
`model/video_vae/model_configurator.py`, `model/audio_vae/model_configurator.py`). The upsampler file
(`ltx-2*-spatial-upscaler-x2-*.safetensors`) has a flat `config` of its own
(`model/upsampler/model_configurator.py`). A key a section leaves out takes ltx-core's default, as
ltx-core would build the network.

Mapping (ltx-core -> ours):

- `transformer`: the widths one to one; `positional_embedding_max_pos` [20, 2048, 2048] ->
  `pos_embed_max_pos`, `base_height`, `base_width`; `positional_embedding_theta` -> `rope_theta`;
  `frequencies_precision` "float64" -> `rope_double_precision`; `av_ca_timestep_scale_multiplier` ->
  `cross_attn_timestep_scale_multiplier`; `apply_gated_attention` -> both streams' `*gated_attn`;
  `cross_attention_adaln` -> both streams' `*cross_attn_mod`; LTX-2.5's two switches keep their
  names: `ff_bias` (false: the video FFN without biases) and `use_keyframes_abs_pos_embedding`, with
  ltx-core's defaults (true, false; `LTXModelConfigurator`). The same section carries the text
  connectors (`connector_*`, `audio_connector_*`, `connector_apply_gated_attention`) and the text
  projection switch: ltx-core's four keys `caption_proj_before_connector` true and
  `caption_proj_input_norm`, `caption_projection_first_linear`, `caption_projection_second_linear` false
  select the per-modality projection of LTX-2.3 (`per_modality_projections`, with bias, to the
  transformer's widths; our transformer then has no caption projection); none of them: LTX-2.0's.
- `vae` (`CausalVideoAutoencoder`): `encoder_blocks` / `decoder_blocks` are lists of
  `[name, params]` alternating `res_x` (`num_layers`, decoder `inject_noise`) and `compress_*`
  (`multiplier`; decoder `compress_all` also `residual`), in encoder order; the encoder starts at
  `latent_channels` and each `compress_*_res` multiplies the width, the decoder's bottleneck is
  `decoder_base_channels` x the product of its multipliers; `spatial_padding_mode` sets both halves
  (as ltx-core reads it), else the encoder has `encoder_spatial_padding_mode` ("zeros") and the
  decoder "reflect".
- `audio_vae`: `model.params.ddconfig` (`ch`, `out_ch`, `ch_mult`, `num_res_blocks`, `z_channels`,
  ...), `model.params.sampling_rate`, `preprocessing.stft.hop_length`, mel bins from `ddconfig`,
  `preprocessing.mel.n_mel_channels` or `variables.mel_bins`; the other training subtrees are ignored.
- `vocoder`: flat HiFi-GAN (`resblock` "1", LTX-2.0) or `{"vocoder": ..., "bwe": ...}` (`resblock`
  "AMP1", snakebeta; LTX-2.3) with `upsample_initial_channel`, `upsample_rates`,
  `upsample_kernel_sizes`, `resblock_kernel_sizes`, `resblock_dilation_sizes`, `use_tanh_at_final`,
  `use_bias_at_final`, and in `bwe` `n_fft`, `hop_length`, `num_mels`, `input_sampling_rate`,
  `output_sampling_rate`.
- upsampler: `in_channels`, `mid_channels`, `num_blocks_per_stage`, `rational_resampler`
  (`use_rational_resampler`), with `dims` 3, `spatial_scale` 2.0 and no temporal upsampling.

Not carried by the ltx-core config, so taken elsewhere:

- derived from other sections, as ltx-core derives them: `vae_scale_factors` (the VAE's block list),
  `audio_sampling_rate` / `audio_hop_length` (the audio VAE), the vocoders' `in_channels`
  (2 x mel bins; ltx-core hard-codes 128 = 2 x 64), `caption_channels` and `text_proj_in_factor` of
  the connectors (the Gemma-3 config: hidden size and layers + 1, `text_encoder_config`; without
  one, the transformer's `caption_channels` and 49, Gemma-3 12B's).
- the release value, the same in both releases: patch sizes 1, `audio_scale_factor` 4,
  `causal_offset` 1, the connectors' `rope_theta` 1e4 (ltx-core's constant), the vocoders'
  anti-aliasing filters (ratio 2, kernel 12) and LeakyReLU slope 0.1.
- the release value of the version (2.3 when `apply_gated_attention`): `perturbed_attn` (diffusers'
  STG processor, no weights): true for 2.3, false for 2.0.
- the LTX-2.3 BWE's first generator: `use_tanh_at_final` false maps to no final activation, as
  diffusers' conversion has it; ltx-core clamps that 16 kHz waveform to [-1, 1] there (its
  `apply_final_activation` defaults to true for that generator), a difference only for samples past 1.

Refused: a key no reader knows (ValueError naming it), and a known key whose value no release uses
(NotImplementedError naming key and value): `audio_ff_bias`, `connector_ff_bias` and
`use_prompt_adaln_single` false (ltx-core knows them, no release sets them), a `duration_head` section, the diffusion VAE decoder (`CausalDiffusionVAE`), and any switch ltx-core
itself refuses (`check_config_value`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from runnerkit.models.ltx2 import audio_arch as aa
from runnerkit.models.ltx2 import connectors_arch as ca
from runnerkit.models.ltx2 import transformer_arch as ta
from runnerkit.models.ltx2 import upsampler as up
from runnerkit.models.ltx2 import vae_arch as va
from runnerkit.models.ltx2.arch import LTX2Arch

SECTIONS = ("transformer", "vae", "audio_vae", "vocoder")
"""Sections a release config must have (`scheduler` is accepted and not read: sampling, no weights)."""
RELEASE_TEXT_ENCODER = (3840, 48)
"""Gemma-3 12B (both releases): hidden size, layers."""


def is_release_config(config: dict[str, Any]) -> bool:
    """Whether a single file's `config` is in ltx-core's format: ours always has a `connectors` section."""
    return "connectors" not in config


def is_release_upsampler_config(config: dict[str, Any]) -> bool:
    """Whether an upsampler file's `config` is ltx-core's (`spatial_scale`, `rational_resampler`,
    `_class_name` "LatentUpsampler") rather than diffusers' (`rational_spatial_scale`, `use_rational_resampler`)."""
    return (config.get("_class_name") == "LatentUpsampler"
            or bool({"spatial_scale", "rational_resampler"} & set(config)))


REQUIRED: Any = object()
"""Default of a key that has no ltx-core default: its absence is an error naming it."""


class _Section:
    """One JSON object of the config, read key by key; `done` refuses the keys nothing read."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"`{path}` must be a JSON object, got {type(data).__name__}")
        self.data, self.path, self.read = data, path, set()

    def name(self, key: str) -> str:
        return f"`{self.path}.{key}`"

    def raw(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        if key not in self.data and default is REQUIRED:
            raise ValueError(f"{self.name(key)} is missing (it has no default)")
        return self.data.get(key, default)

    def ignore(self, *keys: str) -> None:
        self.read.update(keys)

    def _checked(self, key: str, default: Any, ok: Callable[[Any], bool], what: str) -> Any:
        value = self.raw(key, default)
        if not ok(value):
            raise ValueError(f"{self.name(key)}={value!r}: expected {what}")
        return value

    def integer(self, key: str, default: int = REQUIRED) -> int:
        return int(self._checked(key, default, _is_integer, "an integer"))

    def number(self, key: str, default: float = REQUIRED) -> float:
        return float(self._checked(key, default, _is_number, "a number"))

    def flag(self, key: str, default: bool = REQUIRED) -> bool:
        return self._checked(key, default, lambda v: isinstance(v, bool), "true or false")

    def integers(self, key: str, default: list[int] = REQUIRED, length: int | None = None) -> tuple[int, ...]:
        def ok(value: Any) -> bool:
            return isinstance(value, list) and all(map(_is_integer, value)) and length in (None, len(value))
        return tuple(int(v) for v in self._checked(key, default, ok, f"a list of {length or 'some'} integers"))

    def choice(self, key: str, default: Any, allowed: tuple[Any, ...]) -> Any:
        return self._checked(key, default, lambda v: v in allowed, f"one of {list(allowed)}")

    def supported(self, key: str, value: Any, why: str = "") -> None:
        """A switch with the one value both releases use: another value is refused (absent: `value`)."""
        got = self.raw(key, value)
        if got != value or isinstance(got, bool) != isinstance(value, bool):
            raise NotImplementedError(f"{self.name(key)}={got!r} is not supported: LTX-2 and LTX-2.3 use "
                                      f"{value!r}{why}")

    def section(self, key: str) -> _Section:
        return _Section(self.raw(key, {}), f"{self.path}.{key}")

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.read)
        if unknown:
            raise ValueError(f"`{self.path}` has keys this implementation does not know: {unknown}")


def _is_integer(value: Any) -> bool:
    """An int, or a float with an integral value (JSON writers differ: ltx-core writes 1000.0)."""
    return not isinstance(value, bool) and (isinstance(value, int) or (isinstance(value, float) and value.is_integer()))


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


# ltx-core's `check_config_value` list (LTXModelConfigurator) and the constants of both releases.
_TRANSFORMER_FIXED: dict[str, Any] = {
    "_class_name": "AVTransformer3DModel", "dropout": 0.0, "attention_bias": True, "num_vector_embeds": None,
    "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000, "use_linear_projection": False,
    "only_cross_attention": False, "cross_attention_norm": True, "double_self_attention": False,
    "upcast_attention": False, "standardization_norm": "rms_norm", "norm_elementwise_affine": False,
    "qk_norm": "rms_norm", "positional_embedding_type": "rope", "use_audio_video_cross_attention": True,
    "share_ff": False, "av_cross_ada_norm": True, "use_middle_indices_grid": True, "attention_type": "default",
    "causal_temporal_positioning": True, "use_embeddings_connector": True, "connector_norm_output": True,
}
_UNRELEASED = {"audio_ff_bias": True, "connector_ff_bias": True, "use_prompt_adaln_single": True}
"""ltx-core switches whose other value no release uses (LTX-2.5 keeps these defaults: diffusers'
`convert_ltx2_to_diffusers.py` "2.5" configs), so they are not implemented."""
_V2_PROJECTION = {"caption_proj_before_connector": True, "caption_projection_first_linear": False,
                  "caption_proj_input_norm": False, "caption_projection_second_linear": False}
"""ltx-core `_V2_EXPECTED_CONFIG`: all four -> LTX-2.3's per-modality text projection; none -> LTX-2.0's."""


def text_encoder_widths(config: dict[str, Any]) -> tuple[int, int]:
    """(hidden size, layers) of a Gemma-3 `config.json` (`text_config` of a Gemma3ForConditionalGeneration
    folder, or the top level of a Gemma3TextModel one), as ltx-core's `_create_feature_extractor` reads them."""
    text = _Section(config.get("text_config", config), "text_encoder config")
    return text.integer("hidden_size"), text.integer("num_hidden_layers")


def _projection(t: _Section) -> bool:
    """Whether the text projection is LTX-2.3's per-modality one (ltx-core `_create_feature_extractor`)."""
    present = [k for k in _V2_PROJECTION if k in t.data]
    t.ignore(*_V2_PROJECTION)
    if not present:
        return False
    missing = sorted(set(_V2_PROJECTION) - set(present))
    if missing:
        raise NotImplementedError(f"`{t.path}`: a partial per-modality text projection config, missing {missing} "
                                  "(ltx-core refuses it too)")
    for key, value in _V2_PROJECTION.items():
        t.supported(key, value)
    return True


def _transformer(t: _Section, vae: va.LTX2VideoVAEArch, audio: aa.LTX2AudioVAEArch) -> ta.LTX2TransformerArch:
    for key, value in _TRANSFORMER_FIXED.items():
        t.supported(key, value)
    for key, value in _UNRELEASED.items():
        t.supported(key, value, " (so does LTX-2.5; no release uses another value)")
    t.ignore("_diffusers_version", "norm_num_groups")  # unused by any layer
    frames, height, width = t.integers("positional_embedding_max_pos", [20, 2048, 2048], length=3)
    (audio_frames,) = t.integers("audio_positional_embedding_max_pos", [20], length=1)
    gated, modulated = t.flag("apply_gated_attention", False), t.flag("cross_attention_adaln", False)
    fields = {
        key: t.integer(key, default) for key, default in (
            ("in_channels", 128), ("out_channels", 128), ("num_attention_heads", 32), ("attention_head_dim", 128),
            ("cross_attention_dim", 4096), ("num_layers", 48), ("caption_channels", 3840),
            ("audio_in_channels", 128), ("audio_out_channels", 128), ("audio_num_attention_heads", 32),
            ("audio_attention_head_dim", 64), ("audio_cross_attention_dim", 2048),
            ("timestep_scale_multiplier", 1000))}
    return ta.LTX2TransformerArch(
        **fields, norm_eps=t.number("norm_eps", 1e-6), rope_theta=t.number("positional_embedding_theta", 1e4),
        rope_double_precision=t.choice("frequencies_precision", "float32", ("float32", "float64")) == "float64",
        rope_type=t.choice("rope_type", "split", ("split", "interleaved")),
        cross_attn_timestep_scale_multiplier=t.integer("av_ca_timestep_scale_multiplier", 1),
        pos_embed_max_pos=frames, base_height=height, base_width=width, audio_pos_embed_max_pos=audio_frames,
        gated_attn=gated, audio_gated_attn=gated, cross_attn_mod=modulated, audio_cross_attn_mod=modulated,
        use_prompt_embeddings=not _projection(t), perturbed_attn=gated,
        vae_scale_factors=(vae.temporal_compression, vae.spatial_compression, vae.spatial_compression),
        audio_sampling_rate=audio.sample_rate, audio_hop_length=audio.mel_hop_length,
        audio_scale_factor=aa.LATENT_DOWNSAMPLE, causal_offset=1, patch_size=1, patch_size_t=1,
        audio_patch_size=1, audio_patch_size_t=1, ff_bias=t.flag("ff_bias", True),
        use_keyframes_abs_pos_embedding=t.flag("use_keyframes_abs_pos_embedding", False))


def _connectors(t: _Section, transformer: ta.LTX2TransformerArch,
                text_encoder: tuple[int, int] | None) -> ca.LTX2ConnectorsArch:
    """The connectors' part of the transformer section (ltx-core `Embeddings1DConnectorConfigurator`)."""
    per_modality = not transformer.use_prompt_embeddings
    norm = t.raw("text_encoder_norm_type", "per_token_rms" if per_modality else None)
    if norm != ("per_token_rms" if per_modality else None):
        raise NotImplementedError(f"{t.name('text_encoder_norm_type')}={norm!r} with the "
                                  f"{'per-modality' if per_modality else 'shared'} text projection is not supported")
    hidden, layers = text_encoder or (transformer.caption_channels, RELEASE_TEXT_ENCODER[1])
    if not per_modality and hidden != transformer.caption_channels:
        raise ValueError(f"{t.name('caption_channels')}={transformer.caption_channels} must equal the text "
                         f"encoder's hidden size {hidden} (the transformer projects those features)")
    t.ignore("connector_learnable_registers_std")  # initialisation only
    heads, head_dim = t.integer("connector_num_attention_heads", 30), t.integer("connector_attention_head_dim", 128)
    blocks, registers = t.integer("connector_num_layers", 2), t.integer("connector_num_learnable_registers", 128)
    (base,) = t.integers("connector_positional_embedding_max_pos", [1], length=1)
    gated = t.flag("connector_apply_gated_attention", False)
    projected = {}  # LTX-2.3 projects each modality to the transformer's width of it
    if per_modality:
        projected = {"video_hidden_dim": transformer.inner_dim, "audio_hidden_dim": transformer.audio_inner_dim}
    return ca.LTX2ConnectorsArch(
        caption_channels=hidden, text_proj_in_factor=layers + 1,
        video_connector_num_attention_heads=heads, video_connector_attention_head_dim=head_dim,
        video_connector_num_layers=blocks, video_connector_num_learnable_registers=registers, video_gated_attn=gated,
        audio_connector_num_attention_heads=t.integer("audio_connector_num_attention_heads", heads),
        audio_connector_attention_head_dim=t.integer("audio_connector_attention_head_dim", head_dim),
        audio_connector_num_layers=t.integer("audio_connector_num_layers", blocks),
        audio_connector_num_learnable_registers=registers, audio_gated_attn=gated,
        connector_rope_base_seq_len=base, rope_theta=1e4, rope_double_precision=transformer.rope_double_precision,
        rope_type=transformer.rope_type, per_modality_projections=per_modality, proj_bias=per_modality, **projected)


_DOWN = {"compress_space_res": "spatial", "compress_time_res": "temporal", "compress_all_res": "spatiotemporal"}
_UP = {"compress_space": "spatial", "compress_time": "temporal", "compress_all": "spatiotemporal"}


def _blocks(v: _Section, key: str, compress: dict[str, str]) -> tuple[list[_Section], list[tuple[str, _Section]]]:
    """`[name, params]` entries alternating `res_x` and a `compress` block, starting and ending with `res_x`."""
    entries = v.raw(key)
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{v.name(key)}={entries!r}: expected a non-empty list of [name, params]")
    res, down = [], []
    for i, entry in enumerate(entries):
        where = f"{v.path}.{key}[{i}]"
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"`{where}`={entry!r}: expected [name, params]")
        name, params = entry
        params = _Section({"num_layers": params} if isinstance(params, int) else params, where)
        wanted = ("res_x",) if i % 2 == 0 else tuple(compress)
        if name not in wanted:
            raise NotImplementedError(f"`{where}` is {name!r}, expected one of {list(wanted)}: only res_x blocks "
                                      "alternating with these compress blocks, first and last res_x (both "
                                      "releases), are implemented")
        if i % 2 == 0:
            res.append(params)
        else:
            down.append((name, params))
    if len(entries) % 2 == 0:
        raise NotImplementedError(f"{v.name(key)} ends with {entries[-1][0]!r}: the last block must be res_x")
    return res, down


def _layers(res: list[_Section], noise: bool) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    layers = tuple(r.integer("num_layers") for r in res)
    injected = tuple(r.flag("inject_noise", False) if noise else False for r in res)
    for r in res:
        r.done()
    return layers, injected


def _video_vae(v: _Section) -> va.LTX2VideoVAEArch:
    """ltx-core `VideoEncoderConfigurator` / `VideoDecoderConfigurator` (the convolutional VAE)."""
    kind = v.raw("_class_name", "CausalVideoAutoencoder")
    if kind != "CausalVideoAutoencoder":
        raise NotImplementedError(f"{v.name('_class_name')}={kind!r}: only the convolutional VAE of LTX-2 / 2.3 "
                                  "(CausalVideoAutoencoder) is implemented, not LTX-2.5's diffusion decoder")
    for key, value in {"dims": 3, "norm_layer": "pixel_norm", "latent_log_var": "uniform", "use_quant_conv": False,
                       "normalize_latent_channels": False}.items():
        v.supported(key, value)
    latent = v.integer("latent_channels", 128)
    v.supported("encoder_base_channels", latent, " (the encoder starts at `latent_channels`, as ltx-core builds it)")
    res, down = _blocks(v, "encoder_blocks", _DOWN)
    layers, _ = _layers(res, noise=False)
    widths, channels = [], latent
    for _, params in down:
        channels *= params.integer("multiplier", 2)
        params.done()
        widths.append(channels)
    res, up_blocks = _blocks(v, "decoder_blocks", _UP)
    decoder_layers, noise = _layers(res, noise=True)
    factors = tuple(params.integer("multiplier", 1) for _, params in up_blocks)
    residual = tuple(params.flag("residual", False) if name == "compress_all" else False for name, params in up_blocks)
    for _, params in up_blocks:
        params.done()
    channels, decoder_widths = v.integer("decoder_base_channels", 128) * math.prod(factors), []
    for factor in reversed(factors):  # decoder order: each upsampler divides the width
        if channels % factor:
            raise ValueError(f"{v.name('decoder_blocks')}: width {channels} is not divisible by multiplier {factor}")
        decoder_widths.append(channels)
        channels //= factor
    padding = ("zeros", "reflect", "replicate", "circular")
    shared = v.choice("spatial_padding_mode", None, (None, *padding))
    decoder_padding = shared or "reflect"
    v.supported("decoder_spatial_padding_mode", decoder_padding,
                " here (ltx-core reads the decoder's padding from `spatial_padding_mode` only, default reflect)")
    return va.LTX2VideoVAEArch(
        in_channels=v.integer("in_channels", 3), out_channels=v.integer("out_channels", 3), latent_channels=latent,
        block_out_channels=tuple(widths), layers_per_block=layers, spatio_temporal_scaling=(True,) * len(widths),
        downsample_type=tuple(_DOWN[name] for name, _ in down),
        decoder_block_out_channels=tuple(reversed(decoder_widths)), decoder_layers_per_block=decoder_layers,
        decoder_spatio_temporal_scaling=(True,) * len(factors), decoder_inject_noise=noise,
        upsample_type=tuple(_UP[name] for name, _ in reversed(up_blocks)), upsample_residual=residual,
        upsample_factor=factors, timestep_conditioning=v.flag("timestep_conditioning", True),
        patch_size=v.integer("patch_size", 4), scaling_factor=v.number("scaling_factor", 1.0),
        decoder_causal=v.flag("causal_decoder", False),
        encoder_spatial_padding_mode=shared or v.choice("encoder_spatial_padding_mode", "zeros", padding),
        decoder_spatial_padding_mode=decoder_padding)


def _audio_vae(a: _Section) -> aa.LTX2AudioVAEArch:
    """ltx-core `AudioDecoderConfigurator`: `model.params.ddconfig` and the mel settings."""
    params = a.section("model").section("params")
    d = params.section("ddconfig")
    preprocessing = a.section("preprocessing")
    stft, mel, variables = preprocessing.section("stft"), preprocessing.section("mel"), a.section("variables")
    d.ignore("double_z", "in_channels", "dropout", "resamp_with_conv", "attn_type")  # encoder-only or no-op
    d.supported("downsample_time", False)
    mel_bins = d.raw("mel_bins") or mel.raw("n_mel_channels") or variables.raw("mel_bins")
    attention = d.integers("attn_resolutions", [8, 16, 32])
    arch = aa.LTX2AudioVAEArch(
        base_channels=d.integer("ch", 128), output_channels=d.integer("out_ch", 2),
        ch_mult=d.integers("ch_mult", [1, 2, 4]), num_res_blocks=d.integer("num_res_blocks", 2),
        attn_resolutions=attention or None, resolution=d.integer("resolution", 256),
        latent_channels=d.integer("z_channels", 8), norm_type=d.choice("norm_type", "pixel", ("pixel", "group")),
        causality_axis=d.choice("causality_axis", "height", ("none", "width", "height", "width-compatibility")),
        mid_block_add_attention=d.flag("mid_block_add_attention", True),
        sample_rate=params.integer("sampling_rate", 16000), mel_hop_length=stft.integer("hop_length", 160),
        mel_bins=mel_bins)
    d.done()
    return arch


Role = Literal["plain", "first", "bwe"]


def _generator(g: _Section, in_channels: int, rate: int, role: Role) -> aa.LTX2VocoderArch:
    """One ltx-core `Vocoder` (`_vocoder_from_config`) as the LTX-2.0 vocoder ("plain": tanh or clamp at the
    output), the LTX-2.3 BWE's first generator ("first", module docstring) or its extender ("bwe": none)."""
    g.supported("stereo", True)
    amp = g.choice("resblock", "1", ("1", "AMP1")) == "AMP1"
    if amp:
        g.supported("activation", "snakebeta", " with AMP1 blocks")
    else:
        g.ignore("activation")  # ltx-core's HiFi-GAN blocks are LeakyReLU whatever it says
    tanh = g.flag("use_tanh_at_final", True)
    final = {"plain": "tanh" if tanh else "clamp", "first": "tanh" if tanh else None, "bwe": None}[role]
    dilations = g._checked("resblock_dilation_sizes", [[1, 3, 5]] * 3,
                           lambda v: isinstance(v, list) and all(isinstance(d, list) and all(map(_is_integer, d))
                                                                 for d in v), "a list of lists of integers")
    return aa.LTX2VocoderArch(
        in_channels=in_channels, hidden_channels=g.integer("upsample_initial_channel", 1024), out_channels=2,
        upsample_kernel_sizes=g.integers("upsample_kernel_sizes", [16, 15, 8, 4, 4]),
        upsample_factors=g.integers("upsample_rates", [6, 5, 2, 2, 2]),
        resnet_kernel_sizes=g.integers("resblock_kernel_sizes", [3, 7, 11]),
        resnet_dilations=tuple(tuple(int(x) for x in d) for d in dilations),
        act_fn="snakebeta" if amp else "leaky_relu", antialias=amp, final_bias=g.flag("use_bias_at_final", True),
        final_act_fn=final, output_sampling_rate=rate)


def _vocoder(vo: _Section, audio: aa.LTX2AudioVAEArch) -> aa.LTX2VocoderArch | aa.LTX2VocoderBWEArch:
    """ltx-core `VocoderConfigurator`: flat (LTX-2.0) or `vocoder` + `bwe` (LTX-2.3)."""
    mel_features = audio.output_channels * (audio.mel_bins or 64)
    if "bwe" not in vo.data:
        arch = _generator(vo, mel_features, vo.integer("output_sampling_rate", 24000), "plain")
        vo.done()
        return arch
    first, bwe = vo.section("vocoder"), vo.section("bwe")
    rates = {"input_sampling_rate": bwe.integer("input_sampling_rate"),
             "output_sampling_rate": bwe.integer("output_sampling_rate")}
    n_fft, mels = bwe.integer("n_fft"), bwe.integer("num_mels")
    bwe.supported("win_size", n_fft, " (ltx-core's STFT window is `n_fft`)")
    bwe.supported("apply_final_activation", False)
    arch = aa.LTX2VocoderBWEArch(
        vocoder=_generator(first, mel_features, rates["input_sampling_rate"], "first"),
        bwe=_generator(bwe, 2 * mels, rates["output_sampling_rate"], "bwe"),
        filter_length=n_fft, hop_length=bwe.integer("hop_length"), window_length=n_fft, num_mel_channels=mels,
        **rates)
    for section in (first, bwe, vo):
        section.done()
    return arch


def upsampler_from_release_config(config: dict[str, Any]) -> up.LTX2LatentUpsamplerArch:
    """The upsampler file's ltx-core `config` (`LatentUpsamplerConfigurator`; absent keys: its defaults)."""
    u = _Section(config, "latent_upsampler")
    u.supported("_class_name", "LatentUpsampler")
    for key, value in {"dims": 3, "spatial_upsample": True, "temporal_upsample": False, "spatial_scale": 2.0}.items():
        u.supported(key, value, " (only the x2 spatial upsampler is implemented)")
    arch = up.LTX2LatentUpsamplerArch(
        in_channels=u.integer("in_channels", 128), mid_channels=u.integer("mid_channels", 512),
        num_blocks_per_stage=u.integer("num_blocks_per_stage", 4),
        use_rational_resampler=u.flag("rational_resampler", False))
    u.done()
    return arch


def arch_from_release_config(config: dict[str, Any], upsampler: up.LTX2LatentUpsamplerArch,
                             text_encoder_config: dict[str, Any] | None = None,
                             defaults: LTX2Arch | None = None) -> LTX2Arch:
    """The architecture a release file's `config` metadata describes (module docstring).

    Args:
        config: the JSON object of the single file's `config` metadata entry.
        upsampler: the upsampler file's architecture.
        text_encoder_config: the Gemma-3 folder's config.json (None: Gemma-3 12B's widths).
        defaults: the `vae`, `audio_vae` and `vocoder` a split release's transformer file may leave out (its
            VAE and audio files carry them); None: every section is required.

    Raises:
        ValueError: a missing section, an unknown key or a value of the wrong type, naming the key.
        NotImplementedError: a known key with a value no release uses, or an LTX-2.5 part not covered here
            (a `duration_head` section), naming key and value.
    """
    top = _Section(config, "config")
    if "duration_head" in config:
        raise NotImplementedError("`config.duration_head`: LTX-2.5's duration head is not implemented")
    optional = () if defaults is None else ("vae", "audio_vae", "vocoder")
    missing = [s for s in SECTIONS if s not in config and s not in optional]
    if missing:
        raise ValueError(f"`config` has no {missing} section (has {sorted(config)})")
    top.ignore("scheduler")
    t = top.section("transformer")
    vae_section = top.section("vae") if "vae" in config else None
    vae = _video_vae(vae_section) if vae_section is not None else defaults.vae  # type: ignore[union-attr]
    audio = _audio_vae(top.section("audio_vae")) if "audio_vae" in config else defaults.audio_vae  # type: ignore
    transformer = _transformer(t, vae, audio)
    widths = None if text_encoder_config is None else text_encoder_widths(text_encoder_config)
    vocoder = _vocoder(top.section("vocoder"), audio) if "vocoder" in config else defaults.vocoder  # type: ignore
    arch = LTX2Arch(transformer=transformer, connectors=_connectors(t, transformer, widths), vae=vae,
                    audio_vae=audio, vocoder=vocoder, latent_upsampler=upsampler)
    for section in (t, vae_section, top):
        if section is not None:
            section.done()
    return arch


def arch_from_single_file_config(config: dict[str, Any], upsampler_config: dict[str, Any], where: str,
                                 text_encoder_config: dict[str, Any] | None = None,
                                 defaults: LTX2Arch | None = None) -> LTX2Arch:
    """The architecture from the `config` metadata of a single file and of its upsampler file: the
    ltx-core format of Lightricks' releases (this module), or runnerkit's own sections format
    (`LTX2Arch.to_sections`, as the synthetic writer stores it).

    Args:
        text_encoder_config: the Gemma-3 folder's config.json; a release config takes the connectors'
            input width and stacked-layer count from it, as ltx-core does (None: Gemma-3 12B's).
        defaults: a release config's sections that may be missing (`arch_from_release_config`).

    Raises:
        ValueError, NotImplementedError: a missing section, an unknown key or an unsupported value,
            naming it.
    """
    if is_release_upsampler_config(upsampler_config):
        upsampler = upsampler_from_release_config(upsampler_config)
    else:
        upsampler = up.LTX2LatentUpsamplerArch.from_diffusers_config(upsampler_config)
    if is_release_config(config):
        return arch_from_release_config(config, upsampler, text_encoder_config, defaults)
    return LTX2Arch.from_sections({**config, "latent_upsampler": upsampler.to_diffusers_config()}, where)
