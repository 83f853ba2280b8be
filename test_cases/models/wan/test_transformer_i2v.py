"""Wan2.1 i2v / flf2v transformer: parity with diffusers, key maps, configs, float32 layers, streaming."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from runnerkit.models.wan.arch import WanTransformerArch
from runnerkit.models.wan.transformer import WanTransformer3D, keep_fp32
from runnerkit.models.wan.transformer_keys import (
    arch_from_diffusers_config,
    arch_from_original_config,
    arch_to_diffusers_config,
    arch_to_original_config,
    diffusers_to_native,
    native_to_diffusers,
)
from runnerkit.offload.layout import plan_units, resident_names
from runnerkit.weights import assign_state_dict, build_on_meta
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers  # noqa: E402

# diffusers' attention processor takes the last 512 context tokens as text (hard-coded), so the
# tiny archs keep text_len 512; in_dim 9 = 4 latent + 5 conditioning channels (Wan: 16 + 20).
TINY = dict(dim=64, num_heads=2, num_layers=2, text_dim=32, ffn_dim=96, freq_dim=32, text_len=512, in_dim=9, out_dim=4)
ARCHS = {t: WanTransformerArch(model_type=t, **TINY) for t in ("i2v", "flf2v")}
TOKENS = {"i2v": 257, "flf2v": 514}
TOL = 1e-4


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Perturb every parameter (norms, biases and emb_pos included) so parity covers them all."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return module.eval()


def _diffusers_model(task: str, seed: int = 0) -> torch.nn.Module:
    return _randomize(diffusers.WanTransformer3DModel.from_config(arch_to_diffusers_config(ARCHS[task])), seed)


def _load(task: str, sd: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> WanTransformer3D:
    model = build_on_meta(lambda: WanTransformer3D(ARCHS[task]))
    return assign_state_dict(model, sd, "transformer", dtype=dtype, keep_fp32=keep_fp32).eval()


def _native_sd(task: str, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in _randomize(WanTransformer3D(ARCHS[task]), seed).state_dict().items()}


def _inputs(task: str, batch: int, height: int, width: int, lengths: list[int],
            seed: int = 2) -> dict[str, torch.Tensor]:
    """Latents [B, 4, 2, H, W], y [B, 5, 2, H, W], timestep [B], context [B, max(lengths), 32]
    (zeros past each prompt's length), the same context padded to 512, clip [B, 257 | 514, 1280]."""
    gen = torch.Generator().manual_seed(seed)
    arch = ARCHS[task]
    latents = torch.randn(batch, arch.out_dim, 2, height, width, generator=gen)
    y = torch.randn(batch, arch.in_dim - arch.out_dim, 2, height, width, generator=gen)
    context = torch.zeros(batch, max(lengths), arch.text_dim)
    for i, n in enumerate(lengths):
        context[i, :n] = torch.randn(n, arch.text_dim, generator=gen)
    padded = torch.zeros(batch, arch.text_len, arch.text_dim)
    padded[:, : max(lengths)] = context
    clip = torch.randn(batch, TOKENS[task], 1280, generator=gen)
    timestep = torch.tensor([999.0, 437.5][:batch])
    return dict(latents=latents, y=y, context=context, padded=padded, clip=clip, timestep=timestep)


def _reference_forward(reference: torch.nn.Module, task: str, i: dict[str, torch.Tensor]) -> torch.Tensor:
    # diffusers' FLF2V pipeline passes the two frames' tokens stacked on the batch axis, [2B, 257, 1280]
    # (first, last, first, last, ...), and its image embedder views them as [B, 514, 1280].
    image = i["clip"].reshape(-1, 257, 1280) if task == "flf2v" else i["clip"]
    hidden = torch.cat([i["latents"], i["y"]], dim=1)  # the pipeline concatenates the condition channels
    return reference(hidden, i["timestep"], i["padded"], encoder_hidden_states_image=image, return_dict=False)[0]


@pytest.mark.parametrize("task", ["i2v", "flf2v"])
@pytest.mark.parametrize("batch, height, width, lengths", [(1, 4, 4, [7]), (2, 4, 6, [5, 3])], ids=["B1-4x4", "B2-4x6"])
@torch.no_grad()
def test_parity_with_diffusers(task: str, batch: int, height: int, width: int, lengths: list[int]) -> None:
    reference = _diffusers_model(task)
    model = _load(task, diffusers_to_native(reference.state_dict()))
    i = _inputs(task, batch, height, width, lengths)

    expected = _reference_forward(reference, task, i)
    out = model(i["latents"], i["timestep"], i["context"], clip_context=i["clip"], y=i["y"])

    assert out.shape == (batch, 4, 2, height, width) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1, "reference output should not be trivially small"
    assert (out - expected).abs().max() <= TOL
    # The image and conditioning inputs must matter at this tolerance (else parity proves little).
    other = model(i["latents"], i["timestep"], i["context"], clip_context=i["clip"].flip(-1), y=i["y"])
    assert (other - out).abs().max() > 100 * TOL
    if task == "flf2v":  # swapping the first and last frames matters only through `emb_pos`
        other = model(i["latents"], i["timestep"], i["context"], clip_context=i["clip"].roll(257, dims=1), y=i["y"])
        assert (other - out).abs().max() > 100 * TOL
    other = model(i["latents"], i["timestep"], i["context"], clip_context=i["clip"], y=-i["y"])
    assert (other - out).abs().max() > 100 * TOL


@pytest.mark.parametrize("task", ["i2v", "flf2v"])
@torch.no_grad()
def test_image_projection_matches_diffusers_closely(task: str) -> None:
    """The image projection alone, at a tolerance tight enough to tell exact from tanh GELU."""
    reference = _diffusers_model(task)
    model = _load(task, diffusers_to_native(reference.state_dict()))
    clip = 3 * _inputs(task, 2, 4, 4, [3])["clip"]
    expected = reference.condition_embedder.image_embedder(clip.reshape(-1, 257, 1280) if task == "flf2v" else clip)
    out = model.img_emb(clip)
    assert out.shape == (2, TOKENS[task], 64)
    assert (out - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("task", ["i2v", "flf2v"])
@torch.no_grad()
def test_key_maps_cover_every_parameter(task: str) -> None:
    """Our modules, diffusers' modules and the two maps name exactly the same tensors, with the same shapes."""
    sd = _native_sd(task)
    reference = diffusers.WanTransformer3DModel.from_config(arch_to_diffusers_config(ARCHS[task]))
    theirs = reference.state_dict()
    ours = native_to_diffusers(sd)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)
    assert diffusers_to_native(ours) == sd
    image_keys = {k for k in sd if k.startswith("img_emb.") or "_img" in k}
    expected = {"img_emb.proj.0", "img_emb.proj.1", "img_emb.proj.3", "img_emb.proj.4"}
    assert {k.rsplit(".", 1)[0] for k in image_keys if k.startswith("img_emb.proj")} == expected
    assert ("img_emb.emb_pos" in sd) == (task == "flf2v")
    assert {k for k in image_keys if k.startswith("blocks.1.")} == {
        f"blocks.1.cross_attn.{m}.{p}" for m in ("k_img", "v_img") for p in ("weight", "bias")} | {
        "blocks.1.cross_attn.norm_k_img.weight"}


@pytest.mark.parametrize("task", ["i2v", "flf2v"])
@torch.no_grad()
def test_original_keys_match_diffusers_converter(task: str) -> None:
    """Independent check: diffusers' single-file converter (original Wan -> diffusers names).

    The converter has no rule for flf2v's `img_emb.emb_pos` (it passes the name through); that
    tensor is checked by the parity test through `pos_embed`.
    """
    sd = _native_sd(task)
    theirs = convert_wan_transformer_to_diffusers(dict(sd))
    ours = native_to_diffusers(sd)
    if task == "flf2v":
        assert ours.pop("condition_embedder.image_embedder.pos_embed") is theirs.pop("img_emb.emb_pos")
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k] is theirs[k] for k in ours)


