"""Derive this machine's all-reduce table rows from measured latencies (bench/bench_allreduce.py JSON).

    python -m tpgraph.comm.tune --from-bench bench/results/.../bench_allreduce_tp2.json --arch sm90

Launch bands (grid size per message size, per algorithm) come from the benchmark's `--sweep` (graph mode): at
each measured size, the smallest grid within 2% of the fastest. Graph rows use the graph (zero-copy) times;
eager rows use the eager data path's *device* time (staging copy + kernel, captured in a graph so host launch
cost does not hide it). NCCL competes in both. Bands must be ordered push <= pull1 <= pull2 <= nccl, so a winner
that would break the order is folded into the later band.
(The measuring `tpgraph-tune` command comes with its own issue; this derives rows from a benchmark file.)
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from tpgraph.comm.thresholds import LAUNCH_KEYS, Algo, config_dir, parse_table

ORDER = ("1shot_push", "1shot_pull", "2shot_pull", "nccl")
KEYS = ("push_max", "pull1_max", "pull2_max")
NEAR_BEST = 1.02  # a grid this close to the fastest counts as fast: prefer fewer blocks (less SM contention)


def grid_spec(blocks: int, num_sms: int) -> int | str:
    """A grid size as a table writes it: per-SM multiples by name, so the row carries to GPUs of the same arch
    with other SM counts."""
    if blocks % num_sms == 0:
        k = blocks // num_sms
        return "num_sms" if k == 1 else f"num_sms*{k}"
    return blocks


def derive_launch(sweep: list[dict], num_sms: int) -> dict[str, list]:
    """Launch key -> [[max_bytes, spec], ...]: each measured size's grid holds up to that size; equal neighbours
    merge; the last band also covers larger messages."""
    out: dict[str, list] = {}
    for algo in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT):
        bands: list[list] = []
        for entry in sorted((e for e in sweep if e["algo"] == algo.value), key=lambda e: e["bytes"]):
            times = {int(b): t for b, t in entry["us_by_blocks"].items()}
            best = min(times.values())
            spec = grid_spec(min(b for b, t in times.items() if t <= best * NEAR_BEST), num_sms)
            if bands and bands[-1][1] == spec:
                bands[-1][0] = entry["bytes"]
            else:
                bands.append([entry["bytes"], spec])
        if bands:
            out[LAUNCH_KEYS[algo]] = bands
    return out


def winners(rows: list[dict], mode: str) -> list[tuple[int, str]]:
    """(bytes, fastest algorithm) per measured size, for mode 'graph' or 'eager'."""
    out = []
    for row in sorted(rows, key=lambda r: r["bytes"]):
        times = {"nccl": row["nccl_graph_us"]}  # NCCL's device time: its graph figure
        for algo in ORDER[:-1]:
            key = f"{algo}_graph_us" if mode == "graph" else f"{algo}_eager_device_us"
            if key in row:
                times[algo] = row[key]
        out.append((row["bytes"], min(times, key=times.get)))
    return out


def derive_bands(rows: list[dict], mode: str, ceiling: int) -> dict[str, int]:
    """Inclusive upper bounds. A band's bound is the largest measured size whose winner (folded forward to keep
    the order) is that band or an earlier one; the band winning at the largest size extends to `ceiling`."""
    levels, level = [], 0
    for nbytes, algo in winners(rows, mode):
        level = max(level, ORDER.index(algo))
        levels.append((nbytes, level))
    bounds = {key: max((n for n, lv in levels if lv <= i), default=0) for i, key in enumerate(KEYS)}
    for i in range(level, len(KEYS)):  # level == 3 (NCCL) at the top extends nothing
        bounds[KEYS[i]] = ceiling
    return bounds


def update_table(table_path: Path, bench: dict, source: str) -> dict:
    doc = json.loads(table_path.read_text())
    ws = bench["world_size"]
    today = datetime.date.today().isoformat()
    ceiling = max(r["bytes"] for r in bench["rows"])  # unmeasured sizes go to NCCL
    for row in doc["rows"]:
        if row["world_size"] != ws:
            continue
        row.update(derive_bands(bench["rows"], row["mode"], ceiling))
        row["provenance"] = (f"measured {today} on {bench['gpu']} x{ws} by bench/bench_allreduce.py ({source}); "
                             f"{row['mode']} bands from {'graph' if row['mode'] == 'graph' else 'eager device'} "
                             "times, NCCL competing")
    if bench.get("sweep"):
        for key, bands in derive_launch(bench["sweep"], bench["num_sms"]).items():
            current = doc["launch"].get(key, {})
            per_ws = dict(current) if isinstance(current, dict) else {"default": current}
            per_ws[str(ws)] = bands
            doc["launch"][key] = per_ws
        doc["launch_provenance"] = (f"world size {ws} grids measured {today} on {bench['gpu']} x{ws} by "
                                    f"bench/bench_allreduce.py --sweep ({source})")
    parse_table(doc, str(table_path))  # still a valid table
    return doc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tpgraph.comm.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-bench", required=True, type=Path)
    p.add_argument("--arch", required=True, choices=("sm90", "sm100", "other"))
    p.add_argument("--out", type=Path, default=None, help="default: configs/allreduce/ARCH.json (rewritten)")
    args = p.parse_args(argv)
    table = args.out or config_dir() / "allreduce" / f"{args.arch}.json"
    bench = json.loads(args.from_bench.read_text())
    doc = update_table(table, bench, args.from_bench.name)
    table.write_text(json.dumps(doc, indent=1) + "\n")
    for row in doc["rows"]:
        if row["world_size"] == bench["world_size"]:
            print(f"ws={row['world_size']} {row['mode']}: push<={row['push_max']} pull1<={row['pull1_max']} "
                  f"pull2<={row['pull2_max']}")


if __name__ == "__main__":
    main()
