"""Prefill attention cases: sequences with and without a cached prefix over a scattered paged cache."""

import torch

from tpgraph.model.attention import AttentionMetadata, KVCache

BLOCK = 4


def prefill_case(lens, contexts, heads=(8, 2), dim=16, padded=0, seed=0, device="cpu", dtype=torch.float32,
                 block=BLOCK):
    """A cache holding each sequence's prefix and chunk (as rope_store leaves it), scattered over blocks, and the
    chunk's q/k/v laid out sequence after sequence (then `padded` rows of garbage)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    spans = [c + n for c, n in zip(contexts, lens, strict=True)]
    nblocks = sum(-(-s // block) for s in spans) + 3
    order = torch.randperm(nblocks, generator=gen).tolist()
    tables, used = [], 0
    for s in spans:
        tables.append(tuple(order[used:used + -(-s // block)]))
        used += -(-s // block)
    cache = KVCache(torch.randn(nblocks, block, hkv, dim, generator=gen),
                    torch.randn(nblocks, block, hkv, dim, generator=gen))
    total = sum(lens) + padded
    q, k, v = (torch.randn(total, h, dim, generator=gen) for h in (hq, hkv, hkv))
    slots = [t[p // block] * block + p % block
             for t, c, n in zip(tables, contexts, lens, strict=True) for p in range(c, c + n)]
    cache.k.view(-1, hkv, dim)[slots] = k[:sum(lens)]
    cache.v.view(-1, hkv, dim)[slots] = v[:sum(lens)]
    any_context = any(contexts)
    meta = AttentionMetadata(True, torch.tensor(slots), torch.zeros(1), torch.zeros(1, 1), None, 256,
                             query_lens=tuple(lens), context_lens=tuple(contexts) if any_context else (),
                             context_blocks=tuple(tables) if any_context else ())
    to = lambda t: t.to(device, dtype)  # noqa: E731
    cache = KVCache(to(cache.k), to(cache.v))
    meta.slot_mapping = meta.slot_mapping.to(device)
    return to(q), to(k), to(v), cache, meta
