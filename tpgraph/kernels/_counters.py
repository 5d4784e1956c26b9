"""Arrival counters for kernels whose last-arriving program reduces what the others left (split-K projections,
split-KV attention), so that no second kernel is launched for it.

Each program stores its partial, then counts itself in with an acq_rel atomic; the one that sees the count reach
the number of splits adds the partials in split order (a fixed order: the bits do not depend on arrival) and sets the
counter back to 0 for the next call or graph replay. One int32 buffer per device, shared by those kernels: they run
one after another on one stream, and each leaves its counters at zero (a PDL launch counts in only after its wait).

The kernels must use the buffer from one stream at a time per device (decode runs on one stream): two at once would
share counters, and a reduction that never fires leaves its output unwritten. Split-K projections give the bits of
the separate sum kernel; split-KV attention merges in sequence where the combine kernel sums as a tree, so switching
the flag may change the last bit of attention outputs.

On by default (`TPGRAPH_LAST_SPLIT_REDUCES=0` keeps the separate reduce kernels). Measured on 2xH200 (Llama-3-8B
shape, TP=2, full graphs, PDL on, interleaved: bench/results/2026-11-30_h200x2_session7/run1_pdl_default), it took
3.190 / 3.288 / 3.881 ms a step at batch 1 / 8 / 32 against 3.180 / 3.361 / 3.952 without.
"""

from __future__ import annotations

import os

import torch

from tpgraph.kernels._settings import env_choice

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton never launch these kernels
    triton = None

COUNTER_WORDS = 1 << 16  # int32 words of the buffer (256 KB a device)


def counter_stride() -> int:
    """int32 words from one counter to the next: 1 packs 32 counters in a 128-byte L2 line, so the arrivals of a
    kernel's column blocks (384 atomics on one line for the fused qkv + rope at one row) queue at one L2 slice's
    atomic unit; 32 gives each counter its own line. TPGRAPH_COUNTER_STRIDE (1 or 32; read once, at import: the
    kernels compile it in)."""
    return env_choice("TPGRAPH_COUNTER_STRIDE", (1, 32), 1)


STRIDE = counter_stride()
MAX_COUNTERS = COUNTER_WORDS // STRIDE
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # one per device, like a library's workspace


def last_split_reduces() -> bool:
    """Whether split kernels reduce in their last-arriving program instead of a second kernel."""
    return os.environ.get("TPGRAPH_LAST_SPLIT_REDUCES", "1") != "0"


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """This device's counters (zero between calls), of which a kernel uses the first `count`. Made on the device's
    first call, which must not be under graph capture, or the buffer would live in the graph's pool."""
    if count > MAX_COUNTERS:
        raise ValueError(f"{count} counters needed: at most {MAX_COUNTERS}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split counters are made on a device's first eager call; run one before capturing")
        _COUNTERS[device] = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


if triton is not None:
    COUNTER_STRIDE = tl.constexpr(STRIDE)

    @triton.jit
    def counter_at(counters_ptr, i):
        """Counter i of the buffer."""
        return counters_ptr + i * COUNTER_STRIDE

    @triton.jit
    def arrived_last(counter_ptr, arrivals):
        """Count this program in, once every thread of it has stored its partial; True in the program that makes the
        count reach `arrivals`: every other partial is then in memory (the acq_rel count orders the reads after)."""
        tl.debug_barrier()
        return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1

    @triton.jit
    def reset_counter(counter_ptr):
        """Zero again, for the next call (graph replays included); by the last program, after its reduction."""
        tl.atomic_xchg(counter_ptr, 0)
