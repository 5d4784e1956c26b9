"""Paged KV cache: fixed-size blocks handed out from a free list, and the per-layer cache tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tpgraph.errors import ConfigError
from tpgraph.model.attention import KVCache

if TYPE_CHECKING:
    from tpgraph.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    """The cache has no free block left (the caller queues or preempts)."""


class BlockAllocator:
    """Hands out block ids first_block .. first_block + num_blocks - 1 (ids below first_block are reserved)."""

    shares_prefixes = False  # (prefix_cache.py's does: a sequence may begin from blocks another computed)

    def __init__(self, num_blocks: int, first_block: int = 0) -> None:
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(first_block + num_blocks - 1, first_block - 1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def match(self, seq: Sequence) -> int:
        """Cached blocks for a new sequence's prefix: none without prefix caching (prefix_cache.py). Returns the
        tokens matched."""
        return 0

    def register(self, seq: Sequence) -> None:
        """Offer a sequence's computed blocks for sharing: nothing to do without prefix caching."""

    def worth_waiting(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Would seq share more blocks by waiting for a running sequence to compute them? Never without prefix
        caching."""
        return False

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, where no block is held (False, nothing changed, where one is): nothing is
        cached without prefix caching."""
        return self.num_free == self.num_blocks


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers (K and V)."""
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
