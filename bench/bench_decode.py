"""Decode TPOT, side by side in one run: graph modes (full / piecewise / none) x all-reduce (custom / NCCL) x batch.

    torchrun --nproc-per-node 2 bench/bench_decode.py --out bench/results/decode.json [--profile]

Llama-3-8B shape, dummy weights, bf16, every sequence at `--context` cached tokens. A step is what a user waits for
between tokens: input preparation, dispatch, replay (or eager forward), greedy argmax and the one device-to-host
copy of the sampled ids. TPOT is the median step over `--steps`, from the slowest rank. Beside it: the weight-read
floor (this rank's weight bytes / measured HBM copy bandwidth) and the ratio to it; host time per step (preparation
+ dispatch + replay submission, before the sync); capture time and graph pool for both ladders.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from tpgraph.comm import TPCommunicator
from tpgraph.config import ModelConfig, RopeConfig
from tpgraph.distributed import destroy_distributed, gather_objects, init_distributed
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.engine.sampler import PendingSample
from tpgraph.engine.sequence import Sequence
from tpgraph.errors import ConfigError
from tpgraph.graphs.config import GraphConfig
from tpgraph.model.loader import load_model

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192),
                        max_position_embeddings=8192, tie_word_embeddings=False)
# Qwen3-8B: q and k RMS-normed per head (the fused qkv + rope kernel norms them), 36 layers, a 152K vocabulary
QWEN3_8B = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope=RopeConfig(theta=1000000.0, original_max_position_embeddings=40960),
                       max_position_embeddings=40960, tie_word_embeddings=False,
                       qk_norm=True)


def _tp2_share(cfg: ModelConfig) -> ModelConfig:
    """One rank's share of `cfg` at TP=2 (half the heads, the MLP and the vocabulary), as a whole model: its decode
    step at TP=1 is a TP=2 rank's step without the all-reduces (for studying the kernels on one GPU)."""
    return replace(cfg, vocab_size=cfg.vocab_size // 2, intermediate_size=cfg.intermediate_size // 2,
                   num_attention_heads=cfg.num_attention_heads // 2, num_key_value_heads=cfg.num_key_value_heads // 2)


# llama31-*: the same weights with Llama-3.1's 128K positions, for contexts past 8K (--context 32768)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-8b-half": _tp2_share(LLAMA3_8B),
          "llama31-8b": replace(LLAMA3_8B, max_position_embeddings=131072),
          "llama31-8b-half": replace(_tp2_share(LLAMA3_8B), max_position_embeddings=131072),
          "qwen3-8b": QWEN3_8B, "qwen3-8b-half": _tp2_share(QWEN3_8B)}
GiB = 1 << 30
TOP_KERNELS = 8  # the profile's kernels by total time, by name
LAYER_WINDOW = 16  # kernels listed in order from the middle of the step (a layer and a half)
INTERLEAVE_CHUNK = 10  # steps an entry runs per round with --interleave


def hbm_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted), median of 10."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times[2:])


def fake_context(runner: ModelRunner, batch: int, context: int) -> list[Sequence]:
    """Sequences whose `context` tokens are already cached (cache contents do not matter for timing)."""
    seqs = []
    for i in range(batch):
        seq = Sequence(i, [1] * context, max_new_tokens=1 << 30)
        runner.reserve(seq, context)
        seq.num_cached = context
        seqs.append(seq)
    return seqs


def time_decode(runner: ModelRunner, seqs: list[Sequence], steps: int, warmup: int = 3,
                overlap: bool = False) -> dict:
    wall, host = (decode_steps_overlapped if overlap else decode_steps)(runner, seqs, steps, warmup)
    return {"tpot_ms": statistics.median(wall) * 1e3, "host_ms": statistics.median(host) * 1e3}


def decode_steps(runner: ModelRunner, seqs: list[Sequence], steps: int, warmup: int = 0) -> tuple[list, list]:
    """(wall, host) seconds of each of `steps` decode steps, after `warmup` untimed ones."""
    host, wall = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        ids = runner.decode_greedy(seqs)  # as the engine's plain-greedy steps
        t1 = time.perf_counter()
        tokens = ids.tolist()  # the one sync of the step
        t2 = time.perf_counter()
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.output_ids.append(tok)
        if i >= warmup:
            host.append(t1 - t0)
            wall.append(t2 - t0)
    return wall, host


