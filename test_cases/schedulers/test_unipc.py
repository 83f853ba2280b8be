"""FlowUniPCScheduler with the "diffusers" spacing: parity with diffusers' flow UniPC, randomness, state
ownership, warmup jumps (the "train_range" spacing: test_spacing.py)."""

from __future__ import annotations

import pytest
import torch

from runnerkit.schedulers import SCHEDULERS, FlowUniPCScheduler
from test_cases._reference import require_reference
from test_cases.schedulers import LATENT_SHAPE, assert_same_state, fake_velocity

diffusers = require_reference("diffusers")


def reference_unipc(shift: float, steps: int, solver_order: int = 2) -> object:
    """diffusers' UniPC configured as diffusers' WanPipeline samples with it (flow prediction, bh2, x0 form)."""
    ref = diffusers.UniPCMultistepScheduler(
        num_train_timesteps=1000,
        solver_order=solver_order,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=shift,
        predict_x0=True,
        solver_type="bh2",
        lower_order_final=True,
        disable_corrector=[],
        final_sigmas_type="zero",
    )
    ref.set_timesteps(steps, device="cpu")
    return ref


@pytest.mark.parametrize("steps", [1, 6, 10, 50])
@pytest.mark.parametrize("shift", [5.0, 3.0, 1.0])
def test_schedule_matches_diffusers_exactly(steps: int, shift: float) -> None:
    s = FlowUniPCScheduler(shift=shift, spacing="diffusers")
    s.prepare(LATENT_SHAPE, steps, seed=0, device="cpu")
    ref = reference_unipc(shift, steps)
    assert s.sigmas.dtype == torch.float32 and torch.equal(s.sigmas, ref.sigmas)
    assert s.timesteps.dtype == torch.int64 and torch.equal(s.timesteps, ref.timesteps)
    assert s.sigmas[-1].item() == 0.0 and s.sigmas[0].item() < 1.0


@pytest.mark.parametrize("solver_order", [1, 2])
@pytest.mark.parametrize("shift", [5.0, 3.0])
@pytest.mark.parametrize("steps", [6, 10])
def test_trajectory_matches_diffusers(steps: int, shift: float, solver_order: int) -> None:
    s = FlowUniPCScheduler(shift=shift, solver_order=solver_order, spacing="diffusers")
    s.prepare(LATENT_SHAPE, steps, seed=1234, device="cpu")
    ref = reference_unipc(shift, steps, solver_order)
    ref.set_begin_index(0)
    ref_latents = torch.randn(LATENT_SHAPE, generator=torch.Generator("cpu").manual_seed(1234))
    assert torch.equal(s.latents, ref_latents)

    for i in range(steps):
        latents, timestep = s.step_pre(i)
        assert timestep.dtype == torch.int64 and torch.equal(timestep, ref.timesteps[i].repeat(LATENT_SHAPE[0]))
        s.step_post(fake_velocity(latents, i))
        ref_latents = ref.step(fake_velocity(ref_latents, i), ref.timesteps[i], ref_latents).prev_sample
        err = (s.latents - ref_latents).abs().max().item()
        assert err <= 1e-5, f"step {i}: max abs err {err:.3e}"
    assert s.step_index == steps
    assert torch.isfinite(s.latents).all()


@pytest.mark.parametrize("shift", [5.0, 3.0])
def test_production_step_count_matches_diffusers(shift: float) -> None:
    # 50 steps (Wan2.1's default). A smooth velocity: the step-dependent sin(x * (i + 1)) gets
    # stiff at i ~ 50 and amplifies float32 rounding differences of either implementation.
    def velocity(x: torch.Tensor) -> torch.Tensor:
        return 0.7 * x + 0.3 * torch.sin(x)

    s = FlowUniPCScheduler(shift=shift, spacing="diffusers")
    s.prepare(LATENT_SHAPE, 50, seed=1234, device="cpu")
    ref = reference_unipc(shift, 50)
    ref.set_begin_index(0)
    ref_latents = s.latents.clone()
    for i in range(50):
        s.step_post(velocity(s.step_pre(i)[0]))
        ref_latents = ref.step(velocity(ref_latents), ref.timesteps[i], ref_latents).prev_sample
    assert (s.latents - ref_latents).abs().max().item() <= 1e-5


