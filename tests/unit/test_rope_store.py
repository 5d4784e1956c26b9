"""The Triton rope-and-store kernel (run by Triton's interpreter on CPU) against the torch reference, and the
reference against Hugging Face's rotary embedding."""


import pytest
import torch
from tpgtest.head_norms import assert_within_a_variance_bit, random_head_norm
from tpgtest.launches import spy_launches
from tpgtest.markers import interpreted

from tpgraph.kernels.rope_store import rope_and_store, rope_and_store_reference, rope_cos_sin_table

pytest.importorskip("triton")

# These tests hand CPU tensors to the kernels, which only Triton's interpreter runs (conftest turns it on when
# there is no GPU); on a GPU machine without TRITON_INTERPRET=1 they would fail to launch, so they skip.

MAX_POS = 4096


def _inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _case(seed: int, tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
          index_dtype: torch.dtype):
    """A strided qkv view, random positions, distinct random slots and caches filled with noise."""
    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(tokens, width + 24, generator=g).to(dtype)
    qkv = wide[:, 8:8 + width]  # rows width + 24 apart: the kernel must honour the row stride
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g).to(index_dtype)
    num_blocks = 2 + -(-tokens // block_size)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(index_dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return qkv, positions, slots, k_cache, v_cache


def _matches_reference(seed: int, tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, index_dtype: torch.dtype, head_norm: tuple | None = None, **launch):
    """The Triton launch on `_case`'s problem (with `launch`'s keywords) equals the reference bit for bit: q, k and
    both caches (other slots untouched too). Returns the launch's q and k. head_norm (Qwen3's), given to both: q, k
    and the K cache within the variance's last bit (assert_within_a_variance_bit), the V cache bit for bit."""
    qkv, positions, slots, k_cache, v_cache = _case(seed, tokens, heads, kv_heads, head_dim, block_size, dtype,
                                                    index_dtype)
    cos_sin = rope_cos_sin_table(_inv_freq(head_dim), MAX_POS, dtype, "cpu")
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()
    q, k = rope_and_store(qkv, positions, cos_sin, slots, k_cache, v_cache, heads, kv_heads, head_dim,
                          use_triton=True, head_norm=head_norm, **launch)
    q_ref, k_ref = rope_and_store_reference(qkv, positions, cos_sin, slots, k_ref_cache, v_ref_cache, heads,
                                            kv_heads, head_dim, head_norm=head_norm)
    check = assert_within_a_variance_bit if head_norm else lambda got, want: torch.testing.assert_close(
        got, want, rtol=0, atol=0)
    for got, want in ((q, q_ref), (k, k_ref), (k_cache, k_ref_cache)):
        check(got, want)
    assert torch.equal(v_cache, v_ref_cache)
    return q, k


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,index_dtype", [
    (4, 2, 64, 4, torch.int64),
    (8, 1, 128, 16, torch.int32),
    (2, 2, 80, 8, torch.int32),  # head_dim 80: a padded half (40 of 64 lanes)
])
def test_triton_matches_reference_bit_for_bit(dtype, heads, kv_heads, head_dim, block_size, index_dtype):
    q, k = _matches_reference(head_dim + heads, 6, heads, kv_heads, head_dim, block_size, dtype, index_dtype)
    assert q.shape == (6, heads, head_dim) and k.shape == (6, kv_heads, head_dim)
    assert q.is_contiguous() and k.is_contiguous()


@interpreted
@pytest.mark.parametrize("tokens", [255, 256, 300], ids=["a token a program", "16 a program", "a ragged last block"])
def test_prefill_sized_launches_match_reference_bit_for_bit(tokens):
    """At PREFILL_TOKENS tokens and more, a program takes 16 tokens: the last block's tail is masked."""
    _matches_reference(tokens, tokens, 2, 1, 64, 16, torch.bfloat16, torch.int64)


@interpreted
@pytest.mark.parametrize("tokens_per_program", [1, 4, 16])
def test_every_tokens_per_program_setting_gives_the_same_bits(tokens_per_program):
    """bench_kernels.py times a launch shape the size rule would not pick; it must compute the same thing."""
    _matches_reference(7, 37, 2, 1, 64, 16, torch.bfloat16, torch.int32, tokens_per_program=tokens_per_program)


