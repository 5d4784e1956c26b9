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

import math
from collections.abc import Callable

import torch

from tpgraph.kernels._settings import env_flag, triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton never launch these kernels
    triton = None

MAX_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # one per device, like a library's workspace


def last_split_reduces() -> bool:
    """Whether split kernels reduce in their last-arriving program instead of a second kernel."""
    return env_flag("TPGRAPH_LAST_SPLIT_REDUCES", default=True)


def _indexed(device: torch.device) -> torch.device:
    """The device with its index ("cuda" is the current one), as the buffers are keyed."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def _held(buffers: dict[torch.device, torch.Tensor], device: torch.device, what: str,
          make: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
    """buffers[device], made on the device's first call, which must not be under graph capture, or the buffer would
    live in the graph's pool."""
    device = _indexed(device)
    if device not in buffers:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what}: made on a device's first eager call; run one before capturing")
        buffers[device] = make(device)
    return buffers[device]


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """This device's counters (zero between calls), of which a kernel uses the first `count`."""
    if count > MAX_COUNTERS:
        raise ValueError(f"{count} counters needed: at most {MAX_COUNTERS}")
    return _held(_COUNTERS, device, "the split counters",
                 lambda d: torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=d))


# Polled partials (`polled_partials`): a split-K kernel's partials go into one sentinel-filled fp32 buffer per device,
# and a fixed program of each reduction (the last split, dispatched after its partners) polls them until none holds the
# sentinel, instead of the last-arriving program learning it from an acq_rel count: after the K loop that saves the
# wait for the partial's store and the count's round trip (bench/results/2026-12-02_h200_read_ceiling: the count and
# the reduction cost qkv 1.0 and down 1.6 µs alone). The reducer sets the slots back to the sentinel. It cannot wait
# forever on a partner that never started: a partner has a lower block index, and the GPU starts blocks in index order
# (not a documented guarantee; CUB's decoupled look-back leans on the same), and partners never wait.
PARTIAL_SENTINEL = 0x7FBADBAD  # a signalling NaN (quiet bit clear): IEEE arithmetic never makes one
PARTIAL_WORDS = 1 << 21  # fp32 words (8 MB a device); a launch needing more keeps the count
# polls before a reducer traps rather than hang the GPU (seconds; its partners never wait); under the interpreter,
# where the programs run one after another, a partner has always finished, and a missing one is a bug to fail fast on
POLL_LIMIT = 4 if triton_interpreting() else 1 << 24
_PARTIALS: dict[torch.device, torch.Tensor] = {}


def polled_partials() -> bool:
    """Whether the split-K projections of gemv._gemv_kernel reduce by polling sentinel slots (see above), where their
    partials fit the buffer; TPGRAPH_POLLED_PARTIALS=0 keeps the acq_rel count. On by default: whole TP=1 steps on one
    H200 at a TP=2 rank's Llama-3-8B shape (bench/results/2026-12-02_h200_polled_default, run2) took 2.365 against
    2.379 ms at batch 1, 2.598 against 2.647 at batch 8, and no more than the count at any of the batches timed (1, 2,
    4, 8, 16, 24, 32); HF parity held with it at 3 and 24 rows. TP=2 is untimed."""
    return env_flag("TPGRAPH_POLLED_PARTIALS", default=True)


POLLED_ROPE_ROWS = range(2, 17)  # where polling the qkv + rope kernel's heads paid (polled_rope)


def polled_rope(rows: int) -> bool:
    """Whether the qkv + rope kernel's head reducer polls its head's partials (with polled partials on) instead of
    the last of them arriving by a count: by default at 2-16 rows. Whole TP=1 steps on one H200 at a TP=2 rank's
    Llama-3-8B shape (qkv 3072 x 4096 in 32-column tiles, 4 splits: 16 partials a head) took 0.010, 0.015 and 0.031 ms
    less at batches 2, 8 and 16, but 0.006 more at batch 1 and 0.082 more at batch 32, where a head's poll reads 64 KB
    (bench/results/2026-12-02_h200_polled_default, run4). Untimed: the batches between, other shapes' tiles, TP=2.
    TPGRAPH_POLLED_ROPE=1 polls at every row count, =0 at none."""
    return polled_partials() and env_flag("TPGRAPH_POLLED_ROPE", default=rows in POLLED_ROPE_ROWS)


def polled_attention() -> bool:
    """TPGRAPH_POLLED_ATTENTION=1 (with polled partials on): split-KV decode attention's last split in use merges its
    partners' partials by polling the sentinel buffer instead of arriving last by a count
    (decode_attention._polled_combine_group). Opt-in: whole TP=1 steps on one H200 at a TP=2 rank's Llama-3-8B shape,
    512 tokens, against the count (bench/results/2026-12-03_h200_polled_attention_fix, run5) took 0.060 ms more at
    batch 1, 0.015 less at batch 8 and the same at batch 32."""
    return polled_partials() and env_flag("TPGRAPH_POLLED_ATTENTION")


def partials_buffer(device: torch.device, numel: int) -> torch.Tensor | None:
    """This device's sentinel-filled fp32 partials buffer (at least numel words), or None where numel does not fit.
    Made on the device's first call, which must not be under graph capture."""
    if numel > PARTIAL_WORDS:
        return None
    return _held(_PARTIALS, device, "the partials buffer", lambda d: torch.full(
        (PARTIAL_WORDS,), PARTIAL_SENTINEL, dtype=torch.int32, device=d).view(torch.float32))


def split_workspace(partials: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A split kernel's fp32 partials of `shape`: a view of the sentinel-filled buffer where the caller took one
    (`partials_buffer`, to poll), else fresh memory. torch.empty is capturable: under CUDA graph capture it comes
    from the graph's pool."""
    if partials is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return partials[:math.prod(shape)].view(shape)


def workspace_bytes(device: torch.device) -> int:
    """Bytes this module holds on the device (the arrival counters, the polled partials' buffer), for the memory log."""
    device = _indexed(device)
    return sum(t.numel() * t.element_size() for held in (_COUNTERS, _PARTIALS) if (t := held.get(device)) is not None)


if triton is not None:
    SENTINEL_BITS = tl.constexpr(PARTIAL_SENTINEL)
    POLL_LIMIT_C = tl.constexpr(POLL_LIMIT)

    @triton.jit
    def is_sentinel(v):
        """Which of v's fp32 elements hold the sentinel."""
        return v.to(tl.int32, bitcast=True) == SENTINEL_BITS

    @triton.jit
    def unfilled(stale, ok):
        """How many of the tile's elements (where ok) are marked stale (is_sentinel, or-ed over the partials)."""
        return tl.sum(tl.sum(tl.where(ok & stale, 1, 0), axis=1), axis=0)

    @triton.jit
    def sentinel_like(v):
        """The sentinel in v's shape, as fp32."""
        return tl.full(v.shape, SENTINEL_BITS, tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def poll_exhausted(missing, tries):
        """Trap (the CUDA context ends with an error) once a reducer has polled POLL_LIMIT times and a partner's
        partial is still missing: its partners never wait, so that is a bug, and a hang would be worse."""
        if (missing > 0) & (tries >= POLL_LIMIT_C):  # (the interpreter cannot run the trap: it raises instead)
            tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r,r", [tries], dtype=tl.int32, is_pure=False, pack=1)

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
