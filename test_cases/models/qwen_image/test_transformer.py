"""Qwen-Image transformer: key parity and numerical parity with diffusers, RoPE cache, stream spec, errors."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from runnerkit.models.qwen_image.arch import QwenImageTransformerArch
from runnerkit.models.qwen_image.transformer import QwenImageTransformer2D, keep_fp32
from runnerkit.offload.layout import plan_units
from runnerkit.weights import assign_state_dict, build_on_meta
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
EDIT_SHAPES = [(1, 4, 6), (1, 3, 4), (1, 2, 5)]  # target, then two references; odd sizes test the centring
T2I_SHAPES = [(1, 5, 6)]
TEXT_LEN = 7
TOL = 1e-4
PARAMS_20B = 20_430_401_088
"""Parameters of the default (Qwen-Image 20B) arch, equal to diffusers' count."""


def _reference(zero_cond_t: bool, seed: int = 0) -> torch.nn.Module:
    """diffusers' model with every parameter perturbed (norm weights too), so parity covers them all."""
    torch.manual_seed(seed)
    model = diffusers.QwenImageTransformer2DModel(**TINY, zero_cond_t=zero_cond_t)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def _ours(reference: torch.nn.Module, dtype: torch.dtype | None = None) -> QwenImageTransformer2D:
    """Our model loaded strictly (identity key map) from the reference's state dict."""
    arch = QwenImageTransformerArch(**TINY, zero_cond_t=reference.config.zero_cond_t)
    model = build_on_meta(lambda: QwenImageTransformer2D(arch))
    sd = {k: v.clone() for k, v in reference.state_dict().items()}
    return assign_state_dict(model, sd, "transformer", dtype=dtype, keep_fp32=keep_fp32).eval()


def _inputs(shapes: list[tuple[int, int, int]], batch: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """hidden_states [B, L_img, 64], encoder_hidden_states [B, 7, 32], timestep [B] sigmas."""
    gen = torch.Generator().manual_seed(seed)
    L_img = sum(math.prod(s) for s in shapes)
    return (torch.randn(batch, L_img, 64, generator=gen), torch.randn(batch, TEXT_LEN, 32, generator=gen),
            torch.tensor([0.7, 0.25][:batch]))


@torch.no_grad()
def _run_reference(model: torch.nn.Module, x: torch.Tensor, txt: torch.Tensor, t: torch.Tensor,
                   shapes: list[tuple[int, int, int]]) -> torch.Tensor:
    """diffusers' call as its pipelines make it: img_shapes per batch row, timestep = sigma."""
    return model(hidden_states=x, encoder_hidden_states=txt, timestep=t, img_shapes=[shapes] * x.shape[0],
                 return_dict=False)[0]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny matmuls: a second thread only adds sync cost, and on a loaded machine it costs 3x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "zero_cond_t"])
def models(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, QwenImageTransformer2D]:
    reference = _reference(request.param)
    return reference, _ours(reference)


@pytest.fixture(scope="module")
def meta_pair() -> tuple[torch.nn.Module, QwenImageTransformer2D]:
    """diffusers' and our default (20B) models on the meta device."""
    with torch.device("meta"):
        return diffusers.QwenImageTransformer2DModel(), QwenImageTransformer2D(QwenImageTransformerArch())


def test_default_arch_matches_diffusers_keys_shapes_and_count(
        meta_pair: tuple[torch.nn.Module, QwenImageTransformer2D]) -> None:
    reference, ours = meta_pair
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    assert sum(p.numel() for p in reference.parameters()) == PARAMS_20B
    assert sum(p.numel() for p in ours.parameters()) == PARAMS_20B
    assert len(ours.transformer_blocks) == 60 and ours.arch.inner_dim == 3072


@pytest.mark.parametrize("shapes,batch", [(EDIT_SHAPES, 1), (EDIT_SHAPES, 2), (T2I_SHAPES, 1)],
                         ids=["edit", "edit-batch2", "t2i"])