def _diffusers_fp32_names(task: str) -> set[str]:
    """Native names of the parameters diffusers keeps in float32: a parameter whose dotted name has
    a component listed in `_keep_in_fp32_modules` (the rule of diffusers' `ModelMixin` loader)."""
    keep = diffusers.WanTransformer3DModel._keep_in_fp32_modules
    names = diffusers.WanTransformer3DModel.from_config(arch_to_diffusers_config(ARCHS[task])).state_dict()
    kept = {k: names[k] for k in names if any(m in k.split(".") for m in keep)}
    return set(diffusers_to_native(kept))


@pytest.mark.parametrize("task", ["i2v", "flf2v"])
@torch.no_grad()
def test_bf16_weights_keep_the_reference_fp32_layers(task: str) -> None:
    sd = _native_sd(task)
    model16 = _load(task, sd, dtype=torch.bfloat16)
    fp32 = {k for k, v in model16.state_dict().items() if v.dtype == torch.float32}
    assert fp32 == _diffusers_fp32_names(task)
    assert {"img_emb.proj.0.weight", "img_emb.proj.4.bias"} <= fp32
    assert model16.blocks[0].cross_attn.k_img.weight.dtype == torch.bfloat16

    model32 = _load(task, sd)
    i = _inputs(task, 2, 4, 6, [5, 3])
    expected = model32(i["latents"], i["timestep"], i["context"], clip_context=i["clip"], y=i["y"])
    out = model16(i["latents"], i["timestep"], i["context"], clip_context=i["clip"], y=i["y"])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = (out - expected).norm() / expected.norm()
    assert rel < 0.03, f"bf16 relative error {rel:.4f}"


