"""LTX-2 audio+video transformer: numerical parity with diffusers 0.42.1 (LTX-2.0 and LTX-2.3 switches,
t2av and i2av timesteps, padded text masks, batch 1 and 2), release key layouts, config mapping,
patchify, stream spec, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runnerkit.attention import AttentionBackend, install, sdpa
from runnerkit.models.ltx2.transformer import (
    LTX2Transformer,
    keep_fp32,
    pack_audio_latents,
    pack_video_latents,
    unpack_audio_latents,
    unpack_video_latents,
)
from runnerkit.models.ltx2.transformer_arch import LTX2_19B, LTX23_22B, LTX2TransformerArch, tiny_arch
from runnerkit.offload.layout import plan_units
from runnerkit.weights import assign_state_dict, build_on_meta
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

TOL = 1e-4
GRID = (3, 2, 3)  # video latent (frames, height, width): 18 tokens
AUDIO_FRAMES = 5
TEXT_LEN = 8
FPS = 25.0  # not the default 24, so that an ignored frame rate shows
PARAMS = {"2.0": 18_876_174_592, "2.3": 18_988_838_144}
"""Transformer parameters of the releases (diffusers' count with the conversion script's configs):
LTX-2 "19B" and LTX-2.3 "22B" name the whole checkpoint; the transformer alone is ~18.9B in both."""


def _reference(arch: LTX2TransformerArch, seed: int = 0) -> torch.nn.Module:
    """diffusers' model with every parameter perturbed (q/k norm weights too), so parity covers them all."""
    torch.manual_seed(seed)
    model = diffusers.LTX2VideoTransformer3DModel(**arch.model_dump())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def _ours(reference: torch.nn.Module, arch: LTX2TransformerArch, dtype: torch.dtype | None = None) -> LTX2Transformer:
    """Our model built on meta and loaded strictly (identity key map) from the reference's state dict."""
    model = build_on_meta(lambda: LTX2Transformer(arch))
    sd = {k: v.clone() for k, v in reference.state_dict().items()}
    return assign_state_dict(model, sd, "transformer", dtype=dtype, keep_fp32=keep_fp32).eval()


def _inputs(arch: LTX2TransformerArch, task: str, batch: int, split_sigmas: bool = False,
            seed: int = 1) -> dict[str, Any]:
    """Keyword inputs as the diffusers pipelines pass them (timesteps = sigma x 1000, sigma = timestep).

    t2av: timestep [B]. i2av: timestep [B, Lv] with the first latent frame's tokens at 0, audio_timestep [B].
    Text masks pad the last tokens (row 0: 3 padded; row 1: 5). `split_sigmas`: the audio stream at
    other timesteps/sigmas than the video (so that `use_cross_timestep` routing is observable).
    """
    gen = torch.Generator().manual_seed(seed)
    F_, H, W = GRID
    Lv = F_ * H * W
    text_v = arch.caption_channels if arch.use_prompt_embeddings else arch.cross_attention_dim
    text_a = arch.caption_channels if arch.use_prompt_embeddings else arch.audio_cross_attention_dim
    t = torch.tensor([700.0, 250.0][:batch])
    mask = torch.ones(batch, TEXT_LEN)
    mask[0, -3:] = 0
    if batch > 1:
        mask[1, -5:] = 0
    kw: dict[str, Any] = {
        "hidden_states": torch.randn(batch, Lv, arch.in_channels, generator=gen),
        "audio_hidden_states": torch.randn(batch, AUDIO_FRAMES, arch.audio_in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, text_v, generator=gen),
        "audio_encoder_hidden_states": torch.randn(batch, TEXT_LEN, text_a, generator=gen),
        "timestep": t, "sigma": t, "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
        "num_frames": F_, "height": H, "width": W, "audio_num_frames": AUDIO_FRAMES, "fps": FPS}
    if task == "i2av":
        conditioning = torch.zeros(batch, Lv)
        conditioning[:, : H * W] = 1.0  # the first latent frame is the given image
        kw["timestep"] = t.unsqueeze(-1) * (1 - conditioning)  # [B, Lv], as LTX2ImageToVideoPipeline builds it
        kw["audio_timestep"] = t
    if split_sigmas:
        kw["audio_timestep"] = 0.6 * t
        kw["audio_sigma"] = 0.6 * t
    return kw


