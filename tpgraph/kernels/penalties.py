"""The penalty table's two per-step operations (engine/penalties.py) as one Triton launch each, on CUDA by default
(TPGRAPH_FUSED_PENALTIES=0 keeps the torch ops).

In torch, applying the penalties to a step's rows is a dozen [B, V] kernels (gathering the rows' counts and prompt
marks, the casts, the comparisons, two wheres, the subtractions), and counting the step's ids is index_put_ with
accumulate, which sorts its indices and checks them on the device: 48 kernels and 81 µs for a penalized, sampled row
at Llama-3's vocabulary (bench/results/2026-12-04_h200_fused_sampling). Here a program reads a chunk of a row's
logits with its slot's counts and prompt marks and writes the penalized chunk; and a program per row adds its id.
"""

from __future__ import annotations

import torch

from tpgraph.kernels._alignment import aligned
from tpgraph.kernels._settings import env_flag
from tpgraph.kernels.sampling import chunk_for

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the torch ops
    triton = None


def fused_penalties_enabled() -> bool:
    """Whether the penalty table applies and counts with these kernels on CUDA: yes unless TPGRAPH_FUSED_PENALTIES=0."""
    return env_flag("TPGRAPH_FUSED_PENALTIES", default=True)


if triton is not None:

    @triton.jit
    def _apply_kernel(x_ptr, stride_x, out_ptr, counts_ptr, prompt_ptr, slot_ptr, param_ptr, V, CHUNK: tl.constexpr):
        """Grid (rows, chunks): repetition on tokens seen in the prompt or the output (divided if positive, else
        multiplied), then frequency times the count and presence where counted, as PenaltyTable.apply does."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < V
        slot = tl.load(slot_ptr + row)
        rep = tl.load(param_ptr + row * 3)
        freq = tl.load(param_ptr + row * 3 + 1)
        pres = tl.load(param_ptr + row * 3 + 2)
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        counts = tl.load(counts_ptr + slot * V + offs, mask=ok, other=0).to(tl.float32)
        seen = (tl.load(prompt_ptr + slot * V + offs, mask=ok, other=0) != 0) | (counts > 0)
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts
        tl.store(out_ptr + row * V + offs, x - pres * (counts > 0).to(tl.float32), mask=ok)

    @triton.jit
    def _count_kernel(counts_ptr, slot_ptr, id_ptr, V):
        """A program a row: one more of its id in its slot (an id outside the vocabulary is not counted: torch's
        index_put_ would stop the device with an assertion)."""
        row = tl.program_id(0)
        token = tl.load(id_ptr + row)
        tl.atomic_add(counts_ptr + tl.load(slot_ptr + row) * V + token, 1, mask=(token >= 0) & (token < V))


def apply_rows(x: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, slots: torch.Tensor,
               params: torch.Tensor) -> torch.Tensor:
    """x [B, V] logits (a contiguous last dim), the table's counts [slots, V] int32 and in_prompt [slots, V] bool,
    slots [B] int64, params [B, 3] fp32 (repetition, frequency, presence) -> penalized [B, V] fp32 logits (new)."""
    batch, vocab = x.shape
    if x.stride(-1) != 1 or counts.shape[1] != vocab or params.shape != (batch, 3) or slots.shape != (batch,):
        raise ValueError(f"apply_rows: logits {tuple(x.shape)} (strides {x.stride()}), counts {tuple(counts.shape)}, "
                         f"slots {tuple(slots.shape)}, params {tuple(params.shape)} do not fit")
    out = torch.empty(batch, vocab, dtype=torch.float32, device=x.device)
    if batch and vocab:
        chunk = chunk_for(vocab)  # (sampling's chunks)
        _apply_kernel[(batch, triton.cdiv(vocab, chunk))](x, x.stride(0), out, counts, in_prompt.view(torch.uint8),
                                                          aligned(slots), aligned(params), vocab, CHUNK=chunk,
                                                          num_warps=4)
    return out


def count_rows(counts: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
    """counts[slots[i], ids[i]] += 1 for each row i (slots and ids [B] int64, on counts' device)."""
    if slots.shape != ids.shape or slots.dim() != 1:
        raise ValueError(f"count_rows: slots {tuple(slots.shape)} and ids {tuple(ids.shape)} must be one [B] each")
    if slots.numel():
        _count_kernel[(slots.numel(),)](counts, aligned(slots), aligned(ids), counts.shape[1], num_warps=1)
