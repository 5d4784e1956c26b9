"""Attention front end over a paged KV cache: metadata, and the backends that attend (SDPA prefill, paged decode).

K/V reach the cache in the same kernel that rotates them (kernels/rope_store.py); a backend only reads the cache.
Each backend says what it tolerates under CUDA-graph capture, and the attention core is called through
`meta.boundary`, where piecewise capture splits its graphs (attention runs eagerly between them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tpgraph.graphs.captured import call
from tpgraph.graphs.modes import CaptureSupport
from tpgraph.kernels.decode_attention import paged_decode_attention_v2
from tpgraph.kernels.paged_decode import paged_decode_reference
from tpgraph.uploads import to_device


@dataclass
class KVCache:
    """One layer's cache: [num_blocks, block_size, kv_heads, head_dim] for K and for V."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


class AttentionBackend(Protocol):
    name: str
    capture_support: CaptureSupport

    def decode(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [B, Hq, D] (one token per sequence) -> [B, Hq, D], reading seq_lens[b] cached tokens."""

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Chunks of sequences laid out one after another (meta.query_lens), each after meta.context_lens cached
        tokens -> [T, Hq, D]."""


@dataclass
class AttentionMetadata:
    """Describes one forward over a flat token batch.

    Prefill: `query_lens` gives each sequence's new-token count (tokens are laid out sequence after sequence);
    `context_lens` how many of its tokens are cached already (a chunked or resumed prefill; empty: none), read through
    `context_blocks` (each sequence's block ids); tokens past sum(query_lens) are padding. Decode: one token per
    sequence, attending to `seq_lens[b]` cached tokens (the new one included) through `block_tables`; a padded
    row has seq_len 0 and reads nothing. `max_seq_len` bounds seq_lens without reading them (graph-safe grids).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot = block * block_size + offset
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    backend: AttentionBackend
    max_seq_len: int
    query_lens: tuple[int, ...] = ()
    context_lens: tuple[int, ...] = ()
    context_blocks: tuple[tuple[int, ...], ...] = ()
    boundary: Callable[..., Any] = field(default=call)  # piecewise capture ends a graph piece here
    varlen_layout: Any = field(default=None, repr=False, compare=False)  # varlen_prefill's, built at the first layer


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
    out = torch.zeros_like(q)  # padded token rows stay zero
    start = 0
    for i, n in enumerate(meta.query_lens):
        context = meta.context_lens[i] if meta.context_lens else 0
        ks, vs = k[start:start + n], v[start:start + n]
        mask = None
        if context:  # the cached prefix first (its K/V are in the cache), then this chunk; query j sees context + j
            blocks = to_device(meta.context_blocks[i], torch.int64, k.device)  # (queued: no wait for the GPU)
            ks = torch.cat([cache.k[blocks].flatten(0, 1)[:context], ks])
            vs = torch.cat([cache.v[blocks].flatten(0, 1)[:context], vs])
            mask = (torch.arange(context + n, device=q.device)[None, :]
                    <= context + torch.arange(n, device=q.device)[:, None])
        # [H, L, D] layout for SDPA; GQA through enable_gqa (no materialised repeat).
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[start:start + n], ks, vs))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=ks.shape[1] != qs.shape[1])
        out[start:start + n] = o.squeeze(0).transpose(0, 1)
        start += n
    return out


class TritonAttention:
    """Paged decode through the split-KV Triton kernel (grid from shapes and max_seq_len only); prefill through
    `prefill` (varlen FlashAttention where the runner's probe found it usable, else SDPA per sequence)."""

    name = "triton"
    capture_support = CaptureSupport(full_decode=True, piecewise=True)

    def __init__(self, prefill: Callable[..., torch.Tensor] = sdpa_prefill) -> None:
        self.prefill = prefill

    def decode(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention_v2(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale,
                                         max_seq_len=meta.max_seq_len)


class TorchAttention:
    """The plain-torch reference (CPU, and a debugging aid on GPU). Decode reads seq_lens on the host."""

    name = "torch"
    capture_support = CaptureSupport(full_decode=False, piecewise=True,
                                     reason="the torch reference decode reads seq_lens on the host (.tolist())")

    def decode(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_reference(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale)

    prefill = staticmethod(sdpa_prefill)


def attention_backend(use_triton: bool, prefill: Callable[..., torch.Tensor] = sdpa_prefill) -> AttentionBackend:
    return TritonAttention(prefill) if use_triton else TorchAttention()
