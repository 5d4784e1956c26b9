"""kernels/sampling.sample_rows, GPU time per call, by mix and batch.

    python bench/bench_sample_rows.py --vocab 128256 --batches 1,8,32

Each point times 200 calls with CUDA events queued behind a sleep (bench_top_k.gpu_times_us: the GPU alone, gaps
between a call's launches included), each call with fresh seeds, as every decode step has, and prints the median, the
mean and the largest: a row that two races leave rejected runs further rounds in one program, a cost that only some
calls pay. The logits are random normal times the mix's scale, in bf16, as the decode logits come; top-k's floor is
torch.topk's, computed once outside the timing. The mixes: `temperature` (the race alone), `top-p` (0.95: race, check,
second race, check), `min-p` (0.05), `top-k` (50, the race alone) and `flat-top-p` (logits of standard deviation
0.05, top-p 0.05: a race lands in the kept set about 1 time in 20, so nearly every row runs the further rounds).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_top_k import gpu_times_us

from tpgraph.kernels.sampling import SEED_HIGH, sample_rows

MIXES = {"temperature": dict(t=0.8), "top-p": dict(t=0.8, p=0.95), "min-p": dict(t=0.7, min_p=0.05),
         "top-k": dict(t=0.8, k=50), "flat-top-p": dict(t=1.0, p=0.05, scale=0.05 / 3.0)}


def point(vocab: int, batch: int, mix: str, scale: float, calls: int = 200) -> list[float]:
    m = {"p": 1.0, "min_p": 0.0, "k": 0, "scale": 1.0, **MIXES[mix]}
    x = (torch.randn(batch, vocab, device="cuda") * scale * m["scale"]).to(torch.bfloat16)
    floor = x.topk(m["k"], dim=-1).values[:, -1].float() if m["k"] else torch.full((batch,), float("-inf"),
                                                                                  device="cuda")
    params = torch.stack([torch.full_like(floor, m["t"]), torch.full_like(floor, m["p"]),
                          torch.full_like(floor, m["min_p"]), floor], dim=1).contiguous()
    seeds = [torch.randint(0, SEED_HIGH, (batch,), device="cuda") for _ in range(calls + 10)]  # (each 16-byte aligned)
    ids = torch.empty(batch, dtype=torch.int64, device="cuda")
    truncated = m["p"] < 1.0 or m["min_p"] > 0.0
    step = iter(range(calls + 10))
    return gpu_times_us(lambda: sample_rows(x, params, seeds[next(step)], out=ids, truncated=truncated), calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"of {','.join(MIXES)}")
    p.add_argument("--scale", type=float, default=3.0)
    args = p.parse_args()
    for mix in args.mixes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            times = point(args.vocab, batch, mix, args.scale)
            print(f"{mix:12s} batch {batch:3d} | sample_rows median {statistics.median(times):7.1f} mean "
                  f"{statistics.mean(times):7.1f} max {max(times):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