@pytest.mark.parametrize("task", ["i2v", "flf2v"])
@torch.no_grad()
def test_image_weights_stream_with_their_block(task: str) -> None:
    """Block units hold k_img/v_img/norm_k_img; the phase unit `cross_attn` holds them; img_emb is resident;
    with the block weights present only between the block's hooks, the output is unchanged."""
    model = build_on_meta(lambda: WanTransformer3D(ARCHS[task]))
    spec = WanTransformer3D.STREAM_SPEC
    block_units = {u.module: set(u.params) for u in plan_units(model, "block", spec)}
    image_params = {f"blocks.0.cross_attn.{n}" for n in ("k_img.weight", "v_img.bias", "norm_k_img.weight")}
    assert image_params <= block_units["blocks.0"]
    phase_units = {u.module: set(u.params) for u in plan_units(model, "phase", spec)}
    assert "blocks.1.cross_attn.v_img.weight" in phase_units["blocks.1.cross_attn"]
    resident = set(resident_names(model, plan_units(model, "block", spec)))
    assert {k for k in model.state_dict() if k.startswith("img_emb.")} <= resident
    assert not any("_img" in k for k in resident)

    model = _load(task, _native_sd(task))
    i = _inputs(task, 1, 4, 4, [5])
    expected = model(i["latents"], i["timestep"], i["context"], clip_context=i["clip"], y=i["y"])
    saved = [copy.deepcopy(block.state_dict()) for block in model.blocks]

    def fetch(j: int):  # pre-hook: the block's weights arrive
        def hook(module: torch.nn.Module, args: tuple) -> None:
            module.load_state_dict(saved[j], assign=True)
        return hook

    def evict(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:  # post-hook: they leave
        module.to("meta")

    for j, block in enumerate(model.blocks):
        block.to("meta")
        block.register_forward_pre_hook(fetch(j))
        block.register_forward_hook(evict)
    assert torch.equal(model(i["latents"], i["timestep"], i["context"], clip_context=i["clip"], y=i["y"]), expected)


def test_release_shapes_build_on_meta() -> None:
    """The released 14B i2v / flf2v skeletons build on the meta device with every tensor shaped."""
    i2v = arch_from_original_config(WAN_I2V_14B_ORIGINAL)
    shapes = {k: tuple(v.shape) for k, v in build_on_meta(lambda: WanTransformer3D(i2v)).state_dict().items()}
    assert all(v.is_meta for v in build_on_meta(lambda: WanTransformer3D(i2v)).state_dict().values())
    assert shapes["patch_embedding.weight"] == (5120, 36, 1, 2, 2)
    assert shapes["img_emb.proj.0.weight"] == (1280,)
    assert shapes["img_emb.proj.1.weight"] == (1280, 1280)
    assert shapes["img_emb.proj.3.weight"] == (5120, 1280)
    assert shapes["img_emb.proj.4.weight"] == (5120,)
    assert shapes["blocks.39.cross_attn.k_img.weight"] == shapes["blocks.39.cross_attn.v_img.weight"] == (5120, 5120)
    assert shapes["blocks.39.cross_attn.norm_k_img.weight"] == (5120,)
    assert "img_emb.emb_pos" not in shapes
    flf2v = arch_from_original_config(WAN_FLF2V_14B_ORIGINAL)
    flf_shapes = {k: tuple(v.shape) for k, v in build_on_meta(lambda: WanTransformer3D(flf2v)).state_dict().items()}
    assert flf_shapes == shapes | {"img_emb.emb_pos": (1, 514, 1280)}


# Released configs: Wan2.1-I2V-14B-480P / -720P and Wan2.1-FLF2V-14B-720P `config.json`, and the
# diffusers `transformer/config.json` of Wan2.1-I2V-14B-480P-Diffusers.
WAN_I2V_14B_ORIGINAL = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": 5120, "eps": 1e-06,
                        "ffn_dim": 13824, "freq_dim": 256, "in_dim": 36, "model_type": "i2v", "num_heads": 40,
                        "num_layers": 40, "out_dim": 16, "text_len": 512}
