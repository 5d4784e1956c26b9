"""One sampling step's GPU kernels by mix: the sampler alone, on random logits, as the engine calls it.

    python bench/profile_sampling.py --vocab 128256 --batches 8,32

Per (batch, mix): the median of 20 CUDA-event timings around `Sampler.sample_async` (mostly the host launching its
kernels: in the overlapped loop that hides behind the forward), the number of kernels and the sum of their device
time in one step under torch.profiler, and the kernels taking the most of it. The mixes are bench_engine_steps.py's.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_engine_steps import MIXES
from torch.profiler import ProfilerActivity, profile

from tpgraph.engine.penalties import PenaltyTable
from tpgraph.engine.sampler import Sampler, SampleRow
from tpgraph.engine.sampling_params import SamplingParams


def profile_point(batch: int, vocab: int, mix: str, top: int) -> None:
    table = PenaltyTable(batch, vocab, "cuda")
    sampler = Sampler("cuda", penalties=table)
    rows = [SampleRow(SamplingParams(**MIXES[mix]), [1, 2], [], seq_id=i) for i in range(batch)]
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        sampler.sample(logits, rows)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        sampler.sample_async(logits, rows)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sampler.sample(logits, rows)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + e.device_time
    print(f"== batch {batch} {mix}: event median {statistics.median(times):.1f} us, {len(kernels)} kernels, "
          f"{sum(by_name.values()):.1f} us of kernel time")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {us:8.1f} {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256,
                   help="default: Llama-3's (at any TP every rank samples the gathered logits)")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--mixes", default="sampled,penalties,sampled+penalties")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    for batch in (int(b) for b in args.batches.split(",")):
        for mix in args.mixes.split(","):
            profile_point(batch, args.vocab, mix, args.top)


if __name__ == "__main__":
    main()
