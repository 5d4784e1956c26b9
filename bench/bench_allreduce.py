"""All-reduce latency, side by side: custom algorithms (forced and auto), NCCL, torch symm_mem.

    torchrun --nproc-per-node 2 bench/bench_allreduce.py --out bench/results/ar.json

Eager: back-to-back calls timed with CUDA events (median of repeats). Graph: K and 2K ops captured into CUDA graphs
and replayed (median of repeats), timed three ways (`time_graph`): the slope (T(2K) - T(K)) / K, the plain T(K) / K,
and T(K) / K with the replay submitted during a GPU sleep. Each candidate's graph figure is the lowest of the three,
so no timing artifact counts against anyone; all three are in the JSON. Custom algorithms are captured inside
`ar.capture()`, so their pull inputs are zero-copy in graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from report_allreduce import with_best_graph_method  # bench/ is on the path when this script runs

from tpgraph.comm.custom_ar import CustomAllReduce, CustomAllReduceConfig
from tpgraph.comm.thresholds import Algo
from tpgraph.distributed import destroy_distributed, gather_objects, init_distributed
from tpgraph.errors import CommError

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


# GPU cycles to sleep before a timed replay (about 100 us on an H200): longer than the host takes to submit it.
LAUNCH_HIDING_CYCLES = 200_000


def capture_graph(fn, k: int, capture_ctx) -> torch.cuda.CUDAGraph:
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
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, repeats: int, hide_launch: bool = False) -> float:
    """Median µs of one replay between CUDA events. hide_launch queues a GPU sleep first, so the host submits the
    replay while the GPU is busy and the submission gap falls outside the timed window."""
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hide_launch:
            torch.cuda._sleep(LAUNCH_HIDING_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return statistics.median(out)


def slope_us(fn, k: int, repeats: int, capture_ctx, t_k: float | None = None) -> float:
    """(T(2K ops) - T(K ops)) / K: every fixed cost of a replay (host submission gap, first-op rank skew) cancels.
    t_k: T(K) when the caller already measured it."""
    if t_k is None:
        t_k = replay_us(capture_graph(fn, k, capture_ctx), repeats)
    return (replay_us(capture_graph(fn, 2 * k, capture_ctx), repeats) - t_k) / k


def time_graph(fn, k: int, repeats: int, capture_ctx=contextlib.nullcontext) -> dict[str, float]:
    """µs per op of back-to-back ops in a CUDA graph, three ways, all in this process: plain = T(K) / K (submission
    gap included, the figure of earlier results); hidden = T(K) / K with the replay submitted during a GPU sleep;
    slope (slope_us)."""
    graph = capture_graph(fn, k, capture_ctx)
    plain = replay_us(graph, repeats)
    return {"plain": plain / k, "hidden": replay_us(graph, repeats, hide_launch=True) / k,
            "slope": slope_us(fn, k, repeats, capture_ctx, plain)}


CUSTOM = ("auto", "auto_nopdl", "1shot_push", "1shot_pull", "2shot_pull", "2shot_multicast")
SWEEP_SIZES = [8 * KB, 128 * KB, 512 * KB, 2 * MB, 4 * MB, 8 * MB, 16 * MB, 32 * MB, 64 * MB]
SWEEP_BLOCKS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 132, 264]  # 264: two per SM where the kernel fits
NO_CTX = contextlib.nullcontext


def sweep_blocks(ar: CustomAllReduce, k: int, repeats: int, is_driver: bool) -> list[dict]:
    """Graph-mode latency of each forced algorithm over grid sizes: the data behind the tables' launch bands."""
    rows = []
    for nbytes in SWEEP_SIZES:
        x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        for algo in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT):
            if algo == Algo.PUSH_1SHOT and nbytes > ar.push_slot_bytes:
                continue
            times = {}
            for blocks in SWEEP_BLOCKS:
                if blocks > 2 * ar.num_sms:
                    continue
                try:
                    # plain T(K) / K: the grids are compared with each other, and it spends K rows, not 3K
                    fn = functools.partial(ar.all_reduce, x, algo, blocks=blocks)
                    times[blocks] = replay_us(capture_graph(fn, k, ar.capture), repeats) / k
                except CommError:  # more blocks than this kernel keeps resident
                    break
            if not times:
                continue
            best = min(times, key=times.get)
            rows.append({"bytes": nbytes, "algo": algo.value, "us_by_blocks": times, "best_blocks": best})
            if is_driver:
                cells = " ".join(f"{b}:{t:.1f}" for b, t in times.items())
                print(f"sweep {nbytes:>9} B {algo.value:<10} best {best:>3} blocks  {cells}", flush=True)
    return rows


