"""Paged decode attention, defined in plain torch: one query token per sequence against its paged K/V cache.

`paged_decode_reference` is the definition the Triton kernel (`decode_attention.paged_decode_attention_v2`) is
tested against, and the path used on CPU.
"""

from __future__ import annotations

import torch


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
