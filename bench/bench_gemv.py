"""Decode projections at TP=2 Llama-3-8B shapes: cuBLAS (F.linear) against the small-M Triton kernel
(tpgraph/kernels/gemv.py), as a fraction of the measured HBM bandwidth. One GPU.

    python bench/bench_gemv.py --out bench/results/.../gemv.json

Each figure, by the one timing method (tpgraph/tune/timing.py): a CUDA graph of 64 projections cycling through enough
weight copies that they cannot sit in L2, replayed 20 times after a GPU sleep; the median replay / 64. Bandwidth = the
weight's bytes (plus x and y) / that time, over the HBM copy bandwidth measured the same way as bench_decode.py.
Also checks each kernel output against F.linear (bf16: max relative error). Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_decode import hbm_bandwidth  # bench/ is on the path when this script runs

from tpgraph.kernels.gemv import linear_small_m
from tpgraph.tune.timing import K_OPS, capture, graph_op_us

SHAPES = {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
          "lm_head": (64128, 4096)}  # (N, K) per rank at TP=2
L2_MULTIPLE = 4


def per_op_us(fn, copies: int) -> float:
    """The one timing method (tpgraph/tune/timing.py) on this GPU alone: K_OPS projections in a graph, cycling
    through the weight copies."""
    turn = itertools.cycle(range(copies))
    graph = capture(lambda: fn(next(turn)), K_OPS)
    return graph_op_us(None, graph, K_OPS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--ms", default="1,2,4,8,16")
    args = p.parse_args()
    device = torch.device("cuda")
    hbm = hbm_bandwidth(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    print(f"HBM copy bandwidth {hbm / 1e12:.2f} TB/s, L2 {l2 >> 20} MiB", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        wbytes = n * k * 2
        copies = max(1, -(-L2_MULTIPLE * l2 // wbytes))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            moved = wbytes + (m * k + m * n) * 2
            row = {"name": name, "n": n, "k": k, "m": m}
            for label, fn in (("cublas", lambda i, x=x, w=weights: F.linear(x, w[i])),
                              ("triton", lambda i, x=x, w=weights: linear_small_m(x, w[i]))):
                us = per_op_us(fn, copies)
                row[f"{label}_us"], row[f"{label}_of_hbm"] = us, moved / (us * 1e-6) / hbm
            ref, got = F.linear(x, weights[0]).float(), linear_small_m(x, weights[0]).float()
            row["triton_max_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
            rows.append(row)
            print(f"{name:8s} M={m:2d}  cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_of_hbm']:.0%})  triton "
                  f"{row['triton_us']:7.1f} us ({row['triton_of_hbm']:.0%})  err {row['triton_max_rel_err']:.1e}",
                  flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm, "rows": rows},
                                       indent=1))
        plot(rows, args.out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.6), sharey=True)
    for ax, name in zip(axes, names, strict=True):
        sel = [r for r in rows if r["name"] == name]
        for label in ("cublas", "triton"):
            ax.plot([r["m"] for r in sel], [r[f"{label}_of_hbm"] for r in sel], marker="o", label=label)
        ax.axhline(0.88, color="gray", ls="--", lw=0.8)
        ax.set(title=name, xlabel="M (rows)", xscale="log", xticks=[1, 2, 4, 8, 16], xticklabels=[1, 2, 4, 8, 16])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of HBM copy bandwidth")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
