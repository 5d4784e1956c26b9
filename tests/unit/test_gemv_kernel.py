"""The small-M projection kernel (Triton's interpreter on CPU) against torch.matmul, at the shapes a loader can
produce (odd N and K included)."""

import os

import pytest
import torch

from tpgraph.kernels.gemv import linear_small_m, tiles

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")


@interpreted
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(64, 256), (37, 300), (257, 4100), (8200, 64)])
def test_matches_matmul_in_fp32(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = linear_small_m(x, w, use_triton=True)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)


@interpreted
@pytest.mark.parametrize("m", [1, 5])
def test_bf16_within_rounding(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 512, generator=g).to(torch.bfloat16)
    y = linear_small_m(x, w, use_triton=True)
    ref = (x.float() @ w.float().T)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() / ref.abs().clamp_min(1.0)).max() < 1e-2


def test_falls_back_to_linear_where_the_kernel_does_not_apply():
    x, w = torch.randn(17, 64), torch.randn(32, 64)
    torch.testing.assert_close(linear_small_m(x, w, use_triton=True), x @ w.T)  # M > 16: F.linear
    torch.testing.assert_close(linear_small_m(x[:4], w), x[:4] @ w.T)  # CPU tensors by default: F.linear


def test_tiles_give_every_sm_work_on_narrow_matrices():
    assert tiles(2048)[0] == 16 and 2048 // tiles(2048)[0] >= 128
    assert tiles(64128)[0] == 32


def test_layers_use_it_only_when_asked(monkeypatch):
    from tpgraph.model.layers import ColumnParallelLinear

    def layer():
        return ColumnParallelLinear(64, [("w", 32, 0, 32)], torch.float32, torch.device("cpu"))

    assert layer().small_m is False
    monkeypatch.setenv("TPGRAPH_GEMV", "1")
    lin = layer()
    assert lin.small_m is True
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)  # CPU tensors: F.linear, the same numbers
