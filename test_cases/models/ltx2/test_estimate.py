"""The LTX-2 memory estimate (models/ltx2/estimate.py, estimate_decoders.py).

- Weights: the releases' exact parameter counts, built on the meta device here (not through the
  estimate's own footprints); Gemma-3 12B's count is the one transformers 5.23's `Gemma3TextModel`
  gives on meta (11,766,034,176; not imported here: its import alone is over this file's budget).
- The 22B request at 512x768x121: every module's bytes = 2 x its parameters, the stages' tokens, and
  the peak of each offload mode (which stage, which weights) as the placement rules give it.
- The tiny pipeline config through the runner, before loading (synthetic checkpoint still to write).
- Formulas against measured CPU peaks (`torch.profiler` allocation events replayed in time order),
  toy widths: the transformer step and the VAE decode must bound the measurement, tightly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runnerkit.config import load_runner_config
from runnerkit.models.ltx2 import estimate as est
from runnerkit.models.ltx2.arch import LTX23_22B_ARCH, tiny_pipeline_arch
from runnerkit.models.ltx2.estimate_decoders import vae_decode_bytes
from runnerkit.models.ltx2.ltx25_arch import LTX25_22B_ARCH
from runnerkit.models.ltx2.runner import LTX2Runner
from runnerkit.models.ltx2.transformer import LTX2Transformer
from runnerkit.models.ltx2.transformer_arch import tiny_arch
from runnerkit.models.ltx2.vae import LTX2VideoDecoder
from runnerkit.models.ltx2.vae_arch import LTX23_VIDEO_VAE
from runnerkit.planning import fit
from test_cases._memory import peak_tensor_bytes
from test_cases.conftest import REPO

GIB = 1024**3
CUDA = torch.device("cuda")
CONFIGS = REPO / "configs" / "ltx2"
SHAPE = (512, 768, 121)
GEMMA_12B = {"vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256}
# LTX-2.3 parameter counts (meta builds, test_release_parameter_counts) and buffer elements (float32)
PARAMS_22B = {"transformer": 18_988_838_144, "connectors": 3_172_227_584, "vae": 726_105_969,
              "latent_upsampler": 497_867_904, "audio_decoder": 31_915_138 + 128_537_448,
              "text_encoder": 11_766_034_176}
BUFFERS_22B = {"vae": 256, "audio_decoder": 256 + 547_627}
BLOCKS_22B = 18_561_377_280


def count(component: str) -> int:
    """Parameters of the LTX-2.3 network built on meta (the estimate's cached build: once per process)."""
    return sum(p.numel() for p in est._meta(component, LTX23_22B_ARCH).parameters())


def test_release_parameter_counts() -> None:
    """The public "22B": the transformer (19.0 B, 5.7 B of it audio-named) + the text connectors (3.2 B),
    which the release file keeps under the transformer's prefix."""
    transformer = est._meta("transformer", LTX23_22B_ARCH)  # the estimate's meta build (built once per process)
    assert isinstance(transformer, LTX2Transformer)
    assert sum(p.numel() for p in transformer.parameters()) == PARAMS_22B["transformer"]
    assert sum(p.numel() for p in transformer.transformer_blocks.parameters()) == BLOCKS_22B
    assert sum(p.numel() for n, p in transformer.named_parameters() if "audio" in n) == 5_743_964_288
    assert count("connectors") == PARAMS_22B["connectors"]
    assert PARAMS_22B["transformer"] + PARAMS_22B["connectors"] == 22_161_065_728
    assert count("vae") == PARAMS_22B["vae"] and count("latent_upsampler") == PARAMS_22B["latent_upsampler"]
    assert count("audio_vae") + count("vocoder") == PARAMS_22B["audio_decoder"]
    assert est.gemma_parameters(GEMMA_12B) == PARAMS_22B["text_encoder"]


def test_ltx25_transformer_weights_follow_its_switches() -> None:
    """LTX-2.5's transformer weights: 2.3's count less the video FFN biases of 48 blocks ([16384] + [4096] each)
    plus the [1, 4096] keyframe embedding (outside the blocks)."""
    params = PARAMS_22B["transformer"] - 48 * (16384 + 4096) + 4096
    assert params == 18_987_859_200
    offload = load_runner_config(None, {"model_cls": "ltx2", "model_path": "/x"}).offload
    weights = est.footprints(LTX25_22B_ARCH, tuple(GEMMA_12B.items()), torch.bfloat16, offload)["transformer"]
    assert weights.weight_bytes == 2 * params
    blocks = est._meta("transformer", LTX25_22B_ARCH).transformer_blocks
    assert sum(p.numel() for p in blocks.parameters()) == BLOCKS_22B - 48 * (16384 + 4096)


def test_gemma_sizes_come_from_the_release_folder_config(tmp_path: Path) -> None:
    """gemma-3-12b-it's config.json (`Gemma3ForConditionalGeneration`): the sizes are in `text_config`,
    which leaves out what transformers defaults (vocabulary, head size)."""
    text = {k: v for k, v in GEMMA_12B.items() if k not in ("vocab_size", "head_dim")}
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "text_config": {"model_type": "gemma3_text", **text},
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}}))
    assert est.gemma_fields(tmp_path) == GEMMA_12B
    with pytest.raises(fit.EstimateUnavailable, match="Gemma-3 config cannot be read"):
        est.gemma_fields(tmp_path / "absent")


