"""Small-M projections (decode: M <= 32 rows of 16-bit data, 16 of fp32 or with TPGRAPH_GEMV_MAX_M=16) as one
Triton kernel that streams each weight once.

`linear_small_m(x, w)` = x @ w.T for x [M, K] and w [N, K] (nn.Linear's layout). Decode at small batch is a
weight-read problem: each program owns BLOCK_N output columns, walks K in BLOCK_K steps with the weight tile loaded
once and M padded to 16 rows (32 for 17-32 rows) for the tensor-core dot, accumulates in fp32 and rounds once.

Split-K (`GemvConfig.split_k` > 1) gives narrow matrices more programs than they have column blocks: split s sums
its own contiguous, BLOCK_K-aligned K range in fixed order into an fp32 workspace [SPLIT_K, M, N], and a second
small kernel adds the splits in split order and rounds. No atomics, so results do not depend on timing. The tiles
are a fixed table (`tiles`; no autotuning): the same shape gets the same config, and so the same bits, in every run.
A different config is a different (equally valid) rounding of the same sum.

Resident tiles (`resident`: one row, one split whose one tile spans K) load a program's whole weight slice before the
PDL wait and reduce the row over K without tensor cores. The shipped table uses them where a latency-bound kernel
comes before (o_proj at one row).

`gate_up_silu(x, w)` is the gate_up projection with SiLU·mul in its epilogue: each program's tile takes gate rows
and the matching up rows interleaved, so it holds both halves of its outputs and stores the activation only.

On by default for CUDA tensors on sm_80 and later (fp32 only where its tiles' shared memory fits; `TPGRAPH_GEMV=0`
keeps cuBLAS): on 2xH200, Llama-3-8B shape at TP=2, full graphs, it took a decode step from 3.352 to 3.209 ms at
batch 1 and from 3.582 to 3.472 ms at batch 8 against cuBLAS in the same interleaved run
(bench/results/2026-11-30_h200x2_gemv, session 6), with HF parity identical in bf16 and fp32. bench/bench_gemv.py
`--sweep` times the config grid per decode shape; its JSON, shipped as configs/gemv/sm90.json or named by
`TPGRAPH_GEMV_TABLE`, gives each shape its best config.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tpgraph.errors import ConfigError
from tpgraph.kernels._counters import (
    last_split_reduces,
    partials_buffer,
    polled_partials,
    polled_rope,
    split_counters,
    split_workspace,
)
from tpgraph.kernels._pdl import pdl_launch, use_pdl
from tpgraph.kernels._rounding import soft_bf16_rounding
from tpgraph.kernels._rows import block_m, max_rows
from tpgraph.kernels._settings import env_flag
from tpgraph.kernels.lamport import Channel, ReducedNorm, pieces_for
from tpgraph.kernels.rope_store import HeadNorm, head_norm_problem

try:
    import triton
    import triton.language as tl

    from tpgraph.kernels._counters import (
        POLL_LIMIT_C,
        arrived_last,
        is_sentinel,
        poll_exhausted,
        reset_counter,
        sentinel_like,
        unfilled,
    )
    from tpgraph.kernels._pdl import pdl_enter
    from tpgraph.kernels._rounding import add_rn, round_to, to_dtype
    from tpgraph.kernels.activation import silu_mul
    from tpgraph.kernels.lamport import all_reduce_tile, epilogue_inputs, rows_squares, rstd_of
    from tpgraph.kernels.rope_store import head_norm_weights, normed_head, rotate_pair
except ImportError:  # CPU-only installs without Triton use F.linear
    triton = None

# Bytes of weight pulled into L2 ahead of the PDL wait, all programs together; every program takes at least its
# first tile. 0: measured on 2xH200 (bench/results/2026-11-30_h200x2_gemv, run13/run14), a 24 MB budget made the
# small-M path 4-5% slower relative to cuBLAS in the same run than one tile per program did, at batch 1 and 8: the
# prefetch competes with the kernel before it for HBM, and that kernel's own stream evicts what it pulled.
PREFETCH_BUDGET = 0
SUM_BLOCK = 512  # elements per program of the split-K sum: it reads SPLIT_K fp32 partials from L2, latency-bound


def rope_inputs_early() -> bool:
    """Whether the model lets the qkv + rope kernel read the step's positions and slots before its PDL wait
    (qkv_rope_store's inputs_early): on unless TPGRAPH_QKV_ROPE_EARLY=0. Whole TP=1 steps on one H200
    (bench/results/2026-12-01_h200_newest_apart, run1 and run3): 0.001-0.004 ms faster at batch 1, 0.009-0.012 at
    batches 2-8."""
    return env_flag("TPGRAPH_QKV_ROPE_EARLY", default=True)


def qkv_paired() -> bool:
    """TPGRAPH_QKV_PAIRED=1: the qkv + rope kernel pairs the rows rotary embedding rotates together in its tiles, so
    each column block reduces its own splits and rotates its own outputs (_qkv_rope_kernel's PAIRED), instead of a
    reducer per head adding the whole head's partials (at 32 rows 64 KB a head, after the K loop: alone the fused kernel
    took 13.83 µs against the projection's 10.44, bench/results/2026-12-03_h200_wide_rows, run3). A column block
    polls its partials where the projections' do (polled_partials), not by the heads' rule (polled_rope). Opt-in:
    whole TP=1 steps on one H200 at a TP=2 rank's Llama-3-8B shape (bench/results/2026-12-03_h200_paired_qkv) took
    0.013-0.032 ms more at batches 1-16 in the epilogue chain and 0.004 less at 32; in the plain chain 0.005-0.012 ms
    less from batch 2, 0.006 more at 1. Untimed at TP=2."""
    return env_flag("TPGRAPH_QKV_PAIRED")


def late_trigger() -> bool:
    """TPGRAPH_GEMV_AR_LATE_TRIGGER=1: a projection with the all-reduce (or at TP=1 the residual add) in its epilogue
    lets the kernel after it in only at its exit, not after its K loop. Measured at TP=1 against the plain chain
    (bench/results/2026-12-01_h200_solo, run4): 0.045 ms a step faster at batch 8, 0.046 ms slower at batch 1; off
    until measured at TP=2."""
    return env_flag("TPGRAPH_GEMV_AR_LATE_TRIGGER")


def prefetch_budget(n: int | None = None, k: int | None = None) -> int:
    """PREFETCH_BUDGET, or TPGRAPH_PDL_PREFETCH_MB where set, for measuring a prefetch against none
    (bench/gpu_graph_checks.sh pdl-late): a number of MB for every projection, or per weight shape, entries
    `NxK:MB` separated by `/` (e.g. `4096x2048:17/3072x4096:8`; a shape not named keeps PREFETCH_BUDGET)."""
    env = os.environ.get("TPGRAPH_PDL_PREFETCH_MB", "").strip()
    if not env:
        return PREFETCH_BUDGET
    return _parse_budget(env, n, k)


def _parse_budget(env: str, n: int | None, k: int | None) -> int:
    def mb(text: str) -> int:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 <= value < math.inf:  # (inf was an OverflowError traceback, a negative one silently 0)
            raise ConfigError(f"TPGRAPH_PDL_PREFETCH_MB must be a number of MB (at least 0) or NxK:MB entries joined "
                              f"by '/', got {env!r}")
        return int(value * (1 << 20))

    if ":" not in env:
        return mb(env)
    budgets = {}  # every entry checked, not only up to the one asked for: a typo fails at the first projection
    for entry in filter(None, (e.strip() for e in env.split("/"))):
        shape, _, value = entry.partition(":")
        dims = shape.lower().split("x")
        if len(dims) != 2 or not all(d.strip().isdigit() for d in dims):
            raise ConfigError(f"TPGRAPH_PDL_PREFETCH_MB entry {entry!r}: want NxK:MB, e.g. 4096x2048:17")
        budgets[(int(dims[0]), int(dims[1]))] = mb(value)
    return budgets.get((n, k), PREFETCH_BUDGET)


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration: BLOCK_N output columns per program, BLOCK_K per step, and split_k programs per
    column block (1: no workspace, no second kernel). resident (one split): where BLOCK_K spans K, each program loads
    its whole weight slice before its PDL wait, at one row (`resident`)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    resident: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
        if self.block_n < 16 or self.block_k < 16:  # tl.dot's smallest tile side
            raise ValueError(f"GemvConfig needs block_n, block_k >= 16, got {self.block_n}, {self.block_k}")
        if self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"GemvConfig needs num_stages, split_k >= 1, got {self.num_stages}, {self.split_k}")
        if self.resident and self.split_k != 1:
            raise ValueError(f"GemvConfig: resident tiles take one split, got split_k={self.split_k}")


def enabled() -> bool:
    """Whether the model's projections use this kernel for M <= max_rows (read when a layer is built; on unless
    TPGRAPH_GEMV=0). Where it cannot run (CPU tensors, GPUs before sm_80) the layers still get cuBLAS."""
    return env_flag("TPGRAPH_GEMV", default=True)


# fp32 tiles stage 4-byte weights: the widest shipped or default config pipelines up to 192 KiB of shared memory per
# program, more than sm_86/sm_89 parts allow (99 KiB); those take cuBLAS for fp32 by default
FP32_SHARED_BYTES = 192 << 10


@functools.cache
def _device_takes(index: int, elem: int) -> bool:
    """Whether the kernel runs here by default for elements of `elem` bytes: sm_80+ (tl.dot on bf16/fp16 tiles), and
    for fp32 a GPU with the shared memory its tiles need."""
    props = torch.cuda.get_device_properties(index)
    if props.major < 8:
        return False
    return elem <= 2 or getattr(props, "shared_memory_per_block_optin", 0) >= FP32_SHARED_BYTES


@functools.lru_cache(maxsize=8)
def _tuned(path: str, section: str = "best") -> dict[tuple[int, int, int], GemvConfig]:
    """A table written by `bench/bench_gemv.py --sweep` ({"best": {"n,k,m": config fields}}), read once per path.
    section "epilogue": the optional entries for projections with the all-reduce in their epilogue (their best tiles
    in a whole step differ from the plain chain's); none where the table has no such section."""
    try:
        table = json.loads(Path(path).read_text())
        entries = table["best"] if section == "best" else table.get(section, {})
        items = entries.items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"GEMV table {path}: not a table from bench_gemv.py --sweep ({exc})") from exc
    return {_shape(path, section, key): _entry(path, section, key, fields) for key, fields in items}


def _shape(path: str, section: str, key: object) -> tuple[int, int, int]:
    """A table key, "n,k,m": refused here, naming it, rather than failing to unpack later in tiles()."""
    parts = key.split(",") if isinstance(key, str) else []
    # (ASCII digits alone: int() refuses some of what isdigit() takes, such as "²")
    if len(parts) == 3 and all(p.strip().isascii() and p.strip().isdigit() and int(p) > 0 for p in parts):
        n, k, m = (int(p) for p in parts)
        return n, k, m
    raise ConfigError(f"GEMV table {path}: key {key!r} in \"{section}\" is not 'n,k,m' (three positive integers, "
                      f"e.g. \"4096,2048,1\", as bench_gemv.py --sweep writes them)")


def _entry(path: str, section: str, key: str, fields: object) -> GemvConfig:
    try:
        return GemvConfig(**fields)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"GEMV table {path}: key {key!r} in \"{section}\": not a tile config ({exc})") from exc


