"""Rounding helpers shared by the elementwise Triton kernels that must match torch's eager math bit for bit.

Torch rounds every elementwise op on 16-bit tensors to the tensor's dtype (compute in fp32, round to nearest
even). The kernels keep values in fp32 registers and call `round_to` wherever torch would have rounded.

Why a software path: Triton's CPU interpreter (TRITON_INTERPRET=1, used by the unit tests) converts fp32 to
bf16 by truncation, not round-to-nearest-even, so under the interpreter bf16 rounding is done on the bits.
On a GPU the native conversion (cvt.rn) is already round-to-nearest-even and is used instead.
"""

from __future__ import annotations

import torch

from tpgraph.kernels._settings import triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the torch references
    triton = None


def soft_bf16_rounding(t: torch.Tensor) -> bool:
    """Whether a launch on `t` runs under the interpreter (CPU tensors, or TRITON_INTERPRET set)."""
    return not t.is_cuda or triton_interpreting()


if triton is not None:

    @triton.jit
    def to_dtype(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
        """fp32 `x` -> DTYPE, rounded to nearest even."""
        if SOFT_BF16 and DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(x != x, bits >> 16, rounded)  # keep NaNs NaN (the add could carry out of them)
            y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(DTYPE)
        return y

    @triton.jit
    def round_to(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
        """fp32 `x` rounded (nearest even) to DTYPE's precision, returned as fp32."""
        if DTYPE == tl.float32:
            y = x
        else:
            y = to_dtype(x, DTYPE, SOFT_BF16).to(tl.float32)
        return y

    @triton.jit
    def mul_rn(a, b):
        """a * b rounded to nearest, as its own instruction: an explicit rounding mode is never fused into an FMA,
        and unlike libdevice's mul_rn it does not flush denormals."""
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def add_rn(a, b):
        """a + b rounded to nearest, as its own instruction (never the add of an FMA)."""
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)