def test_parity_with_diffusers(models: tuple[torch.nn.Module, QwenImageTransformer2D],
                               shapes: list[tuple[int, int, int]], batch: int) -> None:
    reference, ours = models
    x, txt, t = _inputs(shapes, batch)
    expected = _run_reference(reference, x, txt, t, shapes)
    with torch.no_grad():
        out = ours(x, txt, t, shapes)
    assert out.shape == expected.shape == (batch, x.shape[1], 64)
    err = (out - expected).abs().max().item()
    assert err <= TOL, f"max abs error {err:.3g} (output scale {expected.abs().max().item():.3g})"


def test_zero_cond_t_changes_only_what_diffusers_changes() -> None:
    """The same weights with and without zero_cond_t differ (reference tokens at t = 0), and each
    flag matches diffusers with that flag: guards against a test that passes for both."""
    plain = _reference(False)
    edit = _reference(True)  # same seed: same weights
    x, txt, t = _inputs(EDIT_SHAPES, 1)
    with torch.no_grad():
        a, b = _ours(plain)(x, txt, t, EDIT_SHAPES), _ours(edit)(x, txt, t, EDIT_SHAPES)
    assert (a - b).abs().max().item() > 1e-2
    # t = 0 everywhere: both flags modulate every token with t = 0.
    zero = torch.zeros(1)
    with torch.no_grad():
        a0, b0 = _ours(plain)(x, txt, zero, EDIT_SHAPES), _ours(edit)(x, txt, zero, EDIT_SHAPES)
    assert (a0 - b0).abs().max().item() <= TOL


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_bf16_follows_reference_dtypes(zero_cond_t: bool) -> None:
    """bf16 weights: our output sits much closer to diffusers' bf16 output than bf16 sits to float32
    (a float32 residual stream or modulation would land near the float32 result instead)."""
    reference = _reference(zero_cond_t)
    x, txt, t = _inputs(EDIT_SHAPES, 2)
    fp32 = _run_reference(reference, x, txt, t, EDIT_SHAPES)
    ours = _ours(reference, dtype=torch.bfloat16)
    reference = reference.to(torch.bfloat16)
    bf16 = _run_reference(reference, x.bfloat16(), txt.bfloat16(), t, EDIT_SHAPES)
    with torch.no_grad():
        out = ours(x.bfloat16(), txt.bfloat16(), t, EDIT_SHAPES)
    assert out.dtype == torch.bfloat16
    err = (out.float() - bf16.float()).abs().max().item()
    bf16_vs_fp32 = (bf16.float() - fp32).abs().max().item()
    assert err <= 0.02 * bf16_vs_fp32, f"bf16 error {err:.3g} vs the reference's bf16-vs-fp32 gap {bf16_vs_fp32:.3g}"


def test_rope_cache_cleared_and_keyed_by_shapes(models: tuple[torch.nn.Module, QwenImageTransformer2D]) -> None:
    reference, ours = models
    ours.clear_cache()
    x, txt, t = _inputs(EDIT_SHAPES, 1)
    with torch.no_grad():
        ours(x, txt, t, EDIT_SHAPES)
    assert len(ours._rope_cache) == 1
    ours.clear_cache()
    assert ours._rope_cache == {}
    # Other images and text length, before and after clearing: never a stale table.
    other = [(1, 6, 2), (1, 3, 5)]
    x2, _, t2 = _inputs(other, 1, seed=3)
    txt2 = txt[:, :5]
    expected = _run_reference(reference, x2, txt2, t2, other)
    with torch.no_grad():
        ours(x, txt, t, EDIT_SHAPES)
        cached = ours(x2, txt2, t2, other)
        ours.clear_cache()
        fresh = ours(x2, txt2, t2, other)
    assert len(ours._rope_cache) == 1
    assert (cached - expected).abs().max().item() <= TOL
    assert torch.equal(cached, fresh)


