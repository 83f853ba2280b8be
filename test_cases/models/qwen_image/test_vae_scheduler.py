"""Qwen-Image VAE, scheduler and latent layout: parity with diffusers 0.42.1 (CPU, float32).

References: `AutoencoderKLQwenImage`, `FlowMatchEulerDiscreteScheduler` with Qwen-Image's config and
`QwenImagePipeline`'s `calculate_shift`, `_pack_latents`, `_unpack_latents` and its CFG formula.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from runnerkit.models.qwen_image.arch import QwenImageVAEArch
from runnerkit.models.qwen_image.latents import pack_latents, true_cfg, unpack_latents
from runnerkit.models.qwen_image.scheduler import (
    QwenImageScheduler,
    QwenSchedulerConfig,
    calculate_mu,
    qwen_schedule,
    read_scheduler_config,
    write_scheduler_config,
)
from runnerkit.models.qwen_image.vae import (
    arch_from_diffusers_config,
    arch_to_diffusers_config,
    build_qwen_vae,
    decode_latents,
    diffusers_to_native,
    encode_image,
    native_to_diffusers,
)
from runnerkit.weights import CheckpointError
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline, calculate_shift  # noqa: E402

VAE_TOL = 1e-4
TINY_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)

# `Qwen/Qwen-Image` scheduler/scheduler_config.json as published (diffusers does not ship it).
QWEN_SCHEDULER_JSON = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.34.0.dev0",
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
    "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
    "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
    "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False,
}
# A schedule without the terminal stretch (the Qwen-Image-Lightning config: mu fixed at ln 3).
NO_TERMINAL = QwenSchedulerConfig(base_shift=math.log(3), max_shift=math.log(3), shift_terminal=None)

# (height_px, width_px) -> target tokens (H/16) * (W/16): 16, 256, 1024, 6889 (1328^2),
# 6032 (1664 wide x 928 high), 8192 (the config's max), 9000 (beyond it: mu extrapolates).
SIZES = [(64, 64), (256, 256), (512, 512), (1328, 1328), (928, 1664), (1024, 2048), (1440, 1600)]


def latent_shape(height_px: int, width_px: int, batch: int = 1) -> tuple[int, int, int, int, int]:
    """The pipeline's latent grid: 2 * (px // 16) per side, 16 channels, one frame."""
    return (batch, 16, 1, 2 * (height_px // 16), 2 * (width_px // 16))


def diffusers_scheduler(cfg: QwenSchedulerConfig) -> diffusers.FlowMatchEulerDiscreteScheduler:
    return diffusers.FlowMatchEulerDiscreteScheduler(**cfg.model_dump())


def diffusers_set_timesteps(sched: diffusers.FlowMatchEulerDiscreteScheduler, steps: int, seq_len: int) -> None:
    """`QwenImagePipeline.__call__` step 5."""
    c = sched.config
    mu = calculate_shift(seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)


# ---- VAE ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vae_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny random `AutoencoderKLQwenImage` and ours built from its config and converted weights."""
    torch.manual_seed(0)
    reference = diffusers.AutoencoderKLQwenImage(**TINY_VAE).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)  # fan_in = in_channels * kernel volume
    arch = arch_from_diffusers_config(dict(reference.config))
    ours = build_qwen_vae(arch, diffusers_to_native(reference.state_dict()))
    return ours, reference


def test_vae_names_are_wans() -> None:
    """The reuse of Wan's converters rests on this: same parameter names and shapes as AutoencoderKLWan."""
    qwen = diffusers.AutoencoderKLQwenImage(**TINY_VAE).state_dict()
    wan = diffusers.AutoencoderKLWan(**TINY_VAE).state_dict()
    assert {k: v.shape for k, v in qwen.items()} == {k: v.shape for k, v in wan.items()}


def test_vae_encode_matches_edit_pipeline(vae_pair) -> None:
    ours, reference = vae_pair
    image = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        mode = reference.encode(image[:, :, None]).latent_dist.mode()  # retrieve_latents(..., "argmax")
    mean = torch.tensor(reference.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(reference.config.latents_std).view(1, 16, 1, 1, 1)
    expected = (mode - mean) / std  # QwenImageEditPlusPipeline._encode_vae_image
    got = encode_image(ours, image)
    assert got.shape == (1, 16, 1, 4, 6) and got.dtype == torch.float32
    err = (got - expected).abs().max().item()
    print(f"encode max abs err {err:.3e} (latents std {expected.std():.3f})")
    assert err <= VAE_TOL


def test_vae_decode_matches_pipeline(vae_pair) -> None:
    ours, reference = vae_pair
    latents = torch.randn(2, 16, 1, 4, 6, generator=torch.Generator().manual_seed(3))
    # QwenImagePipeline.__call__ after the loop (output_type != "latent"), before postprocess.
    mean = torch.tensor(reference.config.latents_mean).view(1, 16, 1, 1, 1)
    std_inv = 1.0 / torch.tensor(reference.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        expected = reference.decode(latents / std_inv + mean, return_dict=False)[0][:, :, 0]
    got = decode_latents(ours, latents)
    assert got.shape == (2, 3, 32, 48) and got.dtype == torch.float32
    err = (got - expected).abs().max().item()
    print(f"decode max abs err {err:.3e}; clamped share {(expected.abs() == 1).float().mean():.3f}")
    assert err <= VAE_TOL
    assert got.abs().max() <= 1.0


def test_vae_config_round_trip(vae_pair) -> None:
    ours, reference = vae_pair
    config = arch_to_diffusers_config(ours.arch)
    assert config["_class_name"] == "AutoencoderKLQwenImage"
    assert arch_from_diffusers_config(config) == ours.arch
    rebuilt = diffusers.AutoencoderKLQwenImage(**{k: v for k, v in config.items() if not k.startswith("_")})
    assert {k: v for k, v in rebuilt.config.items() if not k.startswith("_")} == \
        {k: v for k, v in reference.config.items() if not k.startswith("_")}
    # diffusers' constructor defaults are the released Qwen-Image VAE, and so is the default arch.
    defaults = {name: p.default for name, p in
                inspect.signature(diffusers.AutoencoderKLQwenImage.__init__).parameters.items() if name != "self"}
    assert arch_from_diffusers_config(defaults) == arch_from_diffusers_config({}) == QwenImageVAEArch()


@pytest.mark.parametrize(("key", "value"), [
    ("in_channels", 3),  # an AutoencoderKLWan key, not a Qwen-Image one
    ("_class_name", "AutoencoderKLWan"),
    ("input_channels", 4),
    ("dropout", 1.5),
    ("attn_scales", [0.5]),
    ("latents_std", [1.0] * 15),
])
def test_vae_config_refuses(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"`?{key}`?"):
        arch_from_diffusers_config({**TINY_VAE, key: value})


def test_vae_key_conversion_strict_and_reversible(vae_pair) -> None:
    _, reference = vae_pair
    sd = reference.state_dict()
    assert native_to_diffusers(diffusers_to_native(sd)).keys() == sd.keys()
    with pytest.raises(CheckpointError, match="encoder.extra.weight"):
        diffusers_to_native({**sd, "encoder.extra.weight": torch.zeros(1)})


# ---- scheduler ----------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [2, 4, 50])
@pytest.mark.parametrize(("height_px", "width_px"), SIZES)
def test_schedule_matches_diffusers(height_px: int, width_px: int, steps: int) -> None:
    shape = latent_shape(height_px, width_px)
    seq_len = (height_px // 16) * (width_px // 16)
    reference = diffusers_scheduler(QwenSchedulerConfig())
    diffusers_set_timesteps(reference, steps, seq_len)
    ours = QwenImageScheduler(QwenSchedulerConfig())
    ours.prepare(shape, steps, seed=0, device="cpu")
    assert ours.image_seq_len(shape) == seq_len == pack_latents(torch.zeros(shape)).shape[1]
    assert ours.mu == calculate_shift(seq_len, 256, 8192, 0.5, 0.9)
    assert ours.sigmas.dtype == ours.timesteps.dtype == torch.float32
    assert torch.equal(ours.sigmas, reference.sigmas)
    assert torch.equal(ours.timesteps, reference.timesteps)
    assert math.isclose(ours.sigmas[-2].item(), 0.02, rel_tol=1e-5)  # the terminal stretch
    _, timestep = ours.step_pre(0)
    assert torch.equal(timestep, reference.timesteps[0].expand(1))


@pytest.mark.parametrize("steps", [1, 4, 50])
@pytest.mark.parametrize("seq_len", [16, 6032, 9000])
def test_schedule_without_terminal_matches_diffusers(seq_len: int, steps: int) -> None:
    reference = diffusers_scheduler(NO_TERMINAL)
    diffusers_set_timesteps(reference, steps, seq_len)
    sigmas, timesteps = qwen_schedule(steps, calculate_mu(seq_len, NO_TERMINAL), NO_TERMINAL)
    assert torch.equal(sigmas, reference.sigmas) and torch.equal(timesteps, reference.timesteps)


def test_one_step_with_terminal_is_refused() -> None:
    """diffusers stretches 0 / 0 into a NaN sigma; runnerkit refuses the request instead."""
    reference = diffusers_scheduler(QwenSchedulerConfig())
    with np.errstate(invalid="ignore", divide="ignore"):
        diffusers_set_timesteps(reference, 1, 256)
    assert torch.isnan(reference.sigmas[0])
    ours = QwenImageScheduler()
    with pytest.raises(ValueError, match="infer_steps"):
        ours.prepare(latent_shape(256, 256), 1, seed=0, device="cpu")
    assert ours.mu is None and ours.latents is None


def test_euler_steps_match_diffusers() -> None:
    height_px, width_px, steps, seed = 256, 384, 4, 7
    shape = latent_shape(height_px, width_px, batch=2)
    B, C, _, H, W = shape
    ours = QwenImageScheduler()
    ours.prepare(shape, steps, seed=seed, device="cpu")

    reference = diffusers_scheduler(QwenSchedulerConfig())
    # QwenImagePipeline.prepare_latents: randn (B, 1, C, H, W) from the CPU generator, packed.
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = diffusers.utils.torch_utils.randn_tensor((B, 1, C, H, W), generator=generator, dtype=torch.float32)
    expected = QwenImagePipeline._pack_latents(noise, B, C, H, W)
    assert torch.equal(pack_latents(ours.latents), expected)
    diffusers_set_timesteps(reference, steps, expected.shape[1])
    reference.set_begin_index(0)

    outputs = torch.Generator().manual_seed(11)
    for i, t in enumerate(reference.timesteps):
        velocity = torch.randn(expected.shape, generator=outputs)  # [B, L, C*4], one "model output" per step
        _, timestep = ours.step_pre(i)
        assert torch.equal(timestep, t.expand(B))
        ours.step_post(unpack_latents(velocity, height_px, width_px))
        expected = reference.step(velocity, t, expected, return_dict=False)[0]
        assert torch.equal(pack_latents(ours.latents), expected), f"step {i}"


def test_clear_gives_a_fresh_scheduler() -> None:
    ours = QwenImageScheduler()
    ours.prepare(latent_shape(512, 256), 3, seed=0, device="cpu")
    ours.step_pre(0)
    ours.step_post(torch.ones(ours.latents.shape))
    assert ours.mu is not None
    ours.clear()
    assert vars(ours) == vars(QwenImageScheduler())


# ---- scheduler config ---------------------------------------------------------------------

def test_scheduler_config_reads_release_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "scheduler" / "scheduler_config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(QWEN_SCHEDULER_JSON))
    assert read_scheduler_config(path) == QwenSchedulerConfig()

    written = write_scheduler_config(tmp_path / "out" / "scheduler_config.json", NO_TERMINAL)
    assert read_scheduler_config(written) == NO_TERMINAL
    loaded = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(written.parent)
    assert {k: loaded.config[k] for k in NO_TERMINAL.model_dump()} == NO_TERMINAL.model_dump()


@pytest.mark.parametrize(("key", "value"), [
    ("use_dynamic_shifting", False),
    ("time_shift_type", "linear"),
    ("use_karras_sigmas", True),
    ("invert_sigmas", True),
    ("stochastic_sampling", True),
    ("sigma_min", 0.1),  # not a FlowMatchEulerDiscreteScheduler key
    ("_class_name", "UniPCMultistepScheduler"),
    ("shift_terminal", 1.0),
])
def test_scheduler_config_refuses(tmp_path: Path, key: str, value: object) -> None:
    path = tmp_path / "scheduler_config.json"
    path.write_text(json.dumps({**QWEN_SCHEDULER_JSON, key: value}))
    with pytest.raises(ValueError, match=key):
        read_scheduler_config(path)


# ---- latents ------------------------------------------------------------------------------

@pytest.mark.parametrize(("height_px", "width_px"), [(64, 96), (1000, 600), (928, 1664)])
def test_pack_unpack_match_diffusers(height_px: int, width_px: int) -> None:
    B, C, _, H, W = latent_shape(height_px, width_px, batch=2)
    latents = torch.randn(B, C, 1, H, W, generator=torch.Generator().manual_seed(4))
    packed = pack_latents(latents)
    assert packed.shape == (B, (H // 2) * (W // 2), C * 4)
    assert torch.equal(packed, QwenImagePipeline._pack_latents(latents, B, C, H, W))
    unpacked = unpack_latents(packed, height_px, width_px)
    assert torch.equal(unpacked, QwenImagePipeline._unpack_latents(packed, height_px, width_px, 8))
    assert torch.equal(unpacked, latents)


def test_pack_puts_each_patch_in_one_token() -> None:
    """Golden layout: token (i, j) holds channel c's 2x2 patch at [c*4 + 2*di + dj]."""
    latents = torch.arange(2 * 4 * 6, dtype=torch.float32).view(1, 2, 1, 4, 6)
    packed = pack_latents(latents)  # [1, 2*3, 8]
    assert packed[0, 4].tolist() == [14, 15, 20, 21, 38, 39, 44, 45]  # token (1, 1): rows 2-3, cols 2-3


def pipeline_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """`QwenImagePipeline.__call__`'s true CFG, written out in its order of operations."""
    comb_pred = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    return comb_pred * (cond_norm / noise_norm)


@pytest.mark.parametrize("scale", [1.5, 4.0, 7.5])
def test_true_cfg_matches_pipeline(scale: float) -> None:
    generator = torch.Generator().manual_seed(5)
    cond, uncond = torch.randn(2, 2, 24, 64, generator=generator)
    assert torch.equal(true_cfg(cond, uncond, scale), pipeline_cfg(cond, uncond, scale))
    # bfloat16 predictions are combined in float32.
    got = true_cfg(cond.bfloat16(), uncond.bfloat16(), scale)
    assert got.dtype == torch.float32
    assert torch.equal(got, pipeline_cfg(cond.bfloat16().float(), uncond.bfloat16().float(), scale))
    # Each token keeps cond's norm.
    torch.testing.assert_close(got.norm(dim=-1), cond.bfloat16().float().norm(dim=-1))


def test_true_cfg_scale_one_is_cond() -> None:
    cond, uncond = torch.randn(2, 1, 8, 16, generator=torch.Generator().manual_seed(6))
    assert torch.equal(true_cfg(cond, uncond, 1.0), cond)
