"""The Triton decode kernels compiled for the GPU, against their torch references, and captured in a graph."""

from collections.abc import Callable

import pytest
import torch
from tpgtest.head_norms import assert_within_a_variance_bit, random_head_norm
from tpgtest.paged_cases import random_paged_case
from tpgtest.polled import spy_partials

from tpgraph.kernels.activation import silu_and_mul, silu_and_mul_reference
from tpgraph.kernels.decode_attention import paged_decode_attention_v2
from tpgraph.kernels.norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from tpgraph.kernels.paged_decode import paged_decode_reference
from tpgraph.kernels.rope_store import rope_and_store, rope_and_store_reference, rope_cos_sin_table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (13, 2048), (200, 4096), (3, 96)])
def test_norms_match_reference(dtype, rows, hidden):
    """The residual add is exact; the norm sums its squares in another order than torch's CUDA reduction (whose own
    order depends on the row count), so it may differ by one rounding step."""
    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    x, res = (torch.randn(rows, hidden, device="cuda", generator=g).to(dtype) * 3 for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    rtol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # one ulp
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), rtol=rtol, atol=0)
    normed, residual = add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_residual = add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(residual, ref_residual)
    torch.testing.assert_close(normed, ref_normed, rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_gpu(dtype):
    x = torch.randn(37, 2 * 7168, device="cuda").to(dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=0, rtol=1e-2 if dtype != torch.float32
                               else 1e-6)


@pytest.mark.parametrize("normed", [False, True], ids=["", "qwen3 head norms"])
@pytest.mark.parametrize("tokens", [29, 1001], ids=["a token a program", "token blocks"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store_equal_reference_bit_for_bit(dtype, tokens, normed):
    """The kernel against the torch reference: bit for bit, or with Qwen3's head norms (given to both) within the
    variance's last bit."""
    heads, kv_heads, dim, block_size = 16, 4, 128, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda").to(dtype)
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    tables = rope_cos_sin_table(1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim)), 4096, dtype, "cuda")
    slots = torch.randperm(64 * block_size, device="cuda")[:tokens]
    caches = [torch.zeros(64, block_size, kv_heads, dim, dtype=dtype, device="cuda") for _ in range(4)]
    head_norm = random_head_norm(dim, dtype, device="cuda") if normed else None
    q, k = rope_and_store(qkv, positions, tables, slots, caches[0], caches[1], heads, kv_heads, dim,
                          head_norm=head_norm)
    rq, rk = rope_and_store_reference(qkv, positions, tables, slots, caches[2], caches[3], heads, kv_heads, dim,
                                      head_norm=head_norm)
    check = assert_within_a_variance_bit if normed else lambda got, want: torch.testing.assert_close(
        got, want, rtol=0, atol=0)
    for got, want in ((q, rq), (k, rk), (caches[0], caches[2])):
        check(got, want)
    assert torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("newest_apart", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(12))
def test_split_kv_decode_matches_reference(seed, dtype, newest_apart):
    """(newest_apart: TPGRAPH_ATTN_NEWEST_APART's kernel, the newest row as its own term)"""
    q, k, v, bt, lens, scale = random_paged_case(seed, "cuda", dtype, max_batch=16, max_len=600)
    out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=600, newest_apart=newest_apart)
    ref = paged_decode_reference(q, k, v, bt, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_split_kv_decode_replays_in_a_graph():
    q, k, v, bt, lens, scale = random_paged_case(3, "cuda", torch.bfloat16, max_batch=8, max_len=2000)
    eager = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=2000)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=2000)  # compile outside capture
        with torch.cuda.graph(graph, stream=side):
            out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=2000)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    assert torch.equal(out, eager)
    lens.copy_(torch.clamp(lens - 7, min=0))  # new lengths written in place: the replay sees them
    graph.replay()
    torch.testing.assert_close(out.float(), paged_decode_reference(q, k, v, bt, lens, scale).float(), atol=1e-2,
                               rtol=1e-2)


