"""Random paged-decode problems shared by the CPU (interpreted) and GPU kernel tests."""

from __future__ import annotations

import torch


def random_paged_case(seed: int, device: str, dtype: torch.dtype, max_batch: int = 5, max_len: int = 70):
    """Random batch size, context lengths (often not a multiple of the block size, sometimes 0 for a padded
    row), head layout (MHA, GQA, MQA; head_dim 64/80/128) and a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]
    batch = int(torch.randint(1, max_batch + 1, (1,), generator=g))
    kv_heads, group = pick([(1, 8), (2, 4), (4, 1), (2, 1), (1, 1)])
    head_dim = pick([64, 80, 128])
    block_size = pick([4, 8, 16])
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    if batch > 1 and seed % 3 == 0:
        seq_lens[-1] = 0  # a padded row
    max_blocks = -(-max_len // block_size)
    num_blocks = batch * max_blocks + 3
    block_tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g)
    to = lambda t: t.to(device=device, dtype=dtype)
    return (to(q), to(k), to(v), block_tables.to(device=device, dtype=torch.int32),
            seq_lens.to(device=device, dtype=torch.int32), head_dim ** -0.5)