def host_cost_us(fn, n: int, repeats: int = 5) -> float:
    """CPU time to submit one call: n calls timed on the host (median of repeats). n stays below the launch
    queue's depth, so the host never waits for the GPU and device time cannot leak into the figure."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) * 1e6 / n)
    return statistics.median(out)


def p2p_bandwidth_gbs(state, nbytes: int = 256 * MB, iters: int = 10) -> dict[str, float]:
    """Copy-engine bandwidth into the next rank's GPU (GB/s): one way (rank 0 alone), and both ways at once."""
    peer = (state.rank + 1) % state.world_size
    src = torch.empty(nbytes, dtype=torch.uint8, device=state.device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{peer}")
    dst.copy_(src)
    torch.cuda.synchronize(state.device)

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return nbytes * iters / (start.elapsed_time(end) * 1e-3) / 1e9

    out = {}
    gather_objects(state, None)
    if state.rank == 0:
        out["one_way"] = timed()
    gather_objects(state, None)
    out["both_ways_each"] = timed()
    gather_objects(state, None)
    return out


def host_costs(ar: CustomAllReduce, x: torch.Tensor) -> dict[str, float]:
    """Host time per eager call, and its parts: the communicator's entry, the extension call alone, and one
    plain torch op for scale."""
    plan = ar.plan(x)
    stream = torch.cuda.current_stream().cuda_stream
    args = (ar.ctx, plan.algo_code, plan.dtype_code, x.data_ptr(), x.data_ptr(), plan.nbytes, plan.blocks, stream,
            ar.timeout_ns, -1)
    n = 500
    out = {"try_all_reduce": host_cost_us(lambda: ar.try_all_reduce(x), n),
           "extension_call": host_cost_us(lambda: ar.ext.ar_all_reduce(*args), n),
           "torch_add_": host_cost_us(lambda: x.add_(0), n)}
    x.zero_()
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    sizes = [r["bytes"] for r in rows]
    for ax, mode in zip(axes, ("graph", "eager"), strict=True):
        names = sorted({k[: -len(f"_{mode}_us")] for r in rows for k in r if k.endswith(f"_{mode}_us")})
        for name in names:
            ys = [r.get(f"{name}_{mode}_us", float("nan")) for r in rows]
            ax.plot(sizes, ys, marker="o", label=name, linewidth=2.5 if name == "auto" else 1.2)
        ax.set(xscale="log", yscale="log", xlabel="message bytes", title=f"all-reduce, {mode}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per op")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    # each zero-copy candidate spends 3K pointer-table rows per size (K and 2K graphs; 16384 rows in all)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also sweep grid sizes per algorithm (graph mode)")
    args = p.parse_args()
    state = init_distributed("cuda")
    p2p = p2p_bandwidth_gbs(state)
    if state.is_driver:
        print("P2P copy bandwidth (GB/s): " + ", ".join(f"{k}={v:.0f}" for k, v in p2p.items()), flush=True)
    # room for every forced algorithm up to 64 MB, whatever the table gives each
    ar = CustomAllReduce(state, CustomAllReduceConfig(push_slot_bytes=64 * MB, staging_bytes=64 * MB))
    ar_nopdl = CustomAllReduce(state, CustomAllReduceConfig(pdl=False))  # the same kernels, plain launches
    sweep = sweep_blocks(ar, 20, 10, state.is_driver) if args.sweep else []
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
        for algo in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT):  # multicast: emulation only here
            cap = ar.table.bands(state.world_size, False)
            limit = ar.push_slot_bytes if algo == Algo.PUSH_1SHOT else cap.pull2_max
            if nbytes <= limit:
                cands[algo.value] = lambda x=x, a=algo: ar.all_reduce(x, a)
        # what TPCommunicator.all_reduce does: the custom path when the table allows it, else NCCL
        cands["auto"] = lambda x=x: ar.try_all_reduce(x) is not None or dist.all_reduce(x, group=state.tp_group)
        cands["auto_nopdl"] = (lambda x=x: ar_nopdl.try_all_reduce(x) is not None
                               or dist.all_reduce(x, group=state.tp_group))
        if symm_mem is not None:
            try:
                sx = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
                symm_mem.rendezvous(sx, group_name)
                sx.fill_(1)
                cands["symm_1shot"] = lambda sx=sx: torch.ops.symm_mem.one_shot_all_reduce(sx, "sum", group_name)
                cands["symm_2shot"] = lambda sx=sx: torch.ops.symm_mem.two_shot_all_reduce_(sx, "sum", group_name)
            except Exception as exc:  # noqa: BLE001
                print(f"symm_mem at {nbytes}: {exc}")
        row = {"bytes": nbytes, "auto_algo": ar.pick(x, graph=False).value,
               "auto_graph_algo": ar.pick(x, graph=True).value}
        for name, fn in cands.items():
            x.fill_(0)  # keep values bounded across repeats
            custom = name in CUSTOM
            row[f"{name}_eager_us"] = time_eager(fn, 20, args.repeats)
            # graph: custom calls captured inside ar.capture() (zero-copy); eager_device: the eager data path
            # (staging copy + kernel) captured without it, so host launch cost does not hide device time
            ctx = (ar_nopdl.capture if name == "auto_nopdl" else ar.capture) if custom else NO_CTX
            graph = time_graph(fn, args.k, args.repeats, ctx)
            row.update({f"{name}_graph_{method}_us": us for method, us in graph.items()})
            if custom:
                row[f"{name}_eager_device_us"] = slope_us(fn, args.k, args.repeats, NO_CTX)
        # headline graph figure: each candidate's best method, so no method's artifact counts against anyone
        # (NCCL's 100-op graphs cost far more than twice its 50-op ones, so its slope is not its figure)
        row = with_best_graph_method(row)
        if nbytes == 8 * KB:
            host = host_costs(ar, x)
            if state.is_driver:
                print("host cost per eager call at 8 KB (us, Python -> kernel submitted): "
                      + ", ".join(f"{k}={v:.1f}" for k, v in host.items()), flush=True)
        rows.append(row)
        if state.is_driver:
            cols = " ".join(f"{k.removesuffix('_us')}={v:.1f}" for k, v in row.items() if k.endswith("_us"))
            print(f"{nbytes:>9} B  auto={row['auto_algo']:<11} {cols}", flush=True)
    if state.is_driver and args.out:
        plot(rows, Path(args.out).with_suffix(".png"))
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "world_size": state.world_size,
                                              "dtype": "bfloat16", "k": args.k, "num_sms": ar.num_sms,
                                              "graph_timing": "best of slope, plain, hidden",
                                              "host_us_8kb": host, "p2p_gbs": p2p,
                                              "rows": rows, "sweep": sweep}, indent=1))
    ar_nopdl.close()
    ar.close()
    destroy_distributed(state)


if __name__ == "__main__":
    main()
