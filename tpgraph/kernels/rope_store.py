"""Rotary embedding of the fused qkv projection plus the K/V cache write, in one launch.

`rope_and_store` splits a [T, (Hq + 2 * Hkv) * D] qkv row into heads, rotates q and k (rotate-half layout, as
HF Llama), returns the rotated q and k, and writes the rotated k and the untouched v into the paged caches at
`slot_mapping`. `rope_and_store_reference` is the plain-torch definition (HF's `apply_rotary_pos_emb` plus
`index_copy_`) it is tested against and the path used on CPU. `rope_cos_sin_table` precomputes the cos/sin
rows that HF's rotary embedding computes per position.

The kernel rounds where eager torch does: each product (x * cos, rotate_half(x) * sin) to the model dtype,
then their sum; so the result is bit-identical to the eager math. Qwen3's head norms (head_norm) are the one
exception: the kernel sums a head's squares by halves, not in torch's (or the norm kernel's) order, so the variance
may differ in its last fp32 bit, and a rare element one unit in the dtype's last place (in bf16 and fp16 about one in
30k to 1M on the interpreter, at 2048 tokens of random heads).
"""

from __future__ import annotations

import numpy as np
import torch

from tpgraph.kernels._pdl import pdl_launch, use_pdl
from tpgraph.kernels._rounding import soft_bf16_rounding
from tpgraph.kernels.norm import rms_norm_reference

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._pdl import pdl_enter
    from tpgraph.kernels._rounding import mul_rn, round_to, to_dtype
except ImportError:  # CPU-only installs without Triton use the reference path
    triton = None


