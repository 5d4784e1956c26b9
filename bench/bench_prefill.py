"""Prefill through the engine: what time to first token is made of when a burst of prompts arrives.

    python bench/bench_prefill.py --shape llama3-8b --points 1x256,4x256,32x256,1x1024,1x4096 --profile 4x256

`bench_decode.py` times decode steps; this drives `EngineCore.step` as the server does (chunked prefill of
--max-num-batched-tokens tokens a step, overlapped scheduling, sampling) on random weights of a named shape at TP=1.
Per point NxL (N prompts of L random token ids, each generating one token) it reports the wall time until every
prompt has its first token (the last request's TTFT in a burst), the prefill steps it took, their median host time
to the logits' launch (StepTiming.prefill) and their median device time (CUDA events around each step on the
current stream: the span from the step's start to its end on the device, idle gaps included), and prompt
tokens/s. Every point runs once untimed first (first-use costs: kernel compilation, allocator growth); that first
run's wall time is reported too, as `cold_ms`. `--profile NxL` adds the torch profiler's view of one
run of that point (kernels launched, device time by category, the busiest kernels, host ops by self CPU time)
and cProfile's (the Python functions host time goes to). Kernel time well under the step's device span means
the GPU waits on the host.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from bench_decode import SHAPES
from bench_engine_steps import hf_config

from tpgraph import TPEngine
from tpgraph.config import BUILTIN_MODEL
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.graphs.calibration import describe_counts
from tpgraph.graphs.config import GraphConfig

CATEGORIES = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "_gemv_")),
              ("attention", ("flash", "fmha", "attention", "softmax", "_efficient_")),
              ("norm/rope/act", ("rms_norm", "rope", "silu", "_norm")),
              ("copy/index", ("copy", "index", "gather", "scatter", "cat", "fill")))


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def parse_point(text: str) -> tuple[int, int, int]:
    """NxL: N prompts of L tokens; NxL+P: each after the same P-token prefix (a system prompt)."""
    n, _, rest = text.partition("x")
    length, _, prefix = rest.partition("+")
    return int(n), int(length), int(prefix or 0)


def run_point(engine: TPEngine, n: int, length: int, seed: int, prefix: int = 0) -> dict:
    """Queue n prompts at once and step until each has its first token. Their own tokens are random per seed; a
    prefix is the same in every run, so with prefix caching only the first run computes it."""
    core, vocab = engine.core, engine.model.cfg.vocab_size
    cuda = engine.runner.device.type == "cuda"
    # each point's own tokens from its own generator (points with the same seed share no prompt, so no cached
    # blocks), a prefix from one generator for all
    rng, shared = random.Random(hash((seed, n, length, prefix))), random.Random(-1)
    head = [shared.randrange(3, vocab) for _ in range(prefix)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    hits = core.scheduler.prefix_hit_tokens
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(n):
        core.add_request(f"p{seed}-{i}", head + [rng.randrange(3, vocab) for _ in range(length)], params)
    steps = []
    while core.has_work:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        if events:
            events[0].record()
        t0 = time.perf_counter()
        core.step()
        wall = time.perf_counter() - t0
        if events:
            events[1].record()
        steps.append((wall, core.timing.prefill, events))
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    prefill = [(w, p, e[0].elapsed_time(e[1]) / 1e3 if e else float("nan")) for w, p, e in steps if p]
    med = lambda xs: round(1e3 * statistics.median(xs), 3) if xs else float("nan")  # noqa: E731
    return {"prompts": n, "prompt_len": length, "prefix": prefix, "wall_ms": round(total * 1e3, 2),
            "cached_tokens": core.scheduler.prefix_hit_tokens - hits, "steps": len(steps),
            "prefill_steps": len(prefill), "step_wall_ms": med([w for w, _, _ in prefill]),
            "prefill_host_ms": med([p for _, p, _ in prefill]), "step_gpu_ms": med([g for _, _, g in prefill]),
            "tokens_per_s": round(n * length / total)}


def profile_point(engine: TPEngine, n: int, length: int, prefix: int = 0) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_point(engine, n, length, seed=99, prefix=prefix)
    by_cat: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels += 1
            by_cat[category(e.name)] += e.device_time_total / 1e3
            by_kernel[e.name][0] += e.device_time_total / 1e3
            by_kernel[e.name][1] += 1
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:20]
    return {"point": f"{n}x{length}", "kernels": kernels, "device_ms_by_category": dict(by_cat),
            "kernel_ms": round(sum(by_cat.values()), 3),
            "top_kernels": [{"name": k[:90], "ms": round(v[0], 3), "count": v[1]} for k, v in top],
            "top_host_ops": [{"name": a.key[:90], "self_cpu_ms": round(a.self_cpu_time_total / 1e3, 3),
                              "count": a.count} for a in host]}


def python_profile(engine: TPEngine, n: int, length: int, prefix: int = 0) -> str:
    """cProfile of one run of the point: the Python functions the host's time goes to."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    run_point(engine, n, length, seed=98, prefix=prefix)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=(*SHAPES, "builtin"), default="llama3-8b")
    p.add_argument("--points", default="1x256,4x256,32x256,1x1024,1x4096",
                   help="NxL (N prompts of L tokens) or NxL+P (each after one shared P-token prefix), comma-separated")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full, the shared prefix of NxL+P points too")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"))
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per step (the chunk)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median run is reported)")
    p.add_argument("--profile", default=None, help="a point NxL to profile")
    p.add_argument("--prefill-sizes", default=None,
                   help="token counts captured for piecewise prefill, e.g. 16,32,64,128,256,512 (default: "
                        "GraphConfig's)")
    p.add_argument("--no-prefill-calibration", dest="calibrate", action="store_false",
                   help="pad every prefill the capture sizes hold, without the start-up timing that picks eager "
                        "forwards where padding costs more")
    p.add_argument("--out", type=Path, default=Path("bench_prefill.json"))
    args = p.parse_args()
    # (the engine's start-up lines: the KV budget, and what the graphs took against their estimate)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    points = [parse_point(t) for t in args.points.split(",")]
    graphs = GraphConfig(calibrate_prefill=args.calibrate)
    if args.prefill_sizes is not None:
        graphs = replace(graphs, prefill_sizes=tuple(int(s) for s in args.prefill_sizes.split(",")))
    results, profiled = [], None
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(hf_config(SHAPES.get(args.shape, BUILTIN_MODEL))))
        with TPEngine(model_dir, load_format="dummy", max_num_seqs=64, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                      enable_prefix_caching=args.prefix_caching, graphs=graphs) as engine:
            for n, length, prefix in points:
                cold = run_point(engine, n, length, seed=0, prefix=prefix)["wall_ms"]
                runs = sorted((run_point(engine, n, length, seed=1 + r, prefix=prefix) for r in range(args.repeats)),
                              key=lambda r: r["wall_ms"])
                r = runs[len(runs) // 2] | {"cold_ms": cold}
                results.append(r)
                print(f"{n:3d} x {length:5d}{f' + {prefix}' if prefix else ''}: {r['wall_ms']:8.1f} ms to the last "
                      f"first token (cold {cold:.1f}; {r['cached_tokens']} tokens cached), {r['prefill_steps']} "
                      f"prefill steps: wall {r['step_wall_ms']:.2f} ms, host to launch "
                      f"{r['prefill_host_ms']:.2f} ms, device {r['step_gpu_ms']:.2f} ms; "
                      f"{r['tokens_per_s']} prompt tokens/s", flush=True)
            if args.profile:
                profiled = profile_point(engine, *parse_point(args.profile))
                print(f"profile {profiled['point']}: {profiled['kernels']} kernels; device ms by category "
                      f"{ {k: round(v, 2) for k, v in profiled['device_ms_by_category'].items()} }")
                for k in profiled["top_kernels"]:
                    print(f"  {k['ms']:8.3f} ms  x{k['count']:<5d} {k['name']}")
                print(f"kernel time {profiled['kernel_ms']:.2f} ms; host ops by self CPU time:")
                for k in profiled["top_host_ops"]:
                    print(f"  {k['self_cpu_ms']:8.3f} ms  x{k['count']:<5d} {k['name']}")
                print(python_profile(engine, *parse_point(args.profile)))
            runner = engine.runner
            calibration = {"prefill_timings_ms": [(t.size, t.eager_s * 1e3, t.graph_s * 1e3)
                                                  for t in runner.prefill_timings],
                           "eager_counts": describe_counts(runner.prefill_dispatcher.eager_counts)}
    args.out.write_text(json.dumps({"shape": args.shape, "chunk": args.max_num_batched_tokens,
                                    "prefix_caching": args.prefix_caching, **calibration, "results": results,
                                    "profile": profiled}, indent=1))


if __name__ == "__main__":
    main()
