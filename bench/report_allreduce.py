"""Turn a bench_allreduce.py JSON into the markdown table and the performance checks.

    python bench/report_allreduce.py bench/results/.../ar.json [--p2p-gbs 395]

Every figure is the benchmark's one method (T(K)/K, K = 64, slowest rank's median). "Best peer" is the best of NCCL,
symm_mem one-shot and symm_mem two-shot; "best forced" the best of our algorithms forced and NCCL, the choices the
table has. The NVLink floor is bytes each way / P2P bandwidth (measured one-way copy, unless --p2p-gbs overrides).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KB, MB = 1 << 10, 1 << 20
PEERS = ("nccl", "symm_1shot", "symm_2shot")
CHOICES = ("1shot_push", "1shot_pull", "2shot_pull", "nccl")
VLLM_IN_LAYER_8KB_US = 4.77  # REFERENCE.md: vLLM 0.33 one-stage, in a layer, 8 KB, 2xH200
AUTO_VS_FORCED = 1.05


def human(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def best_of(row: dict, names: tuple[str, ...], mode: str, push_cap: int | None = None) -> tuple[str, float]:
    """The fastest of `names` at this row; 1shot_push only up to push_cap (the product's slot), if given."""
    times = {n: row[f"{n}_{mode}_us"] for n in names if f"{n}_{mode}_us" in row
             and not (n == "1shot_push" and push_cap is not None and row["bytes"] > push_cap)}
    name = min(times, key=times.get)
    return name, times[name]


def table(rows: list[dict]) -> str:
    head = ("| bytes | auto graph (algo) | best forced | NCCL | symm 1-shot | symm 2-shot | ÷ best peer "
            "| auto eager (algo) | best forced eager | eager ÷ best peer | no PDL graph |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    nan = float("nan")
    for r in rows:
        forced, forced_eager = best_of(r, CHOICES, "graph"), best_of(r, CHOICES, "eager")
        lines.append(
            f"| {human(r['bytes'])} | {r['auto_graph_us']:.1f} ({r['auto_graph_algo']}) | {forced[1]:.1f} "
            f"({forced[0]}) | {r['nccl_graph_us']:.1f} | {r.get('symm_1shot_graph_us', nan):.1f} "
            f"| {r.get('symm_2shot_graph_us', nan):.1f} | {r['auto_graph_us'] / best_of(r, PEERS, 'graph')[1]:.2f} "
            f"| {r['auto_eager_us']:.1f} ({r['auto_algo']}) | {forced_eager[1]:.1f} ({forced_eager[0]}) "
            f"| {r['auto_eager_us'] / best_of(r, PEERS, 'eager')[1]:.2f} | {r.get('auto_nopdl_graph_us', nan):.1f} |")
    return "\n".join(lines)


def checks(doc: dict, p2p_gbs: float | None) -> list[tuple[str, bool | None, str]]:
    """(target, met, detail) per performance line; met is None where the run lacks the data."""
    rows = doc["rows"]
    # runs before push went through its slot in pieces: forced push beyond the slot ran on a larger workspace and was
    # not a choice auto had (push_cap_bytes). Since then forced push runs as the product runs it, at every size.
    cap = doc.get("push_cap_bytes")
    out: list[tuple[str, bool | None, str]] = []
    for mode in ("graph", "eager"):
        ratios = [(r["auto_" + mode + "_us"] / best_of(r, CHOICES, mode, cap)[1], r) for r in rows]
        q, worst = max(ratios, key=lambda e: e[0])
        out.append((f"{mode}: auto within 5% of the best forced algorithm at every size", q <= AUTO_VS_FORCED,
                    f"worst {q:.3f} at {human(worst['bytes'])} (best forced: "
                    f"{best_of(worst, CHOICES, mode, cap)[0]})"))
    ratios = [(r["auto_graph_us"] / best_of(r, PEERS, "graph")[1], r) for r in rows]
    q, worst = max(ratios, key=lambda e: e[0])
    out.append(("graph: auto <= 1.0x the best peer at every size", q <= 1.0,
                f"worst {q:.3f} at {human(worst['bytes'])}"))
    layer = doc.get("in_layer", {}).get("8KB", {}).get("auto")
    limit = 0.7 * VLLM_IN_LAYER_8KB_US
    out.append((f"in a layer, 8 KB: auto <= 0.7x vLLM's {VLLM_IN_LAYER_8KB_US} us ({limit:.2f} us)",
                None if layer is None else layer <= limit, "not measured" if layer is None else f"{layer:.2f} us"))
    if p2p_gbs:
        floors = [(r["bytes"], r["auto_graph_us"] / (r["bytes"] / (p2p_gbs * 1e3)))
                  for r in rows if r["bytes"] >= 8 * MB]
        if floors:
            out.append((">= 8 MB: within 1.4x of the NVLink floor", max(q for _, q in floors) <= 1.4,
                        ", ".join(f"{human(n)} {q:.2f}x" for n, q in floors)))
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
    p2p = args.p2p_gbs or doc.get("p2p_gbs", {}).get("one_way")
    print(f"{doc['gpu']} x{doc['world_size']}, {doc['dtype']}, {doc.get('method', 'T(K)/K')}, P2P "
          f"{p2p or float('nan'):.0f} GB/s one way\n")
    print(table(doc["rows"]))
    print()
    pieces = [r for r in doc["rows"] if "1shot_push_one_piece_graph_us" in r]
    if pieces:
        print("- 1shot_push above the slot, in pieces (the product) against one launch from a slot that large "
              "(graph / eager us): " + ", ".join(
                  f"{human(r['bytes'])} {r['1shot_push_graph_us']:.1f} vs {r['1shot_push_one_piece_graph_us']:.1f} / "
                  f"{r['1shot_push_eager_us']:.1f} vs {r['1shot_push_one_piece_eager_us']:.1f}" for r in pieces))
    for key, figures in doc.get("in_layer", {}).items():
        print(f"- in a layer, {key}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()) + " us")
    print()
    for name, ok, detail in checks(doc, p2p):
        print(f"- [{'?' if ok is None else 'x' if ok else ' '}] {name}: {detail}")


if __name__ == "__main__":
    main()
