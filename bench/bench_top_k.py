"""kernels/top_k.top_k_floors against torch.topk's k-th value, GPU time per call.

    python bench/bench_top_k.py --vocab 128256 --batches 1,8,32 --ks 1,50,256

Each point checks that both give the same floors, then times 200 calls of each with CUDA events, queued behind a
sleep 40 at a time so that the host is ahead and the events time the GPU alone (gaps between a call's kernels
included), and prints the medians. Logits are random normal times --scale (a small scale makes many ties in bf16).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from tpgraph.kernels.top_k import top_k_floors

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gpu_times_us(fn: Callable[[], object], calls: int = 200, queued: int = 40) -> list[float]:
    """`calls` GPU times of fn, µs: CUDA events around each call, `queued` calls at a time queued behind a sleep, so
    that the GPU alone is timed. (A GPU holds about a thousand pending launches and the host waits past that: a
    longer queue of calls of several launches would time the host's launching for the later ones.)"""
    for _ in range(10):
        fn()
    times = []
    for first in range(0, calls, queued):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # (about 25 ms of GPU time: every call of the round is queued before it ends)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(min(queued, calls - first))]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times += [start.elapsed_time(end) * 1e3 for start, end in events]
    return times


def gpu_median_us(fn: Callable[[], object], calls: int = 200) -> float:
    return statistics.median(gpu_times_us(fn, calls))


def point(vocab: int, batch: int, k: int, dtype: torch.dtype, scale: float) -> tuple[float, float]:
    x = (torch.randn(batch, vocab, device="cuda") * scale).to(dtype)
    ks = torch.full((batch,), float(k), device="cuda")
    floors = torch.empty(batch, device="cuda")
    want = x.topk(k, dim=-1).values[:, -1].float()
    if not torch.equal(top_k_floors(x, ks, floors), want):
        raise SystemExit(f"top_k_floors differs from torch.topk at batch {batch}, k {k}, {dtype}")
    return (gpu_median_us(lambda: x.topk(k, dim=-1).values[:, -1]),
            gpu_median_us(lambda: top_k_floors(x, ks, floors)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ks", default="1,50,256")
    p.add_argument("--dtypes", default="bf16,fp32", help=f"of {','.join(DTYPES)}")
    p.add_argument("--scale", type=float, default=3.0)
    args = p.parse_args()
    for name in args.dtypes.split(","):
        for k in (int(v) for v in args.ks.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                torch_us, kernel_us = point(args.vocab, batch, k, DTYPES[name], args.scale)
                print(f"{name} x{args.scale} k {k:4d} batch {batch:3d} | torch.topk {torch_us:7.1f} us | top_k_floors "
                      f"{kernel_us:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
