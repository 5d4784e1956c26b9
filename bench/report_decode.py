"""Issue 11's performance lines, checked from the benchmarks' JSON:

    python bench/report_decode.py decode.json [--kernels kernels.json] [--profile profile.json]
        [--ceiling read_ceiling.json] [--entry custom+gemv+overlap]

decode.json: `bench/bench_decode.py` (full graphs; `--unfused` adds the unfused entries the fused ones are compared
with). kernels.json: `bench/bench_kernels.py` (each kernel against its bandwidth floor). profile.json: a
`bench_decode.py --profile` run (kernels per step). `--entry` is the configuration the TPOT lines judge: the product's
default path, the small-M kernels with every fused piece, driven as the engine's overlapped scheduling drives it
(`custom+gemv+overlap`; runs before 2026-12-01 have only `custom+gemv`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TPOT_LIMITS = {1: 1.4, 8: 1.5, 32: 1.7}  # batch: at most this many times the weight-read floor
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
MIN_PROJECTION = 0.88  # of the measured HBM bandwidth, at M = 1
MIN_LM_HEAD = 0.90
MAX_KERNELS = 200  # per step, batch 1
# the kernel the product's decode runs for each projection, as bench_kernels.py names it (the qkv one rotates and
# stores K and V too, the gate_up one makes SiLU·mul)
PRODUCT_KERNEL = {"qkv": "qkv+rope_store (Triton)", "o_proj": "o_proj (Triton)", "gate_up": "gate_up+silu (Triton)",
                  "down": "down (Triton)", "lm_head": "lm_head (Triton)"}

Check = tuple[str, bool | None, str]


def _full_rows(decode: dict) -> dict[tuple[str, int], dict]:
    return {(r["allreduce"], r["batch"]): r for r in decode["tpot"] if r.get("mode", "full") == "full"}


def tpot_checks(decode: dict, entry: str) -> list[Check]:
    rows = _full_rows(decode)
    out: list[Check] = []
    for batch, limit in TPOT_LIMITS.items():
        row = rows.get((entry, batch))
        name = f"{entry}, batch {batch}: TPOT <= {limit}x the floor"
        if row is None:
            out.append((name, None, "not measured"))
            continue
        bound = limit * row["floor_ms"]
        out.append((name, row["tpot_ms"] <= bound,
                    f"{row['tpot_ms']:.3f} ms against {bound:.3f} ms ({row['tpot_ms'] / row['floor_ms']:.2f}x "
                    f"the {row['floor_ms']:.3f} ms floor)"))
    return out


def same_code_at_tp1(name: str, tp: int | None) -> bool:
    """Whether an entry and its +unfused twin run the same kernels: at TP=1 with cuBLAS projections there is no
    all-reduce to fuse the add + RMSNorm with (communicator.all_reduce_add_rmsnorm runs the add+RMSNorm kernel either
    way), and only the small-M path (+gemv) has fused pieces of its own (SiLU·mul, the norm's staging)."""
    return tp == 1 and "gemv" not in name.split("+")


def fused_checks(decode: dict) -> list[Check]:
    """Every entry faster than its +unfused version at every batch both ran (pairs that are the same code at TP=1
    left out, and said)."""
    rows = _full_rows(decode)
    twins = decode.get("unfused_twins", {})  # (runs before 2026-12-03 name each twin NAME+unfused)
    pairs, same = [], set()
    for (name, batch), row in rows.items():
        if "unfused" in name.split("+"):
            continue
        unfused = rows.get((twins.get(name, name + "+unfused"), batch))
        if unfused is None:
            continue
        if same_code_at_tp1(name, decode.get("tp")):
            same.add(name)
        else:
            pairs.append((name, batch, row["tpot_ms"], unfused["tpot_ms"]))
    left_out = f"; left out, the same kernels at TP=1: {', '.join(sorted(same))}" if same else ""
    if not pairs:
        return [("every fused path faster than its unfused version", None,
                 "no +unfused entries in this run" + left_out)]
    slow = [p for p in pairs if p[2] >= p[3]]
    worst = max(pairs, key=lambda p: p[2] / p[3])
    detail = (f"{len(pairs)} pairs; closest: {worst[0]} at batch {worst[1]}, {worst[2]:.3f} against "
              f"{worst[3]:.3f} ms unfused")
    if slow:
        detail += "; slower: " + ", ".join(f"{n} bs {b}" for n, b, _, _ in slow)
    return [("every fused path faster than its unfused version", not slow, detail + left_out)]


def read_ceilings(ceiling: dict) -> dict[str, float]:
    """Per projection, the best floor ÷ time of a kernel that only reads its weight bytes and waits for the kernel
    before first (bench_read_ceiling.py's `read pdl` rows): what any kernel of that style could show alone."""
    best: dict[str, float] = {}
    for r in ceiling["rows"]:
        if r["candidate"].startswith("read pdl ") and r["size"] in PROJECTIONS:
            best[r["size"]] = max(best.get(r["size"], 0.0), r["of_floor"])
    return best


def kernel_checks(kernels: dict, ceiling: dict | None = None) -> list[Check]:
    """The per-kernel lines; with `ceiling` (bench_read_ceiling.py's JSON), each projection's figure is followed by
    what a read-only kernel waiting for its input reaches at that size (context for the line, not a change to it)."""
    rows = {r["kernel"]: r for r in kernels["rows"] if r["batch"] == 1}
    reads = read_ceilings(ceiling) if ceiling is not None else {}
    out: list[Check] = []
    found = {p: rows.get(PRODUCT_KERNEL[p]) for p in PROJECTIONS}
    missing = [p for p, r in found.items() if r is None]

    def shown(p: str, r: dict) -> str:
        read = f"; a waiting read {reads[p]:.0%}" if p in reads else ""
        return f"{p} {r['of_floor']:.0%} ({r['us']:.1f} us{read})"

    if missing:
        out.append((f"each projection at >= {MIN_PROJECTION:.0%} of the bandwidth at M = 1", None,
                    f"not measured: {', '.join(missing)}"))
    else:
        out.append((f"each projection at >= {MIN_PROJECTION:.0%} of the bandwidth at M = 1",
                    all(r["of_floor"] >= MIN_PROJECTION for r in found.values()),
                    ", ".join(shown(p, r) for p, r in found.items())))
    head = rows.get(PRODUCT_KERNEL["lm_head"])
    out.append((f"lm_head at >= {MIN_LM_HEAD:.0%} of the bandwidth", None if head is None
                else head["of_floor"] >= MIN_LM_HEAD, "not measured" if head is None
                else f"{head['of_floor']:.0%} ({head['us']:.1f} us)"))
    return out


def profile_checks(profile: dict, entry: str) -> list[Check]:
    row = next((p for p in profile.get("profile", []) if p["allreduce"] == entry and p["batch"] == 1), None)
    name = f"{entry}: kernels per step at batch 1 <= {MAX_KERNELS}"
    if row is None:
        return [(name, None, "not profiled")]
    if not row.get("kernels"):  # profile_step's {"kernels": 0}: the profiler saw no kernel, which is no count
        return [(name, None, "no kernels recorded (the profiler saw none)")]
    return [(name, row["kernels"] <= MAX_KERNELS, f"{row['kernels']} kernels")]


def in_step_checks(profile: dict, entry: str) -> list[Check]:
    """Each projection inside the step at batch 1: its weight bytes over the measured bandwidth, against the time its
    kernel adds to the profiled step (bench_decode.time_added, the median over layers). What a user's step pays for
    it, where the line above times each kernel alone in a chain of its own calls; a kernel that reads its weights while
    the one before it runs (o_proj during attention) adds less than it takes alone, so a share may pass 100%."""
    name = f"{entry}: each projection inside the step at >= {MIN_PROJECTION:.0%} of the bandwidth at batch 1"
    row = next((p for p in profile.get("profile", []) if p["allreduce"] == entry and p["batch"] == 1), None)
    hbm = profile.get("hbm_bytes_per_s")
    if row is None or not hbm or not row.get("projections_added_us"):
        return [(name, None, "not profiled" if row is None else "the profile has no projection times")]
    added, nbytes = row["projections_added_us"], row["projection_bytes"]
    shares = {p: nbytes[p] / hbm * 1e6 / added[p] for p in PROJECTIONS}
    return [(name, all(v >= MIN_PROJECTION for v in shares.values()),
             ", ".join(f"{p} {shares[p]:.0%} ({added[p]:.1f} us)" for p in PROJECTIONS))]


def checks(decode: dict | None, kernels: dict | None, profile: dict | None, entry: str,
           ceiling: dict | None = None) -> list[Check]:
    decode = decode if decode is not None else {"tpot": []}  # (no decode JSON: every TPOT line not measured)
    out = tpot_checks(decode, entry) + fused_checks(decode)
    # every line, whatever was measured: a missing kernels or profile JSON (a bench past its time limit) shows its
    # lines as not measured instead of leaving them out of the verdict
    out += kernel_checks(kernels if kernels is not None else {"rows": []}, ceiling)
    out += profile_checks(profile if profile is not None else {}, entry)
    out += in_step_checks(profile if profile is not None else {}, entry)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("decode_json", type=Path)
    p.add_argument("--kernels", type=Path, default=None)
    p.add_argument("--profile", type=Path, default=None)
    p.add_argument("--ceiling", type=Path, default=None, help="bench_read_ceiling.py's JSON (context per projection)")
    p.add_argument("--entry", default="custom+gemv+overlap")
    args = p.parse_args()

    missing = [str(path) for path in (args.decode_json, args.kernels, args.profile, args.ceiling)
               if path is not None and not path.exists()]

    def load(path: Path | None) -> dict | None:
        return None if path is None or not path.exists() else json.loads(path.read_text())

    # a benchmark that crashed or ran past its limit writes no JSON (bench_decode.py writes it at the end): a failed
    # line for it, then every line (not measured where its input is missing), rather than no verdict at all
    lines = checks(load(args.decode_json), load(args.kernels), load(args.profile), args.entry, load(args.ceiling))
    if missing:
        lines.insert(0, ("every benchmark wrote its results", False, f"missing {', '.join(missing)}"))
    for name, ok, detail in lines:
        print(f"- [{'?' if ok is None else 'x' if ok else ' '}] {name}: {detail}")
    print(verdict(lines))
    raise SystemExit(0 if all(ok for _, ok, _ in lines) else 1)


def verdict(lines: list[Check]) -> str:
    """One line for the whole: passed only where every line holds (a line not measured is not a pass)."""
    failed, unmeasured = sum(ok is False for _, ok, _ in lines), sum(ok is None for _, ok, _ in lines)
    if not failed and not unmeasured:
        return f"verdict: PASS, all {len(lines)} lines hold"
    return f"verdict: NOT PASSED, {failed} of {len(lines)} lines fail and {unmeasured} are not measured"


if __name__ == "__main__":
    main()