@torch.no_grad()
def _run_reference(model: torch.nn.Module, kw: dict[str, Any], use_cross_timestep: bool) -> tuple[torch.Tensor, ...]:
    return model(**kw, use_cross_timestep=use_cross_timestep, return_dict=False)


@pytest.fixture(scope="module", params=["2.0", "2.3"])
def models(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, LTX2Transformer]:
    arch = tiny_arch(request.param)
    reference = _reference(arch)
    return reference, _ours(reference, arch)


def _max_err(out: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> float:
    assert [o.shape for o in out] == [e.shape for e in expected]
    return max((o - e).abs().max().item() for o, e in zip(out, expected))


@pytest.mark.parametrize("use_cross_timestep", [True, False], ids=["cross-t", "own-t"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("task", ["t2av", "i2av"])
def test_parity_with_diffusers(models: tuple[torch.nn.Module, LTX2Transformer], task: str, batch: int,
                               use_cross_timestep: bool) -> None:
    reference, ours = models
    kw = _inputs(ours.arch, task, batch)
    expected = _run_reference(reference, kw, use_cross_timestep)
    with torch.no_grad():
        out = ours(**kw, use_cross_timestep=use_cross_timestep)
    assert out[0].shape == (batch, 18, 4) and out[1].shape == (batch, AUDIO_FRAMES, 4)
    err = _max_err(out, expected)
    print(f"LTX-{'2.3' if ours.arch.cross_attn_mod else '2.0'} {task} B={batch} cross={use_cross_timestep}: "
          f"max abs error {err:.3g}")
    assert err <= TOL, f"max abs error {err:.3g} (output scale {expected[0].abs().max().item():.3g})"


@pytest.mark.parametrize("use_cross_timestep", [True, False], ids=["cross-t", "own-t"])
def test_parity_audio_at_other_sigmas(models: tuple[torch.nn.Module, LTX2Transformer],
                                      use_cross_timestep: bool) -> None:
    """Audio timestep/sigma differ from the video's: which sigma drives which modulation is observable."""
    reference, ours = models
    kw = _inputs(ours.arch, "i2av", 2, split_sigmas=True)
    expected = _run_reference(reference, kw, use_cross_timestep)
    with torch.no_grad():
        out = ours(**kw, use_cross_timestep=use_cross_timestep)
        other = ours(**kw, use_cross_timestep=not use_cross_timestep)
    assert _max_err(out, expected) <= TOL
    assert _max_err(other, expected) > 1e-3, "use_cross_timestep had no effect: the test could not see a swap"


def test_masks_and_per_token_timesteps_matter(models: tuple[torch.nn.Module, LTX2Transformer]) -> None:
    """Guards against inputs that the parity test would pass whether or not they were used."""
    _, ours = models
    kw = _inputs(ours.arch, "i2av", 2)
    with torch.no_grad():
        base = ours(**kw)
        unmasked = ours(**{**kw, "encoder_attention_mask": None, "audio_encoder_attention_mask": None})
        flat = ours(**{**kw, "timestep": kw["sigma"]})
    assert _max_err(unmasked, base) > 1e-3
    assert (flat[0] - base[0]).abs().max().item() > 1e-3


def test_interleaved_rope_parity() -> None:
    """diffusers' default RoPE pairing (no release uses it) matches too."""
    arch = tiny_arch("2.3", rope_type="interleaved", rope_double_precision=False)
    reference = _reference(arch, seed=2)
    kw = _inputs(arch, "t2av", 2)
    err = _max_err(_ours(reference, arch)(**kw), _run_reference(reference, kw, True))
    print(f"LTX-2.3 interleaved RoPE: max abs error {err:.3g}")
    assert err <= TOL


def test_bf16_follows_reference_dtypes() -> None:
    """bf16 weights: our output is far closer to diffusers' bf16 output than bf16 is to float32."""
    arch = tiny_arch("2.3")
    reference = _reference(arch)
    kw = _inputs(arch, "i2av", 2)
    fp32 = _run_reference(reference, kw, True)
    ours = _ours(reference, arch, dtype=torch.bfloat16)
    kw16 = {k: v.bfloat16() if isinstance(v, torch.Tensor) and k.endswith("states") else v for k, v in kw.items()}
    bf16 = _run_reference(reference.to(torch.bfloat16), kw16, True)
    with torch.no_grad():
        out = ours(**kw16)
    assert out[0].dtype == out[1].dtype == torch.bfloat16
    err = _max_err(tuple(o.float() for o in out), tuple(b.float() for b in bf16))
    gap = _max_err(tuple(b.float() for b in bf16), fp32)
    assert err <= 0.1 * gap, f"bf16 error {err:.3g} vs the reference's bf16-vs-fp32 gap {gap:.3g}"


@pytest.mark.parametrize("version,release", [("2.0", LTX2_19B), ("2.3", LTX23_22B)])
def test_release_layouts_match_diffusers(version: str, release: LTX2TransformerArch) -> None:
    """Release widths and switches (2 blocks to stay fast: blocks are identical): same keys and shapes as
    diffusers; the 48-block count equals diffusers' (measured once with the full model)."""
    arch = release.model_copy(update={"num_layers": 2})
    with torch.device("meta"):
        reference = diffusers.LTX2VideoTransformer3DModel(**arch.model_dump())
        ours = LTX2Transformer(arch)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    per_block = sum(p.numel() for p in ours.transformer_blocks[0].parameters())
    total = sum(p.numel() for p in ours.parameters()) + 46 * per_block
    assert total == PARAMS[version]
    assert ours.head_dims == (64, 128)
    assert LTX2TransformerArch.from_diffusers_config(dict(reference.config)) == arch


@pytest.mark.parametrize("release", [LTX2_19B, LTX23_22B], ids=["2.0", "2.3"])
def test_release_rope_tables_match_diffusers(release: LTX2TransformerArch) -> None:
    """The four RoPE tables at release widths (a small grid to stay fast; the audio of 121 frames at 24 fps,
    126 latents), against diffusers' own RoPE modules called as its forward calls them (front padding of the
    4096-wide video table, head grouping, float64 frequencies)."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed as Rope

    a = release
    grid, audio_frames, fps = (4, 3, 5), 126, 24.0
    common = {"theta": a.rope_theta, "causal_offset": a.causal_offset, "double_precision": a.rope_double_precision,
                  "rope_type": a.rope_type}
    audio = {"sampling_rate": a.audio_sampling_rate, "hop_length": a.audio_hop_length, "modality": "audio"}
    av_max = max(a.pos_embed_max_pos, a.audio_pos_embed_max_pos)
    video_rope = Rope(a.inner_dim, base_num_frames=a.pos_embed_max_pos, scale_factors=a.vae_scale_factors,
                      num_attention_heads=a.num_attention_heads, **common)
    audio_rope = Rope(a.audio_inner_dim, base_num_frames=a.audio_pos_embed_max_pos,
                      scale_factors=[a.audio_scale_factor],
                      num_attention_heads=a.audio_num_attention_heads, **audio, **common)
    av_video = Rope(a.audio_cross_attention_dim, base_num_frames=av_max, num_attention_heads=a.num_attention_heads,
                    **common)
    av_audio = Rope(a.audio_cross_attention_dim, base_num_frames=av_max,
                    num_attention_heads=a.audio_num_attention_heads,
                    **audio, **common)
    cpu = torch.device("cpu")
    v_coords = video_rope.prepare_video_coords(1, *grid, cpu, fps=fps)
    a_coords = audio_rope.prepare_audio_coords(1, audio_frames, cpu)
    expected = [video_rope(v_coords), audio_rope(a_coords), av_video(v_coords[:, 0:1]), av_audio(a_coords[:, 0:1])]
    with torch.device("meta"):
        ours = LTX2Transformer(a.model_copy(update={"num_layers": 1}))
    tables = ours.rope_tables(grid, audio_frames, fps, cpu)
    for table, (cos, sin) in zip(tables, expected):
        # diffusers: [B, heads, L, r]; ours: [1, L, heads, r]
        assert table.cos.transpose(1, 2).shape == cos.shape
        err = max((table.cos.transpose(1, 2) - cos).abs().max().item(),
                  (table.sin.transpose(1, 2) - sin).abs().max().item())
        assert err <= 1e-6, f"RoPE table differs by {err:.3g}"


def test_from_diffusers_config_refuses_uncovered_switches() -> None:
    config = {"_class_name": "LTX2VideoTransformer3DModel", **tiny_arch("2.3").model_dump(), "audio_ff_bias": True}
    assert LTX2TransformerArch.from_diffusers_config(config) == tiny_arch("2.3")
    for key, value in (("audio_ff_bias", False), ("use_prompt_adaln_single", False),
                       ("norm_elementwise_affine", True)):
        with pytest.raises(NotImplementedError, match=f"`{key}`"):
            LTX2TransformerArch.from_diffusers_config({**config, key: value})
    with pytest.raises(ValueError, match="no_such_key"):
        LTX2TransformerArch.from_diffusers_config({**config, "no_such_key": 1})
    # diffusers' defaults fill a config that leaves the 2.3 switches out: the LTX-2.0 behaviour
    legacy = {k: v for k, v in config.items() if k not in ("gated_attn", "cross_attn_mod", "audio_gated_attn",
                                                           "audio_cross_attn_mod", "use_prompt_embeddings")}
    arch = LTX2TransformerArch.from_diffusers_config(legacy)
    assert not arch.gated_attn and not arch.cross_attn_mod and arch.use_prompt_embeddings


def test_pack_and_unpack_match_the_pipeline() -> None:
    gen = torch.Generator().manual_seed(3)
    video = torch.randn(2, 5, 4, 6, 8, generator=gen)
    for p, pt in ((1, 1), (2, 2)):
        tokens = pack_video_latents(video, p, pt)
        assert torch.equal(tokens, LTX2Pipeline._pack_latents(video, p, pt))
        assert torch.equal(unpack_video_latents(tokens, 4 // pt, 6 // p, 8 // p, p, pt), video)
    audio = torch.randn(2, 8, 7, 16, generator=gen)
    tokens = pack_audio_latents(audio)
    assert torch.equal(tokens, LTX2Pipeline._pack_audio_latents(audio))
    assert torch.equal(unpack_audio_latents(tokens, 16), LTX2Pipeline._unpack_audio_latents(tokens, 7, 16))


def test_plan_units_and_phase_order(models: tuple[torch.nn.Module, LTX2Transformer]) -> None:
    """Phases partition the block's streamed weights (tables stay with the block) and run in the declared
    order; each phase's weights NaN outside its own forward (what a streamer does) leave the output unchanged."""
    _, ours = models
    spec = LTX2Transformer.STREAM_SPEC
    assert ours.blocks is ours.transformer_blocks
    blocks, phases = plan_units(ours, "block", spec), plan_units(ours, "phase", spec)
    assert [u.module for u in phases] == [f"transformer_blocks.{i}.{p}" for i in range(2) for p in spec.phases]
    in_phases = {p for u in phases for p in u.params}
    outside = {p for u in blocks for p in u.params} - in_phases
    assert outside and all("scale_shift_table" in n for n in outside)
    kw = _inputs(ours.arch, "i2av", 2)
    with torch.no_grad():
        expected = ours(**kw)
    entered: list[str] = []
    handles = []
    saved_all: dict[str, torch.Tensor] = {}
    for unit in phases:
        module = ours.get_submodule(unit.module)
        saved = {n: p.detach().clone() for n, p in module.named_parameters()}
        saved_all.update({f"{unit.module}.{n}": t for n, t in saved.items()})

        def load(mod: torch.nn.Module, args: object, name: str = unit.module, saved: dict = saved) -> None:
            entered.append(name)
            with torch.no_grad():
                for n, p in mod.named_parameters():
                    p.copy_(saved[n])

        def evict(mod: torch.nn.Module, args: object, out: object) -> None:
            with torch.no_grad():
                for p in mod.parameters():
                    p.fill_(float("nan"))

        evict(module, None, None)
        handles += [module.register_forward_pre_hook(load), module.register_forward_hook(evict)]
    try:
        with torch.no_grad():
            out = ours(**kw)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for name, t in saved_all.items():
                ours.get_parameter(name).copy_(t)
    assert entered == [u.module for u in phases]
    assert all(torch.equal(o, e) for o, e in zip(out, expected))


def test_rope_cache_keyed_by_shape_and_fps(models: tuple[torch.nn.Module, LTX2Transformer]) -> None:
    reference, ours = models
    ours.clear_cache()
    kw = _inputs(ours.arch, "t2av", 1)
    with torch.no_grad():
        ours(**kw)
        at_24 = ours(**{**kw, "fps": 24.0})
    assert len(ours._rope_cache) == 2
    assert _max_err(at_24, _run_reference(reference, {**kw, "fps": 24.0}, True)) <= TOL
    ours.clear_cache()
    assert ours._rope_cache == {}


def test_attention_runs_on_the_installed_backend(models: tuple[torch.nn.Module, LTX2Transformer]) -> None:
    """Every unmasked attention calls the runner's backend (6 per block); masked text attention runs SDPA
    with the mask (the backends take none), so with masks only the 4 others per block do."""
    _, ours = models
    calls: list[tuple[int, ...]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    kw = _inputs(ours.arch, "t2av", 1)
    unmasked = {**kw, "encoder_attention_mask": None, "audio_encoder_attention_mask": None}
    with torch.no_grad():
        expected, expected_masked = ours(**unmasked), ours(**kw)
    installed = install(ours, AttentionBackend("recording", recording, "test"))
    try:
        with torch.no_grad():
            out = ours(**unmasked)
            assert len(calls) == 6 * len(ours.blocks)
            calls.clear()
            out_masked = ours(**kw)
            assert len(calls) == 4 * len(ours.blocks)
    finally:
        install(ours, AttentionBackend("sdpa", sdpa, "test"))
    assert installed == 6 * len(ours.blocks)
    assert {shape[-1] for shape in calls} == set(ours.head_dims) == {4}
    assert _max_err(out, expected) == 0 and _max_err(out_masked, expected_masked) == 0


@pytest.mark.parametrize("change,match", [
    (lambda kw: {**kw, "hidden_states": kw["hidden_states"][:, :-1]}, "`hidden_states`"),
    (lambda kw: {**kw, "audio_hidden_states": kw["audio_hidden_states"][..., :2]}, "`audio_hidden_states`"),
    (lambda kw: {**kw, "encoder_hidden_states": kw["encoder_hidden_states"][..., :3]}, "`encoder_hidden_states`"),
    (lambda kw: {**kw, "timestep": kw["timestep"][:, :5]}, "`timestep`"),
    (lambda kw: {k: v for k, v in kw.items() if k != "audio_timestep"}, "`audio_timestep`"),
    (lambda kw: {**kw, "sigma": None, "use_cross_timestep": True}, "`sigma`"),  # 2.0 needs it only then
    (lambda kw: {**kw, "encoder_attention_mask": kw["encoder_attention_mask"][:, :-1]}, "`encoder_attention_mask`"),
], ids=["video-tokens", "audio-channels", "text-width", "timestep-shape", "no-audio-timestep", "no-sigma",
        "mask-length"])
def test_errors_name_the_argument(models: tuple[torch.nn.Module, LTX2Transformer],
                                  change, match: str) -> None:  # type: ignore[no-untyped-def]
    _, ours = models
    with pytest.raises(ValueError, match=match):
        ours(**change(_inputs(ours.arch, "i2av", 2)))


def test_grid_must_be_a_multiple_of_the_patch() -> None:
    ours = LTX2Transformer(tiny_arch("2.3", patch_size=2, in_channels=16))
    kw = _inputs(ours.arch, "t2av", 1)
    with pytest.raises(ValueError, match="`width`=3 must be a positive multiple of its patch size 2"):
        ours(**kw)