def estimate_22b(mode: str, task: str = "t2av") -> tuple[fit.MemoryEstimate, Any]:
    config = load_runner_config(None, {"model_cls": "ltx2", "model_path": "/x", "offload": {"mode": mode}})
    return est.ltx2_estimate(LTX23_22B_ARCH, GEMMA_12B, SHAPE, 24, task, torch.bfloat16, CUDA, config.offload), config


def test_22b_weights_and_stages_at_512x768x121() -> None:
    estimate, _ = estimate_22b("none")
    for name, params in PARAMS_22B.items():
        assert estimate.modules[name].weight_bytes == 2 * params + 4 * BUFFERS_22B.get(name, 0), name
    assert est.stage_tokens(LTX23_22B_ARCH, SHAPE, 24, 1) == ((16, 8, 12), 1536, 126)
    assert est.stage_tokens(LTX23_22B_ARCH, SHAPE, 24, 2) == ((16, 16, 24), 6144, 126)  # round(121 / 24 * 25)
    stages = {s.name: s for s in estimate.stages}
    assert list(stages) == ["text_encoder", "text_connectors", "stage1", "latent_upsampler", "stage2", "vae_decoder",
                            "audio_decoder", "save"]
    # the VAE's widest activation: 128 channels at all 121 frames x 128 x 192 (a quarter of 512 x 768), bf16;
    # a residual block holds 7 of them (input, norm, SiLU, padded copy, output, 2 x CUDA workspace) + the block input
    a = 128 * 121 * 128 * 192 * 2
    assert 7 * a < stages["vae_decoder"].activation_bytes < 8 * a
    # stage 2, per video token (D = 4096, bf16): pre.x + block input 4D, RoPE tables 4D + 2D, at the RoPE of k
    # 5 x 2D + 12D: 32D; + 17%: the text contexts' modulated copies, k and v (50 MB), stage 1's cached RoPE
    # tables (38 MB), the scheduler's joint latents (26 MB), the encoded prompt (13 MB), the audio stream (9 MB)
    assert 6144 * 32 * 4096 < stages["stage2"].activation_bytes < 1.2 * 6144 * 32 * 4096
    i2av, _ = estimate_22b("none", "i2av")
    assert [s.name for s in i2av.stages][2] == "vae_encoder"
    per_token = 2 * (2 * 9 + 1) * 4096  # the per-token AdaLN table, its embedding and the block's rows
    assert {s.name: s for s in i2av.stages}["stage2"].activation_bytes - stages["stage2"].activation_bytes \
        >= 6144 * per_token


@pytest.mark.parametrize(("mode", "stage"), [("none", "vae_decoder"), ("model", "stage2"), ("block", "text_encoder"),
                                             ("phase", "text_encoder")])
def test_the_offload_mode_moves_the_device_peak(mode: str, stage: str) -> None:
    """none: every weight resident (65.8 GiB) at the VAE decode; model: the transformer alone in its stage;
    block/phase: the transformer's resident part + slots beside Gemma-3, which never streams."""
    estimate, config = estimate_22b(mode)
    peak = fit.peak_of(estimate, config, CUDA)
    assert peak.stage == stage
    transformer = estimate.modules["transformer"]
    gemma = 2 * PARAMS_22B["text_encoder"]
    if mode == "none":
        assert peak.weight_bytes == sum(2 * p + 4 * BUFFERS_22B.get(n, 0) for n, p in PARAMS_22B.items())
    elif mode == "model":
        assert peak.weight_bytes == 2 * PARAMS_22B["transformer"]
    else:  # phase mode keeps each block's modulation tables resident too
        resident = 2 * (PARAMS_22B["transformer"] - BLOCKS_22B)
        assert transformer.stream_resident_bytes == resident if mode == "block" else \
            resident < transformer.stream_resident_bytes < 1.1 * resident
        unit = 2 * BLOCKS_22B // 48 if mode == "block" else 2 * 2 * 4096 * 4 * 4096  # a block; the video FFN
        assert 2 * unit <= transformer.stream_slot_bytes < 2.1 * unit  # 2 slots
        assert peak.weight_bytes == gemma + transformer.stream_resident_bytes + transformer.stream_slot_bytes
    bounds = {"none": (78, 79), "model": (40, 41), "block": (27, 28), "phase": (26, 27)}[mode]  # GiB, with margin
    assert bounds[0] * GIB < peak.bytes < bounds[1] * GIB


