"""The Triton silu-and-mul kernel (run by Triton's interpreter on CPU) against the torch reference."""


import numpy as np
import pytest
import torch
from tpgtest.markers import interpreted

from tpgraph.kernels.activation import silu_and_mul, silu_and_mul_reference

pytest.importorskip("triton")

# These tests hand CPU tensors to the kernels, which only Triton's interpreter runs (conftest turns it on when
# there is no GPU); on a GPU machine without TRITON_INTERPRET=1 they would fail to launch, so they skip.


def _case(seed: int, rows: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)


def _with_numpy_exp(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up rounded as torch rounds it, but with numpy's exp: the one the interpreter runs."""
    gate, up = x.float().chunk(2, dim=-1)
    e = torch.from_numpy(np.exp(-gate.numpy()))
    silu = (gate / (1 + e)).to(x.dtype).float()
    return (silu * up.float()).to(x.dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,inter", [(5, 64), (3, 200), (2, 1500)])  # 1500: two column blocks, a ragged one
def test_silu_and_mul(dtype, rows, inter):
    x = _case(rows * inter, rows, inter, dtype)
    out = silu_and_mul(x, use_triton=True)
    ref = silu_and_mul_reference(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    # Every rounding step is torch's: bit-exact once the exp is the same.
    assert torch.equal(out, _with_numpy_exp(x))
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        # The interpreter's exp is numpy's and torch's CPU exp is its own vectorised one; they differ in the
        # last bit for about a third of the inputs, so fp32 silu can differ by an ulp or two. (On a GPU the
        # kernel uses libdevice's expf, the one torch's CUDA silu calls.) bf16 rounding hides it above.
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@interpreted
def test_strided_rows_and_zero_rows():
    x = _case(1, 3, 96, torch.bfloat16)
    wide = torch.zeros(3, 256, dtype=torch.bfloat16)
    wide[:, 16:208] = x
    assert torch.equal(silu_and_mul(wide[:, 16:208], use_triton=True), silu_and_mul_reference(x))
    assert silu_and_mul(torch.empty(0, 128), use_triton=True).shape == (0, 64)


def test_cpu_default_is_the_reference():
    x = _case(2, 2, 32, torch.bfloat16)
    assert torch.equal(silu_and_mul(x), torch.nn.functional.silu(x[:, :32]) * x[:, 32:])


@pytest.mark.parametrize("pdl", [False, True])
def test_the_kernel_compiles_for_sm90_with_torchs_roundings(pdl):
    """Ahead of time, without a GPU: silu_mul's add, IEEE division and product are their own round-to-nearest
    instructions (the gate_up projection's epilogue shares them and keeps FMA contraction on)."""
    from tpgtest.ptx import sm90_ptx

    ptx = sm90_ptx("tpgraph.kernels.activation", "_silu_and_mul_kernel", {"x_ptr": "*bf16", "out_ptr": "*bf16"},
                   ["inter", "stride_x", "stride_o"], {"BLOCK": 1024, "SOFT_BF16": False, "EXACT": True, "PDL": pdl})
    assert "add.rn.f32" in ptx and "div.rn.f32" in ptx and "mul.rn.f32" in ptx
    # as a programmatic dependent: the wait before any load (the kernel before writes x)
    assert ("griddepcontrol.wait" in ptx) == pdl
    if pdl:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
