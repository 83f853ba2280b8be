"""The "train_range" sigma spacing: golden schedule of the Wan2.1 reference, its update, and the gap to diffusers'.

Golden values (GOLDEN below) were taken from the reference itself: Wan-Video/Wan2.1 at commit
9737cba9c1c3c4d04b33fcad41c111989865d315, file `wan/utils/fm_solvers_unipc.py` (last changed in
76e9427657c74f7d063f6c50fce9529900c59e28, a formatting-only commit), run unmodified in a one-off
script outside this repository (diffusers 0.42.1, numpy 2.4.6, torch 2.13.0+cpu) exactly as
`wan/text2video.py` builds it:

    s = FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
    s.set_timesteps(steps, device="cpu", shift=shift)
    s.timesteps.tolist(), s.sigmas.tolist()          # int64 and float32 tensors

The same script recomputed every value from the formula alone and got identical numbers:
`u = linspace(float32(1 - 1/1000), 0, steps + 1)[:-1]` (float64), `sigma = shift * u / (1 + (shift
- 1) * u)` (float64), `timestep = trunc(1000 * sigma)`, sigmas stored as float32 with a final 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from runnerkit.config import RunnerConfig
from runnerkit.schedulers import SCHEDULERS, SPACINGS, FlowEulerScheduler, FlowUniPCScheduler
from test_cases.schedulers import LATENT_SHAPE, assert_same_state

Velocity = Callable[[torch.Tensor, int], torch.Tensor]

# (steps, shift) -> (timesteps, sigmas) of the reference; see the module docstring for provenance.
GOLDEN: dict[tuple[int, float], tuple[list[int], list[float]]] = {
    (50, 5.0): (
        [999, 995, 991, 987, 982, 978, 973, 968, 963, 957, 952, 946, 940, 934, 927, 920, 913, 906, 898, 890,
         882, 873, 863, 854, 843, 833, 821, 809, 796, 783, 768, 753, 737, 720, 701, 681, 660, 636, 611, 584,
         555, 522, 487, 448, 405, 356, 302, 241, 172, 92],
        [0.9997998476028442, 0.9957323670387268, 0.9915304780006409, 0.987187385559082, 0.9826958179473877,
         0.9780480265617371, 0.9732357859611511, 0.9682501554489136, 0.9630816578865051, 0.9577199220657349,
         0.9521540403366089, 0.9463720321655273, 0.9403610825538635, 0.9341073036193848, 0.9275957345962524,
         0.9208101034164429, 0.913732647895813, 0.9063441753387451, 0.8986237049102783, 0.8905484676361084,
         0.8820932507514954, 0.8732306957244873, 0.8639306426048279, 0.8541598320007324, 0.8438816070556641,
         0.8330553770065308, 0.8216361403465271, 0.8095738291740417, 0.7968124747276306, 0.7832895517349243,
         0.7689347267150879, 0.7536689043045044, 0.7374023795127869, 0.720033586025238, 0.7014464139938354,
         0.6815081238746643, 0.6600657105445862, 0.6369423866271973, 0.6119323968887329, 0.5847949981689453,
         0.5552467703819275, 0.5229514837265015, 0.48750731348991394, 0.44843021035194397, 0.40513139963150024,
         0.35688769817352295, 0.3028006851673126, 0.24174034595489502, 0.17226514220237732, 0.09250685572624207,
         0.0]),
    (50, 3.0): (
        [999, 992, 985, 978, 971, 963, 956, 948, 939, 931, 922, 913, 904, 894, 884, 874, 864, 853, 841, 829,
         817, 805, 792, 778, 764, 749, 734, 718, 701, 684, 666, 647, 627, 606, 585, 562, 538, 512, 486, 458,
         428, 396, 363, 327, 290, 249, 206, 160, 111, 57],
        [0.9996664524078369, 0.9929074645042419, 0.9859634041786194, 0.9788264632225037, 0.9714885950088501,
         0.9639410972595215, 0.9561749696731567, 0.9481804966926575, 0.9399474263191223, 0.9314650297164917,
         0.9227216839790344, 0.9137052297592163, 0.9044026732444763, 0.8948001265525818, 0.8848828673362732,
         0.8746352195739746, 0.8640403151512146, 0.8530802130699158, 0.8417357206344604, 0.8299862742424011,
         0.8178097009658813, 0.8051823973655701, 0.7920788526535034, 0.7784715294837952, 0.7643308639526367,
         0.7496247887611389, 0.7343188524246216, 0.7183755040168762, 0.7017540335655212, 0.6844102740287781,
         0.666296124458313, 0.6473590731620789, 0.6275417804718018, 0.6067813038825989, 0.5850088000297546,
         0.5621483325958252, 0.5381162762641907, 0.5128201842308044, 0.48615768551826477, 0.45801496505737305,
         0.42826521396636963, 0.3967667818069458, 0.36336082220077515, 0.32786861062049866, 0.290088415145874,
         0.24979163706302643, 0.20671817660331726, 0.16057077050209045, 0.11100822687149048, 0.05763683468103409,
         0.0]),
    (10, 5.0): (
        [999, 978, 952, 920, 882, 833, 768, 681, 555, 356],
        [0.9997998476028442, 0.9780480265617371, 0.9521540403366089, 0.9208101034164429, 0.8820932507514954,
         0.8330553770065308, 0.7689347267150879, 0.6815081238746643, 0.5552467703819275, 0.35688769817352295,
         0.0]),
    (4, 5.0): ([999, 937, 833, 624], [0.9997998476028442, 0.9372654557228088, 0.8330553770065308, 0.6246873736381531, 0.0]),
    (1, 5.0): ([999], [0.9997998476028442, 0.0]),
}


def smooth_velocity(latents: torch.Tensor, step: int) -> torch.Tensor:
    """A fixed stand-in for the transformer, smooth enough that float32 rounding is not amplified
    over 50 steps (`fake_velocity`'s sin(x * (i + 1)) gets stiff late in a long schedule)."""
    return 0.7 * latents + 0.3 * torch.sin(latents + 0.25 * step)


def _log_snr(sigma: float) -> float:
    return math.inf if sigma == 0 else math.log(1 - sigma) - math.log(sigma)


def reference_unipc_float64(sigmas: list[float], x: torch.Tensor, solver_order: int, velocity: Velocity) -> torch.Tensor:
    """Our own float64 transcription of the Wan2.1 reference's sampling loop with
    `FlowUniPCMultistepScheduler.step` (bh2, predict_x0, lower_order_final, `disable_corrector=[]`,
    no `solver_p`), written from the reference's formulas, not from runnerkit's scheduler.

    Per step i: x0 = x - sigma_i * v; if a step ran before, the corrector UniC-p (p = the previous
    predictor's order) refines x at sigma_i; then the predictor UniP-q, q = min(solver_order,
    S - i, steps so far + 1), moves x to sigma_{i+1}. Coefficients as the reference: h = lambda_t
    - lambda_s with lambda = log((1 - sigma) / sigma), B(h) = expm1(-h), `R rho = b` with
    R[k] = r^k and b[k] = (k + 1)! * (-h) phi_{k+2}(-h) / B(h), except rho = 1/2 for UniP-2 and
    UniC-1.

    Args:
        sigmas: the reference's float32 sigmas [S + 1] as Python floats (the last one 0).
        x: initial latents (any shape).
        velocity: `(latents float32, step) -> velocity`; it sees float32 latents like the model.

    Returns:
        The final latents, float64.
    """
    x = x.to(torch.float64)
    steps = len(sigmas) - 1
    lam = [_log_snr(s) for s in sigmas]
    x0s: list[torch.Tensor] = []  # the last `solver_order` x0 predictions, oldest first
    last_x, last_order = None, 0

    def b_vector(h: float, order: int) -> tuple[float, list[float]]:
        hh = -h
        b_h = math.expm1(hh)
        h_phi, factorial, b = b_h / hh - 1.0, 1, []  # hh * phi_2(hh)
        for k in range(1, order + 1):
            b.append(h_phi * factorial / b_h)
            factorial *= k + 1
            h_phi = h_phi / hh - 1.0 / factorial  # hh * phi_{k+2}(hh)
        return b_h, b

    for i in range(steps):
        x0 = x - sigmas[i] * velocity(x.to(torch.float32), i).to(torch.float64)
        if last_x is not None:  # corrector: x at sigma_i again, from last_x at sigma_{i-1}
            s, t = i - 1, i
            h = lam[t] - lam[s]
            b_h, b = b_vector(h, last_order)
            m0 = x0s[-1]
            rks = [(lam[s - k] - lam[s]) / h for k in range(1, last_order)]
            d1s = [(x0s[-(k + 1)] - m0) / rk for k, rk in enumerate(rks, start=1)]
            if last_order == 1:
                rhos = [0.5]
            else:
                r_mat = torch.tensor([[rk ** k for rk in (*rks, 1.0)] for k in range(last_order)], dtype=torch.float64)
                rhos = torch.linalg.solve(r_mat, torch.tensor(b, dtype=torch.float64)).tolist()
            correction = sum((rho * d for rho, d in zip(rhos[:-1], d1s)), rhos[-1] * (x0 - m0))
            x = sigmas[t] / sigmas[s] * last_x - (1 - sigmas[t]) * b_h * (m0 + correction)
        x0s = [*x0s, x0][-solver_order:]
        order = min(solver_order, steps - i, len(x0s))
        last_x, last_order = x, order
        # predictor: x at sigma_i -> sigma_{i+1}
        s, t = i, i + 1
        h = lam[t] - lam[s]
        b_h = math.expm1(-h)  # -1 on the last step (h = inf)
        m0 = x0s[-1]
        x = sigmas[t] / sigmas[s] * x - (1 - sigmas[t]) * b_h * m0
        if order == 2:
            rk = (lam[s - 1] - lam[s]) / h
            x = x - (1 - sigmas[t]) * b_h * 0.5 * (x0s[-2] - m0) / rk
    return x


# ---- schedule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["unipc", "euler"])
@pytest.mark.parametrize(("steps", "shift"), sorted(GOLDEN))
def test_schedule_equals_the_reference_golden_values(name: str, steps: int, shift: float) -> None:
    # Every solver samples the reference's grid under "train_range" (its timesteps are int64 for all solvers).
    timesteps, sigmas = GOLDEN[(steps, shift)]
    s = SCHEDULERS[name](shift=shift, spacing="train_range")
    s.prepare(LATENT_SHAPE, steps, seed=0, device="cpu")
    assert s.sigmas.dtype == torch.float32 and s.sigmas.tolist() == sigmas
    assert s.timesteps.dtype == torch.int64 and s.timesteps.tolist() == timesteps
    assert s.step_pre(0)[1].tolist() == [timesteps[0]] * LATENT_SHAPE[0]


def test_golden_values_follow_the_formula_by_hand() -> None:
    # 10 steps, shift 5: u_k = 0.999 * (1 - k / 10), sigma_k = 5 u_k / (1 + 4 u_k).
    _, sigmas = GOLDEN[(10, 5.0)]
    assert sigmas[0] == pytest.approx(4.995 / 4.996, abs=1e-7)  # u_0 = 0.999
    assert sigmas[9] == pytest.approx(0.4995 / 1.3996, abs=1e-7)  # u_9 = 0.0999
    assert sigmas[10] == 0.0 and all(a > b for a, b in zip(sigmas, sigmas[1:]))


# ---- update ------------------------------------------------------------------------------------
@pytest.mark.parametrize("solver_order", [1, 2])
@pytest.mark.parametrize(("steps", "shift", "tolerance"), [(4, 5.0, 1e-6), (10, 5.0, 1e-6), (50, 5.0, 3e-6),
                                                           (50, 3.0, 3e-6)])
def test_unipc_matches_a_float64_transcription_of_the_reference(steps: int, shift: float, tolerance: float,
                                                                solver_order: int) -> None:
    # The transcription runs on the golden sigmas, so a schedule or an update that drifts from the
    # reference fails here. runnerkit updates float32 latents (the reference does too); 50 steps
    # accumulate ~1e-6 of float32 rounding (measured once against the reference class itself:
    # <= 9.6e-7 apart, float32 both).
    s = FlowUniPCScheduler(shift=shift, solver_order=solver_order, spacing="train_range")
    s.prepare(LATENT_SHAPE, steps, seed=1234, device="cpu")
    start = s.latents.clone()
    for i in range(steps):
        s.step_post(smooth_velocity(s.step_pre(i)[0], i))
    expected = reference_unipc_float64(GOLDEN[(steps, shift)][1], start, solver_order, smooth_velocity)
    err = (s.latents.double() - expected).abs().max().item()
    assert err <= tolerance, f"max abs err {err:.3e}"


def test_euler_matches_a_float64_euler_on_the_golden_sigmas() -> None:
    sigmas = GOLDEN[(10, 5.0)][1]
    s = FlowEulerScheduler(shift=5.0, spacing="train_range")
    s.prepare(LATENT_SHAPE, 10, seed=5, device="cpu")
    x = s.latents.double()
    for i in range(10):
        s.step_post(smooth_velocity(s.step_pre(i)[0], i))
        x = x + (sigmas[i + 1] - sigmas[i]) * smooth_velocity(x.float(), i).double()
    assert (s.latents.double() - x).abs().max().item() <= 1e-6


# ---- the two spacings differ -------------------------------------------------------------------
@pytest.mark.parametrize("shift", [5.0, 3.0])
def test_wan_and_diffusers_spacings_differ(shift: float) -> None:
    # If "train_range" silently fell back to diffusers' grid (or the reverse), this fails.
    wan, dif = (FlowUniPCScheduler(shift=shift, spacing=sp) for sp in ("train_range", "diffusers"))
    finals = []
    for s in (wan, dif):
        s.prepare(LATENT_SHAPE, 50, seed=1234, device="cpu")
        for i in range(50):
            s.step_post(smooth_velocity(s.step_pre(i)[0], i))
        finals.append(s.latents)
    assert wan.timesteps.tolist() == GOLDEN[(50, shift)][0]
    gap = (wan.timesteps - dif.timesteps).abs()
    assert gap.max().item() == {5.0: 4, 3.0: 3}[shift]  # largest near the end: 92 vs 96 with shift 5
    assert dif.sigmas[0].item() == pytest.approx(1 - 1e-6) and wan.sigmas[0].item() < 0.9998
    assert (finals[0] - finals[1]).abs().max().item() > 1e-3  # ~1.7e-3 here: far above float32 noise (~1e-6)


def test_euler_spacings_differ_and_diffusers_keeps_float_timesteps() -> None:
    wan, dif = (FlowEulerScheduler(shift=5.0, spacing=sp) for sp in ("train_range", "diffusers"))
    for s in (wan, dif):
        s.prepare(LATENT_SHAPE, 10, seed=0, device="cpu")
    assert dif.sigmas[0].item() == 1.0 and wan.sigmas[0].item() == GOLDEN[(10, 5.0)][1][0]
    assert dif.timesteps.dtype == torch.float32 and wan.timesteps.dtype == torch.int64


# ---- construction and config -------------------------------------------------------------------
def test_spacing_is_required_and_validated() -> None:
    with pytest.raises(TypeError, match="spacing"):
        FlowUniPCScheduler(shift=5.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"`spacing` must be one of \['train_range', 'diffusers'\], got 'karras'"):
        FlowEulerScheduler(spacing="karras")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`num_train_timesteps` must be >= 2 with spacing 'train_range', got 1"):
        FlowUniPCScheduler(num_train_timesteps=1, spacing="train_range")
    assert "spacing='train_range'" in repr(FlowUniPCScheduler(spacing="train_range"))


def test_config_accepts_exactly_the_schedulers_spacings() -> None:
    from runnerkit.config import FAMILY_DEFAULTED, ConfigError, load_runner_config

    assert SPACINGS == ("train_range", "diffusers")
    assert "scheduler_spacing" in FAMILY_DEFAULTED  # None in the config: the family decides
    for name in SPACINGS:
        assert RunnerConfig(model_cls="x", model_path="p", scheduler_spacing=name).scheduler_spacing == name
    with pytest.raises(ConfigError, match=r"`scheduler_spacing` must be one of \['train_range', 'diffusers'\] \(got 'karras'\)"):
        load_runner_config(None, {"model_cls": "x", "model_path": "p", "scheduler_spacing": "karras"})


@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_clear_keeps_the_spacing(name: str) -> None:
    s = SCHEDULERS[name](shift=3.0, spacing="train_range")
    s.prepare(LATENT_SHAPE, 4, seed=0, device="cpu")
    s.step_post(smooth_velocity(s.step_pre(0)[0], 0))
    s.clear()
    assert_same_state(s, SCHEDULERS[name](shift=3.0, spacing="train_range"))
