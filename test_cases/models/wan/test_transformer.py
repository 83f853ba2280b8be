"""Wan2.1 transformer: parity with diffusers, key/config converters, dtypes, hooks, errors."""

from __future__ import annotations

import copy
import inspect
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
from runnerkit.weights import CheckpointError, assign_state_dict, build_on_meta
from test_cases._reference import require_reference

diffusers = require_reference("diffusers")
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers  # noqa: E402

# head_dim 32: RoPE axes get 12 / 10 / 10 channels.
ARCH = WanTransformerArch(dim=64, num_heads=2, num_layers=2, text_dim=32, ffn_dim=96, freq_dim=32,
                          text_len=16, in_dim=4, out_dim=4)
TOL = 1e-4


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Perturb every parameter (norm weights and biases included) so parity covers them all."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return module.eval()


def _diffusers_model(seed: int = 0) -> torch.nn.Module:
    model = diffusers.WanTransformer3DModel.from_config(arch_to_diffusers_config(ARCH))
    return _randomize(model, seed)


def _native_sd(seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in _randomize(WanTransformer3D(ARCH), seed).state_dict().items()}


def _load(sd: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> WanTransformer3D:
    model = build_on_meta(lambda: WanTransformer3D(ARCH))
    return assign_state_dict(model, sd, "transformer", dtype=dtype, keep_fp32=keep_fp32).eval()


def _inputs(batch: int, height: int, width: int, lengths: list[int], timesteps: list[int | float],
            seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents [B, 4, 2, H, W], timestep [B], context [B, max(lengths), 32] (zeros past each
    prompt's length) and the same context zero-padded to text_len for diffusers."""
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, ARCH.in_dim, 2, height, width, generator=gen)
    context = torch.zeros(batch, max(lengths), ARCH.text_dim)
    for i, n in enumerate(lengths):
        context[i, :n] = torch.randn(n, ARCH.text_dim, generator=gen)
    padded = torch.zeros(batch, ARCH.text_len, ARCH.text_dim)
    padded[:, : max(lengths)] = context
    timestep = torch.tensor(timesteps)
    return latents, timestep, context, padded


CASES = [
    pytest.param(1, 4, 4, [7], [999], id="B1-4x4-t999-int"),
    pytest.param(2, 4, 6, [5, 3], [999.0, 500.0], id="B2-4x6-t999,500"),
    pytest.param(2, 6, 4, [16, 2], [0.5, 731.25], id="B2-6x4-full-context"),
]


@pytest.mark.parametrize("batch, height, width, lengths, timesteps", CASES)
@torch.no_grad()
def test_parity_with_diffusers(batch: int, height: int, width: int, lengths: list[int],
                               timesteps: list[int | float]) -> None:
    reference = _diffusers_model()
    model = _load(diffusers_to_native(reference.state_dict()))
    latents, timestep, context, padded = _inputs(batch, height, width, lengths, timesteps)

    expected = reference(latents, timestep, padded, return_dict=False)[0]
    out = model(latents, timestep, context)

    assert out.shape == (batch, ARCH.out_dim, 2, height, width) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1, "reference output should not be trivially small"
    assert (out - expected).abs().max() <= TOL


@torch.no_grad()
def test_blocks_get_a_row_major_residual_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patch embedding's [B, dim, f, h, w] output reaches every block as a row-major [B, L, dim] stream: a
    channel-major one (the transpose's strides) makes each LayerNorm reduce over strided channels (1.14 ms of
    a compiled 14B block call on the H200, bench/results/residual_layout_h200.md). Eager values are the same bits."""
    model = _load(_native_sd())
    latents, timestep, context, _ = _inputs(2, 4, 6, [5, 3], [999.0, 500.0])
    seen: list[tuple[tuple[int, ...], bool]] = []
    block_cls = type(model.blocks[0])
    real = block_cls.forward

    def spy(self, x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((tuple(x.stride()), x.is_contiguous()))
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(block_cls, "forward", spy)
    model(latents, timestep, context)
    assert len(seen) == ARCH.num_layers
    assert all(contiguous for _, contiguous in seen), seen


@torch.no_grad()
def test_original_keys_match_diffusers_converter() -> None:
    """Independent check of the key map: diffusers' own original->diffusers converter."""
    sd = _native_sd()
    theirs = convert_wan_transformer_to_diffusers(dict(sd))
    ours = native_to_diffusers(sd)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k] is theirs[k] for k in ours)
    assert diffusers_to_native(ours) == sd

    reference = diffusers.WanTransformer3DModel.from_config(arch_to_diffusers_config(ARCH)).eval()
    reference.load_state_dict(theirs, strict=True)
    model = _load(sd)
    latents, timestep, context, padded = _inputs(2, 4, 6, [5, 9], [999, 500])
    expected = reference(latents, timestep, padded, return_dict=False)[0]
    assert (model(latents, timestep, context) - expected).abs().max() <= TOL


