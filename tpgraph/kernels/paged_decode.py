"""Paged decode attention: one query token per sequence against its paged K/V cache.

`paged_decode_attention` is a Triton kernel (one program per sequence and query head, online softmax
over cache blocks); `paged_decode_reference` is the plain-torch definition it is tested against and
the path used on CPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the reference path
    triton = None


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; caches [blocks, block_size, Hkv, D]; block_tables [B, M]; seq_lens [B] -> [B, Hq, D].

    A sequence with seq_len 0 (a padded batch row) yields zeros.
    """
    batch, num_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].float()  # [n, Hkv, D]
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, scale,
        stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_ob, stride_oh,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kv_h = h // GROUP
        seq_len = tl.load(seq_lens_ptr + b)
        offs_d = tl.arange(0, DIM_PAD)
        dim_ok = offs_d < HEAD_DIM
        offs_t = tl.arange(0, BLOCK_SIZE)

        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=dim_ok, other=0.0).to(tl.float32)
        q = q * scale
        m_i = tl.full([1], float("-inf"), tl.float32)
        l_i = tl.zeros([1], tl.float32)
        acc = tl.zeros([DIM_PAD], tl.float32)
        num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
        for i in range(0, num_blocks):
            block = tl.load(block_tables_ptr + b * stride_bt + i).to(tl.int64)
            tok_ok = i * BLOCK_SIZE + offs_t < seq_len
            offs = block * stride_cb + offs_t[:, None] * stride_ct + kv_h * stride_ch + offs_d[None, :]
            mask = tok_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1)
            s = tl.where(tok_ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (padding row): write zeros, not NaN
        out = acc / l_i
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton version of `paged_decode_reference` (same arguments, same result)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use paged_decode_reference or install triton")
    batch, num_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the Triton kernel, got {block_size}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("K and V caches must share a layout with a contiguous head_dim")
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, num_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=dim, DIM_PAD=triton.next_power_of_2(dim),
    )
    return out