def test_jump_then_consecutive_steps_match_diffusers_begin_index() -> None:
    # After set_step(k) the solver restarts from an empty history, like diffusers started at k.
    steps, k = 10, 4
    s = FlowUniPCScheduler(shift=5.0, spacing="diffusers")
    s.prepare(LATENT_SHAPE, steps, seed=7, device="cpu")
    s.step_post(fake_velocity(s.step_pre(0)[0], 0))  # fill some history first
    s.set_step(k)
    ref = reference_unipc(5.0, steps)
    ref.set_begin_index(k)
    ref_latents = s.latents.clone()
    for i in range(k, steps):
        latents, _ = s.step_pre(i)
        s.step_post(fake_velocity(latents, i))
        ref_latents = ref.step(fake_velocity(ref_latents, i), ref.timesteps[i], ref_latents).prev_sample
        assert (s.latents - ref_latents).abs().max().item() <= 1e-5, f"step {i}"


def test_set_step_to_last_step_is_first_order_x0_update() -> None:
    s = FlowUniPCScheduler(shift=5.0, spacing="diffusers")
    s.prepare(LATENT_SHAPE, 6, seed=3, device="cpu")
    s.step_post(fake_velocity(s.step_pre(0)[0], 0))
    sigmas_before, latents_before = s.sigmas.clone(), s.latents.clone()
    assert len(s.model_outputs) == 1 and s.last_sample is not None

    s.set_step(5)
    assert s.step_index == 5 and s.model_outputs == [] and s.last_sample is None and s.last_order == 0
    assert torch.equal(s.sigmas, sigmas_before) and torch.equal(s.latents, latents_before)

    latents, timestep = s.step_pre(5)
    assert torch.equal(timestep, s.timesteps[5].repeat(LATENT_SHAPE[0]))
    v = fake_velocity(latents, 5)
    s.step_post(v)
    # Last step, sigma_next = 0: the first-order update lands on x0 = x - sigma * v.
    expected = latents - s.sigmas[5].item() * v
    assert torch.isfinite(s.latents).all()
    torch.testing.assert_close(s.latents, expected, atol=1e-6, rtol=0)
    assert s.step_index == 6


def test_set_step_to_middle_step_is_euler_update() -> None:
    s = FlowUniPCScheduler(shift=3.0, spacing="diffusers")
    s.prepare(LATENT_SHAPE, 6, seed=3, device="cpu")
    s.set_step(3)
    latents, _ = s.step_pre(3)
    v = fake_velocity(latents, 3)
    s.step_post(v)
    # UniP-1 in data-prediction form is exactly the flow Euler step.
    expected = latents + (s.sigmas[4].item() - s.sigmas[3].item()) * v
    torch.testing.assert_close(s.latents, expected, atol=1e-6, rtol=0)
    assert s.last_order == 1


def test_set_step_to_current_step_keeps_history() -> None:
    s = FlowUniPCScheduler(spacing="diffusers")
    s.prepare(LATENT_SHAPE, 6, seed=3, device="cpu")
    s.step_post(fake_velocity(s.step_pre(0)[0], 0))
    s.set_step(1)
    assert len(s.model_outputs) == 1 and s.last_sample is not None


def test_reset_history_keeps_request_state_and_restarts_first_order() -> None:
    s = FlowUniPCScheduler(shift=5.0, spacing="diffusers")
    s.prepare(LATENT_SHAPE, 6, seed=11, device="cpu")
    for i in range(2):
        s.step_post(fake_velocity(s.step_pre(i)[0], i))
    kept = {name: getattr(s, name) for name in ("latents", "sigmas", "timesteps", "generator", "step_index")}
    s.reset_history()
    assert s.model_outputs == [] and s.last_sample is None and s.last_order == 0
    for name, value in kept.items():
        assert getattr(s, name) is value, name
    latents, _ = s.step_pre(2)
    v = fake_velocity(latents, 2)
    s.step_post(v)
    expected = latents + (s.sigmas[3].item() - s.sigmas[2].item()) * v
    torch.testing.assert_close(s.latents, expected, atol=1e-6, rtol=0)


def _trajectory(seed: int) -> list[torch.Tensor]:
    s = FlowUniPCScheduler(spacing="diffusers")
    s.prepare(LATENT_SHAPE, 6, seed=seed, device="cpu")
    out = [s.latents.clone()]
    for i in range(6):
        latents, _ = s.step_pre(i)
        s.step_post(fake_velocity(latents, i))
        out.append(s.latents.clone())
    return out


def test_same_seed_is_bit_identical_and_different_seeds_differ() -> None:
    a, b, c = _trajectory(42), _trajectory(42), _trajectory(43)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[-1], c[-1])


def test_generator_created_at_prepare_on_cpu() -> None:
    s = FlowUniPCScheduler(spacing="diffusers")
    assert s.generator is None
    s.prepare(LATENT_SHAPE, 4, seed=5, device="cpu")
    assert isinstance(s.generator, torch.Generator) and s.generator.device.type == "cpu"
    expected = torch.randn(LATENT_SHAPE, generator=torch.Generator("cpu").manual_seed(5))
    assert torch.equal(s.latents, expected)


