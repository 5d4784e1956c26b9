"""The ring GEMV (csrc/gemv_ring.cu) against the shipped small-M projection and cuBLAS, one row, each projection's
weight of a TP=2 Llama-3-8B rank, timed alone as bench_kernels.py times the projections (issue 11).

Timing method, the one of bench_kernels.py and bench_read_ceiling.py, fixed before any number was read: per size,
every candidate is a graph of 64 calls cycling through weight copies that cannot sit in L2 (4 x L2); the replays of
all candidates of that size are interleaved (Williams order) after a GPU sleep; the median of --runs replays / 64 is
a call. The floor is the weight and vector bytes over the HBM copy bandwidth measured in the same process (a 2 GiB
device copy, read + write counted, as bench_decode.py measures it). Each candidate's output is checked exactly on
integer-valued inputs before it is timed.

    python bench/bench_ring_gemv.py --out ring.json   # one GPU of sm_90+; a .md table and a .png beside it
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_kernels import PROJECTION_SHAPES, copies_for, cycling_graph  # bench/ is on the path when this script runs

from tpgraph.kernels.gemv_ring import RingConfig, gemv_ring

SIZES = ("o_proj", "qkv", "down", "gate_up")
BULK = [RingConfig(256, 16 << 10, 48 << 10, per_sm=2)]
PER_THREAD = [RingConfig(t, c << 10, r << 10, per_sm=p, per_thread_copies=True, late_let_in=late)
              for t, c, r, p, late in ((128, 16, 32, 4, False), (128, 16, 32, 4, True), (128, 8, 24, 4, False),
                                       (128, 8, 24, 4, True), (128, 16, 48, 4, False), (128, 16, 48, 4, True))]
SWEEP = BULK + PER_THREAD


@dataclass
class Row:
    size: str
    candidate: str
    us: float
    floor_us: float

    @property
    def of_floor(self) -> float:
        return self.floor_us / self.us


def candidates(x: torch.Tensor, out: torch.Tensor, configs: list[RingConfig]) -> dict:
    """label -> fn(w) writing x @ w.T into out."""
    from tpgraph.kernels.gemv import linear_small_m

    fns = {"shipped small-M": lambda w: linear_small_m(x, w, out=out), "cuBLAS": lambda w: torch.mm(x, w.T, out=out)}
    for c in configs:
        fns[c.label] = lambda w, c=c: gemv_ring(x, w, c, out=out)
    return fns


def measure(name: str, configs: list[RingConfig], hbm: float, l2: int, runs: int) -> list[Row]:
    from tpgraph.tune.timing import K_OPS, graph_ops_us_interleaved

    n, k = PROJECTION_SHAPES[name]
    nbytes = (n * k + n + k) * 2
    copies = copies_for(n * k * 2, l2)
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    probe_x = torch.randint(-4, 5, (1, k), device="cuda").to(torch.bfloat16)
    probe_w = torch.randint(-4, 5, (n, k), device="cuda").to(torch.bfloat16)
    want = (probe_x.float() @ probe_w.float().T).to(torch.bfloat16)
    for label, fn in candidates(probe_x, out, configs).items():  # exact before timed
        out.fill_(float("nan"))
        fn(probe_w)
        if not torch.equal(out, want):
            raise SystemExit(f"{name} {label}: wrong output ({(out.float() - want.float()).abs().max().item()} off)")
    graphs = {label: cycling_graph(lambda i, fn=fn: fn(ws[i]), copies)
              for label, fn in candidates(x, out, configs).items()}
    per_op = graph_ops_us_interleaved(None, graphs, K_OPS, runs)
    floor = nbytes / hbm * 1e6
    return [Row(name, label, us, floor) for label, us in per_op.items()]


def table(rows: list[Row]) -> str:
    lines = ["| size | candidate | µs | floor µs | floor ÷ time |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.size} | {r.candidate} | {r.us:.2f} | {r.floor_us:.2f} | {r.of_floor:.0%} |")
    best = ["", "| size | shipped small-M | cuBLAS | best ring | its config |", "|---|---|---|---|---|"]
    for size in dict.fromkeys(r.size for r in rows):
        of = {r.candidate: r for r in rows if r.size == size}
        ring = min((r for r in of.values() if r.candidate.startswith("ring")), key=lambda r: r.us)
        best.append(f"| {size} | {of['shipped small-M'].us:.2f} ({of['shipped small-M'].of_floor:.0%}) | "
                    f"{of['cuBLAS'].us:.2f} ({of['cuBLAS'].of_floor:.0%}) | {ring.us:.2f} ({ring.of_floor:.0%}) | "
                    f"{ring.candidate} |")
    return "\n".join(lines + best)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r.size for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for j, label in enumerate(("shipped small-M", "cuBLAS", "best ring")):
        vals = []
        for s in sizes:
            pick = [r for r in rows if r.size == s and (r.candidate.startswith("ring") if label == "best ring"
                                                         else r.candidate == label)]
            vals.append(max(r.of_floor for r in pick) * 100)
        ax.bar([i + j * 0.27 for i in range(len(sizes))], vals, 0.27, label=label)
    ax.axhline(88, color="k", lw=0.8, ls="--")
    ax.set_xticks([i + 0.27 for i in range(len(sizes))], sizes)
    ax.set_ylabel("% of HBM copy bandwidth (M = 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure; a .md table and a .png beside it")
    args = p.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    if bad := set(sizes) - set(SIZES):
        raise SystemExit(f"--sizes: unknown {sorted(bad)}; known: {', '.join(SIZES)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_ring_gemv needs a GPU of sm_90 or later")
    from bench_decode import hbm_bandwidth  # bench/ is on the path when this script runs

    hbm = hbm_bandwidth(torch.device("cuda"))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows: list[Row] = []
    for size in sizes:
        rows += measure(size, SWEEP, hbm, l2, args.runs)
        print(f"{size}: done", flush=True)
    text = f"{torch.cuda.get_device_name()}, HBM copy bandwidth {hbm / 1e12:.2f} TB/s\n\n" + table(rows)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm,
                                        "rows": [asdict(r) | {"of_floor": r.of_floor} for r in rows]}, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
        plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
