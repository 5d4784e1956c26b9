"""The all-reduce of a row-parallel projection, fused into that projection and the one after it (decode rows).

At a Llama layer boundary a row-parallel projection (o_proj, down) makes this rank's partial sums, and the next
column-parallel projection (gate_up, the next layer's qkv) reads weight * rmsnorm(sum over ranks + residual). Here no
all-reduce kernel runs between them:

- the row-parallel GEMV's epilogue pushes each finished output tile into slot [phase][this rank] of every rank's
  channel region (`push_tile`), Lamport style: a slot holds the sentinel (-0.0 bits) until its data lands, and data
  never carries the sentinel (-0.0 is pushed as +0.0);
- the next projection receives in its prologue (`stage_received`): its running programs share the input's pieces,
  poll each rank's slot until no element is the sentinel, sum the ranks in rank order and round (1shot_push's
  bits), add the residual and round (the unfused add's bits), write the new residual, and write h * norm weight and
  the piece's sum of squares to scratch; every program waits for all pieces (a counter), then runs its K loop on
  that scratch exactly as on a plain input. The RMS scale is applied to the finished sums: y = rstd * (W @ (h *
  w)), the norm's math in another rounding order (not the unfused path's bits; within bf16 rounding of them). The
  elementwise work is done once per element, not once per program (every program reading the whole input would
  do it hundreds of times over, on 16 padded rows: measured 3x slower for gate_up on an H200).

Many programs read every slot, so no reader can re-arm it. Slots rotate through 3 phases instead, and the pusher of
a boundary re-arms (fills with the sentinel) the rows its own region used one boundary earlier: their readers have
finished (stream order), and no peer writes that phase again before it has received this rank's next push. The
phase and the rows used live in a control block in device memory, each word written by one kind of kernel and read
by the other, so a graph replays with no host state and no atomics:
    push_phase   read by pushers, written by program 0 of the receiver (= its phase + 1 mod 3)
    recv_phase   read by receivers, written by program 0 of the pusher (= its push_phase)
    rows_used[3] rows pushed in each phase, written by program 0 of the pusher, read by the next pusher to re-arm.
Every push must be received exactly once, by a projection (`ReducedNorm.take`) or by `materialize` (the final
norm, or a projection whose tiles cannot take it), before the next push.

A region is CONTROL_BYTES, then [3 phases][world_size sources][slot_elems] 16-bit elements; rows of one push are
packed with a row stride of the hidden size. The custom all-reduce allocates it in its IPC-shared workspace
(comm/custom_ar.py); tests emulate ranks with one region per rank in one process (the kernels take addresses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpgraph.kernels._pdl import pdl_launch, use_pdl
from tpgraph.kernels._rounding import soft_bf16_rounding

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._pdl import pdl_enter
    from tpgraph.kernels._rounding import round_to, to_dtype
except ImportError:  # CPU-only installs without Triton never push
    triton = None

CONTROL_BYTES = 256
PHASES = 3
SENTINEL_WORD = 0x80008000  # two 16-bit -0.0: what an armed slot holds (the all-reduce kernels' sentinel)
MAX_ROWS = 16  # the small-M projections' rows
PIECE = 512  # columns of a received row one program stages at a time (stage_received)
DTYPES = (torch.bfloat16, torch.float16)
# control block words (int32)
PUSH_PHASE, RECV_PHASE, ROWS_USED = 0, 1, 2
TICKET, READY = 16, 32  # a receive's counters (stage_received), each in its own 64-byte sector


def region_bytes(world_size: int, slot_elems: int) -> int:
    """Bytes of one rank's region for slots of `slot_elems` 16-bit elements."""
    return CONTROL_BYTES + (PHASES * world_size * slot_elems * 2 + 15) // 16 * 16


