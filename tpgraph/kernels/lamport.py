"""The all-reduce + residual add + RMSNorm at a Llama layer boundary, fused into the row-parallel projection before it
and the projection after it (decode rows, bf16 models). At TP > 1 opt-in (TPGRAPH_GEMV_ALLREDUCE=1) until it has run
on two GPUs; so far it has run with ranks emulated on one (bench/results/2026-12-01_h200_lamport). At TP=1 there is
nothing to exchange (`solo_channel`): the projection's epilogue adds the residual and stages the norm, so no add +
RMSNorm kernel runs between the projections (173 kernels a step instead of 236). On by default there since the
projection reads the residual before its PDL wait and down takes its own tiles: a whole decode step measured 0.019 ms
faster at batch 1 and 0.067 ms at batch 8 than the plain chain (bench/results/2026-12-01_h200_early_residual, run8);
before that it had measured 0.035-0.04 ms slower (bench/results/2026-12-01_h200_solo).

The row-parallel projection (o_proj, down) makes this rank's partial sums tile by tile. In its epilogue each program
finishes the all-reduce of its own tile (`all_reduce_tile`), 1shot_push style:
- it pushes the tile into slot [phase][this rank] of every peer's channel region (Lamport: a slot holds the sentinel,
  -0.0 bits, until data lands, and data never carries it: -0.0 is pushed as +0.0);
- it polls its own region until every peer's copy of the same tile has landed, sums the ranks in rank order and
  rounds (1shot_push's bits), adds the residual and rounds (the unfused add's bits), and writes the new residual;
- it writes what the next projection needs: h * norm weight (rounded) and the tile's sum of squares per row;
- it re-arms the slots it read (it is their only reader) and advances the phase of its columns (the code does this
  before the local stores above: peers never read those, and this rank's next push comes after the whole kernel).
The projection after it (gate_up, qkv) then runs its plain K loop on h * norm weight and scales its sums by the rows'
1 / RMS, added up from the tiles' squares in a fixed order: y = rstd * (W @ (h * w)), the norm's math in another
rounding order (within bf16 rounding of the unfused path's bits, not equal to them). Anything else that needs the
normalised input makes it from the new residual with the plain RMSNorm kernel (`ReducedNorm.materialize`: the unfused
bits).

So no all-reduce kernel runs between the projections, and every wait is on a peer's data, never on another program of
the same kernel (no grid-wide barrier). Progress does assume what 1shot_push-style kernels assume: a program for tile
t waits for tile t's program on every peer, so when a grid is larger than what fits on the GPU at once (hidden 8192
with 16-wide tiles: 512 programs), both GPUs must dispatch programs in index order, as CUDA does in practice though it
does not promise it. A peer that never pushes (it died, or runs another sequence of calls) ends the poll after the
custom all-reduce's timeout (TPGRAPH_AR_TIMEOUT_S, by %globaltimer; 0 waits forever) with a trap, which ends the
CUDA context with an error. Before it traps, the first program to time out writes rank, the peer it waited for and
its tile into the channel's timeout record (host memory, readable after the trap): for the custom all-reduce's
channel that is its context's record, so its watchdog names the peer as for its own kernels.

Phases: slots rotate through 3 phases, kept per 16-column granule in the region (each granule is written by the one
program that owns it in a call; every call covers all granules, so the phases stay equal across granules and ranks).
A peer is at most one call ahead: it finishes a call only once this rank has pushed it, which this rank does after its
whole previous call (reads and re-arming) is done. So a peer's next push lands in another phase than the one being
read, and the phase being re-armed is not written again before this rank pushes the next call.

A region is PHASES_BYTES of granule phases (int32), then [3 phases][world_size sources][slot_elems] 16-bit elements;
the rows of one push are packed with a row stride of the hidden size. The custom all-reduce allocates it in its
IPC-shared workspace (comm/custom_ar.py); `local_channels` emulates ranks in one process (tests, one-GPU benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpgraph.kernels._rows import WIDE_M, max_rows
from tpgraph.kernels._settings import env_flag
from tpgraph.kernels.norm import rms_norm

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._rounding import round_to, to_dtype
except ImportError:  # CPU-only installs without Triton never push
    triton = None

PHASES = 3
GRANULE = 16  # columns per phase word: every projection tile is whole granules (tl.dot's smallest tile side)
MAX_ROWS = 16  # rows a channel's slots are sized for at MAX_HIDDEN (more fit a narrower hidden: Channel.fits)
MAX_HIDDEN = 8192
PHASES_BYTES = MAX_HIDDEN // GRANULE * 4
SENTINEL_WORD = 0x80008000  # two 16-bit -0.0: what an armed slot holds (the all-reduce kernels' sentinel)
EPILOGUE_ALGO = 4  # the timeout record's algorithm code for this exchange (csrc/ar_context.cu names it)
RECORD_WORDS = 5  # fired, rank, algo, peer, tile
# bf16 only: the staged h * norm weight of a large residual could overflow fp16 where the normalised input would not
DTYPES = (torch.bfloat16,)


def region_bytes(world_size: int, slot_elems: int) -> int:
    """Bytes of one rank's region for slots of `slot_elems` 16-bit elements."""
    return PHASES_BYTES + (PHASES * world_size * slot_elems * 2 + 15) // 16 * 16


