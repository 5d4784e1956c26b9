"""All-reduce latency, side by side, by one timing method for every candidate: ours (auto, each algorithm forced, and
auto without PDL), NCCL, torch symm_mem one-shot and two-shot.

    torchrun --nproc-per-node 2 bench/bench_allreduce.py --out bench/results/ar.json

The method (tpgraph/tune/timing.py, the tuner's too), fixed before any number is read. Every timed run: a CPU
barrier, the same GPU sleep queued ahead of the start event, a one-element NCCL all-reduce after it so the GPUs start
together, CUDA events around the timed work. Graph: per-op time T(K)/K of a graph of K = 64 ops; at each size every
candidate's graph is captured first, then all are timed interleaved (`graph_ops_us_interleaved`): each round gives
every graph one run, in an order from a Williams design (`round_order`), so no candidate always goes first or always
follows the same one, and drift falls on all alike; max(--runs, 100) rounds up to 4 MB (a round costs about a barrier
per candidate), --runs above.
Eager: per-op time of K calls back to back, the candidates interleaved the same way, as many rounds. Per rank the
median of a candidate's runs; the slowest rank's median is the figure. Custom calls are captured inside
`ar.capture()`, so pull inputs are zero-copy in graphs; each candidate's registration is given back after the size's
graphs are dropped.

In a layer: a graph of 32 x (a [M,4096] x [4096,4096] GEMV, then the all-reduce of its output), minus the same graph
without the all-reduces, per layer, at 8 KB (M = 1) and 64 KB (M = 8), all of a case's graphs timed interleaved as
above (max(--runs, 100) rounds); also with rank 0 doing twice the GEMV work (one rank arriving late). Diagnostics
beside them: auto without PDL, and 1shot_push at fixed grids (IN_LAYER_PUSH_GRIDS).
`python bench/report_allreduce.py ar.json` prints the table and the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from tpgraph.comm.custom_ar import CustomAllReduce, CustomAllReduceConfig
from tpgraph.comm.thresholds import Algo
from tpgraph.distributed import destroy_distributed, gather_objects, init_distributed
from tpgraph.tune.timing import K_OPS, MIN_RUNS, capture, eager_ops_us_interleaved, graph_ops_us_interleaved, released

KB, MB = 1 << 10, 1 << 20
SIZES = [4 * KB, 8 * KB, 32 * KB, 128 * KB, 512 * KB, 1 * MB, 2 * MB, 4 * MB, 8 * MB, 16 * MB, 32 * MB, 64 * MB]
FORCED = (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT)  # multicast: gated, never run here
LAYERS, HIDDEN = 32, 4096
IN_LAYER_PUSH_GRIDS = (1, 4)  # 1shot_push grids also timed in a layer (the tuned table's grid is "auto")
# rounds at sizes up to 4 MB: at least 100 (cheap: about 1 ms a run). Per-op times there are 2-16 µs, and two
# identical launches timed as two candidates differed by 5-8% at 50 rounds (2 and 4 KB, 2 MB)
SMALL_BYTES, SMALL_MIN_RUNS = 4 * MB, 100


def graph_runs(nbytes: int, runs: int) -> int:
    """Interleaved rounds at this size: max(runs, SMALL_MIN_RUNS) up to SMALL_BYTES, where per-op times are a few
    µs and noise is largest relative to them; runs above."""
    return max(runs, SMALL_MIN_RUNS) if nbytes <= SMALL_BYTES else runs


def method(runs: int) -> str:
    """The method, as the JSON states it."""
    return (f"T(K)/K, K={K_OPS}; every run: barrier + GPU sleep + one-element NCCL all-reduce before the start event; "
            f"graph: all candidates' graphs captured first, then timed interleaved, one run of each per round in an "
            f"order from a Williams design per round (each candidate in each position and after each other one "
            f"equally often), {graph_runs(SMALL_BYTES, runs)} rounds up to {SMALL_BYTES // MB} MB, {runs} "
            f"above; eager: K calls back to back per run, interleaved the same way; median of runs per rank; "
            f"slowest rank")


def graph_times(state, cands: dict[str, tuple[Callable[[], object], CustomAllReduce | None]],
                runs: int, calls: int = K_OPS, per: int = K_OPS) -> dict[str, float]:
    """Graph µs per op of every candidate by the one method, interleaved: every graph (`calls` calls of its fn, `per`
    ops in all) captured first, a custom candidate inside its own `released` capture context, then all timed
    together; the graphs are dropped before the contexts close and give the registrations back."""
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    with contextlib.ExitStack() as registrations:
        try:
            for name, (fn, custom) in cands.items():
                graphs[name] = capture(fn, calls, registrations.enter_context(released(custom)))
            return graph_ops_us_interleaved(state, graphs, per, runs)
        finally:
            graphs.clear()  # before their registrations are given back (the ExitStack's exit, after this)


def timed(state, cands: dict[str, tuple[Callable[[], object], CustomAllReduce | None]], nbytes: int,
          runs: int) -> dict[str, float]:
    """{name_graph_us, name_eager_us} of every candidate at this size: graphs interleaved (`graph_times`), then the
    eager calls interleaved the same way (more rounds at small sizes, both)."""
    out = {f"{name}_graph_us": us for name, us in graph_times(state, cands, graph_runs(nbytes, runs)).items()}
    eager = eager_ops_us_interleaved(state, {name: fn for name, (fn, _) in cands.items()}, K_OPS,
                                     graph_runs(nbytes, runs))
    out.update({f"{name}_eager_us": us for name, us in eager.items()})
    return out


def in_layer_step(state, all_reduce: Callable[[torch.Tensor], object] | None, m: int, skew: bool,
                  out_buffers: list[torch.Tensor] | None = None) -> Callable[[], None]:
    """One pass of LAYERS x (GEMV, all-reduce); all_reduce None: GEMVs only. With skew, rank 0 runs its GEMV twice.
    out_buffers: where each layer's GEMV writes (symm_mem needs its own buffers)."""
    torch.manual_seed(0)
    x = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.01
    w = torch.randn(HIDDEN, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.01
    outs = out_buffers or [torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    repeat = 2 if skew and state.rank == 0 else 1

    def step() -> None:
        for out in outs:
            for _ in range(repeat):
                torch.matmul(x, w, out=out)
            if all_reduce is not None:
                all_reduce(out)

    return step


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
        ax.set(xscale="log", yscale="log", xlabel="message bytes", title=f"all-reduce, {mode} (T(K)/K, slowest rank)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("us per op")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def forced_instance(ar: CustomAllReduce, roomy: CustomAllReduce, algo: Algo, nbytes: int) -> CustomAllReduce:
    """Where a forced algorithm runs: on the product's own workspace where it can take the message (1shot_push
    always: above the slot it runs in pieces, as auto would; pulls up to the staging their eager calls copy into),
    so that `auto` and the forced algorithm it picks are the same launches on the same memory and differ only by the
    method's noise; else on the roomy second workspace. (One candidate serves graph and eager timing, so pulls go by the
    staging their eager calls need: a graph pull above it, which the product would read in place, runs on the
    second workspace.)"""
    if algo == Algo.PUSH_1SHOT:
        return ar
    return ar if nbytes <= ar.staging_bytes else roomy


def symm_mem_candidates(state, numel: int, group_name: str) -> dict[str, tuple[Callable, torch.Tensor]]:
    """symm_mem one-shot and two-shot on a symmetric buffer of numel bf16; empty where symm_mem is unavailable on
    any rank (every rank must time the same candidates, or the timing's collectives would not pair up)."""
    error = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        sx = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(sx, group_name)
        sx.zero_()
    except Exception as exc:  # noqa: BLE001 - reported, and the column left empty
        error = f"{type(exc).__name__}: {exc}"
    errors = [e for e in gather_objects(state, error) if e]
    if errors:
        if state.is_driver:
            print(f"symm_mem unavailable at {numel * 2} B: {errors[0]}", flush=True)
        return {}
    return {"symm_1shot": (lambda: torch.ops.symm_mem.one_shot_all_reduce(sx, "sum", group_name), sx),
            "symm_2shot": (lambda: torch.ops.symm_mem.two_shot_all_reduce_(sx, "sum", group_name), sx)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--runs", type=int, default=MIN_RUNS)
    args = p.parse_args()
    state = init_distributed("cuda")
    p2p = p2p_bandwidth_gbs(state)
    if state.is_driver:
        print("P2P copy bandwidth (GB/s): " + ", ".join(f"{k}={v:.0f}" for k, v in p2p.items()), flush=True)
    ar = CustomAllReduce(state)  # auto: the product's configuration and table
    # forced algorithms get room up to 64 MB whatever the table gives each: a second workspace for what the
    # product's cannot hold (forced_instance)
    forced_ar = CustomAllReduce(state, CustomAllReduceConfig(push_slot_bytes=64 * MB, staging_bytes=64 * MB))
    ar_nopdl = CustomAllReduce(state, CustomAllReduceConfig(pdl=False))  # the same kernels, plain launches
    nccl = functools.partial(dist.all_reduce, group=state.tp_group)
    group_name = dist.group.WORLD.group_name
    # (symm_mem needs no enabling per group since torch 2.11; symm_mem_candidates reports it where it is missing)
    rows, host = [], {}
    for nbytes in SIZES:
        numel = nbytes // 2
        x = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")  # zeros: sums stay finite over repeats
        cands: dict[str, tuple[Callable, CustomAllReduce | None]] = {"nccl": (lambda x=x: nccl(x), None)}
        for algo in FORCED:
            inst = forced_instance(ar, forced_ar, algo, nbytes)
            cands[algo.value] = (lambda x=x, a=algo, inst=inst: inst.all_reduce(x, a), inst)
        # what TPCommunicator.all_reduce does: the custom path when the table allows it, else NCCL
        cands["auto"] = (lambda x=x: ar.try_all_reduce(x) is not None or nccl(x), ar)
        cands["auto_nopdl"] = (lambda x=x: ar_nopdl.try_all_reduce(x) is not None or nccl(x), ar_nopdl)
        for name, (fn, _) in symm_mem_candidates(state, numel, group_name).items():
            cands[name] = (fn, None)
        if nbytes > ar.push_slot_bytes:  # diagnostic: what one launch with a slot this large would give (not a choice)
            cands["1shot_push_one_piece"] = (lambda x=x: forced_ar.all_reduce(x, Algo.PUSH_1SHOT), forced_ar)
        row = {"bytes": nbytes, "auto_algo": ar.pick(x, graph=False).value,
               "auto_graph_algo": ar.pick(x, graph=True).value}
        times = timed(state, cands, nbytes, args.runs)
        for name in cands:  # the row's order as before: each candidate's graph, then its eager figure
            row.update({key: times[key] for key in (f"{name}_graph_us", f"{name}_eager_us")})
        if nbytes == 8 * KB and ar.plan(x) is not None:
            host = host_costs(ar, x)
            if state.is_driver:
                print("host cost per eager call at 8 KB (us, Python -> kernel submitted): "
                      + ", ".join(f"{k}={v:.1f}" for k, v in host.items()), flush=True)
        rows.append(row)
        if state.is_driver:
            cols = " ".join(f"{k.removesuffix('_us')}={v:.1f}" for k, v in row.items() if k.endswith("_us"))
            print(f"{nbytes:>9} B  auto={row['auto_algo']:<11} {cols}", flush=True)
        del x
        torch.cuda.empty_cache()
    in_layer = {}
    for m in (1, 8):
        nbytes = m * HIDDEN * 2
        for skew in (False, True):
            key = f"{nbytes // KB}KB{'_skew' if skew else ''}"
            # the GEMV-only graph and every candidate's, timed interleaved; each minus the GEMV-only one, per layer
            cands: dict[str, tuple[Callable[[], object], CustomAllReduce | None]] = {
                "base": (in_layer_step(state, None, m, skew), None),
                "nccl": (in_layer_step(state, nccl, m, skew), None),
                "auto": (in_layer_step(state, lambda t: ar.try_all_reduce(t) is not None or nccl(t), m, skew), ar),
                # diagnostic: after a GEMV that never triggers its dependents, does the PDL launch help or cost?
                "auto_nopdl": (in_layer_step(state, lambda t: ar_nopdl.try_all_reduce(t) is not None or nccl(t), m,
                                             skew), ar_nopdl)}
            for blocks in IN_LAYER_PUSH_GRIDS:  # diagnostic: the tuner picks grids back to back, not in a layer
                cands[f"push/{blocks}"] = (in_layer_step(
                    state, lambda t, b=blocks: ar.all_reduce(t, Algo.PUSH_1SHOT, blocks=b), m, skew), ar)
            for name, (_, buf) in symm_mem_candidates(state, m * HIDDEN, group_name).items():
                bufs = [buf.view(m, HIDDEN)] * LAYERS  # symm_mem reduces its own buffer: the GEMV writes there
                op = (torch.ops.symm_mem.one_shot_all_reduce if name == "symm_1shot"
                      else torch.ops.symm_mem.two_shot_all_reduce_)
                cands[name] = (in_layer_step(state, lambda t, op=op: op(t.view(-1), "sum", group_name), m, skew,
                                             bufs), None)
            per_layer = graph_times(state, cands, graph_runs(0, args.runs), calls=1, per=LAYERS)
            figures = {name: us - per_layer["base"] for name, us in per_layer.items() if name != "base"}
            in_layer[key] = figures
            if state.is_driver:
                print(f"in a layer, {key}: " + ", ".join(f"{k}={v:.2f}" for k, v in figures.items()) + " us",
                      flush=True)
    if state.is_driver and args.out:
        plot(rows, Path(args.out).with_suffix(".png"))
        Path(args.out).write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "world_size": state.world_size, "dtype": "bfloat16", "k": K_OPS,
            "runs": args.runs, "num_sms": ar.num_sms, "push_slot_bytes": ar.push_slot_bytes,
            "method": method(args.runs),
            "host_us_8kb": host, "p2p_gbs": p2p, "rows": rows, "in_layer": in_layer}, indent=1))
    for a in (ar_nopdl, forced_ar, ar):
        a.close()
    destroy_distributed(state)


if __name__ == "__main__":
    main()