def decode_steps_overlapped(runner: ModelRunner, seqs: list[Sequence], steps: int,
                            warmup: int = 0) -> tuple[list, list]:
    """(wall, host) seconds of each of `steps` decode steps run as the engine's overlapped scheduling runs them:
    step i+1 is launched (its input ids taken on the device from step i's sampled ids) before step i's ids are read
    back. A step's wall time is the time from one read to the next (the first: from the first launch); host time is
    its launch (preparation, dispatch, replay submission)."""
    host, wall = [], []
    in_flight: tuple[PendingSample, list[int]] | None = None
    last = time.perf_counter()
    for i in range(warmup + steps + 1):
        launched = None
        if i < warmup + steps:
            t0 = time.perf_counter()
            # as the engine's plain-greedy steps: the ids in the rows the next step reads, no copy between
            ids = runner.decode_greedy(seqs, list(range(len(seqs))) if in_flight is not None else None)
            t1 = time.perf_counter()
            launched = (PendingSample(ids, ids, 0), [seq.add_pending() for seq in seqs])
            if i >= warmup:
                host.append(t1 - t0)
        if in_flight is not None:
            sample, index = in_flight
            for seq, at, tok in zip(seqs, index, sample.result().token_ids, strict=True):
                seq.resolve_pending(at, tok)
            now = time.perf_counter()
            if i - 1 >= warmup:  # the step just read
                wall.append(now - last)
            last = now
        in_flight = launched
    return wall, host


def slowest(state, value: float) -> float:
    return max(gather_objects(state, value))


PROJECTION_ORDER = ("qkv", "o_proj", "gate_up", "down")  # a layer's projections, in the order a step runs them


def is_projection(name: str) -> bool:
    """A projection's kernel: a GEMM-class one (the qkv projection that also rotates and stores K and V among them)."""
    return kernel_category(name) == "gemm"


def projections_added(added: list[tuple[str, float]], layers: int) -> dict[str, float] | None:
    """Per projection, the median over layers of the time its kernel adds to the step (time_added), and the lm_head's:
    the projection kernels in step order are each layer's qkv, o_proj, gate_up and down, then the lm_head. None where
    the step has another count of them (split-K sums as kernels of their own, cuBLAS's reduction kernels)."""
    times = [us for name, us in added if is_projection(name)]
    if len(times) != len(PROJECTION_ORDER) * layers + 1:
        return None
    out = {p: statistics.median(times[i:-1:len(PROJECTION_ORDER)]) for i, p in enumerate(PROJECTION_ORDER)}
    return out | {"lm_head": times[-1]}


def projection_bytes(model) -> dict[str, int]:
    """The weight bytes each projection kernel reads at one row (a layer's, and the lm_head's)."""
    layer = model.layers[0]
    weights = {"qkv": layer.self_attn.qkv_proj.weight, "o_proj": layer.self_attn.o_proj.weight,
               "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
               "lm_head": model.lm_head.weight}
    return {p: w.numel() * w.element_size() for p, w in weights.items()}


def profile_step(runner: ModelRunner, seqs: list[Sequence]) -> dict:
    """One decode step under torch.profiler: kernels by category, gaps, total, and the time each projection adds."""
    from torch.profiler import ProfilerActivity, profile

    # a throwaway profiled step first: CUPTI starts up on each rank at its own pace, and a rank still starting would
    # show up as the other rank's all-reduce waiting for it
    with profile(activities=[ProfilerActivity.CUDA]):
        runner.decode_greedy(seqs).tolist()
    for _ in range(3):
        runner.decode_greedy(seqs).tolist()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode_greedy(seqs).tolist()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    by_cat: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_cat.setdefault(kernel_category(e.name), []).append(e.device_time)
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    if not kernels:
        return {"kernels": 0}
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    total = sum(e.device_time for e in kernels)
    # Programmatic dependents are resident (and timed) while the kernel before them still runs: the kernels' sum
    # then exceeds the span. The GPU's busy time is the union of their intervals; the gaps are what it leaves.
    busy = covered_us([(e.time_range.start, e.time_range.end) for e in kernels])
    added = time_added([(e.name, e.time_range.start, e.time_range.end) for e in kernels])
    mid = len(added) // 2
    added_by_cat: dict[str, float] = {}
    added_by_name: dict[str, float] = {}
    for name, us in added:
        added_by_cat[kernel_category(name)] = added_by_cat.get(kernel_category(name), 0.0) + us
        added_by_name[name] = added_by_name.get(name, 0.0) + us
    return {"kernels": len(kernels), "kernel_us": total, "busy_us": busy, "span_us": end - start,
            "gaps_us": end - start - busy, "overlap_us": total - busy,
            "by_category": {c: {"count": len(v), "us": sum(v), "added_us": added_by_cat[c]}
                            for c, v in sorted(by_cat.items())},
            "top_kernels": [{"name": n, "count": len(v), "us": sum(v), "added_us": added_by_name[n]} for n, v in top],
            "one_layer": [{"name": n, "added_us": us} for n, us in added[mid:mid + LAYER_WINDOW]],
            "projections_added_us": projections_added(added, len(runner.model.layers)),
            "projection_bytes": projection_bytes(runner.model)}


