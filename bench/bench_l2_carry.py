"""Can the next projection's weights wait in L2 while the MLP's weights stream past them? One GPU (issue 11).

In a batch-1 decode step, attention and o_proj leave HBM idle for several µs a layer, while qkv (the next layer's
first kernel) pays about 3.6 µs above its floor to ramp its weight stream up and down. If qkv's weights were pulled
into L2 during that idle time (a prefetch with evict_last priority), and the 176 MB of gate_up and down weights that
stream in between were read with evict_first priority, qkv could read them from L2. This measures whether L2 keeps
them, before any kernel is changed. For each size of the carried read (`--sizes`, MB), one kernel reading it is timed
(CUDA events, the median of `--runs`) after each sequence:

    cold        stream (normal hint)      -> read         nothing carried: what qkv pays now
    carry       prefetch (evict_last)     -> stream (evict_first) -> read
    carry-ns    prefetch (evict_last)     -> stream (normal)      -> read
    carry-pn    prefetch (normal)         -> stream (evict_first) -> read
    carry-bulk  bulk prefetch (evict_last, cp.async.bulk.prefetch) -> stream (evict_first) -> read
    hot         read                      -> read         the best L2 can give

Each carried sequence prefetches a different buffer from the last (as consecutive layers would), so lines left with
evict_last priority by earlier turns compete, as they would in a step. The stream is timed with both hints too.

    python bench/bench_l2_carry.py --out l2_carry.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

LINE_ELEMS = 64  # bf16 elements in a 128-byte line
BULK_ELEMS = 2048  # bf16 elements a bulk prefetch asks for (4 KB)
SCENARIOS = ("cold", "carry", "carry-ns", "carry-pn", "carry-bulk", "hot")


@triton.jit
def _prefetch_lines_kernel(ptr, n, EVICT_LAST: tl.constexpr, BLOCK: tl.constexpr, LINE: tl.constexpr):
    """One L2 prefetch per 128-byte line, BLOCK lines a program."""
    lines = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.minimum(lines * LINE, n - 1)
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk_kernel(ptr, n, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """One 4 KB (CHUNK bf16 elements: the asm's byte count) bulk L2 prefetch per element, evict_last; n is a multiple
    of CHUNK."""
    chunks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.minimum(chunks * CHUNK, n - CHUNK)
    tl.inline_asm_elementwise(
        "{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_last.b64 pol, 1.0;\n\t"
        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], 4096, pol;\n\t}\n\tmov.u32 $0, 0;",
        "=r,l", [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sum_kernel(ptr, n, out_ptr, EVICT_FIRST: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """out[pid] = the sum of this program's STEPS * BLOCK elements: a weight stream, as a projection reads it."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(STEPS):
        o = (pid * STEPS + s) * BLOCK + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            v = tl.load(ptr + o, mask=o < n, other=0.0, eviction_policy="evict_first")
        else:
            v = tl.load(ptr + o, mask=o < n, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


class Streams:
    BLOCK, STEPS = 4096, 8

    def __init__(self) -> None:
        self.out = torch.empty(1 << 20, device="cuda", dtype=torch.float32)

    def read(self, buf: torch.Tensor, evict_first: bool = False) -> None:
        grid = (triton.cdiv(buf.numel(), self.BLOCK * self.STEPS),)
        _sum_kernel[grid](buf, buf.numel(), self.out, EVICT_FIRST=evict_first, BLOCK=self.BLOCK, STEPS=self.STEPS,
                          num_warps=8)

    @staticmethod
    def prefetch(buf: torch.Tensor, evict_last: bool) -> None:
        block = 256
        grid = (triton.cdiv(triton.cdiv(buf.numel(), LINE_ELEMS), block),)
        _prefetch_lines_kernel[grid](buf, buf.numel(), EVICT_LAST=evict_last, BLOCK=block, LINE=LINE_ELEMS,
                                     num_warps=4)

    @staticmethod
    def prefetch_bulk(buf: torch.Tensor) -> None:
        block = 128
        grid = (triton.cdiv(triton.cdiv(buf.numel(), BULK_ELEMS), block),)
        _prefetch_bulk_kernel[grid](buf, buf.numel(), BLOCK=block, CHUNK=BULK_ELEMS, num_warps=4)


def timed(before, body) -> float:
    """µs of body's kernels, queued behind before's (so its launch is hidden)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before()
    start.record()
    body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def measure_size(s: Streams, stream: torch.Tensor, size_mb: int, runs: int) -> dict:
    """Median µs of the read after each scenario, the scenarios in a rotated order each round."""
    # four buffers in turn: consecutive carried sequences never find their own lines left from the turn before
    bufs = [torch.randn(size_mb * (1 << 20) // 2, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    turn = itertools.count()

    def run(name: str) -> float:
        buf = bufs[next(turn) % len(bufs)]
        before = {
            "cold": lambda: s.read(stream),
            "carry": lambda: (s.prefetch(buf, True), s.read(stream, True)),
            "carry-ns": lambda: (s.prefetch(buf, True), s.read(stream, False)),
            "carry-pn": lambda: (s.prefetch(buf, False), s.read(stream, True)),
            "carry-bulk": lambda: (s.prefetch_bulk(buf), s.read(stream, True)),
            "hot": lambda: (s.read(stream), s.read(buf)),  # (read, not prefetched: a prefetch's lines are still
            # arriving when the next kernel starts, so it measured the two competing: 2026-12-02 run1)
        }[name]
        return timed(before, lambda: s.read(buf))

    samples: dict[str, list[float]] = {n: [] for n in SCENARIOS}
    for r in range(runs + 3):  # 3 warm-up rounds
        for name in SCENARIOS[r % len(SCENARIOS):] + SCENARIOS[:r % len(SCENARIOS)]:
            us = run(name)
            if r >= 3:
                samples[name].append(us)
    return {"mb": size_mb, **{n: statistics.median(v) for n, v in samples.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,16,25,32,40", help="MB carried (qkv at TP=2 of Llama-3-8B: 25)")
    ap.add_argument("--stream-mb", type=int, default=176, help="MB streamed in between (gate_up + down at TP=2)")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    s = Streams()
    mb = 1 << 20
    stream = torch.randn(args.stream_mb * mb // 2, device="cuda", dtype=torch.bfloat16)
    bw_bytes = stream.numel() * 2
    results: dict = {"gpu": torch.cuda.get_device_name(), "stream_mb": args.stream_mb, "rows": []}
    for hint in (False, True):
        us = statistics.median(timed(lambda: s.read(stream), lambda h=hint: s.read(stream, h))
                               for _ in range(args.runs))
        results[f"stream_us_{'evict_first' if hint else 'normal'}"] = us
        print(f"stream {args.stream_mb} MB, {'evict_first' if hint else 'normal'}: {us:.1f} µs "
              f"({bw_bytes / us / 1e6:.2f} TB/s)")
    for size in (int(x) for x in args.sizes.split(",")):
        row = measure_size(s, stream, size, args.runs)
        results["rows"].append(row)
        nbytes = size * mb
        print(f"{size:3d} MB read: " + ", ".join(f"{n} {row[n]:.2f} µs ({nbytes / row[n] / 1e6:.2f} TB/s)"
                                                 for n in SCENARIOS))
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
