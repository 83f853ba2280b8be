"""The `config` metadata of Lightricks' LTX-2 (19B), LTX-2.3 (22B) and LTX-2.5 files, written out by hand.

Test data, independent of runnerkit's mapping (release_config.py). Sources (the release files
themselves are not in this repository):

- LTX-2.3 (`ltx-2.3-22b-*.safetensors`): a verbatim dump of the file's `config` JSON kept by a public
  ltx-core fork as `ORIGINAL_CONFIG_JSON` in `ltx_core/loader/sft_loader.py`; its `transformer` section
  agrees key for key with a second public dump (`_22B_V23_METADATA` in a ComfyUI-parity golden generator,
  `ltxav_model_goldens`), its vocoder/VAE sections with a public MLX converter's `build_embedded_config("2.3")`.
- LTX-2 (`ltx-2-19b-dev.safetensors`): `transformer` from the public dump `_19B_METADATA` (same golden
  generator: "the verbatim metadata config.transformer dict of the published 19B checkpoint"). No
  verbatim dump of its other sections was found: `vae`, `audio_vae` and `vocoder` are rebuilt from
  ltx-core's configurators (github Lightricks/LTX-2, packages/ltx-core: the keys they read and their
  defaults), the block lists that ComfyUI (`comfy/ldm/lightricks/vae/causal_video_autoencoder.py`,
  `guess_config`) and ltx-core's own VAE test use for this 32x/8x VAE, and the values of diffusers'
  `scripts/convert_ltx2_to_diffusers.py` ("2.0"); the audio VAE is the 2.3 one (diffusers: "Same config
  as LTX-2.0").
- LTX-2.5 (`diffusion_models/ltx-2.5-22b-*-transformer-bf16.safetensors`): no verbatim dump was found. The
  `transformer` section is 2.3's plus the four switches ltx-core's `LTXModelConfigurator` reads for 2.5
  (github Lightricks/LTX-2 @ 400fd31: `ff_bias`, `audio_ff_bias`, `use_prompt_adaln_single`,
  `use_keyframes_abs_pos_embedding`), valued as diffusers' `convert_ltx2_to_diffusers.py` "2.5" config and
  public third-party loaders' tests of 2.5 metadata have them (ff_bias false, the others true). The other
  sections are 2.3's (the conv VAE: `ltx-2.5-video-vae-conv-bf16.safetensors` has 2.3's sizes).
- upsampler files: the keys ltx-core's `LatentUpsamplerConfigurator` reads (the set ComfyUI's
  `LatentUpsampler.config()` writes), values from diffusers' `get_ltx2_spatial_latent_upsampler_config`.
"""

from __future__ import annotations

import copy
from typing import Any

_AUDIO_VAE: dict[str, Any] = {
    "model": {"params": {
        "ddconfig": {"double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False,
                     "in_channels": 2, "out_ch": 2, "ch": 128, "ch_mult": [1, 2, 4], "num_res_blocks": 2,
                     "attn_resolutions": [], "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel",
                     "causality_axis": "height"},
        "sampling_rate": 16000}},
    "preprocessing": {
        "audio": {"sampling_rate": 16000, "max_wav_value": 32768.0, "duration": 5.12, "stereo": True,
                  "causal_padding": 3},
        "stft": {"filter_length": 1024, "hop_length": 160, "win_length": 1024, "causal": True},
        "mel": {"n_mel_channels": 64, "mel_fmin": 0, "mel_fmax": 8000}},
}
_SCHEDULER = {"_class_name": "RectifiedFlowScheduler", "_diffusers_version": "0.25.1", "num_train_timesteps": 1000,
              "shifting": None, "base_resolution": None, "sampler": "LinearQuadratic"}
_TRANSFORMER_COMMON: dict[str, Any] = {
    "_class_name": "AVTransformer3DModel", "activation_fn": "gelu-approximate", "attention_bias": True,
    "attention_head_dim": 128, "attention_type": "default", "caption_channels": 3840, "cross_attention_dim": 4096,
    "double_self_attention": False, "dropout": 0.0, "in_channels": 128, "norm_elementwise_affine": False,
    "norm_eps": 1e-06, "norm_num_groups": 32, "num_attention_heads": 32, "num_embeds_ada_norm": 1000,
    "num_layers": 48, "num_vector_embeds": None, "only_cross_attention": False, "cross_attention_norm": True,
    "out_channels": 128, "upcast_attention": False, "use_linear_projection": False, "qk_norm": "rms_norm",
    "standardization_norm": "rms_norm", "positional_embedding_type": "rope", "positional_embedding_theta": 10000.0,
    "positional_embedding_max_pos": [20, 2048, 2048], "timestep_scale_multiplier": 1000,
    "av_ca_timestep_scale_multiplier": 1000.0, "causal_temporal_positioning": True, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "use_audio_video_cross_attention": True, "share_ff": False,
    "audio_out_channels": 128, "audio_cross_attention_dim": 2048, "audio_positional_embedding_max_pos": [20],
    "av_cross_ada_norm": True, "use_embeddings_connector": True, "connector_attention_head_dim": 128,
    "connector_positional_embedding_max_pos": [4096], "connector_num_learnable_registers": 128,
    "connector_norm_output": True, "use_middle_indices_grid": True, "rope_type": "split",
    "frequencies_precision": "float64",
}