def table_path(capability: tuple[int, int]) -> Path | None:
    """TPGRAPH_GEMV_TABLE if set; else the tuned table shipped for this architecture (configs/gemv), if there is one.
    Without a table every shape gets the default tiles: a table tunes speed, never the result's validity."""
    # (~ expanded here, not in the cached lookup, so that the key holds the home it means; an env file's value
    # reaches here unexpanded by a shell)
    env, config_dir_env = (os.environ.get(name) for name in ("TPGRAPH_GEMV_TABLE", "TPGRAPH_CONFIG_DIR"))
    return _table_path(env and os.path.expanduser(env), config_dir_env and os.path.expanduser(config_dir_env),
                       capability)


@functools.lru_cache(maxsize=16)
def _table_path(env: str | None, config_dir_env: str | None, capability: tuple[int, int]) -> Path | None:
    """Resolved once per setting (every eager projection asks; the file system is not asked again)."""
    # (config_dir_env is part of the key: config_dir() reads the variable itself)
    if env:
        return Path(env)
    from tpgraph.comm.thresholds import config_dir, shipped_config_dir, table_file_for

    name = table_file_for(capability)
    shipped = config_dir() / "gemv" / name
    # (TPGRAPH_CONFIG_DIR's folder without this arch's tiles the package ships: every projection ran the default
    # tiles, slower, without a word; at TP=1, where no all-reduce table is read, a mistyped folder went unsaid)
    if config_dir_env and not shipped.is_file() and (shipped_config_dir() / "gemv" / name).is_file():
        raise ConfigError(f"TPGRAPH_CONFIG_DIR={config_dir_env} has no gemv/{name}: copy tpgraph's configs folder "
                          f"(allreduce/ and gemv/) there, or unset TPGRAPH_CONFIG_DIR to use the shipped tables")
    return shipped if shipped.is_file() else None


def tiles(n: int, k: int, m: int = 1, table: Path | None = None, epilogue: bool = False) -> GemvConfig:
    """The config for an [N, K] weight at M rows: from `table` if it has this shape (the entry with the largest M not
    above m; for a projection with the all-reduce in its epilogue, the table's "epilogue" entry where it has one at
    that M or a larger one not above m), else the default: narrow column blocks for narrow matrices, so that every SM
    gets programs (132 on an H200: N = 2048 / 16 = 128 programs)."""
    if table is not None:
        sections = ("best", "epilogue") if epilogue else ("best",)
        fits = [(tm, rank, cfg) for rank, section in enumerate(sections)
                for (tn, tk, tm), cfg in _tuned(str(table), section).items() if (tn, tk) == (n, k) and tm <= m]
        if fits:
            return max(fits, key=lambda e: e[:2])[2]
    if n <= 8192:
        return GemvConfig(16, 256, 4, 4)
    return GemvConfig(32, 256, 4, 4)


