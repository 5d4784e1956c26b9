"""What a kernel that only reads can reach at each projection's weight size, timed like the projections (issue 11).

Issue 11 asks each projection kernel to run at >= 88% of the measured HBM bandwidth at M = 1. Timed alone
(bench_kernels.py: a graph of 64 calls over weight copies that cannot sit in L2), qkv, o_proj and down stop at 54-80%,
and cuBLAS stops at the same shares. This asks whether any kernel could do better measured that way: a kernel that
does nothing but stream the same bytes and sum them (no dot, no epilogue, no split-K) is the ceiling of every
projection of that size. Its launch shapes are swept (programs a SM, elements a step, warps, pipeline stages), and the
best is the ceiling; the shipped small-M projection of that size is timed in the same process beside it.

Three ways to sit in a chain of kernels:
- `plain`: a normal launch, so each call starts when the one before has ended;
- `pdl`: a programmatic dependent that waits (`gdc_wait`) for the kernel before to end before it reads, and then lets
  the next one in: what a projection whose input comes from the kernel before must do (its weights do not depend on
  that kernel, but its activation does);
- `pdl_free`: let in, and never waits, so consecutive calls overlap: the bandwidth alone, with no boundary at all.

The floor is the bytes over the HBM copy bandwidth measured as bench_decode.py does (a 2 GiB copy, read + write).
A last size (1 GiB, plain only) gives the bandwidth of a pure read against that copy figure.

Then the projection's own access: `tiles` reads each shipped tile shape (and one and twice its splits) as the
projection walks it, [BN, BK] tiles of the row-major weight, BN rows of BK elements, without arithmetic; `packed`
reads the same tiles laid out one program's after another (BN * BK contiguous elements a step). The three together
say where a projection loses against the ceiling: its launch shape (tiles vs read), its access pattern (tiles vs
packed), or its own work (shipped vs tiles).

    python bench/bench_read_ceiling.py --out read_ceiling.json   # one GPU; a .md table and a .png beside it
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_kernels import PROJECTION_SHAPES, copies_for, cycling_graph  # bench/ is on the path when this script runs

try:
    import triton
    import triton.language as tl
except ImportError:  # the bench needs Triton; the CPU tests skip without it
    triton = None

MODES = ("plain", "pdl", "pdl_free")
# weight shapes [N, K] of a Llama-3-8B rank at TP=2 (bench_kernels.py's), bf16, smallest first
SHAPES = {name: PROJECTION_SHAPES[name] for name in ("o_proj", "qkv", "down", "gate_up")}
BIG_READ = 1 << 30  # bytes of the pure-read bandwidth figure


@dataclass(frozen=True)
class ReadConfig:
    """A launch shape of the streaming read: programs per SM, elements a loop step, warps, pipeline stages."""

    per_sm: int
    block: int
    warps: int
    stages: int

    @property
    def label(self) -> str:
        return f"{self.per_sm}x{self.block}x{self.warps}x{self.stages}"


GRID = [ReadConfig(p, b, w, s) for p, b, w, s in itertools.product((1, 2, 4), (4096, 16384), (4, 8), (1, 3))]

if triton is not None:

    @triton.jit
    def _stream_sum(src, out, n, chunk, BLOCK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                    WAIT: tl.constexpr):
        """out[p] = the fp32 sum of src[p * chunk : (p + 1) * chunk] (chunk a multiple of BLOCK; the tail masked)."""
        if PDL:
            if WAIT:
                tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        p = tl.program_id(0)
        start = p.to(tl.int64) * chunk
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for step in tl.range(0, chunk, BLOCK, num_stages=STAGES):
            idx = start + step + offs
            acc += tl.load(src + idx, mask=idx < n, other=0.0).to(tl.float32)
        tl.store(out + p, tl.sum(acc, axis=0))


    @triton.jit
    def _tile_sum(w, out, x, N, K, stride_wn, k_per_split, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                  PACKED: tl.constexpr, PDL: tl.constexpr, DOT: tl.constexpr):
        """The small-M projection's reads without its arithmetic: program (column block b, split s) sums its
        [BN, BK] tiles over its K range, as _gemv_kernel walks them, into out[b * splits + s]. PACKED: the same tiles
        from a buffer where each program's tiles lie one after another (tile t of program (b, s) at
        ((b * splits + s) * steps + t) * BN * BK), so each step reads BN * BK contiguous elements, not BN rows of BK.
        PDL: waits for the kernel before first (as every projection must: its input comes from there). DOT: the
        projection's K loop without its epilogue: each step also loads a [16, BK] tile of x (one row, masked as
        _gemv_kernel pads one row to 16) and adds x @ tile.T on the tensor cores; the sum of the products is stored."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        s = tl.program_id(1)
        r = tl.arange(0, BN)
        c = tl.arange(0, BK)
        k_lo = s * k_per_split
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        prod = tl.zeros([16, BN], dtype=tl.float32)
        m = tl.arange(0, 16)
        base = (b * tl.num_programs(1) + s).to(tl.int64) * BN * k_per_split
        for k0 in tl.range(k_lo, k_lo + k_per_split, BK, num_stages=STAGES):
            if PACKED:
                ptrs = w + base + (k0 - k_lo) * BN + r[:, None] * BK + c[None, :]
            else:
                ptrs = w + (b * BN + r)[:, None].to(tl.int64) * stride_wn + (k0 + c)[None, :]
            tile = tl.load(ptrs)
            if DOT:
                xt = tl.load(x + m[:, None] * K + (k0 + c)[None, :], mask=(m < 1)[:, None], other=0.0)
                prod += tl.dot(xt, tl.trans(tile), out_dtype=tl.float32)
            else:
                acc += tile.to(tl.float32)
        if DOT:
            total = tl.sum(tl.sum(prod, axis=1), axis=0)
        else:
            total = tl.sum(tl.sum(acc, axis=1), axis=0)
        tl.store(out + b * tl.num_programs(1) + s, total)