def test_keep_fp32_is_empty_like_diffusers() -> None:
    assert diffusers.QwenImageTransformer2DModel._keep_in_fp32_modules is None
    names = QwenImageTransformer2D(QwenImageTransformerArch(**TINY)).state_dict()
    assert not any(keep_fp32(n) for n in names)


def test_plan_units_block_and_phase(meta_pair: tuple[torch.nn.Module, QwenImageTransformer2D]) -> None:
    _, ours = meta_pair
    spec = QwenImageTransformer2D.STREAM_SPEC
    blocks = plan_units(ours, "block", spec)
    phases = plan_units(ours, "phase", spec)
    assert [u.module for u in blocks] == [f"transformer_blocks.{i}" for i in range(60)]
    assert [u.module for u in phases] == [f"transformer_blocks.{i}.{p}" for i in range(60) for p in spec.phases]
    # Every weight of a block is in exactly one of its phases.
    block_params = sorted(p for u in blocks for p in u.params)
    phase_params = [p for u in phases for p in u.params]
    assert sorted(phase_params) == block_params and len(set(phase_params)) == len(phase_params)


def test_phases_run_in_declared_order_and_bracket_their_weights() -> None:
    """Forward hooks see the phases in `STREAM_SPEC` order in every block; with each phase's weights
    NaN outside its own forward (what a streamer does), the output is unchanged."""
    reference = _reference(True)
    ours = _ours(reference)
    spec = QwenImageTransformer2D.STREAM_SPEC
    x, txt, t = _inputs(EDIT_SHAPES, 1)
    with torch.no_grad():
        expected = ours(x, txt, t, EDIT_SHAPES)
    entered: list[str] = []
    handles = []
    for unit in plan_units(ours, "phase", spec):
        module = ours.get_submodule(unit.module)
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(float("nan"))

        def load(mod: torch.nn.Module, args: object, name: str = unit.module, saved: dict = weights) -> None:
            entered.append(name)
            with torch.no_grad():
                for n, p in mod.named_parameters():
                    p.copy_(saved[n])

        def evict(mod: torch.nn.Module, args: object, out: object) -> None:
            with torch.no_grad():
                for p in mod.parameters():
                    p.fill_(float("nan"))

        handles += [module.register_forward_pre_hook(load), module.register_forward_hook(evict)]
    with torch.no_grad():
        out = ours(x, txt, t, EDIT_SHAPES)
    for h in handles:
        h.remove()
    assert entered == [f"transformer_blocks.{i}.{p}" for i in range(2) for p in spec.phases]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("change,match", [
    (lambda x, txt, t, s: (x[:, :-1], txt, t, s), "describes 46 image tokens"),
    (lambda x, txt, t, s: (x, txt, t[:1].expand(2).reshape(2, 1), s), "`timestep`"),
    (lambda x, txt, t, s: (x, txt[..., :16], t, s), "`encoder_hidden_states`"),
    (lambda x, txt, t, s: (x[..., :32], txt, t, s), "`hidden_states`"),
    (lambda x, txt, t, s: (x, txt, t, []), "`img_shapes`"),
], ids=["token-count", "timestep-shape", "text-width", "latent-channels", "no-images"])
def test_errors_name_the_argument(change, match: str) -> None:  # type: ignore[no-untyped-def]
    ours = QwenImageTransformer2D(QwenImageTransformerArch(**TINY))
    x, txt, t = _inputs(EDIT_SHAPES, 2)
    with pytest.raises(ValueError, match=match):
        ours(*change(x, txt, t, EDIT_SHAPES))


def test_rope_positions_past_reference_tables_raise() -> None:
    ours = QwenImageTransformer2D(QwenImageTransformerArch(**TINY))
    with pytest.raises(ValueError, match="RoPE positions past 4096"):
        ours.rope_for_shapes([(1, 64, 64)], 4096 - 31, torch.device("cpu"))
    ours.rope_for_shapes([(1, 64, 64)], 4096 - 32, torch.device("cpu"))  # the last text token at position 4095 fits