def test_add_rms_norm_as_programmatic_dependent_equals_plain_launch(monkeypatch):
    """TPGRAPH_TRITON_PDL=1: the norm launches early and waits in-kernel for the kernel before it; eagerly and inside
    a graph (where the wait becomes a programmatic edge) it gives the plain launch's bits."""
    from tpgraph.kernels._pdl import triton_has_pdl, use_pdl

    if torch.cuda.get_device_capability()[0] < 9 or not triton_has_pdl():
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton with launch_pdl")
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(8, 4096, device="cuda", generator=g).bfloat16() for _ in range(2))
    m = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16() * 0.02
    w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=g)).bfloat16()
    monkeypatch.setenv("TPGRAPH_TRITON_PDL", "0")
    plain = add_rms_norm(a @ m, b, w, 1e-5)
    monkeypatch.setenv("TPGRAPH_TRITON_PDL", "1")
    assert use_pdl(a)
    eager = add_rms_norm(a @ m, b, w, 1e-5)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        add_rms_norm(a @ m, b, w, 1e-5)  # compile outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = add_rms_norm(a @ m, b, w, 1e-5)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for got in (eager, captured):
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


@pytest.mark.parametrize("m", list(range(1, 17)))
@pytest.mark.parametrize(("n", "k"), [(3072, 4096), (32003, 4096), (4096, 4100), (257, 2048)])
def test_small_m_projection_matches_matmul(m, n, k):
    from tpgraph.kernels.gemv import linear_small_m

    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    got = linear_small_m(x, w).float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-2
    x32, w32 = x.float(), w.float()
    torch.testing.assert_close(linear_small_m(x32, w32), x32 @ w32.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [17, 24, 32])
def test_wide_rows_match_matmul(monkeypatch, m):
    """TPGRAPH_GEMV_MAX_M=32: 17-32 rows in 32-row tiles (the shipped tiles, split-K reduced by the last split),
    within bf16 rounding of matmul (gate_up's epilogue at 24 rows: the gate_up test below)."""
    from tpgraph.kernels.gemv import linear_small_m

    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32")
    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in [(3072, 4096), (4096, 7168), (32003, 4096)]:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        ref = x.float() @ w.float().T
        got = linear_small_m(x, w)
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        assert torch.equal(linear_small_m(x, w), got)