@dataclass(frozen=True)
class TileConfig:
    """The projection's own launch shape: BN rows x BK columns a tile, warps, stages, splits of K."""

    bn: int
    bk: int
    warps: int
    stages: int
    splits: int

    @property
    def label(self) -> str:
        return f"{self.bn}x{self.bk}x{self.warps}x{self.stages}x{self.splits}"


def tile_sum(w: torch.Tensor, out: torch.Tensor, config: TileConfig, packed: bool, pdl: bool, n: int, k: int,
             x: torch.Tensor | None = None) -> None:
    """Launch the projection-shaped read over w (an [n, k] weight, or its packed copy: the same elements); with x
    (one row of k), its K loop with the dot (DOT)."""
    if n % config.bn or k % (config.bk * config.splits):
        raise ValueError(f"tiles {config.label} do not divide a {n}x{k} weight")
    if out.numel() < n // config.bn * config.splits:
        raise ValueError(f"out holds {out.numel()} sums, the launch has {n // config.bn * config.splits} programs")
    _tile_sum[(n // config.bn, config.splits)](w, out, w if x is None else x, n, k, k, k // config.splits,
                                               BN=config.bn, BK=config.bk, STAGES=config.stages, PACKED=packed,
                                               PDL=pdl, DOT=x is not None, num_warps=config.warps,
                                               **({"launch_pdl": True} if pdl else {}))


def tile_configs(n: int, k: int) -> list[TileConfig]:
    """The shipped tiles for an [n, k] weight at one row (resident ones as the streaming tiles of two rows), and
    the same with one and twice the splits."""
    from tpgraph.kernels.gemv import config_for

    probe = torch.empty(2, k, dtype=torch.bfloat16, device="cuda")
    cfg = config_for(probe[:1], n, k, 1)
    if cfg.resident:
        cfg = config_for(probe, n, k, 2)
    shipped = TileConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.split_k)
    out = [shipped]
    for splits in (1, 2 * shipped.splits):
        c = TileConfig(shipped.bn, shipped.bk, shipped.warps, shipped.stages, splits)
        if c not in out and k % (c.bk * c.splits) == 0:
            out.append(c)
    return out


def ablations(name: str, n: int, k: int) -> dict[str, dict]:
    """The shipped small-M kernel with one piece of its work left out (gemv._launch's `ablate`): no L2 prefetch
    before its wait; split-K partials stored but never counted or added; the kernel after let in only at exit; and
    (o_proj, resident at one row) its streaming tiles instead. With polled partials (the default) the ablations reduce
    by polling as the shipped row does, except "partials not added", which never writes the polled buffer."""
    from tpgraph.kernels.gemv import config_for

    cfg = config_for(torch.empty(1, k, dtype=torch.bfloat16, device="cuda"), n, k, 1)
    out = {"gemv ablate: no L2 prefetch": {"PREFETCH_TILES": 0},
           "gemv ablate: let in at exit": {"EARLY_TRIGGER": False}}
    if cfg.split_k > 1:
        out["gemv ablate: partials not added"] = {"LAST_REDUCES": False}
        out["gemv ablate: neither prefetch nor adding"] = {"LAST_REDUCES": False, "PREFETCH_TILES": 0}
    if cfg.resident:
        out = {"gemv ablate: streaming tiles": {}}
    return out


