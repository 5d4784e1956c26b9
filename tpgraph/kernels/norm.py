"""RMSNorm and fused residual-add + RMSNorm, with Hugging Face Llama's eager rounding.

`rms_norm` / `add_rms_norm` are single Triton launches (one program per row, the whole row in one block);
`rms_norm_reference` / `add_rms_norm_reference` are the plain-torch definitions (HF's `LlamaRMSNorm` math)
they are tested against and the path used on CPU.

The kernels round where torch rounds: the residual sum to the input dtype, the normalised row to the input
dtype before the weight, and the weight product once. The one thing a kernel cannot copy is the order in
which torch sums the squares, so the fp32 variance may differ from torch's in its last bit; after rounding
to bf16 that almost never shows.
"""

from __future__ import annotations

import numpy as np
import torch

from tpgraph.kernels._pdl import pdl_launch, use_pdl
from tpgraph.kernels._rounding import soft_bf16_rounding

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._pdl import pdl_enter
    from tpgraph.kernels._rounding import round_to, to_dtype
except ImportError:  # CPU-only installs without Triton use the reference path
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32, cast back first."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual), the sum rounded to x's dtype as eager torch does."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps, mean_scale,
        stride_x, stride_r, stride_o, stride_ro,
        HAS_RESIDUAL: tl.constexpr, MEAN_BY_DIV: tl.constexpr, SOFT_BF16: tl.constexpr, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_enter(PDL)  # as a programmatic dependent: wait for the kernel before, then let the next one in
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        # the weight with x: loaded after the sum's barrier, it was a second round trip after the wait
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            x = round_to(x + r, dtype, SOFT_BF16)  # eager `x + residual` is rounded to the dtype
            tl.store(res_out_ptr + row * stride_ro + offs, to_dtype(x, dtype, SOFT_BF16), mask=mask)
        total = tl.sum(x * x, axis=0)  # masked lanes are 0
        # torch's mean: sum / H on CPU, sum * fl(1/H) on CUDA; copy whichever the tensors' device does.
        if MEAN_BY_DIV:
            var = tl.div_rn(total, mean_scale)
        else:
            var = total * mean_scale
        normed = round_to(x * tl.rsqrt(var + eps), dtype, SOFT_BF16)  # HF casts back before the weight
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * stride_o + offs, to_dtype(w.to(tl.float32) * normed, out_dtype, SOFT_BF16), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    if triton is None:
        raise RuntimeError("Triton is not installed; use the torch reference or install triton")
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"expected x [T, H] with a contiguous last dim and weight [H]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError("residual must match x in shape and dtype, with a contiguous last dim")
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    by_div = not x.is_cuda
    mean_scale = float(hidden) if by_div else float(np.float32(1.0) / np.float32(hidden))
    res_in = residual if residual is not None else x  # placeholders: not read when HAS_RESIDUAL is False
    res_o = res_out if res_out is not None else out
    pdl = use_pdl(x)
    _rms_norm_kernel[(rows,)](
        x, res_in, weight, out, res_o, hidden, eps, mean_scale,
        x.stride(0), res_in.stride(0), out.stride(0), res_o.stride(0),
        HAS_RESIDUAL=residual is not None, MEAN_BY_DIV=by_div, SOFT_BF16=soft_bf16_rounding(x), BLOCK=block,
        PDL=pdl, num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
        enable_fp_fusion=False,  # an FMA would skip a rounding that eager torch does
        **pdl_launch(pdl),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None) -> torch.Tensor:
    """x [T, H], weight [H] -> new [T, H] tensor. `use_triton` defaults to `x.is_cuda`."""
    if not (x.is_cuda if use_triton is None else use_triton):
        return rms_norm_reference(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rms_norm(x + residual), x + residual), both new tensors, in one launch."""
    if not (x.is_cuda if use_triton is None else use_triton):
        return add_rms_norm_reference(x, residual, weight, eps)
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