@pytest.mark.parametrize("tokens, block_t, warps", [(1, 1, 1), (255, 1, 1), (256, 16, 4), (300, 16, 4)])
def test_the_launch_takes_a_token_a_program_below_256_and_16_from_there(monkeypatch, tokens, block_t, warps):
    """The shapes the bit-for-bit tests above are named after: decode sizes launch as before (a token and one warp
    a program), prefill sizes 16 tokens a program over 4 warps."""
    from tpgraph.kernels import rope_store

    launches = spy_launches(monkeypatch, rope_store, "_rope_store_kernel", run=False,
                            record=lambda grid, args, kw: (grid, kw["BLOCK_T"], kw["num_warps"]))
    qkv, positions, slots, k_cache, v_cache = _case(0, tokens, 2, 1, 64, 16, torch.bfloat16, torch.int64)
    cos_sin = rope_cos_sin_table(_inv_freq(64), MAX_POS, torch.bfloat16, "cpu")
    rope_and_store(qkv, positions, cos_sin, slots, k_cache, v_cache, 2, 1, 64, use_triton=True)
    assert launches == [((-(-tokens // block_t), 3), block_t, warps)]


def test_tokens_per_program_must_be_a_power_of_two():
    qkv, positions, slots, k_cache, v_cache = _case(0, 4, 2, 1, 64, 16, torch.bfloat16, torch.int64)
    cos_sin = rope_cos_sin_table(_inv_freq(64), MAX_POS, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        rope_and_store(qkv, positions, cos_sin, slots, k_cache, v_cache, 2, 1, 64, use_triton=True,
                       tokens_per_program=3)


@interpreted
def test_strided_positions_and_slots_match_reference_bit_for_bit():
    """positions and slot_mapping as views with non-unit steps (every other element of a wider tensor): read as the
    reference reads them, so no k/v lands in a slot not given."""
    qkv, positions, slots, k_cache, v_cache = _case(3, 5, 2, 1, 64, 4, torch.float32, torch.int64)
    strided_pos = torch.stack([positions, torch.zeros_like(positions)], dim=1)[:, 0]
    strided_slots = torch.stack([slots, torch.zeros_like(slots)], dim=1)[:, 0]
    cos_sin = rope_cos_sin_table(_inv_freq(64), MAX_POS, torch.float32, "cpu")
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()
    q, k = rope_and_store(qkv, strided_pos, cos_sin, strided_slots, k_cache, v_cache, 2, 1, 64, use_triton=True)
    q_ref, k_ref = rope_and_store_reference(qkv, positions, cos_sin, slots, k_ref_cache, v_ref_cache, 2, 1, 64)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(k_cache, k_ref_cache) and torch.equal(v_cache, v_ref_cache)


@interpreted
def test_zero_tokens():
    qkv, positions, slots, k_cache, v_cache = _case(0, 0, 4, 2, 64, 4, torch.bfloat16, torch.int64)
    before = k_cache.clone()
    cos_sin = rope_cos_sin_table(_inv_freq(64), MAX_POS, torch.bfloat16, "cpu")
    q, k = rope_and_store(qkv, positions, cos_sin, slots, k_cache, v_cache, 4, 2, 64, use_triton=True)
    assert q.shape == (0, 4, 64) and k.shape == (0, 2, 64) and torch.equal(k_cache, before)


@pytest.mark.parametrize("rope_parameters", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64, rope_theta=500000.0),
])
def test_reference_is_hf_apply_rotary_pos_emb(rope_parameters):
    """HF's rotary embedding builds cos/sin per position; `rope_cos_sin_table` rows must be those, and the
    reference's rotation HF's `apply_rotary_pos_emb`, bit for bit in bf16."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    heads, kv_heads, head_dim, dtype = 4, 2, 64, torch.bfloat16
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=MAX_POS, rope_parameters=rope_parameters)
    rotary = LlamaRotaryEmbedding(config)
    qkv, positions, slots, k_cache, v_cache = _case(1, 7, heads, kv_heads, head_dim, 4, dtype, torch.int64)
    cos_sin = rope_cos_sin_table(rotary.inv_freq, MAX_POS, dtype, "cpu")
    q, k = rope_and_store_reference(qkv, positions, cos_sin, slots, k_cache, v_cache, heads, kv_heads, head_dim)

    cos, sin = rotary(qkv, positions[None])  # [1, T, D] in bf16
    assert torch.equal(cos[0], torch.cat((cos_sin[0][positions],) * 2, dim=-1))
    assert torch.equal(sin[0], torch.cat((cos_sin[1][positions],) * 2, dim=-1))
    hf_q = qkv[:, :heads * head_dim].reshape(1, 7, heads, head_dim).transpose(1, 2)  # HF layout [1, H, T, D]
    hf_k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(1, 7, kv_heads, head_dim).transpose(1, 2)
    hf_q, hf_k = apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
    assert torch.equal(q, hf_q[0].transpose(0, 1)) and torch.equal(k, hf_k[0].transpose(0, 1))
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(7, kv_heads, head_dim)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots], k)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [
    (6, 4, 2, 64),
    (5, 2, 2, 80),  # a padded half: its empty lanes add nothing to the squares
    (300, 2, 1, 128),  # 16 tokens a program, a ragged last block
])
def test_head_norms_match_the_reference(dtype, tokens, heads, kv_heads, head_dim):
    """Qwen3's q and k norms in the kernel, before the rotation: q, k and the caches as the reference makes them
    (transformers' Qwen3RMSNorm over each head, then the rotation), within the variance's last bit; v untouched by
    them."""
    q, _ = _matches_reference(tokens, tokens, heads, kv_heads, head_dim, 16, dtype, torch.int64,
                              head_norm=random_head_norm(head_dim, dtype, torch.Generator().manual_seed(3)))
    plain, _ = _matches_reference(tokens, tokens, heads, kv_heads, head_dim, 16, dtype, torch.int64)
    assert not torch.equal(q, plain)  # (the norms did something)


def test_the_reference_norms_heads_as_transformers_qwen3():
    """The reference's head norms are transformers' Qwen3RMSNorm over each head, bit for bit in bf16."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    heads, kv_heads, head_dim, dtype, tokens = 4, 2, 64, torch.bfloat16, 7
    qkv, positions, slots, k_cache, v_cache = _case(2, tokens, heads, kv_heads, head_dim, 4, dtype, torch.int64)
    cos_sin = rope_cos_sin_table(_inv_freq(head_dim, 1e6), MAX_POS, dtype, "cpu")
    head_norm = random_head_norm(head_dim, dtype, torch.Generator().manual_seed(3))
    q, k = rope_and_store_reference(qkv, positions, cos_sin, slots, k_cache, v_cache, heads, kv_heads, head_dim,
                                    head_norm=head_norm)
    normed = []
    for weight, start, count in ((head_norm[0], 0, heads), (head_norm[1], heads, kv_heads)):
        hf_norm = Qwen3RMSNorm(head_dim, head_norm[2]).to(dtype)
        hf_norm.weight.data.copy_(weight)
        part = qkv[:, start * head_dim:(start + count) * head_dim].reshape(1, tokens, count, head_dim)
        normed.append(hf_norm(part).transpose(1, 2))
    cos, sin = (torch.cat((t[positions],) * 2, dim=-1)[None] for t in cos_sin)
    hf_q, hf_k = apply_rotary_pos_emb(*normed, cos, sin)
    assert torch.equal(q, hf_q[0].transpose(0, 1)) and torch.equal(k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("use_triton", [False, True])
def test_head_norms_of_the_wrong_shape_or_dtype_are_refused_by_name(use_triton):
    qkv, positions, slots, k_cache, v_cache = _case(1, 3, 4, 2, 64, 4, torch.float32, torch.int64)
    cos_sin = rope_cos_sin_table(_inv_freq(64), MAX_POS, torch.float32, "cpu")
    good = torch.ones(64)
    for q_weight, k_weight, name in ((torch.ones(63), good, "q"), (good, torch.ones(64, dtype=torch.bfloat16), "k"),
                                     (good, torch.ones(128)[::2], "k")):
        with pytest.raises(ValueError, match=f"the {name} head norm's weight must be a contiguous \\[64\\]"):
            rope_and_store(qkv, positions, cos_sin, slots, k_cache, v_cache, 4, 2, 64, use_triton=use_triton,
                           head_norm=(q_weight, k_weight, 1e-6))


@pytest.mark.parametrize("use_triton", [False, True])
def test_a_head_norm_refused_for_its_layout_or_device_says_so(use_triton):
    """A strided weight of the right shape and dtype, or one on another device than qkv: the message names that
    (not a shape and dtype that match what it asks for, nor a copy's error from inside the launch)."""
    qkv, positions, slots, k_cache, v_cache = _case(1, 3, 4, 2, 64, 4, torch.float32, torch.int64)
    cos_sin = rope_cos_sin_table(_inv_freq(64), MAX_POS, torch.float32, "cpu")
    good = torch.ones(64)
    for k_weight, said in ((torch.ones(128)[::2], "got a non-contiguous \\(64,\\)"),
                           (torch.ones(64, device="meta"), "got a \\(64,\\) tensor of torch.float32 on meta")):
        with pytest.raises(ValueError, match=f"the k head norm's weight must be .* on cpu; {said}"):
            rope_and_store(qkv, positions, cos_sin, slots, k_cache, v_cache, 4, 2, 64, use_triton=use_triton,
                           head_norm=(good, k_weight, 1e-6))


def test_a_new_prompt_length_compiles_no_new_kernel():
    """Eager prefill (above the piecewise graphs' sizes) launches at any token count; the count must not key the
    compiled kernel, or a first prompt of an unseen length class (300 after 512) compiles in its time to first token.
    """
    from tpgtest.ptx import launch_specializations

    typed = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64",
             "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "q_out_ptr": "*bf16", "k_out_ptr": "*bf16",
             "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps": "fp32", "mean_scale": "fp32"}
    strides = dict(stride_qkv=6144, stride_cos=64, stride_sin=64, stride_cb=16384, stride_ct=1024, stride_ch=128,
                   stride_qo=4096, stride_ko=1024)
    constexprs = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "HALF_PAD": 64,
                  "DIM_PAD": 128, "BLOCK_T": 16, "SOFT_BF16": False, "PDL": False, "HEAD_NORM": False,
                  "MEAN_BY_DIV": False}
    keys = launch_specializations("tpgraph.kernels.rope_store", "_rope_store_kernel", typed, constexprs,
                                  [{"num_tokens": n, **strides} for n in (512, 300, 301, 8192)])
    assert len(set(keys)) == 1, keys
