"""Temperature, top-p and min-p sampling without a sort: one Triton program a row (on CUDA by default;
TPGRAPH_FUSED_SAMPLING=0 keeps engine/sampler.py's torch chain).

The torch chain sorts every row to find top-p's cut, then runs a dozen [B, V] kernels around it: at batch 32 over a
64128-token vocabulary that was 362 µs of kernels and 53 launches a step (bench/results/2026-12-03_h200_s34_engine_
sampling). Here a row is drawn by rejection, as FlashInfer's sampling kernels do, in one launch:

1. One pass over the row finds its maximum m, the total weight S = sum(exp((x - m) / T)) (an online sum, rescaled as
   the maximum grows), and the winner j of an exponential race over the whole row: argmax of x / T - log(E), E ~
   Exp(1) from Philox keyed by the row's seed, which draws j with probability exp(x_j / T) / S exactly.
2. Where the row asks for top-p or min-p, a second pass checks j against the kept set: j stays when its weight
   w_j = exp((x_j - m) / T) is at least min_p and the weight of the tokens above it is below p * S (the smallest set
   of the largest tokens whose share reaches p, ties at its last value kept: engine/sampler.top_p_keep's set).
3. A rejected j only ever lies below the kept set, so the next race runs over the tokens above it (and at least
   min_p), with fresh random numbers. A race over a superset of the kept set, accepted when it lands in the set, draws
   from the set in proportion to the weights: the kept distribution, exactly. The same check pass also weighs the
   midpoint between the last rejected logit and the lowest known kept one, which bisects the gap when the races land
   low: few rounds even where p is small. A row accepts on the first race with probability at least p.

Every rank runs the same program on the same logits with the same seeds, so every rank draws the same token. Each row
draws from its own seed (a seeded request's seed for its position, or one taken from the sampler's generator), so a
row's token does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from tpgraph.kernels._settings import env_flag

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the torch chain
    triton = None

BLOCK = 2048  # entries a program reads at a time (a 128256-entry row: 63 blocks a pass)
MAX_ROUNDS = 48  # races before a row takes its largest logit (never seen: each round bisects the gap at least)
SEED_HIGH = 1 << 62  # the drawn seeds' range: [0, SEED_HIGH)


def fused_sampling_enabled() -> bool:
    """Whether the sampler draws non-greedy rows with this kernel on CUDA: yes unless TPGRAPH_FUSED_SAMPLING=0."""
    return env_flag("TPGRAPH_FUSED_SAMPLING", default=True)


if triton is not None:
    _LOG2E = 1.4426950408889634

    @triton.jit
    def _race(row_ptr, V, seed, counter_base, inv_t, m, low, min_p, FILTER: tl.constexpr, BLOCK: tl.constexpr):
        """The winner's index of one exponential race over the row's logits (with FILTER only those above `low`
        whose weight exp((x - m) / T) is at least min_p), and without FILTER the row's maximum and total weight."""
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int32)
        total = tl.full((), 0.0, tl.float32)
        Q: tl.constexpr = BLOCK // 4
        quads = tl.arange(0, Q)
        if not FILTER:
            m = tl.full((), float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            x = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
            x = tl.where(x == x, x, float("-inf"))  # NaN never wins
            r0, r1, r2, r3 = tl.randint4x(seed, counter_base + start // 4 + quads, 10)
            bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK])
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            if FILTER:
                w = tl.exp2((x - m) * (inv_t * _LOG2E))
                x = tl.where((x > low) & (w >= min_p), x, float("-inf"))
            else:  # the online maximum and total
                m_new = tl.maximum(m, tl.max(x, axis=0))
                if m_new > float("-inf"):
                    total = total * tl.exp2((m - m_new) * (inv_t * _LOG2E)) \
                        + tl.sum(tl.exp2((x - m_new) * (inv_t * _LOG2E)), axis=0)
                m = m_new
            key = x * inv_t - tl.log(-tl.log(u))
            block_best = tl.max(key, axis=0)
            if block_best > best:
                best = block_best
                best_i = start + tl.argmax(key, axis=0)
        return best_i, m, total

    @triton.jit
    def _weight_above(row_ptr, V, m, inv_t, a, b, BLOCK: tl.constexpr):
        """The row's total weight exp((x - m) / T) over the logits above `a`, and over those above `b`."""
        above_a = 0.0
        above_b = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            x = tl.where(x == x, x, float("-inf"))
            w = tl.exp2((x - m) * (inv_t * _LOG2E))
            above_a += tl.sum(tl.where(x > a, w, 0.0), axis=0)
            above_b += tl.sum(tl.where(x > b, w, 0.0), axis=0)
        return above_a, above_b

    @triton.jit
    def _first_max(row_ptr, V, m, BLOCK: tl.constexpr):
        """The first index of the logit m in the row."""
        first = V
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            first = tl.minimum(first, tl.min(tl.where(x == m, offs, V), axis=0))
        return first

    @triton.jit
    def _sample_kernel(x_ptr, stride_x, V, temp_ptr, top_p_ptr, min_p_ptr, seed_ptr, ids_ptr, round_stride,
                       MAX_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
        """One program a row: the row's token (see the module docstring). Rows with temperature 0 are left alone
        (greedy: the caller's argmax)."""
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(temp_ptr + row)
        if t > 0.0:
            inv_t = 1.0 / t
            p = tl.load(top_p_ptr + row)
            min_p = tl.load(min_p_ptr + row)
            seed = tl.load(seed_ptr + row)
            row_ptr = x_ptr + row * stride_x
            j, m, total = _race(row_ptr, V, seed, 0, inv_t, float("-inf"), 0.0, 0.0, False, BLOCK)
            # a row of -inf (or NaN) only has no weights: its first index, as the torch chain's argmax gives
            done = (((p >= 1.0) & (min_p <= 0.0)) | (m == float("-inf")) | (m == float("inf"))).to(tl.int32)
            share = tl.where(p < 1.0, p * total, float("inf"))
            low = tl.full((), float("-inf"), tl.float32)  # every logit at or below it is out of the kept set
            high = m  # every logit above it is in, by weight
            pivot = m
            rounds = 1
            while done == 0:
                xj = tl.load(row_ptr + j).to(tl.float32)
                above_j, above_pivot = _weight_above(row_ptr, V, m, inv_t, xj, pivot, BLOCK)
                wj = tl.exp2((xj - m) * (inv_t * _LOG2E))
                if (wj >= min_p) & (above_j < share):
                    done = 1
                else:
                    low = tl.maximum(low, xj)
                    if above_pivot >= share:
                        low = tl.maximum(low, pivot)
                    else:
                        high = tl.minimum(high, pivot)
                    if rounds >= MAX_ROUNDS:  # (never seen) the largest logit, always kept
                        j = _first_max(row_ptr, V, m, BLOCK)
                        done = 1
                    else:
                        pivot = tl.where(low > float("-inf"), low + (high - low) * 0.5, m)
                        j, _m, _t = _race(row_ptr, V, seed, rounds * round_stride, inv_t, m, low, min_p, True, BLOCK)
                        rounds += 1
            tl.store(ids_ptr + row, j.to(tl.int64))


def block_for(vocab: int) -> int:
    """BLOCK, or the smallest power of two holding a shorter row (at least 16: four Philox counters)."""
    return max(16, min(BLOCK, triton.next_power_of_2(vocab)))


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                seeds: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, V] logits (fp32/bf16/fp16, a contiguous last dim; -inf for tokens a row may not take) and per row
    [B] fp32 temperature (0: greedy, left to the caller), top_p in (0, 1], min_p in [0, 1] and [B] int64 seeds ->
    [B] int64 drawn ids (rows with temperature 0 hold whatever `out` held, or garbage)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; sample with the torch chain")
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"sample_rows takes [batch, vocab] fp32/bf16/fp16 logits with a contiguous last dim, got "
                         f"{tuple(x.shape)} {x.dtype} with strides {x.stride()}")
    batch, vocab = x.shape
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_p", top_p, torch.float32),
                           ("min_p", min_p, torch.float32), ("seeds", seeds, torch.int64)):
        if t.shape != (batch,) or t.dtype != dtype or t.device != x.device:
            raise ValueError(f"sample_rows' {name} must be [{batch}] {dtype} on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    ids = torch.empty(batch, dtype=torch.int64, device=x.device) if out is None else out
    if batch and vocab:
        _sample_kernel[(batch,)](x, x.stride(0), vocab, temperature.contiguous(), top_p.contiguous(),
                                 min_p.contiguous(), seeds.contiguous(), ids, triton.cdiv(vocab, 4),
                                 MAX_ROUNDS=MAX_ROUNDS, BLOCK=block_for(vocab), num_warps=8)
    return ids