@torch.no_grad()
def test_bf16_weights_keep_fp32_layers() -> None:
    sd = _native_sd()
    model32 = _load(sd)
    model16 = _load(sd, dtype=torch.bfloat16)
    fp32 = sorted(k for k, v in model16.state_dict().items() if v.dtype == torch.float32)
    assert fp32 == sorted(k for k in sd if keep_fp32(k))
    assert set(fp32) == {"time_embedding.0.weight", "time_embedding.0.bias", "time_embedding.2.weight",
                         "time_embedding.2.bias", "head.modulation"} | {
        f"blocks.{i}.{n}" for i in range(2) for n in ("modulation", "norm3.weight", "norm3.bias")}
    assert model16.blocks[0].self_attn.q.weight.dtype == torch.bfloat16
    assert model16.rope_freqs.dtype == torch.complex64

    latents, timestep, context, _ = _inputs(2, 4, 6, [5, 3], [999, 500])
    expected = model32(latents, timestep, context)
    out = model16(latents, timestep, context)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = (out - expected).norm() / expected.norm()
    assert rel < 0.02, f"bf16 relative error {rel:.4f}"


@torch.no_grad()
def test_block_hooks_bracket_all_block_weight_use() -> None:
    """Simulated block streaming: block weights exist only between the block's pre/post hooks,
    and the phases run as separate submodules in order."""
    sd = _native_sd()
    model = _load(sd)
    latents, timestep, context, _ = _inputs(2, 4, 4, [5, 3], [999, 500])
    expected = model(latents, timestep, context)

    saved = [copy.deepcopy(block.state_dict()) for block in model.blocks]
    for block in model.blocks:
        block.to("meta")
    events: list[str] = []

    def fetch(i: int):  # pre-hook: the block's weights arrive
        def hook(module: torch.nn.Module, args: tuple) -> None:
            events.append(f"pre{i}")
            module.load_state_dict(saved[i], assign=True)
        return hook

    def evict(i: int):  # post-hook: the block's weights leave
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            events.append(f"post{i}")
            module.to("meta")
        return hook

    def record(name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            events.append(name)
        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(fetch(i))
        block.register_forward_hook(evict(i))
        for phase in ("self_attn", "cross_attn", "ffn"):
            getattr(block, phase).register_forward_pre_hook(record(f"{phase}{i}"))

    assert torch.equal(model(latents, timestep, context), expected)
    assert events == ["pre0", "self_attn0", "cross_attn0", "ffn0", "post0",
                      "pre1", "self_attn1", "cross_attn1", "ffn1", "post1"]


@torch.no_grad()
def test_rope_table_and_cache() -> None:
    eager = WanTransformer3D(ARCH)
    loaded = _load(_native_sd())
    assert loaded.rope_freqs.shape == (1024, 16)
    assert torch.equal(loaded.rope_freqs, eager.rope_freqs)
    # Axis frequencies follow Wan's rope_params: frame axis has 12 channels -> 6 pairs.
    angle = torch.angle(loaded.rope_freqs[1, :6].to(torch.complex128))
    assert torch.allclose(angle, 1.0 / 10000 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 12), atol=1e-6)

    latents, timestep, context, _ = _inputs(1, 4, 6, [3], [10])
    loaded(latents, timestep, context)
    assert list(loaded._rope_cache) == [(2, 2, 3, torch.device("cpu"))]
    cos, sin = loaded._rope_cache[(2, 2, 3, torch.device("cpu"))]
    assert cos.shape == sin.shape == (12, 1, 16)
    loaded.clear_cache()
    assert loaded._rope_cache == {}


@pytest.mark.parametrize("args, name", [
    (((1, 5, 2, 4, 4), (1,), (1, 3, 32)), "`latents`"),
    (((1, 4, 2, 5, 4), (1,), (1, 3, 32)), "`latents` height = 5"),
    (((1, 4, 2, 4, 3), (1,), (1, 3, 32)), "`latents` width = 3"),
    (((1, 4, 2, 4, 4), (2,), (1, 3, 32)), "`timestep`"),
    (((1, 4, 2, 4, 4), (1,), (1, 17, 32)), "`context` length L = 17 exceeds `text_len` = 16"),
    (((1, 4, 2, 4, 4), (1,), (1, 3, 31)), "`context`"),
    (((2, 4, 2, 4, 4), (2,), (1, 3, 32)), "`context`"),
])
def test_bad_inputs_raise(args: tuple[tuple[int, ...], ...], name: str) -> None:
    model = WanTransformer3D(ARCH)
    latents, timestep, context = (torch.zeros(shape) for shape in args)
    with pytest.raises(ValueError, match=re.escape(name)):
        model(latents, timestep, context)


