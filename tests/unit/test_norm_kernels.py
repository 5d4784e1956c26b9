"""The Triton RMSNorm kernels (run by Triton's interpreter on CPU) against the torch references, and the
references against Hugging Face's LlamaRMSNorm."""


import pytest
import torch
from tpgtest.markers import interpreted

from tpgraph.kernels.norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference

pytest.importorskip("triton")

# These tests hand CPU tensors to the kernels, which only Triton's interpreter runs (conftest turns it on when
# there is no GPU); on a GPU machine without TRITON_INTERPRET=1 they would fail to launch, so they skip.

EPS = 1e-5


def _case(seed: int, rows: int, hidden: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return x, residual, weight


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.float32:
        # The kernel sums the squares in another order than torch, so the fp32 variance (and every element
        # of that row) may differ in its last bit or two. In bf16 the final rounding hides it.
        torch.testing.assert_close(out, ref, atol=0, rtol=1e-6)
    else:
        assert torch.equal(out, ref)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,hidden", [(5, 64), (3, 200), (2, 1024)])
def test_rms_norm_matches_reference(dtype, rows, hidden):
    x, _, weight = _case(rows * hidden, rows, hidden, dtype)
    out = rms_norm(x, weight, EPS, use_triton=True)
    assert out.dtype == dtype and out.shape == x.shape
    _assert_matches(out, rms_norm_reference(x, weight, EPS))


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,hidden", [(5, 64), (3, 200), (2, 1024)])
def test_add_rms_norm_matches_reference(dtype, rows, hidden):
    x, residual, weight = _case(rows + hidden, rows, hidden, dtype)
    x_before, res_before = x.clone(), residual.clone()
    out, new_residual = add_rms_norm(x, residual, weight, EPS, use_triton=True)
    ref, ref_residual = add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(new_residual, ref_residual)  # one rounded add: exact in every dtype
    _assert_matches(out, ref)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # out of place


@interpreted
def test_row_strided_input():
    x, residual, weight = _case(7, 4, 96, torch.bfloat16)
    wide = torch.zeros(4, 160, dtype=torch.bfloat16)
    wide[:, 32:128] = x
    view = wide[:, 32:128]  # rows 160 apart, last dim contiguous
    assert torch.equal(rms_norm(view, weight, EPS, use_triton=True), rms_norm_reference(x, weight, EPS))
    out, res = add_rms_norm(view, residual, weight, EPS, use_triton=True)
    ref, ref_res = add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(out, ref) and torch.equal(res, ref_res) and res.is_contiguous()


@interpreted
def test_zero_rows():
    x, residual, weight = _case(0, 0, 64, torch.bfloat16)
    assert rms_norm(x, weight, EPS, use_triton=True).shape == (0, 64)
    out, res = add_rms_norm(x, residual, weight, EPS, use_triton=True)
    assert out.shape == (0, 64) and res.shape == (0, 64)


def test_cpu_default_is_the_reference():
    x, residual, weight = _case(3, 3, 64, torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    out, res = add_rms_norm(x, residual, weight, EPS)
    ref, ref_res = add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(out, ref) and torch.equal(res, ref_res)


@pytest.mark.parametrize("hidden", [64, 4096])
def test_reference_is_hf_llama_rms_norm_bit_for_bit(hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual, weight = _case(hidden, 6, hidden, torch.bfloat16)
    hf = LlamaRMSNorm(hidden, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(weight)
        assert torch.equal(rms_norm_reference(x, weight, EPS), hf(x))
        # A decoder layer's `residual + hidden_states` followed by the next norm.
        out, new_residual = add_rms_norm_reference(x, residual, weight, EPS)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(out, hf(residual + x))
