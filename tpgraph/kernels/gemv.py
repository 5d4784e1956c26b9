"""Small-M projections (decode: M <= 16 rows) as one Triton kernel that streams each weight once.

`linear_small_m(x, w)` = x @ w.T for x [M, K] and w [N, K] (nn.Linear's layout). Decode at small batch is a
weight-read problem: each program owns BLOCK_N output columns, walks K in BLOCK_K steps with the weight tile loaded
once and M padded to 16 rows for the tensor-core dot, accumulates in fp32 and rounds once. No split-K: the sum over
K runs in one fixed order, so results do not depend on timing. The tile sizes are a fixed table by N (no autotuning:
the same shape gets the same kernel, and so the same bits, in every run).

Off unless `TPGRAPH_GEMV=1`: it replaces cuBLAS only once bench/bench_gemv.py has shown it faster on the GPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._rounding import to_dtype
except ImportError:  # CPU-only installs without Triton use F.linear
    triton = None

MAX_M = 16


def enabled() -> bool:
    """Whether the model's projections use this kernel for M <= MAX_M (read when a layer is built)."""
    return os.environ.get("TPGRAPH_GEMV", "0") == "1"


def tiles(n: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for N output columns: narrow column blocks for narrow matrices, so
    that every SM gets programs (132 on an H200: N = 2048 / 16 = 128 programs)."""
    if n <= 8192:
        return 16, 256, 4, 4
    return 32, 256, 4, 4


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr,
                     IEEE: tl.constexpr):
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if SOFT_BF16:  # the interpreter has no bf16 dot: products in fp32 (exact for bf16 inputs)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            elif IEEE:  # fp32 inputs: full fp32 products, not TF32 (as torch's matmul by default)
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
        y = to_dtype(acc, y_ptr.dtype.element_ty, SOFT_BF16)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def linear_small_m(x: torch.Tensor, w: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype; F.linear where the kernel does not apply (M > 16, CPU
    without the interpreter, strided inputs)."""
    if not (x.is_cuda if use_triton is None else use_triton) or triton is None:
        return F.linear(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.shape[0] > MAX_M or x.shape[0] == 0:
        return F.linear(x, w)
    if x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        return F.linear(x, w)
    from tpgraph.kernels._rounding import soft_bf16_rounding

    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = tiles(n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, SOFT_BF16=soft_bf16_rounding(x),
        IEEE=x.dtype == torch.float32,
        num_warps=warps, num_stages=stages)
    return y
