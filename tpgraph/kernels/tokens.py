"""A decode step's input ids, resolved on the device: rows whose last token was sampled by the step still running
take it from the sampler's output buffer; the others keep the id the host wrote.

This is what lets the engine submit step N+1 before it has read step N's tokens back (overlapped scheduling): the
host never needs the token to launch the step that consumes it. `resolve_input_ids` runs inside the decode graph as
one kernel (a program of at most a few hundred rows); `resolve_input_ids_reference` is the torch sequence it stands
for, used on CPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the reference path
    triton = None


NO_SOURCE = -1  # a row whose input id the host wrote


def resolve_input_ids_reference(ids: torch.Tensor, source: torch.Tensor, sampled: torch.Tensor) -> None:
    """In place: ids[i] = sampled[source[i]] where source[i] is a row (>= 0; NO_SOURCE keeps ids[i])."""
    fresh = sampled[source.clamp(min=0)]
    ids.copy_(torch.where(source >= 0, fresh, ids))


if triton is not None:

    @triton.jit
    def _resolve_kernel(ids_ptr, source_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
        rows = tl.arange(0, BLOCK)
        inside = rows < n
        source = tl.load(source_ptr + rows, mask=inside, other=-1)
        from_gpu = inside & (source >= 0)  # NO_SOURCE (-1): the host's id stays
        fresh = tl.load(sampled_ptr + source, mask=from_gpu, other=0)
        tl.store(ids_ptr + rows, fresh, mask=from_gpu)


def resolve_input_ids(ids: torch.Tensor, source: torch.Tensor, sampled: torch.Tensor, *,
                      use_triton: bool | None = None) -> None:
    """ids [n] int64 (written in place), source [n] int64 (a row of `sampled`, or NO_SOURCE: keep ids[i]),
    sampled [m]."""
    if ids.shape != source.shape or ids.dim() != 1:
        raise ValueError(f"ids {tuple(ids.shape)} and source {tuple(source.shape)} must be the same 1-D shape")
    if ids.dtype != sampled.dtype:
        raise ValueError(f"ids ({ids.dtype}) and sampled ({sampled.dtype}) must share a dtype")
    if not (ids.is_cuda if use_triton is None else use_triton) or triton is None:
        resolve_input_ids_reference(ids, source, sampled)
        return
    n = ids.shape[0]
    if n == 0:
        return
    _resolve_kernel[(1,)](ids, source, sampled, n, BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)
