"""A decode layer's projections with the all-reduce fused into them, against the kernels they replace. One GPU.

    python bench/bench_lamport.py --out bench/results/.../lamport.json

Llama-3-8B at TP=2 per rank (bench_kernels.py's shapes), bf16. Per layer:
- plain: o_proj, add + RMSNorm, gate_up + SiLU·mul, down, add + RMSNorm, qkv + rope + KV store (six kernels; the
  add + RMSNorm kernels stand where the all-reduce + add + RMSNorm kernels run at TP=2);
- fused: o_proj with the all-reduce + add + norm staging in its epilogue, gate_up on the staged input, down as
  o_proj, qkv as gate_up (four kernels).
The channel is one rank's (world size 1: nothing to push or wait for), so what is timed is the kernels' own cost of
the fusion (the epilogue's residual add and staging, the RMS scale), not the NVLink round trip that the all-reduce
pays at TP=2. Timing: tpgraph/tune/timing.py's method, both chains interleaved, a
graph of 64 layers cycling through weight copies that cannot sit in L2; µs per layer.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from bench_kernels import BLOCK_SIZE, HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, copies_for

from tpgraph.kernels import gemv
from tpgraph.kernels.lamport import local_channels
from tpgraph.kernels.norm import add_rms_norm
from tpgraph.kernels.rope_store import rope_cos_sin_table

EPS = 1e-5


def layer_weights(device: torch.device, copies: int) -> list[dict[str, torch.Tensor]]:
    def w(*shape):
        return (torch.randn(*shape, device=device) * 0.02).to(torch.bfloat16)

    return [{"o": w(HIDDEN, HEADS * HEAD_DIM), "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER),
             "qkv": w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)} for _ in range(copies)]


def chains(m: int, weights: list[dict], device: torch.device):
    """(plain layer, fused layer): functions of a weight-copy index."""
    bf16 = torch.bfloat16
    attn = torch.randn(m, HEADS * HEAD_DIM, device=device).to(bf16)
    residual = torch.randn(m, HIDDEN, device=device).to(bf16)
    norm_w = torch.ones(HIDDEN, device=device, dtype=bf16)
    rope = rope_cos_sin_table(1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), 4096, bf16, device)
    positions = torch.arange(m, device=device) + 500
    slots = torch.arange(m, device=device) + BLOCK_SIZE
    k_cache, v_cache = (torch.zeros(64, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=bf16) for _ in range(2))
    channel = local_channels(1, 16 * HIDDEN, device)[0]

    def qkv(x, w):
        return gemv.qkv_rope_store(x, w, positions, rope, slots, k_cache, v_cache, HEADS, KV_HEADS, HEAD_DIM)

    def plain(i: int) -> None:
        w = weights[i]
        x, res = add_rms_norm(gemv.linear_small_m(attn, w["o"]), residual, norm_w, EPS)
        act = gemv.gate_up_silu(x, w["gate_up"])
        x, res = add_rms_norm(gemv.linear_small_m(act, w["down"]), res, norm_w, EPS)
        qkv(x, w["qkv"])

    def fused(i: int) -> None:
        w = weights[i]
        # the residuals predate the projections' inputs, as in the model (read before the PDL wait)
        got = gemv.linear_all_reduce_norm(attn, w["o"], channel, residual, norm_w, EPS, residual_early=True)
        act = gemv.gate_up_silu(got, w["gate_up"])
        got = gemv.linear_all_reduce_norm(act, w["down"], channel, got.residual_out, norm_w, EPS,
                                          residual_early=True)
        qkv(got, w["qkv"])

    return plain, fused


def kernel_times(fn, layers: int) -> list[tuple[str, float]]:
    """(kernel, µs) of the last of `layers` eager layers, in launch order (torch.profiler's device durations)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(layers):
            fn(i)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0),
                    key=lambda e: e.time_range.start)
    per_layer = len(events) // layers
    return [(e.name[:40], e.device_time) for e in events[-per_layer:]]


def main() -> None:
    from tpgraph.tune.timing import K_OPS, capture, graph_ops_us_interleaved

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    per_layer = (HIDDEN * HEADS * HEAD_DIM + 3 * INTER * HIDDEN + (HEADS + 2 * KV_HEADS) * HEAD_DIM * HIDDEN) * 2
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    weights = layer_weights(device, max(2, copies_for(per_layer, l2)))
    rows = []
    for m in (int(b) for b in args.batches.split(",")):
        plain, fused = chains(m, weights, device)
        graphs = {}
        for name, fn in (("plain", plain), ("fused", fused)):
            turn = itertools.cycle(range(len(weights)))
            graphs[name] = capture(lambda fn=fn, turn=turn: fn(next(turn)), K_OPS)
        us = graph_ops_us_interleaved(None, graphs, K_OPS, args.runs)
        kernels = {name: kernel_times(fn, len(weights)) for name, fn in (("plain", plain), ("fused", fused))}
        rows.append({"batch": m, **{f"{k}_us_per_layer": v for k, v in us.items()}, "kernels": kernels})
        for name, ks in kernels.items():
            print(f"  {name}: " + ", ".join(f"{k} {t:.1f}" for k, t in ks), flush=True)
        print(f"m={m}: plain {us['plain']:.2f} µs/layer, fused {us['fused']:.2f} µs/layer "
              f"({us['fused'] - us['plain']:+.2f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(device), "weights_bytes_per_layer": per_layer,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