WAN_FLF2V_14B_ORIGINAL = {**WAN_I2V_14B_ORIGINAL, "model_type": "flf2v"}
WAN_I2V_14B_DIFFUSERS = {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
                         "added_kv_proj_dim": 5120, "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-06,
                         "ffn_dim": 13824, "freq_dim": 256, "image_dim": 1280, "in_channels": 36,
                         "num_attention_heads": 40, "num_layers": 40, "out_channels": 16, "patch_size": [1, 2, 2],
                         "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096}


def test_configs_round_trip() -> None:
    i2v = arch_from_original_config(WAN_I2V_14B_ORIGINAL)
    assert (i2v.model_type, i2v.in_dim, i2v.dim) == ("i2v", 36, 5120)
    assert arch_to_original_config(i2v) == {k: v for k, v in WAN_I2V_14B_ORIGINAL.items() if k != "_diffusers_version"}
    assert arch_from_diffusers_config(WAN_I2V_14B_DIFFUSERS) == i2v
    flf2v = arch_from_original_config(WAN_FLF2V_14B_ORIGINAL)
    assert flf2v.model_type == "flf2v" and arch_to_diffusers_config(flf2v)["pos_embed_seq_len"] == 514
    assert arch_from_diffusers_config({**WAN_I2V_14B_DIFFUSERS, "pos_embed_seq_len": 514}) == flf2v
    for arch in ARCHS.values():
        assert arch_from_original_config(arch_to_original_config(arch)) == arch
        assert arch_from_diffusers_config(arch_to_diffusers_config(arch)) == arch
    with pytest.raises(ValueError, match="`in_dim`=16 must exceed `out_dim`=16"):
        arch_from_original_config({**WAN_I2V_14B_ORIGINAL, "in_dim": 16})


@pytest.mark.parametrize("task, change, message", [
    ("i2v", {"clip": None}, "needs `clip_context` and `y`"),
    ("i2v", {"y": None}, "needs `clip_context` and `y`"),
    ("i2v", {"y": (1, 4, 2, 4, 4)}, "`y` must be [B, C_in - C_out, F, H, W] = (1, 5, 2, 4, 4)"),
    ("i2v", {"latents": (1, 9, 2, 4, 4)}, "`latents` must be [B, 4, F, H, W]"),
    ("i2v", {"clip": (1, 257, 1024)}, "`clip_context` must be [1, L_img, 1280]"),
    ("flf2v", {"clip": (1, 257, 1280)}, "`clip_context` must be [1, 514, 1280]"),
])
def test_bad_inputs_raise(task: str, change: dict[str, tuple[int, ...] | None], message: str) -> None:
    model = WanTransformer3D(ARCHS[task])
    shapes = {"latents": (1, 4, 2, 4, 4), "y": (1, 5, 2, 4, 4), "clip": (1, TOKENS[task], 1280)} | change
    t = {k: None if s is None else torch.zeros(s) for k, s in shapes.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        model(t["latents"], torch.zeros(1), torch.zeros(1, 3, 32), clip_context=t["clip"], y=t["y"])


def test_t2v_refuses_image_inputs() -> None:
    model = WanTransformer3D(WanTransformerArch(**{**TINY, "in_dim": 4}))
    with pytest.raises(ValueError, match="only accepted by i2v / flf2v"):
        model(torch.zeros(1, 4, 2, 4, 4), torch.zeros(1), torch.zeros(1, 3, 32), clip_context=torch.zeros(1, 257, 1280))
    assert model.img_emb is None