LTX23_22B_CONFIG: dict[str, Any] = {
    "transformer": {
        **_TRANSFORMER_COMMON, "connector_num_attention_heads": 32, "connector_num_layers": 8,
        "apply_gated_attention": True, "connector_apply_gated_attention": True,
        "caption_projection_first_linear": False, "caption_projection_second_linear": False,
        "caption_proj_input_norm": False, "connector_learnable_registers_std": 1,
        "caption_proj_before_connector": True, "audio_connector_attention_head_dim": 64,
        "audio_connector_num_attention_heads": 32, "cross_attention_adaln": True,
        "text_encoder_norm_type": "per_token_rms"},
    "vae": {
        "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
        "latent_channels": 128,
        "encoder_blocks": [["res_x", {"num_layers": 4}], ["compress_space_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 6}], ["compress_time_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 4}], ["compress_all_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 2}], ["compress_all_res", {"multiplier": 1}],
                           ["res_x", {"num_layers": 2}]],
        "decoder_blocks": [["res_x", {"num_layers": 4}], ["compress_space", {"multiplier": 2}],
                           ["res_x", {"num_layers": 6}], ["compress_time", {"multiplier": 2}],
                           ["res_x", {"num_layers": 4}], ["compress_all", {"multiplier": 1}],
                           ["res_x", {"num_layers": 2}], ["compress_all", {"multiplier": 2}],
                           ["res_x", {"num_layers": 2}]],
        "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
        "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
        "normalize_latent_channels": False, "encoder_base_channels": 128, "decoder_base_channels": 128,
        "spatial_padding_mode": "zeros"},
    "scheduler": _SCHEDULER,
    "audio_vae": _AUDIO_VAE,
    "vocoder": {
        "vocoder": {"upsample_initial_channel": 1536, "resblock": "AMP1", "upsample_rates": [5, 2, 2, 2, 2, 2],
                    "resblock_kernel_sizes": [3, 7, 11], "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4],
                    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "stereo": True,
                    "use_tanh_at_final": False, "activation": "snakebeta", "use_bias_at_final": False},
        "bwe": {"upsample_initial_channel": 512, "resblock": "AMP1", "upsample_rates": [6, 5, 2, 2, 2],
                "resblock_kernel_sizes": [3, 7, 11], "upsample_kernel_sizes": [12, 11, 4, 4, 4],
                "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "stereo": True,
                "use_tanh_at_final": False, "activation": "snakebeta", "use_bias_at_final": False,
                "apply_final_activation": False, "input_sampling_rate": 16000, "output_sampling_rate": 48000,
                "hop_length": 80, "n_fft": 512, "win_size": 512, "num_mels": 64}},
}

LTX25_SWITCHES: dict[str, Any] = {"ff_bias": False, "audio_ff_bias": True, "use_prompt_adaln_single": True,
                                   "use_keyframes_abs_pos_embedding": True}
"""The transformer keys of a 2.5 file's `config` that 2.3's lacks."""
LTX25_22B_CONFIG: dict[str, Any] = {**copy.deepcopy(LTX23_22B_CONFIG),
                                    "transformer": {**LTX23_22B_CONFIG["transformer"], **LTX25_SWITCHES}}

