"""What one kernel boundary costs inside a CUDA graph, against a software barrier inside one kernel.

A batch-1 decode step is about 170 dependent kernels (issue 11), and each kernel's weights are read in a few µs, so
the time between one kernel's last store and the next kernel's first dependent load is paid ~170 times a step. This
measures it on its own, for the forms a decode step uses:

- `plain`: each hop a normal launch (the next starts when this one ends);
- `pdl`: launched as a programmatic dependent that waits (`gdc_wait`) for the one before to end, then lets the next
  one in at once (`pdl_enter`, as the small Triton kernels do);
- `pdl_late`: the same, but the next one is let in only at the end (as a projection with the late trigger);
- `barrier`: all the hops in one kernel, each followed by a software grid barrier (an acq_rel count per hop and an
  acquire poll on it), the alternative to a kernel boundary when the producer and the consumer are one grid whose
  programs are all resident. The counts only grow (each barrier waits for the next multiple of the grid), so a
  replay needs no reset.

Every hop is a grid-wide dependency: program p of hop i reads what program p + 1 wrote in hop i - 1, and adds one, so
after K hops every element has grown by K (checked). Timing: the project's one method (`tpgraph.tune.timing`): K hops
in one CUDA graph, per-hop time = the graph's time / K, the candidates' runs interleaved, the median of the runs.

    python bench/bench_pdl_boundary.py --grids 1,33,132,264 --out boundary.json   # (one GPU; a table and a plot)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tpgraph.kernels._pdl import pdl_enter, pdl_launch, triton_has_pdl
from tpgraph.tune.timing import K_OPS, MIN_RUNS, capture, graph_ops_us_interleaved

try:
    import triton
    import triton.language as tl
except ImportError:  # the bench needs Triton; the CPU tests skip without it
    triton = None

WIDTH = 128  # floats each program carries from hop to hop (one 512-byte row)
SPIN_LIMIT = 1 << 18  # polls before a barrier gives up (a grid larger than what is resident would never pass)
MODES = ("plain", "pdl", "pdl_late", "barrier")

if triton is not None:

    @triton.jit
    def _hop(src, dst, G, WIDTH: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr):
        """dst[p] = src[(p + 1) % G] + 1, for program p's row of WIDTH floats."""
        if LATE:
            if PDL:
                tl.extra.cuda.gdc_wait()
        else:
            pdl_enter(PDL)
        p = tl.program_id(0)
        offs = tl.arange(0, WIDTH)
        row = tl.load(src + ((p + 1) % G) * WIDTH + offs)
        tl.store(dst + p * WIDTH + offs, row + 1.0)
        if PDL and LATE:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _hops_with_barriers(a, b, counts, failed, G, HOPS, SPIN_LIMIT, WIDTH: tl.constexpr):
        """HOPS hops between buffers a and b in one grid, a software barrier after each: every program stores its
        row, counts itself in (acq_rel: its stores are visible to whoever sees the count), and polls until the count
        reaches the multiple of G its own count belongs to (counts[hop] grows by G a replay and is never reset). A
        poll that runs out sets `failed`, and the polls after it give up at once (the result is then wrong, and
        reported)."""
        p = tl.program_id(0)
        offs = tl.arange(0, WIDTH)
        for hop in range(HOPS):
            src = a if hop % 2 == 0 else b
            dst = b if hop % 2 == 0 else a
            row = tl.load(src + ((p + 1) % G) * WIDTH + offs, cache_modifier=".cg")
            tl.store(dst + p * WIDTH + offs, row + 1.0)
            tl.debug_barrier()  # every thread's store before the count
            old = tl.atomic_add(counts + hop, 1, sem="acq_rel", scope="gpu")
            target = (old // G + 1) * G
            seen = old + 1
            tries = tl.where(tl.load(failed) != 0, SPIN_LIMIT, 0)
            while (seen < target) & (tries < SPIN_LIMIT):
                seen = tl.atomic_add(counts + hop, 0, sem="acquire", scope="gpu")
                tries += 1
            if seen < target:
                tl.atomic_xchg(failed, 1)


def hops_reference(start: torch.Tensor, hops: int) -> torch.Tensor:
    """What K hops leave: row p after hop i is row p + 1 of hop i - 1, plus one, so after K hops row p holds the
    starting row (p + K) % G, plus K."""
    grid = start.shape[0]
    return start[(torch.arange(grid) + hops) % grid] + hops


class BoundaryChain:
    """K hops of one mode over a [G, WIDTH] fp32 buffer pair, as a callable to capture (`run`)."""

    def __init__(self, mode: str, grid: int, hops: int, device: torch.device) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode in ("pdl", "pdl_late") and not (device.type == "cuda" and triton_has_pdl()
                                                and torch.cuda.get_device_capability(device)[0] >= 9):
            raise RuntimeError(f"{mode} needs a GPU of sm_90 or later and a Triton with programmatic dependent launch")
        self.mode, self.grid, self.hops = mode, grid, hops
        # small integers: every hop's sum is exact, so the check is equality
        self.start = torch.randint(-1000, 1000, (grid, WIDTH), device=device).float()
        self.a, self.b = self.start.clone(), torch.zeros_like(self.start)
        self.counts = torch.zeros(hops, dtype=torch.int32, device=device)
        self.failed = torch.zeros(1, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.a.copy_(self.start)

    def run(self) -> None:
        """One pass of K hops (the barrier mode: one launch; the others: K launches)."""
        if self.mode == "barrier":
            _hops_with_barriers[(self.grid,)](self.a, self.b, self.counts, self.failed, self.grid, self.hops,
                                              SPIN_LIMIT, WIDTH=WIDTH, num_warps=1)
            return
        pdl = self.mode != "plain"
        for hop in range(self.hops):
            src, dst = (self.a, self.b) if hop % 2 == 0 else (self.b, self.a)
            _hop[(self.grid,)](src, dst, self.grid, WIDTH=WIDTH, PDL=pdl, LATE=self.mode == "pdl_late", num_warps=1,
                               **pdl_launch(pdl))

    def result(self) -> torch.Tensor:
        """Where the last hop wrote."""
        return self.b if self.hops % 2 else self.a


def check(chain: BoundaryChain, graph: torch.cuda.CUDAGraph | None = None) -> None:
    """One pass from the start (eager, or a replay of `graph`) must give hops_reference's rows (an exact float sum
    of small integers)."""
    chain.reset()
    if graph is None:
        chain.run()
    else:
        graph.replay()
        torch.cuda.synchronize()
    if chain.failed.item():
        raise RuntimeError(f"the {chain.grid}-program barrier gave up: not every program was resident")
    want = hops_reference(chain.start.cpu(), chain.hops)
    if not torch.equal(chain.result().cpu(), want):
        raise AssertionError(f"{chain.mode} at {chain.grid} programs: the hops did not carry the rows")


def measure(grids: list[int], modes: list[str], runs: int, device: torch.device) -> list[dict]:
    rows = []
    for grid in grids:
        chains = {mode: BoundaryChain(mode, grid, K_OPS, device) for mode in modes}
        for chain in chains.values():
            check(chain)
        # plain / pdl / pdl_late: K launches captured; barrier: one launch of K hops (capture with one call)
        graphs = {mode: capture(chain.run, 1) for mode, chain in chains.items()}
        per_hop = graph_ops_us_interleaved(None, graphs, K_OPS, runs)
        for mode, chain in chains.items():
            check(chain, graphs[mode])  # what was timed carried the rows too (the PDL edges are the graph's)
            rows.append({"grid": grid, "mode": mode, "us_per_hop": per_hop[mode]})
        print(f"grid {grid:4d}: " + "  ".join(f"{m} {per_hop[m]:.2f} µs" for m in modes), flush=True)
    return rows


def table(rows: list[dict], modes: list[str]) -> str:
    grids = sorted({r["grid"] for r in rows})
    us = {(r["grid"], r["mode"]): r["us_per_hop"] for r in rows}
    lines = ["| programs | " + " | ".join(f"{m} (µs a hop)" for m in modes) + " |",
             "|---|" + "---|" * len(modes)]
    lines += [f"| {g} | " + " | ".join(f"{us[(g, m)]:.2f}" for m in modes) + " |" for g in grids]
    return "\n".join(lines)


def plot(rows: list[dict], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for mode in modes:
        sel = sorted((r["grid"], r["us_per_hop"]) for r in rows if r["mode"] == mode)
        ax.plot([g for g, _ in sel], [u for _, u in sel], marker="o", label=mode)
    ax.set(xlabel="programs a hop", ylabel=f"µs a hop (graph of {K_OPS})", xscale="log", title="one kernel boundary")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", default="1,33,132,264", help="programs a hop, comma-separated")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--runs", type=int, default=MIN_RUNS)
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure; a .md table and a .png beside it")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if bad := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(bad)}; known: {', '.join(MODES)}")
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("bench_pdl_boundary needs a GPU and Triton")
    try:
        grids = [int(g) for g in args.grids.split(",") if g]
    except ValueError:
        raise SystemExit(f"--grids: comma-separated program counts, got {args.grids!r}") from None
    if not grids or min(grids) < 1:
        raise SystemExit(f"--grids: program counts of at least 1, got {args.grids!r}")
    device = torch.device("cuda")
    rows = measure(grids, modes, args.runs, device)
    print(table(rows, modes))
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hops": K_OPS, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(table(rows, modes) + "\n")
        plot(rows, modes, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
