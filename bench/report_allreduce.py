"""Turn a bench_allreduce.py JSON into the markdown table and the issue's performance checks.

    python bench/report_allreduce.py bench/results/.../bench.json [--p2p-gbs 395]

The NVLink floor is bytes each way / P2P bandwidth: the bandwidth the benchmark measured (one-way copy), unless
--p2p-gbs overrides it. Peers' device time is their graph figure; "best peer" is the best of NCCL, symm_mem
one-shot and symm_mem two-shot. Where the run timed graphs several ways, every candidate's graph figure is its
lowest (see bench_allreduce.time_graph).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KB, MB = 1 << 10, 1 << 20
PEERS = ("nccl", "symm_1shot", "symm_2shot")


def with_best_graph_method(row: dict) -> dict:
    """The graph figure of every candidate = the lowest of the timing methods the run recorded (the bench calls this
    too). Runs that wrote the slope as `{name}_graph_us` next to `_graph_plain_us` and `_graph_hidden_us` are read
    the same way."""
    row = dict(row)
    for key in [k for k in row if k.endswith("_graph_plain_us")]:
        name = key.removesuffix("_graph_plain_us")
        slope = row[f"{name}_graph_slope_us" if f"{name}_graph_slope_us" in row else f"{name}_graph_us"]
        times = {"plain": row[key], "hidden": row[f"{name}_graph_hidden_us"], "slope": slope}  # the bench's order
        row[f"{name}_graph_method"] = min(times, key=times.get)
        row[f"{name}_graph_slope_us"], row[f"{name}_graph_us"] = slope, times[row[f"{name}_graph_method"]]
    return row


def human(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def best_peer(row: dict, mode: str = "graph") -> tuple[str, float]:
    times = {p: row[f"{p}_{mode}_us"] for p in PEERS if f"{p}_{mode}_us" in row}
    name = min(times, key=times.get)
    return name, times[name]


def table(rows: list[dict]) -> str:
    head = ("| bytes | auto graph (algo) | no PDL | NCCL | symm 1-shot | symm 2-shot | ÷ NCCL | ÷ best peer "
            "| auto eager device | eager ÷ best peer | auto eager back-to-back |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        _, best = best_peer(r)
        auto = r["auto_graph_us"]
        nan = float("nan")
        lines.append(
            f"| {human(r['bytes'])} | {auto:.1f} ({r['auto_graph_algo']}) | {r.get('auto_nopdl_graph_us', nan):.1f} "
            f"| {r['nccl_graph_us']:.1f} | {r.get('symm_1shot_graph_us', nan):.1f} "
            f"| {r.get('symm_2shot_graph_us', nan):.1f} | {auto / r['nccl_graph_us']:.2f} | {auto / best:.2f} "
            f"| {r['auto_eager_device_us']:.1f} ({r['auto_algo']}) | {r['auto_eager_device_us'] / best:.2f} "
            f"| {r['auto_eager_us']:.1f} |")
    return "\n".join(lines)


def checks(doc: dict, p2p_gbs: float) -> list[tuple[str, bool | None, str]]:
    """(target, met, detail) per performance line of the issue; met is None where the run lacks the data."""
    rows = {r["bytes"]: r for r in doc["rows"]}
    out: list[tuple[str, bool | None, str]] = []

    def ratio_check(name: str, n: int, peer: str, limit: float) -> None:
        key = f"{peer}_graph_us"
        if n not in rows or key not in rows[n]:
            out.append((name, None, "not measured"))
            return
        q = rows[n]["auto_graph_us"] / rows[n][key]
        out.append((name, q <= limit, f"{q:.3f} ({rows[n]['auto_graph_us']:.2f} us vs {rows[n][key]:.2f})"))

    ratio_check("8 KB: auto <= 0.22x NCCL", 8 * KB, "nccl", 0.22)
    ratio_check("8 KB: auto <= 0.6x symm one-shot", 8 * KB, "symm_1shot", 0.6)
    ratio_check("512 KB: auto <= 0.30x NCCL", 512 * KB, "nccl", 0.30)
    ratio_check("2 MB: auto <= 0.35x NCCL", 2 * MB, "nccl", 0.35)
    worst = max(doc["rows"], key=lambda r: r["auto_graph_us"] / best_peer(r)[1])
    w = worst["auto_graph_us"] / best_peer(worst)[1]
    out.append(("every size: auto <= 1.0x best peer", w <= 1.0, f"worst {w:.3f} at {human(worst['bytes'])}"))
    floors = [(n, r["auto_graph_us"] / (n / (p2p_gbs * 1e3)), n / (p2p_gbs * 1e3))
              for n, r in sorted(rows.items()) if n >= 8 * MB]
    if floors:
        out.append((">= 8 MB: within 1.4x of the NVLink floor", max(q for _, q, _ in floors) <= 1.4,
                    ", ".join(f"{human(n)} {q:.2f}x (floor {f:.1f} us)" for n, q, f in floors)))
    else:
        out.append((">= 8 MB: within 1.4x of the NVLink floor", None, "no size >= 8 MB measured"))
    eager = [(n, r["auto_eager_device_us"] / best_peer(r)[1]) for n, r in sorted(rows.items()) if n <= 2 * MB]
    worst_eager = max(eager, key=lambda e: e[1])
    out.append(("eager device time <= best peer up to 2 MB", worst_eager[1] <= 1.0,
                f"worst {worst_eager[1]:.3f} at {human(worst_eager[0])}"))
    host = doc.get("host_us_8kb", {}).get("try_all_reduce")
    out.append(("host cost per eager call < 10 us", None if host is None else host < 10,
                "not measured" if host is None else f"{host:.1f} us"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_json", type=Path)
    p.add_argument("--p2p-gbs", type=float, default=None)
    args = p.parse_args()
    doc = json.loads(args.bench_json.read_text())
    doc["rows"] = [with_best_graph_method(r) for r in doc["rows"]]
    p2p = args.p2p_gbs or doc.get("p2p_gbs", {}).get("one_way")
    if p2p is None:
        raise SystemExit("the benchmark file has no measured P2P bandwidth: pass --p2p-gbs")
    has_methods = "auto_graph_plain_us" in doc["rows"][0]
    if has_methods:
        timing = "each candidate's best of three timing methods"
    else:
        timing = "replay submitted during a GPU sleep" if doc.get("launch_hiding") else "T(K) / K"
    print(f"{doc['gpu']} x{doc['world_size']}, {doc['dtype']}, graph K={doc['k']} ({timing}), "
          f"P2P {p2p:.0f} GB/s one way\n")
    print(table(doc["rows"]))
    print()
    if has_methods:
        print("Graph timing methods side by side (µs per op: slope / plain T(K)/K / plain with the replay submitted "
              "during a GPU sleep):\n")
        for r in doc["rows"]:
            if r["bytes"] <= 512 * KB:
                cells = [f"{n} {r[f'{n}_graph_slope_us']:.2f} / {r[f'{n}_graph_plain_us']:.2f} / "
                         f"{r[f'{n}_graph_hidden_us']:.2f}" for n in ("auto", "nccl", "symm_1shot")
                         if f"{n}_graph_plain_us" in r]
                print(f"- {human(r['bytes'])}: " + "; ".join(cells))
        print()
    for name, ok, detail in checks(doc, p2p):
        print(f"- [{'?' if ok is None else 'x' if ok else ' '}] {name}: {detail}")


if __name__ == "__main__":
    main()
