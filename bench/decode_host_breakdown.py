"""Where a full-graph decode step's time goes on the host, and how much of it the GPU waits for.

    torchrun --nproc-per-node 2 bench/decode_host_breakdown.py --out bench/results/host_breakdown.json

Per batch, median over `--steps` synchronous steps (slowest rank): input writes, buffer commits, dispatch + stats,
replay submission, and the step's wall time; then the GPU time of the graph alone (replays queued back to back,
CUDA events, so no host work sits between them). Wall minus GPU-alone is what the host adds to TPOT.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from bench_decode import build, decode_runner, fake_context, slowest

from tpgraph.distributed import destroy_distributed, init_distributed
from tpgraph.engine.runner import ModelRunner


def breakdown(runner: ModelRunner, batch: int, context: int, steps: int, readback: str) -> dict[str, float]:
    seqs = fake_context(runner, batch, context)
    cuda = runner.device.type == "cuda"
    pinned = torch.empty(batch, dtype=torch.int64, pin_memory=cuda)
    done = torch.cuda.Event() if cuda else None
    parts: dict[str, list[float]] = {k: [] for k in ("null", "dispatch", "stats", "write", "commit", "replay", "sync",
                                                     "wall")}
    for i in range(steps + 3):
        tn = time.perf_counter()
        t0 = time.perf_counter()
        mode, desc = runner.decode_dispatcher.dispatch(batch, batch, True)
        ts = time.perf_counter()
        runner.stats.record("decode", batch, desc.num_tokens, runner._decode_mode_label or mode)
        t1 = time.perf_counter()
        runner._write_decode_inputs(seqs)
        t2 = time.perf_counter()
        runner.decode_in.commit(batch, desc.num_tokens)
        t3 = time.perf_counter()
        logits = runner.graphs.replay("decode", desc.num_tokens)
        t4 = time.perf_counter()
        # the step's own greedy ids where it makes them (greedy_in_step), else the argmax of its gathered logits
        ids = runner.sampled_rows(batch) if runner.greedy_in_step else logits[:batch].argmax(-1)
        if readback == "pinned" and cuda:
            pinned.copy_(ids, non_blocking=True)
            done.record()
            done.synchronize()
            tokens = pinned.tolist()
        else:
            tokens = ids.tolist()
        t5 = time.perf_counter()
        if readback == "pause":  # is the host slow for a while after the sync? (wall then includes the pause)
            while time.perf_counter() - t5 < 3e-4:
                pass
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.num_cached = len(seq)
            seq.output_ids.append(tok)
        if i >= 3:
            spans = (t0 - tn, ts - t0, t1 - ts, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - tn)
            for k, v in zip(parts, spans, strict=True):
                parts[k].append(v * 1e3)
    row = {k: statistics.median(v) for k, v in parts.items()}
    if cuda:
        row.update(gpu_times(runner, desc.num_tokens, steps))
    for seq in seqs:
        runner.free(seq)
    return row


def gpu_times(runner: ModelRunner, size: int, steps: int) -> dict[str, float]:
    # the graph alone: replays back to back, so each launch hides behind the previous replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        runner.graphs.replay("decode", size)
    start.record()
    for _ in range(steps):
        runner.graphs.replay("decode", size)
    end.record()
    end.synchronize()
    alone = start.elapsed_time(end) / steps
    # one replay alone, event to event, after a sync (includes the launch's own latency)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start.record()
        runner.graphs.replay("decode", size)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"gpu_alone": alone, "gpu_single": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--allreduce", default="custom,nccl", help="bench_decode.py's entries (custom or nccl, +unfused, "
                   "+gemv)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--readback", choices=("tolist", "pinned", "pause"), default="tolist")
    p.add_argument("--no-gc", action="store_true", help="gc.disable() for the timed steps")
    p.add_argument("--out", type=Path, default=Path("host_breakdown.json"))
    args = p.parse_args()
    state = init_distributed("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    try:
        for ar in args.allreduce.split(","):
            comm, model = build(state, ar)
            max_len = args.context + 2 * (args.steps + 80)
            runner = decode_runner(model, max(batches), max_len)
            if state.is_driver:
                print(f"gc enabled {gc.isenabled()}, counts {gc.get_count()}, frozen {gc.get_freeze_count()}, "
                      f"tracked {len(gc.get_objects())}", flush=True)
            if args.no_gc:
                gc.disable()
            for batch in batches:
                row = breakdown(runner, batch, args.context, args.steps, args.readback)
                row = {k: slowest(state, v) for k, v in row.items()}
                row.update(allreduce=ar, batch=batch)
                rows.append(row)
                if state.is_driver:
                    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
            runner.close()
            del runner, model
            comm.close()
            torch.cuda.empty_cache()
        if state.is_driver:
            args.out.write_text(json.dumps(rows, indent=1))
    finally:
        destroy_distributed(state)


if __name__ == "__main__":
    main()
