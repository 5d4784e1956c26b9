"""Attention front end over a paged KV cache: store K/V by slot, SDPA for prefill, paged decode."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpgraph.kernels.paged_decode import paged_decode_attention, paged_decode_reference


@dataclass
class AttentionMetadata:
    """Describes one forward over a flat token batch.

    Prefill: `query_lens` gives each sequence's new-token count (tokens are laid out sequence after
    sequence); every sequence starts from an empty cache. Decode: one token per sequence, attending to
    `seq_lens[b]` cached tokens (the new one included) through `block_tables`.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot = block * block_size + offset
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_lens: tuple[int, ...] = ()
    use_triton: bool = False


@dataclass
class KVCache:
    """One layer's cache: [num_blocks, block_size, kv_heads, head_dim] for K and for V."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


def store_kv(cache: KVCache, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    heads, dim = cache.k.shape[2], cache.k.shape[3]
    cache.k.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    cache.v.view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
              scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> [T, Hq, D]. Writes k/v into the cache."""
    store_kv(cache, meta.slot_mapping, k, v)
    if not meta.is_prefill:
        decode = paged_decode_attention if meta.use_triton else paged_decode_reference
        return decode(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty_like(q)
    start = 0
    for n in meta.query_lens:
        # [H, L, D] layout for SDPA; GQA through enable_gqa (no materialised repeat).
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True,
                                           scale=scale, enable_gqa=ks.shape[0] != qs.shape[0])
        out[start:start + n] = o.squeeze(0).transpose(0, 1)
        start += n
    return out