def test_checkpoint_errors_name_the_key() -> None:
    sd = _native_sd()
    del sd["blocks.1.cross_attn.norm_k.weight"]
    with pytest.raises(CheckpointError, match="blocks.1.cross_attn.norm_k.weight"):
        _load(sd)
    with pytest.raises(CheckpointError, match="blocks.0.attn1.to_qq.weight"):
        diffusers_to_native({"blocks.0.attn1.to_qq.weight": torch.zeros(1), "proj_out.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="model.diffusion_model.head.head.weight"):
        native_to_diffusers({"model.diffusion_model.head.head.weight": torch.zeros(1)})
    # a key renamed in one block: the unknown key, and what that block then lacks, are both named
    theirs = native_to_diffusers(_native_sd())
    theirs["blocks.1.ffn.net.0.bias"] = theirs.pop("blocks.1.ffn.net.0.proj.bias")
    with pytest.raises(CheckpointError) as exc:
        diffusers_to_native(theirs)
    assert str(exc.value) == ("transformer: 1 keys are not diffusers Wan transformer keys: blocks.1.ffn.net.0.bias; "
                              "missing in their blocks (1): blocks.1.ffn.net.0.proj.bias")


# Released configs: Wan2.1-T2V-1.3B `config.json` and its diffusers `transformer/config.json`.
WAN_13B_ORIGINAL = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": 1536, "eps": 1e-06,
                    "ffn_dim": 8960, "freq_dim": 256, "in_dim": 16, "model_type": "t2v", "num_heads": 12,
                    "num_layers": 30, "out_dim": 16, "text_len": 512}
WAN_13B_DIFFUSERS = {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
                     "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True,
                     "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "image_dim": None, "in_channels": 16,
                     "num_attention_heads": 12, "num_layers": 30, "out_channels": 16, "patch_size": [1, 2, 2],
                     "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096}


def test_original_config_round_trip() -> None:
    assert arch_from_original_config(WAN_13B_ORIGINAL) == WanTransformerArch()
    assert arch_to_original_config(WanTransformerArch()) == {
        k: v for k, v in WAN_13B_ORIGINAL.items() if k != "_diffusers_version"}
    assert arch_from_original_config(arch_to_original_config(ARCH)) == ARCH
    assert arch_to_original_config(ARCH)["text_dim"] == 32
    # Missing keys take WanModel's own defaults, not the 1.3B ones.
    assert arch_from_original_config({}).dim == 2048
    with pytest.raises(ValueError, match="dimm"):
        arch_from_original_config({**WAN_13B_ORIGINAL, "dimm": 3})
    with pytest.raises(ValueError, match="`window_size`"):
        arch_from_original_config({**WAN_13B_ORIGINAL, "window_size": [8, 8]})
    with pytest.raises(ValueError, match="`_class_name`"):
        arch_from_original_config({**WAN_13B_ORIGINAL, "_class_name": "WanVAE"})


def test_diffusers_config_round_trip() -> None:
    assert arch_from_diffusers_config(WAN_13B_DIFFUSERS) == WanTransformerArch()
    assert arch_from_diffusers_config(arch_to_diffusers_config(ARCH), text_len=16) == ARCH
    accepted = set(inspect.signature(diffusers.WanTransformer3DModel.__init__).parameters)
    assert set(arch_to_diffusers_config(ARCH)) - {"_class_name"} <= accepted
    assert {k: v for k, v in arch_to_diffusers_config(WanTransformerArch()).items() if v is not None or k in WAN_13B_DIFFUSERS} \
        == {k: v for k, v in WAN_13B_DIFFUSERS.items() if k != "_diffusers_version"} | {"rope_max_seq_len": 1024}
    i2v = arch_from_diffusers_config({**WAN_13B_DIFFUSERS, "image_dim": 1280, "added_kv_proj_dim": 1536, "in_channels": 36})
    assert i2v.model_type == "i2v" and arch_to_diffusers_config(i2v)["added_kv_proj_dim"] == 1536
    with pytest.raises(ValueError, match="`qk_norm`"):
        arch_from_diffusers_config({**WAN_13B_DIFFUSERS, "qk_norm": "layer_norm"})
    with pytest.raises(ValueError, match="`image_dim`"):
        arch_from_diffusers_config({**WAN_13B_DIFFUSERS, "image_dim": 1024})
    with pytest.raises(ValueError, match="window_size"):
        arch_from_diffusers_config({**WAN_13B_DIFFUSERS, "window_size": [-1, -1]})
    with pytest.raises(ValueError, match="`qk_norm`"):
        arch_to_diffusers_config(ARCH.model_copy(update={"qk_norm": False}))
    assert build_on_meta(lambda: WanTransformer3D(i2v)).img_emb is not None  # i2v / flf2v: test_transformer_i2v.py