def ablated_gemv(x: torch.Tensor, w: torch.Tensor, name: str, ablate: dict) -> None:
    """One launch of the shipped kernel's tiles with `ablate`'s constexprs (resident o_proj: the streaming tiles of
    two rows, so that RESIDENT=False streams whole BLOCK_K steps)."""
    from tpgraph.kernels import gemv

    cfg = gemv.config_for(x, w.shape[0], x.shape[1], 1)
    if cfg.resident:
        cfg = gemv.config_for(torch.empty(2, x.shape[1], dtype=x.dtype, device=x.device), w.shape[0], x.shape[1], 2)
        ablate = {}
    gemv._launch(x, w, cfg, gate_up=name == "gate_up", ablate=ablate)


def programs_for(n: int, config: ReadConfig, sms: int) -> tuple[int, int]:
    """(programs, elements each) for n elements: about per_sm programs a SM, each a whole number of BLOCK steps."""
    steps = -(-n // config.block)
    per_program = -(-steps // (config.per_sm * sms))
    chunk = per_program * config.block
    return -(-n // chunk), chunk


def stream_sum(src: torch.Tensor, out: torch.Tensor, config: ReadConfig, sms: int, mode: str = "plain") -> int:
    """Launch the streaming read over src (flat) into out (>= its programs); returns the programs launched."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n = src.numel()
    grid, chunk = programs_for(n, config, sms)
    if out.numel() < grid:
        raise ValueError(f"out holds {out.numel()} sums, the launch has {grid} programs")
    pdl = mode != "plain"
    _stream_sum[(grid,)](src, out, n, chunk, BLOCK=config.block, STAGES=config.stages, PDL=pdl,
                         WAIT=mode == "pdl", num_warps=config.warps, **({"launch_pdl": True} if pdl else {}))
    return grid


@dataclass
class CeilingRow:
    size: str
    nbytes: int
    candidate: str  # "read <mode> <config>" or "<projection> (shipped small-M)"
    us: float
    floor_us: float

    @property
    def of_floor(self) -> float:
        return self.floor_us / self.us


def measure_size(name: str, nbytes: int, modes: list[str], configs: list[ReadConfig], hbm: float, l2: int,
                 sms: int, runs: int, device: torch.device) -> list[CeilingRow]:
    """Every read candidate (and, for a projection, the shipped small-M kernel at one row) of one size, timed
    interleaved in one process."""
    from tpgraph.tune.timing import K_OPS, graph_ops_us_interleaved

    copies = copies_for(nbytes, l2)
    shape = SHAPES.get(name)
    flat = nbytes // 2
    ws = [torch.randn(*(shape or (flat,)), dtype=torch.bfloat16, device=device) * 0.02 for _ in range(copies)]
    out = torch.empty(max(max(programs_for(flat, c, sms)[0] for c in configs), 1 << 16), dtype=torch.float32,
                      device=device)
    graphs = {}
    # checked before timing, on small integers (every program's fp32 sum exact): each program's sum, exactly
    probe = torch.randint(-8, 8, shape or (flat,), dtype=torch.int32, device=device)
    probe_w = probe.to(torch.bfloat16)
    for mode, config in itertools.product(modes, configs):
        grid, chunk = programs_for(flat, config, sms)
        out.fill_(float("nan"))
        stream_sum(probe_w.view(-1), out, config, sms, mode)
        check_sums(out, flat_sums(probe, grid, chunk), f"{name} read {mode} {config.label}")
        graphs[f"read {mode} {config.label}"] = cycling_graph(
            lambda i, mode=mode, config=config: stream_sum(ws[i].view(-1), out, config, sms, mode), copies)
    if shape is not None and "pdl" in modes:
        # the projection's own tiles, read without arithmetic: as stored (row-major) and packed per program
        for config, packed in itertools.product(tile_configs(*shape), (False, True)):
            out.fill_(float("nan"))
            tile_sum(probe_w, out, config, packed, True, *shape)
            check_sums(out, tile_sums(probe, config, packed), f"{name} tiles {config.label}")
            graphs[f"tiles {'packed' if packed else 'rows'} {config.label}"] = cycling_graph(
                lambda i, config=config, packed=packed: tile_sum(ws[i], out, config, packed, True, *shape), copies)
    if shape is not None:
        from tpgraph.kernels.gemv import gate_up_silu, linear_small_m

        x = torch.randn(1, shape[1], dtype=torch.bfloat16, device=device)
        if name == "gate_up":
            graphs[f"{name}+silu (shipped small-M)"] = cycling_graph(lambda i: gate_up_silu(x, ws[i]), copies)
        else:
            graphs[f"{name} (shipped small-M)"] = cycling_graph(lambda i: linear_small_m(x, ws[i]), copies)
        if "pdl" in modes:
            config = tile_configs(*shape)[0]
            graphs[f"tiles dot {config.label}"] = cycling_graph(
                lambda i: tile_sum(ws[i], out, config, False, True, *shape, x=x), copies)
            for label, ablate in ablations(name, *shape).items():
                graphs[label] = cycling_graph(lambda i, ablate=ablate: ablated_gemv(x, ws[i], name, ablate), copies)
    per_op = graph_ops_us_interleaved(None, graphs, K_OPS, runs)
    graphs.clear()  # the graphs read these copies: both go once timed
    ws.clear()
    torch.cuda.empty_cache()
    floor = nbytes / hbm * 1e6
    return [CeilingRow(name, nbytes, cand, us, floor) for cand, us in per_op.items()]


def flat_sums(w: torch.Tensor, grid: int, chunk: int) -> torch.Tensor:
    """What _stream_sum's programs must store for an integer tensor read flat, exactly (int64), in program order."""
    flat = w.reshape(-1).long()
    return torch.nn.functional.pad(flat, (0, grid * chunk - flat.numel())).view(grid, chunk).sum(1)


def tile_sums(w: torch.Tensor, config: TileConfig, packed: bool) -> torch.Tensor:
    """What _tile_sum's programs must store for an integer [n, k] weight, exactly (int64), in program order."""
    n, k = w.shape
    if packed:  # program p's tiles: the next BN x (k / splits) elements of the buffer
        return w.reshape(-1).long().view(n // config.bn * config.splits, -1).sum(1)
    return w.long().view(n // config.bn, config.bn, config.splits, k // config.splits).sum((1, 3)).reshape(-1)


def check_sums(out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The launch stored exactly `want` (integer sums, exact in fp32 below 2**24) in out's first programs."""
    got = out[:want.numel()]
    if not torch.equal(got, want.to(torch.float32)):
        bad = int((got != want.to(torch.float32)).sum())
        raise AssertionError(f"{what}: {bad} of {want.numel()} programs stored another sum")


def best_reads(rows: list[CeilingRow]) -> dict[tuple[str, str], CeilingRow]:
    """(size, mode) -> the fastest read candidate of that mode."""
    best: dict[tuple[str, str], CeilingRow] = {}
    for r in rows:
        if r.candidate.startswith("read "):
            key = (r.size, r.candidate.split()[1])
            if key not in best or r.us < best[key].us:
                best[key] = r
    return best


def table(rows: list[CeilingRow], modes: list[str], hbm: float) -> str:
    best = best_reads(rows)
    sizes = list(dict.fromkeys(r.size for r in rows))
    lines = [f"HBM copy bandwidth {hbm / 1e12:.2f} TB/s; floor = bytes / that bandwidth; each cell: µs, floor ÷ time "
             "(best launch shape)", "",
             "| size | bytes | floor µs | shipped small-M | " + " | ".join(f"read, {m}" for m in modes) + " |",
             "|---|---|---|---|" + "---|" * len(modes)]
    for size in sizes:
        sel = [r for r in rows if r.size == size]
        shipped = next((r for r in sel if r.candidate.endswith("(shipped small-M)")), None)
        cells = [f"{shipped.us:.2f}, {shipped.of_floor:.0%}" if shipped else ""]
        for m in modes:
            b = best.get((size, m))
            cells.append(f"{b.us:.2f}, {b.of_floor:.0%} ({b.candidate.split()[2]})" if b else "")
        lines.append(f"| {size} | {sel[0].nbytes:,} | {sel[0].floor_us:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tiles_table(rows: list[CeilingRow]) -> str:
    """The projection-shaped reads (`_tile_sum`, PDL waiting) beside the shipped kernel: µs, floor ÷ time."""
    lines = ["| size | tiles (BNxBKxwarpsxstagesxsplits) | row-major | packed | shipped small-M |",
             "|---|---|---|---|---|"]
    for size in dict.fromkeys(r.size for r in rows):
        sel = {r.candidate: r for r in rows if r.size == size}
        shipped = next((r for c, r in sel.items() if c.endswith("(shipped small-M)")), None)
        for label in dict.fromkeys(c.split()[2] for c in sel if c.startswith("tiles ")):
            cells = [sel.get(f"tiles {form} {label}") for form in ("rows", "packed")]
            lines.append(f"| {size} | {label} | " + " | ".join(f"{r.us:.2f}, {r.of_floor:.0%}" if r else ""
                                                               for r in cells)
                         + (f" | {shipped.us:.2f}, {shipped.of_floor:.0%} |" if shipped else " | |"))
    return "\n".join(lines)


STEPS = ("tiles rows", "tiles dot", "shipped", "gemv ")  # from the read to the kernel, then its ablations


def _step(row: CeilingRow) -> int:
    return next(i for i, key in enumerate(STEPS) if key in row.candidate)


def steps_table(rows: list[CeilingRow]) -> str:
    """From the read to the shipped kernel, a step at a time: the shipped tiles read, with the dot, the shipped
    kernel, and the shipped kernel with one piece left out (µs, floor ÷ time)."""
    lines = ["| size | candidate | µs | floor ÷ time |", "|---|---|---|---|"]
    for size in dict.fromkeys(r.size for r in rows):
        sel = sorted((r for r in rows if r.size == size and any(key in r.candidate for key in STEPS)), key=_step)
        lines += [f"| {size} | {r.candidate} | {r.us:.2f} | {r.of_floor:.0%} |" for r in sel]
    return "\n".join(lines)


def plot(rows: list[CeilingRow], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_reads(rows)
    sizes = [s for s in dict.fromkeys(r.size for r in rows) if s in SHAPES]
    labels = ["shipped small-M"] + [f"read, {m}" for m in modes]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        vals = []
        for s in sizes:
            if j == 0:
                r = next((r for r in rows if r.size == s and r.candidate.endswith("(shipped small-M)")), None)
            else:
                r = best.get((s, modes[j - 1]))
            vals.append(r.of_floor if r else 0.0)
        ax.bar([i + j * width for i in range(len(sizes))], vals, width, label=label)
    ax.axhline(0.88, color="gray", ls="--", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))],
                  [f"{s}\n{SHAPES[s][0] * SHAPES[s][1] * 2 / 1e6:.1f} MB" for s in sizes])
    ax.set(ylabel="floor ÷ time", title="projections against a kernel that only reads (graph of 64, alone)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SHAPES) + ",1GiB", help=f"of {', '.join(SHAPES)}, 1GiB")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure; a .md table and a .png beside it")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if bad := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(bad)}; known: {', '.join(MODES)}")
    sizes = [s for s in args.sizes.split(",") if s]
    if bad := set(sizes) - set(SHAPES) - {"1GiB"}:
        raise SystemExit(f"--sizes: unknown {sorted(bad)}; known: {', '.join(SHAPES)}, 1GiB")
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("bench_read_ceiling needs a GPU and Triton")
    from bench_decode import hbm_bandwidth  # bench/ is on the path when this script runs

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    if "pdl" in modes or "pdl_free" in modes:
        from tpgraph.kernels._pdl import triton_has_pdl

        if props.major < 9 or not triton_has_pdl():
            raise SystemExit("the pdl modes need sm_90+ and a Triton with programmatic dependent launch")
    hbm = hbm_bandwidth(device)
    rows: list[CeilingRow] = []
    for size in sizes:
        big = size == "1GiB"
        nbytes = BIG_READ if big else SHAPES[size][0] * SHAPES[size][1] * 2
        rows += measure_size(size, nbytes, ["plain"] if big else modes, GRID, hbm, props.L2_cache_size,
                             props.multi_processor_count, args.runs, device)
        print(f"{size}: done", flush=True)
    text = (table(rows, modes, hbm) + "\n\nThe projections' own tiles read without arithmetic (PDL waiting):\n\n"
            + tiles_table(rows) + "\n\nFrom the read to the shipped kernel:\n\n" + steps_table(rows))
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm,
                                        "rows": [asdict(r) | {"of_floor": r.of_floor} for r in rows]}, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
        plot(rows, modes, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
