"""The ring GEMV (csrc/gemv_ring.cu) on a GPU of sm_90 or later: exact on integer-valued inputs at the shapes a
TP=2 Llama-3-8B rank and odd loaders give, within bf16 rounding on random ones, and right inside a graph whose
kernels hand x from one to the next (its weights are read before the PDL wait, x only after)."""

import pytest
import torch
import torch.nn.functional as F

from tpgraph.kernels.gemv_ring import RingConfig, gemv_ring

pytestmark = pytest.mark.gpu

CONFIGS = [RingConfig(), RingConfig(threads=128, chunk_bytes=8 << 10, ring_bytes=16 << 10),
           RingConfig(threads=512, chunk_bytes=32 << 10, ring_bytes=192 << 10), RingConfig(per_sm=2),
           RingConfig(pdl=False), RingConfig(per_thread_copies=True),
           RingConfig(threads=512, chunk_bytes=8 << 10, ring_bytes=16 << 10, per_thread_copies=True),
           RingConfig(per_sm=2, ring_bytes=48 << 10, per_thread_copies=True),
           RingConfig(per_sm=4, ring_bytes=32 << 10, threads=128, per_thread_copies=True, late_let_in=True)]
SHAPES = [(4096, 2048), (3072, 4096), (4096, 7168), (14336, 4096), (4100, 4096), (32003, 4096), (13, 2056)]


@pytest.fixture(autouse=True)
def _sm90():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk copies need sm_90+")


def _ints(*shape: int) -> torch.Tensor:
    return torch.randint(-4, 5, shape, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.label)
@pytest.mark.parametrize("n,k", SHAPES)
def test_exact_on_integers(n, k, config):
    torch.manual_seed(n + k)
    x, w = _ints(1, k), _ints(n, k)
    want = (x.float() @ w.float().T).to(torch.bfloat16)  # every sum exact in fp32, rounded once
    torch.testing.assert_close(gemv_ring(x, w, config), want, rtol=0, atol=0)


@pytest.mark.parametrize("n,k", SHAPES[:4])
def test_random_within_bf16_rounding(n, k):
    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(gemv_ring(x, w), F.linear(x, w), rtol=1e-2, atol=1e-2)


def test_out_is_written_in_place_and_nothing_beyond_it():
    x, w = _ints(1, 2048), _ints(4096, 2048)
    buf = torch.full((2, 4096), 7.0, dtype=torch.bfloat16, device="cuda")
    gemv_ring(x, w, out=buf[:1])
    assert torch.equal(buf[0], (x.float() @ w.float().T).to(torch.bfloat16)[0])
    assert torch.all(buf[1] == 7.0)


def test_a_graph_chain_reads_each_x_after_the_kernel_that_wrote_it():
    torch.manual_seed(1)
    n, k, calls = 4096, 2048, 8
    ws = [_ints(n, k) for _ in range(calls)]
    src = [_ints(1, k) for _ in range(calls)]
    x = torch.empty(1, k, dtype=torch.bfloat16, device="cuda")
    outs = torch.empty(calls, 1, n, dtype=torch.bfloat16, device="cuda")

    def chain() -> None:
        for i in range(calls):
            torch.mul(src[i], 1, out=x)  # a kernel writes x just before each projection reads it
            gemv_ring(x, ws[i], out=outs[i])

    chain()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        for s in src:
            s.copy_(_ints(1, k))
        outs.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        for i in range(calls):
            assert torch.equal(outs[i], (src[i].float() @ ws[i].float().T).to(torch.bfloat16)), i


@pytest.mark.parametrize("config", [RingConfig(), RingConfig(per_sm=2), RingConfig(per_thread_copies=True)],
                         ids=lambda c: c.label)
def test_one_ring_feeds_the_next_in_a_graph(config):
    """y = ring(ring(x, w1), w2): the second call's CTAs sit beside the first's and read its output only after the
    wait. 0/1 entries keep every sum an integer below 2**24, so fp32 gives it exactly in any order."""
    torch.manual_seed(2)
    k, hidden, n = 2048, 4096, 3072
    w1 = torch.randint(0, 2, (hidden, k), device="cuda").to(torch.bfloat16)
    w2 = torch.randint(0, 2, (n, hidden), device="cuda").to(torch.bfloat16)
    x = torch.empty(1, k, dtype=torch.bfloat16, device="cuda")
    mid = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")

    def chain() -> None:
        gemv_ring(x, w1, config, out=mid)
        gemv_ring(mid, w2, config, out=y)

    x.copy_(torch.randint(0, 2, (1, k), device="cuda"))
    chain()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(4):
            chain()
    for _ in range(3):
        x.copy_(torch.randint(0, 2, (1, k), device="cuda"))
        y.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        want_mid = (x.float() @ w1.float().T).to(torch.bfloat16)
        assert torch.equal(y, (want_mid.float() @ w2.float().T).to(torch.bfloat16))


def test_linear_small_m_takes_the_ring_for_one_row_when_asked(monkeypatch):
    from tpgraph.kernels import gemv
    from tpgraph.kernels import gemv_ring as ring

    calls = []
    real = ring.gemv_ring
    monkeypatch.setattr(gemv, "gemv_ring", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = _ints(4096, 2048)
    monkeypatch.setenv("TPGRAPH_RING_GEMV", "1")
    for m in (1, 2):
        x = _ints(m, 2048)
        assert torch.equal(gemv.linear_small_m(x, w), (x.float() @ w.float().T).to(torch.bfloat16))
    assert calls == [1]  # one row only
    monkeypatch.setenv("TPGRAPH_RING_GEMV", "0")
    gemv.linear_small_m(_ints(1, 2048), w)
    assert calls == [1]