if triton is not None:

    @triton.jit
    def _weight_rows(pid, N, BLOCK_N: tl.constexpr, GATE_UP: tl.constexpr, ROPE_HALF: tl.constexpr = 0):
        """The weight rows of column block pid's tile, and which of them exist (see _partial for GATE_UP). ROPE_HALF
        (> 0: qkv rows in heads of 2 * ROPE_HALF, _qkv_rope_kernel's PAIRED): the tile pairs rows within a head as
        GATE_UP pairs gate and up rows, its even columns rows j of the head and its odd columns the rows j + ROPE_HALF
        that rotary embedding rotates with them."""
        if ROPE_HALF > 0:
            r = tl.arange(0, BLOCK_N)
            pair = pid * (BLOCK_N // 2) + r // 2  # the pair's index over every head: head * ROPE_HALF + j
            rows = (pair // ROPE_HALF) * (2 * ROPE_HALF) + pair % ROPE_HALF + (r % 2) * ROPE_HALF
            ok = rows < N
        elif GATE_UP:
            r = tl.arange(0, BLOCK_N)
            j = pid * (BLOCK_N // 2) + r // 2  # the output column (gate/up pair) of tile column r
            rows = j + (r % 2) * (N // 2)
            ok = j < N // 2
        else:
            rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = rows < N
        return rows, ok

    @triton.jit
    def _k_range(K, pid_k, BLOCK_K: tl.constexpr):
        """Split pid_k's K range [k_lo, k_hi). Split ranges are whole BLOCK_K steps, so only the last step of K is
        partial and `k < K` is the only K mask (a per-split bound in the mask would cost the loads their vector
        width); k_hi <= k_lo for an empty split: it stores zeros."""
        k_per_split = tl.cdiv(K, tl.num_programs(1) * BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per_split
        return k_lo, tl.minimum(k_lo + k_per_split, K)

    @triton.jit
    def _enter(w_ptr, N, K, stride_wn, pid, pid_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GATE_UP: tl.constexpr, PDL: tl.constexpr, PREFETCH_TILES: tl.constexpr, LINE: tl.constexpr,
               ROPE_HALF: tl.constexpr = 0):
        """With PDL: the weight prefetch, then the wait (see _gemv_kernel). After it, what the kernel before wrote
        may be read: the caller issues its epilogue's loads (squares; the residual, unless RES_EARLY has read it
        before the wait) before the K loop (_partial), so that they arrive while the weights stream instead of
        after."""
        if PDL:
            k_lo, _ = _k_range(K, pid_k, BLOCK_K)
            offs_n, _ = _weight_rows(pid, N, BLOCK_N, GATE_UP, ROPE_HALF)
            rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped, not masked: a prefetch has no mask
            for t in tl.static_range(PREFETCH_TILES):
                cols = tl.minimum(k_lo + t * BLOCK_K + tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                          [w_ptr + rows[:, None] * stride_wn + cols[None, :]], dtype=tl.int32,
                                          is_pure=False, pack=1)
            tl.extra.cuda.gdc_wait()  # the kernel before has finished: x is ready, y's memory is free

    @triton.jit
    def _weight_tile(w_ptr, N, K, stride_wn, pid, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GATE_UP: tl.constexpr, ROPE_HALF: tl.constexpr = 0):
        """Column block pid's [BLOCK_N, BLOCK_K] weight tile at K offset k0 (zeros past N and K)."""
        offs_n, n_ok = _weight_rows(pid, N, BLOCK_N, GATE_UP, ROPE_HALF)
        k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :],
                       mask=n_ok[:, None] & (k < K)[None, :], other=0.0)

    @triton.jit
    def _dot_f32(a, b, SOFT_BF16: tl.constexpr, IEEE: tl.constexpr):
        """a @ b in fp32."""
        if SOFT_BF16:  # the interpreter: fp32 products (exact for 16-bit inputs; it has no bf16 dot), summed over K
            # by numpy's own reduction, so each output's bits depend on K alone, not on its column's place in the tile
            # or on N. Its tl.dot is numpy's matmul, whose BLAS may sum an output differently by its place (OpenBLAS's
            # Haswell/Zen kernels do), so a permuted tile (GATE_UP, qkv's PAIRED) would change bits that on the GPU
            # (one K order per column) it does not.
            return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:  # fp32 inputs: full fp32 products, not TF32 (as torch's matmul by default)
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b, out_dtype=tl.float32)

    @triton.jit
    def _tile_product(acc, x, w, SOFT_BF16: tl.constexpr, IEEE: tl.constexpr):
        """acc + x @ w.T for one K step, in fp32."""
        return acc + _dot_f32(x, tl.trans(w), SOFT_BF16, IEEE)

    @triton.jit
    def _partial(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid, pid_k, w_resident, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr, IEEE: tl.constexpr,
                 GATE_UP: tl.constexpr, PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr, RESIDENT: tl.constexpr,
                 ROPE_HALF: tl.constexpr = 0):
        """This program's fp32 [BLOCK_M, BLOCK_N] sum over its split of K (column block pid, split pid_k), in a fixed
        order, after _enter; with PDL and EARLY_TRIGGER, the kernel after is let in once it is done. GATE_UP: the
        weight is cat(gate, up) with N = 2 * inter rows, and the tile's even columns are gate rows
        pid * BLOCK_N / 2 + i, its odd columns the matching up rows inter + pid * BLOCK_N / 2 + i. RESIDENT: the whole
        K range is one tile, `w_resident`, already loaded (before the wait: see _gemv_kernel), and there is one row:
        fp32 products and a reduction over K (tl.sum), not a tensor-core dot, which over the whole K keeps every warp's
        copy of the weight fragments in registers (sm_90a: 128 mma.sync a warp, 900+ bytes spilled)."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if RESIDENT:  # one row: fp32 products and a reduction over K
            xm = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            row = tl.sum(w_resident.to(tl.float32) * xm[None, :], axis=1)
            acc = tl.where(offs_m[:, None] == 0, row[None, :], acc)
        else:
            k_lo, k_hi = _k_range(K, pid_k, BLOCK_K)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + offs_k
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :],
                            other=0.0)
                w = _weight_tile(w_ptr, N, K, stride_wn, pid, k0, BLOCK_N, BLOCK_K, GATE_UP, ROPE_HALF)
                acc = _tile_product(acc, x, w, SOFT_BF16, IEEE)
        if PDL and EARLY_TRIGGER:
            # Only now may the kernel after become resident (it waits for us before reading anything we write): its
            # programs then take SM slots and L2 for its prefetch during our tail, not while we still stream weights.
            tl.extra.cuda.gdc_launch_dependents()
        return acc

    @triton.jit
    def _silu_mul_store(acc, y_ptr, pid, M, INTER, stride_ym, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
                        SOFT_BF16: tl.constexpr, EXACT: tl.constexpr):
        """y[:, pid * HALF + i] = silu(gate) * up from an interleaved [BLOCK_M, 2 * HALF] tile of fp32 sums (gate,
        up, gate, ...), every step rounded as the projection and then _silu_and_mul_kernel round it."""
        dtype = y_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, HALF, 2)))
        # the projection's outputs, as it would store them, then the activation kernel's roundings
        y = silu_mul(round_to(gate, dtype, SOFT_BF16), round_to(up, dtype, SOFT_BF16), dtype, SOFT_BF16, EXACT)
        offs_m = tl.arange(0, BLOCK_M)
        offs_j = pid * HALF + tl.arange(0, HALF)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_j[None, :], to_dtype(y, dtype, SOFT_BF16),
                 mask=(offs_m < M)[:, None] & (offs_j < INTER)[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, y_ptr, counter_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os,
                     ch_ptr, res_ptr, nw_ptr, rout_ptr, xs_ptr, sq_ptr, tiles, slot_elems, timeout_ns, eps,
                     mean_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr,
                     IEEE: tl.constexpr, GATE_UP: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr,
                     PREFETCH_TILES: tl.constexpr, LINE: tl.constexpr, LAST_REDUCES: tl.constexpr,
                     SPLITS: tl.constexpr, ALL_REDUCE: tl.constexpr, STAGED: tl.constexpr, WS: tl.constexpr,
                     RANK: tl.constexpr, PIECES: tl.constexpr, EARLY_TRIGGER: tl.constexpr, RES_EARLY: tl.constexpr,
                     RESIDENT: tl.constexpr, POLLED: tl.constexpr):
        """Grid (column blocks, splits). One split: out is y, rounded to its dtype. More: out is the fp32
        workspace and split s writes its partial sum at out + s * stride_os. GATE_UP (one split): w is cat(gate, up)
        [2 * inter, K] and y [M, inter] gets silu(gate) * up, from the fp32 sums rounded as the projection would
        store them, then activation.py's roundings; EXACT: those ops as instructions no FMA can absorb (the GPU; the
        interpreter never contracts).
        PDL: launched as a programmatic dependent, so the program is resident while the kernel before still runs.
        The weights do not depend on that kernel: the first PREFETCH_TILES tiles of this program's rows are pulled
        into L2 (one prefetch per LINE elements, a 128-byte line) before the wait, and only x, which the kernel
        before writes, is read after it. The kernel after is let in once the K loop is done (see _partial).
        LAST_REDUCES (split-K): no second kernel. Each split counts itself in at counter_ptr[column block] once its
        partial is stored; the split that arrives last sets the counter back to 0 for the next call or replay, adds
        the partials in split order (the bits of _split_sum_kernel) and writes y (_split_total).
        ALL_REDUCE (a row-parallel weight, one split or LAST_REDUCES): y is not stored; each finished tile goes
        through lamport.all_reduce_tile (the all-reduce, the residual add and the norm's staging, for the projection
        after). STAGED: x is a fused all-reduce's staged input (lamport.py), and the sums are scaled by the rows'
        1 / RMS from its squares [tiles, BLOCK_M] before the epilogue. EARLY_TRIGGER (with PDL): the kernel after is
        let in after the K loop; else only at exit (late_trigger).
        RES_EARLY (with ALL_REDUCE): the residual and norm weights were written at least two launches back
        (linear_all_reduce_norm's residual_early), so they are loaded before the wait: the residual tile's load ends in
        a shared-memory layout change (st.shared, bar.sync, ld.shared), and after the wait it held the K loop's first
        weight loads back by one memory round trip.
        RESIDENT (one split whose one tile spans K: `resident`): the program's whole weight slice is loaded into
        registers before the wait, not prefetched into L2, so it streams while the kernel before still runs (decode
        attention before o_proj: a latency-bound kernel that leaves HBM idle), and after the wait only x is loaded.
        POLLED (with LAST_REDUCES; `polled_partials`): out is the device's sentinel-filled partials buffer, and the
        last split of each column block reduces: it polls the other splits' partials until none holds the sentinel,
        adds them in split order and its own last (the same bits), and sets their slots back to the sentinel. No
        count, and the reducer's own partial is never stored."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        if ALL_REDUCE:
            if RES_EARLY:  # settled before the kernel before us started (see above): no wait needed
                res, nw = epilogue_inputs(res_ptr, nw_ptr, offs_m, offs_n, m_ok, n_ok, N)
        else:
            res, nw = 0, 0  # (no epilogue reads them)
        if RESIDENT:  # the weights do not depend on the kernel before: all of them now, before the wait
            w_resident = _weight_tile(w_ptr, N, K, stride_wn, pid, 0, BLOCK_N, BLOCK_K, GATE_UP)
        else:
            w_resident = 0
        _enter(w_ptr, N, K, stride_wn, pid, pid_k, BLOCK_N, BLOCK_K, GATE_UP, PDL, PREFETCH_TILES, LINE)
        # the epilogue's inputs from the kernels before, loaded now: they arrive while the K loop streams weights (or,
        # resident, with x)
        if STAGED:
            squares = rows_squares(sq_ptr, tiles, offs_m, m_ok, BLOCK_M, PIECES)
        if ALL_REDUCE:
            if not RES_EARLY:
                res, nw = epilogue_inputs(res_ptr, nw_ptr, offs_m, offs_n, m_ok, n_ok, N)
        acc = _partial(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid, pid_k, w_resident, BLOCK_M, BLOCK_N, BLOCK_K,
                       SOFT_BF16, IEEE, GATE_UP, PDL, EARLY_TRIGGER, RESIDENT)
        if STAGED:
            acc = acc * rstd_of(squares, mean_scale, eps)[:, None]
        if GATE_UP:
            _silu_mul_store(acc, y_ptr, pid, M, N // 2, stride_om, BLOCK_M, BLOCK_N // 2, SOFT_BF16, EXACT)
        else:
            y = to_dtype(acc, out_ptr.dtype.element_ty, SOFT_BF16)  # fp32 workspace: stored as is
            tile = offs_m[:, None] * stride_om + offs_n[None, :]
            tile_ok = m_ok[:, None] & n_ok[None, :]
            if ALL_REDUCE and SPLITS == 1:
                all_reduce_tile(y, res, nw, ch_ptr, rout_ptr, xs_ptr, sq_ptr, pid, offs_m, offs_n, m_ok, n_ok, N,
                                slot_elems, timeout_ns, WS, RANK, SOFT_BF16)
            elif LAST_REDUCES:  # the split-K reduction the paired qkv kernel's column blocks share
                reduces, total = _split_total(y, out_ptr, counter_ptr + pid, stride_os, tile, tile_ok, pid_k, SPLITS,
                                              POLLED)
                if reduces:
                    _finish_reduced(total, y_ptr, tile, tile_ok, res, nw, ch_ptr, rout_ptr, xs_ptr, sq_ptr, pid, offs_m,
                                    offs_n, m_ok, n_ok, N, slot_elems, timeout_ns, ALL_REDUCE, WS, RANK, SOFT_BF16)
            else:
                tl.store(out_ptr + pid_k * stride_os + tile, y, mask=tile_ok)

    @triton.jit
    def _finish_reduced(total, y_ptr, tile, tile_ok, res, nw, ch_ptr, rout_ptr, xs_ptr, sq_ptr, pid, offs_m, offs_n,
                        m_ok, n_ok, N, slot_elems, timeout_ns, ALL_REDUCE: tl.constexpr, WS: tl.constexpr,
                        RANK: tl.constexpr, SOFT_BF16: tl.constexpr):
        """A split-K tile's fp32 sum, by whichever program reduces it: rounded to y's dtype, then through the
        all-reduce epilogue (ALL_REDUCE) or stored to y."""
        total = to_dtype(total, y_ptr.dtype.element_ty, SOFT_BF16)
        if ALL_REDUCE:
            all_reduce_tile(total, res, nw, ch_ptr, rout_ptr, xs_ptr, sq_ptr, pid, offs_m, offs_n, m_ok, n_ok, N,
                            slot_elems, timeout_ns, WS, RANK, SOFT_BF16)
        else:
            tl.store(y_ptr + tile, total, mask=tile_ok)

    @triton.jit
    def _polled_partners(ptr, stride_s, tile, ok, SPLITS: tl.constexpr):
        """The polled reducer's (the last split's) view of splits 0 .. SPLITS - 2 at `tile`: polled until none holds
        the sentinel (a trap after POLL_LIMIT polls), their fp32 sum in split order, and their slots set back to the
        sentinel for the next call."""
        total, missing = _polled_splits(ptr, stride_s, tile, ok, SPLITS)
        tries = 0
        while (missing > 0) & (tries < POLL_LIMIT_C):
            total, missing = _polled_splits(ptr, stride_s, tile, ok, SPLITS)
            tries += 1
        poll_exhausted(missing, tries)
        for s in tl.static_range(SPLITS - 1):
            tl.store(ptr + s * stride_s + tile, sentinel_like(total), mask=ok)
        return total

    @triton.jit
    def _polled_splits(ptr, stride_s, tile, ok, SPLITS: tl.constexpr):
        """The fp32 sum, in split order, of the partials of splits 0 .. SPLITS - 2 at `tile` (the reducer's own, the
        last, is not stored), past L1, and how many of their elements still hold the sentinel."""
        total, stale = _polled_sum(ptr, stride_s, tile, ok, SPLITS - 1)
        return total, unfilled(stale, ok)

    @triton.jit
    def _polled_sum(ptr, stride_s, tile, ok, COUNT: tl.constexpr):
        """The fp32 sum, in split order, of partials 0 .. COUNT - 1 at `tile`, loaded past L1, and which elements of
        any of them still held the sentinel. The tests are or-ed element by element for the caller to reduce once: a
        block reduction between the loads (its barriers) would hold each volatile load back behind the one before,
        one L2 round trip a split."""
        total = tl.load(ptr + tile, mask=ok, other=0.0, volatile=True)
        stale = is_sentinel(total)
        for s in tl.static_range(1, COUNT):
            v = tl.load(ptr + s * stride_s + tile, mask=ok, other=0.0, volatile=True)
            stale = stale | is_sentinel(v)
            total += v
        return total, stale

    @triton.jit
    def _qkv_rope_kernel(x_ptr, w_ptr, ws_ptr, counter_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr,
                         v_cache_ptr, q_out_ptr, bias_ptr, qn_ptr, kn_ptr, head_eps, M, N, K, stride_xm, stride_wn,
                         stride_os, stride_cos, stride_sin, stride_cb, stride_ct, stride_ch, stride_qo, sq_ptr, tiles,
                         eps, mean_scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr, PREFETCH_TILES: tl.constexpr, LINE: tl.constexpr,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, EXACT_MUL: tl.constexpr, STAGED: tl.constexpr,
                         PIECES: tl.constexpr, SPLITS: tl.constexpr, ROPE_EARLY: tl.constexpr,
                         POLLED: tl.constexpr, PAIRED: tl.constexpr, HAS_BIAS: tl.constexpr,
                         QK_NORM: tl.constexpr):
        """The qkv projection, then rope_store's work, in one launch. Grid (column blocks, splits), as _gemv_kernel.
        Unless PAIRED (below), every program stores its fp32 partial to the workspace [splits, M, N] and (unless POLLED)
        counts itself in at counter_ptr[head]; the last of a head's HEAD_DIM // BLOCK_N column blocks x splits adds the
        head's partials in split order (the GEMV's bits), rounds them as the GEMV output would be, rotates q and k as
        _rope_store_kernel does, and writes q to q_out and k, v into the paged cache at the row's slot. STAGED: x is a
        fused all-reduce's staged input, and the head's sums are scaled by the rows' 1 / RMS (see _gemv_kernel). What
        the last program needs besides the partials (positions, slots, cos/sin rows: written before the step; the bias
        and the head norms' weights, before the PDL wait) is loaded by every program before its K loop, and the
        SPLITS partials in one unrolled batch of loads: after the head's last count the work is one round of loads and
        the stores, not a chain of dependent loads.
        ROPE_EARLY: those are loaded before the PDL wait (qkv_rope_store's inputs_early): after the wait the cos/sin
        loads waited on the positions' load, and the K loop's third stage of weight loads waited with them (SASS).
        POLLED (ws is the sentinel-filled partials buffer, as _gemv_kernel's POLLED): no count; the head's last column
        block at the last split (dispatched after every partner) stores its partial too, then polls the head's
        partials until none holds the sentinel, and sets them back. (Its first form, which reduced after each partner's
        load, lost 0.05-0.12 ms a step: bench/results/2026-12-02_h200_read_ceiling, run6.)
        PAIRED (qkv_paired): each tile holds BLOCK_N // 2 dims j of one head and the dims j + HEAD_DIM / 2 that rotary
        embedding pairs with them (_weight_rows' ROPE_HALF), so each column block rotates its own outputs: its splits
        reduce as _gemv_kernel's do (the last to arrive by a count at counter_ptr[column block], or POLLED: the last
        split, polling the others), and no program waits for a whole head. The bits are the same: each column sums
        over K in the same order whichever rows share its tile.
        QK_NORM (Qwen3): each q and k head RMS-normed over HEAD_DIM (its weight at qn_ptr or kn_ptr, head_eps) before
        its rotation, by the head's reducer (never PAIRED: a column block holds part of a head)."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        half: tl.constexpr = HEAD_DIM // 2
        if PAIRED:  # this program's dims j of its head (and j + half with them)
            pairs: tl.constexpr = BLOCK_N // 2
            head = pid // (half // pairs)
            offs_h = (pid % (half // pairs)) * pairs + tl.arange(0, pairs)
            rope_half: tl.constexpr = half
        else:
            head = pid // (HEAD_DIM // BLOCK_N)
            offs_h = tl.arange(0, half)
            rope_half: tl.constexpr = 0
        if ROPE_EARLY:  # settled before the kernel before us started (qkv_rope_store's inputs_early)
            c, sn, cache_row = _rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cos, stride_sin, stride_cb,
                                            stride_ct, offs_m, m_ok, offs_h, BLOCK_SIZE)
        # weights no kernel writes: read before the wait, so that after a head's count only its partials load
        b1, b2, nw1, nw2 = _head_constants(bias_ptr, qn_ptr, kn_ptr, head, offs_h, NUM_HEADS, HEAD_DIM, HAS_BIAS,
                                           QK_NORM)
        _enter(w_ptr, N, K, stride_wn, pid, pid_k, BLOCK_N, BLOCK_K, False, PDL, PREFETCH_TILES, LINE, rope_half)
        if STAGED:  # loaded before the K loop (_gemv_kernel); only a reducer (a head's; PAIRED, a block's) reads them
            squares = rows_squares(sq_ptr, tiles, offs_m, m_ok, BLOCK_M, PIECES)
        else:
            squares = tl.zeros((BLOCK_M, PIECES), dtype=tl.float32)
        if not ROPE_EARLY:
            c, sn, cache_row = _rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cos, stride_sin, stride_cb,
                                            stride_ct, offs_m, m_ok, offs_h, BLOCK_SIZE)
        acc = _partial(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid, pid_k, 0, BLOCK_M, BLOCK_N, BLOCK_K,
                       SOFT_BF16, IEEE, False, PDL, True, False, rope_half)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        tile = offs_m[:, None] * N + offs_n[None, :]  # the workspace keeps the tile's (paired) column order
        tile_ok = m_ok[:, None] & (offs_n < N)[None, :]
        if PAIRED:
            if SPLITS == 1:
                reduces, total = True, acc
            else:
                reduces, total = _split_total(acc, ws_ptr, counter_ptr + pid, stride_os, tile, tile_ok, pid_k, SPLITS,
                                              POLLED)
            if reduces:
                _rope_pairs(total, offs_h, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, head, M,
                            stride_ch, stride_qo, squares, eps, mean_scale, BLOCK_M, BLOCK_N, SOFT_BF16, NUM_HEADS,
                            NUM_KV_HEADS, HEAD_DIM, EXACT_MUL, STAGED, HAS_BIAS)
        else:
            _rope_heads(acc, ws_ptr, counter_ptr, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2,
                        nw1, nw2, head_eps, head, pid, pid_k, tile, tile_ok, M, N, stride_os, stride_ch,
                        stride_qo, squares, eps, mean_scale, BLOCK_M, BLOCK_N, SOFT_BF16, NUM_HEADS, NUM_KV_HEADS,
                        HEAD_DIM, EXACT_MUL, STAGED, SPLITS, POLLED, HAS_BIAS, QK_NORM)

    @triton.jit
    def _split_total(acc, ws_ptr, counter_ptr, stride_os, tile, tile_ok, pid_k, SPLITS: tl.constexpr,
                     POLLED: tl.constexpr):
        """(whether this program reduces its column block's SPLITS partials, their fp32 sum in split order there): the
        split-K reduction of _gemv_kernel and of the paired qkv kernel. POLLED (ws the sentinel-filled partials
        buffer), the last split polls the others' partials and adds its own last, and sets their slots back; else
        every split stores its partial and the last to arrive at counter_ptr (set back to 0) loads them all."""
        if POLLED:
            reduces = pid_k == SPLITS - 1
            total = acc
            if reduces:  # dispatched after its partners (a higher program id), which never wait
                total = _polled_partners(ws_ptr, stride_os, tile, tile_ok, SPLITS) + acc  # its own partial last
            else:
                tl.store(ws_ptr + pid_k * stride_os + tile, acc, mask=tile_ok)
        else:
            tl.store(ws_ptr + pid_k * stride_os + tile, acc, mask=tile_ok)
            reduces = arrived_last(counter_ptr, SPLITS)
            total = acc
            if reduces:  # the last split: every partial is in memory
                total = tl.load(ws_ptr + tile, mask=tile_ok, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLITS):  # unrolled: the loads are in flight together
                    total += tl.load(ws_ptr + s * stride_os + tile, mask=tile_ok, other=0.0, cache_modifier=".cg")
                reset_counter(counter_ptr)
        return reduces, total

    @triton.jit
    def _rope_heads(acc, ws_ptr, counter_ptr, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, nw1,
                    nw2, head_eps, head, pid, pid_k, tile, tile_ok, M, N, stride_os, stride_ch, stride_qo, squares,
                    eps, mean_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFT_BF16: tl.constexpr,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    EXACT_MUL: tl.constexpr, STAGED: tl.constexpr, SPLITS: tl.constexpr, POLLED: tl.constexpr,
                    HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr):
        """_qkv_rope_kernel's reduction by heads (not PAIRED): this program's partial stored, then the head's reducer
        (its last column block at the last split, POLLED; else the last of the head's programs to arrive at
        counter_ptr[head]) adds and rotates the whole head (_rope_head)."""
        tl.store(ws_ptr + pid_k * stride_os + tile, acc, mask=tile_ok)
        if POLLED:  # the head's last column block at the last split: its partners have lower program ids
            if (pid % (HEAD_DIM // BLOCK_N) == HEAD_DIM // BLOCK_N - 1) & (pid_k == SPLITS - 1):
                tl.debug_barrier()  # its own partial's stores, seen by all of its threads
                _rope_head(ws_ptr, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, nw1, nw2, head_eps,
                           head, M, N, stride_os, stride_ch, stride_qo, squares, eps, mean_scale, BLOCK_M, SOFT_BF16,
                           NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, EXACT_MUL, STAGED, SPLITS, True, HAS_BIAS, QK_NORM)
        elif arrived_last(counter_ptr + head, (HEAD_DIM // BLOCK_N) * SPLITS):
            _rope_head(ws_ptr, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, nw1, nw2, head_eps,
                       head, M, N, stride_os, stride_ch, stride_qo, squares, eps, mean_scale, BLOCK_M, SOFT_BF16,
                       NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, EXACT_MUL, STAGED, SPLITS, False, HAS_BIAS, QK_NORM)
            reset_counter(counter_ptr + head)

    @triton.jit
    def _head_constants(bias_ptr, qn_ptr, kn_ptr, head, offs_h, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr):
        """What head `head`'s reducer adds and norms with at dims offs_h and offs_h + HEAD_DIM / 2, fp32: its bias
        (HAS_BIAS) and its norm's weight (QK_NORM: q_norm's for a q head, k_norm's otherwise); zeros where absent."""
        zero = tl.zeros(offs_h.shape, dtype=tl.float32)
        b1, b2, nw1, nw2 = zero, zero, zero, zero
        if HAS_BIAS:
            b1 = tl.load(bias_ptr + head * HEAD_DIM + offs_h).to(tl.float32)
            b2 = tl.load(bias_ptr + head * HEAD_DIM + HEAD_DIM // 2 + offs_h).to(tl.float32)
        if QK_NORM:
            nw1, nw2 = head_norm_weights(qn_ptr, kn_ptr, head < NUM_HEADS, offs_h, HEAD_DIM)
        return b1, b2, nw1, nw2

    @triton.jit
    def _rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cos, stride_sin, stride_cb, stride_ct, offs_m, m_ok,
                     offs_h, BLOCK_SIZE: tl.constexpr):
        """The rows' cos and sin at their positions and the first half's dims offs_h (fp32), and their cache row
        offsets from the slot mapping."""
        rows_ok = m_ok[:, None] & (offs_h >= 0)[None, :]
        pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        c = tl.load(cos_ptr + pos[:, None] * stride_cos + offs_h[None, :], mask=rows_ok, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + pos[:, None] * stride_sin + offs_h[None, :], mask=rows_ok, other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        return c, sn, (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct

    @triton.jit
    def _rope_head(ws_ptr, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, nw1, nw2, head_eps, head,
                   M, N, stride_os, stride_ch, stride_qo, squares, eps, mean_scale, BLOCK_M: tl.constexpr,
                   SOFT_BF16: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, EXACT_MUL: tl.constexpr, STAGED: tl.constexpr, SPLITS: tl.constexpr,
                   POLLED: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr):
        """One head of every row: its two halves summed over the SPLITS splits in split order (the loads unrolled, so
        they are in flight together; POLLED: until none holds the sentinel, then the slots go back to it), then
        _rope_store."""
        half: tl.constexpr = HEAD_DIM // 2
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        offs_h = tl.arange(0, half)
        rows_ok = m_ok[:, None] & (offs_h < half)[None, :]
        at = offs_m[:, None] * N + head * HEAD_DIM + offs_h[None, :]
        if POLLED:
            t1, t2, missing = _polled_halves(ws_ptr, at, rows_ok, stride_os, half, SPLITS)
            tries = 0
            while (missing > 0) & (tries < POLL_LIMIT_C):
                t1, t2, missing = _polled_halves(ws_ptr, at, rows_ok, stride_os, half, SPLITS)
                tries += 1
            poll_exhausted(missing, tries)
            for s in tl.static_range(SPLITS):  # the slots back to the sentinel, for the next call
                tl.store(ws_ptr + s * stride_os + at, sentinel_like(t1), mask=rows_ok)
                tl.store(ws_ptr + s * stride_os + at + half, sentinel_like(t2), mask=rows_ok)
        else:
            t1 = tl.load(ws_ptr + at, mask=rows_ok, other=0.0, cache_modifier=".cg")
            t2 = tl.load(ws_ptr + at + half, mask=rows_ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                t1 += tl.load(ws_ptr + s * stride_os + at, mask=rows_ok, other=0.0, cache_modifier=".cg")
                t2 += tl.load(ws_ptr + s * stride_os + at + half, mask=rows_ok, other=0.0, cache_modifier=".cg")
        _rope_store(t1, t2, offs_h, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, nw1, nw2,
                    head_eps, head, M, stride_ch, stride_qo, squares, eps, mean_scale, BLOCK_M, SOFT_BF16, NUM_HEADS,
                    NUM_KV_HEADS, HEAD_DIM, EXACT_MUL, STAGED, HAS_BIAS, QK_NORM)

    @triton.jit
    def _rope_pairs(total, offs_h, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, head, M, stride_ch,
                    stride_qo, squares, eps, mean_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SOFT_BF16: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, EXACT_MUL: tl.constexpr, STAGED: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
        """A PAIRED tile's fp32 sums [BLOCK_M, BLOCK_N] (dims offs_h and offs_h + HEAD_DIM / 2 of head `head`,
        interleaved) through _rope_store."""
        t1, t2 = tl.split(tl.reshape(total, (BLOCK_M, BLOCK_N // 2, 2)))
        _rope_store(t1, t2, offs_h, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, b1, b2, 0.0, head,
                    M, stride_ch, stride_qo, squares, eps, mean_scale, BLOCK_M, SOFT_BF16, NUM_HEADS, NUM_KV_HEADS,
                    HEAD_DIM, EXACT_MUL, STAGED, HAS_BIAS, False)

    @triton.jit
    def _rope_store(t1, t2, offs_h, c, sn, cache_row, k_cache_ptr, v_cache_ptr, q_out_ptr, b1, b2, nw1, nw2, head_eps,
                    head, M, stride_ch, stride_qo, squares, eps, mean_scale, BLOCK_M: tl.constexpr,
                    SOFT_BF16: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, EXACT_MUL: tl.constexpr, STAGED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    QK_NORM: tl.constexpr):
        """Head `head`'s fp32 sums at dims offs_h (t1) and offs_h + HEAD_DIM / 2 (t2) of every row, scaled by the
        rows' 1 / RMS (STAGED), then q/k rotated with the rows' cos/sin at offs_h (c, sn; every op rounded as
        _rope_store_kernel rounds it: rotate_pair) or v copied, to where rope_store would write them (cache_row: the
        rows' cache offsets). EXACT_MUL: the kernel keeps FMA contraction on for its projection, which must give the
        GEMV's bits. QK_NORM: q's and k's heads then normed (normed_head) before the rotation."""
        half: tl.constexpr = HEAD_DIM // 2
        dtype = q_out_ptr.dtype.element_ty
        offs_m = tl.arange(0, BLOCK_M)
        rows_ok = (offs_m < M)[:, None] & (offs_h >= 0)[None, :]
        if STAGED:  # the rows' RMS scale, from the fused all-reduce's squares (rows_squares)
            rstd = rstd_of(squares, mean_scale, eps)
            t1 = t1 * rstd[:, None]
            t2 = t2 * rstd[:, None]
        x1 = round_to(t1, dtype, SOFT_BF16)  # the qkv output, as the GEMV would have stored it
        x2 = round_to(t2, dtype, SOFT_BF16)
        if HAS_BIAS:  # then its bias added and rounded again, as linear_small_m's add_ does (Qwen2's q, k, v)
            if EXACT_MUL:  # (its own instruction: never an FMA with the RMS scale's product)
                x1, x2 = add_rn(x1, b1[None, :]), add_rn(x2, b2[None, :])
            else:
                x1, x2 = x1 + b1[None, :], x2 + b2[None, :]
            x1 = round_to(x1, dtype, SOFT_BF16)
            x2 = round_to(x2, dtype, SOFT_BF16)
        if head < NUM_HEADS + NUM_KV_HEADS:
            if QK_NORM:  # (1 / HEAD_DIM: a power of two, exact)
                x1, x2 = normed_head(x1, x2, nw1, nw2, head_eps, 1.0 / HEAD_DIM, dtype, SOFT_BF16, EXACT_MUL, False)
            o1, o2 = rotate_pair(x1, x2, c, sn, dtype, SOFT_BF16, EXACT_MUL)
            if head < NUM_HEADS:
                dst = q_out_ptr + offs_m[:, None] * stride_qo + head * HEAD_DIM + offs_h[None, :]
            else:
                dst = k_cache_ptr + cache_row[:, None] + (head - NUM_HEADS) * stride_ch + offs_h[None, :]
            tl.store(dst, o1, mask=rows_ok)
            tl.store(dst + half, o2, mask=rows_ok)
        else:
            dst = v_cache_ptr + cache_row[:, None] + (head - NUM_HEADS - NUM_KV_HEADS) * stride_ch + offs_h[None, :]
            tl.store(dst, to_dtype(x1, dtype, SOFT_BF16), mask=rows_ok)  # (x1 holds a value of dtype: exact)
            tl.store(dst + half, to_dtype(x2, dtype, SOFT_BF16), mask=rows_ok)

    @triton.jit
    def _polled_halves(ws_ptr, at, ok, stride_os, half: tl.constexpr, SPLITS: tl.constexpr):
        """A head's two halves summed over all SPLITS partials in split order, past L1, and how many of their elements
        still hold the sentinel (both halves' loads go out before the one reduction)."""
        t1, stale1 = _polled_sum(ws_ptr, stride_os, at, ok, SPLITS)
        t2, stale2 = _polled_sum(ws_ptr + half, stride_os, at, ok, SPLITS)
        return t1, t2, unfilled(stale1 | stale2, ok)

    @triton.jit
    def _split_sum_kernel(ws_ptr, y_ptr, numel, SPLITS, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
                          PDL: tl.constexpr):
        """y (contiguous, numel elements) = the SPLITS partials of ws [SPLITS, numel], added in split order (a
        fixed order: the bits do not depend on which split finished first), rounded once."""
        pdl_enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
        for s in range(1, SPLITS):
            acc += tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, to_dtype(acc, y_ptr.dtype.element_ty, SOFT_BF16), mask=ok)


def config_for(x: torch.Tensor, n: int, k: int, m: int, epilogue: bool = False) -> GemvConfig:
    """The tiles for x's device: its architecture's table (the interpreter's CPU tensors: the default tiles). A
    table's resident tiles are for 16-bit weights at one row: 4-byte ones (a resident 32 x 2048 fp32 slice is 128
    registers a thread over 16 warps, and spills) and more rows (`resident`) take the default tiles instead, not one
    whole-K step."""
    cfg = tiles(n, k, m, table_path(torch.cuda.get_device_capability(x.device)) if x.is_cuda else None, epilogue)
    return resident_or_default(cfg, n, k, m, x.element_size())


def resident_or_default(cfg: GemvConfig, n: int, k: int, m: int, elem: int) -> GemvConfig:
    """cfg, unless it is a resident config spanning K that m rows of `elem`-byte data cannot run resident (see
    config_for): then the default tiles."""
    return tiles(n, k, m) if resident(cfg, k) and (elem > 2 or m > 1) else cfg


def prefetch_tiles(cfg: GemvConfig, n: int, k: int, elem: int, budget: int | None = None) -> int:
    """Weight tiles each program pulls into L2 before its PDL wait: all of its K range where the whole weight fits
    the budget (default `prefetch_budget()`), else as many as fit, and at least the first."""
    steps = -(-k // (cfg.split_k * cfg.block_k))  # BLOCK_K steps per program
    tile_bytes = n * cfg.block_k * elem * cfg.split_k  # one step of every program
    return max(1, min(steps, (prefetch_budget(n, k) if budget is None else budget) // tile_bytes))


def dense_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) by cuBLAS (torch on CPU), into `out` where given: the path wherever the small-M kernel does not
    run. The bias is added as nn.Linear adds it (F.linear, or addmm into out: one rounding)."""
    if out is None:
        return F.linear(x, w, bias)
    return torch.matmul(x, w.t(), out=out) if bias is None else torch.addmm(bias, x, w.t(), out=out)


def linear_small_m(x: torch.Tensor, w: torch.Tensor, *, use_triton: bool | None = None,
                   config: GemvConfig | None = None, out: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in x's dtype; F.linear where the kernel does not apply (M above
    `max_rows`, CPU without the interpreter, strided inputs). `config` overrides `tiles(N, K)` (benchmarks, tuned
    tables). `out` (contiguous [M, N] in x's dtype), where given, receives the product (a persistent buffer graphs
    write into). A bias is added to the kernel's rounded product by a kernel of its own (Qwen2's q, k and v; a Llama
    with attention_bias or mlp_bias): within a rounding of F.linear's."""
    if out is not None and (out.shape != (x.shape[0], w.shape[0]) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"linear_small_m's out must be contiguous [{x.shape[0]}, {w.shape[0]}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if not _applies(x, w, use_triton):
        return dense_linear(x, w, out, bias)
    y = _launch(x, w, config or config_for(x, w.shape[0], x.shape[1], x.shape[0]), gate_up=False, y=out)
    return y if bias is None else y.add_(bias)


def linear_all_reduce_norm(x: torch.Tensor, w: torch.Tensor, channel: Channel, residual: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float, *, residual_early: bool = False,
                           use_triton: bool | None = None, config: GemvConfig | None = None) -> ReducedNorm | None:
    """A row-parallel projection x @ w.T with the all-reduce, the residual add and the next RMSNorm's staging in its
    epilogue (lamport.py): the sum over ranks is never stored, the new residual is, and the projection after takes
    the ReducedNorm. Every rank must call it for the same shapes at the same point (it waits for their tiles). None
    where it does not apply (the caller runs the projection and the all-reduce): where linear_small_m would not run
    the kernel, an output the channel cannot carry, or split-K tiles whose reduction is a second kernel.
    residual_early: the caller vouches that `residual` and `norm_weight` were written before the kernel that produced
    x was launched (a transformer block's residual predates its branch), so the kernel reads them before its PDL
    wait. Safe because every kernel here lets its dependent in only after its own wait: while we wait, the kernel
    before ours has passed its wait, so the one before that has finished and its writes are in L2 (the loads bypass
    L1). Never for a residual that the kernel just before this one writes."""
    if not _applies(x, w, use_triton):
        return None
    m, k = x.shape
    n = w.shape[0]
    if (not channel.fits(m, n, x.dtype, x.device) or residual.shape != (m, n) or residual.dtype != x.dtype
            or norm_weight.shape != (n,) or norm_weight.dtype != x.dtype):
        return None
    cfg = config or config_for(x, n, k, m, epilogue=True)
    if cfg.split_k > 1 and not last_split_reduces():
        return None
    # a copy made here is a kernel just before ours, whose output the early reads would run ahead of (as in
    # qkv_rope_store): read after the PDL wait then
    residual_early = residual_early and residual.is_contiguous() and norm_weight.is_contiguous()
    residual, norm_weight = residual.contiguous(), norm_weight.contiguous()
    n_tiles = triton.cdiv(n, cfg.block_n)
    # torch.empty is capturable: under CUDA graph capture these come from the graph's pool
    reduced = ReducedNorm(torch.empty_like(residual), torch.empty_like(residual),
                          torch.empty(n_tiles, block_m(m), dtype=torch.float32, device=x.device), n_tiles, norm_weight,
                          eps)
    _launch(x, w, cfg, gate_up=False, all_reduce=(channel, residual, reduced), residual_early=residual_early)
    return reduced


def gate_up_silu(x: torch.Tensor | ReducedNorm, w: torch.Tensor, *, use_triton: bool | None = None,
                 config: GemvConfig | None = None) -> torch.Tensor | None:
    """silu_and_mul(linear_small_m(x, w)) in one launch, bit for bit (the same tiles and sums, the activation's
    roundings), for w = cat(gate, up) [2 * inter, K]: the gate_up projection's epilogue makes the activation, so the
    [M, 2 * inter] projection output is never stored and read back. x may be a fused all-reduce's ReducedNorm: the
    kernel then reads its staged input and applies the RMS scale (within bf16 rounding of the normalised input's
    result, not its bits). None where it does not apply (the caller then runs
    the two steps): where linear_small_m would not run the kernel, or the shape's tiles split K."""
    xt = x.staged if isinstance(x, ReducedNorm) else x
    if not _applies(xt, w, use_triton) or w.shape[0] % 2:
        return None
    cfg = config or config_for(xt, w.shape[0], xt.shape[1], xt.shape[0])
    if cfg.split_k != 1:  # the epilogue needs whole sums; a split-K table entry keeps the two kernels
        return None
    return _launch(xt, w, cfg, gate_up=True, recv=x if isinstance(x, ReducedNorm) else None)


def _staged_args(x: torch.Tensor, recv: ReducedNorm | None) -> dict:
    """The kernels' arguments for an input a fused all-reduce staged (its squares; x's own tensors as placeholders
    where x is plain)."""
    if recv is None:
        return dict(sq_ptr=x, tiles=0, eps=0.0, mean_scale=0.0, STAGED=False, PIECES=1)
    if block_m(x.shape[0]) != recv.squares.shape[1]:  # the kernels read the squares with their row tile as stride
        raise ValueError(f"{x.shape[0]} staged rows take a {block_m(x.shape[0])}-row tile; the fused all-reduce's "
                         f"squares were written for {recv.squares.shape[1]}")
    scale = float(np.float32(1.0) / np.float32(x.shape[1]))  # the kernels multiply the squares' sum by fl(1/H)
    return dict(sq_ptr=recv.squares, tiles=recv.tiles, eps=recv.eps, mean_scale=scale, STAGED=True,
                PIECES=pieces_for(recv.tiles))


def _all_reduce_args(x: torch.Tensor, all_reduce: tuple | None) -> dict:
    """_gemv_kernel's arguments for an all-reduce in its epilogue: (channel, residual, ReducedNorm to fill), or
    placeholders."""
    if all_reduce is None:
        return dict(ch_ptr=x, res_ptr=x, nw_ptr=x, rout_ptr=x, xs_ptr=x, slot_elems=0, timeout_ns=0,
                    ALL_REDUCE=False, WS=1, RANK=0)
    ch, residual, r = all_reduce
    return dict(ch_ptr=ch.addrs, res_ptr=residual, nw_ptr=r.weight, rout_ptr=r.residual_out, xs_ptr=r.staged,
                sq_ptr=r.squares, tiles=r.tiles, slot_elems=ch.slot_elems, timeout_ns=ch.timeout_ns, ALL_REDUCE=True,
                WS=ch.world_size, RANK=ch.rank)


def _applies(x: torch.Tensor, w: torch.Tensor, use_triton: bool | None) -> bool:
    """Whether the small-M kernels take x [M, K] @ w [N, K].T: Triton here, M <= max_rows, unit-stride rows, one
    dtype."""
    use = (x.is_cuda and _device_takes(x.device.index, x.element_size()) if use_triton is None
           else use_triton) and triton is not None
    return (use and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
            and 0 < x.shape[0] <= max_rows(x.element_size()) and x.stride(-1) == 1 and w.stride(-1) == 1
            and x.dtype == w.dtype)


def resident(cfg: GemvConfig, k: int, m: int = 1) -> bool:
    """Whether the config asks for resident tiles, its one tile spans K, and there is one row: _gemv_kernel then loads
    a program's whole weight slice before its PDL wait (RESIDENT) instead of prefetching its first tile into L2. The
    weights are then read before the kernel before has finished, so they must not be what that kernel writes (the
    model's parameters never are). The shipped sm90 table gives them to o_proj at one row (32 x 2048 over 16 warps):
    it follows decode attention, which leaves HBM idle, so its 16 MB stream during attention. Whole TP=1 steps on
    one H200 (bench/results/2026-12-01_h200_resident): batch 1 2.498 -> 2.417 ms (epilogue chain), 2.549 -> 2.477
    (plain chain). Not from two rows on: a batched tensor-core dot over K slices took 128 registers a thread over 16
    warps, a whole SM's register file, so o_proj's programs could not sit beside attention's, and it lost 0.15-0.35
    ms a step at batches 2-16 (bench/results/2026-12-02_h200_resident_rows, run1); that path is gone. A table's
    resident entry gives more rows the default tiles (`resident_or_default`); a resident config passed explicitly
    runs its one whole-K tile as a plain one."""
    return cfg.resident and cfg.block_k >= k and m == 1


def _tile_args(x: torch.Tensor, cfg: GemvConfig, n: int, k: int, whole: bool = False) -> dict:
    """The launch arguments every projection kernel takes from its tiles, x's dtype and PDL (the L2 prefetch depth
    matters only to a PDL launch; none where `whole`, the weights resident)."""
    pdl = use_pdl(x)
    return dict(BLOCK_M=block_m(x.shape[0]), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SOFT_BF16=soft_bf16_rounding(x),
                IEEE=x.dtype == torch.float32, PDL=pdl,
                PREFETCH_TILES=0 if whole else (prefetch_tiles(cfg, n, k, x.element_size()) if pdl else 1),
                LINE=min(128 // x.element_size(), cfg.block_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **pdl_launch(pdl))


def _launch(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig, gate_up: bool, recv: ReducedNorm | None = None,
            all_reduce: tuple | None = None, residual_early: bool = False,
            ablate: dict | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
    """recv: x is recv's staged input (scaled by its RMS). all_reduce (channel, residual, ReducedNorm to fill): the
    output goes through lamport.all_reduce_tile instead of y (which is then left unwritten). ablate: constexprs that
    replace the launch's own, for bench/bench_read_ceiling.py's ablations only (e.g. PREFETCH_TILES=0, or
    LAST_REDUCES=False, which leaves y unwritten): never for a result anyone reads. y: the output, where the caller
    holds it (contiguous [M, N])."""
    m, k = x.shape
    n = w.shape[0]
    whole = resident(cfg, k, m)
    tile = _tile_args(x, cfg, n, k, whole)
    soft, pdl = tile["SOFT_BF16"], tile["PDL"]
    early = all_reduce is None or not late_trigger()
    # (an all-reducing projection stores no y: x stands in for it, for its dtype)
    if y is None:
        y = x if all_reduce is not None else torch.empty(m, n // 2 if gate_up else n, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n // 2, cfg.block_n // 2) if gate_up else triton.cdiv(n, cfg.block_n)
    last_reduces = cfg.split_k > 1 and last_split_reduces()
    # (an ablation that leaves partials unadded never writes them into the sentinel buffer: nobody would re-arm it)
    unadded = ablate is not None and ablate.get("LAST_REDUCES") is False
    partials = partials_buffer(x.device, cfg.split_k * m * n) if last_reduces and polled_partials() and not unadded \
        else None
    out = y if cfg.split_k == 1 else split_workspace(partials, (cfg.split_k, m, n), x.device)
    counters = split_counters(x.device, blocks) if last_reduces and partials is None else y
    fused = {**_staged_args(x, recv), **_all_reduce_args(x, all_reduce)}  # (a pusher's squares are its output)
    constexprs = dict(GATE_UP=gate_up, EXACT=not soft, LAST_REDUCES=last_reduces, SPLITS=cfg.split_k,
                      EARLY_TRIGGER=early, RES_EARLY=residual_early and all_reduce is not None, RESIDENT=whole,
                      POLLED=partials is not None, **fused, **tile)
    _gemv_kernel[(blocks, cfg.split_k)](
        x, w, out, y, counters, m, n, k, x.stride(0), w.stride(0), out.stride(-2),
        out.stride(0) if cfg.split_k > 1 else 0, **(constexprs | (ablate or {})))
    if cfg.split_k > 1 and not last_reduces:
        _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            out, y, m * n, cfg.split_k, BLOCK=SUM_BLOCK, SOFT_BF16=soft, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return y


def qkv_rope_store(x: torch.Tensor | ReducedNorm, w: torch.Tensor, positions: torch.Tensor,
                   cos_sin: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, *,
                   inputs_early: bool = False, use_triton: bool | None = None,
                   config: GemvConfig | None = None, bias: torch.Tensor | None = None,
                   head_norm: HeadNorm | None = None) -> torch.Tensor | None:
    """rope_and_store(linear_small_m(x, w), ...)'s q [M, Hq, D], with k and v written into the caches, in one launch
    and with the same bits (the same tiles, the same sums, the same roundings). None where it does not apply (the
    caller then runs the two steps): M above max_rows, a head_dim the tiles do not divide, layouts rope_store would
    refuse, resident tiles (they sum over K in another order: not the two steps' bits). x may be a fused all-reduce's
    ReducedNorm (see gate_up_silu: then within bf16 rounding, not the same bits).
    inputs_early: the caller vouches that positions and slot_mapping were written before the kernel before this one
    was launched (a step's metadata, copied in before its first kernel), so the kernel reads them, and the cos/sin
    rows at them, before its PDL wait (linear_all_reduce_norm's residual_early says why that is safe).
    bias [N] (Qwen2's q, k and v): added to the projection's rounded output and rounded again before the rotation, as
    linear_small_m(x, w, bias=bias) and then rope_and_store do it.
    head_norm (q_norm's weight, k_norm's weight, eps; each [head_dim]: Qwen3): every q and k head RMS-normed before its
    rotation, as rms_norm over each head would, within the variance's last fp32 bit (it sums the squares in another
    order). Not with paired tiles (qkv_paired): a head's reducer normalizes it."""
    recv = x if isinstance(x, ReducedNorm) else None
    x = x.staged if recv is not None else x
    if not _applies(x, w, use_triton):
        return None
    m, k = x.shape
    n = w.shape[0]
    if n != (num_heads + 2 * num_kv_heads) * head_dim or head_dim & (head_dim - 1) or head_dim < 32:
        return None
    cos, sin = cos_sin
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return None
    if cos.shape[-1] != head_dim // 2 or k_cache.shape[2:] != (num_kv_heads, head_dim) or any(
            t.dtype != x.dtype for t in (cos, sin, k_cache, v_cache)) or bias is not None and (
            bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()) or head_norm_problem(
            head_norm, head_dim, x.dtype, x.device) is not None:
        return None  # rope_and_store refuses these with a reason: the caller's two steps will say it
    config = config or config_for(x, n, k, m)
    if head_dim % config.block_n or resident(config, k, m):  # (resident tiles sum in another order: other bits)
        return None
    tile = _tile_args(x, config, n, k)
    # the kernel reads positions and slots at unit steps (a no-op for the engine's contiguous buffers); a copy made
    # here is a kernel that reading them early (before the PDL wait) would run ahead of
    inputs_early = inputs_early and positions.is_contiguous() and slot_mapping.is_contiguous()
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    paired = qkv_paired() and head_norm is None
    blocks = triton.cdiv(n, config.block_n)
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    # (a paired column block reduces as _gemv_kernel's do, so it polls where they do; a head's reducer by its rule)
    polled = polled_partials() if paired else polled_rope(m)
    partials = partials_buffer(x.device, config.split_k * m * n) if polled else None
    ws = split_workspace(partials, (config.split_k, m, n), x.device)
    counters = split_counters(x.device, blocks if paired else num_heads + 2 * num_kv_heads)
    _qkv_rope_kernel[(blocks, config.split_k)](
        x, w, ws, counters, positions, cos, sin, slot_mapping, k_cache, v_cache, q, x if bias is None else bias,
        *(head_norm or (x, x, 0.0)), m, n, k, x.stride(0), w.stride(0), ws.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.stride(0), NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], EXACT_MUL=not tile["SOFT_BF16"],
        SPLITS=config.split_k, ROPE_EARLY=inputs_early, POLLED=partials is not None, PAIRED=paired,
        HAS_BIAS=bias is not None, QK_NORM=head_norm is not None, **_staged_args(x, recv), **tile)
    return q
