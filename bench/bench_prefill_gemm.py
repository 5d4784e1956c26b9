"""cuBLAS bf16 GEMM time against the token count M, for one Llama-3-8B layer's projections at TP=1 (qkv, o_proj,
gate_up, down): where a prefill chunk's row count falls on the GEMMs' tiles.

    python bench/bench_prefill_gemm.py --out gemm_m.json

Each (projection, M) is timed with CUDA events around one torch.nn.functional.linear, 5 warm-up calls, then the
median of 50. Prints the layer's total per M and per token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
TOKENS = (256, 384, 448, 512, 517, 520, 528, 544, 576, 640, 700, 768, 896, 1024, 1100, 1152, 1280, 1536, 2048)


def median_us(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--out", type=Path, default=Path("gemm_m.json"))
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    out: dict[str, dict[int, float]] = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out.setdefault(name, {})[m] = median_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
    print("M, us per layer (qkv + o + gate_up + down), us per token")
    for m in tokens:
        total = sum(out[name][m] for name in out)
        print(m, round(total, 1), round(total / m, 3), {name: round(out[name][m], 1) for name in out})
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