@dataclass(frozen=True, eq=False)
class Channel:
    """Where a rank's fused all-reduce pushes and polls: every rank's region base as mapped in this process."""

    # int64 [world_size + 1] on the device the kernels run on: each rank's region base, then the address of the timeout
    # record (int32 fired, rank, algo, peer, tile in host memory mapped for the device; 0: none)
    addrs: torch.Tensor
    rank: int
    world_size: int
    slot_elems: int
    timeout_ns: int = 0  # a poll longer than this traps (0: waits forever)
    keepalive: tuple = field(default=(), repr=False, compare=False)  # local_channels' region tensors

    def fits(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a row-parallel output [rows, hidden] can go through the channel: rows the small-M kernels take
        (32, or 16 with TPGRAPH_GEMV_MAX_M=16) that its slots hold."""
        return (dtype in DTYPES and 0 < rows <= max_rows(2) and hidden <= MAX_HIDDEN and hidden % GRANULE == 0
                and rows * hidden <= self.slot_elems and device == self.addrs.device)

    def takes(self, residual: torch.Tensor) -> bool:
        """Whether a row-parallel output shaped like `residual` (2-D) can go through the channel."""
        return residual.dim() == 2 and self.fits(*residual.shape, residual.dtype, residual.device)


@dataclass(frozen=True, eq=False)
class ReducedNorm:
    """What a fused all-reduce left for the projection after it: residual_out = the sum over ranks + the residual,
    staged = round(residual_out * norm weight), squares [tiles, row tile] = each tile's per-row sum of residual_out^2.
    The normalised input itself, weight * rmsnorm(residual_out), is never stored: a projection takes `staged` and
    scales its sums by the rows' 1 / RMS; `materialize` makes it for anything else."""

    residual_out: torch.Tensor
    staged: torch.Tensor
    squares: torch.Tensor
    tiles: int
    weight: torch.Tensor
    eps: float

    def materialize(self) -> torch.Tensor:
        """weight * rmsnorm(residual_out), as the unfused add + RMSNorm kernel rounds it (one small kernel)."""
        return rms_norm(self.residual_out, self.weight, self.eps)


@dataclass(frozen=True, eq=False)
class PendingProjection:
    """A row-parallel projection not yet run: its input and layer. The all-reduce after it runs it
    (TPCommunicator.all_reduce_add_rmsnorm): with the all-reduce in its epilogue where the fused path applies, else
    plainly, before the all-reduce. The residual given with it must have been written by a kernel launched before
    the one that wrote x (a transformer block's residual predates its branch): the fused projection reads it before
    its PDL wait (gemv.linear_all_reduce_norm's residual_early)."""

    x: torch.Tensor
    layer: torch.nn.Module  # a RowParallelLinear

    def run(self) -> torch.Tensor:
        return self.layer(self.x)


def materialized(x: torch.Tensor | ReducedNorm) -> torch.Tensor:
    return x.materialize() if isinstance(x, ReducedNorm) else x


def pieces_for(tiles: int) -> int:
    """A power of two >= tiles (rows_squares' piece count)."""
    return 1 << max(0, (tiles - 1).bit_length())


def solo_channel(device: torch.device | str) -> Channel:
    """The channel of a single rank (TP=1): nothing crosses a GPU, so it has no region; the projection's epilogue only
    adds the residual and stages the next norm (all_reduce_tile at WS=1). A launch per layer boundary fewer."""
    return Channel(torch.zeros(2, dtype=torch.int64, device=device), 0, 1, WIDE_M * MAX_HIDDEN)  # (no slots to size)


def epilogue_enabled(world_size: int) -> bool:
    """Whether row-parallel projections take the all-reduce (and at TP=1 the residual add) into their epilogue:
    TPGRAPH_GEMV_ALLREDUCE=1 or 0; unset, on at TP=1 only. At TP=1, with the residual read before the PDL wait and
    down's own tiles (the table's "epilogue" entries), a whole step measured 0.019 ms faster at batch 1 and 0.067 ms
    at batch 8 than the plain chain on one H200 (bench/results/2026-12-01_h200_early_residual, run8); at TP > 1 the
    exchange has not run on two GPUs yet."""
    return env_flag("TPGRAPH_GEMV_ALLREDUCE", default=world_size == 1)


def local_channels(world_size: int, slot_elems: int, device: torch.device | str) -> list[Channel]:
    """Channels of `world_size` ranks whose regions all live in this process, on one device: rank r's push writes
    into the others' regions as it would over NVLink. For tests and one-GPU benchmarks, which run the ranks' kernels
    one after another: a rank's projection only completes once every other rank has pushed, so each rank's pushing
    projection must run while the others' data is already there (see tests/unit/test_lamport_gemv.py)."""
    words = region_bytes(world_size, slot_elems) // 4
    regions = []
    for _ in range(world_size):
        region = torch.zeros(words, dtype=torch.int32, device=device)
        region[PHASES_BYTES // 4:] = SENTINEL_WORD - (1 << 32)  # armed: the word's bits as an int32
        regions.append(region)
    # the timeout record: pinned host memory, which a kernel can write (unified addressing) and the host read after
    # a trap has ended the CUDA context; none off the GPU (the interpreter never traps)
    record = torch.zeros(RECORD_WORDS, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
    record_addr = record.data_ptr() if record.is_pinned() else 0
    addrs = torch.tensor([r.data_ptr() for r in regions] + [record_addr], dtype=torch.int64, device=device)
    return [Channel(addrs, rank, world_size, slot_elems, keepalive=(*regions, record)) for rank in range(world_size)]


def timeout_record(channel: Channel) -> dict[str, int] | None:
    """A local channel's timeout record after a trap (fired, rank, algo, peer, tile), or None if none fired."""
    record = next((t for t in channel.keepalive if t.numel() == RECORD_WORDS and t.is_pinned()), None)
    if record is None or not int(record[0]):
        return None
    return dict(zip(("fired", "rank", "algo", "peer", "tile"), (int(v) for v in record), strict=True))


if triton is not None:
    _PHASES = tl.constexpr(PHASES)
    _GRANULE = tl.constexpr(GRANULE)
    _PHASES_BYTES = tl.constexpr(PHASES_BYTES)
    EPILOGUE_CODE = tl.constexpr(EPILOGUE_ALGO)

    @triton.jit
    def _armed(v):
        return v.to(tl.uint16, bitcast=True) == 0x8000

    @triton.jit
    def _rank_sum(own, slots, slot_elems, at, mask, WS: tl.constexpr, RANK: tl.constexpr):
        """(the ranks' tiles summed in rank order in fp32, this rank's own from registers; how many peer elements
        are still the sentinel): one load per peer, all issued before any is counted, past L1. The polls are volatile
        loads (ld.volatile.global: re-read every time, never from L1, in every Triton), not `cache_modifier=".cv"`:
        torch 2.11's Triton 3.6 emitted no ld.global.cv for it (only .cg and plain loads were in the kernel's PTX),
        where 3.9 does."""
        armed = 0
        s = tl.zeros(own.shape, dtype=tl.float32)
        for r in tl.static_range(WS):
            if r == RANK:
                s += own.to(tl.float32)
            else:
                v = tl.load(slots + r * slot_elems + at, mask=mask, other=0.0, volatile=True)
                armed += tl.sum(tl.sum((_armed(v) & mask).to(tl.int32), axis=1), axis=0)
                s += v.to(tl.float32)
        return s, armed

    @triton.jit
    def _now_ns(dep, SOFT_BF16: tl.constexpr):
        """%globaltimer (0 under the interpreter); `dep` orders it after the value it is computed from."""
        if SOFT_BF16:
            t = dep.to(tl.int64) * 0
        else:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                          is_pure=False, pack=1)
        return t

    @triton.jit
    def _trap_after(start, now, timeout_ns, ch_ptr, slots, slot_elems, at, mask, tile, WS: tl.constexpr,
                    RANK: tl.constexpr, SOFT_BF16: tl.constexpr):
        """A peer that never pushes must not hang the GPU: past timeout_ns (0: never) the first program to time out
        records rank, the first peer whose tile is missing, and its tile in the channel's timeout record (host memory,
        read after the trap; csrc/ar_context.cu names it), then the kernel traps."""
        if not SOFT_BF16:
            if (timeout_ns > 0) & (now - start > timeout_ns):
                record = tl.load(ch_ptr + WS)
                if record != 0:
                    peer = -1
                    for r in tl.static_range(WS):  # the lowest peer whose tile is missing
                        if r != RANK:
                            v = tl.load(slots + r * slot_elems + at, mask=mask, other=0.0, volatile=True)
                            missing = tl.sum(tl.sum((_armed(v) & mask).to(tl.int32), axis=1), axis=0)
                            peer = tl.where((peer < 0) & (missing > 0), r, peer)
                    words = record.to(tl.pointer_type(tl.int32), bitcast=True)
                    if tl.atomic_cas(words, 0, 1, sem="relaxed", scope="sys") == 0:
                        tl.store(words + 1, RANK)
                        tl.store(words + 2, EPILOGUE_CODE)
                        tl.store(words + 3, peer)
                        tl.store(words + 4, tile)
                # the record's stores reach host memory before the trap ends the context
                tl.inline_asm_elementwise("fence.sc.sys; trap; mov.u32 $0, 0;", "=r,r", [timeout_ns.to(tl.int32)],
                                          dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def epilogue_inputs(res_ptr, nw_ptr, offs_m, offs_n, m_ok, n_ok, N):
        """all_reduce_tile's residual tile and norm weights, in fp32: the projection loads them before its K loop (or
        its PDL wait: gemv's RES_EARLY), so that they have arrived when its epilogue needs them. Through L2 (.cg):
        before the wait only L2 is sure to hold what other kernels wrote."""
        res = tl.load(res_ptr + offs_m[:, None] * N + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0,
                      cache_modifier=".cg")
        w = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
        return res.to(tl.float32), w.to(tl.float32)

    @triton.jit
    def all_reduce_tile(y, res, w, ch_ptr, rout_ptr, xs_ptr, sq_ptr, tile, offs_m, offs_n, m_ok, n_ok, N, slot_elems,
                        timeout_ns, WS: tl.constexpr, RANK: tl.constexpr, SOFT_BF16: tl.constexpr):
        """A row-parallel projection's finished output tile y [BLOCK_M, BLOCK_N] (columns offs_n, a whole number of
        granules): push it to every peer, wait for theirs, and leave residual_out, staged and squares (see the
        module doc) for its columns, from the residual tile and norm weights `res`, `w` (epilogue_inputs). After the
        PDL wait (the phases and the slots were last touched by the kernels before)."""
        dtype = y.dtype
        mask = m_ok[:, None] & n_ok[None, :]
        at = offs_m[:, None] * N + offs_n[None, :]
        if WS == 1:  # a solo channel: nothing to exchange, only the residual add and the norm's staging
            s = y.to(tl.float32)
        else:
            s = _exchange_tile(y, ch_ptr, at, offs_n, mask, n_ok, slot_elems, timeout_ns, tile, WS, RANK, SOFT_BF16)
        h = round_to(round_to(s, dtype, SOFT_BF16) + res, dtype, SOFT_BF16)
        tl.store(rout_ptr + at, to_dtype(h, dtype, SOFT_BF16), mask=mask)
        tl.store(xs_ptr + at, to_dtype(h * w[None, :], dtype, SOFT_BF16), mask=mask)
        tl.store(sq_ptr + tile * offs_m.shape[0] + offs_m, tl.sum(h * h, axis=1))

    @triton.jit
    def _exchange_tile(y, ch_ptr, at, offs_n, mask, n_ok, slot_elems, timeout_ns, tile, WS: tl.constexpr,
                       RANK: tl.constexpr, SOFT_BF16: tl.constexpr):
        """all_reduce_tile's exchange: push y to every peer, wait for theirs, re-arm what was read and advance the
        phase of these columns -> the ranks' sum in fp32."""
        dtype = y.dtype
        own_base = tl.load(ch_ptr + RANK)
        phases = own_base.to(tl.pointer_type(tl.int32), bitcast=True) + offs_n // _GRANULE  # [BLOCK_N]
        phase = tl.max(tl.load(phases, mask=n_ok, other=0, volatile=True), axis=0)  # one value: all equal
        bits = y.to(tl.uint16, bitcast=True)
        y = tl.where(bits == 0x8000, tl.zeros_like(bits), bits).to(dtype, bitcast=True)  # -0.0 travels as +0.0
        for i in tl.static_range(1, WS):
            r = (RANK + i) % WS
            peer = (tl.load(ch_ptr + r) + _PHASES_BYTES).to(tl.pointer_type(dtype), bitcast=True)
            peer = tl.multiple_of(peer + phase.to(tl.int64) * WS * slot_elems, 16)
            tl.store(peer + RANK * slot_elems + at, y, mask=mask)
        slots = (own_base + _PHASES_BYTES).to(tl.pointer_type(dtype), bitcast=True)
        slots = tl.multiple_of(slots + phase.to(tl.int64) * WS * slot_elems, 16)
        s, armed = _rank_sum(y, slots, slot_elems, at, mask, WS, RANK)
        start = _now_ns(armed, SOFT_BF16)
        while armed > 0:
            s, armed = _rank_sum(y, slots, slot_elems, at, mask, WS, RANK)
            _trap_after(start, _now_ns(armed, SOFT_BF16), timeout_ns, ch_ptr, slots, slot_elems, at, mask, tile, WS,
                        RANK, SOFT_BF16)
        armed_tile = tl.full(y.shape, 0x8000, tl.uint16).to(dtype, bitcast=True)
        for r in tl.static_range(WS):
            if r != RANK:  # re-arm what we read: we are its only reader
                tl.store(slots + r * slot_elems + at, armed_tile, mask=mask)
        tl.store(phases, ((phase + 1) % _PHASES).to(tl.int32) + tl.zeros_like(offs_n), mask=n_ok)
        return s

    @triton.jit
    def rows_squares(sq_ptr, tiles, offs_m, m_ok, BLOCK_M: tl.constexpr, PIECES: tl.constexpr):
        """Rows offs_m's pieces [BLOCK_M, PIECES] of a fused all-reduce's squares [tiles, BLOCK_M] (zeros past
        `tiles`): loaded early, summed by rstd_of where the scale is needed."""
        c = tl.arange(0, PIECES)
        return tl.load(sq_ptr + c[None, :] * BLOCK_M + offs_m[:, None], mask=m_ok[:, None] & (c < tiles)[None, :],
                       other=0.0)

    @triton.jit
    def rstd_of(squares, mean_scale, eps):
        """1 / RMS per row from rows_squares' pieces, added in a fixed order."""
        return tl.rsqrt(tl.sum(squares, axis=1) * mean_scale + eps)
