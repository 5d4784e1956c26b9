"""The all-reduce of a row-parallel projection, fused into that projection and the one after it (decode rows).

At a Llama layer boundary a row-parallel projection (o_proj, down) makes this rank's partial sums, and the next
column-parallel projection (gate_up, the next layer's qkv) reads weight * rmsnorm(sum over ranks + residual). Here no
all-reduce kernel runs between them:

- the row-parallel GEMV's epilogue pushes each finished output tile into slot [phase][this rank] of every rank's
  channel region (`push_tile`), Lamport style: a slot holds the sentinel (-0.0 bits) until its data lands, and data
  never carries the sentinel (-0.0 is pushed as +0.0);
- the next projection's K loop loads its input tiles from its own region instead (`received_tile`): it polls each
  rank's slot until no element is the sentinel, sums the ranks in rank order and rounds (1shot_push's bits), adds
  the residual and rounds (the unfused add's bits), and multiplies by the norm weight. Its column block 0 writes
  the new residual. The RMS scale needs the whole row, so each program also sums its K range's squares and the
  scale is applied to the finished sums: y = rstd * (W @ (h * w)). That is the norm's math in another rounding
  order (not the unfused path's bits; within bf16 rounding of them).

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
DTYPES = (torch.bfloat16, torch.float16)
# control block words (int32)
PUSH_PHASE, RECV_PHASE, ROWS_USED = 0, 1, 2


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
        return (dtype in DTYPES and 0 < rows <= MAX_ROWS and rows * hidden <= self.slot_elems
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

    @triton.jit
    def control_block(ch_ptr, RANK: tl.constexpr):
        return tl.load(ch_ptr + RANK).to(tl.pointer_type(tl.int32), bitcast=True)

    @triton.jit
    def phase_slots(ch_ptr, r, phase, slot_elems, WS: tl.constexpr, DTYPE: tl.constexpr):
        """Rank r's region: the first slot (source 0) of `phase`, as a DTYPE pointer."""
        # regions and slots are 16-byte aligned: say so, or the loads and stores would not be vectorised
        base = tl.multiple_of(tl.load(ch_ptr + r) + _CONTROL_BYTES, 16).to(tl.pointer_type(DTYPE), bitcast=True)
        return base + phase.to(tl.int64) * WS * slot_elems

    @triton.jit
    def _armed(v):
        return v.to(tl.uint16, bitcast=True) == 0x8000

    @triton.jit
    def spin_load(ptrs, mask):
        """Load until no element under mask is the sentinel: every peer's data has landed."""
        v = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cv")
        while tl.sum((_armed(v) & mask).to(tl.int32)) > 0:
            v = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cv")
        return v

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
    def received_tile(slots, slot_elems, res_ptr, stride_rm, nw_ptr, rout_ptr, offs_m, m_ok, k, k_ok, H,
                      write_res, WS: tl.constexpr, SOFT_BF16: tl.constexpr):
        """Columns k of the reduced input, for rows offs_m: h = round(round(sum of the ranks' slots, rank order) +
        residual) (written to rout where write_res). Returns (round(h * norm weight), the rows' sums of h^2)."""
        dtype = res_ptr.dtype.element_ty
        mask = m_ok[:, None] & k_ok[None, :]
        at = offs_m[:, None] * H + k[None, :]
        s = spin_load(slots + at, mask).to(tl.float32)
        for r in tl.static_range(1, WS):
            s += spin_load(slots + r * slot_elems + at, mask).to(tl.float32)
        res_at = offs_m[:, None] * stride_rm + k[None, :]
        res = tl.load(res_ptr + res_at, mask=mask, other=0.0).to(tl.float32)
        h = round_to(round_to(s, dtype, SOFT_BF16) + res, dtype, SOFT_BF16)
        if write_res:
            tl.store(rout_ptr + res_at, to_dtype(h, dtype, SOFT_BF16), mask=mask)
        w = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        return to_dtype(h * w[None, :], dtype, SOFT_BF16), tl.sum(h * h, axis=1)

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
        took one boundary ago (their readers are done). Program 0 hands its phase to the receiver and records the
        rows it pushed."""
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
        s = spin_load(slots + at, ok).to(tl.float32)
        for r in tl.static_range(1, WS):
            s += spin_load(slots + r * slot_elems + at, ok).to(tl.float32)
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
