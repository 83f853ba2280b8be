"""The LTX-2.5 diffusion decoder's window attention on CUDA (GPU test, `-m gpu`): compiled FlexAttention for heads
of 16 and more, the dense mask below (inductor lowers FlexAttention for no smaller head), both against the
dense-mask path on the CPU (diffusion_decoder_layers.py `uses_flex`). float32, tiny widths."""

from __future__ import annotations

import pytest
import torch

from runnerkit.models.ltx2.diffusion_decoder import TINY_LTX25_DIFFUSION_DECODER, LTX2DiffusionDecoder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("head_dim", [8, 16], ids=["dense-mask", "flex"])
def test_cuda_window_attention_equals_the_cpu_dense_path(head_dim: int) -> None:
    arch = TINY_LTX25_DIFFUSION_DECODER.model_copy(update={"decoder_head_dim": head_dim,
                                                          "decoder_stage_channels": (64, 32, 32, 32, 16)})
    torch.manual_seed(0)
    cpu = LTX2DiffusionDecoder(arch).eval()
    cuda = LTX2DiffusionDecoder(arch).cuda().eval()
    cuda.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1, arch.latent_channels, 2, 1, 3, generator=g)
    x_t = torch.randn(*cpu.pixel_shape(tuple(z.shape)), generator=g)
    t = torch.tensor([0.7])
    with torch.no_grad():
        want = cpu.decoder.predict(cpu.decoder.context(z), x_t, t)
        got = cuda.decoder.predict(cuda.decoder.context(z.cuda()), x_t.cuda(), t.cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("limit", [None, 3 * 2 * 24 * 32 * 128], ids=["whole", "slabs"])
def test_cuda_tiled_flex_attention_equals_the_row_major_dense_mask(limit: int | None) -> None:
    """Compiled FlexAttention in 2x8x8 tile order (the grid padded on every axis) over the geometric block tables
    (window_blocks.py: narrower than the KV block count, partial blocks only), whole and in slabs of frames whose
    mask_mod reads its frame offsets from tensors, against SDPA with the dense row-major window mask."""
    from runnerkit.models.ltx2 import diffusion_decoder_layers as layers

    grid, kernel, heads, d = (9, 20, 30), (5, 7, 7), 2, 64  # padded to 10 x 24 x 32
    cuda = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, *grid, heads, d, generator=g, device=cuda) for _ in range(3))
    mask = layers.stage_mask(grid, kernel, cuda, d, heads * d, limit=limit)
    assert mask.layout.tile == layers.TILE and len(mask.slabs) == (1 if limit is None else 3)
    if limit is None:  # 60 query tiles, each of at most 27 KV tiles: the narrow tables
        assert mask.slabs[0].mask.kv_indices.shape[-2:] == (60, 27)
    got = layers.neighborhood_attention(q, k, v, kernel, mask)
    flat = [t.reshape(1, -1, heads, d).transpose(1, 2) for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(
        *flat, attn_mask=layers.dense_neighborhood_mask(grid, kernel, cuda), scale=1.0)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(1, *grid, heads * d), rtol=2e-3, atol=2e-3)


@pytest.mark.usefixtures("fresh_compiler")
def test_compiled_regions_on_cuda_equal_eager_and_serve_a_third_shape_without_compiling() -> None:
    """Inductor compiles the decoder's declared regions (the attention's query and key paths, the MLP tile;
    runnerkit/compile.py `compile_regions`) at two latent shapes; a third compiles nothing, and every decode equals
    the eager decoder's within 1e-3 (float32)."""
    from torch._dynamo.utils import counters

    from runnerkit import compile as regional_compile
    from runnerkit.config import CompileConfig

    arch = TINY_LTX25_DIFFUSION_DECODER.model_copy(update={"decoder_head_dim": 16,
                                                          "decoder_stage_channels": (64, 32, 32, 32, 16)})
    torch.manual_seed(0)
    eager = LTX2DiffusionDecoder(arch).cuda().eval()
    compiled = LTX2DiffusionDecoder(arch).cuda().eval()
    compiled.load_state_dict(eager.state_dict())
    assert regional_compile.compile_regions(compiled, CompileConfig(enabled=True)) > 0
    g = torch.Generator().manual_seed(1)
    graphs = []
    for f, h, w in ((2, 1, 3), (4, 2, 3), (3, 2, 4)):
        z = torch.randn(1, arch.latent_channels, f, h, w, generator=g).cuda()
        x_t = torch.randn(*eager.pixel_shape(tuple(z.shape)), generator=g).cuda()
        t = torch.tensor([0.7], device="cuda")
        before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            want = eager.decoder.predict(eager.decoder.context(z), x_t, t)
            got = compiled.decoder.predict(compiled.decoder.context(z), x_t, t)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert graphs[0] >= 1 and graphs[2] == 0, graphs
