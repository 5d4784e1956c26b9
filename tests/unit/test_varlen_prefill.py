"""Varlen prefill attention on CPU: the layout (offsets, cache slots, reuse), the keywords for each torch's
varlen_attn, and varlen_prefill against the per-sequence SDPA loop, with a CPU stand-in for FlashAttention's varlen
call (causal masks aligned to each sequence's end, GQA)."""

import pytest
import torch
import torch.nn.functional as F
from tpgtest.prefill_cases import BLOCK, prefill_case

import tpgraph.model.varlen_prefill as vp
from tpgraph.model.attention import sdpa_prefill

varlen = pytest.importorskip("torch.nn.attention.varlen")


def flash_varlen_standin(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, scale=None,
                         return_aux=None):
    """What FlashAttention's varlen forward computes: per sequence, query j of n attends to keys [0, s - n + j]."""
    assert window_size == (-1, 0), "the engine asks for causal attention"
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        n, s = len(qs), len(ks)
        mask = torch.arange(s)[None, :] <= s - n + torch.arange(n)[:, None]
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)), attn_mask=mask,
                                           scale=scale, enable_gqa=enable_gqa)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_attn", flash_varlen_standin)
    vp._keywords.cache_clear()
    yield
    vp._keywords.cache_clear()


@pytest.mark.parametrize("lens, contexts, heads, padded", [
    ((37, 20, 5), (0, 45, 3), (8, 2), 6),  # a fresh prompt, a continued chunk, a short one; padding rows
    ((9,), (0,), (4, 4), 0),  # no prefix anywhere: k/v used as they are; no GQA
    ((1, 16, 3), (7, 0, 64), (6, 1), 2),  # one-token chunk, a block-aligned prompt, a long prefix; MQA
    ((12, 12), (0, 0), (8, 2), 4),
])
def test_varlen_prefill_matches_the_sdpa_loop(standin, lens, contexts, heads, padded):
    q, k, v, cache, meta = prefill_case(lens, contexts, heads, padded=padded)
    want = sdpa_prefill(q, k, v, cache, meta, 0.3)
    got = vp.varlen_prefill(q, k, v, cache, meta, 0.3)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not got[sum(lens):].any(), "padding rows stay zero"


def test_padding_only_forward_gives_zeros(standin):
    q, k, v, cache, meta = prefill_case((3,), (0,), padded=5)
    meta.query_lens = ()  # what piecewise capture runs: padding rows only
    got = vp.varlen_prefill(q, k, v, cache, meta, 0.3)
    assert got.shape == q.shape and not got.any()
    torch.testing.assert_close(got, sdpa_prefill(q, k, v, cache, meta, 0.3))


def test_layout_offsets_slots_and_reuse():
    _, _, _, cache, meta = prefill_case((3, 2), (0, 5))
    layout = vp.layout_for(meta, BLOCK, torch.device("cpu"))
    (call,) = layout.calls
    assert call.cu_q.tolist() == [0, 3, 5] and call.cu_k.tolist() == [0, 3, 10]
    assert (layout.total, call.start, call.end, call.max_q, call.max_k) == (5, 0, 5, 3, 7)
    tables = meta.context_blocks
    want = [tables[0][p // BLOCK] * BLOCK + p % BLOCK for p in range(3)]
    want += [tables[1][p // BLOCK] * BLOCK + p % BLOCK for p in range(7)]
    assert call.k_slots.tolist() == want
    assert vp.layout_for(meta, BLOCK, torch.device("cpu")) is layout, "the next layer of the same forward reuses it"
    meta.query_lens, meta.context_lens = (3, 1), (0, 6)  # the next forward through the same (piecewise) metadata
    again = vp.layout_for(meta, BLOCK, torch.device("cpu"))
    assert again is not layout and again.calls[0].cu_k.tolist() == [0, 3, 10]


def test_gathers_are_split_into_calls_of_bounded_keys(standin, monkeypatch):
    """Keys gathered from the cache are a transient copy: at most GATHER_MAX_TOKENS a call (a longer sequence alone),
    and the answer is the same."""
    monkeypatch.setattr(vp, "GATHER_MAX_TOKENS", 60)
    lens, contexts = (37, 20, 5, 9), (0, 45, 3, 70)  # spans 37, 65, 8, 79
    q, k, v, cache, meta = prefill_case(lens, contexts, padded=3)
    calls = vp.layout_for(meta, BLOCK, torch.device("cpu")).calls
    assert [(c.start, c.end) for c in calls] == [(0, 37), (37, 57), (57, 62), (62, 71)]  # 37 | 65 | 8 | 79
    torch.testing.assert_close(vp.varlen_prefill(q, k, v, cache, meta, 0.3), sdpa_prefill(q, k, v, cache, meta, 0.3),
                               atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(vp, "GATHER_MAX_TOKENS", 120)
    meta.query_lens = tuple(meta.query_lens)  # (a new forward: the layout is built again)
    meta.varlen_layout = None
    assert [(c.start, c.end) for c in vp.layout_for(meta, BLOCK, torch.device("cpu")).calls] == [(0, 62), (62, 71)]


@pytest.mark.parametrize("signature, gqa, scale, want", [
    ("window_size=(-1, -1), enable_gqa=False, scale=None", True, 0.25, {"window_size": (-1, 0), "enable_gqa": True,
                                                                         "scale": 0.25}),
    ("window_size=(-1, -1), scale=None", True, 0.25, {"window_size": (-1, 0), "scale": 0.25}),
    ("is_causal=False", False, 0.25, {"is_causal": True}),  # no scale keyword: the default 1/sqrt(16) is ours
    ("is_causal=False", False, 0.3, None),  # ... and another scale cannot be asked for
    ("scale=None", False, 0.25, None),  # no way to ask for causal attention
])
def test_keywords_follow_the_installed_signature(monkeypatch, signature, gqa, scale, want):
    namespace: dict = {}
    exec(f"def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, {signature}): pass", namespace)
    monkeypatch.setattr(varlen, "varlen_attn", namespace["varlen_attn"])
    vp._keywords.cache_clear()
    try:
        assert vp._keywords(gqa, scale, 16) == want
    finally:
        vp._keywords.cache_clear()


def test_cpu_and_the_switch_keep_the_sdpa_loop(monkeypatch):
    fn, name = vp.prefill_attention(sdpa_prefill, torch.device("cpu"), torch.bfloat16, 8, 2, 64)
    assert fn is sdpa_prefill and "CUDA only" in name
    fn, name = vp.prefill_attention(sdpa_prefill, torch.device("cuda"), torch.float32, 8, 2, 64)
    assert fn is sdpa_prefill and "float32" in name
    monkeypatch.setenv("TPGRAPH_VARLEN_PREFILL", "0")
    fn, name = vp.prefill_attention(sdpa_prefill, torch.device("cuda"), torch.bfloat16, 8, 2, 64)
    assert fn is sdpa_prefill and "TPGRAPH_VARLEN_PREFILL=0" in name
