"""LTX-2 text connectors and the Gemma-3 hidden-state stacking: parity with diffusers 0.42.1, keys, configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runnerkit.models.ltx2.connectors import LTX2TextConnectors, stack_text_hidden_states
from runnerkit.models.ltx2.connectors_arch import (
    LTX2_CONNECTORS,
    LTX23_CONNECTORS,
    TINY23_CONNECTORS,
    TINY_CONNECTORS,
    LTX2ConnectorsArch,
)
from runnerkit.weights import assign_state_dict, build_on_meta
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
transformers = require_reference("transformers")
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors as RefConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

TOL = 1e-4
T = 8
LEFT_PADDED = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * T, [0] * 6 + [1, 1]])
"""Three prompts of 5, 8 and 2 tokens, left-padded (Gemma's padding side) to 8 = 2 x the tiny 4 registers."""
NO_REGISTERS = LTX2ConnectorsArch(**{**TINY_CONNECTORS.model_dump(), "rope_type": "interleaved",
                                     "video_connector_num_learnable_registers": None,
                                     "audio_connector_num_learnable_registers": None})
"""diffusers' own test layout: padding masked in attention instead of replaced, interleaved RoPE."""
VARIANTS = {"2.0": TINY_CONNECTORS, "2.3": TINY23_CONNECTORS, "no-registers-interleaved": NO_REGISTERS}


def _pair(arch: LTX2ConnectorsArch, seed: int = 0) -> tuple[torch.nn.Module, LTX2TextConnectors]:
    """diffusers' connectors with every parameter perturbed (registers, Q/K norm weights too) and ours loaded
    strictly from its state dict, built from its config."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        reference = RefConnectors(**arch.model_dump())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    ours_arch = LTX2ConnectorsArch.from_diffusers_config(dict(reference.config))
    assert ours_arch == arch
    ours = assign_state_dict(build_on_meta(lambda: LTX2TextConnectors(ours_arch)), dict(reference.state_dict()),
                             "connectors")
    return reference.eval(), ours.eval()


def _hidden_states(arch: LTX2ConnectorsArch, seed: int) -> tuple[torch.Tensor, ...]:
    """Per-layer [B, T, D] states of growing scale, as a deep encoder's are (the norms must see distinct layers)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple((1 + 3 * i) * torch.randn(3, T, arch.caption_channels, generator=gen)
                 for i in range(arch.text_proj_in_factor))


def _compare(reference: torch.nn.Module, ours: LTX2TextConnectors, packed: torch.Tensor, mask: torch.Tensor,
             padding_side: str, label: str) -> None:
    with torch.no_grad():
        expected = reference(packed, mask, padding_side=padding_side)
    got = ours(packed, mask, padding_side=padding_side)
    errors = [(g.float() - e.float()).abs().max().item() for g, e in zip(got, expected)]
    print(f"connectors {label}: video {errors[0]:.2e}, audio {errors[1]:.2e}, mask {errors[2]:.0f}")
    assert [g.shape for g in got] == [e.shape for e in expected]
    assert got[2].dtype == expected[2].dtype
    assert max(errors) <= TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_connectors_parity_left_padded(variant: str) -> None:
    arch = VARIANTS[variant]
    reference, ours = _pair(arch)
    packed = stack_text_hidden_states(_hidden_states(arch, seed=1))
    _compare(reference, ours, packed, LEFT_PADDED, "left", f"{variant}, left padding")


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_connectors_parity_right_padded(variant: str) -> None:
    """The 2.0 features place valid tokens by the padding side; the registers follow the mask itself."""
    arch = VARIANTS[variant]
    reference, ours = _pair(arch, seed=2)
    packed = stack_text_hidden_states(_hidden_states(arch, seed=3))
    right = LEFT_PADDED.flip(1)
    _compare(reference, ours, packed, right, "right", f"{variant}, right padding")


def test_prompt_rows_are_independent() -> None:
    """Prompt rows are independent: the full-length row gives the same embeddings alone as in the batch."""
    _, ours = _pair(TINY_CONNECTORS, seed=4)
    packed = stack_text_hidden_states(_hidden_states(TINY_CONNECTORS, seed=5))
    video, audio, _ = ours(packed, LEFT_PADDED)
    alone_video, alone_audio, _ = ours(packed[1:2], LEFT_PADDED[1:2])
    torch.testing.assert_close(alone_video, video[1:2], rtol=0, atol=1e-5)
    torch.testing.assert_close(alone_audio, audio[1:2], rtol=0, atol=1e-5)


# ---- stacking of the Gemma-3 hidden states --------------------------------------------------

def _tiny_gemma3() -> torch.nn.Module:
    """A 2-layer Gemma-3 text model of width 16: 3 hidden states, as TINY_CONNECTORS expects."""
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           sliding_window=4, max_position_embeddings=64)
    with torch.random.fork_rng():
        torch.manual_seed(6)
        return transformers.Gemma3TextModel(config).eval()


class _FixedTokenizer:
    """Stands in for the Gemma tokenizer: fixed ids and mask for three prompts (the pipeline only reads these)."""

    padding_side = "left"
    pad_token = "<pad>"

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.output = SimpleNamespace(input_ids=input_ids, attention_mask=attention_mask)

    def __call__(self, prompts: list[str], **kwargs: object) -> SimpleNamespace:
        assert len(prompts) == self.output.input_ids.shape[0] and kwargs["max_length"] == T
        return self.output


