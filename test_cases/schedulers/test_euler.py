"""FlowEulerScheduler with the "diffusers" spacing: parity with diffusers' FlowMatchEulerDiscreteScheduler,
state ownership, jumps (the "train_range" spacing: test_spacing.py)."""

from __future__ import annotations

import pytest
import torch

from runnerkit.schedulers import SCHEDULERS, FlowEulerScheduler, shift_sigmas
from test_cases._reference import require_reference
from test_cases.schedulers import LATENT_SHAPE, assert_same_state, fake_velocity

diffusers = require_reference("diffusers")


def reference_euler(shift: float, steps: int) -> object:
    ref = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    ref.set_timesteps(steps, device="cpu")
    ref.set_begin_index(0)
    return ref


@pytest.mark.parametrize("steps", [1, 6, 10, 50])
@pytest.mark.parametrize("shift", [5.0, 3.0, 1.0, 3.7])
def test_schedule_matches_diffusers_exactly(steps: int, shift: float) -> None:
    s = FlowEulerScheduler(shift=shift, spacing="diffusers")
    s.prepare(LATENT_SHAPE, steps, seed=0, device="cpu")
    ref = reference_euler(shift, steps)
    assert s.sigmas.dtype == torch.float32 and torch.equal(s.sigmas, ref.sigmas)
    assert s.timesteps.dtype == torch.float32 and torch.equal(s.timesteps, ref.timesteps)
    assert s.sigmas[0].item() == 1.0 and s.sigmas[-1].item() == 0.0


def test_schedule_golden_values() -> None:
    # shift 5, 4 steps: linspace(1000, shift(1/1000) * 1000, 4) / 1000, shifted again.
    s = FlowEulerScheduler(shift=5.0, spacing="diffusers")
    s.prepare((1,), 4, seed=0, device="cpu")
    sigma_min = 5.0 * 0.001 / (1 + 4.0 * 0.001)
    expected = [shift_sigmas(1.0 - k * (1.0 - sigma_min) / 3, 5.0) for k in range(4)] + [0.0]
    torch.testing.assert_close(s.sigmas, torch.tensor(expected), atol=1e-7, rtol=0)
    torch.testing.assert_close(s.timesteps, torch.tensor(expected[:4]) * 1000, atol=1e-4, rtol=0)


@pytest.mark.parametrize("shift", [5.0, 3.0])
@pytest.mark.parametrize("steps", [6, 10])
def test_trajectory_matches_diffusers(steps: int, shift: float) -> None:
    s = FlowEulerScheduler(shift=shift, spacing="diffusers")
    s.prepare(LATENT_SHAPE, steps, seed=99, device="cpu")
    ref = reference_euler(shift, steps)
    ref_latents = torch.randn(LATENT_SHAPE, generator=torch.Generator("cpu").manual_seed(99))
    assert torch.equal(s.latents, ref_latents)

    for i in range(steps):
        latents, timestep = s.step_pre(i)
        assert timestep.dtype == torch.float32 and torch.equal(timestep, ref.timesteps[i].repeat(LATENT_SHAPE[0]))
        s.step_post(fake_velocity(latents, i))
        ref_latents = ref.step(fake_velocity(ref_latents, i), ref.timesteps[i], ref_latents).prev_sample
        # Same float32 arithmetic as diffusers: identical bit for bit.
        assert torch.equal(s.latents, ref_latents), f"step {i}"
    assert s.step_index == steps


def test_update_is_euler_formula() -> None:
    s = FlowEulerScheduler(shift=3.0, spacing="diffusers")
    s.prepare(LATENT_SHAPE, 5, seed=1, device="cpu")
    latents, _ = s.step_pre(0)
    v = fake_velocity(latents, 0)
    s.step_post(v)
    expected = latents + (s.sigmas[1].item() - s.sigmas[0].item()) * v
    torch.testing.assert_close(s.latents, expected, atol=1e-6, rtol=0)


def test_set_step_to_last_step_lands_on_x0() -> None:
    s = FlowEulerScheduler(shift=5.0, spacing="diffusers")
    s.prepare(LATENT_SHAPE, 6, seed=3, device="cpu")
    s.set_step(5)
    latents, timestep = s.step_pre(5)
    assert torch.equal(timestep, s.timesteps[5].repeat(LATENT_SHAPE[0]))
    v = fake_velocity(latents, 5)
    s.step_post(v)
    expected = latents - s.sigmas[5].item() * v  # sigma_next = 0
    assert torch.isfinite(s.latents).all()
    torch.testing.assert_close(s.latents, expected, atol=1e-6, rtol=0)
    assert s.step_index == 6


def test_reset_history_changes_nothing() -> None:
    s = FlowEulerScheduler(spacing="diffusers")
    s.prepare(LATENT_SHAPE, 4, seed=2, device="cpu")
    s.step_post(fake_velocity(s.step_pre(0)[0], 0))
    before = dict(vars(s))
    s.reset_history()
    assert vars(s) == before