def rope_cos_sin_table(inv_freq: torch.Tensor, max_pos: int, dtype: torch.dtype,
                       device: torch.device | str, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq fp32 [D/2] -> (cos, sin), each [max_pos, D/2] in `dtype`.

    Row p holds what HF's rotary embedding computes for position p (its full row is cat(row, row)): the fp32
    product p * inv_freq, cos/sin in fp32 on `device` times `scale` (its attention scaling: YaRN's), then one cast
    to `dtype`.
    """
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq.to(device=device, dtype=torch.float32)
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


# Qwen3's per-head norms: (q_norm's weight, k_norm's weight, eps), each weight [head_dim]
HeadNorm = tuple[torch.Tensor, torch.Tensor, float]


def head_norm_problem(head_norm: HeadNorm | None, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> str | None:
    """What keeps the kernels from applying these head norms to qkv of `dtype` on `device`, or None."""
    if head_norm is None:
        return None
    for name, weight in zip(("q", "k"), head_norm[:2], strict=True):
        if weight.shape != (head_dim,) or weight.dtype != dtype or not weight.is_contiguous() or \
                weight.device != device:
            layout = "a" if weight.is_contiguous() else "a non-contiguous"
            return (f"the {name} head norm's weight must be a contiguous [{head_dim}] tensor of {dtype} on {device}; "
                    f"got {layout} {tuple(weight.shape)} tensor of {weight.dtype} on {weight.device}")
    return None


def check_head_norm(head_norm: HeadNorm | None, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse head norms the kernels cannot apply, naming what is wrong."""
    problem = head_norm_problem(head_norm, head_dim, dtype, device)
    if problem is not None:
        raise ValueError(problem)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, q_width, kv_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_width].reshape(tokens, num_heads, head_dim)
    k = qkv[:, q_width:q_width + kv_width].reshape(tokens, num_kv_heads, head_dim)
    v = qkv[:, q_width + kv_width:q_width + 2 * kv_width].reshape(tokens, num_kv_heads, head_dim)
    return q, k, v


def rope_and_store_reference(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                             slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             num_heads: int, num_kv_heads: int, head_dim: int, *,
                             head_norm: HeadNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 * Hkv) * D] -> (q [T, Hq, D], k [T, Hkv, D]) rotated; k and v written to the caches.

    cos_sin: (cos, sin) tables [max_pos, D/2] (see `rope_cos_sin_table`); slot_mapping [T]: flat cache slot
    (block * block_size + offset); caches [num_blocks, block_size, Hkv, D]. head_norm (Qwen3's q_norm and k_norm
    weights, [D] each, and their eps): each q and k head RMS-normed before the rotation, as transformers does.
    """
    check_head_norm(head_norm, head_dim, qkv.dtype, qkv.device)
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if head_norm is not None:
        q_weight, k_weight, eps = head_norm
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    cos, sin = cos_sin
    pos = positions.long()
    c, s = cos[pos], sin[pos]
    c = torch.cat((c, c), dim=-1)[:, None, :]
    s = torch.cat((s, s), dim=-1)[:, None, :]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    slots = slot_mapping.long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
    return q, k


if triton is not None:

    @triton.jit
    def rotate_pair(x1, x2, c, s, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr):
        """(first, second) halves of x * cos + rotate_half(x) * sin in DTYPE, from fp32 halves x1, x2 and the cos/sin
        rows, every op rounded as eager torch rounds it. rotate_half(x) = cat(-x2, x1); round(-x2 * s) ==
        -round(x2 * s) and a + (-b) == a - b exactly, so the first half is a subtraction. EXACT_MUL: the products by
        `mul_rn`, for kernels that keep FMA contraction on (the interpreter never contracts)."""
        if EXACT_MUL:
            x1c, x2s, x2c, x1s = mul_rn(x1, c), mul_rn(x2, s), mul_rn(x2, c), mul_rn(x1, s)
        else:
            x1c, x2s, x2c, x1s = x1 * c, x2 * s, x2 * c, x1 * s
        o1 = to_dtype(round_to(x1c, DTYPE, SOFT_BF16) - round_to(x2s, DTYPE, SOFT_BF16), DTYPE, SOFT_BF16)
        o2 = to_dtype(round_to(x2c, DTYPE, SOFT_BF16) + round_to(x1s, DTYPE, SOFT_BF16), DTYPE, SOFT_BF16)
        return o1, o2

    @triton.jit
    def head_norm_weights(qn_ptr, kn_ptr, is_q, offs_h, HEAD_DIM: tl.constexpr):
        """A head's norm weight at dims offs_h and offs_h + HEAD_DIM / 2, fp32 (q_norm's for a q head, k_norm's
        otherwise; 0 past the half)."""
        half: tl.constexpr = HEAD_DIM // 2
        ok = offs_h < half
        if is_q:
            w1, w2 = tl.load(qn_ptr + offs_h, mask=ok, other=0.0), tl.load(qn_ptr + half + offs_h, mask=ok, other=0.0)
        else:
            w1, w2 = tl.load(kn_ptr + offs_h, mask=ok, other=0.0), tl.load(kn_ptr + half + offs_h, mask=ok, other=0.0)
        return w1.to(tl.float32), w2.to(tl.float32)

    @triton.jit
    def normed_head(x1, x2, w1, w2, eps, mean_scale, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr,
                    EXACT_MUL: tl.constexpr, MEAN_BY_DIV: tl.constexpr):
        """Qwen3's RMSNorm of one head of every row, from fp32 halves x1, x2 (DTYPE values; lanes past the half hold
        0) and the weight's halves w1, w2 (head_norm_weights), rounded where the norm kernel rounds: the normed row to
        DTYPE, then its product with the weight. The mean as torch takes it on the tensors' device (MEAN_BY_DIV:
        sum / mean_scale, else sum * mean_scale). The squares are summed by halves, the one order the norm kernel may
        not share (the variance's last bit). EXACT_MUL: the squares by mul_rn, for kernels that keep FMA contraction
        on."""
        if EXACT_MUL:
            s1, s2 = mul_rn(x1, x1), mul_rn(x2, x2)
        else:
            s1, s2 = x1 * x1, x2 * x2
        total = tl.sum(s1, axis=1) + tl.sum(s2, axis=1)
        if MEAN_BY_DIV:
            var = tl.div_rn(total, mean_scale)
        else:
            var = total * mean_scale
        rstd = tl.rsqrt(var + eps)[:, None]
        n1, n2 = round_to(x1 * rstd, DTYPE, SOFT_BF16), round_to(x2 * rstd, DTYPE, SOFT_BF16)
        return round_to(w1[None, :] * n1, DTYPE, SOFT_BF16), round_to(w2[None, :] * n2, DTYPE, SOFT_BF16)

    # num_tokens only bounds the last token block: unspecialised, so that a new prompt length (eager prefill above
    # the piecewise sizes) compiles no variant (Triton keys an int equal to 1 or divisible by 16 apart)
    @triton.jit(do_not_specialize=["num_tokens"])
    def _rope_store_kernel(
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr, k_out_ptr, qn_ptr, kn_ptr,
        num_tokens, eps, mean_scale, stride_qkv, stride_cos, stride_sin, stride_cb, stride_ct, stride_ch, stride_qo,
        stride_ko, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
        SOFT_BF16: tl.constexpr, PDL: tl.constexpr, HEAD_NORM: tl.constexpr, MEAN_BY_DIV: tl.constexpr,
    ):
        """One head (program_id 1) of BLOCK_T tokens (program_id 0). Decode-sized launches take a token a program;
        prefill takes 16, so that each program moves more than a 256-byte row (at one token a program, 8192 tokens
        were 327k programs of a warp each, at about a tenth of HBM bandwidth). HEAD_NORM (Qwen3): the head RMS-normed
        (normed_head; qn_ptr's weight for q, kn_ptr's for k, eps) before its rotation."""
        pdl_enter(PDL)
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < num_tokens
        h = tl.program_id(1)  # 0..Hq-1: a q head; Hq..Hq+Hkv-1: a kv head (k rotated, v copied)
        half = HEAD_DIM // 2
        dtype = qkv_ptr.dtype.element_ty
        offs = tl.arange(0, HALF_PAD)
        ok = t_ok[:, None] & (offs < half)[None, :]
        pos = tl.load(pos_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
        c = tl.load(cos_ptr + pos[:, None] * stride_cos + offs[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * stride_sin + offs[None, :], mask=ok, other=0.0).to(tl.float32)
        # q heads then k heads are adjacent in the row, so head h (either kind) starts at h * HEAD_DIM.
        row = qkv_ptr + offs_t[:, None] * stride_qkv
        src = row + h * HEAD_DIM + offs[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
        if HEAD_NORM:
            w1, w2 = head_norm_weights(qn_ptr, kn_ptr, h < NUM_HEADS, offs, HEAD_DIM)
            x1, x2 = normed_head(x1, x2, w1, w2, eps, mean_scale, dtype, SOFT_BF16, False, MEAN_BY_DIV)
        o1, o2 = rotate_pair(x1, x2, c, s, dtype, SOFT_BF16, False)  # the launch turns FMA contraction off
        if h < NUM_HEADS:
            dst = q_out_ptr + offs_t[:, None] * stride_qo + h * HEAD_DIM + offs[None, :]
            tl.store(dst, o1, mask=ok)
            tl.store(dst + half, o2, mask=ok)
        else:
            kv_h = h - NUM_HEADS
            dst = k_out_ptr + offs_t[:, None] * stride_ko + kv_h * HEAD_DIM + offs[None, :]
            tl.store(dst, o1, mask=ok)
            tl.store(dst + half, o2, mask=ok)
            slot = tl.load(slot_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)  # int64: block * stride_cb overflows
            cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kv_h * stride_ch
            k_dst = k_cache_ptr + cache_off[:, None] + offs[None, :]
            tl.store(k_dst, o1, mask=ok)
            tl.store(k_dst + half, o2, mask=ok)
            offs_d = tl.arange(0, DIM_PAD)
            dim_ok = t_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
            v = tl.load(row + (h + NUM_KV_HEADS) * HEAD_DIM + offs_d[None, :], mask=dim_ok, other=0.0)
            tl.store(v_cache_ptr + cache_off[:, None] + offs_d[None, :], v, mask=dim_ok)


# tokens a program at or above PREFILL_TOKENS tokens a launch: prefill, and decode batches of that many rows
# (below: one, as every launch took before)
PREFILL_TOKENS, PREFILL_BLOCK_T = 256, 16


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int, *,
                   use_triton: bool | None = None, tokens_per_program: int | None = None,
                   head_norm: HeadNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and result as `rope_and_store_reference` (head_norm: within the variance's last bit, see the
    module's note), in one Triton launch (grid: token blocks x heads).

    q and k come back as new contiguous tensors; qkv rows may be a strided view (last dim contiguous).
    `use_triton` defaults to `qkv.is_cuda`; `tokens_per_program` (a power of two) to PREFILL_BLOCK_T at
    PREFILL_TOKENS tokens and more, else 1 (bench_kernels.py times both).
    """
    if not (qkv.is_cuda if use_triton is None else use_triton):
        return rope_and_store_reference(qkv, positions, cos_sin, slot_mapping, k_cache, v_cache,
                                        num_heads, num_kv_heads, head_dim, head_norm=head_norm)
    if triton is None:
        raise RuntimeError("Triton is not installed; use rope_and_store_reference or install triton")
    cos, sin = cos_sin
    tokens = qkv.shape[0]
    if head_dim % 2 or qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 * {num_kv_heads} heads of {head_dim}")
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.shape[-1] != head_dim // 2:
        raise ValueError("qkv and the cos/sin tables need a contiguous last dim; the tables are [max_pos, D/2]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.shape[2:] != (num_kv_heads,
                                                                                                  head_dim):
        raise ValueError("K and V caches must be [blocks, block_size, Hkv, D] with one layout and a contiguous D")
    if qkv.dtype != cos.dtype or qkv.dtype != sin.dtype or qkv.dtype != k_cache.dtype:
        raise ValueError("qkv, the cos/sin tables and the caches must share the model dtype")
    check_head_norm(head_norm, head_dim, qkv.dtype, qkv.device)
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q, k
    # the kernel reads positions and slots at unit steps (a no-op for the engine's contiguous buffers)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    pdl = use_pdl(qkv)
    block_t = tokens_per_program or (PREFILL_BLOCK_T if tokens >= PREFILL_TOKENS else 1)
    if block_t & (block_t - 1):
        raise ValueError(f"tokens_per_program must be a power of two, got {block_t}")
    by_div = not qkv.is_cuda  # torch's mean, as the norm kernel copies it
    qn, kn, eps = head_norm or (qkv, qkv, 0.0)
    _rope_store_kernel[(triton.cdiv(tokens, block_t), num_heads + num_kv_heads)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, q, k, qn, kn, tokens, eps,
        float(head_dim) if by_div else float(np.float32(1.0) / np.float32(head_dim)), qkv.stride(0), cos.stride(0),
        sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.stride(0), k.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HALF_PAD=triton.next_power_of_2(head_dim // 2), DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_T=block_t,
        SOFT_BF16=soft_bf16_rounding(qkv), PDL=pdl, HEAD_NORM=head_norm is not None, MEAN_BY_DIV=by_div,
        num_warps=(1 if head_dim <= 128 else 2) * (4 if block_t > 1 else 1),
        enable_fp_fusion=False,  # an FMA would skip a rounding that eager torch does
        **pdl_launch(pdl),
    )
    return q, k
