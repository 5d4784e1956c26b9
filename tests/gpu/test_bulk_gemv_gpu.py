"""The bulk-copy projection (csrc/bulk_gemv.cu) on the GPU: exact on integer inputs, within bf16/fp16 rounding of
torch.matmul on random ones, at every row count, chunk size, trigger and stage count, eager, in graphs and chained."""

import itertools

import pytest
import torch

from tpgraph.kernels.bulk_gemv import BulkConfig, bulk_linear

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_sm90():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk copies need sm_90+")


def integer_case(n, k, m, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (m, k), generator=gen).to("cuda", dtype)
    w = torch.randint(-3, 4, (n, k), generator=gen).to("cuda", dtype)
    return x, w, (x.double() @ w.double().T).to(dtype)


# odd N (a vocabulary of 32003; rows that split unevenly over the blocks), K down to one vector, and the projections
@pytest.mark.parametrize("n,k", [(3072, 4096), (4096, 2048), (4096, 7168), (32003, 4096), (7, 8), (133, 24),
                                 (1000, 4104)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_exact_on_integers(n, k, m):
    for dtype in (torch.bfloat16, torch.float16):
        x, w, want = integer_case(n, k, m, dtype)
        got = bulk_linear(x, w)
        assert torch.equal(got, want), (dtype, (got != want).sum().item())


@pytest.mark.parametrize("rows,stages,trigger,blocks,evict", list(itertools.product(
    (1, 2, 4, 8), (1, 2, 6, 0), ("start", "issued", "exit"), (1, 2), (False, True)))[::5])
def test_every_launch_shape_is_exact(rows, stages, trigger, blocks, evict):
    config = BulkConfig(blocks_per_sm=blocks, rows_per_chunk=rows, stages=stages, trigger=trigger,
                        evict_first=evict)
    for n, k in ((3072, 2048), (517, 1024), (9, 256)):
        x, w, want = integer_case(n, k, 2, torch.bfloat16, seed=n)
        assert torch.equal(bulk_linear(x, w, config=config), want), (n, k, config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_inputs_within_rounding(dtype):
    torch.manual_seed(0)
    for m in (1, 4):
        x = torch.randn(m, 4096, device="cuda", dtype=dtype)
        w = torch.randn(3072, 4096, device="cuda", dtype=dtype) * 0.02
        want = x.float() @ w.float().T
        got = bulk_linear(x, w).float()
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()
        torch.testing.assert_close(got, (x @ w.T).float(), rtol=2e-2, atol=2e-2)


def test_same_bits_every_run_and_in_a_graph_chain():
    """Replayed in one graph, each call a programmatic dependent of the one before (its weights issued before the
    wait), every output equals the eager one: the x it reads is the previous call's output."""
    torch.manual_seed(1)
    n = k = 2048
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(4)]
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        outs = []
        for w in ws:
            x = bulk_linear(x, w)
            outs.append(x)
        return outs

    eager = chain(x0)
    x_in = x0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x_in)
    for _ in range(3):
        for o in captured:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for want, got in zip(eager, captured, strict=True):
            assert torch.equal(got, want)


def test_refuses_what_it_cannot_take():
    x = torch.ones(1, 4100, device="cuda", dtype=torch.bfloat16)  # an intermediate of 4100: not whole vectors
    with pytest.raises(ValueError, match="multiple of 8"):
        bulk_linear(x, torch.ones(16, 4100, device="cuda", dtype=torch.bfloat16))
    x = torch.ones(1, 32768, device="cuda", dtype=torch.bfloat16)  # a lane would hold x in 16 vectors
    with pytest.raises(ValueError, match="vectors a lane"):
        bulk_linear(x, torch.ones(16, 32768, device="cuda", dtype=torch.bfloat16))


def test_linear_small_m_hands_it_the_rows_it_takes(monkeypatch):
    from tpgraph.kernels import bulk_gemv, gemv

    x, w, want = integer_case(4096, 2048, 2, torch.bfloat16)
    calls = []
    monkeypatch.setattr(bulk_gemv, "bulk_linear", lambda *a, **k: calls.append(a[3]) or want)
    monkeypatch.setenv("TPGRAPH_BULK_GEMV", "1")
    assert torch.equal(gemv.linear_small_m(x, w), want) and calls == [bulk_gemv.BulkConfig()]
    x5 = torch.ones(5, 2048, device="cuda", dtype=torch.bfloat16)
    gemv.linear_small_m(x5, w)  # five rows: the Triton kernel
    assert len(calls) == 1
    monkeypatch.setenv("TPGRAPH_BULK_GEMV", "0")
    gemv.linear_small_m(x, w)
    assert len(calls) == 1
