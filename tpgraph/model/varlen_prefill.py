"""Prefill attention in one varlen FlashAttention call a layer (torch.nn.attention.varlen) for every sequence of the
forward at once (a few calls when the cached prefixes to read back are long, see GATHER_MAX_TOKENS).

The per-sequence SDPA loop (attention.sdpa_prefill) costs host time for each sequence in each layer, and on Hopper
SDPA picks cuDNN, which plans each new (query, key) length the first time it sees it: tens of milliseconds that a
request with a new prompt length pays in its time to first token. The varlen call has neither cost: the sequences'
lengths travel as cumulative offsets, GQA is native, and causal masking is aligned to each sequence's end, so a
chunk that continues a cached prefix attends to the prefix and to itself in the same call. Its keys and values are
every sequence's whole span read back from the paged cache (the chunk's own K/V are already there: rope_store
wrote them), or, when no sequence has a cached prefix, the chunk's K/V as they are.

`varlen_attn` is new in torch and its keywords moved between releases (is_causal, then window_size; enable_gqa), so
`probe` calls it once on a small case with a cached prefix and GQA and compares it with the SDPA loop; the engine
uses it only where that agrees (`prefill_attention`), and says which one it runs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tpgraph.kernels._settings import env_flag
from tpgraph.uploads import to_device, to_device_parts

if TYPE_CHECKING:
    from tpgraph.model.attention import AttentionMetadata, KVCache

Prefill = Callable[..., torch.Tensor]


# keys gathered from the cache per varlen call: the gather is a transient copy the start-up memory profile (a prefill
# without cached prefixes) does not see, so sequences are split into calls of at most this many keys (one longer
# sequence alone): 64 MiB of K and V for Llama-3-8B at TP=1
GATHER_MAX_TOKENS = 16384


@dataclass(frozen=True)
class VarlenCall:
    """One varlen call: query rows [start, end) of the forward, their sequences' offsets, and where their keys are."""

    start: int
    end: int
    cu_q: torch.Tensor  # [N + 1] int32 query offsets
    cu_k: torch.Tensor  # [N + 1] int32 key offsets
    max_q: int
    max_k: int
    k_slots: torch.Tensor | None  # int64 flat cache slots, each sequence's prefix then its chunk (None: k/v as given)


@dataclass(frozen=True)
class VarlenLayout:
    """One prefill forward's sequences as varlen calls, built once and shared by every layer."""

    query_lens: tuple[int, ...]  # the metadata it was built from (identity decides reuse)
    context_lens: tuple[int, ...]
    total: int
    calls: tuple[VarlenCall, ...]


def _groups(spans: list[int], gathered: bool) -> list[range]:
    """Consecutive sequences per call: all in one without a gather, else at most GATHER_MAX_TOKENS keys a call."""
    if not gathered:
        return [range(len(spans))]
    groups, start, keys = [], 0, 0
    for i, span in enumerate(spans):
        if i > start and keys + span > GATHER_MAX_TOKENS:
            groups.append(range(start, i))
            start, keys = i, 0
        keys += span
    return [*groups, range(start, len(spans))]