def tiny_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str = "t2av", **overrides: Any) -> LTX2Runner:
    monkeypatch.setenv("RUNNERKIT_CACHE", str(tmp_path / "cache"))
    return LTX2Runner(load_runner_config(CONFIGS / f"ltx2_{task}_tiny.json", {"device": "cpu", **overrides}))


def test_the_tiny_config_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The synthetic checkpoint is not written yet: the configured architecture and the synthetic Gemma's
    sizes; float32 weights = 4 x the parameter counts (meta builds of tiny_pipeline_arch("2.3"))."""
    runner = tiny_runner(tmp_path, monkeypatch)
    estimate = runner.estimate_memory((128, 192, 17))
    assert not (tmp_path / "cache").exists()  # nothing written to estimate
    params = {"transformer": 105_616, "connectors": 29_412, "vae": 433_179 + 16, "latent_upsampler": 161_896,
              "audio_decoder": 143_058 + 32 + 27_412 + 1_279, "text_encoder": 6_832}
    assert {n: m.weight_bytes for n, m in estimate.modules.items()} == {n: 4 * p for n, p in params.items()}
    arch = tiny_pipeline_arch("2.3")
    assert est.stage_tokens(arch, (128, 192, 17), 24, 1)[1:] == (3 * 2 * 3, 18)  # round(17 / 24 * 25)
    peaks = {}
    for mode in ("none", "model", "block"):
        runner = tiny_runner(tmp_path, monkeypatch, offload={"mode": mode})
        runner.device = CUDA  # an estimate for a CUDA device, without one (as bench/estimate_vs_peak.py --dry-run)
        peaks[mode] = fit.peak_of(runner.estimate_memory((128, 192, 17)), runner.config, CUDA)
    # none: everything resident; model: only the peak stage's module; block: that module beside the
    # transformer's resident part and slots. (At this tiny size the peak is the audio decode: the tiny
    # vocoder makes the releases' 160 x 3 samples per mel frame, more than the tiny VAE's decode.)
    module_of = {"vae_decoder": "vae", "audio_decoder": "audio_decoder", "stage2": "transformer"}
    assert peaks["none"].weight_bytes == sum(4 * p for p in params.values())
    assert peaks["model"].weight_bytes == 4 * params[module_of[peaks["model"].stage]]
    transformer = runner.estimate_memory((128, 192, 17)).modules["transformer"]
    assert transformer.stream_resident_bytes is not None and peaks["block"].stage != "stage2"
    assert peaks["block"].weight_bytes == (4 * params[module_of[peaks["block"].stage]]
                                           + transformer.stream_resident_bytes + transformer.stream_slot_bytes)
    assert peaks["none"].bytes > peaks["block"].bytes > peaks["model"].bytes


def test_a_real_config_is_checked_once_its_checkpoint_is_readable(tmp_path: Path) -> None:
    """The 22B config with no checkpoint there: no tiny architecture stands in; the check waits for the load."""
    (tmp_path / "gemma").mkdir()
    (tmp_path / "upsampler.safetensors").touch()
    config = load_runner_config(CONFIGS / "ltx23_t2av_22b_distilled.json", {
        "model_path": str(tmp_path / "absent.safetensors"), "device": "cpu", "text_encoder_path": str(tmp_path / "gemma"),
        "upsampler_path": str(tmp_path / "upsampler.safetensors")})
    runner = LTX2Runner(config)
    assert runner.arch_override is None
    with pytest.raises(fit.EstimateUnavailable, match="cannot be read before loading"):
        runner.estimate_memory(SHAPE)
    assert runner.memory_checks.check_fit(SHAPE, "request 0") is None


def test_the_runner_reads_gemma_from_the_configured_folder(tmp_path: Path) -> None:
    """Single file: `text_encoder_path`; a diffusers folder: its `text_encoder/` (read before loading)."""
    gemma = tmp_path / "gemma-3-12b-it"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": GEMMA_12B}))
    (tmp_path / "upsampler.safetensors").touch()
    single = LTX2Runner(load_runner_config(CONFIGS / "ltx23_t2av_22b_distilled.json", {
        "device": "cpu", "model_path": str(tmp_path / "x.safetensors"), "text_encoder_path": str(gemma),
        "upsampler_path": str(tmp_path / "upsampler.safetensors")}))
    assert single.gemma_sizes(LTX23_22B_ARCH) == GEMMA_12B
    folder = tmp_path / "diffusers"
    (folder / "text_encoder").mkdir(parents=True)
    (folder / "text_encoder" / "config.json").write_text(json.dumps({"model_type": "gemma3_text", **GEMMA_12B,
                                                                     "num_hidden_layers": 4}))
    config = json.loads((CONFIGS / "ltx23_t2av_22b_distilled.json").read_text())
    del config["upsampler_path"], config["text_encoder_path"]
    runner = LTX2Runner(load_runner_config(None, {**config, "device": "cpu", "model_path": str(folder)}))
    assert runner.gemma_sizes(LTX23_22B_ARCH) == {**GEMMA_12B, "num_hidden_layers": 4}


# ---- formulas against measured CPU peaks ------------------------------------------------------
@pytest.mark.parametrize("i2av", [False, True])
def test_transformer_step_bounds_the_measured_peak(i2av: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Video 4 x 64 and audio 2 x 64 wide (the releases' ratio), 1152 video and 40 audio tokens, float32
    (the CPU's unfused FFN is the peak). Ratios when written: t2av 1.06, i2av 1.03."""
    monkeypatch.setattr(est, "TEXT_TOKENS", 64)
    t = tiny_arch("2.3", in_channels=8, out_channels=8, audio_in_channels=16, audio_out_channels=16,
                  num_attention_heads=4, attention_head_dim=64, cross_attention_dim=256, audio_num_attention_heads=2,
                  audio_attention_head_dim=64, audio_cross_attention_dim=128)
    arch = tiny_pipeline_arch("2.3").model_copy(update={"transformer": t})
    model = LTX2Transformer(t).eval()
    F_, H, W, La = 3, 16, 24, 40
    gen = torch.Generator().manual_seed(0)
    video, audio = torch.randn(1, F_ * H * W, 8, generator=gen), torch.randn(1, La, 16, generator=gen)
    context, audio_context = torch.randn(1, 64, 256, generator=gen), torch.randn(1, 64, 128, generator=gen)
    sigma = torch.tensor([500.0])
    timestep = {"timestep": sigma[:, None].expand(1, F_ * H * W).clone(), "audio_timestep": sigma} if i2av \
        else {"timestep": sigma}
    mask = torch.ones(1, 64, dtype=torch.int64)

    def step() -> Any:
        with torch.inference_mode():
            model.clear_cache()  # the RoPE tables are built in the step, as in a request's first step
            return model(video, audio, context, audio_context, num_frames=F_, height=H, width=W, audio_num_frames=La,
                         sigma=sigma, encoder_attention_mask=mask, audio_encoder_attention_mask=mask, **timestep)

    measured = peak_tensor_bytes(step)
    formula, _ = est.transformer_step_bytes(arch, F_ * H * W, La, 4, "cpu", i2av)
    assert 1.0 <= formula / measured <= 1.1, f"{formula} / {measured} = {formula / measured:.3f}"


def test_vae_decode_bounds_the_measured_peak() -> None:
    """The LTX-2.3 decoder's block structure (spatiotemporal, spatiotemporal, temporal, spatial up blocks) at
    1/4 of its widths, float32, decoding 2 latent frames to 9 at once: the peak is inside the last up block,
    after its upsampler, with the block's input still held by the decoder. Ratio when written: 1.000."""
    arch = LTX23_VIDEO_VAE.model_copy(update={"latent_channels": 16, "decoder_block_out_channels": (64, 128, 128, 256),
                                              "decoder_layers_per_block": (1, 2, 1, 1, 1)})
    decoder = LTX2VideoDecoder(arch).eval()
    latents = torch.randn(1, 16, 2, 2, 3, generator=torch.Generator().manual_seed(0))

    def decode() -> Any:
        with torch.inference_mode():
            return decoder(latents).float().clamp(-1, 1)  # as the runner's run_vae_decoder ends

    measured = peak_tensor_bytes(decode) + latents.numel() * 4  # the latents were allocated before profiling
    formula, _ = vae_decode_bytes(arch, (2, 2, 3), 4, "cpu")
    assert 1.0 <= formula / measured <= 1.01, f"{formula} / {measured} = {formula / measured:.4f}"
