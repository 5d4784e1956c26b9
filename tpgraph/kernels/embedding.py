"""The vocab-parallel embedding lookup as one kernel: each rank's rows for the ids in its vocab range, zeros for the
others (the all-reduce after it adds the ranks' rows up).

`vocab_shard_embedding` is a Triton kernel, a program per token; `vocab_shard_embedding_reference` is the torch
sequence it replaces (id - start, a range mask, a masked embedding lookup, the mask applied to the rows: about seven
small kernels per step at TP > 1, each a launch in the decode graph's chain). Both copy rows exactly: the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpgraph.kernels._pdl import pdl_launch, use_pdl

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._pdl import pdl_enter
except ImportError:  # CPU-only installs without Triton use the reference path
    triton = None

_BLOCK = 1024  # columns per step of a program


def vocab_shard_embedding_reference(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [T] (global vocab ids), weight [rows, H] (this rank's vocab rows from `start`) -> [T, H]: the row of an
    id in range, zeros for the others."""
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


if triton is not None:

    @triton.jit
    def _embedding_kernel(ids_ptr, w_ptr, out_ptr, start, rows, H, stride_w, stride_o, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0)
        local = tl.load(ids_ptr + t) - start
        inside = (local >= 0) & (local < rows)
        row = tl.where(inside, local, 0).to(tl.int64)
        for h0 in range(0, H, BLOCK):
            cols = h0 + tl.arange(0, BLOCK)
            ok = cols < H
            v = tl.load(w_ptr + row * stride_w + cols, mask=ok, other=0.0)  # (an id out of range reads row 0)
            tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, tl.where(inside, v, tl.zeros_like(v)), mask=ok)


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, *,
                          use_triton: bool | None = None) -> torch.Tensor:
    """As vocab_shard_embedding_reference, in one launch where Triton runs (default: CUDA tensors)."""
    if not (ids.is_cuda if use_triton is None else use_triton) or triton is None:
        return vocab_shard_embedding_reference(ids, weight, start)
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"expected weight [rows, H] with unit-stride rows, got {tuple(weight.shape)}")
    if ids.dim() != 1:  # any shape of ids, as F.embedding: the rows come out in that shape
        return vocab_shard_embedding(ids.reshape(-1), weight, start, use_triton=use_triton).view(*ids.shape, -1)
    t, h = ids.shape[0], weight.shape[1]
    out = torch.empty(t, h, dtype=weight.dtype, device=weight.device)
    if t == 0:
        return out
    pdl = use_pdl(weight)
    _embedding_kernel[(t,)](ids.contiguous(), weight, out, start, weight.shape[0], h, weight.stride(0), out.stride(0),
                            BLOCK=min(_BLOCK, triton.next_power_of_2(h)), PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out