def test_generator_is_cpu_for_other_devices() -> None:
    s = FlowUniPCScheduler(spacing="diffusers")
    s.prepare(LATENT_SHAPE, 4, seed=5, device="meta", dtype=torch.bfloat16)
    assert s.generator.device.type == "cpu"
    assert s.latents.device.type == "meta" and s.latents.dtype == torch.float32
    assert s.timesteps.device.type == "meta" and s.sigmas.device.type == "cpu"


def test_generator_reused_when_an_encoder_drew_first() -> None:
    s = FlowUniPCScheduler(spacing="diffusers")
    encoder_generator = torch.Generator("cpu").manual_seed(7)
    s.generator = encoder_generator
    torch.randn(5, generator=encoder_generator)  # an encoder's draw, earlier in the request
    s.prepare(LATENT_SHAPE, 4, seed=999, device="cpu")
    assert s.generator is encoder_generator
    replay = torch.Generator("cpu").manual_seed(7)
    torch.randn(5, generator=replay)
    assert torch.equal(s.latents, torch.randn(LATENT_SHAPE, generator=replay))


def test_model_dtype_latents_stay_float32() -> None:
    s = FlowUniPCScheduler(spacing="diffusers")
    s.prepare(LATENT_SHAPE, 4, seed=0, device="cpu", dtype=torch.bfloat16)
    latents, timestep = s.step_pre(0)
    assert latents.dtype == torch.bfloat16 and s.latents.dtype == torch.float32
    assert timestep.shape == (LATENT_SHAPE[0],) and timestep.dtype == torch.int64
    s.step_post(fake_velocity(latents, 0))  # a bf16 model output is accepted
    assert s.latents.dtype == torch.float32 and s.step_index == 1


@pytest.mark.parametrize("solver_order", [1, 2])
def test_clear_restores_fresh_state(solver_order: int) -> None:
    s = FlowUniPCScheduler(shift=3.0, solver_order=solver_order, spacing="diffusers")
    first = _run(s, seed=21, steps=6)
    s.prepare(LATENT_SHAPE, 6, seed=21, device="cpu")
    for i in range(3):
        s.step_post(fake_velocity(s.step_pre(i)[0], i))
    s.clear()
    assert_same_state(s, FlowUniPCScheduler(shift=3.0, solver_order=solver_order, spacing="diffusers"))
    assert s.generator is None and s.latents is None and s.model_outputs == []
    assert torch.equal(_run(s, seed=21, steps=6), first)  # a cleared scheduler serves the next request


def _run(s: FlowUniPCScheduler, seed: int, steps: int) -> torch.Tensor:
    s.clear()
    s.prepare(LATENT_SHAPE, steps, seed=seed, device="cpu")
    for i in range(steps):
        s.step_post(fake_velocity(s.step_pre(i)[0], i))
    return s.latents


def test_errors_name_the_argument() -> None:
    s = FlowUniPCScheduler(spacing="diffusers")
    with pytest.raises(RuntimeError, match="before prepare"):
        s.step_pre(0)
    with pytest.raises(ValueError, match="`infer_steps`.*got 0"):
        s.prepare(LATENT_SHAPE, 0, seed=0, device="cpu")
    with pytest.raises(ValueError, match="`latent_shape`"):
        s.prepare((2, 0, 3), 4, seed=0, device="cpu")
    with pytest.raises(ValueError, match="`dtype`"):
        s.prepare(LATENT_SHAPE, 4, seed=0, device="cpu", dtype=torch.int32)
    s.prepare(LATENT_SHAPE, 2, seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"`i` must equal the current step index 0.*got 1"):
        s.step_pre(1)
    with pytest.raises(ValueError, match="`noise_pred`"):
        s.step_post(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"`i` must be an integer in \[0, 1\], got 2"):
        s.set_step(2)
    for i in range(2):
        s.step_post(fake_velocity(s.step_pre(i)[0], i))
    with pytest.raises(ValueError, match="steps are done"):
        s.step_pre(2)
    with pytest.raises(ValueError, match="steps are done"):
        s.step_post(s.latents)


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="`solver_order` must be 1 or 2, got 3"):
        FlowUniPCScheduler(solver_order=3, spacing="diffusers")
    with pytest.raises(ValueError, match="`shift` must be > 0, got 0"):
        FlowUniPCScheduler(shift=0.0, spacing="diffusers")
    with pytest.raises(ValueError, match="`num_train_timesteps`"):
        FlowUniPCScheduler(num_train_timesteps=0, spacing="diffusers")


def test_registry_and_history_flag() -> None:
    assert SCHEDULERS["unipc"] is FlowUniPCScheduler
    assert FlowUniPCScheduler.keeps_history is True