LTX2_19B_CONFIG: dict[str, Any] = {
    "transformer": {**_TRANSFORMER_COMMON, "_diffusers_version": "0.25.1", "connector_num_attention_heads": 30,
                    "connector_num_layers": 2},
    "vae": {
        "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
        "latent_channels": 128,
        "encoder_blocks": [["res_x", {"num_layers": 4}], ["compress_space_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 6}], ["compress_time_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 6}], ["compress_all_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 2}], ["compress_all_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 2}]],
        "decoder_blocks": [["res_x", {"num_layers": 5, "inject_noise": False}],
                           ["compress_all", {"residual": True, "multiplier": 2}],
                           ["res_x", {"num_layers": 5, "inject_noise": False}],
                           ["compress_all", {"residual": True, "multiplier": 2}],
                           ["res_x", {"num_layers": 5, "inject_noise": False}],
                           ["compress_all", {"residual": True, "multiplier": 2}],
                           ["res_x", {"num_layers": 5, "inject_noise": False}]],
        "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
        "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
        "normalize_latent_channels": False, "encoder_base_channels": 128, "decoder_base_channels": 128},
    "scheduler": _SCHEDULER,
    "audio_vae": _AUDIO_VAE,
    "vocoder": {"upsample_initial_channel": 1024, "resblock": "1", "upsample_rates": [6, 5, 2, 2, 2],
                "resblock_kernel_sizes": [3, 7, 11], "upsample_kernel_sizes": [16, 15, 8, 4, 4],
                "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "stereo": True},
}

LTX2_UPSAMPLER_CONFIG = {"_class_name": "LatentUpsampler", "in_channels": 128, "mid_channels": 1024,
                         "num_blocks_per_stage": 4, "dims": 3, "spatial_upsample": True, "temporal_upsample": False,
                         "spatial_scale": 2.0, "rational_resampler": True}
LTX23_UPSAMPLER_CONFIG = {**LTX2_UPSAMPLER_CONFIG, "rational_resampler": False}

GEMMA3_12B_CONFIG = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                     "text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "num_hidden_layers": 48}}
"""The widths ltx-core reads from `google/gemma-3-12b-it`'s config.json (the rest left out)."""


def tiny_release_config(version: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The release config of `version` at the tiny sizes of `tiny_ltx2_arch` (2.3, 2.5: with the connectors
    chained to the transformer's widths, which a release config cannot express otherwise), and its upsampler's."""
    latest = version in ("2.3", "2.5")
    config = copy.deepcopy({"2.0": LTX2_19B_CONFIG, "2.3": LTX23_22B_CONFIG, "2.5": LTX25_22B_CONFIG}[version])
    config["transformer"].update({
        "in_channels": 4, "out_channels": 4, "num_attention_heads": 4, "attention_head_dim": 4,
        "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4, "audio_num_attention_heads": 2,
        "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8, "num_layers": 2, "caption_channels": 16,
        "connector_num_attention_heads": 2, "connector_attention_head_dim": 8, "connector_num_layers": 2,
        "connector_num_learnable_registers": 4, "connector_positional_embedding_max_pos": [32]})
    if latest:
        config["transformer"].update(audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=4)
    vae = config["vae"]
    vae.update(latent_channels=8, encoder_base_channels=8, decoder_base_channels=4)
    for i, (name, multiplier) in enumerate([("compress_space_res", 1), ("compress_time_res", 2),
                                            ("compress_all_res", 2), ("compress_all_res", 1)]):
        vae["encoder_blocks"][2 * i + 1] = [name, {"multiplier": multiplier}]
    for entry in vae["encoder_blocks"][::2] + vae["decoder_blocks"][::2]:
        entry[1]["num_layers"] = 1
    config["audio_vae"] = copy.deepcopy(_AUDIO_VAE)
    config["audio_vae"]["model"]["params"]["ddconfig"].update(ch=16, ch_mult=[1, 2, 2], num_res_blocks=1,
                                                              z_channels=4, mel_bins=16)
    config["audio_vae"]["preprocessing"]["mel"]["n_mel_channels"] = 16
    small = {"resblock_kernel_sizes": [3, 5], "resblock_dilation_sizes": [[1, 2], [1, 3]],
             "upsample_initial_channel": 16}
    if latest:
        config["vocoder"]["vocoder"].update(small, upsample_rates=[5, 2], upsample_kernel_sizes=[11, 4])
        config["vocoder"]["bwe"].update(upsample_initial_channel=8, upsample_rates=[6, 4],
                                        upsample_kernel_sizes=[12, 4], resblock_kernel_sizes=[3],
                                        resblock_dilation_sizes=[[1, 3]], hop_length=8, n_fft=16, win_size=16,
                                        num_mels=4)
    else:
        config["vocoder"].update(small, upsample_rates=[4, 2], upsample_kernel_sizes=[8, 4])
    upsampler = {**(LTX23_UPSAMPLER_CONFIG if latest else LTX2_UPSAMPLER_CONFIG), "in_channels": 8, "mid_channels": 32,
                 "num_blocks_per_stage": 1}
    return config, upsampler