def test_stacking_matches_the_pipeline_on_gemma3_hidden_states() -> None:
    """`stack_text_hidden_states` on transformers' Gemma-3 output equals LTX2Pipeline's own packing
    (`_get_gemma_prompt_embeds`, run with that text encoder), and feeds the connectors to the same result."""
    gemma = _tiny_gemma3()
    ids = torch.randint(0, 64, (3, T), generator=torch.Generator().manual_seed(7))
    pipeline_like = SimpleNamespace(tokenizer=_FixedTokenizer(ids, LEFT_PADDED), text_encoder=gemma,
                                    _execution_device=torch.device("cpu"))
    with torch.no_grad():
        expected, expected_mask = LTX2Pipeline._get_gemma_prompt_embeds(
            pipeline_like, ["a", "b", "c"], max_sequence_length=T, device=torch.device("cpu"), dtype=torch.float32)
        hidden_states = gemma(input_ids=ids, attention_mask=LEFT_PADDED, output_hidden_states=True).hidden_states
    assert len(hidden_states) == TINY_CONNECTORS.text_proj_in_factor
    packed = stack_text_hidden_states(hidden_states, dtype=torch.float32)
    assert packed.shape == (3, T, 16 * 3)
    assert torch.equal(packed, expected) and torch.equal(expected_mask, LEFT_PADDED)
    for variant in ("2.0", "2.3"):
        reference, ours = _pair(VARIANTS[variant], seed=8)
        _compare(reference, ours, packed, LEFT_PADDED, "left", f"{variant}, tiny Gemma-3 hidden states")


def test_stacking_on_random_hidden_states_and_4d_input() -> None:
    """The packed layout is feature d * L + l, which the connectors unflatten: a 4D input gives the same."""
    states = _hidden_states(TINY23_CONNECTORS, seed=9)
    packed = stack_text_hidden_states(states)
    assert torch.equal(packed.unflatten(2, (16, 3))[:, :, 5, 2], states[2][:, :, 5])
    _, ours = _pair(TINY23_CONNECTORS, seed=10)
    flat, four_d = ours(packed, LEFT_PADDED), ours(torch.stack(states, dim=-1), LEFT_PADDED)
    assert all(torch.equal(a, b) for a, b in zip(flat, four_d))


# ---- errors, release sizes, configs ---------------------------------------------------------

def test_prompt_length_must_be_a_multiple_of_the_registers() -> None:
    _, ours = _pair(TINY_CONNECTORS)
    packed = stack_text_hidden_states(_hidden_states(TINY_CONNECTORS, seed=11))[:, :6]
    with pytest.raises(ValueError, match="multiple of the 4 learnable registers"):
        ours(packed, LEFT_PADDED[:, :6])


@pytest.mark.parametrize("arch", [LTX2_CONNECTORS, LTX23_CONNECTORS], ids=["2.0", "2.3"])
def test_release_sizes_have_diffusers_keys_and_shapes(arch: LTX2ConnectorsArch) -> None:
    with torch.device("meta"):
        reference = RefConnectors(**arch.model_dump())
        ours = LTX2TextConnectors(arch)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    print(f"connectors {arch.rope_type}/{arch.per_modality_projections}: "
          f"{sum(p.numel() for p in ours.parameters()):,} parameters")


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="does not know"):
        LTX2ConnectorsArch.from_diffusers_config({"text_encoder_hidden_dim": 3840})
    with pytest.raises(ValueError, match="video connector's width"):
        LTX2ConnectorsArch(per_modality_projections=True)  # 30 x 128 heads against a 4096-wide projection
    assert LTX2ConnectorsArch.from_diffusers_config({"causal_temporal_positioning": False}) == LTX2ConnectorsArch()


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_bfloat16_follows_diffusers_rounding(variant: str) -> None:
    """bf16 weights and features (the release dtype): the same ops in the same order (RoPE and the Q/K
    rotation in float32 in both), bit-equal to diffusers' bf16 on the development machine; the test asks
    for no more than diffusers' own bf16 error from float32 (2x: bf16 kernels may round differently with
    alignment)."""
    reference, ours = _pair(VARIANTS[variant], seed=12)
    states = _hidden_states(VARIANTS[variant], seed=13)
    with torch.no_grad():
        truth = reference(stack_text_hidden_states(states), LEFT_PADDED)
    reference, ours = reference.to(torch.bfloat16), ours.to(torch.bfloat16)
    packed = stack_text_hidden_states(states, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(packed, LEFT_PADDED)
    got = ours(packed, LEFT_PADDED)
    for g, e, t in zip(got[:2], expected[:2], truth[:2]):
        mine, theirs = ((x.float() - t).abs().max().item() for x in (g, e))
        print(f"connectors {variant} bf16: ours - diffusers {(g.float() - e.float()).abs().max().item():.2e}; "
              f"from float32: ours {mine:.2e}, diffusers {theirs:.2e}")
        assert g.dtype == torch.bfloat16 and mine <= 2 * theirs + 1e-6
