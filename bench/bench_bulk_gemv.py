"""The bulk-copy projection (tpgraph/kernels/bulk_gemv.py) against the shipped Triton small-M kernel and cuBLAS.
One GPU.

    python bench/bench_bulk_gemv.py --out bench/results/.../bulk_gemv.json

Llama-3-8B at TP=2 per rank (bench_kernels.py's PROJECTION_SHAPES), bf16, at `--rows` rows. Every candidate is first
checked exactly: x and w small integers, so every fp32 sum is exact and the output must equal the float64 product
rounded to bf16, element for element.

Two figures, one timing method (tpgraph/tune/timing.py, the one bench_kernels.py uses: graphs replayed interleaved
in a Williams order, the median of `--runs` replays after a GPU sleep; one GPU, so the slowest rank is this one):
- alone: a graph of 64 calls of one projection cycling through weight copies that cannot sit in L2, per call;
- chain: the layer's four projections in layer order (qkv, o_proj, gate_up, down), `--layers` layers of their own
  weights in one graph, per layer: each kernel follows another projection, as in a decode step (which also has
  attention, the norms and rope between them). Bulk candidates there: each projection with its fastest config alone,
  and with the one default config.
The floor: bytes moved over the HBM copy bandwidth measured in the same process (bench_decode.hbm_bandwidth).
Writes JSON, a markdown table (.md) and a plot (.png).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_kernels import PROJECTION_SHAPES, copies_for, cycling_graph  # bench/ is on the path when this runs

CHAIN = ("qkv", "o_proj", "gate_up", "down")


@dataclass
class Row:
    figure: str  # "alone" or "chain"
    projection: str  # a projection's name, or "layer" for the chain
    rows: int
    candidate: str
    moved_bytes: int
    us: float
    floor_us: float

    @property
    def of_floor(self) -> float:
        return self.floor_us / self.us


def moved(n: int, k: int, m: int) -> int:
    return 2 * (n * k + m * (n + k))


def configs(grid: str):
    from tpgraph.kernels.bulk_gemv import BulkConfig

    if grid == "default":
        return [BulkConfig()]
    return [BulkConfig(blocks_per_sm=b, stages=s, trigger=t, evict_first=e)
            for b, s, t, e in itertools.product((1, 2), (2, 4, 6), ("start", "issued", "exit"), (False, True))]


def exact_case(n: int, k: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, w of small integers (every fp32 sum exact) and the float64 product rounded to bf16: what must come out."""
    gen = torch.Generator(device="cpu").manual_seed(n * 31 + k + m)
    x = torch.randint(-3, 4, (m, k), generator=gen).to(device, torch.bfloat16)
    w = torch.randint(-3, 4, (n, k), generator=gen).to(device, torch.bfloat16)
    return x, w, (x.double() @ w.double().T).to(torch.bfloat16)