def time_added(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """(name, µs) per kernel in the order they end: how much later the step's last kernel so far ends because of it
    (its end minus the previous end, or minus the first start). The kernels of a step depend on one another, so this
    splits the span exactly, gaps and waits included, and a programmatic dependent resident early is charged only
    for the time it adds, not for the time it spent waiting."""
    if not kernels:
        return []
    reach = min(start for _, start, _ in kernels)
    out = []
    for name, _, end in sorted(kernels, key=lambda k: k[2]):
        out.append((name, max(end - reach, 0.0)))
        reach = max(reach, end)
    return out


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def profile_table(prof: dict) -> str:
    """The profile as a readable table: kernels by category, gaps, and the step against the floor."""
    if not prof.get("kernels"):
        return "profile: no kernels recorded"
    lines = [f"profile, {prof['allreduce']} all-reduce, batch {prof['batch']}: {prof['kernels']} kernels, "
             f"{prof['kernel_us'] / 1e3:.3f} ms kernel time ({prof['kernel_us'] / 1e3 / prof['floor_ms']:.2f}x the "
             f"{prof['floor_ms']:.2f} ms floor), {prof['gaps_us'] / 1e3:.3f} ms of gaps in a "
             f"{prof['span_us'] / 1e3:.3f} ms span (under the profiler)"
             + (f"; kernels overlapped for {prof['overlap_us'] / 1e3:.3f} ms (programmatic dependents resident "
                f"early), so the GPU was busy {prof['busy_us'] / 1e3:.3f} ms" if prof.get("overlap_us", 0) > 0.5
                else ""),
             f"  {'category':12s} {'kernels':>7s} {'ms':>8s} {'share':>6s} {'added ms':>9s}"]
    for cat, v in sorted(prof["by_category"].items(), key=lambda kv: -kv[1]["us"]):
        lines.append(f"  {cat:12s} {v['count']:7d} {v['us'] / 1e3:8.3f} {v['us'] / prof['kernel_us']:6.1%} "
                     f"{v.get('added_us', float('nan')) / 1e3:9.3f}")
    lines.append(f"  top kernels: {'count':>5s} {'ms':>8s} {'added ms':>9s}  name")
    for k in prof.get("top_kernels", []):
        lines.append(f"  {'':12s} {k['count']:5d} {k['us'] / 1e3:8.3f} {k.get('added_us', float('nan')) / 1e3:9.3f}  "
                     f"{k['name'][:90]}")
    if prof.get("projections_added_us"):
        lines.append("  each projection inside the step (the time it adds, median over layers): " + ", ".join(
            f"{p} {us:.1f} us" for p, us in prof["projections_added_us"].items()))
    if prof.get("one_layer"):
        lines.append("  mid-step kernels in order, µs each adds to the step: " + ", ".join(
            f"{short_name(k['name'])} {k['added_us']:.1f}" for k in prof["one_layer"]))
    return "\n".join(lines)


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and namespaces."""
    return name.split("<")[0].split("::")[-1].split("(")[0].removeprefix("void ").strip()


def kernel_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("nccl", "push_1shot", "pull_1shot", "two_shot")):
        return "collective"  # the all-reduces and the logits all-gather
    # (the qkv projection that also rotates and stores K and V is a projection: its weight read is its time, as the
    # gate_up projection that makes SiLU·mul is, not rope+kv's)
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "splitk", "gemv", "split_sum", "cublas", "qkv_rope")):
        return "gemm"
    if any(k in n for k in ("_decode_", "paged", "flash", "fmha", "attention")):
        return "attention"
    if "norm" in n:
        return "norm"
    if "rope" in n:
        return "rope+kv"
    return "other"


# launch modifiers: the environment the entry's graphs are captured under (read by the kernels at launch); "+pdl"
# sets the variable to 1, "+nopdl" to 0
# "+push": the all-reduce in the small-M row-parallel projection's epilogue (kernels/lamport.py)
# "+late": such a projection lets the kernel after it in only at its exit (gemv.late_trigger)
LAUNCH_ENV = {"pdl": "TPGRAPH_TRITON_PDL", "lr": "TPGRAPH_LAST_SPLIT_REDUCES", "push": "TPGRAPH_GEMV_ALLREDUCE",
              "late": "TPGRAPH_GEMV_AR_LATE_TRIGGER"}
PREFETCH_MOD = r"pf\d+"  # "+pf16": TPGRAPH_PDL_PREFETCH_MB=16 (weights pulled into L2 ahead of the PDL wait)
LAUNCH_MODS = {**{mod: (var, "1") for mod, var in LAUNCH_ENV.items()},
               **{f"no{mod}": (var, "0") for mod, var in LAUNCH_ENV.items()}}


def variant(name: str) -> tuple[bool, bool, bool]:
    """An --allreduce entry -> (custom all-reduce, fused all-reduce + RMSNorm, small-M projection kernel):
    "custom" or "nccl", then modifiers: "+unfused" (the all-reduce and the add+RMSNorm as two kernels, and with +gemv
    SiLU·mul as its own kernel before the down projection), "+gemv" (the Triton small-M projections instead of
    cuBLAS), and the launch modifiers "+pdl" / "+nopdl" (Triton kernels as programmatic dependents or not) and
    "+lr" / "+nolr" (split kernels reduced in their last program or by a second kernel), "+push" / "+nopush" (the
    all-reduce in the row-parallel projection's epilogue, needs +gemv and no +unfused; or its own kernel), "+late" /
    "+nolate" (that projection lets the kernel after it in at its exit or after its K loop) and "+pf<MB>" (the L2
    prefetch budget of the projections), which `entry_env` applies; "+overlap" changes only how its steps are driven
    (`overlapped`)."""
    base, *mods = name.split("+")
    mods = [m for m in mods if not re.fullmatch(PREFETCH_MOD, m)]
    if base not in ("custom", "nccl") or not set(mods) <= {"unfused", "gemv", "overlap", *LAUNCH_MODS}:
        raise SystemExit(f"--allreduce entries are custom or nccl, with +unfused, +gemv, +pdl/+nopdl, +lr/+nolr, "
                         f"+push/+nopush, +late/+nolate, +pf<MB> and/or +overlap; got {name!r}")
    if "push" in mods and (base != "custom" or "gemv" not in mods or "unfused" in mods):
        raise SystemExit(f"+push needs the custom all-reduce, +gemv and no +unfused (it lives in the small-M "
                         f"projection's epilogue and is a fused path); got {name!r}")
    if "late" in mods and "push" not in mods:
        raise SystemExit(f"+late changes when a +push projection lets the next kernel in: it needs +push; got {name!r}")
    return base == "custom", "unfused" not in mods, "gemv" in mods


def overlapped(name: str) -> bool:
    """"+overlap": the entry's steps run as overlapped scheduling runs them (decode_steps_overlapped)."""
    return "overlap" in name.split("+")[1:]


def entry_env(name: str) -> contextlib.AbstractContextManager:
    """The entry's launch modifiers set in the environment while its graphs are captured or its steps run (entries
    without them keep the process's own setting), then put back."""
    mods = set(name.split("+")[1:])
    env = dict(LAUNCH_MODS[mod] for mod in mods if mod in LAUNCH_MODS)
    env.update(("TPGRAPH_PDL_PREFETCH_MB", m[2:]) for m in mods if re.fullmatch(PREFETCH_MOD, m))
    return mock.patch.dict(os.environ, env)


def decode_runner(model, max_batch: int, max_len: int, mode: str = "full",
                  max_model_len: int | None = None, block_size: int = 16) -> ModelRunner:
    """A runner whose decode graphs (sglang ladder, no prefill graphs) serve `max_batch` sequences of `max_len`
    tokens, with KV blocks (of `block_size` tokens) for all of them and a few spare. Its max_model_len (default
    max_len) is what sizes static grids, such as decode attention's splits, as a server's would."""
    max_model_len = max(max_model_len or max_len, max_len)  # (0 or None: max_len)
    graphs = GraphConfig(decode_mode=mode, prefill_mode="none", ladder="sglang")
    blocks = max(max_batch * -(-max_len // block_size), -(-max_model_len // block_size)) + 16
    return ModelRunner(model, RunnerConfig(block_size=block_size, max_batch=max_batch, max_model_len=max_model_len,
                                           num_kv_blocks=blocks, graphs=graphs))


def ladder_runner(model, ladder: str, max_batch: int, max_len: int) -> ModelRunner:
    """A runner capturing `ladder`'s full decode graphs up to `max_batch` sequences of `max_len` tokens (for their
    capture time and pool). Its cache: a block a sequence and a few spare, and at least one whole sequence of
    max_len, which its max_model_len needs (at max_batch + 16 blocks alone, a --context past 4K refused the sglang
    ladder, after every entry was timed and before any result was written)."""
    graphs = GraphConfig(decode_mode="full", prefill_mode="none", ladder=ladder)
    blocks = max(max_batch, -(-max_len // 16) + 1) + 16  # (+1: the null block)
    return ModelRunner(model, RunnerConfig(max_batch=max_batch, max_model_len=max_len, num_kv_blocks=blocks,
                                           graphs=graphs))


def unfused_twin(name: str) -> str:
    """A fused custom entry's unfused version: the same entry with the all-reduce, the add+RMSNorm and SiLU·mul as
    kernels of their own ("+unfused"). An all-reduce in the projection's epilogue ("+push", with "+late") is a fused
    path too, so its twin runs the all-reduce as its own kernel ("+nopush")."""
    base, *mods = name.split("+")
    mods = ["nopush" if m == "push" else m for m in mods if m != "late"]
    return "+".join([base, *mods, "unfused"])


def unfused_twins(args) -> dict[str, str]:
    """With --unfused, each fused custom entry -> its unfused twin (written into the results, where
    report_decode.py pairs them); else none."""
    if not args.unfused:
        return {}
    return {name: unfused_twin(name) for name in args.allreduce.split(",") if variant(name)[:2] == (True, True)}


def entries(args) -> list[str]:
    """The --allreduce entries, and with --unfused each fused custom entry's unfused twin beside it."""
    names = args.allreduce.split(",")
    for name in names:
        variant(name)  # refuse a bad entry before any work
    twins = unfused_twins(args)
    # (once each: a +push entry and its plain chain share one twin)
    return list(dict.fromkeys(n for name in names for n in ([name, twins[name]] if name in twins else [name])))


def build(state, name: str, shape: str = "llama3-8b"):
    """(communicator, model) for one --allreduce entry."""
    from tpgraph.comm.custom_ar import CustomAllReduceConfig

    custom, fused, gemv = variant(name)
    comm = TPCommunicator(state, use_custom_allreduce=custom, custom_config=CustomAllReduceConfig(fused_norm=fused))
    model = load_model(state, comm, None, "dummy", torch.bfloat16, config=SHAPES[shape])
    for module in model.modules():  # the projections' kernel choice, made explicitly for this entry
        if hasattr(module, "small_m"):
            module.small_m = gemv
        if hasattr(module, "fused_activation"):  # SiLU·mul in the gate_up projection's epilogue (with +gemv)
            module.fused_activation = fused
        if hasattr(module, "fused_qkv_rope"):  # qkv + rope + cache writes in one kernel (+gemv, in-kernel reduces)
            module.fused_qkv_rope = fused
    return comm, model


def header(state, context: int, steps: int, bw: float, shape: str = "llama3-8b", block_size: int = 16) -> dict:
    """The results document before any point is timed."""
    return {"shape": shape, "tp": state.world_size, "context": context, "steps": steps, "block_size": block_size,
            "hbm_bytes_per_s": bw, "gpu": torch.cuda.get_device_name(state.device), "tpot": [], "ladders": [],
            "profile": []}


def with_floor(results: dict, model, bw: float) -> float:
    """The weight-read floor (ms) of a step, recorded in results: the bytes of every weight but the embedding table,
    of which a step reads only B rows, over the HBM bandwidth."""
    embed = model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    results.update(weight_bytes_per_rank=weight_bytes, floor_ms=weight_bytes / bw * 1e3)
    return results["floor_ms"]


def parse_batches(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; a batch that is not a positive whole number is refused by name."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        raise SystemExit(f"batches are comma-separated whole numbers, got {text!r}") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"batches must be >= 1, got {text!r}")
    return batches


def timed_len(args) -> int:
    """The tokens a timed sequence reaches: --context and every step run on it (warm-up, profile steps included)."""
    if args.interleave:  # the sequences of one batch at a time, warm-up included
        return args.context + interleave_rounds(args.steps) * INTERLEAVE_CHUNK + 3 + 16
    return args.context + 2 * (args.steps + 8)


def interleave_rounds(steps: int) -> int:
    return max(1, -(-steps // INTERLEAVE_CHUNK))


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Every argument refused by name before the HBM copy, a model or a graph is spent on it: a bad one found later
    (a mode, the profile's batches, a length past the shape's positions) ended the run with a traceback and no
    results written."""
    from tpgraph.graphs.modes import DECODE_MODES

    parse_batches(args.batches)
    if args.profile:
        parse_batches(args.profile_batches)
    bad_modes = [m for m in args.modes.split(",") if m not in DECODE_MODES]
    if bad_modes:
        p.error(f"--modes: {', '.join(map(repr, bad_modes))} not among {', '.join(DECODE_MODES)}")
    entries(args)  # a bad --allreduce entry, by name
    for name in ("steps", "context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_model_len < 0:
        p.error(f"--max-model-len must be 0 (what the steps need) or more, got {args.max_model_len}")
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        p.error(f"--block-size must be a power of two, got {args.block_size}")
    try:  # the runners' max_model_len: the model's positions bound it (as a server's)
        SHAPES[args.shape].check_max_model_len(max(timed_len(args), args.max_model_len))
    except ConfigError as e:
        p.error(f"--shape {args.shape}, --context {args.context} and --steps {args.steps} (sequences of "
                f"{timed_len(args)} tokens), --max-model-len {args.max_model_len}: {e}"
                + ("; the llama31-* shapes have 131072 positions" if not args.shape.startswith("llama31") else ""))
    if args.interleave and (args.modes != "full" or args.profile):
        p.error("--interleave times full graphs only, without ladders or profiles: pass --modes full and no "
                "--profile")
    if args.out.suffix == ".png":
        p.error(f"--out {args.out}: the plot is written beside the JSON as .png, which would overwrite it")
    try:
        args.out.resolve().parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: cannot create its folder ({e.strerror})")


def run(args, state) -> dict:
    batches = parse_batches(args.batches)
    modes = args.modes.split(",")
    context, steps = args.context, args.steps
    max_len = timed_len(args)
    bw = hbm_bandwidth(state.device)
    results = header(state, context, steps, bw, args.shape, args.block_size)
    results["max_model_len"] = args.max_model_len  # 0: each runner's own max_len
    results["unfused_twins"] = unfused_twins(args)
    names = entries(args)
    for ar in names:
        with entry_env(ar):  # eager modes launch under it too
            comm, model = build(state, ar, args.shape)
            floor_ms = with_floor(results, model, bw)
            for mode in modes:
                runner = decode_runner(model, max(batches), max_len, mode, args.max_model_len, args.block_size)
                for batch in batches:
                    seqs = fake_context(runner, batch, context)
                    t = time_decode(runner, seqs, steps if mode != "none" else max(5, steps // 4),
                                    overlap=overlapped(ar))
                    row = {"allreduce": ar, "mode": mode, "batch": batch, "tpot_ms": slowest(state, t["tpot_ms"]),
                           "host_ms": slowest(state, t["host_ms"]), "floor_ms": floor_ms}
                    row["x_floor"] = row["tpot_ms"] / floor_ms
                    if state.is_driver:
                        print(f"{ar:6s} {mode:9s} bs={batch:4d}  TPOT {row['tpot_ms']:7.3f} ms  ({row['x_floor']:.2f}x "
                              f"floor {floor_ms:.2f} ms)  host {row['host_ms']:.3f} ms", flush=True)
                    results["tpot"].append(row)
                    for seq in seqs:
                        runner.free(seq)
                runner.close()
                del runner
                torch.cuda.empty_cache()
            if ar == names[0] and variant(ar)[0] and args.ladders:  # ladders once: the first entry, if custom
                for ladder, max_batch in (("vllm", 512), ("sglang", 256)):
                    runner = ladder_runner(model, ladder, max_batch, max_len)
                    row = {"ladder": ladder, "buckets": len(runner.graphs.sets["decode"].graphs),
                           "capture_s": slowest(state, runner.capture_s),
                           "pool_gib": slowest(state, runner.capture_bytes / GiB)}
                    if state.is_driver:
                        print(f"ladder {ladder}: {row['buckets']} buckets captured in {row['capture_s']:.2f} s, "
                              f"pool {row['pool_gib']:.3f} GiB", flush=True)
                    results["ladders"].append(row)
                    runner.close()
                    del runner
                    torch.cuda.empty_cache()
            del model
            comm.close()
            torch.cuda.empty_cache()
            dist.barrier(group=state.cpu_group)
    if args.profile:  # last: once CUPTI is up, every later launch in the process costs more host time
        results["profile"] = profiles(args, state, max_len, results["floor_ms"])
    return results


def run_interleaved(args, state) -> dict:
    """Full graphs only, every entry side by side: all entries' engines built first, then each batch timed in
    rounds; a round gives every entry CHUNK steps, in an order from a Williams design (the one method's
    interleaving, tpgraph/tune/timing.py), so drift falls on all alike. Per entry the median step over its
    rounds, from the slowest rank."""
    from tpgraph.tune.timing import round_order

    batches = parse_batches(args.batches)
    if args.modes != "full" or args.profile:
        raise SystemExit("--interleave times full graphs only, without ladders or profiles: pass --modes full and "
                         "no --profile")
    context, steps, names = args.context, args.steps, entries(args)
    rounds = interleave_rounds(steps)
    max_len = timed_len(args)
    bw = hbm_bandwidth(state.device)
    results = header(state, context, steps, bw, args.shape, args.block_size)
    results["max_model_len"] = args.max_model_len  # 0: each runner's own max_len
    results["unfused_twins"] = unfused_twins(args)
    results["method"] = (f"interleaved: {rounds} rounds of {INTERLEAVE_CHUNK} steps per entry, order from a "
                         f"Williams design per "
                         f"round; median step; slowest rank")
    engines = {}
    for ar in names:
        with entry_env(ar):
            comm, model = build(state, ar, args.shape)
            runner = decode_runner(model, max(batches), max_len, max_model_len=args.max_model_len,
                                   block_size=args.block_size)
        engines[ar] = (comm, model, runner)
    floor_ms = with_floor(results, engines[names[0]][1], bw)
    for batch in batches:
        seqs = {ar: fake_context(runner, batch, context) for ar, (_, _, runner) in engines.items()}
        wall: dict[str, list[float]] = {ar: [] for ar in names}
        host: dict[str, list[float]] = {ar: [] for ar in names}
        loop = {ar: decode_steps_overlapped if overlapped(ar) else decode_steps for ar in names}
        for ar, (_, _, runner) in engines.items():
            with entry_env(ar):
                loop[ar](runner, seqs[ar], 0, warmup=3)
        for r in range(rounds):
            for ar in round_order(names, r):
                with entry_env(ar):
                    w, h = loop[ar](engines[ar][2], seqs[ar], INTERLEAVE_CHUNK)
                wall[ar] += w
                host[ar] += h
        for ar in names:
            row = {"allreduce": ar, "mode": "full", "batch": batch,
                   "tpot_ms": slowest(state, statistics.median(wall[ar]) * 1e3),
                   "host_ms": slowest(state, statistics.median(host[ar]) * 1e3), "floor_ms": floor_ms}
            row["x_floor"] = row["tpot_ms"] / floor_ms
            if state.is_driver:
                print(f"{ar:6s} full      bs={batch:4d}  TPOT {row['tpot_ms']:7.3f} ms  ({row['x_floor']:.2f}x floor "
                      f"{floor_ms:.2f} ms)  host {row['host_ms']:.3f} ms  (interleaved)", flush=True)
            results["tpot"].append(row)
            for seq in seqs[ar]:
                engines[ar][2].free(seq)
    for comm, _, runner in engines.values():
        runner.close()
        comm.close()
    engines.clear()
    torch.cuda.empty_cache()
    dist.barrier(group=state.cpu_group)
    return results


def profiles(args, state, max_len: int, floor_ms: float) -> list[dict]:
    """One full-graph step at each of --profile-batches under torch.profiler, for each all-reduce."""
    out = []
    batches = parse_batches(args.profile_batches)
    for ar in entries(args):
        with entry_env(ar):
            comm, model = build(state, ar, args.shape)
            runner = decode_runner(model, max(batches), max_len, max_model_len=args.max_model_len,
                                   block_size=args.block_size)
        for batch in batches:
            seqs = fake_context(runner, batch, args.context)
            with entry_env(ar):
                prof = profile_step(runner, seqs)
            prof.update(allreduce=ar, batch=batch, floor_ms=floor_ms)
            out.append(prof)
            if state.is_driver:
                print(profile_table(prof), flush=True)
            for seq in seqs:
                runner.free(seq)
        runner.close()
        del runner, model
        comm.close()
        torch.cuda.empty_cache()
        dist.barrier(group=state.cpu_group)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = results["tpot"]
    for key in sorted({(r["allreduce"], r["mode"]) for r in rows}):
        pts = sorted((r["batch"], r["tpot_ms"]) for r in rows if (r["allreduce"], r["mode"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]}, {key[0]}")
    ax.axhline(results["floor_ms"], color="k", linestyle="--", label=f"weight-read floor {results['floor_ms']:.2f} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"{results['shape']}, TP={results['tp']}, context {results['context']}, {results['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--modes", default="full,piecewise,none")
    p.add_argument("--allreduce", default="custom+gemv+overlap,nccl+gemv+overlap",
                   help="entries: custom or nccl, with +unfused (all-reduce and add+RMSNorm as two kernels), +gemv "
                        "(the small-M projection kernel), +pdl/+nopdl (TPGRAPH_TRITON_PDL=1/0) and/or +lr/+nolr "
                        "(TPGRAPH_LAST_SPLIT_REDUCES=1/0), +pf<MB> (TPGRAPH_PDL_PREFETCH_MB) while its graphs are "
                        "captured and run; +overlap drives the steps as the engine's overlapped scheduling does. "
                        "custom+gemv+overlap is the product's default path, plain custom forces cuBLAS projections")
    p.add_argument("--unfused", action="store_true", help="time each fused custom entry's unfused twin beside it")
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b",
                   help="llama3-8b-half, qwen3-8b-half: one TP=2 rank's share of it as a whole model, to run at "
                        "TP=1; llama31-*: the same with 128K positions, for --context past 8K")
    p.add_argument("--max-model-len", type=int, default=LLAMA3_8B.max_position_embeddings,
                   help="the runners' max_model_len, which sizes static grids (attention's split count) as a server's "
                        "does; default: the model's own (8192), what a server runs with. 0: just what the timed "
                        "steps need (runs before 2026-12-01 were sized so)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    p.add_argument("--steps", type=int, default=50, help="decode steps timed per point (eager: a quarter)")
    p.add_argument("--no-ladders", dest="ladders", action="store_false", help="skip the capture-time comparison")
    p.add_argument("--profile", action="store_true",
                   help="profile one full-graph step at each of --profile-batches (after every timing: CUPTI slows "
                        "later launches; steps are driven plainly, +overlap or not)")
    p.add_argument("--profile-batches", default="1,8", help="the batches --profile profiles (comma-separated)")
    p.add_argument("--interleave", action="store_true",
                   help="full graphs only, no ladders or profile: every entry's engine built first, the entries' "
                        "steps timed in interleaved rounds of 10 (--steps rounded up to whole rounds), for comparing "
                        "variants under the same drift")
    p.add_argument("--out", type=Path, default=Path("bench_decode.json"))
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def main() -> None:
    args = parse_args()
    state = init_distributed("cuda")
    try:
        results = run_interleaved(args, state) if args.interleave else run(args, state)
        if state.is_driver:
            args.out.write_text(json.dumps(results, indent=1))
            try:
                plot(results, args.out.with_suffix(".png"))
            except ImportError:
                print("matplotlib missing: no plot (pip install -e '.[bench]')")
    finally:
        destroy_distributed(state)


if __name__ == "__main__":
    main()
