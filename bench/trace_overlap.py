"""Where the GPU waits between kernels in the overlapped decode loop (the engine's scheduling), as a table.

    torchrun --nproc-per-node 1 bench/trace_overlap.py --shape llama3-8b-half --batch 8 --out trace.json

`bench_decode.py --profile` profiles one step driven plainly (a sync after it), so it cannot see what the
overlapped loop leaves idle between steps. This runs `--steps` steps as `decode_steps_overlapped` does under
torch.profiler (CUDA activity: kernels, copies, sets) and reports, per step: its span (from one device-to-host copy of
the ids to the next), the time the GPU was busy in it, what each kernel adds to it (bench_decode's time_added: by name,
and by place in the step, the median over the steps), and the idle gaps over `--min-gap-us`, grouped by the events on
either side (the last one to end before the gap, the first to start after it), largest total first. Under the
profiler every step is slower; compare variants (say `TPGRAPH_GREEDY_IN_STEP=0/1`) in runs of this script, not with
bench_decode's TPOT. Steps are cut at every device-to-host copy: right for the greedy loop, whose one read-back a step
is the ids; a loop that read back more would need another cut.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_decode import (
    SHAPES,
    build,
    decode_runner,
    decode_steps_overlapped,
    entry_env,
    fake_context,
    short_name,
    time_added,
)

from tpgraph.distributed import destroy_distributed, init_distributed


def gpu_events(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every kernel, copy and set the profiler saw on the device, by start."""
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return sorted(events, key=lambda e: e[1])


def is_readback(name: str) -> bool:
    return "DtoH" in name or "Device -> Pinned" in name or "Device -> Pageable" in name


def step_spans(events: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """[start, end) of each step: from the end of one ids read-back to the end of the next."""
    ends = [end for name, _, end in events if is_readback(name)]
    return list(zip(ends, ends[1:], strict=False))


def gaps(events: list[tuple[str, float, float]], min_gap_us: float) -> list[tuple[str, str, float, float]]:
    """(before, after, at µs, length µs) of each idle stretch of at least min_gap_us: the device ran nothing between
    the last event to end before it and the next event to start."""
    out = []
    reach, last = float("-inf"), ""
    for name, start, end in events:
        if last and start - reach >= min_gap_us:
            out.append((last, name, reach, start - reach))
        if end > reach:
            reach, last = end, name
    return out


def summarise(events: list[tuple[str, float, float]], min_gap_us: float) -> dict:
    spans = step_spans(events)
    found = gaps(events, min_gap_us)
    per_step, busy = [], []
    for lo, hi in spans:
        inside = [(max(s, lo), min(e, hi)) for _, s, e in events if e > lo and s < hi]
        covered, reach = 0.0, float("-inf")
        for s, e in sorted(inside):
            if e > reach:
                covered += e - max(s, reach)
                reach = e
        busy.append(covered)
        per_step.append(hi - lo)
    by_pair: dict[tuple[str, str], list[float]] = {}
    for before, after, at, length in found:
        if spans and spans[0][0] <= at < spans[-1][1]:
            by_pair.setdefault((short_name(before), short_name(after)), []).append(length)
    n = max(len(spans), 1)
    # what each kernel adds to the span (bench_decode's time_added), summed over the steps by name
    added: dict[str, float] = {}
    places: list[list[tuple[str, float]]] = []
    for lo, hi in spans:
        step = time_added([e for e in events if lo <= e[1] < hi])
        places.append(step)
        for name, us in step:
            added[short_name(name)] = added.get(short_name(name), 0.0) + us / n
    # by place: only where every step ran the same events in the same order
    same = places and all([name for name, _ in p] == [name for name, _ in places[0]] for p in places)
    by_place = [{"name": short_name(name), "us": statistics.median(p[i][1] for p in places)}
                for i, (name, _) in enumerate(places[0])] if same else []
    table = sorted(({"before": b, "after": a, "count": len(v), "us_per_step": sum(v) / n, "median_us":
                     statistics.median(v)} for (b, a), v in by_pair.items()), key=lambda r: -r["us_per_step"])
    return {"steps": len(spans), "span_us": statistics.median(per_step) if per_step else 0.0,
            "busy_us": statistics.median(busy) if busy else 0.0, "gaps": table,
            "added_us": dict(sorted(added.items(), key=lambda kv: -kv[1])), "by_place": by_place}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b-half")
    p.add_argument("--allreduce", default="custom+gemv+overlap", help="one bench_decode.py entry")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--min-gap-us", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=Path("trace_overlap.json"))
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile

    state = init_distributed("cuda")
    try:
        with entry_env(args.allreduce):
            comm, model = build(state, args.allreduce, args.shape)
            runner = decode_runner(model, args.batch, args.context + 2 * (args.steps + 40), "full",
                                   model.cfg.max_position_embeddings)
            seqs = fake_context(runner, args.batch, args.context)
            decode_steps_overlapped(runner, seqs, 10, 3)
            with profile(activities=[ProfilerActivity.CUDA]):  # CUPTI's start-up, outside the traced steps
                decode_steps_overlapped(runner, seqs, 2, 0)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                wall, _ = decode_steps_overlapped(runner, seqs, args.steps, 0)
            result = summarise(gpu_events(prof), args.min_gap_us)
            result.update(batch=args.batch, entry=args.allreduce, wall_us=statistics.median(wall) * 1e6)
            runner.close()
            comm.close()
        if state.is_driver:
            print(f"batch {args.batch}: wall {result['wall_us']:.1f} µs, span {result['span_us']:.1f}, busy "
                  f"{result['busy_us']:.1f} ({result['steps']} steps under the profiler)")
            for name, us in list(result["added_us"].items())[:8]:
                print(f"  {us:8.2f} µs/step  {name[:60]}")
            for row in result["gaps"][:12]:
                print(f"  {row['us_per_step']:7.2f} µs/step  x{row['count']:4d} (median {row['median_us']:.2f})  "
                      f"{row['before'][:50]} -> {row['after'][:50]}")
            args.out.write_text(json.dumps(result, indent=1))
    finally:
        destroy_distributed(state)


if __name__ == "__main__":
    main()
