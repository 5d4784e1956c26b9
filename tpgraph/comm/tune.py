"""Derive this machine's all-reduce table rows from measured latencies (bench/bench_allreduce.py JSON).

    python -m tpgraph.comm.tune --from-bench bench/results/.../bench_allreduce_tp2.json --arch sm90

Graph rows use the graph (zero-copy) times; eager rows use the eager data path's *device* time (staging copy +
kernel, captured in a graph so host launch cost does not hide it). NCCL competes in both. Bands must be ordered
push <= pull1 <= pull2 <= nccl, so a winner that would break the order is folded into the later band.
(The measuring `tpgraph-tune` command comes with its own issue; this derives rows from a benchmark file.)
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from tpgraph.comm.thresholds import config_dir, parse_table

ORDER = ("1shot_push", "1shot_pull", "2shot_pull", "nccl")
KEYS = ("push_max", "pull1_max", "pull2_max")


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
    for row in doc["rows"]:
        if row["world_size"] != ws:
            continue
        ceiling = row["pull2_max"]
        row.update(derive_bands(bench["rows"], row["mode"], ceiling))
        row["provenance"] = (f"measured {today} on {bench['gpu']} x{ws} by bench/bench_allreduce.py ({source}); "
                             f"{row['mode']} bands from {'graph' if row['mode'] == 'graph' else 'eager device'} "
                             "times, NCCL competing")
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