@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize(("n", "k"), [(4096, 2048), (257, 4100)])
def test_small_m_split_k_is_repeatable_and_capturable(m, n, k, split_k):
    """Split-K adds its fp32 partials in a fixed order: the same bits every call, eager or replayed in a graph."""
    from tpgraph.kernels.gemv import GemvConfig, linear_small_m

    g = torch.Generator(device="cuda").manual_seed(m * n + k + split_k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    cfg = GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=3, split_k=split_k)
    eager = linear_small_m(x, w, config=cfg)
    ref = x.float() @ w.float().T
    assert ((eager.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert torch.equal(linear_small_m(x, w, config=cfg), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the fp32 workspace comes from the graph's pool
        captured = linear_small_m(x, w, config=cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize(("m", "dtype"), [(m, dtype) for m in (1, 3, 8, 16) for dtype in (torch.bfloat16,
                                                                                           torch.float32)]
                         + [(24, torch.bfloat16), (32, torch.bfloat16)])  # TPGRAPH_GEMV_MAX_M=32's 32-row tiles
@pytest.mark.parametrize(("inter", "k"), [(7168, 4096), (2050, 4100)])
def test_small_m_gate_up_epilogue_gives_the_two_kernels_bits(monkeypatch, m, inter, k, dtype):
    """The gate_up projection making silu(gate) * up in its epilogue: the bits of the projection (the shipped tiles)
    then silu_and_mul, on random-normal inputs, eager and replayed in a graph."""
    from tpgraph.kernels.activation import silu_and_mul
    from tpgraph.kernels.gemv import gate_up_silu, linear_small_m

    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32" if m > 16 else "16")

    g = torch.Generator(device="cuda").manual_seed(m * inter + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(2 * inter, k, device="cuda", generator=g) * 0.05).to(dtype)
    two = silu_and_mul(linear_small_m(x, w))
    fused = gate_up_silu(x, w)
    assert fused is not None and torch.equal(fused, two)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gate_up_silu(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, two)


def assert_pdl_launch_gives(plain: torch.Tensor, step: Callable[[], torch.Tensor], monkeypatch) -> None:
    """With TPGRAPH_TRITON_PDL=1, step() gives `plain`'s bits eagerly and replayed in a graph."""
    monkeypatch.setenv("TPGRAPH_TRITON_PDL", "1")
    assert torch.equal(step(), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, plain)


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize(("n", "k"), [(4096, 2048), (3072, 4096), (14336, 4096)])
def test_small_m_with_pdl_and_prefetch_gives_the_same_bits(monkeypatch, n, k, gate_up):
    """Launched as a programmatic dependent of the kernel that writes x (weights prefetched into L2 before the
    wait): the bits of the plain launch, eager and in a graph, where the dependency is real."""
    from tpgraph.kernels._pdl import triton_has_pdl
    from tpgraph.kernels.gemv import gate_up_silu, linear_small_m

    if not triton_has_pdl():
        pytest.skip("this Triton has no launch_pdl / gdc_wait")
    g = torch.Generator(device="cuda").manual_seed(n + k)
    src = torch.randn(4, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    project = gate_up_silu if gate_up else linear_small_m
    if gate_up and project(src, w) is None:
        pytest.skip(f"the shipped tiles split K for {n}x{k}: no epilogue")

    def step() -> torch.Tensor:
        return project(src * 2, w)  # x is written by the kernel just before

    plain = step()
    assert_pdl_launch_gives(plain, step, monkeypatch)


@pytest.mark.parametrize(("block_n", "warps"), [(32, 16), (16, 8)])
@pytest.mark.parametrize(("n", "k"), [(4096, 2048), (257, 2000)])
def test_resident_weights_with_pdl_match_matmul_and_the_plain_launch(monkeypatch, block_n, warps, n, k):
    """Resident tiles (the weights loaded whole before the PDL wait): within bf16 rounding of matmul, and as a
    programmatic dependent, eager and replayed in a graph, the plain launch's bits. (The kernel before here is torch's,
    which never lets its dependent in early, so this cannot catch x read before the wait: the sm_90 PTX test in
    tests/unit guards that order.) The gate_up epilogue on resident tiles gives the two kernels' bits."""
    from tpgraph.kernels._pdl import triton_has_pdl
    from tpgraph.kernels.activation import silu_and_mul
    from tpgraph.kernels.gemv import GemvConfig, gate_up_silu, linear_small_m, resident

    if not triton_has_pdl():
        pytest.skip("this Triton has no launch_pdl / gdc_wait")
    cfg = GemvConfig(block_n=block_n, block_k=2048, num_warps=warps, num_stages=1, resident=True)
    assert resident(cfg, k)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    src = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)  # resident tiles take one row
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)

    def step() -> torch.Tensor:
        return linear_small_m(src * 2, w, config=cfg)  # x is written by the kernel just before

    monkeypatch.setenv("TPGRAPH_TRITON_PDL", "0")
    plain = step()
    ref = (src * 2).float() @ w.float().T
    assert ((plain.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert_pdl_launch_gives(plain, step, monkeypatch)
    if n % 2 == 0:  # w as cat(gate, up)
        fused = gate_up_silu(src * 2, w, config=cfg)
        assert fused is not None and torch.equal(fused, silu_and_mul(linear_small_m(src * 2, w, config=cfg)))


def test_resident_tiles_are_for_16_bit_weights_only(monkeypatch):
    """The shipped sm90 table's o_proj at one row is resident for bf16; fp32 takes the default tiles (a resident fp32
    slice spills)."""
    from tpgraph.kernels.gemv import config_for, resident, tiles

    monkeypatch.delenv("TPGRAPH_GEMV_TABLE", raising=False)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the shipped resident entry is sm90's")
    x16 = torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16)
    assert resident(config_for(x16, 4096, 2048, 1), 2048) and resident(config_for(x16, 4096, 2048, 1, True), 2048)
    assert config_for(x16.float(), 4096, 2048, 1) == tiles(4096, 2048, 1)


@pytest.mark.parametrize("polled", ["0", "1"])
@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize(("n", "k"), [(3072, 4096), (257, 4100)])
def test_small_m_last_split_reduces_to_the_sum_kernels_bits(monkeypatch, n, k, split_k, polled):
    """Split-K with the last split adding the partials (no second kernel), found by the count or by polling the
    partials (the default): the sum kernel's bits, every call and every graph replay (the counters go back to zero
    and the partials' slots to the sentinel each time)."""
    from tpgraph.kernels._counters import PARTIAL_SENTINEL, partials_buffer, split_counters
    from tpgraph.kernels.gemv import GemvConfig, linear_small_m

    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", polled)

    g = torch.Generator(device="cuda").manual_seed(n + k + split_k)
    x = torch.randn(8, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    cfg = GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=split_k)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")  # the sum kernel first
    two_kernels = linear_small_m(x, w, config=cfg)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    for _ in range(3):
        assert torch.equal(linear_small_m(x, w, config=cfg), two_kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear_small_m(x, w, config=cfg)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, two_kernels)
    assert not split_counters(x.device, 1).any()
    assert (partials_buffer(x.device, 1).view(torch.int32) == PARTIAL_SENTINEL).all()


@pytest.mark.parametrize("polled", ["0", "1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_split_kv_decode_with_the_last_split_combining(monkeypatch, seed, dtype, polled):
    """TPGRAPH_LAST_SPLIT_REDUCES=1 (no combine kernel), the last split found by the count or polling
    (TPGRAPH_POLLED_ATTENTION): the reference within tolerance, the same bits every call and every graph replay
    (with new queries before each, so a stale partial would show), and the counters back at zero and the partials'
    slots at the sentinel."""
    from tpgraph.kernels._counters import PARTIAL_SENTINEL, partials_buffer, split_counters

    q, k, v, bt, lens, scale = random_paged_case(seed, "cuda", dtype, max_batch=16, max_len=2000)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    monkeypatch.setenv("TPGRAPH_POLLED_ATTENTION", polled)
    partials_buffer(q.device, 1)  # (made before the capture, as the runner makes it)
    taken = spy_partials(monkeypatch, "decode_attention")  # its polled launches (equal bits alone would not show them)
    eager = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=2000, num_splits=8)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(eager.float(), paged_decode_reference(q, k, v, bt, lens, scale).float(), atol=tol,
                               rtol=tol)
    assert torch.equal(paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=2000, num_splits=8), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=2000, num_splits=8)
    for turn in range(4):
        q.copy_(torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(turn)))
        graph.replay()
        want = paged_decode_attention_v2(q, k, v, bt, lens, scale, max_seq_len=2000, num_splits=8)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert not split_counters(q.device, 16 * k.shape[2]).any()
    assert (partials_buffer(q.device, 1).view(torch.int32) == PARTIAL_SENTINEL).all()
    assert bool(taken) == (polled == "1")


QKV_ROPE_CASES = [(m, dtype, "") for m in (1, 5, 16) for dtype in DTYPES] + [
    (24, torch.bfloat16, ""), (24, torch.float16, ""), (32, torch.bfloat16, ""),  # 16-bit only
    (1, torch.bfloat16, "bias"), (5, torch.float32, "bias"), (24, torch.float16, "bias"),  # Qwen2's q, k, v biases
    (1, torch.bfloat16, "head norms"), (5, torch.float16, "head norms"), (16, torch.float32, "head norms"),  # Qwen3's
    (24, torch.bfloat16, "head norms")]


@pytest.mark.parametrize("paired", ["0", "1"])
@pytest.mark.parametrize("polled", ["0", "1"])
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize(("m", "dtype", "extra"), QKV_ROPE_CASES)
def test_qkv_rope_store_gives_the_two_steps_bits(monkeypatch, m, dtype, extra, early, polled, paired):
    """The qkv projection and rope_store in one launch (the shipped tiles: split-K over column blocks of 32), its
    splits reduced by head or, paired (TPGRAPH_QKV_PAIRED), by column block, found by the count or by polling
    (TPGRAPH_POLLED_ROPE; paired, TPGRAPH_POLLED_PARTIALS): q and both caches bit for bit the two steps, eager and
    replayed in a graph with new rows before each replay (a reducer that read a stale partial would show), and every
    partial slot back at the sentinel. early: the rotation inputs read before the PDL wait (inputs_early; positions
    and slots are written before x here, as the model's are). extra: a bias, or Qwen3's head norms (paired tiles
    declined: a head's reducer norms it), given to both; with the norms, q and k within the variance's last bit
    (assert_within_a_variance_bit), v bit for bit."""
    from tpgraph.kernels._counters import PARTIAL_SENTINEL, partials_buffer
    from tpgraph.kernels.gemv import linear_small_m, qkv_rope_store

    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", polled)
    monkeypatch.setenv("TPGRAPH_QKV_PAIRED", paired)
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", polled if paired == "1" else "1")
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32" if m > 16 else "16")  # 24 rows: the 32-row tiles
    heads, kv_heads, dim, hidden, block_size = 16, 4, 128, 4096, 16
    g = torch.Generator(device="cuda").manual_seed(m)
    tables = rope_cos_sin_table(1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim)), 4096, dtype, "cuda")
    positions = torch.randint(0, 4000, (m,), device="cuda")
    slots = torch.randperm(64 * block_size, device="cuda")[:m]
    caches = [torch.zeros(64, block_size, kv_heads, dim, dtype=dtype, device="cuda") for _ in range(4)]
    x = torch.randn(m, hidden, device="cuda", generator=g).to(dtype)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, device="cuda", generator=g) * 0.02).to(dtype)
    bias = torch.randn(w.shape[0], device="cuda", generator=g).to(dtype) if extra == "bias" else None
    head_norm = random_head_norm(dim, dtype, g, "cuda") if extra == "head norms" else None
    check = assert_within_a_variance_bit if head_norm else lambda got, want: torch.testing.assert_close(
        got, want, rtol=0, atol=0)

    def fused() -> torch.Tensor | None:
        return qkv_rope_store(x, w, positions, tables, slots, caches[0], caches[1], heads, kv_heads, dim,
                              inputs_early=early, bias=bias, head_norm=head_norm)

    def assert_two_steps(q: torch.Tensor) -> None:
        rq, _ = rope_and_store(linear_small_m(x, w, bias=bias), positions, tables, slots, caches[2], caches[3], heads,
                               kv_heads, dim, head_norm=head_norm)
        torch.cuda.synchronize()
        check(q, rq)
        check(caches[0], caches[2])
        assert torch.equal(caches[1], caches[3]) and caches[1].any()

    q = fused()
    assert q is not None
    assert_two_steps(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused()
    for _ in range(3):
        x.copy_(torch.randn(m, hidden, device="cuda", generator=g).to(dtype))
        for cache in caches:
            cache.zero_()
        graph.replay()
        assert_two_steps(captured)
    assert (partials_buffer(x.device, 1).view(torch.int32) == PARTIAL_SENTINEL).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vocab_shard_embedding_copies_the_torch_sequence_bit_for_bit(dtype):
    from tpgraph.kernels.embedding import vocab_shard_embedding, vocab_shard_embedding_reference

    weight = torch.randn(64128, 4096, device="cuda").to(dtype)
    ids = torch.randint(0, 128256, (37,), device="cuda")
    for start in (0, 64128):
        out = vocab_shard_embedding(ids, weight, start)
        assert torch.equal(out, vocab_shard_embedding_reference(ids, weight, start))


@pytest.mark.parametrize(("l2_prefetch", "kv_ahead", "newest_apart"), [
    ("0", None, None), ("1", None, None), ("0", None, "0"), ("0", "0", None), ("0", "2", "1"), ("0", "2", "0"),
    ("1", "2", "1")])
@pytest.mark.parametrize("max_seq_len", [600, 8192])
def test_decode_attention_sees_the_newest_row_the_kernel_before_writes(monkeypatch, max_seq_len, l2_prefetch,
                                                                       kv_ahead, newest_apart):
    """As in a layer: rope + cache store writes q and the newest token's K/V, and attention runs right after it (a
    programmatic dependent, whose programs load older K/V rows before their wait, and with TPGRAPH_ATTN_L2_PREFETCH=1
    ask L2 for their later tiles, the newest row's line among them, before the store has written it). Every step's
    output must be the reference's over the cache as the store left it, at a grid sized for ~600 tokens and for
    8192; and with the tile loop's read-ahead as chosen (the next tile's places, at 3 stages: pipelined), with the
    newest row apart (as from batch 2) and merged (as at batch 1), none, and the next tile's K/V in registers with the
    newest row apart (the second tile's older rows loaded before the wait) and merged, with and without the L2
    prefetch."""
    for name, value in (("TPGRAPH_ATTN_L2_PREFETCH", l2_prefetch), ("TPGRAPH_ATTN_KV_AHEAD", kv_ahead),
                        ("TPGRAPH_ATTN_NEWEST_APART", newest_apart)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    heads, kv_heads, dim, block_size, batch = 16, 4, 128, 16, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = batch * 38 + 1  # 38 blocks of 16 hold each sequence's (at most 596) tokens
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks - 1, device="cuda", generator=g)[:batch * 38].view(batch, 38).to(torch.int32) + 1
    cos_sin = rope_cos_sin_table(1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim)), 1024, torch.bfloat16,
                                 "cuda")
    lens = torch.tensor([1, 64, 65, 300, 511, 512, 577, 590], dtype=torch.int32, device="cuda")
    for step in range(6):
        lens += 1  # one new token per sequence a step, its K/V written by the store kernel just before attention
        positions = (lens - 1).long()
        slots = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long() * block_size \
            + positions % block_size
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, device="cuda", generator=g).to(torch.bfloat16)
        q, _ = rope_and_store(qkv, positions, cos_sin, slots, k_cache, v_cache, heads, kv_heads, dim)
        out = paged_decode_attention_v2(q.view(batch, heads, dim), k_cache, v_cache, tables, lens, dim ** -0.5,
                                        max_seq_len=max_seq_len)
        ref = paged_decode_reference(q.view(batch, heads, dim), k_cache, v_cache, tables, lens, dim ** -0.5)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2, msg=f"step {step}")