@dataclass(frozen=True)
class Channel:
    """Where a rank's fused all-reduce pushes and polls: every rank's region base as mapped in this process."""

    addrs: torch.Tensor  # int64 [world_size] on the device the kernels run on
    rank: int
    world_size: int
    slot_elems: int
    keepalive: tuple = field(default=(), repr=False, compare=False)  # local_channels' region tensors

    def fits(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a row-parallel output [rows, hidden] can go through the channel."""
        return (dtype in DTYPES and 0 < rows <= MAX_ROWS and rows * hidden <= self.slot_elems and hidden % 8 == 0
                and device == self.addrs.device)


@dataclass
class Pushed:
    """A row-parallel projection's output [rows, hidden], pushed to every rank and not yet reduced."""

    channel: Channel
    rows: int
    hidden: int
    dtype: torch.dtype


@dataclass
class ReducedNorm:
    """weight * rmsnorm(sum over ranks of `pushed` + residual), still to be made: by the prologue of the projection
    that takes it, or by `materialize`. Whichever makes it writes the new residual (sum + residual) to
    residual_out. Exactly one of them must (the channel's phases count on one receive per push)."""

    pushed: Pushed
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor
    taken: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.residual.shape

    def take(self) -> ReducedNorm:
        if self.taken:
            raise RuntimeError("a pushed all-reduce was received twice; each push has exactly one receiver")
        self.taken = True
        return self

    def materialize(self) -> torch.Tensor:
        """The normalised input as a tensor (one small kernel: receive, add, RMSNorm)."""
        self.take()
        return _receive_norm(self)


def local_channels(world_size: int, slot_elems: int, device: torch.device | str) -> list[Channel]:
    """Channels of `world_size` ranks whose regions all live in this process, on one device: rank r's push writes
    into the others' regions as it would over NVLink. For tests and one-GPU benchmarks, which run the ranks' kernels
    one after another (every push, then every receive): a receive only waits for data already there."""
    words = region_bytes(world_size, slot_elems) // 4
    regions = []
    for _ in range(world_size):
        region = torch.zeros(words, dtype=torch.int32, device=device)
        region[CONTROL_BYTES // 4:] = SENTINEL_WORD - (1 << 32)  # armed: the word's bits as an int32
        regions.append(region)
    addrs = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64, device=device)
    return [Channel(addrs, rank, world_size, slot_elems, keepalive=tuple(regions)) for rank in range(world_size)]


def materialized(x: torch.Tensor | ReducedNorm) -> torch.Tensor:
    return x.materialize() if isinstance(x, ReducedNorm) else x


if triton is not None:
    _CONTROL_BYTES = tl.constexpr(CONTROL_BYTES)
    _PHASES = tl.constexpr(PHASES)
    _PUSH_PHASE = tl.constexpr(PUSH_PHASE)
    _RECV_PHASE = tl.constexpr(RECV_PHASE)
    _ROWS_USED = tl.constexpr(ROWS_USED)
    _TICKET, _READY = tl.constexpr(TICKET), tl.constexpr(READY)
    _PIECE = tl.constexpr(PIECE)

    @triton.jit
    def control_block(ch_ptr, RANK: tl.constexpr):
        return tl.load(ch_ptr + RANK).to(tl.pointer_type(tl.int32), bitcast=True)

    @triton.jit
    def phase_slots(ch_ptr, r, phase, slot_elems, WS: tl.constexpr, DTYPE: tl.constexpr):
        """Rank r's region: the first slot (source 0) of `phase`, as a DTYPE pointer."""
        # regions and slots are 16-byte aligned: say so, or the loads and stores would not be vectorised
        base = (tl.load(ch_ptr + r) + _CONTROL_BYTES).to(tl.pointer_type(DTYPE), bitcast=True)
        return tl.multiple_of(base + phase.to(tl.int64) * WS * slot_elems, 16)

    @triton.jit
    def _armed(v):
        return v.to(tl.uint16, bitcast=True) == 0x8000

    @triton.jit
    def _still_armed(slots, slot_elems, at, mask, WS: tl.constexpr):
        """Elements under mask that still hold the sentinel, over every rank's slot: one load per rank, all issued
        before any is counted (one round trip, not WS)."""
        armed = 0
        for r in tl.static_range(WS):
            v = tl.load(slots + r * slot_elems + at, mask=mask, other=0.0, cache_modifier=".cv")
            armed += tl.sum((_armed(v) & mask).to(tl.int32))
        return armed

    @triton.jit
    def wait_landed(slots, slot_elems, at, mask, WS: tl.constexpr):
        """Poll (past L1) until every rank's elements at `at` under mask have landed. Returns 0, which the caller
        must add into what it reads next: a loop of loads whose result is unused has no effect the compiler must
        keep, and it would delete the wait."""
        armed = _still_armed(slots, slot_elems, at, mask, WS)
        while armed > 0:
            armed = _still_armed(slots, slot_elems, at, mask, WS)
        return armed

    @triton.jit
    def receive_phase(ch_ptr, RANK: tl.constexpr):
        """The phase this receive reads (after the PDL wait: the pusher before wrote it)."""
        return tl.load(control_block(ch_ptr, RANK) + _RECV_PHASE, volatile=True)

    @triton.jit
    def finish_receive(ch_ptr, phase, is_first, RANK: tl.constexpr):
        """Program 0 of a receiver: the next push goes to the next phase."""
        if is_first:
            tl.store(control_block(ch_ptr, RANK) + _PUSH_PHASE, (phase + 1) % _PHASES)

    @triton.jit
    def _load_acquire(ptr, SOFT_BF16: tl.constexpr):
        """An int32 load with acquire semantics at GPU scope, in every thread (what other programs released before
        it is visible to this thread's later reads); the interpreter runs programs one at a time: a plain load."""
        if SOFT_BF16:
            v = tl.load(ptr, volatile=True)
        else:
            v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                          is_pure=False, pack=1)
        return v

    @triton.jit
    def _landed_sum(slots, slot_elems, at, mask, WS: tl.constexpr):
        """(the ranks' values at `at` summed in rank order in fp32, how many are still the sentinel): one load per
        rank, all issued before any is counted, past L1."""
        v = tl.load(slots + at, mask=mask, other=0.0, cache_modifier=".cv")
        armed = tl.sum((_armed(v) & mask).to(tl.int32))
        s = v.to(tl.float32)
        for r in tl.static_range(1, WS):
            v = tl.load(slots + r * slot_elems + at, mask=mask, other=0.0, cache_modifier=".cv")
            armed += tl.sum((_armed(v) & mask).to(tl.int32))
            s += v.to(tl.float32)
        return s, armed

    @triton.jit
    def stage_received(ch_ptr, phase, res_ptr, stride_rm, nw_ptr, rout_ptr, xs_ptr, sq_ptr, M, H, slot_elems,
                       WS: tl.constexpr, RANK: tl.constexpr, SOFT_BF16: tl.constexpr):
        """A receiving projection's prologue, every program (after the PDL wait): the programs that are running take
        tickets for the input's pieces (row, PIECE columns) until none is left; for each, poll until every rank's
        slot has landed, then write h = round(round(sum of the ranks, rank order) + residual) to rout (the new
        residual), round(h * norm weight) to xs [M, H] (what the K loop then reads, as it reads a plain input) and
        the piece's sum of h^2 to sq [M, pieces per row]; then count the piece in (release). Then every program
        waits (acquire) for all pieces. Only running programs take tickets, so no program waits for one that is not
        resident. The counters (ticket, ready: control block words) are zero on entry: the push before this receive
        set them back (finish_push). Returns 0, which the caller adds into its loop bounds (see wait_landed)."""
        dtype = res_ptr.dtype.element_ty
        slots = phase_slots(ch_ptr, RANK, phase, slot_elems, WS, dtype)
        ctr_ptr = control_block(ch_ptr, RANK)
        per_row = tl.cdiv(H, _PIECE)
        pieces = M * per_row
        t = tl.atomic_add(ctr_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
        while t < pieces:
            row = t // per_row
            cols = (t % per_row) * _PIECE + tl.arange(0, _PIECE)
            ok = cols < H
            res_at = row * stride_rm + cols
            # the residual and the norm weight first: their latency then hides in the poll's
            res = tl.load(res_ptr + res_at, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            at = row * H + cols
            s, armed = _landed_sum(slots, slot_elems, at, ok, WS)
            while armed > 0:
                s, armed = _landed_sum(slots, slot_elems, at, ok, WS)
            h = round_to(round_to(s, dtype, SOFT_BF16) + res, dtype, SOFT_BF16)
            tl.store(rout_ptr + res_at, to_dtype(h, dtype, SOFT_BF16), mask=ok)
            tl.store(xs_ptr + at, to_dtype(h * w, dtype, SOFT_BF16), mask=ok)
            tl.store(sq_ptr + t, tl.sum(h * h, axis=0))
            tl.debug_barrier()  # every thread's stores, then the release count (as arrived_last)
            tl.atomic_add(ctr_ptr + _READY, 1, sem="release", scope="gpu")
            t = tl.atomic_add(ctr_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
        ready = _load_acquire(ctr_ptr + _READY, SOFT_BF16)
        while ready < pieces:
            ready = _load_acquire(ctr_ptr + _READY, SOFT_BF16)
        return ready - pieces

    @triton.jit
    def rows_rstd(sq_ptr, offs_m, m_ok, H, mean_scale, eps, PIECES: tl.constexpr):
        """1 / RMS of the received rows offs_m: their pieces' sums of squares added in piece order (PIECES: a power
        of two, at least the pieces of a row)."""
        c = tl.arange(0, PIECES)
        per_row = tl.cdiv(H, _PIECE)
        sq = tl.load(sq_ptr + offs_m[:, None] * per_row + c[None, :], mask=m_ok[:, None] & (c < per_row)[None, :],
                     other=0.0, cache_modifier=".cg")
        return tl.rsqrt(tl.sum(sq, axis=1) * mean_scale + eps)

    @triton.jit
    def push_tile(y, ch_ptr, offs_m, offs_n, tile_ok, N, slot_elems, WS: tl.constexpr, RANK: tl.constexpr):
        """Store a finished output tile y [BLOCK_M, BLOCK_N] (16-bit) into slot [push phase][RANK] of every rank's
        region, peers first. -0.0 goes as +0.0: the sentinel never travels as data."""
        phase = tl.load(control_block(ch_ptr, RANK) + _PUSH_PHASE, volatile=True)
        bits = y.to(tl.uint16, bitcast=True)
        y = tl.where(bits == 0x8000, tl.zeros_like(bits), bits).to(y.dtype, bitcast=True)
        at = offs_m[:, None] * N + offs_n[None, :] + RANK * slot_elems
        for i in tl.static_range(1, WS + 1):
            r = (RANK + i) % WS
            tl.store(phase_slots(ch_ptr, r, phase, slot_elems, WS, y.dtype) + at, y, mask=tile_ok)

    @triton.jit
    def finish_push(ch_ptr, prog, nprogs, M, N, slot_elems, WS: tl.constexpr, RANK: tl.constexpr,
                    DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        """Every program of a pusher, after its wait: re-arm this program's share of the rows this rank's region
        took one boundary ago (their readers are done). Program 0 hands its phase to the receiver, records the rows
        it pushed, and sets the receive counters back to 0 for this push's receiver (the last receive
        that counted on them has finished)."""
        ctrl = control_block(ch_ptr, RANK)
        phase = tl.load(ctrl + _PUSH_PHASE, volatile=True)
        old = (phase + _PHASES - 1) % _PHASES
        used = tl.load(ctrl + _ROWS_USED + old, volatile=True) * N
        slots = phase_slots(ch_ptr, RANK, old, slot_elems, WS, DTYPE)
        armed = tl.full((BLOCK,), 0x8000, tl.uint16).to(DTYPE, bitcast=True)
        for src in tl.static_range(WS):
            for start in range(prog * BLOCK, used, nprogs * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(slots + src * slot_elems + offs, armed, mask=offs < used)
        if prog == 0:
            tl.store(ctrl + _RECV_PHASE, phase)
            tl.store(ctrl + _ROWS_USED + phase, M)
            tl.store(ctrl + _TICKET, 0)
            tl.store(ctrl + _READY, 0)

    @triton.jit
    def _receive_norm_kernel(ch_ptr, res_ptr, nw_ptr, out_ptr, rout_ptr, H, slot_elems, eps, mean_scale,
                             WS: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
                             MEAN_BY_DIV: tl.constexpr, PDL: tl.constexpr):
        """One row per program: the received sum + residual (to rout), then the norm rounded as norm.py's kernel
        rounds it (so this path has the unfused path's bits up to the order of the squares' sum)."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        dtype = res_ptr.dtype.element_ty
        phase = receive_phase(ch_ptr, RANK)
        slots = phase_slots(ch_ptr, RANK, phase, slot_elems, WS, dtype)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        at = row * H + offs
        at += wait_landed(slots, slot_elems, at, ok, WS)  # (+ 0: keeps the wait, see wait_landed)
        s = tl.load(slots + at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        for r in tl.static_range(1, WS):
            s += tl.load(slots + r * slot_elems + at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        res = tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32)
        h = round_to(round_to(s, dtype, SOFT_BF16) + res, dtype, SOFT_BF16)
        tl.store(rout_ptr + at, to_dtype(h, dtype, SOFT_BF16), mask=ok)
        total = tl.sum(h * h, axis=0)
        if MEAN_BY_DIV:
            var = tl.div_rn(total, mean_scale)
        else:
            var = total * mean_scale
        normed = round_to(h * tl.rsqrt(var + eps), dtype, SOFT_BF16)
        w = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, to_dtype(w * normed, dtype, SOFT_BF16), mask=ok)
        finish_receive(ch_ptr, phase, row == 0, RANK)


def mean_scale(hidden: int, device: torch.device) -> tuple[float, bool]:
    """(scale, by_div): torch's mean is sum / H on CPU and sum * fl(1/H) on CUDA (norm.py copies whichever)."""
    import numpy as np

    by_div = device.type != "cuda"
    return (float(hidden) if by_div else float(np.float32(1.0) / np.float32(hidden))), by_div


def _receive_norm(r: ReducedNorm) -> torch.Tensor:
    ch, res = r.pushed.channel, r.residual
    rows, hidden = res.shape
    out = torch.empty_like(res)
    scale, by_div = mean_scale(hidden, res.device)
    pdl = use_pdl(res)
    _receive_norm_kernel[(rows,)](
        ch.addrs, res, r.weight, out, r.residual_out, hidden, ch.slot_elems, r.eps, scale, WS=ch.world_size,
        RANK=ch.rank, BLOCK=triton.next_power_of_2(hidden), SOFT_BF16=soft_bf16_rounding(res), MEAN_BY_DIV=by_div,
        PDL=pdl, num_warps=4 if hidden <= 1024 else 8, enable_fp_fusion=False, **pdl_launch(pdl))
    return out


def reduced_norm(pushed: Pushed, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> ReducedNorm:
    """The receive side of a push, to be made by whoever takes it (see ReducedNorm)."""
    if residual.shape != (pushed.rows, pushed.hidden) or residual.dtype != pushed.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match the pushed "
                         f"[{pushed.rows}, {pushed.hidden}] {pushed.dtype}")
    residual = residual.contiguous()
    return ReducedNorm(pushed, residual, weight.contiguous(), eps, torch.empty_like(residual))


def pieces_per_row(hidden: int) -> int:
    """stage_received's pieces of a row, as the power of two rows_rstd's tile takes."""
    return 1 << max(0, (-(-hidden // PIECE) - 1).bit_length())