def build_layout(meta: AttentionMetadata, block_size: int, device: torch.device) -> VarlenLayout:
    lens = meta.query_lens
    contexts = meta.context_lens or (0,) * len(lens)
    spans = [c + n for c, n in zip(contexts, lens, strict=True)]
    starts = np.cumsum((0, *lens))
    calls = []
    for group in _groups(spans, bool(meta.context_lens)):
        g_lens, g_spans = [lens[i] for i in group], [spans[i] for i in group]
        slots = None
        if meta.context_lens:  # keys and values from the cache: each sequence's positions [0, context + n)
            parts = []
            for i in group:
                positions = np.arange(spans[i])
                parts.append(np.asarray(meta.context_blocks[i], dtype=np.int64)[positions // block_size]
                             * block_size + positions % block_size)
            slots = to_device(np.concatenate(parts), torch.int64, device)
        cu_q, cu_k = to_device_parts([np.cumsum((0, *g_lens)).tolist(), np.cumsum((0, *g_spans)).tolist()],
                                     torch.int32, device)
        calls.append(VarlenCall(int(starts[group.start]), int(starts[group.stop]), cu_q, cu_k, max(g_lens),
                                max(g_spans), slots))
    return VarlenLayout(lens, meta.context_lens, int(starts[-1]), tuple(calls))


def layout_for(meta: AttentionMetadata, block_size: int, device: torch.device) -> VarlenLayout:
    """The forward's layout: built at its first layer, reused by the rest (the runner gives each forward new tuples,
    so identity tells a new forward from the same one)."""
    layout = meta.varlen_layout
    if layout is None or layout.query_lens is not meta.query_lens or layout.context_lens is not meta.context_lens:
        layout = meta.varlen_layout = build_layout(meta, block_size, device)
    return layout


@functools.cache
def _keywords(causal_gqa: bool, scale: float, head_dim: int) -> dict[str, Any] | None:
    """varlen_attn's keywords for causal attention (with GQA when `causal_gqa`) in the installed torch; None when it
    cannot express it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = causal_gqa
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - head_dim ** -0.5) > 1e-12:
        return None
    return kwargs


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                   scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (T may be padded past sum(query_lens)) -> [T, Hq, D], padding rows zero."""
    from torch.nn.attention.varlen import varlen_attn

    if not meta.query_lens:  # padding rows only (piecewise capture runs the pieces around attention this way)
        return q.new_zeros(q.shape)
    layout = layout_for(meta, cache.block_size, q.device)
    total = layout.total
    kwargs = _keywords(q.shape[1] != k.shape[1], scale, q.shape[2])
    # one call over every row: its output is the answer; else each call's goes into place (one piece alive at a time)
    out = None if len(layout.calls) == 1 and total == q.shape[0] else q.new_zeros(q.shape)
    for call in layout.calls:
        if call.k_slots is not None:
            keys = cache.k.view(-1, *cache.k.shape[2:])[call.k_slots]
            values = cache.v.view(-1, *cache.v.shape[2:])[call.k_slots]
        else:
            keys, values = k[call.start:call.end], v[call.start:call.end]
        piece = varlen_attn(q[call.start:call.end], keys, values, call.cu_q, call.cu_k, call.max_q, call.max_k,
                            **kwargs)
        if out is None:
            return piece
        out[call.start:call.end] = piece
    return out


def probe(reference: Prefill, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
          head_dim: int) -> str | None:
    """Run varlen_prefill on a small case (two sequences, one continuing a cached prefix, this model's head counts)
    and compare it with `reference`. Returns None where it agrees, else why it cannot be used."""
    from tpgraph.model.attention import AttentionMetadata, KVCache

    if device.type != "cuda":
        return "FlashAttention runs on CUDA only"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention does not take {dtype}"
    if _keywords(num_heads != num_kv_heads, head_dim ** -0.5, head_dim) is None:
        return f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"
    block, lens, contexts = 16, (37, 20), (0, 45)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    cache = KVCache(rand(8, block, num_kv_heads, head_dim), rand(8, block, num_kv_heads, head_dim))
    blocks = ((0, 1, 2), (3, 4, 5, 6, 7))
    slots = [b[p // block] * block + p % block for b, c, n in zip(blocks, contexts, lens, strict=True)
             for p in range(c, c + n)]
    q, k, v = rand(64, num_heads, head_dim), rand(64, num_kv_heads, head_dim), rand(64, num_kv_heads, head_dim)
    flat_k, flat_v = cache.k.view(-1, num_kv_heads, head_dim), cache.v.view(-1, num_kv_heads, head_dim)
    flat_k[slots], flat_v[slots] = k[:57], v[:57]  # as rope_store leaves the cache
    meta = AttentionMetadata(True, torch.tensor(slots, device=device), torch.zeros(1, device=device),
                             torch.zeros(1, 1, device=device), None, 128,  # type: ignore[arg-type]
                             query_lens=lens, context_lens=contexts, context_blocks=blocks)
    layout_for(meta, block, device)  # ours, outside the try: a bug in it raises rather than reading as "no varlen"
    try:
        got = varlen_prefill(q, k, v, cache, meta, head_dim ** -0.5)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"varlen_attn failed on a probe: {type(e).__name__}: {str(e)[:200]}"
    want = reference(q, k, v, cache, meta, head_dim ** -0.5)
    err = (got.float() - want.float()).abs().max().item()
    if not err <= 2e-2:
        return f"varlen_attn differs from SDPA on a probe (max abs error {err:.3g})"
    return None


def prefill_attention(reference: Prefill, device: torch.device, dtype: torch.dtype, num_heads: int,
                      num_kv_heads: int, head_dim: int) -> tuple[Prefill, str]:
    """The prefill attention to run here and its name: varlen FlashAttention where the probe agrees, else
    `reference` (the per-sequence SDPA loop), with the reason. TPGRAPH_VARLEN_PREFILL=0 keeps the reference."""
    if not env_flag("TPGRAPH_VARLEN_PREFILL", True):
        return reference, "SDPA per sequence (TPGRAPH_VARLEN_PREFILL=0)"
    why = probe(reference, device, dtype, num_heads, num_kv_heads, head_dim)
    if why is None:
        return varlen_prefill, "varlen FlashAttention"
    return reference, f"SDPA per sequence ({why})"