def _rank_case(batch: int, max_len: int, seed: int):
    """Decode attention at Llama-3-8B's TP=2 rank shape (16 query heads, 4 KV heads of 128, bf16, 16-token blocks):
    `batch` sequences of 1..max_len tokens, the first max_len long (the most tiles a split), shuffled blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-max_len // 16)
    q = torch.randn(batch, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(batch * per_seq, 16, 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    tables = torch.randperm(batch * per_seq, device="cuda", generator=g).to(torch.int32).view(batch, per_seq)
    lens = torch.randint(1, max_len + 1, (batch,), device="cuda", generator=g, dtype=torch.int32)
    lens[0] = max_len
    return q, k, v, tables, lens, 128 ** -0.5


@pytest.mark.parametrize(("batch", "max_len", "num_splits"), [(1, 4096, None), (8, 600, None), (32, 600, None),
                                                              (3, 2000, 2)])
def test_the_l2_prefetch_changes_no_bit(batch, max_len, num_splits):
    """The L2 prefetch (every tile count, the budget rule's among them) only moves lines into L2: eager and in a
    graph, the output is the bits of the launch without it, from one-tile splits to long ones; at the model's rank
    shape and at random layouts (head dims 64 and 80 among them)."""
    cases = [_rank_case(batch, max_len, batch)]
    cases.append(random_paged_case(batch, "cuda", torch.bfloat16, max_batch=batch, max_len=max_len))
    cases[1][4][0] = max_len  # at least one sequence as long as the grid allows
    for q, k, v, bt, lens, scale in cases:
        run = dict(max_seq_len=max_len, num_splits=num_splits)
        plain = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run, l2_prefetch=0)
        for tiles in (1, 2, 4, 8):
            assert torch.equal(paged_decode_attention_v2(q, k, v, bt, lens, scale, **run, l2_prefetch=tiles), plain)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_decode_attention_v2(q, k, v, bt, lens, scale, **run, l2_prefetch=8)
        graph.replay()
        assert torch.equal(out, plain)


@pytest.mark.parametrize(("batch", "seq_len"), [(1, 513), (4, 513), (1, 4097), (8, 4097), (32, 4097)])
def test_polled_attention_between_polled_projections_in_a_graph(monkeypatch, batch, seq_len):
    """Decode attention as the model runs it (TPGRAPH_POLLED_ATTENTION=1): a TP=2 rank's Llama-3-8B heads (16 query
    heads, 4 KV heads, 128 dims), the grid sized for 8192 tokens (64 splits at batch 1, several merge chunks), between
    two split-K projections that poll the same sentinel buffer, each a programmatic dependent of the one before, in
    one graph replayed with new inputs: the count's bits every replay, and every slot back at the sentinel. (It did
    not catch the batch-32 hang of 2026-12-03_h200_polled_attention_fix, which took whole steps of 32 layers: a
    check of the kernel's logic at the model's grid, not a stress test.)"""
    from tpgraph.kernels._counters import PARTIAL_SENTINEL, partials_buffer
    from tpgraph.kernels.gemv import GemvConfig, linear_small_m

    heads, kv_heads, dim, block_size, hidden = 16, 4, 128, 16, 4096
    g = torch.Generator(device="cuda").manual_seed(batch + seq_len)
    blocks = batch * -(-8192 // block_size)
    k, v = (torch.randn(blocks, block_size, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))
    tables = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    x = torch.randn(batch, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w_q = (torch.randn(heads * dim, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w_o = (torch.randn(hidden, heads * dim, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    split = GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=4)

    def layer() -> torch.Tensor:
        q = linear_small_m(x, w_q, config=split).view(batch, heads, dim)
        out = paged_decode_attention_v2(q, k, v, tables, lens, dim ** -0.5, max_seq_len=8192)
        return linear_small_m(out.view(batch, heads * dim), w_o, config=split)

    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "1")
    partials_buffer(x.device, 1)
    counted = layer()
    monkeypatch.setenv("TPGRAPH_POLLED_ATTENTION", "1")
    taken = spy_partials(monkeypatch, "decode_attention")  # attention's polled launches (bits alone do not show them)
    assert torch.equal(layer(), counted) and taken
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    for turn in range(4):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(x.dtype))
        graph.replay()
        monkeypatch.setenv("TPGRAPH_POLLED_ATTENTION", "0")
        want = layer()
        monkeypatch.setenv("TPGRAPH_POLLED_ATTENTION", "1")
        torch.cuda.synchronize()
        assert torch.equal(captured, want), f"replay {turn}"
    assert (partials_buffer(x.device, 1).view(torch.int32) == PARTIAL_SENTINEL).all()
