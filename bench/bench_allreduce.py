"""All-reduce latency, side by side: custom algorithms (forced and auto), NCCL, torch symm_mem.

    torchrun --nproc-per-node 2 bench/bench_allreduce.py --out bench/results/ar.json

Eager: back-to-back calls timed with CUDA events (median of repeats). Graph: K ops captured into one CUDA graph,
replayed; per-op time = replay time / K (median). Custom algorithms are captured inside `ar.capture()`, so their
pull inputs are zero-copy in graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from tpgraph.comm.custom_ar import CustomAllReduce
from tpgraph.comm.thresholds import Algo
from tpgraph.distributed import destroy_distributed, init_distributed

KB, MB = 1 << 10, 1 << 20
SIZES = [4 * KB, 8 * KB, 32 * KB, 128 * KB, 512 * KB, 1 * MB, 2 * MB, 4 * MB, 8 * MB, 16 * MB, 32 * MB, 64 * MB]


def time_eager(fn, iters: int, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(out)


def time_graph(fn, k: int, repeats: int, capture_ctx=contextlib.nullcontext) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture_ctx(), torch.cuda.graph(graph):  # custom: zero-copy rows registered on exit
        for _ in range(k):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / k)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    state = init_distributed("cuda")
    ar = CustomAllReduce(state)
    group_name = dist.group.WORLD.group_name
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group_name)
    except Exception as exc:  # noqa: BLE001 - reported, and the column left empty
        symm_mem = None
        print(f"symm_mem unavailable: {exc}")
    rows = []
    for nbytes in SIZES:
        numel = nbytes // 2
        x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        cands = {"nccl": lambda x=x: dist.all_reduce(x, group=state.tp_group)}
        for algo in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT):
            cap = ar.table.bands(state.world_size, False)
            limit = cap.push_max if algo == Algo.PUSH_1SHOT else cap.pull2_max
            if nbytes <= limit:
                cands[algo.value] = lambda x=x, a=algo: ar.all_reduce(x, a)
        cands["auto"] = lambda x=x: ar.all_reduce(x) if ar.accepts(x) else dist.all_reduce(x, group=state.tp_group)
        if symm_mem is not None:
            try:
                sx = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
                symm_mem.rendezvous(sx, group_name)
                sx.fill_(1)
                cands["symm_1shot"] = lambda sx=sx: torch.ops.symm_mem.one_shot_all_reduce(sx, "sum", group_name)
                cands["symm_2shot"] = lambda sx=sx: torch.ops.symm_mem.two_shot_all_reduce_(sx, "sum", group_name)
            except Exception as exc:  # noqa: BLE001
                print(f"symm_mem at {nbytes}: {exc}")
        row = {"bytes": nbytes, "auto_algo": ar.pick(x).value}
        for name, fn in cands.items():
            x.fill_(0)  # keep values bounded across repeats
            row[f"{name}_eager_us"] = time_eager(fn, 20, args.repeats)
            ctx = ar.capture if name in ("auto", "1shot_push", "1shot_pull", "2shot_pull") else contextlib.nullcontext
            row[f"{name}_graph_us"] = time_graph(fn, args.k, args.repeats, ctx)
        rows.append(row)
        if state.is_driver:
            cols = " ".join(f"{k.removesuffix('_us')}={v:.1f}" for k, v in row.items() if k.endswith("_us"))
            print(f"{nbytes:>9} B  auto={row['auto_algo']:<11} {cols}", flush=True)
    if state.is_driver and args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "world_size": state.world_size,
                                              "dtype": "bfloat16", "k": args.k, "rows": rows}, indent=1))
    ar.close()
    destroy_distributed(state)


if __name__ == "__main__":
    main()