def check_exact(config, case: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    from tpgraph.kernels.bulk_gemv import bulk_linear

    x, w, want = case
    got = bulk_linear(x, w, config=config)
    torch.cuda.synchronize()
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise SystemExit(f"bulk {config.label} at {list(w.shape)} x {x.shape[0]} rows: {len(bad)} elements differ, "
                         f"first at {bad[0].tolist()}: {got[tuple(bad[0])].item()} against "
                         f"{want[tuple(bad[0])].item()}")


def alone(name: str, m: int, grid, hbm: float, l2: int, runs: int, device: torch.device) -> list[Row]:
    from tpgraph.kernels.bulk_gemv import bulk_linear
    from tpgraph.kernels.gemv import linear_small_m
    from tpgraph.tune.timing import K_OPS, graph_ops_us_interleaved

    n, k = PROJECTION_SHAPES[name]
    copies = copies_for(n * k * 2, l2)
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    graphs = {"cuBLAS": cycling_graph(lambda i: F.linear(x, ws[i]), copies),
              "Triton (shipped)": cycling_graph(lambda i: linear_small_m(x, ws[i]), copies)}
    case = exact_case(n, k, m, device)
    for config in grid:
        check_exact(config, case)
        graphs[config.label] = cycling_graph(lambda i, c=config: bulk_linear(x, ws[i], out, c), copies)
    del case
    per_op = graph_ops_us_interleaved(None, graphs, K_OPS, runs)
    graphs.clear()
    ws.clear()
    torch.cuda.empty_cache()
    nbytes = moved(n, k, m)
    return [Row("alone", name, m, cand, nbytes, us, nbytes / hbm * 1e6) for cand, us in per_op.items()]


def chain(m: int, layers: int, best: dict, hbm: float, runs: int, device: torch.device) -> list[Row]:
    """The layer's projections in order, `layers` layers, each candidate one graph; per layer µs."""
    from tpgraph.kernels.bulk_gemv import BulkConfig, bulk_linear
    from tpgraph.kernels.gemv import linear_small_m
    from tpgraph.tune.timing import graph_ops_us_interleaved

    weights = [{p: torch.randn(*PROJECTION_SHAPES[p], dtype=torch.bfloat16, device=device) * 0.02 for p in CHAIN}
               for _ in range(layers)]
    xs = {p: torch.randn(m, PROJECTION_SHAPES[p][1], dtype=torch.bfloat16, device=device) for p in CHAIN}
    outs = {p: torch.empty(m, PROJECTION_SHAPES[p][0], dtype=torch.bfloat16, device=device) for p in CHAIN}
    candidates = {"cuBLAS": lambda p, w: F.linear(xs[p], w), "Triton (shipped)": lambda p, w: linear_small_m(xs[p], w),
                  "bulk default": lambda p, w: bulk_linear(xs[p], w, outs[p], BulkConfig()),
                  "bulk best alone": lambda p, w: bulk_linear(xs[p], w, outs[p], best[p])}

    def graph_of(fn) -> torch.cuda.CUDAGraph:
        layer = itertools.cycle(range(layers))

        def one_layer() -> None:
            ws = weights[next(layer)]
            for p in CHAIN:
                fn(p, ws[p])

        from tpgraph.tune.timing import capture

        return capture(one_layer, layers)

    graphs = {name: graph_of(fn) for name, fn in candidates.items()}
    per_layer = graph_ops_us_interleaved(None, graphs, layers, runs)
    graphs.clear()
    weights.clear()
    torch.cuda.empty_cache()
    nbytes = sum(moved(*PROJECTION_SHAPES[p], m) for p in CHAIN)
    return [Row("chain", "layer", m, cand, nbytes, us, nbytes / hbm * 1e6) for cand, us in per_layer.items()]


def table(rows: list[Row], hbm: float) -> str:
    lines = [f"HBM copy bandwidth {hbm / 1e12:.2f} TB/s; floor = bytes moved / that bandwidth", "",
             "| figure | projection | rows | candidate | µs | floor µs | floor ÷ time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.figure} | {r.projection} | {r.rows} | {r.candidate} | {r.us:.2f} | {r.floor_us:.2f} | "
                     f"{r.of_floor:.0%} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Per projection and rows: cuBLAS, the shipped kernel and the fastest bulk config, side by side."""
    lines = ["| figure | projection | rows | cuBLAS | Triton (shipped) | fastest bulk | its config |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r.figure, r.projection, r.rows) for r in rows}, key=lambda t: (t[0], CHAIN.index(t[1])
                                                                                   if t[1] in CHAIN else 9, t[2]))
    for key in keys:
        group = {r.candidate: r for r in rows if (r.figure, r.projection, r.rows) == key}
        bulk = min((r for c, r in group.items() if c.startswith("bulk")), key=lambda r: r.us)

        def cell(r: Row) -> str:
            return f"{r.us:.2f} µs, {r.of_floor:.0%}"

        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell(group['cuBLAS'])} | "
                     f"{cell(group['Triton (shipped)'])} | {cell(bulk)} | {bulk.candidate} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in dict.fromkeys((r.figure, r.projection, r.rows) for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(keys)), 4))
    for i, key in enumerate(keys):
        group = [r for r in rows if (r.figure, r.projection, r.rows) == key]
        bulk = min((r for r in group if r.candidate.startswith("bulk")), key=lambda r: r.us)
        for j, (label, r) in enumerate((("cuBLAS", next(r for r in group if r.candidate == "cuBLAS")),
                                        ("Triton (shipped)", next(r for r in group
                                                                  if r.candidate == "Triton (shipped)")),
                                        ("fastest bulk", bulk))):
            ax.bar(i + 0.27 * (j - 1), 100 * r.of_floor, 0.27, color=f"C{j}", label=label if i == 0 else None)
    ax.axhline(88, color="k", lw=0.8, ls="--", label="88%")
    ax.set_xticks(range(len(keys)), [f"{f}\n{p} m={m}" for f, p, m in keys], fontsize=7)
    ax.set_ylabel("floor ÷ time (%)")
    ax.set_title("projections at the HBM floor: bulk copies vs shipped Triton vs cuBLAS")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--projections", default=",".join(CHAIN))
    p.add_argument("--rows", default="1", help="rows of x, comma-separated (1-4)")
    p.add_argument("--grid", choices=("full", "default"), default="full", help="bulk configs timed alone")
    p.add_argument("--layers", type=int, default=32, help="layers in the chain graph (0: no chain)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    names = [n for n in args.projections.split(",") if n]
    if bad := set(names) - set(PROJECTION_SHAPES):
        raise SystemExit(f"--projections: unknown {sorted(bad)}; known: {', '.join(PROJECTION_SHAPES)}")
    rows_list = [int(r) for r in args.rows.split(",") if r]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_bulk_gemv needs an sm_90+ GPU")
    from bench_decode import hbm_bandwidth

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    hbm = hbm_bandwidth(device)
    grid = configs(args.grid)
    rows: list[Row] = []
    for m in rows_list:
        best = {}
        for name in names:
            found = alone(name, m, grid, hbm, props.L2_cache_size, args.runs, device)
            rows += found
            fastest = min((r for r in found if r.candidate.startswith("bulk")), key=lambda r: r.us)
            best[name] = next(c for c in grid if c.label == fastest.candidate)
            print(f"alone {name} m={m}: " + ", ".join(f"{r.candidate} {r.us:.2f}" for r in found
                                                       if not r.candidate.startswith("bulk")) +
                  f", {fastest.candidate} {fastest.us:.2f} µs", flush=True)
        if args.layers and set(CHAIN) <= set(names):
            rows += chain(m, args.layers, best, hbm, args.runs, device)
    text = summary(rows) + "\n\nEvery candidate:\n\n" + table(rows, hbm)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm,
                                        "rows": [asdict(r) | {"of_floor": r.of_floor} for r in rows]}, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
        plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
