"""SwiGLU activation of the fused gate/up projection: silu(gate) * up.

`silu_and_mul` is a Triton kernel (a program per row and column block); `silu_and_mul_reference` is the
plain-torch definition (`F.silu(gate) * up`, as HF Llama's MLP) it is tested against and the path used on
CPU. The kernel rounds where eager torch does: silu(gate) to the dtype, then the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpgraph.kernels._pdl import pdl_launch, use_pdl
from tpgraph.kernels._rounding import soft_bf16_rounding

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from tpgraph.kernels._pdl import pdl_enter
    from tpgraph.kernels._rounding import add_rn, mul_rn, round_to, to_dtype
except ImportError:  # CPU-only installs without Triton use the reference path
    triton = None

_BLOCK = 1024  # columns per program


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = cat(gate, up) -> [T, I] = silu(gate) * up, each op rounded to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def silu_mul(gate, up, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr, EXACT: tl.constexpr):
        """silu(gate) * up in fp32, from fp32 gate and up that hold DTYPE values, rounded where eager torch rounds:
        silu(gate) to DTYPE, then the product (the caller rounds it). torch's CUDA silu is x / (1 + expf(-x)) with
        IEEE division: libdevice's expf and div_rn copy it (tl.exp and `/` lower to approximate instructions).
        EXACT (the GPU): the add and the product as instructions no FMA can absorb, so kernels that keep FMA
        contraction on get these bits too. Not EXACT (the interpreter: no libdevice, no contraction): numpy's exp."""
        if EXACT:
            silu = round_to(tl.div_rn(gate, add_rn(1.0, libdevice.exp(-gate))), DTYPE, SOFT_BF16)
            y = mul_rn(silu, up)
        else:
            silu = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), DTYPE, SOFT_BF16)
            y = silu * up
        return y

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o,
                             BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < inter
        dtype = x_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + offs, mask=ok, other=0.0).to(tl.float32)
        y = silu_mul(gate, up, dtype, SOFT_BF16, EXACT)
        tl.store(out_ptr + row * stride_o + offs, to_dtype(y, out_ptr.dtype.element_ty, SOFT_BF16), mask=ok)


def silu_and_mul(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """x [T, 2I] (last dim contiguous) -> new [T, I] tensor. `use_triton` defaults to `x.is_cuda`."""
    if not (x.is_cuda if use_triton is None else use_triton):
        return silu_and_mul_reference(x)
    if triton is None:
        raise RuntimeError("Triton is not installed; use silu_and_mul_reference or install triton")
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"expected x [T, 2I] with a contiguous last dim, got {tuple(x.shape)}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0 or inter == 0:
        return out
    soft = soft_bf16_rounding(x)
    block = min(_BLOCK, triton.next_power_of_2(inter))
    pdl = use_pdl(x)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0),
        BLOCK=block, SOFT_BF16=soft, EXACT=not soft, PDL=pdl,
        num_warps=4,
        enable_fp_fusion=False,  # an FMA would skip a rounding that eager torch does
        **pdl_launch(pdl),
    )
    return out
