"""Decode projections at TP=2 Llama-3-8B shapes: cuBLAS (F.linear) against the small-M Triton kernel
(tpgraph/kernels/gemv.py), as a fraction of the measured HBM bandwidth. One GPU.

    python bench/bench_gemv.py --out bench/results/.../gemv.json
    python bench/bench_gemv.py --sweep --out bench/results/.../gemv_sweep.json  # the config grid per shape x M

Each figure, by the one timing method (tpgraph/tune/timing.py): a CUDA graph of 64 projections cycling through enough
weight copies that they cannot sit in L2, replayed 20 times after a GPU sleep; the median replay / 64. Bandwidth = the
weight's bytes (plus x and y) / that time, over the HBM copy bandwidth measured the same way as bench_decode.py.
Also checks each kernel output against F.linear (bf16: max relative error). Writes JSON and a PNG.

--sweep times, instead, every GemvConfig of `sweep_configs` (split-K only where the column blocks alone leave SMs
short of two programs each) at each shape x `--sweep-ms`, plus the default config and cuBLAS, by the same method;
configs that fail to compile or launch (shared memory, registers) are noted and skipped. It prints the best and top 3
per shape x M, then `BEST = {(n, k, m): GemvConfig(...)}` to paste into a table; the JSON has it all under "sweep".
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_decode import hbm_bandwidth  # bench/ is on the path when this script runs

from tpgraph.kernels.gemv import GemvConfig, linear_small_m, max_rows, tiles
from tpgraph.tune.timing import K_OPS, capture, graph_op_us

SHAPES = {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
          "lm_head": (64128, 4096)}  # (N, K) per rank at TP=2
L2_MULTIPLE = 4
GRID = {"block_n": (16, 32, 64), "block_k": (128, 256, 512), "num_warps": (4, 8), "num_stages": (3, 5),
        "split_k": (1, 2, 4)}
MAX_TIMED = 200  # configs timed per shape x M (the grid gives at most 108; at most 180 with --splits 1,2,4,8,16)
MAX_REL_ERR = 1e-2  # bf16 output against F.linear: a config above it is wrong, not slow


def sweep_configs(n: int, k: int, sms: int, splits: tuple[int, ...] = GRID["split_k"]) -> list[GemvConfig]:
    """The grid for an [N, K] weight, with split-K counts `splits`: split-K only while the column blocks number fewer
    than two per SM (more programs would only queue), and never into more splits than K has BLOCK_K steps."""
    out = []
    for bn, bk, warps, stages, split in itertools.product(*{**GRID, "split_k": splits}.values()):
        if split > 1 and (-(-n // bn) >= 2 * sms or split > -(-k // bk)):
            continue
        out.append(GemvConfig(bn, bk, warps, stages, split))
    return out[:MAX_TIMED]


def short(cfg: GemvConfig) -> str:
    return f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} k{cfg.split_k}"


def per_op_us(fn, copies: int) -> float:
    """The one timing method (tpgraph/tune/timing.py) on this GPU alone: K_OPS projections in a graph, cycling
    through the weight copies."""
    turn = itertools.cycle(range(copies))
    graph = capture(lambda: fn(next(turn)), K_OPS)
    return graph_op_us(None, graph, K_OPS)


def shape_data(n: int, k: int, l2: int, device: torch.device) -> tuple[list[torch.Tensor], int]:
    """Enough copies of a random [N, K] bf16 weight that cycling through them misses L2, and their count."""
    copies = max(1, -(-L2_MULTIPLE * l2 // (n * k * 2)))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)], copies


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def compare(args: argparse.Namespace, device: torch.device, hbm: float, l2: int) -> list[dict]:
    """cuBLAS against the kernel's default config at every shape x M."""
    rows = []
    for name, (n, k) in selected(args).items():
        weights, copies = shape_data(n, k, l2, device)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            moved = n * k * 2 + (m * k + m * n) * 2
            row = {"name": name, "n": n, "k": k, "m": m}
            for label, fn in (("cublas", lambda i, x=x, w=weights: F.linear(x, w[i])),
                              ("triton", lambda i, x=x, w=weights: linear_small_m(x, w[i]))):
                us = per_op_us(fn, copies)
                row[f"{label}_us"], row[f"{label}_of_hbm"] = us, moved / (us * 1e-6) / hbm
            row["triton_max_rel_err"] = rel_err(linear_small_m(x, weights[0]), F.linear(x, weights[0]).float())
            rows.append(row)
            print(f"{name:8s} M={m:2d}  cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_of_hbm']:.0%})  triton "
                  f"{row['triton_us']:7.1f} us ({row['triton_of_hbm']:.0%})  err {row['triton_max_rel_err']:.1e}",
                  flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    return rows


def time_config(cfg: GemvConfig, x: torch.Tensor, weights: list[torch.Tensor], copies: int, ref: torch.Tensor,
                moved: int, hbm: float) -> dict:
    """One config: an eager call first (compiles it, and a failure to compile or launch raises here, outside any
    capture), its error against F.linear, then the timing."""
    err = rel_err(linear_small_m(x, weights[0], config=cfg), ref)
    us = per_op_us(lambda i: linear_small_m(x, weights[i], config=cfg), copies)
    return {**dataclasses.asdict(cfg), "us": us, "of_hbm": moved / (us * 1e-6) / hbm, "max_rel_err": err}


def sweep(args: argparse.Namespace, device: torch.device, hbm: float, l2: int) -> tuple[list[dict], dict]:
    """Every config of the grid at every shape x M; -> (one entry per shape x M, {(n, k, m): best config})."""
    from tqdm import tqdm

    ms = [int(v) for v in args.sweep_ms.split(",")]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    shapes = selected(args)
    splits = tuple(int(v) for v in args.splits.split(","))
    grids = {name: sweep_configs(n, k, sms, splits) for name, (n, k) in shapes.items()}
    kernels = {(c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k > 1) for g in grids.values() for c in g}
    # Triton compiles per config and argument specialization (M == 1 is specialized; shapes and strides here are
    # all multiples of 16), not per shape.
    m_kinds = len({m == 1 for m in ms})
    print(f"sweep: {len(shapes)} shapes x M in {ms}: {sum(map(len, grids.values())) * len(ms)} timings "
          f"({', '.join(f'{name} {len(g)}' for name, g in grids.items())} per M), ~{len(kernels) * m_kinds} kernel "
          f"compiles", flush=True)
    entries, best = [], {}
    for name, (n, k) in shapes.items():
        weights, copies = shape_data(n, k, l2, device)
        default = tiles(n, k)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            moved = n * k * 2 + (m * k + m * n) * 2
            cublas_us = per_op_us(lambda i, x=x, w=weights: F.linear(x, w[i]), copies)
            timed, failed, wrong = [], [], []
            configs = list(dict.fromkeys([default, *grids[name]]))
            for cfg in tqdm(configs, desc=f"{name} M={m}", leave=False, unit="cfg", mininterval=2):
                try:
                    result = time_config(cfg, x, weights, copies, ref, moved, hbm)
                except Exception as e:  # out of shared memory or registers, a launch the GPU refuses: skip it
                    torch.cuda.synchronize()  # a sticky CUDA error raises here and ends the sweep
                    failed.append({**dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                (wrong if result["max_rel_err"] > MAX_REL_ERR else timed).append(result)
            timed.sort(key=lambda r: r["us"])
            entry = {"name": name, "n": n, "k": k, "m": m, "moved_bytes": moved, "cublas_us": cublas_us,
                     "cublas_of_hbm": moved / (cublas_us * 1e-6) / hbm,
                     "default": next((r for r in timed if GemvConfig(**config_fields(r)) == default), None),
                     "best": timed[0] if timed else None, "top3": timed[:3], "timed": timed, "failed": failed,
                     "wrong": wrong}
            entries.append(entry)
            print(sweep_line(entry), flush=True)
            if timed:
                best[(n, k, m)] = GemvConfig(**config_fields(timed[0]))
        weights.clear()
        torch.cuda.empty_cache()
    return entries, best


def config_fields(result: dict) -> dict:
    """GemvConfig's fields in a timing result (an older JSON lacks the later fields, which have defaults)."""
    return {f.name: result[f.name] for f in dataclasses.fields(GemvConfig) if f.name in result}


def sweep_line(e: dict) -> str:
    """One line per shape x M: the best config and its share of HBM, the default's and cuBLAS's, the top 3."""
    head = f"{e['name']:8s} M={e['m']:2d}"
    counts = f"[{len(e['timed'])} timed, {len(e['failed'])} failed, {len(e['wrong'])} wrong]"
    cublas = f"cuBLAS {e['cublas_us']:.1f} us ({e['cublas_of_hbm']:.0%})"
    if e["best"] is None:
        return f"{head}  no config ran  {cublas}  {counts}"
    b, d = e["best"], e["default"]
    default = f"default {d['us']:.1f} us ({d['of_hbm']:.0%})" if d else "default failed"
    top = ", ".join(f"{short(GemvConfig(**config_fields(r)))} {r['us']:.1f}" for r in e["top3"])
    return (f"{head}  best {short(GemvConfig(**config_fields(b)))} {b['us']:6.1f} us ({b['of_hbm']:.0%})  {default}  "
            f"{cublas}  top3 us: {top}  {counts}")


def selected(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    if unknown := set(names) - set(SHAPES):
        raise SystemExit(f"--shapes: unknown {sorted(unknown)}; known: {', '.join(SHAPES)}")
    return {name: SHAPES[name] for name in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--ms", default="1,2,4,8,16")
    p.add_argument("--shapes", default="", help=f"comma-separated subset of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--sweep", action="store_true", help="time the config grid per shape x M instead")
    p.add_argument("--sweep-ms", default="1,8", help="M values for --sweep")
    p.add_argument("--splits", default=",".join(map(str, GRID["split_k"])),
                   help="split-K counts for --sweep (cheaper reductions, as polled partials, may favour more)")
    args = p.parse_args()
    # above the kernels' rows linear_small_m takes F.linear: it would time cuBLAS under the kernel's name
    most = max(int(m) for m in f"{args.ms},{args.sweep_ms}".split(",") if m)
    if most > max_rows(2):
        raise SystemExit(f"M={most} is above the small-M kernels' {max_rows(2)} rows (TPGRAPH_GEMV_MAX_M=16 is set)")
    device = torch.device("cuda")
    hbm = hbm_bandwidth(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    print(f"HBM copy bandwidth {hbm / 1e12:.2f} TB/s, L2 {l2 >> 20} MiB", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm}
    if args.sweep:
        result["sweep"], best = sweep(args, device, hbm, l2)
        result["best"] = {f"{n},{k},{m}": dataclasses.asdict(cfg) for (n, k, m), cfg in best.items()}
        print("BEST = {\n" + "".join(f"    {key}: {cfg!r},\n" for key, cfg in best.items()) + "}", flush=True)
    else:
        result["rows"] = compare(args, device, hbm, l2)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        if "rows" in result:
            plot(result["rows"], args.out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, name in zip(axes, names, strict=True):
        sel = [r for r in rows if r["name"] == name]
        for label in ("cublas", "triton"):
            ax.plot([r["m"] for r in sel], [r[f"{label}_of_hbm"] for r in sel], marker="o", label=label)
        ax.axhline(0.88, color="gray", ls="--", lw=0.8)
        ticks = [1, 2, 4, 8, 16, 32]
        ax.set(title=name, xlabel="M (rows)", xscale="log", xticks=ticks, xticklabels=ticks)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of HBM copy bandwidth")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
