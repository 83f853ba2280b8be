"""UMT5 text encoder and tokenizer of Wan2.1: transformers parity, key layouts, tokenizer goldens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runnerkit.models.wan.arch import UMT5Arch
from runnerkit.models.wan.text_encoder import (
    UMT5Encoder,
    WanTextEncoder,
    arch_from_hf_config,
    arch_to_hf_config,
    hf_to_native,
    keep_fp32,
    load_umt5_encoder,
    native_to_hf,
    relative_position_buckets,
)
from runnerkit.models.wan.tokenizer import WanTokenizer, clean_prompt, write_debug_tokenizer
from runnerkit.weights import CheckpointError
from test_cases._reference import require_reference

transformers = require_reference("transformers")

# text_len 40 > max_distance 16, so the log buckets and their clamp are exercised.
ARCH = UMT5Arch(vocab_size=160, dim=32, dim_attn=32, dim_ffn=64, num_heads=4, num_layers=2,
                num_buckets=8, max_distance=16, text_len=40)


def _hf_model(attn_implementation: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.UMT5Config(**arch_to_hf_config(ARCH), attn_implementation=attn_implementation)
    model = transformers.UMT5EncoderModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Non-unit norm scales, so a swapped norm1/norm2 mapping cannot pass.
            p.copy_(1 + 0.2 * torch.randn_like(p) if "layer_norm" in name else 0.2 * torch.randn_like(p))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts: one filling all 40 positions, one of 23 tokens then padding."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, ARCH.vocab_size, (2, ARCH.text_len), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 23:] = 0
    mask[1, 23:] = 0
    return ids, mask


# ---- encoder ------------------------------------------------------------------------------

@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_parity_with_transformers_umt5_encoder(attn_implementation: str) -> None:
    hf = _hf_model(attn_implementation)
    ids, mask = _batch()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = load_umt5_encoder(ARCH, hf_to_native(hf.state_dict()))(ids, mask)
    assert ours.shape == (2, ARCH.text_len, ARCH.dim) and ours.dtype == torch.float32
    assert (ours - expected).abs().max().item() <= 1e-4
    assert expected.abs().mean().item() > 0.1  # not a degenerate comparison


def test_buckets_match_transformers() -> None:
    attention = _hf_model().encoder.block[0].layer[0].SelfAttention
    positions = torch.arange(64)
    expected = attention._relative_position_bucket(positions[None, :] - positions[:, None])
    buckets = relative_position_buckets(64, ARCH.num_buckets, ARCH.max_distance)
    assert torch.equal(buckets, expected)
    # Golden row: keys after query 0 use the upper half (4..7): exact for distance 1, then
    # log-spaced, saturating at the last bucket from distance 6 on; keys before use 0..3.
    assert buckets[0, :10].tolist() == [0, 5, 6, 6, 6, 6, 7, 7, 7, 7]
    assert buckets[20, :3].tolist() == [3, 3, 3]


def test_padding_does_not_change_token_rows() -> None:
    model = load_umt5_encoder(ARCH, hf_to_native(_hf_model().state_dict()))
    ids, mask = _batch()
    with torch.no_grad():
        batched = model(ids, mask)[1, :23]
        alone = model(ids[1:, :23], mask[1:, :23])[0]
    assert (batched - alone).abs().max().item() <= 1e-5


def test_native_key_names_are_wan_pth_names() -> None:
    arch = ARCH.model_copy(update={"num_layers": 1})
    keys = list(UMT5Encoder(arch).state_dict())
    assert keys == [
        "token_embedding.weight",
        "blocks.0.norm1.weight",
        "blocks.0.attn.q.weight", "blocks.0.attn.k.weight", "blocks.0.attn.v.weight", "blocks.0.attn.o.weight",
        "blocks.0.norm2.weight",
        "blocks.0.ffn.gate.0.weight", "blocks.0.ffn.fc1.weight", "blocks.0.ffn.fc2.weight",
        "blocks.0.pos_embedding.embedding.weight",
        "norm.weight",
    ]
    assert [k for k in keys if keep_fp32(k)] == ["blocks.0.norm1.weight", "blocks.0.norm2.weight", "norm.weight"]


def test_bfloat16_keeps_norms_float32() -> None:
    sd = hf_to_native(_hf_model().state_dict())
    ids, mask = _batch()
    reference = load_umt5_encoder(ARCH, dict(sd))(ids, mask)
    model = load_umt5_encoder(ARCH, dict(sd), dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert {n for n, d in dtypes.items() if d == torch.float32} == {n for n in dtypes if keep_fp32(n)}
    assert {d for n, d in dtypes.items() if not keep_fp32(n)} == {torch.bfloat16}
    out = model(ids, mask)
    assert out.dtype == torch.bfloat16
    assert (out.float() - reference).abs().mean().item() < 0.05


def test_state_dict_round_trip() -> None:
    hf = _hf_model()
    sd = hf.state_dict()
    back = native_to_hf(hf_to_native(sd))
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    hf.load_state_dict(back, strict=True)
    # Either embedding name alone is accepted.
    for drop in ("shared.weight", "encoder.embed_tokens.weight"):
        single = {k: v for k, v in sd.items() if k != drop}
        assert torch.equal(hf_to_native(single)["token_embedding.weight"], sd["shared.weight"])
    assert "encoder.embed_tokens.weight" not in native_to_hf(hf_to_native(sd), embed_tokens_alias=False)


def test_converters_are_strict() -> None:
    sd = dict(_hf_model().state_dict())
    with pytest.raises(CheckpointError, match=r"decoder\.block\.0\.layer\.0\.SelfAttention\.q\.weight"):
        hf_to_native({**sd, "decoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="differ"):
        hf_to_native({**sd, "encoder.embed_tokens.weight": sd["shared.weight"] + 1})
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.qq\.weight"):
        native_to_hf({"blocks.0.attn.qq.weight": torch.zeros(1)})


def test_missing_tensor_is_named() -> None:
    sd = hf_to_native(_hf_model().state_dict())
    del sd["blocks.1.attn.k.weight"]
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): blocks\.1\.attn\.k\.weight"):
        load_umt5_encoder(ARCH, sd)


def test_forward_rejects_bad_shapes() -> None:
    model = UMT5Encoder(ARCH)
    ids, mask = _batch()
    with pytest.raises(ValueError, match="`input_ids` must be"):
        model(ids[0], mask[0])
    with pytest.raises(ValueError, match="`attention_mask`"):
        model(ids, mask[:, :10])


# ---- configs ------------------------------------------------------------------------------

def test_hf_config_round_trip_and_umt5_xxl_values() -> None:
    full = transformers.UMT5Config(**arch_to_hf_config(ARCH)).to_dict()
    assert arch_from_hf_config(full, text_len=ARCH.text_len) == ARCH
    xxl = arch_to_hf_config(UMT5Arch())
    assert {k: xxl[k] for k in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                                "relative_attention_num_buckets", "relative_attention_max_distance")} == {
        "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
        "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}


@pytest.mark.parametrize("key,value", [("feed_forward_proj", "relu"), ("model_type", "t5"), ("is_decoder", True),
                                       ("dense_act_fn", "relu")])
def test_hf_config_unsupported_values(key: str, value: object) -> None:
    config = {**arch_to_hf_config(ARCH), key: value}
    with pytest.raises(ValueError, match=f"`{key}`"):
        arch_from_hf_config(config)


def test_hf_config_errors() -> None:
    config = arch_to_hf_config(ARCH)
    del config["d_model"]
    with pytest.raises(ValueError, match="d_model"):
        arch_from_hf_config(config)
    with pytest.raises(ValueError, match="`dim_attn` \\(30\\)"):
        arch_to_hf_config(ARCH.model_copy(update={"dim_attn": 30}))


# ---- tokenizer ----------------------------------------------------------------------------

@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    return write_debug_tokenizer(tmp_path / "tokenizer", vocab_size=128)


def test_debug_tokenizer_golden_ids(tokenizer_file: Path) -> None:
    tokenizer = WanTokenizer.from_file(tokenizer_file.parent)
    ids, mask = tokenizer(["Hi!", "a\u00e9b"], text_len=6)
    # ' ' = 3, ..., '!' = 4, 'H' = 43, 'a' = 68, 'i' = 76; </s> = 1, <unk> = 2, <pad> = 0.
    assert ids.tolist() == [[43, 76, 4, 1, 0, 0], [68, 2, 69, 1, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long


def test_truncation_keeps_eos_last(tokenizer_file: Path) -> None:
    ids, mask = WanTokenizer.from_file(tokenizer_file)(["abcdefghij", "ab"], text_len=5)
    assert ids.tolist() == [[68, 69, 70, 71, 1], [68, 69, 1, 0, 0]]
    assert mask.sum(dim=1).tolist() == [5, 3]
    assert WanTokenizer.from_file(tokenizer_file)(["abc"], text_len=1)[0].tolist() == [[1]]


def test_whitespace_cleaning(tokenizer_file: Path) -> None:
    text = "  Hi\t\n  &amp;amp;  there\u3000\u00a0! "
    assert clean_prompt(text) == "Hi & there !"
    assert clean_prompt("a\x1cb  c") == "a\x1cb c"  # Wan's regex \s does not match U+001C
    tokenizer = WanTokenizer.from_file(tokenizer_file)
    assert torch.equal(tokenizer([text], 20)[0], tokenizer(["Hi & there !"], 20)[0])


def test_matches_transformers_fast_tokenizer(tokenizer_file: Path) -> None:
    prompts = ["A cat walks on grass.", "x" * 30, "Hi"]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), pad_token="<pad>")
    expected = hf(prompts, padding="max_length", truncation=True, max_length=16, add_special_tokens=True)
    ids, mask = WanTokenizer.from_file(tokenizer_file)(prompts, 16)
    assert ids.tolist() == expected["input_ids"]
    assert mask.tolist() == expected["attention_mask"]
    auto = transformers.AutoTokenizer.from_pretrained(str(tokenizer_file.parent))
    assert auto(prompts, padding="max_length", truncation=True, max_length=16)["input_ids"] == ids.tolist()


def test_debug_tokenizer_is_deterministic_and_fits_vocab(tmp_path: Path) -> None:
    a = write_debug_tokenizer(tmp_path / "a", 50)
    b = write_debug_tokenizer(tmp_path / "b", 50)
    assert a.read_bytes() == b.read_bytes()
    tokenizer = WanTokenizer.from_file(a)
    assert tokenizer.vocab_size == 50
    ids, _ = tokenizer(["N~ !"], 8)  # 'N' is the last character kept below id 50
    assert ids[0].tolist() == [49, 2, 3, 4, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="`vocab_size`"):
        write_debug_tokenizer(tmp_path / "c", 3)


def test_eos_added_without_post_processor(tmp_path: Path, tokenizer_file: Path) -> None:
    data = json.loads(tokenizer_file.read_text())
    data["post_processor"] = None
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    assert WanTokenizer.from_file(bare)(["ab"], 4)[0].tolist() == [[68, 69, 1, 0]]


def test_tokenizer_errors(tmp_path: Path, tokenizer_file: Path) -> None:
    from runnerkit.weights import CheckpointError

    with pytest.raises(CheckpointError, match=f"tokenizer: no tokenizer.json at {tmp_path / 'nowhere'} "):
        WanTokenizer.from_file(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="tokenizer: no tokenizer.json at"):
        WanTokenizer.from_file(tmp_path)  # a folder without tokenizer.json
    tokenizer = WanTokenizer.from_file(tokenizer_file)
    with pytest.raises(ValueError, match="`text_len`"):
        tokenizer(["a"], 0)
    with pytest.raises(ValueError, match="`prompts`"):
        tokenizer([], 4)


# ---- WanTextEncoder -----------------------------------------------------------------------

def test_encode_trims_to_token_counts(tokenizer_file: Path) -> None:
    encoder = load_umt5_encoder(ARCH, hf_to_native(_hf_model().state_dict()))
    text_encoder = WanTextEncoder(WanTokenizer.from_file(tokenizer_file), encoder)
    prompts = ["Hi there", "A   much &amp; longer prompt", "z" * 100]
    out = text_encoder.encode(prompts)
    ids, mask = text_encoder.tokenizer(prompts, ARCH.text_len)
    assert [u.shape for u in out] == [(9, 32), (23, 32), (40, 32)]
    assert [u.shape[0] for u in out] == mask.sum(dim=1).tolist()
    with torch.no_grad():
        full = encoder(ids, mask)
    for i, u in enumerate(out):
        assert torch.equal(u, full[i, : u.shape[0]])
        assert u.dtype == torch.float32 and u.device == encoder.token_embedding.weight.device
    # A prompt's embedding does not depend on the other prompts of the batch.
    assert (text_encoder.encode(["Hi there"])[0] - out[0]).abs().max().item() <= 1e-5


def test_encode_rejects_tokenizer_larger_than_vocab(tokenizer_file: Path) -> None:
    tokenizer = WanTokenizer.from_file(tokenizer_file)  # 3 specials + 95 characters
    with pytest.raises(ValueError, match="98 ids but the encoder embeds only 90"):
        WanTextEncoder(tokenizer, UMT5Encoder(ARCH.model_copy(update={"vocab_size": 90})))


@pytest.mark.parametrize("update,field", [({"num_heads": 5}, "`dim_attn`"), ({"num_buckets": 2}, "`num_buckets`"),
                                          ({"max_distance": 2}, "`max_distance`")])
def test_encoder_rejects_unbuildable_arch(update: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        UMT5Encoder(ARCH.model_copy(update=update))
