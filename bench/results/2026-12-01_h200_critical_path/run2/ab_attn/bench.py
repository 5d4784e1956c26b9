"""A/B of decode attention variants (session 11 scratch): each variant's kernel file is imported by path; a CUDA graph
of CALLS back-to-back calls per (variant, batch, context), replayed round-robin; median µs per call."""
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from tpgraph.kernels.paged_decode import paged_decode_reference

HEADS, KV, D, BS, MAXLEN, CALLS = 16, 4, 128, 16, 8192, 32
here = Path(__file__).parent
names = sys.argv[1].split(",")
mods = {}
for n in names:
    spec = importlib.util.spec_from_file_location(f"da_{n}", here / f"da_{n}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    mods[n] = m
dev = torch.device("cuda")
g = torch.Generator(device="cpu").manual_seed(0)
results = {}
for batch in (1, 8, 32):
    for ctx in (512, 4096):
        per = -(-ctx // BS)
        nblocks = batch * per + 7
        k = torch.randn(nblocks, BS, KV, D, generator=g).to(dev, torch.bfloat16)
        v = torch.randn(nblocks, BS, KV, D, generator=g).to(dev, torch.bfloat16)
        table = torch.zeros(batch, MAXLEN // BS, dtype=torch.int32)
        table[:, :per] = torch.randperm(nblocks, generator=g)[: batch * per].view(batch, per)
        table = table.to(dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, HEADS, D, generator=g).to(dev, torch.bfloat16)
        ref = paged_decode_reference(q, k, v, table, lens, D ** -0.5).float()
        graphs = {}
        for n, m in mods.items():
            out = m.paged_decode_attention_v2(q, k, v, table, lens, D ** -0.5, max_seq_len=MAXLEN)
            err = (out.float() - ref).abs().max().item()
            assert err < 3e-2, (n, batch, ctx, err)
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(2):
                    m.paged_decode_attention_v2(q, k, v, table, lens, D ** -0.5, max_seq_len=MAXLEN)
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(CALLS):
                    m.paged_decode_attention_v2(q, k, v, table, lens, D ** -0.5, max_seq_len=MAXLEN)
            graphs[n] = gr
        times = {n: [] for n in mods}
        for _ in range(7):
            for n, gr in graphs.items():
                for _ in range(10):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    gr.replay()
                    b.record()
                    b.synchronize()
                    times[n].append(a.elapsed_time(b) * 1000 / CALLS)
        row = {n: statistics.median(t) for n, t in times.items()}
        results[f"{batch},{ctx}"] = row
        print(f"bs {batch:3d} ctx {ctx:5d} " + "  ".join(f"{n} {us:6.2f}" for n, us in row.items()), flush=True)
        del graphs
json.dump(results, open(sys.argv[2], "w"), indent=1)
