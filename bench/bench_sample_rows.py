"""kernels/sampling.sample_rows, GPU time per call, by mix and batch.

    python bench/bench_sample_rows.py --vocab 128256 --batches 1,8,32

Each point times 200 calls with CUDA events queued behind a sleep (bench_top_k.gpu_median_us: the GPU alone, gaps
between a call's launches included) and prints the median. The logits are random normal times --scale in bf16, as
the decode logits come; top-k's floor is torch.topk's, computed once outside the timing. The mixes: `temperature`
(the race alone), `top-p` (0.95: race, check, second race, check), `min-p` (0.05) and `top-k` (50, the race alone).
"""

from __future__ import annotations

import argparse

import torch
from bench_top_k import gpu_median_us

from tpgraph.kernels.sampling import sample_rows

MIXES = {"temperature": (0.8, 1.0, 0.0, 0), "top-p": (0.8, 0.95, 0.0, 0), "min-p": (0.7, 1.0, 0.05, 0),
         "top-k": (0.8, 1.0, 0.0, 50)}


def point(vocab: int, batch: int, mix: str, scale: float) -> float:
    t, p, min_p, k = MIXES[mix]
    x = (torch.randn(batch, vocab, device="cuda") * scale).to(torch.bfloat16)
    floor = x.topk(k, dim=-1).values[:, -1].float() if k else torch.full((batch,), float("-inf"), device="cuda")
    params = torch.stack([torch.full_like(floor, t), torch.full_like(floor, p), torch.full_like(floor, min_p), floor],
                         dim=1).contiguous()
    seeds = torch.randint(0, 1 << 62, (batch,), device="cuda")
    ids = torch.empty(batch, dtype=torch.int64, device="cuda")
    truncated = p < 1.0 or min_p > 0.0
    return gpu_median_us(lambda: sample_rows(x, params, seeds, out=ids, truncated=truncated))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"of {','.join(MIXES)}")
    p.add_argument("--scale", type=float, default=3.0)
    args = p.parse_args()
    for mix in args.mixes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"{mix:12s} batch {batch:3d} | sample_rows {point(args.vocab, batch, mix, args.scale):7.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