def test_same_seed_bit_identical_and_generator_rules() -> None:
    a, b, c = (FlowEulerScheduler(spacing="diffusers") for _ in range(3))
    for s, seed in ((a, 8), (b, 8), (c, 9)):
        s.prepare(LATENT_SHAPE, 4, seed=seed, device="cpu")
        assert s.generator.device.type == "cpu"
        for i in range(4):
            s.step_post(fake_velocity(s.step_pre(i)[0], i))
    assert torch.equal(a.latents, b.latents) and not torch.equal(a.latents, c.latents)

    encoder_generator = torch.Generator("cpu").manual_seed(8)
    a.clear()
    a.generator = encoder_generator
    a.prepare(LATENT_SHAPE, 4, seed=123, device="cpu")
    assert a.generator is encoder_generator
    assert torch.equal(a.latents, torch.randn(LATENT_SHAPE, generator=torch.Generator("cpu").manual_seed(8)))


def test_clear_restores_fresh_state() -> None:
    s = FlowEulerScheduler(shift=3.0, spacing="diffusers")
    s.prepare(LATENT_SHAPE, 6, seed=21, device="cpu", dtype=torch.bfloat16)
    for i in range(2):
        s.step_post(fake_velocity(s.step_pre(i)[0], i))
    s.clear()
    assert_same_state(s, FlowEulerScheduler(shift=3.0, spacing="diffusers"))


def test_errors_name_the_argument() -> None:
    s = FlowEulerScheduler(spacing="diffusers")
    with pytest.raises(ValueError, match="`infer_steps`.*got 0"):
        s.prepare(LATENT_SHAPE, 0, seed=0, device="cpu")
    s.prepare(LATENT_SHAPE, 3, seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"`i` must equal the current step index 0.*got 2"):
        s.step_pre(2)


def test_registry_and_history_flag() -> None:
    assert SCHEDULERS == {"unipc": SCHEDULERS["unipc"], "euler": FlowEulerScheduler}
    assert FlowEulerScheduler.keeps_history is False


# ---- a fixed sigma table (step-distilled models) and latents of several parts -------------------
DISTILLED = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875)  # diffusers ltx2/utils.py


@pytest.mark.parametrize("table", [DISTILLED, DISTILLED[5:]])
def test_fixed_sigma_table_matches_diffusers_trajectory_exactly(table: tuple[float, ...]) -> None:
    """diffusers' Euler with `sigmas=table`, shift 1 and no dynamic shifting uses the table as given;
    ours gives the same sigmas, timesteps and latents, bit for bit."""
    ref = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    ref.set_timesteps(sigmas=list(table), device="cpu")
    ref.set_begin_index(0)
    s = FlowEulerScheduler(shift=1.0, spacing="diffusers", sigmas=table)
    s.prepare(LATENT_SHAPE, len(table), seed=3, device="cpu")
    assert torch.equal(s.sigmas, ref.sigmas) and torch.equal(s.timesteps, ref.timesteps)
    x = s.latents.clone()
    for i, t in enumerate(ref.timesteps):
        latents, timestep = s.step_pre(i)
        v = fake_velocity(latents, i)
        s.step_post(v)
        x = ref.step(v, t, x, return_dict=False)[0]
        assert torch.equal(s.latents, x), f"step {i}"


def test_fixed_sigma_table_refuses_another_step_count_and_bad_tables() -> None:
    s = FlowEulerScheduler(shift=1.0, spacing="diffusers", sigmas=DISTILLED)
    with pytest.raises(ValueError, match=r"`infer_steps` must be 8: .*fixed table"):
        s.prepare(LATENT_SHAPE, 4, seed=0, device="cpu")
    for bad in ((), (1.0, 1.0), (0.5, 0.7), (1.2, 0.5), (0.5, 0.0)):
        with pytest.raises(ValueError, match="`sigmas` must be a non-empty, strictly decreasing table"):
            FlowEulerScheduler(shift=1.0, spacing="diffusers", sigmas=bad)


def test_noise_of_several_parts_is_each_part_drawn_in_its_own_shape_in_order() -> None:
    """Video noise [1, 4, 2, 3, 5] then audio noise [1, 2, 7, 4] from one generator: the latents
    are their flat concatenation (not one draw of the joint shape: CPU randn fills in blocks)."""
    video, audio = (1, 4, 2, 3, 5), (1, 2, 7, 4)
    n = 4 * 2 * 3 * 5 + 2 * 7 * 4
    s = FlowEulerScheduler(shift=1.0, spacing="diffusers")
    s.prepare((1, n), 2, seed=11, device="cpu", noise_shapes=(video, audio))
    g = torch.Generator().manual_seed(11)
    expected = torch.cat([torch.randn(video, generator=g).flatten(1), torch.randn(audio, generator=g).flatten(1)], 1)
    assert torch.equal(s.latents, expected)
    assert not torch.equal(s.latents, torch.randn((1, n), generator=torch.Generator().manual_seed(11)))
    with pytest.raises(ValueError, match="`noise_shapes`"):
        s.prepare((1, n + 1), 2, seed=11, device="cpu", noise_shapes=(video, audio))
    with pytest.raises(ValueError, match="`noise_shapes`"):
        s.prepare((1, n), 2, seed=11, device="cpu", noise_shapes=(video, (2, 2, 7, 2)))
